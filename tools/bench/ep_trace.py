#!/usr/bin/env python3
"""Per-block phase trace of the IntraNode EP kernels on the LL config (where does combine time go?).

    torchrun --nproc_per_node=4 tools/bench/ep_trace.py [--shapes 16x16,64x16,64x8,132x8,132x16]
    python3 tools/bench/ep_trace.py --nproc 2 [--perfetto DIR]   # DIR: Chrome-trace JSON per run and rank

LL config as tools/bench/ep_bench.py: 128 tokens/rank (--tokens 4096: the HT config), hidden 7168,
top-8 of 256, BF16 zero-copy combine with weights, FP8 dispatch with scales. Tracing (the op's
enable_trace; record layout in include/mori/ops/dispatch_combine/trace.hpp, read through
mori.ops.trace.layout()) makes thread 0 of every block stamp globaltimer + clock64 at
kernel entry and at the end of each phase:
  P1 = entry -> ready sent      P2 = ready sent -> every peer's ready seen (+ barrier)
  P3 = reduce                   F  = per-block release fence (before the grid counter)
  A  = grid-counter atomic      tail = last block: done signals + epoch
The push combine (small-batch configs, MORI_EP_COMBINE_PUSH=1, the default there) stamps the same
slots with other meanings: P1 = push this rank's rows to their tokens' PEs (+ fence + counter add),
P2 = wait until every PE's rows for our tokens have arrived, P3 = reduce from local memory, F = 0,
tail = check and reset the arrival counters + epoch.
Modes per launch shape: "iso" (one launch after a barrier + sync, no predecessor), "eager"
(back-to-back plain launches) and "graph" (CUDA graph of 50 combines replayed as the bench does,
event-timed per replay: "bench us" = what ep_bench reports).

Dispatch phases: scan (bitmap + prefix), announce, cwait (counts of lower PEs), copy, publish
(fence + arrived add), recv (block 0), ctr; and, apart, the copy time of the local-copy blocks and of
the blocks streaming to peers, with the time (from launch start) by which each group had published.

Per line (medians over launches x ranks; "max" = max over them): period (start-to-start of
consecutive launches on one rank), span (first entry -> last exit), launch skew (entry spread
over blocks), phase durations (median / max over blocks, from clock64), "exit slope" (ns per
block of the exit staircase, exits sorted by arrival at the grid counter), "P2 late" (own ready
sent -> last peer's ready seen, per rank) and the cross-rank ready offsets (globaltimer corrected
by an NTP-style offset estimate from the ready signals themselves). The verdict table (last)
names the component that grows with the block count (ns per added block).
"""

import argparse
import os
import statistics
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "tests", "ops"))
sys.path.insert(0, os.path.join(_ROOT, "tests", "python"))
import ep_test_utils as U  # noqa: E402
from test_ep_kernel_model import block_role  # noqa: E402  (the model of EpDispatchBlockRole)

HIDDEN, TOPK, EXPERTS, SCALE_DIM = 7168, 8, 256, 56
T = 128  # tokens per rank (--tokens)
SLOTS = 64
# The record layout (word indices, stamps) is the library's: mori.ops.trace.layout(), from the C++
# constants of include/mori/ops/dispatch_combine/trace.hpp; load_layout() fills these.
WORDS = MAGIC = NPEER = G0 = C0 = EPOCH = BLOCK = SMID = ORDER = GRID = PARTS = MAGW = SEEN = ENTRY = None
LOCAL_BLOCKS = 0  # MORI_EP_DISPATCH_LOCAL_BLOCKS as the library reads it (load_layout)
STAMP = {}  # (kind code: 0 combine, 1 dispatch; phase name) -> the stamp that ends the phase
PHASES = {}  # kind code -> [(stamp, phase name)] in the order a block passes them
# this tool's short names of the phases
LABELS = {0: {"send": "P1", "wait_peers": "P2", "reduce": "P3", "fence": "F", "grid_counter": "A"},
          1: {"scan": "scan", "announce": "announce", "count_wait": "cwait", "copy": "copy", "publish": "publish",
              "receive": "recv", "grid_counter": "ctr"}}


