"""Benchmark figures as data (no GPU, no torch): the bench_json schema that `ep_bench.py --json`
writes, ep_bench's conversion of its result rows into records, the markdown tables of report.py
(and that docs/performance.md holds exactly the tables of docs/results/*.json), and plot.py."""

import json
import os
import subprocess
import sys

import bench_json as BJ
import pytest
import report as R

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BENCH = os.path.join(REPO, "tools", "bench")

HT = dict(config="HT", tokens=4096, hidden=7168, topk=8, experts=256)


def rec(**kw):
    fields = dict(impl="mori", kernel_type="IntraNode", phase="dispatch", dtype="bf16", ranks=4, us=500.0, **HT)
    fields.update(kw)
    return BJ.make_record(**fields)


def doc_of(machine="4x H200", gpu="NVIDIA H200", gpus=4, records=None, commit="abc1234", command="python3 x.py"):
    run = BJ.make_run(tool="tools/bench/ep_bench.py", command=command, commit=commit, machine=machine, gpu=gpu,
                      gpus=gpus, sm_count=132, date="2026-11-27T10:00:00Z", records=records or [rec()])
    return BJ.document([run])


# --- schema ----------------------------------------------------------------------------------
def test_record_defaults_and_types():
    r = rec()
    assert r["variant"] == "" and r["nodes"] == 1 and r["gpus_per_node"] == 4 and r["baselines"] == {}
    assert r["blocks"] is None and r["physical_gbps"] is None and r["us_repeats"] == []
    assert rec(ranks=4, nodes=2)["gpus_per_node"] == 2


@pytest.mark.parametrize("bad, message", [
    (dict(us="fast"), "'us'"),
    (dict(us=0.0), "us must be > 0"),
    (dict(ranks=True), "'ranks'"),  # a bool is not a count
    (dict(impl="cublas"), "impl"),
    (dict(colour="red"), "unknown field"),
    (dict(baselines={"torch": "slow"}), "baseline"),
    (dict(baselines={"nccl": 3.0}), "baseline"),
    (dict(us_repeats=[1.0, "x"]), "us_repeats"),
])
def test_record_rejects(bad, message):
    with pytest.raises(BJ.SchemaError, match=message):
        rec(**bad)


def test_missing_field_is_named():
    with pytest.raises(BJ.SchemaError, match="missing field 'tokens'"):
        BJ.make_record(impl="mori", kernel_type="IntraNode", config="HT", phase="dispatch", ranks=1, hidden=1,
                       topk=1, experts=1, us=1.0)


def test_write_load_round_trip(tmp_path):
    d = doc_of(records=[rec(), rec(phase="combine", baselines={"torch": 1000.0})])
    p = str(tmp_path / "a.json")
    BJ.write(p, d)
    with open(p) as f:
        assert json.load(f) == d
    assert BJ.load([p, p]) == d["runs"] * 2


def test_load_names_the_file_and_the_problem(tmp_path):
    p = tmp_path / "bad.json"
    d = doc_of()
    d["runs"][0]["records"][0]["us"] = -1
    p.write_text(json.dumps(d))
    with pytest.raises(BJ.SchemaError, match=r"bad\.json: runs\[0\]\.records\[0\]: us must be > 0"):
        BJ.load([str(p)])
    p.write_text(json.dumps({"schema": "other/9", "runs": []}))
    with pytest.raises(BJ.SchemaError, match="not a mori-bench/1 document"):
        BJ.load([str(p)])
    p.write_text("{")
    with pytest.raises(BJ.SchemaError, match="not JSON"):
        BJ.load([str(p)])


def test_run_facts(monkeypatch):
    assert BJ.machine_kind("NVIDIA H100 80GB HBM3", 2) == "2x H100"
    assert BJ.machine_kind("NVIDIA H200", 4) == "4x H200"
    assert BJ.machine_kind("AMD Instinct MI300X", 8) == "8x Instinct"
    for name in [k for k in os.environ if k.startswith(("MORI_", "CUDA_", "NVSHMEM_"))]:  # the caller's own
        monkeypatch.delenv(name)
    monkeypatch.setenv("MORI_EP_PDL", "0")
    monkeypatch.setenv("MORI_BUILD_DIR", "/somewhere")
    cmd = BJ.command_line(["tools/bench/ep_bench.py", "--nproc", "4", "--ht-grid", "20,24:16", "--json", "a b.json"])
    assert cmd.startswith("MORI_EP_PDL=0 python3 tools/bench/ep_bench.py --nproc 4")
    assert "'a b.json'" in cmd and "MORI_BUILD_DIR" not in cmd
    monkeypatch.setenv("MORI_TEST_STORE_FILE", "/tmp/mori-ranks-x/store")  # set for spawned ranks
    cmd = BJ.command_line([os.path.join(REPO, "tools", "bench", "ep_bench.py"), "--nproc", "2"])
    assert cmd == "MORI_EP_PDL=0 python3 tools/bench/ep_bench.py --nproc 2", cmd
    assert "MORI_EP_PDL=0 torchrun --nproc-per-node=4 x.py" == BJ.command_line(["x.py"], "torchrun --nproc-per-node=4")
    monkeypatch.setenv("NVSHMEM_REMOTE_TRANSPORT", "none")  # DeepEP's LL mode on one node: kept
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "1")  # machine policy, not what the run compares: left out
    assert BJ.command_line(["x.py"]) == "MORI_EP_PDL=0 NVSHMEM_REMOTE_TRANSPORT=none python3 x.py"
    commit = BJ.git_commit(REPO)
    assert commit is None or (4 <= len(commit) <= 40 and all(c in "0123456789abcdef" for c in commit))
    assert BJ.git_commit("/") is None  # not a repository


