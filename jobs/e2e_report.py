"""The report of jobs/e2e.py: its records rendered as tables, plots and the results page.

jobs/e2e_records.py reads the records back and aggregates them; this module turns that into
``DIR/e2e.md`` (a table per launch), ``DIR/e2e_loss.png``, ``DIR/e2e_ttt.png`` and ``DIR/e2e_summary.md``
(:func:`write_docs`: the tuning, per workload and rate the summary over launches (seeds), the model
against the measured steps, the regime in which each method pays) with ``DIR/e2e_regime.png``. Every
time to target is measured at its own rate: times composed from another run's curves are not part of
the protocol. No MPI, no torch.

    python jobs/e2e.py --report out/e2e/e2e.jsonl --out out/e2e       # the CLI
"""
import os

import numpy as np

from common import markdown_table
from e2e_records import (ALPHA, BASES, BEST_DILOCO, DOC_RATES, as_finite, choose_lrs, groups, mean_of, model_check,
                         own_budget, rate_key, rates_of, read_records, regime, run_name, source_labels, summary_rows,
                         workloads_of)

README_BEGIN = "<!-- e2e-results:begin -->"
README_END = "<!-- e2e-results:end -->"
#: the methods of the README's short table, in its order: the library's defaults (``exdyna``; on the
#: AdamW LM ``exdyna-demoage999``, the default ``adam="demo-age"`` with the ``betas[0]`` of 0.999 the
#: docs advise), the baselines, and the library's sparse outer exchange (``sloco-h16``)
HEADLINE = ("exdyna", "exdyna-demoage999", "ddp-bf16", "ddp-powersgd", BEST_DILOCO, "sloco-h16", "ddp-accum")
MIN_SEEDS = 3   # held-out seeds the protocol asks for at each rate


def _fmt(x, spec):
    return "—" if x is None else format(x, spec)


def _rate_label(rate):
    return "no link shaping" if rate is None else f"{rate:g} Mbit/s"


def _records_cell(labels):
    return ", ".join(labels) if labels else "—"


def _budget_label(budgets):
    """What a method's name carries in the tables when it ran budgets of its own (``--steps-of``)."""
    return f" (budget {', '.join(str(b) for b in budgets)} batches)" if budgets else ""


def table(setup, runs):
    """The table of one launch.

    Args:
        setup: the launch's ``setup`` record.
        runs: its ``run`` records, in the order they ran.

    Returns:
        Markdown: a heading line, then one row per run (``ddp``'s second pass as ``ddp (again)``) with
        speedups against ddp (the mean of its passes' times to target) and ddp-powersgd.
    """
    ttt = {}
    for r in runs:
        ttt.setdefault(r["method"], []).append(as_finite(r["time_to_target_s"]))
    base = {m: None if None in t else sum(t) / len(t) for m, t in ttt.items()}

    def speedup(name, r):
        b, t = base.get(name), r["time_to_target_s"]
        return "—" if not b or not t else f"{b / t:.2f}x"     # None, or reached at step 0

    with_compute = any(r.get("compute_s") is not None for r in runs)
    rows = []
    for r in runs:
        own = own_budget(r, setup)
        row = [run_name(r) + _budget_label([own] if own else []), _fmt(r["step_s"], ".3f")]
        if with_compute:
            row.append(_fmt(r.get("compute_s"), ".3f"))
        row += [_fmt(r.get("comm_share"), ".2f"),
                _fmt(None if r["bytes_per_step"] is None else r["bytes_per_step"] / 1e6, ".3f"),
                _fmt(r["loss_at_steps"], ".4f"), f"{r['steps_run']}",
                "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}",
                speedup("ddp", r), speedup("ddp-powersgd", r)]
        rows.append(row)
    head = (f"**{setup['workload']}**, P={setup['ranks']}, {_fmt(setup['rate_mbit'], 'g')} Mbit/s, "
            f"{setup['params']:,} parameters, batch {setup['batch']}/rank, {setup['steps']} steps; "
            f"compute {setup['compute_s']:.3f} s/step, dense allreduce {setup['allreduce_s']:.3f} s "
            f"(ratio {setup['comm_compute_ratio']:.2f}); target val loss {_fmt(setup.get('target'), '.4f')}")
    return head + "\n\n" + markdown_table(
        ["method", "step s"] + (["compute s"] if with_compute else []) +
        ["comm share", "MB/step/rank", "loss at steps", "steps run", "time to target s", "vs ddp",
         "vs ddp-powersgd"], rows)


