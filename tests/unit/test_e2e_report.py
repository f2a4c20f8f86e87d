"""jobs/e2e_records.py and jobs/e2e_report.py on synthetic records (no MPI, no torch): the learning-rate
choice, the summary's ratios within each launch, the alpha-beta model and its break-even rate
(hand-computed cases), the results page and the README block, and report()'s files."""
import json
import math
import os
import sys

import pytest

from tests.launch import ROOT

sys.path.insert(0, os.path.join(ROOT, "jobs"))
import e2e_records as rd  # noqa: E402
import e2e_report as er  # noqa: E402


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def _setup(lid, rate, seed, workload="lm"):
    return {"kind": "setup", "launch": lid, "workload": workload, "ranks": 4, "rate_mbit": rate, "params": 1000,
            "compute_s": 0.1, "allreduce_s": 0.05, "comm_compute_ratio": 0.5, "batch": 8, "steps": 100,
            "seed": seed, "target": 2.5, "optimizer": "adamw", "clip": 1.0, "schedule": "cosine",
            "lr_of": {"ddp": 3e-4}, "tuned_from": None, "val_predictions": 64, "date": "2026-11-26", "host": "h",
            "methods": []}


def _run(lid, rate, seed, method, ttt, steps=None, loss=3.0, npass=1, workload="lm", compute_s=0.1, step_s=0.2,
         nbytes=1e6, collectives=1.0):
    reached = ttt is not None
    return {"kind": "run", "launch": lid, "method": method, "pass": npass, "seed": seed, "workload": workload,
            "ranks": 4, "rate_mbit": rate, "params": 1000, "lr": 3e-4, "steps": 100, "steps_run": 100,
            "step_s": step_s, "compute_s": compute_s, "comm_share": 0.5, "bytes_per_step": nbytes,
            "bytes_source": "model", "final_loss": loss, "loss_at_steps": loss, "target": 2.5,
            "time_to_target_s": ttt, "steps_to_target": (steps or 100) if reached else None,
            "evals": [[0, 0.0, 5.0], [steps or 100, ttt or 20.0, loss]], "params_identical": True,
            "collectives_per_step": collectives}


def _launch(lid, rate, seed, runs, workload="lm"):
    """A setup and its runs; ``runs``: ``(method, ttt, {other _run keywords})``, ddp's second entry is its
    pass 2."""
    recs, seen = [_setup(lid, rate, seed, workload)], set()
    for method, ttt, kw in runs:
        npass = 2 if method in seen else 1
        seen.add(method)
        recs.append(_run(lid, rate, seed, method, ttt, npass=npass, workload=workload, **kw))
    return recs


def _tune(method, lr, seed, loss, steps=50, workload="lm"):
    return {"kind": "tune", "workload": workload, "method": method, "lr": lr, "seed": seed, "steps": steps,
            "loss_at_steps": loss, "final_loss": loss, "evals": []}


GRID = (1e-4, 3e-4, 1e-3)


def _tunes():
    losses = {"ddp": [(3.0, 3.2), (2.9, 2.7), (2.5, float("nan"))],        # one seed diverged at 1e-3
              "exdyna": [(2.6, 3.4), (2.9, 2.9), (3.5, 3.5)],              # best single run is not the best mean
              "ddp-bf16": [(3.0, 3.0), (3.1, 3.1), (None, 4.0)],           # the smallest value wins: an edge
              "topk": [(2.0, 2.0), (2.0, 2.0), (2.5, 2.5)]}                # a tie: the smaller rate
    return [_tune(m, lr, seed, vals[i][j]) for m, vals in losses.items() for i, lr in enumerate(GRID)
            for j, seed in enumerate((11, 12))]


