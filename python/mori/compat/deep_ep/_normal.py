"""Buffer's normal-mode calls: get_dispatch_layout, dispatch (with the notify step, or a cached
handle's layout) and combine (module docstring of mori.compat.deep_ep)."""

from . import _base
from ._base import _check_int, _int_types, _refuse_if
from .config import _by_rank_width, _reserved_scale_columns
from .events import _check_events, _OnComm
from .handles import DispatchHandle, _Routing
from .layout import _layout, _local_routing


class _NormalMode:
    """The normal-mode calls of Buffer (which provides the op slots, capacity, checks and the
    error reporting around each call)."""

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        """From topk_idx [T, K] (int64 or int32; -1: no expert): num_tokens_per_rank [W] int32
        (tokens with at least one expert on rank r), num_tokens_per_rdma_rank [nodes] int32 (at
        least one expert on a rank of node n; nodes are mori's, shmem_local_size() ranks each) or
        None on one node, num_tokens_per_expert [E] int32 (top-k slots naming expert e),
        is_token_in_rank [T, W] bool, and an EventOverlap. Ids outside [-1, E) count nowhere."""
        self._alive("get_dispatch_layout")
        _check_events(previous_event, async_finish, allocate_on_comm_stream, "get_dispatch_layout")
        self._num_experts(num_experts, "get_dispatch_layout")
        torch = _base._torch()
        self._tensor("get_dispatch_layout: topk_idx", topk_idx, 2, (torch.int64, torch.int32))
        W = self.group_size
        gpn = self._gpu_per_node if self._num_nodes > 1 else W
        with _OnComm(self, previous_event, async_finish, allocate_on_comm_stream, (topk_idx,)) as ctx:
            per_rank, per_rdma, per_expert, in_rank = _layout(topk_idx, num_experts, W, gpn, ctx.empties)
        return per_rank, per_rdma, per_expert, in_rank, ctx.event

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        """x: [T, H] (bf16, fp16, fp32 or fp8) or (x_fp8 [T, H], scales [T, S] float32/int32).
        Returns (recv_x or (recv_x, recv_scales), recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event): fresh tensors of the received rows
        (ordered by source rank, then source token), recv_topk_idx in local expert ids with -1
        for other ranks' experts (weights 0 there), the per-local-expert counts as a Python list
        rounded up to expert_alignment (one host read of the received and per-expert counts: this
        synchronises with the GPU, as in DeepEP).
        num_worst_tokens > 0: no host synchronisation (graph-capturable once the op exists);
        outputs have num_worst_tokens rows (rows past the received count: topk_idx -1, weights 0,
        x unspecified), the count list is empty, and a dispatch receiving more rows is an
        attributed device error.
        T must not exceed the Buffer's normal-mode capacity (module docstring), else
        InvalidUsageError naming it.
        handle given (cached layout): x goes where that dispatch's tokens went; returns
        (recv_x, None, None, None, None, event).
        Without a handle, num_tokens_per_expert is required (its length is the expert count) and
        the routing is topk_idx, or without topk_idx is_token_in_rank (DeepEP's dispatch without
        top-k: each token goes to the ranks it marks; recv_topk_idx and recv_topk_weights are
        None and the count list is the sum of every rank's num_tokens_per_expert for this rank's
        experts). num_tokens_per_rank and num_tokens_per_rdma_rank are shape-checked only (mori
        counts from the routing), as is is_token_in_rank when topk_idx is given.
        Before the dispatch a notify step (one small dispatch of its own) gathers every rank's
        per-rank counts, and num_tokens_per_expert, for the handle's rank_prefix_matrix
        (DispatchHandle)."""
        self._alive("dispatch")
        _check_events(previous_event, async_finish, allocate_on_comm_stream, "dispatch")
        _check_int("dispatch: expert_alignment", expert_alignment, 1)
        _check_int("dispatch: num_worst_tokens", num_worst_tokens, 0)
        blocks = self._blocks(config)
        torch = _base._torch()
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        self._tensor("dispatch: x", x, 2)
        T, H = int(x.shape[0]), int(x.shape[1])
        if x_scales is not None:
            self._tensor("dispatch: x scales", x_scales, 2, (torch.float32, torch.int32))
            _refuse_if(int(x_scales.shape[0]) != T, f"dispatch: x scales must have {T} rows, got {tuple(x_scales.shape)}")
            # DeepEP accepts column-major scales; the op moves rows (made contiguous in _OnComm.stage)
        if handle is not None:
            return self._cached_dispatch(x, x_scales, handle, topk_idx, topk_weights, num_worst_tokens, blocks,
                                         previous_event, async_finish, allocate_on_comm_stream)
        _refuse_if(num_tokens_per_expert is None, "dispatch: num_tokens_per_expert is required (its length is the "
                                                  "number of experts)")
        W = self.group_size
        by_rank = topk_idx is None  # DeepEP's dispatch without top-k: routed by is_token_in_rank
        if by_rank:
            _refuse_if(is_token_in_rank is None, "dispatch: without topk_idx, is_token_in_rank is required (it is "
                                                 "the routing)")
            _refuse_if(topk_weights is not None, "dispatch: topk_weights needs topk_idx")
            K = _by_rank_width(W)
        else:
            self._tensor("dispatch: topk_idx", topk_idx, 2, (torch.int64, torch.int32))
            K = int(topk_idx.shape[1])
            _refuse_if(int(topk_idx.shape[0]) != T, f"dispatch: topk_idx must have {T} rows, got "
                                                    f"{tuple(topk_idx.shape)}")
        self._tensor("dispatch: num_tokens_per_expert", num_tokens_per_expert, 1, _int_types(torch))
        E = int(num_tokens_per_expert.shape[0])
        epr = self._num_experts(E, "dispatch")
        if num_tokens_per_rank is not None:
            self._tensor("dispatch: num_tokens_per_rank", num_tokens_per_rank, 1)
            _refuse_if(tuple(num_tokens_per_rank.shape) != (W,), f"dispatch: num_tokens_per_rank must have shape [{W}]")
        if is_token_in_rank is not None:
            self._tensor("dispatch: is_token_in_rank", is_token_in_rank, 2, (torch.bool,) if by_rank else None)
            _refuse_if(tuple(is_token_in_rank.shape) != (T, W), f"dispatch: is_token_in_rank must have shape [{T}, {W}]")
        if num_tokens_per_rdma_rank is not None:
            self._tensor("dispatch: num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, 1)
        if topk_weights is not None:
            self._tensor("dispatch: topk_weights", topk_weights, 2, (torch.float32,))
            _refuse_if(tuple(topk_weights.shape) != (T, K), f"dispatch: topk_weights must have shape [{T}, {K}]")
        tb = max(2, x.element_size())
        M = self._normal_capacity(H, tb)
        if T > M or M == 0:
            raise self._over_capacity(T, M, H, tb)
        _refuse_if(num_worst_tokens == 0 and torch.cuda.is_current_stream_capturing(),
                   "dispatch: without num_worst_tokens the received count is read on the host, which cannot be "
                   "captured in a CUDA graph (pass num_worst_tokens)")
        cap = num_worst_tokens if 0 < num_worst_tokens < W * M else 0
        # One op serves rows with and without scales: it reserves DeepEP's FP8 scale columns
        # (hidden / 128 float32 words) unless the call's scales have another width.
        sd = _reserved_scale_columns(H) if x_scales is None else int(x_scales.shape[1])
        key = ("normal", H, tb, K, epr, M, sd, cap)
        pending = self._pending_errors()
        with _OnComm(self, previous_event, async_finish, allocate_on_comm_stream) as ctx:
            x, x_scales, topk_idx, topk_weights, is_token_in_rank, per_expert = (
                ctx.stage(t) for t in (x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert))
            if by_rank:
                topk_idx = self._routing_by_rank(is_token_in_rank, epr, K)
            slot = self._slot(key, hidden=H, token_bytes=tb, max_tokens=M, experts_per_rank=epr, topk=K,
                              scale_dim=sd, scale_type_size=4, recv_cap=cap)
            op = slot.op
            notified = self._notify(topk_idx, per_expert, E)
            rank_prefix_matrix = ctx.empty((W, W), torch.int32)
            torch.cumsum(notified[:, :W], 0, dtype=torch.int32, out=rank_prefix_matrix)
            out, out_w, out_s, out_i, total = op.dispatch(x, topk_weights, x_scales, topk_idx, block_num=blocks)
            routing = _Routing(topk_idx.clone(), T)
            slot.current = routing
            counts = []
            if num_worst_tokens:
                n = num_worst_tokens
                rows = min(n, int(out.shape[0]))
                pad = self._rows_at_or_after(rows, total)
            else:
                # One device-to-host read for both counts (it waits for the dispatch). By rank, the
                # per-expert counts are the notified num_tokens_per_expert of this rank's experts.
                first = W + self.rank * epr
                expert = notified[:, first:first + epr].sum(0, dtype=torch.int32) if by_rank else \
                    op.get_local_expert_count()
                host = torch.cat((total, expert)).tolist()
                n = rows = host[0]
                pad = None
                a = expert_alignment
                counts = [-(-c // a) * a for c in host[1:]] if a > 1 else host[1:]
            routing.num_recv = n
            recv_x, recv_s, recv_idx, recv_w = ctx.empties(
                ((n, H), out.dtype), None if out_s is None else ((n, int(out_s.shape[1])), out_s.dtype),
                None if by_rank else ((n, K), topk_idx.dtype), None if out_w is None else ((n, K), torch.float32))
            recv_x[:rows].copy_(out[:rows])
            if recv_s is not None:
                recv_s[:rows].copy_(out_s[:rows])
            if not by_rank:
                _local_routing(recv_idx, recv_w, out_i, out_w, rows, self.rank * epr, epr, pad)
            handle = DispatchHandle(self, slot, routing, n, H, rank_prefix_matrix)
        self._after_call("dispatch", pending)
        return ((recv_x, recv_s) if recv_s is not None else recv_x), recv_idx, recv_w, counts, handle, ctx.event

    def _cached_dispatch(self, x, x_scales, handle, topk_idx, topk_weights, num_worst_tokens, blocks,
                         previous_event, async_finish, allocate_on_comm_stream):
        self._check_handle(handle, DispatchHandle, "dispatch")
        _refuse_if(topk_idx is not None or topk_weights is not None,
                   "dispatch(handle=...): the cached layout carries the routing; pass neither topk_idx nor topk_weights")
        _refuse_if(num_worst_tokens != 0, "dispatch(handle=...): num_worst_tokens is not supported with a cached handle")
        routing, slot = handle._routing, handle._slot
        T, H = int(x.shape[0]), int(x.shape[1])
        _refuse_if(T != routing.num_tokens, f"dispatch(handle=...): x has {T} tokens, the handle's dispatch had "
                                            f"{routing.num_tokens}")
        cfg = slot.op.config
        _refuse_if(H > cfg.hidden_dim or x.element_size() > cfg.max_token_type_size,
                   f"dispatch(handle=...): rows of {H} x {x.dtype} exceed the handle's op (hidden {cfg.hidden_dim}, "
                   f"{cfg.max_token_type_size}-byte elements)")
        if x_scales is not None:
            _refuse_if(int(x_scales.shape[1]) != cfg.scale_dim,
                       f"dispatch(handle=...): scales must have {cfg.scale_dim} columns (the handle's op)")
        n = handle.num_recv_tokens
        pending = self._pending_errors()
        with _OnComm(self, previous_event, async_finish, allocate_on_comm_stream) as ctx:
            x, x_scales = ctx.stage(x), ctx.stage(x_scales)
            out, _, out_s, _, _ = slot.op.dispatch(x, None, x_scales, routing.topk_idx, block_num=blocks)
            slot.current = routing
            recv_x, recv_s = ctx.empties(((n, H), out.dtype),
                                         None if out_s is None else ((n, int(out_s.shape[1])), out_s.dtype))
            m = min(n, int(out.shape[0]))  # num_worst_tokens may exceed the op's receive rows
            recv_x[:m].copy_(out[:m])
            if recv_s is not None:
                recv_s[:m].copy_(out_s[:m])
        self._after_call("dispatch", pending)
        return ((recv_x, recv_s) if recv_s is not None else recv_x), None, None, None, None, ctx.event

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None, async_finish=False,
                allocate_on_comm_stream=False):
        """x: [num_recv_tokens, H] bf16/fp16/fp32 in the order dispatch returned (any earlier
        dispatch's handle). Returns (combined_x [T, H], combined_topk_weights [T, K] or None,
        event): token t's rows from its destination ranks summed in fp32 in ascending rank order
        and rounded once; weights likewise (dispatch zeroed other ranks' entries, so each weight
        comes back from its expert's rank). bias: a tensor or a tuple of up to two [T, H] tensors,
        added in fp32 to the rounded sum and rounded again (DeepEP adds them before its single
        rounding: results may differ by one rounding)."""
        self._alive("combine")
        _check_events(previous_event, async_finish, allocate_on_comm_stream, "combine")
        self._check_handle(handle, DispatchHandle, "combine")
        torch = _base._torch()
        routing, slot = handle._routing, handle._slot
        op = slot.op
        n, T, K = handle.num_recv_tokens, routing.num_tokens, op.config.num_experts_per_token
        self._tensor("combine: x", x, 2, (torch.bfloat16, torch.float16, torch.float32))
        H = int(x.shape[1])
        _refuse_if(int(x.shape[0]) != n, f"combine: x must have the handle's {n} received rows, got {int(x.shape[0])}")
        _refuse_if(H > op.config.hidden_dim or x.element_size() > op.config.max_token_type_size,
                   f"combine: rows of {H} x {x.dtype} exceed the handle's op (hidden {op.config.hidden_dim}, "
                   f"{op.config.max_token_type_size}-byte elements)")
        if topk_weights is not None:
            self._tensor("combine: topk_weights", topk_weights, 2, (torch.float32,))
            _refuse_if(tuple(topk_weights.shape) != (n, K), f"combine: topk_weights must have shape [{n}, {K}]")
        biases = () if bias is None else (bias if isinstance(bias, tuple) else (bias,))
        _refuse_if(len(biases) > 2, "combine: bias takes at most two tensors")
        for i, b in enumerate(biases):
            self._tensor(f"combine: bias[{i}]", b, 2)
            _refuse_if(tuple(b.shape) != (T, H), f"combine: bias[{i}] must have shape [{T}, {H}]")
        blocks = self._blocks(config)
        pending = self._pending_errors()
        with _OnComm(self, previous_event, async_finish, allocate_on_comm_stream, biases) as ctx:
            x, topk_weights = ctx.stage(x), ctx.stage(topk_weights)
            self._reestablish(slot, routing, blocks)
            y, y_w = op.combine(x, topk_weights, None, block_num=blocks)
            combined, combined_w = ctx.empties(((T, H), x.dtype), None if y_w is None else ((T, K), torch.float32))
            if biases:
                acc = y.float()
                for b in biases:
                    acc = acc + b.float()
                combined.copy_(acc)
            else:
                combined.copy_(y)
            if y_w is not None:
                combined_w.copy_(y_w)
        self._after_call("combine", pending)
        return combined, combined_w, ctx.event
