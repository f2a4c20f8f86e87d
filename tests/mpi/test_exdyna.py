"""ExDyna on 1..4 ranks: the contract's semantics against references computed here from gathered data.

Run serially (P=1, and COMM_SELF) and under ``mpiexec -n 2/3/4 ... --with-mpi``.
"""
import numpy as np
import pytest

import exdyna_mpi
from exdyna_mpi.kernels.cpu_index import index_form
from tests.conftest import allgather_array, mpi_assert
from tests.reference import AuthorsExDyna, laplace_grad

pytestmark = pytest.mark.mpi


def _check_step(sp, comm, grad, out, before):
    """Every property of one step, from all ranks' inputs gathered in the test."""
    P = comm.Get_size()
    st = sp.stats
    acc = before + grad                                   # the same IEEE adds as the kernel
    accs = allgather_array(acc, comm)
    outs = allgather_array(out, comm)
    mpi_assert(all(o.tobytes() == out.tobytes() for o in outs), "outputs differ between ranks", comm)

    # Each rank's selection recomputed from its accumulator, the reported threshold and bounds.
    b = st.bounds
    sel = []
    for r in range(P):
        p = st.owned[r]
        lo, hi = b[p], b[p + 1]
        sel.append(lo + np.flatnonzero(np.abs(accs[r, lo:hi].astype(np.float64)) >= st.threshold))
    union = np.concatenate(sel)
    mpi_assert(np.array_equal([s.size for s in sel], st.counts), "counts differ from the reference", comm)
    mpi_assert(np.unique(union).size == union.size, "selections overlap", comm)
    mpi_assert(st.selected == union.size and st.density == union.size / acc.size, "selected/density", comm)

    mask = np.zeros(acc.size, bool)
    mask[union] = True
    ref = accs[:, union].astype(np.float64).sum(axis=0) / P
    tol = 1e-6 if acc.dtype == np.float32 else 1e-13
    mpi_assert(np.all(out[~mask] == 0), "out is not zero off the union", comm)
    mpi_assert(np.allclose(out[union], ref, rtol=tol, atol=tol * np.abs(ref).max(initial=0)),
               "out is not the average of the ranks' accumulators on the union", comm)

    res = sp.residual
    expect = acc.copy()
    expect[union] = 0
    mpi_assert(res.tobytes() == expect.tobytes(), "residual is not acc with the union zeroed", comm)
    contribution = np.where(mask, acc, 0)
    mpi_assert(np.array_equal(res + contribution, before + grad),
               "residual_after + contribution != residual_before + grad", comm)
    return union


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("numel", [20_011, 700])
def test_semantics_against_gathered_reference(comm, dtype, numel):
    P = comm.Get_size()
    sp = exdyna_mpi.ExDyna(numel, 0.02, comm, controller="faithful")
    mpi_assert(np.all(sp.residual == 0), "residual not zero before the first step", comm)
    for t in range(6):
        g = laplace_grad(comm.Get_rank(), t, numel, dtype)
        before = sp.residual
        out = sp.step(g)
        mpi_assert(isinstance(out, np.ndarray) and out.dtype == dtype and out.shape == (numel,), "out kind", comm)
        mpi_assert(sp.stats.iteration == t and len(sp.stats.counts) == P and len(sp.stats.bounds) == P + 1,
                   "stats", comm)
        _check_step(sp, comm, g, out, before)


