"""One training run of jobs/train.py (one sparsifier at one density): its optimizer, its loop and records.

``Run.train`` builds the run's workload (jobs/train_work.py: model, batches, loss, evaluation) and
optimizer, restores them from a checkpoint's entry when resuming (at another number of ranks too:
``reshard``, every old rank's entry), then trains epoch by epoch. One step is ``Run.step``: the
gradient of this rank's batch, the exchange, and the step's record; the workload (with its sampler)
and the optimizer live on the Run, so a step can be retried after they are rebuilt.

Example::

    run = Run("exdyna", 0.01, args, comm, job)
    run.train(show_progress=False)
    print(run.summary["params_identical"])
"""
import hashlib
import os
import signal
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

import checkpoint
import train_elastic
from common import key_values
from exdyna_mpi import RanksLost
from exdyna_mpi.adapters.torch import DistributedOptimizer, GroupAveragingOptimizer
from train_elastic import guard
from train_work import WORKS

EX_REQUEUE = 75   # exit status after a checkpoint on SIGUSR1: the job wants to be requeued
# Runs that average models instead of sparsifying gradients (--method, or names in --compare).
MODEL_AVERAGING = ("wagma", "local")


def base_optimizer(args, model):
    """The torch optimizer each rank steps with: SGD with momentum, or AdamW with betas (0.9, 0.95)."""
    if args.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)


def build_optimizer(name, density, args, model, comm):
    """The distributed optimizer of one run: a sparsifier's DistributedOptimizer (``--clip`` as its
    ``clip_norm``: each rank's gradient clipped before the exchange), or model averaging."""
    opt = base_optimizer(args, model)
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
    if args.clip:
        extra["clip_norm"] = args.clip
    return DistributedOptimizer(opt, model, sparsifier=name, density=density, comm=comm, elastic=args.elastic,
                                **extra)