def load_layout(mori):
    global WORDS, MAGIC, NPEER, G0, C0, EPOCH, BLOCK, SMID, ORDER, GRID, PARTS, MAGW, SEEN, ENTRY, LOCAL_BLOCKS
    LOCAL_BLOCKS = next(int(e["value"]) for e in mori._C.env_entries() if e["name"] == "MORI_EP_DISPATCH_LOCAL_BLOCKS")
    L = mori.ops.trace.layout()
    WORDS, MAGIC, NPEER, ENTRY = L["words"], L["magic"], L["peers"], L["entry_stamp"]
    G0, C0, SEEN = L["word_time"], L["word_cycles"], L["word_peer_ready"]
    EPOCH, BLOCK, SMID, ORDER = L["word_epoch"], L["word_block"], L["word_sm"], L["word_arrival"]
    GRID, PARTS, MAGW = L["word_grid"], L["word_parts"], L["word_magic"]
    for name, code in L["kinds"].items():
        PHASES[code] = L["phases"][name]
        for stamp, phase in L["phases"][name]:
            STAMP[(code, phase)] = stamp


def phase_spans(kind):
    """(label, from stamp, to stamp) of the kind's phases in order (the combine tail apart)."""
    out, prev = [], ENTRY
    for stamp, phase in PHASES[kind]:
        if phase not in LABELS[kind]:
            continue  # the combine tail, and InterNodeV1's phases (IntraNode never stamps them)
        out.append((LABELS[kind][phase], prev, stamp))
        prev = stamp
    return out


def log(rank, *a):
    if rank == 0:
        print(*a, flush=True)


def med(v):
    v = [x for x in v if x is not None]
    return statistics.median(v) if v else float("nan")


def mx(v):
    v = [x for x in v if x is not None]
    return max(v) if v else float("nan")


def slope(xs, ys):
    n = len(xs)
    if n < 2:
        return float("nan")
    mxv, myv = sum(xs) / n, sum(ys) / n
    den = sum((x - mxv) ** 2 for x in xs)
    return sum((x - mxv) * (y - myv) for x, y in zip(xs, ys)) / den if den else float("nan")


def launches_from(buf, kind, nb_max, grid):
    """Complete launches of `grid` blocks in the trace buffer: {epoch: [record rows (lists)]}."""
    a = buf.view(2, SLOTS, nb_max, WORDS)[kind].cpu().tolist()
    out = {}
    for s in range(SLOTS):
        recs = [r for r in a[s][:grid] if (r[MAGW] & 0xFFFFFFFF) == MAGIC and r[GRID] == grid]
        if len(recs) == grid and len({r[EPOCH] for r in recs}) == 1:
            out[recs[0][EPOCH]] = recs
    return out


