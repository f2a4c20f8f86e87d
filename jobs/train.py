#!/usr/bin/env python
"""Data-parallel training with sparse gradient exchange: the job people run.

    mpiexec -n 4 python -m mpi4py jobs/train.py                          # CNN on digits, ExDyna d=0.01
    mpiexec -n 4 python -m mpi4py jobs/train.py --compare dense,exdyna   # same seed, one plot
    mpiexec -n 4 python -m mpi4py jobs/train.py --model big --epochs 1   # >= 10M parameters, synthetic
    mpiexec -n 4 python -m mpi4py jobs/train.py --checkpoint-every 50 --resume   # restartable
    mpiexec -n 4 python -m mpi4py jobs/train.py --compare dense,wagma,local --group-size 2 --sync-every 10

``python -m mpi4py`` (and the hook this script installs) turns an uncaught exception on one rank
into an abort of the whole job, with that rank's traceback, instead of a hang in the next collective.

Each rank trains on its own shard; gradients go through ``exdyna_mpi.adapters.torch.
DistributedOptimizer``. Rank 0 shows a progress bar, one line per epoch and a final table, and writes
``<out>/metrics.jsonl`` (one record per step, per epoch and per run) and ``<out>/train.png``. At the
end every rank's parameters are hashed and compared; the job exits 1 if any rank differs.

Checkpoints (``--checkpoint-every N`` steps, and on SIGUSR1): every rank writes its model,
optimizer + sparsifier state, RNG states, data position and the metrics so far under
``<out>/checkpoints`` (jobs/checkpoint.py). ``--resume`` continues bit-exactly from the last
complete one. After a SIGUSR1 (Slurm's ``--signal=USR1@T``) the job checkpoints at the next step
and exits with status 75 (EX_TEMPFAIL: "requeue me"), see jobs/slurm_train.sbatch.
"""
import argparse
import hashlib
import json
import os
import random
import signal
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

import checkpoint  # jobs/checkpoint.py, jobs/common.py, jobs/models.py: beside this script
import models
from common import abort_on_exception, key_values, set_torch_threads
from exdyna_mpi import available as sparsifier_names
from exdyna_mpi.adapters.torch import DistributedOptimizer, GroupAveragingOptimizer

EX_REQUEUE = 75   # exit status after a checkpoint on SIGUSR1: the job wants to be requeued
# Runs that average models instead of sparsifying gradients (--method, or names in --compare).
MODEL_AVERAGING = ("wagma", "local")


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
    ap.add_argument("--model", choices=sorted(models.MODELS), default="cnn",
                    help="cnn: small CNN on sklearn digits; big: >=10M-parameter MLP on synthetic data")
    ap.add_argument("--width", type=int, default=16, help="model width (CNN channels; MLP hidden = 256*width)")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--max-steps", type=int, default=0, help="stop each epoch after this many steps (0: full epoch)")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--weight-decay", type=float, default=1e-4)
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
    ap.add_argument("--fail-at", default="", metavar="RANK:STEP[:HOW]",
                    help="fault drill: at job step STEP (from 0, over all runs) rank RANK raises an error "
                         "(HOW=raise, default), kills itself with SIGKILL (kill) or sends itself SIGUSR1 (signal)")
    args = ap.parse_args(argv)
    args.fail_at = parse_fail_at(ap, args.fail_at)
    return args


def build_optimizer(name, density, args, model, comm):
    """The distributed optimizer of one run: a sparsifier's DistributedOptimizer, or model averaging."""
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                          weight_decay=args.weight_decay)
    if name == "wagma":
        return GroupAveragingOptimizer(opt, model, group_size=args.group_size, sync_every=args.sync_every,
                                       mode=args.wagma_mode, comm=comm)
    if name == "local":
        return GroupAveragingOptimizer(opt, model, group_size=1, sync_every=args.sync_every, mode="sync", comm=comm)
    extra = key_values(args.opt) if name != "dense" else {}
    if name == "exdyna":   # --deadline-ms / --max-loss: exdyna runs only
        if args.deadline_ms is not None:
            extra["deadline_ms"] = args.deadline_ms if args.deadline_ms == "auto" else float(args.deadline_ms)
        if args.max_loss is not None:
            extra["max_loss"] = args.max_loss
    return DistributedOptimizer(opt, model, sparsifier=name, density=density, comm=comm, **extra)


