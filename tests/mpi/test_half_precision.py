"""Half-precision gradients (float16, bfloat16) through every sparsifier, on the host.

A half gradient is computed in float32: the residual is float32 and the output is rounded to the
gradient's dtype. With ``wire_dtype="float32"`` float32 values go on the wire, and the reference here
is a second instance of the same sparsifier fed the float32-widened gradients: rounded to the half
dtype, its output must equal the half run's bit for bit, and its residual must be the half run's
residual. (16-bit values on the wire, the default for a half gradient: tests/mpi/test_wire.py.) Also: float32 unchanged,
ranks bit-identical, the output's kind and dtype, ``out=``, ``state_dict`` round trip, the refusal
text, and the torch adapters (``DistributedOptimizer``, the DDP hook) with a bfloat16 model.

Run serially (P=1) and under ``mpiexec -n 2/3/4 ... --with-mpi``.
"""
import hashlib

import numpy as np
import pytest
from mpi4py import MPI

import exdyna_mpi
from exdyna_mpi.arrays.half import bf16_bits_to_f32, f32_to_bf16_bits
from tests.conftest import allgather_array, init_gloo, mpi_assert, require

pytestmark = pytest.mark.mpi

NAMES = exdyna_mpi.available()
OPTIONS = {"oktopk": dict(local_period=2, global_period=2, region_period=3), "fft": dict(block=256)}
NUMEL, DENSITY, STEPS = 4096, 0.02, 3
DTYPES = ("bfloat16", "float16", "float32")


def _grad32(rank, t, dtype="float32"):
    """A float32 gradient whose values are exact in ``dtype``: what the half run is given, widened."""
    rng = np.random.default_rng([11, rank, t])
    g = rng.laplace(0.0, 0.03, NUMEL)
    lo = (t * NUMEL // 5) % NUMEL
    g[lo: lo + NUMEL // 10] *= 4.0
    return f32_round(g.astype(np.float32), dtype)


def f32_round(x, dtype):
    """float32 ``x`` rounded to ``dtype`` and widened back to float32 (float32: ``x`` itself)."""
    if dtype == "bfloat16":
        return bf16_bits_to_f32(f32_to_bf16_bits(x))
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    return x


def _bits(x):
    """The raw bits of a NumPy or torch array as an unsigned integer NumPy array."""
    if not isinstance(x, np.ndarray):
        import torch

        if x.dtype == torch.bfloat16:
            x = x.view(torch.int16)
        x = x.numpy()
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize]).copy()


def _as_half_bits(x32, dtype):
    """The bits of float32 ``x32`` rounded to ``dtype`` (numpy RNE for float16, ours for bf16)."""
    if dtype == "bfloat16":
        return f32_to_bf16_bits(x32)
    if dtype == "float16":
        return x32.astype(np.float16).view(np.uint16)
    return x32.view(np.uint32)


def _to_input(g32, dtype, kind):
    """``g32`` as the gradient the user would pass: NumPy (float16/float32) or torch (any)."""
    if kind == "torch":
        torch = require("torch")
        return torch.from_numpy(g32.copy()).to(getattr(torch, dtype))
    return g32.astype(dtype)


def _kind_for(dtype):
    return "torch" if dtype == "bfloat16" else "numpy"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_half_equals_rounded_float32_reference(name, dtype, wcomm):
    kind = _kind_for(dtype)
    if kind == "torch":
        torch = require("torch")
    rank = wcomm.Get_rank()
    sp = exdyna_mpi.make(name, NUMEL, DENSITY, wcomm, wire_dtype="float32", **OPTIONS.get(name, {}))
    ref = exdyna_mpi.make(name, NUMEL, DENSITY, wcomm, **OPTIONS.get(name, {}))
    for t in range(STEPS):
        g32 = _grad32(rank, t, dtype)
        g = _to_input(g32, dtype, kind)
        out = sp.step(g)
        want = ref.step(g32.copy())
        ok_kind = isinstance(out, np.ndarray) if kind == "numpy" else isinstance(out, torch.Tensor)
        mpi_assert(ok_kind and out.dtype == g.dtype and tuple(out.shape) == (NUMEL,),
                   f"{name}/{dtype}: out is {type(out)} {out.dtype}", wcomm)
        got = _bits(out)
        mpi_assert(np.array_equal(got, _as_half_bits(np.asarray(want, np.float32), dtype)),
                   f"{name}/{dtype} t={t}: output is not the rounded float32 reference", wcomm)
        mpi_assert(sp.residual.dtype == np.float32 and np.array_equal(sp.residual.view(np.uint32),
                                                                      ref.residual.view(np.uint32)),
                   f"{name}/{dtype} t={t}: residual {sp.residual.dtype} differs from the reference", wcomm)
        allb = allgather_array(got, wcomm)
        mpi_assert((allb == allb[0]).all(), f"{name}/{dtype} t={t}: ranks differ", wcomm)
        mpi_assert(sp.stats.bytes_sent == ref.stats.bytes_sent, f"{name}/{dtype}: wire bytes differ", wcomm)


