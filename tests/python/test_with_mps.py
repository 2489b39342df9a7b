"""tools/with_mps.sh's client settings, with a stand-in nvidia-cuda-mps-control on PATH (it answers
the daemon start, the readiness query and quit): each client gets 100/N % of the SMs and, unless the
caller set CUDA_DEVICE_MAX_CONNECTIONS, 64/N hardware work queues clamped to [2, 32] (docs/rdma.md,
"Hardware work queues"); a caller's value is kept, and sourcing mps_stop leaves the caller's
environment as it was. Needs no GPU."""

import os
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WITH_MPS = os.path.join(REPO, "tools", "with_mps.sh")

# The daemon's control pipe stands for a running daemon: -d creates it, quit removes it.
STAND_IN = """#!/usr/bin/env bash
if [[ ${1:-} == -d ]]; then : >"$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0; fi
read -r cmd || true
[[ $cmd == quit ]] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
exit 0
"""


def _env(tmp_path, **extra):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "nvidia-cuda-mps-control"
    tool.write_text(STAND_IN)
    tool.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_MPS_", "CUDA_DEVICE_MAX_CONNECTIONS"))}
    env.update(PATH=f"{bin_dir}:{env.get('PATH', '')}", TMPDIR=str(tmp_path), **extra)
    return env


def _client_env(tmp_path, n, **extra):
    """The environment with_mps.sh gives the command it runs, as a dict."""
    r = subprocess.run(["bash", WITH_MPS, str(n), "env"], env=_env(tmp_path, **extra), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)


@pytest.mark.parametrize("n,percent,queues", [(1, 100, 32), (2, 50, 32), (4, 25, 16), (8, 12, 8), (64, 1, 2)])
def test_client_shares_and_queues(tmp_path, n, percent, queues):
    got = _client_env(tmp_path, n)
    assert got["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(percent)
    assert got["CUDA_DEVICE_MAX_CONNECTIONS"] == str(queues)
    assert got["CUDA_MPS_PIPE_DIRECTORY"].startswith(str(tmp_path))


def test_callers_queue_count_is_kept(tmp_path):
    assert _client_env(tmp_path, 4, CUDA_DEVICE_MAX_CONNECTIONS="5")["CUDA_DEVICE_MAX_CONNECTIONS"] == "5"


@pytest.mark.parametrize("preset", [None, "5"])
def test_sourced_stop_restores_the_callers_environment(tmp_path, preset):
    extra = {} if preset is None else {"CUDA_DEVICE_MAX_CONNECTIONS": preset}
    script = (f"source {WITH_MPS}; mps_start 4 || exit 3; echo during=$CUDA_DEVICE_MAX_CONNECTIONS; mps_stop; "
              "echo after=${CUDA_DEVICE_MAX_CONNECTIONS-unset} pct=${CUDA_MPS_ACTIVE_THREAD_PERCENTAGE-unset}")
    r = subprocess.run(["bash", "-c", script], env=_env(tmp_path, **extra), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"during={preset or 16}" in r.stdout
    assert f"after={preset or 'unset'} pct=unset" in r.stdout
