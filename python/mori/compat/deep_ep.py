"""DeepEP's ``Buffer`` API on top of mori's EpDispatchCombineOp (docs/compat.md).

    from mori.compat.deep_ep import Buffer, Config, EventOverlap      # instead of: from deep_ep import ...
    buf = Buffer(group, num_nvl_bytes, num_rdma_bytes)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(x, topk_idx=topk_idx, topk_weights=w,
        num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    y, y_w, _ = buf.combine(expert_out, handle, topk_weights=recv_w)

Semantics are DeepEP's documented ones; where mori works differently the difference is stated on
the call, and what cannot be honoured raises mori.InvalidUsageError naming it (nothing is dropped
silently). How the calls map onto mori:

* Ops are created lazily, one per shape, and reused. Creating one is collective (every rank, same
  config; the op compares configs across ranks and raises on a mismatch), so the first call of
  each shape must happen on every rank and outside CUDA-graph capture (checked: a first call
  during capture raises).
* Normal mode: one op per (hidden, element size, top-k, experts per rank, tokens per rank,
  scales, receive cap); an op reserves DeepEP's FP8 scale columns (hidden / 128) so that bf16 and
  FP8 calls share it, and a dispatch by is_token_in_rank alone (no topk_idx) routes with one id
  per destination rank, top-max(W, 8), sharing top-8's op on up to 8 ranks. Tokens per rank (the op's capacity) comes from the Buffer's construction
  arguments and the row size only, never from a call's token count, so every rank picks the same
  op with no communication whatever its own count: the Buffer's num_max_tokens_per_rank (a mori
  keyword) when given, else the most tokens per rank whose op, as Config's size hints count it
  (rows of hidden x max(element size, 2) bytes, DeepEP's hidden_bytes; top-8, one expert per
  rank, this Buffer's node layout), fits in num_nvl_bytes + num_rdma_bytes. That is the inverse
  of the hints: a Buffer sized with Config(num_max_tokens_per_rank=N)'s hints for those rows holds
  N tokens per rank (the op itself, with the call's top-k, experts and scales, may take slightly
  more or less heap). A dispatch of more tokens raises InvalidUsageError naming the bound; each
  rank decides from its own count, so ranks under the bound launch and then time out waiting
  for the one that refused.
* Every op runs on the Buffer's communication stream, ordered after the caller's stream or
  previous_event, as DeepEP's kernels are; async_finish returns an EventOverlap instead of making
  the caller's stream wait.
* A normal dispatch first runs DeepEP's notify step: every rank's per-rank counts and
  num_tokens_per_expert are gathered by a one-row dispatch on a small op of their own, giving
  the handle's rank_prefix_matrix (and, by rank, the per-expert counts). Handles index like
  DeepEP's tuples (DispatchHandle, LowLatencyHandle).
* Handles keep the routing (the sender's topk_idx). An op's buffers hold its last dispatch only;
  combine(handle) of an older dispatch, and dispatch(x, handle=...), first re-establish that
  routing with a dispatch of 16-byte dummy rows (same routing gives the same received-row order),
  which costs one extra dispatch round.
* Low-latency mode: two ops per shape used in turn (DeepEP's two low-latency buffers: results of
  at most the two newest dispatches of a shape stay valid), expert-major layout and fused FP8 from
  the op. return_recv_hook=True splits the call where the op can (dispatch: at most 256 tokens
  per rank; combine: the push combine, on one node and across nodes): the call launches the send
  half and returns, and the hook launches the receive half on the caller's current stream; the
  returned tensors hold the results once the hook's work has run. Elsewhere (larger shapes,
  MORI_EP_COMBINE_PUSH=0, the first dispatch of each of a shape's two ops, which allocates the
  expert-major buffers) the whole call runs up front and the hook does nothing.
"""

import warnings

from .. import _C

