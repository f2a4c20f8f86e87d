"""ExDyna through the simulated device path against the CPU path, on every rank of COMM_WORLD.

Run by test_exdyna_device.py as ``timeout 300 mpiexec -n 2 python sim_exdyna_run.py``; also
usable alone. Exits non-zero (on every rank) when any rank disagrees.
"""
import os
import sys

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")   # a script: its folder (simdevice.py) is on sys.path

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import exdyna_mpi  # noqa: E402
from simdevice import simulated  # noqa: E402


def run(comm, steps=4, n=1500, seed=11, **opts):
    """True when the device path (staged and direct) matched the CPU bit for bit on every rank.
    ``opts``: more ExDyna options (``max_imbalance``: rank r's gradient is then 1 + r times larger,
    so that the quotas move selections; ``wire_dtype``: 16-bit values, the device's kernels or,
    staged, the host's; ``output="sign"``: the signs' codes, staged through the host on both paths)."""
    rank = comm.Get_rank()
    kw = dict(n_blocks=16, block_align=32, **opts)
    scale = np.float32(1 + rank if "max_imbalance" in opts else 1)
    ref = exdyna_mpi.ExDyna(n, 0.02, comm, device="cpu", **kw)
    devs = {aware: simulated(exdyna_mpi.ExDyna, n, 0.02, comm, cuda_aware=aware, **kw) for aware in (False, True)}
    rng = np.random.default_rng(seed + rank)
    ok, moved = True, 0
    for _ in range(steps):
        g = (rng.standard_normal(n) * 0.05).astype(np.float32) * scale
        want = ref.step(g.copy())
        for aware, sp in devs.items():
            got = sp.step(g.copy())
            ok &= got.tobytes() == want.tobytes()
            ok &= sp.residual.tobytes() == ref.residual.tobytes()
            ok &= list(sp.stats.counts) == list(ref.stats.counts)
            ok &= sp.stats.quota_moved == ref.stats.quota_moved
            ok &= (sp.stats.bytes_sent, sp.stats.bytes_received) == (ref.stats.bytes_sent,
                                                                     ref.stats.bytes_received)
        moved += ref.stats.quota_moved
    if "max_imbalance" in opts:
        ok &= moved > 0
    # every rank holds the same output
    outs = comm.allgather(want.tobytes())
    ok &= all(o == outs[0] for o in outs)
    ok &= ref.stats.selected > 0
    return all(comm.allgather(bool(ok)))


if __name__ == "__main__":
    with np.errstate(invalid="ignore"):
        good = (run(MPI.COMM_WORLD) and run(MPI.COMM_WORLD, max_imbalance=0.0)
                and run(MPI.COMM_WORLD, wire_dtype="bfloat16") and run(MPI.COMM_WORLD, wire_dtype="float16")
                and run(MPI.COMM_WORLD, output="sign") and run(MPI.COMM_WORLD, output="sign", wire_dtype="bfloat16"))
    if MPI.COMM_WORLD.Get_rank() == 0:
        print("SIM-EXDYNA", "OK" if good else "MISMATCH", "P =", MPI.COMM_WORLD.Get_size())
    sys.exit(0 if good else 1)