# --- ep_bench.py: rows -> records, without torch ---------------------------------------------
def test_ep_bench_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None; sys.path.insert(0, %r); import ep_bench; "
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]; print('ok')" % BENCH)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def _bench_rows():
    import ep_bench as B

    k = dict(config="HT", tokens=4096, phase="dispatch", dtype="BF16")
    c = dict(config="HT", tokens=4096, phase="combine", dtype="BF16")
    return [
        B.row(k, 525.0, 404.0, 390.0, 300.0, (24, 16)),
        B.row(dict(k, impl="copy kernel"), 400.0, 530.0, 530.0, 0.0, (24, 16)),
        B.row(dict(k, impl="empty kernel"), 1.0, 0.0, 0.0, 0.0, (1, 1)),
        B.row(c, 530.0, 400.0, 395.0, 299.0, (20, 16)),
        B.row(dict(c, variant="external input"), 790.0, 268.0, 260.0, 200.0, (20, 16)),
        B.row(dict(c, impl="copy kernel"), 410.0, 520.0, 520.0, 0.0, (20, 16)),
        B.row(dict(k, impl="torch"), 1043.0, 203.0, 200.0, 150.0, None),
        B.row(dict(c, impl="torch"), 1600.0, 130.0, 128.0, 99.0, None),
    ]


def test_ep_bench_labels_match_the_printed_table():
    rows = _bench_rows()
    assert [r["label"] for r in rows] == [
        "HT dispatch BF16", "HT dispatch BF16 [copy kernel]", "HT dispatch BF16 [empty kernel]", "HT combine BF16",
        "HT combine BF16 (external input)", "HT combine BF16 [copy kernel]", "HT dispatch BF16 [torch]",
        "HT combine BF16 [torch]"]


def test_ep_bench_alternate_times_in_turn_and_keeps_medians():
    """A sweep's winner is timed again, and the external-input combine in turn with the registered
    one: alternate() calls the timers a, b, a, b, ... and keeps each one's median."""
    import ep_bench as B

    calls = []
    seq = {"registered": iter([3.0, 1.0, 2.0]), "external": iter([10.0, 30.0, 20.0])}

    def timer(name):
        def f():
            calls.append(name)
            return next(seq[name])
        return f

    med = B.alternate({"registered": timer("registered"), "external": timer("external")}, 3)
    assert calls == ["registered", "external"] * 3
    assert med == {"registered": 2.0, "external": 20.0}
    assert B.alternate({"one": lambda: 5.0}, 1) == {"one": 5.0}


def test_ep_bench_records_carry_settings_and_same_run_baselines():
    import ep_bench as B

    recs = B.records(_bench_rows(), ranks=4, linked=True, shared=False)
    assert len(recs) == 8  # every printed figure
    d, c, ext = recs[0], recs[3], recs[4]
    assert (d["impl"], d["kernel_type"], d["config"], d["phase"], d["dtype"]) == ("mori", "IntraNode", "HT", "dispatch", "bf16")
    assert (d["ranks"], d["nodes"], d["gpus_per_node"], d["tokens"], d["hidden"], d["topk"], d["experts"]) == \
        (4, 1, 4, 4096, B.HIDDEN, B.TOPK, B.EXPERTS)
    assert (d["blocks"], d["warps"], d["us"], d["logical_gbps"], d["logical_gbps_min"], d["physical_gbps"]) == \
        (24, 16, 525.0, 404.0, 390.0, 300.0)
    assert d["baselines"] == {"copy kernel": 400.0, "empty kernel": 1.0, "torch": 1043.0}
    assert c["baselines"] == {"copy kernel": 410.0, "torch": 1600.0}
    # the kernel baselines time the zero-copy launch; the external-input row keeps torch only
    assert ext["variant"] == "external input" and ext["baselines"] == {"torch": 1600.0}
    assert recs[1]["impl"] == "copy kernel" and recs[1]["physical_gbps"] is None and recs[1]["baselines"] == {}
    assert recs[2]["blocks"] is None  # the empty kernel's 1 x 1 launch is not the phase's
    assert recs[6]["impl"] == "torch" and recs[6]["blocks"] is None and recs[6]["physical_gbps"] == 150.0
    # ranks sharing GPUs: nothing crossed a link
    shared = B.records(_bench_rows(), ranks=4, linked=False, shared=True)
    assert all(r["physical_gbps"] is None and r["ranks_share_gpus"] for r in shared)


