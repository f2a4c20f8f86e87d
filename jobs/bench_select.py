"""One whole ExDyna step against exact top-k + Allgatherv and the memory floor, same gradients, one run.

    timeout 900 mpiexec -n 4 python -m mpi4py jobs/bench_select.py --numel 10000000 --density 0.001 --steps 12

Methods, alternating step by step on the same gradient stream (so they see the same machine load):
  floor      ``np.add(residual, grad, out=acc)`` alone: the 12 B/element pass every error-feedback
             method needs;
  topk       ``acc = residual + grad``; ``np.argpartition(|acc|, N-k)``; Allgatherv of int32 indices;
             the union (``np.unique``); Allreduce of each rank's ``acc`` at the union; residual zeroed;
  exdyna     ``sp.step`` with default options (the measured controller);
  exdyna-NAME ``sp.step`` with ``controller="NAME"`` (e.g. ``exdyna-faithful``).
  exdyna-out ``sp.step(g, out=buf)`` with default options into a buffer reused every step, as the
             torch adapter does (``out`` = the flat gradient): the output is a memset, not a fresh
             buffer whose pages the OS zero-fills as the scatter touches them.
A step's time is the slowest rank's (the step ends when every rank is done): ``total`` is the
longest time from a rank's exit from the barrier to its end, ``span`` (ranks on one node only) the
time from the first rank's exit to the last rank's end on the node's one clock. They differ when
ranks share cores: a rank that leaves the barrier late (it was off a core) starts its clock late,
so ``total`` undercounts a floor that has no collective to wait in, and ``span`` is the step's
time as the node sees it. The table gives the median over ``--steps`` steps after ``--warmup``, and
ExDyna's phases (``stats.seconds``, slowest rank per phase): pass (acc = residual + grad, non-finite
count, the owned-range histograms; with a count-only controller the selection instead), words (the
summed controller words), choose (zooms and the owned-range select), counts (the count words),
indices (Allgatherv), gather + reduce (the values), scatter (output and residual), balance. Threads
per rank: Numba's default unless ``--threads``; ranks sharing a node's cores run one thread each
(see docs/bench.md).
"""
import time

import numpy as np
from mpi4py import MPI

import exdyna_mpi
import streams as corpus
from common import append_json_line, parser, world

PHASES = (("pass", ("select",)), ("words", ("sum_words",)), ("choose", ("choose",)), ("counts", ("counts",)),
          ("indices", ("indices",)), ("values", ("gather", "reduce")), ("scatter", ("scatter",)),
          ("balance", ("balance",)))


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
        self.seconds = {"select": t1 - t0, "total": t2 - t0, "union": union.size}
        return out


class Floor:
    def __init__(self, numel):
        self.residual = np.zeros(numel, np.float32)
        self.acc = np.empty(numel, np.float32)

    def step(self, grad):
        np.add(self.residual, grad, out=self.acc)


def main():
    ap = parser(__doc__, numel=10_000_000, density=0.001, steps=12, warmup=3, seed=0, json_path=None, raw=True)
    ap.add_argument("--stream", default="rotate3", help="a synthetic stream of jobs/streams.py")
    ap.add_argument("--methods", default="floor,topk,exdyna,exdyna-out")
    a = ap.parse_args()
    comm, rank, P = world(a)
    st = corpus.Synthetic(a.stream, a.numel, rank, P, a.seed)
    methods = a.methods.split(",")
    sps = {}
    for m in methods:
        if m == "floor":
            sps[m] = Floor(a.numel)
        elif m == "topk":
            sps[m] = ExactTopK(a.numel, a.density, comm)
        elif m in ("exdyna", "exdyna-out"):
            sps[m] = exdyna_mpi.ExDyna(a.numel, a.density, comm)
        elif m.startswith("exdyna-") and m != "exdyna-out":
            sps[m] = exdyna_mpi.ExDyna(a.numel, a.density, comm, controller=m.split("-", 1)[1])
    rows = {m: [] for m in methods}
    buf = np.empty(a.numel, np.float32) if "exdyna-out" in methods else None
    k = max(1, int(a.numel * a.density))
    for t in range(a.warmup + a.steps):
        g = st.next() * np.float32(0.01)
        for m in methods:
            sp = sps[m]
            comm.Barrier()
            t0 = time.perf_counter()
            if m == "exdyna-out":
                sp.step(g, out=buf)
            else:
                sp.step(g)
            t1 = time.perf_counter()
            wall = t1 - t0
            ph = [0.0] * len(PHASES)
            sel = 0
            if m.startswith("exdyna"):
                s = sp.stats.seconds
                ph = [sum(s.get(x, 0.0) for x in keys) for _, keys in PHASES]
                sel = sp.stats.selected
            elif m == "topk":
                sel = sp.seconds["union"]
            v = np.array([wall, t1, -t0] + ph)
            comm.Allreduce(MPI.IN_PLACE, v, op=MPI.MAX)
            if t >= a.warmup:
                span = v[1] + v[2]  # last rank's end - first rank's start, one clock for the node
                rows[m].append((np.concatenate([[v[0], span], v[3:]]), sel,
                                sp.stats.bytes_sent if m.startswith("exdyna") else 0))
    # One clock (CLOCK_MONOTONIC) serves every rank only when all share a node.
    one_node = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size() == P
    if rank:
        return
    res = {"nranks": P, "numel": a.numel, "density": a.density, "steps": a.steps, "stream": a.stream}
    print(f"P={P} numel={a.numel:,} density={a.density} k={k} stream={a.stream} ({a.steps} steps after "
          f"{a.warmup} warm-up; median of the slowest rank per step; ms)")
    floor = np.median([r[0][0] for r in rows["floor"]]) if "floor" in rows else None
    floor_span = np.median([r[0][1] for r in rows["floor"]]) if "floor" in rows and one_node else None
    hdr = f"{'method':18} {'total':>8} {'/floor':>7} {'span':>8} {'/floor':>7} {'sel/k':>6} {'sent B':>8}  " + " ".join(
        f"{n:>8}" for n, _ in PHASES)
    print(hdr)
    for m, rs in rows.items():
        tot = float(np.median([r[0][0] for r in rs]))
        span = float(np.median([r[0][1] for r in rs]))
        phs = [float(np.median([r[0][2 + i] for r in rs])) for i in range(len(PHASES))]
        sel = float(np.median([r[1] for r in rs]))
        sent = float(np.median([r[2] for r in rs]))
        res[m] = {"total": tot, "selected": sel, "bytes_sent": sent, **{n: v for (n, _), v in zip(PHASES, phs)}}
        ratio = f"{tot / floor:7.2f}" if floor else "      -"
        if one_node:
            res[m]["span"] = span
            span_txt = f"{span * 1e3:8.2f} " + (f"{span / floor_span:7.2f}" if floor_span else "      -")
        else:
            span_txt = f"{'-':>8} {'-':>7}"
        phtxt = " ".join(f"{v * 1e3:8.2f}" for v in phs) if m.startswith("exdyna") else ""
        print(f"{m:18} {tot * 1e3:8.2f} {ratio} {span_txt} {sel / k:6.2f} {sent:8.0f}  {phtxt}")
    if a.json:
        append_json_line(a.json, res)


if __name__ == "__main__":
    main()
