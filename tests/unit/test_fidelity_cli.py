"""jobs/fidelity.py end to end at P=2 under mpiexec (a tiny --quick): JSON lines, table, plots; and
--report rebuilding the table from JSON lines, a later file's run replacing an earlier one.
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed")
pytest.importorskip("sklearn", reason="scikit-learn is not installed")
pytest.importorskip("matplotlib", reason="matplotlib is not installed")

import fidelity  # noqa: E402  (jobs/fidelity.py: pytest.ini puts jobs/ on the path)
import fidelity_report  # noqa: E402
from tests.launch import MPIEXEC, ROOT, child_env  # noqa: E402

JOB = os.path.join(ROOT, "jobs", "fidelity.py")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    if MPIEXEC is None:
        pytest.skip("no mpiexec on PATH")
    out = tmp_path_factory.mktemp("fid") / "out"
    cmd = ["timeout", "-k", "5", "300", MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", JOB, "--quick",
           "--sparsifiers", "dense,exdyna", "--lstm-steps", "3", "--cnn-steps", "4", "--evals", "2",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=320)
    assert proc.returncode == 0, f"rc {proc.returncode}\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(line) for line in (out / "fidelity.jsonl").read_text().splitlines()]
    return proc, out, recs


def test_quick_writes_runs_evals_table_and_plots(quick_run):
    proc, out, recs = quick_run
    runs = [r for r in recs if r["kind"] == "run"]
    labels = [(r["workload"], r["run"]) for r in runs]
    assert labels == [(w, n) for w in ("lstm", "cnn") for n in ("dense", "exdyna d=0.01", "exdyna+ d=0.01")]
    for r in runs:
        assert r["ranks"] == 2 and r["params_identical"], r
        assert r["steps"] == (3 if r["workload"] == "lstm" else 4)
        steps = [x for x in recs if x["kind"] == "step" and x["workload"] == r["workload"] and x["run"] == r["run"]]
        assert len(steps) == r["steps"]
        # the run's total is the sum of its per-step bytes, and a sparse run sends less than dense
        assert r["bytes_total"] == pytest.approx(sum(x["bytes_sent"] for x in steps), rel=1e-9)
        evals = [x for x in recs if x["kind"] == "eval" and x["workload"] == r["workload"] and x["run"] == r["run"]]
        assert evals[0]["step"] == 0 and evals[-1]["step"] == r["steps"]
        assert evals[-1][r["quality_key"]] == r[r["quality_key"]]
    lstm = [r for r in runs if r["workload"] == "lstm"]
    assert lstm[0]["numel"] >= 2_000_000 and "val_ppl" in lstm[0]
    assert all(r["bytes_total"] < 0.2 * lstm[0]["bytes_total"] for r in lstm[1:])
    # the recipe (fidelity.DEFAULT_RECIPE: momentum 0.9 from d=0.01) on top of the LSTM workload's own clip
    assert lstm[2]["options"]["momentum_correction"] == 0.9 and lstm[2]["options"]["clip_norm"] == 0.25
    assert lstm[2]["recipe"] == {"momentum_correction": 0.9}
    table = (out / "fidelity.md").read_text()
    assert "### lstm" in table and "### cnn" in table and "val ppl" in table and "test acc" in table
    assert table.count("*") >= 2                       # each workload has a Pareto front
    for png in ("pareto.png", "quality_vs_step.png"):
        assert (out / png).stat().st_size > 10_000
    assert "wall" in proc.stdout


def test_report_merges_files_later_run_replaces_earlier(quick_run, tmp_path):
    _, out, recs = quick_run
    later = tmp_path / "later.jsonl"
    run = next(r for r in recs if r["kind"] == "run" and r["workload"] == "cnn" and r["run"] == "exdyna d=0.01")
    later.write_text(json.dumps(dict(run, test_acc=0.4321)) + "\n")
    rep = tmp_path / "rep"
    assert fidelity.main(["--report", f"{out / 'fidelity.jsonl'},{later}", "--out", str(rep), "--no-plot"]) == 0
    table = (rep / "fidelity.md").read_text()
    assert "43.21 %" in table and table.count("exdyna d=0.01") == 2   # replaced, not duplicated

    # Pareto: a run beaten on both bytes and quality is not on the front
    rows = [{"run": "a", "q": 0.9, "bytes_total": 10.0}, {"run": "b", "q": 0.8, "bytes_total": 20.0},
            {"run": "c", "q": 0.7, "bytes_total": 5.0}]
    assert fidelity_report.pareto(rows, True) == {"a", "c"}
    assert fidelity_report.pareto(rows, False) == {"c"}   # lower is better: c beats both


def test_report_orders_workloads_as_the_runner_lists_them():
    assert tuple(fidelity.WORKLOADS) == fidelity_report.WORKLOAD_ORDER


def test_report_averages_seeds(quick_run, tmp_path):
    """Runs of the same label under other seeds are averaged, with their range; the same seed in a
    later file still replaces."""
    _, out, recs = quick_run
    other = tmp_path / "seed7.jsonl"
    run = next(r for r in recs if r["kind"] == "run" and r["workload"] == "cnn" and r["run"] == "exdyna d=0.01")
    other.write_text(json.dumps(dict(run, seed=7, test_acc=run["test_acc"] - 0.10)) + "\n")
    rep = tmp_path / "rep"
    assert fidelity.main(["--report", f"{out / 'fidelity.jsonl'},{other}", "--out", str(rep), "--no-plot"]) == 0
    table = (rep / "fidelity.md").read_text()
    lo, hi = 100 * (run["test_acc"] - 0.10), 100 * run["test_acc"]
    assert f"{(lo + hi) / 2:.2f} % [{lo:.2f}, {hi:.2f}]" in table, table
    assert f"mean over seeds {run['seed']}, 7" in table


def test_lstm_clip_option_reaches_every_lstm_run():
    """--lstm-clip sets the LSTM's base clip_norm for every run, dense included (0: none); the default
    is the workload's 0.25; the CNN keeps its own options; a recipe's clip still cannot loosen it.
    No MPI: parse, build the workload, compute the run options."""
    def opts(argv, wname="lstm", recipe=None):
        args = fidelity.parse_args(argv)
        wl = fidelity.make_workload(wname, args)
        return args, fidelity.run_options(wl, recipe or {}, 100)

    args, o = opts([])
    assert args.lstm_clip == 0.25 and o == {"clip_norm": 0.25}                # today's behaviour
    assert fidelity.LSTMWork.base_options == {"clip_norm": 0.25}              # the class is not changed
    args, o = opts(["--lstm-clip", "1.0"])
    assert args.lstm_clip == 1.0 and o == {"clip_norm": 1.0}
    assert opts(["--lstm-clip", "1.0"], recipe={"clip_norm": 0.5})[1]["clip_norm"] == 0.5
    assert opts(["--lstm-clip", "0.1"], recipe={"clip_norm": 0.5})[1]["clip_norm"] == 0.1
    args, o = opts(["--lstm-clip", "0"])
    assert args.lstm_clip == 0 and o == {}                                    # no base clip at all
    assert opts(["--lstm-clip", "0"], recipe={"clip_norm": 2.0})[1] == {"clip_norm": 2.0}
    assert opts(["--lstm-clip", "0"], recipe={"warmup_steps": 0.2})[1] == {"warmup_steps": 20}
    assert opts(["--lstm-clip", "1.0"], wname="cnn")[1] == {}                 # the CNN has no base clip
    with pytest.raises(SystemExit):
        fidelity.parse_args(["--lstm-clip", "-1"])


def test_lstm_schedule_option_cosine_lr_and_merged_report(tmp_path):
    """--lstm-schedule: constant is the default (no scheduler, labels unchanged); cosine gives
    lr * 0.5 * (1 + cos(pi * s / S)) at step s for the LSTM (the CNN stays constant), through a
    LambdaLR stepped after each optimizer step as train_one does; cosine runs carry the schedule in
    their label and record, and a merged report keeps them apart from constant-lr runs of the same
    base label (own table, own dense reference). No MPI."""
    import math

    import torch

    args = fidelity.parse_args([])
    assert args.lstm_schedule == "constant"
    wl = fidelity.make_workload("lstm", args)
    assert wl.lr_schedule == "constant" and fidelity.run_label(wl, "exdyna d=0.01") == "exdyna d=0.01"
    assert fidelity.LSTMWork.lr_schedule == "constant"
    assert all(fidelity.lr_factor("constant", s, 1000) == 1.0 for s in (0, 500, 999))
    args = fidelity.parse_args(["--lstm-schedule", "cosine"])
    assert args.lstm_schedule == "cosine"
    wl = fidelity.make_workload("lstm", args)
    assert wl.lr_schedule == "cosine" and fidelity.run_label(wl, "exdyna d=0.01") == "exdyna d=0.01 cosine"
    assert fidelity.make_workload("cnn", args).lr_schedule == "constant"
    assert fidelity.LSTMWork.lr_schedule == "constant"                      # the class is not changed
    with pytest.raises(SystemExit):
        fidelity.parse_args(["--lstm-schedule", "linear"])

    # the lr each step of a 1000-step budget runs at, as train_one sets it (base lr 1.0)
    S = 1000
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=wl.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: fidelity.lr_factor(wl.lr_schedule, s, S))
    lrs = []
    for _ in range(S):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert wl.lr == 1.0
    assert lrs[0] == pytest.approx(1.0, abs=1e-12)
    assert lrs[S // 2] == pytest.approx(0.5, abs=1e-12)
    assert lrs[S - 1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 999 / 1000)), rel=1e-9)
    assert lrs[S - 1] == pytest.approx(2.4674e-6, rel=1e-3)                 # ~ (pi / 2S)^2, not 0
    assert lrs[S // 4] == pytest.approx(0.5 + 0.5 * math.sqrt(0.5), abs=1e-12)
    assert all(a > b for a, b in zip(lrs, lrs[1:]))                          # strictly decreasing

    # merged report: constant and cosine runs of the same base label and seed both survive
    def run(label, sched, q, sparsifier="exdyna"):
        r = {"kind": "run", "workload": "lstm", "run": label, "sparsifier": sparsifier,
             "target": 1.0 if sparsifier == "dense" else 0.01, "recipe": {}, "seed": 0, "ranks": 4,
             "numel": 100, "steps": 1000, "quality_key": "val_loss", "higher_is_better": False,
             "val_loss": q, "val_ppl": math.exp(q), "density": 0.01, "bytes_total": 1e6,
             "bytes_per_step": 1e3, "dense_bytes_per_step": 1e5}
        if sched is not None:
            r["lr_schedule"] = sched
        return json.dumps(r) + "\n"

    old = tmp_path / "constant.jsonl"     # written before --lstm-schedule: no lr_schedule field
    old.write_text(run("dense", None, 1.40, "dense") + run("exdyna d=0.01", None, 1.47))
    new = tmp_path / "cosine.jsonl"
    new.write_text(run("dense cosine", "cosine", 1.30, "dense") + run("exdyna d=0.01 cosine", "cosine", 1.326))
    rep = tmp_path / "rep"
    assert fidelity.main(["--report", f"{old},{new}", "--out", str(rep), "--no-plot"]) == 0
    table = (rep / "fidelity.md").read_text()
    assert table.count("### lstm") == 2 and "1000 steps, cosine lr schedule, seed 0" in table, table
    assert "| exdyna d=0.01 " in table and "| exdyna d=0.01 cosine" in table
    assert "+5.00 %" in table and "+2.00 %" in table                         # each against its own dense


def test_recipe_density_warmup_parses_to_a_tuple_the_adapter_accepts():
    """--recipe density_warmup=D1/D2/... (slash-separated: the comma separates options) becomes a tuple
    of floats in the run's recipe and options; DistributedOptimizer accepts it. No MPI (one rank)."""
    import torch

    from exdyna_mpi.adapters.torch import DistributedOptimizer

    text = "momentum_correction=0.8,density_warmup=0.25/0.0625/0.015625,density_warmup_steps=11"
    recipe = fidelity.parse_recipe(text)
    assert recipe == {"momentum_correction": 0.8, "density_warmup": (0.25, 0.0625, 0.015625),
                      "density_warmup_steps": 11}
    assert fidelity.parse_recipe("density_warmup=0.25,density_warmup_steps=5")["density_warmup"] == (0.25,)
    with pytest.raises(ValueError, match="density_warmup"):
        fidelity.parse_recipe("density_warmup=0.25/x,density_warmup_steps=5")

    runs = fidelity.plan(fidelity.parse_args(["--sparsifiers", "exdyna", "--densities", "0.01", "--recipe", text]))
    assert [r[0] for r in runs] == ["exdyna d=0.01", "exdyna+ d=0.01"] and runs[1][3] == recipe
    options = fidelity.run_options(fidelity.make_workload("cnn", fidelity.parse_args([])), recipe, 165)
    assert options == recipe
    assert json.loads(json.dumps({"options": options}))["options"]["density_warmup"] == [0.25, 0.0625, 0.015625]

    model = torch.nn.Linear(4, 2)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, sparsifier="exdyna",
                               density=0.01, **options)
    assert opt._exdyna_options.stages == (0.25, 0.0625, 0.015625) and opt._exdyna_options.stage_steps == 11


