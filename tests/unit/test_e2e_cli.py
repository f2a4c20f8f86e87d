"""jobs/e2e.py end to end on a tiny model: every method's record, the target from ddp, explicit targets,
the report rebuilt from JSON lines; and jobs/run_e2e.sh on the testbed (wire bytes, nothing left behind).
"""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="PyTorch is not installed")
pytest.importorskip("matplotlib", reason="matplotlib is not installed")

from tests.launch import MPIEXEC, ROOT, child_env  # noqa: E402

JOB = os.path.join(ROOT, "jobs", "e2e.py")
TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--context", "16", "--batch", "4", "--val-windows", "64"]
ALL = ["ddp", "ddp-powersgd", "ddp-bf16", "dense", "exdyna", "topk", "oktopk", "micro", "exdyna-q",
       "exdyna-deadline", "wagma", "exdyna-bf16", "dense-bf16", "exdyna-mc", "exdyna-q02", "exdyna-dw",
       "exdyna-mcq", "exdyna-plain", "exdyna-mcq02", "ddp-bv", "ddp-accum", "diloco-h16", "ddp-exdyna"]
#: the methods' arithmetic as before the AdamW protocol: momentum SGD, constant rate, no clipping
SGD = ["--optimizer", "sgd", "--lr", "0.05", "--clip", "0", "--schedule", "constant", "--lr-warmup", "20"]
REQUIRED = {"method", "ranks", "rate_mbit", "params", "steps", "step_s", "comm_share", "bytes_per_step",
            "final_loss", "time_to_target_s"}


