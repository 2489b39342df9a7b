"""Benchmark figures as data: the JSON documents that `ep_bench.py --json FILE` writes and that
`report.py` (markdown tables) and `plot.py` (per-phase charts) read. Plain Python: no torch, no
mori, so the schema can be written, read and tested anywhere.

A document:

    {"schema": "mori-bench/1",
     "runs": [{"tool": "tools/bench/ep_bench.py",
               "command": "python3 tools/bench/ep_bench.py --nproc 4 --json out.json",
               "commit": "67add9b" or null, "date": "2026-11-27T10:00:00Z" or null,
               "machine": "4x H200",                     # the machine kind the tables group by
               "gpu": "NVIDIA H200", "gpus": 4, "sm_count": 132,
               "settings": {...},                        # anything else of the run (env, torch)
               "records": [RECORD, ...]}]}

A RECORD is one printed figure:

    impl         "mori", or a baseline measured in the same run: "torch" (count exchange,
                 permutation, all_to_all_single), "copy kernel" (the library's grid copy of the
                 phase's bytes on the phase's launch), "empty kernel", "fused" (the fused call
                 against a split-phase one)
    kernel_type  IntraNode, AsyncLL, InterNode, InterNodeV1, InterNodeV1LL
    config       "HT" or "LL" (or any label of the shape)
    phase        "dispatch", "combine", or a named part of one (e.g. "dispatch GPU work")
    variant      "" or e.g. "external input", "MORI_EP_COMBINE_PUSH=0"
    dtype        "bf16", "fp8", ...
    ranks, nodes, gpus_per_node, ranks_share_gpus
    tokens, hidden, topk, experts
    blocks, warps                          (null where the kernel picks them or n/a)
    us                                     time per call (slowest rank)
    us_repeats                             every repetition, where a row was measured repeatedly
    logical_gbps, logical_gbps_min         received rows x row bytes / time (mean, min over ranks)
    physical_gbps                          rows that crossed a link x row bytes / time (or null)
    baselines                              {impl: us} of the baselines of this row in the same run
    note                                   free text (or "")

`make_record` fills the defaults and checks the types; `validate` checks a whole document.
"""

import datetime
import json
import os
import shlex
import subprocess
import sys

SCHEMA = "mori-bench/1"

IMPLS = ("mori", "torch", "copy kernel", "empty kernel", "fused", "DeepEP")

# Run setting: ep_bench.py's store-ceiling probe of the same run (one rank's plain stores into all
# its peers at once, physical GB/s per rank); report.py quotes it under the table.
STORE_CEILING = "store ceiling GB/s per rank (physical)"

# field: (types, required); None is allowed where the types include type(None)
_NUM = (int, float)
RECORD_FIELDS = {
    "impl": ((str,), True),
    "kernel_type": ((str,), True),
    "config": ((str,), True),
    "phase": ((str,), True),
    "variant": ((str,), False),
    "dtype": ((str,), False),
    "ranks": ((int,), True),
    "nodes": ((int,), False),
    "gpus_per_node": ((int,), False),
    "ranks_share_gpus": ((bool,), False),
    "tokens": ((int,), True),
    "hidden": ((int,), True),
    "topk": ((int,), True),
    "experts": ((int,), True),
    "blocks": ((int, type(None)), False),
    "warps": ((int, type(None)), False),
    "us": (_NUM, True),
    "us_repeats": ((list,), False),
    "logical_gbps": (_NUM + (type(None),), False),
    "logical_gbps_min": (_NUM + (type(None),), False),
    "physical_gbps": (_NUM + (type(None),), False),
    "baselines": ((dict,), False),
    "note": ((str,), False),
}

RUN_FIELDS = {
    "tool": ((str,), True),
    "command": ((str,), True),
    "commit": ((str, type(None)), True),
    "date": ((str, type(None)), False),
    "machine": ((str,), True),
    "gpu": ((str,), True),
    "gpus": ((int,), True),
    "sm_count": ((int, type(None)), False),
    "settings": ((dict,), False),
    "records": ((list,), True),
}

_DEFAULTS = {"variant": "", "dtype": "", "nodes": 1, "ranks_share_gpus": False, "blocks": None, "warps": None,
             "us_repeats": [], "logical_gbps": None, "logical_gbps_min": None, "physical_gbps": None,
             "baselines": {}, "note": ""}


class SchemaError(ValueError):
    pass


def _check(obj, fields, where):
    if not isinstance(obj, dict):
        raise SchemaError(f"{where}: expected an object, got {type(obj).__name__}")
    unknown = set(obj) - set(fields)
    if unknown:
        raise SchemaError(f"{where}: unknown field(s) {sorted(unknown)}")
    for name, (types, required) in fields.items():
        if name not in obj:
            if required:
                raise SchemaError(f"{where}: missing field {name!r}")
            continue
        v = obj[name]
        # bool is an int in Python: a count or a time given as true/false is an error
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            raise SchemaError(f"{where}: field {name!r} = {v!r} is not {'/'.join(t.__name__ for t in types)}")


