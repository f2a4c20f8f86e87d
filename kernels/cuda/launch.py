"""The launch path: grid sizing, the views and launch configurations kept between calls, and ``_go``,
which every launcher calls (Numba's launch the first time a kind of call is seen, then the hand
launch of ``_numba_private``)."""
import math
import os
import threading
import warnings

from numba import cuda
from numba.core.errors import NumbaPerformanceWarning

from ._numba_private import _DRIVER, _FastLaunch
from .config import BLOCK, GRID_MAX, ITEMS, SIMULATOR

#: EXDYNA_CUDA_LAUNCH=numba: every launch through Numba's ``kernel[...]`` (=core: cuda.core's
#: launch, =fast, the default: the raw driver launch; see ``_numba_private``).
_FAST = os.environ.get("EXDYNA_CUDA_LAUNCH", "fast").strip().lower() != "numba"
_fast = {}
_views = {}
_configs = {}


def _shape(n_work, block=None):
    """(blocks, threads) for ``n_work`` elements: enough blocks for ITEMS elements per thread."""
    bd = block or BLOCK
    nb = max(1, min(GRID_MAX, math.ceil(n_work / (bd * ITEMS))))
    return nb, bd


def _chunk(m, nb, bd):
    """Elements of the selection range per block: a multiple of the block size and of 32 (a block's
    chunk starts on a mask word)."""
    per = math.ceil(m / nb) if m > 0 else 0
    unit = bd * 32 // math.gcd(bd, 32)
    return math.ceil(per / unit) * unit


def _round32(n):
    return n if SIMULATOR else max(32, math.ceil(n / 32) * 32)


def _dev(a):
    """What to hand a kernel: CAI producers (CuPy) become Numba views without a stream sync.

    The caller launches on the producer's stream (CuPy's current stream), so ordering holds and
    Numba's default sync on the CAI ``stream`` key would only add a host round trip per launch.

    Views are kept by (pointer, shape, strides, dtype), without a reference to ``a``: building one
    costs tens of microseconds of host time (on an H100 the step was host-bound, with ~30 of them
    per step), and a view whose key matches the caller's live array describes exactly that memory.
    """
    if SIMULATOR or not hasattr(a, "__cuda_array_interface__"):
        return a
    if type(a).__module__.startswith("numba"):  # already a Numba device array
        return a
    cai = a.__cuda_array_interface__
    key = (cai["data"][0], cai["shape"], cai.get("strides"), cai["typestr"])
    got = _views.get(key)
    if got is None:
        if len(_views) > 1024:
            _views.clear()
        got = _views[key] = cuda.from_cuda_array_interface(cai, owner=None, sync=False)
    return got


def _launch(kernel, nb, bd, stream):
    """``kernel[nb, bd, stream]``, made once and kept: numba-cuda warns on every launch
    configuration of fewer than 128 blocks (the scan, the zeroing of the histogram words, and
    gather/scatter of small selections are small on purpose), and building it costs host time."""
    if SIMULATOR:  # the simulator's kernel[...] reconfigures and returns the kernel itself: no caching
        return kernel[nb, bd, stream]
    key = (id(kernel), nb, bd, id(stream))
    got = _configs.get(key)
    if got is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NumbaPerformanceWarning)
            cfg = kernel[nb, bd, stream]
        if len(_configs) > 4096:
            _configs.clear()
        got = _configs[key] = (cfg, kernel, stream)  # the references keep the ids from being reused
    return got[0]


def _kind(a):
    """What decides the compiled overload and the marshalling: a cheap key per argument."""
    t = type(a)
    if t is int or t is bool or t is float:
        return t
    dt = getattr(a, "dtype", None)
    return (t, dt.char if dt is not None else None)


def _go(kernel, nb, bd, stream, *args):
    """``kernel[nb, bd, stream](*args)``: arrays as the caller holds them (CuPy, Numba, or NumPy
    under the simulator). The first call of a kind goes through Numba (it compiles); later ones
    take ``_FastLaunch``."""
    fast = _FAST and bool(stream) and not SIMULATOR
    f = None
    if fast:
        # the raw driver launch takes the grid per call: one entry per kernel and argument kinds,
        # whatever the shape (a shape that follows the selection's size was a new entry, through
        # Numba's launch, on a third of the steps)
        key = (id(kernel), id(stream), threading.get_ident()) + (() if _DRIVER else (nb, bd)) + tuple(
            map(_kind, args))
        f = _fast.get(key)
        if f and f(args, nb, bd):
            return
    dev = [_dev(a) if hasattr(a, "shape") else a for a in args]
    _launch(kernel, nb, bd, stream)(*dev)
    if fast and f is None:   # the first launch of its kind compiled the overload: fast from the next one
        try:
            f = _FastLaunch(kernel, dev, nb, bd, stream)
        except Exception as e:  # pragma: no cover - a numba-cuda whose internals moved
            warnings.warn(f"exdyna_mpi: Numba's launch path for {kernel.__name__}: {e!r}", RuntimeWarning)
            f = False
        if len(_fast) > 4096:
            _fast.clear()
        _fast[key] = f


def _elementwise(kernel, n, stream, *args):
    if n == 0:
        return
    nb, bd = _shape(n)
    _go(kernel, nb, bd, stream, *args)
