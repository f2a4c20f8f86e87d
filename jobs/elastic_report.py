#!/usr/bin/env python
"""The table of jobs/run_elastic.sh: each elastic run against its seed's uninterrupted 4-rank run.

    python jobs/elastic_report.py out/elastic       # reads <case>-s<seed>/metrics.jsonl

Writes ``elastic.jsonl`` (one line per run: the final validation loss, the wall time of the
training loop, the ranks lost and at which step, the recovery's seconds) and ``elastic.md``.
"""
import glob
import json
import os
import re
import sys


def run_line(folder):
    recs = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
    run = [r for r in recs if r["kind"] == "run"][-1]
    steps = [r for r in recs if r["kind"] == "step"]
    lost = [r for r in recs if r["kind"] == "ranks_lost"]
    reshard = [r for r in recs if r["kind"] == "reshard"]
    case, seed = re.match(r"(\w+)-s(\d+)$", os.path.basename(folder)).groups()
    return {"case": case, "seed": int(seed), "val_loss": run["val_loss"], "wall": run["wall"],
            "steps": len(steps), "ranks_end": run["ranks"], "identical": run["params_identical"],
            "lost": [r["lost"] for r in lost], "lost_at": [r["step"] for r in lost],
            "recovery_s": [r["seconds"] for r in lost],
            "resharded_at": [(r["job_step"], r["to_ranks"]) for r in reshard],
            "step_s_4": sum(r["t_compute"] + r["t_select"] + r["t_exchange"] for r in steps if r["ranks"] == 4)
            / max(1, sum(r["ranks"] == 4 for r in steps))}


def main(out):
    lines = [run_line(f) for f in sorted(glob.glob(os.path.join(out, "*-s*"))) if os.path.isdir(f)]
    ref = {r["seed"]: r for r in lines if r["case"] == "reference"}
    with open(os.path.join(out, "elastic.jsonl"), "w") as f:
        for r in lines:
            f.write(json.dumps(r) + "\n")
    rows = ["| seed | run | ranks at the end | lost (at step) | recovery s | val loss | vs 4-rank run | wall s "
            "| wall vs 4-rank run | identical |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(lines, key=lambda r: (r["seed"], r["case"] != "reference", r["case"])):
        base = ref.get(r["seed"])
        rel = "" if base is None or r is base else f"{100 * (r['val_loss'] / base['val_loss'] - 1):+.2f} %"
        dwall = "" if base is None or r is base else f"{r['wall'] - base['wall']:+.1f} s"
        lost = ", ".join(f"{lost} ({at})" for lost, at in zip(r["lost"], r["lost_at"])) or "none"
        lost += "".join(f"; resumed at {n} ranks from step {at}" for at, n in r["resharded_at"])
        rec = ", ".join(f"{s:.3f}" for s in r["recovery_s"]) or "-"
        rows.append(f"| {r['seed']} | {r['case']} | {r['ranks_end']} | {lost} | {rec} | {r['val_loss']:.4f} | {rel} "
                    f"| {r['wall']:.1f} | {dwall} | {'yes' if r['identical'] else 'NO'} |")
    text = "\n".join(rows) + "\n"
    with open(os.path.join(out, "elastic.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out/elastic")
