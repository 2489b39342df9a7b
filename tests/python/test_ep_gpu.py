"""The EP GPU correctness suites in a short form, on any machine with a GPU (ranks share GPUs when
there are fewer than ranks): tests/ops/ep_intranode_test.py with 2 and 4 ranks, and
tests/ops/ep_internode_test.py with 4 ranks as 2 emulated nodes of 2 GPUs where that file exists, for
InterNode, InterNodeV1 and InterNodeV1LL; AsyncLL (which runs as IntraNode on one node, as InterNode
across nodes) with 4 ranks both ways.

Cases that need a GPU per rank (push_combine_beside_full_gpu) run once more with one rank
(test_ep_one_rank_cases): the suites do not run them where ranks share a GPU.

Short form: every case, the randomized stress with SHORT_ITERS iterations and SHORT_ITERS
back-to-back iterations. A case the suite skips fails the test, as does a skip of the test itself
while a GPU is visible (conftest.needs_gpu); without a GPU it skips with the reason."""

import os
import re
import subprocess
import sys

import pytest

from conftest import needs_gpu

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INTRANODE = os.path.join(REPO, "tests", "ops", "ep_intranode_test.py")
INTERNODE = os.path.join(REPO, "tests", "ops", "ep_internode_test.py")
SHORT_ITERS = 200

# (suite, ranks, GPUs per emulated node or None for one node, kernel type or None for the suite's)
RUNS = [(INTRANODE, 2, None, None), (INTRANODE, 4, None, None), (INTRANODE, 4, None, "AsyncLL")]
if os.path.exists(INTERNODE):
    RUNS += [(INTERNODE, 4, 2, kt) for kt in (None, "InterNodeV1", "InterNodeV1LL", "AsyncLL")]


def _run_id(run):
    suite, nranks, per_node, kernel_type = run
    name = os.path.basename(suite)[: -len("_test.py")]
    return (f"{name}-{nranks}ranks" + (f"-{per_node}pernode" if per_node else "") +
            (f"-{kernel_type}" if kernel_type else ""))


@needs_gpu
@pytest.mark.parametrize("run", RUNS, ids=[_run_id(r) for r in RUNS])
def test_ep_suite_short(run, suite_env):
    suite, nranks, per_node, kernel_type = run
    env = dict(suite_env)
    env["MORI_EP_STRESS_ITERS"] = str(SHORT_ITERS)
    cmd = [sys.executable, suite, "--nproc", str(nranks), "--b2b-iters", str(SHORT_ITERS)]
    if per_node is not None:
        # The inter-node path runs between emulated nodes through the RDMA queue emulator.
        cmd += ["--gpu-per-node", str(per_node)]
        env.update(MORI_RDMA_EMULATE="1")
    if kernel_type is not None:
        cmd += ["--kernel-type", kernel_type]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    out = proc.stdout + proc.stderr
    tail = f"$ {' '.join(cmd)}\n" + out[-4000:]
    m = re.search(r"^(\d+) passed, (\d+) failed$", proc.stdout, re.M)
    assert m is not None, tail
    skipped = re.findall(r"^\[SKIP\] .*$", proc.stdout, re.M)
    assert not skipped, "cases skipped on a GPU machine:\n" + "\n".join(skipped)
    assert int(m.group(2)) == 0 and proc.returncode == 0, tail
    assert int(m.group(1)) > 10, tail


@needs_gpu
def test_ep_one_rank_cases(suite_env):
    """The cases the suites leave out where ranks share a GPU, with one rank (which has its GPU)."""
    env = dict(suite_env)
    for kernel_type in (None, "AsyncLL"):
        cmd = [sys.executable, INTRANODE, "--nproc", "1", "-k", "push_combine_beside_full_gpu"]
        if kernel_type is not None:
            cmd += ["--kernel-type", kernel_type]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        tail = f"$ {' '.join(cmd)}\n" + (proc.stdout + proc.stderr)[-4000:]
        assert re.search(r"^1 passed, 0 failed$", proc.stdout, re.M) and proc.returncode == 0, tail
        assert "not applicable here" not in proc.stdout, tail
