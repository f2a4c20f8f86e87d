"""Deprecated location, kept for scripts that still import it (tests/run_all.sh, jobs/gpu_lane.sh):
use ``exdyna_mpi.arrays.gpu_available``. Re-exports only; no logic lives here."""
from .arrays.ops import gpu_available

__all__ = ["gpu_available"]
