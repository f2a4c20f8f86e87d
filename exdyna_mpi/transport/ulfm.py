"""Transport layer: the MPI calls of a shrink-and-continue after a lost rank (ULFM).

User-Level Failure Mitigation gives the survivors of a dead process three calls: ``Revoke`` (every
pending and later operation on the communicator fails on every rank, so no survivor waits for ever
on the dead one), ``Shrink`` (a new communicator of the survivors) and ``Agree``. mpi4py 4 exposes
them; only an MPI built with ULFM and launched with fault tolerance on implements them:

- Open MPI 5 (the PyPI wheel included), launched ``mpiexec --with-ft ulfm --mca pml ob1 --mca btl
  tcp,self`` (with the default UCX transport a survivor hangs after the failure). ``--with-ft ulfm``
  sets ``OMPI_MCA_mpi_ft_enable=1`` in every rank's environment, which is how a rank can tell.
- MPICH (the PyPI wheel included): ``Revoke`` raises ``NotImplementedError``, while ``Agree`` falls
  back to an allreduce and ``Shrink`` to ``Comm_dup`` without saying so: neither tolerates a
  fault. ``fault_tolerance_problem`` refuses it, rather than claim what it cannot do.
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple

from mpi4py import MPI

__all__ = ["Shrunk", "fault_tolerance_problem", "is_rank_failure", "shrink"]

#: how a job must be launched for shrink-and-continue (Open MPI with ULFM)
LAUNCH = "mpiexec --with-ft ulfm --mca pml ob1 --mca btl tcp,self -n N python -m mpi4py ..."


def fault_tolerance_problem() -> str | None:
    """Why this process cannot shrink and continue after a lost rank, or None when it can.

    Not collective: every rank of a job sees the same library and environment, and the entry points
    agree on the answer with their other construction checks.
    """
    version = MPI.Get_library_version().split("\n")[0].strip("\0 ")
    calls = ("Revoke", "Shrink", "Agree", "Get_failed", "Ack_failed")
    missing = [name for name in calls if not hasattr(MPI.Comm, name)]
    if missing:
        return f"mpi4py {_mpi4py_version()} lacks Comm.{', Comm.'.join(missing)} (ULFM needs mpi4py >= 4)"
    if not version.startswith("Open MPI"):
        return (f"the MPI library ({version}) has no fault tolerance (ULFM): MPICH's Shrink and Agree "
                f"fall back to calls that do not survive a lost rank; run Open MPI 5 as `{LAUNCH}`")
    if os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() not in ("1", "true", "yes", "on"):
        return (f"Open MPI was launched without fault tolerance (OMPI_MCA_mpi_ft_enable is not set); "
                f"launch as `{LAUNCH}`")
    return None


def _mpi4py_version() -> str:
    import mpi4py

    return str(getattr(mpi4py, "__version__", "?"))


_FAILURE_CLASSES = tuple(getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                         if hasattr(MPI, name))


def is_rank_failure(exc: BaseException, comm: Any = None) -> bool:
    """Whether ``exc`` is MPI's report of a lost rank (``ERR_PROC_FAILED``, ``..._PENDING``) or of a
    communicator another survivor revoked after one (``ERR_REVOKED``).

    Some collectives report a peer that died during them under another class: Open MPI 5's
    ``Alltoallv`` (coll/tuned over ob1) returns ``ERR_OTHER``. With ``comm``, any MPI error on a
    communicator whose failure detector knows a dead rank (``Comm.Get_failed``) counts too.
    """
    if not isinstance(exc, MPI.Exception):
        return False
    try:
        if exc.Get_error_class() in _FAILURE_CLASSES:
            return True
    except MPI.Exception:
        return False
    return comm is not None and _knows_failed(comm)


def _knows_failed(comm: Any) -> bool:
    """Whether ``comm``'s failure detector has reported a dead rank to this process (local)."""
    try:
        group = comm.Get_failed()
    except (MPI.Exception, NotImplementedError, AttributeError):
        return False
    try:
        return bool(group.Get_size() > 0)
    finally:
        if group != MPI.GROUP_EMPTY:
            group.Free()


class Shrunk(NamedTuple):
    """The survivors' communicator after ``shrink``.

    Attributes:
        comm: the new communicator (the survivors, in their old order; errors return, as before).
        lost: the ranks of the old communicator that are gone, ascending.
        old_ranks: for each rank of ``comm``, its rank in the old communicator.
    """

    comm: Any
    lost: tuple[int, ...]
    old_ranks: tuple[int, ...]


def shrink(comm: Any, also: tuple[Any, ...] = ()) -> Shrunk:
    """Revoke ``comm`` (and the communicators in ``also`` that share its ranks), then the survivors'
    communicator. Collective over the survivors of ``comm``: every one of them must call it, which
    the revoke brings about (each survivor's next operation on ``comm`` fails with ``ERR_REVOKED``).

    Args:
        comm: the communicator a rank was lost from.
        also: other communicators over the same ranks to revoke (a library's duplicates).

    Returns:
        The ``Shrunk`` survivors.

    Raises:
        MPI.Exception: a second failure while shrinking (the caller may try again).
    """
    for c in (comm, *also):
        try:
            c.Revoke()
        except MPI.Exception:
            pass   # revoked already by another survivor: the same end
    new = comm.Shrink()
    new.Set_errhandler(MPI.ERRORS_RETURN)
    old_group, new_group = comm.Get_group(), new.Get_group()
    try:
        old = MPI.Group.Translate_ranks(new_group, list(range(new.Get_size())), old_group)
    finally:
        new_group.Free()
        old_group.Free()
    old_ranks = tuple(int(r) for r in old)
    lost = tuple(r for r in range(comm.Get_size()) if r not in set(old_ranks))
    return Shrunk(new, lost, old_ranks)