def analyse_launch(recs, W, kind, me=0):
    """Per-launch metrics of one rank (times in ns; cycle deltas converted with a per-launch rate)."""
    st = lambda name: STAMP[(kind, name)]  # noqa: E731
    cnt = st("grid_counter")
    rates = [(r[C0 + cnt] - r[C0 + ENTRY]) / (r[G0 + cnt] - r[G0 + ENTRY]) for r in recs
             if r[G0 + cnt] - r[G0 + ENTRY] > 3000 and r[C0 + cnt] > r[C0 + ENTRY]]
    rate = med(rates) if rates else 1.8  # cycles per ns

    def dur(r, i, j):
        if r[C0 + i] == 0 or r[C0 + j] == 0:
            return None
        return (r[C0 + j] - r[C0 + i]) / rate

    entry = [r[G0 + ENTRY] for r in recs]
    exit_ = [max(r[G0 + cnt], r[G0 + st("tail")] if kind == 0 else 0) for r in recs]
    m = dict(start=min(entry), end=max(exit_), span=max(exit_) - min(entry), skew=max(entry) - min(entry), rate=rate)
    for nm, i, j in phase_spans(kind):
        d = [dur(r, i, j) for r in recs]
        m[nm] = (med(d), mx(d))
    last = [r for r in recs if kind == 0 and r[G0 + st("tail")] != 0]
    m["tail"] = dur(last[0], cnt, st("tail")) if last else None
    order = [r[ORDER] for r in recs]
    if all(o > 0 for o in order):
        m["exit_slope"] = slope(order, [r[G0 + cnt] for r in recs])
        m["fence_slope"] = slope(order, [dur(r, st("reduce"), st("fence")) or 0.0 for r in recs]) \
            if kind == 0 else float("nan")
        # time from the first to the last block reaching the counter, per block
        m["ctr_spread"] = max(r[G0 + cnt] for r in recs) - min(r[G0 + cnt] for r in recs)
    else:
        m["exit_slope"] = m["fence_slope"] = m["ctr_spread"] = float("nan")
    m["smids"] = len({r[SMID] for r in recs})
    if kind == 0:
        b0 = [r for r in recs if r[BLOCK] == 0][0]
        m["issue"] = b0[G0 + st("send")]  # block 0: ready sent (zero-copy input)
        m["seen_min"] = [min(r[SEEN + p] for r in recs) if p < NPEER else 0 for p in range(min(W, NPEER))]
        m["seen_max"] = [max(r[SEEN + p] for r in recs) if p < NPEER else 0 for p in range(min(W, NPEER))]
        # The push combine (small batches) stamps no peer-ready words: no P2 late then.
        if m["seen_min"] and all(t != 0 for t in m["seen_min"]):
            late = [m["seen_min"][p] - m["issue"] for p in range(len(m["seen_min"]))]
            m["P2late"] = max(late)
            m["last_peer"] = late.index(max(late))
        else:
            m["P2late"] = None
            m["last_peer"] = "-"
        m["parts"] = recs[0][PARTS]
    else:
        # local-copy blocks vs blocks streaming to peers: copy time and when their rows were published
        nb = len(recs)
        for grp, want in (("L", True), ("R", False)):
            g = [r for r in recs if (block_role(r[BLOCK], nb, W, me, LOCAL_BLOCKS)[0] == me) == want]
            d = [dur(r, st("count_wait"), st("copy")) for r in g]
            m["copy" + grp] = (med(d), mx(d))
            pub = st("publish")
            m["pub" + grp] = mx([r[G0 + pub] - m["start"] for r in g if r[G0 + pub]])
    return m


