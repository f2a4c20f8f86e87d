"""CUDA kernels: Numba ``@cuda.jit`` on CUDA device buffers, bit-identical to ``kernels.cpu``.

Same semantics as the CPU kernels: ``acc = residual + grad`` (``residual`` and ``grad`` only read),
``|acc| >= thr`` selected inside ``[lo, hi)``, indices written in ascending order, non-finite values
counted over the whole vector with the same ``x - x != 0`` test, ``out[i] = sums[j] / p`` in out's
dtype. No fastmath anywhere, so every compare, add and divide is IEEE round-to-nearest as on the CPU.

The modules, by job:

- ``select``: the ordered selection (count, scan, compact) and its launchers ``accumulate_select``,
  ``select_range``, ``select_marked_async``, ``count_range``, and its stages ``scan_async`` and
  ``compact_async``;
- ``measure``: the measured controller's measuring pass (``accumulate_measure_async``: acc, the
  histograms and the marks; ``measure_kernel``) and the zoom's histogram (``hist_range``);
- ``finish``: a one-rank step finished on the device behind its measuring pass
  (``finish_fine_async``);
- ``scatter_gather``: ``gather``, ``scatter``, ``zero_at``, ``scatter_mean_zero``, ``zero_words``;
- ``half``: float16/bfloat16 gradients widened to float32 and outputs rounded back (``widen16``,
  ``narrow16``), on the 16-bit patterns; 16-bit values on the wire (``wire_round``,
  ``owner_mean``, ``scatter_wire``);
- ``shard``: the owner's side of the sparse reduce-scatter (``owner_mean32``, ``owner_mean16``,
  ``scatter_run``);
- ``index``: the compact index forms of ``exdyna_mpi/kernels/cpu_index.py``, the same bytes (``encode``,
  ``popcounts`` and ``emit``, ``raw_decode``);
- ``blocks``: device functions the passes share; ``scratch``: ``Scratch``, the reused device words;
- ``config``: what is fixed at import (``SIMULATOR``, ``NB_MAX``, ``HIST_MAX``) and ``CONFIG``, the
  launch shapes, the compaction's ``ipt``, the block-scan variant, the launch path and the
  ``on_launch`` hook, read at every launch; ``configured(**changes)`` sets some for a ``with`` block;
- ``launch``: ``launch_kernel`` (the launch every launcher makes), ``grid_shape``, ``chunk_size``,
  ``device_view``; ``_numba_private``: the hand launch that skips Numba's per-call work, the only
  code that relies on numba-cuda internals.

Launchers take arrays the kernels accept (Numba device arrays, any object with
``__cuda_array_interface__`` such as CuPy arrays, or NumPy arrays under the simulator), a
``stream`` and, for the selection, a ``Scratch`` of small int64 buffers so nothing is allocated per
step. The ``*_async`` forms leave the counts in ``scratch.totals`` (and histograms in
``scratch.hist``) on the device; the plain forms copy those words to the host and return them, like
``kernels.cpu`` / ``kernels.cpu_controller``.

Tuning and instrumenting: ``CONFIG.block = 128`` (or ``with configured(block=128): ...``) changes
the shape of every later launch, in every module, because the launchers read ``CONFIG`` when they
launch; ``with configured(on_launch=hook): ...`` has ``hook(kernel, blocks, threads, args)`` see
every launch (tests count launches with it). This package exports public names only; a test of a
private kernel imports it from its own module (``from exdyna_mpi.kernels.cuda.select import _scan``).
"""
from numba import cuda

from . import blocks, config, finish, half, index, launch, measure, scatter_gather, scratch, select, shard
from .config import CONFIG, HIST_MAX, NB_MAX, SIMULATOR, LaunchConfig, check_variant, configured
from .finish import finish_fine_async
from .half import MODE_BF16, MODE_F16, narrow16, owner_mean, scatter_wire, widen16, wire_round
from .launch import chunk_size, device_view, grid_shape, launch_kernel
from .measure import accumulate_measure_async, hist_range, hist_range_async, measure_kernel, read_totals_hist
from .scatter_gather import gather, scatter, scatter_mean_zero, zero_at, zero_words
from .scratch import Scratch, new_scratch
from .shard import owner_mean16, owner_mean32, scatter_run
from .select import (
    accumulate_select,
    accumulate_select_async,
    compact_async,
    count_range,
    count_range_async,
    scan_async,
    select_marked_async,
    select_range,
    select_range_async,
)

__all__ = [
    "CONFIG", "HIST_MAX", "MODE_BF16", "MODE_F16", "NB_MAX", "SIMULATOR", "LaunchConfig", "Scratch",
    "accumulate_measure_async", "accumulate_select", "accumulate_select_async", "check_variant", "chunk_size",
    "compact_async", "configured", "count_range", "count_range_async", "cuda", "device_view", "finish_fine_async",
    "gather", "grid_shape", "hist_range", "hist_range_async", "launch_kernel", "measure_kernel", "narrow16",
    "new_scratch", "owner_mean", "owner_mean16", "owner_mean32", "read_totals_hist", "scan_async", "scatter",
    "scatter_mean_zero", "scatter_run", "scatter_wire", "select_marked_async", "select_range", "select_range_async",
    "widen16", "wire_round", "zero_at", "zero_words",
    # the modules, by job
    "blocks", "config", "finish", "half", "index", "launch", "measure", "scatter_gather", "scratch", "select",
    "shard",
]
