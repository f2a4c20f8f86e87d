"""jobs/e2e.py's records read back and aggregated: launches, the learning-rate choice, the summary
rows over seeds, and an alpha-beta performance model against the measured steps. No MPI, no torch.

``e2e.py`` writes ``DIR/e2e.jsonl``, one JSON object a line, by ``kind``:

- ``link``: the testbed's measured rates before a launch;
- ``setup``: one per launch (``launch`` id, workload, ranks, link rate, learning rates, target, ...);
- ``run``: one per method and pass in a launch; ``ddp`` runs first (pass 1) and again last (pass 2);
  a run also carries ``method_spec`` (its row of jobs/e2e_methods.py) and ``resolved`` (what its
  entry point was given and resolved), which nothing here needs (older records lack both);
- ``tune``: one per method, learning rate and seed of the learning-rate grid search (no link shaping);
- ``tuned``: the learning rates chosen from those (:func:`choose_lrs`).

Records from before a field was added still read: each reader falls back where a field is absent.
jobs/e2e_report.py renders what this module computes (tables, plots, the results page).

Example::

    from e2e_records import choose_lrs, read_records, summary_rows
    records = read_records(["out/tune"])
    tuned = choose_lrs(records, "lm")
    rows, launches = summary_rows(read_records(["out/e2e"]), "lm", 200.0)
"""
import json
import math
import os

import numpy as np

# Latency charged per collective call, seconds. An assumption, not a measurement: a LAN round trip
# plus gloo's and the library's software overhead is of this order; it matters only for methods that
# send few bytes in many calls.
ALPHA = 1e-3
#: the per-launch better of the DiLoCo variants (the one that reached the target sooner)
BEST_DILOCO = "diloco (best)"
#: the methods every other one is compared with, within each launch
BASES = ("ddp", "ddp-bf16", "ddp-powersgd", BEST_DILOCO)
#: the rates at which the regime table states the modelled speed-up, Mbit/s
DOC_RATES = (100, 1000, 10000)
_ANY = object()