def test_ep_bench_deep_ep_rows_are_same_run_baselines(capsys):
    """--compare deep_ep: DeepEP's rows become baselines of the mori rows of the same phase, the
    external-input combine included (DeepEP always combines the caller's tensor), and the printed
    table gains "vs DeepEP" (its time over ours) and, with a store-ceiling probe, "of ceiling"."""
    import ep_bench as B

    k = dict(config="HT", tokens=4096, phase="dispatch", dtype="BF16")
    c = dict(config="HT", tokens=4096, phase="combine", dtype="BF16")
    rows = [B.row(k, 500.0, 400.0, 390.0, 300.0, (24, 16)),
            B.row(c, 520.0, 390.0, 385.0, 290.0, (24, 16)),
            B.row(dict(c, variant="external input"), 650.0, 312.0, 300.0, 230.0, (24, 16)),
            B.row(dict(k, impl="DeepEP"), 800.0, 250.0, 245.0, 190.0, None),
            B.row(dict(c, impl="DeepEP"), 600.0, 338.0, 330.0, 250.0, None)]
    recs = B.records(rows, ranks=4, linked=True, shared=False)
    assert recs[0]["baselines"] == {"DeepEP": 800.0}
    assert recs[1]["baselines"] == {"DeepEP": 600.0} and recs[2]["baselines"] == {"DeepEP": 600.0}
    assert recs[3]["impl"] == "DeepEP" and recs[3]["blocks"] is None
    B.print_results(rows, {}, "4 rank(s)", linked=True, four_gpus=False, logical_ceiling=500.0)
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| phase"))
    assert "vs DeepEP" in header and "of ceiling" in header
    line = next(line for line in out.splitlines() if line.startswith("| HT dispatch BF16 "))
    assert line.rstrip(" |").endswith("1.60x |       0.80"), line
    ext = next(line for line in out.splitlines() if "(external input)" in line)
    assert "0.92x" in ext and "0.62" in ext, ext
    deep = next(line for line in out.splitlines() if "[DeepEP]" in line and "dispatch" in line)
    assert "0.50" in deep, deep  # its own share of the ceiling, no ratio to itself
    assert R.baselines_cell(recs[0]) == "DeepEP 800.0 µs (1.60×)"
    run = BJ.make_run(tool="tools/bench/ep_bench.py", command="python3 tools/bench/ep_bench.py --compare deep_ep",
                      commit="abc1234", machine="4x H200", gpu="NVIDIA H200", gpus=4, sm_count=132,
                      settings={BJ.STORE_CEILING: 322.4}, date="2026-11-29", records=recs)
    lines = R.tables([run])
    assert any(line.startswith("- a: `abc1234`") and "store ceiling 322.4 GB/s per rank (physical)" in line
               for line in lines), lines


def test_ep_bench_json_document(tmp_path):
    import ep_bench as B

    argv = ["tools/bench/ep_bench.py", "--nproc", "4", "--json", "out.json"]
    d = B.json_document(_bench_rows(), ranks=4, linked=True, shared=False, gpu="NVIDIA H200", gpus=4, sm_count=132,
                        settings={"torch": "2.11"}, argv=argv)
    BJ.validate(d)
    (run,) = d["runs"]
    assert run["machine"] == "4x H200" and run["gpu"] == "NVIDIA H200" and run["gpus"] == 4
    assert run["command"].endswith("python3 tools/bench/ep_bench.py --nproc 4 --json out.json")
    assert run["commit"] == BJ.git_commit() and run["date"].endswith("Z") and run["settings"] == {"torch": "2.11"}
    p = str(tmp_path / "out.json")
    BJ.write(p, d)
    lines = R.tables(BJ.load([p]))
    assert any(line.startswith("| IntraNode | 4 ranks | HT: 4096 × 7168, top-8/256 | dispatch BF16 | 525.0 | 404.0 / 300.0 |")
               and "torch 1,043.0 µs (2.0×)" in line and "copy kernel 400.0 µs (0.76)" in line for line in lines)


