"""The measuring pass's kernel (exdyna_mpi/kernels/cuda/measure.py: ``_acc_measure32/64``, what
``accumulate_measure_async`` launches) under the simulator: its acc, histogram words and marks
equal an independent NumPy reference for every stride, range and window shape, with non-finite
values (a float64 NaN whose bits are all ones included: the pattern at the top of the int64 range
that a disabled window's edge must not reach)."""
import numpy as np
import pytest

from exdyna_mpi.kernels import cuda as kc


def _ity(dtype):
    return np.int32 if dtype == np.float32 else np.int64


def _mb(dtype):
    return 23 if dtype == np.float32 else 52


def _reference(r, g, lo, hi, mark, coarse, fine, stride):
    """acc, [marked, nonfinite, coarse..., fine...], marked indices: from the definitions."""
    acc = r + g
    dtype = acc.dtype.type
    bits = acc.view(_ity(acc.dtype)) & np.iinfo(_ity(acc.dtype)).max   # sign bit off
    bits = bits.astype(np.int64)

    def hist(sel, shift, key0, nb):
        j = np.clip((bits[sel] >> shift) - key0, 0, nb - 1)
        return np.bincount(j, minlength=nb).astype(np.int64)

    rng = np.arange(lo, hi)
    words = []
    with np.errstate(invalid="ignore"):
        hits = rng[np.abs(acc[lo:hi]) >= dtype(mark)]
    words += [hits.size, int((~np.isfinite(acc)).sum())]
    shift, key0, nh = coarse
    words += hist(rng[rng % stride == 0], shift, key0, nh).tolist()
    shift_f, key0_f, nf = fine
    if nf:
        words += hist(rng, shift_f, key0_f, nf).tolist()
    return acc, words, hits


def _inputs(n, dtype, seed):
    rng = np.random.default_rng(seed)
    r = (rng.standard_normal(n) * np.exp2(rng.integers(-6, 3, n)) * 0.05).astype(dtype)
    g = (rng.standard_normal(n) * 0.05).astype(dtype)
    g[::97] = -r[::97]          # exact zeros
    g[[4, n // 2, n - 3]] = [np.inf, np.nan, -np.inf]
    if dtype == np.float64:      # every bit set: the largest int64 a float64's |bits| can be
        g[n // 3] = np.array([-1], np.int64).view(np.float64)[0]
    return r, g


def _windows(dtype, mark):
    mb = _mb(dtype)
    key = int(np.array([mark], dtype).view(_ity(dtype))[0])
    coarse = (mb - 3, (key >> (mb - 3)) - 20, 40)        # 8 per octave, 40 buckets around the mark
    fine = (mb - 8, (key >> (mb - 8)) - 24, 48)          # 256 per octave, 48 buckets
    return coarse, fine


def _run(r, g, lo, hi, mark, coarse, fine, stride):
    s = kc.new_scratch()
    acc = np.empty_like(r)
    kc.accumulate_measure_async(r, g, acc, lo, hi, r.dtype.type(mark), coarse[0], coarse[1], coarse[2], s,
                                fine=fine, stride=stride)
    nw = 2 + coarse[2] + fine[2]
    mask = s.mask_for(max(hi - lo, 1), keep_marks=True)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:max(hi - lo, 0)]
    return acc, s.totals_hist[:nw].tolist(), lo + np.flatnonzero(bits)


def _launched(run, *args):
    """``run(*args)``'s result and the (kernel, blocks, threads) it launched."""
    launched = []
    with kc.configured(on_launch=lambda k, nb, bd, a: launched.append((k, nb, bd))):
        return run(*args), launched


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("lo,hi", [(0, 1000), (96, 640), (37, 611), (320, 320), (0, 1)])
@pytest.mark.parametrize("stride", [1, 4, 32])
@pytest.mark.parametrize("with_fine", [True, False])
def test_measure_kernel_matches_reference(dtype, lo, hi, stride, with_fine):
    assert kc.CONFIG.block % stride == 0   # the block the other launches use
    n = 1000
    r, g = _inputs(n, dtype, seed=lo + 7 * stride)
    mark = 0.04
    coarse, fine = _windows(dtype, mark)
    if not with_fine:
        fine = (0, 0, 0)
    (acc, words, hits), launched = _launched(_run, r, g, lo, hi, mark, coarse, fine, stride)
    assert (kc.measure_kernel(dtype), kc.grid_shape(n)[0], kc.CONFIG.block) in launched
    want_acc, want_words, want_hits = _reference(r, g, lo, hi, mark, coarse, fine, stride)
    assert acc.tobytes() == want_acc.tobytes()
    assert words == want_words
    assert np.array_equal(hits, want_hits)


def test_stride_above_the_block_widens_it():
    """A coarse stride larger than the block (the simulator's 32 threads, the controller's strides
    up to 64) launches blocks of ``stride`` threads: a thread's elements keep their index mod the
    stride, and the words are the same."""
    n, dtype, stride = 700, np.float32, 2 * kc.CONFIG.block
    r, g = _inputs(n, dtype, seed=2)
    coarse, fine = _windows(dtype, 0.04)
    (acc, words, hits), launched = _launched(_run, r, g, 50, 650, 0.04, coarse, fine, stride)
    assert [bd for k, _, bd in launched if k is kc.measure_kernel(dtype)] == [stride]
    want_acc, want_words, want_hits = _reference(r, g, 50, 650, 0.04, coarse, fine, stride)
    assert (acc.tobytes(), words) == (want_acc.tobytes(), want_words) and np.array_equal(hits, want_hits)


def test_stride_not_a_power_of_two_refused():
    r, g = _inputs(100, np.float32, seed=3)
    coarse, fine = _windows(np.float32, 0.04)
    with pytest.raises(ValueError, match="power of two"):
        _run(r, g, 0, 100, 0.04, coarse, fine, 3)
