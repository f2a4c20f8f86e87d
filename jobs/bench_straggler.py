#!/usr/bin/env python
"""Straggler benchmark: allreduce SGD, local SGD, WAGMA sync and WAGMA wait-avoiding side by side.

    mpiexec -n 8 python -m mpi4py jobs/bench_straggler.py                 # one straggler per step
    mpiexec -n 8 python -m mpi4py jobs/bench_straggler.py --straggler fixed --stragglers 1

The digits CNN (jobs/models.py) trains for ``--steps`` steps per method, same seed, same data, same
delays. Each step, ``--stragglers`` ranks sleep a heavy-tailed random time (Pareto, scale
``--delay-scale-ms``, clipped to ``--delay-max-ms``), after computing their gradient:

- ``--straggler rotating`` (default): the delayed ranks are drawn afresh every step (a transient
  straggler, the load-imbalance model of the WAGMA/eager-SGD papers);
- ``--straggler fixed``: always the last ranks. With a global average every T steps no method can
  then beat the straggler's own rate; only the noise of the other ranks is avoided.

The delays are a function of (seed, step, rank) only, so every method sees the same ones. Nothing
but the method's own exchange synchronises ranks during training (no per-step metrics collective).
steps/s = steps / (time from a common start until the last rank finishes). After training, the model
averaging methods take one global average, and the test accuracy of the final model is reported.
This is a benchmark, not a test: on an oversubscribed machine (more ranks than cores) the compute
part is slowed by time sharing, so quote the ratios of one run, not absolute times.
"""
import argparse
import json
import os
import time

import numpy as np
import torch
from mpi4py import MPI

import models  # jobs/models.py, beside this script
from common import cores as node_cores
from exdyna_mpi.adapters.torch import DistributedOptimizer, GroupAveragingOptimizer

METHODS = ("allreduce", "local", "wagma-sync", "wagma-wa")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--group-size", type=int, default=0, help="0: 2**ceil(log2(P)/2), about sqrt(P)")
    ap.add_argument("--sync-every", type=int, default=10)
    ap.add_argument("--straggler", choices=("rotating", "fixed"), default="rotating")
    ap.add_argument("--stragglers", type=int, default=1, help="delayed ranks per step")
    ap.add_argument("--delay-scale-ms", type=float, default=10.0)
    ap.add_argument("--delay-max-ms", type=float, default=50.0)
    ap.add_argument("--pareto-shape", type=float, default=1.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/bench_straggler")
    return ap.parse_args(argv)


def delay_of(args, step, rank, nranks):
    """Seconds this rank sleeps at ``step``: the same on every rank's view, for every method."""
    rng = np.random.default_rng([args.seed, step])
    if args.straggler == "rotating":
        who = rng.choice(nranks, size=min(args.stragglers, nranks), replace=False)
    else:
        who = np.arange(nranks - min(args.stragglers, nranks), nranks)
    ms = np.minimum(args.delay_max_ms, args.delay_scale_ms * rng.pareto(args.pareto_shape, size=nranks))
    return float(ms[rank]) / 1e3 if rank in who else 0.0


def build(method, args, model, comm):
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    if method == "allreduce":
        return DistributedOptimizer(opt, model, sparsifier="dense", density=1.0, comm=comm)
    S = args.group_size
    if method == "local":
        return GroupAveragingOptimizer(opt, model, group_size=1, sync_every=args.sync_every, comm=comm)
    mode = "sync" if method == "wagma-sync" else "wait_avoiding"
    return GroupAveragingOptimizer(opt, model, group_size=S, sync_every=args.sync_every, mode=mode, comm=comm)


def run(method, args, comm):
    rank, nranks = comm.Get_rank(), comm.Get_size()
    model, data = models.build("cnn", args.width, args.seed, rank, nranks)
    opt = build(method, args, model, comm)
    lossf = torch.nn.functional.cross_entropy
    shard = comm.allreduce(data.x_train.shape[0], op=MPI.MIN)
    per_epoch = max(1, shard // args.batch_size)
    delays = [delay_of(args, t, rank, nranks) for t in range(args.steps)]
    stale, kinds = [], {"group": 0, "global": 0}
    comm.Barrier()
    t0 = time.perf_counter()
    step = 0
    epoch = 0
    while step < args.steps:
        for x, y in data.batches(epoch, args.batch_size, min(per_epoch, args.steps - step), args.seed, rank):
            opt.zero_grad()
            lossf(model(x), y).backward()
            if delays[step]:
                time.sleep(delays[step])  # the injected straggler
            opt.step()
            st = opt.stats
            if method.startswith("wagma") or method == "local":
                stale.append(st.staleness)
                kinds[st.kind] += 1
            step += 1
        epoch += 1
    mine = time.perf_counter() - t0
    wall = comm.allreduce(mine, op=MPI.MAX)
    fast = comm.allreduce(mine, op=MPI.MIN)
    if method != "allreduce":
        opt.synchronize_model()
        opt.close()
    acc, _ = models.evaluate(model, data, comm)
    worst = comm.allreduce(max(stale) if stale else 0, op=MPI.MAX)
    delay_total = comm.allreduce(sum(delays), op=MPI.MAX)
    return {"method": method, "ranks": nranks, "steps": args.steps, "wall_s": wall, "fastest_rank_s": fast,
            "steps_per_s": args.steps / wall, "test_acc": acc, "max_staleness": worst,
            "group_steps": kinds["group"], "global_steps": kinds["global"],
            "max_rank_delay_s": delay_total}


def main(argv=None):
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, nranks = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    if args.group_size == 0:
        L = nranks.bit_length() - 1
        args.group_size = 1 << (-(-L // 2))
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise SystemExit(f"unknown methods {bad}; choose from {METHODS}")
    if rank == 0:
        print(f"straggler bench: digits CNN width {args.width}, {nranks} ranks on {node_cores()} cores, "
              f"{args.steps} steps, batch {args.batch_size}/rank, {args.stragglers} {args.straggler} "
              f"straggler(s), delay min({args.delay_max_ms:g}, "
              f"{args.delay_scale_ms:g} * Pareto({args.pareto_shape:g})) ms, "
              f"WAGMA S={args.group_size} T={args.sync_every}", flush=True)
    rows = []
    for m in methods:
        rows.append(run(m, args, comm))
        if rank == 0:
            r = rows[-1]
            print(f"  {m:<11} {r['steps_per_s']:7.2f} steps/s  test acc {100 * r['test_acc']:.2f}%", flush=True)
    if rank == 0:
        base = next((r for r in rows if r["method"] == "allreduce"), None)
        head = ("method", "steps/s", "vs allreduce", "test acc", "acc - allreduce (pp)", "max staleness", "wall s")
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        for r in rows:
            ratio = f"{r['steps_per_s'] / base['steps_per_s']:.2f}x" if base else "n/a"
            dacc = f"{100 * (r['test_acc'] - base['test_acc']):+.2f}" if base else "n/a"
            lines.append(f"| {r['method']} | {r['steps_per_s']:.2f} | {ratio} | {100 * r['test_acc']:.2f}% | {dacc} "
                         f"| {r['max_staleness']} | {r['wall_s']:.2f} |")
        print("\n".join(lines), flush=True)
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"P{nranks}_{args.straggler}{args.stragglers}.json")
        with open(path, "w") as f:
            json.dump({"args": vars(args), "cores": node_cores(), "rows": rows}, f, indent=1)
        print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
