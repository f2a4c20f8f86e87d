"""16-bit values and compact indices on the wire, against an independent reference.

Every sparsifier that can send 16-bit values (``CAPABILITIES.wire_half``: the union-average ones and dense) x
{bfloat16, float16 gradients (16-bit values by default), float32 with ``wire_dtype="bfloat16"``},
one to four ranks. At each step the test records every rank's accumulator and the step's union
(from ``average_at``; all elements for dense) and recomputes in NumPy + ml_dtypes what the protocol
promises: share j of the union (an equal split) is reduced by rank j, which adds its own float32
values to the others' values rounded (saturating) to 16 bits, in rank order, in float32; the mean
is rounded to 16 bits; each sender keeps what its rounding lost, the owner what the mean's rounding
lost, and an element outside the union keeps its accumulator. Output and residual must match to the
bit; ranks bit-identical; output dtype = gradient dtype; residual float32; the mass conserved
(sum of residuals + P x output = sum of accumulators, to float32 rounding).

Compact indices change bytes, not results: float32 runs with and without them give the same bits.
Bytes per selected element at d = 0.01 (the exchange's own count): at most 10.5 for float32 and
6.5 for 16-bit values.
"""
import numpy as np
import pytest

import exdyna_mpi
from exdyna_mpi.arrays.half import WireFormat
from exdyna_mpi.sparsifiers.base import Sparsifier
from tests.conftest import allgather_array, mpi_assert, require

pytestmark = pytest.mark.mpi

ml_dtypes = require("ml_dtypes")

WIRE_NAMES = [n for n in exdyna_mpi.available() if exdyna_mpi.sparsifiers.REGISTRY[n].CAPABILITIES.wire_half]
NUMEL, STEPS = 6000, 3
CASES = [("bfloat16", None), ("float16", None), ("float32", "bfloat16"), ("float32", "float16")]


def _grad(rank, t, dtype):
    rng = np.random.default_rng([7, rank, t])
    g = rng.laplace(0.0, 0.05, NUMEL).astype(np.float32)
    g[(t * 997) % NUMEL] = 3e4 if dtype != "float16" else 6e4    # near the top of the format's range
    if dtype == "bfloat16":
        return g.astype(ml_dtypes.bfloat16)
    return g.astype(dtype)


def _round16(x, name):
    """float32 ``x`` rounded to ``name`` (nearest even, saturating at the largest finite value)."""
    t = np.float16 if name == "float16" else ml_dtypes.bfloat16
    top = np.float32(np.finfo(np.float16).max if name == "float16" else ml_dtypes.finfo(t).max)
    with np.errstate(over="ignore"):
        h = x.astype(t)
    h = np.where(np.isinf(h.astype(np.float32)) & np.isfinite(x), np.copysign(top, x).astype(t), h)
    return h.astype(np.float32)


