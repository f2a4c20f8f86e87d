"""The report of jobs/fidelity.py: its JSON lines read back, the tables and the plots.

``fidelity.py`` trains and writes the records (``"kind": "step"``, ``"eval"``, ``"run"``, ``"job"``,
one JSON object a line); this module turns records into ``fidelity.md`` (one table per workload and
learning-rate schedule: each run's quality against dense, density, bytes, Pareto front marked),
``pareto.png`` and ``quality_vs_step.png``. It needs no MPI and no torch.

    python jobs/fidelity.py --report out/fidelity/fidelity.jsonl,out/fid_exdyna/fidelity.jsonl   # the CLI

As a module (jobs import each other by plain name, see jobs/common.py)::

    import fidelity_report as fr
    summaries, evals = fr.load_records(["out/fidelity/fidelity.jsonl"])
    print(fr.tables(summaries))
"""
import gzip
import json
import os

import numpy as np

#: workloads in table and plot order (fidelity.py's ``WORKLOADS``); others follow, by name
WORKLOAD_ORDER = ("lstm", "cnn")


def _workload_rank(name):
    return (WORKLOAD_ORDER.index(name), "") if name in WORKLOAD_ORDER else (len(WORKLOAD_ORDER), name)


def pareto(rows, hib):
    """Labels of the runs no other run beats on both bytes (fewer) and quality (better)."""
    front = set()
    for r in rows:
        q, b = r["q"], r["bytes_total"]
        dominated = any((o["bytes_total"] <= b and (o["q"] >= q if hib else o["q"] <= q))
                        and (o["bytes_total"] < b or (o["q"] > q if hib else o["q"] < q)) for o in rows)
        if not dominated:
            front.add(r["run"])
    return front


MEANS = ("density", "bytes_total", "bytes_per_step", "val_ppl")


def by_seed(summaries):
    """One row per (workload, run): the mean over its seeds of the quality and of ``MEANS``, with
    ``q_min``/``q_max`` and ``seeds`` (the list); one seed: the run itself."""
    groups = {}
    for s in summaries:
        groups.setdefault((s["workload"], s["run"]), []).append(s)
    out = []
    for runs in groups.values():
        runs.sort(key=lambda r: r.get("seed", 0))
        qs = [r[r["quality_key"]] for r in runs]
        row = dict(runs[0], q=float(np.mean(qs)), q_min=min(qs), q_max=max(qs), seeds=[r.get("seed") for r in runs],
                   params_identical=all(r.get("params_identical", True) for r in runs))
        row[row["quality_key"]] = row["q"]
        for k in MEANS:
            if all(r.get(k) is not None for r in runs):
                row[k] = float(np.mean([r[k] for r in runs]))
        out.append(row)
    return out


def _sched(r):
    return r.get("lr_schedule") or "constant"   # records written before --lstm-schedule: constant


def tables(summaries):
    """One markdown table per (workload, learning-rate schedule): each has its own dense reference
    ("vs dense") and Pareto front, so cosine runs are never compared with constant-lr ones."""
    out = []
    summaries = by_seed(summaries)
    sections = sorted({(s["workload"], _sched(s)) for s in summaries},
                      key=lambda k: (_workload_rank(k[0]), k[1] != "constant", k[1]))
    for wl, sched in sections:
        rows = [s for s in summaries if s["workload"] == wl and _sched(s) == sched]
        key, hib = rows[0]["quality_key"], rows[0]["higher_is_better"]
        seeds = sorted({x for r in rows for x in r["seeds"]}, key=lambda x: (x is None, x))
        spread = any(len(r["seeds"]) > 1 for r in rows)
        dense = next((r for r in rows if r["sparsifier"] == "dense" and not r.get("recipe")), None)
        front = pareto(rows, hib)
        rows.sort(key=lambda r: (r["sparsifier"] != "dense", -r["target"], r["sparsifier"], r["run"]))
        r0 = rows[0]
        seed_text = (f"mean over seeds {', '.join(map(str, seeds))} (range in brackets)" if spread
                     else f"seed {r0['seed']}")
        sched_text = "" if sched == "constant" else f", {sched} lr schedule"
        out.append(f"### {wl}: {r0.get('model', '')}, {r0['numel']:,} parameters, P={r0['ranks']}, "
                   f"{r0['steps']} steps{sched_text}, {seed_text}\n")
        if key == "test_acc":
            head = ("run", "test acc", "vs dense", "density", "MB sent", "kB/step", "bytes vs dense", "Pareto")
        else:
            head = ("run", "val loss", "vs dense", "val ppl", "density", "MB sent", "kB/step", "bytes vs dense",
                    "Pareto")
        lines = []
        for r in rows:
            dq = "" if dense is None else (f"{100 * (r['q'] - dense['q']):+.2f} pp" if key == "test_acc"
                                           else f"{100 * (r['q'] / dense['q'] - 1):+.2f} %")
            ratio = r["bytes_per_step"] / r["dense_bytes_per_step"]
            if key == "test_acc":
                qtxt = f"{100 * r['q']:.2f} %" + (f" [{100 * r['q_min']:.2f}, {100 * r['q_max']:.2f}]"
                                                   if len(r["seeds"]) > 1 else "")
            else:
                qtxt = f"{r['q']:.4f}" + (f" [{r['q_min']:.4f}, {r['q_max']:.4f}]" if len(r["seeds"]) > 1 else "")
            qcol = (qtxt,) if key == "test_acc" else (qtxt, dq, f"{r['val_ppl']:.2f}")
            cells = (r["run"], *qcol) if key != "test_acc" else (r["run"], qcol[0], dq)
            cells += (f"{r['density']:.5f}", f"{r['bytes_total'] / 1e6:.3f}", f"{r['bytes_per_step'] / 1e3:.1f}",
                      f"{100 * ratio:.2f} %", "*" if r["run"] in front else "")
            if not r.get("params_identical", True):
                cells = (cells[0] + " (RANKS DIFFER)",) + cells[1:]
            lines.append(cells)
        widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(head)]
        fmt = "| " + " | ".join(f"{{:<{w}}}" for w in widths) + " |"
        out.append(fmt.format(*head))
        out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        out += [fmt.format(*c) for c in lines]
        out.append("")
    return "\n".join(out)


