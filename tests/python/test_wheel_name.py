"""The wheel's version names its CUDA major as torch names its wheels: MORI_WHEEL_CUDA=12 gives
0.1.0+cu12, 13 gives +cu13, none the plain version. The build backend's metadata hook (no CMake
run) computes it from pyproject.toml in a child process, as a wheel build would."""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Where tools/install_wheel_deps.sh unpacks the backend on Debian 12 (its default prefix).
WHEEL_TOOLS = os.path.join(os.environ.get("MORI_WHEEL_TOOLS_PREFIX", "/opt/mori-wheel-tools"),
                           "usr", "lib", "python3", "dist-packages")
HOOK = ("import sys, scikit_build_core.build as b\n"
        "print(b.prepare_metadata_for_build_wheel(sys.argv[1]))")


def _backend_path():
    for extra in ("", WHEEL_TOOLS):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (extra, os.environ.get("PYTHONPATH", "")) if p))
        r = subprocess.run([sys.executable, "-c", "import scikit_build_core"], env=env, capture_output=True)
        if r.returncode == 0:
            return env["PYTHONPATH"]
    return None


@pytest.mark.parametrize("major, suffix", [("12", "+cu12"), ("13", "+cu13"), ("", "")])
def test_wheel_version_names_the_cuda_major(tmp_path, major, suffix):
    path = _backend_path()
    if path is None:
        pytest.skip("scikit-build-core is not importable (tools/install_wheel_deps.sh provides it)")
    env = dict(os.environ, PYTHONPATH=path, MORI_WHEEL_CUDA=major)
    r = subprocess.run([sys.executable, "-c", HOOK, str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    with open(os.path.join(tmp_path, r.stdout.strip().splitlines()[-1], "METADATA")) as f:
        meta = f.read()
    assert re.search(r"^Name: mori-ep$", meta, re.M), meta
    version = re.search(r"^Version: (\S+)$", meta, re.M).group(1)
    assert re.fullmatch(r"[0-9]+(\.[0-9]+)*" + re.escape(suffix), version), version
