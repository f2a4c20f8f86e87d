"""``output="sign"``: the step returns the sign of the union average, and only signs are gathered.

- Every sparsifier that offers it (``CAPABILITIES.sign_output``: the union-average ones) x {float32, float32 with
  ``wire_dtype="bfloat16"``, bfloat16 gradients}, one to four ranks: the output is 1, -1 or 0 at the
  union and 0 elsewhere, equal to the sign of a reference mean computed here from every rank's
  accumulator (for 16-bit values, test_wire's rank-order reference, to the bit; for float32, where
  MPI chooses the summation order, wherever the float64 sum is not within rounding of zero) and to
  the sign of the same sparsifier's ``output="mean"`` step to the bit; the residual equals that
  step's to the bit; ranks bit-identical.
- Bytes: the value exchange moves exactly what the ring model says for a Reduce_scatter of the
  values plus an Allgatherv of 2-bit codes, fewer than the mean's at P > 1.
- ``output`` is checked and agreed: a bad value, a sparsifier without it, or ranks that disagree
  give the same error on every rank.
- ``DistributedOptimizer(AdamW, sparsifier="exdyna")`` (``adam="demo"`` by default) gathers signs
  by default and gives the parameters of ``output="mean"`` to the bit, with fewer bytes.
"""
import numpy as np
import pytest

import exdyna_mpi
from exdyna_mpi.sparsifiers import REGISTRY
from exdyna_mpi.transport import ByteCounter
from tests.conftest import allgather_array, mpi_assert, require, same_error_everywhere
from tests.mpi.test_wire import _bits, _grad, _record_unions, _reference

pytestmark = pytest.mark.mpi

ml_dtypes = require("ml_dtypes")

SIGN_NAMES = [n for n in exdyna_mpi.available() if REGISTRY[n].CAPABILITIES.sign_output]
NUMEL, STEPS = 6000, 3
CASES = [("float32", None), ("float32", "bfloat16"), ("bfloat16", None)]


def test_the_union_average_sparsifiers_offer_it():
    assert {"exdyna", "micro", "topk"} <= set(SIGN_NAMES)
    assert "dense" not in SIGN_NAMES and "oktopk" not in SIGN_NAMES


@pytest.mark.parametrize("grad_dtype,wire", CASES)
@pytest.mark.parametrize("name", SIGN_NAMES)
def test_sign_output_matches_the_reference_and_the_mean(name, grad_dtype, wire, wcomm):
    rank, p = wcomm.Get_rank(), wcomm.Get_size()
    sp = exdyna_mpi.make(name, NUMEL, 0.02, wcomm, wire_dtype=wire, output="sign")
    mean = exdyna_mpi.make(name, NUMEL, 0.02, wcomm, wire_dtype=wire)
    unions = _record_unions(sp)
    for t in range(STEPS):
        g = _grad(rank, t, grad_dtype)
        acc = sp.residual + g.astype(np.float32)
        out = sp.step(g.copy())
        ref = mean.step(g.copy())
        got = np.asarray(out).astype(np.float32)
        union = unions[-1]
        inside = np.zeros(NUMEL, bool)
        inside[union] = True
        mpi_assert(out.dtype == g.dtype and np.isin(got[inside], (-1.0, 0.0, 1.0)).all() and not got[~inside].any(),
                   f"{name}/{grad_dtype}/{wire} t={t}: not a sign at the union and 0 elsewhere", wcomm)
        accs = allgather_array(acc, wcomm).reshape(p, NUMEL)
        fmt = wire or (grad_dtype if grad_dtype != "float32" else None)
        if fmt is not None:   # the owners sum in rank order: the reference is exact
            want = np.sign(_reference(accs, union, fmt)[0])
            agree = np.ones(NUMEL, bool)
        else:
            s = accs.astype(np.float64).sum(0)
            want = np.where(inside, np.sign(s), 0.0)
            agree = np.abs(s) > 1e-5 * np.abs(accs).astype(np.float64).sum(0)   # not within rounding of 0
        mpi_assert(np.array_equal(got[agree], want[agree]) and agree[inside].mean() > 0.99,
                   f"{name}/{grad_dtype}/{wire} t={t}: {int((got[agree] != want[agree]).sum())} signs differ "
                   "from the reference", wcomm)
        mpi_assert(np.array_equal(_bits(got), _bits(np.sign(np.asarray(ref).astype(np.float32)))),
                   f"{name}/{grad_dtype}/{wire} t={t}: not the sign of output='mean'", wcomm)
        mpi_assert(np.array_equal(_bits(sp.residual), _bits(mean.residual)),
                   f"{name}/{grad_dtype}/{wire} t={t}: the residual differs from output='mean''s", wcomm)
        allo = allgather_array(_bits(got), wcomm)
        mpi_assert((allo == allo[0]).all(), f"{name} t={t}: ranks differ", wcomm)


