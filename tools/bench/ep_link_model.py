#!/usr/bin/env python3
"""Modelled link time of one phase of RDMA work requests, from the emulator's trace ring.

Pure Python (no torch, no GPU, no mori): `model_link_time(entries)` takes the trace entries of one
phase, as `mori.shmem.rdma_stats()["trace"]` gives them ({time_ns, qp, qpn, src, dst, opcode,
bytes, wqe_index, outcome}; src, dst, bytes and outcome are read, and qp under protocol
dependencies), in execution order, and returns the modelled time next to the physical floor. Each
rank's emulator traces only the work requests (WRs) its own PE posted: `merge_traces` puts the
ranks' lists into one execution order (by time_ns, which is CLOCK_MONOTONIC and comparable between
the processes of one host; ties by rank, then by position in the rank's list).

Everything this module computes is *modelled*: it is what an idealised network would take for the
WRs the kernels actually posted, not a measurement. GPU-side work (packing, P2P forwarding, the
local sums, kernel launches) costs nothing here; the model starts every PE at time 0.

The rules, exactly (B = bandwidth in bytes per µs = GB/s x 1000; o = per-WR cost in µs; L =
latency in µs; times in µs from 0):

1. WRs whose outcome is not "ok" are skipped (counted in `skipped`): they moved no data. Every
   other WR, whatever its opcode, is one message of `bytes` bytes from `src` to `dst` (a READ's
   or an atomic's reply is not modelled separately; the EP data path posts only WRITEs).
   Zero-byte and inline WRs are modelled the same way: they pay o and L.
2. Each PE has one transmit (TX) and one receive (RX) port. A PE's WRs use its TX port one at a
   time in trace order (FIFO across all of its QPs and peers): WR i of PE s starts at
       start_i = max(txFree_s, ready_i),   txFree_s := start_i + o + bytes_i / B.
3. Dependencies, deps="trace" (conservative happens-before): WR i of PE s may not start before
   every WR j that the trace executed earlier (j < i) and that was delivered to s (dst_j == s,
   loopback included) has arrived:  ready_i = max(arrive_j), 0 when there is none. The trace
   cannot tell which arrivals s actually waited for, so it assumes all earlier ones. An
   emulator records a WR (and its time) right after executing it, and s's reaction to the data
   (poll, post, the emulator picking the WR up) takes far longer, so a direct dependency is
   earlier in the trace and is not missed. Where ranks share a GPU they run in time slices: one
   rank's WRs execute before another's, and this rule turns that order into waits the kernels
   do not have (it serialises the ranks).
3'. Dependencies, deps="protocol" (a `PhaseProtocol` names the kernel type and the phase): WR i
   of PE s waits only for the WRs j < i that the kernel makes its poster wait for within the
   call, read from the kernels; ready_i = max(arrive_j) over them, 0 when there is none. Waits on
   an earlier call (the V1 credit >= k - 1 and landFree >= e - 1, the previous combine's done
   words, the other parity's buffers) are met before the phase starts and are not modelled, nor
   are waits on P2P or local work (free in the model) unless an RDMA arrival reaches them
   through it. WRs are told apart by size and by their predecessor on the same QP (`qp`, per
   src) in the phase: the shmem layer posts a signal right behind its data on one QP, so an
   8-byte WR directly behind a larger WRITE is that WRITE's tail; an 8-byte WR that is the
   first of its QP in the phase, or directly behind another 8-byte WR or the count record, is a
   standalone word (credit, landFree, done). Per kernel type and phase (G = gpu_per_node, Epr =
   experts per rank; "slot" of a remote node as EpV1NodeSlot: (node - myNode - 1) mod N):
   - InterNodeV1LL, both phases: no WR waits. The count record, chunks and tails (dispatch)
     and the partials and landing tails (combine) wait only for P2P work and for buffers of the
     other parity; there is no credit and no landFree.
   - InterNodeV1 dispatch: the count record (8 (2 + G + G Epr) bytes), chunks and tails wait
     for nothing. The credit p -> s waits for every count record delivered to a PE of p's node
     (the bases of the rows p forwards need counts its node-mates relay; a superset, as the bases
     need only the lower PEs' counts) and for every other WR delivered to p by a PE whose
     node's slot is <= s's (p's blocks forward rail peers in slot order, and the last block to
     finish s posts the credit; internode_v1_dispatch.cpp, step 4).
   - InterNodeV1 combine: partials and landing tails wait for nothing. landFree r -> o waits for
     every other WR delivered to r (the last block posts it after every block waited for all
     landing tails; internode_v1_combine.cpp, step 5).
   - InterNode dispatch: count pairs (16 bytes) and histograms (4 Epr bytes) wait for nothing.
     Every other WR from s to d (rows, weights, scales, indices, source positions, tail) waits
     for every count pair delivered to s by a PE below s or by d (the block sending to d waits
     for count(s' -> d) of every s' < s and count(d -> d); a pair's size does not say which d
     it is for, so all pairs from those PEs are waited for: a superset).
   - InterNode combine: returned rows, weights and landing words wait for nothing. A done word
     r -> p waits for every other WR delivered to r (the reduce waited for every landing word)
     and for every other WR r sent in the phase (the quiet before the done words;
     acknowledgements are not modelled, so a WR counts as complete when it has arrived).
     The push combine (InterNode ops of <= 256 tokens per rank; run parameter "push_combine"):
     no WR waits (rows, weights, the tail and "done" are posted together by the send).
   A WR whose size is that of a count record, count pair or histogram is read as one (the
   sizes differ for the standard shapes); the standalone words are checked to be the last WR
   of their QP, at most one per (src, dst), and a trace that breaks this raises ValueError.
   deps="none": no WR waits; only the ports and the per-WR cost remain.
   "none" never exceeds "trace": every start is no later, and each RX port's last arrival only
   grows with its head times. "protocol" is not bounded by "trace" in general: rule 3' waits
   for WRs outside rule 3 in two places (the count records delivered to p's node-mates, the
   quiet's own WRs), and with fewer waits a WR can take an RX port earlier and lengthen a chain
   through it (a list-scheduling anomaly). The tests check protocol <= trace on V1/V1LL-shaped
   traces in time-sliced orders, and show the quiet's case.
4. The first byte of WR i reaches dst's RX port at head_i = start_i + o + L. The RX port serves
   WRs in order of head time (FIFO by arrival; equal head times in trace order), one at a time,
   each for bytes / B:
       rxStart_i = max(rxFree_d, head_i),   arrive_i = rxFree_d := rxStart_i + bytes_i / B.
   So a lone WR arrives at start + o + L + bytes / B, never before its last byte left the TX
   port plus L, and two senders into one receiver share its RX port.
   o + L must be > 0: then every WR's head time is known (it started) before the port serves
   any head at that time, so the tie rule holds exactly.
5. Modelled time = the latest arrive_i (0 with no WR). Floor = max over PEs of max(bytes sent,
   bytes received) / B: no per-WR cost, no latency, no dependencies. Ratio = modelled / floor.

Worked example (B = 50 000 B/µs, o = 0.2, L = 2): one 1 MB WRITE 0 -> 1 starts at 0, leaves TX at
20.2, heads at 2.2, arrives at 22.2; floor 20, ratio 1.11. Add a 1 MB WRITE 2 -> 1: it heads at
2.2 too, and (later in the trace) waits for the RX port until 22.2: arrives at 42.2, floor 40
(PE 1 receives 2 MB). Rule 3 is evaluated with the arrivals of rule 4; `model_link_time`
simulates both in head-time order, so a reader can recompute any table by hand, WR by WR.

Worked example of rule 3' (same parameters): the trace [1 MB 0 -> 1, 1 MB 1 -> 0], two ranks
of one GPU whose time slices ran rank 0 first. Rule 3 makes 1's WRITE wait for 0's arrival:
start 22.2, head 24.4, arrive 44.4; modelled 44.4. Under deps="protocol" for InterNodeV1LL (or
deps="none") neither waits: both start at 0 and arrive at 22.2; modelled 22.2, floor 20.

Defaults: 50 GB/s (400 Gb/s) per port, 2 µs latency, 0.2 µs per WR (a 400 Gb/s NIC per GPU).

As a command, it re-models a trace that `ep_internode_bench.py --save-trace` wrote:

    python3 tools/bench/ep_link_model.py TRACE.json [--deps both|protocol|trace|none] \\
        [--link-gbps G] [--link-latency-us L] [--link-per-wr-us O]

and prints the bench's table (the link parameters default to the run's).
"""