def test_recipe_clauses_apply_from_their_density_on():
    """--recipe 'BASE|d>=D:KEY=VALUE,...': the clause's options join (or replace) the base for runs at
    densities >= D; the default recipe is momentum 0.8 below d=0.01 and 0.9 from it."""
    d = fidelity.DEFAULT_RECIPE
    assert fidelity.parse_recipe(d) == {"momentum_correction": 0.8}
    assert fidelity.parse_recipe(d, 0.00338) == {"momentum_correction": 0.8}
    assert fidelity.parse_recipe(d, 0.01) == fidelity.parse_recipe(d, 0.05) == {"momentum_correction": 0.9}
    text = "clip_norm=1.0|d>=0.003:momentum_correction=0.8|d>=0.01:momentum_correction=0.9,clip_norm=5.0"
    assert fidelity.parse_recipe(text, 0.001) == {"clip_norm": 1.0}
    assert fidelity.parse_recipe(text, 0.003) == {"clip_norm": 1.0, "momentum_correction": 0.8}
    assert fidelity.parse_recipe(text, 0.01) == {"clip_norm": 5.0, "momentum_correction": 0.9}
    runs = fidelity.plan(fidelity.parse_args(["--sparsifiers", "exdyna", "--densities", "0.01,0.001", "--plus-only"]))
    assert [(r[0], r[3]) for r in runs] == [("exdyna+ d=0.01", {"momentum_correction": 0.9}),
                                            ("exdyna+ d=0.001", {"momentum_correction": 0.8})]
    for bad in ("momentum_correction=0.8|0.01:clip_norm=1", "momentum_correction=0.8|d>=x:clip_norm=1",
                "momentum_correction=0.8|d>=0.01"):
        with pytest.raises(ValueError, match="--recipe"):
            fidelity.plan(fidelity.parse_args(["--sparsifiers", "exdyna", "--recipe", bad]))
