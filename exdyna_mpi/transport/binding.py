"""Transport layer: which GPU of its node a rank uses.

``bind_local_gpu(comm=None)`` (exported as ``exdyna_mpi.bind_local_gpu``) makes device
``local rank mod GPUs`` this process's current CUDA device. It is an explicit call, made once at
start-up before anything allocates on a GPU: building an exchange or a sparsifier never moves a
process to another device, unless ``EXDYNA_BIND_GPU=1`` asks the device exchange to bind when it is
built (``binds_at_construction``; job scripts that want each rank on its own GPU without a call).

Imports CuPy and the CUDA backend only when called.
"""
import os

BIND_ENV = "EXDYNA_BIND_GPU"
# Node-local rank as launchers publish it: Open MPI, MPICH/Intel MPI (Hydra), MVAPICH, Slurm, Cray PALS.
_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK",
                    "SLURM_LOCALID", "PALS_LOCAL_RANKID", "FLUX_TASK_LOCAL_ID")


def local_rank(comm=None):
    """This rank's index among the ranks on its node.

    With ``comm``: a ``COMM_TYPE_SHARED`` split (collective: every rank of ``comm`` must call).
    Without: the launcher's environment (no communication; None when no launcher variable is set).
    """
    if comm is not None:
        from mpi4py import MPI

        from .watchdog import waiting

        with waiting("Comm.Split_type (the ranks of this node)", comm):
            local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            return local.Get_rank()
        finally:
            local.Free()
    for var in _LOCAL_RANK_VARS:
        v = os.environ.get(var)
        if v is not None and v.strip().isdigit():
            return int(v)
    return None


def bind_local_gpu(comm=None):
    """Give this rank its own GPU of its node: device ``local rank mod GPUs`` becomes current.

    Call it once at start-up, before torch, JAX, CuPy or a sparsifier allocates on a GPU (buffers
    made before stay on the device they were made on). With one GPU, or no known local rank, the
    current device stays.

    Args:
        comm: a communicator whose ranks on this node number the local ranks, through a
            ``COMM_TYPE_SHARED`` split (collective: every rank of ``comm`` calls, whatever its GPUs);
            None (default): the launcher's local-rank variable (Open MPI, Hydra, MVAPICH, Slurm,
            PALS, Flux), no communication.

    Returns:
        The current CUDA device id after binding; None where CuPy sees no CUDA device (a CPU-only
        machine, the Numba CUDA simulator).

    Raises:
        cupy.cuda.runtime.CUDARuntimeError: the CUDA runtime refused the device.
    """
    lrank = local_rank(comm)   # the collective first, on every rank, whatever is decided below
    from ..arrays.ops import gpu_available

    if not gpu_available():
        return None
    from ..arrays.device import BACKEND

    if BACKEND.simulated:
        return None
    return _use_local_device(lrank)


def _use_local_device(lrank):  # pragma: no cover - real GPU only
    """Make device ``lrank mod GPUs`` current where there are several GPUs; the current id."""
    import cupy

    ndev = cupy.cuda.runtime.getDeviceCount()
    if ndev >= 2 and lrank is not None:
        cupy.cuda.Device(lrank % ndev).use()
    return cupy.cuda.Device().id


def binds_at_construction(env=None):
    """Whether a device exchange binds the GPU when it is built: ``EXDYNA_BIND_GPU`` is ``1``
    (``on``, ``yes``, ``true``); anything else, or unset, leaves binding to ``bind_local_gpu``.
    ``env``: the variable's value (default: the environment's)."""
    raw = os.environ.get(BIND_ENV, "") if env is None else env
    return str(raw).strip().lower() in ("1", "on", "yes", "true")