import argparse
import bisect
import heapq
import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field

DEFAULT_GBPS = 50.0
DEFAULT_LATENCY_US = 2.0
DEFAULT_PER_WR_US = 0.2

DEPS = ("trace", "protocol", "none")
KERNEL_TYPES = ("InterNode", "InterNodeV1", "InterNodeV1LL")
SAVE_FORMAT = "mori-ep-link-trace"
SAVE_VERSION = 1
SAVE_COLUMNS = ("time_ns", "src", "dst", "qp", "opcode", "bytes", "outcome")


@dataclass
class PeLink:
    """One PE's share of a modelled phase (bytes and µs)."""

    sent: int = 0
    received: int = 0
    wrs: int = 0
    tx_busy_us: float = 0.0
    rx_busy_us: float = 0.0
    last_arrival_us: float = 0.0  # latest arrival of a WR this PE received


@dataclass
class LinkModelResult:
    """Modelled time of one phase (see the module docstring for the rules)."""

    modelled_us: float
    floor_us: float
    wrs: int
    bytes: int
    skipped: int
    gbps: float
    latency_us: float
    per_wr_us: float
    pes: dict = field(default_factory=dict)  # pe -> PeLink
    arrive_us: list = field(default_factory=list)  # per modelled WR, in trace order
    deps: str = "trace"  # "trace", "none", or "protocol: <kernel type> <phase>"
    waiting: int = 0  # WRs with at least one dependency under rule 3' (0 under "trace")

    @property
    def ratio(self):
        return self.modelled_us / self.floor_us if self.floor_us > 0 else float("nan")


