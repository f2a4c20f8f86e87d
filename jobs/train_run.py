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
from exdyna_mpi.adapters.torch import DistributedOptimizer, GroupAveragingOptimizer
from common import key_values
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
    return DistributedOptimizer(opt, model, sparsifier=name, density=density, comm=comm, **extra)


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
        # Ring allreduce of the whole gradient: what dense sends per rank and step (same model as
        # exdyna_mpi's byte accounting), at the number of ranks the run goes on with.
        self.numel, self.steps_per_epoch = flat.numel(), self.work.steps_per_epoch
        self.dense_bytes = 2 * (nranks - 1) * self.numel * flat.element_size() // nranks

    def train(self, show_progress, runs_done=(), resume=None, reshard=None):
        """Train (from the start, or from ``resume``: the checkpoint's "current" entry; ``reshard``
        as for ``setup``)."""
        args, comm, job = self.args, self.comm, self.job
        rank = comm.Get_rank()
        self.setup(resume, reshard)
        first_epoch, skip = (0, 0) if resume is None else (resume["epoch"], resume["in_epoch"])
        bar = None
        if show_progress:
            from tqdm import tqdm

            bar = tqdm(total=args.epochs * self.steps_per_epoch, initial=len(self.steps), desc=self.label,
                       unit="step", dynamic_ncols=True, mininterval=0.5, file=sys.stderr)
        t_start = time.perf_counter() - self.elapsed
        for epoch in range(first_epoch, args.epochs):
            self.model.train()
            done = skip if epoch == first_epoch else 0
            first = len(self.steps) - done
            for s, x, y, weight in self.work.batches(epoch, done):
                fault_drill(args.fail_at, rank, job.step)
                rec, stop = self.step(epoch, x, y, weight)
                if bar is not None:
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", density=f"{rec['density']:.4f}", refresh=False)
                    bar.update(1)
                every = args.checkpoint_every
                if stop or (every and job.step % every == 0):   # stop: a SIGUSR1 on any rank
                    self.elapsed = time.perf_counter() - t_start
                    job.save(runs_done, self, self.model, self.opt, epoch, s + 1)
                if stop:
                    if bar is not None:
                        bar.close()
                    if rank == 0:
                        print(f"[{self.label}] SIGUSR1: checkpoint written at job step {job.step} "
                              f"under {checkpoint.folder(args.out)}; exiting with {EX_REQUEUE} (requeue)",
                              flush=True)
                    raise SystemExit(EX_REQUEUE)
            self.model.eval()
            if self.name in MODEL_AVERAGING:
                self.opt.synchronize_model()  # evaluate (and end with) one model: the global average
            ev = self.work.evaluate(self.model, comm)
            ep = self._epoch_record(epoch, self.steps[first:], ev, time.perf_counter() - t_start)
            self.epochs.append(ep)
            self.log(ep)
            line = self.epoch_line(ep)
            if bar is not None:
                bar.write(line, file=sys.stderr)
            elif rank == 0:
                print(line, flush=True)
        if bar is not None:
            bar.close()
        self._finish(time.perf_counter() - t_start)
        return self

    def step(self, epoch, x, y, weight):
        """One step on this rank's batch ``x, y`` (``weight``: the workload's loss factor): gradient,
        exchange and optimizer step, then the step's record, logged. Collective. Returns ``(record,
        stop)``; ``stop``: some rank got SIGUSR1. Nothing is recorded before the exchange completes."""
        opt, comm, job = self.opt, self.comm, self.job
        nranks = comm.Get_size()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = self.work.loss(self.model, x, y, weight)
        if loss.requires_grad:   # a rank without windows (more ranks than the global batch) adds zero
            loss.backward()
        if self.args.clip and self.name in MODEL_AVERAGING:   # sparse runs clip inside (clip_norm)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip)
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
               "t_exchange": mean[5], "ranks": nranks}
        self.steps.append(rec)
        self.log(rec)
        job.step += 1
        return rec, mean[6] > 0

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
