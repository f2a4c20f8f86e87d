"""DLPack in and out: any framework's 1-D gradient goes in without a copy and comes back as its own kind.

Every result is compared with the NumPy path on the same data (a second sparsifier fed NumPy), so a
wrong conversion cannot pass. JAX and TensorFlow tests skip where the framework is not installed,
except in the frameworks lane (``bash tests/run_all.sh --lane frameworks``), which installs both.
"""
import numpy as np
import pytest
from mpi4py import MPI

import exdyna_mpi
from exdyna_mpi.arrays.dlpack import _aligned_host, as_input
from tests.conftest import require

N = 40_000
DENSITY = 0.01


def _grads(steps=3, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(N).astype(dtype) for _ in range(steps)]


def _reference(grads, name="exdyna"):
    sp = exdyna_mpi.make(name, N, DENSITY, MPI.COMM_SELF)
    return [np.array(sp.step(g), copy=True) for g in grads], sp


def _aligned(a):
    """A 64-byte aligned copy (JAX and TensorFlow share only aligned host memory)."""
    raw = np.zeros(a.nbytes + 64, np.uint8)
    off = -raw.ctypes.data % 64
    b = raw[off:off + a.nbytes].view(a.dtype)
    b[...] = a
    return b


# --------------------------------------------------------------------------- NumPy
def test_numpy_in_numpy_out_no_copy():
    g = _grads(1)[0]
    inp = as_input(g)
    assert inp.array is g and inp.device == "cpu" and inp.error is None
    sp = exdyna_mpi.ExDyna(N, DENSITY, MPI.COMM_SELF)
    keep = g.copy()
    out = sp.step(g)
    assert type(out) is np.ndarray and out.dtype == g.dtype and out.shape == (N,)
    np.testing.assert_array_equal(g, keep)  # the input is read, never written
    buf = np.empty(N, np.float32)
    res = sp.step(g, out=buf)
    assert res is buf or res.ctypes.data == buf.ctypes.data


# --------------------------------------------------------------------------- PyTorch
torch = pytest.importorskip("torch", reason="PyTorch is not installed")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_torch_matches_numpy_and_returns_torch(dtype):
    grads = _grads(3, dtype=dtype)
    ref, _ = _reference(grads)
    sp = exdyna_mpi.ExDyna(N, DENSITY, MPI.COMM_SELF)
    for g, r in zip(grads, ref):
        t = torch.from_numpy(g.copy())
        out = sp.step(t)
        assert isinstance(out, torch.Tensor) and out.dtype == t.dtype and out.device == t.device
        np.testing.assert_array_equal(out.numpy(), r)


def test_torch_zero_copy_both_ways():
    t = torch.randn(N)
    inp = as_input(t)
    assert inp.error is None and inp.array.ctypes.data == t.data_ptr()  # input not copied
    buf = np.zeros(N, np.float32)
    back = inp.wrap(buf)
    assert isinstance(back, torch.Tensor) and back.data_ptr() == buf.ctypes.data  # output not copied
    back[7] = 5.0
    assert buf[7] == 5.0


def test_torch_out_is_the_gradient_buffer():
    grads = _grads(3)
    ref, _ = _reference(grads)
    sp = exdyna_mpi.ExDyna(N, DENSITY, MPI.COMM_SELF)
    flat = torch.empty(N)
    ptr = flat.data_ptr()
    for g, r in zip(grads, ref):
        flat.copy_(torch.from_numpy(g))
        res = sp.step(flat, out=flat)
        assert res.data_ptr() == ptr and flat.data_ptr() == ptr
        np.testing.assert_array_equal(flat.numpy(), r)


def _refused(sp, grad, text):
    before = (sp.iteration, sp.residual.copy())
    with pytest.raises(exdyna_mpi.StepError, match=text):
        sp.step(grad)
    assert sp.iteration == before[0]
    np.testing.assert_array_equal(sp.residual, before[1])


