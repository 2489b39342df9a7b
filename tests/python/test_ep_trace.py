"""mori.ops.trace: the EP phase trace as Chrome-trace/Perfetto JSON.

CPU part: synthetic buffers written with the binding's record layout (the C++ constants) go
through the real conversion (to_chrome_trace): tracks, phase order, durations to the ns, metadata,
clock alignment, launch selection, slot wrap-around, missing stamps, merging, argument checks.
GPU part (full tier): the suite case tests/ops/ep_intranode_test.py -k phase_trace (enable_trace,
checked round trips, dumps, JSON checks on every rank) on 2 ranks, sharing a GPU where there is
one."""

import json
import os
import subprocess
import sys

import pytest

from conftest import needs_gpu

import mori
from mori.ops import trace

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
L = trace.layout()

T0 = 5_000_000_000  # GPU clock of the first entry (ns)
HOST_OFFSET = 1_732_000_000_000_000_000 - 4_000_000_000  # host realtime - GPU clock (ns)
RATE = 2  # cycles per ns (exact, so the cycle-based times equal the wall-clock ones)


def phases(kind):
    return L["phases"][kind]


def phase_dur(kind, i, block):
    return 1000 + 37 * i + 11 * block  # ns


class Buffer:
    """A trace buffer (flat list of uint64 words) written through the layout's word indices."""

    def __init__(self, slots, max_blocks):
        self.slots, self.max_blocks = slots, max_blocks
        self.words = [0] * trace.buffer_words(slots, max_blocks)

    def record(self, kind, epoch, block, grid, start, stamps=None, arrival=None, sm=None, peers=(), parts=0,
               block_dim=256, cycle_offset=None):
        """Writes block `block`'s record of launch `epoch` starting at GPU ns `start`; the stamps are
        the kind's phases in order (or `stamps`: {stamp: ns}). Returns {stamp: ns}."""
        base = ((L["kinds"][kind] * self.slots + epoch % self.slots) * self.max_blocks + block) * L["words"]
        r = [0] * L["words"]
        if stamps is None:
            stamps, t = {L["entry_stamp"]: start}, start
            for i, (s, name) in enumerate(phases(kind)):
                if name == "tail" and arrival != grid:
                    continue  # only the last block to arrive runs the tail
                t += phase_dur(kind, i, block)
                stamps[s] = t
        off = cycle_offset if cycle_offset is not None else 1000 * (block + 1)
        for s, t in stamps.items():
            r[L["word_time"] + s] = t
            r[L["word_cycles"] + s] = RATE * (t - T0) + 2 * off
        r[L["word_epoch"]] = epoch
        r[L["word_block"]] = block
        r[L["word_sm"]] = sm if sm is not None else 2 * block + 1
        r[L["word_arrival"]] = arrival if arrival is not None else block + 1
        r[L["word_grid"]] = grid
        r[L["word_block_dim"]] = block_dim
        r[L["word_parts"]] = parts
        r[L["word_magic"]] = L["magic"]
        for p, t in peers:
            r[L["word_peer_ready"] + p] = t
        self.words[base:base + L["words"]] = r
        return stamps


def launch(buf, kind, epoch, grid, start, peers_of=None):
    """Writes a complete launch of `grid` blocks (block b enters 100*b ns after `start`, arrives
    in block order); returns {block: {stamp: ns}}."""
    out = {}
    for b in range(grid):
        peers = peers_of(b) if peers_of else ()
        out[b] = buf.record(kind, epoch, b, grid, start + 100 * b, arrival=b + 1, peers=peers, parts=1)
    return out


def ns(us):
    return int(round(us * 1000))  # how Perfetto reads a ts/dur in us


def slices_by_tid(tr):
    out = {}
    for e in tr["traceEvents"]:
        if e["ph"] == "X":
            out.setdefault(e["tid"], []).append(e)
    for v in out.values():
        v.sort(key=lambda e: e["ts"])
    return out


def host(t):
    return t + HOST_OFFSET


SAMPLE = [(host(T0 - 1000), T0 - 1000, 1500)]


