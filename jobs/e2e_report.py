"""The report of jobs/e2e.py: its JSON lines read back, the tables, an alpha-beta performance model and plots.

``e2e.py`` trains and writes ``DIR/e2e.jsonl``, one JSON object a line, by ``kind``:

- ``link``: the testbed's measured rates before a launch;
- ``setup``: one per launch (``launch`` id, workload, ranks, link rate, learning rates, target, ...);
- ``run``: one per method and pass in a launch; ``ddp`` runs first (pass 1) and again last (pass 2);
- ``tune``: one per method, learning rate and seed of the learning-rate grid search (no link shaping);
- ``tuned``: the learning rates chosen from those (:func:`choose_lrs`).

This module turns records into ``DIR/e2e.md`` (a table per launch), ``DIR/e2e_loss.png``,
``DIR/e2e_ttt.png`` and ``DIR/e2e_summary.md`` (:func:`write_docs`: the tuning, per workload and rate the
summary over launches (seeds), the model against the measured steps, the regime in which each method pays)
with ``DIR/e2e_regime.png``. Every time to target is measured at its own rate: times composed from another
run's curves are not part of the protocol. No MPI, no torch.

    python jobs/e2e.py --report out/e2e/e2e.jsonl --out out/e2e       # the CLI
"""
import json
import math
import os

import numpy as np

# Latency charged per collective call, seconds. An assumption, not a measurement: a LAN round trip
# plus gloo's and the library's software overhead is of this order; it matters only for methods that
# send few bytes in many calls.
ALPHA = 1e-3

README_BEGIN = "<!-- e2e-results:begin -->"
README_END = "<!-- e2e-results:end -->"
#: the per-launch better of the DiLoCo variants (the one that reached the target sooner)
BEST_DILOCO = "diloco (best)"
#: the methods every other one is compared with, within each launch
BASES = ("ddp", "ddp-bf16", "ddp-powersgd", BEST_DILOCO)
#: the methods of the README's short table, in its order: the library's defaults (``exdyna``; on the
#: AdamW LM ``exdyna-demoage999``, the default ``adam="demo-age"`` with the ``betas[0]`` of 0.999 the
#: docs advise), the baselines, and the library's sparse outer exchange (``sloco-h16``)
HEADLINE = ("exdyna", "exdyna-demoage999", "ddp-bf16", "ddp-powersgd", BEST_DILOCO, "sloco-h16", "ddp-accum")
#: the rates at which the regime table states the modelled speed-up, Mbit/s
DOC_RATES = (100, 1000, 10000)
_ANY = object()