def test_choose_lrs_mean_over_seeds_diverged_edge_and_ties(tmp_path):
    recs = rd.read_records([_write(tmp_path / "tune.jsonl", _tunes() + [_tune("ddp", 1e-3, 11, 1.0, workload="cnn")])])
    tuned = rd.choose_lrs(recs, "lm")
    assert tuned["kind"] == "tuned" and tuned["workload"] == "lm"
    assert tuned["grid"] == list(GRID) and tuned["seeds"] == [11, 12] and tuned["steps"] == 50
    assert tuned["lr_of"] == {"ddp": 3e-4, "exdyna": 3e-4, "ddp-bf16": 1e-4, "topk": 1e-4}
    assert tuned["edge"] == {"ddp": False, "exdyna": False, "ddp-bf16": True, "topk": True}
    assert tuned["loss"]["ddp"] == {"0.0001": pytest.approx(3.1), "0.0003": pytest.approx(2.8), "0.001": None}
    assert tuned["loss"]["exdyna"]["0.0001"] == pytest.approx(3.0)
    assert tuned["loss"]["ddp-bf16"]["0.001"] is None
    json.dumps(tuned, allow_nan=False)           # the record is written as strict JSON
    text = er.tuning_table(tuned)
    ddp_row = next(line for line in text.splitlines() if line.startswith("| ddp |"))
    assert ddp_row.split(" | ")[1:4] == ["3.1000", "**2.8000**", "diverged"]
    assert "edge: widen the grid" in next(line for line in text.splitlines() if line.startswith("| topk |"))
    assert "tune.jsonl" in ddp_row


def test_choose_lrs_refuses_unequal_or_short_grids():
    two = [_tune(m, lr, 1, 3.0) for m in ("ddp", "exdyna") for lr in (1e-4, 3e-4)]
    with pytest.raises(ValueError, match="at least 3"):
        rd.choose_lrs(two, "lm")
    unequal = [_tune("ddp", lr, 1, 3.0) for lr in GRID] + [_tune("exdyna", lr, 1, 3.0) for lr in GRID + (3e-3,)]
    with pytest.raises(ValueError, match="same size"):
        rd.choose_lrs(unequal, "lm")
    seeds = [_tune(m, lr, 1, 3.0) for m in ("ddp", "exdyna") for lr in GRID] + [_tune("exdyna", 1e-4, 2, 3.0)]
    with pytest.raises(ValueError, match="same tuning seeds"):
        rd.choose_lrs(seeds, "lm")
    with pytest.raises(ValueError, match="no tune records"):
        rd.choose_lrs(seeds, "cnn")


def _two_launches(rate=1000.0):
    """Launch A (seed 1) and B (seed 2) at ``rate``; the expected numbers are worked out in the tests."""
    a = _launch("A", rate, 1, [
        ("ddp", 100.0, dict(steps=400, loss=3.0, compute_s=0.10)),
        ("ddp-bf16", 88.0, dict(steps=400, loss=3.1)),
        ("exdyna", 55.0, dict(steps=500, loss=3.255)),
        ("topk", None, dict(loss=3.5)),
        ("micro", 220.0, dict(steps=900, loss=3.3)),
        ("diloco-h16", 50.0, dict(steps=300, loss=3.0)),
        ("diloco-h64", 40.0, dict(steps=350, loss=3.05)),
        ("ddp", 120.0, dict(steps=400, loss=3.2, compute_s=0.11))])       # pass 2: 10 % slower compute
    b = _launch("B", rate, 2, [
        ("ddp", 200.0, dict(steps=600, loss=2.0, compute_s=0.10)),
        ("exdyna", 400.0, dict(steps=1000, loss=2.1)),
        ("topk", None, dict(loss=2.4)),
        ("micro", None, dict(loss=2.3)),
        ("diloco-h16", 100.0, dict(steps=500, loss=2.2)),
        ("diloco-h64", None, dict(loss=2.25)),
        ("ddp", 200.0, dict(steps=600, loss=2.0, compute_s=0.099))])
    return a, b


