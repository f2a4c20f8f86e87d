"""The deadline exchange (the DLCP analogue, ``ExDyna(..., deadline_ms=..., max_loss=...)``) on 1..4 ranks.

Every step is checked against a reference computed here from every rank's gathered accumulator:
the applied union is a subset of the step's selections (a late chunk of an older step is never
applied), the output is the average of the ranks' accumulators on it, the residual keeps
everything else bit for bit (residual_before + grad == residual_after + contribution), and the
deferred fraction is what the step reports and at most ``max_loss``.

Delays are injected with the transport's test hook (``set_send_delay``); every test clears it.
Wall-clock bounds are behavioural and generous ("did not wait 5 s for the stalled sender").
"""
import pickle
import time

import numpy as np
import pytest
from mpi4py import MPI

import exdyna_mpi
from exdyna_mpi.sparsifiers import deadline as dlmod
from exdyna_mpi.transport.deadline import SendDelay, set_send_delay
from tests.conftest import allgather_array, mpi_assert

pytestmark = pytest.mark.mpi

N, DENSITY = 4000, 0.05


@pytest.fixture(autouse=True)
def _no_delay():
    set_send_delay(None)
    yield
    set_send_delay(None)


def _make(comm, **kw):
    return exdyna_mpi.ExDyna(N, DENSITY, comm, controller="faithful", n_blocks=16, block_align=4, **kw)


def _grads(rank, steps, dtype=np.float32):
    rng = np.random.default_rng(11 + rank)
    base = np.random.default_rng(5).standard_normal(N)
    g, out = base.copy(), []
    for _ in range(steps):
        g = 0.7 * g + 0.5 * rng.standard_normal(N)
        out.append((g * (1 + np.abs(base))).astype(dtype))
    return out


def _check(sp, comm, grad, before, out, max_loss):
    """Every property of one deadline step, against all ranks' gathered accumulators."""
    P = comm.Get_size()
    st = sp.stats
    rep = st.deadline
    acc = before + grad
    accs = allgather_array(acc, comm)
    outs = allgather_array(out, comm)
    mpi_assert(all(o.tobytes() == out.tobytes() for o in outs), "outputs differ between ranks", comm)
    union = np.asarray(sp.deadline.applied)
    unions = comm.allgather(union.tobytes())
    mpi_assert(all(u == unions[0] for u in unions), "ranks applied different unions", comm)
    parts = np.split(union, np.cumsum(rep["applied"])[:-1])
    sel_mass = def_mass = 0.0
    subset = True
    for r in range(P):
        p = st.owned[r]
        lo, hi = st.bounds[p], st.bounds[p + 1]
        sel = lo + np.flatnonzero(np.abs(accs[r, lo:hi].astype(np.float64)) >= st.threshold)
        subset &= (sel.size == st.counts[r] and np.isin(parts[r], sel).all()
                   and np.unique(parts[r]).size == parts[r].size)
        sel_mass += np.abs(accs[r, sel].astype(np.float64)).sum()
        deferred = np.setdiff1d(sel, parts[r])
        def_mass += np.abs(accs[r, deferred].astype(np.float64)).sum()
    mpi_assert(subset, "an applied index is not in its sender's selection of this step", comm)
    frac = def_mass / sel_mass if sel_mass > 0 else 0.0
    mpi_assert(np.isclose(frac, rep["deferred"], rtol=1e-9, atol=1e-12), f"deferred {rep['deferred']} != {frac}", comm)
    mpi_assert(rep["deferred"] <= max_loss + 1e-12, f"deferred {rep['deferred']} > max_loss {max_loss}", comm)

    mask = np.zeros(N, bool)
    mask[union] = True
    ref = accs[:, union].astype(np.float64).sum(axis=0) / P
    mpi_assert(np.all(out[~mask] == 0), "out is not zero off the applied union", comm)
    mpi_assert(np.allclose(out[union], ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max(initial=0)),
               "out is not the average of the accumulators on the applied union", comm)
    res = sp.residual
    expect = acc.copy()
    expect[union] = 0
    mpi_assert(res.tobytes() == expect.tobytes(), "residual is not acc with the applied union zeroed", comm)
    contribution = np.where(mask, acc, 0).astype(acc.dtype)
    mpi_assert((res + contribution).tobytes() == (before + grad).tobytes(),
               "conservation: residual_before + grad != residual_after + contribution", comm)
    return rep


