"""The EP kernels' per-block phase trace as Chrome-trace / Perfetto JSON.

    op.enable_trace()                       # kernels launched from now on stamp their phases
    ... op.dispatch(...); op.combine(...) ...
    op.dump_dispatch_trace("ep_dispatch_rank{rank}.json")   # one file per rank
    op.dump_combine_trace("ep_combine_rank{rank}.json")
    mori.ops.trace.merge_chrome_traces(paths, "ep_all_ranks.json")   # optional: one file

Open a file in https://ui.perfetto.dev (or chrome://tracing). Each rank is a process ("rank N",
pid N + 1), each block of the kernel a thread ("dispatch block B"), each phase of a block one
slice: the slice ends at the phase's stamp and starts at the block's previous one (the record
layout and the phases: include/mori/ops/dispatch_combine/trace.hpp, read here through the
binding's TRACE_LAYOUT). A "launches" track per rank spans each launch from its first block's
entry to its last block's exit. Combine blocks carry an instant per peer: when the block saw that
peer's ready signal (pull) or rows (push).

Time axis: host wall clock (CLOCK_REALTIME), in us from a round origin (the file's
otherData.mori_trace.origin_unix_ns; merge_chrome_traces re-bases files to one origin). Within a
block the times come from the SM's cycle counter, scaled by the launch's cycles per ns and anchored
on the GPU wall clock (globaltimer, whose updates may be 1 us apart); timebase="globaltimer" uses
the wall clock alone. The GPU clock is mapped to the host's by clock samples (a kernel answering
the host through mapped memory) taken when tracing is enabled and at each dump: with two samples
at least 1 ms apart the mapping is the line through them (it absorbs the clocks' drift), else the
offset of the tightest sample. Its error is the sample's half round trip (a few us, in
otherData.mori_trace.clock.uncertainty_ns) plus, across hosts, the offset between the hosts'
CLOCK_REALTIME: ranks on one host share that clock; ranks on different hosts line up as well as
their clocks are synchronised (NTP: ~0.1-1 ms; PTP: ~1 us).

to_chrome_trace() is the whole conversion, a plain function of the raw buffer (a torch tensor,
numpy array or list of its uint64 words), so it runs without a GPU.
"""

import json
import os
import statistics
import warnings

from .. import _C

_MASK64 = (1 << 64) - 1
_LAYOUT = None

# Thread ids: one range per kind, so a rank's dispatch and combine tracks stay apart in a merged
# file (and no tid is 0, which some Perfetto versions merge with tid 1).
_TID_STRIDE = 100000

# Origins are multiples of this (10^4 s): times stay below 10^10 us, exact to the ns in a double.
_ORIGIN_GRID_NS = 10**13

# Clock samples closer than this are combined as an offset only (no drift estimate).
_MIN_DRIFT_SPAN_NS = 1_000_000

# A launch's cycles per ns come from blocks that ran at least this long.
_MIN_RATE_SPAN_NS = 2000


def _usage(msg):
    return _C.InvalidUsageError(msg)


def layout():
    """The record layout (dict) of this build: word indices, magic, kinds, phases per kind as
    [(stamp, name)] in the order a block passes them. From the C++ constants (one source)."""
    global _LAYOUT
    if _LAYOUT is None:
        ops = getattr(_C, "ops", None)
        if ops is None or not hasattr(ops, "TRACE_LAYOUT"):
            raise ImportError("mori._C.ops has no TRACE_LAYOUT: this build lacks the EP trace bindings")
        raw = dict(ops.TRACE_LAYOUT)
        raw["kinds"] = dict(raw["kinds"])
        raw["phases"] = {k: [(int(s), str(n)) for s, n in v] for k, v in dict(raw["phases"]).items()}
        _LAYOUT = raw
    return _LAYOUT


def buffer_words(slots, max_blocks):
    """uint64 words of a trace buffer of `slots` launches per kind and `max_blocks` blocks."""
    L = layout()
    return L["num_kinds"] * slots * max_blocks * L["words"]


def _kind_code(kind):
    L = layout()
    if kind not in L["kinds"]:
        raise _usage(f"trace kind must be one of {sorted(L['kinds'])}, got {kind!r}")
    return L["kinds"][kind]


# --- reading the buffer ---------------------------------------------------------------------
def _numel(buf):
    if hasattr(buf, "numel") and callable(buf.numel):
        return int(buf.numel())
    if hasattr(buf, "size") and not callable(buf.size):
        return int(buf.size)  # numpy
    return len(buf)


