"""GPU lane: ``DistributedOptimizer(overlap=True)`` with a CUDA model.

The overlapped run equals, to the bit, the synchronous optimizer given each gradient one step
late (the reference the CPU test builds, tests/mpi/test_torch_overlap.py), for ``adam="demo"``
and for momentum SGD; ranks identical; a resume with an update pending reaches the straight run's
bits. Runs where CuPy sees a CUDA device and torch was built with CUDA (serially and under
``mpiexec -n 2``).
"""
import io

import numpy as np
import pytest
from mpi4py import MPI

from tests.conftest import mpi_assert
from tests.gpu import cuda_steps, needs_cuda_torch
from tests.mpi.test_torch_overlap import _grad, late_step

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.mpi(min_size=1),
    needs_cuda_torch(torch),
]

from exdyna_mpi.adapters.torch import DistributedOptimizer  # noqa: E402


def _build(kind, overlap, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 10)).cuda()
    if kind == "demo":
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.99, 0.95), weight_decay=0.1)
        kw = dict(adam="demo")
    else:
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        kw = {}
    return model, DistributedOptimizer(inner, model, sparsifier="exdyna", density=0.05, overlap=overlap, **kw)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy()


def _batch(s):
    g = torch.Generator().manual_seed(1000 * s + MPI.COMM_WORLD.Get_rank())
    return torch.randn(64, 32, generator=g).cuda(), torch.randint(0, 10, (64,), generator=g).cuda()


@pytest.mark.parametrize("kind", ["demo", "sgd"])
def test_cuda_overlap_equals_the_late_synchronous_step(kind):
    comm = MPI.COMM_WORLD
    model, opt = _build(kind, overlap=True)
    ref_model, ref = _build(kind, overlap=False)
    late = None
    for s in range(8):
        cuda_steps(model, opt, s, s + 1)
        x, y = _batch(s)   # cuda_steps' batch of step s, on the reference's parameters
        late = late_step(ref_model, ref, _grad(ref_model, x, y), late)
        torch.cuda.synchronize()
        mpi_assert(np.array_equal(_flat(model).view(np.uint32), _flat(ref_model).view(np.uint32)),
                   f"{kind} step {s}: the overlapped run differs from the late reference")
    opt.flush()
    digests = comm.allgather(_flat(model).tobytes())
    mpi_assert(len(set(digests)) == 1, f"{kind}: ranks differ")


def test_cuda_overlap_resume_with_an_update_pending_is_bit_exact():
    model, opt = _build("demo", overlap=True)
    cuda_steps(model, opt, 0, 6)
    opt.flush()
    straight = _flat(model)

    model, opt = _build("demo", overlap=True)
    cuda_steps(model, opt, 0, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model, opt = _build("demo", overlap=True, seed=5)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    cuda_steps(model, opt, 3, 6)
    opt.flush()
    mpi_assert(np.array_equal(straight.view(np.uint32), _flat(model).view(np.uint32)),
               "the resumed overlapped run differs from the straight one")
