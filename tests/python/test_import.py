"""`import mori` is light (no torch), complete, and reports a consistent version."""

import os
import re
import shutil
import subprocess

import mori
from conftest import MORI_PYTHON_PATH, REPO_ROOT


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


def _project_version():
    """The version as pyproject.toml derives it: its version regex over its input file."""
    with open(os.path.join(REPO_ROOT, "pyproject.toml")) as f:
        toml = f.read()
    section = toml[toml.index("[tool.scikit-build.metadata.version]"):]
    source = re.search(r'^input\s*=\s*"([^"]+)"', section, re.M).group(1)
    regex = re.search(r"^regex\s*=\s*'([^']+)'", section, re.M).group(1)
    with open(os.path.join(REPO_ROOT, source)) as f:
        m = re.search(regex, f.read())
    assert m, f"pyproject.toml's version regex finds nothing in {source}"
    return m.group("value")


def _build_source_dir():
    """The source directory of the CMake build this mori comes from, or None (an installed mori)."""
    cache = os.path.join(os.path.dirname(MORI_PYTHON_PATH), "CMakeCache.txt")
    if not os.path.isfile(cache):
        return None
    with open(cache) as f:
        m = re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.*)$", f.read(), re.M)
    return m.group(1) if m else None


def test_version_is_project_version_plus_commit():
    m = re.fullmatch(re.escape(_project_version()) + r"(\+g([0-9a-f]{4,40}))?", mori.__version__)
    assert m, f"mori.__version__ {mori.__version__!r} is not {_project_version()} with an optional +g<commit>"
    git = shutil.which("git")
    source = _build_source_dir()
    if git is None or source is None or os.path.realpath(source) != os.path.realpath(REPO_ROOT):
        return  # not built from this tree: the commit, if any, is another checkout's
    top = subprocess.run([git, "-C", REPO_ROOT, "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if top.returncode != 0 or os.path.realpath(top.stdout.strip()) != os.path.realpath(REPO_ROOT):
        assert m.group(1) is None, f"{mori.__version__}: a commit, but the source is no git checkout"
        return
    assert m.group(2), f"{mori.__version__}: built from a git checkout but no +g<commit>"
    r = subprocess.run([git, "-C", REPO_ROOT, "cat-file", "-e", m.group(2) + "^{commit}"], capture_output=True)
    assert r.returncode == 0, f"{m.group(2)} is not a commit of this repository"


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
