"""CUDA kernels: Numba ``@cuda.jit`` on CUDA device buffers, bit-identical to ``kernels.cpu``.

Same semantics as the CPU kernels: ``acc = residual + grad`` (``residual`` and ``grad`` only read),
``|acc| >= thr`` selected inside ``[lo, hi)``, indices written in ascending order, non-finite values
counted over the whole vector with the same ``x - x != 0`` test, ``out[i] = sums[j] / p`` in out's
dtype. No fastmath anywhere, so every compare, add and divide is IEEE round-to-nearest as on the CPU.

The modules, by job:

- ``select``: the ordered selection (count, scan, compact) and its launchers ``accumulate_select``,
  ``select_range``, ``select_marked_async``, ``count_range``;
- ``measure``: the measured controller's measuring pass (``accumulate_measure_async``: acc, the
  histograms and the marks) and the zoom's histogram (``hist_range``);
- ``finish``: a one-rank step finished on the device behind its measuring pass
  (``finish_fine_async``);
- ``scatter_gather``: ``gather``, ``scatter``, ``zero_at``, ``scatter_mean_zero``;
- ``half``: float16/bfloat16 gradients widened to float32 and outputs rounded back (``widen16``,
  ``narrow16``), on the 16-bit patterns; 16-bit values on the wire (``wire_round``,
  ``owner_mean``, ``scatter_wire``);
- ``blocks``: device functions the passes share; ``scratch``: ``Scratch``, the reused device words;
- ``config``: simulator or GPU, limits, launch shapes, the block-scan variant;
- ``launch``: grid sizing and ``_go``, the launch every launcher makes; ``_numba_private``: the
  hand launch that skips Numba's per-call work, the only code that relies on numba-cuda internals.

Launchers take arrays the kernels accept (Numba device arrays, any object with
``__cuda_array_interface__`` such as CuPy arrays, or NumPy arrays under the simulator), a
``stream`` and, for the selection, a ``Scratch`` of small int64 buffers so nothing is allocated per
step. The ``*_async`` forms leave the counts in ``scratch.totals`` (and histograms in
``scratch.hist``) on the device; the plain forms copy those words to the host and return them, like
``kernels.cpu`` / ``kernels.cpu_controller``.

This package re-exports the names code outside it uses (``arrays/cuda_ops.py``, jobs/, tests/).
Setting one of them here (a test's ``monkeypatch.setattr(kc, "BLOCK", 48)``, a benchmark's
``kc._DRIVER = False``) sets it in every module of the package that binds it, as it did when the
package was one module: see ``_Package``.
"""
import sys
import types

from numba import cuda  # noqa: F401  (kc.cuda: callers make streams with it)

from . import (
    _numba_private,
    blocks,
    config,
    finish,
    half,
    launch,
    measure,
    scatter_gather,
    scratch,
    select,
)
from ._numba_private import _DRIVER  # noqa: F401
from .config import (  # noqa: F401
    BLOCK,
    GRID_MAX,
    HIST_MAX,
    IPT,
    ITEMS,
    NB_MAX,
    SCAN_THREADS,
    SIMULATOR,
    VARIANT,
)
from .finish import (  # noqa: F401
    _filter_marks_at,
    _resolve_fine,
    _take_mean_zero_at,
    finish_fine_async,
)
from .half import narrow16, owner_mean, scatter_wire, widen16, wire_round  # noqa: F401
from .launch import _chunk, _dev, _fast, _go, _launch, _round32, _shape  # noqa: F401
from .measure import (  # noqa: F401
    _acc_measure32,
    _acc_measure32_warp,
    _acc_measure64,
    _acc_measure64_warp,
    _hist_marked32,
    _hist_marked64,
    _hist_range32,
    _hist_range64,
    _marks_cover,
    _measure_kernel,
    _measure_pass,
    accumulate_measure_async,
    hist_range,
    hist_range_async,
    read_totals_hist,
)
from .scatter_gather import (  # noqa: F401
    _gather,
    _scatter,
    _scatter_mean_zero,
    _zero_at,
    _zero_words,
    gather,
    scatter,
    scatter_mean_zero,
    zero_at,
)
from .scratch import Scratch, new_scratch  # noqa: F401
from .select import (  # noqa: F401
    _acc_count,
    _compact_fast,
    _compact_fast_at,
    _compact_kernel,
    _compact_safe,
    _compact_safe_at,
    _count,
    _filter_marks,
    _scan,
    accumulate_select,
    accumulate_select_async,
    count_range,
    count_range_async,
    select_marked_async,
    select_range,
    select_range_async,
)

_MODULES = (config, _numba_private, launch, blocks, scatter_gather, scratch, select, measure, finish, half)


class _Package(types.ModuleType):
    """The package, whose attributes stay the names its modules use.

    The launchers read module globals at call time (``BLOCK`` in ``_shape``, ``_go`` in every
    launcher, ``select_range_async`` in ``select_marked_async``; the simulator reads ``IPT`` inside
    the kernels), and callers set them on the package to change a launch shape, the launch path or
    to count calls. Python's ``from . import`` binds a copy of each name per module, so a plain
    package would change only its own copy: here setting a name also sets it in every module of the
    package that binds it."""

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        for mod in self.__dict__.get("_MODULES", ()):
            if name in vars(mod):
                setattr(mod, name, value)


sys.modules[__name__].__class__ = _Package
