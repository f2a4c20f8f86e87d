"""Every step is a transaction: the first collective names the sparsifier and its iteration, a binding
(dtype, device, wire format, buffers) is made only by an agreed step, and a sum over ranks that
overflows is a non-finite step under the ``nonfinite`` policy. A refused or skipped step changes no
state on any rank, and nothing non-finite enters the residual.

Each check runs for every sparsifier of ``exdyna_mpi.available()`` (and the summed first collective,
the deadline exchange and the count-only controller as variants) against a fresh sparsifier stepped
through the same good steps in this test, with every rank's result compared across ranks.
"""
import hashlib
import pickle

import numpy as np
import pytest

import exdyna_mpi
from tests.conftest import mpi_assert

pytestmark = pytest.mark.mpi(min_size=2)

N, DENSITY = 4096, 0.05
NAMES = exdyna_mpi.available()
#: (id, name, options): every sparsifier, and the paths that differ inside one
CASES = [(n, n, {}) for n in NAMES] + [
    ("exdyna-faithful", "exdyna", {"controller": "faithful"}),      # the StepWords Allgather path
    ("exdyna-deadline", "exdyna", {"deadline_ms": 5000.0}),         # the deadline index exchange
    ("topk-deadline", "topk", {"deadline_ms": 5000.0}),
    ("exdyna-bf16", "exdyna", {"wire_dtype": "bfloat16"}),          # values that travel in 16 bits
    ("dense-bf16", "dense", {"wire_dtype": "bfloat16"}),
    ("exdyna-int8", "exdyna", {"wire_dtype": "int8"}),              # values that travel in 8 bits
    ("topk-int8-sign", "topk", {"wire_dtype": "int8", "output": "sign"}),
    ("exdyna-fp8-sign", "exdyna", {"wire_dtype": "float8_e4m3fn", "output": "sign"}),
    ("exdyna-sign", "exdyna", {"output": "sign"}),
]
IDS = [c[0] for c in CASES]


@pytest.fixture
def make(wcomm):
    """``make(name, opts, **kw)``: a sparsifier on ``wcomm``, closed (collectively) after the test."""
    made = []

    def _make(name, opts, **kw):
        made.append(exdyna_mpi.make(name, N, 1.0 if name == "dense" else DENSITY, wcomm, **opts, **kw))
        return made[-1]

    yield _make
    for sp in made:
        sp.close()


def _grad(rank, t, dtype=np.float32):
    rng = np.random.default_rng(1000 * t + rank)
    shared = np.random.default_rng(t).standard_normal(N)
    return (0.05 * shared + 0.02 * rng.standard_normal(N)).astype(dtype)


def _state(sp):
    """This rank's whole state (residual bits included), as bytes."""
    d = sp.state_dict()
    return pickle.dumps(sorted(d.items(), key=lambda kv: kv[0]))


def _digest(out, sp):
    h = hashlib.sha256(np.ascontiguousarray(out).tobytes())
    h.update(sp.residual.tobytes())
    return h.hexdigest()


def _error(call):
    """The StepError text of ``call()`` on this rank, or None when it did not raise."""
    try:
        call()
    except exdyna_mpi.StepError as e:
        return str(e)
    return None


def _same_error(comm, msg, *words):
    msgs = comm.allgather(msg)
    mpi_assert(all(m is not None for m in msgs), f"some rank did not raise: {msgs}", comm)
    mpi_assert(len(set(msgs)) == 1, f"ranks raised different messages: {msgs}", comm)
    for w in words:
        mpi_assert(w in msgs[0], f"{w!r} not in {msgs[0]!r}", comm)
    return msgs[0]


def _agree_with(comm, sp, ref, out, want, what):
    """``out`` is ``want`` bit for bit (``ref``: the fresh reference), residuals alike, and the same
    on every rank."""
    ok = np.asarray(out).tobytes() == np.asarray(want).tobytes() and sp.residual.tobytes() == ref.residual.tobytes()
    ok &= sp.iteration == ref.iteration
    mpi_assert(ok, f"{what}: differs from a fresh sparsifier's step", comm)
    d = comm.allgather(hashlib.sha256(np.ascontiguousarray(out).tobytes()).hexdigest())
    mpi_assert(len(set(d)) == 1, f"{what}: outputs differ between ranks", comm)