def _check_two_launches(rows):
    by = {r["method"]: r for r in rows}
    assert [r["method"] for r in rows] == ["ddp", "ddp-bf16", "exdyna", "topk", "micro", "diloco-h16", "diloco-h64",
                                           rd.BEST_DILOCO]
    ex = by["exdyna"]
    # per launch: A 110 / 55 = 2.0 (ddp's passes 100 and 120), B 200 / 400 = 0.5. Mixing launches would
    # give 155 / 227.5 = 0.68; ddp's first pass only, (100 / 55 + 0.5) / 2 = 1.16.
    assert ex["vs"]["ddp"]["mean"] == pytest.approx(1.25)
    assert (ex["vs"]["ddp"]["min"], ex["vs"]["ddp"]["max"]) == (pytest.approx(0.5), pytest.approx(2.0))
    assert ex["vs"]["ddp"]["values"] == [("A", pytest.approx(2.0)), ("B", pytest.approx(0.5))]
    assert ex["vs"]["ddp-bf16"]["values"] == [("A", pytest.approx(88 / 55))]      # bf16 ran in A only
    # the better DiLoCo per launch: A h64 (40 s), B h16 (100 s)
    assert ex["vs"][rd.BEST_DILOCO]["values"] == [("A", pytest.approx(40 / 55)), ("B", pytest.approx(0.25))]
    best = by[rd.BEST_DILOCO]
    assert best["chosen"] == ["diloco-h64", "diloco-h16"]
    assert best["vs"]["ddp"]["mean"] == pytest.approx((110 / 40 + 200 / 100) / 2)
    assert ex["steps_to_target"] == pytest.approx(750) and ex["time_to_target_s"] == pytest.approx(227.5)
    assert ex["seeds"] == [1, 2] and ex["n"] == 2 and ex["reached"] == 2
    assert ex["loss_at_steps"] == pytest.approx((3.255 + 2.1) / 2)
    assert ex["loss_std"] == pytest.approx(abs(3.255 - 2.1) / math.sqrt(2))
    assert ex["loss_vs_ddp_pct"] == pytest.approx((5.0 + 5.0) / 2)          # A: 3.255 vs 3.1, B: 2.1 vs 2.0
    ddp = by["ddp"]
    assert ddp["time_to_target_s"] == pytest.approx((110 + 200) / 2) and ddp["vs"]["ddp"] == "ref"
    assert ddp["loss_at_steps"] == pytest.approx((3.1 + 2.0) / 2)
    assert by["topk"]["reached"] == 0 and "ddp" not in by["topk"]["vs"]
    assert by["micro"]["reached"] == 1 and by["micro"]["vs"]["ddp"]["values"] == [("A", pytest.approx(0.5))]
    assert by["micro"]["time_to_target_s"] == pytest.approx(220)


def test_summary_ratios_within_each_launch(tmp_path):
    a, b = _two_launches()
    recs = rd.read_records([_write(tmp_path / "a.jsonl", a), _write(tmp_path / "b.jsonl", b)])
    rows, text = er.summary(recs, "lm", 1000)
    _check_two_launches(rows)
    assert rows[2]["records"] == ["a.jsonl", "b.jsonl"] and rows[1]["records"] == ["a.jsonl"]
    lines = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ")}
    assert "1.25x (0.50–2.00)" in lines["exdyna"]
    assert "not reached" in lines["topk"] and "x" not in lines["topk"].split(" | ")[4]
    assert "220.0 (reached 1/2)" in lines["micro"]
    assert "+5.00 %" in lines["exdyna"] and "a.jsonl, b.jsonl" in lines["exdyna"]
    assert "compute drift" in text and "10.0 %" in text       # ddp's pass 2 compute 0.11 vs 0.10 in A
    assert er.summary(recs, "lm", 100) == ([], "**lm**, 100 Mbit/s: no runs.")


def test_summary_flags_a_target_above_the_trigram(tmp_path):
    """A target a count model reaches is named as such in the table's head; one below it is not."""
    for target, flagged in ((2.5, True), (2.0, False)):
        a, _ = _two_launches()
        a[0] = dict(a[0], target=target, ngram={"unigram": 3.2, "bigram": 2.4, "trigram": 2.2})
        recs = rd.read_records([_write(tmp_path / f"t{target}.jsonl", a)])
        _, text = er.summary(recs, "lm", 1000)
        assert "n-gram baselines unigram 3.2000, bigram 2.4000, trigram 2.2000" in text
        assert ("the target lies above the trigram (2.2000)" in text) == flagged, text.splitlines()[0]


def test_a_method_with_its_own_budget_is_named_with_it(tmp_path):
    """A run of ``--steps-of`` (another budget than the launch's) says so in both tables: its loss at the
    budget is not comparable with DDP's without it."""
    recs = _launch("A", 1000, 1, [("ddp", 100.0, {}), ("sloco-h16", 60.0, {"steps": 150}),
                                  ("exdyna", 80.0, {})])
    recs[2] = dict(recs[2], steps=400, steps_run=400)
    recs = rd.read_records([_write(tmp_path / "own.jsonl", recs)])
    _, text = er.summary(recs, "lm", 1000)
    names = [line.split(" | ")[0][2:] for line in text.splitlines() if line.startswith("| ")]
    assert "sloco-h16 (budget 400 batches)" in names and "exdyna" in names and "ddp" in names
    setup, runs = rd.groups(recs)[0]
    rows = er.table(setup, runs).splitlines()
    assert any(r.startswith("| sloco-h16 (budget 400 batches) |") for r in rows)
    assert any(r.startswith("| exdyna |") for r in rows)


