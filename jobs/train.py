#!/usr/bin/env python
"""Data-parallel training with sparse gradient exchange: the job people run.

    mpiexec -n 4 python -m mpi4py jobs/train.py                          # CNN on digits, ExDyna d=0.01
    mpiexec -n 4 python -m mpi4py jobs/train.py --compare dense,exdyna   # same seed, one plot
    mpiexec -n 4 python -m mpi4py jobs/train.py --model big --epochs 1   # >= 10M parameters, synthetic
    mpiexec -n 4 python -m mpi4py jobs/train.py --model lm               # byte-level GPT, AdamW, clipping
    mpiexec -n 4 python -m mpi4py jobs/train.py --checkpoint-every 50 --resume   # restartable
    mpiexec -n 3 python -m mpi4py jobs/train.py --checkpoint-every 50 --resume --reshard   # at another -n
    mpiexec -n 4 python -m mpi4py jobs/train.py --compare dense,wagma,local --group-size 2 --sync-every 10

``python -m mpi4py`` (and the hook this script installs) turns an uncaught exception on one rank
into an abort of the whole job, with that rank's traceback, instead of a hang in the next collective.

Each rank trains on its own shard (``--model lm``: its part of a global batch that does not depend on
the number of ranks, jobs/sampler.py); gradients go through ``exdyna_mpi.adapters.torch.
DistributedOptimizer``. Rank 0 shows a progress bar, one line per epoch and a final table, and writes
``<out>/metrics.jsonl`` (one record per step, per epoch and per run) and ``<out>/train.png``. At the
end every rank's parameters are hashed and compared; the job exits 1 if any rank differs.

Checkpoints (``--checkpoint-every N`` steps, and on SIGUSR1): every rank writes its model,
optimizer + sparsifier state, RNG states, data position and the metrics so far under
``<out>/checkpoints`` (jobs/checkpoint.py). ``--resume`` continues bit-exactly from the last
complete one. After a SIGUSR1 (Slurm's ``--signal=USR1@T``) the job checkpoints at the next step
and exits with status 75 (EX_TEMPFAIL: "requeue me"), see jobs/slurm_train.sbatch. ``--resume
--reshard`` also continues from a checkpoint that another number of ranks wrote: every rank reads
every old rank's file, the parameters and optimizer state carry over exactly and each rank's
error-feedback residual becomes the mean of the old ones (a "reshard" record in the metrics).
"""
import argparse
import json
import os
import random
import signal
import sys

import numpy as np
import torch
from mpi4py import MPI

import checkpoint  # jobs/checkpoint.py, jobs/common.py, jobs/models.py: beside this script
import train_elastic
from common import abort_on_exception, set_torch_threads
from exdyna_mpi import available as sparsifier_names
from train_run import MODEL_AVERAGING, Run
from train_work import WORKS