def _ring(counts, itemsize, rank):
    """What ``ByteCounter.allgather`` adds for these counts on ``rank``: (sent, received)."""
    b = ByteCounter(rank, len(counts))
    b.allgather(np.asarray(counts), itemsize)
    return b.sent, b.received


@pytest.mark.parametrize("name", ["exdyna", "topk"])
def test_bytes_are_the_reduce_scatter_and_the_codes(name, wcomm):
    rank, p = wcomm.Get_rank(), wcomm.Get_size()
    sp = exdyna_mpi.make(name, NUMEL, 0.05, wcomm, output="sign")
    mean = exdyna_mpi.make(name, NUMEL, 0.05, wcomm)
    unions = _record_unions(sp)
    for t in range(STEPS):
        g = _grad(rank, t, "float32")
        sp.step(g.copy())
        mean.step(g.copy())
        n = unions[-1].shape[0]
        shares = np.full(p, n // p)
        shares[: n % p] += 1
        half = (p - 1) * n * 4 // p
        codes = _ring((shares + 3) // 4, 1, rank) if p > 1 else (0, 0)
        full = 2 * (p - 1) * n * 4 // p
        want = mean.stats.bytes_sent - full + half + codes[0]
        mpi_assert(sp.stats.bytes_sent == want,
                   f"{name} t={t}: sent {sp.stats.bytes_sent}, the ring model says {want}", wcomm)
        mpi_assert(sp.stats.bytes_sent < mean.stats.bytes_sent if p > 1 else sp.stats.bytes_sent == 0,
                   f"{name}: signs sent {sp.stats.bytes_sent}, means {mean.stats.bytes_sent}", wcomm)


def test_output_is_checked_and_agreed(wcomm):
    for name in ("dense", "oktopk"):
        msg = same_error_everywhere(lambda: exdyna_mpi.make(name, NUMEL, 0.02, wcomm, output="sign"), wcomm)
        mpi_assert(f"{name} cannot return the sign" in msg and "exdyna" in msg, msg, wcomm)
    msg = same_error_everywhere(lambda: exdyna_mpi.make("exdyna", NUMEL, 0.02, wcomm, output="median"), wcomm)
    mpi_assert("output must be one of" in msg, msg, wcomm)
    if wcomm.Get_size() > 1:
        out = "sign" if wcomm.Get_rank() == 0 else "mean"
        msg = same_error_everywhere(lambda: exdyna_mpi.make("exdyna", NUMEL, 0.02, wcomm, output=out), wcomm)
        mpi_assert("output" in msg, msg, wcomm)


def test_demo_gathers_signs_by_default_and_changes_no_bit(wcomm):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    from exdyna_mpi.adapters.torch import DistributedOptimizer
    from tests.mpi.test_torch_adam_update import _train
    from tests.mpi.test_torch_options import _flat, _model

    rank = wcomm.Get_rank()
    runs, wires = {}, []
    for output in ("default", "mean"):
        model = _model()
        # float32 values both ways (wire_dtype=None, not adam="auto"'s AUTO_WIRE): the 8-bit codes round
        # a gathered mean, so with them only signs are exact
        kw = {"wire_dtype": None} if output == "default" else {"output": "mean", "wire_dtype": None}
        opt = DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95)), model,
                                   comm=wcomm, sparsifier="exdyna", density=0.05, **kw)
        sent = 0
        for t in range(6):
            _train(model, opt, rank, [t])
            sent += opt.stats.bytes_sent
        wires.append(str(opt.sparsifier.wire_dtype))
        runs[output] = (opt.sparsifier.output, _flat(model.parameters()), opt.sparsifier.residual, sent)
    (out_d, theta_d, res_d, sent_d), (out_m, theta_m, res_m, sent_m) = runs["default"], runs["mean"]
    mpi_assert(out_d == "sign" and out_m == "mean", f"outputs {out_d}, {out_m}", wcomm)
    mpi_assert(wires == ["None", "None"], f"wires {wires}", wcomm)
    mpi_assert(theta_d.tobytes() == theta_m.tobytes() and res_d.tobytes() == res_m.tobytes(),
               "gathering signs changed the parameters or the momentum", wcomm)
    mpi_assert(sent_d < sent_m if wcomm.Get_size() > 1 else sent_d == sent_m == 0,
               f"bytes: signs {sent_d}, means {sent_m}", wcomm)