def plots(grouped, out):
    """``out/e2e_loss.png`` (validation loss against training seconds) and ``out/e2e_ttt.png`` (time to
    target), a panel per launch of ``grouped`` (as :func:`groups` returns)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(grouped)
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4.5), squeeze=False)
    for ax, (setup, runs) in zip(axes[0], grouped):
        for r in runs:
            e = np.array([row[:3] for row in r["evals"]], dtype=float)
            ax.plot(e[:, 1], e[:, 2], marker=".", label=run_name(r))
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
        names = [run_name(r) for r in runs]
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


def _bucket(link):
    """How a link record's tbf bucket reads: records before 2026-11-28 did not carry it, and their
    bucket (at least 256 KiB) let small exchanges cross unshaped."""
    sizes = link.get("burst_bytes")
    if not sizes:
        return "tbf bucket not recorded: at least 256 KiB, which small exchanges crossed unshaped"
    kib = sorted({round(b / 1024, 1) for b in sizes})
    return "tbf bucket " + "/".join(f"{k:g}" for k in kib) + " KiB"


def tuning_table(tuned, labels=None):
    """Markdown: a row per method, its mean loss at each grid value (the chosen one bold), the chosen
    rate and whether it lies at the grid's edge.

    Args:
        tuned: a ``tuned`` record (:func:`choose_lrs`, or one read back from a file).
        labels: ``{source path: label}`` for the records column; by default the file basenames.

    Returns:
        The table's Markdown.
    """
    grid = [float(lr) for lr in tuned["grid"]]
    rows = []
    for m, chosen in tuned["lr_of"].items():
        by_lr = {float(k): v for k, v in tuned["loss"].get(m, {}).items()}
        cells = []
        for lr in grid:
            if lr not in by_lr:
                cells.append("—")
                continue
            v = by_lr[lr]
            text = "diverged" if as_finite(v) is None else f"{v:.4f}"
            cells.append(f"**{text}**" if lr == float(chosen) else text)
        srcs = tuned.get("sources", {}).get(m) or ([tuned["_source"]] if tuned.get("_source") else [])
        names = [(labels or {}).get(s, os.path.basename(s)) for s in srcs]
        rows.append([m, *cells, f"{float(chosen):g}", "edge: widen the grid" if tuned["edge"].get(m) else "",
                     _records_cell(names)])
    seeds = ", ".join(str(s) for s in tuned.get("seeds", []))
    text = markdown_table(["method", *(f"loss at lr {lr:g}" for lr in grid), "chosen lr", "edge", "records"], rows)
    return text + f"\n\nMean validation loss at step {tuned.get('steps', '?')} over tuning seeds {seeds}."


def summary(records, workload, rate):
    """The launches (seeds) of one workload at one rate, aggregated per method, and their table.

    Args:
        records: records as :func:`e2e_records.read_records` returns them.
        workload: ``"lm"`` or ``"cnn"``.
        rate: the link rate in Mbit/s, None for the launches without link shaping.

    Returns:
        ``(rows, markdown)``: :func:`e2e_records.summary_rows`' rows, and :func:`summary_table`'s
        markdown under a heading with the compute drift of each launch.
    """
    rows, aggs_list = summary_rows(records, workload, rate)
    if not aggs_list:
        return [], f"**{workload}**, {_rate_label(rate)}: no runs."
    return rows, summary_table(rows, _summary_head(aggs_list, workload, rate))


def _summary_head(aggs_list, workload, rate):
    drift, spread = [], []
    for _, aggs in aggs_list:
        p = aggs.get("ddp", {}).get("passes", {})
        if 1 in p and 2 in p:
            c1, c2 = as_finite(p[1].get("compute_s")), as_finite(p[2].get("compute_s"))
            if c1 and c2 is not None:
                drift.append(abs(c2 / c1 - 1))
            t1, t2 = as_finite(p[1].get("time_to_target_s")), as_finite(p[2].get("time_to_target_s"))
            if t1 and t2 is not None:
                spread.append(abs(t2 / t1 - 1))
    setups = [s for s, _ in aggs_list]
    targets = sorted({s["target"] for s in setups if s.get("target") is not None})
    target = ("—" if not targets else f"{targets[0]:.4f}" if len(targets) == 1 else
              f"{targets[0]:.4f}–{targets[-1]:.4f} (each launch its own)")
    head = (f"**{workload}**, {_rate_label(rate)}, P={setups[0].get('ranks')}, {len(setups)} launch(es); "
            f"target val loss {target}; compute drift within a launch (ddp's pass 2 / pass 1 compute_s, "
            f"worst launch): {'—' if not drift else f'{100 * max(drift):.1f} %'}; ddp's two passes' times "
            f"to target differ by up to {'—' if not spread else f'{100 * max(spread):.1f} %'}")
    ngram = setups[0].get("ngram")
    if ngram:
        head += "; n-gram baselines " + ", ".join(f"{k} {v:.4f}" for k, v in ngram.items())
        best = min(ngram, key=ngram.get)
        if targets and targets[-1] > ngram[best]:
            # a count model already gets there: such a target judges the warm-up, not the training
            head += f"; **the target lies above the {best} ({ngram[best]:.4f}): a count model reaches it**"
    return head


def _best_name(r):
    # which variant was the better DiLoCo, each named once in launch order; a budget of its own beside
    name = r["method"] + (f" ({', '.join(dict.fromkeys(c for c in r['chosen'] if c))})" if r.get("chosen") else "")
    return name + _budget_label(r.get("budgets"))


def _ratio_cell(v):
    if v == "ref":
        return "ref"
    if not v:
        return "—"
    text = f"{v['mean']:.2f}x"
    return text + (f" ({v['min']:.2f}–{v['max']:.2f})" if len(v["values"]) > 1 else "")


def _ttt_cell(row):
    if row["reached"] == 0:
        return "not reached"
    text = f"{row['time_to_target_s']:.1f}"
    return text + (f" (reached {row['reached']}/{row['n']})" if row["reached"] < row["n"] else "")


def _loss_cell(row):
    if row["loss_at_steps"] is None:
        text = "diverged" if row["nonfinite"] else "—"
    elif row["loss_std"] is None:
        text = f"{row['loss_at_steps']:.4f}"
    else:
        text = f"{row['loss_at_steps']:.4f} ± {row['loss_std']:.4f}"
    return text + (f" ({row['nonfinite']} diverged)" if row["nonfinite"] and row["loss_at_steps"] is not None
                   else "")


def _pct_cell(v):
    return "ref" if v == "ref" else _fmt(v, "+.2f") + (" %" if v is not None else "")


def summary_table(rows, head=""):
    """Markdown of :func:`summary`'s rows.

    Args:
        rows: the rows.
        head: a line above the table.

    Returns:
        The table, one row per method: seeds, steps and seconds to target (means over the launches that
        reached; "not reached" when none did), the time-to-target ratio against each base present (mean,
        min–max over launches), loss at the step budget (mean ± sample std) and against ddp's, step time,
        bytes, and the record files.
    """
    bases = [b for b in BASES if any(b in r["vs"] for r in rows)]
    body = [[_best_name(r), ", ".join(str(s) for s in r["seeds"]), _fmt(r["steps_to_target"], ".0f"), _ttt_cell(r),
             *(_ratio_cell(r["vs"].get(b)) for b in bases), _loss_cell(r), _pct_cell(r["loss_vs_ddp_pct"]),
             _fmt(r["step_s"], ".3f"), _fmt(r["mb_per_step"], ".3f"), _records_cell(r["records"])] for r in rows]
    text = markdown_table(["method", "seeds", "steps to target", "time to target s",
                           *(f"vs {b} (time to target)" for b in bases), "loss at budget", "loss vs ddp",
                           "step s", "MB/step/rank", "records"], body)
    return (head + "\n\n" + text) if head else text


def model_check_table(rows):
    """Markdown of :func:`model_check`'s rows, averaged per workload, rate and method (one line per launch
    would not fit a page)."""
    cells = {}
    for r in rows:
        cells.setdefault((r["workload"], r["rate_mbit"], r["method"]), []).append(r)
    body = []
    for (wl, rate, m), rs in sorted(cells.items(), key=lambda kv: (str(kv[0][0]), rate_key(kv[0][1]))):
        labels = sorted({x for r in rs for x in r["records"]})
        body.append([wl, f"{rate:g}", m, str(len(rs)), _fmt(mean_of([r["measured"] for r in rs]), ".3f"),
                     _fmt(mean_of([r["predicted"] for r in rs]), ".3f"), _fmt(mean_of([r["ratio"] for r in rs]), ".2f"),
                     _records_cell(labels)])
    return markdown_table(["workload", "rate Mbit/s", "method", "runs", "measured step s",
                           "predicted step s (modelled)", "predicted/measured (modelled)", "records"], body)


def _break_even_cell(r, rates):
    if r["method"] == "ddp":
        return "ref"
    if r["speedup"] is None:
        return "not reached" if r["reached"] == 0 else "—"
    if r["break_even_mbit"] is not None:
        return f"pays {r['pays']} {r['break_even_mbit']:.3g} Mbit/s"
    side = "faster" if r["speedup"][0] > 1 else "slower"
    return f"{side} than ddp at every rate {rates.min():g}–{rates.max():g} Mbit/s"


def regime_table(rows):
    """Markdown of :func:`regime`'s rows: the measured inputs, the modelled break-even rate and speed-ups."""
    body = []
    for r in rows:
        body.append([r["method"], f"{_fmt(r['steps'], '.0f')} ({r['reached']}/{r['launches']})",
                     _fmt(r["compute_s"], ".3f"),
                     _fmt(None if r["bytes_per_step"] is None else r["bytes_per_step"] / 1e6, ".3f"),
                     _fmt(r["collectives"], ".3g"), _break_even_cell(r, r["rates"]),
                     *(_fmt(r["at"].get(x), ".2f") + ("x" if x in r["at"] else "") for x in DOC_RATES),
                     _records_cell(r["records"])])
    return markdown_table(["method", "steps to target (reached)", "compute s", "MB/step/rank", "collectives/step",
                           "break-even (modelled)", *(f"speed-up vs ddp at {x:g} Mbit/s (modelled)" for x in DOC_RATES),
                           "records"], body)


