"""Buffer's low-latency calls: low_latency_dispatch, low_latency_combine (each split into a send
half and a receive hook where the op can) and the check of the combine's topk_idx."""

from . import _base
from ._base import _DUMMY_HIDDEN, _MAX_TOKENS_PER_RANK, _QUANT_GROUP, _check_int, _refuse_if, _usage
from .events import _OnComm
from .handles import LowLatencyHandle, _Routing


def _no_hook():
    """return_recv_hook where the call could not be split: it already completed."""


class _ReceiveHook:
    """The receive half of a split low-latency call, run on the caller's current stream; callable
    once (a second call raises InvalidUsageError)."""

    def __init__(self, what, receive):
        self._what, self._receive = what, receive

    def __call__(self):
        receive, self._receive = self._receive, None
        if receive is None:
            raise _usage(f"{self._what}: its recv hook was already called")
        receive()


class _LowLatencyMode:
    """The low-latency calls of Buffer (which provides the op slots, checks and the error
    reporting around each call; _pending_errors and _after_call use the topk_idx check here)."""

    # --- the combine's topk_idx check -------------------------------------------------------------
    def _ll_idx_flags(self):
        """(device flag, pinned host copy) of the low-latency topk_idx check, made on first use
        (outside graph capture: the first combine of a shape cannot be captured anyway)."""
        if self._ll_idx_bad is None:
            torch = _base._torch()
            self._ll_idx_bad = (torch.zeros(1, dtype=torch.int32, device=self._device),
                                torch.zeros(1, dtype=torch.int32, device="cpu", pin_memory=True))
        return self._ll_idx_bad

    def _check_ll_idx(self, topk_idx, routing, ctx):
        """low_latency_combine routes by the dispatch's topk_idx (the handle's); DeepEP's combine
        reads its own topk_idx (-1: no expert). Unless it is the dispatch's own tensor, unmodified,
        compare them on the GPU (on the comm stream, no host sync): a difference sets a sticky
        device flag that is copied to pinned memory; this rank's next low-latency call finds it
        (_ll_idx_pending) and raises it once its own work is launched (_raise_ll_idx_error)."""
        caller = routing.caller_idx
        if caller is not None and caller[0] is topk_idx and caller[1] == topk_idx._version:
            return
        torch = _base._torch()
        dev, host = self._ll_idx_flags()
        idx = ctx.stage(topk_idx)
        differs = (idx.to(torch.int64) != routing.topk_idx.to(torch.int64)).any().view(1).to(torch.int32)
        dev.bitwise_or_(differs)
        host.copy_(dev, non_blocking=True)

    def _ll_idx_pending(self):
        """Whether an earlier low_latency_combine on this rank found a topk_idx difference (reads
        pinned memory, no synchronisation: a combine still running may report later)."""
        return self._ll_idx_bad is not None and int(self._ll_idx_bad[1][0]) != 0

    def _raise_ll_idx_error(self, what):
        """Raise (and clear) the topk_idx difference _ll_idx_pending found; called once the call's
        own work is launched, so no rank skips a call its peers wait for."""
        dev, host = self._ll_idx_bad
        self._comm_stream.synchronize()  # the flag's last update and copy (error path only)
        dev.zero_()
        host.zero_()
        raise _usage(f"{what}: an earlier low_latency_combine on rank {self.rank} got a topk_idx that differs from "
                     "its dispatch's; mori combines by the dispatch's routing (the handle's), so that combine used "
                     "the dispatch's ids, not the ones passed (DeepEP reads the combine's, -1 = no expert). Pass the "
                     "dispatch's topk_idx to low_latency_combine. Raised after this call's work was launched: the "
                     "call takes place on every rank (do not repeat it); the check is this rank's own, other ranks "
                     "raise only for their own topk_idx")

    # --- calls ---------------------------------------------------------------------------------------
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False,
                             return_recv_hook=False, *, topk_weights=None):
        """x [T, H] bf16 (T <= num_max_dispatch_tokens_per_rank = M, H a multiple of 128 with
        use_fp8), topk_idx [T, K] (-1: none). Returns (recv_x, recv_count, handle, event, hook):
        recv_x [E_local, W*M, H] (float8_e4m3fn with use_fp8, else bf16; slot s < recv_count[e] of
        local expert e is a received token, in (source rank, source token) order), with use_fp8
        a tuple (recv_x, scales): scales [E_local, W*M, H/128] float32, or with use_ue8m0
        [E_local, W*M, ceil(H/512)] int32 of packed exponent bytes, column-major per expert
        (stride 1 along tokens, written so by the op's expert-major conversion) as DeepEP's;
        recv_count [E_local] int32. recv_x, the scales and recv_count are views of one of the
        shape's two ops: valid until the second next dispatch of this shape (as DeepEP's two
        buffers).
        cumulative_local_expert_recv_stats ([E_local] int32) gets recv_count added.
        dispatch_wait_recv_cost_stats is refused (no per-rank wait timing in mori).
        return_recv_hook=True: where the op splits (module docstring) only the send half runs
        here; recv_x, recv_count and the handle's source positions hold the received data once
        hook() (call it exactly once, before using them or dispatching again on this op) has run
        on the current stream. Elsewhere the hook does nothing.
        topk_weights (mori keyword, [T, K] float32): send the routing weights with the tokens, so
        that low_latency_combine with the same, unmodified tensor needs no extra round (else it
        first sends the combine's weights with one small dispatch)."""
        self._alive("low_latency_dispatch")
        _refuse_if(not self.low_latency_mode, "low_latency_dispatch: the Buffer was created with low_latency_mode=False")
        _refuse_if(dispatch_wait_recv_cost_stats is not None,
                   "low_latency_dispatch: dispatch_wait_recv_cost_stats is not supported by mori (no per-rank wait "
                   "timing; mori.ops phase traces give per-block times)")
        _refuse_if(not use_fp8 and (round_scale or use_ue8m0), "low_latency_dispatch: round_scale and use_ue8m0 need "
                                                                "use_fp8=True")
        M = _check_int("low_latency_dispatch: num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1,
                       _MAX_TOKENS_PER_RANK)
        epr = self._num_experts(num_experts, "low_latency_dispatch")
        torch = _base._torch()
        self._tensor("low_latency_dispatch: x", x, 2, (torch.bfloat16,))
        self._tensor("low_latency_dispatch: topk_idx", topk_idx, 2, (torch.int64, torch.int32))
        T, H, K = int(x.shape[0]), int(x.shape[1]), int(topk_idx.shape[1])
        _refuse_if(int(topk_idx.shape[0]) != T, f"low_latency_dispatch: topk_idx must have {T} rows")
        _refuse_if(T > M, f"low_latency_dispatch: {T} tokens exceed num_max_dispatch_tokens_per_rank ({M})")
        if use_fp8:
            _refuse_if(H % _QUANT_GROUP != 0, f"low_latency_dispatch(use_fp8=True): hidden ({H}) must be a multiple "
                                              f"of {_QUANT_GROUP}")
        if cumulative_local_expert_recv_stats is not None:
            self._tensor("low_latency_dispatch: cumulative_local_expert_recv_stats",
                         cumulative_local_expert_recv_stats, 1, (torch.int32,))
            _refuse_if(tuple(cumulative_local_expert_recv_stats.shape) != (epr,),
                       f"low_latency_dispatch: cumulative_local_expert_recv_stats must have shape [{epr}]")
        if topk_weights is not None:
            self._tensor("low_latency_dispatch: topk_weights", topk_weights, 2, (torch.float32,))
            _refuse_if(tuple(topk_weights.shape) != (T, K), f"low_latency_dispatch: topk_weights must be [{T}, {K}]")
            _refuse_if(not topk_weights.is_contiguous(), "low_latency_dispatch: topk_weights must be contiguous")
        groups = H // _QUANT_GROUP
        sd = (((groups + 3) // 4) if use_ue8m0 else groups) if use_fp8 else 0
        base = ("ll", H, K, epr, M, sd)
        turn = self._ll_turn.get(base, 0)
        caller_idx = (topk_idx, topk_idx._version)
        pending = self._pending_errors(ll=True)  # raised once this call's work is launched
        with _OnComm(self, None, async_finish, False, (topk_weights,)) as ctx:
            x, topk_idx = ctx.stage(x), ctx.stage(topk_idx)
            slot = self._slot(base + (turn % 2,), hidden=H, token_bytes=2, max_tokens=M, experts_per_rank=epr, topk=K,
                              scale_dim=sd, scale_type_size=4)
            self._ll_turn[base] = turn + 1
            op = slot.op
            qkw = dict(use_fp8=bool(use_fp8), round_scale=bool(round_scale), use_ue8m0=bool(use_ue8m0))
            # The split needs the expert-major buffers to exist (their views are returned now).
            split = return_recv_hook and op.split_dispatch_available and op._h().expert_major_base != 0
            if split:
                op.dispatch_send(x, topk_weights, None, topk_idx, **qkw)
                meta = op._pending_dispatch[0]
                em = op._expert_major_views(meta[1], meta[2], None if meta[4] is None else meta[4][1],
                                            column_major_scales=bool(use_fp8))
            else:
                op.dispatch(x, topk_weights, None, topk_idx, **qkw)
                em = op.convert_dispatch_output(column_major_scales=bool(use_fp8))
            routing = _Routing(topk_idx.clone(), T,
                               weights=None if topk_weights is None else (topk_weights, topk_weights._version),
                               caller_idx=caller_idx)
            slot.current = routing
            recv_x = (em.tokens, em.scales) if use_fp8 else em.tokens

            def finish(em):
                if cumulative_local_expert_recv_stats is not None:
                    cumulative_local_expert_recv_stats.add_(em.counts)

            if not split:
                finish(em)
            handle = LowLatencyHandle(self, slot, routing, M, H, num_experts, em.src_pos, em.counts)
        hook = None
        if split:  # nothing is raised between the halves: the hook must still run on this rank
            hook = _ReceiveHook("low_latency_dispatch", lambda: (
                op.dispatch_recv(), finish(op.convert_dispatch_output(column_major_scales=bool(use_fp8))),
                self._after_call("low_latency_dispatch (recv hook)", pending)))
        else:
            self._after_call("low_latency_dispatch", pending)
            if return_recv_hook:
                hook = _no_hook
        return recv_x, em.counts, handle, ctx.event, hook

    def get_next_low_latency_combine_buffer(self, handle):
        """A [E_local, W*M, H] bf16 tensor to write expert outputs into for
        low_latency_combine(..., zero_copy=True). mori reads the combine input in place either way,
        so zero-copy saves no copy here; the tensor is kept per op and reused."""
        self._check_handle(handle, LowLatencyHandle, "get_next_low_latency_combine_buffer")
        torch = _base._torch()
        op = handle._slot.op
        shape = (op.config.num_experts_per_rank, op.max_num_tokens_to_recv(), handle.hidden)
        t = self._ll_combine_inputs.get(handle._slot.key)
        if t is None or tuple(t.shape) != shape:
            t = torch.empty(shape, dtype=torch.bfloat16, device=self._device)
            self._ll_combine_inputs[handle._slot.key] = t
        return t

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False,
                            async_finish=False, return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None):
        """x [E_local, >= W*M, H] bf16: slot for slot the experts' outputs for the handle's recv_x.
        Returns (combined_x [T, H] bf16, event, hook): for each token, sum over k of
        topk_weights[t, k] times the output of expert topk_idx[t, k] for it, computed as mori's
        combine_standard_moe: each destination rank sums its local experts' weighted rows in fp32
        and rounds once, the token's rank sums those in fp32 in ascending rank order and rounds
        once (DeepEP rounds once at the end: results may differ by a rounding). The routing comes
        from the handle: topk_idx (int64/int32, -1: no expert) must be the dispatch's; unless it is
        the dispatch's own tensor, unmodified, it is compared on the GPU and a difference is raised
        by this rank's next low-latency call (no host sync here). Weights, fixed by the dispatch
        so that every rank takes the same path: a dispatch that sent topk_weights needs that same,
        unmodified tensor here (else InvalidUsageError); after one that sent none, one small
        dispatch carries topk_weights to the experts' ranks first.
        Refused: use_logfmt=True, combine_wait_recv_cost_stats. zero_copy: accepted, x is read in
        place in both cases. return_recv_hook: where the op has the push combine, only the send
        half runs here and the result is written when hook() has run on the current stream (see
        low_latency_dispatch); elsewhere a hook that does nothing. out:
        [T, H] bf16 to write the result into (returned)."""
        self._alive("low_latency_combine")
        _refuse_if(not self.low_latency_mode, "low_latency_combine: the Buffer was created with low_latency_mode=False")
        _refuse_if(use_logfmt, "low_latency_combine: use_logfmt=True is not supported by mori (rows travel in bf16)")
        _refuse_if(combine_wait_recv_cost_stats is not None,
                   "low_latency_combine: combine_wait_recv_cost_stats is not supported by mori (no per-rank wait timing)")
        self._check_handle(handle, LowLatencyHandle, "low_latency_combine")
        pending = self._pending_errors(ll=True)  # raised once this call's work is launched
        torch = _base._torch()
        routing, slot = handle._routing, handle._slot
        op = slot.op
        T, K, epr = routing.num_tokens, op.config.num_experts_per_token, op.config.num_experts_per_rank
        R = op.max_num_tokens_to_recv()
        self._tensor("low_latency_combine: x", x, 3, (torch.bfloat16,))
        _refuse_if(int(x.shape[0]) != epr or int(x.shape[1]) < R or int(x.shape[2]) != handle.hidden,
                   f"low_latency_combine: x must have shape [{epr}, >= {R}, {handle.hidden}], got {tuple(x.shape)}")
        self._tensor("low_latency_combine: topk_idx", topk_idx, 2, (torch.int64, torch.int32))
        _refuse_if(tuple(topk_idx.shape) != (T, K), f"low_latency_combine: topk_idx must have the dispatch's shape "
                                                    f"[{T}, {K}]")
        self._tensor("low_latency_combine: topk_weights", topk_weights, 2, (torch.float32,))
        _refuse_if(tuple(topk_weights.shape) != (T, K), f"low_latency_combine: topk_weights must have shape [{T}, {K}]")
        if out is not None:
            self._tensor("low_latency_combine: out", out, 2, (torch.bfloat16,))
            _refuse_if(tuple(out.shape) != (T, handle.hidden), f"low_latency_combine: out must be [{T}, {handle.hidden}]")
        sent = routing.weights
        # Which weights: decided by what every rank did at dispatch (a collective fact), never by a
        # rank-local test, since the other path has one more collective round. Dispatched with
        # weights: those are the weights, and the combine must pass that same, unmodified tensor.
        _refuse_if(sent is not None and (sent[0] is not topk_weights or sent[1] != topk_weights._version),
                   "low_latency_combine: the dispatch sent topk_weights with the tokens, so the combine weights "
                   "with them on every rank: pass that same tensor, unmodified (to combine with other weights, "
                   "dispatch without topk_weights; then one small extra dispatch carries the combine's weights)")
        self._ll_idx_flags()
        with _OnComm(self, None, async_finish, False, (topk_weights,)) as ctx:
            x = ctx.stage(x)
            self._check_ll_idx(topk_idx, routing, ctx)
            if slot.current is not routing:
                # Older than the shape's two newest dispatches (beyond DeepEP's contract): dispatch
                # the routing again; this overwrites the recv tensors of that op's newest dispatch.
                self._reestablish(slot, routing)
                op.convert_dispatch_output()
            weights = None
            if sent is None:
                wslot = self._slot(("ll-weights", K, epr, handle.num_max_dispatch_tokens_per_rank), hidden=_DUMMY_HIDDEN,
                                   token_bytes=2, max_tokens=handle.num_max_dispatch_tokens_per_rank,
                                   experts_per_rank=epr, topk=K)
                _, weights, _, _, _ = wslot.op.dispatch(self._dummy_rows(wslot, T), topk_weights.contiguous(), None,
                                                        routing.topk_idx)
                wslot.current = None
            result = out if out is not None else ctx.empty((T, handle.hidden), torch.bfloat16)
            split = return_recv_hook and op.split_combine_available
            if split:
                # convert_combine_input + combine_send here, combine_recv in the hook (the
                # registered input is read in place, weights applied in the conversion)
                buf = op.convert_combine_input(x, weights)
                op.combine_send(buf, None, None)
            else:
                y, _ = op.combine_standard_moe(x, weights)
                result.copy_(y)
        hook = None
        if split:  # nothing is raised between the halves: the hook must still run on this rank
            hook = _ReceiveHook("low_latency_combine", lambda: (
                result.copy_(op.combine_recv()[0]),
                self._after_call("low_latency_combine (recv hook)", pending)))
        else:
            self._after_call("low_latency_combine", pending)
            if return_recv_hook:
                hook = _no_hook
        return result, ctx.event, hook