# --- report.py -------------------------------------------------------------------------------
def test_report_tables():
    runs = doc_of(machine="1x H100", gpu="NVIDIA H100 80GB HBM3", gpus=1, commit=None, records=[
        rec(ranks=1, us=80.0, blocks=24, warps=16)])["runs"]
    runs += doc_of(records=[
        rec(us=525.1, us_repeats=[525.1, 530.2], logical_gbps=403.9, blocks=24, warps=16, baselines={"torch": 1043.0}),
        rec(phase="combine", variant="split: send + receive", config="LL", tokens=128, us=37.6, baselines={"fused": 33.2},
            note="a note"),
        rec(impl="torch", us=1043.0),  # a baseline: in its row's cell, not a row of its own
        rec(kernel_type="InterNodeV1", nodes=2, phase="combine GPU work", us=417.3, ranks=4),
    ])["runs"]
    text = "\n".join(R.tables(runs))
    assert text.index("### 4× H200") < text.index("### 1× H100")  # newer model first, then more GPUs
    assert "| IntraNode | 4 ranks | HT: 4096 × 7168, top-8/256 | dispatch BF16 | 525.1 (525.1–530.2) | 403.9 | " \
           "24 (24 × 16) | torch 1,043.0 µs (2.0×) | a |" in text
    assert "| combine BF16 (split: send + receive) | 37.6 | — | — | fused 33.2 µs; a note | a |" in text
    assert "| InterNodeV1 | 2 nodes × 2 (emulated) |" in text
    assert text.count("| IntraNode | 4 ranks |") == 2  # the torch record is no row
    assert "- a: `abc1234`, 2026-11-27: `python3 x.py`" in text
    assert "- a: commit unknown, 2026-11-27: `python3 x.py`" in text


def test_report_update_and_check(tmp_path):
    data = tmp_path / "r.json"
    BJ.write(str(data), doc_of())
    md = tmp_path / "perf.md"
    md.write_text(f"# Results\n\nintro\n\n{R.BEGIN}\nold\n{R.END}\n\nafter\n")
    assert R.main([str(data), "--check", str(md)]) == 1
    assert R.main([str(data), "--update", str(md)]) == 0
    text = md.read_text()
    assert text.startswith("# Results\n\nintro\n\n" + R.BEGIN) and text.endswith(R.END + "\n\nafter\n")
    assert "| IntraNode | 4 ranks |" in text and "old" not in text
    assert R.main([str(data), "--check", str(md)]) == 0
    assert R.main([str(data), "--update", str(md)]) == 0 and md.read_text() == text  # idempotent
    (tmp_path / "plain.md").write_text("no markers\n")
    assert R.main([str(data), "--update", str(tmp_path / "plain.md")]) == 2
    assert R.main([str(tmp_path / "missing.json")]) == 2


def test_performance_doc_tables_come_from_the_data():
    import glob

    files = sorted(glob.glob(os.path.join(REPO, "docs", "results", "*.json")))
    assert files, "docs/results/*.json are missing"
    assert R.main(files + ["--check", os.path.join(REPO, "docs", "performance.md")]) == 0


# --- plot.py ---------------------------------------------------------------------------------
def test_plot_without_matplotlib_says_so(tmp_path):
    data = tmp_path / "r.json"
    BJ.write(str(data), doc_of())
    code = ("import sys; sys.modules['matplotlib'] = None; sys.path.insert(0, %r); import plot; "
            "sys.exit(plot.main([%r, '-o', %r]))" % (BENCH, str(data), str(tmp_path / "x.png")))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 77, out.stderr
    assert "matplotlib is not installed" in out.stderr and not (tmp_path / "x.png").exists()


def test_plot_series():
    import plot

    runs = doc_of(records=[rec(baselines={"torch": 1000.0}), rec(phase="combine", baselines={"copy kernel": 400.0}),
                           rec(impl="torch", us=1000.0)])["runs"]
    labels, bars = plot.series(runs)["4x H200"]
    assert labels == ["IntraNode HT dispatch BF16, 4 ranks", "IntraNode HT combine BF16, 4 ranks"]
    assert bars == {"mori": [500.0, 500.0], "torch": [1000.0, None], "copy kernel": [None, 400.0]}


@pytest.mark.parametrize("ext, magic", [("png", b"\x89PNG"), ("svg", b"<?xml")])
def test_plot_draws(tmp_path, ext, magic):
    pytest.importorskip("matplotlib", reason="NEEDS MATPLOTLIB: plot.py draws nothing without it")
    import plot

    data = tmp_path / "r.json"
    BJ.write(str(data), doc_of(records=[rec(baselines={"torch": 1000.0}), rec(phase="combine")]))
    out = tmp_path / f"phases.{ext}"
    assert plot.main([str(data), "-o", str(out)]) == 0
    assert out.read_bytes().startswith(magic)