class Tracer:
    def __init__(self, rank, W, local_rank, args):
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.rank, self.W, self.args = torch, dist, rank, W, args
        self.dev = torch.device("cuda", local_rank)
        self.mori = U.import_mori()
        load_layout(self.mori)
        self.fp8 = U.fp8_dtype(torch)
        self.nsm = torch.cuda.get_device_properties(local_rank).multi_processor_count
        cfg = self.mori.ops.EpDispatchCombineConfig(
            rank=rank, world_size=W, hidden_dim=HIDDEN, scale_dim=SCALE_DIM, scale_type_size=4, max_token_type_size=2,
            max_num_inp_token_per_rank=T, num_experts_per_rank=EXPERTS // W, num_experts_per_token=TOPK,
            use_external_inp_buf=False)
        self.op = self.mori.ops.EpDispatchCombineOp(cfg, check_inputs=False)
        self.h = self.op._handle
        g = torch.Generator(device=self.dev)
        g.manual_seed(1000 + rank)
        self.x = torch.randn((T, HIDDEN), generator=g, device=self.dev).to(torch.bfloat16)
        scores = torch.randn((T, EXPERTS), generator=g, device=self.dev).abs() + 1
        self.idx = torch.topk(scores, TOPK, dim=-1, largest=True, sorted=False)[1].to(torch.int32)
        self.w = torch.rand((T, TOPK), generator=g, device=self.dev)
        self.scales = torch.rand((T, SCALE_DIM), generator=g, device=self.dev)
        self.x8 = self.x.float().clamp(-448, 448).to(self.fp8) if self.fp8 is not None else None
        outs = self.op.dispatch(self.x, self.w, None, self.idx)
        self.cbuf = self.op.get_registered_combine_input_buffer(torch.bfloat16, HIDDEN)
        self.cbuf.copy_(outs[0])
        self.wbuf = self.op.get_registered_combine_weights_buffer()
        self.wbuf.copy_(outs[1])
        torch.cuda.synchronize()
        dist.barrier()

    def set_trace(self, on):
        """The op's switch: on = a fresh buffer of SLOTS launches per kind, every SM's block."""
        self.torch.cuda.synchronize()
        if on:
            self.op.enable_trace(slots=SLOTS, max_blocks=self.nsm)
        else:
            self.op.disable_trace()
        self.torch.cuda.synchronize()

    @property
    def buf(self):
        return self.op._trace.buffer

    def dump(self, kind, label):
        """--perfetto DIR: this rank's Chrome-trace JSON of every launch of the last run."""
        name = f"ep_trace_{'combine' if kind == 0 else 'dispatch'}_{label.replace(' ', '_')}_rank{{rank}}.json"
        path = os.path.join(self.args.perfetto, name)
        return (self.op.dump_combine_trace if kind == 0 else self.op.dump_dispatch_trace)(path, launches="all")

    def fn(self, kind, b, w):
        if kind == 0:
            return lambda: self.op.combine(self.cbuf, self.wbuf, self.idx, block_num=b, warp_per_block=w)
        if self.x8 is not None:
            return lambda: self.op.dispatch(self.x8, self.w, self.scales, self.idx, block_num=b, warp_per_block=w)
        return lambda: self.op.dispatch(self.x, self.w, None, self.idx, block_num=b, warp_per_block=w)

    def run(self, kind, b, w, mode):
        """Runs one mode with tracing; returns (per-launch metrics of this rank, bench-like us)."""
        torch, dist = self.torch, self.dist
        f = self.fn(kind, b, w)
        grid = self.h.resolve_launch(T, b, w, kind == 1)[0]
        self.set_trace(True)
        bench_us = None
        if mode == "iso":
            for _ in range(5):
                torch.cuda.synchronize()
                dist.barrier()
                f()
            torch.cuda.synchronize()
        elif mode == "eager":
            dist.barrier()
            for _ in range(10):
                f()
            torch.cuda.synchronize()
        else:
            n_inner = 50 if kind == 0 else 20
            f()
            torch.cuda.synchronize()
            dist.barrier()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(n_inner):
                    f()
            torch.cuda.synchronize()
            times = []
            for _ in range(3):
                dist.barrier()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                graph.replay()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e) * 1e3 / n_inner)
            bench_us = statistics.median(times)
            del graph
        torch.cuda.synchronize()
        self.mori.shmem.shmem_check_device_error()
        launches = launches_from(self.buf, kind, self.nsm, grid)
        self.set_trace(False)
        eps = sorted(launches)
        if mode == "graph":
            eps = eps[-n_inner:]  # the last replay
        ms = []
        for i, ep in enumerate(eps):
            m = analyse_launch(launches[ep], self.W, kind, self.rank)
            m["epoch"] = ep
            m["first"] = mode != "iso" and i == 0  # no predecessor in the stream (replay start)
            if mode != "iso" and i > 0 and eps[i - 1] == ep - 1:
                prev = ms[-1]
                m["period"] = m["start"] - prev["start"]
                m["gap"] = m["start"] - prev["end"]
            ms.append(m)
        return ms, bench_us, grid


def clock_offsets(per_rank, W):
    """NTP-style offset of rank p's globaltimer vs rank 0 from the ready signals: d[r][p] = min over
    launches of (r sees p's ready) - (p sent it) = lat + off[r] - off[p]."""
    eps = set.intersection(*[{m["epoch"] for m in per_rank[r]} for r in range(W)])
    by = [{m["epoch"]: m for m in per_rank[r]} for r in range(W)]
    d = [[None] * W for _ in range(W)]
    for r in range(W):
        for p in range(min(W, NPEER)):
            if p == r:
                continue
            v = [by[r][e]["seen_min"][p] - by[p][e]["issue"] for e in eps]
            d[r][p] = min(v) if v else None
    off = [0.0] * W
    lat = []
    for p in range(1, min(W, NPEER)):
        if d[p][0] is not None and d[0][p] is not None:
            off[p] = (d[p][0] - d[0][p]) / 2.0  # rank p's clock minus rank 0's
            lat.append((d[p][0] + d[0][p]) / 2.0)
    return off, (med(lat) if lat else float("nan")), eps, by


