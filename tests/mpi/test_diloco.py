"""``DiLoCo``: local steps, then an outer step on the averaged parameter delta, on 1..4 ranks.

- with ``"dense"``, each outer step equals a reference DiLoCo step computed here (the mean of the
  ranks' deltas gathered with mpi4py, Nesterov momentum by its formula), and the local model
  restarts from the global parameters;
- with ``"exdyna"`` (and 16-bit wire values), ranks end bit-identical, and error feedback loses
  nothing: P x the applied delta equals the sum over ranks of (delta + residual before - residual
  after); 16-bit values halve the value bytes;
- resume between any two inner steps (a new model, inner optimizer and ``DiLoCo`` loaded from the
  dicts) reaches the straight run's bits;
- ``error_decay`` (SparseLoCo's decayed accumulator): what was sent equals the decayed error
  feedback's account, ranks identical, resume bit-exact, another decay refused at load;
- the defaults: a sparse exchange runs SparseLoCo's recipe (decay 0.95, outer SGD at lr 1), the
  dense one DiLoCo's Nesterov step, bit for bit the same as those options given;
- refusals: a bad ``sync_every`` or ``error_decay`` and a dict corrupt on one rank (the same error on every rank,
  nothing changed); a non-finite delta on one rank raises ``StepError`` everywhere.
"""
import copy
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

import exdyna_mpi  # noqa: E402
from exdyna_mpi.adapters.torch import DiLoCo, nesterov_sgd, plain_sgd  # noqa: E402
from tests.conftest import allgather_array, mpi_assert, same_error_everywhere  # noqa: E402

pytestmark = pytest.mark.mpi

H = 3


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))


