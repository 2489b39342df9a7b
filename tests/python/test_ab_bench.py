"""tools/bench/ab_bench.py without a GPU: variant settings, the order of the runs, the table of
their records, and the commands of a dry run."""

import contextlib
import io
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools", "bench")
sys.path.insert(0, BENCH)
import ab_bench as AB  # noqa: E402


def test_variants_parse_and_bad_ones_raise():
    assert AB.parse_variant("lb10:MORI_EP_DISPATCH_LOCAL_BLOCKS=10") == \
        ("lb10", "head", {"MORI_EP_DISPATCH_LOCAL_BLOCKS": "10"})
    assert AB.parse_variant("x.1:A=,B_2=y=z") == ("x.1", "head", {"A": "", "B_2": "y=z"})
    assert AB.parse_variant("b10@base:A=1") == ("b10", "base", {"A": "1"})
    assert AB.parse_variant("h@head:A=1") == ("h", "head", {"A": "1"})
    for bad in ("lb10", "lb10:", ":A=1", "base:A=1", "head:A=1", "a b:A=1", "v:a=1", "v:A", "v:A=1,",
                "v@:A=1", "v@main:A=1", "base@base:A=1", "@base:A=1"):
        with pytest.raises(ValueError):
            AB.parse_variant(bad)


def test_every_variant_runs_once_per_round_in_turn():
    variants = [("base", {}), ("head", {}), ("v", {"A": "1"})]
    assert AB.run_plan(variants, 2) == [(0, "base"), (0, "head"), (0, "v"), (1, "base"), (1, "head"), (1, "v")]


def _rec(phase, dtype, us, variant="", impl="mori", config="HT"):
    return {"config": config, "phase": phase, "dtype": dtype, "variant": variant, "impl": impl, "us": us}


def test_table_lists_every_round_the_median_and_the_ratio_to_base():
    results = {
        "base": [[_rec("dispatch", "fp8", 120.0), _rec("dispatch", "fp8", 60.0, impl="copy kernel")],
                 [_rec("dispatch", "fp8", 118.0)], [_rec("dispatch", "fp8", 119.0)]],
        "head": [[_rec("dispatch", "fp8", 110.0), _rec("combine", "bf16", 200.0, variant="external input")],
                 None, [_rec("dispatch", "fp8", 112.0)]],
    }
    text = AB.table(results, ["base", "head"])
    lines = text.splitlines()
    assert lines[0] == "| phase | base | head |"
    row = next(line for line in lines if line.startswith("| HT dispatch FP8 |"))
    # rounds in order, the median, and head's median over base's (111 / 119)
    assert "120.0, 118.0, 119.0 (median 119.0)" in row
    assert f"110.0, 112.0 (median 111.0, {111 / 119:.3f}×)" in row
    assert "60.0" not in text  # only mori's rows
    ext = next(line for line in lines if "(external input)" in line)
    assert ext.startswith("| HT combine BF16 (external input) | — |") and "(median 200.0)" in ext
    assert "head: 1 failed run(s)" in text


def test_a_variant_whose_runs_all_failed_says_so():
    text = AB.table({"base": [[_rec("dispatch", "bf16", 180.0)]], "head": [None]}, ["base", "head"])
    assert "| HT dispatch BF16 | 180.0 (median 180.0) | failed |" in text


def test_dry_run_prints_the_builds_and_the_alternated_runs():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = AB.main(["--base", "HEAD", "--rounds", "2", "--variant", "lb10:MORI_EP_DISPATCH_LOCAL_BLOCKS=10",
                      "--jobs", "4", "--dry-run", "--", "--nproc", "2", "--configs", "ht"])
    assert rc == 0
    lines = out.getvalue().splitlines()
    assert "rev-parse --verify 'HEAD^{commit}'" in lines[0] and "archive" in lines[0]
    builds = [line for line in lines if line.startswith("[base]") or line.startswith("[head]")]
    assert len(builds) == 4 and all("-j2" in line for line in builds if "--build" in line)
    runs = [line for line in lines if line.startswith("[round")]
    assert len(runs) == 6
    assert [("ab/HEAD/src" in r, "MORI_EP_DISPATCH_LOCAL_BLOCKS=10" in r) for r in runs[:3]] == \
        [(True, False), (False, False), (False, True)]
    assert all(r.endswith("--nproc 2 --configs ht --json '<%s-%d.json>'" % (n, i))
               for r, (i, n) in zip(runs, AB.run_plan([("base", {}), ("head", {}), ("lb10", {})], 2)))
    # a variant of the base runs the base tree's bench with the base build and its settings
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        AB.main(["--base", "HEAD", "--rounds", "1", "--variant", "b8@base:MORI_EP_DISPATCH_LOCAL_BLOCKS=8",
                 "--dry-run", "--", "--nproc", "2"])
    runs = [line for line in out.getvalue().splitlines() if line.startswith("[round")]
    assert len(runs) == 3
    assert "MORI_EP_DISPATCH_LOCAL_BLOCKS=8" in runs[2] and "ab/HEAD/build" in runs[2] and "ab/HEAD/src" in runs[2]
    # an existing build of the working tree is taken as it is
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        AB.main(["--base", "HEAD", "--head-build", "/tmp/b", "--dry-run", "--", "--nproc", "2"])
    assert not any(line.startswith("[head]") for line in out.getvalue().splitlines())
    assert "MORI_BUILD_DIR=/tmp/b" in out.getvalue()


def test_json_is_the_scripts_own_argument():
    with pytest.raises(SystemExit):
        AB.main(["--base", "HEAD", "--dry-run", "--", "--json", "x.json"])
    with pytest.raises(SystemExit):
        AB.main(["--base", "HEAD", "--variant", "a:X=1", "--variant", "a:X=2", "--dry-run"])


def test_the_base_tree_is_extracted_again_only_for_another_commit(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "f.txt").write_text("one\n")
    subprocess.run(git + ["add", "f.txt"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "one"], check=True)
    dest = tmp_path / "ab" / "src"
    cmd = AB.archive_command(str(repo), "HEAD", str(dest))
    subprocess.run(["bash", "-c", cmd], check=True)
    assert (dest / "f.txt").read_text() == "one\n"
    os.utime(dest / "f.txt", (1, 1))  # a time the extraction would not give
    subprocess.run(["bash", "-c", cmd], check=True)
    assert os.stat(dest / "f.txt").st_mtime == 1  # same commit: kept as it was
    (repo / "f.txt").write_text("two\n")
    subprocess.run(git + ["commit", "-q", "-am", "two"], check=True)
    subprocess.run(["bash", "-c", cmd], check=True)
    assert (dest / "f.txt").read_text() == "two\n" and os.stat(dest / "f.txt").st_mtime != 1
    assert subprocess.run(["bash", "-c", AB.archive_command(str(repo), "no-such-ref", str(dest))],
                          capture_output=True).returncode != 0
