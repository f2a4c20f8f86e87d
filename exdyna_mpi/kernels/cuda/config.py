"""The kernels' configuration: what is fixed at import, and ``CONFIG``, what the launchers read
when they launch.

Fixed at import (module constants, not settings): ``SIMULATOR`` (the Numba CUDA simulator runs the
kernels), ``NB_MAX`` (most blocks a selection uses: the ``Scratch`` layout and the scans' shared
arrays), ``HIST_MAX`` (most histogram buckets: the passes' shared arrays). They size shared memory
inside compiled kernels, so changing one means another package, not another launch.

``CONFIG`` (a ``LaunchConfig``) holds the launch shapes (``block``, ``grid_max``, ``scan_threads``,
``items``), the compaction's ``ipt``, the block-scan ``variant``, the ``launch`` path and the
``on_launch`` hook. Every launcher reads it when it launches (an attribute read per launch), so a
change applies to the next launch in every module; ``configured(**changes)`` sets values for a
``with`` block and restores them after (tests, benchmarks). Every value is checked when set.

``ipt`` (mask words per compaction thread per tile) is a compile-time constant inside the
compaction kernels: the GPU compiler unrolls their loops over it, so it is never read at run time
inside a kernel. The kernels for the default ``ipt`` are built at import, as they always were;
another value gets its own kernels, built once on first use and cached (``select._compact_kernel``).
That was chosen over refusing the change because the tests run the compaction at several ``ipt``
values to check its tiling, and a benchmark can try one without editing the source. The other
settings are launch arguments or pick among kernels compiled at import, so no setting compiles
anything per call.
"""
import contextlib
import numbers
import os
from typing import Callable, Optional

from numba import cuda

try:  # numba-cuda (the NVIDIA package) keeps its config here; numba's built-in target elsewhere
    from numba.cuda.core import config as _config
except ImportError:  # pragma: no cover - numba's deprecated built-in CUDA target
    from numba.core import config as _config

#: True when the Numba CUDA simulator runs these kernels (NUMBA_ENABLE_CUDASIM=1 before import).
SIMULATOR = bool(_config.ENABLE_CUDASIM)

# Seen on an H100 node whose numba-cuda's import hook had not run: numba's deprecated built-in target
# fails on these kernels with "Signature mismatch" deep in type inference. Say what to install instead.
if getattr(cuda, "implementation", "NVIDIA") == "Built-in" and not SIMULATOR:
    raise ImportError("exdyna_mpi's CUDA kernels need NVIDIA's numba-cuda package, and numba.cuda is numba's "
                      "deprecated built-in target here: pip install 'numba-cuda[cu12]' (or [cu13]); if it is "
                      "installed, its .pth redirect did not run (a site dir added without site.addsitedir?)")

NB_MAX = 1024          # most blocks a selection uses; the scan runs one block of up to NB_MAX threads
HIST_MAX = 1024        # most buckets (coarse + fine) a histogram pass fills: one shared int32 array per block
HIST_SPARE = HIST_MAX + 2   # the measuring pass's shared words: the buckets and 2 spare words
FULL_MASK = 0xFFFFFFFF
MAX_THREADS = 1024     # threads per block: the block scans keep one shared word per thread

VARIANTS = ("safe", "fast")
LAUNCHES = ("fast", "core", "numba")


def _env_variant():
    want = os.environ.get("EXDYNA_CUDA_KERNELS", "auto").strip().lower()
    if SIMULATOR:
        return "safe"  # ballot_sync does not exist in the simulator
    return want if want in VARIANTS else "fast"


def _env_launch():
    """EXDYNA_CUDA_LAUNCH: ``fast`` (unset too) the raw driver launch, ``numba`` Numba's own
    ``kernel[...]``, anything else cuda.core's launch (see ``_numba_private``)."""
    want = os.environ.get("EXDYNA_CUDA_LAUNCH", "fast").strip().lower()
    return want if want in ("fast", "numba") else "core"


def _defaults():
    """The launch shapes of this target. The simulator runs one OS thread per CUDA thread and each
    syncthreads is a Python barrier, so it gets tiny grids; the loops in every kernel cover any
    length with any grid."""
    if SIMULATOR:
        shapes = dict(block=32, grid_max=2, scan_threads=8, items=1, ipt=2)
    else:
        shapes = dict(block=256, grid_max=NB_MAX, scan_threads=NB_MAX, items=8, ipt=4)
    return dict(shapes, variant=_env_variant(), launch=_env_launch(), on_launch=None)


def _count(name, value, lo, hi):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not lo <= value <= hi:
        raise ValueError(f"CONFIG.{name} must be an integer in [{lo}, {hi}], not {value!r}")
    return int(value)


def _checked(v):
    """``v`` (a full set of values) checked and normalised; raises on the first bad one."""
    out = dict(v)
    out["block"] = _count("block", v["block"], 1, MAX_THREADS)
    out["grid_max"] = _count("grid_max", v["grid_max"], 1, NB_MAX)
    out["scan_threads"] = _count("scan_threads", v["scan_threads"], 1, NB_MAX)
    out["items"] = _count("items", v["items"], 1, 1 << 30)
    out["ipt"] = _count("ipt", v["ipt"], 1, 1024)
    if v["variant"] not in VARIANTS:
        raise ValueError(f"CONFIG.variant must be one of {VARIANTS}, not {v['variant']!r}")
    if v["variant"] == "fast":
        if SIMULATOR:
            raise RuntimeError("the 'fast' CUDA kernels need warp intrinsics, absent in the simulator")
        if out["block"] % 32:
            raise ValueError(f"CONFIG.block must be a multiple of 32 with the 'fast' variant (warp scans and "
                             f"ballots), not {out['block']}")
    if v["launch"] not in LAUNCHES:
        raise ValueError(f"CONFIG.launch must be one of {LAUNCHES}, not {v['launch']!r}")
    if v["on_launch"] is not None and not callable(v["on_launch"]):
        raise TypeError(f"CONFIG.on_launch must be None or callable, not {v['on_launch']!r}")
    return out