def test_a_run_stopped_at_target_is_not_counted_as_diverged(tmp_path):
    """``--stop-at-target`` leaves no loss at the budget (null); a diverged run's is NaN."""
    recs = _launch("A", 1000, 1, [("ddp", 100.0, {}), ("sloco-h16", 60.0, {}), ("exdyna", None, {})])
    recs[2] = dict(recs[2], loss_at_steps=None, steps_run=60)
    recs[3] = dict(recs[3], loss_at_steps=float("nan"), steps_run=30, diverged=True)
    rows, text = er.summary(rd.read_records([_write(tmp_path / "stop.jsonl", recs)]), "lm", 1000)
    by = {r["method"]: r for r in rows}
    assert by["sloco-h16"]["nonfinite"] == 0 and by["exdyna"]["nonfinite"] == 1
    lines = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ")}
    assert "diverged" not in lines["sloco-h16"] and "diverged" in lines["exdyna"]


def test_summary_groups_interleaved_launches_by_id(tmp_path):
    """Both launches' records interleaved in one file: runs still join their own launch."""
    a, b = _two_launches()
    mixed = [a[0], b[0]] + [r for pair in zip(a[1:], b[1:]) for r in pair] + a[1 + len(b[1:]):]
    recs = rd.read_records([_write(tmp_path / "mixed.jsonl", mixed)])
    rows, _ = er.summary(recs, "lm", 1000.0)
    _check_two_launches(rows)


def test_predict_step_s_and_model_check(tmp_path):
    # 0.1 s compute + 2 calls x 1 ms + 8 x 1.25 MB over 100 Mbit/s (0.1 s)
    assert rd.predict_step_s(0.1, 1.25e6, 100, collectives=2) == pytest.approx(0.202)
    assert rd.predict_step_s(0.1, 1.25e6, 100, collectives=2, alpha_s=0.0) == pytest.approx(0.2)
    assert rd.predict_step_s(0.1, 1.25e6, [100, 1000]) == pytest.approx([0.201, 0.111])
    recs = _launch("A", 100.0, 1, [("ddp", 10.0, dict(nbytes=1.25e6, collectives=2.0, step_s=0.25)),
                                   ("ddp", 10.0, dict(nbytes=1.25e6, collectives=2.0, step_s=0.2))])
    recs += _launch("U", None, 1, [("ddp", 10.0, {})])         # no link shaping: nothing to predict
    rows = rd.model_check(recs)
    assert [(r["method"], r["rate_mbit"]) for r in rows] == [("ddp", 100.0), ("ddp (again)", 100.0)]
    assert rows[0]["predicted"] == pytest.approx(0.202) and rows[0]["ratio"] == pytest.approx(0.202 / 0.25)
    assert "predicted step s (modelled)" in er.model_check_table(rows)


def _regime_records():
    """ddp: 100 steps, 1.25 MB a step; exdyna 200 steps (180 and 220 at two rates), 12.5 kB; ddp-bf16: 50
    steps, 5 MB; micro: 100 steps, 1 kB. compute 0.1 s and one call per step for all."""
    recs = []
    for lid, rate, steps in (("r100", 100.0, 180), ("r1000", 1000.0, 220)):
        recs += _launch(lid, rate, 1, [
            ("ddp", 10.0, dict(steps=100, nbytes=1.25e6)), ("exdyna", 20.0, dict(steps=steps, nbytes=1.25e4)),
            ("ddp-bf16", 5.0, dict(steps=50, nbytes=5e6)), ("micro", 5.0, dict(steps=100, nbytes=1e3)),
            ("topk", None, dict(nbytes=1e3)), ("ddp", 10.0, dict(steps=100, nbytes=1.25e6))])
    return recs