def _close(sp, comm):
    dl = sp.deadline
    sp.close()
    mpi_assert(dl.pending_requests == 0 and dl.scheduled_sends == 0, "requests left after close", comm)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_no_delay_is_bit_identical_to_exact(wcomm, dtype):
    ref = _make(wcomm)
    sp = _make(wcomm, deadline_ms=60_000, max_loss=0.01)
    for t, g in enumerate(_grads(wcomm.Get_rank(), 6, dtype)):
        before = sp.residual
        want = ref.step(g.copy())
        out = sp.step(g.copy())
        _check(sp, wcomm, g, before, out, 0.01)
        same = (out.tobytes() == want.tobytes() and sp.residual.tobytes() == ref.residual.tobytes()
                and sp.threshold == ref.threshold and list(sp.stats.counts) == list(ref.stats.counts))
        mpi_assert(same and sp.stats.deadline["deferred"] == 0 and not sp.stats.deadline["waited"],
                   f"deadline exchange differs from the exact one at step {t}", wcomm)
    a, b = sp.state_dict(), ref.state_dict()
    mpi_assert(a.pop("deadline") == {"history": sp.deadline.history}, "deadline state", wcomm)
    a["options"] = {k: v for k, v in a["options"].items() if k not in dlmod.DEFAULTS}
    mpi_assert(pickle.dumps(sorted((k, repr(v)) for k, v in a.items())) ==
               pickle.dumps(sorted((k, repr(v)) for k, v in b.items())), "state differs from exact mode", wcomm)
    _close(sp, wcomm)


def test_with_block_closes_the_deadline_exchange(wcomm):
    with _make(wcomm, deadline_ms=60_000, max_loss=0.0) as sp:
        sp.step(_grads(wcomm.Get_rank(), 1)[0])
        dl = sp.deadline
        mpi_assert(dl is not None and dl.transport.comm is not None, "no deadline exchange after a step", wcomm)
    mpi_assert(sp.deadline is None and dl.transport.comm is None and dl.pending_requests == 0,
               "the with block left the deadline exchange open", wcomm)
    with _make(wcomm) as exact:   # exact mode: nothing to close
        exact.step(_grads(wcomm.Get_rank(), 1)[0])


def test_exact_mode_state_is_unchanged(wcomm):
    sp = _make(wcomm)
    sp.step(_grads(wcomm.Get_rank(), 1)[0])
    d = sp.state_dict()
    mpi_assert("deadline" not in d and not set(dlmod.DEFAULTS) & set(d["options"]) and sp.deadline is None,
               "deadline_ms=None adds state", wcomm)
    sp.close()   # a no-op in exact mode


def test_stalled_sender_is_deferred_not_waited_for(wcomm):
    """One rank's chunks are 5 s late, the deadline is 50 ms and the bound allows it: every step
    returns long before the 5 s, the stalled sender's selection stays in the residuals."""
    P = wcomm.Get_size()
    if P == 1:
        pytest.skip("needs a second rank")
    sp = _make(wcomm, deadline_ms=50, max_loss=1.0)
    gs = _grads(wcomm.Get_rank(), 3)
    sp.step(gs[0].copy())          # warm-up (kernel compilation is not the exchange's time)
    set_send_delay(SendDelay(P - 1, 5000))
    for g in gs[1:]:
        before = sp.residual
        t0 = time.perf_counter()
        out = sp.step(g.copy())
        took = time.perf_counter() - t0
        mpi_assert(took < 2.0, f"a step took {took:.2f} s: it waited for the stalled sender", wcomm)
        rep = _check(sp, wcomm, g, before, out, 1.0)
        mpi_assert(rep["applied"][P - 1] == 0 and rep["deferred"] > 0 and not rep["waited"],
                   f"the stalled sender's chunks were not deferred: {rep}", wcomm)
    t0 = time.perf_counter()
    _close(sp, wcomm)
    mpi_assert(time.perf_counter() - t0 < 2.0, "close waited for the held-back sends' delay", wcomm)


