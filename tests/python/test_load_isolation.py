"""`import mori` loads mori and its GPU runtime and nothing else: libmori and the native module
list no MPI, UCX, hwloc or udev library as needed, importing installs no signal handler, and MPI
is loaded only when the MPI bootstrap is asked for, from the plugin next to libmori (a missing
plugin, or one whose MPI library is missing, is a typed error then). The MPI bootstrap works from
Python (one rank, MPI initialised through ctypes): up to the GPU here, the whole shmem init on a
GPU machine. On a GPU machine, mori and torch also work imported in either order."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import mori
from conftest import GPU_COUNT, needs_gpu, needs_torch

# MPI (MPICH, Open MPI and its runtime, PMIx) and what MPI brings along (UCX, hwloc, udev). Not
# libnuma: UCX loads it, but so does the HIP runtime.
FOREIGN = re.compile(r"^lib(mpi|mpich|open-pal|open-rte|pmix|uc[mpst]|hwloc|udev)[^/]*\.so")
MPI_LIB = re.compile(r"^lib(mpi|mpich)[^/]*\.so")


def loaded_libraries():
    """Paths of the shared objects mapped into this process."""
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith("/") and ".so" in parts[5]:
                paths.add(parts[5])
    return sorted(paths)


def loaded_libmori():
    hits = [p for p in loaded_libraries() if os.path.basename(p) == "libmori.so"]
    assert len(hits) == 1, f"libmori.so mapped {len(hits)} times: {hits}"
    return hits[0]


def needed(path):
    """DT_NEEDED entries of `path`, from readelf -d."""
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("NEEDS readelf (binutils) to read the dynamic section")
    out = subprocess.run([readelf, "-d", path], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def run_child(run_python, code):
    r = run_python(code)
    assert r.returncode == 0, f"child failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_libmori_and_module_need_no_mpi():
    for path in (loaded_libmori(), mori._C.__file__):
        libs = needed(path)
        assert libs, f"{path}: no NEEDED entries read"
        bad = [lib for lib in libs if FOREIGN.match(lib)]
        assert not bad, f"{path} needs {bad}"
    assert "libmori.so" in needed(mori._C.__file__)


def test_mpi_plugin_next_to_libmori_when_built():
    info = mori._C._mpi_bootstrap_plugin()
    libmori = loaded_libmori()
    assert info["default_path"] == os.path.join(os.path.dirname(libmori), "libmori_mpi_bootstrap.so")
    if info["built"]:
        assert os.path.isfile(info["default_path"]), f"the build has MPI but {info['default_path']} is missing"
        libs = needed(info["default_path"])
        assert any(MPI_LIB.match(lib) for lib in libs), f"the plugin needs no MPI library: {libs}"
        assert "libmori.so" not in libs, libs  # the plugin calls MPI only; it knows nothing of mori


IMPORT_CHILD = r"""
import ctypes, json, re, signal, sys

libc = ctypes.CDLL(None, use_errno=True)

class Sigaction(ctypes.Structure):  # glibc's struct sigaction (handler, mask, flags, restorer)
    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16),
                ("flags", ctypes.c_int), ("restorer", ctypes.c_void_p)]

def handlers():
    out = {}
    for s in range(1, signal.NSIG):
        sa = Sigaction()
        if libc.sigaction(s, None, ctypes.byref(sa)) == 0:
            out[s] = [sa.handler or 0, sa.flags]
    return out

def python_handlers():
    out = {}
    for s in signal.valid_signals():
        try:
            h = signal.getsignal(s)
        except (ValueError, OSError):
            continue
        out[int(s)] = repr(h)
    return out