def merge_traces(traces):
    """One execution order from per-rank trace lists (each oldest first): sorted by time_ns, ties
    by the list's position in `traces`, then by the entry's position in its list."""
    keyed = [(int(e["time_ns"]), r, k, e) for r, lst in enumerate(traces) for k, e in enumerate(lst)]
    keyed.sort(key=lambda t: t[:3])
    return [t[3] for t in keyed]


@dataclass(frozen=True)
class PhaseProtocol:
    """What the WRs of one phase wait for within the call (rule 3' of the module docstring)."""

    kernel_type: str  # "InterNode", "InterNodeV1" or "InterNodeV1LL"
    phase: str  # "dispatch" or "combine"
    world_size: int
    gpu_per_node: int
    experts_per_rank: int
    push_combine: bool = False  # InterNode: the op combines by pushing (no WR of it waits)

    def __post_init__(self):
        if self.kernel_type not in KERNEL_TYPES or self.phase not in ("dispatch", "combine"):
            raise ValueError(f"link model: no protocol for kernel type {self.kernel_type!r}, phase {self.phase!r}")
        if not (self.gpu_per_node >= 1 and self.world_size >= self.gpu_per_node
                and self.world_size % self.gpu_per_node == 0 and self.experts_per_rank >= 1):
            raise ValueError(f"link model: bad protocol shape (world {self.world_size}, gpu_per_node "
                             f"{self.gpu_per_node}, experts per rank {self.experts_per_rank})")

    @property
    def name(self):
        return f"{self.kernel_type} {self.phase}"

    @property
    def count_record_bytes(self):
        """InterNodeV1's count record: 2 + G + G Epr tagged words (layout.hpp EpV1CountWords)."""
        return 8 * (2 + self.gpu_per_node + self.gpu_per_node * self.experts_per_rank)

    @property
    def histogram_bytes(self):
        """InterNode's histogram WRITE: Epr int32 counts."""
        return 4 * self.experts_per_rank

    def describe(self):
        """One line: which WRs wait under rule 3', and for what."""
        k, p = self.kernel_type, self.phase
        if k == "InterNodeV1LL":
            return f"{k}: no WR waits within the call (parity buffers, no credit, no landFree)"
        if k == "InterNode" and p == "combine" and self.push_combine:
            return f"{k} combine (push): no WR waits within the call (parity landings, tail and done posted together)"
        if k == "InterNodeV1" and p == "dispatch":
            return (f"{k} dispatch: only the credits wait (for the rail peers' records and the node's count "
                    f"records)")
        if k == "InterNodeV1":
            return f"{k} combine: only landFree waits (for the partials delivered to its sender)"
        if p == "dispatch":
            return (f"{k} dispatch: rows wait for the count pairs of the lower PEs and of the destination; "
                    f"count pairs and histograms wait for nothing")
        return f"{k} combine: only the done words wait (for the returned rows and the sender's own WRITEs)"

    def waits(self, wrs):
        """For each WR of `wrs` (the phase's modelled WRs, trace order): the sorted indices j < i
        of the WRs it waits for under rule 3'. ValueError where the trace does not have the
        structure the rule reads (standalone words not last on their QP, or two per pair)."""
        n = len(wrs)
        if self.kernel_type == "InterNodeV1LL" or (self.kernel_type == "InterNode" and self.phase == "combine"
                                                   and self.push_combine):
            return [[] for _ in range(n)]
        src = [int(e["src"]) for e in wrs]
        dst = [int(e["dst"]) for e in wrs]
        nb = [int(e["bytes"]) for e in wrs]
        G = self.gpu_per_node
        node = lambda pe: pe // G  # noqa: E731
        waits = [[] for _ in range(n)]
        if self.kernel_type == "InterNode" and self.phase == "dispatch":
            pair = [b == 16 for b in nb]
            hist = [b == self.histogram_bytes and not pair[i] for i, b in enumerate(nb)]
            pairs_to = defaultdict(list)  # pe -> count pairs delivered to it, trace order
            for j in range(n):
                if pair[j]:
                    pairs_to[dst[j]].append(j)
            for i in range(n):
                if not (pair[i] or hist[i]):
                    s, d = src[i], dst[i]
                    waits[i] = [j for j in pairs_to[s] if j < i and (src[j] < s or src[j] == d)]
            return waits
        if any("qp" not in e for e in wrs):
            raise ValueError(f"link model: the {self.name} protocol needs each trace entry's qp")
        count = [self.kernel_type == "InterNodeV1" and self.phase == "dispatch" and b == self.count_record_bytes
                 for b in nb]
        standalone = self._standalone_words(wrs, nb, count)
        if self.kernel_type == "InterNodeV1" and self.phase == "dispatch":
            N = self.world_size // G
            slot = lambda p, q: (node(q) - node(p) - 1) % N  # noqa: E731
            for i in (i for i in range(n) if standalone[i]):
                p, s = src[i], dst[i]
                waits[i] = [j for j in range(i) if (count[j] and node(dst[j]) == node(p)) or
                            (dst[j] == p and not standalone[j] and node(src[j]) != node(p)
                             and slot(p, src[j]) <= slot(p, s))]
        else:  # InterNodeV1 combine (landFree), InterNode combine (done words)
            own = self.kernel_type == "InterNode"
            for i in (i for i in range(n) if standalone[i]):
                r = src[i]
                waits[i] = [j for j in range(i) if not standalone[j] and (dst[j] == r or (own and src[j] == r))]
        return waits

    def _standalone_words(self, wrs, nb, count):
        """8-byte WRs not directly behind a data WRITE on their QP (module docstring, rule 3'),
        checked: each is the last WR of its QP in the phase, at most one per (src, dst)."""
        n = len(wrs)
        last = {}
        pred = [-1] * n
        has_next = [False] * n
        for i, e in enumerate(wrs):
            key = (int(e["src"]), int(e["qp"]))
            pred[i] = last.get(key, -1)
            if pred[i] >= 0:
                has_next[pred[i]] = True
            last[key] = i
        word = [nb[i] == 8 and (pred[i] < 0 or nb[pred[i]] == 8 or count[pred[i]]) for i in range(n)]
        seen = set()
        for i in (i for i in range(n) if word[i]):
            pair = (int(wrs[i]["src"]), int(wrs[i]["dst"]))
            if has_next[i] or pair in seen:
                what = "is not the last WR of its QP" if has_next[i] else "is the second one of its pair"
                raise ValueError(f"link model: the trace does not have the {self.name} structure: the standalone "
                                 f"8-byte word {pair[0]} -> {pair[1]} (entry {i}) {what}")
            seen.add(pair)
        return word