# Per-model defaults of the flags left unset: the digits CNN and the MLP train with momentum SGD,
# the language model the way transformers train (AdamW, clipping, a small learning rate).
DEFAULTS = {
    "cnn": {"optimizer": "sgd", "lr": 0.1, "weight_decay": 1e-4, "clip": 0.0, "batch_size": 32, "epochs": 30},
    "lm": {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.1, "clip": 1.0, "batch_size": 8, "epochs": 3},
}
DEFAULTS["big"] = DEFAULTS["cnn"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--sparsifier", default="exdyna", help=f"one of {', '.join(sparsifier_names())}")
    ap.add_argument("--compare", default="",
                    help="comma-separated sparsifiers run back to back (overrides --sparsifier)")
    ap.add_argument("--density", type=float, default=0.01, help="target density (fraction of gradient kept)")
    ap.add_argument("--densities", default="", help="comma-separated densities: each sparse run is repeated at each")
    ap.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                    help="sparsifier option, e.g. --opt controller=symmetric (repeatable)")
    ap.add_argument("--deadline-ms", default=None, metavar="MS|auto",
                    help="exdyna: deadline-bounded exchange with a loss bound (docs/deadline.md); default exact")
    ap.add_argument("--max-loss", type=float, default=None,
                    help="exdyna with --deadline-ms: largest deferred fraction of a step's selected mass (0.01)")
    ap.add_argument("--model", choices=sorted(WORKS), default="cnn",
                    help="cnn: small CNN on sklearn digits; big: >=10M-parameter MLP on synthetic data; "
                         "lm: byte-level GPT on the Python standard library's source")
    ap.add_argument("--width", type=int, default=16, help="model width (CNN channels; MLP hidden = 256*width)")
    ap.add_argument("--d-model", type=int, default=128, help="lm: embedding width")
    ap.add_argument("--layers", type=int, default=2, help="lm: transformer blocks")
    ap.add_argument("--heads", type=int, default=4, help="lm: attention heads")
    ap.add_argument("--context", type=int, default=64, help="lm: window length in bytes")
    ap.add_argument("--epochs", type=int, default=None, help="30 (cnn, big); 3 (lm)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="per rank: 32 (cnn, big); lm: 8 windows, the global batch this times the ranks it "
                         "started with")
    ap.add_argument("--max-steps", type=int, default=0,
                    help="stop each epoch after this many steps (0: full epoch; lm: 100 steps)")
    ap.add_argument("--optimizer", choices=("sgd", "adamw"), default=None,
                    help="sgd (cnn, big): momentum SGD; adamw (lm): AdamW with betas (0.9, 0.95)")
    ap.add_argument("--lr", type=float, default=None, help="0.1 (sgd models); 1e-3 (lm)")
    ap.add_argument("--momentum", type=float, default=0.9, help="sgd's momentum")
    ap.add_argument("--weight-decay", type=float, default=None, help="1e-4 (cnn, big); 0.1 (lm)")
    ap.add_argument("--clip", type=float, default=None,
                    help="clip each rank's gradient to this norm before the exchange (0: off); 0 (cnn, big), 1 (lm)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / ranks on this node)")
    ap.add_argument("--out", default="out/train", help="folder for metrics.jsonl and train.png")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--method", choices=("sparse",) + MODEL_AVERAGING, default="sparse",
                    help="sparse: gradient exchange with --sparsifier; wagma: WAGMA-SGD group model "
                         "averaging; local: local SGD (global model average every --sync-every steps). "
                         "--compare also takes wagma and local as names")
    ap.add_argument("--group-size", type=int, default=2, help="wagma: ranks per group (power of two)")
    ap.add_argument("--sync-every", type=int, default=10, help="wagma/local: global average every T steps")
    ap.add_argument("--wagma-mode", choices=("sync", "wait_avoiding"), default="wait_avoiding")
    ap.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                    help="write a checkpoint every N steps under <out>/checkpoints (0: only on SIGUSR1)")
    ap.add_argument("--resume", action="store_true",
                    help="continue from the last complete checkpoint in --out (start fresh if there is none)")
    ap.add_argument("--reshard", action="store_true",
                    help="with --resume: also from a checkpoint written by another number of ranks")
    ap.add_argument("--elastic", action="store_true",
                    help="survive lost ranks: the survivors shrink and go on (Open MPI with ULFM, launched as "
                         "mpiexec --with-ft ulfm --mca pml ob1 --mca btl tcp,self)")
    ap.add_argument("--fail-at", action="append", default=[], metavar="RANK:STEP[:HOW]",
                    help="fault drill: at job step STEP (from 0, over all runs) rank RANK (at launch) raises an "
                         "error (HOW=raise, default), kills itself with SIGKILL (kill), sends itself SIGUSR1 "
                         "(signal), is killed inside the next checkpoint write, after its file (save), or is killed "
                         "after the step's exchange, before its record (exchanged); repeatable")
    args = ap.parse_args(argv)
    args.fail_at = [parse_fail_at(ap, text) for text in args.fail_at if text]
    for k, v in DEFAULTS[args.model].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.reshard and not args.resume:
        ap.error("--reshard goes with --resume")
    return args


def parse_fail_at(ap, text):
    parts = text.split(":")
    how = parts[2] if len(parts) == 3 else "raise"
    try:
        if len(parts) not in (2, 3) or how not in ("raise", "kill", "signal", "save", "exchanged"):
            raise ValueError
        return int(parts[0]), int(parts[1]), how
    except ValueError:
        ap.error(f"--fail-at wants RANK:STEP[:raise|kill|signal|save|exchanged], got {text!r}")


