"""``elastic=True`` where the MPI cannot shrink and continue: refused at construction, on every rank
with the same text, before any broadcast (the MPICH lanes: MPICH's ``Shrink``/``Agree`` fall back to
calls that do not survive a lost rank; the Open MPI lane: launched without ``--with-ft ulfm``)."""
import os

import pytest
import torch
from mpi4py import MPI

import exdyna_mpi
from exdyna_mpi.adapters.torch import DiLoCo, DistributedOptimizer


def _expected():
    lib = MPI.Get_library_version()
    if "Open MPI" in lib:
        if os.environ.get("OMPI_MCA_mpi_ft_enable") == "1":
            pytest.skip("launched with fault tolerance: tests/unit/test_elastic.py covers this launch")
        return "launched without fault tolerance"
    return "has no fault tolerance (ULFM)"


def _model():
    torch.manual_seed(MPI.COMM_WORLD.Get_rank())   # differ: a broadcast that ran would show
    return torch.nn.Linear(6, 3)


@pytest.mark.mpi
@pytest.mark.parametrize("entry", ["optimizer", "diloco"])
def test_elastic_is_refused_without_fault_tolerance_on_every_rank(entry):
    comm = MPI.COMM_WORLD
    expected = _expected()
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(exdyna_mpi.CollectiveError) as info:
        if entry == "optimizer":
            DistributedOptimizer(inner, model, sparsifier="exdyna", density=0.1, comm=comm, elastic=True)
        else:
            DiLoCo(inner, model, sync_every=2, sparsifier="exdyna", density=0.1, comm=comm, elastic=True)
    text = str(info.value)
    assert "elastic=True needs an MPI that survives a lost rank" in text and expected in text, text
    assert len(set(comm.allgather(text))) == 1, "the ranks raised different texts"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "the model changed"


@pytest.mark.mpi
def test_elastic_must_be_a_bool_and_overlap_is_refused():
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(exdyna_mpi.CollectiveError, match="elastic must be True or False"):
        DistributedOptimizer(inner, model, elastic="yes")
