"""The one conftest of the Python tests.

Makes `import mori` work from a CMake build tree when mori is not installed: the build tree's
python/ directory holds a complete package (the .py files are symlinked there and _C*.so is built
next to them, see src/pybind/CMakeLists.txt). The build directory is $MORI_BUILD_DIR, default
build-cuda, relative to the repository root unless absolute. An installed mori (one whose package
directory has the native module) is used as is. tests/ops and tools/bench are importable through
pyproject.toml's pytest `pythonpath`.

MORI_TEST_INSTALLED=1 tests the installed package only (a wheel installed into the running
Python's environment): the session stops with an error when mori is not installed or is imported
from this repository, and tests of the installed package (the console script) fail instead of
skipping.

Tiers (markers registered in pyproject.toml): `gpu` marks a test that needs a GPU; `full` a test
of the full tier only, `quick` one of the quick tier only (a short form of what `full` tests
cover). tools/run_tests.sh selects `-m "not full"` for --quick and `-m "not quick"` otherwise; a
plain pytest run selects both.

run_suite() runs a GPU suite in a child process and logs each line of its output as it comes
(logger "mori.tests"; pyproject.toml turns pytest's live log on), so a long suite shows its
cases while it runs. The fixture suite_case reports each case of a suite run as a test of its own
(suite_cases.py).
"""

import glob
import importlib.util
import logging
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _has_native_module(spec):
    return any(glob.glob(os.path.join(loc, "_C*.so")) for loc in (spec.submodule_search_locations or []))


def _build_dir():
    build = os.environ.get("MORI_BUILD_DIR", "build-cuda")
    return build if os.path.isabs(build) else os.path.join(REPO_ROOT, build)


TEST_INSTALLED = os.environ.get("MORI_TEST_INSTALLED") == "1"


def _setup_import_path():
    spec = importlib.util.find_spec("mori")
    if TEST_INSTALLED:
        where = spec.origin if spec is not None else None
        if where is None or not _has_native_module(spec):
            raise RuntimeError(
                f"tests/python: MORI_TEST_INSTALLED=1 but {sys.executable} finds no installed mori with "
                f"its native module (found: {where}). pip install the wheel into this environment."
            )
        if os.path.realpath(where).startswith(REPO_ROOT + os.sep) or where.startswith(REPO_ROOT + os.sep):
            raise RuntimeError(
                f"tests/python: MORI_TEST_INSTALLED=1 but mori is imported from this repository "
                f"({where}), not from an installed package: run pytest outside the source tree, "
                "without PYTHONPATH pointing into it."
            )
        return os.path.dirname(os.path.dirname(spec.origin))
    if spec is not None and _has_native_module(spec):
        return os.path.dirname(os.path.dirname(spec.origin))
    path = os.path.join(_build_dir(), "python")
    if not glob.glob(os.path.join(path, "mori", "_C*.so")):
        raise RuntimeError(
            f"tests/python: mori is not installed and {path}/mori has no native module. Build it "
            "(cmake --build <build> --target mori_python) and set MORI_BUILD_DIR=<build>, or "
            "pip install --no-build-isolation ."
        )
    sys.path.insert(0, path)
    for name in [m for m in sys.modules if m == "mori" or m.startswith("mori.")]:
        del sys.modules[name]
    return path


MORI_PYTHON_PATH = _setup_import_path()


@pytest.fixture
def subprocess_env():
    """Environment for child Python processes: the same mori first on PYTHONPATH, no MORI_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MORI_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (MORI_PYTHON_PATH, os.environ.get("PYTHONPATH")) if p)
    return env


@pytest.fixture
def suite_env(subprocess_env):
    """Environment for a child running a GPU suite (tests/ops): subprocess_env with this run's
    MORI_BUILD_DIR. Skips the test where torch is missing."""
    why = _torch_missing_reason()
    if why is not None:
        pytest.skip(why)
    env = dict(subprocess_env)
    env["MORI_BUILD_DIR"] = os.environ.get("MORI_BUILD_DIR", "")
    return env


_SUITE_LOG = logging.getLogger("mori.tests")


def stream_suite(cmd, env, timeout):
    """Runs cmd (a GPU suite) in a session of its own, logging each line of its output (stdout and
    stderr together) as it comes. Returns (exit code, the whole output); the exit code is None
    where the suite was still running after `timeout` seconds: then it and every process it started
    (ranks, emulated NICs) have been killed."""
    _SUITE_LOG.info("$ %s", " ".join(cmd))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True)
    lines = []

    def pump():
        for line in proc.stdout:
            lines.append(line)
            _SUITE_LOG.info("%s", line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(5)
        return None, "".join(lines)
    # The output ends when the last process holding the pipe exits; one the suite left running
    # is stopped with its session.
    reader.join(30)
    if reader.is_alive():
        os.killpg(proc.pid, signal.SIGKILL)
        reader.join(5)
    return rc, "".join(lines)


def run_suite(cmd, env, timeout):
    """Runs cmd (a GPU suite: a program that ends its output with "N passed, M failed") through
    stream_suite. Returns (exit code, the whole output, "$ cmd" and the output's last 4000
    characters for an assertion message). Past `timeout` seconds the test fails (the suite and its
    processes killed)."""
    shown = " ".join(cmd)
    rc, out = stream_suite(cmd, env, timeout)
    if rc is None:
        pytest.fail(f"$ {shown}\nstill running after {timeout} s: killed\n" + out[-4000:], pytrace=False)
    return rc, out, f"$ {shown}\n" + out[-4000:]


def suite_counts(out, tail):
    """(passed, failed) from a suite's "N passed, M failed" line; fails the test without one."""
    m = re.search(r"^(\d+) passed, (\d+) failed$", out, re.M)
    assert m is not None, tail
    return int(m.group(1)), int(m.group(2))


