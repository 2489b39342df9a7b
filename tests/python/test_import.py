"""`import mori` is light (no torch), complete, and reports a consistent version."""

import os
import re

import mori
from conftest import REPO_ROOT


def test_import_does_not_import_torch(run_python):
    code = (
        "import sys, mori, mori.shmem, mori.ops, mori.info\n"
        "mori.shmem.shmem_is_initialized()\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
        "print('ok', mori.__version__)\n"
    )
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok ")


def test_version_matches_cmake_project():
    with open(os.path.join(REPO_ROOT, "CMakeLists.txt")) as f:
        m = re.search(r"project\(mori\s+VERSION\s+([0-9.]+)", f.read())
    assert m, "no project(mori VERSION ...) in CMakeLists.txt"
    assert mori.__version__ == m.group(1)


def test_backend():
    assert mori.backend() in ("CUDA", "HIP")


def test_lazy_submodules():
    assert "shmem" in dir(mori)
    assert mori.shmem.shmem_get_unique_id is not None
    assert mori.info.main is not None
    try:
        mori.no_such_thing
    except AttributeError as e:
        assert "no_such_thing" in str(e)
    else:
        raise AssertionError("mori.no_such_thing did not raise AttributeError")


def test_public_names():
    for name in mori.__all__:
        assert hasattr(mori, name), name
