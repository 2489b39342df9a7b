"""The trace-driven link model (tools/bench/ep_link_model.py) on hand-computed traces, under the
trace-order dependencies (rule 3) and the kernels' own (rule 3'), its command that re-models a
saved trace, and the wire-count bench's --link-model options. CPU only: no torch, no GPU.

Defaults throughout: 50 GB/s = 50 000 B/µs, 2 µs latency, 0.2 µs per work request (WR), so a
1 MB (10^6 B) WRITE occupies a port for 20 µs of bytes, and an 8-byte signal T = 8 / 50 000 µs."""

import math
import os
import subprocess
import sys

import ep_link_model as LM
import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BENCH = os.path.join(REPO, "tools", "bench")

MB = 10**6


def wr(src, dst, nbytes, outcome="ok", time_ns=0, opcode="write", qp=0):
    return {"time_ns": time_ns, "qp": qp, "qpn": 0, "src": src, "dst": dst, "opcode": opcode, "bytes": nbytes,
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
    for opt in ("--link-model", "--link-model-trace", "--save-trace", "--link-gbps", "--link-latency-us",
                "--link-per-wr-us"):
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


def _fixed_point(entries, gbps, latency_us, per_wr_us, waits=None):
    """The rules recomputed the slow way: starts in trace order from the last round's arrivals,
    then each receive port in head order, until nothing changes. waits: rule 3' (each WR's list
    of the WRs it waits for); None: rule 3."""
    bw = gbps * 1e3
    n = len(entries)
    if waits is None:
        waits = [[j for j in range(i) if entries[j]["dst"] == entries[i]["src"]] for i in range(n)]
    arrive = [0.0] * n
    for _ in range(n + 2):
        tx_free, head = {}, [0.0] * n
        for i, e in enumerate(entries):
            s = e["src"]
            ready = max([arrive[j] for j in waits[i]], default=0.0)
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




# ---- rule 3' (deps="protocol") and deps="none" ------------------------------------------------

T8 = 8 / 5e4  # µs of an 8-byte signal on a port


def test_trace_is_the_default_and_unchanged():
    entries = [wr(0, 1, MB), wr(1, 2, 0), wr(2, 3, 0), wr(4, 5, 0)]
    r = LM.model_link_time(entries, deps="trace")
    assert r.arrive_us == LM.model_link_time(entries).arrive_us
    assert r.arrive_us == [approx(22.2), approx(24.4), approx(26.6), approx(2.2)]
    assert (r.deps, r.waiting) == ("trace", 0)


def test_none_lets_a_pe_send_while_it_receives():
    # ranks 0 and 1 share a GPU; rank 0's slice ran first. Rule 3 makes 1's WRITE wait for 0's
    # (start 22.2, head 24.4, arrive 44.4); without dependencies both start at 0 (the docstring's
    # worked example of rule 3')
    entries = [wr(0, 1, MB), wr(1, 0, MB)]
    assert LM.model_link_time(entries).arrive_us == [approx(22.2), approx(44.4)]
    r = LM.model_link_time(entries, deps="none")
    assert r.arrive_us == [approx(22.2), approx(22.2)]
    assert r.modelled_us == approx(22.2) and r.floor_us == approx(20.0)
    assert (r.deps, r.waiting) == ("none", 0)


def test_none_keeps_the_ports_and_the_per_wr_cost():
    # two senders into one receiver still share its RX port
    assert LM.model_link_time([wr(0, 1, MB), wr(2, 1, MB)], deps="none").arrive_us == [approx(22.2), approx(42.2)]
    # one sender's WRs on two QPs still take its TX port in trace order
    assert LM.model_link_time([wr(0, 1, MB, qp=0), wr(0, 2, MB, qp=1)], deps="none").arrive_us == [
        approx(22.2), approx(42.4)]
    assert LM.model_link_time([wr(0, 1, 1000) for _ in range(100)], deps="none").modelled_us == approx(24.0)


def test_parameters_of_the_dependency_mode():
    with pytest.raises(ValueError):
        LM.model_link_time([], deps="order")
    with pytest.raises(ValueError):
        LM.model_link_time([], deps="protocol")
    with pytest.raises(ValueError):
        LM.PhaseProtocol("IntraNode", "dispatch", 4, 2, 1)
    with pytest.raises(ValueError):
        LM.PhaseProtocol("InterNodeV1", "receive", 4, 2, 1)
    with pytest.raises(ValueError):
        LM.PhaseProtocol("InterNodeV1", "dispatch", 6, 4, 1)  # 6 PEs are not nodes of 4


def v1(kernel, phase, W=4, G=2, Epr=1):
    return LM.PhaseProtocol(kernel, phase, W, G, Epr)


def test_v1ll_waits_for_nothing():
    # 2 nodes x 2, Epr 1: count records 8 (2 + 2 + 2) = 48 B. Rail pairs 0 <-> 2 (records) and
    # 1 <-> 3 (empty lists: the count record and an empty share's tail)
    c = 48 / 5e4
    entries = [wr(0, 2, 48), wr(0, 2, MB), wr(0, 2, 8), wr(2, 0, 48), wr(2, 0, MB), wr(2, 0, 8),
               wr(1, 3, 48), wr(1, 3, 8), wr(3, 1, 48), wr(3, 1, 8)]
    p = v1("InterNodeV1LL", "dispatch")
    assert p.waits(entries) == [[]] * 10
    r = LM.model_link_time(entries, deps="protocol", protocol=p)
    assert r.arrive_us == LM.model_link_time(entries, deps="none").arrive_us
    # PE 0: record 0 .. 0.2 + c (arrives 2.2 + c), chunk from 0.2 + c (arrives 22.4 + c), tail
    # from 20.4 + c (heads 22.6 + c, arrives 22.6 + c + T)
    assert r.arrive_us[:3] == [approx(2.2 + c), approx(22.4 + c), approx(22.6 + c + T8)]
    assert r.arrive_us[7] == approx(2.4 + c + T8)
    assert r.modelled_us == approx(22.6 + c + T8)
    assert (r.deps, r.waiting) == ("protocol: InterNodeV1LL dispatch", 0)
    assert LM.model_link_time(entries).modelled_us > r.modelled_us


def test_v1_combine_landfree_waits_for_the_partials_it_received():
    # partial + landing tail each way on QP 0, then each owner's landFree (an 8-byte word behind
    # an 8-byte tail: standalone)
    entries = [wr(0, 1, MB), wr(0, 1, 8), wr(1, 0, MB), wr(1, 0, 8), wr(0, 1, 8), wr(1, 0, 8)]
    p = v1("InterNodeV1", "combine", W=2, G=1)
    assert p.waits(entries) == [[], [], [], [], [2, 3], [0, 1]]
    r = LM.model_link_time(entries, deps="protocol", protocol=p)
    # partials arrive at 22.2, tails start 20.2 and arrive 22.4 + T; landFree starts then: heads
    # 24.6 + T, arrives 24.6 + 2T
    assert r.arrive_us == [approx(22.2), approx(22.4 + T8)] * 2 + [approx(24.6 + 2 * T8)] * 2
    assert r.waiting == 2
    # rule 3: PE 1's partial waits for PE 0's WRITEs (22.4 + T): arrives 44.6 + T, its tail 44.8 +
    # 2T; PE 0's landFree waits for those (arrives 47.0 + 3T), PE 1's for it (49.2 + 4T)
    t = LM.model_link_time(entries)
    assert t.arrive_us == [approx(22.2), approx(22.4 + T8), approx(44.6 + T8), approx(44.8 + 2 * T8),
                           approx(47.0 + 3 * T8), approx(49.2 + 4 * T8)]


def test_v1_dispatch_credit_waits_for_the_records_and_the_nodes_count_records():
    # 2 nodes x 2, Epr 1 (count records 48 B), one QP per pair. Rail peers 0 <-> 2 send a chunk
    # each; 1 <-> 3 send none. Each credit follows a tail or the count record on its QP.
    entries = [wr(0, 2, 48), wr(0, 2, MB), wr(0, 2, 8),  # 0..2
               wr(1, 3, 48),  # 3
               wr(2, 0, 48), wr(2, 0, MB), wr(2, 0, 8),  # 4..6
               wr(3, 1, 48),  # 7
               wr(2, 0, 8), wr(0, 2, 8), wr(1, 3, 8), wr(3, 1, 8)]  # credits 8..11
    p = v1("InterNodeV1", "dispatch")
    w = p.waits(entries)
    assert w[:8] == [[]] * 8
    # 2's credit to 0: the count records delivered to node 1 (0 -> 2, 1 -> 3) and 0's records
    assert w[8:] == [[0, 1, 2, 3], [4, 5, 6, 7], [4, 7], [0, 3]]
    c = 48 / 5e4
    r = LM.model_link_time(entries, deps="protocol", protocol=p)
    # tails arrive at 22.6 + c + T; the credits start then (TX free at 20.6 + c + T) and arrive
    # at 24.8 + c + 2T. PE 1's credit waits for the count records to node 0 (2.2 + c): starts
    # then, arrives at 4.4 + c + T
    assert r.arrive_us[8:] == [approx(24.8 + c + 2 * T8)] * 2 + [approx(4.4 + c + T8)] * 2
    assert r.modelled_us == approx(24.8 + c + 2 * T8)
    assert r.floor_us == approx((MB + 48 + 16) / 5e4)
    assert r.waiting == 4
    assert r.modelled_us < LM.model_link_time(entries).modelled_us


def test_v1_dispatch_credit_waits_for_lower_slots_only():
    # 3 nodes x 1: PE 0's rail peers are 1 (slot 0) and 2 (slot 1). Its credit to 1 waits for
    # 1's records, not for 2's; its credit to 2 waits for both. Count records: 8 (2 + 1 + 1) B.
    entries = [wr(1, 0, 32, qp=0), wr(1, 0, MB, qp=0), wr(1, 0, 8, qp=0),
               wr(2, 0, 32, qp=0), wr(2, 0, MB, qp=0), wr(2, 0, 8, qp=0),
               wr(0, 1, 32, qp=0), wr(0, 2, 32, qp=1), wr(0, 1, 8, qp=0), wr(0, 2, 8, qp=1)]
    w = LM.PhaseProtocol("InterNodeV1", "dispatch", 3, 1, 1).waits(entries)
    assert w[8] == [0, 1, 2, 3] and w[9] == [0, 1, 2, 3, 4, 5]


def test_internode_dispatch_rows_wait_for_the_count_pairs():
    # 2 nodes x 1, Epr 32 (histograms 128 B). Each PE: histogram and count pair for the other
    # (about it), the pair about itself, then rows and tail.
    entries = [wr(0, 1, 128), wr(0, 1, 16), wr(0, 1, 16), wr(1, 0, 128), wr(1, 0, 16), wr(1, 0, 16),
               wr(0, 1, MB), wr(0, 1, 8), wr(1, 0, MB), wr(1, 0, 8)]
    p = LM.PhaseProtocol("InterNode", "dispatch", 2, 1, 32)
    assert p.waits(entries) == [[]] * 6 + [[4, 5], [4, 5], [1, 2], [1, 2]]
    h, q = 128 / 5e4, 16 / 5e4
    r = LM.model_link_time(entries, deps="protocol", protocol=p)
    # the second pair arrives at 2.6 + h + 2q; rows start then, arrive 24.8 + h + 2q; the tail
    # starts when they left (22.8 + h + 2q) and arrives at 25.0 + h + 2q + T
    assert r.arrive_us[5] == approx(2.6 + h + 2 * q)
    assert r.arrive_us[6:8] == [approx(24.8 + h + 2 * q), approx(25.0 + h + 2 * q + T8)]
    assert r.modelled_us == approx(25.0 + h + 2 * q + T8)
    assert r.modelled_us < LM.model_link_time(entries).modelled_us


def test_internode_combine_done_waits_for_returned_rows_and_its_own_writes():
    p = LM.PhaseProtocol("InterNode", "combine", 2, 1, 32)
    entries = [wr(0, 1, MB), wr(0, 1, 8), wr(1, 0, MB), wr(1, 0, 8), wr(0, 1, 8), wr(1, 0, 8)]
    assert p.waits(entries) == [[], [], [], [], [0, 1, 2, 3], [0, 1, 2, 3]]
    r = LM.model_link_time(entries, deps="protocol", protocol=p)
    assert r.arrive_us[4:] == [approx(24.6 + 2 * T8)] * 2
    assert LM.model_link_time(entries).modelled_us == approx(49.2 + 4 * T8)
    # one way only: the done word waits for the quiet (its own rows and landing word arrived at
    # 22.4 + T), which rule 3 does not see: here "protocol" (24.6 + 2T) exceeds "trace" (the done
    # word starts when the TX port is free, 20.4 + T, and arrives at 22.6 + 2T)
    one = entries[:2] + [entries[4]]
    assert LM.model_link_time(one, deps="protocol", protocol=p).modelled_us == approx(24.6 + 2 * T8)
    assert LM.model_link_time(one).modelled_us == approx(22.6 + 2 * T8)


def test_internode_push_combine_waits_for_nothing():
    # the push combine (ops of <= 256 tokens per rank): rows, weights, tail and done posted
    # together, also tail + done with no rows, which the landing protocol's reading refuses
    p = LM.PhaseProtocol("InterNode", "combine", 2, 1, 32, push_combine=True)
    entries = [wr(0, 1, MB), wr(0, 1, 8), wr(0, 1, 8), wr(1, 0, 8), wr(1, 0, 8)]
    assert p.waits(entries) == [[]] * 5
    assert "push" in p.describe()
    r = LM.model_link_time(entries, deps="protocol", protocol=p)
    assert r.modelled_us == approx(LM.model_link_time(entries, deps="protocol", protocol=_Waits([[]] * 5)).modelled_us)
    with pytest.raises(ValueError):
        LM.PhaseProtocol("InterNode", "combine", 2, 1, 32).waits(entries)
    run = {"params": {"kernel_type": "InterNode", "world_size": 2, "gpu_per_node": 1, "experts_per_rank": 32,
                      "push_combine": True}}
    assert LM.run_protocol(run["params"], {"kind": "combine"}).push_combine
    assert not LM.run_protocol({**run["params"], "push_combine": False}, {"kind": "combine"}).push_combine


def test_protocol_rejects_traces_without_its_structure():
    p = v1("InterNodeV1", "combine", W=2, G=1)
    # a standalone word (first of its QP) with a WR behind it on the same QP
    with pytest.raises(ValueError, match="not the last WR of its QP"):
        p.waits([wr(0, 1, 8), wr(0, 1, MB)])
    with pytest.raises(ValueError, match="second one of its pair"):
        p.waits([wr(0, 1, 8, qp=0), wr(0, 1, 8, qp=1)])
    entry = wr(0, 1, MB)
    del entry["qp"]
    with pytest.raises(ValueError, match="qp"):
        p.waits([entry])
    # InterNode dispatch reads sizes only
    assert LM.PhaseProtocol("InterNode", "dispatch", 2, 1, 32).waits([entry]) == [[]]


class _Waits:
    """A protocol given as explicit waits (model_link_time takes any object with waits(wrs))."""

    name = "explicit"

    def __init__(self, waits):
        self.w = waits

    def waits(self, wrs):
        return self.w


@pytest.mark.parametrize("seed", range(60))
def test_random_waits_match_the_rules_recomputed_slowly(seed):
    import random

    rng = random.Random(1000 + seed)
    pes = rng.randint(2, 5)
    entries = [wr(rng.randrange(pes), rng.randrange(pes), rng.choice([0, 8, 1000, 50_000, MB]))
               for _ in range(rng.randint(1, 25))]
    waits = [sorted(rng.sample(range(i), rng.randint(0, min(i, 3)))) for i in range(len(entries))]
    params = dict(gbps=rng.choice([25.0, 50.0]), latency_us=rng.choice([0.5, 2.0]), per_wr_us=rng.choice([0.0, 0.2]))
    r = LM.model_link_time(entries, deps="protocol", protocol=_Waits(waits), **params)
    assert r.arrive_us == [approx(a) for a in _fixed_point(entries, waits=waits, **params)]
    none = LM.model_link_time(entries, deps="none", **params)
    assert none.arrive_us == [approx(a) for a in _fixed_point(entries, waits=[[]] * len(entries), **params)]
    # no dependencies never exceed rule 3's (module docstring)
    assert none.modelled_us <= LM.model_link_time(entries, **params).modelled_us + 1e-9


def test_protocol_waits_must_point_earlier():
    with pytest.raises(ValueError, match="earlier"):
        LM.model_link_time([wr(0, 1, 1), wr(1, 0, 1)], deps="protocol", protocol=_Waits([[1], []]))


def _v1_shaped_trace(rng, N, G, Q, phase, ll, Epr=2, rec=14672, chunk=36):
    """A V1 / V1LL phase as the kernels post it (count record first on QP 0, chunks and tails per
    share, V1: the standalone word last on QP 0), in a time-sliced order: the ranks' data in
    random slices, then (V1) the credits or landFree words, which follow what they wait for."""
    W = N * G
    count = 8 * (2 + G + G * Epr)
    data, words = [], []
    for p in range(W):
        seq = []
        for m in range(N - 1):
            s = ((p // G + m + 1) % N) * G + p % G
            c = rng.randint(0, 60)
            if phase == "dispatch":
                seq.append(wr(p, s, count, qp=s * Q))
            for q in range(Q):
                a, b = c * q // Q, c * (q + 1) // Q
                if a == b and not ll:
                    continue
                x = a
                while True:
                    y = b if ll or b - x < chunk else x + chunk
                    if y > x:
                        seq.append(wr(p, s, (y - x) * rec, qp=s * Q + q))
                    seq.append(wr(p, s, 8, qp=s * Q + q))
                    x = y
                    if x >= b:
                        break
            if not ll:
                words.append(wr(p, s, 8, qp=s * Q))
        data.append(seq)
    trace = []
    pos = [0] * W
    while any(pos[p] < len(data[p]) for p in range(W)):
        p = rng.choice([p for p in range(W) if pos[p] < len(data[p])])
        k = rng.randint(1, 40)
        trace += data[p][pos[p]:pos[p] + k]
        pos[p] += k
    rng.shuffle(words)
    return trace + words, LM.PhaseProtocol("InterNodeV1LL" if ll else "InterNodeV1", phase, W, G, Epr)


@pytest.mark.parametrize("seed", range(40))
def test_protocol_is_at_most_the_trace_order_bound_on_v1_shaped_traces(seed):
    import random

    rng = random.Random(seed)
    entries, proto = _v1_shaped_trace(rng, rng.choice([2, 3]), rng.choice([1, 2, 4]), rng.choice([1, 2]),
                                      rng.choice(["dispatch", "combine"]), rng.random() < 0.5)
    pr = LM.model_link_time(entries, deps="protocol", protocol=proto)
    tr = LM.model_link_time(entries)
    assert pr.floor_us == tr.floor_us
    assert pr.floor_us - 1e-9 <= pr.modelled_us <= tr.modelled_us + 1e-9


# ---- the design targets, saved runs and the command ----------------------------------------

def _run(kernel="InterNodeV1LL", W=4, G=2, tokens=128, Epr=1):
    """A run as the bench builds it: V1LL dispatch of test_v1ll_waits_for_nothing, and a combine
    whose trace ring overflowed."""
    entries = [wr(0, 2, 48), wr(0, 2, MB), wr(0, 2, 8), wr(2, 0, 48), wr(2, 0, MB), wr(2, 0, 8),
               wr(1, 3, 48), wr(1, 3, 8), wr(3, 1, 48), wr(3, 1, 8)]
    for k, e in enumerate(entries):
        e["time_ns"] = 100 + k
        for key in ("qpn", "wqe_index"):
            del e[key]
    params = {"kernel_type": kernel, "world_size": W, "gpu_per_node": G, "tokens": tokens, "experts_per_rank": Epr,
              "link_gbps": 50.0, "link_latency_us": 2.0, "link_per_wr_us": 0.2}
    return {"params": params, "phases": [{"name": "dispatch fp8", "kind": "dispatch", "entries": entries},
                                         {"name": "combine bf16 (fp8)", "kind": "combine", "entries": None}]}


def test_design_targets():
    std = {"world_size": 16, "gpu_per_node": 8, "hidden": 7168, "topk": 8, "experts": 256}
    assert LM.design_target(dict(std, kernel_type="InterNodeV1", tokens=4096), "combine") == ("ratio", 1.15)
    assert LM.design_target(dict(std, kernel_type="InterNodeV1LL", tokens=128), "dispatch") == ("us", 34.0)
    assert LM.design_target(dict(std, kernel_type="InterNodeV1LL", tokens=128), "combine") == ("us", 52.0)
    assert LM.design_target(dict(std, kernel_type="InterNode", tokens=4096), "dispatch") is None
    assert LM.design_target(dict(std, kernel_type="InterNodeV1LL", tokens=128, world_size=8), "dispatch") is None
    assert LM.design_target(dict(std, kernel_type="InterNodeV1LL", tokens=256), "dispatch") is None


def test_run_table_puts_protocol_first_and_trace_order_second():
    run = _run()
    lines = LM.run_table(run)
    assert lines[0].startswith("InterNodeV1LL, 2 nodes x 2, 128 tokens/rank: modelled link time (not measured)")
    assert "rule 3'" in lines[1] and "InterNodeV1LL: no WR waits" in lines[1]
    assert lines[2].startswith("trace-order modelled us:")
    assert lines[3].split()[:4] == ["phase", "modelled", "us", "floor"]
    c = 48 / 5e4
    trace = LM.model_link_time(run["phases"][0]["entries"]).modelled_us
    row = lines[4].split()
    # protocol 22.6 + c + T, floor 20 + (48 + 8) / B; no target outside 2 x 8
    assert row[:6] == ["dispatch", "fp8", f"{22.6 + c + T8:.1f}", "20.0",
                       f"{(22.6 + c + T8) / ((MB + 56) / 5e4):.3f}", "-"]
    assert row[6:8] == [f"{trace:.1f}", f"{trace / ((MB + 56) / 5e4):.3f}"]
    assert row[8:10] == ["10", "0"]  # WRs, waiting
    assert lines[5] == "combine bf16 (fp8)   modelled: n/a (trace ring overflowed)"
    assert lines[-1].startswith("targets at 2 x 8")
    one = LM.run_table(run, deps="trace")
    assert "dependencies from the trace (rule 3)" in one[0]
    assert one[2].split()[:3] == ["dispatch", "fp8", f"{trace:.1f}"]
    prot = LM.run_table(run, deps="protocol")
    assert "the kernels' own dependencies (rule 3')" in prot[0] and prot[1].startswith("rule 3': ")


def test_run_table_marks_the_target():
    run = _run(W=16, G=8, Epr=16)  # as if at 2 x 8: the target of LL dispatch applies
    run["params"].update(hidden=7168, topk=8, experts=256)
    assert "<= 34 us: met" in LM.run_table(run)[4]
    run["params"]["link_gbps"] = 25.0  # 1 MB now takes 40 us
    assert "<= 34 us: NOT met" in LM.run_table(run)[4]


def test_saved_run_round_trips_through_the_command(tmp_path):
    run = _run()
    path = str(tmp_path / "trace.json")
    LM.save_run(path, run)
    back = LM.load_run(path)
    assert back["params"] == run["params"]
    assert back["phases"][1]["entries"] is None
    assert back["phases"][0]["entries"] == [{k: e[k] for k in LM.SAVE_COLUMNS if k in e}
                                            for e in run["phases"][0]["entries"]]
    cli = os.path.join(BENCH, "ep_link_model.py")
    out = subprocess.run([sys.executable, cli, path], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == LM.run_table(run)
    out = subprocess.run([sys.executable, cli, path, "--deps", "trace", "--link-gbps", "25"], capture_output=True,
                         text=True, check=True)
    assert out.stdout.splitlines() == LM.run_table(run, deps="trace", gbps=25.0)
    assert "at 25 GB/s" in out.stdout.splitlines()[0]
    out = subprocess.run([sys.executable, cli, path, "--deps", "protocol"], capture_output=True, text=True,
                         check=True)
    assert out.stdout.splitlines()[3].split()[2] == f"{22.6 + 48 / 5e4 + T8:.1f}"
    (tmp_path / "bad.json").write_text("{}")
    bad = subprocess.run([sys.executable, cli, str(tmp_path / "bad.json")], capture_output=True, text=True)
    assert bad.returncode == 2 and "not a mori-ep-link-trace" in bad.stderr


def test_bench_models_every_ranks_trace_and_saves_it(capsys, tmp_path):
    import ep_internode_bench as B

    path = str(tmp_path / "t.json")
    args = B.parse_args(["--nproc", "4", "--kernel-type", "InterNodeV1LL", "--save-trace", path])
    assert args.link_model  # implied by --save-trace
    # rank 0's request to rank 2 and rank 2's reply, recorded by their own emulators
    rows = [{"trace": [wr(0, 2, MB, time_ns=10)], "trace_dropped": 0}, {"trace": [], "trace_dropped": 0},
            {"trace": [wr(2, 0, 0, time_ns=20)], "trace_dropped": 0}, {"trace": [], "trace_dropped": 0}]
    merged = B.merged_trace(rows, args)
    assert [(e["src"], e["dst"]) for e in merged] == [(0, 2), (2, 0)]
    rows[3]["trace_dropped"] = 7
    assert B.merged_trace(rows, args) is None
    assert "rank: entries) 3: 7" in capsys.readouterr().out
    run = B.link_run([("dispatch fp8", "dispatch", merged), ("combine bf16 (fp8)", "combine", None)], args, 4, 2, 128)
    assert run["params"]["experts_per_rank"] == 64 and run["params"]["kernel_type"] == "InterNodeV1LL"
    lines = B.link_model_lines(run)
    assert lines[0].startswith("InterNodeV1LL, 2 nodes x 2, 128 tokens/rank: modelled link time")
    # no dependency under V1LL: the reply starts at 0 (rule 3 would start it at 22.2)
    assert lines[4].split()[:6] == ["dispatch", "fp8", "22.2", "20.0", "1.110", "-"]
    assert lines[4].split()[6:8] == ["24.4", "1.220"]
    assert lines[5] == "combine bf16 (fp8)   modelled: n/a (trace ring overflowed)"
    LM.save_run(path, run)
    assert LM.run_table(LM.load_run(path)) == lines


def test_bench_phase_table_sums_the_gpu_work():
    """--phases: per phase the median over ranks; the "(GPU work)" line adds only the V1 phases that
    wait for nobody (packing, forwarding, the sums); InterNode gets no such line."""
    import ep_internode_bench as B

    assert B.parse_args(["--phases", "3"]).phases == 3
    with pytest.raises(SystemExit):
        B.parse_args(["--phases", "-1"])

    def rank(f):
        return {"dispatch": {"launches": 3, "span_us": 10.0 * f,
                             "phases": [("v1_stage", 1.0 * f), ("scan", 2.0 * f), ("publish", 3.0 * f)]},
                "combine": {"launches": 3, "span_us": 12.0 * f,
                            "phases": [("v1_proxy_sums", 1.5 * f), ("v1_own_sums", 0.5 * f),
                                       ("v1_landing_wait", 9.0 * f), ("reduce", 2.0 * f)]}}

    every = [rank(1), rank(2), rank(4)]  # medians are rank(2)'s
    args = B.parse_args(["--kernel-type", "InterNodeV1", "--phases", "3"])
    lines = B.phase_lines([("bf16", every)], args, 4, 2, 128)
    rows = {tuple(ln.split()[:3]): ln.split()[3:5] for ln in lines[2:]}
    assert rows[("bf16", "dispatch", "scan")] == ["4.0", "8.0"]  # median, max over ranks
    work = {ln.split()[1]: ln.split()[4] for ln in lines if "(GPU work)" in ln}
    assert work == {"dispatch": "8.0", "combine": "8.0"}  # v1_stage 2 + publish 6; 3 + 1 + 4, no wait
    args = B.parse_args(["--kernel-type", "InterNode", "--phases", "3"])
    assert not any("(GPU work)" in ln for ln in B.phase_lines([("bf16", every)], args, 4, 2, 128))


def test_bench_v1_work_traffic():
    """--phases (V1): each GPU-work phase's bytes read plus written, from the routing (hand-counted
    for a 2 x 2 case)."""
    torch = pytest.importorskip("torch")
    import ep_internode_bench as B

    W, G, Epr, K = 4, 2, 1, 2
    IDX = torch.full((W, 3, K), -1, dtype=torch.int32)
    IDX[0] = torch.tensor([[0, 1], [2, 3], [1, 3]])  # own node only; remote only; both
    IDX[2] = torch.tensor([[0, 1], [2, -1], [1, 3]])  # rank 0's rail peer: 2, 0 and 1 rows for node 0
    got = B.v1_work_traffic(torch, IDX, [3, 0, 3, 0], 0, W, G, Epr, K, 16, 32, 0, 4)
    # record 48 B (row 16 + weights 8 -> 24, + indices 8 + position 4 + 2 per-PE slots 8 = 44 -> 48),
    # metadata beside a row 20 B, partial 48 B (combine row 32 + weights 8 -> 48)
    assert got == {"v1_stage": 2 * (16 + 48),            # tokens 1 and 2 go to node 1
                   "publish": 2 * 48 + 3 * (16 + 20),    # rail peer's 2 records, 3 rows delivered
                   "v1_proxy_sums": 3 * 32 + 2 * 48,     # 3 rows read, 2 partials written
                   "v1_own_sums": 3 * 32 + 2 * 32,       # 3 own-node rows read, tokens 0 and 2 written
                   "reduce": (1 + 2) * 32 + 2 * 32}      # tokens 1 (1 node) and 2 (2 nodes), 2 written


def test_bench_v1_gpu_work_against_the_copy_kernel():
    """--phases (V1): each GPU-work phase's GB/s (its bytes over its time, median over ranks)
    against the copy kernel's on the op's grid."""
    import ep_internode_bench as B

    def rank(f):
        return {"dispatch": {"launches": 3, "span_us": 10.0, "phases": [("v1_stage", 2.0 * f), ("publish", 4.0)]},
                "combine": {"launches": 3, "span_us": 12.0, "phases": [("reduce", 1.0)]},
                "traffic": {"v1_stage": 4e6, "publish": 2e6, "reduce": 1e6},
                "copy_dispatch": (24, 16, 1000.0 * f), "copy_combine": (24, 16, 500.0)}

    args = B.parse_args(["--kernel-type", "InterNodeV1", "--phases", "3"])
    lines = B.phase_lines([("bf16", [rank(1), rank(2), rank(4)])], args, 4, 2, 128)
    text = "\n".join(lines)
    assert "on the op's 24 x 16: 2000 GB/s" in text  # dispatch copy: median over ranks
    # v1_stage: 4 MB over 2, 4, 8 us -> 2000, 1000, 500 GB/s, median 1000 = 0.50 of 2000
    assert "v1_stage" in text and "4.0 MB read + written, 1000 GB/s = 0.50 of the copy kernel" in text
    assert "1.0 MB read + written, 1000 GB/s = 2.00 of the copy kernel" in text  # reduce vs 500