def test_regime_break_even_by_hand():
    rows = {r["method"]: r for r in rd.regime(_regime_records(), "lm")}
    ex, bf, mi = rows["exdyna"], rows["ddp-bf16"], rows["micro"]
    assert ex["steps"] == pytest.approx(200) and ex["bytes_per_step"] == pytest.approx(1.25e4)
    # 100 (0.101 + 10 / R) = 200 (0.101 + 0.1 / R)  =>  R = 9.8 / 0.101; fewer bytes to target: pays below
    assert ex["break_even_mbit"] == pytest.approx(9.8 / 0.101, rel=1e-9) and ex["pays"] == "below"
    # 100 (0.101 + 10 / R) = 50 (0.101 + 40 / R)  =>  R = 1000 / 5.05; more bytes to target: pays above
    assert bf["break_even_mbit"] == pytest.approx(1000 / 5.05, rel=1e-9) and bf["pays"] == "above"
    assert mi["break_even_mbit"] is None and min(mi["speedup"]) > 1       # same steps, fewer bytes: always
    assert ex["at"][1000] == pytest.approx(100 * (0.101 + 0.01) / (200 * (0.101 + 0.0001)))
    assert rows["topk"]["speedup"] is None and rows["ddp"]["at"][100] == pytest.approx(1.0)
    i = int(abs(ex["rates"] - 100).argmin())                          # the grid holds 100 Mbit/s exactly
    assert ex["speedup"][i] == pytest.approx(100 * 0.201 / (200 * 0.102))
    text = er.regime_table(list(rows.values()))
    assert "pays below 97 Mbit/s" in text and "pays above 198 Mbit/s" in text and "not reached" in text


def _docs_records(tmp_path):
    paths = []
    for wl in ("lm", "cnn"):
        for rate in (100.0, 1000.0, 10000.0):
            for seed in (1, 2, 3):
                lid = f"{wl}-{rate:g}-s{seed}"
                runs = [("ddp", 100.0 + seed, dict(steps=400))]
                runs += [(m, 80.0 + seed, dict(steps=500, nbytes=1e4)) for m in
                         ("exdyna", "ddp-bf16", "ddp-powersgd", "ddp-accum", "diloco-h16", "diloco-h64", "topk")]
                runs += [("ddp", 110.0, dict(steps=400))]
                paths.append(_write(tmp_path / f"{lid}.jsonl", _launch(lid, rate, seed, runs, workload=wl)))
    paths.append(_write(tmp_path / "tune.jsonl", _tunes()))
    return rd.read_records(paths)


def test_write_docs_page_and_readme_block(tmp_path):
    recs = _docs_records(tmp_path)
    readme = tmp_path / "README.md"
    before, after = "# Title\n\nintro\n\n", "\n\n## Later\n\ntail\n"
    readme.write_text(before + f"{er.README_BEGIN}\nold table\n{er.README_END}" + after)
    page = tmp_path / "docs" / "results.md"
    text = er.write_docs(recs, str(page), readme=str(readme), header="# Results\n\nMethod prose.")
    assert page.read_text() == text and text.startswith("# Results\n\nMethod prose.\n")
    assert text.count("\n") < 400
    assert (tmp_path / "docs" / "e2e_regime.png").stat().st_size > 0
    assert (tmp_path / "docs" / "e2e_regime_cnn.png").stat().st_size > 0
    new = readme.read_text()
    assert new.startswith(before + er.README_BEGIN + "\n") and new.endswith(er.README_END + after)
    block = new[len(before):-len(after)]
    assert "old table" not in block and "(docs/results.md)" in block
    head = next(line for line in block.splitlines() if line.startswith("| workload |"))
    assert head.split(" | ")[2:5] == ["100 Mbit/s", "1000 Mbit/s", "10000 Mbit/s"]
    rows = [line for line in block.splitlines() if line.startswith("| lm |")]
    assert [r.split(" | ")[1] for r in rows] == ["exdyna", "ddp-bf16", "ddp-powersgd", "diloco (best) (diloco-h16)",
                                                 "ddp-accum"]
    # seeds s: ddp (100 + s + 110) / 2 over 80 + s; the mean over seeds 1..3, the same at each rate here
    mean = sum((100 + s + 110) / 2 / (80 + s) for s in (1, 2, 3)) / 3
    assert all(c.startswith(f"{mean:.2f}x (") for c in rows[0].split(" | ")[2:5])
    assert rows[0].rstrip(" |").split(" | ")[-1] == "lm-100-s*.jsonl, lm-1000-s*.jsonl, lm-10000-s*.jsonl"
    assert len([line for line in block.splitlines() if line.startswith("| cnn |")]) == 5
    # every row of every summary table names the record files of its launches
    lines = text.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("| method | seeds |")]
    assert len(heads) == 6
    for i in heads:
        rate = lines[i - 2].split(", ")[1]           # the heading line: **lm**, 1000 Mbit/s, ...
        j = i + 2
        while j < len(lines) and lines[j].startswith("| "):
            files = lines[j].rstrip(" |").split(" | ")[-1].split(", ")
            assert len(files) == 3 and all(f.endswith(".jsonl") and f"-{rate.split()[0]}-s" in f for f in files)
            j += 1
        assert j - i - 2 == 9                        # ddp, 7 methods, diloco (best)
    assert "**2.8000**" in text and "(modelled)" in text and "- tune.jsonl: `../tune.jsonl`" in text
    assert text.index("10000 Mbit/s") > text.index("1000 Mbit/s") > text.index("**lm**, 100 Mbit/s")