def test_step_by_step_equals_authors_bookkeeping(comm):
    """Bounds, owners, thresholds and selections match an independent transcription of the spec."""
    numel, P, rank = 131_072 + 77, comm.Get_size(), comm.Get_rank()
    sp = exdyna_mpi.ExDyna(numel, 0.005, comm, controller="faithful", balance=True)
    ref = AuthorsExDyna(numel, 0.005, P)
    for t in range(40):
        # The head eighth is 3x larger, so the partitions really rebalance.
        g = laplace_grad(rank, t, numel, scale=0.004)
        g[: numel // 8] *= 3
        acc = sp.residual + g
        accs = allgather_array(acc, comm)
        sp.step(g)
        st = sp.stats
        mpi_assert(st.threshold == ref.thr, f"t={t}: threshold {st.threshold} != {ref.thr}", comm)
        mpi_assert(st.bounds.tolist() == ref.bounds(), f"t={t}: bounds differ", comm)
        mpi_assert(st.owned.tolist() == ref.owned(), f"t={t}: owners differ", comm)
        ks = [ref.select(accs[r], r).size for r in range(P)]
        mpi_assert(st.counts.tolist() == ks, f"t={t}: counts {st.counts.tolist()} != {ks}", comm)
        ref.advance(ks)
    if P > 1:
        mpi_assert(ref.blk_part != [1024 // P + (1 if i < 1024 % P else 0) for i in range(P)],
                   "the skewed stream never moved a boundary: the test would prove nothing", comm)


def test_density_one_is_the_dense_average(comm):
    P, rank = comm.Get_size(), comm.Get_rank()
    sp = exdyna_mpi.ExDyna(5_000, 1.0, comm)
    g = laplace_grad(rank, 0, 5_000, np.float64)
    out = sp.step(g)
    gs = allgather_array(g, comm)
    dense = gs.sum(axis=0) / P
    # MPI may add the P terms in another order: allow a few ulps of the largest term.
    mpi_assert(np.allclose(out, dense, rtol=0, atol=4 * np.finfo(np.float64).eps * np.abs(gs).max()),
               "density 1.0 is not the dense average", comm)
    mpi_assert(sp.stats.selected == 5_000 and np.all(sp.residual == 0), "not everything selected", comm)


def test_zero_counts_are_legal(comm):
    """A rank whose partition holds nothing above threshold sends nothing; nobody waits or pads."""
    P = comm.Get_size()
    numel = 64 * 1024
    sp = exdyna_mpi.ExDyna(numel, 0.01, comm, controller="faithful")
    g = np.zeros(numel, np.float32)
    g[: numel // (2 * P)] = 1.0                     # only partition 0 has anything
    out = sp.step(g)
    counts = sp.stats.counts
    mpi_assert(counts[sp.stats.owned.tolist().index(0)] == numel // (2 * P), "partition 0's count", comm)
    mpi_assert(int(np.count_nonzero(counts)) == 1, "other ranks should select nothing", comm)
    mpi_assert(np.all(out[: numel // (2 * P)] == 1.0) and np.all(out[numel // (2 * P):] == 0), "out", comm)
    sp.step(np.zeros(numel, np.float32))            # everyone selects nothing
    mpi_assert(sp.stats.selected == 0 and sp.stats.bytes_received >= 0, "all-zero step", comm)


def test_bytes_follow_the_ring_model(comm):
    P, rank = comm.Get_size(), comm.Get_rank()
    sp = exdyna_mpi.ExDyna(30_000, 0.01, comm, controller="faithful")
    sp.step(laplace_grad(rank, 0, 30_000))
    c = sp.stats.counts
    K = int(c.sum())
    if P == 1:
        want_recv = want_sent = 0
    else:
        words = 4 * 8 * (P - 1)                     # the count/error words, 4 int64 per rank
        vals = 2 * (P - 1) * K * 4 // P             # reduce-scatter + allgather of float32 values
        # indices in compact form: a rank's bytes follow from its count and its partition's span
        b, own = sp.stats.bounds, sp.stats.owned
        nb = [index_form(int(c[r]), int(b[own[r] + 1] - b[own[r]]))[1] for r in range(P)]
        want_recv = words + sum(nb) - nb[rank] + vals
        want_sent = words + sum(nb) - nb[(rank + 1) % P] + vals
    mpi_assert((sp.stats.bytes_received, sp.stats.bytes_sent) == (want_recv, want_sent),
               f"bytes {sp.stats.bytes_received, sp.stats.bytes_sent} != {want_recv, want_sent}", comm)


def test_torch_tensor_in_torch_tensor_out(wcomm):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    sp = exdyna_mpi.ExDyna(4_096, 0.05, wcomm)
    g = torch.from_numpy(laplace_grad(wcomm.Get_rank(), 0, 4_096))
    out = sp.step(g)
    mpi_assert(isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == (4_096,),
               "torch in must give torch out", wcomm)


def test_out_buffer_may_be_the_gradient(wcomm):
    rank = wcomm.Get_rank()
    a = exdyna_mpi.ExDyna(9_000, 0.02, wcomm)
    b = exdyna_mpi.ExDyna(9_000, 0.02, wcomm)
    for t in range(3):
        g = laplace_grad(rank, t, 9_000)
        want = a.step(g.copy())
        got = b.step(g, out=g)
        mpi_assert(got is g and g.tobytes() == want.tobytes(), "out=grad must give the same result", wcomm)
        mpi_assert(a.residual.tobytes() == b.residual.tobytes(), "residuals differ", wcomm)


def test_state_dict_resume_in_process(wcomm):
    rank = wcomm.Get_rank()
    numel = 50_000

    def grads(t):
        return laplace_grad(rank, t, numel, scale=0.003)

    full = exdyna_mpi.ExDyna(numel, 0.003, wcomm)
    want = [full.step(grads(t)).copy() for t in range(20)]
    first = exdyna_mpi.ExDyna(numel, 0.003, wcomm)
    for t in range(8):
        first.step(grads(t))
    import pickle
    blob = pickle.dumps(first.state_dict())
    again = exdyna_mpi.ExDyna(numel, 0.003, wcomm)
    again.load_state_dict(pickle.loads(blob))
    ok = all(again.step(grads(t)).tobytes() == want[t].tobytes() for t in range(8, 20))
    mpi_assert(ok and again.iteration == 20, "resumed run differs from the uninterrupted one", wcomm)


def test_micro_has_equal_fixed_partitions(comm):
    P = comm.Get_size()
    sp = exdyna_mpi.make("micro", 10_003, 0.02, comm)
    for t in range(3):
        g = laplace_grad(comm.Get_rank(), t, 10_003)
        before = sp.residual
        out = sp.step(g)
        _check_step(sp, comm, g, out, before)
    sizes = np.diff(sp.stats.bounds)
    mpi_assert(sizes.max() - sizes.min() <= 1 and sp.stats.bounds[-1] == 10_003, "micro bounds", comm)
    mpi_assert(P >= 1, "", comm)