def _shape_of(buf, slots, max_blocks):
    """(slots, max_blocks) of a buffer, from the arguments or a 4-D shape."""
    L = layout()
    shape = tuple(int(d) for d in getattr(buf, "shape", ()))
    if len(shape) == 4:
        if shape[0] != L["num_kinds"] or shape[3] != L["words"]:
            raise _usage(f"trace buffer shape {shape} is not [{L['num_kinds']}, slots, max_blocks, {L['words']}]")
        slots = shape[1] if slots is None else slots
        max_blocks = shape[2] if max_blocks is None else max_blocks
    n = _numel(buf)
    per = L["num_kinds"] * L["words"]
    if slots is None and max_blocks is None:
        raise _usage("trace buffer: pass slots or max_blocks (or a [kinds, slots, max_blocks, words] array)")
    if slots is None:
        slots = n // (per * max_blocks) if max_blocks > 0 else 0
    if max_blocks is None:
        max_blocks = n // (per * slots) if slots > 0 else 0
    if slots < 1 or max_blocks < 1 or n != per * slots * max_blocks:
        raise _usage(
            f"trace buffer of {n} words does not hold {L['num_kinds']} kinds x {slots} slots x "
            f"{max_blocks} blocks x {L['words']} words"
        )
    return int(slots), int(max_blocks)


def _words(buf, start, stop):
    """Words [start, stop) of the flattened buffer as Python ints in [0, 2^64)."""
    if hasattr(buf, "detach"):  # torch
        t = buf.detach().reshape(-1)[start:stop]
        if t.device.type != "cpu":
            t = t.cpu()
        vals = t.tolist()
    elif hasattr(buf, "reshape"):  # numpy
        vals = buf.reshape(-1)[start:stop].tolist()
    else:
        vals = list(buf[start:stop])
    return [int(v) & _MASK64 for v in vals]


def parse_records(buf, kind, slots=None, max_blocks=None):
    """The written records of one kind ("dispatch" or "combine"), as dicts: slot, block, epoch,
    sm, arrival, grid, block_dim, parts, time[stamps], cycles[stamps], peer_ready[peers]."""
    L = layout()
    slots, max_blocks = _shape_of(buf, slots, max_blocks)
    W, S, P = L["words"], L["stamps"], L["peers"]
    per_kind = slots * max_blocks * W
    start = _kind_code(kind) * per_kind
    words = _words(buf, start, start + per_kind)
    out = []
    for slot in range(slots):
        for b in range(max_blocks):
            r = words[(slot * max_blocks + b) * W:(slot * max_blocks + b + 1) * W]
            if (r[L["word_magic"]] & 0xFFFFFFFF) != L["magic"]:
                continue
            t0, c0, p0 = L["word_time"], L["word_cycles"], L["word_peer_ready"]
            out.append({
                "slot": slot,
                "block": r[L["word_block"]],
                "epoch": r[L["word_epoch"]],
                "sm": r[L["word_sm"]],
                "arrival": r[L["word_arrival"]],
                "grid": r[L["word_grid"]],
                "block_dim": r[L["word_block_dim"]],
                "parts": r[L["word_parts"]],
                "time": r[t0:t0 + S],
                "cycles": r[c0:c0 + S],
                "peer_ready": r[p0:p0 + P],
            })
    return out


def group_launches(records, max_blocks):
    """Records grouped by launch (epoch), oldest first: dicts epoch, grid, records (by block),
    complete (a record for every block the buffer holds: min(grid, max_blocks))."""
    by_epoch = {}
    for r in records:
        by_epoch.setdefault(r["epoch"], []).append(r)
    out = []
    for epoch in sorted(by_epoch):
        recs = sorted(by_epoch[epoch], key=lambda r: r["block"])
        grid = max(r["grid"] for r in recs)
        want = set(range(min(grid, max_blocks)))
        complete = {r["block"] for r in recs} == want and all(r["grid"] == grid for r in recs)
        out.append({"epoch": epoch, "grid": grid, "records": recs, "complete": complete})
    return out


def _select(launches, which):
    if not launches:
        return []
    if which == "last":
        done = [ln for ln in launches if ln["complete"]]
        return [(done or launches)[-1]]
    if which == "all":
        return list(launches)
    wanted = [which] if isinstance(which, int) else list(which)
    by_epoch = {ln["epoch"]: ln for ln in launches}
    missing = [e for e in wanted if e not in by_epoch]
    if missing:
        raise _usage(f"trace: launch epoch(s) {missing} not in the buffer (recorded: {sorted(by_epoch)})")
    return [by_epoch[e] for e in wanted]


