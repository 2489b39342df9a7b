"""Buffer: DeepEP's Buffer over mori. Construction, the static API, lifecycle, the op slots and
what every call shares; the calls themselves are in _normal (normal mode) and _low_latency."""

import warnings

from . import _base
from ._base import (
    _DEFAULT_NUM_SMS,
    _DUMMY_HIDDEN,
    _MAX_TOKENS_PER_RANK,
    _MAX_WORLD,
    _NOMINAL_TOPK,
    _NOTIFY_ROW_WORDS,
    _QUANT_GROUP,
    _check_int,
    _refuse_if,
    _usage,
)
from ._low_latency import _LowLatencyMode
from ._normal import _NormalMode
from .config import Config, _nominal_normal_bytes, _op_config, _symmetric_bytes, _tokens_for_bytes
from .events import EventHandle, EventOverlap
from .handles import _OpSlot
from .layout import _rank_mask


_live_shmem_owners = []


class Buffer(_NormalMode, _LowLatencyMode):
    """DeepEP's Buffer over mori (collective: create it on every rank of `group`).

    Initialises mori.shmem over `group` (a torch.distributed ProcessGroup) unless it is already
    initialised, in which case it must span exactly the group's ranks in the same order.
    num_nvl_bytes / num_rdma_bytes: mori allocates each op from the shmem symmetric heap
    (MORI_SHMEM_HEAP_SIZE) when it is first used, so these are not allocated; a warning names
    them if the heap has fewer free bytes than their sum. num_qps_per_rank is checked (>= 1) and
    kept: the QPs are shmem's (MORI_NUM_QP_PER_PE; InterNode posts on one QP per peer).
    Refused (InvalidUsageError): allow_mnnvl=True and use_fabric=True (no multi-node NVLink or
    fabric memory: other nodes are reached by RDMA), allow_nvlink_for_low_latency_mode=False (mori
    always uses load/store within a node), enable_shrink=True (no rank masking), comm (a group
    is required). num_max_tokens_per_rank (mori keyword, 1..65536): normal-mode token capacity
    per rank; None: the most tokens per rank whose op fits num_nvl_bytes + num_rdma_bytes as the
    size hints count it, per row size (module docstring); with both byte counts 0 and no
    num_max_tokens_per_rank, normal-mode dispatch is refused. Either way no call communicates to
    agree on it."""

    num_sms = _DEFAULT_NUM_SMS

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                 allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, use_fabric=False,
                 explicitly_destroy=False, enable_shrink=False, comm=None, *, num_max_tokens_per_rank=None):
        self._ops_by_key = {}
        self._slots = []
        self._destroyed = True  # until construction succeeds
        _check_int("Buffer: num_nvl_bytes", num_nvl_bytes, 0)
        _check_int("Buffer: num_rdma_bytes", num_rdma_bytes, 0)
        _check_int("Buffer: num_qps_per_rank", num_qps_per_rank, 1)
        _refuse_if(allow_mnnvl, "Buffer: allow_mnnvl=True is not supported by mori: there is no multi-node NVLink "
                                "path (ranks on other nodes are reached by RDMA)")
        _refuse_if(use_fabric, "Buffer: use_fabric=True is not supported by mori (no fabric-memory allocation; the "
                               "symmetric heap is per node)")
        _refuse_if(not allow_nvlink_for_low_latency_mode,
                   "Buffer: allow_nvlink_for_low_latency_mode=False is not supported by mori: ranks of one node "
                   "always exchange by load/store, never through the NIC")
        _refuse_if(enable_shrink, "Buffer: enable_shrink=True is not supported by mori (no rank masking / "
                                  "low_latency_update_mask_buffer)")
        _refuse_if(comm is not None, "Buffer: comm= is not supported by mori: pass a torch.distributed group")
        _refuse_if(group is None, "Buffer: a torch.distributed process group is required")
        if num_max_tokens_per_rank is not None:
            _check_int("Buffer: num_max_tokens_per_rank", num_max_tokens_per_rank, 1, _MAX_TOKENS_PER_RANK)
        torch = _base._torch()
        import torch.distributed as dist

        from ... import shmem

        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        _refuse_if(self.group_size > _MAX_WORLD, f"Buffer: mori supports up to {_MAX_WORLD} ranks, the group has "
                                                 f"{self.group_size}")
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = num_qps_per_rank
        self.explicitly_destroy = bool(explicitly_destroy)
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self._owns_shmem = False
        if not shmem.shmem_is_initialized():
            shmem.shmem_torch_process_group_init(group)
            self._owns_shmem = True
            _live_shmem_owners.append(self)
        elif shmem.shmem_npes() != self.group_size or shmem.shmem_mype() != self.rank:
            raise _usage(f"Buffer: mori.shmem is initialised with {shmem.shmem_npes()} PEs (this PE "
                         f"{shmem.shmem_mype()}) but the group has {self.group_size} ranks (this rank {self.rank}); "
                         "one shmem world per process: initialise it over this group")
        elif _live_shmem_owners:  # shmem a Buffer initialised: finalised when the last Buffer goes
            _live_shmem_owners.append(self)
        self._num_nodes = shmem.shmem_num_nodes()
        self._gpu_per_node = shmem.shmem_local_size()
        self.num_rdma_ranks = self._num_nodes
        free = shmem.shmem_heap_free_bytes()
        if num_nvl_bytes + num_rdma_bytes > free:
            warnings.warn(f"mori.compat.deep_ep.Buffer: asked for {num_nvl_bytes} + {num_rdma_bytes} bytes but the "
                          f"shmem heap has {free} free; ops are allocated from it on first use (raise "
                          "MORI_SHMEM_HEAP_SIZE if an op does not fit)", stacklevel=2)
        self._device = torch.device("cuda", torch.cuda.current_device())
        self._comm_stream = torch.cuda.Stream(self._device)
        self._capacities = {}  # row bytes -> normal-mode tokens per rank (_normal_capacity)
        self._row_ids = {}  # n -> arange(n) int32 on the device (_arange)
        self._ll_turn = {}
        self._ll_combine_inputs = {}
        self._ll_idx_bad = None  # (device flag, pinned copy) of the low-latency topk_idx check
        self._destroyed = False

    # --- static / class-level API ---------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled():
        """True: DeepEP's flag for builds with its FP8 (SM90) paths. Every mori build has FP8
        normal-mode dispatch (float8 rows with [T, hidden / 128] float32 scales) and FP8
        low-latency dispatch, on every GPU it builds for."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms):
        """Blocks (SMs) of the normal-mode kernels when no Config is given. Even, as DeepEP's."""
        _check_int("Buffer.set_num_sms: new_num_sms", new_num_sms, 2)
        _refuse_if(new_num_sms % 2 != 0, f"Buffer.set_num_sms: new_num_sms must be even, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks):
        """A Config with Buffer.num_sms for `num_ranks` ranks (1..32)."""
        _check_int("Buffer.get_dispatch_config: num_ranks", num_ranks, 1, _MAX_WORLD)
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks):
        _check_int("Buffer.get_combine_config: num_ranks", num_ranks, 1, _MAX_WORLD)
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
        """Symmetric-heap bytes of the low-latency ops of this shape: the two ops used in turn
        (FP8 scales reserved) plus the small op that carries combine weights, for top-8 and a
        one-node layout up to 8 ranks (nodes of 8 beyond). Any hidden is accepted, as by DeepEP's
        hint (whose layout reserves hidden // 128 scales, as this does); only an FP8 dispatch
        needs hidden % 128 == 0, and low_latency_dispatch(use_fp8=True) refuses it there."""
        m = _check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1, _MAX_TOKENS_PER_RANK)
        h = _check_int("hidden", hidden, 1)
        w = _check_int("num_ranks", num_ranks, 1, _MAX_WORLD)
        e = _check_int("num_experts", num_experts, 1)
        _refuse_if(e % w != 0, f"num_experts ({e}) must be a multiple of num_ranks ({w})")
        k = min(_NOMINAL_TOPK, e)
        gpn = None if w <= 8 else 8
        main = _symmetric_bytes(world=w, hidden=h, token_bytes=2, max_tokens=m, experts_per_rank=e // w, topk=k,
                                scale_dim=h // _QUANT_GROUP, scale_type_size=4, gpu_per_node=gpn)
        weights = _symmetric_bytes(world=w, hidden=_DUMMY_HIDDEN, token_bytes=2, max_tokens=m,
                                   experts_per_rank=e // w, topk=k, gpu_per_node=gpn)
        return 2 * main + weights

    # --- lifecycle ------------------------------------------------------------------------------
    def _alive(self, what):
        _refuse_if(self._destroyed, f"Buffer.{what}: the buffer was destroyed")

    def destroy(self):
        """Collective: closes every op (in creation order, as every rank created them) and, if a
        Buffer initialised mori.shmem and this is the last live Buffer, finalises it. Needs
        explicitly_destroy=True (as DeepEP); without it the ops are released when dropped."""
        _refuse_if(not self.explicitly_destroy, "Buffer.destroy: explicitly_destroy must be set at construction")
        self._alive("destroy")
        self._destroyed = True
        slots, self._slots, self._ops_by_key = self._slots, [], {}
        self._ll_combine_inputs.clear()
        for s in slots:
            s.op.close()
        if self in _live_shmem_owners:
            _live_shmem_owners.remove(self)
            if not _live_shmem_owners:
                from ... import shmem

                shmem.shmem_finalize()

    def get_comm_stream(self):
        """The stream every op of this Buffer runs on."""
        return self._comm_stream

    @staticmethod
    def capture():
        """An EventOverlap of an event recorded on the current stream now (static, as DeepEP's)."""
        return EventOverlap(EventHandle())

    def get_local_buffer_tensor(self, dtype, size=None, offset=0, use_rdma_buffer=False):
        """Refused: mori has no single NVL/RDMA buffer to view (each op owns its regions)."""
        raise _usage("Buffer.get_local_buffer_tensor is not supported by mori: there is no single NVL/RDMA buffer "
                     "(each op owns its symmetric regions; see mori.ops ep_layout)")

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """Nothing to clean: mori's signals carry the call's epoch (a stale value never matches a
        later call) and the kernels reset their own counters, and normal and low-latency calls use
        separate ops, so no region needs zeroing between modes. Arguments are range-checked."""
        self._alive("clean_low_latency_buffer")
        _check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        _check_int("hidden", hidden, 1)
        _check_int("num_experts", num_experts, 1)

    def low_latency_update_mask_buffer(self, *args, **kwargs):
        raise _usage("Buffer.low_latency_update_mask_buffer is not supported by mori (no rank masking)")

    # --- ops ------------------------------------------------------------------------------------
    def _slot(self, key, **cfg):
        slot = self._ops_by_key.get(key)
        if slot is not None:
            return slot
        torch = _base._torch()
        if torch.cuda.is_current_stream_capturing():
            raise _usage(f"mori.compat.deep_ep: the first call of shape {key} happens during CUDA-graph capture; "
                         "creating its op is collective and allocates, so run one call of every shape on every "
                         "rank before capturing")
        gpn = self._gpu_per_node if self._num_nodes > 1 else self.group_size
        op = _base._ops().EpDispatchCombineOp(_op_config(rank=self.rank, world=self.group_size, gpu_per_node=gpn, **cfg))
        op._input_errors_after_calls = False  # a Buffer call makes several op calls: _after_call checks
        slot = _OpSlot(op, key)
        self._ops_by_key[key] = slot
        self._slots.append(slot)
        return slot

    def _pending_errors(self, ll=False):
        """Before a call launches anything: what this rank has to raise once the call's work is
        launched (_after_call): the ops of this Buffer holding an input-error report (an expert id
        outside [-1, E) at some rank's dispatch; every rank's op records the same report, docs/ep.md
        "Errors"; none while the comm stream captures a graph), and (ll) whether a topk_idx
        difference was found (_ll_idx_pending). Host reads only: what a call's own work reports is
        raised by a later call."""
        comm = int(self._comm_stream.cuda_stream)
        ops = [s.op for s in self._slots if s.op._h().input_error_pending(comm)]
        return ops, ll and self._ll_idx_pending()

    def _after_call(self, what, pending):
        """The end of a call whose work is launched (never instead of launching it: no rank skips
        a call its peers wait for): raise what _pending_errors found, the topk_idx difference first.
        Nothing is raised while the current stream captures a graph: it stays for a later call."""
        ops, ll_idx_bad = pending
        if not (ops or ll_idx_bad) or _base._torch().cuda.is_current_stream_capturing():
            return
        if ll_idx_bad and self._ll_idx_pending():  # (a call between may have raised it)
            self._raise_ll_idx_error(what)
        for op in ops:
            op._h().take_expert_id_error(f"Buffer.{what}", True)

    def _blocks(self, config):
        if config is None:
            return Buffer.num_sms
        if not isinstance(config, Config):
            raise _usage(f"config must be a mori.compat.deep_ep.Config or None, got {type(config).__name__}")
        return config.num_sms

    def _normal_capacity(self, hidden, token_bytes):
        """Tokens per rank of the normal-mode ops for rows of hidden x token_bytes (module
        docstring): a function of construction arguments and the row size only, so every rank
        computes the same without communicating. Computed once per row size."""
        if self.num_max_tokens_per_rank is not None:
            return self.num_max_tokens_per_rank
        row_bytes = hidden * token_bytes
        m = self._capacities.get(row_bytes)
        if m is None:
            m = _tokens_for_bytes(self.num_nvl_bytes + self.num_rdma_bytes, self.group_size, row_bytes,
                                  self._capacity_gpn())
            self._capacities[row_bytes] = m
        return m

    def _capacity_gpn(self):
        # the node layout of this Buffer's ops, as _op_config takes it (None: one node)
        return self._gpu_per_node if self._num_nodes > 1 else None

    def _over_capacity(self, num_tokens, capacity, hidden, token_bytes):
        """The InvalidUsageError of a dispatch of num_tokens > capacity tokens."""
        W, row_bytes = self.group_size, hidden * token_bytes
        fix = (f"size the Buffer for N tokens per rank with Config(num_max_tokens_per_rank=N)."
               f"get_nvl_buffer_size_hint({row_bytes}, {W}) plus get_rdma_buffer_size_hint({row_bytes}, {W}), "
               "or pass num_max_tokens_per_rank=N to Buffer")
        budget = self.num_nvl_bytes + self.num_rdma_bytes
        if self.num_max_tokens_per_rank is not None:
            what = f"{num_tokens} tokens exceed the Buffer's num_max_tokens_per_rank ({capacity})"
            fix = "create the Buffer with a larger num_max_tokens_per_rank"
        elif capacity == 0:
            one = _nominal_normal_bytes(W, row_bytes, 1, self._capacity_gpn())
            return _usage(f"dispatch: this Buffer's num_nvl_bytes + num_rdma_bytes ({budget} bytes) hold no "
                          f"normal-mode op for rows of {row_bytes} bytes (one token per rank takes {one} bytes); "
                          f"{fix}. Every rank refuses alike (nothing was launched)")
        else:
            what = (f"{num_tokens} tokens exceed this Buffer's normal-mode capacity of {capacity} tokens per rank for "
                    f"rows of {row_bytes} bytes (the most whose op fits num_nvl_bytes + num_rdma_bytes = {budget} "
                    "bytes)")
        return _usage(f"dispatch: {what}; {fix}. Each rank decides this from its own token count: this rank "
                      "launched nothing, and ranks whose count fits wait for it until they time out")

    def _reestablish(self, slot, routing, blocks=-1):
        """Make `routing` the op's last dispatch again (a dispatch of dummy rows, same routing,
        hence the same received-row order). Runs on the current (communication) stream."""
        if slot.current is routing:
            return
        w = None if routing.weights is None else routing.weights[0]
        slot.op.dispatch(self._dummy_rows(slot, routing.num_tokens), w, None, routing.topk_idx, block_num=blocks)
        slot.current = routing

    def _dummy_rows(self, slot, n):
        """[n, _DUMMY_HIDDEN] bf16 rows for a routing-only dispatch on slot's op (their values are
        never used): a view of one zero tensor of the op's capacity, made on the current (comm)
        stream and kept while the slot lives, since a captured graph may hold its address; made
        during capture, it is the graph's and is not kept."""
        d = slot.dummy
        if d is None:
            torch = _base._torch()
            d = torch.zeros((slot.op.config.max_num_inp_token_per_rank, _DUMMY_HIDDEN), dtype=torch.bfloat16,
                            device=self._device)
            if not torch.cuda.is_current_stream_capturing():
                slot.dummy = d
        return d[:n]

    def _routing_by_rank(self, is_token_in_rank, epr, K):
        """[T, K] int32 routing for a dispatch by is_token_in_rank alone: the first expert of
        every rank the token goes to, in rank order, then -1. On the current stream."""
        torch = _base._torch()
        T, W = int(is_token_in_rank.shape[0]), self.group_size
        ids = torch.full((T, K), -1, dtype=torch.int32, device=self._device)
        first = self._arange(W) * epr + 1  # rank r's first expert, + 1
        torch.mul(is_token_in_rank, first, out=ids[:, :W])
        ids[:, :W] -= 1  # in rank r: r * epr; else 0 - 1 = -1
        return ids

    def _notify(self, topk_idx, num_tokens_per_expert, num_experts):
        """DeepEP's notify step, on the current (comm) stream: every rank's count of tokens for each
        rank (from its routing) and its num_tokens_per_expert reach every rank, as one row per rank
        dispatched to all ranks on a small op of its own (one row per rank, no host sync, CUDA-graph
        capturable). Returns [W, W + E] int32, row s from rank s: its counts for ranks 0..W-1,
        then its num_tokens_per_expert; a view of the op's output, valid until the next notify."""
        torch = _base._torch()
        W = self.group_size
        n = W + num_experts
        cols = -(-n // _NOTIFY_ROW_WORDS) * _NOTIFY_ROW_WORDS
        slot = self._slot(("notify", cols), hidden=cols, token_bytes=4, max_tokens=1, experts_per_rank=1, topk=W)
        row = torch.zeros((1, cols), dtype=torch.int32, device=self._device)
        torch.sum(_rank_mask(topk_idx, num_experts, W), 0, dtype=torch.int32, out=row[0, :W])
        row[0, W:n].copy_(num_tokens_per_expert)
        every_rank = self._arange(W).view(1, W)  # one expert per rank: expert r is rank r's
        out = slot.op.dispatch(row.view(torch.float32), None, None, every_rank)[0]
        slot.current = None
        return out[:W].view(torch.int32)

    def _rows_at_or_after(self, n, total):
        """[n] bool on the device: row i >= total (a [1] device count)."""
        return self._arange(n) >= total

    def _arange(self, n):
        """arange(n) int32 on the device, kept per n (outside capture, as _dummy_rows)."""
        torch = _base._torch()
        ids = self._row_ids.get(n)
        if ids is None:
            ids = torch.arange(n, dtype=torch.int32, device=self._device)
            if not torch.cuda.is_current_stream_capturing():
                self._row_ids[n] = ids
        return ids

    # --- checks -----------------------------------------------------------------------------------
    def _tensor(self, what, t, ndim, dtypes=None):
        torch = _base._torch()
        if not isinstance(t, torch.Tensor):
            raise _usage(f"{what} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != self._device:
            raise _usage(f"{what} is on {t.device}, the Buffer on {self._device}")
        if t.dim() != ndim:
            raise _usage(f"{what} must be {ndim}-D, got shape {tuple(t.shape)}")
        if dtypes is not None and t.dtype not in dtypes:
            raise _usage(f"{what} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
        return t

    def _num_experts(self, num_experts, what):
        _check_int(f"{what}: num_experts", num_experts, 1)
        _refuse_if(num_experts % self.group_size != 0,
                   f"{what}: num_experts ({num_experts}) must be a multiple of the group size ({self.group_size})")
        return num_experts // self.group_size

    def _check_handle(self, handle, cls, what):
        if not isinstance(handle, cls):
            raise _usage(f"{what}: handle must be a {cls.__name__} from this Buffer, got {type(handle).__name__}")
        _refuse_if(handle._buffer is not self, f"{what}: the handle comes from another Buffer")
        _refuse_if(handle._slot.key not in self._ops_by_key, f"{what}: the handle's op was released")
