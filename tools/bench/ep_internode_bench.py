#!/usr/bin/env python3
"""Wire counts of mori.ops InterNode / InterNodeV1 / InterNodeV1LL dispatch/combine against the
ideal computed from the routing.

    python3 tools/bench/ep_internode_bench.py --nproc 4 --gpu-per-node 2            # 2 x 2 on one GPU
    python3 tools/bench/ep_internode_bench.py --nproc 8 --gpu-per-node 4 --tokens 4096
    python3 tools/bench/ep_internode_bench.py --nproc 8 --gpu-per-node 4 --tokens 128 --dtypes fp8 \
        --kernel-type InterNodeV1LL --num-qp-per-pe 2                                 # node-deduplicated LL

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
  combine headers  = an 8-byte landing word per non-empty list (the push combine of configs of
                     <= 256 tokens per rank: per (rank, other-node rank), also with no rows) and
                     an 8-byte done word per (rank, other-node rank)

InterNode is the direct scheme (one copy per destination rank): the payload is also the "naive"
bytes the node-deduplicated kernels are measured against.

InterNodeV1 / InterNodeV1LL (docs/ep_internode_v1.md §8; R_d / R_c the record / partial sizes of
layout.hpp's EpV1RecordLayout / EpV1PartialBytes, c(s, n) the tokens of s that node n needs, Q
channels, shares c*q//Q..c*(q+1)//Q, V1 chunks of ceil(512 KiB / R_d) records):
  dispatch payload = sum over (token, remote node it needs) of row + 4K + scales + K idx bytes + 4
  dispatch headers = per record R_d minus that (the G per-PE indices, padding); per (rank, remote
                     node) the count record 8 (2 + G + G Epr), an 8-byte tail per chunk (V1LL: per
                     channel, also empty), V1: an 8-byte credit
  combine payload  = per record row + 4K (weights always travel)
  combine headers  = per record R_c minus that; per (rank, remote node) an 8-byte landing tail per
                     chunk (V1LL: per channel), V1: an 8-byte landFree
  work requests    = per (rank, remote node): V1LL dispatch 1 + per channel 2 (1 if empty), combine
                     per channel 2 (1 if empty): at most (N - 1) Q 3 per rank and phase
The table also gives the deduplication ratio (InterNode's payload for the same routing over the
measured bytes) and whether every WRITE went to the sender's rail peer. Shapes (DeepSeek-V3-like): hidden 7168,
top-8 of 256 experts, BF16 or FP8 (+56 fp32 scales) dispatch, BF16 combine; --tokens sets tokens per
rank (HT 4096, LL 128). The table is printed last.

--link-model also prints, per phase, the *modelled* link time of the work requests the kernels
posted (tools/bench/ep_link_model.py: per PE one TX and one RX port at --link-gbps, FIFO across
QPs, --link-latency-us, --link-per-wr-us per work request) next to the floor (max over PEs of
max(bytes sent, received) / bandwidth), twice: with the dependencies the kernels have within the
call (rule 3' of ep_link_model.py, the headline, checked against the design targets of
docs/ep_internode_v1.md §8.1) and with
every earlier delivery in the emulator's trace as a dependency (rule 3, the trace-order bound;
ranks that share a GPU run in time slices, and this bound serialises them). It sets
MORI_RDMA_EMULATE_TRACE=--link-model-trace (entries per rank, enough for one call of a phase)
before shmem init; a phase whose trace ring overflowed gets no modelled time, only a warning.
--save-trace PATH (implies --link-model) also writes the merged per-phase traces and the run's
parameters as JSON, which `python3 tools/bench/ep_link_model.py PATH` re-models.
--phases N runs N more round trips (each kernel after a host barrier) with the op's per-block phase
trace on and prints,
per phase, the median over ranks of each rank's median-over-calls longest block time: the GPU-side
work of packing, forwarding and the partial sums. With emulated nodes run one rank per GPU
(--nproc <= GPUs) for these times; phases that wait for the network then show the emulator.
For V1 it also gives each GPU-work phase's bytes read plus written (v1_work_traffic, from the
routing) over its time, against the library's grid copy on the op's grid in the same run.
Standard shapes at 2 x 8 (the design targets):

    python3 tools/bench/ep_internode_bench.py --nproc 16 --gpu-per-node 8 --tokens 128 --dtypes fp8 \
        --kernel-type InterNodeV1LL --link-model
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests", "ops"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ep_link_model as LM  # noqa: E402
import ep_test_utils as U  # noqa: E402

HIDDEN, TOPK, EXPERTS, SCALE_DIM = 7168, 8, 256, 56


def phase_stats(mori, dist, W, trace=False):
    """Every rank's RDMA WRITE counts since the last reset (and resets them): list of dicts. Call
    after the phase's kernels finished on every rank: waits until the emulator has executed every
    request they posted (a kernel does not wait for its last signals). trace=True adds the rank's
    trace ring ("trace": the entries' time_ns, src, dst, qp, opcode, bytes, outcome) and
    "trace_dropped"."""
    deadline = time.monotonic() + 10.0
    while mori.shmem.rdma_stats()["pending_sq_blocks"] != 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the RDMA emulator left requests unexecuted for 10 s after the phase")
        time.sleep(0.001)
    st = mori.shmem.rdma_stats(reset=True)
    mine = {"wqes": 0, "bytes": 0, "inline": 0, "atomics": 0, "other": 0, "off_rail": 0}
    G = int(os.environ.get("MORI_GPU_PER_NODE", "1") or 1)
    for row in st["per_peer"]:
        if row["dst"] % G != row["src"] % G:
            mine["off_rail"] += row["bytes"]
        if row["opcode"] in ("write", "write_inline"):
            mine["wqes"] += row["wqes"]
            mine["bytes"] += row["bytes"]
            mine["inline"] += row["inline"]
        else:
            mine["other"] += row["wqes"]
        mine["atomics"] += row["atomics"]
    if trace:
        keys = ("time_ns", "src", "dst", "qp", "opcode", "bytes", "outcome")
        mine["trace"] = [{k: e[k] for k in keys} for e in st["trace"]]
        mine["trace_dropped"] = st["trace_dropped"]
    allr = [None] * W
    dist.all_gather_object(allr, mine)
    return allr


def ideal(torch, IDX, Ts, W, G, Epr, K, row, combine_row, scale_bytes, idx_bytes, push=False):
    """(dispatch payload, dispatch headers, combine payload, combine headers, pairs, lists) summed
    over ranks, from the routing alone. push: the op combines by pushing (op.split_combine_available),
    whose tail word goes to every rank of another node, also with no rows."""
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
    c_headers = (remote_pairs_of_ranks if push else lists) * 8 + remote_pairs_of_ranks * 8
    return d_payload, d_headers, c_payload, c_headers, pairs, lists


def align(v, a):
    return (v + a - 1) // a * a


def v1_ideal(torch, IDX, Ts, W, G, Epr, K, row, combine_row, scale_bytes, idx_bytes, Q, ll):
    """InterNodeV1/V1LL wire ideal (module docstring): (dispatch payload, dispatch headers, combine
    payload, combine headers, dispatch WQEs, combine WQEs, max WQEs of one rank in one phase)."""
    N = W // G
    rec_payload = row + 4 * K + scale_bytes + K * idx_bytes + 4
    rec = align(align(row + 4 * K + scale_bytes, 8) + K * idx_bytes + 4 + 4 * G, 16)
    part_payload = combine_row + 4 * K
    part = align(part_payload, 16)
    chunk_d = -(-(512 << 10) // rec)
    chunk_c = -(-(512 << 10) // part)
    dp = dh = cp = ch = dw = cw = 0
    worst = 0
    for s in range(W):
        T = Ts[s]
        ids = IDX[s, :T].long()
        valid = (ids >= 0) & (ids < W * Epr)
        node_of = torch.where(valid, ids // (Epr * G), torch.full_like(ids, -1))
        d_wqes = c_wqes = 0
        for n in range(N):
            if n == s // G:
                continue
            c = int((node_of == n).any(1).sum().item()) if T > 0 else 0
            dp += c * rec_payload
            dh += c * (rec - rec_payload) + 8 * (2 + G + G * Epr)
            cp += c * part_payload
            ch += c * (part - part_payload)
            d_wqes += 1
            for q in range(Q):
                share = c * (q + 1) // Q - c * q // Q
                if ll:
                    dh += 8
                    ch += 8
                    d_wqes += 2 if share else 1
                    c_wqes += 2 if share else 1
                else:
                    kd, kc = -(-share // chunk_d), -(-share // chunk_c)
                    dh += 8 * kd
                    ch += 8 * kc
                    d_wqes += 2 * kd
                    c_wqes += 2 * kc
            if not ll:
                dh += 8  # credit
                ch += 8  # landFree
                d_wqes += 1
                c_wqes += 1
        dw += d_wqes
        cw += c_wqes
        worst = max(worst, d_wqes, c_wqes)
    return dp, dh, cp, ch, dw, cw, worst


def v1_work_traffic(torch, IDX, Ts, r, W, G, Epr, K, row, combine_row, scale_bytes, idx_bytes):
    """Bytes rank r's GPU-work phases read plus write in one V1 call (the kernels' loops in
    internode_v1_dispatch.cpp / internode_v1_combine.cpp, from the routing; records and partials
    as in v1_ideal, metadata beside a delivered row as the record's). Returns {phase: bytes}.
    v1_stage and reduce touch this GPU's memory only; publish, v1_proxy_sums and v1_own_sums also
    write or read the node's other GPUs (over NVLink/P2P)."""
    N = W // G
    node = r // G
    rec = align(align(row + 4 * K + scale_bytes, 8) + K * idx_bytes + 4 + 4 * G, 16)
    meta = 4 * K + scale_bytes + K * idx_bytes + 4
    part = align(combine_row + 4 * K, 16)

    def per_node(s):  # [T, N] destinations of s's tokens on each node
        ids = IDX[s, :Ts[s]].long()
        valid = (ids >= 0) & (ids < W * Epr)
        dest = torch.where(valid, ids // Epr, torch.full_like(ids, -1))
        hit = torch.zeros((ids.shape[0], W + 1), dtype=torch.bool, device=ids.device)
        hit.scatter_(1, torch.where(dest >= 0, dest, torch.full_like(dest, W)), True)
        return hit[:, :W].view(-1, N, G).sum(2)  # distinct ranks per node

    out = dict.fromkeys(("v1_stage", "publish", "v1_proxy_sums", "v1_own_sums", "reduce"), 0)
    mine = per_node(r)
    remote = torch.ones(N, dtype=torch.bool, device=mine.device)
    remote[node] = False
    staged = int((mine[:, remote] > 0).sum().item())
    out["v1_stage"] = staged * (row + scale_bytes + rec)  # input row (+ scales) read, record written
    for n in range(N):  # rail peers on other nodes: their records for our node
        if n == node:
            continue
        k = per_node(n * G + r % G)[:, node]
        recs, rows = int((k > 0).sum().item()), int(k.sum().item())
        out["publish"] += recs * rec + rows * (row + meta)
        out["v1_proxy_sums"] += rows * combine_row + recs * part
    own = mine[:, node]
    out["v1_own_sums"] = int(own.sum().item()) * combine_row + int((own > 0).sum().item()) * combine_row
    nodes_hit = (mine > 0).sum(1)
    with_remote = mine[:, remote].sum(1) > 0
    out["reduce"] = int(nodes_hit[with_remote].sum().item()) * combine_row + int(with_remote.sum().item()) * combine_row
    return out


def copy_traffic_gbps(torch, dist, mori, dev, blocks, warps, reps=20):
    """Every rank at once: the library's grid copy (read + write, 64 MiB each way) on blocks x warps,
    median of `reps` CUDA-event timings; GB/s of bytes read plus written (the unit of
    v1_work_traffic)."""
    t = mori._C._testing
    n = 64 << 20
    src = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    stream = torch.cuda.current_stream().cuda_stream
    t.grid_copy(dst.data_ptr(), src.data_ptr(), n, blocks, warps * 32, stream)
    torch.cuda.synchronize()
    if not torch.equal(dst, src):
        raise RuntimeError("grid copy baseline did not copy")
    times = []
    for _ in range(reps):
        dist.barrier()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t.grid_copy(dst.data_ptr(), src.data_ptr(), n, blocks, warps * 32, stream)
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    return 2 * n / statistics.median(times) / 1e9


def merged_trace(phase_rows, args):
    """One phase's WRs from every rank's phase_stats(trace=True) row, in one execution order
    (ep_link_model.merge_traces), or None (with a warning) when a rank's trace ring dropped
    entries."""
    dropped = [(r, row["trace_dropped"]) for r, row in enumerate(phase_rows) if row["trace_dropped"]]
    if dropped:
        print("WARNING: the RDMA trace ring dropped entries (rank: entries) " +
              ", ".join(f"{r}: {n}" for r, n in dropped) + f"; no modelled time for this phase. "
              f"Raise --link-model-trace (now {args.link_model_trace}).")
        return None
    return LM.merge_traces([row["trace"] for row in phase_rows])


def link_run(phases, args, W, G, M, push_combine=False):
    """The run ep_link_model.run_table and save_run take: the parameters and
    [{"name", "kind", "entries" or None}]. push_combine: the op combines by pushing."""
    params = {"kernel_type": args.kernel_type, "world_size": W, "gpu_per_node": G, "tokens": M, "hidden": HIDDEN,
              "push_combine": bool(push_combine),
              "topk": TOPK, "experts": EXPERTS, "experts_per_rank": EXPERTS // W, "num_qp_per_pe": args.num_qp_per_pe,
              "dtypes": args.dtypes, "link_gbps": args.link_gbps, "link_latency_us": args.link_latency_us,
              "link_per_wr_us": args.link_per_wr_us, "link_model_trace": args.link_model_trace}
    return {"params": params, "phases": [{"name": n, "kind": k, "entries": e} for n, k, e in phases]}


def link_model_lines(run):
    """The --link-model table: rule 3' (headline, the design targets) next to rule 3."""
    return LM.run_table(run, deps="both")


def phase_times(torch, dist, op, x, w, sc, idx, cin, W, calls, extra):
    """`calls` round trips with the op's phase trace on, every kernel started after a host sync and
    barrier (so no phase includes the previous call's tail), then every rank's
    op.trace_phase_summary per kind (a list over ranks of {"dispatch": ..., "combine": ...} and
    `extra`'s items)."""
    op.enable_trace(slots=max(64, calls))
    for _ in range(calls):
        torch.cuda.synchronize()
        dist.barrier()
        out = op.dispatch(x, w, sc, idx)
        cin[:out[0].shape[0]].copy_(out[0].to(torch.bfloat16) if out[0].dtype != torch.bfloat16 else out[0])
        torch.cuda.synchronize()
        dist.barrier()
        op.combine(cin, out[1], idx)
    summary = {k: op.trace_phase_summary(k) for k in ("dispatch", "combine")}
    summary.update(extra)
    op.disable_trace()
    dist.barrier()
    every = [None] * W
    dist.all_gather_object(every, summary)
    return every


# What each V1 phase does (include/mori/ops/dispatch_combine/trace.hpp); "wait"/"+ wait": the phase
# waits for another PE or the network, so it is not GPU work alone. The GPU-side work: v1_stage
# (packing), publish (forwarding), v1_proxy_sums and v1_own_sums / reduce (the sums); exact with
# two nodes (with more, the forward and proxy loops interleave rail peers).
V1_PHASES = {
    ("dispatch", "v1_stage"): "scan, stage our records for the remote node",
    ("dispatch", "scan"): "post the shares (V1: after the credit) + wait for queue room",
    ("dispatch", "announce"): "relay rail peers' count records + wait",
    ("dispatch", "count_wait"): "own-node counts announced + wait (local PEs done)",
    ("dispatch", "copy"): "own-node rows copied to local PEs + wait (lower counts)",
    ("dispatch", "v1_tail_wait"): "wait: rail peer's records landed (+ relayed counts)",
    ("dispatch", "publish"): "forward rail peers' records to local PEs",
    ("dispatch", "receive"): "block 0: totals + wait (every source)",
    ("combine", "send"): "input in place, ready sent",
    ("combine", "wait_peers"): "wait: local PEs' rows ready",
    ("combine", "v1_proxy_sums"): "proxy: partial sums of rail peers' tokens",
    ("combine", "v1_post_partials"): "post them (V1: after landFree) + wait for queue room",
    ("combine", "v1_own_sums"): "owner: own-node sums",
    ("combine", "v1_landing_wait"): "wait: partials landed",
    ("combine", "reduce"): "owner: every node's partial summed",
}


# The V1 phases that do not wait for another PE or the network: the kernels' GPU-side work
# (packing, forwarding, the sums), summed in the "(GPU work)" line.
V1_GPU_WORK = {"dispatch": ("v1_stage", "publish"), "combine": ("v1_proxy_sums", "v1_own_sums", "reduce")}


def phase_lines(phased, args, W, G, M):
    """The --phases table: per dtype, kind and phase the median (and max) over ranks of each
    rank's median-over-calls longest block time."""
    out = [f"\n{args.kernel_type} kernel phases ({W} ranks, {W // G} nodes x {G}, {M} tokens/rank; "
           f"{args.phases} round trips, each kernel after a host barrier, per-block trace; link emulated by the software NIC, "
           f"so phases that wait for the network show the emulator, not a link)",
           f"{'dtype':<6} {'kind':<9} {'phase':<13} {'median us':>10} {'max us':>8}  what"]
    for name, every in phased:
        for kind in ("dispatch", "combine"):
            spans = [r[kind]["span_us"] for r in every if r[kind]["span_us"] is not None]
            if spans:
                out.append(f"{name:<6} {kind:<9} {'(span)':<13} {statistics.median(spans):>10.1f} {max(spans):>8.1f}"
                           f"  first entry -> last exit ({min(r[kind]['launches'] for r in every)} calls)")
            med = {}
            for n, _ in every[0][kind]["phases"]:
                v = [x for x in (dict(r[kind]["phases"]).get(n) for r in every) if x is not None]
                med[n] = statistics.median(v)
                what = V1_PHASES.get((kind, n), "") if args.kernel_type != "InterNode" else ""
                out.append(f"{name:<6} {kind:<9} {n:<13} {med[n]:>10.1f} {max(v):>8.1f}  {what}")
            got = [n for n in V1_GPU_WORK[kind] if n in med] if args.kernel_type != "InterNode" else []
            if got:
                out.append(f"{name:<6} {kind:<9} {'(GPU work)':<13} {sum(med[n] for n in got):>10.1f} {'':>8}  "
                           + " + ".join(f"{n} {med[n]:.1f}" for n in got))
            if got and "traffic" in every[0]:
                blocks, warps, _ = every[0]["copy_" + kind]
                copy = statistics.median(r["copy_" + kind][2] for r in every)
                out.append(f"{name:<6} {kind:<9} {'[copy kernel]':<13} {'':>10} {'':>8}  library grid copy on the op's "
                           f"{blocks} x {warps}: {copy:.0f} GB/s read + written (median over ranks)")
                for n in got:  # each rank's bytes over its own phase time, median over ranks
                    gbps = [r["traffic"][n] / (dict(r[kind]["phases"])[n] * 1e3) for r in every
                            if dict(r[kind]["phases"]).get(n)]
                    mb = statistics.median(r["traffic"][n] for r in every) / 1e6
                    g = statistics.median(gbps) if gbps else float("nan")
                    out.append(f"{name:<6} {kind:<9} {n:<13} {'':>10} {'':>8}  {mb:.1f} MB read + written, "
                               f"{g:.0f} GB/s = {g / copy:.2f} of the copy kernel")
    return out


def worker(rank, world, local_rank, args):
    os.environ.setdefault("MORI_SHMEM_HEAP_SIZE", args.heap)
    import torch
    import torch.distributed as dist

    local_rank %= max(1, torch.cuda.device_count())
    torch.cuda.set_device(local_rank)
    U.init_process_group(dist, "gloo", rank, world)
    mori = U.import_mori()
    mori.shmem.shmem_torch_process_group_init("default")
    dev = torch.device("cuda", local_rank)
    W, G, M = world, args.gpu_per_node, args.tokens
    Epr = EXPERTS // W
    rows = []
    traced = []  # (phase, "dispatch" | "combine", merged trace or None): rank 0, --link-model
    phased = []  # (dtype, every rank's phase summaries): --phases
    for name in args.dtypes.split(","):
        fp8 = name == "fp8"
        dt = U.fp8_dtype(torch) if fp8 else torch.bfloat16
        sdim = SCALE_DIM if fp8 else 0
        cfg = mori.ops.EpDispatchCombineConfig(
            rank=rank, world_size=W, hidden_dim=HIDDEN, scale_dim=sdim, scale_type_size=4 if fp8 else 0,
            max_token_type_size=2, max_num_inp_token_per_rank=M, num_experts_per_rank=Epr,
            num_experts_per_token=TOPK, kernel_type=args.kernel_type, gpu_per_node=G,
            num_qp_per_pe=args.num_qp_per_pe)
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
            dstats = phase_stats(mori, dist, W, trace=counted and args.link_model)
            cin = op.get_registered_combine_input_buffer(torch.bfloat16, HIDDEN)
            n = int(out[4].item())
            cin[:n].copy_(out[0][:n].to(torch.bfloat16) if not fp8 else out[0][:n].float().to(torch.bfloat16))
            dist.barrier()
            op.combine(cin, out[1], IDX[rank])
            torch.cuda.synchronize()
            dist.barrier()
            cstats = phase_stats(mori, dist, W, trace=counted and args.link_model)
        if args.phases:
            extra = {}
            if args.kernel_type != "InterNode":
                extra["traffic"] = v1_work_traffic(torch, IDX, Ts, rank, W, G, Epr, TOPK, HIDDEN * (1 if fp8 else 2),
                                                   HIDDEN * 2, sdim * 4, 4)
                for kind, for_dispatch in (("dispatch", True), ("combine", False)):
                    blocks, warps = op.resolve_launch(M, -1, -1, for_dispatch)
                    extra["copy_" + kind] = (blocks, warps, copy_traffic_gbps(torch, dist, mori, dev, blocks, warps))
            phased.append((name, phase_times(torch, dist, op, x, w, sc, IDX[rank], cin, W, args.phases, extra)))
            phase_stats(mori, dist, W)  # drains what the traced calls put on the wire
        if args.link_model and rank == 0:
            traced.append(("dispatch " + name, "dispatch", merged_trace(dstats, args)))
            traced.append((f"combine bf16 ({name})", "combine", merged_trace(cstats, args)))
        mori.shmem.shmem_check_device_error()
        row_b = HIDDEN * (1 if fp8 else 2)
        push = op.split_combine_available
        dp, dh, cp, ch, pairs, lists = ideal(torch, IDX, Ts, W, G, Epr, TOPK, row_b, HIDDEN * 2, sdim * 4, 4,
                                             push=push)
        naive = {"dispatch": dp, "combine": cp}  # InterNode's payload: one copy per remote rank
        max_wqes = {}
        if args.kernel_type != "InterNode":
            ll = args.kernel_type == "InterNodeV1LL"
            dp, dh, cp, ch, dw, cw, worst = v1_ideal(torch, IDX, Ts, W, G, Epr, TOPK, row_b, HIDDEN * 2, sdim * 4, 4,
                                                     args.num_qp_per_pe, ll)
            max_wqes = {"dispatch": dw, "combine": cw, "bound": (W // G - 1) * args.num_qp_per_pe * 3}
        for kind, phase, st, payload, headers in (("dispatch", "dispatch " + name, dstats, dp, dh),
                                                  ("combine", "combine bf16", cstats, cp, ch)):
            wqes = sum(r["wqes"] for r in st)
            nbytes = sum(r["bytes"] for r in st)
            atom = sum(r["atomics"] for r in st)
            off_rail = sum(r["off_rail"] for r in st)
            rank_wqes = max(r["wqes"] + r["other"] for r in st)
            rows.append((phase, wqes, nbytes, payload, headers, atom, pairs, naive[kind], off_rail, rank_wqes,
                         max_wqes.get(kind)))
        op.close()
    if rank == 0:
        print(f"\n{args.kernel_type} wire counts: {W} ranks, {W // G} nodes x {G}, {M} tokens/rank, hidden {HIDDEN}, "
              f"top-{TOPK} of {EXPERTS}, {args.num_qp_per_pe} QP(s) per peer; sums over ranks, one call each "
              f"(emulated NIC, exact)")
        print(f"{'phase':<16} {'WQEs':>7} {'bytes':>14} {'ideal payload':>14} {'ideal hdr':>10} "
              f"{'bytes/ideal':>11} {'bytes/payload':>13} {'dedup':>6} {'mean WRITE':>11} {'atomics':>7} "
              f"{'off-rail B':>10} {'WQEs/rank':>9} {'pairs':>7}")
        for phase, wqes, nbytes, payload, headers, atom, pairs, naive, off_rail, rank_wqes, ideal_w in rows:
            ratio = nbytes / (payload + headers) if payload + headers else float("nan")
            over = nbytes / payload if payload else float("nan")
            dedup = naive / nbytes if nbytes else float("nan")
            mean = nbytes / wqes if wqes else 0
            print(f"{phase:<16} {wqes:>7} {nbytes:>14} {payload:>14} {headers:>10} {ratio:>11.4f} {over:>13.4f} "
                  f"{dedup:>6.2f} {mean / 1024:>9.1f}KB {atom:>7} {off_rail:>10} {rank_wqes:>9} {pairs:>7}")
            if ideal_w is not None:
                print(f"{'':<16} ideal WQEs {ideal_w} (summed over ranks)")
        if phased:
            print("\n".join(phase_lines(phased, args, W, G, M)))
        if args.link_model:
            run = link_run(traced, args, W, G, M, push_combine=push)
            if args.save_trace:
                LM.save_run(args.save_trace, run)
                print(f"\nsaved the per-phase traces to {args.save_trace} (re-model: python3 "
                      f"tools/bench/ep_link_model.py {args.save_trace})")
            print()
            print("\n".join(link_model_lines(run)))
    # Exact: measured bytes = ideal payload + headers; V1: no off-rail byte, no atomic, and (V1LL)
    # at most (N - 1) Q 3 work requests per rank and phase.
    bound = (W // G - 1) * args.num_qp_per_pe * 3
    bad = [r for r in rows if r[2] != r[3] + r[4] or (args.kernel_type != "InterNode" and (
        r[8] != 0 or r[5] != 0 or (args.kernel_type == "InterNodeV1LL" and r[9] > bound)))]
    mori.shmem.shmem_finalize()
    dist.barrier()
    dist.destroy_process_group()
    if bad and rank == 0:
        print("wire bytes differ from the ideal (payload + headers) for: " + ", ".join(r[0] for r in bad))
    return 1 if bad else 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--gpu-per-node", type=int, default=2)
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank (HT 4096, LL 128)")
    p.add_argument("--dtypes", default="bf16,fp8", help="dispatch dtypes (bf16, fp8)")
    p.add_argument("--heap", default="4G", help="MORI_SHMEM_HEAP_SIZE per rank")
    p.add_argument("--kernel-type", default="InterNode", choices=("InterNode", "InterNodeV1", "InterNodeV1LL"))
    p.add_argument("--num-qp-per-pe", type=int, default=1, help="config num_qp_per_pe (and MORI_NUM_QP_PER_PE)")
    p.add_argument("--phases", type=int, default=0, metavar="N",
                   help="also run N traced round trips and print each phase's time (per-block trace)")
    p.add_argument("--link-model", action="store_true",
                   help="also print the modelled link time per phase (tools/bench/ep_link_model.py)")
    p.add_argument("--link-model-trace", type=int, default=1 << 18,
                   help="with --link-model: MORI_RDMA_EMULATE_TRACE, trace entries per rank (at most 2^24)")
    p.add_argument("--save-trace", metavar="PATH",
                   help="with --link-model (implied): write the merged per-phase traces and the run's parameters "
                        "as JSON (re-model: python3 tools/bench/ep_link_model.py PATH)")
    p.add_argument("--link-gbps", type=float, default=LM.DEFAULT_GBPS, help="modelled port bandwidth, GB/s")
    p.add_argument("--link-latency-us", type=float, default=LM.DEFAULT_LATENCY_US, help="modelled latency, us")
    p.add_argument("--link-per-wr-us", type=float, default=LM.DEFAULT_PER_WR_US,
                   help="modelled cost per work request on the TX port, us")
    args = p.parse_args(argv)
    if args.save_trace:
        args.link_model = True
    if args.phases < 0:
        p.error(f"--phases must be >= 0, got {args.phases}")
    if args.link_model and not 1 <= args.link_model_trace <= 1 << 24:
        p.error("--link-model-trace must be in [1, 2^24]")
    if not (args.link_gbps > 0 and args.link_latency_us >= 0 and args.link_per_wr_us >= 0
            and args.link_latency_us + args.link_per_wr_us > 0):
        p.error("--link-gbps must be > 0, --link-latency-us and --link-per-wr-us >= 0 and not both 0")
    return args


def bench_env(args):
    """The environment the ranks need (set before shmem init; spawned ranks inherit it)."""
    env = {"MORI_GPU_PER_NODE": str(args.gpu_per_node)}
    if args.link_model:
        env["MORI_RDMA_EMULATE_TRACE"] = str(args.link_model_trace)
    return env


def main():
    args = parse_args()
    try:
        import torch

        if torch.cuda.device_count() < 1:
            print("SKIPPED: needs a GPU, found none")
            return 77
    except ImportError:
        print("SKIPPED: needs torch")
        return 77
    os.environ.update(bench_env(args))
    if args.num_qp_per_pe != 1:
        os.environ.setdefault("MORI_NUM_QP_PER_PE", str(args.num_qp_per_pe))
    os.environ.setdefault("MORI_RDMA_EMULATE", "1")
    return U.launch(worker, args.nproc, args)


if __name__ == "__main__":
    sys.exit(main())