def model_link_time(entries, gbps=DEFAULT_GBPS, latency_us=DEFAULT_LATENCY_US, per_wr_us=DEFAULT_PER_WR_US,
                    deps="trace", protocol=None):
    """Modelled link time and floor of the WRs `entries` (trace dicts in execution order).
    deps: "trace" (rule 3), "protocol" (rule 3', `protocol` a PhaseProtocol, or any object with
    `waits(wrs)` and `name`) or "none"."""
    if not (gbps > 0 and latency_us >= 0 and per_wr_us >= 0 and latency_us + per_wr_us > 0):
        raise ValueError(f"link model: need gbps > 0, latency >= 0, per-WR cost >= 0 and latency + per-WR cost "
                         f"> 0 (got {gbps}, {latency_us}, {per_wr_us})")
    if deps not in DEPS:
        raise ValueError(f"link model: deps must be one of {DEPS} (got {deps!r})")
    if deps == "protocol" and protocol is None:
        raise ValueError('link model: deps="protocol" needs the phase\'s protocol')
    bw = gbps * 1e3  # bytes per µs
    wrs = [e for e in entries if e.get("outcome", "ok") == "ok"]
    skipped = len(entries) - len(wrs)
    n = len(wrs)
    src = [int(e["src"]) for e in wrs]
    dst = [int(e["dst"]) for e in wrs]
    nbytes = [int(e["bytes"]) for e in wrs]
    waits = None
    if deps == "protocol":
        waits = [sorted(set(w)) for w in protocol.waits(wrs)]
        if len(waits) != n or any(j < 0 or j >= i for i, w in enumerate(waits) for j in w):
            raise ValueError("link model: protocol waits must name earlier WRs of the phase")
    elif deps == "none":
        waits = [[] for _ in range(n)]

    pes = defaultdict(PeLink)
    txq = defaultdict(list)  # pe -> its WRs in trace order
    incoming = defaultdict(list)  # pe -> WRs delivered to it, in trace order
    for i in range(n):
        s, d, b = src[i], dst[i], nbytes[i]
        txq[s].append(i)
        incoming[d].append(i)
        pes[s].sent += b
        pes[s].wrs += 1
        pes[s].tx_busy_us += per_wr_us + b / bw
        pes[d].received += b
        pes[d].rx_busy_us += b / bw

    if waits is None:
        # rule 3: need[i] = how many of the WRs delivered to src[i] come earlier in the trace
        need = [bisect.bisect_left(incoming[src[i]], i) for i in range(n)]
        done = defaultdict(int)  # pe -> length of the prefix of incoming[pe] that has arrived
        done_max = defaultdict(lambda: [0.0])  # pe -> max arrival over each such prefix length

        def ready(i):
            s = src[i]
            return done_max[s][need[i]] if done[s] >= need[i] else None
    else:
        # rule 3': pending[i] = dependencies of i not yet arrived; ready_at[i] = the latest arrived
        pending = [len(w) for w in waits]
        ready_at = [0.0] * n
        dependents = defaultdict(list)
        for i, w in enumerate(waits):
            for j in w:
                dependents[j].append(i)

        def ready(i):
            return ready_at[i] if pending[i] == 0 else None

    arrive = [math.nan] * n
    tx_free = defaultdict(float)
    rx_free = defaultdict(float)
    next_tx = defaultdict(int)  # pe -> position in txq of its next WR to start
    events = []  # (time, kind, trace index): kind 0 = head at the RX port, 1 = arrival

    def start_ready(s):
        q = txq[s]
        while next_tx[s] < len(q):
            i = q[next_tx[s]]
            r = ready(i)
            if r is None:
                return
            start = max(tx_free[s], r)
            tx_free[s] = start + per_wr_us + nbytes[i] / bw
            heapq.heappush(events, (start + per_wr_us + latency_us, 0, i))
            next_tx[s] += 1

    for s in sorted(txq):
        start_ready(s)
    while events:
        t, kind, i = heapq.heappop(events)
        d = dst[i]
        if kind == 0:
            rx_free[d] = max(rx_free[d], t) + nbytes[i] / bw
            arrive[i] = rx_free[d]
            heapq.heappush(events, (arrive[i], 1, i))
            continue
        if waits is None:
            inc, pm = incoming[d], done_max[d]
            while done[d] < len(inc) and not math.isnan(arrive[inc[done[d]]]) and arrive[inc[done[d]]] <= t:
                pm.append(max(pm[-1], arrive[inc[done[d]]]))
                done[d] += 1
            start_ready(d)
            continue
        for k in dependents[i]:
            pending[k] -= 1
            ready_at[k] = max(ready_at[k], t)
            if pending[k] == 0:
                start_ready(src[k])
    if any(math.isnan(a) for a in arrive):  # cannot happen: every dependency points earlier
        raise RuntimeError("link model: a work request never started")

    for i in range(n):
        pes[dst[i]].last_arrival_us = max(pes[dst[i]].last_arrival_us, arrive[i])
    floor = max((max(p.sent, p.received) for p in pes.values()), default=0) / bw
    label = f"protocol: {protocol.name}" if deps == "protocol" else deps
    return LinkModelResult(modelled_us=max(arrive, default=0.0), floor_us=floor, wrs=n, bytes=sum(nbytes),
                           skipped=skipped, gbps=gbps, latency_us=latency_us, per_wr_us=per_wr_us,
                           pes=dict(pes), arrive_us=arrive, deps=label,
                           waiting=sum(1 for w in waits if w) if deps == "protocol" else 0)