def test_torch_bad_inputs_refused_with_state_untouched():
    sp = exdyna_mpi.ExDyna(N, DENSITY, MPI.COMM_SELF)
    sp.step(torch.randn(N))
    _refused(sp, torch.randn(N, requires_grad=True), "requires grad")
    _refused(sp, torch.nn.Parameter(torch.randn(N)), "requires grad")
    _refused(sp, torch.randn(2 * N)[::2], "not contiguous")        # imports with stride 2, then refused
    _refused(sp, torch.randn(N, 3)[:, 0], "not contiguous")
    _refused(sp, torch.randn(N, dtype=torch.bfloat16), "earlier steps fixed the dtype")
    _refused(sp, torch.zeros(N, dtype=torch.int32), "dtype int32; accepted: float16, bfloat16, float32, float64")
    _refused(sp, torch.randn(N // 10, 10), "2 dimensions")
    _refused(sp, torch.randn(N, dtype=torch.float64), "earlier steps fixed the dtype")
    _refused(sp, torch.zeros(N, device="meta"), "not on this sparsifier's device")
    _refused(sp, [0.0] * N, "not an array")
    sp.step(torch.randn(N))  # a good step after all the refusals goes through
    assert sp.iteration == 2


def test_torch_non_contiguous_import_is_a_strided_view():
    # np.from_dlpack accepts a strided torch view; check_vector's stride test must be what refuses it.
    t = torch.randn(2 * N)[::2]
    inp = as_input(t)
    assert inp.error is None and inp.array.strides == (8,)


def test_torch_cuda_tensor_without_cupy_is_a_device_error():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    pytest.importorskip("cupy", reason="CuPy is not installed")
    t = torch.randn(N, device="cuda")
    sp = exdyna_mpi.ExDyna(N, DENSITY, MPI.COMM_SELF, device="cpu")
    _refused(sp, t, "not on this sparsifier's device")


# --------------------------------------------------------------------------- JAX
def test_jax_in_jax_out():
    jax = require("jax")
    import jax.numpy as jnp

    grads = _grads(3)
    ref, _ = _reference(grads)
    sp = exdyna_mpi.ExDyna(N, DENSITY, MPI.COMM_SELF)
    for g, r in zip(grads, ref):
        x = jnp.asarray(g)
        inp = as_input(x)
        assert inp.error is None and inp.array.ctypes.data == x.unsafe_buffer_pointer()  # no copy in
        out = sp.step(x)
        assert isinstance(out, jax.Array) and out.dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(out), r)
    buf = _aligned(np.arange(N, dtype=np.float32))
    assert as_input(jnp.zeros(N)).wrap(buf).unsafe_buffer_pointer() == buf.ctypes.data  # no copy out


def _bf16_reference(bits):
    """The outputs (uint16) of a NumPy run fed the bfloat16 patterns ``bits`` (ml_dtypes)."""
    ml_dtypes = require("ml_dtypes")
    sp = exdyna_mpi.ExDyna(N, DENSITY, MPI.COMM_SELF)
    return [sp.step(b.view(ml_dtypes.bfloat16)).view(np.uint16).copy() for b in bits]


def test_jax_bfloat16_in_and_out():
    jax = require("jax")
    import jax.numpy as jnp

    xs = [jnp.asarray(g, dtype=jnp.bfloat16) for g in _grads(4)]
    ref = _bf16_reference([np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16)) for x in xs])
    sp = exdyna_mpi.ExDyna(N, DENSITY, MPI.COMM_SELF)
    for x, r in zip(xs, ref):
        out = sp.step(x)
        assert isinstance(out, jax.Array) and out.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(out, jnp.uint16)), r)


def test_tensorflow_bfloat16_in_and_out():
    tf = require("tensorflow")
    xs = [tf.cast(tf.constant(g), tf.bfloat16) for g in _grads(5)]
    ref = _bf16_reference([tf.bitcast(x, tf.uint16).numpy() for x in xs])
    sp = exdyna_mpi.ExDyna(N, DENSITY, MPI.COMM_SELF)
    for x, r in zip(xs, ref):
        out = sp.step(x)
        assert isinstance(out, tf.Tensor) and out.dtype == tf.bfloat16
        np.testing.assert_array_equal(tf.bitcast(out, tf.uint16).numpy(), r)


# --------------------------------------------------------------------------- TensorFlow
def test_tensorflow_in_tensorflow_out():
    tf = require("tensorflow")
    grads = _grads(2)
    ref, _ = _reference(grads)
    sp = exdyna_mpi.ExDyna(N, DENSITY, MPI.COMM_SELF)
    for g, r in zip(grads, ref):
        out = sp.step(tf.constant(g))
        assert isinstance(out, tf.Tensor) and out.dtype == tf.float32
        np.testing.assert_array_equal(out.numpy(), r)
    buf = _aligned(np.arange(N, dtype=np.float32))
    t = as_input(tf.zeros(N)).wrap(buf)
    assert as_input(t).array.ctypes.data == buf.ctypes.data  # no copy out
    # An unaligned result is copied to aligned memory instead of crashing TensorFlow's kernels.
    odd = np.arange(N + 1, dtype=np.float32)[1:]
    assert odd.ctypes.data % 64 != 0
    t = as_input(tf.zeros(N)).wrap(odd)
    np.testing.assert_array_equal(t[1:4].numpy(), odd[1:4])


def test_aligned_host_copies_only_when_needed():
    a = _aligned(np.arange(10, dtype=np.float64))
    assert _aligned_host(a) is a
    odd = np.arange(17, dtype=np.float32)[1:]
    b = _aligned_host(odd)
    assert b.ctypes.data % 64 == 0 and b is not odd
    np.testing.assert_array_equal(b, odd)


# --------------------------------------------------------------------------- the framework examples
def _example(name):
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "jobs", "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"exdyna_example_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name, framework", [("jax_train", "jax"), ("tf_train", "tensorflow")])
def test_framework_example_trains(name, framework):
    require(framework)
    first, last, params = _example(name).train(MPI.COMM_SELF, steps=30)
    assert last < 0.8 * first, (first, last)
    assert np.isfinite(params).all()
