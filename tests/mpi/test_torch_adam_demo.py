"""DistributedOptimizer(adam="demo"): DeMo's decoupled momentum, the residual as the momentum.

- With the union top-k exchange, under ``"demo"`` and ``"demo-age"``, the parameters and every
  rank's residual equal a reference computed here (``"demo-age"``: each move scaled by ``sqrt`` of
  the steps since the coordinate last moved, whose record the path's ``moved`` must equal): each
  rank's momentum ``m = beta1 m + g`` (Adam's coupled decay in ``g``), its top-k by magnitude, the
  union of the ranks' selections averaged, ``theta -= lr * sign(avg)`` after AdamW's decoupled
  decay, the sent entries removed from every rank's momentum.
- With ExDyna at 5 %: every rank holds the same parameters, the residuals differ (each rank's own
  momentum), and a state dict resumes bit-exactly.
- A step skipped everywhere leaves parameters, residual (the decay included) and step count as
  they were; a dict of another ``beta1`` or mode is refused on every rank with the same error;
  param groups with different ``betas[0]`` are refused at construction.
- The default ``adam="auto"`` runs ``"demo-age"`` (``"demo"`` with age-scaled signs,
  tests/mpi/test_torch_adam_demo_age.py) for Adam/AdamW with ExDyna and ``"live"`` for other
  sparsifiers, optimizers, ``amsgrad`` and mixed ``betas[0]``; the DDP hook's default follows it.
  Its values travel as float8 e4m3fn for float32 parameters unless ``wire_dtype`` is given (None
  included); bfloat16 parameters and ``"demo-age"`` by name keep the gradient's values.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

from exdyna_mpi.adapters.torch import DistributedOptimizer  # noqa: E402
from tests.conftest import allgather_array, mpi_assert, same_error_everywhere  # noqa: E402
from tests.mpi.test_torch_adam import _grad_at  # noqa: E402
from tests.mpi.test_torch_adam_update import _train, skipped_step, straight_and_resumed  # noqa: E402
from tests.mpi.test_torch_options import _batch, _flat, _model, _step  # noqa: E402

pytestmark = pytest.mark.mpi
LR, BETAS, WD = 1e-2, (0.9, 0.95), 0.1


def _make(model, wcomm, cls=torch.optim.AdamW, betas=BETAS, adam="demo", **kw):
    opt = cls(model.parameters(), lr=LR, betas=betas, weight_decay=WD)
    return DistributedOptimizer(opt, model, comm=wcomm, adam=adam, **kw)


@pytest.mark.parametrize("adam", ["demo", "demo-age"])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_topk_exchange_equals_decoupled_momentum_computed_here(wcomm, cls, adam):
    """``"demo-age"`` moves each coordinate by ``sqrt`` of the steps since it last moved times what
    ``"demo"`` moves it; the reference tracks those steps and checks the path's ``moved`` too."""
    rank, size = wcomm.Get_rank(), wcomm.Get_size()
    model = _model()
    density = 0.1
    opt = _make(model, wcomm, cls, adam=adam, sparsifier="topk", density=density)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))   # the lr is read at each step
    theta = _flat(model.parameters()).astype(np.float64)
    n = theta.shape[0]
    k = max(1, int(density * n))
    m = np.zeros(n)
    moved = np.zeros(n)                              # the step of each coordinate's last move
    waits = set()
    beta1 = BETAS[0]
    decoupled = cls is torch.optim.AdamW
    for t in range(1, 9):
        lr = LR / t
        x, y = _batch(rank, t)
        g = _grad_at(model, theta, x, y)
        if not decoupled:
            g = g + WD * theta
        m = m + g                                    # decayed after the previous exchange (below)
        every = allgather_array(m, wcomm)
        union = np.zeros(n, bool)
        for mr in every:                             # each rank's top-k by magnitude, ties at the k-th taken
            union |= np.abs(mr) >= np.sort(np.abs(mr))[-k]
        avg = every.mean(axis=0)
        moves = union & (avg != 0)                   # a zero average's sign moves nothing
        wait = t - moved[moves]
        waits.update(wait.astype(int).tolist())
        scale = np.sqrt(wait) if adam == "demo-age" else 1.0
        expect = theta * (1 - lr * WD) if decoupled else theta.copy()
        expect[moves] -= lr * scale * np.sign(avg[moves])
        moved[moves] = t
        m[union] = 0.0
        m *= beta1
        _step(model, opt, x, y)
        sched.step()
        got = _flat(model.parameters()).astype(np.float64)
        err = np.abs(got - expect).max()
        mpi_assert(err < 1e-5, f"{cls.__name__} {adam} step {t}: max |theta - reference| {err:.3g}", wcomm)
        res_err = np.abs(opt.sparsifier.residual.astype(np.float64) - m).max() / max(np.abs(m).max(), 1e-30)
        mpi_assert(res_err < 1e-5, f"step {t}: the residual is not the decayed momentum ({res_err:.3g})", wcomm)
        if adam == "demo-age":
            mpi_assert(np.array_equal(opt._exdyna_adam.moved.numpy(), moved),
                       f"step {t}: the steps of the last moves differ from the reference", wcomm)
        theta = got
    mpi_assert(opt._exdyna_adam.step == 8, f"steps counted: {opt._exdyna_adam.step}", wcomm)
    mpi_assert(1 in waits and max(waits) >= 3, f"the run scaled no long wait (waits {sorted(waits)})", wcomm)
    if size > 1:
        res = allgather_array(opt.sparsifier.residual, wcomm)
        mpi_assert(res[0].tobytes() != res[1].tobytes(), "each rank's momentum is its own", wcomm)


