"""The handles a dispatch returns (DispatchHandle, LowLatencyHandle, indexed like DeepEP's tuples)
and the per-op state they refer to (_OpSlot, _Routing)."""

from . import _base
from .layout import _rank_mask


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
            torch, buf = _base._torch(), self._buffer
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
    return src_pos.remainder(M).to(_base._torch().int32)


def _ll_layout_range(src_pos, recv_count, M, W):
    """DeepEP's layout_range [E_local, W] int64: (begin << 32) | count of each source rank's slots
    of each local expert, from the slot positions (src_rank * M + src_token; slots are in source
    rank order) and the per-expert counts; slots at or past recv_count[e] count nowhere."""
    torch = _base._torch()
    E, R = int(src_pos.shape[0]), int(src_pos.shape[1])
    valid = torch.arange(R, device=src_pos.device).view(1, R) < recv_count.view(E, 1)
    rank = torch.where(valid, src_pos.div(M, rounding_mode="floor").to(torch.int64), W)
    count = torch.zeros((E, W + 1), dtype=torch.int64, device=src_pos.device)
    count.scatter_add_(1, rank, torch.ones_like(rank))
    count = count[:, :W]
    begin = count.cumsum(1) - count
    return (begin << 32) | count
