"""DistributedOptimizer(adam="update"): Adam's moments on each rank, its update exchanged.

- With the dense exchange, the parameters equal a float64 reference computed here: every rank's
  own Adam moments from its own gradient, the per-rank updates averaged, AdamW's decoupled (and
  Adam's coupled) weight decay, the learning rate read at each step (a scheduler changes it).
- With ExDyna at 5 %: every rank holds the same parameters, the moments differ between ranks (they
  are each rank's own), and a state dict resumes bit-exactly; a bfloat16 model trains too.
- A step skipped everywhere (``nonfinite="skip"``) leaves moments, step count and parameters as
  they were; a moment vector corrupt on one rank is refused on every rank with the same error and
  nothing changes; a dict of another mode is refused.
"""
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

from exdyna_mpi.adapters.torch import DistributedOptimizer  # noqa: E402
from tests.conftest import allgather_array, mpi_assert, same_error_everywhere  # noqa: E402
from tests.mpi.test_torch_adam import _grad_at  # noqa: E402
from tests.mpi.test_torch_options import _batch, _flat, _model, _step  # noqa: E402

pytestmark = pytest.mark.mpi
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1


def _make(model, wcomm, cls=torch.optim.AdamW, **kw):
    opt = cls(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    return DistributedOptimizer(opt, model, comm=wcomm, adam="update", **kw)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_dense_exchange_equals_per_rank_adam_averaged_here(wcomm, cls):
    rank = wcomm.Get_rank()
    model = _model()
    opt = _make(model, wcomm, cls, sparsifier="dense", density=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))   # the lr is read at each step
    theta = _flat(model.parameters()).astype(np.float64)
    m = np.zeros_like(theta)
    v = np.zeros_like(theta)
    b1, b2 = BETAS
    decoupled = cls is torch.optim.AdamW
    for t in range(1, 9):
        lr = LR / t
        x, y = _batch(rank, t)
        g = _grad_at(model, theta, x, y)            # this rank's own gradient
        if not decoupled:
            g = g + WD * theta
        m = b1 * m + (1 - b1) * g                   # this rank's own moments
        v = b2 * v + (1 - b2) * g * g
        u = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + EPS)
        u_avg = allgather_array(u, wcomm).mean(axis=0)
        expect = theta * (1 - lr * WD) if decoupled else theta
        expect = expect - lr * u_avg
        _step(model, opt, x, y)
        sched.step()
        got = _flat(model.parameters()).astype(np.float64)
        err = np.abs(got - expect).max()
        mpi_assert(err < 2e-5, f"{cls.__name__} step {t}: max |theta - reference| {err:.3g}", wcomm)
        theta = got   # the next gradient at the optimizer's parameters; errors do not compound
    path = opt._exdyna_adam
    err_m = np.abs(path.m.numpy() - m).max()
    mpi_assert(path.step == 8 and err_m < 1e-5, f"moments: step {path.step}, max |m - reference| {err_m:.3g}", wcomm)


def _train(model, opt, rank, steps):
    for s in steps:
        _step(model, opt, *_batch(rank, s))


def skipped_step(model, opt, rank, wcomm, s=3):
    """One ``step()`` whose gradient is NaN on the last rank only (``nonfinite="skip"``): asserts it
    was skipped on every rank."""
    opt.zero_grad()
    x, y = _batch(rank, s)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    if rank == wcomm.Get_size() - 1:
        with torch.no_grad():
            next(model.parameters()).grad[0, 0] = float("nan")
    opt.step()
    mpi_assert(opt.stats.skipped, "the step was skipped on every rank", wcomm)


def straight_and_resumed(make, wcomm):
    """Ten steps of ``make(model)`` (a ``DistributedOptimizer``) with a state dict saved after six;
    a fresh model and optimizer loaded from it take the last four. Checks that the ranks end
    identical, the exchange was sparse and the resumed run reaches the straight run's bits.

    Returns:
        ``(opt, opt2)``: the straight run's optimizer and the resumed one, for the caller's checks.
    """
    rank = wcomm.Get_rank()
    model = _model()
    opt = make(model)
    _train(model, opt, rank, range(6))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _train(model, opt, rank, range(6, 10))
    mine = _flat(model.parameters())
    every = allgather_array(mine, wcomm)
    mpi_assert(all(r.tobytes() == mine.tobytes() for r in every), "ranks hold different parameters", wcomm)
    mpi_assert(opt.stats.density < 0.2, f"the exchange is sparse (density {opt.stats.density:.3g})", wcomm)

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model2 = _model(seed=99)
    opt2 = make(model2)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    _train(model2, opt2, rank, range(6, 10))
    mpi_assert(_flat(model2.parameters()).tobytes() == mine.tobytes(), "resume is not bit-exact", wcomm)
    return opt, opt2