@pytest.mark.parametrize("how", ["stall", "trickle"])
def test_loss_bound_makes_the_step_wait(wcomm, how):
    """Beyond ``max_loss`` the step waits for the largest missing chunks; what it defers is the
    delayed sender's smallest values (priority order), at most ``max_loss`` of the mass."""
    P = wcomm.Get_size()
    if P == 1:
        pytest.skip("needs a second rank")
    max_loss = 0.01 if how == "stall" else 0.05
    delay = SendDelay(P - 1, 300) if how == "stall" else SendDelay(P - 1, 0, per_chunk_ms=10)
    set_send_delay(delay)
    sp = _make(wcomm, deadline_ms=20, max_loss=max_loss)
    for g in _grads(wcomm.Get_rank(), 2):
        before = sp.residual
        out = sp.step(g.copy())
        rep = _check(sp, wcomm, g, before, out, max_loss)
        mpi_assert(rep["waited"] and rep["late_chunks"] > 0, f"the step did not wait: {rep}", wcomm)
        # priority: every deferred value of the delayed sender is no larger than its applied ones
        accs = allgather_array(before + g, wcomm)
        union = sp.deadline.applied
        part = np.split(union, np.cumsum(rep["applied"])[:-1])[P - 1]
        st = sp.stats
        p = st.owned[P - 1]
        lo, hi = st.bounds[p], st.bounds[p + 1]
        sel = lo + np.flatnonzero(np.abs(accs[P - 1, lo:hi].astype(np.float64)) >= st.threshold)
        deferred = np.setdiff1d(sel, part)
        a = np.abs(accs[P - 1])
        ok = deferred.size == 0 or part.size == 0 or a[deferred].max() <= a[part].min()
        mpi_assert(ok, "a deferred value is larger than an applied one of the same sender", wcomm)
    _close(sp, wcomm)


def test_late_messages_are_drained_never_applied(wcomm):
    """Step t's chunks of one rank land during step t+3 or so: they complete only their own
    step's receives (versioned tags) and are discarded; every step applies only its own chunks."""
    P = wcomm.Get_size()
    if P == 1:
        pytest.skip("needs a second rank")
    set_send_delay(SendDelay(P - 1, 90, jitter_ms=20))
    sp = _make(wcomm, deadline_ms=30, max_loss=1.0)
    for g in _grads(wcomm.Get_rank(), 9):
        before = sp.residual
        out = sp.step(g.copy())
        _check(sp, wcomm, g, before, out, 1.0)
    stale = wcomm.allreduce(sp.deadline.stale_received)
    pending = sp.deadline.pending_requests
    mpi_assert(stale > 0, "no late message landed during a later step: the case was not constructed", wcomm)
    mpi_assert(pending < 9 * 2 * dlmod.CHUNKS * P, f"requests pile up: {pending}", wcomm)
    _close(sp, wcomm)
    # the sparsifier steps on after close (a fresh exchange), still consistent
    set_send_delay(None)
    g = _grads(wcomm.Get_rank(), 10)[-1]
    before = sp.residual
    _check(sp, wcomm, g, before, sp.step(g.copy()), 1.0)
    _close(sp, wcomm)


def test_auto_deadline_is_agreed_and_resumes(wcomm):
    sp = _make(wcomm, deadline_ms="auto", max_loss=0.05)
    gs = _grads(wcomm.Get_rank(), 7)
    saved = None
    for t, g in enumerate(gs):
        if t == 5:
            saved = pickle.loads(pickle.dumps(sp.state_dict()))
        before = sp.residual
        _check(sp, wcomm, g, before, sp.step(g.copy()), 0.05)
        ms = wcomm.allgather(sp.stats.deadline["ms"])
        mpi_assert(len(set(ms)) == 1, f"ranks used different deadlines {ms}", wcomm)
        if t < dlmod.AUTO_MIN_SAMPLES:
            mpi_assert(ms[0] == dlmod.AUTO_START_MS, "first deadlines", wcomm)
        else:
            mpi_assert(dlmod.AUTO_MIN_MS <= ms[0] <= dlmod.AUTO_MAX_MS, f"auto deadline {ms[0]}", wcomm)
    hist = wcomm.allgather(sp.deadline.history)
    want = len(gs) if wcomm.Get_size() > 1 else 0   # one rank: no links to time
    mpi_assert(all(h == hist[0] for h in hist) and len(hist[0]) == want, "history differs", wcomm)
    b = _make(wcomm, deadline_ms="auto", max_loss=0.05)
    b.load_state_dict(saved)
    b.step(gs[5].copy())
    mpi_assert(b.deadline.history[:5] == sp.deadline.history[:5] and b.iteration == 6, "resumed history", wcomm)
    _close(sp, wcomm)
    _close(b, wcomm)


