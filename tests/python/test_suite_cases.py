"""suite_cases.py and conftest's suite_case fixture, which make each case of a GPU suite run a test
of its own: the reading of a suite's output (passed, failed, skipped, not applicable and missing
cases, a crash, a timeout), and, in a child pytest with a stand-in suite and a stand-in `mori` that
reports a GPU, the tests they make: outcomes, one suite process per run, the -k of a partial
selection, and the case's suite time as the test's duration. The EP suite's case selection
(selected_cases, not_applicable) too. Needs no GPU."""

import os
import shutil
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import ep_intranode_test as E
import pytest

import suite_cases as S

HERE = os.path.dirname(os.path.abspath(__file__))

RUN = S.Run("r", ("suite.py", "--nproc", "2"), ("a", "b", "c", "d", "e"), ks=("x",))

OUT = """mori EP IntraNode suite: 2 ranks
(not applicable here, not run: d: ranks share a GPU, so other ranks' kernels hold SMs too (run it with --nproc 1))
[PASS] a (6.4 s)
rank 1: Traceback: something
[FAIL] b (0.3 s): rank 1: 3 rows differ | rank 0: device error
  a second line of b's message
[SKIP] c: needs 2 GPUs
(1 skipped)
1 passed, 1 failed
"""


def verdict(outcome, name):
    return S.verdict(outcome, S.SuiteCase(RUN, name))


def test_cases_of_a_run_that_ends():
    o = S.Outcome("python3 suite.py --nproc 2", 1, OUT, 60)
    assert o.summary == (1, 1)
    assert verdict(o, "a") == (True, "", 6.4)
    ok, msg, secs = verdict(o, "b")
    assert not ok and secs == 0.3
    assert msg.startswith("b failed: rank 1: 3 rows differ | rank 0: device error\n")
    # the output since the previous case's line, its line, and what follows until the next case
    assert "rank 1: Traceback: something\n[FAIL] b (0.3 s)" in msg and "a second line of b's message" in msg
    assert "[PASS] a" not in msg and "[SKIP] c" not in msg
    ok, msg, secs = verdict(o, "c")
    assert not ok and secs is None and msg.startswith("c: the suite skipped it on a GPU machine: needs 2 GPUs")
    ok, msg, _ = verdict(o, "d")
    assert not ok and msg.startswith("d: not reported, the suite found it not applicable here: ranks share a GPU, "
                                     "so other ranks' kernels hold SMs too (run it with --nproc 1)\n$ python3 suite.py")
    ok, msg, _ = verdict(o, "e")
    assert not ok and msg.startswith("e: not reported, the suite ran to its end (exit 1) without it\n")
    assert msg.endswith(OUT[-S.TAIL_CHARS:])
    # exit 1 is the failed case's, the summary agrees with the case lines: the run is sound
    assert verdict(o, S.RUN_CASE) == (True, "", None)


def test_a_crash_fails_the_cases_after_it_and_the_run():
    out = "[PASS] a (1.0 s): fine\n[PASS] b (2.5 s)\nSegmentation fault (core dumped)\n"
    o = S.Outcome("suite.py", 139, out, 60)
    assert verdict(o, "a") == (True, "fine", 1.0) and verdict(o, "b")[0]
    ok, msg, _ = verdict(o, "c")
    assert not ok and msg.startswith("c: not reported, the suite ended (exit 139) before it\n$ suite.py\n")
    assert "Segmentation fault" in msg
    ok, msg, _ = verdict(o, S.RUN_CASE)
    assert not ok and msg.startswith('exit 139 without the summary line "N passed, M failed"\n$ suite.py\n')


def test_a_timeout_fails_the_cases_after_it_and_the_run():
    o = S.Outcome("suite.py", None, "[PASS] a (1.0 s)\nTIMEOUT b\n", 30)
    assert verdict(o, "a")[0]
    ok, msg, _ = verdict(o, "b")
    assert not ok and "the suite was still running after 30 s and was killed before it finished" in msg
    assert "TIMEOUT b" in msg
    ok, msg, _ = verdict(o, S.RUN_CASE)
    assert not ok and msg.startswith("still running after 30 s: killed\n")