def test_readme_cell_from_fewer_seeds_says_so(tmp_path):
    """A rate run on fewer held-out seeds than the protocol asks is marked in its cell, not averaged
    silently beside three-seed cells."""
    recs = _docs_records(tmp_path)
    one = [r for r in recs if not (r.get("workload", "lm") == "lm" and r.get("rate_mbit") == 100.0
                                   and r.get("seed") in (2, 3))]
    lm100 = [r for r in one if r.get("rate_mbit") == 100.0 and r.get("workload") == "lm"]
    assert lm100 and {r.get("seed") for r in lm100 if "seed" in r} == {1}
    readme = tmp_path / "README.md"
    readme.write_text(f"{er.README_BEGIN}\n{er.README_END}\n")
    er.write_docs(one, str(tmp_path / "page.md"), readme=str(readme), plot=False)
    row = next(line for line in readme.read_text().splitlines() if line.startswith("| lm | exdyna |"))
    cells = row.split(" | ")
    assert cells[2].endswith("(1 seed only)") and "only" not in cells[3] and "only" not in cells[4]


def test_readme_rows_name_the_adamw_default_and_the_sparse_outer_exchange(tmp_path):
    """The LM's timed launches run the default Adam path as ``exdyna-demoage999`` and the library's
    DiLoCo with an ExDyna exchange as ``sloco-h16``: both are headline rows, in HEADLINE's order, while a
    method outside the headline (``topk``) stays on the results page only."""
    paths = []
    for seed in (1, 2, 3):
        lid = f"lm-200-s{seed}"
        runs = [("ddp", 100.0 + seed, dict(steps=400)), ("sloco-h16", 70.0, dict(steps=900, nbytes=1e4)),
                ("topk", 90.0, dict(steps=500, nbytes=1e4)), ("diloco-h64", 60.0, dict(steps=800, nbytes=1e4)),
                ("exdyna-demoage999", 40.0 + seed, dict(steps=400, nbytes=1e5))]
        paths.append(_write(tmp_path / f"{lid}.jsonl", _launch(lid, 200.0, seed, runs)))
    readme = tmp_path / "README.md"
    readme.write_text(f"{er.README_BEGIN}\n{er.README_END}\n")
    er.write_docs(rd.read_records(paths), str(tmp_path / "page.md"), readme=str(readme), plot=False)
    rows = [line.split(" | ") for line in readme.read_text().splitlines() if line.startswith("| lm |")]
    assert [r[1] for r in rows] == ["exdyna-demoage999", "diloco (best) (diloco-h64)", "sloco-h16"]
    mean = sum((100.0 + s) / (40.0 + s) for s in (1, 2, 3)) / 3
    sloco = sum(100.0 + s for s in (1, 2, 3)) / 210
    assert rows[0][2].startswith(f"{mean:.2f}x (") and rows[2][2] == f"{sloco:.2f}x ({101 / 70:.2f}–{103 / 70:.2f})"


