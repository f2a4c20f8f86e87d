"""DistributedOptimizer(adam="frozen" | "frozen-gradient"): Adam with a frozen second moment.

- With the dense exchange, both modes equal a frozen-variance Adam computed here in float64 from
  every rank's gradient (AdamW's decoupled and Adam's coupled weight decay): the warm-up is Adam,
  then the second moment of the last warm-up step divides every later step.
- The warm-up steps are bit for bit those of the wrapped optimizer without the option.
- With ExDyna at 5 %: every rank holds the same parameters, and a state dict saved after the
  freeze resumes bit-exactly.
- Refusals: another optimizer, no warm-up, amsgrad, an unknown mode, a dict of another mode.
"""
import copy
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

from exdyna_mpi.adapters.torch import DistributedOptimizer  # noqa: E402
from tests.conftest import allgather_array, mpi_assert  # noqa: E402
from tests.mpi.test_torch_options import _batch, _flat, _model, _step  # noqa: E402  (the same toy model)

pytestmark = pytest.mark.mpi
LR, BETAS, EPS, WD, WARM = 1e-2, (0.9, 0.95), 1e-8, 0.1, 3


def _grad_at(model, flat_params, x, y):
    """This rank's gradient at ``flat_params`` (a copy of the model, float64 result)."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(torch.from_numpy(flat_params.astype(np.float32)), m.parameters())
    torch.nn.functional.cross_entropy(m(x), y).backward()
    return _flat(p.grad for p in m.parameters()).astype(np.float64)


def _make(model, wcomm, cls=torch.optim.AdamW, **kw):
    opt = cls(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    return DistributedOptimizer(opt, model, comm=wcomm, **kw)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("mode", ["frozen", "frozen-gradient"])
def test_dense_exchange_equals_frozen_variance_adam_computed_here(wcomm, mode, cls):
    rank = wcomm.Get_rank()
    model = _model()
    opt = _make(model, wcomm, cls, sparsifier="dense", density=1.0, adam=mode, warmup_steps=WARM)
    theta = _flat(model.parameters()).astype(np.float64)
    m = np.zeros_like(theta)
    v = np.zeros_like(theta)
    b1, b2 = BETAS
    decoupled = cls is torch.optim.AdamW
    denom = None
    for t in range(1, 9):
        x, y = _batch(rank, t)
        g = allgather_array(_grad_at(model, theta, x, y), wcomm).mean(axis=0)
        if t <= WARM:                     # Adam as torch writes it
            if not decoupled:
                g = g + WD * theta
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            d = np.sqrt(v / (1 - b2 ** t)) + EPS
            if decoupled:
                theta = theta * (1 - LR * WD)
            theta = theta - LR / (1 - b1 ** t) * m / d
        else:                             # the second moment of step WARM, held
            if denom is None:
                denom = np.sqrt(v / (1 - b2 ** WARM)) + EPS
                m = m / denom
            p = g / denom
            if not decoupled:
                p = p + WD * theta / denom
            m = b1 * m + (1 - b1) * p
            if decoupled:
                theta = theta * (1 - LR * WD)
            theta = theta - LR / (1 - b1 ** t) * m
        _step(model, opt, x, y)
        got = _flat(model.parameters()).astype(np.float64)
        err = np.abs(got - theta).max()
        mpi_assert(err < 2e-5, f"{mode} {cls.__name__} step {t}: max |theta - reference| {err:.3g}", wcomm)
        theta = got   # the next gradient at the optimizer's parameters; errors do not compound
    mpi_assert(opt._exdyna_adam.frozen and opt._exdyna_adam.step == 8, "frozen after the warm-up", wcomm)


def test_warm_up_is_the_wrapped_optimizer_bit_for_bit(wcomm):
    rank = wcomm.Get_rank()
    a, b = _model(), _model()
    oa = _make(a, wcomm, sparsifier="exdyna", density=0.05, adam="frozen", warmup_steps=WARM)
    ob = _make(b, wcomm, sparsifier="exdyna", density=0.05, adam="live", warmup_steps=WARM)
    for s in range(WARM):
        x, y = _batch(rank, s)
        _step(a, oa, x, y)
        _step(b, ob, x, y)
        mpi_assert(_flat(a.parameters()).tobytes() == _flat(b.parameters()).tobytes(),
                   f"warm-up step {s}: adam='frozen' differs from AdamW", wcomm)
    mpi_assert(not oa._exdyna_adam.frozen, "still live after the warm-up's last step", wcomm)


@pytest.mark.parametrize("mode", ["frozen", "frozen-gradient"])
def test_sparse_ranks_identical_and_resume_bit_exact(wcomm, mode):
    rank = wcomm.Get_rank()
    model = _model()
    opt = _make(model, wcomm, sparsifier="exdyna", density=0.05, adam=mode, warmup_steps=WARM)
    for s in range(6):
        _step(model, opt, *_batch(rank, s))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    for s in range(6, 10):
        _step(model, opt, *_batch(rank, s))
    mine = _flat(model.parameters())
    every = allgather_array(mine, wcomm)
    mpi_assert(all(r.tobytes() == mine.tobytes() for r in every), f"{mode}: ranks hold different parameters", wcomm)
    mpi_assert(opt.stats.density < 0.2, f"{mode}: the sparse phase ran (density {opt.stats.density:.3g})", wcomm)

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model2 = _model(seed=99)
    opt2 = _make(model2, wcomm, sparsifier="exdyna", density=0.05, adam=mode, warmup_steps=WARM)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    for s in range(6, 10):
        _step(model2, opt2, *_batch(rank, s))
    mpi_assert(_flat(model2.parameters()).tobytes() == mine.tobytes(), f"{mode}: resume is not bit-exact", wcomm)


def test_refusals(wcomm):
    model = _model()
    with pytest.raises(ValueError, match="needs torch.optim.Adam or AdamW"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm=wcomm, adam="frozen",
                             warmup_steps=2)
    with pytest.raises(ValueError, match="warmup_steps >= 1"):
        _make(model, wcomm, adam="frozen")
    with pytest.raises(ValueError, match="amsgrad"):
        DistributedOptimizer(torch.optim.AdamW(model.parameters(), amsgrad=True), model, comm=wcomm,
                             adam="frozen", warmup_steps=2)
    with pytest.raises(ValueError, match="adam must be one of"):
        _make(model, wcomm, adam="frozen-variance", warmup_steps=2)
    frozen = _make(model, wcomm, sparsifier="dense", density=1.0, adam="frozen", warmup_steps=1)
    other = _make(_model(), wcomm, sparsifier="dense", density=1.0, adam="frozen-gradient", warmup_steps=1)
    with pytest.raises(ValueError, match="adam='frozen'"):
        other.load_state_dict(frozen.state_dict())
    live = _make(_model(), wcomm, sparsifier="dense", density=1.0, warmup_steps=1)
    with pytest.raises(ValueError, match="has no 'exdyna_adam'"):
        frozen.load_state_dict(live.state_dict())
