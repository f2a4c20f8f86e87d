"""Step time of adam="demo" (d 0.05) on the e2e LM (834k GPT, batch 8 x 64, AdamW, clip 1.0) with and
without overlap=True, and with the interpreter's GIL switch interval at its default (5 ms) and at
0.1 ms: 50 steps each, the median of the slowest rank's step after 10.

    bash jobs/run_e2e.sh --job results/e2e/2026-11-28-overlap/probe_ov.py --rate 20 --out DIR
    bash jobs/run_e2e.sh --ranks 2 --job results/e2e/2026-11-28-overlap/probe_ov.py --rate 20 --out DIR
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.getcwd(), "jobs"))
import numpy as np
import torch
from mpi4py import MPI
import models
from exdyna_mpi.adapters.torch import DistributedOptimizer

torch.set_num_threads(1)
ap = argparse.ArgumentParser()
for flag in ("--ranks", "--rate", "--out"):   # what run_e2e.sh passes a --job
    ap.add_argument(flag)
a, _ = ap.parse_known_args()
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
out = []
for overlap, switch in [(False, 0.005), (True, 0.005), (True, 1e-4), (False, 1e-4)]:
    sys.setswitchinterval(switch)
    torch.manual_seed(0)
    model = models.GPT(d_model=128, layers=4, heads=2, context=64)
    opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.999, 0.95), weight_decay=0.1),
                               model, sparsifier="exdyna", density=0.05, adam="demo", overlap=overlap, comm=comm)
    gen = torch.Generator().manual_seed(rank)
    ts, comp = [], []
    comm.Barrier()
    for s in range(50):
        x = torch.randint(0, 256, (8, 64), generator=gen)
        t0 = time.perf_counter()
        opt.zero_grad()
        models.text_loss(model, x, torch.roll(x, -1, 1)).backward()   # random bytes: the compute, not the loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        ts.append(t2 - t0)
        comp.append(t1 - t0)
    if overlap:
        opt.flush()
    st = np.median(np.max(comm.allgather(ts), axis=0)[10:])
    cp = np.median(np.max(comm.allgather(comp), axis=0)[10:])
    sec = opt.stats.seconds if opt.stats is not None else {}
    rec = dict(overlap=overlap, switch=switch, step_s=float(st), fwd_bwd_s=float(cp), rate=a.rate,
               bytes=int(opt.stats.bytes_sent), sec={k: round(v, 4) for k, v in dict(sec).items()})
    if rank == 0:
        print(json.dumps(rec), flush=True)
        out.append(rec)
if rank == 0:
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"probe_{a.rate}.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in out))