def regime_plot(records, workload, path, alpha_s=ALPHA):
    """The modelled speed-up over ddp against the link rate, a curve per method, with the measured ratios
    (one marker per launch, from :func:`summary`) in the curve's colour at their rates.

    Args:
        records: records as :func:`read_records` returns them.
        workload: ``"lm"`` or ``"cnn"``.
        path: the PNG to write.
        alpha_s: the latency per collective call.

    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = regime(records, workload, alpha_s=alpha_s)
    measured = {}
    for rate in rates_of(records, workload):
        if rate is not None:
            for s in summary(records, workload, rate)[0]:
                measured.setdefault(s["method"], []).extend(
                    (rate, p["vs_ddp"]) for p in s["per_launch"] if p["vs_ddp"] is not None)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, r in enumerate(x for x in rows if x["method"] != "ddp"):
        color = f"C{i % 10}"
        if r["speedup"] is not None:
            ax.plot(r["rates"], r["speedup"], color=color, label=f"{r['method']} (modelled)")
        pts = measured.get(r["method"], [])
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=color, marker="o", s=22, zorder=3,
                       label=None if r["speedup"] is not None else f"{r['method']} (measured)")
    ax.axhline(1.0, color="k", lw=1, ls=":")
    ax.set(xscale="log", yscale="log", xlabel="link rate, Mbit/s", ylabel="time to target: ddp / method",
           title=f"{workload}: speed-up over ddp (lines: alpha-beta model; dots: measured launches)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _regime_name(workload, rated):
    # the first workload with shaped links gets the plain name report() promises; the others their own
    return "e2e_regime.png" if workload == rated[0] else f"e2e_regime_{workload}.png"


def _tuning_section(records, workload, labels):
    """The learning-rate tables of ``workload``: one per tuning budget (a method given a schedule of its
    own, ``--steps-of``, is tuned at that length), each held to the protocol by :func:`choose_lrs`."""
    tunes = [r for r in records if r.get("kind") == "tune" and r.get("workload") == workload]
    stored = [r for r in records if r.get("kind") == "tuned" and r.get("workload") == workload]
    if not tunes and not stored:
        return []
    out = [f"### {workload}: learning rates", ""]
    budgets = sorted({r.get("steps") for r in tunes}, key=lambda b: (b is None, b))
    chosen = []   # the tuned record of each budget
    if not tunes:   # only a stored choice: its own table
        chosen.append(stored[-1])
        out += [tuning_table(stored[-1], labels), ""]
    for budget in budgets:
        group = [r for r in tunes if r.get("steps") == budget]
        if len(budgets) > 1:
            out += [f"At a budget of {budget} batches ({', '.join(sorted({r['method'] for r in group}))}):", ""]
        try:
            tuned = choose_lrs(group, workload)
        except ValueError as e:
            out += [f"The tune records do not meet the protocol: {e}", ""]
            continue
        out += [tuning_table(tuned, labels), ""]
        chosen.append(tuned)
    if not chosen:
        return out
    if stored and len(chosen) == 1 and stored[-1]["lr_of"] != chosen[0]["lr_of"]:
        out += [f"The stored tuned record chose {stored[-1]['lr_of']}, the tune records give "
                f"{chosen[0]['lr_of']}.", ""]
    rates = {}   # method: every rate chosen for it, one per budget it was tuned at
    for tuned in chosen:
        for m, v in tuned["lr_of"].items():
            rates.setdefault(m, set()).add(float(v))
    off = sorted({f"{m} {float(v):g} (launch {s.get('launch')})" for s in records
                  if s.get("kind") == "setup" and s.get("workload") == workload
                  for m, v in (s.get("lr_of") or {}).items() if m in rates and float(v) not in rates[m]})
    if off:
        out += ["Launches that ran with another learning rate than the tuned one: " + "; ".join(off), ""]
    return out


def _launch_glob(labels):
    """The record files of a row's launches, one pattern per rate (``lm_200_s*/e2e.jsonl``)."""
    import re

    return ", ".join(dict.fromkeys(re.sub(r"s\d+(?=[/.])", "s*", x, count=1) for x in labels))