def model_phases(phases, deps="trace", protocols=None, **params):
    """{phase name: entries} -> {phase name: LinkModelResult}, same parameters for each;
    deps="protocol" takes each phase's protocol from `protocols` {phase name: PhaseProtocol}."""
    return {name: model_link_time(entries, deps=deps, protocol=(protocols or {}).get(name), **params)
            for name, entries in phases.items()}


def _deps_words(deps):
    return {"trace": "dependencies from the trace (rule 3)", "none": "no dependencies",
            "protocol": "the kernels' own dependencies (rule 3')"}[deps.split(":")[0]]


def format_table(results, title=""):
    """Lines of a table of {phase: LinkModelResult} (one dependency mode), every figure labelled
    modelled."""
    lines = []
    if results:
        r0 = next(iter(results.values()))
        lines.append(f"{title}modelled link time (not measured): per PE one TX and one RX port at {r0.gbps:g} GB/s, "
                     f"latency {r0.latency_us:g} us, {r0.per_wr_us:g} us per work request, {_deps_words(r0.deps)}; "
                     f"floor = max over PEs of max(bytes sent, received) / bandwidth")
    lines.append(f"{'phase':<20} {'modelled us':>12} {'floor us':>10} {'modelled/floor':>14} {'WRs':>7} "
                 f"{'bytes':>14} {'busiest TX us':>13}")
    for name, r in results.items():
        busiest = max((p.tx_busy_us for p in r.pes.values()), default=0.0)
        lines.append(f"{name:<20} {r.modelled_us:>12.1f} {r.floor_us:>10.1f} {r.ratio:>14.3f} {r.wrs:>7} "
                     f"{r.bytes:>14} {busiest:>13.1f}")
    return lines


