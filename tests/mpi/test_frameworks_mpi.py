"""JAX arrays and TensorFlow tensors through every sparsifier on every rank.

Each rank feeds its own gradients as the framework's array; a second sparsifier of the same kind is
fed the same values as NumPy, so the framework path must give the NumPy path's bits, the framework's
own type back, and the same output on every rank. Skipped where the framework is not installed,
except in the frameworks lane (``bash tests/run_all.sh --lane frameworks``), which installs both.
"""
import numpy as np
import pytest

import exdyna_mpi
from tests.conftest import allgather_array, mpi_assert, require
from tests.contract import OPTIONS

N, DENSITY, STEPS = 4_096, 0.02, 3


def _grads(rank):
    rng = np.random.default_rng(11 + rank)
    base = np.random.default_rng(5).standard_normal(N)
    return [(0.7 * base + rng.standard_normal(N)).astype(np.float32) for _ in range(STEPS)]


def _to_framework(framework, g):
    if framework == "jax":
        import jax.numpy as jnp

        return jnp.asarray(g)
    import tensorflow as tf

    return tf.constant(g)


def _is_framework(framework, x):
    if framework == "jax":
        import jax

        return isinstance(x, jax.Array)
    import tensorflow as tf

    return isinstance(x, tf.Tensor)


@pytest.mark.parametrize("name", exdyna_mpi.available())
@pytest.mark.parametrize("framework", ["jax", "tensorflow"])
def test_framework_arrays_give_the_numpy_bits_on_every_rank(wcomm, framework, name):
    require(framework)
    kw = OPTIONS.get(name, {})
    sp = exdyna_mpi.make(name, N, DENSITY, wcomm, **kw)
    ref = exdyna_mpi.make(name, N, DENSITY, wcomm, **kw)
    for t, g in enumerate(_grads(wcomm.Get_rank())):
        out = sp.step(_to_framework(framework, g))
        want = np.array(ref.step(g), copy=True)
        got = np.asarray(out)
        mpi_assert(_is_framework(framework, out) and got.dtype == np.float32, f"{type(out)} back", wcomm)
        mpi_assert(np.array_equal(got, want), f"step {t}: not the NumPy path's bits", wcomm)
        every = allgather_array(got, wcomm)
        mpi_assert((every == every[0]).all(), f"step {t}: ranks differ", wcomm)
