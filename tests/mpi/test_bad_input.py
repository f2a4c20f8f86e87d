"""Bad input on one rank: the same clear error on every rank, no hang, state exactly as before."""
import copy

import numpy as np
import pytest

import exdyna_mpi
from tests.conftest import mpi_assert
from tests.reference import laplace_grad

pytestmark = pytest.mark.mpi
NUMEL = 12_000


def _snapshot(sp):
    return (sp.residual.tobytes(), sp.threshold, sp.iteration, sp.layout.bounds().tolist())


def _bad(kind, good):
    if kind == "length":
        return good[:-1]
    if kind == "2d":
        return good.reshape(2, -1)
    if kind == "int":
        return good.astype(np.int32)
    if kind == "nan":
        b = good.copy()
        b[17] = np.nan
        return b
    if kind == "inf":
        b = good.copy()
        b[-1] = -np.inf
        return b
    if kind == "list":
        return good.tolist()
    if kind == "strided":
        return np.repeat(good, 2)[::2]
    if kind == "float64":
        return good.astype(np.float64)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind,words", [
    ("length", "length 11999, expected numel=12000"), ("2d", "2 dimensions"),
    ("int", "dtype int32; accepted: float16, bfloat16, float32, float64"),
    ("nan", "1 non-finite"), ("inf", "1 non-finite"), ("list", "not an array"), ("strided", "not contiguous"),
    ("float64", "dtype"),
])
def test_bad_grad_on_last_rank_raises_everywhere(comm, kind, words):
    P, rank = comm.Get_size(), comm.Get_rank()
    bad_rank = P - 1
    sp = exdyna_mpi.ExDyna(NUMEL, 0.01, comm)
    sp.step(laplace_grad(rank, 0, NUMEL))                 # a good step first: the dtype is fixed
    before = _snapshot(sp)
    g = laplace_grad(rank, 1, NUMEL)
    arg = _bad(kind, g) if rank == bad_rank else g
    try:
        sp.step(arg)
        msg = None
    except exdyna_mpi.StepError as e:
        msg = str(e)
    msgs = comm.allgather(msg)
    mpi_assert(all(m is not None for m in msgs), f"some rank did not raise: {msgs}", comm)
    mpi_assert(len(set(msgs)) == 1, f"ranks raised different messages: {msgs}", comm)
    mpi_assert(f"rank {bad_rank}:" in msg and words in msg, f"unclear message: {msg}", comm)
    mpi_assert(_snapshot(sp) == before, "a refused step changed the state", comm)
    out = sp.step(g)                                      # and the next good step still works
    mpi_assert(sp.iteration == 2 and out.shape == (NUMEL,), "no recovery after a refused step", comm)


def test_dtype_disagreement_on_first_step(wcomm):
    P, rank = wcomm.Get_size(), wcomm.Get_rank()
    if P == 1:
        pytest.skip("needs two ranks to disagree")
    sp = exdyna_mpi.ExDyna(NUMEL, 0.01, wcomm)
    g = laplace_grad(rank, 0, NUMEL, np.float64 if rank == 1 else np.float32)
    with pytest.raises(exdyna_mpi.StepError, match="different dtypes"):
        sp.step(g)
    mpi_assert(sp.iteration == 0 and np.all(sp.residual == 0), "state changed", wcomm)


def test_nonfinite_skip_policy_skips_on_all_ranks(comm):
    rank = comm.Get_rank()
    sp = exdyna_mpi.ExDyna(NUMEL, 0.01, comm, nonfinite="skip")
    sp.step(laplace_grad(rank, 0, NUMEL))
    before = _snapshot(sp)
    g = laplace_grad(rank, 1, NUMEL)
    if rank == 0:
        g[5] = np.inf
    out = sp.step(g)
    mpi_assert(sp.stats.skipped and np.all(out == 0), "the step was not skipped", comm)
    mpi_assert(_snapshot(sp) == before, "a skipped step changed the state", comm)
    # Only non-finite values are skipped; a wrong length still raises.
    with pytest.raises(exdyna_mpi.StepError):
        sp.step(g[:-1] if rank == 0 else laplace_grad(rank, 1, NUMEL))