# --- the layout comes from the binding ---------------------------------------------------------
def test_layout_is_the_bindings():
    assert L is trace.layout()
    assert L["words"] == 40 and L["stamps"] == 12 and L["peers"] == 8 and L["num_kinds"] == 2
    words = [L[k] for k in ("word_epoch", "word_block", "word_sm", "word_arrival", "word_grid", "word_block_dim",
                            "word_parts", "word_magic")]
    spans = set(range(L["word_time"], L["word_time"] + L["stamps"])) | \
        set(range(L["word_cycles"], L["word_cycles"] + L["stamps"])) | \
        set(range(L["word_peer_ready"], L["word_peer_ready"] + L["peers"]))
    assert len(set(words)) == len(words) and not spans & set(words)
    assert len(spans) + len(words) == L["words"]
    assert sorted(L["kinds"].values()) == [0, 1]
    for kind in ("dispatch", "combine"):
        stamps = [s for s, _ in phases(kind)]
        assert len(set(stamps)) == len(stamps) and L["entry_stamp"] not in stamps
        assert all(0 <= s < L["stamps"] for s in stamps)
    assert [n for _, n in phases("dispatch")] == ["v1_stage", "scan", "announce", "count_wait", "copy",
                                                   "v1_tail_wait", "publish", "receive", "grid_counter"]
    assert [n for _, n in phases("combine")] == ["send", "wait_peers", "v1_proxy_sums", "v1_post_partials", "v1_own_sums",
                                                  "v1_landing_wait", "reduce", "fence", "grid_counter", "tail"]


# --- conversion ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dispatch", "combine"])
def test_tracks_phases_durations(kind):
    grid, W, rank = 6, 4, 2
    buf = Buffer(slots=4, max_blocks=8)
    peers_of = (lambda b: [(p, T0 + 100 * b + 1500 + 10 * p) for p in range(W) if p != rank]) \
        if kind == "combine" else None
    written = launch(buf, kind, 3, grid, T0, peers_of)
    tr = trace.to_chrome_trace(buf.words, kind, rank=rank, world_size=W, clock_samples=SAMPLE, slots=4)
    json.loads(json.dumps(tr))  # plain JSON
    meta = tr["otherData"]["mori_trace"]
    origin = meta["origin_unix_ns"]
    assert origin % 10**13 == 0 and origin <= host(T0)
    assert meta["kind"] == kind and meta["rank"] == rank and meta["recorded_epochs"] == [3]
    assert meta["clock"]["aligned"] and meta["clock"]["uncertainty_ns"] == 1500
    assert [ln["epoch"] for ln in meta["launches"]] == [3] and meta["launches"][0]["complete"]
    assert meta["launches"][0]["cycles_per_ns"] == pytest.approx(RATE)
    ev = tr["traceEvents"]
    pid, base = rank + 1, meta["tid_base"]
    assert all(e["pid"] == pid for e in ev)
    meta_ev = [e for e in ev if e["ph"] == "M"]
    assert all("ts" not in e for e in meta_ev)
    assert [e["args"]["name"] for e in meta_ev if e["name"] == "process_name"] == [f"rank {rank}"]
    threads = {e["tid"]: e["args"]["name"] for e in meta_ev if e["name"] == "thread_name"}
    assert threads == {base: f"{kind} launches", **{base + 1 + b: f"{kind} block {b}" for b in range(grid)}}
    assert min(threads) > 0
    by_tid = slices_by_tid(tr)
    names = [n for _, n in phases(kind)]
    for b in range(grid):
        xs = by_tid[base + 1 + b]
        want = names if (kind == "dispatch" or b == grid - 1) else [n for n in names if n != "tail"]
        assert [e["name"] for e in xs] == want
        stamps = [L["entry_stamp"]] + [s for s, n in phases(kind) if n in want]
        for e, s0, s1 in zip(xs, stamps, stamps[1:]):
            assert ns(e["ts"]) == host(written[b][s0]) - origin
            assert ns(e["dur"]) == written[b][s1] - written[b][s0] > 0
            assert e["args"]["block"] == b and e["args"]["epoch"] == 3 and e["args"]["sm"] == 2 * b + 1
            assert e["args"]["arrival"] == b + 1 and e["args"]["grid"] == grid and e["cat"] == kind
            assert e["args"]["cycles"] == RATE * (written[b][s1] - written[b][s0])
        for a, c in zip(xs, xs[1:]):
            assert ns(a["ts"]) + ns(a["dur"]) == ns(c["ts"])  # contiguous
    span = by_tid[base]
    assert len(span) == 1 and span[0]["name"] == f"{kind} #3"
    assert ns(span[0]["ts"]) == host(T0) - origin
    assert ns(span[0]["ts"]) + ns(span[0]["dur"]) == max(host(max(w.values())) for w in written.values()) - origin
    assert span[0]["args"]["entry_skew_us"] == pytest.approx(0.1 * (grid - 1))
    instants = [e for e in ev if e["ph"] == "i"]
    if kind == "dispatch":
        assert not instants
    else:
        assert len(instants) == grid * (W - 1)
        for e in instants:
            b, p = e["tid"] - base - 1, e["args"]["peer"]
            assert e["s"] == "t" and e["name"] == f"peer {p} ready" and p != rank
            assert ns(e["ts"]) == host(T0 + 100 * b + 1500 + 10 * p) - origin
        wait = [e for e in by_tid[base + 1] if e["name"] == "wait_peers"][0]
        assert wait["args"]["last_peer"] == W - 1
        assert sorted(wait["args"]["peer_ready_us"]) == [str(p) for p in range(W) if p != rank]


