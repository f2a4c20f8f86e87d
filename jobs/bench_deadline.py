"""Deadline exchange against the exact exchange, training the digits CNN with one slow, jittery link.

    timeout 1800 mpiexec -n 4 python -m mpi4py jobs/bench_deadline.py --out out/bench_deadline

Every variant trains the same model from the same initialisation on the same shards, back to back
in one job (ExDyna, density 0.01 by default). One link is slowed with the transport's test hook
(``exdyna_mpi.transport.SendDelay``: chunk c of a step leaves ``--delay-ms + U(0, --jitter-ms) +
c * --per-chunk-ms`` after it was posted, on the link ``--slow-src`` -> ``--slow-dst``):

- ``exact``: the exact exchange (one ``Allgatherv`` of indices). A collective cannot be slowed on
  one link by the hook, so this row is the undisturbed reference.
- ``exact-p2p``: the deadline exchange with ``max_loss=0`` and a deadline it never reaches: the
  same bits as ``exact`` every step, over the point-to-point transport the slow link delays; the
  exact exchange as it would run over that link (and once without the delay: the transport's own
  cost against ``Allgatherv``).
- ``deadline D/L``: ``deadline_ms=D`` (or ``auto``), ``max_loss=L``.

Per step: the sparsifier's step time on the slowest rank (max over ranks of ``stats.seconds
["total"]``), and the deferred fraction of the step's selected mass. The table gives the median and
p90 step time after ``--warmup`` steps, the mean and max deferred fraction, the fraction of steps
that had to wait for mandatory chunks, and the final test accuracy. JSON in ``--out``.
"""
import argparse
import os
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

import models  # jobs/common.py, jobs/models.py: beside this script
from common import abort_on_exception, markdown_table, write_json
from exdyna_mpi.adapters.torch import DistributedOptimizer
# the deadline transport's test hook: this benchmark slows one link with it
from exdyna_mpi.transport import SendDelay, set_send_delay


def parse():
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    ap.add_argument("--out", default="out/bench_deadline")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--slow-src", type=int, default=-1, help="sender of the slow link (-1: the last rank)")
    ap.add_argument("--slow-dst", type=int, default=0, help="receiver of the slow link (-1: every rank)")
    ap.add_argument("--delay-ms", type=float, default=2.0)
    ap.add_argument("--jitter-ms", type=float, default=8.0)
    ap.add_argument("--per-chunk-ms", type=float, default=2.0)
    ap.add_argument("--deadlines", default="5:0.05,5:0.3,auto:0.05,auto:0.3",
                    help="comma-separated DEADLINE_MS:MAX_LOSS variants (DEADLINE_MS may be auto)")
    return ap.parse_args()


def run(label, options, delayed, args, comm):
    rank, P = comm.Get_rank(), comm.Get_size()
    src = args.slow_src % P
    dst = None if args.slow_dst < 0 else args.slow_dst % P
    set_send_delay(SendDelay(src, args.delay_ms, args.jitter_ms, args.per_chunk_ms, dest=dst, seed=args.seed)
                   if delayed else None)
    model, data = models.build("cnn", args.width, args.seed, rank, P)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), model,
                               sparsifier="exdyna", density=args.density, comm=comm, **options)
    steps = comm.allreduce(data.x_train.shape[0], op=MPI.MIN) // args.batch_size
    lossf = torch.nn.functional.cross_entropy
    times, deferred, waited, losses, dms = [], [], [], [], []
    t_run = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        for x, y in data.batches(epoch, args.batch_size, steps, args.seed, rank):
            opt.zero_grad()
            loss = lossf(model(x), y)
            loss.backward()
            opt.step()
            st = opt.stats
            rep = getattr(st, "deadline", None) or {}
            local = np.array([st.seconds.get("total", 0.0), loss.item()])
            mx = np.empty_like(local)
            comm.Allreduce(local, mx, op=MPI.MAX)
            times.append(float(mx[0]))
            losses.append(float(loss.item()))
            deferred.append(float(rep.get("deferred", 0.0)))
            waited.append(bool(rep.get("waited", False)))
            dms.append(float(rep.get("ms", float("nan"))))
    acc, _ = models.evaluate(model, data, comm)
    dl = opt.sparsifier.deadline
    pending = dl.pending_requests if dl is not None else 0
    opt.sparsifier.close()
    set_send_delay(None)
    w = args.warmup
    t = np.array(times[w:]) * 1e3
    d = np.array(deferred[w:])
    return {"variant": label, "options": {k: v for k, v in options.items()}, "delayed": delayed,
            "steps": len(times), "step_ms_median": float(np.median(t)), "step_ms_p90": float(np.quantile(t, 0.9)),
            "deferred_mean": float(d.mean()), "deferred_max": float(d.max()),
            "waited_fraction": float(np.mean(waited[w:])), "deadline_ms_median": float(np.median(dms[w:])),
            "test_acc": float(acc),
            "final_loss": float(np.mean(losses[-steps:])), "pending_before_close": int(pending),
            "wall_s": time.perf_counter() - t_run, "step_ms": [float(x) for x in t], "deferred": deferred}


def main():
    args = parse()
    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), comm.Get_size()
    abort_on_exception(comm)
    torch.set_num_threads(1)
    p2p = {"deadline_ms": 1e7, "max_loss": 0.0}
    variants = [("exact", {}, False), ("exact-p2p, no delay", p2p, False), ("exact-p2p", p2p, True)]
    for item in args.deadlines.split(","):
        d, loss = item.split(":")
        variants.append((f"deadline {d} ms / {loss}", {"deadline_ms": d if d == "auto" else float(d),
                                                        "max_loss": float(loss)}, True))
    rows = []
    for label, options, delayed in variants:
        res = run(label, options, delayed, args, comm)
        rows.append(res)
        if rank == 0:
            print(f"[bench_deadline] {label}: median {res['step_ms_median']:.2f} ms/step, deferred mean "
                  f"{res['deferred_mean']:.4f}, test acc {100 * res['test_acc']:.2f}%", flush=True)
    if rank == 0:
        base = rows[2]["step_ms_median"]
        table = markdown_table(
            ("variant", "link delayed", "deadline ms", "step ms median", "p90", "vs exact-p2p", "deferred mean",
             "deferred max", "steps waited", "test acc"),
            [(r["variant"], "yes" if r["delayed"] else "no",
              "-" if not np.isfinite(r["deadline_ms_median"]) or r["deadline_ms_median"] >= 1e6
              else f"{r['deadline_ms_median']:.1f}", f"{r['step_ms_median']:.2f}", f"{r['step_ms_p90']:.2f}",
              f"{r['step_ms_median'] / base:.2f}x", f"{r['deferred_mean']:.4f}", f"{r['deferred_max']:.4f}",
              f"{100 * r['waited_fraction']:.0f}%", f"{100 * r['test_acc']:.2f}%") for r in rows])
        src = args.slow_src % P
        dst = "every rank" if args.slow_dst < 0 else str(args.slow_dst % P)
        head = (f"P={P}, digits CNN width {args.width}, ExDyna density {args.density}, {args.epochs} epochs x "
                f"{rows[0]['steps'] // args.epochs} steps; slow link {src} -> {dst}: chunk c leaves after "
                f"{args.delay_ms:g} + U(0, {args.jitter_ms:g}) + c x {args.per_chunk_ms:g} ms")
        print(head)
        print(table)
        os.makedirs(args.out, exist_ok=True)
        write_json(os.path.join(args.out, "bench_deadline.json"),
                   {"argv": sys.argv, "header": head, "args": vars(args), "runs": rows})
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write(head + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