def _style(label):
    name = label.split(" ")[0]
    order = ["dense", "exdyna", "exdyna+", "topk", "cltk", "gaussiank", "dgc", "oktopk", "micro"]
    i = order.index(name) if name in order else len(order) + hash(name) % 5
    d = label.split("d=")[-1].split(" ")[0] if "d=" in label else ""   # "exdyna d=0.01 cosine": 0.01
    ls = {"0.01": "-", "0.003": "--", "0.001": ":"}.get(d, "-")
    mk = {"0.01": "o", "0.003": "s", "0.001": "^"}.get(d, "*")
    return f"C{i % 10}", ls, mk


def plots(summaries, evals, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = by_seed(summaries)
    wls = sorted({s["workload"] for s in summaries}, key=_workload_rank)
    fig, axes = plt.subplots(1, len(wls), figsize=(7 * len(wls), 5.5), squeeze=False)
    for ax, wl in zip(axes[0], wls):
        rows = [s for s in summaries if s["workload"] == wl]
        key, hib = rows[0]["quality_key"], rows[0]["higher_is_better"]
        front = pareto(rows, hib)
        for r in rows:
            c, _, mk = _style(r["run"])
            ax.scatter(r["bytes_total"] / 1e6, r["q"], color=c, marker=mk, s=40,
                       edgecolors="k" if r["run"] in front else "none", zorder=3)
            ax.annotate(r["run"], (r["bytes_total"] / 1e6, r["q"]), fontsize=6, xytext=(3, 2),
                        textcoords="offset points")
        f = sorted((r for r in rows if r["run"] in front), key=lambda r: r["bytes_total"])
        ax.plot([r["bytes_total"] / 1e6 for r in f], [r["q"] for r in f], "k-", lw=1, alpha=0.6,
                label="Pareto front")
        ax.set(xscale="log", xlabel="total MB sent per rank (whole run)", ylabel=key,
               title=f"{wl}: {key} vs bytes sent ({'higher' if hib else 'lower'} is better)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "pareto.png"), dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(wls), figsize=(7 * len(wls), 5.5), squeeze=False)
    for ax, wl in zip(axes[0], wls):
        rows = [s for s in summaries if s["workload"] == wl]
        key = rows[0]["quality_key"]
        for r in rows:   # the curve of the first seed
            pts = [e for e in evals if e["workload"] == wl and e["run"] == r["run"] and e.get("seed", r["seeds"][0])
                   == r["seeds"][0]]
            c, ls, _ = _style(r["run"])
            ax.plot([e["step"] for e in pts], [e[key] for e in pts], color=c, ls=ls, lw=1.2, label=r["run"])
        ax.set(xlabel="step", ylabel=key, title=f"{wl}: {key} vs step")
        if key == "val_loss":
            lo = min(e[key] for e in evals if e["workload"] == wl)
            ax.set_ylim(lo * 0.95, lo * 2.0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "quality_vs_step.png"), dpi=110)
    plt.close(fig)


def load_records(paths):
    """Run summaries and evaluations from JSON lines files; a later file's run (same workload, label
    and seed) replaces an earlier one. Runs of other seeds are kept: the table averages them."""
    summaries, evals = {}, {}
    for path in paths:
        file_evals = {}
        seed_of = {}
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            lines = [json.loads(line) for line in f]
        for rec in lines:   # evaluation records carry no seed: their file's run does
            if rec.get("kind") == "run":
                seed_of[(rec.get("workload"), rec.get("run"))] = rec.get("seed")
        for rec in lines:
            k = (rec.get("workload"), rec.get("run"), seed_of.get((rec.get("workload"), rec.get("run"))))
            if rec.get("kind") == "run":
                summaries[k] = rec
            elif rec.get("kind") == "eval":
                file_evals.setdefault(k, []).append(dict(rec, seed=k[2]))
        evals.update(file_evals)
    return list(summaries.values()), [e for k in summaries for e in evals.get(k, [])]


def write_report(summaries, evals, out, plot=True, header=""):
    text = header + tables(summaries)
    with open(os.path.join(out, "fidelity.md"), "w") as f:
        f.write(text)
    print("\n" + text, flush=True)
    if plot:
        plots(summaries, evals, out)
    return text
