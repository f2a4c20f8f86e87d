"""jobs/e2e.py's training and timing: one method's run on a workload, and the set-up measurements.

``train`` runs a method (jobs/e2e_build.py) for its budget, on to ``--max-steps`` if it has not reached
the target, evaluating every ``--eval-every`` batches, and returns its ``run`` record (the same on
every rank): the slowest rank's median step, the evaluations with the training time at each, the
time to target, bytes per step (the testbed's interface, else the library's count, else a model),
the phases and imbalance of the library's steps, whether every rank ends with the same parameters,
and the method's table row and what its entry point resolved (``method_spec``, ``resolved``).
``measure_compute`` and ``measure_setup`` time a step without communication and gloo's dense
allreduce; ``init_torch_distributed`` starts gloo.

Example::

    from e2e_train import init_torch_distributed, measure_setup, train
    init_torch_distributed(comm)
    compute_s, allreduce_s = measure_setup(wl, args, comm, numel)
    rec = train(METHODS["exdyna"], wl, args, comm, numel, target=None, log=print)
"""
import copy
import datetime
import math
import os
import time

import numpy as np

from e2e_build import build, make_optimizer, modelled_bytes, prime_library
from e2e_methods import Kind


def lr_factor(step, args):
    """The learning-rate multiplier before optimiser step at batch ``step``: a linear warm-up over
    ``--lr-warmup`` batches, then constant or a cosine to a tenth at ``--steps`` (held after it)."""
    warm = min(1.0, (step + 1) / args.lr_warmup) if args.lr_warmup > 0 else 1.0
    if args.schedule == "cosine":
        return warm * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, step / args.steps))))
    return warm



def max_over_ranks(comm, values):
    """Element-wise maximum over the ranks of equally long float sequences."""
    from mpi4py import MPI

    a = np.ascontiguousarray(values, dtype=np.float64)
    out = np.empty_like(a)
    comm.Allreduce(a, out, op=MPI.MAX)
    return out



class WireCounter:
    """Bytes this rank's testbed interface sent (None when not on the testbed)."""

    def __init__(self):
        iface = os.environ.get("EXDYNA_TESTBED_IFACE")
        self.path = f"/sys/class/net/{iface}/statistics/tx_bytes" if iface else None
        if self.path and not os.path.exists(self.path):
            self.path = None

    def read(self):
        if self.path is None:
            return 0
        with open(self.path) as f:
            return int(f.read())


