"""The compact index forms on the (simulated) device: ``CudaOps.encode_indices`` writes the host
encoder's bytes (exdyna_mpi/kernels/cpu_index.py) in every form, and ``CudaOps.decode_indices`` reads them back
to the host decoder's indices; the staged and direct device exchanges send those bytes."""
import numpy as np
import pytest
from mpi4py import MPI

from exdyna_mpi.arrays.cuda_ops import CudaOps
from exdyna_mpi.kernels import cpu_index as ki
from exdyna_mpi.transport.device import DeviceExchange

# small shapes: the simulator runs one OS thread per CUDA thread
CASES = [(1, 1, ki.FORM_RAW), (4000, 2, ki.FORM_RAW), (64, 40, ki.FORM_BITMAP), (100, 33, ki.FORM_BITMAP),
         (3000, 61, ki.FORM_EF), (5000, 97, ki.FORM_EF), (1 << 20, 80, ki.FORM_EF), (2**31 + 9, 40, ki.FORM_EF)]


def _selection(span, count, seed):
    rng = np.random.default_rng(seed)
    if span < 2**24:
        return np.sort(rng.choice(span, size=count, replace=False)).astype(np.int64)
    return np.unique(rng.integers(0, span, size=count))


@pytest.mark.parametrize("span,count,form", CASES)
def test_device_bytes_are_the_host_bytes(span, count, form):
    lo = 7
    idx = _selection(span, count, span + count) + lo
    count = idx.shape[0]
    assert ki.index_form(count, span)[0] == form
    nbytes = ki.index_form(count, span)[1]
    host = np.empty(nbytes, np.uint8)
    ki.encode_indices(idx, lo, span, host)
    dev = np.full(nbytes + 4, 0xAB, np.uint8)           # stale bytes: the encoder zeroes what it needs
    assert CudaOps.encode_indices(idx, lo, span, dev) == nbytes
    assert np.array_equal(dev[:nbytes], host)
    assert (dev[nbytes:] == 0xAB).all()
    out = np.full(count, -1, np.int64)
    CudaOps.decode_indices(host, count, lo, span, out)
    assert np.array_equal(out, idx)


def test_an_empty_selection_is_no_bytes():
    assert CudaOps.encode_indices(np.empty(0, np.int32), 0, 1000, np.empty(4, np.uint8)) == 0
    out = np.empty(0, np.int32)
    assert CudaOps.decode_indices(np.empty(0, np.uint8), 0, 0, 1000, out) is out


@pytest.mark.parametrize("aware", [False, True])
def test_device_exchange_sends_the_host_bytes(aware):
    # one rank: the multi-rank gather is tests/mpi/test_contract.py -k cuda (P = 2 in this lane);
    # here the encode, the byte count and the decode of the device path against the host exchange's
    comm = MPI.COMM_SELF.Dup()
    try:
        xch = DeviceExchange(comm, cuda_aware=aware)
        idx = (_selection(3000, 61, 1) + 100).astype(np.int32)
        spans = np.array([[100, 3100]], np.int64)
        got = xch.allgather_indices(idx, np.array([61]), spans)
        assert np.array_equal(got, idx)
    finally:
        comm.Free()
