"""The launch path: grid sizing, the views and launch configurations kept between calls, and
``launch_kernel``, which every launcher calls (Numba's launch the first time a kind of call is seen,
then the hand launch of ``_numba_private``). Shapes and the path come from ``config.CONFIG``, read
at each call."""
import math
import threading
import warnings

from numba import cuda
from numba.core.errors import NumbaPerformanceWarning

from ._numba_private import _FastLaunch
from .config import CONFIG, SIMULATOR

_fast: dict[tuple, object] = {}      # (kernel, stream, thread, mode, ...) -> a _FastLaunch, or False
_views: dict[tuple, object] = {}     # (pointer, shape, strides, typestr) -> a Numba device array
_configs: dict[tuple, tuple] = {}    # (kernel, blocks, threads, stream) -> (kernel[...], kernel, stream)


def grid_shape(n_work, block=None):
    """The launch shape for ``n_work`` elements: enough blocks for ``CONFIG.items`` elements per
    thread, at most ``CONFIG.grid_max``.

    Args:
        n_work: elements the launch covers (the kernels loop over any the grid does not).
        block: threads per block; None for ``CONFIG.block``.

    Returns:
        tuple: ``(blocks, threads)``.

    Raises:
        Nothing.
    """
    cfg = CONFIG
    bd = block or cfg.block
    nb = max(1, min(cfg.grid_max, math.ceil(n_work / (bd * cfg.items))))
    return nb, bd


def chunk_size(m, blocks, threads):
    """Elements of a selection range each block owns: a multiple of the block size and of 32 (a
    block's chunk starts on a mask word).

    Args:
        m: elements of the selection range.
        blocks: blocks of the launch.
        threads: threads per block.

    Returns:
        int: the chunk size (0 for an empty range).

    Raises:
        Nothing.
    """
    per = math.ceil(m / blocks) if m > 0 else 0
    unit = threads * 32 // math.gcd(threads, 32)
    return math.ceil(per / unit) * unit


def _round32(n):
    return n if SIMULATOR else max(32, math.ceil(n / 32) * 32)


def device_view(a):
    """What to hand a kernel: CAI producers (CuPy) become Numba views without a stream sync.

    The caller launches on the producer's stream (CuPy's current stream), so ordering holds and
    Numba's default sync on the CAI ``stream`` key would only add a host round trip per launch.

    Views are kept by (pointer, shape, strides, dtype), without a reference to ``a``: building one
    costs tens of microseconds of host time (on an H100 the step was host-bound, with ~30 of them
    per step), and a view whose key matches the caller's live array describes exactly that memory.

    Args:
        a: an array: Numba device array, any ``__cuda_array_interface__`` producer, or NumPy.

    Returns:
        A Numba device array on the same memory, or ``a`` itself (a Numba or NumPy array, or
        anything under the simulator).

    Raises:
        Nothing of its own (Numba's, for an interface it cannot read).
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


def launch_kernel(kernel, blocks, threads, stream, *args):
    """``kernel[blocks, threads, stream](*args)``, the launch every launcher makes.

    Arrays as the caller holds them (CuPy, Numba, or NumPy under the simulator). ``CONFIG.on_launch``,
    when set, sees every launch first. The first call of a kind goes through Numba (it compiles);
    later ones take ``_FastLaunch`` on a non-default stream unless ``CONFIG.launch`` is ``"numba"``
    (``"fast"``: the raw driver launch; ``"core"``: cuda.core's).

    Args:
        kernel: a ``@cuda.jit`` kernel.
        blocks: blocks of the grid.
        threads: threads per block.
        stream: a Numba stream (or 0, the default stream: always Numba's launch).
        *args: the kernel's arguments.

    Returns:
        None; the launch is queued on ``stream``.

    Raises:
        Whatever Numba raises for arguments the kernel does not accept, or the CUDA error of a
        failed launch.
    """
    cfg = CONFIG
    hook = cfg.on_launch
    if hook is not None:
        hook(kernel, blocks, threads, args)
    mode = cfg.launch
    fast = mode != "numba" and bool(stream) and not SIMULATOR
    f = None
    if fast:
        # the raw driver launch takes the grid per call: one entry per kernel and argument kinds,
        # whatever the shape (a shape that follows the selection's size was a new entry, through
        # Numba's launch, on a third of the steps); the mode is in the key, so a change of
        # ``CONFIG.launch`` makes its own entries
        driver = mode == "fast"
        key = (id(kernel), id(stream), threading.get_ident(), mode) + (() if driver else (blocks, threads)) + tuple(
            map(_kind, args))
        f = _fast.get(key)
        if f and f(args, blocks, threads):
            return
    dev = [device_view(a) if hasattr(a, "shape") else a for a in args]
    _launch(kernel, blocks, threads, stream)(*dev)
    if fast and f is None:   # the first launch of its kind compiled the overload: fast from the next one
        try:
            f = _FastLaunch(kernel, dev, blocks, threads, stream, driver)
        except Exception as e:  # pragma: no cover - a numba-cuda whose internals moved
            warnings.warn(f"exdyna_mpi: Numba's launch path for {kernel.__name__}: {e!r}", RuntimeWarning)
            f = False
        if len(_fast) > 4096:
            _fast.clear()
        _fast[key] = f


def _elementwise(kernel, n, stream, *args):
    if n == 0:
        return
    nb, bd = grid_shape(n)
    launch_kernel(kernel, nb, bd, stream, *args)
