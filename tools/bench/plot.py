#!/usr/bin/env python3
"""Per-phase charts of bench_json documents (`ep_bench.py --json FILE`): for every machine kind, one
panel of bars, mori's time per phase beside the baselines measured in the same run (DeepEP, torch, the
copy kernel, a fused call), on a log scale (the baselines can be 30x slower).

    python3 tools/bench/plot.py out.json [more.json ...] -o phases.png    # or .svg, .pdf

Needs matplotlib (Debian: apt-get install python3-matplotlib; pip: pip install matplotlib);
without it, it prints so and exits 77 having drawn nothing.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_json as BJ  # noqa: E402
import report as R  # noqa: E402

SKIP_EXIT = 77
BASELINE_ORDER = ("DeepEP", "torch", "copy kernel", "fused", "empty kernel")
COLOURS = {"mori": "tab:blue", "DeepEP": "tab:red", "torch": "tab:orange", "copy kernel": "tab:green", "fused": "tab:purple",
           "empty kernel": "tab:gray"}  # the same in every panel


def series(runs):
    """{machine kind: (labels, {"mori" or a baseline impl: [µs or None per label]})}: one bar group
    per mori figure, in the order of the files."""
    recs = {}
    for run in runs:
        recs.setdefault(run["machine"], []).extend(r for r in run["records"] if r["impl"] == "mori")
    out = {}
    for kind, rs in recs.items():
        labels = []
        for r in rs:
            label = f"{r['kernel_type']} {r['config']} {R.phase(r)}"
            if r["ranks"] > 1 or r.get("nodes", 1) > 1:
                label += f", {R.topology(r)}"
            labels.append(label)
        bars = {"mori": [r["us"] for r in rs]}
        for impl in BASELINE_ORDER:
            if any(impl in r.get("baselines", {}) for r in rs):
                bars[impl] = [r.get("baselines", {}).get(impl) for r in rs]
        out[kind] = (labels, bars)
    return out


def draw(runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = series(runs)
    kinds = sorted(data, key=R.machine_order, reverse=True)
    heights = [max(2.0, 0.45 * len(data[k][0]) + 1.2) for k in kinds]
    fig, axes = plt.subplots(len(kinds), 1, figsize=(10, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, kind in zip(axes[:, 0], kinds):
        labels, bars = data[kind]
        impls = [i for i in ("mori",) + BASELINE_ORDER if i in bars]
        width = 0.8 / len(impls)
        for j, impl in enumerate(impls):
            ys = [i + (j - (len(impls) - 1) / 2) * width for i in range(len(labels))]
            vals = bars[impl]
            ax.barh([y for y, v in zip(ys, vals) if v], [v for v in vals if v], height=width, label=impl,
                    color=COLOURS[impl])
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("µs per call (log scale)")
        ax.set_title(kind.replace("x ", "× ", 1))
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="bench_json documents (ep_bench.py --json)")
    p.add_argument("-o", "--output", default="phases.png", help="image file; its extension picks the format")
    args = p.parse_args(argv)
    try:
        runs = BJ.load(args.files)
    except (OSError, BJ.SchemaError) as e:
        print(f"plot.py: {e}", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot.py: SKIPPED: matplotlib is not installed (Debian: apt-get install python3-matplotlib; "
              "pip: pip install matplotlib); nothing drawn", file=sys.stderr)
        return SKIP_EXIT
    if not any(labels for labels, _ in series(runs).values()):
        print("plot.py: no mori figures in the files; nothing drawn", file=sys.stderr)
        return 2
    draw(runs, args.output)
    print(f"plot.py: wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
