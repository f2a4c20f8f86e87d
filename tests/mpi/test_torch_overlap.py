"""DistributedOptimizer(overlap=True): each exchange runs on a worker thread while the next gradient
is computed, and its result is applied one step late.

- The reference, computed here: the synchronous ``DistributedOptimizer`` of the same configuration
  given each gradient one step late (at call ``t`` its ``.grad`` is the gradient computed at call
  ``t - 1``, on the parameters of that moment). The overlapped run, flushed, must reach its bits
  on every rank, for the plain sparsifier step, the SGD recipe (clipping, a dense warm-up, momentum
  correction), AdamW on the sparse average, ``adam="demo"``, ``"demo-age"`` and ``adam="frozen"`` (its freeze
  falls between the warm-up's delayed update and the first sparse exchange).
- A checkpoint taken with an update pending resumes bit-exactly.
- A refused exchange is raised by the next ``step()`` on every rank with nothing applied, and
  training goes on; refused state dicts are refused on every rank and change nothing.
"""

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

import exdyna_mpi  # noqa: E402
from exdyna_mpi.adapters.torch import DistributedOptimizer  # noqa: E402
from tests.conftest import allgather_array, mpi_assert, same_error_everywhere  # noqa: E402
from tests.mpi.test_torch_adam_update import _train, straight_and_resumed  # noqa: E402
from tests.mpi.test_torch_options import _batch, _flat, _model, _step  # noqa: E402

pytestmark = pytest.mark.mpi

CONFIGS = {
    "sgd-exdyna": lambda m: (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3),
                             dict(sparsifier="exdyna", density=0.05)),
    "sgd-recipe": lambda m: (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                             dict(sparsifier="exdyna", density=0.01, clip_norm=0.5, warmup_steps=2)),
    "adamw-live-topk": lambda m: (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
                                  dict(sparsifier="topk", density=0.1)),
    "adamw-demo": lambda m: (torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.99, 0.95), weight_decay=0.1),
                             dict(sparsifier="exdyna", density=0.05, adam="demo")),
    "adamw-demo-age": lambda m: (torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.99, 0.95), weight_decay=0.1),
                                 dict(sparsifier="exdyna", density=0.05, adam="demo-age")),
    "adam-frozen": lambda m: (torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=0.01),
                              dict(sparsifier="exdyna", density=0.05, adam="frozen", warmup_steps=3)),
}


def _make(model, wcomm, config, overlap):
    opt, kw = CONFIGS[config](model)
    return DistributedOptimizer(opt, model, comm=wcomm, overlap=overlap, **kw)


def _grad(model, x, y):
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def late_step(ref_model, ref, now, late):
    """The reference's call: ``now`` (this call's gradient, taken on the reference's parameters as
    they are) is kept for the next call, and the synchronous optimizer ``ref`` steps on ``late`` (the
    previous call's; none at the first). Returns what to pass as ``late`` next time."""
    if late is not None:
        ref.zero_grad()
        for p, g in zip(ref_model.parameters(), late):
            p.grad.copy_(g)
        ref.step()
    return now


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_overlap_equals_the_synchronous_step_given_each_gradient_one_step_late(wcomm, config):
    rank = wcomm.Get_rank()
    steps = 9
    model, ref_model = _model(), _model()
    opt = _make(model, wcomm, config, overlap=True)
    ref = _make(ref_model, wcomm, config, overlap=False)
    late = None   # the reference's gradient of the previous call
    for t in range(steps):
        x, y = _batch(rank, t)
        _step(model, opt, x, y)
        late = late_step(ref_model, ref, _grad(ref_model, x, y), late)
        got, want = _flat(model.parameters()), _flat(ref_model.parameters())
        mpi_assert(got.tobytes() == want.tobytes(),
                   f"{config} call {t}: parameters differ from the late reference "
                   f"(max {np.abs(got - want).max():.3g})", wcomm)
    stats = opt.flush()
    late_step(ref_model, ref, None, late)
    got, want = _flat(model.parameters()), _flat(ref_model.parameters())
    mpi_assert(got.tobytes() == want.tobytes(), f"{config}: flushed parameters differ from the reference", wcomm)
    every = allgather_array(got, wcomm)
    mpi_assert(all(r.tobytes() == got.tobytes() for r in every), "ranks hold different parameters", wcomm)
    mpi_assert(stats is not None and stats.bytes_sent == ref.stats.bytes_sent,
               f"the flushed step's stats are the last exchange's ({stats})", wcomm)
    mpi_assert(opt.flush() is None, "a second flush has nothing to apply", wcomm)
    res, ref_res = opt.sparsifier.residual, ref.sparsifier.residual
    mpi_assert(res.tobytes() == ref_res.tobytes(), "the residuals differ from the reference's", wcomm)