# ---- the design targets and whole runs (the bench's table, saved traces) ----------------------

TARGET_TEXT = ("targets at 2 x 8 (EP16), standard shapes (hidden 7168, top-8 of 256; HT 4096, "
               "LL 128 tokens/rank): InterNodeV1 phases modelled/floor <= 1.15; InterNodeV1LL dispatch <= 34 us "
               "and combine <= 52 us modelled")


def design_target(params, phase):
    """("ratio", 1.15) or ("us", limit) where the node-deduplicated kernels' design sets a target
    for this run and phase
    ("dispatch" or "combine"), else None."""
    G, W = params.get("gpu_per_node"), params.get("world_size")
    shape = (params.get("hidden", 7168), params.get("topk", 8), params.get("experts", 256))
    if (W, G) != (16, 8) or shape != (7168, 8, 256):
        return None
    if params.get("kernel_type") == "InterNodeV1" and params.get("tokens") == 4096:
        return ("ratio", 1.15)
    if params.get("kernel_type") == "InterNodeV1LL" and params.get("tokens") == 128:
        return ("us", 34.0 if phase == "dispatch" else 52.0)
    return None


def _target_cell(target, r):
    if target is None or r is None:
        return "-"
    kind, limit = target
    value = r.ratio if kind == "ratio" else r.modelled_us
    text = f"<= {limit:g}" + (" us" if kind == "us" else "x")
    return f"{text}: {'met' if value <= limit else 'NOT met'}"


