"""The EP GPU correctness suites (tests/ops/ep_intranode_test.py, and tests/ops/ep_internode_test.py
between emulated nodes where that file exists) on any machine with a GPU; ranks share GPUs when
there are fewer than ranks. Each run of a suite is one suite process; each of its cases is a test
of its own, `<run>::<case>`, and `<run>::suite_exit` checks the run as a whole (suite_cases.py).

Quick tier (marker `quick`, test_ep_suite_quick): every kernel type once on QUICK_CASES, in two
suite runs that test their kernel types in turn in the same ranks (one start-up each; a case of
type T is `<case>[T]`): IntraNode and AsyncLL (which runs as IntraNode on one node) with 2 ranks;
InterNode, InterNodeV1 and InterNodeV1LL with 4 ranks as 2 emulated nodes of 2.

Full tier (marker `full`, test_ep_suite_short), the short form: every case, the randomized stress
with SHORT_ITERS iterations and SHORT_ITERS back-to-back iterations; IntraNode with 2 and 4 ranks,
AsyncLL with 4 both ways (one node, and 2 emulated nodes where it runs as InterNode), InterNode,
InterNodeV1 and InterNodeV1LL at 2 x 2. A case that does not apply to a run (the suite's
NOT_APPLICABLE: no RDMA on one node, no push combine, ranks sharing a GPU, the RDMA emulator) is
not one of its tests. Cases that need a GPU per rank (push_combine_beside_full_gpu) run once more
with one rank (test_ep_one_rank_cases): the suites do not run them where ranks share a GPU.

A case fails when the suite fails or skips it or does not run it, as does a skip of the test
itself while a GPU is visible (conftest.needs_gpu); without a GPU every test skips with the reason.
The suite's case lines show as they come (conftest.stream_suite)."""

import dataclasses
import logging
import os
import subprocess
import sys
import time

import ep_intranode_test as E
import mori.ops
import pytest
import suite_cases

from conftest import GPU_COUNT, needs_gpu, run_suite, suite_counts

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INTRANODE = os.path.join(REPO, "tests", "ops", "ep_intranode_test.py")
INTERNODE = os.path.join(REPO, "tests", "ops", "ep_internode_test.py")
SHORT_ITERS = 200

# The quick tier's cases (the suite's -k, a name each): round trips of every dtype and combine
# mode, empty ranks, split-phase dispatch and combine, a CUDA-graph replay, block and warp counts
# given per call (small grids: the dispatch's pool of rows claimed after the shares). Each applies
# to every kernel type and rank count of QUICK_RUNS.
QUICK_CASES = ("random_topk_seeds", "dtypes_and_combine_modes", "zero_tokens", "split_phase_dispatch",
               "split_phase_combine", "cuda_graph_replay", "launch_shapes")

# (suite, ranks, GPUs per emulated node or None for one node, kernel types (a --kernel-type each, in
# turn in the same ranks) or None for the suite's default type)
QUICK_RUNS = [(INTRANODE, 2, None, ("IntraNode", "AsyncLL"))]
FULL_RUNS = [(INTRANODE, 2, None, None), (INTRANODE, 4, None, None), (INTRANODE, 4, None, ("AsyncLL",))]
if os.path.exists(INTERNODE):
    QUICK_RUNS += [(INTERNODE, 4, 2, ("InterNode", "InterNodeV1", "InterNodeV1LL"))]
    FULL_RUNS += [(INTERNODE, 4, 2, kt) for kt in (None, ("InterNodeV1",), ("InterNodeV1LL",), ("AsyncLL",))]
ONE_RANK_RUNS = [(INTRANODE, 1, None, None), (INTRANODE, 1, None, ("AsyncLL",))]
ONE_RANK_CASES = ("push_combine_beside_full_gpu",)
# The pull combine's two ways to take an external input (every op on the pull combine,
# MORI_EP_COMBINE_PUSH=0: the small configs of these cases would push): a copy kernel of its own,
# beside the combine kernel with programmatic launches (MORI_EP_COMBINE_PRECOPY=1, the default), or
# the combine's own blocks (0). Cases:
# external inputs of every dtype and weights mode, the too-short input (the copy's check, no wait),
# combines back to back (no dispatch between), graph replays.
PRECOPY_RUN = (INTRANODE, 2, None, ("IntraNode",))
PRECOPY_CASES = ("dtypes_and_combine_modes", "combine_input_too_short", "combine_back_to_back",
                 "cuda_graph_replay")
PRECOPY_ENVS = {"precopy-pull": {"MORI_EP_COMBINE_PRECOPY": "1", "MORI_EP_COMBINE_PUSH": "0"},
                "in-kernel-copy-pull": {"MORI_EP_COMBINE_PRECOPY": "0", "MORI_EP_COMBINE_PUSH": "0"}}


