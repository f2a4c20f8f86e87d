#!/usr/bin/env python
"""Time to accuracy across communication methods, each at its own tuned learning rate, on one model.

    bash jobs/run_e2e.sh --no-testbed --tune-lrs 1e-3,2e-3,4e-3 --seed 100 --out out/tune   # the search
    bash jobs/run_e2e.sh --rate 1000 --tuned out/tune/tuned.json --seed 1 --out out/e2e      # a held-out seed
    srun python -m mpi4py jobs/e2e.py --tuned tuned.json --seed 1          # a cluster's real network
    python jobs/e2e.py --report out/e2e --docs docs/e2e.md --readme README.md   # tables, plots, pages
    python jobs/e2e.py --choose-lrs out/tune out/tune_8e-3 --methods M --out out/tuned  # a widened grid

The protocol (docs/e2e.md): every method is searched over the same learning-rate grid on tuning seeds
(``--tune-lrs``: each method at each rate for ``--steps``, the lowest validation loss at the budget,
mean over the file's tuning seeds, goes to ``DIR/tuned.json``); timed runs take those rates
(``--tuned``, which refuses a method it has no rate for) on other seeds. A grid widened at its edge in
a later launch is chosen from both launches' records by ``--choose-lrs``. Every method trains with the
same optimiser (``--optimizer``), clipping (``--clip``: ``clip_grad_norm_`` over the model's
parameters before every optimiser step, as a user's loop does it) and schedule (``--lr-warmup``
batches of linear warm-up, then ``--schedule`` constant or cosine to a tenth at ``--steps``).
A method that trades batches for bytes (local steps) may get a longer budget of its own
(``--steps-of sloco-h16=2400``: its schedule ends there), tuned at that budget; the target stays
DDP's loss at ``--steps``.

Workloads (offline, no downloads):
- ``lm`` (default): a GPT-style byte-level transformer (jobs/models.py ``GPT``, default d_model 128,
  4 layers, 2 heads, context 64: 834,304 parameters) on the Python standard library's source, split
  by file into train and validation (``models.stdlib_corpus``), AdamW (betas 0.9, 0.95, weight decay
  0.1), clipping at 1.0, cosine, 600 batches of 8 sequences per rank; the metric is the validation
  loss (nats per byte) on ``--val-windows`` 512 held-out windows (32,768 predictions). The setup
  record carries count-based unigram, bigram and interpolated trigram losses on the same predictions
  (jobs/ngram.py): a target above the trigram's measures the warm-up, not training.
- ``cnn``: the digits CNN at width 48 (141k parameters), SGD with momentum 0.9, no clipping, 264
  batches of 32 per rank (24 epochs at P=4: at 8, DDP's test loss still falls by half and every
  sparsifier is still in its transient); the metric is the test cross-entropy (accuracy beside).

Methods (``--methods``, run one after another in one launch, ``ddp`` first and, unless
``--no-ddp-last``, again last so that drift within the launch shows):
- ``ddp``: torch ``DistributedDataParallel`` over gloo, default buckets (25 MB, the first 1 MB),
  its allreduce overlapped with backward; ``ddp-bv``: the same with ``gradient_as_bucket_view=True``
  (the same arithmetic, one copy fewer); ``ddp-accum``: gradient accumulation, ``--accum`` batches per
  optimiser step under ``no_sync`` but the last (the budget counts batches, so it sees the same data).
- ``ddp-powersgd``: DDP with torch's ``powerSGD_hook``, rank 4, error feedback and warm start (the
  defaults), ``start_powerSGD_iter`` = a tenth of the steps (torch's advice: vanilla allreduce for
  the first part of training), and ONE bucket (``bucket_cap_mb`` above the model's size). On gloo
  the hook issues its second allreduce (of Q) from the completion callback of the first (of P);
  with several buckets those callbacks race the next buckets' hooks, the ranks issue gloo
  collectives in different orders, and gloo aborts ("Received data size doesn't match expected
  size") or hangs (0.5 MB buckets on 3 ranks).
- ``ddp-bf16``: DDP with torch's ``bf16_compress_hook`` (values cast to bfloat16 for the allreduce).
- ``diloco-h4``, ``-h8``, ``-h16``, ``-h64``: DiLoCo as torchft runs it: H local steps of the run's optimiser
  (no communication), then the pseudo-gradient (global minus local parameters) averaged in one dense
  float32 allreduce and applied to the global parameters by Nesterov SGD (lr 0.7, momentum 0.9);
  the global parameters are what is evaluated. ``diloco-exdyna-h16``/``-h64`` (``-bf16-h16``: 16-bit
  values) and ``diloco-dense-h16``: the library's ``DiLoCo`` with the delta exchanged by ExDyna at
  ``--density`` (error feedback) or densely, the same outer Nesterov SGD. ``sloco-h16``: SparseLoCo's
  recipe on the library's ``DiLoCo`` (its default for a sparse exchange, spelt out): ExDyna on the
  delta, the residual decayed by 0.95 after each outer step (``error_decay``), a plain outer SGD at
  lr 1 in place of Nesterov momentum;
  ``sloco-ef-h16``: the same without the decay; ``sloco-h4``, ``-h8``, ``-h64``: the recipe with 4, 8, 64 inner steps;
  ``sloco-bf16-h16``: with 16-bit values.
- ``dense``, ``exdyna``, ``topk``, ``oktopk``, ``micro``: ``exdyna_mpi.adapters.torch.
  DistributedOptimizer`` with that sparsifier at ``--density`` (the library's defaults for the
  optimiser given), the exchange after backward; ``exdyna-q``: ExDyna with ``max_imbalance=0.05``
  (no momentum correction); ``exdyna-bf16`` and ``dense-bf16``: float32 gradients, values sent in
  bfloat16 (``wire_dtype="bfloat16"``, error feedback keeps the rounding); the SGD recipe's parts,
  one at a time (each with ``momentum_correction=0`` but ``exdyna-mc``): ``exdyna-mc`` (momentum
  correction with the run's momentum, DGC's masking), ``exdyna-q02`` (``max_imbalance=0.2``),
  ``exdyna-dw`` (density warm-up 25 %, 6.25 %, 1.5625 %, each stage an eighth of ``--steps``);
  ``exdyna-mcq``: momentum correction and ``max_imbalance=0.05`` (``exdyna-mcq02``: 0.2);
  ``exdyna-plain``: no momentum correction and no quotas. ``exdyna-mc``/``-mcq``/``-mcq02`` move
  SGD's momentum and run with ``--optimizer sgd`` only. ``exdyna-adam``: ``adam="frozen"``
  (``--adam-warmup`` dense Adam steps, then the second moment frozen, the gradient divided by it
  before ExDyna's selection and error feedback); ``exdyna-adam-g``: ``adam="frozen-gradient"`` (the
  division after the exchange); ``exdyna-adam-u``: ``adam="update"`` (Adam's moments on each rank,
  its update exchanged by ExDyna with error feedback, the average applied); ``dense-adam-u``: the
  same update averaged densely (what the per-rank moments cost without sparsity);
  ``exdyna-demo``: ``adam="demo"`` (DeMo's decoupled momentum: the residual as the momentum, decayed
  by beta1 = 0.9, ``lr * sign`` of the average applied); ``exdyna-demo99``/``-demo999``: the same with
  beta1 = 0.99/0.999; ``exdyna-demo999-ov``: ``-demo999`` with ``overlap=True`` (each exchange on a
  worker thread while the next gradient is computed, its update applied one step late);
  ``exdyna-demo999-mean``: ``-demo999`` gathering the 32-bit means rather than their signs
  (``output="mean"``: the same losses, more bytes); ``exdyna-demo999-bf16``: ``-demo999`` with
  its values summed in bfloat16 (``wire_dtype="bfloat16"``, the rounding kept in the momentum; signs
  gathered as by default); ``exdyna-demoage``/``-demoage999``: ``adam="demo-age"`` at beta1 = 0.9/0.999
  (each sign scaled by the root of the steps since the coordinate last moved), ``exdyna-demoage999-bf16``
  the same with bfloat16 values, ``exdyna-demoage999-int8`` with 8-bit values (``wire_dtype="int8"``,
  a float32 scale per block of 128, the rounding kept in the momentum), ``exdyna-demoage999-fp8``
  with float8 e4m3fn values (``wire_dtype="float8_e4m3fn"``, the same layout), ``exdyna-demoage-fp8``
  ``-demoage`` with them; all sixteen with ``--optimizer adamw`` only.
  ``exdyna`` is the library's default, which for AdamW is ``adam="demo-age"`` since 2026-11-29, with
  float8 values since 2026-12-02 (``adam="demo"`` from 2026-11-28, ``adam="live"`` before: records
  of ``exdyna`` on the LM made earlier measured those);
  ``exdyna-live``: ``adam="live"`` by name.
- ``ddp-exdyna``: DDP (default buckets) with the library's hook, ``exdyna_hook`` and
  ``ExDynaHookState("exdyna", density, optimizer=opt)``: one sparsifier over the whole model, exchanged
  on the hook's worker thread once the last bucket is ready, inside the same training recipe as
  ``exdyna`` (under SGD its momentum moved before the exchange, under AdamW ``adam="demo"``, both
  entry points' default since 2026-11-28, ``"live"`` in the hook before), clipping each rank's
  gradient before the exchange (``clip_norm=``) as ``exdyna``'s loop does; ``ddp-exdyna-bucket``:
  ``scope="bucket"``, a plain sparsifier per bucket, each exchanged as soon as its bucket is ready
  (overlapping backward); ``ddp-exdyna-demo999``: the model-scope hook with ``adam="demo"`` at
  beta1 = 0.999 (``exdyna-demo999`` through DDP: the same losses, AdamW only).
- ``wagma``: WAGMA-SGD's group averaging (groups of 2, wait-avoiding, a global average every 10).

Timing: a step is forward, backward and the optimiser step with its exchange; evaluation is not
timed. ``step_s`` is the median over steps after ``--warmup`` of the slowest rank's step, per batch.
``compute_s`` (a step with no communication, all ranks at once) is measured before every method's
run, ``allreduce_s`` (gloo's allreduce of the model's float32 gradient) once; ``comm_compute_ratio`` =
allreduce_s / compute_s, and each method's ``comm_share`` = 1 - compute_s / step_s (the exposed
communication). Bytes per step are the wire bytes each rank's interface sent
(``EXDYNA_TESTBED_IFACE``, set by the testbed), else the library's count (``bytes_source``).

Target: ``--target``, else the validation loss ``ddp`` reaches at the end of ``--steps``. Every method
trains ``--steps``; one that has not reached the target by then goes on, at the same evaluation
cadence, up to ``--max-steps`` and stops at the first evaluation at or below it.
``time_to_target_s`` is the training time (slowest rank) at that evaluation, null if never.

Rank 0 writes ``DIR/e2e.jsonl`` (a ``setup`` record, then a ``run`` record per method, which carries
the method's row of the method table as ``method_spec`` and what its entry point was given and
resolved as ``resolved``; with ``--tune-lrs`` a ``tune`` record per method and rate and a ``tuned``
record), ``DIR/e2e.md`` (the table), ``DIR/e2e_summary.md`` (over seeds), ``DIR/e2e_loss.png``,
``DIR/e2e_ttt.png`` and ``DIR/e2e_regime.png`` (speed-up against link rate: the alpha-beta model and
the measured points).
The modules beside this one: jobs/e2e_methods.py (the method table, ``METHODS``), jobs/e2e_build.py
(a method built from its row), jobs/e2e_workloads.py, jobs/e2e_train.py (the training loop and the
timing); jobs/e2e_records.py reads the records back, jobs/e2e_report.py renders them.
"""
import argparse
import datetime
import json
import os
import platform
import socket
import sys