def summarise(label, gathered, W, kind, bench_us):
    """gathered[r] = per-launch metrics of rank r. Returns a dict of headline numbers."""
    allm = [m for r in range(W) for m in gathered[r] if not m["first"]] or \
        [m for r in range(W) for m in gathered[r]]
    s = dict(label=label)
    s["period"] = med([m.get("period") for m in allm])
    s["gap"] = med([m.get("gap") for m in allm])
    s["span"] = med([m["span"] for m in allm])
    s["span_max"] = mx([m["span"] for m in allm])
    s["skew"] = med([m["skew"] for m in allm])
    s["exit_slope"] = med([m["exit_slope"] for m in allm])
    s["ctr_spread"] = med([m["ctr_spread"] for m in allm])
    s["bench"] = bench_us
    names = ("P1", "P2", "P3", "F", "A") if kind == 0 else ("scan", "announce", "cwait", "copy", "publish", "recv", "ctr",
                                                           "copyL", "copyR")
    for nm in names:
        s[nm] = med([m[nm][0] for m in allm])
        s[nm + "_max"] = med([m[nm][1] for m in allm])
    s["tail"] = med([m["tail"] for m in allm])
    if kind == 1:
        s["pubL"] = med([m["pubL"] for m in allm])
        s["pubR"] = med([m["pubR"] for m in allm])
    parts = ""
    if kind == 0:
        s["fence_slope"] = med([m["fence_slope"] for m in allm])
        s["P2late"] = med([m["P2late"] for m in allm])
        s["P2late_max"] = mx([m["P2late"] for m in allm])
        lp = [m["last_peer"] for m in allm]
        s["last_peer"] = max(set(lp), key=lp.count)
        off, lat, eps, by = clock_offsets(gathered, W)
        firsts = {m["epoch"] for m in gathered[0] if m["first"]}
        # cross-rank: spread of corrected ready-send times per launch, and which rank is last
        spreads, lastr = [], []
        for e in eps:
            t = [by[r][e]["issue"] - off[r] for r in range(W)]
            spreads.append(max(t) - min(t))
            lastr.append(t.index(max(t)))
        fs = [max(by[r][e]["issue"] - off[r] for r in range(W)) - min(by[r][e]["issue"] - off[r] for r in range(W))
              for e in firsts if e in eps]
        s["first_spread"] = med(fs) if fs else None  # replay-start skew between ranks
        s["xrank_spread"] = med(spreads)
        s["xrank_spread_max"] = mx(spreads)
        s["xrank_last"] = max(set(lastr), key=lastr.count) if lastr else -1
        s["lat"] = lat
        s["off"] = off
        parts = f" parts {gathered[0][0]['parts']}" if gathered[0] else ""
    s["rate"] = med([m["rate"] for m in allm])
    s["smids"] = med([m["smids"] for m in allm])
    s["n"] = len(allm)
    s["parts"] = parts
    return s


def fmt(v, scale=1e-3, nd=1):
    return "   -  " if v is None or v != v else f"{v * scale:6.{nd}f}"