def _run_id(run):
    suite, nranks, per_node, kernel_types = run
    name = os.path.basename(suite)[: -len("_test.py")]
    return (f"{name}-{nranks}ranks" + (f"-{per_node}pernode" if per_node else "") +
            (f"-{'+'.join(kernel_types)}" if kernel_types else ""))


def _kernel_types(run):
    """The kernel types `run` tests, in order (the suite's default where it names none)."""
    suite, _, _, kernel_types = run
    return tuple(kernel_types or ("InterNode" if suite == INTERNODE else "IntraNode",))


def _topology(run, kernel_type):
    """The suite's Topology of `kernel_type` in `run` on this machine: the kernel type its configs
    run as (mori's config says), and as many GPUs as visible here (without a GPU, where the tests
    skip: one per rank)."""
    suite, nranks, per_node, _ = run
    gpn = per_node or nranks
    # the config the suite's worker makes to learn what its configs run as
    cfg = mori.ops.EpDispatchCombineConfig(rank=0, world_size=nranks, gpu_per_node=gpn, kernel_type=kernel_type,
                                           hidden_dim=256, scale_dim=0, scale_type_size=0, max_token_type_size=2,
                                           max_num_inp_token_per_rank=8, num_experts_per_rank=1,
                                           num_experts_per_token=1)
    return E.Topology(cfg.runs_as.name, nranks, GPU_COUNT or nranks, gpn < nranks)


def _suite_run(run, ks, args=(), env=(), timeout=1800, only_applicable=True):
    """A suite_cases.Run of `run` with -k `ks`. Its cases: those -k selects (named as the suite
    reports them: `case[type]` where the run has several kernel types), less those that do not
    apply to the run where only_applicable (else the suite's not running one fails its test)."""
    suite, nranks, per_node, kernel_types = run
    argv = [suite, "--nproc", str(nranks), *args]
    env = dict(env)
    if per_node is not None:
        # The inter-node path runs between emulated nodes through the RDMA queue emulator.
        argv += ["--gpu-per-node", str(per_node)]
        env.update(MORI_RDMA_EMULATE="1")
    for kt in kernel_types or ():
        argv += ["--kernel-type", kt]
    selected = E.run_cases(ks, _kernel_types(run))
    skip = E.run_not_applicable(selected, lambda kt: _topology(run, kt)) if only_applicable else {}
    cases = [c[0] for c in selected if c[0] not in skip]
    return suite_cases.Run(_run_id(run), tuple(argv), tuple(cases), tuple(ks), tuple(sorted(env.items())),
                           timeout)


QUICK = [_suite_run(r, QUICK_CASES, timeout=600, only_applicable=False) for r in QUICK_RUNS]
SHORT = [_suite_run(r, (), args=("--b2b-iters", str(SHORT_ITERS)), env={"MORI_EP_STRESS_ITERS": str(SHORT_ITERS)})
         for r in FULL_RUNS]
ONE_RANK = [_suite_run(r, ONE_RANK_CASES, timeout=600, only_applicable=False) for r in ONE_RANK_RUNS]
PRECOPY = [dataclasses.replace(r, id=f"{r.id}-{name}") for name, env in PRECOPY_ENVS.items()
           for r in [_suite_run(PRECOPY_RUN, PRECOPY_CASES, env=env, timeout=600, only_applicable=False)]]


@needs_gpu
@pytest.mark.quick
@pytest.mark.parametrize("case", suite_cases.params(QUICK))
def test_ep_suite_quick(case, suite_case):
    suite_case()


@needs_gpu
@pytest.mark.full
@pytest.mark.parametrize("case", suite_cases.params(SHORT))
def test_ep_suite_short(case, suite_case):
    suite_case()


@needs_gpu
@pytest.mark.full
@pytest.mark.parametrize("case", suite_cases.params(ONE_RANK))
def test_ep_one_rank_cases(case, suite_case):
    """The cases the suites leave out where ranks share a GPU, with one rank (which has its GPU)."""
    suite_case()


@needs_gpu
@pytest.mark.quick
@pytest.mark.parametrize("case", suite_cases.params(PRECOPY))
def test_ep_suite_precopy(case, suite_case):
    """External combine inputs of the pull combine, copied by a kernel of their own or by the
    combine kernel (MORI_EP_COMBINE_PRECOPY 1 and 0)."""
    suite_case()


