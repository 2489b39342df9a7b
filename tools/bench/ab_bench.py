#!/usr/bin/env python3
"""Alternated A/B timing of the EP phases: a base commit against the working tree (and variants of
the working tree under other environment settings), built side by side and run in turn on one
machine.

    python3 tools/bench/ab_bench.py --base HEAD~1 -- --nproc 2 --configs ht --ht-grid 24:16 --no-baseline
    python3 tools/bench/ab_bench.py --base main --rounds 3 \\
        --variant lb10:MORI_EP_DISPATCH_LOCAL_BLOCKS=10 -- --nproc 2 --configs ht --no-baseline
    python3 tools/bench/ab_bench.py --base main --variant lb10@base:MORI_EP_DISPATCH_LOCAL_BLOCKS=10 \\
        --variant lb10:MORI_EP_DISPATCH_LOCAL_BLOCKS=10 -- --nproc 2 --configs ht --no-baseline

Figures of one run vary by up to +-5 % on these machines (docs/performance.md), so a change is
judged on rounds of every variant in turn, never on one run of each:
  1. builds, at once, each with half the cores: the base ref (`git archive`) in .ab/<ref>/ and the
     working tree in build-ab/ (the Python module, tests off; --head-build DIR takes a build that
     exists instead). A base tree of the same commit as the last run's is kept, so its build is
     incremental;
  2. rounds: each variant runs its own tree's tools/bench/ep_bench.py once per round, in turn (base,
     head, then every --variant: head with those settings, or base with them for NAME@base),
     each writing --json;
  3. the table: per phase (config, phase, dtype, input) and variant, every round's µs (slowest
     rank) and their median; after the base column, each median's ratio to the base median.
A run that fails is reported with its last lines and left out of the table (its cells say so;
the exit status is then 1).
The arguments after -- are ep_bench.py's (not --json: this script sets it). Needs git, CMake, the
backend's compiler (tools/gpu_env.sh: mori_detect_backend), torch and the GPUs ep_bench needs.
--dry-run prints the commands instead.
"""

import argparse
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_json as BJ  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAME = re.compile(r"[A-Za-z0-9_.-]+")
ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


def parse_variant(text):
    """"name[@tree]:VAR=value,VAR2=value" -> (name, tree, {VAR: value, ...}); tree is "head" (the
    working tree, the default) or "base". ValueError when malformed."""
    spec, sep, settings = text.partition(":")
    name, at, tree = spec.partition("@")
    tree = tree if at else "head"
    if not NAME.fullmatch(name) or name in ("base", "head") or tree not in ("base", "head") or not sep \
            or not settings:
        raise ValueError(f"variant {text!r}: expected NAME[@base]:VAR=VALUE[,VAR=VALUE...] "
                         "(NAME of letters, digits, '_', '.', '-'; not base or head)")
    env = {}
    for item in settings.split(","):
        var, eq, value = item.partition("=")
        if not eq or not ENV_NAME.fullmatch(var):
            raise ValueError(f"variant {text!r}: {item!r} is not VAR=VALUE")
        env[var] = value
    return name, tree, env


def safe_ref(ref):
    return re.sub(r"[^A-Za-z0-9._-]", "_", ref)


def archive_command(repo, ref, dest):
    """The shell command that extracts commit `ref` of `repo` into `dest`, unless `dest` already
    holds that commit (a stamp file says which): files of the same commit keep their times, so a
    build of them is incremental."""
    q = shlex.quote
    stamp = os.path.join(dest, ".ab-commit")
    return (f"c=$(git -C {q(repo)} rev-parse --verify {q(ref + '^{commit}')}) && "
            f"{{ [ \"$(cat {q(stamp)} 2>/dev/null)\" = \"$c\" ] || {{ rm -rf {q(dest)} && mkdir -p {q(dest)} && "
            f"git -C {q(repo)} archive \"$c\" | tar -x -C {q(dest)} && echo \"$c\" > {q(stamp)}; }}; }}")


def build_commands(src, build, backend, jobs, python):
    """The configure and build commands of the Python module of tree `src` in `build`."""
    configure = ["cmake", "-S", src, "-B", build, "-DCMAKE_BUILD_TYPE=Release", f"-DMORI_GPU_BACKEND={backend}",
                 "-DMORI_BUILD_TESTS=OFF", f"-DPython_EXECUTABLE={python}"]
    if os.environ.get("MORI_GPU_ARCHS"):  # else CMake's default for the backend
        configure.append(f"-DMORI_GPU_ARCHS={os.environ['MORI_GPU_ARCHS']}")
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    try:
        import pybind11  # Debian's python3-pybind11, or pip's
        configure.append(f"-Dpybind11_DIR={pybind11.get_cmake_dir()}")
    except ImportError:
        pass
    return [configure, ["cmake", "--build", build, f"-j{jobs}"]]


def run_plan(variants, rounds):
    """[(round, variant name)] in the order the runs go: every variant once per round, in turn."""
    return [(r, name) for r in range(rounds) for name, _ in variants]


def phase_key(rec):
    return (rec["config"], rec["phase"], rec["dtype"], rec.get("variant") or "")


def key_text(key):
    config, phase, dtype, variant = key
    return f"{config} {phase} {dtype.upper()}" + (f" ({variant})" if variant else "")