def run_protocol(params, phase):
    """The PhaseProtocol of one phase ({"kind": "dispatch"|"combine", ...}) of a run."""
    return PhaseProtocol(kernel_type=params["kernel_type"], phase=phase["kind"], world_size=params["world_size"],
                         gpu_per_node=params["gpu_per_node"], experts_per_rank=params["experts_per_rank"],
                         push_combine=bool(params.get("push_combine", False)))


def run_link(params, gbps=None, latency_us=None, per_wr_us=None):
    """The link parameters: the given ones, else the run's, else the defaults."""
    pick = lambda v, k, dflt: v if v is not None else params.get(k, dflt)  # noqa: E731
    return dict(gbps=pick(gbps, "link_gbps", DEFAULT_GBPS), latency_us=pick(latency_us, "link_latency_us",
                DEFAULT_LATENCY_US), per_wr_us=pick(per_wr_us, "link_per_wr_us", DEFAULT_PER_WR_US))


def run_table(run, deps="both", gbps=None, latency_us=None, per_wr_us=None):
    """Lines of the table of a run ({"params", "phases": [{"name", "kind", "entries" or None}]}):
    deps="both" gives the protocol figures (headline, with the design targets) and the trace-order
    bound side by side; "protocol", "trace" or "none" one table of that mode."""
    params = run["params"]
    link = run_link(params, gbps, latency_us, per_wr_us)
    W, G = params["world_size"], params["gpu_per_node"]
    title = f"{params['kernel_type']}, {W // G} nodes x {G}, {params['tokens']} tokens/rank: "
    if deps != "both":
        results, notes = {}, []
        for ph in run["phases"]:
            if ph.get("entries") is None:
                notes.append(f"{ph['name']:<20} modelled: n/a (trace ring overflowed)")
                continue
            try:
                proto = run_protocol(params, ph) if deps == "protocol" else None
                results[ph["name"]] = model_link_time(ph["entries"], deps=deps, protocol=proto, **link)
            except ValueError as err:
                notes.append(f"{ph['name']:<20} modelled: n/a ({err})")
        lines = format_table(results, title=title)
        if deps == "protocol" and run["phases"]:
            lines.insert(1, "rule 3': " + "; ".join(sorted({run_protocol(params, ph).describe()
                                                          for ph in run["phases"]})))
        return lines + notes + [TARGET_TEXT]

    lines = [f"{title}modelled link time (not measured): per PE one TX and one RX port at {link['gbps']:g} GB/s, "
             f"latency {link['latency_us']:g} us, {link['per_wr_us']:g} us per work request; floor = max over PEs "
             f"of max(bytes sent, received) / bandwidth",
             "modelled us: the kernels' own dependencies within the call (ep_link_model.py rule 3': " +
             "; ".join(sorted({run_protocol(params, ph).describe() for ph in run["phases"]})) + ")",
             "trace-order modelled us: every earlier delivery to the poster as a dependency (rule 3, the "
             "conservative bound; ranks that share a GPU are serialised by it)",
             f"{'phase':<20} {'modelled us':>12} {'floor us':>10} {'modelled/floor':>14} {'target':>17} "
             f"{'trace-order modelled us':>23} {'trace-order/floor':>17} {'WRs':>7} {'waiting':>7} {'bytes':>14} "
             f"{'busiest TX us':>13}"]
    notes = []
    for ph in run["phases"]:
        name = ph["name"]
        if ph.get("entries") is None:
            notes.append(f"{name:<20} modelled: n/a (trace ring overflowed)")
            continue
        tr = model_link_time(ph["entries"], deps="trace", **link)
        try:
            pr = model_link_time(ph["entries"], deps="protocol", protocol=run_protocol(params, ph), **link)
        except ValueError as err:
            pr = None
            notes.append(f"{name:<20} protocol: n/a ({err})")
        busiest = max((p.tx_busy_us for p in tr.pes.values()), default=0.0)
        cell = _target_cell(design_target(params, ph["kind"]), pr)
        head = (f"{pr.modelled_us:>12.1f} {pr.floor_us:>10.1f} {pr.ratio:>14.3f}" if pr is not None else
                f"{'n/a':>12} {tr.floor_us:>10.1f} {'n/a':>14}")
        lines.append(f"{name:<20} {head} {cell:>17} {tr.modelled_us:>23.1f} {tr.ratio:>17.3f} {tr.wrs:>7} "
                     f"{pr.waiting if pr is not None else 0:>7} {tr.bytes:>14} {busiest:>13.1f}")
    return lines + notes + [TARGET_TEXT]