def test_world_size_limits_peer_instants():
    buf = Buffer(2, 2)
    launch(buf, "combine", 1, 2, T0, lambda b: [(p, T0 + 2000 + p) for p in range(8)])
    tr = trace.to_chrome_trace(buf.words, "combine", world_size=3, max_blocks=2)
    assert sorted({e["args"]["peer"] for e in tr["traceEvents"] if e["ph"] == "i"}) == [0, 1, 2]
    tr = trace.to_chrome_trace(buf.words, "combine", max_blocks=2)
    assert len([e for e in tr["traceEvents"] if e["ph"] == "i"]) == 2 * 8


def test_launch_selection_and_slot_wrap():
    slots, grid = 3, 4
    buf = Buffer(slots, grid)
    for epoch in range(1, 6):  # epochs 1, 2 overwritten by 4, 5 (slot = epoch % slots)
        launch(buf, "dispatch", epoch, grid, T0 + epoch * 1_000_000)
    # epoch 6: still running, block 3 has not started (no record): "last" skips it
    for b in range(3):
        buf.record("dispatch", 6, b, grid, T0 + 6_000_000 + 100 * b, arrival=b + 1)
    tr = trace.to_chrome_trace(buf.words, "dispatch", slots=slots, max_blocks=grid)
    meta = tr["otherData"]["mori_trace"]
    # slot 0 holds epoch 6 (blocks 0-2) and epoch 3 (block 3, not overwritten)
    assert meta["recorded_epochs"] == [3, 4, 5, 6]
    assert [ln["epoch"] for ln in meta["launches"]] == [5]
    assert all(e["args"]["epoch"] == 5 for e in tr["traceEvents"] if e["ph"] == "X")
    tr = trace.to_chrome_trace(buf.words, "dispatch", slots=slots, max_blocks=grid, launches="all")
    got = {(ln["epoch"], ln["complete"], ln["blocks_recorded"]) for ln in tr["otherData"]["mori_trace"]["launches"]}
    assert got == {(3, False, 1), (4, True, 4), (5, True, 4), (6, False, 3)}
    # every launch's slices sit on the block tracks, in time order, without overlap
    for xs in slices_by_tid(tr).values():
        for a, c in zip(xs, xs[1:]):
            assert ns(a["ts"]) + ns(a["dur"]) <= ns(c["ts"])
    tr = trace.to_chrome_trace(buf.words, "dispatch", slots=slots, max_blocks=grid, launches=[4, 5])
    assert [ln["epoch"] for ln in tr["otherData"]["mori_trace"]["launches"]] == [4, 5]
    with pytest.raises(mori.InvalidUsageError, match="not in the buffer"):
        trace.to_chrome_trace(buf.words, "dispatch", slots=slots, max_blocks=grid, launches=1)
    # the other kind's records are separate
    assert trace.to_chrome_trace(buf.words, "combine", slots=slots, max_blocks=grid)["otherData"]["mori_trace"][
        "launches"] == []


def test_grid_larger_than_buffer():
    buf = Buffer(1, 2)
    for b in range(2):
        buf.record("dispatch", 1, b, 5, T0 + 100 * b, arrival=b + 1)
    meta = trace.to_chrome_trace(buf.words, "dispatch", slots=1)["otherData"]["mori_trace"]
    assert meta["launches"][0]["grid"] == 5 and meta["launches"][0]["complete"]