def method_args(args, method):
    """``args`` as ``method`` runs them: its own ``--density-of``; its own budget where ``--steps-of``
    gives one (the schedule, the budget's evaluation and the methods' warm-ups follow it), at least to
    ``--max-steps``; evaluated every ``--eval-every`` (default: the launch's ``--steps`` / 10), so that
    every method's time to target has the same resolution."""
    own = copy.copy(args)
    own.eval_every = args.eval_every or max(1, args.steps // 10)
    own.density = args.density_of.get(method, args.density)
    if method in args.steps_of:
        own.steps = args.steps_of[method]
        own.max_steps = max(own.steps, args.max_steps)
    return own


def train(spec, wl, args, comm, numel, target, log):
    """One method's run: the ``run`` record (the same on every rank).

    The loop counts batches per rank (``step``); an optimiser step takes ``Method.stride`` of them, so
    gradient accumulation sees the same data per step budget as the others. Every method trains
    its budget (``--steps``, or its ``--steps-of``); one that has not reached ``target`` by then goes
    on to ``--max-steps``.
    """
    from mpi4py import MPI

    import exdyna_mpi

    method = spec.name
    args = method_args(args, method)
    prime_library(spec, wl, args, comm, numel)
    m = build(spec, wl, args, comm, numel)
    base_lr = [g["lr"] for g in m.opt.param_groups]
    wire = WireCounter()
    steps = _StepLog()
    evals = []

    def evaluate(step):
        if spec.kind is Kind.WAGMA:
            m.opt.synchronize_model()    # the ranks' models differ between global averages
        m.runner.eval()
        with m.evaluated():
            res = wl.evaluate(m.model, comm)
        m.runner.train()
        t = comm.allreduce(steps.elapsed, op=MPI.MAX)
        evals.append([step, round(t, 4), res["val_loss"]] + ([res["val_acc"]] if "val_acc" in res else []))
        log(f"{method}: step {step} val_loss {res['val_loss']:.4f} at {t:.1f} s")
        return res["val_loss"]

    every = args.eval_every
    diverged = False
    comm.Barrier()
    loss = evaluate(0)
    reached = target is not None and loss <= target
    step = 0
    while step < args.max_steps:
        for g, lr in zip(m.opt.param_groups, base_lr):
            g["lr"] = lr * lr_factor(step, args)
        b0 = wire.read()
        t0 = time.perf_counter()
        try:
            m.step(wl, step, args.clip)
        except exdyna_mpi.StepError as e:
            # raised on every rank together (a library method refusing a non-finite gradient or delta):
            # the run diverged; DDP's would go on with NaN, which the records also count as diverged
            log(f"{method}: diverged at step {step} ({e})")
            evals.append([step, round(comm.allreduce(steps.elapsed, op=MPI.MAX), 4), float("nan")])
            diverged = True
            break
        steps.add(time.perf_counter() - t0, wire.read() - b0, m.stats())
        prev, step = step, step + m.stride
        crossed = step // every > prev // every
        if crossed or prev < args.steps <= step or step >= args.max_steps:
            loss = evaluate(step)
            reached = reached or (target is not None and loss <= target)
            if step >= args.steps and (reached or target is None) or args.stop_at_target and reached:
                break
    rec = _run_record(spec, m, wl, args, comm, numel, target, evals, steps, step, diverged, wire.path is not None)
    m.close()
    return rec


class _StepLog:
    """What each timed step left: its seconds and wire bytes on this rank, and the library's ``Stats``
    (bytes it counted, the ranks' selection counts, the phases' seconds) where the method has them."""

    def __init__(self):
        self.times, self.wire_bytes, self.lib_bytes, self.imbalance, self.phases = [], [], [], [], {}
        self.elapsed = 0.0

    def add(self, seconds, wire_bytes, stats):
        self.wire_bytes.append(wire_bytes)
        self.times.append(seconds)
        self.elapsed += seconds
        if stats is not None:
            self.lib_bytes.append(stats.bytes_sent)
            counts = np.asarray(stats.counts, dtype=np.float64)
            if counts.mean() > 0:
                self.imbalance.append(float(counts.max() / counts.mean() - 1.0))
            for k, v in stats.seconds.items():
                self.phases.setdefault(k, []).append(v)


def _run_record(spec, m, wl, args, comm, numel, target, evals, steps, step, diverged, on_wire):
    """The ``run`` record of a finished loop (collective: the ranks' times, bytes and hashes meet)."""
    method, P = spec.name, comm.Get_size()
    times = max_over_ranks(comm, steps.times)
    budget = [e for e in evals if e[0] >= args.steps]     # none where --stop-at-target ended the run early
    loss_at_steps = float("nan") if diverged else budget[0][2] if budget else None
    hit = next((e for e in evals if target is not None and e[2] <= target), None)
    hashes = comm.allgather(m.param_hash())
    w = np.mean(comm.allgather(float(np.mean(steps.wire_bytes[args.warmup:] or steps.wire_bytes))))
    warm = max(0, min(args.warmup, len(times) - 1))
    per_step = float(np.median(times[warm:]))
    no_density = spec.kind in (Kind.DDP, Kind.DILOCO, Kind.FSDP) or spec.sparsifier == "dense"
    rec = {"kind": "run", "method": method, "workload": wl.name, "ranks": P, "rate_mbit": args.rate,
           "seed": args.seed, "lr": args.lr_of.get(method, args.lr), "params": numel, "steps": args.steps,
           "steps_run": step, "stride": m.stride, "step_s": per_step / m.stride,
           "final_loss": evals[-1][2], "loss_at_steps": loss_at_steps, "target": target,
           "time_to_target_s": None if hit is None else hit[1], "steps_to_target": None if hit is None else hit[0],
           "evals": evals, "params_identical": len(set(hashes)) == 1, "diverged": diverged,
           "collectives_per_step": m.collectives, "density": None if no_density else args.density}
    if on_wire:
        rec["bytes_per_step"], rec["bytes_source"] = float(w) / m.stride, "wire"
    elif steps.lib_bytes:
        per_outer = spec.h if spec.kind is Kind.DILOCO_LIB else 1   # lib_bytes: one per outer step
        rec["bytes_per_step"] = float(np.mean(comm.allgather(float(np.mean(steps.lib_bytes))))) / per_outer
        rec["bytes_source"] = "model"
    else:
        rec["bytes_per_step"] = modelled_bytes(spec, m.stride, P, numel)
        rec["bytes_source"] = None if rec["bytes_per_step"] is None else "model"
    if steps.lib_bytes:
        sl = slice(args.warmup, None)
        rec["phase_s"] = {k: float(np.median(max_over_ranks(comm, v)[sl] if len(v) > args.warmup else v))
                          for k, v in sorted(steps.phases.items())}
        rec["imbalance_median"] = float(np.median(steps.imbalance)) if steps.imbalance else None
    rec["method_spec"], rec["resolved"] = spec.as_dict(), m.resolved
    return rec


def measure_compute(wl, args, comm, steps=7):
    """Seconds of a step without communication (forward, backward, the run's optimiser step), every
    rank at once; the median of the slowest rank's steps after two."""
    import torch

    torch.manual_seed(args.seed)
    model = wl.model()
    opt = make_optimizer(model.parameters(), args, args.lr)
    ts = []
    comm.Barrier()
    for s in range(steps):
        x, y = wl.batch_at(s)
        t0 = time.perf_counter()
        opt.zero_grad()
        wl.loss(model, x, y).backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        ts.append(time.perf_counter() - t0)
    return float(np.median(max_over_ranks(comm, ts[2:])))


def measure_setup(wl, args, comm, numel):
    """``compute_s`` (``measure_compute``) and ``allreduce_s`` (gloo's allreduce of the model's float32
    gradient), medians."""
    import torch
    import torch.distributed as dist

    compute = measure_compute(wl, args, comm)
    buf = torch.ones(numel)
    dist.all_reduce(buf)
    ar = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        ar.append(time.perf_counter() - t0)
    allreduce = float(np.median(max_over_ranks(comm, ar)))
    return compute, allreduce


def init_torch_distributed(comm):
    """gloo over the rendezvous the testbed names (MASTER_ADDR/PORT), else loopback and a port from rank 0."""
    import torch.distributed as dist

    addr = os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT")
    if not addr:
        addr = "127.0.0.1"
    if addr.startswith("127.") and not os.environ.get("GLOO_SOCKET_IFNAME"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if port:
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=comm.Get_rank(),
                                world_size=comm.Get_size())
        return
    # No port given: rank 0 binds the store on port 0 and broadcasts the kernel's choice, so no
    # other job can take the port between a probe and the bind.
    timeout = datetime.timedelta(seconds=300)
    store = None
    if comm.Get_rank() == 0:
        store = dist.TCPStore(addr, 0, comm.Get_size(), is_master=True, timeout=timeout,
                              wait_for_workers=False)
    port = comm.bcast(store.port if store is not None else None)
    if store is None:
        store = dist.TCPStore(addr, port, comm.Get_size(), is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=comm.Get_rank(), world_size=comm.Get_size())
