"""The trace-driven link model (tools/bench/ep_link_model.py) on hand-computed traces, and the
wire-count bench's --link-model options. CPU only: no torch, no GPU.

Defaults throughout: 50 GB/s = 50 000 B/µs, 2 µs latency, 0.2 µs per work request (WR), so a
1 MB (10^6 B) WRITE occupies a port for 20 µs of bytes."""

import math
import os
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BENCH = os.path.join(REPO, "tools", "bench")
sys.path.insert(0, BENCH)
import ep_link_model as LM  # noqa: E402

MB = 10**6


def wr(src, dst, nbytes, outcome="ok", time_ns=0, opcode="write"):
    return {"time_ns": time_ns, "qp": 0, "qpn": 0, "src": src, "dst": dst, "opcode": opcode, "bytes": nbytes,
            "wqe_index": 0, "outcome": outcome}


def approx(v):
    return pytest.approx(v, abs=1e-9)


def test_one_big_write():
    r = LM.model_link_time([wr(0, 1, MB)])
    # start 0, per-WR 0.2, latency 2, 20 µs of bytes
    assert r.modelled_us == approx(22.2)
    assert r.floor_us == approx(20.0)
    assert r.ratio == approx(1.11)
    assert (r.wrs, r.bytes, r.skipped) == (1, MB, 0)
    assert r.pes[0].sent == MB and r.pes[1].received == MB
    assert r.pes[0].tx_busy_us == approx(20.2)
    assert r.pes[1].last_arrival_us == approx(22.2)


def test_two_sources_contend_for_one_receive_port():
    r = LM.model_link_time([wr(0, 1, MB), wr(2, 1, MB)])
    # both head at 2.2; the receiver's port takes the first (trace order on a tie) to 22.2, then
    # the second to 42.2
    assert r.arrive_us == [approx(22.2), approx(42.2)]
    assert r.modelled_us == approx(42.2)
    assert r.floor_us == approx(40.0)  # PE 1 receives 2 MB
    # two senders into two receivers do not contend
    r2 = LM.model_link_time([wr(0, 1, MB), wr(2, 3, MB)])
    assert r2.modelled_us == approx(22.2) and r2.floor_us == approx(20.0)


def test_transmit_port_is_fifo_across_qps_and_peers():
    a, b = wr(0, 1, MB), wr(0, 2, MB)
    b["qp"] = 1
    r = LM.model_link_time([a, b])
    # the second WR starts when the first has left the port (20.2), heads at 22.4, arrives 42.4
    assert r.arrive_us == [approx(22.2), approx(42.4)]
    assert r.floor_us == approx(40.0)  # PE 0 sends 2 MB


def test_reply_waits_for_the_delivered_request():
    r = LM.model_link_time([wr(0, 1, MB), wr(1, 0, 0, opcode="write_inline")])
    # the request arrives at 22.2; the zero-byte reply still pays 0.2 + 2
    assert r.arrive_us == [approx(22.2), approx(24.4)]
    assert r.modelled_us == approx(24.4)
    assert r.floor_us == approx(20.0)


def test_dependencies_are_every_earlier_delivery_transitively():
    # PE 1 got the request before it posted to 2 (conservatively a dependency); PE 2 then got
    # that before posting to 3. PE 4 received nothing earlier: its WR starts at 0.
    r = LM.model_link_time([wr(0, 1, MB), wr(1, 2, 0), wr(2, 3, 0), wr(4, 5, 0)])
    assert r.arrive_us == [approx(22.2), approx(24.4), approx(26.6), approx(2.2)]
    assert r.modelled_us == approx(26.6)
    # a later delivery is no dependency: PE 1's WR comes before the request in the trace
    r2 = LM.model_link_time([wr(1, 2, 0), wr(0, 1, MB)])
    assert r2.arrive_us == [approx(2.2), approx(22.2)]


def test_receive_port_serves_by_head_time_not_trace_order():
    # e0: 3 -> 0 arrives at 22.2; e1: 0 -> 2 waits for it (starts 22.2, heads 24.4); e2: 1 -> 2,
    # later in the trace, heads at 2.2 and takes PE 2's port first (2.2 .. 22.2); e1 then arrives
    # at 24.4 + 20 = 44.4. Trace-order FIFO would have given e2 64.4.
    r = LM.model_link_time([wr(3, 0, MB), wr(0, 2, MB), wr(1, 2, MB)])
    assert r.arrive_us == [approx(22.2), approx(44.4), approx(22.2)]
    assert r.modelled_us == approx(44.4)
    assert r.floor_us == approx(40.0)