@pytest.mark.parametrize("bad", [
    {"density": 0.0}, {"density": 1.5}, {"numel": 0}, {"numel": -3}, {"controller": "nope"},
    {"controller": "histogram"}, {"n_blocks": 0}, {"nonfinite": "ignore"}, {"frobnicate": 1}, {"device": "tpu"},
    {"max_imbalance": -0.1}, {"max_imbalance": True},
])
def test_bad_construction_on_one_rank_raises_everywhere(comm, bad):
    P, rank = comm.Get_size(), comm.Get_rank()
    kw = {"numel": NUMEL, "density": 0.01}
    if rank == P - 1:
        kw.update(bad)
    numel, density = kw.pop("numel"), kw.pop("density")
    try:
        exdyna_mpi.ExDyna(numel, density, comm, **kw)
        msg = None
    except ValueError as e:
        msg = str(e)
    msgs = comm.allgather(msg)
    mpi_assert(all(m is not None and m == msgs[0] for m in msgs), f"not the same error everywhere: {msgs}", comm)
    mpi_assert(f"rank {P - 1}:" in msgs[0], msgs[0], comm)


@pytest.mark.parametrize("cls", [exdyna_mpi.ExDyna, exdyna_mpi.MiCRO])
def test_removed_histogram_controller_names_measured_on_every_rank(wcomm, cls):
    with pytest.raises(ValueError, match=r"controller 'histogram' was removed.*controller='measured'"):
        cls(NUMEL, 0.01, wcomm, controller="histogram")


def test_ranks_disagreeing_on_numel(wcomm):
    P, rank = wcomm.Get_size(), wcomm.Get_rank()
    if P == 1:
        pytest.skip("needs two ranks to disagree")
    with pytest.raises(ValueError, match="disagree"):
        exdyna_mpi.ExDyna(NUMEL + (rank == 1), 0.01, wcomm)
    with pytest.raises(ValueError, match="disagree"):
        exdyna_mpi.ExDyna(NUMEL, 0.01, wcomm, balance=(rank != 1))


def test_load_state_dict_mismatch_is_collective(wcomm):
    P, rank = wcomm.Get_size(), wcomm.Get_rank()
    sp = exdyna_mpi.ExDyna(NUMEL, 0.01, wcomm)
    sp.step(laplace_grad(rank, 0, NUMEL))
    d = sp.state_dict()
    if rank == P - 1:
        d = dict(d, numel=NUMEL + 1)
    with pytest.raises(ValueError, match=f"rank {P - 1}: state_dict has numel"):
        sp.load_state_dict(d)
    mpi_assert(sp.iteration == 1, "refused load changed the state", wcomm)


@pytest.mark.parametrize("part", ["layout", "controller"])
def test_corrupt_extra_state_on_one_rank_changes_nothing(wcomm, part):
    """A layout or threshold that does not fit, on the last rank only: every rank refuses before any
    rank loads anything (the residual, the iteration and the layout stay as they were)."""
    P, rank = wcomm.Get_size(), wcomm.Get_rank()
    sp = exdyna_mpi.ExDyna(NUMEL, 0.01, wcomm)
    sp.step(laplace_grad(rank, 0, NUMEL))
    d = copy.deepcopy(sp.state_dict())
    sp.step(laplace_grad(rank, 1, NUMEL))
    before = (sp.residual.tobytes(), sp.iteration, repr(sorted(sp.state_dict().items())))
    if rank == P - 1:
        if part == "layout":
            d["layout"]["blk_part"][0] += 1
        else:
            d["controller_state"]["threshold"] = float("nan")
    with pytest.raises(ValueError, match=f"rank {P - 1}: state_dict is malformed"):
        sp.load_state_dict(d)
    after = (sp.residual.tobytes(), sp.iteration, repr(sorted(sp.state_dict().items())))
    mpi_assert(after == before, "a refused load changed the state", wcomm)
