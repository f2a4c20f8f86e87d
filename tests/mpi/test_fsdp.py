"""FSDP2 (``fully_shard``) with ExDyna's sparse reduce-scatter (``ShardedExchange``), one to four
ranks, over a gloo process group that spans the MPI ranks.

- every call FSDP makes gets, on rank r, the shard r of the mean at the step's union of every
  rank's accumulator (gathered in the test and summed there in rank order, float32), zeros outside
  the union; the residual is the accumulator with the union zeroed; a replicated ExDyna fed the
  same inputs selects the same union and keeps the same residual, bit for bit;
- the unchanged loop (AdamW, ``clip_grad_norm_`` on the sharded gradients,
  ``zero_grad(set_to_none=True)``) trains, and every rank ends with the same full parameters;
- a checkpoint of the exchange resumes to the straight run's parameters bit for bit; one refused on
  one rank is refused on every rank with the same message and changes nothing;
- FSDP told to sum rather than average is refused with a clear error; a non-finite gradient on one
  rank fails every rank's backward with the same ``StepError`` and changes nothing; a bad density
  on one rank is refused on every rank;
- gradient accumulation with ``set_requires_gradient_sync(False)``: the exchange steps once per
  optimizer step.

At one rank FSDP makes no reduce-scatter (torch skips it), so the exchange is never called there.
"""
import copy
import hashlib

import numpy as np
import pytest
from mpi4py import MPI

from tests.conftest import mpi_assert, require, state_content

torch = require("torch")
fsdp = pytest.importorskip("torch.distributed.fsdp")

import exdyna_mpi  # noqa: E402
from exdyna_mpi.adapters.torch_fsdp import ShardedExchange  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("gloo")]

COMM = MPI.COMM_WORLD
P, ME = COMM.Get_size(), COMM.Get_rank()
DENSITY = 0.1
SIZES = (13, 29, 7, 3)      # uneven, so FSDP pads the shards


def _model(seed=0):
    torch.manual_seed(seed)
    layers = []
    for i in range(len(SIZES) - 1):
        layers.append(torch.nn.Linear(SIZES[i], SIZES[i + 1]))
        if i < len(SIZES) - 2:
            layers.append(torch.nn.Tanh())
    model = torch.nn.Sequential(*layers)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    return model


def _batch(step):
    g = torch.Generator().manual_seed(1000 * step + ME)
    return torch.randn(8, SIZES[0], generator=g), torch.randn(8, SIZES[-1], generator=g)


def _train_step(model, opt, step):
    x, y = _batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _full_params(model):
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()]).numpy()


def _digest(a):
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _round16(x, name):
    t = torch.bfloat16 if name == "bfloat16" else torch.float16
    return torch.from_numpy(x).to(t).to(torch.float32).numpy()   # nearest even; the values stay in range


@pytest.mark.parametrize("wire", [None, "bfloat16"])
def test_each_shard_is_the_rank_order_mean_at_the_union(wire):
    model = _model()
    options = {} if wire is None else {"wire_dtype": wire}
    exchange = ShardedExchange(model, DENSITY, **options)
    mpi_assert(len(exchange.units) == 3, f"units {sorted(exchange.units)}")
    calls = []
    for key, rs in exchange.units.items():
        sp = rs.sparsifier
        # float32 values: a replicated ExDyna fed the same gradients must select and keep the same
        twin = exdyna_mpi.make("exdyna", sp.numel, DENSITY, COMM) if wire is None else None
        unions = []
        orig = sp.average_at

        def spy(acc, union, out, sec, done=False, _seen=unions, _orig=orig):
            _seen.append(np.sort(np.array(union, copy=True)))
            return _orig(acc, union, out, sec, done)
        sp.average_at = spy
        step = sp.step

        def recorder(grad, out=None, _sp=sp, _twin=twin, _step=step, _key=key, _unions=unions):
            acc = _sp.residual + grad.numpy()               # what the step accumulates
            if _twin is not None:
                _twin.step(grad.numpy().copy())
            res = _step(grad, out=out)
            calls.append((_key, acc, _unions[-1] if P > 1 else None, grad.numpy().copy(), _sp.residual.copy(),
                          None if _twin is None else _twin.residual.copy()))
            return res
        sp.step = recorder
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = [_train_step(model, opt, t) for t in range(4)]
    if P == 1:   # one rank: FSDP makes no reduce-scatter, the gradient stays the rank's own
        mpi_assert(not calls, f"{len(calls)} reduce-scatters at one rank")
        return
    mpi_assert(len(calls) == 4 * 3, f"{len(calls)} reduce-scatters")
    for key, acc, union, out, residual, twin_residual in calls:
        n = acc.shape[0]
        s = n // P
        accs = COMM.allgather(acc)
        total = np.zeros(union.shape[0], np.float32)
        for r in range(P):                       # rank order, float32; the others' values as they travel
            v = accs[r][union]
            total = total + (v if wire is None or r == ME else _round16(v, wire))
        want = np.zeros(n, np.float32)
        want[union] = total / np.float32(P)
        shard = slice(ME * s, (ME + 1) * s)
        mpi_assert(out[shard].tobytes() == want[shard].tobytes(), f"{key}/{wire}: the shard differs from the mean")
        keep = acc.copy()
        keep[union] = 0.0 if wire is None else acc[union] - _round16(acc[union], wire)
        mine = union[(union >= ME * s) & (union < (ME + 1) * s)]
        keep[mine] = 0.0                         # the owner's own values are consumed
        mpi_assert(residual.tobytes() == keep.tobytes(), f"{key}/{wire}: the residual")
        if twin_residual is not None:
            mpi_assert(residual.tobytes() == twin_residual.tobytes(),
                       f"{key}: the replicated step kept another residual")
    mpi_assert(np.isfinite(losses).all(), f"losses {losses}")
    digests = COMM.allgather(_digest(_full_params(model)))
    mpi_assert(len(set(digests)) == 1, "ranks hold different parameters")