def test_many_small_wrs_pay_the_per_wr_cost():
    r = LM.model_link_time([wr(0, 1, 1000) for _ in range(100)])
    # each WR holds the TX port 0.2 + 0.02; the last starts at 99 x 0.22 = 21.78, heads at 23.98
    # and (the receive port is idle between heads) arrives at 24.0
    assert r.modelled_us == approx(24.0)
    assert r.floor_us == approx(2.0)
    assert r.ratio == approx(12.0)
    assert r.pes[0].tx_busy_us == approx(22.0)
    z = LM.model_link_time([wr(0, 1, 0) for _ in range(100)])
    assert z.modelled_us == approx(99 * 0.2 + 0.2 + 2.0)
    assert z.floor_us == 0.0 and math.isnan(z.ratio)


def test_floor_is_the_busiest_port_in_bytes():
    # PE 0 sends 1 MB to each of 1, 2, 3; PE 5 receives 0.5 MB from 4 and 6
    entries = [wr(0, d, MB) for d in (1, 2, 3)] + [wr(4, 5, MB // 2), wr(6, 5, MB // 2)]
    r = LM.model_link_time(entries)
    assert r.floor_us == approx(60.0)
    # PE 0's third WR starts at 40.4, heads at 42.6, arrives 62.6
    assert r.modelled_us == approx(62.6)
    assert r.pes[5].received == MB and r.pes[0].sent == 3 * MB


def test_parameters():
    r = LM.model_link_time([wr(0, 1, MB)], gbps=25.0, latency_us=1.0, per_wr_us=0.0)
    assert r.modelled_us == approx(41.0) and r.floor_us == approx(40.0)
    assert (r.gbps, r.latency_us, r.per_wr_us) == (25.0, 1.0, 0.0)
    with pytest.raises(ValueError):
        LM.model_link_time([], gbps=0)
    with pytest.raises(ValueError):
        LM.model_link_time([], latency_us=-1)
    with pytest.raises(ValueError):
        LM.model_link_time([], latency_us=0, per_wr_us=0)


def test_failed_wrs_are_skipped_and_empty_trace_is_zero():
    r = LM.model_link_time([wr(0, 1, 0, outcome="error"), wr(0, 1, 0, outcome="flushed"), wr(0, 1, MB)])
    assert (r.wrs, r.skipped) == (1, 2)
    assert r.modelled_us == approx(22.2)
    e = LM.model_link_time([])
    assert (e.modelled_us, e.floor_us, e.wrs) == (0.0, 0.0, 0)


def test_merge_traces_orders_by_time_then_rank_then_position():
    rank0 = [wr(0, 1, 1, time_ns=5), wr(0, 1, 2, time_ns=9)]
    rank1 = [wr(1, 0, 3, time_ns=5), wr(1, 0, 4, time_ns=1)]  # out of order: sorted anyway
    merged = LM.merge_traces([rank0, rank1])
    assert [e["bytes"] for e in merged] == [4, 1, 3, 2]


def test_model_phases_and_table_are_labelled_modelled():
    res = LM.model_phases({"dispatch fp8": [wr(0, 1, MB)], "combine bf16 (fp8)": [wr(1, 0, MB), wr(1, 0, 0)]},
                          per_wr_us=0.5)
    assert res["dispatch fp8"].modelled_us == approx(22.5)
    assert res["combine bf16 (fp8)"].modelled_us == approx(20.5 + 0.5 + 2.0)
    lines = LM.format_table(res, title="t: ")
    assert lines[0].startswith("t: modelled link time") and "0.5 us per work request" in lines[0]
    assert "modelled us" in lines[1]
    assert lines[2].split()[:5] == ["dispatch", "fp8", "22.5", "20.0", "1.125"]


def test_model_module_needs_no_torch():
    code = "import sys; sys.path.insert(0, %r); import ep_link_model; print('torch' in sys.modules)" % BENCH
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_bench_options_without_a_gpu():
    out = subprocess.run([sys.executable, os.path.join(BENCH, "ep_internode_bench.py"), "--help"],
                         capture_output=True, text=True, check=True)
    for opt in ("--link-model", "--link-model-trace", "--link-gbps", "--link-latency-us", "--link-per-wr-us"):
        assert opt in out.stdout
    code = ("import sys; sys.path.insert(0, %r); import ep_internode_bench as B; "
            "a = B.parse_args(['--nproc', '16', '--gpu-per-node', '8', '--link-model', '--link-model-trace', '4096']); "
            "print(sorted(B.bench_env(a).items())); print(sorted(B.bench_env(B.parse_args([])).items())); "
            "print('torch' in sys.modules)") % BENCH
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [
        "[('MORI_GPU_PER_NODE', '8'), ('MORI_RDMA_EMULATE_TRACE', '4096')]",
        "[('MORI_GPU_PER_NODE', '2')]",
        "False",
    ]
    bad = subprocess.run([sys.executable, os.path.join(BENCH, "ep_internode_bench.py"), "--link-model",
                          "--link-model-trace", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--link-model-trace" in bad.stderr


def _fixed_point(entries, gbps, latency_us, per_wr_us):
    """The rules recomputed the slow way: starts in trace order from the last round's arrivals,
    then each receive port in head order, until nothing changes."""
    bw = gbps * 1e3
    n = len(entries)
    arrive = [0.0] * n
    for _ in range(n + 2):
        tx_free, head = {}, [0.0] * n
        for i, e in enumerate(entries):
            s = e["src"]
            ready = max([arrive[j] for j in range(i) if entries[j]["dst"] == s], default=0.0)
            start = max(tx_free.get(s, 0.0), ready)
            tx_free[s] = start + per_wr_us + e["bytes"] / bw
            head[i] = start + per_wr_us + latency_us
        new = [0.0] * n
        for d in {e["dst"] for e in entries}:
            free = 0.0
            for i in sorted((i for i in range(n) if entries[i]["dst"] == d), key=lambda i: (head[i], i)):
                free = max(free, head[i]) + entries[i]["bytes"] / bw
                new[i] = free
        if new == arrive:
            return arrive
        arrive = new
    raise AssertionError("no fixed point")


@pytest.mark.parametrize("seed", range(60))
def test_random_traces_match_the_rules_recomputed_slowly(seed):
    import random

    rng = random.Random(seed)
    pes = rng.randint(2, 5)
    entries = [wr(rng.randrange(pes), rng.randrange(pes), rng.choice([0, 8, 1000, 50_000, MB]))
               for _ in range(rng.randint(1, 25))]
    params = dict(gbps=rng.choice([25.0, 50.0]), latency_us=rng.choice([0.5, 2.0]), per_wr_us=rng.choice([0.0, 0.2]))
    r = LM.model_link_time(entries, **params)
    assert r.arrive_us == [approx(a) for a in _fixed_point(entries, **params)]
    # the floor is a lower bound: every byte crosses its sender's and its receiver's port
    assert r.modelled_us >= r.floor_us - 1e-9


def test_bench_models_a_phase_from_every_ranks_trace(capsys):
    sys.path.insert(0, BENCH)
    import ep_internode_bench as B

    args = B.parse_args(["--nproc", "4", "--kernel-type", "InterNodeV1LL", "--link-model"])
    # rank 0's request to rank 2 and rank 2's reply, recorded by their own emulators
    rows = [{"trace": [wr(0, 2, MB, time_ns=10)], "trace_dropped": 0}, {"trace": [], "trace_dropped": 0},
            {"trace": [wr(2, 0, 0, time_ns=20)], "trace_dropped": 0}, {"trace": [], "trace_dropped": 0}]
    r = B.link_model(rows, args)
    assert r.arrive_us == [approx(22.2), approx(24.4)] and r.floor_us == approx(20.0)
    rows[3]["trace_dropped"] = 7
    assert B.link_model(rows, args) is None
    assert "rank: entries) 3: 7" in capsys.readouterr().out
    lines = B.link_model_lines({"dispatch fp8": r, "combine bf16 (fp8)": None}, args, 4, 2, 128)
    assert lines[0].startswith("InterNodeV1LL, 2 nodes x 2, 128 tokens/rank: modelled link time")
    assert lines[2].split()[:5] == ["dispatch", "fp8", "24.4", "20.0", "1.220"]
    assert lines[3] == "combine bf16 (fp8)   modelled: n/a (trace ring overflowed)"