def _check_launches_arg(which):
    ok = which in ("last", "all") or (isinstance(which, int) and not isinstance(which, bool) and which >= 1)
    if not ok and isinstance(which, (list, tuple)):
        ok = len(which) > 0 and all(isinstance(e, int) and not isinstance(e, bool) and e >= 1 for e in which)
    if not ok:
        raise _usage(f"trace: launches must be 'last', 'all', an epoch (int >= 1) or a list of epochs, got {which!r}")


# --- time ----------------------------------------------------------------------------------------
class ClockMap:
    """GPU trace clock (ns) -> host CLOCK_REALTIME (ns) from clock samples
    [(host_ns, device_ns, uncertainty_ns)] (see the module doc). No sample: the identity,
    marked unaligned."""

    def __init__(self, samples):
        samples = sorted(((int(h), int(d), int(u)) for h, d, u in samples), key=lambda s: s[1])
        self.samples = samples
        self.aligned = bool(samples)
        self.slope, self.host0, self.dev0, self.uncertainty_ns = 1.0, 0, 0, None
        if not samples:
            return
        best = min(samples, key=lambda s: s[2])
        self.host0, self.dev0, self.uncertainty_ns = best[0], best[1], best[2]
        first, last = samples[0], samples[-1]
        if last[1] - first[1] >= _MIN_DRIFT_SPAN_NS:
            slope = (last[0] - first[0]) / (last[1] - first[1])
            if abs(slope - 1.0) <= 1e-3:  # else a sample is off (or a clock jumped): offset only
                self.slope, self.host0, self.dev0 = slope, first[0], first[1]
                self.uncertainty_ns = max(first[2], last[2])

    def __call__(self, device_ns):
        return self.host0 + int(round((device_ns - self.dev0) * self.slope))

    def describe(self):
        return {
            "aligned": self.aligned,
            "samples": [list(s) for s in self.samples],
            "slope": self.slope,
            "offset_ns": self.host0 - self.dev0,
            "uncertainty_ns": self.uncertainty_ns,
        }


def _order(kind):
    L = layout()
    return [L["entry_stamp"]] + [s for s, _ in L["phases"][kind]]


def _launch_rate(records, order):
    """Median cycles per ns of the launch's blocks that ran >= _MIN_RATE_SPAN_NS, or None."""
    rates = []
    for r in records:
        reached = [s for s in order if r["time"][s] != 0 and r["cycles"][s] != 0]
        if len(reached) < 2:
            continue
        a, b = reached[0], reached[-1]
        dt, dc = r["time"][b] - r["time"][a], r["cycles"][b] - r["cycles"][a]
        if dt >= _MIN_RATE_SPAN_NS and dc > 0:
            rates.append(dc / dt)
    return statistics.median(rates) if rates else None


def _block_times(r, order, rate):
    """{stamp: GPU ns} of the stamps the block reached: with `rate`, the cycle counter scaled and
    anchored on the wall clock (median offset over the stamps), else the wall clock."""
    reached = [s for s in order if r["time"][s] != 0]
    if rate is None or any(r["cycles"][s] == 0 for s in reached):
        return {s: r["time"][s] for s in reached}
    anchor = statistics.median(r["time"][s] - r["cycles"][s] / rate for s in reached)
    return {s: int(round(anchor + r["cycles"][s] / rate)) for s in reached}


