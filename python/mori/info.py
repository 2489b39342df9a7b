"""`mori-info` / `python -m mori.info`: what this mori build sees. Prints the version and backend,
how it was built (commit, GPU architectures compiled in, the MPI bootstrap plugin) and the GPU
runtime library this process loaded, the GPUs with their P2P matrix, RDMA devices, and every MORI_*
setting with its value and source. Runs on machines without a GPU (it says why none is listed)."""

import argparse
import json
import os
import re
import subprocess
import sys

from . import _C


def _runtime_version_text(backend, v):
    if not v:
        return "none"
    if backend == "HIP":  # major * 10^7 + minor * 10^5 + patch
        return f"{v // 10_000_000}.{(v // 100_000) % 100}.{v % 100_000}"
    return f"{v // 1000}.{(v % 1000) // 10}"  # CUDA: major * 1000 + minor * 10


def _size_text(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _rdma_discovery():
    # Discovery reads MORI_RDMA_DEVICES through the env table, so a bad MORI_* value raises here;
    # the report shows that error in its environment section instead.
    try:
        return dict(_C.rdma_discovery())
    except _C.MoriError as e:
        return {"devices": [], "reason": "not probed: %s" % e}


def _loaded_libraries():
    """Paths of the shared libraries mapped into this process (Linux: /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            fields = [line.split(None, 5) for line in f]
    except OSError:
        return []
    return sorted({p[5].strip() for p in fields if len(p) == 6 and ".so" in p[5]})


def _plugin_load_error(path):
    """None when the shared library at `path` loads, else the loader's message. It is loaded in a
    child process, so its dependencies' constructors and signal handlers (an MPI's) never run in
    this one."""
    code = "import ctypes, sys\ntry:\n    ctypes.CDLL(sys.argv[1])\nexcept OSError as e:\n    print(e)\n    sys.exit(1)"
    try:
        r = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"could not check: {e}"
    return None if r.returncode == 0 else (r.stdout.strip() or r.stderr.strip() or f"exit code {r.returncode}")


def _build():
    """How this mori was built (commit, GPU architectures compiled in) and which files this import
    runs: libmori, the GPU runtime library it loaded, and the two programs libmori starts from its
    own directory on demand (the MPI bootstrap plugin, the emulated NIC of MORI_RDMA_EMULATE).
    Library names may carry a wheel repair tool's hash (libcudart-1a2b3c4d.so.13)."""
    libs = _loaded_libraries()
    config = dict(_C._build_config())

    def named(stem):
        return [p for p in libs if re.match(re.escape(stem) + r"(-[0-9a-f]+)?\.so", os.path.basename(p))]

    libmori = next(iter(named("libmori")), None)
    runtime = named(config["runtime_library"])
    here = os.path.dirname(libmori) if libmori else None
    nic = os.path.join(here, "mori-emulated-nic") if here else None
    mpi = dict(_C._mpi_bootstrap_plugin())
    mpi_present = bool(mpi["default_path"]) and os.path.exists(mpi["default_path"])
    return {
        "commit": config["commit"] or None,
        "gpu_archs": list(config["gpu_archs"]),
        "libmori": libmori,
        "gpu_runtime_library": runtime[0] if runtime else None,
        "mpi_bootstrap_plugin": {"built": bool(mpi["built"]), "path": mpi["default_path"], "present": mpi_present,
                                 "load_error": _plugin_load_error(mpi["default_path"]) if mpi_present else None},
        "emulated_nic": {"path": nic, "present": bool(nic) and os.access(nic, os.X_OK)},
    }


def collect():
    """Everything the report shows, as plain data. 'env_error' is set (and 'env' empty) when a
    MORI_* value does not parse."""
    report = {
        "version": _C.version(),
        "backend": _C.backend(),
        "module": _C.__file__,
        "build": _build(),
        "devices": _C.device_info(),
        "rdma": _rdma_discovery(),
        "env": [],
        "env_error": None,
    }
    try:
        report["env"] = list(_C.env_entries())
    except _C.MoriError as e:
        report["env_error"] = str(e)
    return report