def powersgd_start(steps):
    """PowerSGD's ``start_powerSGD_iter`` for a budget of ``steps``: plain allreduce for the first tenth
    (torch's advice: compress only once training has settled; its default is 1000)."""
    return max(2, steps // 10)


def _fmt(x, spec):
    return "—" if x is None else format(x, spec)


def _num(x):
    """``x`` as a float; None for null and for NaN or infinity (a run that diverged)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _name(r):
    """A run's name in tables and plots: ``ddp``'s second pass is ``ddp (again)``."""
    return r["method"] + (" (again)" if r.get("pass", 1) == 2 else "")


def _rate_label(rate):
    return "no link shaping" if rate is None else f"{rate:g} Mbit/s"


def _rate_key(rate):
    # shaped rates ascending, the unshaped launches last
    return (rate is None, rate or 0.0)


def table(setup, runs):
    """The table of one launch.

    Args:
        setup: the launch's ``setup`` record.
        runs: its ``run`` records, in the order they ran.

    Returns:
        Markdown: a heading line, then one row per run (``ddp``'s second pass as ``ddp (again)``) with
        speedups against ddp (the mean of its passes' times to target) and ddp-powersgd.
    """
    from common import markdown_table

    ttt = {}
    for r in runs:
        ttt.setdefault(r["method"], []).append(_num(r["time_to_target_s"]))
    base = {m: None if None in t else sum(t) / len(t) for m, t in ttt.items()}

    def speedup(name, r):
        b, t = base.get(name), r["time_to_target_s"]
        return "—" if not b or not t else f"{b / t:.2f}x"     # None, or reached at step 0

    with_compute = any(r.get("compute_s") is not None for r in runs)
    rows = []
    for r in runs:
        own = _own_budget(r, setup)
        row = [_name(r) + _budget_label([own] if own else []), _fmt(r["step_s"], ".3f")]
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
            ax.plot(e[:, 1], e[:, 2], marker=".", label=_name(r))
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
        names = [_name(r) for r in runs]
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
    """The records of JSON-lines files.

    Args:
        paths: files, or folders holding ``e2e.jsonl``.

    Returns:
        The records in file order, each with ``_source``: the path of the file it came from (so every
        table row can name its record files).
    """
    records = []
    for p in paths:
        p = os.path.join(p, "e2e.jsonl") if os.path.isdir(p) else p
        with open(p) as f:
            records += [dict(json.loads(line), _source=p) for line in f if line.strip()]
    return records


def _labels(records):
    """``{source path: label}``: the shortest tail of each path that no other source shares (the
    basename, unless several folders each hold an ``e2e.jsonl``)."""
    paths = sorted({r["_source"] for r in records if r.get("_source")})
    parts = {p: os.path.abspath(p).split(os.sep) for p in paths}
    out = {}
    for p in paths:
        for k in range(1, len(parts[p]) + 1):
            if all(parts[q][-k:] != parts[p][-k:] for q in paths if q != p):
                break
        out[p] = "/".join(parts[p][-k:])
    return out


def _sorted(xs):
    try:
        return sorted(xs)
    except TypeError:           # seeds of mixed types (null beside numbers)
        return sorted(xs, key=str)


def _bucket(link):
    """How a link record's tbf bucket reads: records before 2026-11-28 did not carry it, and their
    bucket (at least 256 KiB) let small exchanges cross unshaped."""
    sizes = link.get("burst_bytes")
    if not sizes:
        return "tbf bucket not recorded: at least 256 KiB, which small exchanges crossed unshaped"
    kib = sorted({round(b / 1024, 1) for b in sizes})
    return "tbf bucket " + "/".join(f"{k:g}" for k in kib) + " KiB"


def _records_cell(labels):
    return ", ".join(labels) if labels else "—"


# --- learning-rate tuning -------------------------------------------------------------------------------


def choose_lrs(records, workload):
    """The learning rate of each method from the grid search's ``tune`` records.

    A method's loss at a learning rate is the mean over tuning seeds of ``loss_at_steps``; a null or NaN
    loss (the run diverged) counts as infinite, so one diverged seed rules the value out. The lowest mean
    wins, a tie goes to the smaller rate. A later record of the same method, rate and seed replaces an
    earlier one (a rerun).

    Args:
        records: records as :func:`read_records` returns them (others than ``tune`` are ignored).
        workload: ``"lm"`` or ``"cnn"``.

    Returns:
        A ``tuned`` record: ``{"kind": "tuned", "workload", "grid": every rate tried, ascending, "seeds",
        "steps", "lr_of": {method: lr}, "loss": {method: {str(lr): mean loss, null if diverged}},
        "edge": {method: the chosen rate is the grid's smallest or largest (widen the grid)},
        "sources": {method: [record files]}}``.

    Raises:
        ValueError: no tune records; or the tuning budget differs between methods (the protocol gives
            each the same): a grid of fewer than 3 values, grids of different sizes, rates tried on
            different seeds, or different step budgets.
    """
    cells, sources = {}, {}
    for r in records:
        if r.get("kind") == "tune" and r.get("workload") == workload:
            m = r["method"]
            cells.setdefault(m, {}).setdefault(float(r["lr"]), {})[r.get("seed")] = r
            sources.setdefault(m, set()).add(r.get("_source"))
    if not cells:
        raise ValueError(f"no tune records of workload {workload!r}")
    sizes = {m: len(by_lr) for m, by_lr in cells.items()}
    if min(sizes.values()) < 3:
        raise ValueError(f"a learning-rate grid needs at least 3 values (an optimum inside it): {sizes}")
    if len(set(sizes.values())) > 1:
        raise ValueError(f"every method needs a grid of the same size (the same tuning budget): {sizes}")
    seed_sets = {(m, lr): frozenset(by_seed) for m, by_lr in cells.items() for lr, by_seed in by_lr.items()}
    if len(set(seed_sets.values())) > 1:
        raise ValueError("every method and learning rate needs the same tuning seeds: " + "; ".join(
            f"{m} {lr:g}: {_sorted(s)}" for (m, lr), s in seed_sets.items()))
    budgets = {r.get("steps") for by_lr in cells.values() for by_seed in by_lr.values() for r in by_seed.values()}
    if len(budgets) > 1:
        raise ValueError(f"every tune run needs the same step budget: {_sorted(budgets)}")
    lr_of, loss, edge = {}, {}, {}
    for m, by_lr in cells.items():
        grid = sorted(by_lr)
        means = {}
        for lr in grid:
            vals = [_num(r.get("loss_at_steps")) for r in by_lr[lr].values()]
            means[lr] = math.inf if None in vals else sum(vals) / len(vals)
        best = min(grid, key=lambda lr: (means[lr], lr))
        lr_of[m] = best
        loss[m] = {str(lr): None if math.isinf(means[lr]) else means[lr] for lr in grid}
        edge[m] = best in (grid[0], grid[-1])
    return {"kind": "tuned", "workload": workload,
            "grid": sorted({lr for by_lr in cells.values() for lr in by_lr}),
            "seeds": _sorted(next(iter(seed_sets.values()))), "steps": budgets.pop(),
            "lr_of": lr_of, "loss": loss, "edge": edge,
            "sources": {m: sorted(s for s in srcs if s) for m, srcs in sources.items()}}


def tuning_table(tuned, labels=None):
    """Markdown: a row per method, its mean loss at each grid value (the chosen one bold), the chosen
    rate and whether it lies at the grid's edge.

    Args:
        tuned: a ``tuned`` record (:func:`choose_lrs`, or one read back from a file).
        labels: ``{source path: label}`` for the records column; by default the file basenames.

    Returns:
        The table's Markdown.
    """
    from common import markdown_table

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
            text = "diverged" if _num(v) is None else f"{v:.4f}"
            cells.append(f"**{text}**" if lr == float(chosen) else text)
        srcs = tuned.get("sources", {}).get(m) or ([tuned["_source"]] if tuned.get("_source") else [])
        names = [(labels or {}).get(s, os.path.basename(s)) for s in srcs]
        rows.append([m, *cells, f"{float(chosen):g}", "edge: widen the grid" if tuned["edge"].get(m) else "",
                     _records_cell(names)])
    seeds = ", ".join(str(s) for s in tuned.get("seeds", []))
    text = markdown_table(["method", *(f"loss at lr {lr:g}" for lr in grid), "chosen lr", "edge", "records"], rows)
    return text + f"\n\nMean validation loss at step {tuned.get('steps', '?')} over tuning seeds {seeds}."


# --- per launch, per method --------------------------------------------------------------------------------


def launches(records):
    """``[(setup, [runs])]``, one per launch in file order: a run joins the setup of its ``launch`` id; runs
    without one (records from before launch ids) join the setup before them, as in :func:`groups`."""
    out, by_id, last = [], {}, None
    for r in records:
        kind = r.get("kind")
        if kind == "setup":
            last = (r, [])
            out.append(last)
            if r.get("launch") is not None:
                by_id[r["launch"]] = last
        elif kind == "run":
            lid = r.get("launch")
            group = last if lid is None else by_id.get(lid)
            if group is None:       # its setup line is missing: the run's own fields stand in for it
                group = ({"kind": "setup", "launch": lid, "_source": r.get("_source"),
                          **{k: r.get(k) for k in ("workload", "ranks", "rate_mbit", "params", "seed", "target")}},
                         [])
                out.append(group)
                if lid is None:
                    last = group
                else:
                    by_id[lid] = group
            group[1].append(r)
    return out


def _field(run, setup, key):
    return run[key] if key in run else setup.get(key)


def _steps_to_target(r, setup):
    if "steps_to_target" in r:
        return r["steps_to_target"]
    target = _field(r, setup, "target")     # records from before the field: the first evaluation at target
    if target is None or r.get("time_to_target_s") is None:
        return None
    return next((e[0] for e in r.get("evals", []) if e[2] <= target), None)


def _budget_label(budgets):
    """What a method's name carries in the tables when it ran budgets of its own (``--steps-of``)."""
    return f" (budget {', '.join(str(b) for b in budgets)} batches)" if budgets else ""


def _own_budget(r, setup):
    """The run's step budget where it differs from the launch's (``--steps-of``), else None."""
    return r["steps"] if r.get("steps") is not None and r.get("steps") != setup.get("steps") else None


def _combine(runs, setup, lid):
    """One method's runs in one launch (its passes) as one: times to target and steps averaged over the
    passes when every pass reached (else not reached), the other quantities averaged over the passes."""
    ttts = [_num(r.get("time_to_target_s")) for r in runs]
    steps = [_steps_to_target(r, setup) for r in runs]
    losses = [_num(r.get("loss_at_steps")) for r in runs]
    by_pass = {r.get("pass", 1): r for r in runs}
    # records from before bytes_source counted the library's bytes
    counted = [r for r in runs if r.get("bytes_per_step") is not None
               and r.get("bytes_source", "model") in ("model", "wire")]
    return {"method": runs[0]["method"], "launch": lid, "seed": _field(runs[0], setup, "seed"),
            "rate_mbit": _field(runs[0], setup, "rate_mbit"),
            "ttt": None if None in ttts else sum(ttts) / len(ttts),
            "steps": None if None in ttts or None in steps else sum(steps) / len(steps),
            # NaN where a run diverged; null where --stop-at-target ended it before its budget
            "loss": _mean(losses), "nonfinite": sum(1 for r in runs if r.get("diverged") or (
                r.get("loss_at_steps") is not None and _num(r["loss_at_steps"]) is None)),
            "step_s": _mean([_num(r.get("step_s")) for r in runs]),
            "compute_s": _mean([_num(r.get("compute_s")) for r in runs]),
            "bytes": _mean([float(r["bytes_per_step"]) for r in counted]),
            "collectives": _mean([float(r.get("collectives_per_step", 1)) for r in runs]),
            "passes": by_pass, "sources": sorted({r["_source"] for r in runs if r.get("_source")}),
            "budget": _own_budget(runs[0], setup)}


def _launch_aggs(records, workload, rate=_ANY):
    """``[(setup, {method: combined})]`` for the launches of ``workload`` (at ``rate`` unless any), with
    ``diloco (best)``: per launch the DiLoCo variant that reached sooner (if none did, the lower loss)."""
    out = []
    for i, (setup, runs) in enumerate(launches(records)):
        if not runs or _field(runs[0], setup, "workload") != workload:
            continue
        if rate is not _ANY and _field(runs[0], setup, "rate_mbit") != rate:
            continue
        lid = setup.get("launch") or f"#{i + 1}"
        by_method = {}
        for r in runs:
            by_method.setdefault(r["method"], []).append(r)
        aggs = {m: _combine(rs, setup, lid) for m, rs in by_method.items()}
        dilocos = [a for m, a in aggs.items() if m.startswith("diloco")]
        if dilocos:
            best = min(dilocos, key=lambda a: (a["ttt"] is None, a["ttt"] or 0.0,
                                               a["loss"] is None, a["loss"] or 0.0))
            aggs[BEST_DILOCO] = dict(best, method=BEST_DILOCO, chosen=best["method"])
        out.append((setup, aggs))
    return out


def _ratio(base, a):
    if base is None or base["ttt"] is None or a["ttt"] is None or a["ttt"] <= 0:
        return None
    return base["ttt"] / a["ttt"]


def _method_order(aggs_list):
    seen = ["ddp"] if any("ddp" in aggs for _, aggs in aggs_list) else []
    for _, aggs in aggs_list:
        seen += [m for m in aggs if m not in seen and m != BEST_DILOCO]
    if any(BEST_DILOCO in aggs for _, aggs in aggs_list):
        seen.append(BEST_DILOCO)
    return seen


def summary(records, workload, rate):
    """The launches (seeds) of one workload at one rate, aggregated per method.

    Within each launch, ddp's time to target is the mean of its two passes, and every ratio divides
    times of that launch only (the launches differ in seed and in the machine's state); the ratios are
    then averaged over launches. The same holds for the other bases, ``ddp-bf16``, ``ddp-powersgd`` and
    the better DiLoCo of each launch (``diloco (best)``, also a row of its own).

    Args:
        records: records as :func:`read_records` returns them.
        workload: ``"lm"`` or ``"cnn"``.
        rate: the link rate in Mbit/s, None for the launches without link shaping.

    Returns:
        ``(rows, markdown)``. A row per method: ``method``, ``n`` (launches), ``reached`` (launches that
        reached the target), ``seeds``, ``launches``, ``steps_to_target`` and ``time_to_target_s`` (means
        over the launches that reached), ``vs`` (``{base: {"mean", "min", "max", "values": [(launch,
        ratio)]}}``, >1: sooner than the base; ``"ref"`` for the base itself), ``loss_at_steps`` with
        ``loss_std`` (sample standard deviation over launches), ``loss_vs_ddp_pct``, ``step_s``,
        ``mb_per_step``, ``per_launch`` and ``records`` (labels of the record files); the markdown is
        :func:`summary_table`'s, under a heading with the compute drift of each launch.
    """
    aggs_list = _launch_aggs(records, workload, rate)
    if not aggs_list:
        return [], f"**{workload}**, {_rate_label(rate)}: no runs."
    labels = _labels(records)
    bases = [b for b in BASES if any(b in aggs for _, aggs in aggs_list)]
    rows = []
    for m in _method_order(aggs_list):
        mine = [(setup, aggs) for setup, aggs in aggs_list if m in aggs]
        ags = [aggs[m] for _, aggs in mine]
        vs = {}
        for b in bases:
            if b == m:
                vs[b] = "ref"
                continue
            vals = [(a["launch"], _ratio(aggs.get(b), a)) for (_, aggs), a in zip(mine, ags)]
            vals = [(lid, v) for lid, v in vals if v is not None]
            if vals:
                xs = [v for _, v in vals]
                vs[b] = {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs), "values": vals}
        losses = [a["loss"] for a in ags if a["loss"] is not None]
        rel = []
        for (_, aggs), a in zip(mine, ags):
            d = aggs.get("ddp")
            if m != "ddp" and d and d["loss"] and a["loss"] is not None:
                rel.append(100.0 * (a["loss"] - d["loss"]) / d["loss"])
        reached = [a for a in ags if a["ttt"] is not None]
        mb = _mean([a["bytes"] for a in ags])
        sources = sorted({s for a in ags for s in a["sources"]})
        rows.append({
            "method": m, "workload": workload, "rate_mbit": rate, "n": len(ags), "reached": len(reached),
            "seeds": [a["seed"] for a in ags], "launches": [a["launch"] for a in ags],
            "steps_to_target": _mean([a["steps"] for a in reached]),
            "time_to_target_s": _mean([a["ttt"] for a in reached]), "vs": vs,
            "loss_at_steps": _mean(losses),
            "loss_std": float(np.std(losses, ddof=1)) if len(losses) > 1 else None,
            "nonfinite": sum(a["nonfinite"] for a in ags),
            "loss_vs_ddp_pct": "ref" if m == "ddp" else _mean(rel),
            "step_s": _mean([a["step_s"] for a in ags]), "mb_per_step": None if mb is None else mb / 1e6,
            "chosen": [a.get("chosen") for a in ags] if m == BEST_DILOCO else None,
            "budgets": sorted({a["budget"] for a in ags if a.get("budget")}),
            "per_launch": [{"launch": a["launch"], "seed": a["seed"], "time_to_target_s": a["ttt"],
                            "vs_ddp": _ratio(aggs.get("ddp"), a), "loss_at_steps": a["loss"]}
                           for (_, aggs), a in zip(mine, ags)],
            "sources": sources, "records": [labels.get(s, os.path.basename(s)) for s in sources]})
    return rows, summary_table(rows, _summary_head(aggs_list, workload, rate))


def _summary_head(aggs_list, workload, rate):
    drift, spread = [], []
    for _, aggs in aggs_list:
        p = aggs.get("ddp", {}).get("passes", {})
        if 1 in p and 2 in p:
            c1, c2 = _num(p[1].get("compute_s")), _num(p[2].get("compute_s"))
            if c1 and c2 is not None:
                drift.append(abs(c2 / c1 - 1))
            t1, t2 = _num(p[1].get("time_to_target_s")), _num(p[2].get("time_to_target_s"))
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
    from common import markdown_table

    bases = [b for b in BASES if any(b in r["vs"] for r in rows)]
    body = [[_best_name(r), ", ".join(str(s) for s in r["seeds"]), _fmt(r["steps_to_target"], ".0f"), _ttt_cell(r),
             *(_ratio_cell(r["vs"].get(b)) for b in bases), _loss_cell(r), _pct_cell(r["loss_vs_ddp_pct"]),
             _fmt(r["step_s"], ".3f"), _fmt(r["mb_per_step"], ".3f"), _records_cell(r["records"])] for r in rows]
    text = markdown_table(["method", "seeds", "steps to target", "time to target s",
                           *(f"vs {b} (time to target)" for b in bases), "loss at budget", "loss vs ddp",
                           "step s", "MB/step/rank", "records"], body)
    return (head + "\n\n" + text) if head else text


# --- the performance model ---------------------------------------------------------------------------------


def predict_step_s(compute_s, bytes_per_step, rate_mbit, collectives=1, alpha_s=ALPHA):
    """A step's time in the alpha-beta model: compute, then a latency per collective call, then the bytes
    over the link. Communication is assumed not to overlap compute, so for DDP (whose allreduce overlaps
    backward) the prediction is an upper bound.

    Args:
        compute_s: the step with no communication, seconds.
        bytes_per_step: bytes each rank sends per step.
        rate_mbit: the link rate, Mbit/s (a number or an array).
        collectives: collective calls per step (fractions for methods that communicate every few steps).
        alpha_s: the latency per call, seconds (:data:`ALPHA`: an assumption).

    Returns:
        ``compute_s + collectives * alpha_s + 8 * bytes_per_step / (rate_mbit * 1e6)``: a float, or an
        array for an array of rates.
    """
    t = compute_s + collectives * alpha_s + 8.0 * bytes_per_step / (np.asarray(rate_mbit, dtype=float) * 1e6)
    return float(t) if np.ndim(t) == 0 else t


def model_check(records, alpha_s=ALPHA):
    """The model against each measured step.

    Args:
        records: records as :func:`read_records` returns them; runs without a link rate are left out.
        alpha_s: the latency per collective call.

    Returns:
        A row per run: ``workload``, ``rate_mbit``, ``method`` (``ddp (again)`` for its second pass),
        ``launch``, ``measured`` (``step_s``), ``predicted`` (:func:`predict_step_s` of the run's
        ``compute_s``, ``bytes_per_step`` and ``collectives_per_step``; None without bytes), ``ratio``
        (predicted / measured) and ``records``.
    """
    labels = _labels(records)
    rows = []
    for setup, runs in launches(records):
        for r in runs:
            rate = _field(r, setup, "rate_mbit")
            if rate is None:
                continue
            compute, nbytes, step = _num(r.get("compute_s")), _num(r.get("bytes_per_step")), _num(r.get("step_s"))
            pred = (None if compute is None or nbytes is None else
                    predict_step_s(compute, nbytes, rate, r.get("collectives_per_step", 1), alpha_s))
            rows.append({"workload": _field(r, setup, "workload"), "rate_mbit": rate, "method": _name(r),
                         "launch": _field(r, setup, "launch"), "measured": step, "predicted": pred,
                         "ratio": None if pred is None or not step else pred / step,
                         "records": [labels.get(r.get("_source"), "—")]})
    return rows


def model_check_table(rows):
    """Markdown of :func:`model_check`'s rows, averaged per workload, rate and method (one line per launch
    would not fit a page)."""
    from common import markdown_table

    cells = {}
    for r in rows:
        cells.setdefault((r["workload"], r["rate_mbit"], r["method"]), []).append(r)
    body = []
    for (wl, rate, m), rs in sorted(cells.items(), key=lambda kv: (str(kv[0][0]), _rate_key(kv[0][1]))):
        labels = sorted({x for r in rs for x in r["records"]})
        body.append([wl, f"{rate:g}", m, str(len(rs)), _fmt(_mean([r["measured"] for r in rs]), ".3f"),
                     _fmt(_mean([r["predicted"] for r in rs]), ".3f"), _fmt(_mean([r["ratio"] for r in rs]), ".2f"),
                     _records_cell(labels)])
    return markdown_table(["workload", "rate Mbit/s", "method", "runs", "measured step s",
                           "predicted step s (modelled)", "predicted/measured (modelled)", "records"], body)


def _break_even(d, m, lo, hi):
    """The rate at which ``m``'s modelled time to target equals ``d``'s (ddp's), and on which side ``m``
    pays. With u = 1 / rate both times are linear in u (``steps * (compute + collectives * alpha + 8 *
    bytes * u / 1e6)``), so their ratio is monotone in the rate and crosses 1 at most once, where the two
    lines meet; the exact root, rather than one interpolated between grid points."""
    a_d, a_m = d["steps"] * d["fixed_s"], m["steps"] * m["fixed_s"]
    b_d, b_m = d["steps"] * 8e-6 * d["bytes_per_step"], m["steps"] * 8e-6 * m["bytes_per_step"]
    if b_d == b_m or (a_m - a_d) / (b_d - b_m) <= 0:
        return None, None
    rate = (b_d - b_m) / (a_m - a_d)
    if not lo <= rate <= hi:
        return None, None
    # below the break-even rate the bytes term dominates: m pays there if it sends fewer bytes to target
    return rate, "below" if b_d > b_m else "above"


def regime(records, workload, rates=np.logspace(1, 5, 81), alpha_s=ALPHA):
    """Where each method pays: the model's time to target against the link rate, from the measured steps
    to target, compute and bytes.

    Steps to target do not depend on the link (same model, data and arithmetic), so the launches of
    ``workload`` at every rate and seed are pooled: per method, steps to target are the mean over the
    launches that reached, compute_s the mean over its runs, bytes the mean of the recorded counts
    (``bytes_source`` "wire" or "model"), collectives the mean ``collectives_per_step`` (1 where absent).

    Args:
        records: records as :func:`read_records` returns them.
        workload: ``"lm"`` or ``"cnn"``.
        rates: the link rates, Mbit/s, at which to evaluate the model.
        alpha_s: the latency per collective call.

    Returns:
        A row per method: ``method``, ``steps``, ``compute_s``, ``bytes_per_step``, ``collectives``,
        ``launches``, ``reached``, ``rates``, ``ttt`` (modelled seconds to target at each rate, None when
        the method never reached), ``speedup`` (ddp's modelled time / the method's), ``break_even_mbit``
        (where the speed-up crosses 1, None if not within ``rates``), ``pays`` (``"below"``: faster than
        ddp below the break-even rate, ``"above"``: above it), ``at`` (``{rate: speed-up}`` at
        :data:`DOC_RATES`) and ``records``.
    """
    rates = np.asarray(rates, dtype=float)
    aggs_list = _launch_aggs(records, workload)
    labels = _labels(records)
    rows = []
    for m in _method_order(aggs_list):
        if m == BEST_DILOCO:        # each variant has its own curve; the better is the upper one
            continue
        ags = [aggs[m] for _, aggs in aggs_list if m in aggs]
        reached = [a for a in ags if a["steps"] is not None]
        row = {"method": m, "steps": _mean([a["steps"] for a in reached]),
               "compute_s": _mean([a["compute_s"] for a in ags]), "bytes_per_step": _mean([a["bytes"] for a in ags]),
               "collectives": _mean([a["collectives"] for a in ags]), "launches": len(ags), "reached": len(reached),
               "rates": rates, "ttt": None, "speedup": None, "break_even_mbit": None, "pays": None, "at": {},
               "records": sorted({labels.get(s, os.path.basename(s)) for a in ags for s in a["sources"]})}
        if None not in (row["steps"], row["compute_s"], row["bytes_per_step"], row["collectives"]):
            row["fixed_s"] = row["compute_s"] + row["collectives"] * alpha_s
            row["ttt"] = row["steps"] * predict_step_s(row["compute_s"], row["bytes_per_step"], rates,
                                                       row["collectives"], alpha_s)
        rows.append(row)
    ddp = next((r for r in rows if r["method"] == "ddp" and r["ttt"] is not None), None)
    if ddp is None:
        return rows
    def ttt(r, rate):
        return r["steps"] * predict_step_s(r["compute_s"], r["bytes_per_step"], rate, r["collectives"], alpha_s)

    for r in rows:
        if r["ttt"] is None:
            continue
        r["speedup"] = ddp["ttt"] / r["ttt"]
        r["at"] = {x: ttt(ddp, x) / ttt(r, x) for x in DOC_RATES}
        if r is not ddp:
            r["break_even_mbit"], r["pays"] = _break_even(ddp, r, rates.min(), rates.max())
    return rows


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
    from common import markdown_table

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


def _rates(records, workload):
    return sorted({_field(runs[0], setup, "rate_mbit") for setup, runs in launches(records)
                   if runs and _field(runs[0], setup, "workload") == workload}, key=_rate_key)


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
    for rate in _rates(records, workload):
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


# --- the results page --------------------------------------------------------------------------------------


def _workloads(records):
    out = []
    for r in records:
        wl = r.get("workload")
        if r.get("kind") in ("setup", "run", "tune", "tuned") and wl is not None and wl not in out:
            out.append(wl)
    return out


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


MIN_SEEDS = 3   # held-out seeds the protocol asks for at each rate


def _readme_block(records, workloads, page, readme):
    """A row per workload and headline method, a column per link rate: time to target against DDP
    (mean and min–max over the launches; how many reached), the loss at the budget against DDP's
    (mean over every launch), and the record files. A rate a workload was not run at reads "—"."""
    from common import markdown_table

    rates = sorted({r for wl in workloads for r in _rates(records, wl)}, key=_rate_key)
    body = []
    for wl in workloads:
        cells, loss, recs, first = {}, {}, {}, {}
        for rate in _rates(records, wl):
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
                         _pct_cell(_mean(loss.get(name, []))), _launch_glob(recs[name])])
    link = os.path.relpath(os.path.abspath(page), os.path.dirname(os.path.abspath(readme)))
    return ("Time to target against DDP (>1: sooner; mean and min–max over the held-out seeds, each ratio "
            f"within one launch; loss at the step budget against DDP's, mean over the launches). Full tables: "
            f"[{link}]({link}).\n\n" +
            markdown_table(["workload", "method", *(_rate_label(r) for r in rates), "loss at budget vs ddp",
                            "records"], body))


def write_docs(records, path, readme=None, header="", plot=True, max_lines=400):
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
    labels = _labels(records)
    workloads = _workloads(records)
    rated = [wl for wl in workloads if any(r is not None for r in _rates(records, wl))]
    folder = os.path.dirname(os.path.abspath(path))
    lines = [header.rstrip(), ""] if header.strip() else []
    pngs = []
    for wl in workloads:
        lines += [f"## {wl}", ""]
        lines += _tuning_section(records, wl, labels)
        rates = _rates(records, wl)
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