def test_sparse_ranks_identical_moments_own_and_resume_bit_exact(wcomm):
    opt, _ = straight_and_resumed(lambda m: _make(m, wcomm, sparsifier="exdyna", density=0.05), wcomm)
    moments = allgather_array(opt._exdyna_adam.m.numpy(), wcomm)
    mpi_assert(wcomm.Get_size() == 1 or moments[0].tobytes() != moments[1].tobytes(),
               "the moments are each rank's own", wcomm)


def test_bfloat16_model_trains_and_ranks_agree(wcomm):
    rank = wcomm.Get_rank()
    model = _model().to(torch.bfloat16)
    opt = _make(model, wcomm, sparsifier="exdyna", density=0.05)
    before = _flat(p.float() for p in model.parameters())
    for s in range(5):
        x, y = _batch(rank, s)
        _step(model, opt, x.to(torch.bfloat16), y)
    after = _flat(p.float() for p in model.parameters())
    every = allgather_array(after, wcomm)
    mpi_assert(opt._exdyna_adam.m.dtype == torch.bfloat16 and np.isfinite(after).all()
               and not np.array_equal(before, after), "bfloat16 moments, finite parameters that moved", wcomm)
    mpi_assert(all(r.tobytes() == after.tobytes() for r in every), "ranks hold different parameters", wcomm)


def test_a_skipped_step_changes_nothing(wcomm):
    rank = wcomm.Get_rank()
    model = _model()
    opt = _make(model, wcomm, sparsifier="exdyna", density=0.05, nonfinite="skip")
    _train(model, opt, rank, range(3))
    path = opt._exdyna_adam
    kept = (_flat(model.parameters()), path.m.clone(), path.v.clone(), path.step)
    skipped_step(model, opt, rank, wcomm)
    mpi_assert(_flat(model.parameters()).tobytes() == kept[0].tobytes() and torch.equal(path.m, kept[1])
               and torch.equal(path.v, kept[2]) and path.step == kept[3], "a skipped step changed the state", wcomm)
    _train(model, opt, rank, range(4, 6))   # and training goes on from there
    mpi_assert(path.step == kept[3] + 2, f"steps counted after the skip: {path.step}", wcomm)


def test_refusals_are_collective_and_change_nothing(wcomm):
    rank = wcomm.Get_rank()
    model = _model()
    opt = _make(model, wcomm, sparsifier="exdyna", density=0.05)
    _train(model, opt, rank, range(3))
    good = opt.state_dict()
    path = opt._exdyna_adam
    kept = (path.m.clone(), path.v.clone(), path.step, opt.sparsifier.state_dict()["iteration"])
    bad = dict(good, exdyna_adam=dict(good["exdyna_adam"]))
    if rank == wcomm.Get_size() - 1:
        bad["exdyna_adam"]["v"] = bad["exdyna_adam"]["v"][:-1]
    msg = same_error_everywhere(lambda: opt.load_state_dict(bad), wcomm)
    mpi_assert("exdyna_adam.v" in msg, f"the error names the vector: {msg}", wcomm)
    mpi_assert(torch.equal(path.m, kept[0]) and torch.equal(path.v, kept[1]) and path.step == kept[2]
               and opt.sparsifier.state_dict()["iteration"] == kept[3], "a refused load changed the state", wcomm)
    nan = dict(good, exdyna_adam=dict(good["exdyna_adam"], m=good["exdyna_adam"]["m"] * float("nan")))
    same_error_everywhere(lambda: opt.load_state_dict(nan), wcomm)
    other = dict(good, exdyna_adam=dict(good["exdyna_adam"], mode="frozen"))
    msg = same_error_everywhere(lambda: opt.load_state_dict(other), wcomm)
    mpi_assert("adam='frozen'" in msg and "adam='update'" in msg, f"names both modes: {msg}", wcomm)
    live = {k: v for k, v in good.items() if k != "exdyna_adam"}
    with pytest.raises(ValueError, match="has no 'exdyna_adam'"):
        opt.load_state_dict(live)
    with pytest.raises(ValueError, match="needs torch.optim.Adam or AdamW"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm=wcomm, adam="update")