@pytest.mark.parametrize("name", ["exdyna", "topk", "dense"])
def test_half_out_buffer_and_state_dict_round_trip(name, wcomm):
    torch = require("torch")
    rank = wcomm.Get_rank()
    sp = exdyna_mpi.make(name, NUMEL, DENSITY, wcomm)
    buf = torch.empty(NUMEL, dtype=torch.bfloat16)
    sp.step(_to_input(_grad32(rank, 0), "bfloat16", "torch"), out=buf)
    d = sp.state_dict()
    twin = exdyna_mpi.make(name, NUMEL, DENSITY, wcomm)
    twin.load_state_dict(d)
    g = _to_input(_grad32(rank, 1), "bfloat16", "torch")
    res = sp.step(g.clone(), out=buf)
    again = twin.step(g.clone())
    mpi_assert(res.data_ptr() == buf.data_ptr() and res.dtype == torch.bfloat16,
               f"{name}: out= not used", wcomm)
    mpi_assert(np.array_equal(_bits(buf), _bits(again)) and np.array_equal(sp.residual, twin.residual)
               and twin.residual.dtype == np.float32, f"{name}: state_dict does not round-trip", wcomm)
    # the dtype stays fixed: a float32 step after bfloat16 ones is refused on every rank
    with pytest.raises(exdyna_mpi.StepError, match="earlier steps fixed the dtype"):
        twin.step(_grad32(rank, 2))


def test_ml_dtypes_bfloat16(wcomm):
    ml_dtypes = require("ml_dtypes")
    rank = wcomm.Get_rank()
    sp = exdyna_mpi.make("exdyna", NUMEL, DENSITY, wcomm, wire_dtype="float32")
    ref = exdyna_mpi.make("exdyna", NUMEL, DENSITY, wcomm)
    for t in range(2):
        g32 = _grad32(rank, t, "bfloat16")
        out = sp.step(g32.astype(ml_dtypes.bfloat16))
        want = ref.step(g32)
        mpi_assert(out.dtype == np.dtype(ml_dtypes.bfloat16)
                   and np.array_equal(out.view(np.uint16), f32_to_bf16_bits(want)), "ml_dtypes bf16", wcomm)


def test_bf16_rounding_is_nearest_even_with_nan_and_inf():
    x = np.array([1.0, 1.00390625, 1.01171875, -1.00390625, np.finfo(np.float32).max, np.inf, -np.inf, np.nan,
                  -np.nan, 0.0, -0.0, 1e-40], np.float32)
    got = f32_to_bf16_bits(x)
    # 1 + 2^-8 is a tie: down to 1 (even); 1 + 3*2^-8 a tie: up to 1 + 2^-6; the largest float32 to inf
    assert got[:4].tolist() == [0x3F80, 0x3F80, 0x3F82, 0xBF80]
    assert got[4] == 0x7F80 and got[5] == 0x7F80 and got[6] == 0xFF80
    back = bf16_bits_to_f32(got)
    assert np.isnan(back[7]) and np.isnan(back[8]) and got[9] == 0 and got[10] == 0x8000
    assert bf16_bits_to_f32(f32_to_bf16_bits(back[:4])).tolist() == back[:4].tolist()
    torch = pytest.importorskip("torch")
    ours = f32_to_bf16_bits(np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 1e3)
    t = torch.from_numpy(bf16_bits_to_f32(ours))
    assert np.array_equal(_bits(t.to(torch.bfloat16)), ours)   # torch agrees on exact values
    r = np.random.default_rng(1).standard_normal(10000).astype(np.float32)
    assert np.array_equal(_bits(torch.from_numpy(r).to(torch.bfloat16)), f32_to_bf16_bits(r))


