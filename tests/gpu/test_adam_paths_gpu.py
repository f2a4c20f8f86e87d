"""GPU lane: ``DistributedOptimizer``'s Adam paths with a CUDA model (the flat gradient and the
residual on the device).

For ``adam="update"``, ``adam="demo"`` (the residual as the momentum, scaled on the device after
each exchange) and ``adam="demo-age"`` (also the steps of the last moves on the device): ranks
identical after every step, and a resume from a state dict reaches the straight run's bits. Runs
where CuPy sees a CUDA device and torch was built with CUDA (the lane runs it serially and under
``mpiexec -n 2``).
"""
import io

import numpy as np
import pytest
from mpi4py import MPI

from tests.conftest import mpi_assert
from tests.gpu import cuda_steps, needs_cuda_torch

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.mpi(min_size=1),
    needs_cuda_torch(torch),
]

from exdyna_mpi.adapters.torch import DistributedOptimizer  # noqa: E402


def _build(mode, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 10)).cuda()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    return model, DistributedOptimizer(inner, model, sparsifier="exdyna", density=0.05, adam=mode)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy()


@pytest.mark.parametrize("mode", ["update", "demo", "demo-age"])
def test_cuda_adam_path_ranks_identical_and_resume_bit_exact(mode):
    comm = MPI.COMM_WORLD
    model, opt = _build(mode)
    for s in range(6):
        cuda_steps(model, opt, s, s + 1)
        digests = comm.allgather(_flat(model).tobytes())
        mpi_assert(len(set(digests)) == 1, f"adam={mode!r} step {s}: ranks differ")
    straight = _flat(model)

    model, opt = _build(mode)
    cuda_steps(model, opt, 0, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model, opt = _build(mode, seed=5)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    cuda_steps(model, opt, 3, 6)
    mpi_assert(np.array_equal(straight.view(np.uint32), _flat(model).view(np.uint32)),
               f"adam={mode!r}: the resumed run differs from the straight one")


def test_cuda_demo_signs_change_no_bit():
    """``adam="demo"`` gathers signs by default (``output="sign"``, staged through the host on a
    device): the same parameters as ``output="mean"``, to the bit, with fewer bytes."""
    comm = MPI.COMM_WORLD
    runs = []
    for kw in ({}, {"output": "mean"}):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 10)).cuda()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        opt = DistributedOptimizer(inner, model, sparsifier="exdyna", density=0.05, **kw)
        sent = 0
        for s in range(5):
            cuda_steps(model, opt, s, s + 1)
            sent += opt.stats.bytes_sent
        runs.append((opt.sparsifier.output, _flat(model), sent))
    (o1, t1, b1), (o2, t2, b2) = runs
    mpi_assert(o1 == "sign" and o2 == "mean", f"outputs {o1}, {o2}")
    mpi_assert(np.array_equal(t1.view(np.uint32), t2.view(np.uint32)), "signs changed the parameters")
    mpi_assert(b1 < b2 if comm.Get_size() > 1 else b1 == b2, f"bytes: signs {b1}, means {b2}")