# ---------------------------------------------------------------------- 1. order mistakes
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_two_sparsifiers_stepped_in_opposite_orders_raise_everywhere(case, wcomm, make):
    """Rank 0 steps a then b, the others b then a: both calls raise the same StepError on every rank,
    naming each rank's sparsifier and iteration; nothing changes, and stepping in order afterwards gives
    what fresh sparsifiers give."""
    _, name, opts = case
    rank = wcomm.Get_rank()
    a, b = make(name, opts), make(name, opts)
    ra, rb = make(name, opts), make(name, opts)
    for t in range(2):   # once unbound (t = 0), once bound (t = 1)
        before = (_state(a), _state(b))
        ga, gb = _grad(rank, t), _grad(rank + 7, t)
        for on0, others in ((a, b), (b, a)):
            sp = on0 if rank == 0 else others
            g = ga if sp is a else gb
            msg = _same_error(wcomm, _error(lambda: sp.step(g.copy())), "different sparsifiers")
            for r, stepped in ((0, on0), (1, others)):
                mpi_assert(f"rank {r}: {name} #{stepped.serial} at iteration {t}" in msg, msg, wcomm)
        mpi_assert(a.serial != b.serial, "two sparsifiers with one number", wcomm)
        mpi_assert((_state(a), _state(b)) == before, f"{name}: a refused step changed the state", wcomm)
        mpi_assert(a.stats is None if t == 0 else a.stats.iteration == t - 1, "stats of a refused step", wcomm)
        _agree_with(wcomm, a, ra, a.step(ga.copy()), ra.step(ga.copy()), f"{name} a t={t}")
        _agree_with(wcomm, b, rb, b.step(gb.copy()), rb.step(gb.copy()), f"{name} b t={t}")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_rank_at_another_iteration_raises_everywhere(case, wcomm, make):
    """One sparsifier whose iteration counter differs on rank 0 (set back by hand, as from an older
    checkpoint restored outside ``load_state_dict``): the same StepError everywhere, state unchanged."""
    _, name, opts = case
    rank = wcomm.Get_rank()
    sp, ref = make(name, opts), make(name, opts)
    for t in range(2):
        g = _grad(rank, t)
        sp.step(g.copy())
        ref.step(g.copy())
    if rank == 0:
        sp.iteration = 1
    before = _state(sp)
    _same_error(wcomm, _error(lambda: sp.step(_grad(rank, 2))), "rank 0: " + name, "at iteration 1",
                "rank 1: " + name, "at iteration 2")
    mpi_assert(_state(sp) == before, f"{name}: a refused step changed the state", wcomm)
    sp.iteration = 2
    _agree_with(wcomm, sp, ref, sp.step(_grad(rank, 2)), ref.step(_grad(rank, 2)), name)


# ---------------------------------------------------------------------- 2. binding on an agreed step
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_refused_first_step_binds_nothing(case, wcomm, make):
    """A float64 first gradient on rank 0 only: the same StepError on every rank; the sparsifier is
    then exactly a fresh one, and float32 steps give a fresh sparsifier's results."""
    _, name, opts = case
    if opts.get("wire_dtype"):
        pytest.skip("16- and 8-bit values refuse a float64 gradient on their own")
    rank = wcomm.Get_rank()
    sp, ref = make(name, opts), make(name, opts)
    fresh = _state(sp)
    g = _grad(rank, 0, np.float64 if rank == 0 else np.float32)
    _same_error(wcomm, _error(lambda: sp.step(g)), "different dtypes", "rank 0: float64", "rank 1: float32")
    same = _state(sp) == fresh and sp.ops is None and sp.memory.residual is None and sp.stats is None
    mpi_assert(same, f"{name}: a refused first step left a binding", wcomm)
    for t in range(2):
        _agree_with(wcomm, sp, ref, sp.step(_grad(rank, t)), ref.step(_grad(rank, t)), f"{name} t={t}")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_skipped_first_step_binds_nothing(case, wcomm, make):
    """A float64 first step with a NaN on rank 0, under ``nonfinite="skip"``: skipped everywhere, and
    the sparsifier stays unbound, so float32 steps then run as on a fresh one."""
    _, name, opts = case
    if opts.get("wire_dtype"):
        pytest.skip("16- and 8-bit values refuse a float64 gradient on their own")
    rank = wcomm.Get_rank()
    sp, ref = make(name, opts, nonfinite="skip"), make(name, opts, nonfinite="skip")
    fresh = _state(sp)
    g = _grad(rank, 0, np.float64)
    if rank == 0:
        g[11] = np.nan
    out = sp.step(g)
    mpi_assert(sp.stats.skipped and not np.any(out), f"{name}: the step was not skipped", wcomm)
    same = _state(sp) == fresh and sp.ops is None and sp.memory.residual is None and sp.iteration == 0
    mpi_assert(same, f"{name}: a skipped first step left a binding", wcomm)
    for t in range(2):
        _agree_with(wcomm, sp, ref, sp.step(_grad(rank, t)), ref.step(_grad(rank, t)), f"{name} t={t}")


