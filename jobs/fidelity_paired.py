"""Paired per-seed gaps between jobs/fidelity.py runs, with a 95 % interval over seeds.

    python jobs/fidelity_paired.py --pair "exdyna+ d=0.01:dense" --pair "exdyna+ d=0.00338:topk d=0.001" \
        results/fidelity/2026-11-22/seeds/cnn_*.jsonl.gz

Reads the ``"kind": "run"`` records of the JSON lines given (``*.gz``: gzipped). For each
``RUN:REF`` pair and each workload that has both, the runs labelled RUN are grouped by recipe (the
adapter options of a ``+`` run), each group is matched seed by seed with the runs labelled REF
(which must not differ in recipe), and one row per group gives the seeds, the mean quality, the mean
of the per-seed differences (RUN - REF: percentage points of accuracy, or of loss for a loss
metric), its standard error and the 95 % interval (Student's t).
Seed-to-seed spread on the digits CNN is several points, so a pair of means without this says
little; the paired difference removes what the seed does to both runs alike.
"""
import argparse
import gzip
import json
import math
from collections import defaultdict

# two-sided 95 % quantiles of Student's t, degrees of freedom 1..30 (above: the normal's 1.96)
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)


def t95(df):
    return _T95[df - 1] if 1 <= df <= len(_T95) else 1.96


def load(paths):
    """Run records by workload and label: {(workload, label): {recipe key: {seed: record}}} (a later
    file wins a repeated seed). Unlike ``fidelity.load_records`` (which the table's averages use) runs
    of the same label and seed under different recipes are all kept: the seed studies are such files."""
    runs = defaultdict(lambda: defaultdict(dict))
    for path in paths:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            for line in f:
                r = json.loads(line)
                if r.get("kind") == "run":
                    key = (r.get("workload"), r["run"])
                    runs[key][json.dumps(r.get("recipe") or {}, sort_keys=True)][r["seed"]] = r
    return runs


def quality(r):
    v = r[r["quality_key"]]
    return 100.0 * v if r["quality_key"].endswith("acc") else v


def paired(runs, run_label, ref_label, workload):
    """Rows (recipe, seeds, mean, ref mean, gap, s.e., low, high, MB sent per rank) for one pair on
    one workload."""
    refs = runs.get((workload, ref_label), {})
    if len(refs) != 1:
        raise SystemExit(f"{workload} reference {ref_label!r}: expected runs of one recipe, found {len(refs)}")
    ref = next(iter(refs.values()))
    rows = []
    for recipe, by_seed in sorted(runs.get((workload, run_label), {}).items()):
        seeds = sorted(set(by_seed) & set(ref))
        if not seeds:
            continue
        x = [quality(by_seed[s]) for s in seeds]
        y = [quality(ref[s]) for s in seeds]
        d = [a - b for a, b in zip(x, y)]
        n = len(d)
        mean = sum(d) / n
        se = math.sqrt(sum((v - mean) ** 2 for v in d) / (n - 1) / n) if n > 1 else float("nan")
        half = t95(n - 1) * se if n > 1 else float("nan")
        mb = sum(by_seed[s]["bytes_total"] for s in seeds) / n / 1e6
        rows.append((recipe, seeds, sum(x) / n, sum(y) / n, mean, se, mean - half, mean + half, mb))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="fidelity.jsonl files")
    ap.add_argument("--pair", action="append", required=True, metavar="RUN:REF",
                    help="run label and reference label, e.g. 'exdyna+ d=0.01:dense'")
    a = ap.parse_args(argv)
    runs = load(a.files)
    print("| workload | run | recipe | seeds | n | mean | MB sent | reference | mean | gap | s.e. | 95 % interval |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    workloads = sorted({w for w, _ in runs}, key=str)
    for pair in a.pair:
        run_label, _, ref_label = pair.partition(":")
        for wl in (w for w in workloads if (w, run_label) in runs and (w, ref_label) in runs):
            for recipe, seeds, mx, my, gap, se, lo, hi, mb in paired(runs, run_label, ref_label, wl):
                opts = ",".join(f"{k}={v}" for k, v in json.loads(recipe).items()) or "none"
                print(f"| {wl} | {run_label} | `{opts}` | {seeds[0]}-{seeds[-1]} | {len(seeds)} | {mx:.2f} | "
                      f"{mb:.3f} | {ref_label} | {my:.2f} | {gap:+.2f} | {se:.2f} | [{lo:+.2f}, {hi:+.2f}] |")

if __name__ == "__main__":
    main()