# --- conversion ----------------------------------------------------------------------------------
def to_chrome_trace(buf, kind, *, rank=0, world_size=None, clock_samples=(), launches="last",
                    slots=None, max_blocks=None, timebase="auto", origin_ns=None):
    """The Chrome-trace dict ({"traceEvents": [...], "otherData": {"mori_trace": {...}}}) of one
    kind ("dispatch" or "combine") of a raw trace buffer.

    buf: the buffer's uint64 words (torch tensor, numpy array or list; any shape, or
    [kinds, slots, max_blocks, words]); slots / max_blocks: its dimensions (one is enough).
    launches: "last" (the newest launch with every block recorded, else the newest), "all", an
    epoch or a list of epochs. clock_samples: [(host_ns, device_ns, uncertainty_ns)] (none: GPU
    clock as is). timebase: "auto" (cycle counter anchored on the wall clock when the launch
    gives a rate) or "globaltimer". origin_ns: host ns of ts 0 (default: a multiple of 10^13 ns
    below the first event). world_size limits the combine's peer instants to real peers."""
    L = layout()
    _kind_code(kind)
    _check_launches_arg(launches)
    if timebase not in ("auto", "globaltimer"):
        raise _usage(f"trace: timebase must be 'auto' or 'globaltimer', got {timebase!r}")
    rank = int(rank)
    slots, max_blocks = _shape_of(buf, slots, max_blocks)
    all_launches = group_launches(parse_records(buf, kind, slots, max_blocks), max_blocks)
    chosen = _select(all_launches, launches)
    cmap = ClockMap(clock_samples)
    order = _order(kind)
    entry = L["entry_stamp"]
    phases = L["phases"][kind]
    npeers = L["peers"] if world_size is None else min(L["peers"], int(world_size))

    rates = {}
    if timebase == "auto":
        pooled = _launch_rate([r for ln in all_launches for r in ln["records"]], order)
        for ln in chosen:
            rate = _launch_rate(ln["records"], order)
            rates[ln["epoch"]] = rate if rate is not None else pooled

    # Host ns of every event first (the origin depends on the earliest).
    pid = rank + 1
    base = (L["kinds"][kind] + 1) * _TID_STRIDE
    slices, instants, launch_info = [], [], []
    blocks_seen = set()
    for ln in chosen:
        rate = rates.get(ln["epoch"])
        starts, ends = [], []
        for r in ln["records"]:
            gpu = _block_times(r, order, rate)
            host = {s: cmap(t) for s, t in gpu.items()}
            b = r["block"]
            blocks_seen.add(b)
            common = {"rank": rank, "block": b, "sm": r["sm"], "epoch": r["epoch"], "arrival": r["arrival"],
                      "grid": r["grid"], "block_dim": r["block_dim"]}
            if kind == "combine":
                common["parts"] = r["parts"]
            prev, prev_name, skipped = entry, "entry", []
            starts.append(host[entry])
            ends.append(max(host.values()))
            for stamp, name in phases:
                if stamp not in host:
                    skipped.append(name)
                    continue
                args = dict(common, start=prev_name)
                if skipped:
                    args["skipped"] = list(skipped)
                if r["cycles"][stamp] and r["cycles"][prev]:
                    args["cycles"] = r["cycles"][stamp] - r["cycles"][prev]
                if kind == "combine" and name == "wait_peers":
                    seen = {p: cmap(r["peer_ready"][p]) for p in range(npeers) if r["peer_ready"][p]}
                    if seen:
                        args["last_peer"] = max(seen, key=lambda p: seen[p])
                        args["peer_ready_us"] = {str(p): (t - host[entry]) / 1000.0 for p, t in sorted(seen.items())}
                slices.append((name, host[prev], host[stamp], base + 1 + b, args))
                prev, prev_name, skipped = stamp, name, []
            if kind == "combine":
                for p in range(npeers):
                    if r["peer_ready"][p]:
                        instants.append((f"peer {p} ready", cmap(r["peer_ready"][p]), base + 1 + b,
                                         {"rank": rank, "block": b, "peer": p, "epoch": r["epoch"]}))
        if starts:
            last = max(ln["records"], key=lambda r: max(_block_times(r, order, rate).values()))
            launch_info.append({
                "epoch": ln["epoch"], "grid": ln["grid"], "blocks_recorded": len(ln["records"]),
                "complete": ln["complete"], "block_dim": ln["records"][0]["block_dim"],
                "cycles_per_ns": rate, "entry_skew_us": (max(starts) - min(starts)) / 1000.0,
                "last_block": last["block"], "start_ns": min(starts), "end_ns": max(ends),
            })

    times = [s[1] for s in slices] + [i[1] for i in instants]
    if origin_ns is None:
        origin_ns = (min(times) // _ORIGIN_GRID_NS) * _ORIGIN_GRID_NS if times else 0
    origin_ns = int(origin_ns)

    def us(ns):
        return (ns - origin_ns) / 1000.0

    events = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {rank}"}},
        {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": rank}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": base, "args": {"name": f"{kind} launches"}},
        {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": base, "args": {"sort_index": base}},
    ]
    for b in sorted(blocks_seen):
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": base + 1 + b,
                       "args": {"name": f"{kind} block {b}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": base + 1 + b,
                       "args": {"sort_index": base + 1 + b}})
    for info in launch_info:
        args = {k: v for k, v in info.items() if k not in ("start_ns", "end_ns")}
        args["rank"] = rank
        events.append({"name": f"{kind} #{info['epoch']}", "cat": kind, "ph": "X", "pid": pid, "tid": base,
                       "ts": us(info["start_ns"]), "dur": (info["end_ns"] - info["start_ns"]) / 1000.0,
                       "args": args})
    for name, t0, t1, tid, args in slices:
        if t1 < t0:  # not expected (stamps are taken in order); shown empty, flagged
            args = dict(args, out_of_order_ns=t0 - t1)
            t1 = t0
        events.append({"name": name, "cat": kind, "ph": "X", "pid": pid, "tid": tid, "ts": us(t0),
                       "dur": (t1 - t0) / 1000.0, "args": args})
    for name, t, tid, args in instants:
        events.append({"name": name, "cat": kind, "ph": "i", "s": "t", "pid": pid, "tid": tid, "ts": us(t),
                       "args": args})

    meta = {
        "kind": kind,
        "rank": rank,
        "world_size": world_size,
        "origin_unix_ns": origin_ns,
        "timebase": timebase,
        "clock": cmap.describe(),
        "pid": pid,
        "tid_base": base,
        "slots": slots,
        "max_blocks": max_blocks,
        "launches": [{k: v for k, v in i.items()} for i in launch_info],
        "recorded_epochs": [ln["epoch"] for ln in all_launches],
    }
    return {"traceEvents": events, "otherData": {"mori_trace": meta}}