# ---------------------------------------------------------------------- 3. a sum that overflows
def _overflowing(rank, t):
    """Finite float32 gradients whose sum over ranks overflows at one coordinate (3e38 on every rank)."""
    g = _grad(rank, t)
    g[123] = np.float32(3e38)
    return g


#: with output="sign" the ranks exchange the signs of the sums, and an overflowing sum's sign is its
#: own (nothing non-finite is made or kept): that step is a good one
SUM_CASES = [c for c in CASES if c[2].get("output") != "sign"]


@pytest.mark.parametrize("policy", ["raise", "skip"])
@pytest.mark.parametrize("case", SUM_CASES, ids=[c[0] for c in SUM_CASES])
def test_a_sum_that_overflows_is_a_nonfinite_step(case, policy, wcomm, make):
    """Finite inputs whose sum over ranks overflows: under "raise" the same StepError on every rank,
    under "skip" a skipped step on every rank; the state (residual, threshold, partitions, iteration,
    deadline history) is untouched and holds nothing non-finite; the next good step is a fresh
    sparsifier's. Once on a bound sparsifier, once as the very first step."""
    _, name, opts = case
    rank = wcomm.Get_rank()
    sp, ref = make(name, opts, nonfinite=policy), make(name, opts, nonfinite=policy)
    for t in range(3):
        if t == 1:
            g = _grad(rank, t)
            _agree_with(wcomm, sp, ref, sp.step(g.copy()), ref.step(g.copy()), f"{name} good step")
        before, stats = _state(sp), sp.stats
        bad = _overflowing(rank, t)
        if policy == "raise":
            _same_error(wcomm, _error(lambda: sp.step(bad)), f"{name}: step refused on all ranks", "not finite")
            mpi_assert(sp.stats is stats, "a refused step set stats", wcomm)
        else:
            out = sp.step(bad)
            ok = sp.stats.skipped and not np.any(out) and sp.stats.selected == 0
            mpi_assert(ok, f"{name}: the overflowing step was not skipped", wcomm)
        mpi_assert(_state(sp) == before, f"{name}: the overflowing step changed the state", wcomm)
        mpi_assert(bool(np.isfinite(sp.residual).all()), f"{name}: a non-finite residual", wcomm)
        if t == 0:
            mpi_assert(sp.ops is None and sp.memory.residual is None, f"{name}: bound by a refused step", wcomm)
    g = _grad(rank, 5)
    _agree_with(wcomm, sp, ref, sp.step(g.copy()), ref.step(g.copy()), f"{name} after the overflow")
    mpi_assert(bool(np.isfinite(sp.residual).all()), f"{name}: a non-finite residual", wcomm)