def _readme_block(records, workloads, page, readme):
    """A row per workload and headline method, a column per link rate: time to target against DDP
    (mean and min–max over the launches; how many reached), the loss at the budget against DDP's
    (mean over every launch), and the record files. A rate a workload was not run at reads "—"."""
    rates = sorted({r for wl in workloads for r in rates_of(records, wl)}, key=rate_key)
    body = []
    for wl in workloads:
        cells, loss, recs, first = {}, {}, {}, {}
        for rate in rates_of(records, wl):
            for r in summary(records, wl, rate)[0]:
                if r["method"] not in HEADLINE:
                    continue
                name = _best_name(r)
                ttt = "not reached" if r["reached"] == 0 else _ratio_cell(r["vs"].get("ddp"))
                if 0 < r["reached"] < r["n"]:
                    ttt += f", reached {r['reached']}/{r['n']}"
                if r["n"] < MIN_SEEDS:   # a cell from fewer seeds than the protocol asks says so
                    ttt += f" ({r['n']} seed{'s' if r['n'] > 1 else ''} only)"
                cells.setdefault(name, {})[rate] = ttt
                first.setdefault(name, r["method"])
                if isinstance(r["loss_vs_ddp_pct"], (int, float)):
                    loss.setdefault(name, []).append(r["loss_vs_ddp_pct"])
                recs.setdefault(name, []).extend(r["records"])
        for name in sorted(cells, key=lambda n: HEADLINE.index(first[n])):
            body.append([wl, name, *(cells[name].get(rate, "—") for rate in rates),
                         _pct_cell(mean_of(loss.get(name, []))), _launch_glob(recs[name])])
    link = os.path.relpath(os.path.abspath(page), os.path.dirname(os.path.abspath(readme)))
    return ("Time to target against DDP (>1: sooner; mean and min–max over the held-out seeds, each ratio "
            f"within one launch; loss at the step budget against DDP's, mean over the launches). Full tables: "
            f"[{link}]({link}).\n\n" +
            markdown_table(["workload", "method", *(_rate_label(r) for r in rates), "loss at budget vs ddp",
                            "records"], body))