def save_run(path, run):
    """Writes a run ({"params", "phases"}) as JSON, each phase's entries as rows of SAVE_COLUMNS."""
    phases = []
    for ph in run["phases"]:
        out = {k: v for k, v in ph.items() if k != "entries"}
        ents = ph.get("entries")
        out["entries"] = None if ents is None else [[e.get(c, "ok" if c == "outcome" else None) for c in SAVE_COLUMNS]
                                                    for e in ents]
        phases.append(out)
    doc = {"format": SAVE_FORMAT, "version": SAVE_VERSION, "columns": list(SAVE_COLUMNS),
           "params": run["params"], "phases": phases}
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")


def load_run(path):
    """A run written by save_run (entries back as dicts, without the absent fields)."""
    with open(path) as f:
        doc = json.load(f)
    if doc.get("format") != SAVE_FORMAT or doc.get("version") != SAVE_VERSION:
        raise ValueError(f"{path}: not a {SAVE_FORMAT} v{SAVE_VERSION} file")
    cols = doc["columns"]
    phases = []
    for ph in doc["phases"]:
        ph = dict(ph)
        if ph.get("entries") is not None:
            ph["entries"] = [{c: v for c, v in zip(cols, row) if v is not None} for row in ph["entries"]]
        phases.append(ph)
    return {"params": doc["params"], "phases": phases}


def main(argv=None):
    p = argparse.ArgumentParser(description="Re-model a trace saved by ep_internode_bench.py --save-trace "
                                            "(rules: this module's docstring).")
    p.add_argument("trace", help="JSON file written by ep_internode_bench.py --save-trace")
    p.add_argument("--deps", default="both", choices=("both",) + DEPS,
                   help="both (default): rule 3' next to rule 3; or one table of that mode")
    p.add_argument("--link-gbps", type=float, help="modelled port bandwidth, GB/s (default: the run's)")
    p.add_argument("--link-latency-us", type=float, help="modelled latency, us (default: the run's)")
    p.add_argument("--link-per-wr-us", type=float, help="modelled cost per work request, us (default: the run's)")
    args = p.parse_args(argv)
    try:
        run = load_run(args.trace)
        lines = run_table(run, deps=args.deps, gbps=args.link_gbps, latency_us=args.link_latency_us,
                          per_wr_us=args.link_per_wr_us)
    except (OSError, ValueError, KeyError) as err:
        print(f"ep_link_model: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