before, py_before = handlers(), python_handlers()
import mori, mori.shmem, mori.ops, mori.info
after, py_after = handlers(), python_handlers()
changed = {s: [before[s], after.get(s)] for s in before if before[s] != after.get(s)}
py_changed = {s: [py_before[s], py_after.get(s)] for s in py_before if py_before[s] != py_after.get(s)}
maps = sorted({l.split()[5] for l in open("/proc/self/maps") if len(l.split()) >= 6})
print(json.dumps({"changed": changed, "py_changed": py_changed, "maps": maps, "checked": len(before)}))
"""


def test_import_installs_no_signal_handler_and_loads_no_mpi(run_python):
    out = run_child(run_python, IMPORT_CHILD)
    assert out["checked"] > 30, out["checked"]
    assert not out["changed"], f"import mori changed signal dispositions: {out['changed']}"
    assert not out["py_changed"], f"import mori changed Python signal handlers: {out['py_changed']}"
    foreign = [p for p in out["maps"] if FOREIGN.match(os.path.basename(p))]
    assert not foreign, f"import mori loaded {foreign}"
    assert any(os.path.basename(p) == "libmori.so" for p in out["maps"])


MPI_REQUEST_CHILD = r"""
import json, os, re
import mori, mori.shmem

def mpi_libs():
    return sorted({l.split()[5] for l in open("/proc/self/maps")
                   if len(l.split()) >= 6 and re.match(r"lib(mpi|mpich)[^/]*\.so", os.path.basename(l.split()[5]))})

before = mpi_libs()
try:
    mori.shmem.shmem_mpi_init()
    error = None
except mori.MoriError as e:
    error = [type(e).__name__, e.detail]
print(json.dumps({"before": before, "after": mpi_libs(), "error": error,
                  "built": mori._C._mpi_bootstrap_plugin()["built"]}))
"""


def test_mpi_is_loaded_only_when_the_mpi_bootstrap_is_asked_for(run_python):
    # MPI is not initialised in the child: the request fails before any GPU work, with a typed
    # error; with the plugin the MPI library is loaded by then, without it nothing is.
    out = run_child(run_python, MPI_REQUEST_CHILD)
    assert out["before"] == [], out
    assert out["error"] is not None and out["error"][0] == "InvalidUsageError", out
    if out["built"]:
        assert "MPI is not initialised" in out["error"][1], out
        assert out["after"], f"the MPI bootstrap did not load MPI: {out}"
    else:
        assert "built without MPI" in out["error"][1], out
        assert out["after"] == [], out


def _relocated_mori(tmp_path, plugin_needs_missing_mpi):
    """A copy of the mori package with libmori in tmp/lib (found first through LD_LIBRARY_PATH), and
    next to it either no plugin or a copy of the plugin whose MPI library name is changed to one
    that does not exist. Returns the child's environment overrides and the lib directory."""
    pkg = tmp_path / "pkg"
    shutil.copytree(os.path.dirname(mori.__file__), pkg / "mori", ignore=shutil.ignore_patterns("__pycache__"))
    lib = tmp_path / "lib"
    lib.mkdir()
    shutil.copy(loaded_libmori(), lib / "libmori.so")
    if plugin_needs_missing_mpi:
        plugin = mori._C._mpi_bootstrap_plugin()["default_path"]
        mpi = next(n for n in needed(plugin) if MPI_LIB.match(n))
        gone = mpi.replace("mpi", "zzz", 1)  # same length: the dynamic string table keeps its layout
        with open(plugin, "rb") as f:
            data = f.read()
        assert data.count(mpi.encode() + b"\0") == 1, mpi
        (lib / "libmori_mpi_bootstrap.so").write_bytes(data.replace(mpi.encode() + b"\0", gone.encode() + b"\0"))
        assert gone in needed(str(lib / "libmori_mpi_bootstrap.so"))
    env = {"PYTHONPATH": str(pkg), "LD_LIBRARY_PATH": str(lib)}
    return env, str(lib)


RELOCATED_CHILD = r"""
import json, mori, mori.shmem
info = mori._C._mpi_bootstrap_plugin()
try:
    mori.shmem.shmem_mpi_init()
    error = None
except mori.MoriError as e:
    error = [type(e).__name__, e.detail]
print(json.dumps({"error": error, "default_path": info["default_path"]}))
"""


def _needs_plugin_build():
    if not mori._C._mpi_bootstrap_plugin()["built"]:
        pytest.skip("this build has no MPI bootstrap plugin (MPI not found or MORI_WITH_MPI=OFF)")


