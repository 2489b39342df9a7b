#!/usr/bin/env python3
"""Benchmark of mori.ops IntraNode dispatch/combine against a torch.distributed baseline.

    torchrun --nproc_per_node=4 tools/bench/ep_bench.py            # all local GPUs
    python3 tools/bench/ep_bench.py --nproc 2 [--configs ht,ll] [--max-sms 24] [--quick]
    python3 tools/bench/ep_bench.py --nproc 4      # on fewer GPUs: ranks share GPUs

mori is imported from an installation, $MORI_BUILD_DIR/python, or <repo>/build*/python.

Configs (DeepSeek-V3-like): HT = 4096 tokens/rank, hidden 7168, top-8 of 256 experts, BF16 and
FP8 (+56 fp32 scales per token) dispatch, BF16 combine; LL = 128 tokens/rank, FP8 dispatch, BF16
combine. Routing: top-k of random scores (as DeepEP's tests). Times come from CUDA graphs of
back-to-back calls (no host overhead), per rank; GB/s are per rank:
  logical  = received rows x row bytes (FP8: + scale bytes) / time   (DeepEP's and MORI's metric)
  physical = rows received from other ranks (crossed a link) x row bytes / time
Combine moves the same rows back, so it uses the same byte counts. Ranks may share a GPU (--nproc
above the GPU count, as the test suites do): the kernels and the protocol between ranks run, but no
row crosses a link, so the physical column and the multi-GPU targets are left out, and the torch
baseline too (NCCL takes one GPU per rank). A block/warp sweep keeps the fastest setting per
phase and times it again (RETIME_ROUNDS times, the median: the minimum over a sweep's noisy
timings is biased low); the registered combine is timed again in turn with the combine of an
external input at that setting, as often. "SMs" = blocks (one block per SM). The baseline is what
users write without us: count exchange, permutation, all_to_all_single of rows, and back with
index_add_.
The result table is printed last.

--compare deep_ep: DeepEP's `Buffer` (an installed `deep_ep`, built from its source) runs the same
shapes on the same inputs in the same process group: HT as its intranode normal mode with the same
SM budget (--max-sms), timed on a cached layout (DeepEP's normal dispatch without a handle reads
the counts on the host, so it cannot be replayed in a graph: eager back-to-back calls, CUDA
events), LL as its low-latency mode in CUDA graphs like ours (its dispatch quantises BF16 to FP8
itself). DeepEP rows count mori's bytes (the same rows received), so their GB/s ratio to ours is
the time ratio; the table gains a "vs DeepEP" column (DeepEP time / ours). Each DeepEP phase is
checked against the same reference as ours before it is timed.

With one rank per GPU on several GPUs, a store-ceiling probe runs first: every rank stores a
contiguous chunk into each peer's symmetric heap at once (the library's grid copy, --max-sms
blocks shared out one peer per block group), the per-GPU egress of an all-to-all; the "of ceiling"
column is a phase's logical GB/s over that egress x W / (W - 1) (the logical bytes a rank could
move if only the rows to other ranks cross links).

--json FILE also writes every figure of the table with its settings (tools/bench/bench_json.py:
kernel type, ranks, shape, dtype, blocks x warps, µs, GB/s, the baselines of the same run, GPU,
commit, command line); tools/bench/report.py turns such files into the tables of
docs/performance.md, tools/bench/plot.py into charts.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests", "ops"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_json as BJ  # noqa: E402
import ep_test_utils as U  # noqa: E402

HIDDEN, TOPK, EXPERTS, SCALE_DIM = 7168, 8, 256, 56
RETIME_ROUNDS = 3  # re-timings of a sweep's winner (1 with --quick)


def alternate(timers, rounds):
    """Calls each timer of `timers` ({name: () -> seconds}) `rounds` times, in turn (a, b, a, b,
    ...), so a drift of the machine reaches each alike; returns {name: median seconds}."""
    seen = {name: [] for name in timers}
    for _ in range(rounds):
        for name, timer in timers.items():
            seen[name].append(timer())
    return {name: statistics.median(v) for name, v in seen.items()}


def log(rank, *a):
    if rank == 0:
        print(*a, flush=True)


class Bench:
    def __init__(self, rank, world, local_rank, args, shared):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank, self.W, self.args = rank, world, args
        self.shared = shared  # ranks share GPUs: nothing crosses a link
        self.rounds = 1 if args.quick else RETIME_ROUNDS  # re-timings of a sweep's winner
        self.dev = torch.device("cuda", local_rank)
        self.mori = U.import_mori()
        self.fp8 = U.fp8_dtype(torch)
        self.rows = []  # result table (row())
        self.settings = {}  # facts of the run for --json

    # --- timing ---------------------------------------------------------------------------------
    def time_calls(self, fn, n_inner, n_rep):
        """Seconds per call of fn(): CUDA graph of n_inner calls, replayed n_rep times (median).
        Falls back to eager launches if capture fails."""
        torch, dist = self.torch, self.dist
        fn()  # warm-up (also creates cached views outside the graph)
        torch.cuda.synchronize()
        dist.barrier()
        graph = None
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(n_inner):
                    fn()
            torch.cuda.synchronize()
            dist.barrier()
        except Exception as e:  # noqa: BLE001
            log(self.rank, f"  (graph capture failed: {e}; timing eager launches)")
            graph = None
            torch.cuda.synchronize()
            dist.barrier()
        times = []
        for _ in range(n_rep):
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if graph is not None:
                graph.replay()
            else:
                for _ in range(n_inner):
                    fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / n_inner)
        self.mori.shmem.shmem_check_device_error()
        return statistics.median(times)

    # --- store ceiling --------------------------------------------------------------------------
    def store_ceiling(self, blocks, chunk=64 << 20):
        """Per-rank egress (physical GB/s) of an all-to-all of plain stores: this rank's `blocks`
        shared out over its peers (one peer per block group), each group storing one contiguous
        `chunk` into its peer's symmetric heap, all peers at once; the slowest rank's time."""
        torch, sh = self.torch, self.mori.shmem
        t = self.mori._C._testing
        peers = [p for p in range(self.W) if p != self.rank]
        per = max(1, blocks // len(peers))
        heap = sh.shmem_malloc(self.W * chunk)  # collective: slot r of every heap is rank r's
        src = torch.empty(chunk, dtype=torch.uint8, device=self.dev).random_(0, 255)
        dsts = [sh.shmem_ptr_p2p(heap + self.rank * chunk, self.rank, p) for p in peers]
        if not all(dsts):
            raise RuntimeError("store ceiling: a peer is not load/store reachable")
        streams = [torch.cuda.Stream(device=self.dev) for _ in peers]

        def once():
            cur = torch.cuda.current_stream()
            for st, d in zip(streams, dsts):
                st.wait_stream(cur)
                t.grid_copy(d, src.data_ptr(), chunk, per, 512, st.cuda_stream)
            for st in streams:
                cur.wait_stream(st)

        secs = max(self.allgather(self.time_calls(once, 5, 3 if self.args.quick else 5)))
        torch.cuda.synchronize()
        self.dist.barrier()
        sh.shmem_free(heap)
        return len(peers) * chunk / secs / 1e9, per * len(peers)

    def allgather(self, v):
        out = [None] * self.W
        self.dist.all_gather_object(out, v)
        return out

    # --- data -----------------------------------------------------------------------------------
    def make_inputs(self, T, seed):
        torch = self.torch
        g = torch.Generator(device=self.dev)
        g.manual_seed(seed * 1000 + self.rank)
        x = torch.randn((T, HIDDEN), generator=g, device=self.dev).to(torch.bfloat16)
        scores = torch.randn((T, EXPERTS), generator=g, device=self.dev).abs() + 1
        idx = torch.topk(scores, TOPK, dim=-1, largest=True, sorted=False)[1].to(torch.int32)
        w = torch.rand((T, TOPK), generator=g, device=self.dev)
        scales = torch.rand((T, SCALE_DIM), generator=g, device=self.dev)
        x8 = x.float().clamp(-448, 448).to(self.fp8) if self.fp8 is not None else None
        return x, x8, scales, idx, w

    def row_counts(self, idx):
        """(rows this rank receives, rows it receives from other ranks) for everyone's routing."""
        torch = self.torch
        epr = EXPERTS // self.W
        dest = (idx.long() // epr)
        mask = torch.zeros((idx.shape[0], self.W), dtype=torch.bool, device=self.dev)
        mask.scatter_(1, dest, True)
        sent = mask.sum(0).tolist()  # rows this rank sends to each rank
        allsent = self.allgather(sent)
        recv = sum(allsent[s][self.rank] for s in range(self.W))
        recv_remote = recv - allsent[self.rank][self.rank]
        return recv, recv_remote, mask

    # --- ours -----------------------------------------------------------------------------------
    def make_op(self, T):
        cfg = self.mori.ops.EpDispatchCombineConfig(
            rank=self.rank, world_size=self.W, hidden_dim=HIDDEN, scale_dim=SCALE_DIM, scale_type_size=4,
            max_token_type_size=2, max_num_inp_token_per_rank=T, num_experts_per_rank=EXPERTS // self.W,
            num_experts_per_token=TOPK, use_external_inp_buf=False)
        return self.mori.ops.EpDispatchCombineOp(cfg, check_inputs=False)

    def sweep(self, label, T, launches, fn_factory, n_inner, n_rep, retime=True):
        """fn_factory(blocks, warps) -> callable; returns (best seconds, (blocks, warps), all).
        retime: the best seconds are the winner's, timed again (else the sweep's minimum: for a
        caller that times the winner itself)."""
        best = None
        results = []
        for b, w in launches:
            secs = self.time_calls(fn_factory(b, w), n_inner, n_rep)
            worst = max(self.allgather(secs))  # a collective is as slow as its slowest rank
            results.append(((b, w), worst))
            if best is None or worst < best[0]:
                best = (worst, (b, w))
            log(self.rank, f"  {label:<22} blocks {b:>3} x warps {w:>2}: {worst * 1e6:9.1f} us")
        if retime and len(results) > 1:
            again = alternate({"best": self.slowest_rank(fn_factory(*best[1]), n_inner, n_rep)}, self.rounds)["best"]
            log(self.rank, f"  {label:<22} blocks {best[1][0]:>3} x warps {best[1][1]:>2} again: {again * 1e6:9.1f} us "
                           f"(median of {self.rounds}; the sweep's minimum {best[0] * 1e6:.1f} us)")
            best = (again, best[1])
        return best[0], best[1], results

    def slowest_rank(self, fn, n_inner, n_rep):
        """A timer (no arguments) of fn: time_calls on every rank, the slowest rank's seconds."""
        return lambda: max(self.allgather(self.time_calls(fn, n_inner, n_rep)))

    def run_config(self, name, T, dispatch_kinds, launches):
        torch = self.torch
        op = self.make_op(T)
        symm_mib = op.symmetric_bytes / 2**20
        x, x8, scales, idx, w = self.make_inputs(T, seed=1)
        recv, recv_remote, mask = self.row_counts(idx)
        n_inner, n_rep = (5, 3) if self.args.quick else ((10, 5) if T > 1024 else (50, 5))
        pdl = getattr(op._handle, "programmatic_launch", "n/a")
        self.settings.update({f"{name} symmetric MiB per rank": round(symm_mib, 1), "programmatic launch": str(pdl)})
        log(self.rank, f"== {name}: {T} tokens/rank, hidden {HIDDEN}, top-{TOPK} of {EXPERTS}, {self.W} ranks; "
                       f"symmetric memory {symm_mib:.1f} MiB/rank, local {op.local_bytes / 2**20:.1f} MiB/rank; "
                       f"programmatic launch {pdl} (MORI_EP_PDL)")
        row_bf16 = HIDDEN * 2
        row_fp8 = HIDDEN + SCALE_DIM * 4
        for kind in dispatch_kinds:
            if kind == "FP8" and x8 is None:
                log(self.rank, "  FP8 skipped: torch has no float8 e4m3 dtype")
                continue
            inp, sc, rb = (x, None, row_bf16) if kind == "BF16" else (x8, scales, row_fp8)

            def fac(b, wp, inp=inp, sc=sc):
                return lambda: op.dispatch(inp, w, sc, idx, block_num=b, warp_per_block=wp)

            secs, lw, _ = self.sweep(f"dispatch {kind}", T, launches, fac, n_inner, n_rep)
            key = dict(config=name, tokens=T, phase="dispatch", dtype=kind)
            self.record(key, secs, recv * rb, recv_remote * rb, lw)
            self.kernel_baselines(key, recv * rb, lw, n_inner, n_rep)
        # combine (BF16, zero-copy): expert output = the dispatched BF16 rows
        outs = op.dispatch(x, w, None, idx)
        buf = op.get_registered_combine_input_buffer(torch.bfloat16, HIDDEN)
        buf.copy_(outs[0])
        wbuf = op.get_registered_combine_weights_buffer()
        wbuf.copy_(outs[1])
        torch.cuda.synchronize()
        self.dist.barrier()

        def cfac(b, wp):
            return lambda: op.combine(buf, wbuf, idx, block_num=b, warp_per_block=wp)

        _, lw, _ = self.sweep("combine BF16", T, launches, cfac, n_inner, n_rep, retime=False)
        # correctness spot check: combine of unchanged rows = x * (number of destination ranks)
        out, _ = op.combine(buf, wbuf, idx)
        ndest = mask.sum(1, keepdim=True).float()
        ok = torch.allclose(out.float(), (x.float() * ndest).to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
        oks = self.allgather(bool(ok))
        log(self.rank, f"  check: combine(dispatch(x)) == x * n_dest on all ranks: {all(oks)}")
        ref = out.clone()
        # external (copied) input, at the registered input's best launch, timed in turn with it
        ext = outs[0][:recv].clone() if recv > 0 else outs[0][:1].clone()
        med = alternate({"registered": self.slowest_rank(cfac(*lw), n_inner, n_rep),
                         "external": self.slowest_rank(
                             lambda: op.combine(ext, None, idx, block_num=lw[0], warp_per_block=lw[1]), n_inner, n_rep)},
                        self.rounds)
        log(self.rank, f"  combine BF16 at blocks {lw[0]} x warps {lw[1]}, in turn ({self.rounds} each, median): "
                       f"registered {med['registered'] * 1e6:.1f} us, external input {med['external'] * 1e6:.1f} us")
        # the external input's rows are the registered buffer's: the same sums, bit for bit
        out_e, _ = op.combine(ext, None, idx, block_num=lw[0], warp_per_block=lw[1])
        oks = self.allgather(bool(torch.equal(out_e, ref)))
        log(self.rank, f"  check: combine of the external input == registered, bitwise, on all ranks: {all(oks)}")
        key = dict(config=name, tokens=T, phase="combine", dtype="BF16")
        self.record(key, med["registered"], recv * row_bf16, recv_remote * row_bf16, lw)
        self.kernel_baselines(key, recv * row_bf16, lw, n_inner, n_rep)
        self.record(dict(key, variant="external input"), med["external"], recv * row_bf16, recv_remote * row_bf16, lw)
        if not self.args.no_baseline and not self.shared:
            self.baseline(name, x, x8, scales, idx, w, recv, recv_remote, dispatch_kinds)
        op.close()
        if self.args.compare == "deep_ep":
            compare = self.deep_ep_ht if name == "HT" else self.deep_ep_ll
            compare(name, x, scales, idx, w, recv, recv_remote, mask, dispatch_kinds, n_inner, n_rep)
        return symm_mib

    # --- DeepEP, same inputs, same group --------------------------------------------------------
    def _deep_ep(self):
        try:
            import deep_ep
        except ImportError as e:
            raise RuntimeError(f"--compare deep_ep: deep_ep is not importable ({e}); build DeepEP from its "
                               "source into this Python (tools/bench/build_deep_ep.sh)") from e
        return deep_ep

    def _check(self, what, ok):
        oks = self.allgather(bool(ok))
        log(self.rank, f"  check: {what} on all ranks: {all(oks)}")
        if not all(oks):
            raise RuntimeError(f"--compare deep_ep: {what} fails on ranks {[r for r, o in enumerate(oks) if not o]}")

    def deep_ep_ht(self, name, x, scales, idx, w, recv, recv_remote, mask, kinds, n_inner, n_rep):
        """DeepEP's intranode normal mode with our SM budget: dispatch on a cached layout (BF16, FP8
        with its per-128-column scales, column-major as DeepEP's tests pass them), combine BF16."""
        torch = self.torch
        deep_ep = self._deep_ep()
        if self.shared:
            log(self.rank, "  (DeepEP skipped: it needs a GPU per rank)")
            return
        deep_ep.Buffer.set_num_sms(self.args.max_sms)
        dcfg, ccfg = deep_ep.Buffer.get_dispatch_config(self.W), deep_ep.Buffer.get_combine_config(self.W)
        hidden_bytes = HIDDEN * 2
        nvl = max(dcfg.get_nvl_buffer_size_hint(hidden_bytes, self.W), ccfg.get_nvl_buffer_size_hint(hidden_bytes, self.W))
        buf = deep_ep.Buffer(self.dist.group.WORLD, nvl, 0, explicitly_destroy=True)
        T = x.shape[0]
        topk = idx.long()
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, EXPERTS)
        log(self.rank, f"== DeepEP {deep_ep.__file__}: intranode, {self.args.max_sms} SMs, NVL buffer {nvl / 2**20:.0f} MiB")
        row_fp8 = HIDDEN + SCALE_DIM * 4
        recv_bf16 = None
        for kind in kinds:
            if kind == "FP8" and self.fp8 is None:
                continue
            if kind == "BF16":
                xin, rb = x, HIDDEN * 2
            else:
                xin, rb = (x.float().clamp(-448, 448).to(self.fp8), scales.t().contiguous().t()), row_fp8
            out = buf.dispatch(xin, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=w, config=dcfg)
            rx, handle = out[0], out[4]
            rows = (rx[0] if isinstance(rx, tuple) else rx).shape[0]
            self._check(f"DeepEP {name} dispatch {kind} receives the rows ours does ({recv} here)", rows == recv)
            if kind == "BF16":
                recv_bf16 = (rx, handle)
            secs = self.time_eager(lambda xin=xin, handle=handle: buf.dispatch(xin, handle=handle, config=dcfg),
                                   n_inner, n_rep, events=True)
            key = dict(config=name, tokens=T, phase="dispatch", dtype=kind, impl="DeepEP")
            self.record(key, max(self.allgather(secs)), recv * rb, recv_remote * rb, None)
        rx, handle = recv_bf16
        combined = buf.combine(rx, handle, config=ccfg)[0]
        ndest = mask.sum(1, keepdim=True).float()
        ref = (x.float() * ndest).to(torch.bfloat16).float()
        self._check(f"DeepEP {name} combine(dispatch(x)) == x * n_dest",
                    torch.allclose(combined.float(), ref, rtol=1e-2, atol=1e-2))
        secs = self.time_eager(lambda: buf.combine(rx, handle, config=ccfg), n_inner, n_rep, events=True)
        key = dict(config=name, tokens=T, phase="combine", dtype="BF16", impl="DeepEP")
        self.record(key, max(self.allgather(secs)), recv * HIDDEN * 2, recv_remote * HIDDEN * 2, None)
        torch.cuda.synchronize()
        self.dist.barrier()
        buf.destroy()

    def deep_ep_ll(self, name, x, scales, idx, w, recv, recv_remote, mask, kinds, n_inner, n_rep):
        """DeepEP's low-latency mode over NVLink: FP8 dispatch (it quantises our BF16 rows), BF16
        combine of the unchanged expert rows (weighted by the top-k weights, as DeepEP combines),
        both replayed in CUDA graphs."""
        torch = self.torch
        deep_ep = self._deep_ep()
        if self.shared:
            log(self.rank, "  (DeepEP skipped: it needs a GPU per rank)")
            return
        T = x.shape[0]
        rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, HIDDEN, self.W, EXPERTS)
        buf = deep_ep.Buffer(self.dist.group.WORLD, 0, rdma, low_latency_mode=True,
                             num_qps_per_rank=EXPERTS // self.W, explicitly_destroy=True)
        log(self.rank, f"== DeepEP {deep_ep.__file__}: low-latency mode, RDMA buffer {rdma / 2**20:.0f} MiB")
        topk = idx.long()
        row_fp8 = HIDDEN + SCALE_DIM * 4
        rx, count, handle, _, _ = buf.low_latency_dispatch(x, topk, T, EXPERTS, use_fp8=True)
        epr = EXPERTS // self.W
        got = int(count.sum().item())
        # DeepEP's low-latency dispatch delivers one row per (token, local expert): compare with the
        # routing every rank sees.
        allidx = [None] * self.W
        self.dist.all_gather_object(allidx, idx.cpu())
        expect = sum(int(((a.long() >= self.rank * epr) & (a.long() < (self.rank + 1) * epr)).sum()) for a in allidx)
        self._check(f"DeepEP {name} dispatch FP8 delivers one row per (token, local expert) ({expect} here)", got == expect)
        secs = self.time_calls(lambda: buf.low_latency_dispatch(x, topk, T, EXPERTS, use_fp8=True), n_inner, n_rep)
        key = dict(config=name, tokens=T, phase="dispatch", dtype="FP8", impl="DeepEP")
        self.record(key, max(self.allgather(secs)), recv * row_fp8, recv_remote * row_fp8, None)
        rxb, _, handle, _, _ = buf.low_latency_dispatch(x, topk, T, EXPERTS, use_fp8=False)
        out = buf.low_latency_combine(rxb, topk, w, handle)[0]
        ref = (x.float() * w.sum(1, keepdim=True)).to(torch.bfloat16).float()
        self._check(f"DeepEP {name} combine == x * sum(top-k weights)",
                    torch.allclose(out.float(), ref, rtol=2e-2, atol=2e-2))
        secs = self.time_calls(lambda: buf.low_latency_combine(rxb, topk, w, handle), n_inner, n_rep)
        key = dict(config=name, tokens=T, phase="combine", dtype="BF16", impl="DeepEP")
        self.record(key, max(self.allgather(secs)), recv * HIDDEN * 2, recv_remote * HIDDEN * 2, None)
        torch.cuda.synchronize()
        self.dist.barrier()
        buf.destroy()

    def kernel_baselines(self, key, nbytes, launch, n_inner, n_rep):
        """--kernel-baselines: in the same run, the library's plain grid copy of the phase's logical
        bytes (read once, written once) on the phase's best blocks x warps, and an empty kernel,
        both replayed in CUDA graphs like the phase. The copy sets what one rank's kernel could
        reach on those SMs; the empty kernel its fixed launch cost."""
        if not self.args.kernel_baselines:
            return
        torch = self.torch
        t = self.mori._C._testing
        nbytes = max(16, (nbytes + 15) // 16 * 16)
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.dev).random_(0, 255)
        dst = torch.empty_like(src)
        blocks, threads = launch[0], launch[1] * 32

        def copy():
            t.grid_copy(dst.data_ptr(), src.data_ptr(), nbytes, blocks, threads,
                        torch.cuda.current_stream().cuda_stream)

        secs = self.time_calls(copy, 10, n_rep)
        if not torch.equal(dst, src):
            raise RuntimeError("kernel baseline: the grid copy did not copy")
        secs = max(self.allgather(secs))
        self.record(dict(key, impl="copy kernel"), secs, nbytes, 0, launch)
        secs = self.time_calls(lambda: t.empty_kernel(1, 32, torch.cuda.current_stream().cuda_stream), 50, n_rep)
        self.record(dict(key, impl="empty kernel"), max(self.allgather(secs)), 0, 0, (1, 1))

    def record(self, key, secs, logical, physical, launch):
        """One figure: `key` = config, tokens, phase, dtype (+ variant, impl); every rank calls it
        (the GB/s gather the ranks' byte counts)."""
        gl = [b / secs / 1e9 for b in self.allgather(logical)]
        gp = [b / secs / 1e9 for b in self.allgather(physical)]
        self.rows.append(row(key, secs * 1e6, statistics.mean(gl), min(gl), statistics.mean(gp), launch))

    # --- torch baseline -------------------------------------------------------------------------
    def baseline(self, name, x, x8, scales, idx, w, recv, recv_remote, kinds):
        torch, dist = self.torch, self.dist
        W = self.W
        epr = EXPERTS // W

        def layout():
            dest = idx.long() // epr
            mask = torch.zeros((idx.shape[0], W), dtype=torch.bool, device=self.dev)
            mask.scatter_(1, dest, True)
            send_counts = mask.sum(0)
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts)
            order = mask.t().nonzero()[:, 1]  # tokens grouped by destination rank
            return order, send_counts.tolist(), recv_counts.tolist()

        def dispatch(src):
            order, sc_, rc_ = layout()
            send = src[order]
            out = torch.empty((sum(rc_),) + tuple(src.shape[1:]), dtype=src.dtype, device=self.dev)
            dist.all_to_all_single(out, send, rc_, sc_)
            return out, order, sc_, rc_

        def combine(state):
            rows, order, sc_, rc_ = state
            back = torch.empty((sum(sc_), HIDDEN), dtype=torch.bfloat16, device=self.dev)
            dist.all_to_all_single(back, rows, sc_, rc_)
            out = torch.zeros((x.shape[0], HIDDEN), dtype=torch.float32, device=self.dev)
            out.index_add_(0, order, back.float())
            return out.to(torch.bfloat16)

        n_inner, n_rep = (3, 3) if self.args.quick else (5, 5)
        for kind in kinds:
            if kind == "FP8" and x8 is None:
                continue
            if kind == "BF16":
                fn = lambda: dispatch(x)  # noqa: E731
                rb = HIDDEN * 2
            else:
                xs = torch.cat([x8.view(torch.uint8), scales.view(torch.uint8)], dim=1)
                fn = lambda xs=xs: dispatch(xs)  # noqa: E731
                rb = HIDDEN + SCALE_DIM * 4
            secs = max(self.allgather(self.time_eager(fn, n_inner, n_rep)))
            key = dict(config=name, tokens=x.shape[0], phase="dispatch", dtype=kind, impl="torch")
            self.record(key, secs, recv * rb, recv_remote * rb, None)
        state = dispatch(x)
        secs = max(self.allgather(self.time_eager(lambda: combine(state), n_inner, n_rep)))
        rb = HIDDEN * 2
        key = dict(config=name, tokens=x.shape[0], phase="combine", dtype="BF16", impl="torch")
        self.record(key, secs, recv * rb, recv_remote * rb, None)

    def time_eager(self, fn, n_inner, n_rep, events=False):
        """Seconds per call of fn(), launched eagerly n_inner times back to back (median of n_rep),
        for calls a graph cannot hold: host clock to a device synchronisation (the torch baseline,
        whose collectives involve the host), or with `events` between two CUDA events."""
        torch, dist = self.torch, self.dist
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(n_rep):
            dist.barrier()
            if events:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            for _ in range(n_inner):
                fn()
            if events:
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3 / n_inner)
            else:
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) / n_inner)
        return statistics.median(times)