def as_finite(x):
    """``x`` as a float; None for null and for NaN or infinity (a run that diverged)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def mean_of(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def run_name(r):
    """A run's name in tables and plots: ``ddp``'s second pass is ``ddp (again)``."""
    return r["method"] + (" (again)" if r.get("pass", 1) == 2 else "")


def rate_key(rate):
    # shaped rates ascending, the unshaped launches last
    return (rate is None, rate or 0.0)


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


def source_labels(records):
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


def groups(records):
    """``[(setup, [runs])]`` in file order: runs belong to the setup record before them."""
    out = []
    for r in records:
        if r.get("kind") == "setup":
            out.append((r, []))
        elif r.get("kind") == "run" and out:
            out[-1][1].append(r)
    return out


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


def _sorted(xs):
    try:
        return sorted(xs)
    except TypeError:           # seeds of mixed types (null beside numbers)
        return sorted(xs, key=str)


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
            vals = [as_finite(r.get("loss_at_steps")) for r in by_lr[lr].values()]
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


def field_of(run, setup, key):
    return run[key] if key in run else setup.get(key)


def _steps_to_target(r, setup):
    if "steps_to_target" in r:
        return r["steps_to_target"]
    target = field_of(r, setup, "target")     # records from before the field: the first evaluation at target
    if target is None or r.get("time_to_target_s") is None:
        return None
    return next((e[0] for e in r.get("evals", []) if e[2] <= target), None)


def own_budget(r, setup):
    """The run's step budget where it differs from the launch's (``--steps-of``), else None."""
    return r["steps"] if r.get("steps") is not None and r.get("steps") != setup.get("steps") else None


def _combine(runs, setup, lid):
    """One method's runs in one launch (its passes) as one: times to target and steps averaged over the
    passes when every pass reached (else not reached), the other quantities averaged over the passes."""
    ttts = [as_finite(r.get("time_to_target_s")) for r in runs]
    steps = [_steps_to_target(r, setup) for r in runs]
    losses = [as_finite(r.get("loss_at_steps")) for r in runs]
    by_pass = {r.get("pass", 1): r for r in runs}
    # records from before bytes_source counted the library's bytes
    counted = [r for r in runs if r.get("bytes_per_step") is not None
               and r.get("bytes_source", "model") in ("model", "wire")]
    return {"method": runs[0]["method"], "launch": lid, "seed": field_of(runs[0], setup, "seed"),
            "rate_mbit": field_of(runs[0], setup, "rate_mbit"),
            "ttt": None if None in ttts else sum(ttts) / len(ttts),
            "steps": None if None in ttts or None in steps else sum(steps) / len(steps),
            # NaN where a run diverged; null where --stop-at-target ended it before its budget
            "loss": mean_of(losses), "nonfinite": sum(1 for r in runs if r.get("diverged") or (
                r.get("loss_at_steps") is not None and as_finite(r["loss_at_steps"]) is None)),
            "step_s": mean_of([as_finite(r.get("step_s")) for r in runs]),
            "compute_s": mean_of([as_finite(r.get("compute_s")) for r in runs]),
            "bytes": mean_of([float(r["bytes_per_step"]) for r in counted]),
            "collectives": mean_of([float(r.get("collectives_per_step", 1)) for r in runs]),
            "passes": by_pass, "sources": sorted({r["_source"] for r in runs if r.get("_source")}),
            "budget": own_budget(runs[0], setup)}


def launch_aggregates(records, workload, rate=_ANY):
    """``[(setup, {method: combined})]`` for the launches of ``workload`` (at ``rate`` unless any), with
    ``diloco (best)``: per launch the DiLoCo variant that reached sooner (if none did, the lower loss)."""
    out = []
    for i, (setup, runs) in enumerate(launches(records)):
        if not runs or field_of(runs[0], setup, "workload") != workload:
            continue
        if rate is not _ANY and field_of(runs[0], setup, "rate_mbit") != rate:
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


def method_order(aggs_list):
    seen = ["ddp"] if any("ddp" in aggs for _, aggs in aggs_list) else []
    for _, aggs in aggs_list:
        seen += [m for m in aggs if m not in seen and m != BEST_DILOCO]
    if any(BEST_DILOCO in aggs for _, aggs in aggs_list):
        seen.append(BEST_DILOCO)
    return seen


def summary_rows(records, workload, rate):
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
        ``(rows, launches)``. A row per method: ``method``, ``n`` (launches), ``reached`` (launches that
        reached the target), ``seeds``, ``launches``, ``steps_to_target`` and ``time_to_target_s`` (means
        over the launches that reached), ``vs`` (``{base: {"mean", "min", "max", "values": [(launch,
        ratio)]}}``, >1: sooner than the base; ``"ref"`` for the base itself), ``loss_at_steps`` with
        ``loss_std`` (sample standard deviation over launches), ``loss_vs_ddp_pct``, ``step_s``,
        ``mb_per_step``, ``per_launch`` and ``records`` (labels of the record files); ``launches`` is
        :func:`launch_aggregates`' list for the workload and rate (empty: no runs).
    """
    aggs_list = launch_aggregates(records, workload, rate)
    if not aggs_list:
        return [], []
    labels = source_labels(records)
    bases = [b for b in BASES if any(b in aggs for _, aggs in aggs_list)]
    rows = []
    for m in method_order(aggs_list):
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
        mb = mean_of([a["bytes"] for a in ags])
        sources = sorted({s for a in ags for s in a["sources"]})
        rows.append({
            "method": m, "workload": workload, "rate_mbit": rate, "n": len(ags), "reached": len(reached),
            "seeds": [a["seed"] for a in ags], "launches": [a["launch"] for a in ags],
            "steps_to_target": mean_of([a["steps"] for a in reached]),
            "time_to_target_s": mean_of([a["ttt"] for a in reached]), "vs": vs,
            "loss_at_steps": mean_of(losses),
            "loss_std": float(np.std(losses, ddof=1)) if len(losses) > 1 else None,
            "nonfinite": sum(a["nonfinite"] for a in ags),
            "loss_vs_ddp_pct": "ref" if m == "ddp" else mean_of(rel),
            "step_s": mean_of([a["step_s"] for a in ags]), "mb_per_step": None if mb is None else mb / 1e6,
            "chosen": [a.get("chosen") for a in ags] if m == BEST_DILOCO else None,
            "budgets": sorted({a["budget"] for a in ags if a.get("budget")}),
            "per_launch": [{"launch": a["launch"], "seed": a["seed"], "time_to_target_s": a["ttt"],
                            "vs_ddp": _ratio(aggs.get("ddp"), a), "loss_at_steps": a["loss"]}
                           for (_, aggs), a in zip(mine, ags)],
            "sources": sources, "records": [labels.get(s, os.path.basename(s)) for s in sources]})
    return rows, aggs_list


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
    labels = source_labels(records)
    rows = []
    for setup, runs in launches(records):
        for r in runs:
            rate = field_of(r, setup, "rate_mbit")
            if rate is None:
                continue
            compute, nbytes = as_finite(r.get("compute_s")), as_finite(r.get("bytes_per_step"))
            step = as_finite(r.get("step_s"))
            pred = (None if compute is None or nbytes is None else
                    predict_step_s(compute, nbytes, rate, r.get("collectives_per_step", 1), alpha_s))
            rows.append({"workload": field_of(r, setup, "workload"), "rate_mbit": rate, "method": run_name(r),
                         "launch": field_of(r, setup, "launch"), "measured": step, "predicted": pred,
                         "ratio": None if pred is None or not step else pred / step,
                         "records": [labels.get(r.get("_source"), "—")]})
    return rows


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
    aggs_list = launch_aggregates(records, workload)
    labels = source_labels(records)
    rows = []
    for m in method_order(aggs_list):
        if m == BEST_DILOCO:        # each variant has its own curve; the better is the upper one
            continue
        ags = [aggs[m] for _, aggs in aggs_list if m in aggs]
        reached = [a for a in ags if a["steps"] is not None]
        row = {"method": m, "steps": mean_of([a["steps"] for a in reached]),
               "compute_s": mean_of([a["compute_s"] for a in ags]),
               "bytes_per_step": mean_of([a["bytes"] for a in ags]),
               "collectives": mean_of([a["collectives"] for a in ags]), "launches": len(ags), "reached": len(reached),
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


def rates_of(records, workload):
    return sorted({field_of(runs[0], setup, "rate_mbit") for setup, runs in launches(records)
                   if runs and field_of(runs[0], setup, "workload") == workload}, key=rate_key)


def workloads_of(records):
    out = []
    for r in records:
        wl = r.get("workload")
        if r.get("kind") in ("setup", "run", "tune", "tuned") and wl is not None and wl not in out:
            out.append(wl)
    return out