def make_record(**fields):
    """A record with the defaults filled in; raises SchemaError on a missing or mistyped field."""
    rec = dict(_DEFAULTS)
    rec.update(fields)
    if "gpus_per_node" not in rec:
        rec["gpus_per_node"] = rec.get("ranks", 0) // max(1, rec.get("nodes", 1))
    _check(rec, RECORD_FIELDS, "record")
    _check_record_values(rec, "record")
    return rec


def _check_record_values(rec, where):
    if rec["impl"] not in IMPLS:
        raise SchemaError(f"{where}: impl {rec['impl']!r} is not one of {IMPLS}")
    if rec["us"] <= 0:
        raise SchemaError(f"{where}: us must be > 0, got {rec['us']}")
    if not all(isinstance(v, _NUM) and not isinstance(v, bool) for v in rec.get("us_repeats", [])):
        raise SchemaError(f"{where}: us_repeats must hold numbers")
    for k, v in rec.get("baselines", {}).items():
        if k not in IMPLS or not isinstance(v, _NUM) or isinstance(v, bool):
            raise SchemaError(f"{where}: baseline {k!r}: {v!r} (expected an impl name and µs)")


def make_run(tool, command, commit, machine, gpu, gpus, records, sm_count=None, settings=None, date=None):
    run = dict(tool=tool, command=command, commit=commit, date=date, machine=machine, gpu=gpu, gpus=gpus,
               sm_count=sm_count, settings=settings or {}, records=list(records))
    validate({"schema": SCHEMA, "runs": [run]})
    return run


def validate(doc):
    """Checks a document; returns it. Raises SchemaError naming the first problem."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise SchemaError(f"not a {SCHEMA} document (schema = {doc.get('schema') if isinstance(doc, dict) else None!r})")
    if set(doc) - {"schema", "runs"}:
        raise SchemaError(f"document: unknown field(s) {sorted(set(doc) - {'schema', 'runs'})}")
    runs = doc.get("runs")
    if not isinstance(runs, list):
        raise SchemaError("document: 'runs' must be a list")
    for i, run in enumerate(runs):
        _check(run, RUN_FIELDS, f"runs[{i}]")
        for j, rec in enumerate(run["records"]):
            where = f"runs[{i}].records[{j}]"
            _check(rec, RECORD_FIELDS, where)
            _check_record_values(rec, where)
    return doc


def document(runs):
    return validate({"schema": SCHEMA, "runs": list(runs)})


def write(path, doc):
    validate(doc)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def load(paths):
    """The runs of every document in `paths`, in order."""
    runs = []
    for p in paths:
        with open(p) as f:
            try:
                doc = json.load(f)
            except json.JSONDecodeError as e:
                raise SchemaError(f"{p}: not JSON: {e}") from None
        try:
            validate(doc)
        except SchemaError as e:
            raise SchemaError(f"{p}: {e}") from None
        runs.extend(doc["runs"])
    return runs


# --- facts of the run ------------------------------------------------------------------------
def git_commit(repo=None):
    """`git rev-parse --short HEAD` of the repository, or None where git or the repository is missing."""
    repo = repo or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        out = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def command_line(argv=None, launcher="python3"):
    """The command as typed: the environment variables that change what runs (MORI_*, CUDA_*, and
    NVSHMEM_REMOTE_TRANSPORT, which DeepEP's low-latency mode needs on one node), then
    the launcher (python3, or e.g. torchrun --nproc-per-node=4) and the arguments, shell-quoted."""
    argv = list(sys.argv if argv is None else argv)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if argv and os.path.isabs(argv[0]) and argv[0].startswith(repo + os.sep):
        argv[0] = os.path.relpath(argv[0], repo)  # as typed from the repository root
    # Not what a user sets: where the build is, and the file store the spawned ranks meet through.
    internal = ("MORI_BUILD_DIR", "MORI_TEST_STORE_FILE")
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
           if k.startswith(("MORI_", "CUDA_VISIBLE_DEVICES", "CUDA_MODULE_LOADING", "CUDA_DEVICE_MAX_CONNECTIONS",
                                  "NVSHMEM_REMOTE_TRANSPORT"))
           and k not in internal]
    return " ".join(env + [launcher] + [shlex.quote(a) for a in argv])


def utc_now():
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def machine_kind(gpu_name, gpus):
    """"4x H200" from "NVIDIA H200" and 4: the vendor prefix and the memory suffix dropped."""
    name = gpu_name
    for prefix in ("NVIDIA ", "AMD "):
        if name.startswith(prefix):
            name = name[len(prefix):]
    name = name.split()[0] if name.split() else gpu_name
    return f"{gpus}x {name}"