def _run(steps, state=None, save_at=None):
    model = _model()
    exchange = ShardedExchange(model, DENSITY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    saved = None
    for t in range(steps):
        if t == save_at:
            # torch's state dicts hold the live tensors: copies, as a checkpoint file would
            saved = copy.deepcopy((exchange.state_dict(), opt.state_dict(), model.state_dict()))
        _train_step(model, opt, t)
    return model, exchange, opt, saved


def test_a_resumed_exchange_reaches_the_straight_runs_parameters():
    straight, _, _, saved = _run(6, save_at=3)
    ex_state, opt_state, params = saved
    model = _model()
    exchange = ShardedExchange(model, DENSITY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    opt.load_state_dict(opt_state)                      # torch's usual order: optimizer, model, then ours
    model.load_state_dict(params)
    exchange.load_state_dict(ex_state)
    for t in range(3, 6):
        _train_step(model, opt, t)
    a, b = _full_params(straight), _full_params(model)
    mpi_assert(a.tobytes() == b.tobytes(), f"resumed differs by {np.abs(a - b).max()}")


@pytest.mark.parametrize("fault", ["missing-unit", "wrong-size"])
def test_a_checkpoint_bad_on_one_rank_is_refused_everywhere(fault):
    model, exchange, opt, saved = _run(3, save_at=2)
    now = state_content(exchange.state_dict())
    bad = copy.deepcopy(saved[0])              # an older, good checkpoint, spoiled on the last rank
    last = list(bad)[-1]                       # the units before it load first, then are undone
    if ME == P - 1:
        if fault == "missing-unit":
            bad.pop(last)
        else:
            bad[last]["numel"] += 1
    msg = ""
    try:
        exchange.load_state_dict(bad)
    except Exception as e:   # the library's collective error, the same text everywhere
        msg = str(e)
    msgs = COMM.allgather(msg)
    mpi_assert(msgs[0] and len(set(msgs)) == 1, f"{msgs}")
    mpi_assert(state_content(exchange.state_dict()) == now, f"{fault}: a refused load changed the exchange")


def test_forced_sums_are_refused():
    model = _model()
    ShardedExchange(model, DENSITY)
    for m in model.modules():
        if isinstance(m, fsdp.FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    x, y = _batch(0)
    msg = ""
    try:
        torch.nn.functional.mse_loss(model(x), y).backward()
    except ValueError as e:
        msg = str(e)
    mpi_assert(("must average gradients" in msg) if P > 1 else msg == "", msg)   # one rank: no reduce-scatter


def test_a_non_finite_gradient_on_one_rank_fails_every_ranks_backward():
    model = _model()
    sharded = ShardedExchange(model, DENSITY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt, 0)
    before = state_content(sharded.state_dict())
    x, y = _batch(1)
    if ME == P - 1:
        x[0, 0] = float("nan")
    msg = ""
    try:
        torch.nn.functional.mse_loss(model(x), y).backward()
    except exdyna_mpi.StepError as e:
        msg = str(e)
    msgs = COMM.allgather(msg)
    if P == 1:   # no reduce-scatter at one rank: nothing of the exchange runs
        mpi_assert(msgs == [""], f"{msgs}")
        return
    mpi_assert(msgs[0] and len(set(msgs)) == 1 and "non-finite" in msgs[0], f"{msgs}")
    mpi_assert(state_content(sharded.state_dict()) == before, "a refused step changed the exchange")


@pytest.mark.parametrize("where", ["one rank", "every rank"])
def test_a_bad_density_is_refused_on_every_rank(where):
    density = 1.5 if (where == "every rank" or ME == P - 1) else DENSITY
    msg = ""
    try:
        ShardedExchange(_model(), density)
    except ValueError as e:
        msg = str(e)
    msgs = COMM.allgather(msg)
    mpi_assert(msgs[0] and len(set(msgs)) == 1 and "density" in msgs[0], f"{msgs}")


def test_accumulation_without_sync_steps_the_exchange_once():
    """``set_requires_gradient_sync(False)`` on all but the last micro-batch: FSDP reduces once, and
    the exchange steps once per optimizer step, on the micro-batches' summed gradient."""
    model = _model()
    sharded = ShardedExchange(model, DENSITY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        for micro in range(3):
            model.set_requires_gradient_sync(micro == 2)
            x, y = _batch(10 * step + micro)
            torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    iterations = {k: rs.sparsifier.iteration for k, rs in sharded.units.items()}
    mpi_assert(set(iterations.values()) == ({0} if P == 1 else {2}), f"iterations {iterations}")
    mpi_assert(len(set(COMM.allgather(_digest(_full_params(model))))) == 1, "ranks hold different parameters")