@pytest.mark.parametrize("opts, text", [({"deadline_ms": -1}, "deadline_ms must be"),
                                        ({"deadline_ms": "soon"}, "deadline_ms must be"),
                                        ({"deadline_ms": True}, "deadline_ms must be"),
                                        ({"max_loss": 1.5}, "max_loss must be"),
                                        ({"max_loss": None}, "max_loss must be")])
def test_bad_options_refused_on_every_rank(wcomm, opts, text):
    with pytest.raises(ValueError, match=text):
        _make(wcomm, **opts)


def test_ranks_disagreeing_on_the_deadline_refused(wcomm):
    if wcomm.Get_size() == 1:
        pytest.skip("needs a second rank")
    with pytest.raises(ValueError, match="disagree"):
        _make(wcomm, deadline_ms=10 + wcomm.Get_rank())


def test_send_delay_parse():
    d = SendDelay.parse("2:5:1.5:3:0")
    assert (d.rank, d.ms, d.jitter_ms, d.per_chunk_ms, d.dest) == (2, 5.0, 1.5, 3.0, 0)
    d = SendDelay.parse("1:40")
    assert (d.rank, d.ms, d.jitter_ms, d.per_chunk_ms, d.dest) == (1, 40.0, 0.0, 0.0, None)
    assert d.release(3, 0, 0, 1.0) == pytest.approx(1.04)
    with pytest.raises(ValueError):
        SendDelay.parse("1")
    j = SendDelay(0, 0, jitter_ms=10, seed=1)
    assert j.release(4, 0, 1, 0.0) == j.release(4, 0, 1, 0.0) <= 0.01
    assert dlmod.chunk_sizes(35, 16).tolist() == [3, 3, 3] + [2] * 13
    assert MPI.Is_initialized()


@pytest.mark.parametrize("name", ["topk", "threshold", "cltk", "micro"])
def test_other_sparsifiers(wcomm, name):
    """The union baselines and MiCRO: bit-identical to their exact exchange with no delay; with a
    stalled sender, the same applied union on every rank, a subset of the step's selections, and
    exact conservation."""
    P, rank = wcomm.Get_size(), wcomm.Get_rank()
    opts = {"threshold": {"threshold": 1.5}}.get(name, {})
    ref = exdyna_mpi.make(name, N, DENSITY, wcomm, **opts)
    sp = exdyna_mpi.make(name, N, DENSITY, wcomm, deadline_ms=60_000, **opts)
    gs = _grads(rank, 4)
    for g in gs[:2]:
        same = ref.step(g.copy()).tobytes() == sp.step(g.copy()).tobytes()
        mpi_assert(same and ref.residual.tobytes() == sp.residual.tobytes(), f"{name}: differs from exact", wcomm)
    _close(sp, wcomm)
    if P == 1:
        return
    sp = exdyna_mpi.make(name, N, DENSITY, wcomm, deadline_ms=20, max_loss=1.0, **opts)
    set_send_delay(SendDelay(P - 1, 5000))
    for g in gs[2:]:
        before = sp.residual
        out = sp.step(g.copy())
        acc = before + g
        union = np.asarray(sp.deadline.applied)
        applied = np.unique(union)
        outs = allgather_array(out, wcomm)
        mpi_assert(all(o.tobytes() == out.tobytes() for o in outs), f"{name}: outputs differ", wcomm)
        parts = np.split(union, np.cumsum(sp.stats.deadline["applied"])[:-1])
        mpi_assert(parts[P - 1].size == 0, f"{name}: the stalled sender's chunks were applied", wcomm)
        if name != "micro":   # each sender's applied indices are among its selection of this step
            accs = allgather_array(acc, wcomm)
            thr = sp.stats.thresholds
            inside = all(np.all(np.abs(accs[r, parts[r]].astype(np.float64)) >= thr[r]) for r in range(P))
            mpi_assert(inside, f"{name}: an applied index is not in its sender's selection", wcomm)
        mask = np.zeros(N, bool)
        mask[applied] = True
        res = sp.residual
        contribution = np.where(mask, acc, 0).astype(acc.dtype)
        ok = (res + contribution).tobytes() == acc.tobytes() and np.all(res[mask] == 0) and np.all(out[~mask] == 0)
        mpi_assert(ok, f"{name}: conservation", wcomm)
    _close(sp, wcomm)
