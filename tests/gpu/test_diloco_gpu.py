"""GPU lane: ``DiLoCo`` with a CUDA model (the outer delta through the device exchange).

Ranks identical after every outer step, for the dense and the ExDyna outer exchange (16-bit values
and the decayed residual too), and a resume in the middle of a period reaching the straight run's
bits. Runs where CuPy sees a CUDA device and torch was built with CUDA (the lane runs it serially
and under ``mpiexec -n 2``).
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

from exdyna_mpi.adapters.torch import DiLoCo, nesterov_sgd  # noqa: E402

H = 2


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 10)).cuda()


def _build(name, options, seed=0):
    model = _model(seed)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    return model, DiLoCo(inner, model, sync_every=H, sparsifier=name, density=0.05, **options)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy()


@pytest.mark.parametrize("name, options", [("dense", {}), ("exdyna", {}), ("exdyna", {"wire_dtype": "bfloat16"}),
                                           ("exdyna", {"outer_optimizer": nesterov_sgd, "error_decay": 1.0})])
def test_cuda_diloco_ranks_identical_and_resume_bit_exact(name, options):
    comm = MPI.COMM_WORLD
    model, opt = _build(name, options)
    cuda_steps(model, opt, 0, 3 * H)
    straight = _flat(model)
    digests = comm.allgather(straight.tobytes())
    mpi_assert(len(set(digests)) == 1 and opt.outer_steps == 3, f"{name}: ranks differ after the outer steps")

    model, opt = _build(name, options)
    cuda_steps(model, opt, 0, H + 1)   # one step into the second period
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model, opt = _build(name, options, seed=5)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    cuda_steps(model, opt, H + 1, 3 * H)
    mpi_assert(np.array_equal(straight.view(np.uint32), _flat(model).view(np.uint32)),
               f"{name} {options}: the resumed run differs from the straight one")