def owner_reference(accs, union, rnd, signs=False):
    """(out, residuals) of one step from every rank's accumulator (P, N) and the union, the values
    rounded by ``rnd`` on the way to their share's owner and the means on the way back (``signs``:
    the sign of each mean, and the owner keeps nothing)."""
    p, n = accs.shape[0], union.shape[0]
    out = np.zeros(accs.shape[1], np.float32)
    res = accs.copy()
    counts = np.full(p, n // p)
    counts[: n % p] += 1
    starts = np.concatenate(([0], np.cumsum(counts)))
    for j in range(p):
        u = union[starts[j]: starts[j + 1]]
        s = np.zeros(u.shape[0], np.float32)
        for r in range(p):
            v = accs[r, u]
            if r == j:
                s += v
            else:
                sent = rnd(v)
                s += sent
                res[r, u] = v - sent
        mean = s / np.float32(p)
        if signs:
            out[u] = np.sign(mean)
            res[j, u] = 0
        else:
            m = rnd(mean)
            out[u] = m
            res[j, u] = s - np.float32(p) * m
    return out, res


def _reference(accs, union, wire):
    return owner_reference(accs, union, lambda v: _round16(v, wire))


def _bits(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _record_unions(sp):
    """Wrap ``sp.average_at`` to record each step's union (dense: None, all elements)."""
    seen = []
    orig = sp.average_at

    def spy(acc, union, out, sec, done=False):
        seen.append(np.array(union, copy=True))
        return orig(acc, union, out, sec, done)
    sp.average_at = spy
    return seen


@pytest.mark.parametrize("grad_dtype,wire", CASES)
@pytest.mark.parametrize("name", WIRE_NAMES)
def test_wire_matches_the_reference(name, grad_dtype, wire, wcomm):
    rank, p = wcomm.Get_rank(), wcomm.Get_size()
    density = 1.0 if name == "dense" else 0.02
    sp = exdyna_mpi.make(name, NUMEL, density, wcomm, wire_dtype=wire)
    unions = _record_unions(sp)
    fmt = wire or grad_dtype
    for t in range(STEPS):
        g = _grad(rank, t, grad_dtype)
        acc = sp.residual + g.astype(np.float32)          # what the step accumulates (float32)
        out = sp.step(g)
        mpi_assert(out.dtype == g.dtype and sp.residual.dtype == np.float32,
                   f"{name}/{grad_dtype}: out {out.dtype}, residual {sp.residual.dtype}", wcomm)
        union = np.arange(NUMEL) if name == "dense" else unions[-1]
        accs = allgather_array(acc, wcomm).reshape(p, NUMEL)
        want_out, want_res = _reference(accs, union, fmt)
        got = np.asarray(out).astype(np.float32)
        mpi_assert(np.array_equal(_bits(got), _bits(want_out)),
                   f"{name}/{grad_dtype}/{fmt} t={t}: output differs from the reference "
                   f"({int((got != want_out).sum())} elements)", wcomm)
        mpi_assert(np.array_equal(_bits(sp.residual), _bits(want_res[rank])),
                   f"{name}/{grad_dtype}/{fmt} t={t}: residual differs from the reference", wcomm)
        allo = allgather_array(_bits(np.asarray(out)), wcomm)
        mpi_assert((allo == allo[0]).all(), f"{name}/{grad_dtype} t={t}: ranks differ", wcomm)
        # conservation: what was accumulated is either applied (P x mean) or kept in a residual
        kept = allgather_array(sp.residual, wcomm).reshape(p, NUMEL).astype(np.float64).sum(0)
        total = accs.astype(np.float64).sum(0)
        gap = np.abs(kept + p * got.astype(np.float64) - total)
        mpi_assert((gap <= 1e-6 * (np.abs(accs).astype(np.float64).sum(0) + 1e-30) + 1e-30).all(),
                   f"{name}/{grad_dtype}: mass not conserved (max gap {gap.max():.3g})", wcomm)
    WireFormat.of(fmt)   # the format the reference used exists


@pytest.mark.parametrize("name", WIRE_NAMES)
def test_compact_indices_change_bytes_not_bits(name, wcomm, monkeypatch):
    rank = wcomm.Get_rank()
    density = 1.0 if name == "dense" else 0.02
    compact = exdyna_mpi.make(name, NUMEL, density, wcomm)
    plain = exdyna_mpi.make(name, NUMEL, density, wcomm)
    plain.COMPACT_INDICES = False
    for t in range(STEPS):
        g = _grad(rank, t, "float32")
        a, b = compact.step(g.copy()), plain.step(g.copy())
        mpi_assert(np.array_equal(_bits(a), _bits(b)) and np.array_equal(compact.residual, plain.residual),
                   f"{name} t={t}: compact indices changed the result", wcomm)
        # never more bytes; fewer wherever ranks select a fair share (a few indices travel raw)
        c, r = compact.stats.bytes_sent, plain.stats.bytes_sent
        strict = wcomm.Get_size() > 1 and name in ("exdyna", "micro", "topk")
        mpi_assert(c < r if strict else c <= r, f"{name}: compact indices sent {c}, plain {r}", wcomm)


@pytest.mark.parametrize("grad_dtype,wire,goal", [("float32", None, 10.5), ("bfloat16", None, 6.5),
                                                  ("float32", "bfloat16", 6.5)])
def test_bytes_per_selected_element(grad_dtype, wire, goal, wcomm):
    rank, p = wcomm.Get_rank(), wcomm.Get_size()
    if p == 1:
        pytest.skip("nothing travels on one rank")
    n = 2_000_000
    sp = exdyna_mpi.make("exdyna", n, 0.01, wcomm, wire_dtype=wire)
    rng = np.random.default_rng(rank)
    base = rng.standard_normal(n).astype(np.float32)
    sent = selected = 0
    for t in range(4):
        g = base * np.float32(1 + 0.1 * t) + rng.standard_normal(n).astype(np.float32) * np.float32(0.3)
        sp.step(g.astype(ml_dtypes.bfloat16) if grad_dtype == "bfloat16" else g)
        sent += sp.stats.bytes_sent
        selected += sp.stats.selected
    per = wcomm.allreduce(sent) / p / (selected * (p - 1) / p)
    mpi_assert(per <= goal, f"{grad_dtype}/wire={wire}: {per:.3f} bytes per selected element > {goal}", wcomm)


def test_sparsifiers_without_16_bit_values_say_so(wcomm):
    no = [n for n in exdyna_mpi.available() if n not in WIRE_NAMES]
    assert no, "every sparsifier sends 16-bit values: drop this test"
    for name in no:
        with pytest.raises(ValueError, match=f"{name} cannot send its values in bfloat16"):
            exdyna_mpi.make(name, NUMEL, 0.02, wcomm, wire_dtype="bfloat16")
    with pytest.raises(ValueError, match="wire_dtype must be None or one of"):
        exdyna_mpi.make("exdyna", NUMEL, 0.02, wcomm, wire_dtype="int4")


def test_float64_with_16_bit_values_is_refused_on_every_rank(wcomm):
    rank, p = wcomm.Get_rank(), wcomm.Get_size()
    sp = exdyna_mpi.make("topk", NUMEL, 0.02, wcomm, wire_dtype="bfloat16")
    g = _grad(rank, 0, "float32")
    arg = g.astype(np.float64) if rank == p - 1 else g
    if p > 1:
        sp.step(g)          # float32 fixes the dtype on every rank first; then float64 on one rank
    with pytest.raises(exdyna_mpi.StepError) as ei:
        sp.step(arg if p > 1 else g.astype(np.float64))
    msgs = wcomm.allgather(str(ei.value))
    mpi_assert(len(set(msgs)) == 1, msgs[0], wcomm)
    fresh = exdyna_mpi.make("topk", NUMEL, 0.02, wcomm, wire_dtype="bfloat16")
    with pytest.raises(exdyna_mpi.StepError, match="values travel in 16 or 8 bits"):
        fresh.step(g.astype(np.float64))
    mpi_assert(fresh.iteration == 0 and not fresh.residual.any(), "state changed by a refusal", wcomm)


def test_wire_dtype_is_agreed(wcomm):
    if wcomm.Get_size() == 1:
        pytest.skip("one rank agrees with itself")
    wire = "bfloat16" if wcomm.Get_rank() == 0 else None
    with pytest.raises(ValueError, match="wire_dtype"):
        exdyna_mpi.make("exdyna", NUMEL, 0.02, wcomm, wire_dtype=wire)


def test_class_flags(wcomm):
    assert Sparsifier.CAPABILITIES.wire_half is False and "exdyna" in WIRE_NAMES and "dense" in WIRE_NAMES