def test_missing_stamps_are_skipped():
    """A block that stopped early (e.g. a device timeout) shows the phases it finished; one whose
    stamp in the middle is missing shows the next phase from the last stamp it reached."""
    buf = Buffer(1, 2)
    stamps = {s: T0 + 1000 * i for i, s in enumerate([L["entry_stamp"]] + [s for s, _ in phases("dispatch")])}
    names = dict((s, n) for s, n in phases("dispatch"))
    announce = [s for s, n in phases("dispatch") if n == "announce"][0]
    copy = [s for s, n in phases("dispatch") if n == "copy"][0]
    b0 = {s: t for s, t in stamps.items() if t <= stamps[copy]}  # stopped after copy
    b1 = {s: t for s, t in stamps.items() if s != announce}
    buf.record("dispatch", 1, 0, 2, T0, stamps=b0, arrival=0)
    buf.record("dispatch", 1, 1, 2, T0, stamps=b1, arrival=1)
    tr = trace.to_chrome_trace(buf.words, "dispatch", slots=1, clock_samples=SAMPLE)
    base = tr["otherData"]["mori_trace"]["tid_base"]
    by_tid = slices_by_tid(tr)
    assert [e["name"] for e in by_tid[base + 1]] == [n for s, n in phases("dispatch") if stamps[s] <= stamps[copy]]
    xs = by_tid[base + 2]
    assert [e["name"] for e in xs] == [n for n in names.values() if n != "announce"]
    cw = [e for e in xs if e["name"] == "count_wait"][0]
    assert cw["args"]["skipped"] == ["announce"] and cw["args"]["start"] == "scan"
    assert ns(cw["dur"]) == 2000