class StopRequest:
    """SIGUSR1 sets the flag; the ranks agree on it in the step's metrics Allreduce."""

    def __init__(self):
        self.requested = False
        try:
            signal.signal(signal.SIGUSR1, self._handler)
        except (ValueError, AttributeError):   # not the main thread, or no SIGUSR1 on this OS
            pass

    def _handler(self, signum, frame):
        self.requested = True


def shared_state(state):
    """The part of a checkpoint's state every rank holds bit for bit: the current run's parameters
    and buffers, which the gradient exchange keeps identical (runs that average models let them
    differ between averages, so theirs is not compared)."""
    name = state["config"]["runs"][state["run_index"]][0]
    return None if name in MODEL_AVERAGING else state["current"]["model"]


class Job:
    """What the whole job shares: the step counter over all runs, the log, checkpoints, stop requests."""

    def __init__(self, args, comm, todo, log_file):
        self.args, self.comm, self.todo, self.log_file = args, comm, todo, log_file
        self.records = []          # everything logged so far (every rank keeps it; rank 0 writes it)
        self.step = 0              # steps completed in the whole job
        self.stop = StopRequest()
        self.launch_rank = comm.Get_rank()   # who a fault drill names; ranks move when some are lost
        # "ranks": the ranks the job started with (a resume takes it from the checkpoint; the lm's
        # global batch is batch_size times it)
        self.config = {"ranks": comm.Get_size(), "runs": [list(r) for r in todo],
                       **{k: getattr(args, k) for k in (
                           "model", "width", "epochs", "batch_size", "max_steps", "optimizer", "lr", "momentum",
                           "weight_decay", "clip", "seed", "opt", "group_size", "sync_every", "wagma_mode",
                           "deadline_ms", "max_loss", "d_model", "layers", "heads", "context")}}

    def log(self, rec):
        self.records.append(rec)
        if self.log_file is not None:
            self.log_file.write(json.dumps(rec, default=str) + "\n")
            self.log_file.flush()

    def save(self, runs_done, current, model, opt, epoch, in_epoch):
        """A checkpoint after job step ``self.step`` (collective)."""
        state = {
            "config": self.config, "job_step": self.step, "records": self.records,
            "runs_done": [r.export() for r in runs_done], "run_index": len(runs_done),
            "current": {**current.export(), "epoch": epoch, "in_epoch": in_epoch,
                        "model": model.state_dict(), "opt": opt.state_dict()},
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        }
        checkpoint.save(self.comm, self.args.out, self.step, state, shared=shared_state)


