"""The EP GPU correctness suites (tests/ops/ep_intranode_test.py, and tests/ops/ep_internode_test.py
between emulated nodes where that file exists) on any machine with a GPU; ranks share GPUs when
there are fewer than ranks.

Quick tier (marker `quick`): every kernel type once on QUICK_CASES: IntraNode and AsyncLL (which
runs as IntraNode on one node) with 2 ranks; InterNode, InterNodeV1 and InterNodeV1LL with 4 ranks
as 2 emulated nodes of 2.

Full tier (marker `full`), the short form: every case, the randomized stress with SHORT_ITERS
iterations and SHORT_ITERS back-to-back iterations; IntraNode with 2 and 4 ranks, AsyncLL with 4
both ways (one node, and 2 emulated nodes where it runs as InterNode), InterNode, InterNodeV1 and
InterNodeV1LL at 2 x 2. Cases that need a GPU per rank (push_combine_beside_full_gpu) run once more
with one rank (test_ep_one_rank_cases): the suites do not run them where ranks share a GPU.

A case the suite skips fails the test, as does a skip of the test itself while a GPU is visible
(conftest.needs_gpu); without a GPU it skips with the reason. The suite's case lines show as they
come (conftest.run_suite)."""

import logging
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import needs_gpu, run_suite, suite_counts

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INTRANODE = os.path.join(REPO, "tests", "ops", "ep_intranode_test.py")
INTERNODE = os.path.join(REPO, "tests", "ops", "ep_internode_test.py")
SHORT_ITERS = 200

# The quick tier's cases (the suite's -k, a name each): round trips of every dtype and combine
# mode, empty ranks, split-phase dispatch and combine, a CUDA-graph replay. Each applies to every
# kernel type and rank count of QUICK_RUNS.
QUICK_CASES = ("random_topk_seeds", "dtypes_and_combine_modes", "zero_tokens", "split_phase_dispatch",
               "split_phase_combine", "cuda_graph_replay")

# (suite, ranks, GPUs per emulated node or None for one node, kernel type or None for the suite's)
QUICK_RUNS = [(INTRANODE, 2, None, None), (INTRANODE, 2, None, "AsyncLL")]
FULL_RUNS = [(INTRANODE, 2, None, None), (INTRANODE, 4, None, None), (INTRANODE, 4, None, "AsyncLL")]
if os.path.exists(INTERNODE):
    QUICK_RUNS += [(INTERNODE, 4, 2, kt) for kt in (None, "InterNodeV1", "InterNodeV1LL")]
    FULL_RUNS += [(INTERNODE, 4, 2, kt) for kt in (None, "InterNodeV1", "InterNodeV1LL", "AsyncLL")]


def _run_id(run):
    suite, nranks, per_node, kernel_type = run
    name = os.path.basename(suite)[: -len("_test.py")]
    return (f"{name}-{nranks}ranks" + (f"-{per_node}pernode" if per_node else "") +
            (f"-{kernel_type}" if kernel_type else ""))


def _run(run, suite_env, extra_args, env_overrides=None, timeout=1800):
    """Runs one suite run; returns (passed, output, assertion tail). Fails on a failed or skipped
    case or a non-zero exit."""
    suite, nranks, per_node, kernel_type = run
    env = dict(suite_env)
    env.update(env_overrides or {})
    cmd = [sys.executable, suite, "--nproc", str(nranks), *extra_args]
    if per_node is not None:
        # The inter-node path runs between emulated nodes through the RDMA queue emulator.
        cmd += ["--gpu-per-node", str(per_node)]
        env.update(MORI_RDMA_EMULATE="1")
    if kernel_type is not None:
        cmd += ["--kernel-type", kernel_type]
    rc, out, tail = run_suite(cmd, env, timeout)
    passed, failed = suite_counts(out, tail)
    skipped = re.findall(r"^\[SKIP\] .*$", out, re.M)
    assert not skipped, "cases skipped on a GPU machine:\n" + "\n".join(skipped) + "\n" + tail
    assert failed == 0 and rc == 0, tail
    return passed, out, tail


@needs_gpu
@pytest.mark.quick
@pytest.mark.parametrize("run", QUICK_RUNS, ids=[_run_id(r) for r in QUICK_RUNS])
def test_ep_suite_quick(run, suite_env):
    ks = [a for k in QUICK_CASES for a in ("-k", k)]
    passed, out, tail = _run(run, suite_env, ks, timeout=600)
    assert "not applicable here" not in out, tail
    assert passed == len(QUICK_CASES), tail


@needs_gpu
@pytest.mark.full
@pytest.mark.parametrize("run", FULL_RUNS, ids=[_run_id(r) for r in FULL_RUNS])
def test_ep_suite_short(run, suite_env):
    passed, _, tail = _run(run, suite_env, ["--b2b-iters", str(SHORT_ITERS)],
                           env_overrides={"MORI_EP_STRESS_ITERS": str(SHORT_ITERS)})
    assert passed > 10, tail


@needs_gpu
@pytest.mark.full
@pytest.mark.parametrize("kernel_type", [None, "AsyncLL"], ids=["IntraNode", "AsyncLL"])
def test_ep_one_rank_cases(kernel_type, suite_env):
    """The cases the suites leave out where ranks share a GPU, with one rank (which has its GPU)."""
    passed, out, tail = _run((INTRANODE, 1, None, kernel_type), suite_env, ["-k", "push_combine_beside_full_gpu"],
                             timeout=600)
    assert passed == 1, tail
    assert "not applicable here" not in out, tail


def test_quick_cases_name_one_case_each():
    """Each of QUICK_CASES selects exactly one case of the suite (its -k matches substrings), and
    none selects the cases the suite runs around the others (use_before_shmem_init,
    use_after_finalize), so a quick run passes exactly len(QUICK_CASES) cases."""
    out = subprocess.run([sys.executable, INTRANODE, "--list"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    names = [n for n in out.stdout.split("\n") if n]
    for k in QUICK_CASES:
        assert [n for n in names if k in n] == [k], k
        assert k not in "use_before_shmem_init" and k not in "use_after_finalize", k


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
