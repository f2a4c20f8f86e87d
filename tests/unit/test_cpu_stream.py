"""The streaming adds (exdyna_mpi/kernels/cpu_stream.py): nontemporal stores, the same bits as ``np.add``.

The vector part starts where the output is 64-byte aligned, so every offset of the output's start
(0..16 elements) and lengths around a vector's width exercise the head, the vectors and the tail."""
import numpy as np
import pytest

from exdyna_mpi.kernels import cpu_stream

LENGTHS = [0, 1, 5, 15, 16, 17, 31, 33, 64, 1000, 4099]
TYPES = [(np.float32, np.int32, np.int32(0x7FFFFFFF)), (np.float64, np.int64, np.int64(0x7FFFFFFFFFFFFFFF))]


def _case(dt, n, off, seed):
    rng = np.random.default_rng(seed)
    r = rng.standard_normal(n + 40).astype(dt)
    g = rng.standard_normal(n + 40).astype(dt)
    if n > 3:
        g[off + n // 2] = np.inf
        g[off + n // 3] = -3e38 if dt == np.float32 else -1e308
    buf = np.full(n + 40, 7, dt)
    return r[off:], g[off:], buf, buf[off:off + n], (r[off:off + n] + g[off:off + n])


def test_enabled_on_x86():
    import platform
    assert cpu_stream.ENABLED == (platform.machine().lower() in ("x86_64", "amd64"))


@pytest.mark.parametrize("dt,ity,sign_off", TYPES)
@pytest.mark.parametrize("n", LENGTHS)
def test_stream_add_copy_writes_both(dt, ity, sign_off, n):
    for off in range(17):
        r, g, buf, a, want = _case(dt, n, off, n * 37 + off)
        c = np.full(n + 5, 3, dt)
        cpu_stream.stream_add_copy(r, g, a, c)
        assert np.array_equal(a.view(ity), want.view(ity)), off
        assert np.array_equal(c[:n].view(ity), want.view(ity)) and (c[n:] == 3).all(), off
        assert (buf[:off] == 7).all() and (buf[off + n:] == 7).all(), off


@pytest.mark.parametrize("dt,ity,sign_off", TYPES)
@pytest.mark.parametrize("n", LENGTHS)
def test_stream_add_max_is_the_largest_magnitude_pattern(dt, ity, sign_off, n):
    for off in range(17):
        r, g, buf, a, want = _case(dt, n, off, n * 41 + off)
        got = cpu_stream.stream_add_max(r, g, a, a.view(ity), sign_off)
        assert np.array_equal(a.view(ity), want.view(ity)), off
        assert int(got) == (int((want.view(ity) & sign_off).max()) if n else 0), off


@pytest.mark.skipif(not cpu_stream.ENABLED, reason="nontemporal stores are x86-64 only (elsewhere plain loops)")
@pytest.mark.parametrize("name", ["stream_add_copy", "stream_add_max"])
def test_the_vector_loop_stores_nontemporal_and_fences(name):
    from numba import njit
    fn = njit(nogil=True)(getattr(cpu_stream, name).py_func)   # uncached: cached code cannot be inspected
    x = np.ones(64, np.float32)
    args = {"stream_add_copy": (x, x, np.empty_like(x), np.empty_like(x)),
            "stream_add_max": (x, x, np.empty_like(x), np.empty(64, np.float32).view(np.int32),
                               np.int32(0x7FFFFFFF))}[name]
    fn(*args)
    asm = "\n".join(fn.inspect_asm().values())
    assert "movntp" in asm and "sfence" in asm


@pytest.mark.parametrize("dt,ity,sign_off", TYPES)
def test_strided_inputs_take_the_scalar_loop(dt, ity, sign_off):
    # the vector loop reads through data pointers: a strided view must not reach it
    rng = np.random.default_rng(5)
    r = rng.standard_normal(2000).astype(dt)
    g = rng.standard_normal(2000).astype(dt)
    for rs, gs in ((r[::2], g[:1000]), (r[:1000], g[::2])):
        a = np.zeros(1000, dt)
        c = np.zeros(1000, dt)
        cpu_stream.stream_add_copy(rs, gs, a, c)
        assert np.array_equal(a.view(ity), (rs + gs).view(ity)) and np.array_equal(c, a)
        a[:] = 0
        got = cpu_stream.stream_add_max(rs, gs, a, a.view(ity), sign_off)
        assert np.array_equal(a.view(ity), (rs + gs).view(ity)) and int(got) == int((a.view(ity) & sign_off).max())
    a = np.zeros(2000, dt)
    c = np.zeros(2000, dt)
    cpu_stream.stream_add_copy(r[:1000], g[:1000], a[::2], c[::2])
    assert np.array_equal(a[::2].view(ity), (r[:1000] + g[:1000]).view(ity)) and not a[1::2].any()