def phase_summary(buf, kind, *, launches="all", slots=None, max_blocks=None):
    """How long one kind's launches spend in each phase, from a raw trace buffer (as
    to_chrome_trace, whose slices it reads). Only launches with every block recorded count.

    Returns {"launches": n, "span_us": median launch span (first block's entry -> last block's
    exit), "phases": [(name, us)]}: per phase, in the kind's order, the median over launches of the
    longest time any block of the launch spent in it (phases no block reached are left out). A
    phase that waits for another PE includes that wait (trace.hpp names what each phase does)."""
    tr = to_chrome_trace(buf, kind, launches=launches, slots=slots, max_blocks=max_blocks)
    meta = tr["otherData"]["mori_trace"]
    complete = {ln["epoch"] for ln in meta["launches"] if ln["complete"]}
    spans, longest = [], {}  # longest: phase -> epoch -> us
    for e in tr["traceEvents"]:
        if e["ph"] != "X" or e["args"].get("epoch") not in complete:
            continue
        if e["tid"] == meta["tid_base"]:
            spans.append(e["dur"])
        else:
            per = longest.setdefault(e["name"], {})
            per[e["args"]["epoch"]] = max(per.get(e["args"]["epoch"], 0.0), e["dur"])
    names = [name for _, name in layout()["phases"][kind]]
    return {
        "launches": len(spans),
        "span_us": statistics.median(spans) if spans else None,
        "phases": [(n, statistics.median(longest[n].values())) for n in names if n in longest],
    }


def write_chrome_trace(trace, path):
    """Write a trace dict as JSON (compact) to `path`; returns the path."""
    path = os.fspath(path)
    with open(path, "w") as f:
        json.dump(trace, f, separators=(",", ":"))
    return path


def merge_chrome_traces(traces, path=None):
    """One trace of several (dicts or JSON file paths; e.g. every rank's dispatch and combine
    files): events re-based to the earliest origin. Written to `path` when given; returns the dict."""
    loaded = []
    for t in traces:
        if isinstance(t, (str, os.PathLike)):
            with open(t) as f:
                t = json.load(f)
        loaded.append(t)
    if not loaded:
        raise _usage("merge_chrome_traces: no traces")
    origins = [int(t.get("otherData", {}).get("mori_trace", {}).get("origin_unix_ns", 0)) for t in loaded]
    origin = min(origins)
    events, metas = [], []
    for t, o in zip(loaded, origins):
        shift_ns = o - origin
        for e in t["traceEvents"]:
            if "ts" in e and shift_ns:
                e = dict(e, ts=(int(round(e["ts"] * 1000)) + shift_ns) / 1000.0)
            events.append(e)
        m = t.get("otherData", {}).get("mori_trace")
        if m is not None:
            metas.append(dict(m, origin_unix_ns=origin))
    merged = {"traceEvents": events, "otherData": {"mori_trace_merged": metas, "origin_unix_ns": origin}}
    if path is not None:
        write_chrome_trace(merged, path)
    return merged


