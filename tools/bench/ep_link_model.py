"""Modelled link time of one phase of RDMA work requests, from the emulator's trace ring.

Pure Python (no torch, no GPU, no mori): `model_link_time(entries)` takes the trace entries of one
phase, as `mori.shmem.rdma_stats()["trace"]` gives them ({time_ns, qp, qpn, src, dst, opcode,
bytes, wqe_index, outcome}; only src, dst, bytes and outcome are read), in execution order, and
returns the modelled time next to the physical floor. Each rank's emulator traces only the work
requests (WRs) its own PE posted: `merge_traces` puts the ranks' lists into one execution order
(by time_ns, which is CLOCK_MONOTONIC and comparable between the processes of one host; ties by
rank, then by position in the rank's list).

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
3. Dependencies from the trace (conservative happens-before): WR i of PE s may not start before
   every WR j that the trace executed earlier (j < i) and that was delivered to s (dst_j == s,
   loopback included) has arrived:  ready_i = max(arrive_j), 0 when there is none. The trace
   cannot tell which arrivals s actually waited for, so it assumes all earlier ones. An
   emulator records a WR (and its time) right after executing it, and s's reaction to the data
   (poll, post, the emulator picking the WR up) takes far longer, so a real dependency is
   earlier in the trace and is not missed.
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

Defaults are issue 14's: 50 GB/s (400 Gb/s) per port, 2 µs latency, 0.2 µs per WR.
"""

import bisect
import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, field

DEFAULT_GBPS = 50.0
DEFAULT_LATENCY_US = 2.0
DEFAULT_PER_WR_US = 0.2


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

    @property
    def ratio(self):
        return self.modelled_us / self.floor_us if self.floor_us > 0 else float("nan")


def merge_traces(traces):
    """One execution order from per-rank trace lists (each oldest first): sorted by time_ns, ties
    by the list's position in `traces`, then by the entry's position in its list."""
    keyed = [(int(e["time_ns"]), r, k, e) for r, lst in enumerate(traces) for k, e in enumerate(lst)]
    keyed.sort(key=lambda t: t[:3])
    return [t[3] for t in keyed]


def model_link_time(entries, gbps=DEFAULT_GBPS, latency_us=DEFAULT_LATENCY_US, per_wr_us=DEFAULT_PER_WR_US):
    """Modelled link time and floor of the WRs `entries` (trace dicts in execution order)."""
    if not (gbps > 0 and latency_us >= 0 and per_wr_us >= 0 and latency_us + per_wr_us > 0):
        raise ValueError(f"link model: need gbps > 0, latency >= 0, per-WR cost >= 0 and latency + per-WR cost "
                         f"> 0 (got {gbps}, {latency_us}, {per_wr_us})")
    bw = gbps * 1e3  # bytes per µs
    wrs = [e for e in entries if e.get("outcome", "ok") == "ok"]
    skipped = len(entries) - len(wrs)
    n = len(wrs)
    src = [int(e["src"]) for e in wrs]
    dst = [int(e["dst"]) for e in wrs]
    nbytes = [int(e["bytes"]) for e in wrs]

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
    # need[i]: how many of the WRs delivered to src[i] come earlier in the trace (rule 3)
    need = [bisect.bisect_left(incoming[src[i]], i) for i in range(n)]

    arrive = [math.nan] * n
    tx_free = defaultdict(float)
    rx_free = defaultdict(float)
    next_tx = defaultdict(int)  # pe -> position in txq of its next WR to start
    done = defaultdict(int)  # pe -> length of the prefix of incoming[pe] that has arrived
    done_max = defaultdict(lambda: [0.0])  # pe -> max arrival over each such prefix length
    events = []  # (time, kind, trace index): kind 0 = head at the RX port, 1 = arrival

    def start_ready(s):
        q = txq[s]
        while next_tx[s] < len(q):
            i = q[next_tx[s]]
            if done[s] < need[i]:
                return
            start = max(tx_free[s], done_max[s][need[i]])
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
        inc, pm = incoming[d], done_max[d]
        while done[d] < len(inc) and not math.isnan(arrive[inc[done[d]]]) and arrive[inc[done[d]]] <= t:
            pm.append(max(pm[-1], arrive[inc[done[d]]]))
            done[d] += 1
        start_ready(d)
    if any(math.isnan(a) for a in arrive):  # cannot happen: every dependency points earlier
        raise RuntimeError("link model: a work request never started")

    for i in range(n):
        pes[dst[i]].last_arrival_us = max(pes[dst[i]].last_arrival_us, arrive[i])
    floor = max((max(p.sent, p.received) for p in pes.values()), default=0) / bw
    return LinkModelResult(modelled_us=max(arrive, default=0.0), floor_us=floor, wrs=n, bytes=sum(nbytes),
                           skipped=skipped, gbps=gbps, latency_us=latency_us, per_wr_us=per_wr_us,
                           pes=dict(pes), arrive_us=arrive)


def model_phases(phases, **params):
    """{phase name: entries} -> {phase name: LinkModelResult}, same parameters for each."""
    return {name: model_link_time(entries, **params) for name, entries in phases.items()}


def format_table(results, title=""):
    """Lines of a table of {phase: LinkModelResult}, every figure labelled modelled."""
    lines = []
    if results:
        r0 = next(iter(results.values()))
        lines.append(f"{title}modelled link time (not measured): per PE one TX and one RX port at {r0.gbps:g} GB/s, "
                     f"latency {r0.latency_us:g} us, {r0.per_wr_us:g} us per work request, dependencies from "
                     f"the trace; floor = max over PEs of max(bytes sent, received) / bandwidth")
    lines.append(f"{'phase':<20} {'modelled us':>12} {'floor us':>10} {'modelled/floor':>14} {'WRs':>7} "
                 f"{'bytes':>14} {'busiest TX us':>13}")
    for name, r in results.items():
        busiest = max((p.tx_busy_us for p in r.pes.values()), default=0.0)
        lines.append(f"{name:<20} {r.modelled_us:>12.1f} {r.floor_us:>10.1f} {r.ratio:>14.3f} {r.wrs:>7} "
                     f"{r.bytes:>14} {busiest:>13.1f}")
    return lines
