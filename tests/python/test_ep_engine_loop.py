"""The engine-loop suite (tests/ops/ep_engine_loop_test.py): dispatch/combine step after step with
no host synchronisation, a CUDA graph replayed with new inputs, and a bad expert id every few
steps.

On a GPU machine, its short form (--short) with this run's rank count (MORI_TEST_NPES, else the
visible GPUs, at least 4; ranks share GPUs when there are fewer). Full tier (marker `full`): each
kernel type, IntraNode and AsyncLL on one node; InterNode, InterNodeV1, InterNodeV1LL and AsyncLL on
two or more emulated nodes (half the ranks per node, one per node for an odd count); engine_loop and
cuda_graph in one suite run per kernel type (test_engine_loop_short), bad_expert_id in another
(test_engine_loop_bad_expert_id: it checks that every rank reports one rank's bad id, which the
op's error reporting provides). Quick tier (marker `quick`): engine_loop and cuda_graph of
IntraNode. Each case of a run is a test of its own, `<run>::<case>`, and `<run>::suite_exit` checks
the run as a whole (suite_cases.py): a case fails when the suite fails it or does not run it, as
does a skip of the test itself while a GPU is visible (conftest.needs_gpu). The suite's case lines
show as they come (conftest.stream_suite).

Anywhere: the step plans (what every rank passes) are deterministic and cover the variety the suite
promises, and --list names the cases of a topology."""

import os
import subprocess
import sys

import ep_engine_loop_test as L
import pytest
import suite_cases

from conftest import GPU_COUNT, needs_gpu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPS = os.path.join(REPO, "tests", "ops")
SUITE = os.path.join(OPS, "ep_engine_loop_test.py")

RANKS = int(os.environ.get("MORI_TEST_NPES") or max(4, GPU_COUNT))
PER_NODE = RANKS // 2 if RANKS % 2 == 0 else 1
# (kernel type, ranks per emulated node or None for one node)
RUNS = [("IntraNode", None), ("AsyncLL", None)]
RUNS += [(kt, PER_NODE) for kt in ("InterNode", "InterNodeV1", "InterNodeV1LL", "AsyncLL")]
QUICK_RUNS = [("IntraNode", None)]
LOOP_CASES = ("engine_loop", "cuda_graph")
BAD_ID_CASES = ("bad_expert_id",)


def _run_id(run):
    kernel_type, per_node = run
    return f"{kernel_type}-{RANKS}ranks" + (f"-{per_node}pernode" if per_node else "")


def _suite_run(run, kinds):
    """A suite_cases.Run of the short form of `run` on the cases `kinds` of its kernel type (which
    its topology must allow: the suite's not running one fails its test)."""
    kernel_type, per_node = run
    argv = [SUITE, "--nproc", str(RANKS), "--short", "--kernel-type", kernel_type]
    env = {}
    if per_node is not None:
        argv += ["--gpu-per-node", str(per_node)]
        env.update(MORI_RDMA_EMULATE="1")
    return suite_cases.Run(_run_id(run), tuple(argv), tuple(L.case_names([kernel_type], kinds)), kinds,
                           tuple(sorted(env.items())))


@needs_gpu
@pytest.mark.quick
@pytest.mark.parametrize("case", suite_cases.params([_suite_run(r, LOOP_CASES) for r in QUICK_RUNS]))
def test_engine_loop_quick(case, suite_case):
    """engine_loop and cuda_graph of IntraNode, short form."""
    suite_case()


@needs_gpu
@pytest.mark.full
@pytest.mark.parametrize("case", suite_cases.params([_suite_run(r, LOOP_CASES) for r in RUNS]))
def test_engine_loop_short(case, suite_case):
    """engine_loop and cuda_graph of one kernel type, short form."""
    suite_case()


@needs_gpu
@pytest.mark.full
@pytest.mark.parametrize("case", suite_cases.params([_suite_run(r, BAD_ID_CASES) for r in RUNS]))
def test_engine_loop_bad_expert_id(case, suite_case):
    """bad_expert_id of one kernel type, short form: every rank raises the same error for the
    step with one rank's bad id, and the next step is right."""
    suite_case()


# --- no GPU: the plans and the case list ----------------------------------------------------------
def _ops():
    return [L.OpShape(128, 8, None, True, True), L.OpShape(384, 6, None, False, False),
            L.OpShape(64, 4, "fp8_direct_cast", True, True)]