def row_label(key):
    """The table's phase label: "HT dispatch BF16", "HT combine BF16 (external input)",
    "HT dispatch FP8 [copy kernel]"."""
    label = f"{key['config']} {key['phase']} {key['dtype']}"
    if key.get("variant"):
        label += f" ({key['variant']})"
    if key.get("impl", "mori") != "mori":
        label += f" [{key['impl']}]"
    return label


def row(key, us, gl_mean, gl_min, gp_mean, launch):
    """One printed figure (a dict: the key's fields, label, us, GB/s, launch)."""
    r = dict(variant="", impl="mori")
    r.update(key)
    r.update(label=row_label(r), us=us, gl_mean=gl_mean, gl_min=gl_min, gp_mean=gp_mean,
             launch=tuple(launch) if launch else None)
    return r


def records(rows, ranks, linked, shared, kernel_type="IntraNode"):
    """The rows as bench_json records: every figure with its settings; a mori row carries the
    baselines of the same run and phase ({impl: us}). `linked`: rows crossed a link (physical GB/s
    means something)."""
    base = {}
    for r in rows:
        if r["impl"] != "mori":
            base.setdefault((r["config"], r["phase"], r["dtype"]), {})[r["impl"]] = r["us"]
    out = []
    for r in rows:
        baselines = {}
        if r["impl"] == "mori":
            baselines = dict(base.get((r["config"], r["phase"], r["dtype"]), {}))
            if r["variant"]:  # the kernel baselines time the zero-copy phase's bytes and launch
                baselines = {k: v for k, v in baselines.items() if k in ("torch", "DeepEP")}
        launch = r["launch"]
        out.append(BJ.make_record(
            impl=r["impl"], kernel_type=kernel_type, config=r["config"], phase=r["phase"], variant=r["variant"],
            dtype=r["dtype"].lower(), ranks=ranks, nodes=1, gpus_per_node=ranks, ranks_share_gpus=bool(shared),
            tokens=int(r["tokens"]), hidden=HIDDEN, topk=TOPK, experts=EXPERTS,
            blocks=int(launch[0]) if launch and r["impl"] != "empty kernel" else None,
            warps=int(launch[1]) if launch and r["impl"] != "empty kernel" else None,
            us=round(float(r["us"]), 3), logical_gbps=round(float(r["gl_mean"]), 2) if r["gl_mean"] else None,
            logical_gbps_min=round(float(r["gl_min"]), 2) if r["gl_min"] else None,
            physical_gbps=round(float(r["gp_mean"]), 2) if linked and r["impl"] in ("mori", "torch") else None,
            baselines=baselines))
    return out