_DEFAULT_NUM_SMS = 20
_QUANT_GROUP = 128
_MAX_TOKENS_PER_RANK = 65536
_MAX_WORLD = 32
_DUMMY_HIDDEN = 8  # bf16 elements of the routing-only dispatches (16-byte rows, the minimum)
_NOMINAL_TOPK = 8  # top-k the size hints assume (DeepEP's hints do not take one)
_NOMINAL_TOKENS_PER_RANK = 4096  # Config's default capacity for the normal-mode size hints
_NOTIFY_ROW_WORDS = 4  # int32 words of 16 bytes, the unit of the notify op's rows


def _usage(msg):
    return _C.InvalidUsageError(msg)


def _torch():
    import torch

    return torch


def _ops():
    from .. import ops

    return ops


def _check_int(what, value, lo=None, hi=None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise _usage(f"{what} must be an int, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise _usage(f"{what} must be {bounds}, got {value}")
    return value


def _refuse_if(cond, msg):
    if cond:
        raise _usage(msg)


# --- size hints (no GPU: from the ops' layout table) ---------------------------------------------
def _op_config(rank, world, hidden, token_bytes, max_tokens, experts_per_rank, topk, scale_dim=0,
               scale_type_size=0, gpu_per_node=None, recv_cap=0):
    ops = _ops()
    gpn = world if gpu_per_node is None else gpu_per_node
    kernel = ops.EpDispatchCombineKernelType.IntraNode if gpn >= world else ops.EpDispatchCombineKernelType.InterNode
    return ops.EpDispatchCombineConfig(
        rank=rank, world_size=world, hidden_dim=hidden, scale_dim=scale_dim,
        scale_type_size=scale_type_size if scale_dim else 0, max_token_type_size=token_bytes,
        max_num_inp_token_per_rank=max_tokens, num_experts_per_rank=experts_per_rank,
        num_experts_per_token=topk, kernel_type=kernel, gpu_per_node=min(gpn, world),
        max_total_recv_tokens=recv_cap)


def _symmetric_bytes(**kw):
    return int(_ops().ep_symmetric_bytes(_op_config(rank=0, **kw)))


def _reserved_scale_columns(hidden):
    """Scale columns a normal-mode op reserves whatever the call: DeepEP's FP8 scales (one float32
    per 128 elements) where hidden is a multiple of 128, so that bf16 and FP8 calls of one hidden
    size share an op (its rows are 1.6 % larger than without)."""
    return hidden // _QUANT_GROUP if hidden % _QUANT_GROUP == 0 else 0


def _by_rank_width(world):
    """Top-k width of the routing a dispatch by is_token_in_rank alone is given: one id per rank
    (at most W), at least the nominal top-8, so that on up to 8 ranks it shares the op of top-8
    dispatches."""
    return max(world, _NOMINAL_TOPK)


def _int_types(torch):
    return (torch.int32, torch.int64)


def _hidden_of_bytes(hidden_bytes):
    # bf16 elements of a row of `hidden_bytes`, rounded up to 16-byte rows
    return max(8, -(-int(hidden_bytes) // 16) * 8)


def _nominal_normal_bytes(world, hidden_bytes, max_tokens, gpu_per_node=None):
    """Symmetric bytes of the normal-mode op the size hints count: rows of `hidden_bytes`, top-8,
    one expert per rank, `max_tokens` tokens per rank (gpu_per_node None: one node)."""
    return _symmetric_bytes(world=world, hidden=_hidden_of_bytes(hidden_bytes), token_bytes=2, max_tokens=max_tokens,
                            experts_per_rank=1, topk=_NOMINAL_TOPK, gpu_per_node=gpu_per_node)


def _tokens_for_bytes(budget, world, hidden_bytes, gpu_per_node=None):
    """The most tokens per rank, 0 to _MAX_TOKENS_PER_RANK, whose nominal op
    (_nominal_normal_bytes) fits in `budget` bytes: the inverse of the size hints. A function of
    its arguments only, so equal on every rank. The bytes grow with the tokens except where the
    small-batch buffers end (ops of at most PUSH_COMBINE_MAX_TOKENS / SPLIT_DISPATCH_MAX_TOKENS
    tokens per rank carry push-combine and split-dispatch buffers, larger ones do not), so each
    stretch between those bounds is bisected and the largest fit wins."""
    native = _C.ops
    bounds = sorted({0, native.PUSH_COMBINE_MAX_TOKENS, native.SPLIT_DISPATCH_MAX_TOKENS, _MAX_TOKENS_PER_RANK})
    best = 0
    for first, last in zip(bounds, bounds[1:]):  # the stretch first + 1 .. last
        lo, hi = first, last  # lo: the largest fit found in the stretch (first: none yet)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _nominal_normal_bytes(world, hidden_bytes, mid, gpu_per_node) <= budget:
                lo = mid
            else:
                hi = mid - 1
        if lo > first:
            best = lo
    return best


class EventHandle:
    """DeepEP's deep_ep.utils.EventHandle: a CUDA event recorded on the current stream when it is
    created (Megatron's fused_a2a passes EventOverlap(EventHandle()) as previous_event). `event` is
    the torch.cuda.Event."""

    def __init__(self):
        torch = _torch()
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream())

    def current_stream_wait(self):
        _torch().cuda.current_stream().wait_event(self.event)


def _cuda_event(event):
    """The torch.cuda.Event of an EventOverlap's `event` (a torch.cuda.Event or an EventHandle)."""
    return event.event if isinstance(event, EventHandle) else event


class EventOverlap:
    """DeepEP's event wrapper: `event` (a torch.cuda.Event or an EventHandle, or None when the call
    already made the caller's stream wait), `current_stream_wait()`, and use as a context manager
    (`with ev:` runs the block, then makes the current stream wait). extra_tensors are kept alive
    with it."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self):
        """The current stream waits for the event. A None event (the call was not async) needs no
        wait: the caller's stream was already ordered after the work."""
        if self.event is not None:
            _torch().cuda.current_stream().wait_event(_cuda_event(self.event))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.current_stream_wait()
        return False


class Config:
    """DeepEP's per-call tuning object. num_sms becomes the op's block count (mori launches one
    kernel per phase with num_sms blocks, at least world size, at most the SM count). The chunk
    sizes describe DeepEP's ring buffers, which mori does not have: they are range-checked and
    kept (as attributes) but change nothing. num_max_tokens_per_rank (mori keyword) is the token
    capacity the size hints assume: a Buffer given these hints' bytes for rows of hidden_bytes
    dispatches up to that many tokens per rank (module docstring)."""

    def __init__(self, num_sms=_DEFAULT_NUM_SMS, num_max_nvl_chunked_send_tokens=6,
                 num_max_nvl_chunked_recv_tokens=256, num_max_rdma_chunked_send_tokens=6,
                 num_max_rdma_chunked_recv_tokens=256, *, num_max_tokens_per_rank=_NOMINAL_TOKENS_PER_RANK):
        self.num_sms = _check_int("Config.num_sms", num_sms, 1)
        self.num_max_nvl_chunked_send_tokens = _check_int("Config.num_max_nvl_chunked_send_tokens",
                                                          num_max_nvl_chunked_send_tokens, 1)
        self.num_max_nvl_chunked_recv_tokens = _check_int("Config.num_max_nvl_chunked_recv_tokens",
                                                          num_max_nvl_chunked_recv_tokens, 1)
        self.num_max_rdma_chunked_send_tokens = _check_int("Config.num_max_rdma_chunked_send_tokens",
                                                           num_max_rdma_chunked_send_tokens, 1)
        self.num_max_rdma_chunked_recv_tokens = _check_int("Config.num_max_rdma_chunked_recv_tokens",
                                                           num_max_rdma_chunked_recv_tokens, 1)
        self.num_max_tokens_per_rank = _check_int("Config.num_max_tokens_per_rank", num_max_tokens_per_rank, 1,
                                                  _MAX_TOKENS_PER_RANK)

    def _bytes(self, hidden_bytes, num_ranks, gpu_per_node):
        _check_int("hidden_bytes", hidden_bytes, 1)
        _check_int("num_ranks", num_ranks, 1, _MAX_WORLD)
        return _nominal_normal_bytes(num_ranks, hidden_bytes, self.num_max_tokens_per_rank, gpu_per_node)

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        """Symmetric-heap bytes of a normal-mode op for rows of `hidden_bytes` among `num_ranks`
        ranks on one node, for num_max_tokens_per_rank tokens per rank and top-8 (the op the
        first call creates has the call's top-k, experts and scales: its bytes may differ
        slightly). A Buffer given these bytes (plus get_rdma_buffer_size_hint's) holds
        num_max_tokens_per_rank tokens per rank for such rows: its normal-mode capacity is the
        inverse of this hint. mori allocates each op from the shmem heap (MORI_SHMEM_HEAP_SIZE) on
        first use, not a buffer of this size up front: Buffer compares the sum of the sizes it is
        given with the heap's free bytes."""
        return self._bytes(hidden_bytes, num_ranks, None)

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        """Extra bytes the InterNode op's staging and landing rows take over the one-node op when
        `num_ranks` spans nodes of 8 ranks (0 for up to 8 ranks, as DeepEP's hint)."""
        if _check_int("num_ranks", num_ranks, 1, _MAX_WORLD) <= 8:
            return 0
        return max(0, self._bytes(hidden_bytes, num_ranks, 8) - self._bytes(hidden_bytes, num_ranks, None))

    def __repr__(self):
        return (f"Config(num_sms={self.num_sms}, nvl_chunks=({self.num_max_nvl_chunked_send_tokens}, "
                f"{self.num_max_nvl_chunked_recv_tokens}), rdma_chunks=({self.num_max_rdma_chunked_send_tokens}, "
                f"{self.num_max_rdma_chunked_recv_tokens}), num_max_tokens_per_rank={self.num_max_tokens_per_rank})")


class _Routing:
    """What a later call needs to re-establish a dispatch's layout: the sender's routing."""

    def __init__(self, topk_idx, num_tokens, num_recv=None, weights=None, caller_idx=None):
        self.topk_idx = topk_idx  # private copy
        self.num_tokens = num_tokens
        self.num_recv = num_recv  # host count (normal mode without num_worst_tokens), else None
        self.weights = weights  # (tensor, its _version) when the weights travelled with the dispatch
        self.caller_idx = caller_idx  # (the caller's topk_idx, its _version): low-latency dispatches


class _OpSlot:
    def __init__(self, op, key):
        self.op = op
        self.key = key
        self.current = None  # the _Routing of the op's last dispatch
        self.dummy = None  # rows of the routing-only dispatches (Buffer._dummy_rows)


class _HandleTuple:
    """Indexing, length and iteration like DeepEP's handle tuples: _FIELDS names the attribute at
    each position (None: an entry of DeepEP's own kernel bookkeeping that mori does not have,
    read as None). Attributes are made on first access."""

    _FIELDS = ()

    def __len__(self):
        return len(self._FIELDS)

    def __getitem__(self, i):
        names = self._FIELDS[i]  # an int (negative too) or a slice, as for a tuple
        if isinstance(i, slice):
            return tuple(None if n is None else getattr(self, n) for n in names)
        return None if names is None else getattr(self, names)

    def __iter__(self):
        return iter(self[:])


class DispatchHandle(_HandleTuple):
    """Normal-mode handle. combine() and dispatch(handle=...) accept it at any later time while
    the Buffer lives. Attributes: num_tokens (this rank's tokens), num_recv_tokens (rows received;
    the padded count with num_worst_tokens), hidden, topk_idx (a copy of the routing: the
    dispatch's topk_idx, or for a dispatch by is_token_in_rank alone one id of each rank the
    token goes to), and DeepEP's layout tensors:
      rank_prefix_matrix [W, W] int32: entry [i][j] counts the tokens ranks 0..i sent to rank j
        (so rows [m[i-1][r], m[i][r]) of this rank r's received rows came from rank i);
      recv_gbl_rank_prefix_sum [W] int32: column r of it, the received rows from ranks 0..i;
      is_token_in_rank [T, W] bool: where this rank's tokens went.
    It indexes like DeepEP's handle tuple: on one node (6 entries) [0] is rank_prefix_matrix and
    [4] is_token_in_rank; across nodes (10 entries) [0] is is_token_in_rank and [6] (= [-4])
    recv_gbl_rank_prefix_sum. The other entries (DeepEP's per-channel prefix matrices, source
    indices and send heads, bookkeeping of its own kernels) are None."""

    _ONE_NODE = ("rank_prefix_matrix", None, None, None, "is_token_in_rank", None)
    _NODES = ("is_token_in_rank", None, None, None, None, None, "recv_gbl_rank_prefix_sum", None, None, None)

    def __init__(self, buffer, slot, routing, num_recv_rows, hidden, rank_prefix_matrix):
        self._buffer = buffer
        self._slot = slot
        self._routing = routing
        self.num_tokens = routing.num_tokens
        self.num_recv_tokens = num_recv_rows
        self.hidden = hidden
        self.rank_prefix_matrix = rank_prefix_matrix
        self._FIELDS = self._NODES if buffer._num_nodes > 1 else self._ONE_NODE
        self._made = {}

    @property
    def topk_idx(self):
        return self._routing.topk_idx

    @property
    def recv_gbl_rank_prefix_sum(self):
        t = self._made.get("recv_gbl_rank_prefix_sum")
        if t is None:
            t = self._made["recv_gbl_rank_prefix_sum"] = self.rank_prefix_matrix[:, self._buffer.rank].contiguous()
        return t

    @property
    def is_token_in_rank(self):
        t = self._made.get("is_token_in_rank")
        if t is None:
            torch, buf = _torch(), self._buffer
            # The routing copy was made on the comm stream by the dispatch.
            torch.cuda.current_stream(buf._device).wait_stream(buf._comm_stream)
            cfg = self._slot.op.config
            t = _rank_mask(self._routing.topk_idx, cfg.num_experts_per_rank * buf.group_size, buf.group_size)
            self._made["is_token_in_rank"] = t
        return t


class LowLatencyHandle(_HandleTuple):
    """Low-latency handle: the op slot, routing, num_max_dispatch_tokens_per_rank (M), hidden and
    num_experts of the dispatch, src_pos [num_local_experts, W*M] int32 (src_rank * M +
    src_token of each slot), and, as DeepEP's handle tuple (src_info, layout_range, M, hidden,
    num_experts) indexes them:
      src_info [num_local_experts, W*M] int32: the source token index (on its rank) of each slot;
      layout_range [num_local_experts, W] int64: for local expert e and source rank j,
        (begin << 32) | count, the slots [begin, begin + count) of e that hold rank j's tokens.
    Slots past recv_count[e] are unspecified. Both are made on first access, on the current
    stream, from the dispatch's outputs: read them while those are valid (until the second next
    dispatch of the shape), after the call's event or hook, as its other outputs."""

    _FIELDS = ("src_info", "layout_range", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts")

    def __init__(self, buffer, slot, routing, num_max_dispatch_tokens_per_rank, hidden, num_experts, src_pos,
                 recv_count=None):
        self._buffer = buffer
        self._slot = slot
        self._routing = routing
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.hidden = hidden
        self.num_experts = num_experts
        self.src_pos = src_pos
        self._recv_count = recv_count
        self._made = {}

    @property
    def src_info(self):
        t = self._made.get("src_info")
        if t is None:
            t = self._made["src_info"] = _ll_src_info(self.src_pos, self.num_max_dispatch_tokens_per_rank)
        return t

    @property
    def layout_range(self):
        t = self._made.get("layout_range")
        if t is None:
            t = _ll_layout_range(self.src_pos, self._recv_count, self.num_max_dispatch_tokens_per_rank,
                                 self._buffer.group_size)
            self._made["layout_range"] = t
        return t


def _ll_src_info(src_pos, M):
    """DeepEP's src_info from mori's slot positions (src_rank * M + src_token): the source token."""
    return src_pos.remainder(M).to(_torch().int32)


def _ll_layout_range(src_pos, recv_count, M, W):
    """DeepEP's layout_range [E_local, W] int64: (begin << 32) | count of each source rank's slots
    of each local expert, from the slot positions (src_rank * M + src_token; slots are in source
    rank order) and the per-expert counts; slots at or past recv_count[e] count nowhere."""
    torch = _torch()
    E, R = int(src_pos.shape[0]), int(src_pos.shape[1])
    valid = torch.arange(R, device=src_pos.device).view(1, R) < recv_count.view(E, 1)
    rank = torch.where(valid, src_pos.div(M, rounding_mode="floor").to(torch.int64), W)
    count = torch.zeros((E, W + 1), dtype=torch.int64, device=src_pos.device)
    count.scatter_add_(1, rank, torch.ones_like(rank))
    count = count[:, :W]
    begin = count.cumsum(1) - count
    return (begin << 32) | count


class _OnComm:
    """The Buffer's communication stream for one call: it waits for previous_event (or the caller's
    stream) first, so everything the call enqueues, its own input copies (stage()) included, is
    ordered after that; outputs are allocated on the caller's stream unless
    allocate_on_comm_stream; at the end the caller's stream waits (async_finish=False) or an event
    is returned. With previous_event the comm stream does not wait for the caller's stream (as in
    DeepEP): the inputs must be ready when the event is; the adapter's own work on them (making
    them contiguous) therefore runs on the comm stream after the wait, never on the caller's stream
    where the event would not cover it. Inputs and outputs are record_stream'ed only with
    async_finish (as DeepEP): without it the caller's stream waits for the comm stream before the
    call returns, so whatever the caller later does with them on its stream, freeing included, is
    ordered after the comm stream's work."""

    def __init__(self, buf, previous_event, async_finish, allocate_on_comm_stream, inputs=()):
        self.torch = _torch()
        self.buf = buf
        self.previous_event = previous_event
        self.async_finish = bool(async_finish)
        self.alloc_on_comm = bool(allocate_on_comm_stream)
        self.inputs = [t for t in inputs if t is not None]
        self.outputs = []
        self.event = None

    def __enter__(self):
        torch = self.torch
        self.compute = torch.cuda.current_stream(self.buf._device)
        self.comm = self.buf._comm_stream
        if self.previous_event is not None and self.previous_event.event is not None:
            self.comm.wait_event(_cuda_event(self.previous_event.event))
        else:
            self.comm.wait_stream(self.compute)
        self._guard = torch.cuda.stream(self.comm)
        self._guard.__enter__()
        return self

    def stage(self, t):
        """`t` as the op reads it (contiguous), enqueued on the comm stream after the wait; the
        caller's tensor is kept for record_stream. None stays None."""
        if t is None:
            return None
        self.inputs.append(t)
        return t.contiguous()

    def empties(self, *specs):
        """Fresh output tensors, one per (shape, dtype) spec (a None spec gives None), allocated
        on the caller's stream (one stream switch for all) unless allocate_on_comm_stream."""
        torch, dev = self.torch, self.buf._device

        def make():
            return [None if s is None else torch.empty(s[0], dtype=s[1], device=dev) for s in specs]

        if self.alloc_on_comm:
            outs = make()
        else:
            with torch.cuda.stream(self.compute):
                outs = make()
        self.outputs.extend(t for t in outs if t is not None)
        return outs

    def empty(self, shape, dtype):
        return self.empties((shape, dtype))[0]

    def __exit__(self, exc_type, exc, tb):
        self._guard.__exit__(exc_type, exc, tb)
        if exc_type is not None or not self.async_finish:
            self.compute.wait_stream(self.comm)
            if exc_type is None:
                self.event = EventOverlap(None)
            return False
        if not self.torch.cuda.is_current_stream_capturing():  # a graph's memory lives with the graph
            for t in self.inputs:  # freed by the caller before the comm stream is done with them
                t.record_stream(self.comm)
            for t in self.outputs:
                t.record_stream(self.compute if self.alloc_on_comm else self.comm)
        ev = self.torch.cuda.Event()
        ev.record(self.comm)
        self.event = EventOverlap(ev, self.inputs + self.outputs)
        return False


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


def _check_events(previous_event, async_finish, allocate_on_comm_stream, what):
    if previous_event is not None and not isinstance(previous_event, EventOverlap):
        raise _usage(f"{what}: previous_event must be an EventOverlap or None, got {type(previous_event).__name__}")
    if allocate_on_comm_stream and not (previous_event is not None and async_finish):
        raise _usage(f"{what}: allocate_on_comm_stream=True needs previous_event and async_finish=True (as DeepEP)")


def dispatch_layout(topk_idx, num_experts, num_ranks, gpu_per_node):
    """DeepEP's dispatch layout with torch ops on topk_idx's device (what
    Buffer.get_dispatch_layout computes): (num_tokens_per_rank [W] int32, num_tokens_per_rdma_rank
    [W / gpu_per_node] int32 or None when gpu_per_node >= W, num_tokens_per_expert [E] int32,
    is_token_in_rank [T, W] bool). Ids outside [0, E) (-1: no expert) count nowhere."""
    torch = _torch()

    def empties(*specs):
        return [None if s is None else torch.empty(s[0], dtype=s[1], device=topk_idx.device) for s in specs]

    return _layout(topk_idx, num_experts, num_ranks, gpu_per_node, empties)


def _layout(topk_idx, num_experts, num_ranks, gpu_per_node, empties):
    """dispatch_layout written into the tensors empties(*(shape, dtype) specs) returns (the
    results are those tensors, or views of them); the work runs on the current stream."""
    torch = _torch()
    W, E = num_ranks, num_experts
    T = int(topk_idx.shape[0])
    nodes = 0
    if gpu_per_node < W:
        if W % gpu_per_node != 0:
            raise _usage(f"get_dispatch_layout: {W} ranks do not form nodes of {gpu_per_node} GPUs")
        nodes = W // gpu_per_node
    i32 = torch.int32
    per_rank, per_rdma, per_expert, in_rank = empties(((W,), i32), ((nodes,), i32) if nodes else None,
                                                      ((E + 1,), i32), ((T, W), torch.bool))
    dev = topk_idx.device
    slot = _expert_slots(topk_idx, E)
    per_expert.zero_()
    per_expert.scatter_add_(0, slot.reshape(-1), torch.ones(slot.numel(), dtype=i32, device=dev))
    in_rank.copy_(_rank_mask(topk_idx, E, W, slot))
    torch.sum(in_rank, 0, dtype=i32, out=per_rank)
    if nodes:
        torch.sum(in_rank.view(T, nodes, gpu_per_node).any(2), 0, dtype=i32, out=per_rdma)
    return per_rank, per_rdma, per_expert[:E], in_rank


def _expert_slots(topk_idx, num_experts):
    """topk_idx as int64 with every id outside [0, num_experts) (-1: no expert) replaced by
    num_experts, an expert of no rank."""
    idx = topk_idx.long()
    return idx.masked_fill((idx < 0) | (idx >= num_experts), num_experts)


def _rank_mask(topk_idx, num_experts, num_ranks, slot=None):
    """[T, num_ranks] bool: token t has an expert on rank r (ids outside [0, num_experts) count
    nowhere). slot: _expert_slots(topk_idx, num_experts) when the caller has it."""
    torch = _torch()
    if slot is None:
        slot = _expert_slots(topk_idx, num_experts)
    hit = torch.zeros((int(topk_idx.shape[0]), num_ranks + 1), dtype=torch.bool, device=topk_idx.device)
    hit.scatter_(1, slot.div(num_experts // num_ranks, rounding_mode="floor"), True)
    return hit[:, :num_ranks]


def _local_routing(recv_idx, recv_w, out_i, out_w, rows, first, epr, pad=None):
    """DeepEP's recv_topk_idx and recv_topk_weights of a normal dispatch, written into recv_idx
    [n, K] and recv_w ([n, K] float32 or None) on the current stream: for the first `rows`
    received rows, out_i's global expert ids as this rank's local ids (id - first when in
    [first, first + epr)), -1 for any other id; out_w's weights where the local id is kept, 0
    elsewhere; rows where pad ([rows] bool, or None) is set, and rows past `rows`, get -1 and 0.
    Plain arithmetic on the ids (no gather), so whatever an unused row holds is harmless."""
    n = int(recv_idx.shape[0])
    idx = recv_idx[:rows]
    _torch().sub(out_i[:rows], first, out=idx)
    drop = idx.div(epr, rounding_mode="floor").ne(0)  # local ids are exactly those with quotient 0
    if pad is not None:
        drop |= pad.view(rows, 1)
    idx.masked_fill_(drop, -1)
    if rows < n:
        recv_idx[rows:].fill_(-1)
    if recv_w is not None:
        recv_w[:rows].copy_(out_w[:rows]).masked_fill_(drop, 0.0)
        if rows < n:
            recv_w[rows:].zero_()


_live_shmem_owners = []


class Buffer:
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
        torch = _torch()
        import torch.distributed as dist

        from .. import shmem

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
                from .. import shmem

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
        torch = _torch()
        if torch.cuda.is_current_stream_capturing():
            raise _usage(f"mori.compat.deep_ep: the first call of shape {key} happens during CUDA-graph capture; "
                         "creating its op is collective and allocates, so run one call of every shape on every "
                         "rank before capturing")
        gpn = self._gpu_per_node if self._num_nodes > 1 else self.group_size
        op = _ops().EpDispatchCombineOp(_op_config(rank=self.rank, world=self.group_size, gpu_per_node=gpn, **cfg))
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
        if not (ops or ll_idx_bad) or _torch().cuda.is_current_stream_capturing():
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
            torch = _torch()
            d = torch.zeros((slot.op.config.max_num_inp_token_per_rank, _DUMMY_HIDDEN), dtype=torch.bfloat16,
                            device=self._device)
            if not torch.cuda.is_current_stream_capturing():
                slot.dummy = d
        return d[:n]

    def _routing_by_rank(self, is_token_in_rank, epr, K):
        """[T, K] int32 routing for a dispatch by is_token_in_rank alone: the first expert of
        every rank the token goes to, in rank order, then -1. On the current stream."""
        torch = _torch()
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
        torch = _torch()
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
        torch = _torch()
        ids = self._row_ids.get(n)
        if ids is None:
            ids = torch.arange(n, dtype=torch.int32, device=self._device)
            if not torch.cuda.is_current_stream_capturing():
                self._row_ids[n] = ids
        return ids

    # --- checks -----------------------------------------------------------------------------------
    def _tensor(self, what, t, ndim, dtypes=None):
        torch = _torch()
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

    # --- normal mode ------------------------------------------------------------------------------
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
        torch = _torch()
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
        torch = _torch()
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

    def _ll_idx_flags(self):
        """(device flag, pinned host copy) of the low-latency topk_idx check, made on first use
        (outside graph capture: the first combine of a shape cannot be captured anyway)."""
        if self._ll_idx_bad is None:
            torch = _torch()
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
        torch = _torch()
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

    def _check_handle(self, handle, cls, what):
        if not isinstance(handle, cls):
            raise _usage(f"{what}: handle must be a {cls.__name__} from this Buffer, got {type(handle).__name__}")
        _refuse_if(handle._buffer is not self, f"{what}: the handle comes from another Buffer")
        _refuse_if(handle._slot.key not in self._ops_by_key, f"{what}: the handle's op was released")

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
        torch = _torch()
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

    # --- low-latency mode ---------------------------------------------------------------------------
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
        torch = _torch()
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
        torch = _torch()
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
        torch = _torch()
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


__all__ = ["Buffer", "Config", "DispatchHandle", "EventHandle", "EventOverlap", "LowLatencyHandle", "dispatch_layout"]