def test_quick_cases_name_one_case_each():
    """Each of QUICK_CASES selects exactly one case of the suite (its -k matches substrings; --list
    names every case, use_before_shmem_init and use_after_finalize included), so a quick run
    reports exactly QUICK_CASES."""
    out = subprocess.run([sys.executable, INTRANODE, "--list"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    names = [n for n in out.stdout.split("\n") if n]
    assert names[0] == "use_before_shmem_init" and names[-1] == "use_after_finalize", names
    for k in QUICK_CASES:
        assert [n for n in names if k in n] == [k], k
    assert sorted(E.selected_cases(QUICK_CASES)) == sorted(QUICK_CASES)


@pytest.mark.parametrize("run", QUICK + SHORT + ONE_RANK, ids=lambda r: r.id)
def test_runs_name_their_cases_as_the_suite_does(run):
    """A run's tests are the names its suite command lists (--list with the run's arguments: the
    case names, `case[type]` where it tests several kernel types), in the suite's order, less the
    cases that do not apply to it; each quick run has QUICK_CASES for each of its kernel types."""
    out = subprocess.run([sys.executable, *run.command(set(run.cases)), "--list"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, **dict(run.env)})
    assert out.returncode == 0, out.stdout + out.stderr
    listed = [n for n in out.stdout.split("\n") if n]
    assert [n for n in listed if n in run.cases] == list(run.cases)
    if run in QUICK:
        types = [a for i, a in enumerate(run.argv) if run.argv[i - 1] == "--kernel-type"]
        assert len(types) > 1
        assert listed == [f"{k}[{kt}]" for kt in types for k in E.selected_cases(QUICK_CASES)]
        assert list(run.cases) == listed


def test_quick_runs_cover_every_kernel_type_once():
    types = [a for r in QUICK for i, a in enumerate(r.argv) if r.argv[i - 1] == "--kernel-type"]
    want = set(E.KERNEL_TYPES) if os.path.exists(INTERNODE) else {"IntraNode", "AsyncLL"}
    assert sorted(types) == sorted(want)


# --- no GPU: conftest.run_suite, which runs the suites above ----------------------------------------
def test_run_suite_logs_each_line_while_the_suite_runs(tmp_path):
    """The child prints a line, then waits for a file that a log handler creates when that line is
    logged: it finishes only if run_suite logs its lines while it runs (not at its end)."""
    go = tmp_path / "go"
    child = ("import os, sys, time\n"
             "print('[PASS] first (0.1 s)', flush=True)\n"
             "t = time.monotonic()\n"
             f"while not os.path.exists({str(go)!r}) and time.monotonic() - t < 60:\n"
             "    time.sleep(0.05)\n"
             f"print('[PASS] second' if os.path.exists({str(go)!r}) else 'the first line was not logged', "
             "flush=True)\n"
             "print('oops', file=sys.stderr, flush=True)\n"
             "print('2 passed, 0 failed', flush=True)\n")
    seen = []

    class Handler(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())
            if "[PASS] first" in record.getMessage():
                go.touch()

    log = logging.getLogger("mori.tests")
    handler = Handler()
    log.addHandler(handler)
    try:
        rc, out, tail = run_suite([sys.executable, "-c", child], dict(os.environ), 120)
    finally:
        log.removeHandler(handler)
    assert rc == 0, tail
    assert suite_counts(out, tail) == (2, 0)
    assert "[PASS] second" in out and "oops" in out  # stderr comes with stdout
    assert seen[0].startswith("$ ") and seen[1:] == ["[PASS] first (0.1 s)", "[PASS] second", "oops", "2 passed, 0 failed"]
    assert tail.startswith("$ " + sys.executable)


@pytest.mark.full  # waits out a 10 s timeout
def test_run_suite_kills_the_suite_and_its_processes_past_the_timeout(tmp_path):
    """A suite still running at its timeout fails the test; it and the processes it started (the
    ranks) are killed."""
    pid_file = tmp_path / "pid"
    child = ("import subprocess, sys, time\n"
             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
             f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
             "print('started', flush=True)\n"
             "time.sleep(600)\n")
    # 10 s: the child and its child start well within it, even on a loaded machine
    with pytest.raises(pytest.fail.Exception, match="still running after 10 s: killed"):
        run_suite([sys.executable, "-c", child], dict(os.environ), 10)
    grandchild = int(pid_file.read_text())
    # Killed, it stays a zombie until init reaps it; a signal is acted on when the process next
    # runs, so a live state (S/R) may be seen for a moment: poll, bounded.
    state = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{grandchild}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return  # gone
        if state == "Z":
            return
        time.sleep(0.05)
    pytest.fail(f"the suite's child {grandchild} outlived the timeout by 30 s (state {state})")


def test_suite_counts_needs_the_summary_line():
    assert suite_counts("x\n[PASS] a\n3 passed, 1 failed\n", "tail") == (3, 1)
    with pytest.raises(AssertionError, match="the tail"):
        suite_counts("3 passed, 1 failed, 2 skipped\n", "the tail")