def json_document(rows, *, ranks, linked, shared, gpu, gpus, sm_count, settings, argv=None, launcher="python3",
                  kernel_type="IntraNode"):
    """The --json document of one run (bench_json schema)."""
    run = BJ.make_run(tool="tools/bench/ep_bench.py", command=BJ.command_line(argv, launcher), commit=BJ.git_commit(),
                      machine=BJ.machine_kind(gpu, gpus), gpu=gpu, gpus=gpus, sm_count=sm_count,
                      settings=settings, date=BJ.utc_now(),
                      records=records(rows, ranks, linked, shared, kernel_type))
    return BJ.document([run])


def print_results(rows, symm, setup, linked, four_gpus, logical_ceiling=None):
    """The result table. `linked`: every rank has its own GPU and there are several, so rows from
    other ranks crossed a link and the physical column means something. `four_gpus`: 4 ranks on
    4 GPUs, the setting the targets are stated for. `logical_ceiling`: the store-ceiling probe's
    logical GB/s per rank (an "of ceiling" column), or None. DeepEP rows add "vs DeepEP" (its time
    over ours)."""
    print()
    print(f"Results: {setup}; per-rank GB/s (mean / min over ranks); time = slowest rank, CUDA-graph replays")
    cols = [("phase", 34), ("time us", 9), ("logical GB/s", 15)]
    if linked:
        cols.append(("physical GB/s", 13))
    cols += [("blocks x warps (SMs)", 20), ("vs torch", 8)]
    deep_ep_us = {r["label"].replace(" [DeepEP]", ""): r["us"] for r in rows if r["impl"] == "DeepEP"}
    if deep_ep_us:
        cols.append(("vs DeepEP", 9))
    if logical_ceiling:
        cols.append(("of ceiling", 10))
    # On a [copy kernel] row the last column is the phase's efficiency: copy time / phase time.
    print("| " + " | ".join(f"{n:<{w}}" if n == "phase" else f"{n:>{w}}" for n, w in cols) + " |")
    print("|" + "|".join("-" * (w + 2) for _, w in cols) + "|")
    torch_us = {r["label"].replace(" [torch]", ""): r["us"] for r in rows if r["label"].endswith("[torch]")}
    for r in rows:
        lw = f"{r['launch'][0]} x {r['launch'][1]} ({r['launch'][0]})" if r["launch"] else "-"
        base = torch_us.get(r["label"].replace(" (external input)", ""))
        sp = f"{base / r['us']:.1f}x" if base and not r["label"].endswith("[torch]") else ""
        if r["label"].endswith("[copy kernel]"):  # the phase's time / the copy's: efficiency vs copy
            op_us = next((o["us"] for o in rows if o["label"] == r["label"].replace(" [copy kernel]", "")), None)
            sp = f"{r['us'] / op_us:.2f}" if op_us else ""
        cells = [f"{r['label']:<34}", f"{r['us']:>9.1f}", f"{r['gl_mean']:>7.1f} / {r['gl_min']:>5.1f}"]
        if linked:
            cells.append(f"{r['gp_mean']:>13.1f}")
        cells += [f"{lw:>20}", f"{sp:>8}"]
        if deep_ep_us:
            de = deep_ep_us.get(r["label"].replace(" (external input)", ""))
            ratio = f"{de / r['us']:.2f}x" if de and r["impl"] == "mori" else ""
            cells.append(f"{ratio:>9}")
        if logical_ceiling:
            of = r["gl_mean"] / logical_ceiling if r["impl"] in ("mori", "DeepEP") and r["gl_mean"] else None
            cells.append(f"{of:>10.2f}" if of else f"{'':>10}")
        print("| " + " | ".join(cells) + " |")
    for k, v in symm.items():
        print(f"symmetric memory per rank, {k} config: {v:.1f} MiB")
    if not linked:
        print("(no physical GB/s: no row crossed a link in this run)")
    if four_gpus:
        print("targets (4x H200): HT dispatch BF16 >= 380 GB/s, FP8 >= 350, combine >= 425 with <= 24 SMs; "
              "LL dispatch <= 20 us, combine <= 25 us; >= 3x torch; HT symmetric memory <= 1024 MiB")
    else:
        print("(the targets are stated for 4 ranks on 4 GPUs: not shown for this run)")