def test_timebase_cycle_counter_vs_coarse_wall_clock():
    """A wall clock that updates every 1 us (as some GPUs' globaltimer): "auto" recovers the phase
    durations from the cycle counter; "globaltimer" shows the 1 us steps."""
    buf = Buffer(1, 4)
    true = {}
    for b in range(4):
        t, st = T0 + 333 * b, {}
        st[L["entry_stamp"]] = t
        for i, (s, _) in enumerate(phases("dispatch")):
            t += 50_000 + 170 * i + 13 * b
            st[s] = t
        true[b] = st
        base = (L["kinds"]["dispatch"] * 4 + b) * L["words"]  # slots 1, max_blocks 4
        coarse = {s: (v // 1000) * 1000 for s, v in st.items()}
        buf.record("dispatch", 1, b, 4, 0, stamps=coarse, arrival=b + 1)
        for s, v in st.items():  # exact cycles
            buf.words[base + L["word_cycles"] + s] = RATE * (v - T0) + 77 * b + 1000
    auto = trace.to_chrome_trace(buf.words, "dispatch", slots=1)
    wall = trace.to_chrome_trace(buf.words, "dispatch", slots=1, timebase="globaltimer")
    base = auto["otherData"]["mori_trace"]["tid_base"]
    for b in range(4):
        stamps = [L["entry_stamp"]] + [s for s, _ in phases("dispatch")]
        want = [true[b][s1] - true[b][s0] for s0, s1 in zip(stamps, stamps[1:])]
        got = [ns(e["dur"]) for e in slices_by_tid(auto)[base + 1 + b]]
        assert all(abs(g - w) <= 0.01 * w + 2 for g, w in zip(got, want)), (got, want)
        assert all(ns(e["dur"]) % 1000 == 0 for e in slices_by_tid(wall)[base + 1 + b])
    assert auto["otherData"]["mori_trace"]["launches"][0]["cycles_per_ns"] == pytest.approx(RATE, rel=0.02)


def test_clock_map_offset_and_drift():
    assert not trace.ClockMap([]).aligned and trace.ClockMap([])(123) == 123
    m = trace.ClockMap([(10_000 + 5, 5, 40), (20_000 + 7, 7, 10)])  # too close: tightest offset
    assert m.slope == 1.0 and m(1_000) == 1_000 + 20_000 and m.uncertainty_ns == 10
    # 10 ms apart, GPU clock 20 ppm slow: the line through both samples
    a = (HOST_OFFSET + T0, T0, 800)
    b = (HOST_OFFSET + T0 + 10_000_000, T0 + 9_999_800, 1200)
    m = trace.ClockMap([b, a])
    assert m(T0) == a[0] and m(T0 + 9_999_800) == b[0] and m(T0 + 4_999_900) == a[0] + 5_000_000
    assert m.uncertainty_ns == 1200 and m.describe()["aligned"]
    # a sample 1 % off is not believed as a drift: offset of the tightest sample
    m = trace.ClockMap([(HOST_OFFSET + T0, T0, 800), (HOST_OFFSET + T0 + 10_100_000, T0 + 10_000_000, 900)])
    assert m.slope == 1.0 and m(T0 + 5) == HOST_OFFSET + T0 + 5


def test_ranks_on_one_clock_and_merge(tmp_path):
    """Two ranks whose GPU clocks differ by 3 ms: on the host clock their launches line up; merged
    files keep every event's host time, with origins re-based."""
    files = []
    for rank, gpu_off in ((0, 0), (1, 3_000_000)):
        buf = Buffer(2, 2)
        launch(buf, "combine", 1, 2, T0 + gpu_off, lambda b: [(1 - rank, T0 + gpu_off + 2500)])
        sample = [(host(T0), T0 + gpu_off, 900)]
        origin = 10**13 * (173200 - rank)  # differing origins, as across a 10^4 s boundary
        tr = trace.to_chrome_trace(buf.words, "combine", rank=rank, world_size=2, clock_samples=sample, slots=2,
                                   origin_ns=origin)
        files.append(trace.write_chrome_trace(tr, tmp_path / f"c{rank}.json"))
    loaded = [json.load(open(f)) for f in files]
    starts = [ns(min(e["ts"] for e in t["traceEvents"] if e["ph"] == "X")) + t["otherData"]["mori_trace"][
        "origin_unix_ns"] for t in loaded]
    assert starts[0] == starts[1] == host(T0)
    merged = trace.merge_chrome_traces(files, tmp_path / "all.json")
    assert json.load(open(tmp_path / "all.json")) == json.loads(json.dumps(merged))
    origin = merged["otherData"]["origin_unix_ns"]
    assert origin == 10**13 * 173199
    per_pid = {}
    for e in merged["traceEvents"]:
        if e["ph"] == "X":
            per_pid.setdefault(e["pid"], []).append(ns(e["ts"]) + origin)
    assert sorted(per_pid) == [1, 2] and min(per_pid[1]) == min(per_pid[2]) == host(T0)
    names = {(e["pid"], e["args"]["name"]) for e in merged["traceEvents"] if e["name"] == "process_name"}
    assert names == {(1, "rank 0"), (2, "rank 1")}


def test_dispatch_and_combine_tracks_do_not_collide():
    buf = Buffer(1, 2)
    launch(buf, "dispatch", 1, 2, T0)
    launch(buf, "combine", 1, 2, T0 + 50_000)
    d = trace.to_chrome_trace(buf.words, "dispatch", slots=1)
    c = trace.to_chrome_trace(buf.words, "combine", slots=1)
    tids = lambda t: {e["tid"] for e in t["traceEvents"] if "tid" in e}  # noqa: E731
    assert not tids(d) & tids(c)


def test_inputs_numpy_and_4d():
    np = pytest.importorskip("numpy")
    buf = Buffer(2, 3)
    launch(buf, "dispatch", 2, 3, T0)
    ref = trace.to_chrome_trace(buf.words, "dispatch", slots=2)
    a = np.array(buf.words, dtype=np.uint64)
    assert trace.to_chrome_trace(a, "dispatch", slots=2) == ref
    assert trace.to_chrome_trace(a.view(np.int64), "dispatch", max_blocks=3) == ref
    assert trace.to_chrome_trace(a.reshape(2, 2, 3, L["words"]), "dispatch") == ref


@pytest.mark.parametrize("kind", ["dispatch", "combine"])
def test_phase_summary(kind):
    """Per phase: the median over complete launches of the longest block's time; the launch span;
    an incomplete launch and an unreached phase left out."""
    grid = 5
    buf = Buffer(slots=8, max_blocks=8)
    names = [n for _, n in phases(kind)]
    skip = names[1]  # a phase no block reaches (as IntraNode never stamps the proxy sums)
    scale = {1: 1, 2: 3, 3: 2}  # launch epoch -> duration factor: medians are epoch 3's
    for epoch, f in scale.items():
        start = T0 + epoch * 10**6
        for b in range(grid):
            stamps, t = {L["entry_stamp"]: start + 100 * b}, start + 100 * b
            for i, (s, name) in enumerate(phases(kind)):
                if name == skip:
                    continue
                t += f * phase_dur(kind, i, b)
                stamps[s] = t
            buf.record(kind, epoch, b, grid, start, stamps=stamps, arrival=b + 1)
    buf.record(kind, 4, 0, grid, T0 + 5 * 10**6)  # launch 4: one block of 5 recorded
    got = trace.phase_summary(buf.words, kind, slots=8)
    assert got["launches"] == 3
    want = [(n, 2 * phase_dur(kind, i, grid - 1) / 1000.0) for i, (_, n) in enumerate(phases(kind)) if n != skip]
    assert [n for n, _ in got["phases"]] == [n for n, _ in want]
    for (_, us), (_, w) in zip(got["phases"], want):
        assert us == pytest.approx(w, abs=1e-3)
    total = sum(phase_dur(kind, i, grid - 1) for i, (_, n) in enumerate(phases(kind)) if n != skip)
    assert got["span_us"] == pytest.approx((100 * (grid - 1) + 2 * total) / 1000.0, abs=1e-3)
    assert trace.phase_summary(buf.words, kind, slots=8, launches=2)["launches"] == 1


def test_bad_arguments():
    buf = Buffer(1, 1)
    with pytest.raises(mori.InvalidUsageError, match="kind"):
        trace.to_chrome_trace(buf.words, "gather", slots=1)
    with pytest.raises(mori.InvalidUsageError, match="launches"):
        trace.to_chrome_trace(buf.words, "dispatch", slots=1, launches="newest")
    with pytest.raises(mori.InvalidUsageError, match="launches"):
        trace.to_chrome_trace(buf.words, "dispatch", slots=1, launches=[1, True])
    with pytest.raises(mori.InvalidUsageError, match="timebase"):
        trace.to_chrome_trace(buf.words, "dispatch", slots=1, timebase="clock64")
    with pytest.raises(mori.InvalidUsageError, match="does not hold"):
        trace.to_chrome_trace(buf.words[:-1], "dispatch", slots=1)
    with pytest.raises(mori.InvalidUsageError, match="slots or max_blocks"):
        trace.to_chrome_trace(buf.words, "dispatch")
    assert issubclass(mori.InvalidUsageError, ValueError)


class _FakeHandle:
    multi_processor_count = 132


class _FakeOp:
    """Stands for an EpDispatchCombineOp in the argument checks (which run before any GPU call)."""

    config = None

    def _h(self):
        return _FakeHandle()


def test_op_switch_argument_checks():
    t = trace.OpTrace()
    for slots, mb in ((0, None), (True, None), (1 << 17, None), ("8", None), (8, 0), (8, 2.5)):
        with pytest.raises(mori.InvalidUsageError, match="enable_trace"):
            t.enable(_FakeOp(), slots, mb)
    assert t.buffer is None and not t.enabled
    with pytest.raises(mori.InvalidUsageError, match="never enabled"):
        t.dump(_FakeOp(), "dispatch", "x.json", "last")
    with pytest.raises(mori.InvalidUsageError, match="never enabled"):
        t.summary(_FakeOp(), "dispatch", "all")
    t.buffer = object()  # as if enabled: the launches argument is checked before anything runs
    with pytest.raises(mori.InvalidUsageError, match="launches"):
        t.dump(_FakeOp(), "combine", "x.json", "first")
    with pytest.raises(mori.InvalidUsageError, match="launches"):
        t.summary(_FakeOp(), "combine", "first")


def test_resolve_path(tmp_path):
    assert trace.resolve_path("t_{rank}.json", "dispatch", 3) == "t_3.json"
    assert trace.resolve_path(tmp_path, "combine", 1) == os.path.join(str(tmp_path), "mori_combine_trace_rank1.json")
    assert trace.resolve_path("plain.json", "combine", 1) == "plain.json"


def test_op_has_the_switch():
    op = mori.ops.EpDispatchCombineOp
    for name in ("enable_trace", "disable_trace", "dump_dispatch_trace", "dump_combine_trace", "trace_enabled"):
        assert hasattr(op, name)


# --- GPU: the suite case on 2 ranks ------------------------------------------------------------
@needs_gpu
@pytest.mark.full  # a suite start-up of its own; the quick tier's EP runs cover the round trips
def test_phase_trace_on_gpu(suite_env):
    env = dict(suite_env)
    cmd = [sys.executable, os.path.join(REPO, "tests", "ops", "ep_intranode_test.py"), "--nproc", "2",
           "-k", "phase_trace"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    tail = f"$ {' '.join(cmd)}\n" + out[-4000:]
    assert "[PASS] phase_trace" in proc.stdout, tail
    assert proc.returncode == 0, tail