def table(results, names):
    """results: {variant name: [records of one run, or None for a failed run], ...} -> markdown.
    Only mori's own rows (impl "mori") are compared."""
    times = {}  # key -> name -> [us]
    failed = {name: sum(1 for recs in results.get(name, []) if recs is None) for name in names}
    for name in names:
        for recs in results.get(name, []):
            for rec in recs or []:
                if rec.get("impl") == "mori" and rec.get("us") is not None:
                    times.setdefault(phase_key(rec), {}).setdefault(name, []).append(rec["us"])
    head = "| phase | " + " | ".join(names) + " |"
    lines = [head, "|---|" + "---|" * len(names)]
    for key in sorted(times):
        base = times[key].get(names[0])
        base_med = statistics.median(base) if base else None
        cells = []
        for name in names:
            us = times[key].get(name)
            if not us:
                cells.append("failed" if failed[name] else "—")
                continue
            med = statistics.median(us)
            cell = ", ".join(f"{u:.1f}" for u in us) + f" (median {med:.1f}"
            if name != names[0] and base_med:
                cell += f", {med / base_med:.3f}×"
            cells.append(cell + ")")
        lines.append(f"| {key_text(key)} | " + " | ".join(cells) + " |")
    notes = [f"{name}: {n} failed run(s)" for name, n in failed.items() if n]
    return "\n".join(lines + ([""] + notes if notes else []))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="git ref of the base build")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variant", action="append", default=[], metavar="NAME[@base]:VAR=VALUE[,...]",
                   help="the working tree (NAME@base: the base) with these settings (repeatable)")
    p.add_argument("--head-build", help="an existing build of the working tree (default: build it in build-ab)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="build jobs in all (default: the cores)")
    p.add_argument("--timeout", type=float, default=600, help="seconds one ep_bench.py run may take")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(own)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if "--json" in bench_args:
        p.error("ep_bench.py's --json is set by this script")
    try:
        extra = [parse_variant(v) for v in args.variant]
    except ValueError as e:
        p.error(str(e))
    if len({n for n, _, _ in extra}) != len(extra):
        p.error("variant names must differ")

    python = sys.executable
    base_tree = os.path.join(REPO, ".ab", safe_ref(args.base))
    base_src, base_build = os.path.join(base_tree, "src"), os.path.join(base_tree, "build")
    head_build = os.path.abspath(args.head_build) if args.head_build else os.path.join(REPO, "build-ab")
    backend = subprocess.run(["bash", "-c", f"source {shlex.quote(os.path.join(REPO, 'tools', 'gpu_env.sh'))}; "
                              "mori_detect_backend"], capture_output=True, text=True).stdout.strip() or "CUDA"
    half = max(1, args.jobs // 2)
    builds = [("base", build_commands(base_src, base_build, backend, half, python))]
    if not args.head_build:
        builds.append(("head", build_commands(REPO, head_build, backend, half, python)))
    variants = [("base", {}), ("head", {})] + [(name, env) for name, _, env in extra]
    tree = {"base": (base_src, base_build), "head": (REPO, head_build)}
    for name, which, _ in extra:
        tree[name] = tree[which]
    archive = archive_command(REPO, args.base, base_src)

    def bench_command(name, json_path):
        src, build = tree[name]
        env = dict(dict(variants)[name], MORI_BUILD_DIR=build)
        return env, [python, os.path.join(src, "tools", "bench", "ep_bench.py"), *bench_args, "--json", json_path]

    if args.dry_run:
        print(archive)
        for who, cmds in builds:
            for c in cmds:
                print(f"[{who}] " + shlex.join(c))
        for r, name in run_plan(variants, args.rounds):
            env, cmd = bench_command(name, f"<{name}-{r}.json>")
            print(f"[round {r + 1}] " + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(cmd))
        return 0

    if subprocess.run(["bash", "-c", archive]).returncode != 0:
        print(f"ab_bench.py: git archive of {args.base} failed", file=sys.stderr)
        return 2
    os.makedirs(base_tree, exist_ok=True)
    procs = []
    for who, cmds in builds:
        log = open(os.path.join(base_tree, f"build-{who}.log"), "w")
        script = " && ".join(shlex.join(c) for c in cmds)
        procs.append((who, log.name, subprocess.Popen(["bash", "-c", script], stdout=log, stderr=subprocess.STDOUT)))
    bad = [(who, path) for who, path, proc in procs if proc.wait() != 0]
    for who, path in bad:
        with open(path) as f:
            print(f"ab_bench.py: the {who} build failed ({path}):\n" + "".join(f.readlines()[-20:]), file=sys.stderr)
    if bad:
        return 2

    results = {name: [] for name, _ in variants}
    with tempfile.TemporaryDirectory(prefix="ab_bench.") as tmp:
        for r, name in run_plan(variants, args.rounds):
            path = os.path.join(tmp, f"{name}-{r}.json")
            env, cmd = bench_command(name, path)
            print(f"== round {r + 1}/{args.rounds}: {name}", flush=True)
            try:
                out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                                     timeout=args.timeout)
                ok = out.returncode == 0 and os.path.exists(path)
                tail = (out.stdout + out.stderr).splitlines()[-15:]
            except subprocess.TimeoutExpired:
                ok, tail = False, [f"timed out after {args.timeout:.0f} s"]
            if not ok:
                print(f"ab_bench.py: {name}, round {r + 1} failed:\n  " + "\n  ".join(tail), file=sys.stderr)
                results[name].append(None)
                continue
            results[name].append([rec for run in BJ.load([path]) for rec in run["records"]])
    base_commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", args.base], capture_output=True,
                                 text=True).stdout.strip()
    print(f"\nbase {args.base} ({base_commit or '?'}) against the working tree "
          f"({BJ.git_commit(REPO)}); ep_bench.py {shlex.join(bench_args)}; {args.rounds} round(s), µs:\n")
    print(table(results, [name for name, _ in variants]))
    return 1 if any(recs is None for runs in results.values() for recs in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