def test_plans_are_deterministic_and_cover_the_variety():
    ops = _ops()
    W, steps = 4, 300
    seen = {k: set() for k in ("op", "kind", "H", "cname", "idx", "routing", "weights", "scales", "split_d",
                               "split_c", "mode", "wmode", "launch", "tokens")}
    for s in range(steps):
        p = L.step_plan(7, s, W, 16, ops)
        assert p.__dict__ == L.step_plan(7, s, W, 16, ops).__dict__  # every rank computes the same plan
        o = ops[p.op]
        for k in ("op", "kind", "cname", "idx", "routing", "weights", "scales", "split_d", "split_c"):
            seen[k].add(getattr(p, k))
        seen["H"].add(p.H)
        assert p.H <= L.HIDDEN and p.H % L.BLOCK == 0
        if p.quant:
            assert p.dname == "bf16" and p.H % 128 == 0 and not p.scales
        assert not (p.split_d and not o.split_dispatch) and not (p.split_c and not o.split_combine)
        assert p.bad is None
        for r in range(W):
            assert 0 <= p.Ts[r] <= o.M
            seen["tokens"].add("0" if p.Ts[r] == 0 else "M" if p.Ts[r] == o.M else "between")
            seen["mode"].add(p.mode[r])
            if p.mode[r] == "direct":  # the dispatch output is a combine input in its own dtype only
                assert p.out_dname == p.cname
            seen["wmode"].add(p.wmode[r])
            seen["launch"].update((p.d_launch[r], p.r_launch[r], p.c_launch[r]))
    assert seen["op"] == {0, 1, 2}
    assert seen["kind"] == set(L.KINDS)
    assert seen["H"] == set(L.H_PLAIN) | set(L.H_QUANT)
    assert seen["cname"] == {"bf16", "fp16"} and seen["idx"] == {"int32", "int64"}
    assert seen["routing"] == set(L.ROUTINGS)
    for k in ("weights", "scales", "split_d", "split_c"):
        assert seen[k] == {False, True}, k
    assert seen["mode"] == set(L.MODES) and seen["wmode"] == set(L.WMODES)
    assert seen["launch"] == set(L.launch_shapes(W, 16))
    assert seen["tokens"] == {"0", "M", "between"}
    # another seed, other plans
    assert [L.step_plan(8, s, W, 16, ops).__dict__ for s in range(10)] != [L.step_plan(7, s, W, 16, ops).__dict__
                                                                          for s in range(10)]


def test_bad_id_plans():
    ops = _ops()[:1]
    W = 4
    assert L.bad_steps(300, 50) == [49, 99, 149, 199, 249]  # each followed by a step
    assert L.bad_steps(30, 10) == [9, 19]
    assert L.bad_steps(50, 50) == []
    ranks = set()
    for s in range(200):
        p = L.step_plan(3, s, W, 16, ops, bad=True)
        b, t, k, v = p.bad
        ranks.add(b)
        assert 0 <= t < p.Ts[b] and 0 <= k < ops[0].K
        lim = 2**31 if p.idx == "int32" else 2**63
        assert (v < -1 or v >= W * L.EPR) and -lim <= v < lim
    assert ranks == set(range(W))


def test_list_names_the_cases_of_a_topology():
    def names(*args):
        out = subprocess.run([sys.executable, SUITE, "--list", *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.split("\n")

    one_node = names("--nproc", "4")
    assert [n for n in one_node if n.startswith("engine_loop[")] == [
        f"engine_loop[{kt}]" for kt in ("IntraNode", "InterNode", "InterNodeV1", "InterNodeV1LL", "AsyncLL")]
    two_nodes = names("--nproc", "4", "--gpu-per-node", "2", "-k", "bad_expert_id")
    assert "bad_expert_id[IntraNode]" not in two_nodes and "bad_expert_id[AsyncLL]" in two_nodes
    assert all(n.startswith("bad_expert_id[") or n.startswith("(not applicable") or not n for n in two_nodes)
    assert names("--nproc", "4", "--kernel-type", "AsyncLL")[:3] == [
        "engine_loop[AsyncLL]", "cuda_graph[AsyncLL]", "bad_expert_id[AsyncLL]"]