def _batch(rank, s):
    g = torch.Generator().manual_seed(100 * s + rank)
    return torch.randn(16, 12, generator=g), torch.randint(0, 3, (16,), generator=g)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def _inner(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _step(model, opt, rank, s):
    x, y = _batch(rank, s)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return opt.step()


def test_dense_outer_step_equals_reference_diloco(wcomm):
    rank = wcomm.Get_rank()
    model, ref = _model(seed=rank), _model(seed=0)   # DiLoCo broadcasts rank 0's (seed 0)
    opt = DiLoCo(_inner(model), model, sync_every=H, comm=wcomm)
    ref_inner = _inner(ref)
    glob, buf = _flat(ref), np.zeros(_flat(ref).size, dtype=np.float32)
    lr, m = 0.7, 0.9
    for s in range(3 * H):
        stats = _step(model, opt, rank, s)
        _step(ref, ref_inner, rank, s)
        if (s + 1) % H:
            mpi_assert(stats is None and np.allclose(_flat(model), _flat(ref), rtol=1e-5, atol=1e-6),
                       f"step {s}: the inner step differs from the plain optimizer's", wcomm)
            continue
        deltas = allgather_array(glob - _flat(ref), wcomm).astype(np.float64)
        g = deltas.mean(axis=0).astype(np.float32)
        buf = m * buf + g                      # torch's SGD: buf <- m*buf + g (dampening 0)
        glob = glob - lr * (g + m * buf)       # Nesterov: p <- p - lr*(g + m*buf)
        with torch.no_grad():
            sizes = [p.numel() for p in ref.parameters()]
            for p, v in zip(ref.parameters(), torch.from_numpy(glob.copy()).split(sizes)):
                p.copy_(v.view_as(p))
        got = _flat(model)
        mpi_assert(isinstance(stats, exdyna_mpi.Stats) and opt.inner_steps == 0, f"step {s}: no outer step", wcomm)
        mpi_assert(np.allclose(got, glob, rtol=1e-5, atol=1e-6),
                   f"outer step {opt.outer_steps}: max diff from the reference {np.abs(got - glob).max():.3g}", wcomm)
        mpi_assert(np.array_equal(got, opt.global_params.detach().numpy()), "the local model did not restart", wcomm)
        digests = wcomm.allgather(got.tobytes())
        mpi_assert(len(set(digests)) == 1, f"outer step {opt.outer_steps}: ranks differ", wcomm)
        glob = got.copy()   # follow the library's bits (the sum's rounding may differ in the last place)
    mpi_assert(opt.outer_steps == 3, f"{opt.outer_steps} outer steps", wcomm)


@pytest.mark.parametrize("wire", [None, "bfloat16"])
def test_exdyna_outer_exchange_is_identical_on_every_rank_and_loses_nothing(wire, wcomm):
    rank, size = wcomm.Get_rank(), wcomm.Get_size()
    model = _model()
    options = {} if wire is None else {"wire_dtype": wire}
    opt = DiLoCo(_inner(model), model, sync_every=H, sparsifier="exdyna", density=0.05, comm=wcomm,
                 outer_optimizer=nesterov_sgd, error_decay=1.0, **options)   # the applied delta from the momentum
    for s in range(4 * H):
        if (s + 1) % H == 0:
            glob = opt.global_params.detach().numpy().copy()
            res_before = np.zeros_like(glob) if opt.outer_steps == 0 else opt.sparsifier.residual.copy()
            _step(model, opt.optimizer, rank, s)   # the inner step by hand, then the outer one
            delta = glob - _flat(model)
            buf_before = (opt.outer.state[opt.global_params]["momentum_buffer"].numpy().copy()
                          if opt.outer_steps else None)
            opt.inner_steps += 1
            stats = opt.sync()
            res_after = opt.sparsifier.residual.copy()
            # the applied (averaged) delta, recovered from the outer optimizer's momentum
            buf = opt.outer.state[opt.global_params]["momentum_buffer"].numpy()
            applied = buf - (0.9 * buf_before if buf_before is not None else 0)
            sent = allgather_array((delta + res_before - res_after).astype(np.float64), wcomm).sum(axis=0)
            mpi_assert(np.allclose(size * applied, sent, rtol=1e-3, atol=1e-6),
                       f"outer step {opt.outer_steps}: error feedback lost {np.abs(size * applied - sent).max():.3g}",
                       wcomm)
            mpi_assert(0 < stats.density <= 0.05 * size * 1.2, f"density {stats.density}", wcomm)
        else:
            _step(model, opt, rank, s)
    digests = wcomm.allgather(_flat(model).tobytes())
    mpi_assert(len(set(digests)) == 1, "ranks differ after the outer steps", wcomm)
    value_bytes = wcomm.allgather(opt.stats.bytes_sent)
    mpi_assert(min(value_bytes) > 0 or size == 1, f"bytes {value_bytes}", wcomm)
    opt.close()


def test_16_bit_values_send_fewer_bytes(wcomm):
    if wcomm.Get_size() == 1:
        pytest.skip("one rank sends nothing")
    sent = {}
    for wire in (None, "bfloat16"):
        model = _model()
        options = {} if wire is None else {"wire_dtype": wire}
        opt = DiLoCo(_inner(model), model, sync_every=1, sparsifier="dense", comm=wcomm, **options)
        _step(model, opt, wcomm.Get_rank(), 0)
        sent[wire] = opt.stats.bytes_sent
    mpi_assert(sent["bfloat16"] < 0.6 * sent[None], f"bytes per outer step {sent}", wcomm)


@pytest.mark.parametrize("at", [1, 3, 4])
@pytest.mark.parametrize("name, options", [("dense", {}), ("exdyna", {}),   # the sparse default decays the residual
                                           ("exdyna", {"outer_optimizer": nesterov_sgd, "error_decay": 1.0})])
def test_resume_between_inner_steps_is_bit_exact(name, options, at, wcomm):
    rank, steps = wcomm.Get_rank(), 3 * H

    def build(seed):
        model = _model(seed=seed)
        return model, DiLoCo(_inner(model), model, sync_every=H, sparsifier=name, density=0.05, comm=wcomm,
                             **options)

    model, opt = build(0)
    for s in range(steps):
        _step(model, opt, rank, s)
    straight = _flat(model)

    model, opt = build(0)
    for s in range(at):
        _step(model, opt, rank, s)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    for s in range(at, at + 2):   # train on, so the load has something to undo
        _step(model, opt, rank, s)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model, opt = build(5)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    mpi_assert(opt.inner_steps == at % H and opt.outer_steps == at // H, f"position {opt.inner_steps}", wcomm)
    for s in range(at, steps):
        _step(model, opt, rank, s)
    mpi_assert(np.array_equal(straight.view(np.uint32), _flat(model).view(np.uint32)),
               f"{name} {options} resumed at {at}: differs from the straight run", wcomm)


@pytest.mark.parametrize("name, explicit, decay, outer", [
    ("exdyna", {"outer_optimizer": plain_sgd, "error_decay": 0.95}, 0.95, {"lr": 1.0, "momentum": 0}),
    ("dense", {"outer_optimizer": nesterov_sgd, "error_decay": 1.0}, 1.0, {"lr": 0.7, "momentum": 0.9})])
def test_defaults_follow_the_exchange(name, explicit, decay, outer, wcomm):
    rank = wcomm.Get_rank()
    runs = []
    for options in ({}, explicit):
        model = _model()
        opt = DiLoCo(_inner(model), model, sync_every=H, sparsifier=name, density=0.05, comm=wcomm, **options)
        for s in range(3 * H):
            _step(model, opt, rank, s)
        runs.append((_flat(model), opt))
    (default_bits, opt), (explicit_bits, _) = runs
    group = opt.outer.param_groups[0]
    mpi_assert(opt.error_decay == decay and all(group[k] == v for k, v in outer.items())
               and group["nesterov"] == (name == "dense"), f"{name}: decay {opt.error_decay}, outer {group}", wcomm)
    mpi_assert(default_bits.tobytes() == explicit_bits.tobytes(), f"{name}: the default is not {explicit}", wcomm)
    for _, o in runs:
        o.close()


def test_decayed_error_feedback_is_sparselocos_accumulator(wcomm):
    """``error_decay=beta`` with a plain outer SGD at lr 1 (SparseLoCo's recipe): every outer step
    sends from ``beta * e + delta`` and keeps the rest, so with the residual read after each step
    (already decayed) ``P x applied == sum over ranks of (delta + e_before - e_after / beta)``; the
    global parameters move by exactly the applied delta; ranks identical."""
    rank, size = wcomm.Get_rank(), wcomm.Get_size()
    beta = 0.5
    model = _model()
    opt = DiLoCo(_inner(model), model, sync_every=H, sparsifier="exdyna", density=0.05, comm=wcomm,
                 outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0), error_decay=beta)
    for s in range(4 * H):
        if (s + 1) % H != 0:
            _step(model, opt, rank, s)
            continue
        glob = opt.global_params.detach().numpy().astype(np.float64)
        e_before = opt.sparsifier.residual.astype(np.float64)
        _step(model, opt.optimizer, rank, s)
        delta = glob - _flat(model)
        opt.inner_steps += 1
        opt.sync()
        e_after = opt.sparsifier.residual.astype(np.float64)
        applied = glob - opt.global_params.detach().numpy()
        sent = allgather_array(delta + e_before - e_after / beta, wcomm).sum(axis=0)
        mpi_assert(np.allclose(size * applied, sent, rtol=1e-3, atol=1e-6),
                   f"outer step {opt.outer_steps}: off by {np.abs(size * applied - sent).max():.3g}", wcomm)
        mpi_assert(np.abs(e_after).max() > 0, "nothing left in the residual: the test shows nothing", wcomm)
    digests = wcomm.allgather(_flat(model).tobytes())
    mpi_assert(len(set(digests)) == 1, "ranks differ after the outer steps", wcomm)
    opt.close()


def test_a_dict_of_another_error_decay_is_refused_everywhere(wcomm):
    model = _model()
    opt = DiLoCo(_inner(model), model, sync_every=H, sparsifier="exdyna", density=0.05, comm=wcomm,
                 error_decay=0.9)
    for s in range(H + 1):
        _step(model, opt, wcomm.Get_rank(), s)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    other_model = _model()
    other = DiLoCo(_inner(other_model), other_model, sync_every=H, sparsifier="exdyna", density=0.05, comm=wcomm,
                   error_decay=0.5)
    msg = same_error_everywhere(lambda: other.load_state_dict(saved), wcomm)
    mpi_assert("error_decay" in msg, msg, wcomm)


def test_bad_error_decay_is_refused_everywhere(wcomm):
    model = _model()
    for bad in (0.0, 1.5, float("nan"), True, "0.9"):
        msg = same_error_everywhere(lambda: DiLoCo(_inner(model), model, sync_every=H, error_decay=bad,
                                                   comm=wcomm), wcomm)
        mpi_assert("error_decay" in msg, msg, wcomm)


def test_bad_sync_every_is_refused_everywhere(wcomm):
    model = _model()
    for bad in (0, 2.5, True):
        msg = same_error_everywhere(lambda: DiLoCo(_inner(model), model, sync_every=bad, comm=wcomm), wcomm)
        mpi_assert("sync_every" in msg, msg, wcomm)


@pytest.mark.parametrize("fault", ["global", "sync_every", "position", "residual", "not-a-dict"])
def test_a_dict_corrupt_on_one_rank_changes_nothing(fault, wcomm):
    rank, size = wcomm.Get_rank(), wcomm.Get_size()
    if fault == "position" and size == 1:
        pytest.skip("positions that differ between ranks need two ranks")
    bad = size - 1
    model = _model()
    opt = DiLoCo(_inner(model), model, sync_every=H, sparsifier="exdyna", density=0.05, comm=wcomm)
    for s in range(H + 1):
        _step(model, opt, rank, s)
    saved = copy.deepcopy(opt.state_dict())
    _step(model, opt, rank, H + 1)
    before = (opt.global_params.detach().clone(), copy.deepcopy(opt.optimizer.state_dict()), opt.inner_steps,
              opt.sparsifier.residual.copy())
    d = copy.deepcopy(saved)
    if rank == bad:
        if fault == "global":
            d["diloco"]["global"] = d["diloco"]["global"][:-1]
        elif fault == "sync_every":
            d["diloco"]["sync_every"] = H + 1
        elif fault == "position":
            d["diloco"]["inner_steps"] = 0
        elif fault == "residual":
            d["diloco"]["sparsifier"]["residual"] = d["diloco"]["sparsifier"]["residual"][:7]
        else:
            d = "garbage"
    msg = same_error_everywhere(lambda: opt.load_state_dict(d), wcomm)
    mpi_assert(("refused" in msg) and (fault == "position" or f"rank {bad}" in msg), msg, wcomm)
    mpi_assert(torch.equal(before[0], opt.global_params.detach()) and opt.inner_steps == before[2]
               and np.array_equal(before[3], opt.sparsifier.residual), "a refused load changed the state", wcomm)
    inner = opt.optimizer.state_dict()["state"]
    mpi_assert(all(torch.equal(inner[k]["exp_avg"], before[1]["state"][k]["exp_avg"]) for k in inner),
               "a refused load changed the inner optimizer", wcomm)
    opt.load_state_dict(copy.deepcopy(saved))   # the good dicts still load
    mpi_assert(opt.inner_steps == 1 and opt.outer_steps == 1, f"position {opt.inner_steps}", wcomm)


def test_a_non_finite_delta_raises_everywhere_and_changes_nothing(wcomm):
    rank, size = wcomm.Get_rank(), wcomm.Get_size()
    model = _model()
    opt = DiLoCo(_inner(model), model, sync_every=H, sparsifier="exdyna", density=0.05, comm=wcomm)
    for s in range(H - 1):
        _step(model, opt, rank, s)
    glob = opt.global_params.detach().clone()
    if rank == size - 1:
        with torch.no_grad():
            next(model.parameters())[0, 0] = float("nan")
    raised = ""
    try:
        opt.sync()
    except exdyna_mpi.StepError as e:
        raised = str(e)
    mpi_assert("non-finite" in raised, f"no StepError: {raised!r}", wcomm)
    mpi_assert(torch.equal(glob, opt.global_params.detach()) and opt.outer_steps == 0, "state changed", wcomm)


def test_global_model_holds_the_global_parameters_and_gives_the_local_back(wcomm):
    rank = wcomm.Get_rank()
    model = _model()
    opt = DiLoCo(_inner(model), model, sync_every=H, sparsifier="exdyna", density=0.05, comm=wcomm)
    for s in range(H + 1):   # one step into the second period: local and global differ
        _step(model, opt, rank, s)
    local, glob = _flat(model), opt.global_params.detach().numpy().copy()
    mpi_assert(not np.array_equal(local, glob), "test premise: local equals global", wcomm)
    with opt.global_model():
        mpi_assert(np.array_equal(_flat(model), glob), "the model does not hold the global parameters", wcomm)
    mpi_assert(np.array_equal(_flat(model), local), "the local parameters did not come back", wcomm)