@pytest.mark.parametrize("bad", ["int32", "uint16", "float64"])
def test_refusal_names_the_dtype_and_the_accepted_ones(bad, wcomm):
    P, rank = wcomm.Get_size(), wcomm.Get_rank()
    sp = exdyna_mpi.make("exdyna", NUMEL, DENSITY, wcomm)
    g = _grad32(rank, 0).astype(np.float16)
    arg = g.astype(bad) if rank == P - 1 else g
    if bad == "float64":   # the first step fixes float16; float64 then is a mismatch
        sp.step(g)
        arg = g.astype(np.float64) if rank == P - 1 else g
    with pytest.raises(exdyna_mpi.StepError) as ei:
        sp.step(arg)
    msgs = wcomm.allgather(str(ei.value))
    want = ("earlier steps fixed the dtype" if bad == "float64"
            else f"grad has dtype {bad}; accepted: float16, bfloat16, float32, float64")
    mpi_assert(len(set(msgs)) == 1 and want in msgs[0] and f"rank {P - 1}:" in msgs[0], msgs[0], wcomm)


def test_torch_int_refusal_text(wcomm):
    torch = require("torch")
    sp = exdyna_mpi.make("topk", NUMEL, DENSITY, wcomm)
    with pytest.raises(exdyna_mpi.StepError, match="grad has dtype int32; accepted: float16, bfloat16"):
        sp.step(torch.zeros(NUMEL, dtype=torch.int32))


# --------------------------------------------------------------------------- torch adapters, bfloat16
def _model(seed=0):
    torch = require("torch")
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(torch.bfloat16)


def _batch(step, rank):
    torch = require("torch")
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=g).to(torch.bfloat16), torch.randint(0, 4, (16,), generator=g)


def _digest(model):
    torch = require("torch")
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(_bits(flat).tobytes()).hexdigest()


@pytest.mark.parametrize("name", ["exdyna", "topk"])
def test_distributed_optimizer_trains_a_bf16_model(name, wcomm):
    torch = require("torch")
    from exdyna_mpi.adapters.torch import DistributedOptimizer

    rank = wcomm.Get_rank()
    model = _model(seed=rank)     # rank 0's parameters are broadcast
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model, sparsifier=name,
                               density=0.1, comm=wcomm)
    before = _digest(model)
    for step in range(3):
        x, y = _batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x).float(), y).backward()
        opt.step()
    mpi_assert(opt.flat_grad.dtype == torch.bfloat16 and opt.sparsifier.residual.dtype == np.float32,
               f"flat grad {opt.flat_grad.dtype}", wcomm)
    digests = wcomm.allgather(_digest(model))
    mpi_assert(len(set(digests)) == 1 and digests[0] != before, f"{name}: ranks differ or no training", wcomm)


@pytest.fixture(scope="module")
def gloo():
    dist = pytest.importorskip("torch.distributed")
    require("torch")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    init_gloo()
    yield dist
    dist.destroy_process_group()


@pytest.mark.parametrize("scope", ["model", "bucket"])
def test_ddp_hook_trains_a_bf16_model(scope, gloo):
    torch = require("torch")
    from exdyna_mpi.adapters.torch import ExDynaHookState, exdyna_hook

    rank = MPI.COMM_WORLD.Get_rank()
    model = _model(seed=rank)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005)
    state = ExDynaHookState("exdyna", 0.1, scope=scope)
    ddp.register_comm_hook(state, exdyna_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = _digest(model)
    try:
        for step in range(3):
            x, y = _batch(step, rank)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x).float(), y).backward()
            opt.step()
    finally:
        state.close()
    digests = MPI.COMM_WORLD.allgather(_digest(model))
    mpi_assert(len(set(digests)) == 1 and digests[0] != before and state.step == 3,
               f"{scope}: ranks differ or no training: {digests}")