@pytest.fixture
def run_case_script(suite_env):
    """run_case_script(script, nranks, ncases): runs the GPU worker of test file `script` on
    `nranks` ranks (`script --nproc nranks`) and checks that all `ncases` cases passed; skipped
    where torch is missing."""

    def run(script, nranks, ncases, timeout=900):
        rc, out, tail = run_suite([sys.executable, os.path.abspath(script), "--nproc", str(nranks)],
                                  dict(suite_env), timeout)
        passed, failed = suite_counts(out, tail)
        assert failed == 0 and rc == 0, tail
        assert passed == ncases, tail

    return run


_SUITE_OUTCOMES = {}  # suite_cases.Run -> suite_cases.Outcome: each run runs once per session


@pytest.fixture
def suite_case(request, suite_env, record_property):
    """For a test parametrized with `case` (suite_cases.params): runs the case's suite run, once
    per session for all the cases of that run the session selected (so its time counts in the
    set-up of the first of them), and returns a function that reports the case from that run's
    output (suite_cases.check). Skipped where torch is missing."""
    import suite_cases

    def case_of(item):
        spec = getattr(item, "callspec", None)
        found = {**getattr(spec, "funcargs", {}), **getattr(spec, "params", {})}.get("case")
        return found if isinstance(found, suite_cases.SuiteCase) else None

    case = case_of(request.node)
    outcome = _SUITE_OUTCOMES.get(case.run)
    if outcome is None:
        selected = {c.name for c in map(case_of, request.session.items) if c is not None and c.run == case.run}
        cmd = [sys.executable, *case.run.command(selected)]
        env = dict(suite_env)
        env.update(case.run.env)
        rc, out = stream_suite(cmd, env, case.run.timeout)
        outcome = _SUITE_OUTCOMES[case.run] = suite_cases.Outcome(" ".join(cmd), rc, out, case.run.timeout)
    return lambda: suite_cases.check(outcome, case, record_property)


@pytest.fixture
def run_python(subprocess_env):
    """run_python(code, env_overrides=None) -> CompletedProcess (text, captured)."""

    def run(code, env_overrides=None, timeout=120):
        env = dict(subprocess_env)
        env.update(env_overrides or {})
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)

    return run


def _visible_gpus():
    """(count, why none) of the GPUs the runtime sees here."""
    import mori

    info = mori.device_info()
    return int(info["count"]), info["error"] or "no device"


GPU_COUNT, _NO_GPU_WHY = _visible_gpus()


def _gpu_missing_reason():
    if GPU_COUNT == 0:
        return f"NEEDS GPU: none visible here ({_NO_GPU_WHY})"
    return None


def _torch_missing_reason():
    if importlib.util.find_spec("torch") is None:
        return "NEEDS TORCH: torch is not installed for " + sys.executable
    return None


# Markers for tests that need hardware or torch: they skip with the reason shown by -rs (never a
# silent pass), reported at the test's own location.
needs_torch = pytest.mark.skipif(_torch_missing_reason() is not None, reason=str(_torch_missing_reason()))


def needs_gpu(test):
    """Marks a GPU test (marker `gpu`): skipped with the reason where no GPU is visible. Where one
    is, the test must run: a skip of it, for whatever reason, fails the run."""
    test = pytest.mark.gpu(test)
    return pytest.mark.skipif(GPU_COUNT == 0, reason=str(_gpu_missing_reason()))(test)


def pytest_collection_modifyitems(config, items):
    """The GPU case tables of the test files (the adapters' and engines' call sequences, through
    run_case_script) belong to the full tier: the quick tier runs each EP kernel type once
    (test_ep_gpu.py) and the tests of one process."""
    for item in items:
        if "run_case_script" in item.fixturenames:
            item.add_marker(pytest.mark.full)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A GPU test skipped (in set-up or in its body) while GPUs are visible is reported as failed:
    on a GPU machine the test command must run what it claims, not pass by skipping. The call of a
    test with the user property suite_seconds (a GPU suite's case) lasts that long in reports."""
    outcome = yield
    rep = outcome.get_result()
    if call.when == "call":
        # A GPU suite's case (suite_cases): its duration is the case's time in the suite.
        seconds = [v for k, v in item.user_properties if k == "suite_seconds"]
        if seconds:
            rep.duration = float(seconds[-1])
    if GPU_COUNT == 0 or not rep.skipped or hasattr(rep, "wasxfail") or item.get_closest_marker("gpu") is None:
        return
    reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    reason = reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason
    rep.outcome = "failed"
    rep.longrepr = f"GPU test skipped although {GPU_COUNT} GPU(s) are visible: {reason}"


def cpp_mori_info():
    """Path of the C++ mori-info built in the build tree, or None (also when testing the installed
    package: the wheel has no C++ tool, and a build tree's is another build's)."""
    if TEST_INSTALLED:
        return None
    path = os.path.join(_build_dir(), "tools", "mori-info")
    return path if os.access(path, os.X_OK) else None