def print_line(s, kind):
    us = lambda k: fmt(s.get(k))  # noqa: E731
    bench = f"{s['bench']:6.1f}" if s.get("bench") else "   -  "
    if kind == 0:
        print(f"  {s['label']:<26} bench {bench} | period {us('period')} gap {us('gap')} span {us('span')} "
              f"skew {us('skew')} | P1 {us('P1')} P2 {us('P2')}/{us('P2_max')} P3 {us('P3')}/{us('P3_max')} "
              f"F {us('F')}/{us('F_max')} A {us('A')}/{us('A_max')} tail {us('tail')} | exit slope "
              f"{fmt(s['exit_slope'], 1, 0)} ns/blk, fence slope {fmt(s['fence_slope'], 1, 0)} | P2late "
              f"{us('P2late')}/{us('P2late_max')} (peer {s['last_peer']}) xrank ready spread "
              f"{us('xrank_spread')}/{us('xrank_spread_max')} (last rank {s['xrank_last']}) replay-start skew "
              f"{us('first_spread')}", flush=True)
    else:
        print(f"  {s['label']:<26} bench {bench} | period {us('period')} gap {us('gap')} span {us('span')} "
              f"skew {us('skew')} | scan {us('scan')}/{us('scan_max')} announce {us('announce')}/{us('announce_max')} "
              f"cwait {us('cwait')}/{us('cwait_max')} copy {us('copy')}/{us('copy_max')} publish "
              f"{us('publish')}/{us('publish_max')} recv {us('recv')}/{us('recv_max')} ctr {us('ctr')}/{us('ctr_max')} | exit slope "
              f"{fmt(s['exit_slope'], 1, 0)} ns/blk | local-copy blocks: copy {us('copyL')}/{us('copyL_max')} all "
              f"published at {us('pubL')}; peer blocks: copy {us('copyR')}/{us('copyR_max')} published at {us('pubR')}",
              flush=True)


def worker(rank, world, local_rank, args):
    global T
    T = args.tokens
    os.environ.setdefault("MORI_SHMEM_HEAP_SIZE", "4G")
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(local_rank)
    U.init_process_group(dist, "cpu:gloo,cuda:nccl", rank, world)
    tr = mori = None
    try:
        mori = U.import_mori()
        mori.shmem.shmem_torch_process_group_init("default")
        tr = Tracer(rank, world, local_rank, args)
        shapes = []
        for sp in args.shapes.split(","):
            b, _, w = sp.strip().partition("x")
            shapes.append((min(int(b), tr.nsm), int(w)))
        log(rank, f"EP trace: {world} x {torch.cuda.get_device_name(local_rank)} ({tr.nsm} SMs), {T} tok/rank, "
                  f"hidden {HIDDEN}, top-{TOPK}/{EXPERTS}; times in us unless noted; x/y = median/max over blocks "
                  "(median over launches x ranks)")
        summaries = {}
        kinds = ([0] if not args.no_combine else []) + ([1] if not args.no_dispatch else [])
        for kind in kinds:
            log(rank, "== " + ("combine BF16 zero-copy (+weights)" if kind == 0 else "dispatch FP8 (+scales)"))
            modes = [("iso", 0), ("eager", 0), ("graph", 0)]
            for b, w in shapes:
                for mode, flags in modes:
                    ms, bench_us, grid = tr.run(kind, b, w, mode)
                    if args.perfetto:
                        tr.dump(kind, f"{grid}x{w} {mode}")
                    gathered = [None] * world
                    dist.all_gather_object(gathered, ms)
                    bl = [None] * world
                    dist.all_gather_object(bl, bench_us)
                    bu = max(bl) if bl[0] is not None else None
                    label = f"{grid}x{w} {mode}"
                    if rank == 0:
                        if any(not g for g in gathered):
                            print(f"  {label:<26} no complete trace (grid {grid})", flush=True)
                            continue
                        s = summarise(label, gathered, world, kind, bu)
                        summaries[(kind, grid, w, mode, flags)] = s
                        print_line(s, kind)
                if rank == 0 and kind == 0 and (0, grid, w, "graph", 0) in summaries:
                    s = summaries[(0, grid, w, "graph", 0)]
                    print(f"    clocks: rank offsets vs rank 0 (ns) {[round(o) for o in s['off']]}, one-way ready latency "
                          f"~{fmt(s['lat'])} us, {s['smids']:.0f} distinct SMs, clock {s['rate']:.2f} cyc/ns,{s['parts']}",
                          flush=True)
        if rank == 0:
            verdict(summaries, shapes, tr.nsm)
    finally:
        if tr is not None:
            tr.set_trace(False)
            tr.op.close()
        if mori is not None:
            mori.shmem.shmem_finalize()
        dist.barrier()
        dist.destroy_process_group()
    return 0