def format_report(report):
    lines = []
    d = report["devices"]
    b = report["backend"]
    lines.append(f"mori {report['version']} ({b} backend)")
    lines.append(f"  module: {report['module']}")
    bi = report["build"]
    lines.append(f"  commit: {bi['commit'] or 'unknown (not built from a git checkout)'}")
    lines.append(f"  GPU architectures compiled in: {','.join(bi['gpu_archs']) or '?'}")
    lines.append(f"  libmori: {bi['libmori'] or '?'}")
    lines.append(f"  {b} runtime library: {bi['gpu_runtime_library'] or 'not loaded'}")
    mpi = bi["mpi_bootstrap_plugin"]
    if not mpi["built"]:
        lines.append("  MPI bootstrap: not built (no MPI when this mori was built)")
    elif not mpi["present"]:
        lines.append(f"  MPI bootstrap: plugin {mpi['path']} (missing)")
    elif mpi["load_error"]:
        lines.append(f"  MPI bootstrap: plugin {mpi['path']} (does not load here, so the MPI bootstrap is "
                     f"unavailable; the others work: {mpi['load_error']})")
    else:
        lines.append(f"  MPI bootstrap: plugin {mpi['path']} (loads)")
    nic = bi["emulated_nic"]
    lines.append(f"  emulated NIC (MORI_RDMA_EMULATE): {nic['path'] or '?'}{'' if nic['present'] else ' (missing)'}")
    lines.append(
        f"  {b} runtime {_runtime_version_text(b, d['runtime_version'])}, "
        f"driver {_runtime_version_text(b, d['driver_version'])}"
    )
    if d["count"] == 0:
        lines.append(f"GPUs: none ({d['error'] or 'no device visible'})")
    else:
        lines.append(f"GPUs: {d['count']}")
        for dev in d["devices"]:
            lines.append(
                f"  [{dev['index']}] {dev.get('name', '?')}  {dev.get('arch', '?')}  "
                f"pci {dev['pci_bus_id'] or '?'}  {_size_text(dev.get('total_memory', 0))}  "
                f"{dev.get('multiprocessors', '?')} SMs/CUs"
            )
        lines.append("P2P access (row GPU can access column GPU):")
        lines.append("       " + " ".join(f"{j:>3}" for j in range(d["count"])))
        for i, row in enumerate(d["p2p"]):
            cells = ("  -" if i == j else ("  Y" if ok else "  N") for j, ok in enumerate(row))
            lines.append(f"  {i:>3}  " + " ".join(cells))
    rdma = report["rdma"]
    if not rdma["devices"]:
        lines.append("RDMA devices: none (%s)" % (rdma.get("reason") or "no device with an active port"))
    else:
        lines.append("RDMA devices:")
        for d in rdma["devices"]:
            lines.append("  %s  pci %s  numa %s  fw %s" % (d["name"], d.get("pci_bus_id"),
                                                        d.get("numa_node"), d.get("firmware")))
            for p in d.get("ports", []):
                gids = ", ".join("%d:%s(%s)" % (g["index"], g["gid"], g["type"])
                                 for g in p.get("gids", []))
                lines.append("    port %s %s %s mtu %s lid %s gids [%s]" % (
                    p["port"], p["state"], p["link_layer"], p["active_mtu"], p["lid"], gids))
    lines.append("Environment (value in effect, source):")
    if report["env_error"]:
        lines.append(f"  error: {report['env_error']}")
    width = max((len(e["name"]) for e in report["env"]), default=0)
    for e in report["env"]:
        value = e["value"] if e["value"] != "" else "(empty)"
        lines.append(f"  {e['name']:<{width}} = {value}  [{e['source']}]")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="mori-info", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--help-env", action="store_true", help="also print each setting's help")
    args = parser.parse_args(argv)
    report = collect()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
        if args.help_env:
            print("\nSettings:")
            for e in report["env"]:
                default = e["default"] if e["default"] != "" else "(empty)"
                print(f"  {e['name']} ({e['type']}, default {default})\n      {e['help']}")
    return 1 if report["env_error"] else 0


if __name__ == "__main__":
    sys.exit(main())