def test_a_transform_that_overflows_never_reaches_the_residual(wcomm, make):
    """FFT: 3e38 on rank 0 alone, finite, but the inverse transform of its spectrum overflows float32
    (its contribution, whose residual is rank 0's alone): a non-finite step on every rank, skipped
    under "skip", never a residual holding inf or NaN; the next good step is a fresh sparsifier's."""
    rank = wcomm.Get_rank()
    sp, ref = make("fft", {}, nonfinite="skip"), make("fft", {}, nonfinite="skip")
    g = _grad(rank, 0)
    if rank == 0:
        g[123] = np.float32(3e38)
    before = _state(sp)
    out = sp.step(g)
    ok = sp.stats.skipped and not np.any(out) and bool(np.isfinite(sp.residual).all()) and _state(sp) == before
    mpi_assert(ok, "fft: the overflowing transform was not a skipped step", wcomm)
    _agree_with(wcomm, sp, ref, sp.step(_grad(rank, 1)), ref.step(_grad(rank, 1)), "fft after the overflow")


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_spectrum_that_overflows_on_one_rank_is_refused_everywhere(policy, wcomm, make):
    """FFT: two 3e38 values in one row of the last rank's gradient, finite, but their transform is not:
    that rank says so in the count exchange, and every rank raises the same StepError naming it (or
    skips), with the state untouched."""
    rank, p = wcomm.Get_rank(), wcomm.Get_size()
    sp, ref = make("fft", {}, nonfinite=policy), make("fft", {}, nonfinite=policy)
    g = _grad(rank, 0)
    _agree_with(wcomm, sp, ref, sp.step(g.copy()), ref.step(g.copy()), "fft good step")
    bad = _grad(rank, 1)
    if rank == p - 1:
        bad[10:12] = np.float32(3e38)
    before = _state(sp)
    if policy == "raise":
        _same_error(wcomm, _error(lambda: sp.step(bad)), f"rank {p - 1}: ", "sums of grad's finite values")
    else:
        out = sp.step(bad)
        mpi_assert(sp.stats.skipped and not np.any(out), "fft: the overflowing spectrum was not skipped", wcomm)
    mpi_assert(_state(sp) == before, "fft: a refused step changed the state", wcomm)
    g = _grad(rank, 2)
    _agree_with(wcomm, sp, ref, sp.step(g.copy()), ref.step(g.copy()), "fft after the overflow")


def _ramp(rank, t):
    """float16 gradients with 300 values from 50,000 to 60,000: more than k of them, so the smaller ones
    wait in the residual (float32) and the next step's averages there pass float16's largest value."""
    g = _grad(rank, t)
    g[:300] = np.linspace(50_000, 60_000, 300)
    return g.astype(np.float16)


def _spread(rank, t):
    """float16 gradients of +-65,000: finite, but the FFT's 8-bit codes round some averages past 65,504."""
    return (np.sign(np.random.default_rng(5).standard_normal(N)) * 65_000).astype(np.float16)


@pytest.mark.parametrize("policy", ["raise", "skip"])
@pytest.mark.parametrize("name,opts,grads", [("fft", {}, _spread), ("oktopk", {}, _ramp),
                                             ("topk", {"wire_dtype": "float32"}, _ramp),
                                             ("exdyna", {"wire_dtype": "float32"}, _ramp)],
                         ids=["fft", "oktopk", "topk-f32", "exdyna-f32"])
def test_a_half_average_beyond_its_range_is_a_nonfinite_step(name, opts, grads, policy, wcomm, make):
    """Finite float16 gradients whose averages, computed in float32, round to inf in float16: a
    non-finite step (refused or skipped on every rank, state untouched), never an inf in the output."""
    rank = wcomm.Get_rank()
    sp, ref = make(name, opts, nonfinite=policy), make(name, opts, nonfinite=policy)
    t0 = 0 if grads is _spread else 1
    for t in range(t0):
        _agree_with(wcomm, sp, ref, sp.step(grads(rank, t)), ref.step(grads(rank, t)), f"{name} t={t}")
    before = _state(sp)
    if policy == "raise":
        _same_error(wcomm, _error(lambda: sp.step(grads(rank, t0))), f"{name}: step refused", "overflows float16")
    else:
        out = sp.step(grads(rank, t0))
        mpi_assert(sp.stats.skipped and not np.any(out), f"{name}: the step was not skipped", wcomm)
    mpi_assert(_state(sp) == before, f"{name}: a refused step changed the state", wcomm)
    g = _grad(rank, 9).astype(np.float16)
    _agree_with(wcomm, sp, ref, sp.step(g.copy()), ref.step(g.copy()), f"{name} after the refusal")
