"""mori-info (Python console script, `python -m mori.info`, and the C++ tool) run everywhere,
GPU or not, and print every env setting with its value and source."""

import json
import os
import shutil
import subprocess
import sys

import pytest

import mori
from conftest import TEST_INSTALLED, cpp_mori_info


def _env_names():
    return [e["name"] for e in mori.env_entries()]


def _check_report(text, env_from_environment=()):
    assert f"mori {mori.__version__}" in text
    assert "GPUs:" in text
    assert "RDMA devices: none" in text
    for name in _env_names():
        assert name in text, f"{name} missing from report"
    for name in env_from_environment:
        line = next(l for l in text.splitlines() if l.strip().startswith(name))
        assert "[env]" in line, line


def test_device_info_never_raises():
    info = mori.device_info()
    assert info["backend"] == mori.backend()
    assert info["count"] == len(info["devices"]) == len(info["p2p"])
    if info["count"] == 0:
        assert info["error"], "no GPU but no explanation"
    for row in info["p2p"]:
        assert len(row) == info["count"]


def test_rdma_devices_shape():
    # Machines with NICs list them; the shape is what this test can check everywhere.
    devices = mori.rdma_devices()
    assert isinstance(devices, list)
    for d in devices:
        assert isinstance(d["name"], str) and d["name"]
        assert all(p["state"] for p in d["ports"])