def summary_table(runs):
    lm = runs[0].args.model == "lm"
    head = ("run", "val loss" if lm else "test acc", "final loss", "density", "imbalance", "kB sent/step", "vs dense",
            "compute ms", "select ms", "exchange ms", "identical")
    rows = []
    for r in runs:
        s = r.summary
        ratio = "n/a" if s["bytes_ratio"] is None else f"{100 * s['bytes_ratio']:.2f}%"
        score = f"{s['val_loss']:.4f}" if lm else f"{100 * s['test_acc']:.2f}%"
        rows.append((s["run"], score, f"{s['train_loss']:.4f}", f"{s['density']:.5f}",
                     f"{s['imbalance']:.3f}", f"{s['bytes_sent_per_step'] / 1e3:.1f}", ratio,
                     f"{1e3 * s['t_compute']:.2f}", f"{1e3 * s['t_select']:.2f}", f"{1e3 * s['t_exchange']:.2f}",
                     "yes" if s["params_identical"] else "NO"))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    fmt = "| " + " | ".join(f"{{:<{w}}}" for w in widths) + " |"
    lines = [fmt.format(*head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += [fmt.format(*row) for row in rows]
    return "\n".join(lines)


def plot(runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, scale, what = (("val_loss", 1, "validation loss (nats/byte)") if runs[0].args.model == "lm"
                        else ("test_acc", 100, "test accuracy (%)"))
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    for i, r in enumerate(runs):
        c = f"C{i}"
        steps = np.array([s["step"] for s in r.steps])
        loss = np.array([s["loss"] for s in r.steps])
        k = max(1, r.steps_per_epoch // 2)
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid") if len(loss) >= k else loss
        ax[0, 0].plot(steps, loss, color=c, alpha=0.2, lw=0.8)
        ax[0, 0].plot(steps[len(steps) - len(smooth):], smooth, color=c, label=r.label)
        ax[0, 1].plot([0] + [e["step"] for e in r.epochs],
                      [scale * r.initial[key]] + [scale * e[key] for e in r.epochs],
                      "o-", color=c, ms=3, label=r.label)
        ax[1, 0].plot(steps, [s["density"] for s in r.steps], color=c, label=f"{r.label} achieved")
        if r.name != "dense" and r.name not in MODEL_AVERAGING:
            ax[1, 0].axhline(r.density, color=c, ls="--", lw=1, label=f"{r.label} target")
        if r.dense_bytes:
            ax[1, 1].plot(steps, [s["bytes_sent"] / r.dense_bytes for s in r.steps], color=c, label=r.label)
    ax[0, 0].set(xlabel="step", ylabel="training loss (mean over ranks)", title="loss")
    ax[0, 1].set(xlabel="step", ylabel=what, title=f"{what.split(' (')[0]} (end of each epoch)")
    ax[1, 0].set(xlabel="step", ylabel="density", yscale="log", title="achieved vs target density")
    ax[1, 1].set(xlabel="step", ylabel="bytes sent / dense allreduce", yscale="log", title="bytes per step vs dense")
    for a in ax.flat:
        a.grid(alpha=0.3)
        if a.lines:
            a.legend(fontsize=7)
    p = runs[0].comm.Get_size()
    fig.suptitle(f"{runs[0].args.model}, {p} ranks, {runs[0].numel:,} parameters, seed {runs[0].args.seed}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plan(args):
    names = [n.strip() for n in args.compare.split(",") if n.strip()] or [
        args.sparsifier if args.method == "sparse" else args.method]
    dens = [float(d) for d in args.densities.split(",") if d.strip()] or [args.density]
    known = list(sparsifier_names()) + list(MODEL_AVERAGING)
    bad = [n for n in names if n not in known]
    if bad:
        raise SystemExit(f"unknown sparsifier(s) {bad}; available: {', '.join(known)}")
    runs = []
    for n in names:
        for d in ([1.0] if n == "dense" or n in MODEL_AVERAGING else dens):
            runs.append((n, d))
    return runs


def resume_state(args, comm, job, passed):
    """``(this rank's checkpoint state or None, every old rank's state or None)``: the second only
    when ``--reshard`` resumes a checkpoint of another number of ranks; this rank's state is then
    old rank ``rank % P_old``'s (its RNG states; everything else is the same on every old rank).
    Collective; raises the same ``CheckpointError`` on every rank."""
    if not args.resume:
        return None, None
    rank, nranks = comm.Get_rank(), comm.Get_size()
    if not args.reshard:
        return checkpoint.load_latest(comm, args.out, job.config, report=passed, shared=shared_state,
                                      ignore=("ranks",)), None
    states = checkpoint.load_all(comm, args.out, job.config, report=passed, shared=shared_state, ignore=("ranks",))
    if states is None:
        return None, None
    ck = states[rank % len(states)]
    if len(states) == nranks:
        return ck, None   # the same number of ranks: the exact resume
    name = ck["config"]["runs"][ck["run_index"]][0]
    if name in MODEL_AVERAGING:
        raise checkpoint.CheckpointError(f"--reshard: the checkpoint is inside a {name} run, whose ranks hold "
                                         "models of their own; it resumes at its own number of ranks only")
    return ck, states


def main(argv=None):
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    abort_on_exception(comm)
    rank, nranks = comm.Get_rank(), comm.Get_size()
    threads = set_torch_threads(comm, args.threads)
    todo = plan(args)
    if args.elastic:   # refused on every rank, before anything is built, where the MPI cannot shrink
        averaging = sorted({n for n, _ in todo if n in MODEL_AVERAGING})
        problems = {p for p in comm.allgather(train_elastic.problem(args, averaging)) if p}
        if problems:
            if rank == 0:
                print(f"train.py: --elastic refused on all {nranks} ranks: {'; '.join(sorted(problems))}",
                      file=sys.stderr, flush=True)
            return 2
    job = Job(args, comm, todo, None)
    try:
        passed = []
        ck, old = resume_state(args, comm, job, passed)
    except checkpoint.CheckpointError as e:   # the same text on every rank: say it once, all exit 2
        if rank == 0:
            print(f"train.py: --resume refused on all {nranks} ranks: {e}", file=sys.stderr, flush=True)
            if not args.reshard and "ranks, this job has" in str(e):
                print("train.py: --resume --reshard continues it at this number of ranks", file=sys.stderr, flush=True)
        return 2
    if ck is not None:
        job.config["ranks"] = ck["config"]["ranks"]   # the ranks the job started with, kept across resumes
        job.records, job.step = list(ck["records"]), ck["job_step"]
        torch.set_rng_state(ck["rng"]["torch"])
        np.random.set_state(ck["rng"]["numpy"])
        random.setstate(ck["rng"]["python"])
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        job.log_file = open(os.path.join(args.out, "metrics.jsonl"), "w")
        for rec in job.records:   # resumed: the metrics so far, as the checkpoint holds them
            job.log_file.write(json.dumps(rec, default=str) + "\n")
        print(f"exdyna_mpi train: model {args.model}, {nranks} ranks x {threads} torch threads, "
              f"runs: {', '.join(n if n == 'dense' or n in MODEL_AVERAGING else f'{n} d={d:g}' for n, d in todo)}",
              flush=True)
        for line in passed:   # the newest generation failed on some rank: say why it was passed over
            print(f"--resume: passed over the checkpoint of {line}", file=sys.stderr, flush=True)
        if args.resume:
            print(f"resumed from job step {job.step} ({checkpoint.folder(args.out)})" if ck is not None
                  else f"--resume: no checkpoint in {checkpoint.folder(args.out)}, starting from the beginning",
                  flush=True)
    if old is not None:
        job.log({"kind": "reshard", "job_step": job.step, "run": todo[ck["run_index"]][0],
                 "step": len(ck["current"]["steps"]), "from_ranks": len(old), "to_ranks": nranks,
                 "start_ranks": job.config["ranks"]})
        if rank == 0:
            print(f"resharded from {len(old)} to {nranks} ranks: parameters and optimizer state as saved, each "
                  f"rank's residual the mean of the {len(old)} old ones", flush=True)

    runs = []
    if ck is not None:
        runs = [Run(n, d, args, comm, job).restore(r) for (n, d), r in zip(todo, ck["runs_done"])]
    reshard = None if old is None else [s["current"] for s in old]   # the old ranks' entries of the run resumed
    del old
    for i in range(len(runs), len(todo)):
        name, density = todo[i]
        resume = ck["current"] if ck is not None and i == ck["run_index"] else None
        run = Run(name, density, args, job.comm, job)   # the survivors' comm once ranks are lost
        runs.append(run.train(show_progress=rank == 0 and not args.no_progress, runs_done=runs[:i], resume=resume,
                              reshard=reshard if resume is not None else None))
        reshard = None
    ok = all(r.identical for r in runs)
    rank, nranks = job.comm.Get_rank(), job.comm.Get_size()
    if rank == 0:
        job.log_file.close()
        print("\n" + summary_table(runs), flush=True)
        if not args.no_plot:
            plot(runs, os.path.join(args.out, "train.png"))
        for r in runs:
            state = "bit-identical" if r.identical else "DIFFERENT"
            opts = " ".join(f"{k}={v}" for k, v in sorted(r.options.items()))
            print(f"[{r.label}] parameters {state} on all {nranks} ranks (sha256 {r.hash[:16]})"
                  + (f"; options {opts}" if opts else ""))
        print(f"wrote {os.path.join(args.out, 'metrics.jsonl')}"
              + ("" if args.no_plot else f" and {os.path.join(args.out, 'train.png')}"), flush=True)
    if job.comm is not comm:   # ranks were lost: see train_elastic.leave
        train_elastic.leave(job.comm, 0 if ok else 1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