@pytest.mark.parametrize("config", ["adamw-demo", "sgd-recipe"])
def test_resume_with_an_update_pending_is_bit_exact(wcomm, config):
    opt, opt2 = straight_and_resumed(lambda m: _make(m, wcomm, config, overlap=True), wcomm)
    mpi_assert(opt.state_dict()["exdyna_overlap"]["pending"] is not None, "an update is pending", wcomm)
    a, b = opt.state_dict(), opt2.state_dict()
    mpi_assert(torch.equal(a["exdyna_overlap"]["pending"], b["exdyna_overlap"]["pending"]),
               "the pending updates differ", wcomm)
    mpi_assert(opt.sparsifier.residual.tobytes() == opt2.sparsifier.residual.tobytes(),
               "the resumed residual differs", wcomm)


def test_a_refused_exchange_is_raised_by_the_next_step_everywhere(wcomm):
    rank, size = wcomm.Get_rank(), wcomm.Get_size()
    model = _model()
    opt = _make(model, wcomm, "adamw-demo", overlap=True)
    _train(model, opt, rank, range(3))
    opt.zero_grad()
    x, y = _batch(rank, 3)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    if rank == size - 1:
        with torch.no_grad():
            next(model.parameters()).grad[0, 0] = float("nan")
    opt.step()                        # hands the bad gradient over; the worker refuses it
    kept = (_flat(model.parameters()), opt._exdyna_adam.step)
    opt.zero_grad()
    x, y = _batch(rank, 4)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    msg = same_error_everywhere(opt.step, wcomm)
    mpi_assert("non-finite" in msg or "nan" in msg.lower(), f"the error names the bad values: {msg}", wcomm)
    mpi_assert(_flat(model.parameters()).tobytes() == kept[0].tobytes() and opt._exdyna_adam.step == kept[1],
               "the refusal applied something", wcomm)
    opt.step()                        # the same gradient again: handed over now
    _train(model, opt, rank, range(5, 8))
    opt.flush()
    mine = _flat(model.parameters())
    every = allgather_array(mine, wcomm)
    mpi_assert(all(r.tobytes() == mine.tobytes() for r in every), "ranks differ after the refusal", wcomm)
    mpi_assert(opt._exdyna_adam.step == kept[1] + 4, f"updates applied (batches 4-7): {opt._exdyna_adam.step}", wcomm)


def test_refused_state_dicts_change_nothing(wcomm):
    rank, size = wcomm.Get_rank(), wcomm.Get_size()
    model = _model()
    opt = _make(model, wcomm, "adamw-demo", overlap=True)
    _train(model, opt, rank, range(4))
    good = opt.state_dict()
    kept = (opt.sparsifier.residual, good["exdyna_overlap"]["pending"].clone())
    short = dict(good, exdyna_overlap=dict(good["exdyna_overlap"]))
    if rank == size - 1:
        short["exdyna_overlap"]["pending"] = kept[1][:-1]
    msg = same_error_everywhere(lambda: opt.load_state_dict(short), wcomm)
    mpi_assert("pending" in msg, f"the error names the pending update: {msg}", wcomm)
    missing = dict(good)
    if rank == 0:
        del missing["exdyna_overlap"]
    msg = same_error_everywhere(lambda: opt.load_state_dict(missing), wcomm)
    mpi_assert("exdyna_overlap" in msg, f"the error names the missing key: {msg}", wcomm)
    now = opt.state_dict()
    mpi_assert(opt.sparsifier.residual.tobytes() == kept[0].tobytes()
               and torch.equal(now["exdyna_overlap"]["pending"], kept[1]), "a refused load changed the state", wcomm)
    buf = io.BytesIO()
    torch.save(good, buf)
    buf.seek(0)
    opt.load_state_dict(torch.load(buf, weights_only=True))   # the good one still loads
    _train(model, opt, rank, range(4, 6))


def test_arguments_and_synchronize(wcomm):
    model = _model()
    with pytest.raises(ValueError, match="overlap must be True or False"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm=wcomm, overlap="yes")
    opt = _make(model, wcomm, "sgd-exdyna", overlap=True)
    with pytest.raises(RuntimeError, match="overlap=True"):
        opt.synchronize()
    mpi_assert(opt.flush() is None and opt.stats is None, "nothing to flush before the first step", wcomm)
    mpi_assert(isinstance(opt.sparsifier, exdyna_mpi.Sparsifier), "the sparsifier is there", wcomm)
