"""A job that loses a rank and goes on (``elastic=True``), for tests/unit/test_elastic.py.

    mpiexec --with-ft ulfm --mca pml ob1 --mca btl tcp,self -n 4 python -m mpi4py \
        tests/elastic_job.py ENTRY VICTIM STEP WHERE OUT

ENTRY: ``optimizer`` (DistributedOptimizer over momentum SGD), ``adamw`` (DistributedOptimizer over
AdamW, its default Adam path), ``zoo`` (AdamW with clipping on a model with BatchNorm, a tied
weight, a frozen layer and an unused parameter) or ``diloco`` (DiLoCo, an outer step every 4 steps). At step STEP rank
VICTIM kills itself (SIGKILL) WHERE: ``exchange`` (inside the step's gradient exchange, after its
first collective), ``outer`` (DiLoCo: inside the outer step's exchange), ``compute`` (between
steps, before the backward), or ``none`` (no fault: the reference run). The global batch of a step
does not depend on the number of ranks (rank r of P takes rows r::P), so a run that goes on at P - 1
trains on the same data. Every survivor writes ``OUT/rank<R>.json``: the losses per step, the ranks
each step ran at, the recoveries (time, lost ranks, seconds) and its parameters' sha256.
"""
import contextlib
import hashlib
import json
import os
import signal
import sys
import time

import torch

import exdyna_mpi
from exdyna_mpi import transport
from exdyna_mpi.adapters.torch import DiLoCo, DistributedOptimizer

STEPS, BATCH, DIM, CLASSES = 24, 48, 32, 4


def batch(step, rank, nranks):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, DIM, generator=g)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(DIM, CLASSES, generator=teacher)
    y = (x @ w).argmax(1)
    return x[rank::nranks], y[rank::nranks]


class Zoo(torch.nn.Module):
    """What user models hold: BatchNorm (running statistics, a step counter), a weight tied between
    two layers, a frozen layer and a parameter no step uses."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(DIM, 64)
        self.bn = torch.nn.BatchNorm1d(64)
        self.down = torch.nn.Linear(64, 16, bias=False)   # its weight is used again, transposed
        self.frozen = torch.nn.Linear(64, 64)
        self.frozen.requires_grad_(False)
        self.unused = torch.nn.Linear(5, 5)
        self.head = torch.nn.Linear(64, CLASSES)
        self.head.weight = self.tied = torch.nn.Parameter(torch.randn(CLASSES, 64) * 0.1)

    def forward(self, x):
        h = torch.relu(self.bn(self.inp(x)))
        h = h + torch.relu(self.frozen(h)) + torch.nn.functional.linear(torch.relu(self.down(h)), self.down.weight.t())
        return torch.nn.functional.linear(h, self.tied, self.head.bias)


def build(entry, comm):
    torch.manual_seed(0)
    if entry == "zoo":   # AdamW with per-rank clipping, as transformers train
        model = Zoo()
        inner = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.1)
        return model, DistributedOptimizer(inner, model, sparsifier="exdyna", density=0.1, comm=comm, elastic=True,
                                           clip_norm=1.0)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.ReLU(), torch.nn.Linear(64, CLASSES))
    if entry == "optimizer":
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, DistributedOptimizer(inner, model, sparsifier="exdyna", density=0.1, comm=comm, elastic=True)
    if entry == "adamw":
        inner = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        return model, DistributedOptimizer(inner, model, sparsifier="exdyna", density=0.1, comm=comm, elastic=True)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    return model, DiLoCo(inner, model, sync_every=4, sparsifier="exdyna", density=0.1, comm=comm, elastic=True)


def plant(where, victim, rank, at_step, step_now):
    """On the victim: die inside the next exchange (after its first collective) at ``at_step``."""
    if rank != victim or step_now != at_step or where not in ("exchange", "outer"):
        return
    for name in ("allgather_indices", "allgatherv"):   # the selection's gather: the exchange's second collective
        real = getattr(transport.Exchange, name)

        def dying(self, *a, _real=real, **k):
            out = _real(self, *a, **k)
            print(f"victim {rank}: SIGKILL inside the exchange at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
            return out

        setattr(transport.Exchange, name, dying)


def main():
    entry, victim, at_step, where, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    comm = transport.world()
    rank, nranks = comm.Get_rank(), comm.Get_size()
    me = rank   # the victim is named by its rank at launch; ranks move after a shrink
    model, opt = build(entry, comm)
    losses, full, ranks_at, recoveries = {}, {}, {}, []
    step = 0
    while step < STEPS:
        if where == "compute" and me == victim and step == at_step:
            print(f"victim {rank}: SIGKILL between steps at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        # the whole global batch's loss (DiLoCo's global parameters): the same on every rank, at any P
        with torch.no_grad(), (opt.global_model() if entry == "diloco" else contextlib.nullcontext()):
            xs, ys = batch(step, 0, 1)
            model.eval()   # BatchNorm's running statistics, not this batch's
            full[step] = torch.nn.functional.cross_entropy(model(xs), ys).item()
            model.train()
        x, y = batch(step, rank, nranks)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        # a DiLoCo run dies in the outer step of the period that STEP ends
        plant(where, victim, me, at_step if where != "outer" else at_step - at_step % 4 + 3, step)
        try:
            opt.step()
        except exdyna_mpi.RanksLost as e:
            comm, rank, nranks = e.comm, e.rank, e.nranks
            recoveries.append({"at": time.time(), "step": step, "agreed": e.step, "lost": list(e.lost),
                               "seconds": e.seconds, "nranks": e.nranks})
            # go on from the step the survivors agreed on (the most advanced one's): the step that
            # raised was not applied; DiLoCo's period restarts from the global parameters
            step = e.step * (4 if entry == "diloco" else 1)
            continue
        losses[step], ranks_at[step] = loss.item(), nranks   # a step trained again replaces its entry
        step += 1
    # parameters and buffers (BatchNorm's running statistics come from the most advanced survivor)
    digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes()
                                     for t in list(model.parameters()) + list(model.buffers()))).hexdigest()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"losses": [losses.get(s) for s in range(STEPS)], "full": [full.get(s) for s in range(STEPS)],
                   "ranks": [ranks_at.get(s) for s in range(STEPS)],
                   "recoveries": recoveries, "sha256": digest, "nranks": nranks}, f)
    print(f"rank {rank} of {nranks}: done", flush=True)
    if recoveries:   # Open MPI's finalize can wait for ever on a dead rank: leave once all survivors are done
        comm.Barrier()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
