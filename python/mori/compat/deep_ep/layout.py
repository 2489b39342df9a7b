"""DeepEP's dispatch layout (per-rank, per-node and per-expert counts, is_token_in_rank) and the
routing arithmetic of normal-mode dispatches, as torch ops on the device."""

from . import _base
from ._base import _usage


def dispatch_layout(topk_idx, num_experts, num_ranks, gpu_per_node):
    """DeepEP's dispatch layout with torch ops on topk_idx's device (what
    Buffer.get_dispatch_layout computes): (num_tokens_per_rank [W] int32, num_tokens_per_rdma_rank
    [W / gpu_per_node] int32 or None when gpu_per_node >= W, num_tokens_per_expert [E] int32,
    is_token_in_rank [T, W] bool). Ids outside [0, E) (-1: no expert) count nowhere."""
    torch = _base._torch()

    def empties(*specs):
        return [None if s is None else torch.empty(s[0], dtype=s[1], device=topk_idx.device) for s in specs]

    return _layout(topk_idx, num_experts, num_ranks, gpu_per_node, empties)


def _layout(topk_idx, num_experts, num_ranks, gpu_per_node, empties):
    """dispatch_layout written into the tensors empties(*(shape, dtype) specs) returns (the
    results are those tensors, or views of them); the work runs on the current stream."""
    torch = _base._torch()
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
    torch = _base._torch()
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
    _base._torch().sub(out_i[:rows], first, out=idx)
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