def test_missing_plugin_is_invalid_usage_at_request_time(run_python, tmp_path):
    _needs_plugin_build()
    env, lib = _relocated_mori(tmp_path, plugin_needs_missing_mpi=False)
    out = run_child(lambda code: run_python(code, env), RELOCATED_CHILD)
    assert out["default_path"] == os.path.join(lib, "libmori_mpi_bootstrap.so"), out
    assert out["error"] and out["error"][0] == "InvalidUsageError", out
    assert f"libmori_mpi_bootstrap.so is neither in {lib}/ nor on the library search path" in out["error"][1], out


def test_plugin_without_its_mpi_is_system_error_with_the_loader_text(run_python, tmp_path):
    _needs_plugin_build()
    env, lib = _relocated_mori(tmp_path, plugin_needs_missing_mpi=True)
    out = run_child(lambda code: run_python(code, env), RELOCATED_CHILD)
    assert out["error"] and out["error"][0] == "SystemError", out
    detail = out["error"][1]
    assert f"cannot load the plugin {lib}/libmori_mpi_bootstrap.so: " in detail, out
    assert "zzz" in detail and "cannot open shared object file" in detail, out


IMPORT_ORDER_CHILD = r"""
import json, sys
first = sys.argv[1]
if first == "mori":
    import mori
    import torch
else:
    import torch
    import mori
x = torch.zeros(1, device="cuda")
x += 1
info = mori.device_info()
import mori.shmem as shmem
shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 0, 1, shmem.shmem_get_unique_id())
buf = shmem.shmem_malloc(4096)
shmem.shmem_barrier_all()
shmem.shmem_free(buf)
shmem.shmem_finalize()
torch.cuda.synchronize()
print(json.dumps({"count": info["count"], "x": float(x.item()), "buf": bool(buf)}))
"""


@needs_gpu
@needs_torch
@pytest.mark.parametrize("first", ["mori", "torch"])
def test_mori_and_torch_in_either_order(subprocess_env, first):
    r = subprocess.run([sys.executable, "-c", IMPORT_ORDER_CHILD, first], env=subprocess_env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{first} first: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["count"] >= 1 and out["x"] == 1.0 and out["buf"], out


MPI_INIT_CHILD = r"""
import ctypes, json, os, re
import mori, mori.shmem as shmem

def mpi_lib():
    for l in open("/proc/self/maps"):
        p = l.split()[5] if len(l.split()) >= 6 else ""
        if re.match(r"lib(mpi|mpich)[^/]*\.so", os.path.basename(p)):
            return p
    return None

out = {"built": mori._C._mpi_bootstrap_plugin()["built"]}
try:
    shmem.shmem_mpi_init()  # MPI not initialised yet: refused, but the plugin and MPI are loaded
except mori.InvalidUsageError as e:
    out["first"] = e.detail
if out["built"]:
    mpi = ctypes.CDLL(mpi_lib(), mode=ctypes.RTLD_GLOBAL)
    assert mpi.MPI_Init(None, None) == 0
    try:
        shmem.shmem_mpi_init()
        out["pe"] = [shmem.shmem_mype(), shmem.shmem_npes()]
        buf = shmem.shmem_malloc(1 << 16)
        shmem.shmem_barrier_all()
        shmem.shmem_free(buf)
        shmem.shmem_finalize()
    except mori.MoriError as e:
        out["second"] = [type(e).__name__, e.detail]
    assert mpi.MPI_Finalize() == 0
print(json.dumps(out))
"""


def test_mpi_bootstrap_from_python(run_python):
    # One rank over MPI_COMM_WORLD, as MORI_SHMEM_INIT_WITH_MPI_COMM uses it (a singleton MPI_Init
    # through ctypes, no mpiexec). With a GPU shmem initialises; without one the bootstrap is made
    # and the GPU is what is missing. Without the plugin the request is refused with the reason.
    out = run_child(run_python, MPI_INIT_CHILD)
    if not out["built"]:
        assert "built without MPI" in out["first"], out
        return
    assert "MPI is not initialised" in out["first"], out
    if GPU_COUNT > 0:
        assert "second" not in out and out["pe"] == [0, 1], out
    else:
        assert out["second"][0] == "GpuRuntimeError" and "MPI" not in out["second"][1], out
