"""Config (DeepEP's per-call tuning object) and the size hints: symmetric bytes of the ops a
Buffer creates, from the ops' layout table (no GPU), and their inverse, the normal-mode token
capacity of a byte budget."""

from ... import _C
from . import _base
from ._base import (
    _DEFAULT_NUM_SMS,
    _MAX_TOKENS_PER_RANK,
    _MAX_WORLD,
    _NOMINAL_TOKENS_PER_RANK,
    _NOMINAL_TOPK,
    _QUANT_GROUP,
    _check_int,
)


# --- size hints (no GPU: from the ops' layout table) ---------------------------------------------
def _op_config(rank, world, hidden, token_bytes, max_tokens, experts_per_rank, topk, scale_dim=0,
               scale_type_size=0, gpu_per_node=None, recv_cap=0):
    ops = _base._ops()
    gpn = world if gpu_per_node is None else gpu_per_node
    kernel = ops.EpDispatchCombineKernelType.IntraNode if gpn >= world else ops.EpDispatchCombineKernelType.InterNode
    return ops.EpDispatchCombineConfig(
        rank=rank, world_size=world, hidden_dim=hidden, scale_dim=scale_dim,
        scale_type_size=scale_type_size if scale_dim else 0, max_token_type_size=token_bytes,
        max_num_inp_token_per_rank=max_tokens, num_experts_per_rank=experts_per_rank,
        num_experts_per_token=topk, kernel_type=kernel, gpu_per_node=min(gpn, world),
        max_total_recv_tokens=recv_cap)


def _symmetric_bytes(**kw):
    return int(_base._ops().ep_symmetric_bytes(_op_config(rank=0, **kw)))


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
