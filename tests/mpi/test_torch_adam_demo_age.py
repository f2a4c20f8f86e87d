"""DistributedOptimizer(adam="demo-age"): DeMo's decoupled momentum, each sign scaled by the root of its wait.

- Its arithmetic against a reference computed in the test (the union top-k exchange, the steps of
  the last moves included) is checked beside ``"demo"``'s, in tests/mpi/test_torch_adam_demo.py.
- The scale is not ``"demo"``'s: the same run under ``"demo"`` ends elsewhere.
- With ExDyna at 5 %, also with bfloat16 values on the wire and on bfloat16 parameters: every
  rank holds the same parameters and the same steps of the last moves, and a state dict resumes
  bit-exactly through ``torch.save``/``torch.load(weights_only=True)``.
- A step skipped everywhere changes nothing, the steps of the last moves included (beside
  ``"demo"``'s, in tests/mpi/test_torch_adam_demo.py); a dict whose ``moved`` is of the wrong
  length, dtype or range on one rank, or of ``adam="demo"``, is refused on every rank with the
  same error and nothing changes.
"""

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

from exdyna_mpi.adapters.torch import DistributedOptimizer  # noqa: E402
from tests.conftest import allgather_array, mpi_assert, same_error_everywhere  # noqa: E402
from tests.mpi.test_hook_recipe import _bits  # noqa: E402
from tests.mpi.test_torch_adam_update import _train  # noqa: E402
from tests.mpi.test_torch_options import _batch, _flat, _model, _step  # noqa: E402

pytestmark = pytest.mark.mpi
LR, BETAS, WD = 1e-2, (0.9, 0.95), 0.1


def _make(model, wcomm, cls=torch.optim.AdamW, adam="demo-age", **kw):
    opt = cls(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    return DistributedOptimizer(opt, model, comm=wcomm, adam=adam, **kw)


def test_the_scale_is_not_demos(wcomm):
    rank = wcomm.Get_rank()
    runs = {}
    for adam in ("demo", "demo-age"):
        model = _model()
        opt = _make(model, wcomm, adam=adam, sparsifier="exdyna", density=0.05)
        _train(model, opt, rank, range(6))
        runs[adam] = _flat(model.parameters())
    mpi_assert(runs["demo"].tobytes() != runs["demo-age"].tobytes(), "'demo-age' moved as 'demo' did", wcomm)


def _run(model, opt, rank, steps, dtype):
    for s in steps:
        x, y = _batch(rank, s)
        _step(model, opt, x.to(dtype), y)


@pytest.mark.parametrize("variant", ["float32", "wire-bfloat16", "bfloat16-parameters"])
def test_exdyna_ranks_identical_and_resume_bit_exact(wcomm, variant):
    """Ten steps with a state dict saved after six; a fresh model and optimizer loaded from it take
    the last four and reach the straight run's bits."""
    rank = wcomm.Get_rank()
    dtype = torch.bfloat16 if variant == "bfloat16-parameters" else torch.float32
    kw = {"wire_dtype": "bfloat16"} if variant == "wire-bfloat16" else {}

    def make(seed):
        model = _model(seed=seed).to(dtype)
        return model, _make(model, wcomm, sparsifier="exdyna", density=0.05, **kw)

    model, opt = make(5)
    _run(model, opt, rank, range(6), dtype)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _run(model, opt, rank, range(6, 10), dtype)
    mine = _bits(model)
    every = allgather_array(mine, wcomm)
    mpi_assert(all(np.array_equal(r, mine) for r in every), "ranks hold different parameters", wcomm)
    moved = opt._exdyna_adam.moved
    every = allgather_array(moved.numpy(), wcomm)
    mpi_assert(all(np.array_equal(r, every[0]) for r in every), "ranks hold different steps of the last moves",
               wcomm)
    mpi_assert(int(moved.max()) == 10 and 0 < int((moved > 0).sum()) < moved.numel(),
               f"moves recorded up to step {int(moved.max())}, {int((moved > 0).sum())} coordinates", wcomm)

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model2, opt2 = make(99)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    _run(model2, opt2, rank, range(6, 10), dtype)
    mpi_assert(np.array_equal(_bits(model2), mine), "resume is not bit-exact", wcomm)
    mpi_assert(opt2.sparsifier.residual.tobytes() == opt.sparsifier.residual.tobytes(),
               "the resumed momentum differs", wcomm)
    mpi_assert(torch.equal(opt2._exdyna_adam.moved, moved), "the resumed steps of the last moves differ", wcomm)


@pytest.mark.parametrize("fault", ["length", "dtype", "ahead", "negative", "mode"])
def test_a_bad_dict_on_one_rank_is_refused_everywhere(wcomm, fault):
    rank = wcomm.Get_rank()
    model = _model()
    opt = _make(model, wcomm, sparsifier="exdyna", density=0.05)
    _train(model, opt, rank, range(3))
    good = opt.state_dict()
    path = opt._exdyna_adam
    kept = (_flat(model.parameters()), opt.sparsifier.residual, path.step, path.moved.clone(),
            opt.sparsifier.state_dict()["iteration"])
    bad = dict(good, exdyna_adam=dict(good["exdyna_adam"]))
    moved = good["exdyna_adam"]["moved"]
    if rank == wcomm.Get_size() - 1:
        bad["exdyna_adam"].update({
            "length": {"moved": moved[:-1]},
            "dtype": {"moved": moved.to(torch.int64)},
            "ahead": {"moved": moved + 1},
            "negative": {"moved": moved - 4},
            "mode": {"mode": "demo"},
        }[fault])
    msg = same_error_everywhere(lambda: opt.load_state_dict(bad), wcomm)
    want = "adam='demo'" if fault == "mode" else "moved"
    mpi_assert(want in msg, f"the error names {want}: {msg}", wcomm)
    mpi_assert(_flat(model.parameters()).tobytes() == kept[0].tobytes()
               and opt.sparsifier.residual.tobytes() == kept[1].tobytes() and path.step == kept[2]
               and torch.equal(path.moved, kept[3]) and opt.sparsifier.state_dict()["iteration"] == kept[4],
               "a refused load changed the state", wcomm)