def parse_fail_at(ap, text):
    if not text:
        return None
    parts = text.split(":")
    how = parts[2] if len(parts) == 3 else "raise"
    try:
        if len(parts) not in (2, 3) or how not in ("raise", "kill", "signal"):
            raise ValueError
        return int(parts[0]), int(parts[1]), how
    except ValueError:
        ap.error(f"--fail-at wants RANK:STEP[:raise|kill|signal], got {text!r}")


def fault_drill(fail_at, rank, step):
    """``--fail-at``: make this rank fail at this job step, the way real jobs fail."""
    if fail_at is None or fail_at[:2] != (rank, step):
        return
    how = fail_at[2]
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "signal":
        os.kill(os.getpid(), signal.SIGUSR1)
    else:
        raise RuntimeError(f"fault drill (--fail-at): rank {rank} fails at step {step} (time {time.time():.3f})")


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


def params_hash(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def shared_state(state):
    """The part of a checkpoint's state every rank holds bit for bit: the current run's parameters
    and buffers, which the gradient exchange keeps identical (runs that average models let them
    differ between averages, so theirs is not compared)."""
    name = state["config"]["runs"][state["run_index"]][0]
    return None if name in MODEL_AVERAGING else state["current"]["model"]


def imbalance_of(stats):
    imb = getattr(stats, "imbalance", None)
    if imb is not None:
        return float(imb)
    counts = np.asarray(stats.counts if stats.counts is not None else [0])
    total = counts.sum()
    return float(counts.max() * len(counts) / total - 1.0) if total else 0.0


class Job:
    """What the whole job shares: the step counter over all runs, the log, checkpoints, stop requests."""

    def __init__(self, args, comm, todo, log_file):
        self.args, self.comm, self.todo, self.log_file = args, comm, todo, log_file
        self.records = []          # everything logged so far (every rank keeps it; rank 0 writes it)
        self.step = 0              # steps completed in the whole job
        self.stop = StopRequest()
        self.config = {"ranks": comm.Get_size(), "runs": [list(r) for r in todo],
                       **{k: getattr(args, k) for k in (
                           "model", "width", "epochs", "batch_size", "max_steps", "lr", "momentum",
                           "weight_decay", "seed", "opt", "group_size", "sync_every", "wagma_mode", "deadline_ms",
                           "max_loss")}}

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


class Run:
    """One training run (one sparsifier, one density) with its per-step records."""

    EXPORTED = ("steps", "epochs", "initial", "numel", "steps_per_epoch", "dense_bytes", "options",
                "summary", "identical", "hash", "wall", "elapsed")

    def __init__(self, name, density, args, comm, job):
        self.name, self.density, self.args, self.comm, self.job = name, density, args, comm, job
        self.log = job.log
        self.label = name if name == "dense" else f"{name} d={density:g}"
        if name in MODEL_AVERAGING:
            self.label = (f"wagma S={args.group_size} T={args.sync_every} {args.wagma_mode}" if name == "wagma"
                          else f"local T={args.sync_every}")
        self.steps, self.epochs = [], []
        self.elapsed = 0.0

    def export(self):
        return {k: getattr(self, k) for k in self.EXPORTED if hasattr(self, k)}

    def restore(self, d):
        for k, v in d.items():
            if k in self.EXPORTED:
                setattr(self, k, v)
        return self

    def train(self, show_progress, runs_done=(), resume=None):
        """Train (from the start, or from ``resume``: the checkpoint's "current" entry)."""
        args, comm, job = self.args, self.comm, self.job
        rank, nranks = comm.Get_rank(), comm.Get_size()
        model, data = models.build(args.model, args.width, args.seed, rank, nranks)
        opt = build_optimizer(self.name, self.density, args, model, comm)
        flat = opt.flat_params if self.name in MODEL_AVERAGING else opt.flat_grad
        numel = flat.numel()
        self.options = dict(getattr(getattr(opt, "sparsifier", None), "options", {}) or {})
        itemsize = flat.element_size()
        # Ring allreduce of the whole gradient: what dense sends per rank and step (same model as
        # exdyna_mpi's byte accounting).
        self.dense_bytes = 2 * (nranks - 1) * numel * itemsize // nranks
        shard = comm.allreduce(data.x_train.shape[0], op=MPI.MIN)
        steps = max(1, shard // args.batch_size)
        if args.max_steps:
            steps = min(steps, args.max_steps)
        self.numel, self.steps_per_epoch = numel, steps
        first_epoch, skip = 0, 0
        if resume is None:
            acc0, loss0 = models.evaluate(model, data, comm)
            self.initial = {"test_acc": acc0, "test_loss": loss0}
        else:
            self.restore(resume)
            model.load_state_dict(resume["model"])
            opt.load_state_dict(resume["opt"])
            first_epoch, skip = resume["epoch"], resume["in_epoch"]
        bar = None
        if show_progress:
            from tqdm import tqdm

            bar = tqdm(total=args.epochs * steps, initial=len(self.steps), desc=self.label, unit="step",
                       dynamic_ncols=True, mininterval=0.5, file=sys.stderr)
        lossf = torch.nn.functional.cross_entropy
        t_start = time.perf_counter() - self.elapsed
        for epoch in range(first_epoch, args.epochs):
            model.train()
            first = len(self.steps) - (skip if epoch == first_epoch else 0)
            for s, (x, y) in enumerate(data.batches(epoch, args.batch_size, steps, args.seed, rank)):
                if epoch == first_epoch and s < skip:
                    continue   # resumed: this batch was trained on before the checkpoint
                fault_drill(args.fail_at, rank, job.step)
                t0 = time.perf_counter()
                opt.zero_grad()
                loss = lossf(model(x), y)
                loss.backward()
                t1 = time.perf_counter()
                opt.step()
                st = opt.stats
                sec = st.seconds or {}
                select = sec.get("select", 0.0)
                local = np.array([loss.item(), st.bytes_sent, st.bytes_received, t1 - t0, select,
                                  sec.get("total", 0.0) - select, float(job.stop.requested)])
                mean = np.empty_like(local)
                comm.Allreduce(local, mean, op=MPI.SUM)
                mean /= nranks
                rec = {"kind": "step", "run": self.label, "sparsifier": self.name, "target": self.density,
                       "step": len(self.steps), "epoch": epoch, "loss": mean[0], "density": float(st.density),
                       "imbalance": imbalance_of(st), "bytes_sent": mean[1], "bytes_received": mean[2],
                       "dense_bytes": self.dense_bytes, "t_compute": mean[3], "t_select": mean[4],
                       "t_exchange": mean[5]}
                self.steps.append(rec)
                self.log(rec)
                job.step += 1
                if bar is not None:
                    bar.set_postfix(loss=f"{mean[0]:.3f}", density=f"{st.density:.4f}", refresh=False)
                    bar.update(1)
                stop = mean[6] > 0   # a SIGUSR1 on any rank: every rank checkpoints here, then leaves
                every = args.checkpoint_every
                if stop or (every and job.step % every == 0):
                    self.elapsed = time.perf_counter() - t_start
                    job.save(runs_done, self, model, opt, epoch, s + 1)
                if stop:
                    if bar is not None:
                        bar.close()
                    if rank == 0:
                        print(f"[{self.label}] SIGUSR1: checkpoint written at job step {job.step} "
                              f"under {checkpoint.folder(args.out)}; exiting with {EX_REQUEUE} (requeue)",
                              flush=True)
                    raise SystemExit(EX_REQUEUE)
            model.eval()
            if self.name in MODEL_AVERAGING:
                opt.synchronize_model()  # evaluate (and end with) one model: the global average
            acc, tloss = models.evaluate(model, data, comm)
            ep = self._epoch_record(epoch, self.steps[first:], acc, tloss, time.perf_counter() - t_start)
            self.epochs.append(ep)
            self.log(ep)
            line = self.epoch_line(ep)
            if bar is not None:
                bar.write(line, file=sys.stderr)
            elif rank == 0:
                print(line, flush=True)
        if bar is not None:
            bar.close()
        if self.name in MODEL_AVERAGING:
            opt.close()
        elif hasattr(opt.sparsifier, "close"):   # the deadline exchange's late messages
            opt.sparsifier.close()
        self.wall = time.perf_counter() - t_start
        digest = params_hash(model)
        hashes = comm.allgather(digest)
        self.identical = all(h == hashes[0] for h in hashes)
        self.hash = digest
        self.summary = self._summary()
        self.log(self.summary)
        return self

    def _epoch_record(self, epoch, recs, acc, tloss, wall):
        def mean(key):
            return float(np.mean([r[key] for r in recs]))

        return {"kind": "epoch", "run": self.label, "sparsifier": self.name, "target": self.density,
                "epoch": epoch, "step": len(self.steps), "train_loss": mean("loss"), "test_acc": acc,
                "test_loss": tloss, "density": mean("density"), "imbalance": mean("imbalance"),
                "bytes_sent": mean("bytes_sent"), "dense_bytes": self.dense_bytes,
                "t_compute": mean("t_compute"), "t_select": mean("t_select"),
                "t_exchange": mean("t_exchange"), "wall": wall}

    def epoch_line(self, ep):
        ratio = ep["bytes_sent"] / self.dense_bytes if self.dense_bytes else float("nan")
        return (f"[{self.label}] epoch {ep['epoch'] + 1}/{self.args.epochs}  loss {ep['train_loss']:.4f}  "
                f"test acc {100 * ep['test_acc']:.2f}%  density {ep['density']:.5f} (target "
                f"{self.density if self.name != 'dense' else 1:g})  imbalance {ep['imbalance']:.3f}  "
                f"sent/step {ep['bytes_sent'] / 1e3:.1f} kB = {100 * ratio:.2f}% of dense  "
                f"ms/step compute {1e3 * ep['t_compute']:.2f} select {1e3 * ep['t_select']:.2f} "
                f"exchange {1e3 * ep['t_exchange']:.2f}")

    def _summary(self):
        recs = self.steps
        last = self.epochs[-1]

        def mean(key):
            return float(np.mean([r[key] for r in recs]))

        sent = mean("bytes_sent")
        return {"kind": "run", "run": self.label, "sparsifier": self.name, "target": self.density,
                "ranks": self.comm.Get_size(), "numel": self.numel, "steps": len(recs), "options": self.options,
                "initial_test_acc": self.initial["test_acc"], "test_acc": last["test_acc"],
                "test_loss": last["test_loss"], "train_loss": last["train_loss"],
                "density": mean("density"), "density_last_epoch": last["density"],
                "imbalance": mean("imbalance"), "bytes_sent_per_step": sent,
                "dense_bytes_per_step": self.dense_bytes,
                "bytes_ratio": sent / self.dense_bytes if self.dense_bytes else None,
                "t_compute": mean("t_compute"), "t_select": mean("t_select"),
                "t_exchange": mean("t_exchange"), "wall": self.wall,
                "params_identical": self.identical, "params_sha256": self.hash}


def summary_table(runs):
    head = ("run", "test acc", "final loss", "density", "imbalance", "kB sent/step", "vs dense",
            "compute ms", "select ms", "exchange ms", "identical")
    rows = []
    for r in runs:
        s = r.summary
        ratio = "n/a" if s["bytes_ratio"] is None else f"{100 * s['bytes_ratio']:.2f}%"
        rows.append((s["run"], f"{100 * s['test_acc']:.2f}%", f"{s['train_loss']:.4f}", f"{s['density']:.5f}",
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
                      [100 * r.initial["test_acc"]] + [100 * e["test_acc"] for e in r.epochs],
                      "o-", color=c, ms=3, label=r.label)
        ax[1, 0].plot(steps, [s["density"] for s in r.steps], color=c, label=f"{r.label} achieved")
        if r.name != "dense" and r.name not in MODEL_AVERAGING:
            ax[1, 0].axhline(r.density, color=c, ls="--", lw=1, label=f"{r.label} target")
        if r.dense_bytes:
            ax[1, 1].plot(steps, [s["bytes_sent"] / r.dense_bytes for s in r.steps], color=c, label=r.label)
    ax[0, 0].set(xlabel="step", ylabel="training loss (mean over ranks)", title="loss")
    ax[0, 1].set(xlabel="step", ylabel="test accuracy (%)", title="test accuracy (end of each epoch)")
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


def main(argv=None):
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    abort_on_exception(comm)
    rank, nranks = comm.Get_rank(), comm.Get_size()
    threads = set_torch_threads(comm, args.threads)
    todo = plan(args)
    job = Job(args, comm, todo, None)
    try:
        passed = []
        ck = (checkpoint.load_latest(comm, args.out, job.config, report=passed, shared=shared_state)
              if args.resume else None)
    except checkpoint.CheckpointError as e:   # the same text on every rank: say it once, all exit 2
        if rank == 0:
            print(f"train.py: --resume refused on all {nranks} ranks: {e}", file=sys.stderr, flush=True)
        return 2
    if ck is not None:
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

    runs = []
    if ck is not None:
        runs = [Run(n, d, args, comm, job).restore(r) for (n, d), r in zip(todo, ck["runs_done"])]
    for i in range(len(runs), len(todo)):
        name, density = todo[i]
        resume = ck["current"] if ck is not None and i == ck["run_index"] else None
        run = Run(name, density, args, comm, job)
        runs.append(run.train(show_progress=rank == 0 and not args.no_progress, runs_done=runs[:i], resume=resume))
    ok = all(r.identical for r in runs)
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
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