def verdict(S, shapes, nsm):
    print()
    print("Verdict (combine, graph mode = the bench's timing; ns per added block between the smallest and "
          "largest grid of the same warps, else over all shapes):")
    keys = [(g, w) for (k, g, w, m, f) in S if k == 0 and m == "graph" and f == 0]
    if not keys:
        print("  no data")
        return
    comps = [("bench per call", "bench", 1e3), ("period", "period", 1), ("span", "span", 1),
             ("inter-kernel gap", "gap", 1), ("launch skew", "skew", 1), ("P2 wait max", "P2_max", 1),
             ("P2 late (peer)", "P2late", 1), ("xrank ready spread", "xrank_spread", 1),
             ("replay-start skew", "first_spread", 1), ("P3 reduce max", "P3_max", 1),
             ("fence max", "F_max", 1), ("counter spread", "ctr_spread", 1), ("last-block tail", "tail", 1)]
    small, large = min(keys), max(keys)
    same_w = [k for k in keys if k[1] == large[1]]
    if len(same_w) >= 2:
        small, large = min(same_w), max(same_w)
    hdr = f"| {'component':<20} | " + " | ".join(f"{g}x{w:<3}" for g, w in sorted(keys)) + f" | ns/blk {small[0]}->{large[0]} |"
    print(hdr)
    print("|" + "|".join("-" * len(c) for c in hdr.split("|")[1:-1]) + "|")
    growth = {}
    for name, key, sc in comps:
        vals = {k: S[(0, k[0], k[1], "graph", 0)].get(key) for k in keys}
        row = " | ".join(f"{(v * sc / 1e3 if v is not None and v == v else float('nan')):7.1f}" for v in
                         [vals[k] for k in sorted(keys)])
        a, b = vals[small], vals[large]
        gr = (b - a) * sc / (large[0] - small[0]) if a is not None and b is not None and large[0] != small[0] else float("nan")
        growth[name] = gr
        print(f"| {name:<20} | {row} | {gr:12.0f} |")
    print("(values in us; bench per call = event time of a 50-combine graph replay / 50, max over ranks)")
    cands = {n: g for n, g in growth.items() if n not in ("bench per call", "period", "span") and g == g}
    per_blk = growth.get("bench per call", float("nan"))
    if cands:
        top = max(cands, key=lambda n: cands[n])
        print(f"==> per-call time grows {per_blk:.0f} ns/block; the component that grows most: '{top}' "
              f"({cands[top]:.0f} ns/block).")
        if growth.get("span", 0) == growth.get("span", 0) and per_blk == per_blk and \
                growth.get("span", 0) < 0.5 * per_blk:
            print("==> the kernel span does NOT grow like the bench time: the cost is between kernels "
                  "(gap / launch / cross-rank waiting) or a measurement artifact")
    print("Reading: fence/counter spread or exit slope ~1000 ns/blk = per-block serial tail (sys fence); launch skew "
          "= block scheduling; P2 wait with small P2late = local polling cost, large P2late/xrank spread = waiting "
          "for a late rank (previous replay); P3 = reduce (reading peer rows); gap = between kernels.")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=0, help="ranks to spawn when not under torchrun (default: all GPUs)")
    p.add_argument("--shapes", default="16x16,64x16,64x8,132x8,132x16", help="blocks x warps, comma separated")
    p.add_argument("--no-dispatch", action="store_true")
    p.add_argument("--no-combine", action="store_true")
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank (4096: the HT config)")
    p.add_argument("--perfetto", metavar="DIR", default="",
                   help="also write each run's launches as Chrome-trace JSON per rank into DIR (open in "
                        "https://ui.perfetto.dev; merge ranks with mori.ops.trace.merge_chrome_traces)")
    args = p.parse_args()
    if args.perfetto:
        os.makedirs(args.perfetto, exist_ok=True)
    nproc = args.nproc
    if nproc <= 0 and "LOCAL_RANK" not in os.environ:
        import torch

        nproc = torch.cuda.device_count()
    return U.launch(worker, nproc, args)


if __name__ == "__main__":
    sys.exit(main())