# --- the op's switch (EpDispatchCombineOp.enable_trace / dump_*_trace) ----------------------------
class OpTrace:
    """The trace buffer and clock sample of one op. The buffer lives as long as the op's native
    handle (set_trace keeps it alive): kernels captured in a CUDA graph while tracing keep writing
    into it on every replay, even after disable_trace."""

    def __init__(self):
        # No reference to the op: a cycle would delay the op's (collective) release to the GC.
        self.buffer = None
        self.slots = 0
        self.max_blocks = 0
        self.samples = []
        self.enabled = False

    def enable(self, op, slots, max_blocks):
        h = op._h()
        if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= 1 << 16:
            raise _usage(f"enable_trace: slots must be an int in [1, 65536], got {slots!r}")
        if max_blocks is None:
            max_blocks = int(h.multi_processor_count)
        if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or not 1 <= max_blocks <= 1 << 16:
            raise _usage(f"enable_trace: max_blocks must be an int in [1, 65536] or None, got {max_blocks!r}")
        import torch

        with torch.cuda.device(op._device_index):
            sample = h.sample_trace_clock()  # before any change: a failure leaves tracing as it was
            n = buffer_words(slots, max_blocks)
            if self.buffer is None or self.buffer.numel() != n:
                self.buffer = torch.zeros(n, dtype=torch.int64, device=op.device)
            else:
                self.buffer.zero_()
            # Kernels on any stream may be the next to write: the zeros must have landed first.
            torch.cuda.current_stream(op.device).synchronize()
            h.set_trace(self.buffer.data_ptr(), slots, max_blocks, self.buffer)
        self.slots, self.max_blocks, self.samples, self.enabled = slots, max_blocks, [tuple(sample)], True

    def disable(self, op):
        op._h().set_trace(0, 0, 0)
        self.enabled = False

    def dump(self, op, kind, path, launches):
        what = f"dump_{kind}_trace"
        if self.buffer is None:
            raise _usage(f"{what}: tracing was never enabled on this op (op.enable_trace())")
        _check_launches_arg(launches)
        import torch

        h = op._h()
        cfg = op.config
        with torch.cuda.device(op._device_index):
            raw = self._records(op)
            samples = list(self.samples)
            note = None
            try:
                samples.append(tuple(h.sample_trace_clock()))
            except Exception as e:  # noqa: BLE001  (e.g. a pending device error: the trace is still wanted)
                note = f"dump-time clock sample failed ({type(e).__name__}: {e}); enable-time sample used"
        trace = to_chrome_trace(raw, kind, rank=cfg.rank, world_size=cfg.world_size, clock_samples=samples,
                                launches=launches, slots=self.slots, max_blocks=self.max_blocks)
        meta = trace["otherData"]["mori_trace"]
        if note:
            meta["note"] = note
        if not meta["launches"]:
            warnings.warn(f"{what}: no {kind} launch was recorded since enable_trace", stacklevel=3)
        return write_chrome_trace(trace, resolve_path(path, kind, cfg.rank))

    def summary(self, op, kind, launches):
        if self.buffer is None:
            raise _usage("trace_phase_summary: tracing was never enabled on this op (op.enable_trace())")
        _check_launches_arg(launches)
        return phase_summary(self._records(op), kind, launches=launches, slots=self.slots,
                             max_blocks=self.max_blocks)

    def _records(self, op):
        """The buffer on the host, once every launch so far (any stream) has written its records."""
        import torch

        with torch.cuda.device(op._device_index):
            torch.cuda.synchronize(op.device)
            return self.buffer.cpu()


def resolve_path(path, kind, rank):
    """`path` with "{rank}" replaced by the rank; a directory gets mori_<kind>_trace_rank<rank>.json."""
    path = os.fspath(path).replace("{rank}", str(rank))
    if os.path.isdir(path):
        path = os.path.join(path, f"mori_{kind}_trace_rank{rank}.json")
    return path


__all__ = [
    "ClockMap",
    "OpTrace",
    "buffer_words",
    "group_launches",
    "layout",
    "merge_chrome_traces",
    "parse_records",
    "resolve_path",
    "to_chrome_trace",
    "write_chrome_trace",
]
