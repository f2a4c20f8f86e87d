"""The report of jobs/e2e.py: its JSON lines read back, the table and the plots.

``e2e.py`` trains and writes ``DIR/e2e.jsonl`` (a ``setup`` record, a ``run`` record per method,
``link`` records from the testbed); this module turns records into ``DIR/e2e.md`` (one table per
setup: step time, exposed communication, bytes, time to target, speedups against ddp and
ddp-powersgd), ``DIR/e2e_loss.png`` and ``DIR/e2e_ttt.png``, and composes times to target from
another run's curves (``--curves-from``). No MPI, no torch.

    python jobs/e2e.py --report out/e2e/e2e.jsonl --out out/e2e       # the CLI
"""
import json
import os

import numpy as np


def powersgd_start(steps):
    """PowerSGD's ``start_powerSGD_iter`` for a budget of ``steps``: plain allreduce for the first tenth
    (torch's advice: compress only once training has settled; its default is 1000)."""
    return max(2, steps // 10)


def _fmt(x, spec):
    return "—" if x is None else format(x, spec)


def table(setup, runs):
    """Markdown: one row per method, speedups against ddp and ddp-powersgd (time to target)."""
    from common import markdown_table

    ttt = {r["method"]: r["time_to_target_s"] for r in runs}

    def speedup(base, r):
        b, t = ttt.get(base), r["time_to_target_s"]
        return "—" if not b or not t else f"{b / t:.2f}x"     # None, or reached at step 0

    rows = [[r["method"], _fmt(r["step_s"], ".3f"), _fmt(r.get("comm_share"), ".2f"),
             _fmt(None if r["bytes_per_step"] is None else r["bytes_per_step"] / 1e6, ".3f"),
             _fmt(r["loss_at_steps"], ".4f"), f"{r['steps_run']}",
             "not reached" if r["time_to_target_s"] is None else
             f"{r['time_to_target_s']:.1f}" + (" *" if r.get("ttt_source") == "composed" else ""),
             speedup("ddp", r), speedup("ddp-powersgd", r)] for r in runs]
    head = (f"**{setup['workload']}**, P={setup['ranks']}, {_fmt(setup['rate_mbit'], 'g')} Mbit/s, "
            f"{setup['params']:,} parameters, batch {setup['batch']}/rank, {setup['steps']} steps; "
            f"compute {setup['compute_s']:.3f} s/step, dense allreduce {setup['allreduce_s']:.3f} s "
            f"(ratio {setup['comm_compute_ratio']:.2f}); target val loss {_fmt(setup.get('target'), '.4f')}")
    return head + "\n\n" + markdown_table(
        ["method", "step s", "comm share", "MB/step/rank", "loss at steps", "steps run", "time to target s",
         "vs ddp", "vs ddp-powersgd"], rows)


def groups(records):
    """``[(setup, [runs])]`` in file order: runs belong to the setup record before them."""
    out = []
    for r in records:
        if r.get("kind") == "setup":
            out.append((r, []))
        elif r.get("kind") == "run" and out:
            out[-1][1].append(r)
    return out


def plots(grouped, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(grouped)
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4.5), squeeze=False)
    for ax, (setup, runs) in zip(axes[0], grouped):
        for r in runs:
            e = np.array([row[:3] for row in r["evals"]], dtype=float)
            ax.plot(e[:, 1], e[:, 2], marker=".", label=r["method"])
        if setup.get("target") is not None:
            ax.axhline(setup["target"], color="k", ls=":", lw=1, label="target")
        ax.set(xlabel="training seconds (slowest rank)", ylabel="validation loss",
               title=f"{setup['workload']}, P={setup['ranks']}, {_fmt(setup['rate_mbit'], 'g')} Mbit/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "e2e_loss.png"), dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4), squeeze=False)
    for ax, (setup, runs) in zip(axes[0], grouped):
        names = [r["method"] for r in runs]
        vals = [r["time_to_target_s"] or 0.0 for r in runs]
        bars = ax.bar(names, vals, color=["C0" if r["time_to_target_s"] else "0.8" for r in runs])
        for b, r in zip(bars, runs):
            if r["time_to_target_s"] is None:
                ax.text(b.get_x() + b.get_width() / 2, 0, "not\nreached", ha="center", va="bottom", fontsize=7)
        ax.set(ylabel="seconds to target", title=f"{setup['workload']}, {_fmt(setup['rate_mbit'], 'g')} Mbit/s")
        ax.tick_params(axis="x", rotation=45, labelsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "e2e_ttt.png"), dpi=110)
    plt.close(fig)


def read_records(paths):
    records = []
    for p in paths:
        p = os.path.join(p, "e2e.jsonl") if os.path.isdir(p) else p
        with open(p) as f:
            records += [json.loads(line) for line in f if line.strip()]
    return records


def compose(grouped, curves):
    """Time to target from another run's curves: for each method, the steps its full run at another
    rate took to reach that run's target, times this run's measured ``step_s``. The loss after a
    given step does not depend on the link (same model, data and arithmetic), only the seconds do;
    so a short run per rate measures the step, and one long run gives the steps. Runs so derived
    carry ``ttt_source: "composed"`` (marked * in the table). PowerSGD's first ``powersgd_start``
    steps are plain allreduce: they are charged at ``ddp``'s step of the same run."""
    full = {}
    for setup, runs in groups(curves):
        for r in runs:
            reached = [e[0] for e in r["evals"] if setup.get("target") is not None and e[2] <= setup["target"]]
            full[(setup["workload"], r["method"])] = (reached[0] if reached else None, setup["target"],
                                                      powersgd_start(setup["steps"]))
    out = []
    for setup, runs in grouped:
        ddp_step = next((r["step_s"] for r in runs if r["method"] == "ddp"), None)
        new = []
        for r in runs:
            steps, target, start = full.get((setup["workload"], r["method"]), (None, None, 0))
            r = dict(r, ttt_source="composed", steps_to_target=steps, target=target)
            r["time_to_target_s"] = None if steps is None else steps * r["step_s"]
            if r["method"] == "ddp-powersgd" and steps is not None:
                if ddp_step is None:      # its first steps are plain allreduce: ddp's step, not measured here
                    r["time_to_target_s"] = None
                else:
                    r["time_to_target_s"] += min(start, steps) * max(0.0, ddp_step - r["step_s"])
            new.append(r)
        out.append((dict(setup, target=target), new))
    return out


def report(paths, out, plot=True, curves=None):
    records = read_records(paths)
    grouped = [(s, r) for s, r in groups(records) if r]
    if curves:
        grouped = compose(grouped, read_records(curves))
    links = [r for r in records if r.get("kind") == "link"]
    text = "\n\n".join(table(s, r) for s, r in grouped)
    if links:
        text += "\n\nLinks measured before the runs (one TCP stream per rank's link, Mbit/s): " + "; ".join(
            f"set {lk['set_mbit']:g}: {', '.join(f'{m:g}' for m in lk['measured_mbit'])}" for lk in links)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "e2e.md"), "w") as f:
        f.write(text + "\n")
    if plot and grouped:
        plots(grouped, out)
    return text