def test_exdyna_ranks_identical_and_resume_bit_exact(wcomm):
    opt, opt2 = straight_and_resumed(lambda m: _make(m, wcomm, sparsifier="exdyna", density=0.05), wcomm)
    mpi_assert(opt2.sparsifier.residual.tobytes() == opt.sparsifier.residual.tobytes(),
               "the resumed momentum differs", wcomm)


@pytest.mark.parametrize("adam", ["demo", "demo-age"])
def test_a_skipped_step_changes_nothing(wcomm, adam):
    """Under ``"demo-age"`` the steps of the last moves stay too."""
    rank = wcomm.Get_rank()
    model = _model()
    opt = _make(model, wcomm, adam=adam, sparsifier="exdyna", density=0.05, nonfinite="skip")
    _train(model, opt, rank, range(3))
    path = opt._exdyna_adam
    kept = (_flat(model.parameters()), opt.sparsifier.residual, path.step)
    moved = path.moved.clone() if adam == "demo-age" else None
    skipped_step(model, opt, rank, wcomm)
    mpi_assert(_flat(model.parameters()).tobytes() == kept[0].tobytes()
               and opt.sparsifier.residual.tobytes() == kept[1].tobytes() and path.step == kept[2]
               and (moved is None or torch.equal(path.moved, moved)),
               "a skipped step changed the state (or decayed the momentum)", wcomm)
    _train(model, opt, rank, range(4, 6))
    mpi_assert(path.step == kept[2] + 2, f"steps counted after the skip: {path.step}", wcomm)


def test_refusals_are_collective_and_change_nothing(wcomm):
    rank = wcomm.Get_rank()
    model = _model()
    opt = _make(model, wcomm, sparsifier="exdyna", density=0.05)
    _train(model, opt, rank, range(3))
    good = opt.state_dict()
    kept = (opt.sparsifier.residual, opt._exdyna_adam.step, opt.sparsifier.state_dict()["iteration"])
    bad = dict(good, exdyna_adam=dict(good["exdyna_adam"]))
    if rank == wcomm.Get_size() - 1:
        bad["exdyna_adam"]["beta1"] = 0.5   # a momentum of another decay
    msg = same_error_everywhere(lambda: opt.load_state_dict(bad), wcomm)
    mpi_assert("beta1" in msg, f"the error names beta1: {msg}", wcomm)
    mpi_assert(opt.sparsifier.residual.tobytes() == kept[0].tobytes() and opt._exdyna_adam.step == kept[1]
               and opt.sparsifier.state_dict()["iteration"] == kept[2], "a refused load changed the state", wcomm)
    other = dict(good, exdyna_adam=dict(good["exdyna_adam"], mode="update"))
    msg = same_error_everywhere(lambda: opt.load_state_dict(other), wcomm)
    mpi_assert("adam='update'" in msg and "adam='demo'" in msg, f"names both modes: {msg}", wcomm)
    two = torch.nn.Linear(4, 2)
    groups = [{"params": [two.weight], "betas": (0.9, 0.95)}, {"params": [two.bias], "betas": (0.8, 0.95)}]
    with pytest.raises(ValueError, match="one betas"):
        DistributedOptimizer(torch.optim.AdamW(groups, lr=LR), two, comm=wcomm, adam="demo")
    with pytest.raises(ValueError, match="needs torch.optim.Adam or AdamW"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm=wcomm, adam="demo")


