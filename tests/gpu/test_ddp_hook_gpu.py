"""GPU lane: the DDP communication hook with CUDA buckets.

DDP hands the hook CUDA gradient buffers; the sparsifiers reach them through DLPack as CuPy arrays,
and the transport stages them or hands them to a CUDA-aware MPI (``EXDYNA_CUDA_AWARE``). Runs where
CuPy sees a CUDA device and torch was built with CUDA (the lane runs it serially and under
``mpiexec -n 2``), over a gloo process group that spans the MPI ranks.
"""
import copy
import hashlib

import numpy as np
import pytest
from mpi4py import MPI

from tests.conftest import mpi_assert
from tests.gpu import cuda_steps, needs_cuda_torch

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.mpi(min_size=1),
    pytest.mark.usefixtures("gloo"),
    needs_cuda_torch(torch),
]

from exdyna_mpi.adapters.torch import ExDynaHookState, exdyna_hook  # noqa: E402


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                               torch.nn.Tanh(), torch.nn.Linear(256, 10)).cuda()


def _train(ddp, steps):
    cuda_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9), 0, steps)


def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy()


@pytest.mark.parametrize("scope", ["model", "bucket"])
@pytest.mark.parametrize("name", ["exdyna", "topk"])
def test_cuda_buckets_end_bit_identical(name, scope):
    comm = MPI.COMM_WORLD
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.1)
    state = ExDynaHookState(name, density=0.05, scope=scope)
    ddp.register_comm_hook(state, exdyna_hook)
    before = _params(model).copy()
    _train(ddp, 4)
    state.close()
    p = _params(model)
    digests = comm.allgather(hashlib.sha256(p.tobytes()).hexdigest())
    mpi_assert(len(set(digests)) == 1, f"{name}/{scope}: parameters differ between ranks", comm)
    mpi_assert(np.isfinite(p).all() and not np.array_equal(p, before), f"{name}/{scope}: no training", comm)


def test_dense_hook_on_cuda_equals_ddp_allreduce():
    comm = MPI.COMM_WORLD
    ref_model = _model()
    _train(torch.nn.parallel.DistributedDataParallel(ref_model, bucket_cap_mb=0.1), 3)
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.1)
    state = ExDynaHookState("dense")
    ddp.register_comm_hook(state, exdyna_hook)
    _train(ddp, 3)
    state.close()
    got, want = _params(model), _params(ref_model)
    mpi_assert(np.allclose(got, want, rtol=1e-5, atol=1e-6),
               f"dense hook differs from DDP's allreduce by {np.abs(got - want).max():.3g}", comm)


#: optimizer factory, density, recipe options: momentum SGD under the default recipe (momentum moved,
#: quotas) with clipping and a dense warm-up; AdamW with clipping; the Adam paths that own the step
#: (their state comes back from host copies at the resume: "frozen" resumes after its freeze)
RECIPES = {
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), 0.01, dict(clip_norm=1.0, warmup_steps=1)),
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, betas=(0.9, 0.95)), 0.01, dict(clip_norm=1.0, adam="live")),
    "adamw-update": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, betas=(0.9, 0.95)), 0.01,
                     dict(clip_norm=1.0, adam="update")),
    "adamw-demo": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, betas=(0.99, 0.95)), 0.01, dict(adam="demo")),
    "adam-frozen": (lambda ps: torch.optim.Adam(ps, lr=1e-3), 0.01, dict(adam="frozen", warmup_steps=1)),
    "adamw-auto": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, betas=(0.99, 0.95)), 0.01, dict(clip_norm=1.0)),
}


@pytest.mark.parametrize("case", sorted(RECIPES))
def test_cuda_hook_with_optimizer_equals_distributed_optimizer_and_resumes(case):
    """The hook with ``optimizer=`` and ``DistributedOptimizer`` on CUDA: the same parameters after
    every step; a resume through the hook's state dict (the recipe's velocity comes back from the
    CPU) reaches the straight run's bits."""
    from exdyna_mpi.adapters.torch import DistributedOptimizer

    comm = MPI.COMM_WORLD
    make_opt, density, recipe = RECIPES[case]
    plain = _model()
    wrapped = DistributedOptimizer(make_opt(plain.parameters()), plain, sparsifier="exdyna", density=density,
                                   **recipe)
    hooked = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(hooked, bucket_cap_mb=0.1)
    opt = make_opt(hooked.parameters())
    state = ExDynaHookState("exdyna", density, optimizer=opt, **recipe)
    ddp.register_comm_hook(state, exdyna_hook)
    try:
        for s in range(3):
            cuda_steps(plain, wrapped, s, s + 1)
            cuda_steps(ddp, opt, s, s + 1)
            mpi_assert(np.array_equal(_params(plain).view(np.uint32), _params(hooked).view(np.uint32)),
                       f"{case} step {s}: the hook differs from DistributedOptimizer", comm)
        saved = copy.deepcopy({"model": hooked.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()})
        cuda_steps(ddp, opt, 3, 6)
    finally:
        state.close()
    straight = _params(hooked).copy()

    resumed = _model(seed=5)
    resumed.load_state_dict(saved["model"])
    ddp = torch.nn.parallel.DistributedDataParallel(resumed, bucket_cap_mb=0.1)
    opt = make_opt(resumed.parameters())
    state = ExDynaHookState("exdyna", density, optimizer=opt, **recipe)
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["hook"])
    ddp.register_comm_hook(state, exdyna_hook)
    try:
        cuda_steps(ddp, opt, 3, 6)
    finally:
        state.close()
    mpi_assert(np.array_equal(straight.view(np.uint32), _params(resumed).view(np.uint32)),
               f"{case}: the resumed run differs from the straight one", comm)


def test_cuda_grad_edited_after_backward_is_refused_everywhere():
    """The default path for AdamW (``"demo"``) on CUDA buckets: a binding ``clip_grad_norm_`` on the
    last rank between ``backward()`` and ``step()`` raises the same ``CollectiveError`` on every rank
    (the check compares the device tensors), nothing applied; with ``.grad`` put back the step goes on."""
    from exdyna_mpi import CollectiveError

    comm = MPI.COMM_WORLD
    model = _model(seed=3)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.99, 0.95))
    state = ExDynaHookState("exdyna", 0.01, optimizer=opt, clip_norm=1.0)
    ddp.register_comm_hook(state, exdyna_hook)
    try:
        cuda_steps(ddp, opt, 0, 2)
        g = torch.Generator().manual_seed(7 + comm.Get_rank())
        x, y = torch.randn(64, 32, generator=g).cuda(), torch.randint(0, 10, (64,), generator=g).cuda()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        before = _params(model).copy()
        if comm.Get_rank() == comm.Get_size() - 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-4)
        msg = ""
        try:
            opt.step()
        except CollectiveError as e:
            msg = str(e)
        msgs = comm.allgather(msg)
        mpi_assert(msgs[0] and len(set(msgs)) == 1 and f"rank {comm.Get_size() - 1}" in msgs[0],
                   f"not the same refusal everywhere: {msgs}", comm)
        mpi_assert(np.array_equal(before, _params(model)), "a refused step moved the parameters", comm)
        for p, gr in zip(model.parameters(), grads):
            p.grad.copy_(gr)
        opt.step()
        cuda_steps(ddp, opt, 3, 4)
    finally:
        state.close()
    digests = comm.allgather(hashlib.sha256(_params(model).tobytes()).hexdigest())
    mpi_assert(len(set(digests)) == 1 and not np.array_equal(before, _params(model)),
               "parameters differ between ranks, or did not move", comm)