from e2e_methods import DEFAULT_METHODS, METHODS, REFERENCE
from e2e_report import report, table
from e2e_train import init_torch_distributed, measure_compute, measure_setup, train
from e2e_workloads import WORKLOADS


def _density(text):
    """``text`` as a density in (0, 1], else None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0.0 < value <= 1.0 else None


def _method_values(ap, flag, items, methods, expected, parse):
    """``{method: value}`` from ``flag``'s ``METHOD=VALUE`` items; ``parse`` gives None for a bad value.
    An item whose method is not launched, or whose value is bad, is refused (argparse's exit 2)."""
    values = {}
    for item in items:
        method, _, text = item.partition("=")
        value = parse(text)
        if method not in methods or value is None:
            ap.error(f"{flag} {item}: expected {expected} and METHOD one of --methods")
        values[method] = value
    return values


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="lm")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help=f"comma-separated, of {', '.join(METHODS)} (default: {', '.join(DEFAULT_METHODS)})")
    ap.add_argument("--ranks", type=int, help="checked against the MPI world's size")
    ap.add_argument("--rate", type=float, help="link rate for the records (default: EXDYNA_TESTBED_RATE_MBIT)")
    ap.add_argument("--steps", type=int, help="budget in batches per rank (lm 600, cnn 264: 24 epochs at P=4)")
    ap.add_argument("--max-steps", type=int, help="batches a method may run to reach the target (default 2 x steps)")
    ap.add_argument("--steps-of", dest="steps_of_items", action="append", default=[], metavar="METHOD=N",
                    help="another budget for one method (repeatable): its schedule ends at N batches, it trains N "
                         "(to --max-steps for the target); local-step methods trade batches for bytes")
    ap.add_argument("--stop-at-target", action="store_true",
                    help="end each run when it reaches the target (else it trains its whole budget): times to "
                         "target only, no loss at the budget for the runs that stop early")
    ap.add_argument("--density-of", dest="density_of_items", action="append", default=[], metavar="METHOD=D",
                    help="another --density for one method (repeatable): each at the density it was tuned at")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--target", type=float, help="validation loss to reach (default: ddp's at --steps)")
    ap.add_argument("--batch", type=int, help="per-rank batch (lm 8 sequences, cnn 32 images)")
    ap.add_argument("--optimizer", choices=("adamw", "sgd"),
                    help="lm: adamw (betas 0.9, 0.95), cnn: sgd (with --momentum)")
    ap.add_argument("--lr", type=float, help="learning rate of every method without a tuned one (lm 1e-3, cnn 0.1)")
    ap.add_argument("--tuned", metavar="JSON", action="append",
                    help="per-method learning rates chosen by --tune-lrs (tuned.json; repeatable, a later file's "
                         "rate wins); each must have been tuned at the method's budget")
    ap.add_argument("--tune-lrs", metavar="LR,LR,...",
                    help="tune instead: every method at each learning rate for --steps, no target; writes tune "
                         "records and DIR/tuned.json (the lowest loss at the budget, mean over the file's seeds)")
    ap.add_argument("--clip", type=float, help="clip_grad_norm_ before every optimiser step (lm 1.0, cnn off; 0: off)")
    ap.add_argument("--schedule", choices=("constant", "cosine"), help="after the warm-up (lm cosine, cnn constant)")
    ap.add_argument("--momentum", type=float)
    ap.add_argument("--adam-warmup", type=int,
                    help="exdyna-adam/-adam-g: dense Adam steps before the variance freezes (default: --lr-warmup)")
    ap.add_argument("--lr-warmup", type=int, help="batches of linear learning-rate warm-up (lm 30, cnn 0)")
    ap.add_argument("--weight-decay", type=float)
    ap.add_argument("--accum", type=int, default=4, help="ddp-accum: batches accumulated per optimiser step")
    ap.add_argument("--no-ddp-last", dest="ddp_last", action="store_false",
                    help="do not run ddp again after the other methods (drift check)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=0, help="batches between evaluations (default steps/10)")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of step_s")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / ranks on the node)")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--val-windows", type=int, default=512, help="lm: held-out windows of --context predictions")
    ap.add_argument("--out", default="out/e2e")
    ap.add_argument("--report", nargs="+", metavar="JSONL_OR_DIR", help="rebuild table and plots, no MPI")
    ap.add_argument("--docs", metavar="MD", help="with --report: also write this results page (and --readme's table)")
    ap.add_argument("--readme", metavar="MD", help="with --docs: README whose e2e-results block is regenerated")
    ap.add_argument("--choose-lrs", nargs="+", metavar="JSONL_OR_DIR",
                    help="write OUT/tuned.json: each of --methods' rate chosen from its tune records in these "
                         "files (one grid spread over launches, e.g. an edge widened later); no MPI")
    ap.add_argument("--curves-from", nargs="+", metavar="JSONL_OR_DIR", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        ap.error(f"unknown methods {bad}; choose from {', '.join(METHODS)}")
    args.methods = sorted(methods, key=lambda m: m != REFERENCE)      # ddp first: it sets the target
    for k, v in WORKLOADS[args.workload].defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    wrong = [m for m in args.methods if METHODS[m].optimizer not in (None, args.optimizer)]
    if wrong:   # each needs the other optimiser
        needs = METHODS[wrong[0]].optimizer
        why = "move SGD's momentum" if needs == "sgd" else "are Adam paths"
        ap.error(f"{wrong} {why}; they run with --optimizer {needs} only")
    if args.adam_warmup is None:
        args.adam_warmup = max(1, args.lr_warmup)
    args.clip = args.clip or None
    if args.accum < 1:
        ap.error("--accum must be >= 1")
    args.max_steps = max(args.steps, args.max_steps or 2 * args.steps)
    if args.rate is None and os.environ.get("EXDYNA_TESTBED_RATE_MBIT"):
        args.rate = float(os.environ["EXDYNA_TESTBED_RATE_MBIT"])
    args.grid = [float(x) for x in args.tune_lrs.split(",")] if args.tune_lrs else None
    args.steps_of = _method_values(ap, "--steps-of", args.steps_of_items, args.methods, "METHOD=N with N >= 1",
                                   lambda n: int(n) if n.isdigit() and int(n) >= 1 else None)
    args.density_of = _method_values(ap, "--density-of", args.density_of_items, args.methods,
                                     "METHOD=D with 0 < D <= 1", _density)
    if args.steps_of and args.grid:
        ap.error("--steps-of with --tune-lrs: tune a method at another budget with --steps in its own launch")
    args.lr_of, chosen = {}, {}
    for path in args.tuned or []:
        with open(path) as f:
            tuned = json.load(f)
        if tuned.get("workload") != args.workload:
            ap.error(f"--tuned {path} is for workload {tuned.get('workload')!r}, not {args.workload!r}")
        for m, v in tuned["lr_of"].items():
            args.lr_of[m], chosen[m] = float(v), (path, tuned.get("steps"))
    for m, (path, steps) in chosen.items():
        budget = args.steps_of.get(m, args.steps)
        if m in args.methods and steps not in (None, budget):
            # a rate tuned for one schedule length is not the best for another (the cosine's pace)
            ap.error(f"--tuned {path} chose {m}'s rate at {steps} batches; it runs {budget} here: tune it at "
                     f"that budget")
    if args.tuned:
        for m, twin in ((s.name, s.same_arithmetic) for s in METHODS.values() if s.same_arithmetic):
            if twin not in args.lr_of:
                continue
            if m in args.methods and args.steps_of.get(m, args.steps) != args.steps_of.get(twin, args.steps):
                ap.error(f"{m} takes {twin}'s tuned rate: give both the same budget (--steps-of)")
            args.lr_of.setdefault(m, args.lr_of[twin])
        untuned = [m for m in args.methods if m not in args.lr_of]
        if untuned:
            ap.error(f"--tuned {', '.join(args.tuned)} has no learning rate for {untuned}: tune them first")
    return args


def choose(paths, methods, workload, out):
    """``OUT/tuned.json`` from tune records spread over several launches (a grid widened at its edge
    in a launch of its own): the records of ``methods`` only, held to the protocol by
    :func:`e2e_records.choose_lrs` (the same grid size, seeds and budget for each). Returns its table."""
    import common
    from e2e_records import choose_lrs, read_records, source_labels
    from e2e_report import tuning_table

    records = [r for r in read_records(paths) if r.get("kind") == "tune" and r.get("method") in methods]
    missing = [m for m in methods if m not in {r["method"] for r in records}]
    if missing:
        raise SystemExit(f"e2e: no tune records of {missing} in {', '.join(paths)}")
    try:
        tuned = choose_lrs(records, workload)
    except ValueError as e:
        raise SystemExit(f"e2e: {e}") from None
    common.write_json(os.path.join(out, "tuned.json"), tuned)
    return tuning_table(tuned, source_labels(records))


def main(argv=None):
    args = parse_args(argv)
    if args.choose_lrs:
        print(choose(args.choose_lrs, args.methods, args.workload, args.out))
        return 0
    if args.report:
        if args.curves_from:
            raise SystemExit("e2e: --curves-from is gone: composed times are not part of the protocol")
        print(report(args.report, args.out))
        if args.docs:
            from e2e_records import read_records
            from e2e_report import write_docs

            write_docs(read_records(args.report), args.docs, readme=args.readme, header=DOCS_HEADER)
        return 0
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import common

    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), comm.Get_size()
    if args.ranks is not None and args.ranks != P:
        raise SystemExit(f"e2e: --ranks {args.ranks} but the MPI world has {P} ranks")
    # Ranks per host by host name: on the testbed MPICH runs with MPIR_CVAR_NOLOCAL=1 and sees every
    # rank as alone on its node, so a shared-memory split would give each rank all the cores.
    host = socket.gethostname()
    threads = args.threads or max(1, common.cores() // comm.allgather(host).count(host))
    torch.set_num_threads(threads)
    init_torch_distributed(comm)
    # After init_process_group, which replaces sys.excepthook with one that buffers the old hook's
    # output to prefix it with the rank: installed before it, an abort would drop the traceback.
    common.abort_on_exception(comm)
    wl = WORKLOADS[args.workload](args, rank, P)
    torch.manual_seed(args.seed)
    numel = sum(p.numel() for p in wl.model().parameters())

    def log(msg):
        if rank == 0:
            common.log("e2e", msg)

    compute_s, allreduce_s = measure_setup(wl, args, comm, numel)
    target = args.target
    launch = comm.bcast(f"{datetime.datetime.now():%Y%m%dT%H%M%S}-{args.workload}-s{args.seed}-r{args.rate}"
                        if rank == 0 else None)
    setup = {"kind": "setup", "launch": launch, "workload": args.workload, "ranks": P, "rate_mbit": args.rate,
             "params": numel, "compute_s": compute_s, "allreduce_s": allreduce_s,
             "comm_compute_ratio": allreduce_s / compute_s, "batch": args.batch, "steps": args.steps,
             "max_steps": args.max_steps, "optimizer": args.optimizer, "lr": args.lr, "lr_of": args.lr_of,
             "tuned_from": ", ".join(args.tuned) if args.tuned else None,
             "steps_of": args.steps_of, "density_of": args.density_of, "stop_at_target": args.stop_at_target,
             "clip": args.clip, "schedule": args.schedule, "momentum": args.momentum,
             "weight_decay": args.weight_decay, "lr_warmup": args.lr_warmup, "accum": args.accum,
             "density": args.density, "seed": args.seed, "target": target, "methods": args.methods,
             "tune_grid": args.grid, "threads_per_rank": threads, "torch": torch.__version__,
             "mpi": common.mpi_library(), "host": platform.node(), "cores": common.cores(),
             "cpu": common.cpu_model(), "date": datetime.date.today().isoformat(), "command": common.command(),
             **wl.info}
    log(f"{args.workload}: {numel:,} parameters, P={P}, rate {args.rate} Mbit/s: compute {compute_s:.3f} s/step, "
        f"dense allreduce {allreduce_s:.3f} s (ratio {allreduce_s / compute_s:.2f})")
    path = os.path.join(args.out, "e2e.jsonl")
    if args.grid:
        if rank == 0:
            common.append_json_line(path, setup)
        return tune(args, wl, comm, numel, setup, path, log)
    plan = [(m, 1) for m in args.methods]
    if args.ddp_last and REFERENCE in args.methods and len(args.methods) > 1:
        plan.append((REFERENCE, 2))             # DDP first and last: drift within the launch shows
    runs = []
    for method, npass in plan:
        method_compute = measure_compute(wl, args, comm)
        rec = train(METHODS[method], wl, args, comm, numel, target, log)
        rec.update({"launch": launch, "pass": npass, "compute_s": method_compute,
                    "comm_share": max(0.0, 1.0 - method_compute / rec["step_s"])})
        if method == REFERENCE and target is None:
            target = setup["target"] = rec["target"] = rec["loss_at_steps"]
            hit = next(e for e in rec["evals"] if e[2] <= target)
            rec["time_to_target_s"], rec["steps_to_target"] = hit[1], hit[0]
        runs.append(rec)
        if rank == 0:
            if len(runs) == 1:         # after the first run, so that it carries ddp's target
                common.append_json_line(path, setup)
            common.append_json_line(path, rec)
        log(f"{method}: step {rec['step_s']:.3f} s, comm share {rec['comm_share']:.2f}, "
            f"time to target {rec['time_to_target_s']}, identical {rec['params_identical']}")
        comm.Barrier()
    if rank == 0:
        print(table(setup, runs))
        report([path], args.out)
    dist.destroy_process_group()
    return 0


def tune(args, wl, comm, numel, setup, path, log):
    """The learning-rate search: every method at every grid value for ``--steps`` (no target), a ``tune``
    record each; then ``choose_lrs`` over every tune record of the file and workload (so tuning seeds
    run as separate launches add up), written as a ``tuned`` record and ``DIR/tuned.json``."""
    import torch.distributed as dist

    import common
    from e2e_records import choose_lrs, read_records

    for method in args.methods:
        for lr in args.grid:
            args.lr_of = dict(args.lr_of, **{method: lr})
            rec = train(METHODS[method], wl, args, comm, numel, None, log)
            tune_rec = {"kind": "tune", "launch": setup["launch"], "workload": args.workload, "method": method,
                        "lr": lr, "seed": args.seed, "steps": args.steps, "loss_at_steps": rec["loss_at_steps"],
                        "final_loss": rec["final_loss"], "step_s": rec["step_s"], "evals": rec["evals"],
                        "params_identical": rec["params_identical"], "diverged": rec["diverged"],
                        "method_spec": rec["method_spec"], "resolved": rec["resolved"]}
            if comm.Get_rank() == 0:
                common.append_json_line(path, tune_rec)
            log(f"tune {method} lr {lr:g}: loss at {args.steps} {rec['loss_at_steps']}")
    if comm.Get_rank() == 0:
        try:
            tuned = choose_lrs(read_records([path]), args.workload)
        except ValueError as e:     # a short grid: this launch widens another's (--choose-lrs joins them)
            log(f"no tuned.json: {e}; join these tune records with the rest of the grid: --choose-lrs")
        else:
            common.append_json_line(path, tuned)
            common.write_json(os.path.join(args.out, "tuned.json"), tuned)
            log(f"tuned: {tuned['lr_of']}")
    dist.destroy_process_group()
    return 0


#: the static part of the results page that ``--report ... --docs`` writes above the generated tables
DOCS_HEADER = """# Time to accuracy on a shaped network

The question users ask of a compressor: does my model, trained the way I train it, reach its target
sooner on my network than with what I already run? `jobs/e2e.py` answers it on one model, from the
same initial weights, on the same batches, with the same optimiser, clipping and schedule for every
method, and every method at its own tuned learning rate. `jobs/testbed.py` gives it a real network
on one machine. This page is generated from the records (`python jobs/e2e.py --report RECORDS --docs
docs/e2e.md --readme README.md`); a withdrawn protocol (momentum SGD without clipping, untuned
baselines) is recorded in `results/e2e/2026-11-25-sgd-protocol.md`.

```bash
bash jobs/run_e2e.sh --no-testbed --tune-lrs 1e-3,2e-3,4e-3 --seed 100 --out out/tune  # the search
bash jobs/run_e2e.sh --rate 1000 --tuned out/tune/tuned.json --seed 1 --out out/e2e     # held-out seed
bash jobs/run_e2e.sh --workload cnn --no-testbed --tune-lrs 0.025,0.05,0.1,0.2,0.4 --seed 100 --out out/cnn_tune
bash jobs/run_e2e.sh --workload cnn --rate 20 --tuned out/cnn_tune/tuned.json --seed 1 --out out/cnn
```

## The protocol

- **Tuning.** Every method searches the same learning-rate grid (LM: three values a factor 2
  apart; CNN: five) at the full step budget on a tuning seed (100), without link shaping (the loss after a given step
  does not depend on the link); the lowest validation loss at the budget wins (`tuned.json`, the
  `tune` and `tuned` records). Timed runs use other seeds (1, 2, 3). `ddp-bv` takes DDP's rate: the
  two compute the same bits (tested).
- **The LM as GPT users train it.** AdamW (betas 0.9, 0.95, weight decay 0.1), `clip_grad_norm_(...,
  1.0)` before every optimiser step for every method, 30 batches of linear warm-up, then a cosine to
  a tenth at the budget (600 batches of 8 sequences of 64 bytes per rank, P = 4). Model: the
  GPT-style byte-level transformer at d_model 128, 4 layers, 2 heads (834,304 parameters). The
  target is DDP's validation loss at the budget, on 512 held-out windows (32,768 predictions); the
  setup record carries a count-based interpolated trigram of the same split on the same predictions
  (the floor: a target above it measures the warm-up), and the tables say where the target lies.
- **Why a small model, and why 200 Mbit/s.** On these two cores the 10.8M-parameter GPT needs
  about 0.57 s a step and several hundred steps to pass the trigram; the search and three seeds
  would take days. What decides the outcome is the communication/compute ratio (gloo's dense
  allreduce seconds over the compute seconds of one step without communication; each table's
  setup records it). Small matrices run at a lower FLOP rate on a CPU, so this model's ratio at a
  given link rate is lower than the 10.8M model's; the links were set to 200 Mbit/s, where this
  model's ratio on the AMD EPYC VM (1.12) matched the 10.8M model's at 1 Gbit/s (0.95, 2026-11-25).
  On the Intel Xeon VM, whose compute is faster, it is 3.2–3.3 at 200 Mbit/s: a more link-bound
  regime than 1 Gbit/s, which favours the compressed methods against DDP. The LM's tables below
  are the 2026-11-29 launches at 200 Mbit/s, three held-out seeds, every method in each launch
  (`results/e2e/2026-11-29-regimes.md`, which also holds launches at 700 Mbit/s, ratio 1.8: latency
  keeps the allreduce from scaling with the rate). The slow end (20 and 2 Mbit/s) was timed without
  DDP, whose 600 batches take about 22 minutes at 20 Mbit/s here; those launches, against DDP's loss
  on the same seed, are in that narrative and in `docs/results.md`.
- **The CNN as CNNs are trained.** The digits CNN at width 48 (141,066 parameters), momentum SGD
  (0.9, weight decay 1e-4, no clipping, constant learning rate), 264 batches of 32 per rank at P = 4
  (24 epochs). The target is DDP's test cross-entropy at the budget on the 360 held-out images
  (accuracy beside in the records). At 8 epochs DDP's test loss is still falling by half and every
  sparsifier is in its transient (ExDyna 0.27 against DDP's 0.05 on the tuning seed:
  `results/e2e/2026-11-26-cnn-8-epochs/`), so the budget is 24 epochs. 360 images make
  the test loss near 0.05 noisy (one image moves it by several per cent), so the spread over
  seeds is wide: on the Intel VM `exdyna` reaches the target on seeds 1 and 2, on the AMD VM on
  seed 2 only, with the same rates and batches (the CPUs' last bits differ). Links at 20, 200 and
  2000 Mbit/s put its communication/compute ratio near 21, 2 and 0.55 on the Intel VM (8, 0.8 and
  0.08 on the AMD VM, whose convolutions are slower): the slow, middle and fast ends, every one
  measured.
- **Each budget its own search.** A method on a schedule of its own is tuned at that length, so
  the learning-rate tables come one per budget. `sloco-h16`'s choice (4e-3) lies at its grid's edge
  there; 8e-3 at 2,400 batches ends at 1.9503 against 4e-3's 1.7152
  (`results/e2e/2026-11-29-regimes/tune_sloco_8e-3`), so the choice stands.
- **Reading the tables.** "not reached": the method did not reach DDP's loss within 1.5x the budget
  (LM 900 batches, CNN 396); its loss at the budget, beside, says how far it was. Ratios above 1 are sooner than
  DDP. The learning-rate table marks a choice at the grid's edge, where a wider grid might help.
- **A budget of its own.** Local-step methods (DiLoCo, SparseLoCo's recipe) trade batches for
  bytes: they need more batches than DDP to reach its loss, each far cheaper on a slow link.
  `--steps-of METHOD=N` gives such a method its own schedule (the cosine ends at N) in the same
  launch, `--density-of METHOD=D` its own density; its rate is tuned at that budget (`--tuned`
  refuses a rate chosen at another), the target stays DDP's loss at DDP's budget, and the tables
  name the budget beside the method. Its loss at its budget is not comparable with DDP's; its time
  to target is. `--stop-at-target` ends each run at the target (no loss at the budget then).
- **Baselines as their documentation advises.** DDP with its default buckets and with
  `gradient_as_bucket_view=True`; DDP with gradient accumulation (4 batches per optimiser step, the
  budget counted in batches); torch's `bf16_compress_hook`; torch's `powerSGD_hook` (rank 4, error
  feedback and warm start, `start_powerSGD_iter` a tenth of the budget, one bucket: with several
  buckets it aborts or hangs on gloo); DiLoCo (H = 16 and 64 local AdamW steps, then the averaged
  parameter delta applied by Nesterov SGD, lr 0.7, momentum 0.9, as in the DiLoCo paper and
  torchft; the global parameters are evaluated). `exdyna` is `DistributedOptimizer(SGD,
  sparsifier="exdyna", density=0.01)` on the CNN with the library's defaults for momentum SGD
  (momentum correction and quotas). On the LM, `exdyna-demoage999` is `DistributedOptimizer(AdamW,
  sparsifier="exdyna", density=0.05)` with the AdamW default `adam="demo-age"` and `betas[0]` 0.999
  (the value the docs advise for it), on a 1,200-batch schedule of its own, with float32 values on
  the wire (`-fp8`: float8 e4m3fn values, the default since 2026-12-02); `diloco-h64` is
  torchft's dense DiLoCo and `sloco-h16` the library's `DiLoCo("exdyna", density=0.03)`, each on
  2,400 batches of its own.
- **Measured, not composed.** Every time to target is a full run at the rate shown; each CNN
  launch runs DDP first and last (`ddp (again)`) and its ratios are taken against the mean of the
  two; the LM's launches run DDP once, first (`--no-ddp-last`). Ratios are always taken within a
  launch, and every run records `compute_s` (a step without communication, measured just before
  it) so drift is visible.
- **The link's bucket.** tbf lets what its bucket holds cross at the veth's speed after an idle
  moment, which a real link never does, so the testbed's bucket is 2 KiB, or a quarter millisecond
  of the rate where that is more (`testbed.burst_bytes`; the links record it). A 256 KiB bucket let
  256 KiB of each rank's exchange a step cross unshaped (0.1 s of link time at 20 Mbit/s; the dense
  allreduce probe at 20 Mbit/s took 2.10 s against 2.44 s), flattering most a few hundred kB a step
  on little compute (`adam="demo"` at 20 Mbit/s needed 1.9x its time once re-measured); a 16 KiB
  one let a 15 kB exchange (ExDyna's on the CNN) cross in 0.4 ms instead of 6. The CNN's tables
  are launches of 2026-11-28 on the Intel Xeon VM, 2 KiB at 20 Mbit/s and 16 KiB at 200 and 2000
  (at 200 Mbit/s a 45 kB exchange gained 0.5 ms of a 30 ms step; at 2000 the bucket is the quarter
  millisecond either way; `results/e2e/2026-11-28-rebucket.md`); the LM's ran on 2026-11-29 with a
  6.1 KiB bucket (a quarter millisecond) at 200 Mbit/s.

Machine: the 2-core Intel Xeon VM (every launch below; the LM's search on seed 100 partly on a
2-core AMD EPYC VM, as its records' `cpu` says), no GPU, Python 3.11, torch 2.13.0 (CPU), MPICH 5.0.2 wheel,
gloo for torch.distributed; 4 ranks on 2 cores, one torch thread each; every rank in its own network
namespace behind a `tc tbf`-shaped veth (no added delay).
"""


if __name__ == "__main__":
    sys.exit(main())