def write_docs(records, path, readme=None, header="", plot=True, max_lines=300):
    """The results page: per workload the tuning, the summary at each rate, the model check and the
    regime, then the record files. Each table row names its record files; every column that is not a
    measurement says "modelled".

    Args:
        records: records as :func:`read_records` returns them (with ``_source``).
        path: the Markdown page to write; the regime plots are written beside it (``e2e_regime.png``
            for the first workload with shaped links, ``e2e_regime_<workload>.png`` for others).
        readme: a Markdown file whose text between the lines ``<!-- e2e-results:begin -->`` and
            ``<!-- e2e-results:end -->`` becomes a short table of the headline methods; None: no README.
        header: the page's static text (methodology), written first.
        plot: write the regime plots (and link them).
        max_lines: the page must stay under this many lines; None: no limit.

    Returns:
        The page's text.

    Raises:
        ValueError: ``readme`` lacks the markers (nothing is written then), or the page would be
            ``max_lines`` lines or longer.
    """
    if readme is not None:
        with open(readme) as f:
            old = f.read().split("\n")
        if README_BEGIN not in old or README_END not in old or old.index(README_BEGIN) > old.index(README_END):
            raise ValueError(f"{readme} lacks the lines {README_BEGIN} and {README_END} (in that order)")
    labels = source_labels(records)
    workloads = workloads_of(records)
    rated = [wl for wl in workloads if any(r is not None for r in rates_of(records, wl))]
    folder = os.path.dirname(os.path.abspath(path))
    lines = [header.rstrip(), ""] if header.strip() else []
    pngs = []
    for wl in workloads:
        lines += [f"## {wl}", ""]
        lines += _tuning_section(records, wl, labels)
        rates = rates_of(records, wl)
        if rates:
            lines += [f"### {wl}: time to target, per rate", ""]
        for rate in rates:
            lines += [summary(records, wl, rate)[1], ""]
        checks = [r for r in model_check(records) if r["workload"] == wl]
        if checks:
            lines += [f"### {wl}: the model against the measured step", "",
                      f"Predicted: compute_s + collectives x {ALPHA:g} s (latency: an assumption) + bytes / rate, "
                      "no overlap of communication and compute (an upper bound for ddp, which overlaps).", "",
                      model_check_table(checks), ""]
        if wl in rated:
            reg = regime(records, wl)
            lines += [f"### {wl}: regime (modelled from measured steps, compute and bytes)", "", regime_table(reg), ""]
            if plot:
                name = _regime_name(wl, rated)
                pngs.append((wl, os.path.join(folder, name)))
                lines += [f"![{wl}: speed-up over ddp against the link rate]({name})", ""]
    sources = sorted({r["_source"] for r in records if r.get("_source")})
    lines += ["## Records", ""]
    lines += [f"- {labels[s]}: `{os.path.relpath(os.path.abspath(s), folder)}`" for s in sources] or ["- none"]
    text = "\n".join(lines) + "\n"
    if max_lines is not None and text.count("\n") >= max_lines:
        raise ValueError(f"the page would be {text.count(chr(10))} lines; it must stay under {max_lines}")
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    for wl, png in pngs:
        regime_plot(records, wl, png)
    if readme is not None:
        block = _readme_block(records, workloads, path, readme)
        new = old[:old.index(README_BEGIN) + 1] + block.split("\n") + old[old.index(README_END):]
        with open(readme, "w") as f:
            f.write("\n".join(new))
    return text


