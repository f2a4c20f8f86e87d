"""The sparse reduce-scatter (``Exchange.reduce_scatter_mean``), one to four ranks, against a
reference computed in the test from every rank's values.

Every rank holds the same ascending union of positions of an n-element gradient and its own values
there; shards are ranges of positions ``[bounds[r], bounds[r+1])`` (equal ones, uneven ones, empty
ones, one rank owning all). Rank r must get, for the union's positions in its shard only, the
float32 sum of every rank's values in rank order divided by P: with float32 values on the wire,
the values themselves; with 16-bit values, each other rank's values rounded (nearest even,
saturating) to the format and the owner's own in float32. Each rank keeps in ``vals`` what its
rounding lost outside its run and nothing inside. The dense shard built with ``scatter_run`` is
the shard of the dense mean of the sparse gradients. Bytes: what crosses the rank's link, exact.
Counts that do not cut the union raise the same error on every rank.
"""
import numpy as np
import pytest
from mpi4py import MPI

from exdyna_mpi.arrays.half import WireFormat
from exdyna_mpi.kernels import cpu_shard
from exdyna_mpi.transport import Exchange, shard_runs
from tests.conftest import mpi_assert, require, same_error_everywhere

pytestmark = pytest.mark.mpi

ml_dtypes = require("ml_dtypes")

COMM = MPI.COMM_WORLD
P, ME = COMM.Get_size(), COMM.Get_rank()
N = 5000


def _bounds(kind):
    if kind == "equal":                      # FSDP's chunks: ceil(n / P) each, the last one short
        s = -(-N // P)
        return np.minimum(np.arange(P + 1) * s, N)
    if kind == "uneven":
        cuts = np.sort(np.random.default_rng(P).choice(np.arange(1, N), P - 1, replace=False))
        return np.concatenate([[0], cuts, [N]])
    if kind == "first-empty":                # rank 0 owns nothing (one rank owns all at P = 1)
        b = np.minimum(np.arange(P + 1) * (-(-N // P)), N)
        b[1] = 0 if P > 1 else N
        return b
    return np.array([0] + [N] * P)           # "one-owner": rank 0 owns everything


def _union(k, seed=3):
    return np.sort(np.random.default_rng(seed).choice(N, k, replace=False)).astype(np.int64)


def _values(rank, k):
    return np.random.default_rng([11, rank]).laplace(0.0, 0.3, k).astype(np.float32)


def _round16(x, name):
    t = np.float16 if name == "float16" else ml_dtypes.bfloat16
    top = np.float32(np.finfo(np.float16).max if name == "float16" else ml_dtypes.finfo(t).max)
    with np.errstate(over="ignore"):
        h = x.astype(t).astype(np.float32)
    return np.where(np.isinf(h) & np.isfinite(x), np.copysign(top, x), h).astype(np.float32)


@pytest.mark.parametrize("wire", [None, "bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["equal", "uneven", "first-empty", "one-owner"])
def test_each_owner_gets_the_rank_order_mean_of_its_run(kind, wire):
    k = 900
    union, bounds = _union(k), _bounds(kind)
    counts = shard_runs(union, bounds)
    lo, hi = int(bounds[ME]), int(bounds[ME + 1])
    mine_pos = union[(union >= lo) & (union < hi)]
    mpi_assert(counts.sum() == k and counts[ME] == mine_pos.size, f"runs {counts.tolist()}")

    vals = _values(ME, k)
    xch = Exchange(COMM)
    got = xch.reduce_scatter_mean(vals, counts, None if wire is None else WireFormat.of(wire))
    kept = vals                               # what the call left in the rank's values

    start = int(np.searchsorted(union, lo))
    run = slice(start, start + int(counts[ME]))
    total = np.zeros(int(counts[ME]), np.float32)
    for r in range(P):                       # the reference: rank order, float32
        v = _values(r, k)[run]
        total = total + (v if (wire is None or r == ME) else _round16(v, wire))
    want = total / np.float32(P)
    mpi_assert(got.dtype == np.float32 and got.tobytes() == want.tobytes(), f"{kind}/{wire}: means differ")

    mine = _values(ME, k)
    keep = np.zeros(k, np.float32) if wire is None else mine - _round16(mine, wire)
    keep[run] = 0.0
    mpi_assert(kept.tobytes() == keep.tobytes(), f"{kind}/{wire}: what the rank keeps")

    item = 4 if wire is None else 2
    sent = (k - int(counts[ME])) * item if P > 1 else 0
    received = (P - 1) * int(counts[ME]) * item
    mpi_assert((xch.bytes_sent, xch.bytes_received) == (sent, received),
               f"bytes {(xch.bytes_sent, xch.bytes_received)} != {(sent, received)}")


def test_the_dense_shard_is_the_shard_of_the_dense_mean():
    k = 1200
    union, bounds = _union(k, seed=8), _bounds("uneven")
    counts = shard_runs(union, bounds)
    lo, hi = int(bounds[ME]), int(bounds[ME + 1])
    means = Exchange(COMM).reduce_scatter_mean(_values(ME, k), counts)
    start = int(np.searchsorted(union, lo))
    shard = np.zeros(hi - lo, np.float32)
    cpu_shard.scatter_run(shard, union[start: start + int(counts[ME])], lo, means)

    dense = np.zeros(N, np.float32)           # every rank's sparse gradient, summed in rank order
    for r in range(P):
        g = np.zeros(N, np.float32)
        g[union] = _values(r, k)
        dense = dense + g
    want = (dense / np.float32(P))[lo:hi]
    mpi_assert(shard.tobytes() == want.tobytes(), "the dense shard differs from the dense mean's shard")


def test_an_empty_union_moves_nothing():
    xch = Exchange(COMM)
    got = xch.reduce_scatter_mean(np.empty(0, np.float32), np.zeros(P, np.int64))
    mpi_assert(got.shape == (0,) and (xch.bytes_sent, xch.bytes_received) == (0, 0), "empty union")


def test_counts_that_do_not_cut_the_union_are_refused_everywhere():
    vals = _values(ME, 10)
    bad = np.zeros(P, np.int64)
    bad[-1] = 9                               # one short
    msg = same_error_everywhere(lambda: Exchange(COMM).reduce_scatter_mean(vals, bad))
    mpi_assert("non-negative runs of 10" in msg, msg)
    mpi_assert(vals.tobytes() == _values(ME, 10).tobytes(), "a refused call changed the values")


def test_runs_follow_the_bounds():
    union = np.array([0, 3, 4, 9, 10, 19], np.int64)
    assert shard_runs(union, [0, 4, 10, 20]).tolist() == [2, 2, 2]
    assert shard_runs(union, [0, 0, 20, 20]).tolist() == [0, 6, 0]
    assert shard_runs(np.empty(0, np.int64), [0, 5, 10]).tolist() == [0, 0]