def test_learning_rates_one_table_per_budget():
    """Methods tuned at a schedule of their own (``--steps-of``) get a table per budget, each held to
    the protocol on its own: a short grid at one budget is named there and spares the other tables."""
    recs = [dict(r, _source="t600.jsonl") for r in _tunes()]                    # budget 50
    recs += [dict(_tune(m, lr, s, loss, steps=200), _source="t200.jsonl")
             for m, losses in (("diloco-h64", (2.2, 2.0, 2.4)), ("sloco-h16", (2.3, 2.2, 2.1)))
             for lr, loss in zip(GRID, losses) for s in (11, 12)]
    text = "\n".join(er._tuning_section(recs, "lm", None))
    assert text.count("| method | loss at lr") == 2
    at50, at200 = text.split("At a budget of 200 batches")
    assert "At a budget of 50 batches (ddp, ddp-bf16, exdyna, topk)" in at50 and "diloco-h64" not in at50
    rows = {line.split(" | ")[0].lstrip("| "): line for line in at200.splitlines() if line.startswith("| ")}
    assert " **2.0000** " in rows["diloco-h64"] and "edge" not in rows["diloco-h64"].split(" | ")[-2]
    assert rows["sloco-h16"].split(" | ")[-2] == "edge: widen the grid"
    short = [r for r in recs if not (r["method"] == "sloco-h16" and r["lr"] == GRID[0])]
    text = "\n".join(er._tuning_section(short, "lm", None))
    assert text.count("| method | loss at lr") == 1 and "at least 3 values" in text.split("200 batches")[1]
    stored = rd.choose_lrs([r for r in recs if r["steps"] == 200], "lm")   # a stored choice alone: its table
    text = "\n".join(er._tuning_section([dict(stored, _source="tuned.json")], "lm", None))
    assert text.count("| method | loss at lr") == 1 and "sloco-h16" in text and "budget" not in text


def test_write_docs_without_markers_or_over_the_limit(tmp_path):
    recs = _docs_records(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text("# Title\n<!-- e2e-results:begin -->\nno end marker\n")
    page = tmp_path / "page.md"
    with pytest.raises(ValueError, match="e2e-results:end"):
        er.write_docs(recs, str(page), readme=str(readme), plot=False)
    assert not page.exists() and readme.read_text() == "# Title\n<!-- e2e-results:begin -->\nno end marker\n"
    with pytest.raises(ValueError, match="under 300"):
        er.write_docs(recs, str(page), header="x\n" * 300, plot=False)


def test_report_writes_summary_and_regime(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    a, b = _two_launches()
    _write(run_dir / "e2e.jsonl", [{"kind": "link", "set_mbit": 1000, "measured_mbit": [957.9, 958.1]},
                                   {"kind": "link", "set_mbit": 20, "measured_mbit": [19.1, 19.1],
                                    "burst_bytes": [16384, 16384]}] + a + b)
    out = tmp_path / "out"
    text = er.report([str(run_dir)], str(out))
    # the bucket a link ran with is named; an old record without it says what that bucket did
    assert "set 20: 19.1, 19.1 (tbf bucket 16 KiB)" in text
    assert "set 1000: 957.9, 958.1 (tbf bucket not recorded: at least 256 KiB" in text
    for name in ("e2e.md", "e2e_loss.png", "e2e_ttt.png", "e2e_summary.md", "e2e_regime.png"):
        assert (out / name).stat().st_size > 0, name
    assert "| ddp (again) |" in text and "| compute s |" in text and "set 1000: 957.9, 958.1" in text
    again = next(line for line in text.splitlines() if line.startswith("| ddp (again) |"))
    assert again.split(" | ")[2] == "0.110"
    # e2e.md's launch A: exdyna against ddp's mean of 100 and 120 s
    ex = next(line for line in text.splitlines() if line.startswith("| exdyna |"))
    assert "| 2.00x |" in ex
    summary_md = (out / "e2e_summary.md").read_text()
    assert "**lm**, 1000 Mbit/s" in summary_md and "1.25x (0.50–2.00)" in summary_md
    with pytest.raises(ValueError, match="composed times are not part of the protocol"):
        er.report([str(run_dir)], str(out), curves=[str(run_dir)])


def test_the_docs_page_begins_with_the_header_the_report_writes():
    """``jobs/e2e.py --report ... --docs docs/e2e.md`` rewrites the page from its static header: an
    edit of the page's text that the header lacks would be lost at the next report."""
    import e2e
    with open(os.path.join(ROOT, "docs", "e2e.md")) as f:
        page = f.read()
    assert page.startswith(e2e.DOCS_HEADER), "docs/e2e.md's methodology differs from jobs/e2e.py's DOCS_HEADER"