def test_auto_runs_demo_age_for_adam_with_exdyna_and_live_elsewhere(wcomm):
    from exdyna_mpi.adapters.torch import ExDynaHookState

    def mode(make_opt, sparsifier="exdyna", **kw):
        model = _model()
        opt = DistributedOptimizer(make_opt(model.parameters()), model, sparsifier=sparsifier,
                                   density=1.0 if sparsifier == "dense" else 0.05, comm=wcomm, **kw)
        return None if opt._exdyna_adam is None else opt._exdyna_adam.mode

    def adamw(ps):
        return torch.optim.AdamW(ps, lr=LR, betas=(0.99, 0.95))

    def two_betas(ps):
        ps = list(ps)
        return torch.optim.AdamW([{"params": ps[:2], "betas": (0.9, 0.95)}, {"params": ps[2:], "betas": (0.99, 0.95)}])

    cases = {
        "AdamW, exdyna": (mode(adamw), "demo-age"),
        "Adam, exdyna": (mode(lambda ps: torch.optim.Adam(ps, lr=LR)), "demo-age"),
        "AdamW, topk": (mode(adamw, "topk"), None),
        "AdamW, dense": (mode(adamw, "dense"), None),
        "SGD, exdyna": (mode(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)), None),
        "AdamW amsgrad": (mode(lambda ps: torch.optim.AdamW(ps, amsgrad=True)), None),
        "AdamW, two betas[0]": (mode(two_betas), None),
        "AdamW, adam='live'": (mode(adamw, adam="live"), None),
    }
    for name, (got, want) in cases.items():
        mpi_assert(got == want, f"{name}: adam='auto' ran {got!r}, expected {want!r}", wcomm)
    model = _model()
    state = ExDynaHookState("exdyna", 0.05, comm=wcomm, optimizer=adamw(model.parameters()))
    mpi_assert(state._adam is not None and state._adam.mode == "demo-age", "the DDP hook's default is not 'demo-age'",
               wcomm)
    mpi_assert(state.options.get("wire_dtype") == "float8_e4m3fn", f"the DDP hook's values: {state.options}", wcomm)
    state = ExDynaHookState("topk", 0.05, comm=wcomm, optimizer=adamw(model.parameters()))
    mpi_assert(state._adam is None, "the DDP hook ran an Adam path for top-k", wcomm)


def test_auto_sends_float8_values_unless_told_otherwise(wcomm):
    def wire(adam="auto", dtype=torch.float32, **kw):
        model = _model().to(dtype)
        opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.99, 0.95)), model,
                                   sparsifier="exdyna", density=0.05, comm=wcomm, adam=adam, **kw)
        return opt.sparsifier.wire_dtype, opt.sparsifier.output

    cases = {
        "auto": (wire(), ("float8_e4m3fn", "sign")),
        "auto, wire_dtype=None": (wire(wire_dtype=None), (None, "sign")),
        "auto, bfloat16 values asked": (wire(wire_dtype="bfloat16"), ("bfloat16", "sign")),
        "auto, bfloat16 parameters": (wire(dtype=torch.bfloat16), (None, "sign")),
        "demo-age by name": (wire(adam="demo-age"), (None, "sign")),
    }
    for name, (got, want) in cases.items():
        mpi_assert(got == want, f"{name}: (wire_dtype, output) {got!r}, expected {want!r}", wcomm)
