"""Runs the EP GPU correctness suite (tests/ops/ep_intranode_test.py) on 2 GPUs, and on 4 when
there are 4. Skips with the reason when there is no torch or fewer than 2 GPUs."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

import mori

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUITE = os.path.join(REPO, "tests", "ops", "ep_intranode_test.py")


def _gpu_count():
    try:
        return int(mori.device_info()["count"])
    except Exception:  # noqa: BLE001
        return 0


def _skip_reason(nranks):
    if importlib.util.find_spec("torch") is None:
        return "NEEDS TORCH: torch is not installed for " + sys.executable
    n = _gpu_count()
    if n < nranks:
        return f"NEEDS {nranks} GPUs: {n} visible"
    return None


@pytest.mark.parametrize("nranks", [2, 4])
def test_ep_intranode_suite(nranks, subprocess_env):
    reason = _skip_reason(nranks)
    if reason:
        pytest.skip(reason)
    env = dict(subprocess_env)
    env["MORI_BUILD_DIR"] = os.environ.get("MORI_BUILD_DIR", "")
    proc = subprocess.run([sys.executable, SUITE, "--nproc", str(nranks)], env=env, capture_output=True,
                          text=True, timeout=3600)
    out = proc.stdout + proc.stderr
    m = re.search(r"^(\d+) passed, (\d+) failed$", proc.stdout, re.M)
    assert m is not None, out[-4000:]
    assert int(m.group(2)) == 0 and proc.returncode == 0, out[-4000:]
    assert int(m.group(1)) > 10, out[-4000:]