def fault_drill(drills, rank, step, exchanged=False):
    """``--fail-at``: make this rank (its rank at launch) fail at this job step, the way real jobs
    fail; ``save``: die inside the next checkpoint write, once this rank's file is written;
    ``exchanged`` (called with ``exchanged=True`` after the step's exchange): die before the step's
    record, the exchange complete here."""
    hows = [how for r, s, how in drills if (r, s) == (rank, step) and (how == "exchanged") == exchanged]
    if not hows:
        return
    how = hows[0]
    if how in ("kill", "exchanged"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "save":
        write = checkpoint._write_encoded

        def written_then_killed(*a, **k):
            write(*a, **k)
            print(f"fault drill (--fail-at): rank {rank} killed inside a checkpoint write at {time.time():.3f}",
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        checkpoint._write_encoded = written_then_killed
    elif how == "signal":
        os.kill(os.getpid(), signal.SIGUSR1)
    else:
        raise RuntimeError(f"fault drill (--fail-at): rank {rank} fails at step {step} (time {time.time():.3f})")


def params_hash(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def imbalance_of(stats):
    imb = getattr(stats, "imbalance", None)
    if imb is not None:
        return float(imb)
    counts = np.asarray(stats.counts if stats.counts is not None else [0])
    total = counts.sum()
    return float(counts.max() * len(counts) / total - 1.0) if total else 0.0


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
        self.work = self.model = self.opt = None
        self.saved_at = -1   # the job step of this run's last checkpoint on this rank

    def export(self):
        return {k: getattr(self, k) for k in self.EXPORTED if hasattr(self, k)}

    def restore(self, d):
        for k, v in d.items():
            if k in self.EXPORTED:
                setattr(self, k, v)
        return self

    def setup(self, resume=None, reshard=None):
        """Build the workload and the optimizer (collective), from the start or from ``resume`` (a
        checkpoint's "current" entry); ``reshard``: every old rank's entry, in rank order, when the
        checkpoint was written by another number of ranks (the optimizer's state is resharded)."""
        args, comm = self.args, self.comm
        nranks = comm.Get_size()
        self.work = WORKS[args.model](args, comm, start_ranks=self.job.config["ranks"])
        self.model = self.work.model
        self.opt = build_optimizer(self.name, self.density, args, self.model, comm)
        # the run's steps before this optimizer was built (an elastic one counts its own from 0)
        self.first_step = len(resume["steps"]) if resume is not None else 0
        flat = self.opt.flat_params if self.name in MODEL_AVERAGING else self.opt.flat_grad
        self.options = dict(getattr(getattr(self.opt, "sparsifier", None), "options", {}) or {})
        if resume is None:
            self.initial = self.work.evaluate(self.model, comm)
        else:
            self.restore(resume)
            self.model.load_state_dict(resume["model"])
            if reshard is None:
                self.opt.load_state_dict(resume["opt"])
            else:
                self.opt.load_state_dict([entry["opt"] for entry in reshard], reshard=True)
        self.numel, self.steps_per_epoch = flat.numel(), self.work.steps_per_epoch
        self.element_size = flat.element_size()
        self.count_dense_bytes(nranks)

    def count_dense_bytes(self, nranks):
        """What a ring allreduce of the whole gradient sends per rank and step at ``nranks`` ranks
        (the same model as exdyna_mpi's byte accounting): the run's dense reference from now on."""
        self.dense_bytes = 2 * (nranks - 1) * self.numel * self.element_size // nranks

    def train(self, show_progress, runs_done=(), resume=None, reshard=None):
        """Train (from the start, or from ``resume``: the checkpoint's "current" entry; ``reshard``
        as for ``setup``). With ``--elastic``, a lost rank's survivors go on (jobs/train_elastic.py)."""
        self.runs_done = runs_done
        self.setup(resume, reshard)
        self.first_epoch, self.first_skip = (0, 0) if resume is None else (resume["epoch"], resume["in_epoch"])
        self.bar = None
        if show_progress:
            from tqdm import tqdm

            self.bar = tqdm(total=self.args.epochs * self.steps_per_epoch, initial=len(self.steps),
                            desc=self.label, unit="step", dynamic_ncols=True, mininterval=0.5, file=sys.stderr)
        self.t_start = time.perf_counter() - self.elapsed
        epoch, done = self.first_epoch, self.first_skip
        if any(e["epoch"] == epoch for e in self.epochs):   # resumed after that epoch's evaluation
            epoch, done = epoch + 1, 0
        while True:
            try:
                self._epochs(epoch, done)
                break
            except RanksLost as lost:
                while lost is not None:   # a checkpoint written again in go_on may lose a rank too
                    try:
                        epoch, done = train_elastic.go_on(self, lost)
                        lost = None
                    except RanksLost as again:
                        lost = again
                if self.bar is not None:
                    self.bar.n = len(self.steps)
        if self.bar is not None:
            self.bar.close()
        self._finish(time.perf_counter() - self.t_start)   # a rank lost here ends the job
        return self

    def _epochs(self, epoch, done):
        """The epochs from step ``done`` of ``epoch`` on, each ended by its evaluation."""
        args, job = self.args, self.job
        for epoch in range(epoch, args.epochs):
            self.model.train()
            for s, x, y, weight in self.work.batches(epoch, done):
                fault_drill(args.fail_at, job.launch_rank, job.step)
                rec, stop = self.step(epoch, x, y, weight)
                if self.bar is not None:
                    self.bar.set_postfix(loss=f"{rec['loss']:.3f}", density=f"{rec['density']:.4f}", refresh=False)
                    self.bar.update(1)
                every = args.checkpoint_every
                if stop or (every and job.step % every == 0):   # stop: a SIGUSR1 on any rank
                    self.save_at(epoch, s + 1)
                if stop:
                    if self.bar is not None:
                        self.bar.close()
                    if self.comm.Get_rank() == 0:
                        print(f"[{self.label}] SIGUSR1: checkpoint written at job step {job.step} "
                              f"under {checkpoint.folder(args.out)}; exiting with {EX_REQUEUE} (requeue)",
                              flush=True)
                    raise SystemExit(EX_REQUEUE)
            done = 0
            self.model.eval()
            if self.name in MODEL_AVERAGING:
                self.opt.synchronize_model()  # evaluate (and end with) one model: the global average
            ev = guard(self, self.work.evaluate, self.model, self.comm)
            ep = self._epoch_record(epoch, [r for r in self.steps if r["epoch"] == epoch], ev,
                                    time.perf_counter() - self.t_start)
            self.epochs.append(ep)
            self.log(ep)
            line = self.epoch_line(ep)
            if self.bar is not None:
                self.bar.write(line, file=sys.stderr)
            elif self.comm.Get_rank() == 0:
                print(line, flush=True)

    def save_at(self, epoch, in_epoch):
        """A checkpoint after this job step (collective; ``in_epoch``: the epoch's steps done)."""
        self.elapsed = time.perf_counter() - self.t_start
        guard(self, self.job.save, self.runs_done, self, self.model, self.opt, epoch, in_epoch)
        self.saved_at = self.job.step

    def step(self, epoch, x, y, weight):
        """One step on this rank's batch ``x, y`` (``weight``: the workload's loss factor): gradient,
        exchange and optimizer step, then the step's record, logged. Collective. Returns ``(record,
        stop)``; ``stop``: some rank got SIGUSR1. Nothing is recorded before the exchange completes."""
        opt, comm, job = self.opt, self.comm, self.job
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = self.work.loss(self.model, x, y, weight)
        if loss.requires_grad:   # a rank without windows (more ranks than the global batch) adds zero
            loss.backward()
        if self.args.clip and self.name in MODEL_AVERAGING:   # sparse runs clip inside (clip_norm)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip)
        t1 = time.perf_counter()
        # what this rank saw of the step, should the exchange complete and its record be lost
        self.pending, self.pending_epoch = [loss.item(), 0.0, 0.0, t1 - t0, 0.0, 0.0, 0.0], epoch
        self.pending_shape = None
        opt.step()
        st = opt.stats
        self.pending_shape = (float(st.density), imbalance_of(st))   # the step's, for its record
        fault_drill(self.args.fail_at, job.launch_rank, job.step, exchanged=True)
        sec = st.seconds or {}
        select = sec.get("select", 0.0)
        local = np.array([loss.item(), st.bytes_sent, st.bytes_received, t1 - t0, select,
                          sec.get("total", 0.0) - select, float(job.stop.requested)])
        self.pending = list(local)
        mean = np.empty_like(local)
        guard(self, comm.Allreduce, local, mean, op=MPI.SUM)
        mean /= comm.Get_size()
        rec = self.step_record(epoch, mean, self.pending_shape)
        self.steps.append(rec)
        self.log(rec)
        job.step += 1
        return rec, mean[6] > 0

    def step_record(self, epoch, mean, shape, **extra):
        """A step's record from the ranks' mean of ``[loss, sent, received, compute, select,
        exchange, ...]`` and the step's ``(density, imbalance)``."""
        return {"kind": "step", "run": self.label, "sparsifier": self.name, "target": self.density,
                "step": len(self.steps), "epoch": epoch, "loss": mean[0], "density": shape[0],
                "imbalance": shape[1], "bytes_sent": mean[1], "bytes_received": mean[2],
                "dense_bytes": self.dense_bytes, "t_compute": mean[3], "t_select": mean[4],
                "t_exchange": mean[5], "ranks": self.comm.Get_size(), **extra}

    def _finish(self, wall):
        opt = self.opt
        if self.name in MODEL_AVERAGING:
            opt.close()
        elif hasattr(opt.sparsifier, "close"):   # the deadline exchange's late messages
            opt.sparsifier.close()
        self.wall = wall
        digest = params_hash(self.model)
        hashes = self.comm.allgather(digest)
        self.identical = all(h == hashes[0] for h in hashes)
        self.hash = digest
        self.summary = self._summary()
        self.log(self.summary)

    def _epoch_record(self, epoch, recs, ev, wall):
        def mean(key):
            return float(np.mean([r[key] for r in recs]))

        return {"kind": "epoch", "run": self.label, "sparsifier": self.name, "target": self.density,
                "epoch": epoch, "step": len(self.steps), "train_loss": mean("loss"), **ev,
                "density": mean("density"), "imbalance": mean("imbalance"),
                "bytes_sent": mean("bytes_sent"), "dense_bytes": self.dense_bytes,
                "t_compute": mean("t_compute"), "t_select": mean("t_select"),
                "t_exchange": mean("t_exchange"), "wall": wall}

    def epoch_line(self, ep):
        ratio = ep["bytes_sent"] / self.dense_bytes if self.dense_bytes else float("nan")
        score = (f"val loss {ep['val_loss']:.4f} nats/byte" if "val_loss" in ep
                 else f"test acc {100 * ep['test_acc']:.2f}%")
        return (f"[{self.label}] epoch {ep['epoch'] + 1}/{self.args.epochs}  loss {ep['train_loss']:.4f}  "
                f"{score}  density {ep['density']:.5f} (target "
                f"{self.density if self.name != 'dense' else 1:g})  imbalance {ep['imbalance']:.3f}  "
                f"sent/step {ep['bytes_sent'] / 1e3:.1f} kB = {100 * ratio:.2f}% of dense  "
                f"ms/step compute {1e3 * ep['t_compute']:.2f} select {1e3 * ep['t_select']:.2f} "
                f"exchange {1e3 * ep['t_exchange']:.2f}")

    def _summary(self):
        recs = self.steps
        last = self.epochs[-1]
        key = self.work.metric[0]
        scores = {f"initial_{key}": self.initial[key], **{k: last[k] for k in self.initial}}

        def mean(k):
            return float(np.mean([r[k] for r in recs]))

        sent = mean("bytes_sent")
        return {"kind": "run", "run": self.label, "sparsifier": self.name, "target": self.density,
                "ranks": self.comm.Get_size(), "numel": self.numel, "steps": len(recs), "options": self.options,
                **scores, "train_loss": last["train_loss"],
                "density": mean("density"), "density_last_epoch": last["density"],
                "imbalance": mean("imbalance"), "bytes_sent_per_step": sent,
                "dense_bytes_per_step": self.dense_bytes,
                "bytes_ratio": sent / self.dense_bytes if self.dense_bytes else None,
                "t_compute": mean("t_compute"), "t_select": mean("t_select"),
                "t_exchange": mean("t_exchange"), "wall": self.wall,
                "params_identical": self.identical, "params_sha256": self.hash}
