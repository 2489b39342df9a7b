#!/usr/bin/env python3
"""Wire counts of mori.ops InterNode dispatch/combine against the ideal computed from the routing.

    python3 tools/bench/ep_internode_bench.py --nproc 4 --gpu-per-node 2            # 2 x 2 on one GPU
    python3 tools/bench/ep_internode_bench.py --nproc 8 --gpu-per-node 4 --tokens 4096

Ranks may share a GPU; nodes are virtual (MORI_GPU_PER_NODE, MORI_RDMA_EMULATE=1): the RDMA work
requests each rank posts are executed by the software NIC emulator, whose statistics
(mori.shmem.rdma_stats) are exact without a NIC. Shared-GPU runs are time-sliced, so this prints no
times: only work requests and bytes per rank and phase, next to the ideal from the routing:

  dispatch payload = sum over (token, destination rank on another node) pairs of
                     row + weights (4K) + scales + indices (K x index bytes) + source position (4)
  dispatch headers = per (rank, other-node rank): W {count, format} pairs (16 B: the rank's count
                     for every destination) and the expert histogram (4 Epr B), plus an 8-byte
                     tail per non-empty list
  combine payload  = sum over the same pairs of row (+ 4K with weights)
  combine headers  = an 8-byte landing word per non-empty list and an 8-byte done word per
                     (rank, other-node rank)

InterNode is the direct scheme (one copy per destination rank): the payload is also the "naive"
bytes the node-deduplicated kernels are measured against. Shapes (DeepSeek-V3-like): hidden 7168,
top-8 of 256 experts, BF16 or FP8 (+56 fp32 scales) dispatch, BF16 combine; --tokens sets tokens per
rank (HT 4096, LL 128). The table is printed last.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests", "ops"))
import ep_test_utils as U  # noqa: E402

HIDDEN, TOPK, EXPERTS, SCALE_DIM = 7168, 8, 256, 56


def phase_stats(mori, dist, W):
    """Every rank's RDMA WRITE counts since the last reset (and resets them): list of dicts. Call
    after the phase's kernels finished on every rank: waits until the emulator has executed every
    request they posted (a kernel does not wait for its last signals)."""
    deadline = time.monotonic() + 10.0
    while mori.shmem.rdma_stats()["pending_sq_blocks"] != 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the RDMA emulator left requests unexecuted for 10 s after the phase")
        time.sleep(0.001)
    st = mori.shmem.rdma_stats(reset=True)
    mine = {"wqes": 0, "bytes": 0, "inline": 0, "atomics": 0, "other": 0}
    for row in st["per_peer"]:
        if row["opcode"] in ("write", "write_inline"):
            mine["wqes"] += row["wqes"]
            mine["bytes"] += row["bytes"]
            mine["inline"] += row["inline"]
        else:
            mine["other"] += row["wqes"]
        mine["atomics"] += row["atomics"]
    allr = [None] * W
    dist.all_gather_object(allr, mine)
    return allr


def ideal(torch, IDX, Ts, W, G, Epr, K, row, combine_row, scale_bytes, idx_bytes):
    """(dispatch payload, dispatch headers, combine payload, combine headers, pairs, lists) summed
    over ranks, from the routing alone."""
    node = lambda p: p // G  # noqa: E731
    pairs = 0
    lists = 0
    for s in range(W):
        T = Ts[s]
        if T == 0:
            continue
        ids = IDX[s, :T].long()
        valid = (ids >= 0) & (ids < W * Epr)
        dest = torch.where(valid, ids // Epr, torch.full_like(ids, -1))
        for d in range(W):
            if node(d) == node(s):
                continue
            n = int((dest == d).any(1).sum().item())
            pairs += n
            lists += 1 if n > 0 else 0
    remote_pairs_of_ranks = sum(1 for s in range(W) for d in range(W) if node(d) != node(s))
    d_payload = pairs * (row + 4 * K + scale_bytes + K * idx_bytes + 4)
    # each rank's count for every destination goes to every rank (W x remote ranks pairs of words)
    d_headers = remote_pairs_of_ranks * (W * 16 + 4 * Epr) + lists * 8
    c_payload = pairs * (combine_row + 4 * K)
    c_headers = lists * 8 + remote_pairs_of_ranks * 8
    return d_payload, d_headers, c_payload, c_headers, pairs, lists


def worker(rank, world, local_rank, args):
    os.environ.setdefault("MORI_SHMEM_HEAP_SIZE", args.heap)
    import torch
    import torch.distributed as dist

    local_rank %= max(1, torch.cuda.device_count())
    torch.cuda.set_device(local_rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mori = U.import_mori()
    mori.shmem.shmem_torch_process_group_init("default")
    dev = torch.device("cuda", local_rank)
    W, G, M = world, args.gpu_per_node, args.tokens
    Epr = EXPERTS // W
    rows = []
    for name in args.dtypes.split(","):
        fp8 = name == "fp8"
        dt = U.fp8_dtype(torch) if fp8 else torch.bfloat16
        sdim = SCALE_DIM if fp8 else 0
        cfg = mori.ops.EpDispatchCombineConfig(
            rank=rank, world_size=W, hidden_dim=HIDDEN, scale_dim=sdim, scale_type_size=4 if fp8 else 0,
            max_token_type_size=2, max_num_inp_token_per_rank=M, num_experts_per_rank=Epr,
            num_experts_per_token=TOPK, kernel_type="InterNode", gpu_per_node=G)
        op = mori.ops.EpDispatchCombineOp(cfg, check_inputs=False)
        # every rank builds every rank's routing from the same seeds (no communication needed)
        IDX = torch.full((W, M, TOPK), -1, dtype=torch.int32, device=dev)
        for s in range(W):
            g = torch.Generator(device=dev)
            g.manual_seed(1000 + s)
            IDX[s] = torch.rand((M, W * Epr), generator=g, device=dev).topk(TOPK, dim=1).indices.int()
        Ts = [M] * W
        x = torch.randn((M, HIDDEN), device=dev).to(dt)
        w = torch.rand((M, TOPK), device=dev)
        sc = torch.rand((M, sdim), device=dev) if fp8 else None
        # warm-up round trip, then counted phases
        for counted in (False, True):
            torch.cuda.synchronize()
            dist.barrier()
            phase_stats(mori, dist, W)  # drains and drops what earlier calls put on the wire
            dist.barrier()
            out = op.dispatch(x, w, sc, IDX[rank])
            torch.cuda.synchronize()
            dist.barrier()
            dstats = phase_stats(mori, dist, W)
            cin = op.get_registered_combine_input_buffer(torch.bfloat16, HIDDEN)
            n = int(out[4].item())
            cin[:n].copy_(out[0][:n].to(torch.bfloat16) if not fp8 else out[0][:n].float().to(torch.bfloat16))
            dist.barrier()
            op.combine(cin, out[1], IDX[rank])
            torch.cuda.synchronize()
            dist.barrier()
            cstats = phase_stats(mori, dist, W)
        mori.shmem.shmem_check_device_error()
        row_b = HIDDEN * (1 if fp8 else 2)
        dp, dh, cp, ch, pairs, lists = ideal(torch, IDX, Ts, W, G, Epr, TOPK, row_b, HIDDEN * 2, sdim * 4, 4)
        for phase, st, payload, headers in (("dispatch " + name, dstats, dp, dh), ("combine bf16", cstats, cp, ch)):
            wqes = sum(r["wqes"] for r in st)
            nbytes = sum(r["bytes"] for r in st)
            atom = sum(r["atomics"] for r in st)
            rows.append((phase, wqes, nbytes, payload, headers, atom, pairs))
        op.close()
    if rank == 0:
        print(f"\nInterNode wire counts: {W} ranks, {W // G} nodes x {G}, {M} tokens/rank, hidden {HIDDEN}, "
              f"top-{TOPK} of {EXPERTS}; sums over ranks, one call each (emulated NIC, exact)")
        print(f"{'phase':<16} {'WQEs':>7} {'bytes':>14} {'ideal payload':>14} {'ideal hdr':>10} "
              f"{'bytes/ideal':>11} {'mean WRITE':>11} {'atomics':>7} {'pairs':>7}")
        for phase, wqes, nbytes, payload, headers, atom, pairs in rows:
            ratio = nbytes / (payload + headers) if payload + headers else float("nan")
            mean = nbytes / wqes if wqes else 0
            print(f"{phase:<16} {wqes:>7} {nbytes:>14} {payload:>14} {headers:>10} {ratio:>11.4f} "
                  f"{mean / 1024:>9.1f}KB {atom:>7} {pairs:>7}")
    bad = [r for r in rows if r[2] != r[3] + r[4]]
    mori.shmem.shmem_finalize()
    dist.barrier()
    dist.destroy_process_group()
    if bad and rank == 0:
        print("wire bytes differ from the ideal (payload + headers) for: " + ", ".join(r[0] for r in bad))
    return 1 if bad else 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--gpu-per-node", type=int, default=2)
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank (HT 4096, LL 128)")
    p.add_argument("--dtypes", default="bf16,fp8", help="dispatch dtypes (bf16, fp8)")
    p.add_argument("--heap", default="4G", help="MORI_SHMEM_HEAP_SIZE per rank")
    args = p.parse_args()
    try:
        import torch

        if torch.cuda.device_count() < 1:
            print("SKIPPED: needs a GPU, found none")
            return 77
    except ImportError:
        print("SKIPPED: needs torch")
        return 77
    os.environ["MORI_GPU_PER_NODE"] = str(args.gpu_per_node)
    os.environ.setdefault("MORI_RDMA_EMULATE", "1")
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    return U.launch(worker, args.nproc, args)


if __name__ == "__main__":
    sys.exit(main())