def test_python_module_report(subprocess_env):
    env = dict(subprocess_env, MORI_LOG_LEVEL="DEBUG")
    r = subprocess.run([sys.executable, "-m", "mori.info"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    _check_report(r.stdout, env_from_environment=["MORI_LOG_LEVEL"])
    if mori.device_info()["count"] == 0:
        assert "GPUs: none (" in r.stdout


def test_python_module_json(subprocess_env):
    r = subprocess.run(
        [sys.executable, "-m", "mori.info", "--json"], env=subprocess_env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["version"] == mori.__version__
    assert [e["name"] for e in report["env"]] == _env_names()


def test_python_module_bad_env_value_fails(subprocess_env):
    env = dict(subprocess_env, MORI_DEVICE_TIMEOUT_MS="soon")
    r = subprocess.run([sys.executable, "-m", "mori.info"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "MORI_DEVICE_TIMEOUT_MS" in r.stdout


def test_console_script(subprocess_env):
    # pip puts console scripts beside the environment's python (a venv's bin/, activated or not).
    path = os.pathsep.join(p for p in (os.path.dirname(sys.executable), subprocess_env.get("PATH")) if p)
    exe = shutil.which("mori-info", path=path)
    if exe is None:
        if TEST_INSTALLED:
            pytest.fail(f"MORI_TEST_INSTALLED=1 but no mori-info console script on {path}")
        pytest.skip("mori-info console script not on PATH (mori is not pip-installed here)")
    r = subprocess.run([exe], env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    _check_report(r.stdout)


def test_cpp_tool(subprocess_env):
    exe = cpp_mori_info()
    if exe is None:
        pytest.skip("no C++ mori-info: not in $MORI_BUILD_DIR/tools, or the installed package is tested")
    env = dict(subprocess_env, MORI_SHMEM_HEAP_SIZE="1G")
    r = subprocess.run([exe, "--help-env"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    _check_report(r.stdout, env_from_environment=["MORI_SHMEM_HEAP_SIZE"])
    if mori.device_info()["count"] == 0:
        assert "GPUs: none (" in r.stdout


def test_report_names_the_files_this_build_runs():
    """mori-info names libmori, the GPU runtime library loaded with it, and the two programs
    libmori starts from its own directory (MPI bootstrap plugin, emulated NIC), present or not."""
    import os

    from mori import info

    report = info.collect()
    b = report["build"]
    assert b["libmori"] and os.path.basename(b["libmori"]).startswith("libmori.so"), b
    assert os.path.exists(b["libmori"])
    runtime = b["gpu_runtime_library"]
    assert runtime and ("libcudart" in runtime or "libamdhip64" in runtime), b
    here = os.path.dirname(b["libmori"])
    assert b["emulated_nic"]["path"] == os.path.join(here, "mori-emulated-nic")
    assert b["emulated_nic"]["present"] == os.access(b["emulated_nic"]["path"], os.X_OK)
    mpi = b["mpi_bootstrap_plugin"]
    assert mpi["built"] == bool(mori._C._mpi_bootstrap_plugin()["built"])
    if mpi["built"]:
        assert mpi["present"] == os.path.exists(mpi["path"])
    if mpi["present"]:  # built here, with the MPI it was linked to: it loads
        assert mpi["load_error"] is None, mpi
    text = info.format_report(report)
    assert f"libmori: {b['libmori']}" in text
    assert f"runtime library: {runtime}" in text
    assert "emulated NIC (MORI_RDMA_EMULATE): " in text
    assert "MPI bootstrap: " in text
    assert json.loads(json.dumps(report))["build"] == b


def test_report_names_commit_and_compiled_archs():
    """The commit is the one in mori.__version__ (+g<commit>) and a commit of this checkout; the
    GPU architectures are those the build compiled for (its MORI_GPU_ARCHS when set)."""
    import os
    import re

    from conftest import REPO_ROOT, _build_dir
    from mori import info

    report = info.collect()
    b = report["build"]
    m = re.search(r"\+g([0-9a-f]+)$", mori.__version__)
    assert b["commit"] == (m.group(1) if m else None), (b["commit"], mori.__version__)
    if b["commit"] and os.path.isdir(os.path.join(REPO_ROOT, ".git")):
        r = subprocess.run(["git", "-C", REPO_ROOT, "cat-file", "-e", b["commit"] + "^{commit}"],
                           capture_output=True, text=True)
        assert r.returncode == 0, f"commit {b['commit']} is not in {REPO_ROOT}: {r.stderr}"
    archs = b["gpu_archs"]
    assert archs and all(a and "," not in a and ";" not in a for a in archs), archs
    if mori.backend() == "HIP":
        assert all(a.startswith("gfx") for a in archs), archs
    else:
        assert all(re.match(r"^[0-9]+[a-z]?(-real|-virtual)?$", a) for a in archs), archs
    cache = os.path.join(_build_dir(), "CMakeCache.txt")
    if os.path.exists(cache) and os.path.realpath(mori._C.__file__).startswith(os.path.realpath(_build_dir())):
        with open(cache) as f:
            set_archs = next((l.split("=", 1)[1].strip() for l in f if l.startswith("MORI_GPU_ARCHS:")), "")
        if set_archs:
            assert archs == set_archs.split(";"), (archs, set_archs)
    text = info.format_report(report)
    assert f"GPU architectures compiled in: {','.join(archs)}" in text
    assert f"commit: {b['commit']}" in text if b["commit"] else "commit: unknown" in text
    assert json.loads(json.dumps(report))["build"]["gpu_archs"] == archs


def test_runtime_library_found_under_a_repaired_name(monkeypatch):
    """A wheel repair tool renames bundled libraries (libcudart-<hash>.so.13): the report still
    names them; an unrelated library of a similar name is not taken for them."""
    from mori import info

    maps = ["/w/mori.libs/libcudart-1a2b3c4d.so.13.0.96", "/w/mori/lib/libmori-0f0e.so",
            "/usr/lib/libcudartx.so", "/usr/lib/libmori_mpi_plugin.so"]
    monkeypatch.setattr(info, "_loaded_libraries", lambda: sorted(maps))
    b = info._build()
    assert b["gpu_runtime_library"] == maps[0]
    assert b["libmori"] == maps[1]
    assert b["emulated_nic"]["path"] == "/w/mori/lib/mori-emulated-nic"


def test_cpp_tool_reports_the_build(subprocess_env):
    """The C++ mori-info prints the same commit, architectures and MPI plugin state as the module
    (both come from the same build), and the runtime library it mapped itself."""
    exe = cpp_mori_info()
    if exe is None:
        pytest.skip("no C++ mori-info: not in $MORI_BUILD_DIR/tools, or the installed package is tested")
    from mori import info

    b = info.collect()["build"]
    r = subprocess.run([exe], env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert f"  commit: {b['commit']}" in lines if b["commit"] else any(l.startswith("  commit: unknown") for l in lines)
    assert f"  GPU architectures compiled in: {','.join(b['gpu_archs'])}" in lines, r.stdout
    runtime = next(l for l in lines if " runtime library: " in l).split(": ", 1)[1]
    assert "libcudart" in runtime or "libamdhip64" in runtime, runtime
    mpi = next(l for l in lines if l.startswith("  MPI bootstrap: "))
    assert ("plugin " in mpi) == b["mpi_bootstrap_plugin"]["built"], mpi


def test_plugin_load_check_reports_the_loader_error(tmp_path):
    """mori-info says when the MPI plugin is there but cannot load (its MPI is absent on this
    machine): the loader's message, from a child process, and None for a library that loads."""
    from mori import info

    bad = tmp_path / "libnot_a_library.so"
    bad.write_bytes(b"not an ELF file")
    err = info._plugin_load_error(str(bad))
    assert err and "libnot_a_library.so" in err, err
    assert info._plugin_load_error(info.collect()["build"]["libmori"]) is None