def parse_grid(spec):
    """"b1,b2,...:w1,w2,..." -> (blocks, warps); an empty side keeps the default."""
    bs, _, ws = spec.partition(":")
    return ([int(v) for v in bs.split(",") if v.strip()], [int(v) for v in ws.split(",") if v.strip()])


def launch_grid(kind, world, max_sms, sm_count, max_warps, override=""):
    if kind == "ht":
        # <= 24 SMs (the target); from 3 blocks per destination on, the local copy gets only
        # blocks / (2 x world) of them (EpDispatchBlockRole), so 12..24 are the interesting counts.
        blocks = (world * 2, 8, 12, 16, 20, 24, max_sms)
        warps = (8, 12, 16)
        cap = min(max_sms, sm_count)
    else:
        # latency-bound: up to the whole GPU (the per-block cost of per-thread system fences is gone)
        blocks = (16, 32, 48, 64, 96, sm_count)
        warps = (4, 8, 16)
        cap = sm_count
    ob, ow = parse_grid(override) if override else ([], [])
    blocks = sorted({b for b in (ob or blocks) if world <= b <= cap})
    warps = sorted({w for w in (ow or warps) if 1 <= w <= max_warps})
    return [(b, w) for b in blocks for w in warps]


def worker(rank, world, local_rank, args):
    os.environ.setdefault("MORI_SHMEM_HEAP_SIZE", "4G")
    import torch
    import torch.distributed as dist

    # More ranks than GPUs: ranks share GPUs round-robin (shmem maps peers on one GPU as plain device
    # memory; their kernels take turns on it). NCCL takes one GPU per rank, so they talk over gloo.
    ngpus = torch.cuda.device_count()
    shared = world > ngpus
    local_rank %= max(1, ngpus)
    torch.cuda.set_device(local_rank)
    U.init_process_group(dist, "gloo" if shared else "cpu:gloo,cuda:nccl", rank, world)
    b = Bench(rank, world, local_rank, args, shared)
    mori = b.mori
    mori.shmem.shmem_torch_process_group_init("default")
    sm_count = torch.cuda.get_device_properties(local_rank).multi_processor_count
    o = mori._C.ops
    max_warps = o.MAX_THREADS_PER_BLOCK // o.WARP_SIZE
    gpu_name = torch.cuda.get_device_name(local_rank)
    n_used = min(world, ngpus)
    setup = f"{world} rank(s) on {n_used} x {gpu_name}" + (" (ranks share GPUs: no row crosses a link)" if shared else "")
    log(rank, f"mori EP benchmark: {setup} ({sm_count} SMs), torch {torch.__version__}, HT SM cap {args.max_sms}")
    if shared and not args.no_baseline:
        log(rank, "  (no torch baseline: NCCL takes one GPU per rank)")
    symm = {}
    ceiling = None
    if world > 1 and not shared:
        ceiling, probe_blocks = b.store_ceiling(args.max_sms)
        b.settings[BJ.STORE_CEILING] = round(ceiling, 1)
        b.settings["store ceiling blocks"] = probe_blocks
        log(rank, f"store ceiling: {ceiling:.1f} GB/s per rank of plain stores to {world - 1} peer(s) at once, "
                  f"{probe_blocks} blocks (logical ceiling {ceiling * world / (world - 1):.1f} GB/s)")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if "ht" in configs:
        symm["HT"] = b.run_config("HT", 4096, ["BF16", "FP8"],
                                  launch_grid("ht", world, args.max_sms, sm_count, max_warps, args.ht_grid))
    if "ll" in configs:
        symm["LL"] = b.run_config("LL", 128, ["FP8"],
                                  launch_grid("ll", world, args.max_sms, sm_count, max_warps, args.ll_grid))
    mori.shmem.shmem_finalize()
    if rank == 0:
        linked = world > 1 and not shared
        logical_ceiling = ceiling * world / (world - 1) if ceiling else None
        print_results(b.rows, symm, setup, linked=linked, four_gpus=world == 4 and not shared,
                      logical_ceiling=logical_ceiling)
        if args.json:
            settings = dict(b.settings, torch=torch.__version__, mori=getattr(mori, "__version__", "?"),
                            gpus_used=n_used, ht_sm_cap=args.max_sms, quick=bool(args.quick))
            doc = json_document(b.rows, ranks=world, linked=linked, shared=shared, gpu=gpu_name, gpus=n_used,
                                sm_count=sm_count, settings=settings, argv=args.argv, launcher=args.launcher)
            BJ.write(args.json, doc)
            print(f"wrote {sum(len(r['records']) for r in doc['runs'])} records to {args.json}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=0, help="ranks to spawn when not under torchrun (default: all GPUs)")
    p.add_argument("--configs", default="ht,ll")
    p.add_argument("--max-sms", type=int, default=24, help="largest block count tried for HT")
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument("--ht-grid", default="", help='HT sweep "blocks,...:warps,..." (e.g. "20,24:16")')
    p.add_argument("--ll-grid", default="", help='LL sweep "blocks,...:warps,..." (e.g. "64,132:4,8")')
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--json", metavar="FILE", default="",
                   help="also write every figure with its settings as JSON (tools/bench/bench_json.py); "
                        "tools/bench/report.py makes markdown tables of such files, plot.py charts")
    p.add_argument("--compare", choices=["deep_ep"], default=None,
                   help="also run DeepEP's Buffer on the same shapes and inputs in the same group "
                        "(needs deep_ep installed: tools/bench/build_deep_ep.sh)")
    p.add_argument("--kernel-baselines", action="store_true",
                   help="also time the library's grid copy of each phase's bytes on its best launch, and "
                        "an empty kernel (one-rank kernel efficiency; the last column of a [copy kernel] "
                        "row is copy time / phase time)")
    args = p.parse_args()
    args.argv = list(sys.argv)  # the command line as typed, for --json
    args.launcher = (f"torchrun --nproc-per-node={os.environ.get('LOCAL_WORLD_SIZE', os.environ['WORLD_SIZE'])}"
                     if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ else "python3")
    if args.json:
        args.json = os.path.abspath(args.json)
    nproc = args.nproc
    if nproc <= 0 and "LOCAL_RANK" not in os.environ:
        import torch

        nproc = torch.cuda.device_count()
        if nproc < 1:
            print("SKIPPED: needs a GPU, found none")
            return 77
    return U.launch(worker, nproc, args)


if __name__ == "__main__":
    sys.exit(main())