@pytest.mark.parametrize("rc,out,problem", [
    (1, "[PASS] a (1.0 s)\n1 passed, 0 failed\n", "exit 1 with 0 failed case(s)"),
    (0, "[FAIL] a (1.0 s): bad\n0 passed, 1 failed\n", "exit 0 with 1 failed case(s)"),
    (0, "[PASS] a (1.0 s)\n2 passed, 0 failed\n", "its summary says 2 passed, 0 failed; its case lines 1 and 0"),
    (0, "[PASS] a (1.0 s)\n[PASS] z (1.0 s)\n2 passed, 0 failed\n", "it reported cases that are not the run's: z"),
], ids=["exit-1-nothing-failed", "exit-0-a-case-failed", "summary-disagrees", "a-case-not-the-runs"])
def test_a_run_that_disagrees_with_itself_fails_as_a_whole(rc, out, problem):
    o = S.Outcome("suite.py", rc, out, 60)
    ok, msg, _ = verdict(o, S.RUN_CASE)
    assert not ok and msg.split("\n")[0] == problem


def test_case_lines_of_the_suites():
    o = S.Outcome("s", 0, "[PASS] engine_loop[AsyncLL] (12.0 s): 30 steps (each of the 4 ranks)\n"
                         "[PASS] cuda_graph[AsyncLL] (3 s)\n[FAIL] bad_expert_id[AsyncLL] (0.5 s):\n"
                         "[PASS]  not a case\n", 60)
    assert {n: (c.status, c.seconds, c.detail) for n, c in o.cases.items()} == {
        "engine_loop[AsyncLL]": ("PASS", 12.0, "30 steps (each of the 4 ranks)"),
        "cuda_graph[AsyncLL]": ("PASS", 3.0, ""),
        "bad_expert_id[AsyncLL]": ("FAIL", 0.5, "")}


def test_params_and_the_command_of_a_selection():
    assert [p.id for p in S.params([RUN])] == ["r::a", "r::b", "r::c", "r::d", "r::e", "r::suite_exit"]
    assert [p.values[0] for p in S.params([RUN])][1] == S.SuiteCase(RUN, "b")
    base = ["suite.py", "--nproc", "2"]
    assert RUN.command({"a", "b", "c", "d", "e", S.RUN_CASE}) == base + ["-k", "x"]
    assert RUN.command({S.RUN_CASE}) == base + ["-k", "x"]
    assert RUN.command({"c", "a", S.RUN_CASE}) == base + ["-k", "a", "-k", "c"]
    assert S.Run("all", ("s",), ("a", "b")).command({"a", "b"}) == ["s"]