class LaunchConfig:
    """How the CUDA launchers launch, read at every launch: set a value and the next launch uses it.

    Attributes (each checked when set; ``ValueError``/``TypeError`` for a bad one):

    - ``block``: threads per block of the element-wise and selection kernels (1..1024; a multiple
      of 32 with the ``fast`` variant);
    - ``grid_max``: most blocks per launch (1..``NB_MAX``);
    - ``scan_threads``: most threads of the one-block scans (1..``NB_MAX``);
    - ``items``: elements per thread the grid is sized for (the kernels loop over any rest);
    - ``ipt``: mask words per compaction thread per tile, a compile-time constant of the compaction
      kernels: a value other than the default compiles its kernels once, on first use;
    - ``variant``: ``"fast"`` (warp shuffles and ballots; a GPU) or ``"safe"`` (shared memory only;
      the simulator's, where ``"fast"`` raises ``RuntimeError``);
    - ``launch``: ``"fast"`` (the raw driver launch), ``"core"`` (cuda.core's) or ``"numba"``
      (Numba's ``kernel[...]`` every time); the first launch of a kind always goes through Numba;
    - ``on_launch``: ``None`` or a callable ``on_launch(kernel, blocks, threads, args)`` called
      before every launch with the kernel and its arguments as the launcher passes them, to count
      or record launches (tests, profiling); it must not launch kernels itself.

    Args:
        **values: initial values of the attributes above; all of them.

    Raises:
        TypeError: an unknown or missing name, or an ``on_launch`` that is not callable.
        ValueError: a value out of its range.
        RuntimeError: ``variant="fast"`` under the simulator.
    """

    __slots__ = ("block", "grid_max", "scan_threads", "items", "ipt", "variant", "launch", "on_launch")
    block: int
    grid_max: int
    scan_threads: int
    items: int
    ipt: int
    variant: str
    launch: str
    on_launch: Optional[Callable[..., object]]

    def __init__(self, **values):
        if set(values) != set(self.__slots__):
            raise TypeError(f"LaunchConfig takes exactly {self.__slots__}, not {sorted(values)}")
        for k, v in _checked(values).items():
            object.__setattr__(self, k, v)

    def __setattr__(self, name, value):
        self.update(**{name: value})

    def values(self):
        """The current values.

        Returns:
            dict: ``{attribute name: value}`` for every attribute.

        Raises:
            Nothing.
        """
        return {k: getattr(self, k) for k in self.__slots__}

    def update(self, **changes):
        """Set several attributes at once, checked together (e.g. ``variant`` and ``block``).

        Args:
            **changes: ``name=value`` for the attributes to set.

        Returns:
            None. Nothing is set when a value is refused.

        Raises:
            TypeError: an unknown name, or an ``on_launch`` that is not callable.
            ValueError: a value out of its range.
            RuntimeError: ``variant="fast"`` under the simulator.
        """
        unknown = sorted(set(changes) - set(self.__slots__))
        if unknown:
            raise TypeError(f"LaunchConfig has no setting {unknown}; it has {self.__slots__}")
        new = _checked({**self.values(), **changes})
        for k in changes:
            object.__setattr__(self, k, new[k])

    def __repr__(self):
        return "LaunchConfig(" + ", ".join(f"{k}={v!r}" for k, v in self.values().items()) + ")"


#: The configuration every launcher reads when it launches (defaults: this target's, the variant and
#: launch path from EXDYNA_CUDA_KERNELS and EXDYNA_CUDA_LAUNCH).
CONFIG = LaunchConfig(**_defaults())


@contextlib.contextmanager
def configured(**changes):
    """Set ``CONFIG`` values for a ``with`` block and restore the previous ones after it.

    ``with configured(block=48, ipt=1): ...`` launches every kernel of the block with 48-thread
    blocks; ``with configured(on_launch=lambda k, nb, bd, args: seen.append(k)): ...`` records
    launches. Not thread-safe: ``CONFIG`` is one object for the process.

    Args:
        **changes: ``name=value`` for ``LaunchConfig`` attributes.

    Returns:
        A context manager that yields ``CONFIG``.

    Raises:
        TypeError, ValueError, RuntimeError: as ``LaunchConfig.update``, on entry (nothing set).
    """
    saved = {k: getattr(CONFIG, k) for k in changes if k in LaunchConfig.__slots__}
    CONFIG.update(**changes)
    try:
        yield CONFIG
    finally:
        CONFIG.update(**saved)


def check_variant(variant):
    """``variant or CONFIG.variant``, checked.

    Args:
        variant: ``"safe"``, ``"fast"``, or None for ``CONFIG.variant``.

    Returns:
        str: the variant.

    Raises:
        ValueError: an unknown variant.
        RuntimeError: ``"fast"`` under the simulator (no warp intrinsics there).
    """
    v = variant or CONFIG.variant
    if v not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, not {v!r}")
    if v == "fast" and SIMULATOR:
        raise RuntimeError("the 'fast' CUDA kernels need warp intrinsics, absent in the simulator")
    return v