def report(paths, out, plot=True, curves=None):
    """Rebuild the report from JSON lines: ``out/e2e.md`` (a table per launch, with the links measured
    before), the plots ``out/e2e_loss.png`` and ``out/e2e_ttt.png``, and ``out/e2e_summary.md`` (every
    workload and rate, :func:`write_docs`) with ``out/e2e_regime.png`` when runs at a link rate exist.

    Args:
        paths: JSON-lines files or folders holding ``e2e.jsonl``.
        out: the folder to write into.
        plot: write the PNGs.
        curves: must stay None: composed times are not part of the protocol.

    Returns:
        The text of ``out/e2e.md``.

    Raises:
        ValueError: ``curves`` given.
    """
    if curves is not None:
        raise ValueError("composed times are not part of the protocol: every time to target is measured "
                         "at its own rate")
    records = read_records(paths)
    grouped = [(s, r) for s, r in groups(records) if r]
    links = [r for r in records if r.get("kind") == "link"]
    text = "\n\n".join(table(s, r) for s, r in grouped)
    if links:
        text += "\n\nLinks measured before the runs (one TCP stream per rank's link, Mbit/s): " + "; ".join(
            f"set {lk['set_mbit']:g}: {', '.join(f'{m:g}' for m in lk['measured_mbit'])} ({_bucket(lk)})"
            for lk in links)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "e2e.md"), "w") as f:
        f.write(text + "\n")
    if plot and grouped:
        plots(grouped, out)
    write_docs(records, os.path.join(out, "e2e_summary.md"), plot=plot, max_lines=None)
    return text