def test_ep_suite_case_selection():
    names = E.selected_cases(())
    assert names[0] == E.BEFORE_INIT and names[-1] == E.AFTER_FINALIZE and names[1:-1] == [n for n, _ in E.CASES]
    assert E.selected_cases(("bad_inputs",)) == ["bad_inputs", "standard_moe_bad_inputs"]
    assert E.selected_cases(("use_",)) == [E.BEFORE_INIT, E.AFTER_FINALIZE]
    push, key = "push_combine_beside_full_gpu", "bad_rdma_key_remote_error"
    assert E.not_applicable(names, E.Topology("IntraNode", 1, 1, False)) == {key: "IntraNode has no RDMA"}
    assert E.not_applicable(names, E.Topology("IntraNode", 2, 1, False))[push].startswith("ranks share a GPU")
    assert E.not_applicable(names, E.Topology("InterNode", 4, 4, True)) == {
        push: "the RDMA emulator's copies need free SMs"}
    assert E.not_applicable(names, E.Topology("InterNodeV1LL", 4, 8, False)) == {
        push: "InterNodeV1LL has no push combine"}
    out = subprocess.run([sys.executable, E.__file__, "--list", "-k", "bad_inputs"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["bad_inputs", "standard_moe_bad_inputs"], out


def test_ep_suite_cases_of_several_kernel_types():
    """A run of one kernel type names its cases plainly (as it always did); a run of several names
    each `case[type]`, each type's cases in turn between every type's use_before_shmem_init and
    use_after_finalize, a -k selecting by those names; not_applicable holds per type."""
    assert E.case_names((), ["InterNodeV1"]) == E.selected_cases(())
    assert E.case_names(("bad_inputs",), ["AsyncLL"]) == ["bad_inputs", "standard_moe_bad_inputs"]
    two = ["IntraNode", "AsyncLL"]
    names = E.case_names((), two)
    n = len(E.CASES)
    assert names[:2] == [f"{E.BEFORE_INIT}[IntraNode]", f"{E.BEFORE_INIT}[AsyncLL]"]
    assert names[2:2 + n] == [f"{c}[IntraNode]" for c, _ in E.CASES]
    assert names[2 + n:2 + 2 * n] == [f"{c}[AsyncLL]" for c, _ in E.CASES]
    assert names[2 + 2 * n:] == [f"{E.AFTER_FINALIZE}[IntraNode]", f"{E.AFTER_FINALIZE}[AsyncLL]"]
    assert E.case_names(("zero_tokens",), two) == ["zero_tokens[IntraNode]", "zero_tokens[AsyncLL]"]
    assert E.case_names(("zero_tokens[AsyncLL]", "cuda_graph_replay[IntraNode]"), two) == [
        "cuda_graph_replay[IntraNode]", "zero_tokens[AsyncLL]"]
    assert E.run_cases(("zero_tokens",), two) == [("zero_tokens[IntraNode]", "zero_tokens", "IntraNode"),
                                                  ("zero_tokens[AsyncLL]", "zero_tokens", "AsyncLL")]
    # a push combine applies to InterNode between emulated nodes only without the emulator; V1 types have none
    three = ["InterNode", "InterNodeV1", "InterNodeV1LL"]
    cases = E.run_cases(("push_combine", "bad_rdma"), three)
    topo = {"InterNode": E.Topology("InterNode", 4, 8, False), "InterNodeV1": E.Topology("InterNodeV1", 4, 8, False),
            "InterNodeV1LL": E.Topology("InterNodeV1LL", 4, 8, False)}
    assert E.run_not_applicable(cases, topo.get) == {
        "push_combine_beside_full_gpu[InterNodeV1]": "InterNodeV1 has no push combine",
        "push_combine_beside_full_gpu[InterNodeV1LL]": "InterNodeV1LL has no push combine"}
    topo = {"IntraNode": E.Topology("IntraNode", 2, 2, False), "AsyncLL": E.Topology("IntraNode", 2, 2, False)}
    assert E.run_not_applicable(E.run_cases(("bad_rdma",), two), topo.get) == {
        "bad_rdma_key_remote_error[IntraNode]": "IntraNode has no RDMA",
        "bad_rdma_key_remote_error[AsyncLL]": "IntraNode has no RDMA"}
    out = subprocess.run([sys.executable, E.__file__, "--list", "-k", "zero_tokens", "--kernel-type", "IntraNode",
                          "--kernel-type", "AsyncLL", "--kernel-type", "IntraNode"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["zero_tokens[IntraNode]", "zero_tokens[AsyncLL]"], out
    out = subprocess.run([sys.executable, E.__file__, "--list", "-k", "zero_tokens", "--kernel-type", "AsyncLL"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["zero_tokens"], out


# --- the fixture, in a child pytest -----------------------------------------------------------------
FAKE_MORI = """
def device_info():
    return {"count": 1, "error": None, "devices": []}
"""

# The stand-in suite: logs its arguments, prints what its first argument names, and exits.
FAKE_SUITE = r"""
import sys, time
open(sys.argv[2], "a").write(" ".join(sys.argv[1:]) + "\n")
kind = sys.argv[1]
if kind == "fake":
    print("(not applicable here, not run: d: no RDMA)")
    print("[PASS] a (6.4 s): fine", flush=True)
    print("rank 1 said why", flush=True)
    print("[FAIL] b (0.3 s): rank 1: 3 rows differ")
    print("[SKIP] c: needs 2 GPUs")
    print("1 passed, 1 failed")
    sys.exit(1)
if kind == "crash":
    print("[PASS] a (1.0 s)")
    print("Segmentation fault")
    sys.exit(139)
print("[PASS] a (1.0 s)", flush=True)
time.sleep(60)
"""

TESTS = """
import os
import pytest
import suite_cases as S
from conftest import needs_gpu

HERE = os.path.dirname(os.path.abspath(__file__))
SUITE, LOG = os.path.join(HERE, "fake_suite.py"), os.path.join(HERE, "runs.log")
RUNS = [S.Run("fake", (SUITE, "fake", LOG), ("a", "b", "c", "d", "e")),
        S.Run("crash", (SUITE, "crash", LOG), ("a", "b"), ks=("a", "b")),
        S.Run("slow", (SUITE, "slow", LOG), ("a", "b"), timeout=3)]

@needs_gpu
@pytest.mark.parametrize("case", S.params(RUNS))
def test_case(case, suite_case):
    suite_case()
"""


def run_child(tmp_path, *args):
    for d in ("mori", "torch"):
        (tmp_path / "pkg" / d).mkdir(parents=True, exist_ok=True)
    (tmp_path / "pkg" / "mori" / "__init__.py").write_text(textwrap.dedent(FAKE_MORI))
    (tmp_path / "pkg" / "mori" / "_C.so").write_text("")  # conftest takes a package with _C as built
    (tmp_path / "pkg" / "torch" / "__init__.py").write_text("")  # suite_env needs a torch to find
    shutil.copy(os.path.join(HERE, "conftest.py"), tmp_path / "conftest.py")
    shutil.copy(os.path.join(HERE, "suite_cases.py"), tmp_path / "suite_cases.py")
    (tmp_path / "fake_suite.py").write_text(FAKE_SUITE)
    (tmp_path / "test_cases.py").write_text(textwrap.dedent(TESTS))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MORI_")}
    env.update(PYTHONPATH=str(tmp_path / "pkg"), PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider",
                        f"--junitxml={tmp_path / 'report.xml'}", *args, str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout + r.stderr


def outcomes(out):
    """{test id: outcome} of the verbose report ("test_cases.py::test_case[fake::a] PASSED [ 9%]")."""
    found = {}
    for line in out.splitlines():
        if line.startswith("test_cases.py::test_case[") and " " in line:
            name, outcome = line.split()[:2]
            found[name[len("test_cases.py::test_case["):-1]] = outcome
    return found


def test_each_case_is_a_test_and_each_run_one_suite_process(tmp_path):
    rc, out = run_child(tmp_path)
    assert rc == 1, out
    assert outcomes(out) == {
        "fake::a": "PASSED", "fake::b": "FAILED", "fake::c": "FAILED", "fake::d": "FAILED", "fake::e": "FAILED",
        "fake::suite_exit": "PASSED",
        "crash::a": "PASSED", "crash::b": "FAILED", "crash::suite_exit": "FAILED",
        "slow::a": "PASSED", "slow::b": "FAILED", "slow::suite_exit": "FAILED"}, out
    # one suite process per run, with the run's own -k where every case is selected
    suite = str(tmp_path / "fake_suite.py")
    log = str(tmp_path / "runs.log")
    assert (tmp_path / "runs.log").read_text().splitlines() == [
        f"fake {log}", f"crash {log} -k a -k b", f"slow {log}"]
    for why in ("b failed: rank 1: 3 rows differ", "rank 1 said why",
                "c: the suite skipped it on a GPU machine: needs 2 GPUs",
                "d: not reported, the suite found it not applicable here: no RDMA",
                "e: not reported, the suite ran to its end (exit 1) without it",
                "b: not reported, the suite ended (exit 139) before it",
                'exit 139 without the summary line "N passed, M failed"',
                "b: not reported, the suite was still running after 3 s and was killed before it finished",
                "still running after 3 s: killed", f"$ {sys.executable} {suite} slow"):
        assert why in out, (why, out)
    # the JUnit report: each case's suite time is its duration and a property
    cases = {c.get("name"): c for c in ET.parse(tmp_path / "report.xml").getroot().iter("testcase")}
    b = cases["test_case[fake::b]"]
    assert 0.3 <= float(b.get("time")) < 2.0
    assert [(p.get("name"), p.get("value")) for p in b.iter("property")] == [("suite_seconds", "0.3")]
    assert float(cases["test_case[fake::a]"].get("time")) >= 6.4
    assert [p.get("value") for p in cases["test_case[fake::a]"].iter("property")] == ["6.4"]


def test_a_partial_selection_runs_those_cases(tmp_path):
    rc, out = run_child(tmp_path, "-k", "fake::a or fake::c")
    assert rc == 1, out
    assert outcomes(out) == {"fake::a": "PASSED", "fake::c": "FAILED"}, out
    log = str(tmp_path / "runs.log")
    assert (tmp_path / "runs.log").read_text().splitlines() == [f"fake {log} -k a -k c"]
