"""The rule of conftest.py that a GPU test must run where a GPU is visible: run in a child pytest
with this conftest and a stand-in `mori` whose device_info reports `count` GPUs, GPU tests that
skip (marker, in the body, or needing torch) fail there with the reason, and skip (never pass)
where no GPU is visible. Needs no GPU."""

import os
import shutil
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))

FAKE_MORI = """
import os

def device_info():
    n = int(os.environ["FAKE_GPU_COUNT"])
    return {"count": n, "error": None if n else "stand-in: no device", "devices": []}
"""

TESTS = """
import pytest
from conftest import needs_gpu, needs_torch

@needs_gpu
def test_gpu_runs():
    pass

@needs_gpu
def test_gpu_skips_in_body():
    pytest.skip("heap too large")

@needs_gpu
@pytest.mark.skipif(True, reason="NEEDS SOMETHING")
def test_gpu_skipped_by_marker():
    pass

def test_host_skip_is_a_skip():
    pytest.skip("not a GPU test")

@needs_gpu
@pytest.mark.xfail(reason="known", strict=True)
def test_gpu_xfail_stays_xfail():
    assert False
"""


def run_child(tmp_path, count):
    (tmp_path / "pkg" / "mori").mkdir(parents=True, exist_ok=True)
    (tmp_path / "pkg" / "mori" / "__init__.py").write_text(textwrap.dedent(FAKE_MORI))
    (tmp_path / "pkg" / "mori" / "_C.so").write_text("")  # conftest takes a package with _C as built
    shutil.copy(os.path.join(HERE, "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_rule.py").write_text(textwrap.dedent(TESTS))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MORI_")}
    env.update(FAKE_GPU_COUNT=str(count), PYTHONPATH=str(tmp_path / "pkg"), PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout + r.stderr


def outcome(out, name):
    """The verbose report's outcome of test `name` ("test_rule.py::name PASSED [ 20%]")."""
    for line in out.splitlines():
        if line.startswith("test_rule.py::" + name + " "):
            return line.split()[1]
    raise AssertionError(f"{name} not in the report:\n{out}")


def test_skipped_gpu_tests_fail_where_a_gpu_is_visible(tmp_path):
    rc, out = run_child(tmp_path, 1)
    assert rc == 1, out
    assert outcome(out, "test_gpu_runs") == "PASSED", out
    assert outcome(out, "test_gpu_skips_in_body") == "FAILED", out
    assert outcome(out, "test_gpu_skipped_by_marker") == "ERROR", out  # failed in set-up
    assert outcome(out, "test_host_skip_is_a_skip") == "SKIPPED", out
    assert outcome(out, "test_gpu_xfail_stays_xfail") == "XFAIL", out
    assert "GPU test skipped although 1 GPU(s) are visible: heap too large" in out, out
    assert "GPU test skipped although 1 GPU(s) are visible: NEEDS SOMETHING" in out, out


def test_gpu_tests_skip_where_no_gpu_is_visible(tmp_path):
    rc, out = run_child(tmp_path, 0)
    assert rc == 0, out
    for name in ("test_gpu_runs", "test_gpu_skips_in_body", "test_gpu_skipped_by_marker", "test_host_skip_is_a_skip"):
        assert outcome(out, name) == "SKIPPED", out
    assert "NEEDS GPU: none visible here (stand-in: no device)" in out, out
