"""jobs/fidelity_paired.py: seeds matched pairwise, recipes kept apart, the interval from the paired
differences (a hand-computed case)."""
import json
import math

import fidelity_paired as fp  # jobs/fidelity_paired.py: pytest.ini puts jobs/ on the path
import pytest


def _run(label, seed, acc, recipe=None, mb=1.0, workload="cnn"):
    return {"kind": "run", "workload": workload, "run": label, "seed": seed, "recipe": recipe, "test_acc": acc,
            "quality_key": "test_acc", "bytes_total": mb * 1e6}


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def test_paired_gap_interval_and_recipes(tmp_path):
    f = _write(tmp_path / "a.jsonl", [
        _run("dense", 0, 0.98), _run("dense", 1, 0.96), _run("dense", 2, 0.97), _run("dense", 9, 0.5),
        _run("x+ d=0.01", 0, 0.97, {"m": 0.8}), _run("x+ d=0.01", 1, 0.96, {"m": 0.8}),
        _run("x+ d=0.01", 2, 0.95, {"m": 0.8}), _run("x+ d=0.01", 0, 0.90, {"m": 0.9}, mb=3.0),
        _run("dense", 0, 0.10, workload="lstm"), _run("x+ d=0.01", 1, 0.20, {"m": 0.8}, workload="lstm")])
    rows = fp.paired(fp.load([f]), "x+ d=0.01", "dense", "cnn")   # the lstm runs stay out
    assert [json.loads(r[0]) for r in rows] == [{"m": 0.8}, {"m": 0.9}]
    recipe, seeds, mx, my, gap, se, lo, hi, mb = rows[0]
    d = [-1.0, 0.0, -2.0]   # per-seed differences in points; seed 9 has no run: not paired
    assert seeds == [0, 1, 2] and mx == pytest.approx(96.0) and my == pytest.approx(97.0)
    assert gap == pytest.approx(-1.0) and se == pytest.approx(math.sqrt(1.0 / 3))
    assert (lo, hi) == (pytest.approx(-1.0 - 4.303 * se), pytest.approx(-1.0 + 4.303 * se))
    assert rows[1][1] == [0] and rows[1][4] == pytest.approx(-8.0) and math.isnan(rows[1][5])
    assert rows[1][8] == pytest.approx(3.0) and mb == pytest.approx(1.0)
    assert sum(d) / 3 == gap


def test_a_later_file_replaces_a_seed_and_a_mixed_reference_is_refused(tmp_path):
    a = _write(tmp_path / "a.jsonl", [_run("dense", 0, 0.9), _run("y", 0, 0.8)])
    b = _write(tmp_path / "b.jsonl", [_run("y", 0, 0.85)])
    (row,) = fp.paired(fp.load([a, b]), "y", "dense", "cnn")
    assert row[4] == pytest.approx(-5.0)
    c = _write(tmp_path / "c.jsonl", [_run("dense", 1, 0.9, {"clip_norm": 1.0})])
    with pytest.raises(SystemExit, match="one recipe"):
        fp.paired(fp.load([a, c]), "y", "dense", "cnn")
