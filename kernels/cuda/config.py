"""What every module of the package reads at import: simulator or GPU, the size limits, the launch
shapes and the block-scan variant."""
import os

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

# Launch shapes. The simulator runs one OS thread per CUDA thread and each syncthreads is a Python
# barrier, so it gets tiny grids; the loops in every kernel cover any length with any grid.
# IPT: 32-element mask words per compaction thread per tile (a compile-time constant on a GPU).
if SIMULATOR:
    BLOCK, GRID_MAX, SCAN_THREADS, ITEMS, IPT = 32, 2, 8, 1, 2
else:
    BLOCK, GRID_MAX, SCAN_THREADS, ITEMS, IPT = 256, NB_MAX, NB_MAX, 8, 4


def _pick_variant():
    want = os.environ.get("EXDYNA_CUDA_KERNELS", "auto").strip().lower()
    if SIMULATOR:
        return "safe"  # ballot_sync does not exist in the simulator
    return want if want in ("safe", "fast") else "fast"


VARIANT = _pick_variant()


def check_variant(variant):
    """``variant or VARIANT``; the ``fast`` kernels need warp intrinsics, which the simulator lacks."""
    v = variant or VARIANT
    if v == "fast" and SIMULATOR:
        raise RuntimeError("the 'fast' CUDA kernels need warp intrinsics, absent in the simulator")
    return v