def e2e(out, *args, n=2, timeout=300):
    if MPIEXEC is None:
        pytest.skip("no mpiexec on PATH")
    cmd = ["timeout", "-k", "5", str(timeout), MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", JOB,
           *TINY, "--out", str(out), *args]
    p = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout + 20)
    assert p.returncode == 0, f"rc {p.returncode}\n" + p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads(line) for line in (out / "e2e.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def every_method(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "out"
    # ddp listed last: it still runs first, since its final loss is the target of the others
    methods = ALL[1:] + ALL[:1]
    return out, e2e(out, *SGD, "--steps", "3", "--max-steps", "3", "--eval-every", "1", "--warmup", "1",
                    "--accum", "1", "--methods", ",".join(methods))


def test_every_method_writes_a_record(every_method):
    out, recs = every_method
    assert recs[0]["kind"] == "setup" and recs[0]["ranks"] == 2 and recs[0]["params"] > 0
    assert recs[0]["compute_s"] > 0 and recs[0]["allreduce_s"] > 0
    assert isinstance(recs[0]["cpu"], str) and recs[0]["cpu"]   # last bits depend on the CPU model
    runs = [r for r in recs if r["kind"] == "run"]
    assert [r["method"] for r in runs] == ALL + ["ddp"]                   # ddp first and last
    assert [r["pass"] for r in runs] == [1] * len(ALL) + [2]
    for r in runs:
        assert REQUIRED <= set(r), (r["method"], REQUIRED - set(r))
        assert r["steps"] == 3 and r["steps_run"] == 3 and r["ranks"] == 2, r
        assert [e[0] for e in r["evals"]] == [0, 1, 2, 3], r["method"]
        assert all(math.isfinite(e[2]) for e in r["evals"]), r["method"]
        assert r["params_identical"], r["method"]
        assert r["step_s"] > 0 and 0 <= r["comm_share"] < 1
        assert r["evals"][0][2] == runs[0]["evals"][0][2]        # same initial weights everywhere
        assert r["method_spec"]["name"] == r["method"] and r["resolved"]["entry"], r["method"]


def test_each_record_carries_the_method_s_row_and_what_its_entry_point_resolved(every_method):
    """``method_spec``: the method's row of the table; ``resolved``: the options the harness passed (the
    recipe's from the run's arguments) and, for the library's entry points, the configuration they
    resolved; torch's own methods have none."""
    _, recs = every_method
    runs = {r["method"]: r for r in recs if r["kind"] == "run"}
    mc = runs["exdyna-mc"]
    assert mc["method_spec"]["recipe"] == "momentum-correction" and mc["method_spec"]["kind"] == "library"
    assert mc["resolved"]["options"] == {"max_imbalance": None, "momentum_correction": 0.9}
    assert mc["resolved"]["optimizer_momentum"] == 0.0       # the recipe moved SGD's momentum
    assert mc["resolved"]["config"]["recipe.momentum_correction"] == "0.9"
    assert mc["resolved"]["sparsifier_options"]["max_imbalance"] is None
    # the default's "auto" resolves to momentum correction with the 0.2 quotas: exdyna-mcq02's options
    auto = runs["exdyna"]["resolved"]
    assert auto["config"]["recipe.momentum_correction"] == "0.9" and auto["sparsifier_options"]["max_imbalance"] == 0.2
    assert runs["exdyna-dw"]["resolved"]["options"]["density_warmup_steps"] == 1   # an eighth of 3 steps, at least 1
    assert runs["ddp-exdyna"]["resolved"]["config"]["scope"] == "model"
    assert runs["ddp"]["resolved"] == {"entry": "DistributedDataParallel", "optimizer_momentum": None, "config": None,
                                       "options": {"gradient_as_bucket_view": False}}
    assert runs["ddp-bv"]["method_spec"]["same_arithmetic"] == "ddp"


def test_the_hook_trains_as_the_optimizer(every_method):
    """``ddp-exdyna`` (DDP + the hook with ``optimizer=``) runs ``exdyna``'s recipe: the same losses,
    to the last bit, under momentum SGD (the recipe moves the momentum before the exchange)."""
    _, recs = every_method
    runs = {r["method"]: r for r in recs if r["kind"] == "run"}
    losses = {m: [(e[0], e[2]) for e in runs[m]["evals"]] for m in ("ddp-exdyna", "exdyna", "ddp")}
    assert losses["ddp-exdyna"] == losses["exdyna"] != losses["ddp"]


def test_the_target_is_ddps_final_loss(every_method):
    _, recs = every_method
    setup, runs = recs[0], {r["method"]: r for r in recs if r["kind"] == "run"}
    ddp = runs["ddp"]
    assert setup["target"] == ddp["target"] == ddp["loss_at_steps"] == ddp["final_loss"]
    assert ddp["time_to_target_s"] == ddp["evals"][-1][1]
    for r in runs.values():
        reached = [e[1] for e in r["evals"] if e[2] <= setup["target"]]
        assert r["time_to_target_s"] == (reached[0] if reached else None), r["method"]


def test_averages_agree_with_ddp(every_method):
    """The library's dense average and DDP's allreduce are the same SGD: the same losses to float
    tolerance; the bf16 hook rounds the values it sends, so it stays close but not equal."""
    _, recs = every_method
    runs = {r["method"]: r for r in recs if r["kind"] == "run"}
    for a, b in zip(runs["ddp"]["evals"], runs["dense"]["evals"]):
        assert abs(a[2] - b[2]) < 1e-4, (a, b)
    for a, b in zip(runs["ddp"]["evals"], runs["ddp-bf16"]["evals"]):
        assert abs(a[2] - b[2]) < 2e-2, (a, b)
    for a, b in zip(runs["ddp"]["evals"], runs["dense-bf16"]["evals"]):   # 16-bit values, error feedback
        assert abs(a[2] - b[2]) < 2e-2, (a, b)
    # the default momentum_correction="auto" moves the SGD's 0.9 before the exchange and adds the 0.2
    # quotas: exdyna-mcq02's bits
    curve = {m: [(e[0], e[2]) for e in runs[m]["evals"]] for m in ("exdyna", "exdyna-mcq02", "exdyna-plain")}
    assert curve["exdyna"] == curve["exdyna-mcq02"] and curve["exdyna-plain"] != curve["exdyna"]
    # fewer bytes than the dense average for every sparse method (model counts off the testbed)
    for m in ("exdyna", "topk", "oktopk", "micro", "exdyna-q", "exdyna-bf16", "exdyna-mc", "exdyna-q02",
              "exdyna-mcq", "exdyna-plain", "exdyna-mcq02"):
        assert runs[m]["bytes_per_step"] < runs["dense"]["bytes_per_step"], m
        assert runs[m]["density"] == 0.01 and runs[m]["phase_s"]["total"] > 0


def test_report_rebuilds_table_and_plots(every_method, tmp_path):
    out, recs = every_method
    for name in ("e2e.md", "e2e_loss.png", "e2e_ttt.png"):
        assert (out / name).stat().st_size > 0, name
    table = (out / "e2e.md").read_text()
    for m in ALL:
        assert f"| {m} |" in table
    p = subprocess.run([sys.executable, JOB, "--report", str(out / "e2e.jsonl"), "--out", str(tmp_path)],
                       cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert (tmp_path / "e2e.md").read_text() == table
    assert (tmp_path / "e2e_ttt.png").stat().st_size > 0


def test_explicit_targets(tmp_path):
    """A target met at step 0 still trains the whole budget (loss_at_steps is recorded) and stops there;
    one never met runs to --max-steps and records null."""
    easy = e2e(tmp_path / "easy", "--steps", "2", "--max-steps", "6", "--eval-every", "1", "--target", "100",
               "--methods", "exdyna")
    run = easy[-1]
    assert run["target"] == 100 and run["time_to_target_s"] == 0.0 and run["steps_run"] == 2
    hard = e2e(tmp_path / "hard", "--steps", "2", "--max-steps", "6", "--eval-every", "2", "--target", "0",
               "--methods", "topk", "--workload", "cnn")
    run = hard[-1]
    assert run["time_to_target_s"] is None and run["steps_run"] == 6
    assert [e[0] for e in run["evals"]] == [0, 2, 4, 6] and run["loss_at_steps"] == run["evals"][1][2]
    assert len(run["evals"][0]) == 4 and 0 <= run["evals"][-1][3] <= 1      # the CNN's accuracy beside its loss


def test_cnn_methods_see_the_same_batches(tmp_path):
    """Each method starts the data order from step 0 (the set-up measurement and earlier methods
    draw batches too): ddp and the library's dense average, the same SGD, give the same losses."""
    recs = e2e(tmp_path, "--workload", "cnn", "--steps", "4", "--eval-every", "2", "--methods", "ddp,dense")
    runs = {r["method"]: r for r in recs if r["kind"] == "run"}
    assert [e[0] for e in runs["ddp"]["evals"]] == [0, 2, 4]
    for a, b in zip(runs["ddp"]["evals"], runs["dense"]["evals"]):
        assert abs(a[2] - b[2]) < 1e-4 and abs(a[3] - b[3]) < 1e-2, (a, b)


def test_an_error_ends_the_job_with_its_traceback(tmp_path):
    """A rank that raises after torch.distributed is up (which installs its own excepthook) aborts
    the job, and the traceback reaches the output."""
    if MPIEXEC is None:
        pytest.skip("no mpiexec on PATH")
    cmd = ["timeout", "-k", "5", "120", MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", JOB, *TINY,
           "--methods", "exdyna", "--density", "2.0", "--steps", "2", "--out", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=140)
    assert p.returncode not in (0, 124), p.returncode          # failed, and not by the timeout
    assert "Traceback" in p.stderr and "density" in p.stderr, p.stderr[-2000:]


def _testbed_why_not():
    spec = importlib.util.spec_from_file_location("exdyna_jobs_testbed_e2e", os.path.join(ROOT, "jobs", "testbed.py"))
    tb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tb)
    try:
        tb.require_privilege()
    except tb.TestbedError as e:
        return str(e)
    return None


def test_run_e2e_on_the_testbed(tmp_path):
    """bash jobs/run_e2e.sh at 2 ranks: a link record, wire bytes from the namespaces' interfaces,
    the rate in every record, and the testbed removed afterwards."""
    why = _testbed_why_not()
    if why:
        pytest.skip(f"testbed unavailable: {why}")
    out = tmp_path / "tb"
    env = child_env({"EXDYNA_TESTBED_PREFIX": "xdyt", "NP": "2"})
    p = subprocess.run(["timeout", "-k", "5", "300", "bash", os.path.join(ROOT, "jobs", "run_e2e.sh"), "--rate", "1000",
                        "--out", str(out), *TINY, "--steps", "3", "--eval-every", "1", "--warmup", "1",
                        "--methods", "ddp,exdyna"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=330)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = [json.loads(line) for line in (out / "e2e.jsonl").read_text().splitlines()]
    assert recs[0]["kind"] == "link" and recs[0]["set_mbit"] == 1000 and len(recs[0]["measured_mbit"]) == 2
    runs = [r for r in recs if r["kind"] == "run"]
    assert [r["method"] for r in runs] == ["ddp", "exdyna", "ddp"]          # ddp first and last
    for r in runs:
        assert r["rate_mbit"] == 1000 and r["bytes_source"] == "wire" and r["params_identical"]
    # ddp sends its whole gradient; exdyna at d=0.01 a small part of it (both counted on the wire)
    assert runs[1]["bytes_per_step"] < runs[0]["bytes_per_step"]
    assert runs[0]["bytes_per_step"] >= 4 * recs[1]["params"] / 2
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "xdyt-" not in left


def test_choose_lrs_joins_a_grid_widened_in_another_launch(tmp_path):
    """``--choose-lrs``: a method's grid spread over two launches is chosen as one (its edge flag
    follows the widened grid); another method's records in the same file are left out unless named,
    and a named method without records is refused."""
    def tune(method, lr, loss):
        return {"kind": "tune", "workload": "lm", "method": method, "lr": lr, "seed": 100, "steps": 50,
                "loss_at_steps": loss}

    first, later = tmp_path / "first.jsonl", tmp_path / "later.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in
                             [tune("sloco-h4", 1e-3, 2.0), tune("sloco-h4", 2e-3, 1.9), tune("sloco-h4", 4e-3, 1.8),
                              tune("sloco-h8", 1e-3, 2.1), tune("sloco-h8", 2e-3, 2.0), tune("sloco-h8", 4e-3, 2.2)]))
    later.write_text(json.dumps(tune("sloco-h4", 8e-3, 1.85)) + "\n")

    def choose(*args):
        return subprocess.run([sys.executable, JOB, "--choose-lrs", str(first), str(later), *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)

    p = choose("--methods", "sloco-h4", "--out", str(tmp_path / "h4"))
    assert p.returncode == 0, p.stderr
    tuned = json.loads((tmp_path / "h4" / "tuned.json").read_text())
    assert tuned["lr_of"] == {"sloco-h4": 4e-3} and tuned["grid"] == [1e-3, 2e-3, 4e-3, 8e-3]
    assert tuned["edge"] == {"sloco-h4": False} and tuned["steps"] == 50
    # both methods: their grids differ in size, which the protocol refuses
    p = choose("--methods", "sloco-h4,sloco-h8", "--out", str(tmp_path / "both"))
    assert p.returncode == 1 and "same size" in p.stderr and "Traceback" not in p.stderr
    p = choose("--methods", "sloco-h16", "--out", str(tmp_path / "none"))
    assert p.returncode != 0 and "no tune records of ['sloco-h16']" in p.stderr


def test_library_diloco_methods_take_outer_steps(tmp_path):
    """The library's DiLoCo in the harness: 16 inner steps, then the outer step; the dense one close
    to torchft's recipe (``diloco-h16``, gloo's allreduce) after it, ranks identical, the sparse
    one's bytes per step those of one outer step over 16; SparseLoCo's recipe (``sloco-h16``) sends
    the same and steps otherwise; ``sloco-h4`` and ``diloco-h4`` take four outer steps in the same 16
    batches, about four times the bytes of their H = 16 versions."""
    recs = e2e(tmp_path, *SGD, "--steps", "16", "--max-steps", "16", "--eval-every", "16", "--warmup", "1",
               "--density", "0.05", "--methods", "ddp,diloco-h16,diloco-dense-h16,diloco-exdyna-h16,"
               "diloco-exdyna-bf16-h16,sloco-h16,sloco-h4,diloco-h4")
    runs = {r["method"]: r for r in recs if r["kind"] == "run"}
    for m in ("diloco-dense-h16", "diloco-exdyna-h16", "diloco-exdyna-bf16-h16", "sloco-h16", "sloco-h4", "diloco-h4"):
        assert runs[m]["params_identical"] and runs[m]["steps_run"] == 16, m
        assert runs[m]["evals"][-1][2] != runs[m]["evals"][0][2], m
    assert abs(runs["diloco-dense-h16"]["evals"][-1][2] - runs["diloco-h16"]["evals"][-1][2]) < 1e-4
    assert runs["diloco-exdyna-h16"]["density"] == 0.05 and runs["diloco-dense-h16"]["density"] is None
    sparse, half = runs["diloco-exdyna-h16"]["bytes_per_step"], runs["diloco-exdyna-bf16-h16"]["bytes_per_step"]
    assert 0 < half < sparse < runs["diloco-dense-h16"]["bytes_per_step"]
    # SparseLoCo's outer step (plain SGD at lr 1) is not the Nesterov one (0.7 x 1.9 the first delta)
    assert runs["sloco-h16"]["bytes_per_step"] == sparse
    assert runs["sloco-h16"]["evals"][-1][2] != runs["diloco-exdyna-h16"]["evals"][-1][2]
    # H is what the name says: four outer steps of about the same size in place of one
    for short, long in (("sloco-h4", "sloco-h16"), ("diloco-h4", "diloco-h16")):
        assert 3 < runs[short]["bytes_per_step"] / runs[long]["bytes_per_step"] < 5, short
        assert runs[short]["evals"][-1][2] != runs[long]["evals"][-1][2], short


def test_adam_paths_train_with_adamw(tmp_path):
    """The harness's Adam paths (``DistributedOptimizer(adam=...)``) under the AdamW protocol: each
    trains, every rank holds the same parameters, and the paths differ from each other and from
    ``adam="live"``; the library's default for AdamW (``exdyna``) is ``adam="demo-age"`` at AdamW's
    ``betas[0]`` with float8 values (``exdyna-demoage-fp8``), to the bit, and not float32 values'
    ``exdyna-demoage``; the DDP hook gives ``DistributedOptimizer``'s losses,
    by default (``ddp-exdyna``, clipping inside) and with ``adam="demo"`` named; ``"demo"``
    gathering its means (``exdyna-demo999-mean``) trains to the same bits with more bytes; an Adam
    path under SGD is refused."""
    recs = e2e(tmp_path, "--optimizer", "adamw", "--lr", "2e-3", "--steps", "4", "--max-steps", "4",
               "--eval-every", "4", "--warmup", "1", "--density", "0.05",
               "--methods", "ddp,exdyna,exdyna-live,exdyna-adam-u,exdyna-demo,exdyna-demo999,ddp-exdyna-demo999,"
               "ddp-exdyna,exdyna-demo999-mean,exdyna-demoage,exdyna-demoage-fp8")
    runs = {r["method"]: r for r in recs if r["kind"] == "run"}
    finals = set()
    for m in ("exdyna-live", "exdyna-adam-u", "exdyna-demo", "exdyna-demo999", "exdyna-demoage"):
        assert runs[m]["params_identical"] and runs[m]["steps_run"] == 4, m
        assert runs[m]["evals"][-1][2] < runs[m]["evals"][0][2], m
        finals.add(runs[m]["evals"][-1][2])
    assert len(finals) == 5
    assert [e[2] for e in runs["exdyna"]["evals"]] == [e[2] for e in runs["exdyna-demoage-fp8"]["evals"]]
    assert runs["exdyna"]["evals"][-1][2] != runs["exdyna-demoage"]["evals"][-1][2]
    assert runs["exdyna"]["bytes_per_step"] < runs["exdyna-demoage"]["bytes_per_step"]
    # the DDP hook's Adam path trains as DistributedOptimizer's: the same losses to the last bit
    assert runs["ddp-exdyna-demo999"]["evals"] and runs["ddp-exdyna-demo999"]["params_identical"]
    assert [e[2] for e in runs["ddp-exdyna-demo999"]["evals"]] == [e[2] for e in runs["exdyna-demo999"]["evals"]]
    assert runs["ddp-exdyna"]["params_identical"]
    assert [e[2] for e in runs["ddp-exdyna"]["evals"]] == [e[2] for e in runs["exdyna"]["evals"]]
    mean, signs = runs["exdyna-demo999-mean"], runs["exdyna-demo999"]
    assert [e[2] for e in mean["evals"]] == [e[2] for e in signs["evals"]]
    assert mean["bytes_per_step"] > 1.3 * signs["bytes_per_step"], (mean["bytes_per_step"], signs["bytes_per_step"])
    with pytest.raises(AssertionError, match="are Adam paths"):
        e2e(tmp_path / "sgd", *SGD, "--steps", "2", "--methods", "ddp,exdyna-demo")


def test_fsdp_methods_train_sharded(tmp_path):
    """FSDP2 in the harness (``fully_shard`` on the block and the root, over gloo): its dense
    reduce-scatter averages as DDP's allreduce does (the same AdamW steps to float tolerance: only
    the summation order differs), its bf16 one stays close, and the library's sparse one
    (``ShardedExchange``) trains its own way; each record hashes the gathered parameters, the same on
    every rank, and counts the gathers and the reduce-scatters of its units."""
    recs = e2e(tmp_path, "--optimizer", "adamw", "--lr", "2e-3", "--steps", "4", "--max-steps", "4",
               "--eval-every", "2", "--warmup", "1", "--density", "0.05",
               "--methods", "ddp,fsdp,fsdp-bf16,fsdp-exdyna")
    runs = {r["method"]: r for r in recs if r["kind"] == "run"}
    for m in ("fsdp", "fsdp-bf16", "fsdp-exdyna"):
        assert runs[m]["params_identical"] and runs[m]["steps_run"] == 4, m
        assert runs[m]["evals"][-1][2] < runs[m]["evals"][0][2], m
    for a, b in zip(runs["ddp"]["evals"], runs["fsdp"]["evals"]):
        assert abs(a[2] - b[2]) < 1e-4, (a, b)
    for a, b in zip(runs["ddp"]["evals"], runs["fsdp-bf16"]["evals"]):
        assert abs(a[2] - b[2]) < 2e-2, (a, b)
    assert abs(runs["fsdp-exdyna"]["evals"][-1][2] - runs["fsdp"]["evals"][-1][2]) > 1e-4
    assert runs["fsdp-exdyna"]["density"] == 0.05 and runs["fsdp"]["density"] is None
    # TINY has one block: its parameters gathered twice, the root's once; a reduce-scatter per unit
    assert runs["fsdp"]["collectives_per_step"] == 2 * 1 + 1 + 2
    assert runs["fsdp-exdyna"]["collectives_per_step"] == 2 * 1 + 1 + 4 * 2
    assert runs["fsdp-exdyna"]["resolved"]["entry"] == "ShardedExchange"
    assert runs["fsdp-exdyna"]["resolved"]["options"]["units"] == 2
