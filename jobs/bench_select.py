"""Per-step time of ExDyna's select + exchange against exact top-k + Allgatherv, same gradients.

    mpiexec -n 4 python -m mpi4py jobs/bench_select.py --numel 10000000 --density 0.001 --steps 10

Both methods run in one process, alternating step by step on the same gradient stream, so they see
the same machine load. A step's time is the slowest rank's (the step ends when every rank is done).
Top-k: ``acc = residual + grad``; ``np.argpartition(|acc|, N-k)`` (no full sort); Allgatherv of
int32 indices; the union (``np.unique``); Allreduce of each rank's ``acc`` at the union; residual
zeroed there. ExDyna: ``sp.step`` (default controller) with its own phase timers.
"""
import time

import numpy as np
from mpi4py import MPI

import exdyna_mpi
from common import append_json_line, parser, world


class ExactTopK:
    """Reference top-k exchange with Allgatherv, written plainly with NumPy (a benchmark baseline)."""

    def __init__(self, numel, density, comm):
        self.comm, self.k = comm, max(1, int(numel * density))
        self.residual = np.zeros(numel, np.float32)
        self.seconds = {}

    def step(self, grad):
        c, P = self.comm, self.comm.Get_size()
        t0 = time.perf_counter()
        acc = self.residual + grad
        n = acc.size
        idx = np.argpartition(np.abs(acc), n - self.k)[n - self.k:].astype(np.int32)
        t1 = time.perf_counter()
        counts = np.array(c.allgather(idx.size))
        union = np.empty(int(counts.sum()), np.int32)
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
        c.Allgatherv(idx, [union, (counts, displs)])
        union = np.unique(union)
        vals = acc[union]
        c.Allreduce(MPI.IN_PLACE, vals, op=MPI.SUM)
        out = np.zeros(n, np.float32)
        out[union] = vals / np.float32(P)
        acc[union] = 0
        self.residual = acc
        t2 = time.perf_counter()
        self.seconds = {"select": t1 - t0, "exchange": t2 - t1, "total": t2 - t0, "union": union.size}
        return out


def grad_stream(rank, step, n):
    rng = np.random.default_rng([rank, step])
    g = rng.standard_normal(n, dtype=np.float32)
    g *= np.float32(0.01)
    g[: n // 8] *= np.float32(3.0)          # a heavier head, as real layers differ
    return g


def main():
    ap = parser(__doc__, numel=10_000_000, density=0.001, steps=10, warmup=3, json_path=None)
    a = ap.parse_args()
    comm, rank, P = world(a)
    # The default controller holds the density from step 0, so both select about k per step.
    ex = exdyna_mpi.ExDyna(a.numel, a.density, comm)
    tk = ExactTopK(a.numel, a.density, comm)
    rows = {"exdyna": [], "topk": []}
    for t in range(a.warmup + a.steps):
        g = grad_stream(rank, t, a.numel)
        for name, sp in (("exdyna", ex), ("topk", tk)):
            comm.Barrier()
            t0 = time.perf_counter()
            sp.step(g)
            wall = time.perf_counter() - t0
            if name == "exdyna":
                s = ex.stats.seconds
                sel = s["select"]
                extra = {"selected": ex.stats.selected, "imbalance": ex.stats.imbalance}
            else:
                sel = tk.seconds["select"]
                extra = {"selected": tk.seconds["union"]}
            step = np.array([wall, sel])
            comm.Allreduce(MPI.IN_PLACE, step, op=MPI.MAX)
            if t >= a.warmup:
                rows[name].append({"total": step[0], "select": step[1], "exchange": step[0] - step[1], **extra})
    if rank == 0:
        res = {"nranks": P, "numel": a.numel, "density": a.density, "steps": a.steps}
        print(f"P={P} numel={a.numel:,} density={a.density} ({a.steps} steps after {a.warmup} warm-up; "
              f"median of the slowest rank per step)")
        print(f"{'method':8} {'select ms':>10} {'exchange ms':>12} {'total ms':>9} {'selected':>9}")
        for name, rs in rows.items():
            med = {k: float(np.median([r[k] for r in rs])) for k in ("total", "select", "exchange", "selected")}
            res[name] = med
            print(f"{name:8} {med['select']*1e3:10.2f} {med['exchange']*1e3:12.2f} {med['total']*1e3:9.2f} "
                  f"{int(med['selected']):9d}")
        ratio = res["topk"]["total"] / res["exdyna"]["total"]
        res["speedup_total"] = ratio
        print(f"exact top-k / ExDyna, per-step time: {ratio:.1f}x")
        if a.json:   # one JSON line per run
            append_json_line(a.json, res)


if __name__ == "__main__":
    main()
