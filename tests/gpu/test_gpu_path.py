"""GPU lane: CuPy buffers, real kernels (both variants), staged and direct transport.

Runs only where CuPy can allocate on a CUDA device (``exdyna_mpi.arrays.gpu_available()``); the lane
runs it serially and under ``mpiexec -n 2 ... --with-mpi``. Never runs under the simulator.
"""
import numpy as np
import pytest
from mpi4py import MPI

import exdyna_mpi
from exdyna_mpi.arrays import gpu_available
from exdyna_mpi.sparsifiers.registry import REGISTRY
from tests.conftest import allgather_array, mpi_assert

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu_available(), reason="needs a CUDA device visible to CuPy"),
]


@pytest.fixture(scope="module")
def cp():
    import cupy

    from exdyna_mpi.kernels import cuda as kc

    if kc.SIMULATOR:
        pytest.skip("NUMBA_ENABLE_CUDASIM is on: the GPU lane needs the real CUDA target")
    return cupy


@pytest.mark.parametrize("variant", ["safe", "fast"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n,lo,hi", [(1 << 20, 0, 1 << 20), (1_000_003, 12_345, 987_001), (5000, 77, 77)])
def test_kernels_match_cpu(cp, variant, dtype, n, lo, hi):
    from exdyna_mpi.kernels import cpu
    from exdyna_mpi.kernels import cuda as kc

    rng = np.random.default_rng(n)
    r = rng.standard_normal(n).astype(dtype)
    g = rng.standard_normal(n).astype(dtype)
    g[[1, n // 2, n - 1]] = [np.inf, np.nan, -np.inf]
    thr = dtype(2.5)
    acc, idx = np.empty(n, dtype), np.empty(max(hi - lo, 1), np.int32)
    want = cpu.accumulate_select(r, g, acc, lo, hi, thr, idx)
    d_acc, d_idx = cp.empty(n, dtype), cp.full(max(hi - lo, 1), -1, np.int32)
    got = kc.accumulate_select(cp.asarray(r), cp.asarray(g), d_acc, lo, hi, thr, d_idx, variant=variant)
    assert got == (int(want[0]), int(want[1]))
    np.testing.assert_array_equal(cp.asnumpy(d_idx[: got[0]]), idx[: want[0]])
    # A NaN's payload is the hardware's: x86 keeps the operand's, an NVIDIA GPU writes its canonical
    # NaN (seen on an H100: float32 0x7fffffff against the CPU's 0x7fc00000). A non-finite acc makes
    # the step raise or skip (``nonfinite``), so no payload reaches a result; everything else is bitwise.
    got_acc = cp.asnumpy(d_acc)
    nan = np.isnan(acc)
    np.testing.assert_array_equal(np.isnan(got_acc), nan)
    assert got_acc[~nan].tobytes() == acc[~nan].tobytes()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("aware", ["0", "1"], ids=["staged", "direct"])
def test_exdyna_on_cupy_matches_cpu(cp, monkeypatch, aware):
    from exdyna_mpi.transport import device as dt

    if aware == "1" and MPI.COMM_WORLD.Get_size() > 1 and not dt.probe_cuda_aware()[0]:
        pytest.skip("this MPI is not CUDA-aware: direct device buffers would crash it")
    monkeypatch.setenv(dt.ENV, aware)
    comm = MPI.COMM_WORLD
    n = 200_003
    ref = exdyna_mpi.ExDyna(n, 0.01, comm, device="cpu")
    dev = exdyna_mpi.ExDyna(n, 0.01, comm, device="cuda")
    assert dev.exchange.cuda_aware is (aware == "1")
    rng = np.random.default_rng(comm.Get_rank())
    ok = True
    for _ in range(5):
        g = (rng.standard_normal(n) * 0.02).astype(np.float32)
        want = ref.step(g.copy())
        got = dev.step(cp.asarray(g))
        ok &= isinstance(got, cp.ndarray) and cp.asnumpy(got).tobytes() == want.tobytes()
        ok &= dev.residual.tobytes() == ref.residual.tobytes()
        ok &= list(dev.stats.counts) == list(ref.stats.counts)
    mpi_assert(ok, "GPU ExDyna differs from the CPU ExDyna")
    outs = allgather_array(cp.asnumpy(got))
    mpi_assert((outs == outs[0]).all(), "ranks hold different outputs")


@pytest.mark.mpi(min_size=1)
def test_auto_device_resumed_from_a_cpu_checkpoint_steps_on_cupy(cp):
    """A ``device="auto"`` sparsifier that loads a checkpoint before its first step binds to the
    device of the first gradient (CuPy here), not to the CPU, and continues the CPU run's bits."""
    comm = MPI.COMM_WORLD
    n = 200_003
    ref = exdyna_mpi.ExDyna(n, 0.01, comm, device="cpu")
    rng = np.random.default_rng(comm.Get_rank())
    gs = [(rng.standard_normal(n) * 0.02).astype(np.float32) for _ in range(5)]
    for g in gs[:2]:
        ref.step(g.copy())
    dev = exdyna_mpi.ExDyna(n, 0.01, comm)
    dev.load_state_dict(ref.state_dict())
    ok = dev.ops is None
    for g in gs[2:]:
        want = ref.step(g.copy())
        got = dev.step(cp.asarray(g))
        ok &= isinstance(got, cp.ndarray) and cp.asnumpy(got).tobytes() == want.tobytes()
        ok &= dev.residual.tobytes() == ref.residual.tobytes()
    mpi_assert(ok and dev.device == "cuda", "the resumed auto-device sparsifier did not continue on CuPy")


@pytest.mark.mpi(min_size=1)
def test_no_full_length_copy_to_host(cp, monkeypatch):
    """A step moves O(k) bytes device->host (staged payload + count words), never O(numel).

    Counted at every device->host route the library has (CuPy forbids implicit ``np.asarray`` of a
    device array, so any other copy would raise): the staging helper, ``BACKEND.read_words`` (the
    one route of the count words and histograms, whichever controller reads them), asnumpy.
    """
    from exdyna_mpi.arrays import device as _device
    from exdyna_mpi.transport import device as dt

    monkeypatch.setenv(dt.ENV, "0")
    moved = []
    backend = _device.BACKEND
    real_stage, real_words, real_asnumpy = dt._to_host_async, backend.read_words, cp.asnumpy
    real_words_async = backend.read_words_async

    def stage(dev, host):
        moved.append(dev.nbytes)
        real_stage(dev, host)

    def words(w):
        moved.append(w.nbytes)
        return real_words(w)

    def words_async(w):   # a one-rank step's words, read while the device finishes the step
        moved.append(w.nbytes)
        return real_words_async(w)

    def asnumpy(a, *args, **kw):
        moved.append(a.nbytes)
        return real_asnumpy(a, *args, **kw)

    comm = MPI.COMM_WORLD
    n = 1 << 21
    sp = exdyna_mpi.ExDyna(n, 0.001, comm, device="cuda")
    g = cp.asarray((np.random.default_rng(1).standard_normal(n) * 0.0033).astype(np.float32))
    sp.step(g)  # warm-up: compile, allocate
    monkeypatch.setattr(dt, "_to_host_async", stage)
    monkeypatch.setattr(backend, "read_words", words)
    monkeypatch.setattr(backend, "read_words_async", words_async)
    monkeypatch.setattr(cp, "asnumpy", asnumpy)
    for _ in range(3):
        sp.step(g)
    biggest = max(moved) if moved else 0
    mpi_assert(biggest < n * 4 // 10, f"a step copied {biggest} bytes to the host (numel {n})")
    mpi_assert(len(moved) > 0, "no device->host traffic counted: the hooks are not on the path")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n,lo,hi,stride", [(1 << 22, 0, 1 << 22, 64), (3_000_017, 4_096, 2_999_969, 32),
                                            (100_000, 320, 99_968, 1), (38_282, 16_800, 38_282, 64),
                                            (38_282, 23_040, 38_282, 1), (38_282, 38_272, 38_282, 1)])
def test_measure_pass_warp_marks_equal_atomic_marks(cp, dtype, n, lo, hi, stride):
    """The measuring pass with marks by warp ballot (the GPU's default) and by atomic or (the
    variant the simulator checks against NumPy) leave the same acc, words and mask, on a vector with
    a pile of values at the mark (error feedback's shape: many marks per mask word).

    The 38,282-element cases (numel % 32 = 10) are the last partition of that model at P = 2, and
    a range of 10 elements. There the last block's chunk is not a multiple of 32 (between three
    and four blocks long, or under one warp), so a loop that tested each lane's own index would
    split a warp: its upper lanes would mark without lane 0 (their marks lost, as the kernel once
    did) or overwrite lane 0's word. The end of the range is all pile, so those lanes have marks to
    lose."""
    import math

    from exdyna_mpi.kernels import cuda as kc
    from exdyna_mpi.kernels.cuda.launch import chunk_size, grid_shape

    rng = np.random.default_rng(n)
    r = (rng.standard_normal(n) * 0.05).astype(dtype)
    g = (rng.standard_normal(n) * 0.05).astype(dtype)
    r[rng.integers(0, n, n // 50)] = 0.1   # the pile
    if n == 38_282:
        block = kc.CONFIG.block
        nb, bd = grid_shape(n, block * stride // math.gcd(block, stride))
        cs = chunk_size(hi - lo, nb, bd)
        last = (hi - lo) - (math.ceil((hi - lo) / cs) - 1) * cs
        assert last % 32 and (3 * bd < last < 4 * bd or last < 32), (nb, bd, cs, last)   # the cases it is here for
        r[hi - 4 * bd:hi] = 0.1
        g[hi - 4 * bd:hi] = 0.0
    g[[1, n // 2]] = [np.inf, np.nan]
    mark = dtype(0.098)
    mb = 23 if dtype == np.float32 else 52
    ity = np.int32 if dtype == np.float32 else np.int64
    key = int(np.array([mark], dtype).view(ity)[0])
    coarse = (mb - 3, (key >> (mb - 3)) - 20, 40)
    fine = (mb - 10, (key >> (mb - 10)) - 8, 256)
    got = {}
    for variant in ("safe", "fast"):
        s = kc.Scratch(cp.zeros(kc.Scratch.size(), cp.int64), zeros=lambda m, dt: cp.zeros(m, dt))
        acc = cp.empty(n, dtype)
        kc.accumulate_measure_async(cp.asarray(r), cp.asarray(g), acc, lo, hi, mark, *coarse, s, stream=0, fine=fine,
                                    stride=stride, variant=variant)
        words = cp.asnumpy(s.totals_hist[:2 + coarse[2] + fine[2]])
        mask = cp.asnumpy(s.mask[:(hi - lo + 31) // 32])
        a = cp.asnumpy(acc)
        got[variant] = (a[~np.isnan(a)].tobytes(), words.tolist(), mask.tobytes())
    assert got["safe"][1][0] > (hi - lo) // 100   # many marks
    assert got["fast"] == got["safe"]


def test_driver_launch_takes_any_grid_with_one_entry(cp):
    # a grid that follows the selection's size (gather, scatter) must not make a launch entry, nor
    # go through Numba's launch, per size: one entry per kernel and argument kinds, right results
    from exdyna_mpi.kernels import cuda as kc
    from exdyna_mpi.kernels.cuda.launch import _fast
    from exdyna_mpi.kernels.cuda.scatter_gather import _gather

    if kc.CONFIG.launch != "fast":
        pytest.skip("EXDYNA_CUDA_LAUNCH is not 'fast': the raw driver launch is off")
    stream = kc.cuda.external_stream(cp.cuda.get_current_stream().ptr)
    src = cp.arange(100_000, dtype=cp.float32)
    _fast.clear()
    for m in (1, 7, 1000, 33_333, 99_999):
        idx = cp.asarray(np.random.default_rng(m).choice(100_000, m, replace=False).astype(np.int32))
        out = cp.full(m, -1, cp.float32)
        kc.gather(src, idx, out, stream)
        cp.cuda.get_current_stream().synchronize()
        assert cp.array_equal(out, src[idx]), m
    keys = [k for k in _fast if k[0] == id(_gather)]
    assert len(keys) == 1 and _fast[keys[0]], keys


@pytest.mark.parametrize("out_kind", ["none", "grad"])
def test_one_rank_step_finished_on_device_matches_cpu(cp, monkeypatch, out_kind):
    # P = 1: the device settles the threshold and finishes the step behind the measuring pass
    # (CudaOps.accumulate_measure_finish); the steps it finishes are the CPU's, to the bit
    from exdyna_mpi.arrays import cuda_ops

    settled = []
    real = cuda_ops.CudaOps.finish_settled
    monkeypatch.setattr(cuda_ops.CudaOps, "finish_settled", staticmethod(lambda: (settled.append(True), real())[1]))
    n = 1_000_003
    ref = exdyna_mpi.ExDyna(n, 0.001, MPI.COMM_SELF, device="cpu")
    dev = exdyna_mpi.ExDyna(n, 0.001, MPI.COMM_SELF, device="cuda")
    rng = np.random.default_rng(7)
    g = rng.standard_normal(n)
    for step in range(16):
        g = 0.9 * g + 0.45 * rng.standard_normal(n)
        h = (g * 0.01).astype(np.float32)
        want = ref.step(h.copy())
        d = cp.asarray(h)
        got = dev.step(d) if out_kind == "none" else dev.step(d, out=d)
        assert cp.asnumpy(got).tobytes() == want.tobytes(), step
        assert dev.residual.tobytes() == ref.residual.tobytes(), step
        assert list(dev.stats.counts) == list(ref.stats.counts) and dev.stats.threshold == ref.stats.threshold
    assert sum(settled) >= 4, settled


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_gradients_on_the_device_equal_the_host(cp, dtype, wcomm):
    # CuPy float16 / torch CUDA bfloat16 in, the same kind out, 16-bit values on the wire; the host
    # run of the same values gives the same bits, ranks identical
    rank = wcomm.Get_rank()
    n = 1 << 20
    dev = exdyna_mpi.ExDyna(n, 0.01, wcomm, device="cuda")
    host = exdyna_mpi.ExDyna(n, 0.01, wcomm, device="cpu")
    rng = np.random.default_rng(rank)
    for _ in range(3):
        g = (rng.standard_normal(n) * 0.1).astype(np.float32)
        if dtype == "float16":
            got = cp.asnumpy(dev.step(cp.asarray(g.astype(np.float16)))).view(np.uint16)
            want = host.step(g.astype(np.float16)).view(np.uint16)
        else:
            torch = pytest.importorskip("torch")
            out = dev.step(torch.from_numpy(g).to("cuda", torch.bfloat16))
            assert out.is_cuda and out.dtype == torch.bfloat16
            got = out.view(torch.int16).cpu().numpy()
            want = host.step(torch.from_numpy(g).to(torch.bfloat16)).view(torch.int16).numpy()
        mpi_assert(np.array_equal(got, want), f"{dtype}: device and host differ", wcomm)
        allo = allgather_array(got, wcomm)
        mpi_assert((allo == allo[0]).all(), f"{dtype}: ranks differ", wcomm)


def test_bind_local_gpu_on_a_real_device(cp, monkeypatch):
    """The real-GPU branch of ``bind_local_gpu``: with the shared-memory split or the launcher's
    variable, the current device becomes ``local rank mod GPUs`` (with one GPU it stays), the id is
    returned, and ``EXDYNA_BIND_GPU=1`` makes a device exchange bind the same way when it is built."""
    from exdyna_mpi.transport import binding
    from exdyna_mpi.transport import device as dt

    comm = MPI.COMM_WORLD
    ndev = cp.cuda.runtime.getDeviceCount()
    lrank = binding.local_rank(comm)
    before = cp.cuda.Device().id
    try:
        got = exdyna_mpi.bind_local_gpu(comm)
        want = lrank % ndev if ndev >= 2 else before
        mpi_assert(got == want == cp.cuda.Device().id, f"bound {got}, want {want}, current {cp.cuda.Device().id}")
        # the launcher's variable path (no collective) agrees with the split on a one-node launch
        for v in binding._LOCAL_RANK_VARS:
            monkeypatch.delenv(v, raising=False)
        monkeypatch.setenv("SLURM_LOCALID", str(lrank))
        monkeypatch.setenv(binding.BIND_ENV, "1")
        cp.cuda.Device(before).use()
        dt.DeviceExchange(comm, cuda_aware=False)
        mpi_assert(cp.cuda.Device().id == want, f"the exchange bound {cp.cuda.Device().id}, want {want}")
    finally:
        cp.cuda.Device(before).use()


def _skewed_stream(n, steps, rank):
    """AR(0.9) gradients whose large values drift across the vector, larger on rank 0: the
    partitions' loads move, so faithful rebalancing and the quotas act."""
    rng = np.random.default_rng(100 + rank)
    g = rng.standard_normal(n).astype(np.float32)
    pos = np.arange(n, dtype=np.float32) / n
    for t in range(steps):
        g = (0.9 * g + 0.44 * rng.standard_normal(n)).astype(np.float32)
        bump = np.exp(-((pos - (t / steps)) ** 2) / 0.01).astype(np.float32) * (3.0 if rank == 0 else 1.5)
        yield (g * 0.02 * (1.0 + bump)).astype(np.float32)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name,options", [("exdyna", {}), ("micro", {}), ("exdyna", {"balance": "faithful"}),
                                          ("exdyna", {"max_imbalance": 0.05}),
                                          ("exdyna", {"controller": "faithful"}),
                                          ("exdyna", {"deadline_ms": 1000.0})],
                         ids=["default", "micro", "faithful-balance", "quotas", "faithful-controller", "deadline"])
def test_every_exdyna_setting_on_cupy_matches_cpu_and_repeats(cp, name, options):
    """Each ``jobs/bit_hashes.py`` setting of ExDyna and MiCRO gives the CPU's bits on CuPy at every
    step, and the same bits when run again (no launch-order or atomic-order dependence)."""
    comm = MPI.COMM_WORLD
    n, steps = 300_007, 20
    gs = list(_skewed_stream(n, steps, comm.Get_rank()))
    ref = exdyna_mpi.make(name, n, 0.01, comm, device="cpu", **options)
    runs = [exdyna_mpi.make(name, n, 0.01, comm, device="cuda", **options) for _ in range(2)]
    first_bad = None
    for t, g in enumerate(gs):
        want = ref.step(g.copy())
        for dev in runs:
            got = dev.step(cp.asarray(g))
            same = (cp.asnumpy(got).tobytes() == want.tobytes()
                    and cp.asnumpy(dev.residual).tobytes() == ref.residual.tobytes())
            if not same and first_bad is None:
                first_bad = (t, runs.index(dev), list(ref.stats.counts), list(dev.stats.counts))
    mpi_assert(first_bad is None, f"{name} {options}: (step, run, CPU counts, CuPy counts) first differing: "
                                  f"{first_bad}")
    outs = allgather_array(cp.asnumpy(got))
    mpi_assert((outs == outs[0]).all(), f"{name} {options}: ranks hold different outputs on CuPy")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", [n for n in exdyna_mpi.available() if not REGISTRY[n].CAPABILITIES.device_step])
def test_host_step_sparsifiers_refuse_cuda_clearly(cp, name):
    """A sparsifier whose step is host NumPy code refuses ``device="cuda"`` at construction and a
    CuPy gradient at its first step, with the same clear error on every rank and no state changed;
    host gradients still work."""
    from exdyna_mpi import StepError
    from tests.conftest import same_error_everywhere

    comm = MPI.COMM_WORLD
    n = 4096
    msg = same_error_everywhere(lambda: exdyna_mpi.make(name, n, 0.05, comm, device="cuda"), comm)
    assert "host NumPy code" in msg and "exdyna" in msg
    sp = exdyna_mpi.make(name, n, 0.05, comm)
    g = (np.random.default_rng(comm.Get_rank()).standard_normal(n) * 0.1).astype(np.float32)
    with pytest.raises(StepError, match="host NumPy code"):
        sp.step(cp.asarray(g))
    mpi_assert(sp.iteration == 0 and sp.ops is None, "a refused step changed the state")
    out = sp.step(g)
    mpi_assert(isinstance(out, np.ndarray) and sp.device == "cpu", "host gradients no longer work")
