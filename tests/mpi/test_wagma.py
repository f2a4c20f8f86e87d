"""WAGMA-SGD ``GroupAverager`` on 1..4 ranks (and 8 through a launched job), against references
computed here.

Inputs are deterministic functions of (rank, step), so every rank can compute any rank's input and
the references need no per-step collective (which would hide wait-avoidance).

- sync mode: groups follow the pure schedule; every group member ends with the same bits, close to
  the float64 mean of the group's inputs; every T-th call is a global average, bit-identical on all
  ranks;
- bad arguments (P = 3 included): the same ValueError on every rank; bad step input: StepError;
- wait-avoiding: with an injected delay on one rank, its partner does not wait for it (it uses the
  late rank's older snapshot: staleness >= 1), staleness stays <= T - 1 on every rank, every result
  equals the mean of the snapshots the stats say were used (own vector substituted);
- close: no pending requests, the progress thread has ended; exit without close does not hang;
- resume from state_dict: the continuation is bit-identical to an uninterrupted run (sync);
- the torch wrapper: local step, then the group average of the locally stepped models.
"""
import pickle
import subprocess
import sys
import time

import numpy as np
import pytest
from mpi4py import MPI

from exdyna_mpi import GroupAverager, StepError
from exdyna_mpi.averaging import wagma
from tests.conftest import allgather_array, mpi_assert, same_error_everywhere
from tests.launch import MPIEXEC, ROOT, child_env

pytestmark = pytest.mark.mpi
N = 1003


def x_of(rank, t, dtype=np.float32):
    return np.random.default_rng(1_000 * rank + t).standard_normal(N).astype(dtype)


def _pow2_or_skip(comm):
    if not wagma.is_pow2(comm.Get_size()):
        pytest.skip("WAGMA needs a power-of-two number of ranks (checked by the bad-argument test)")


def _same_text_everywhere(text, comm):
    texts = comm.allgather(text)
    mpi_assert(all(t == texts[0] for t in texts), f"different messages: {texts}", comm)


# ---------------------------------------------------------------------- checks (also run at P=8)
def check_sync_exact(comm, S, dtype, T=3, steps=8):
    P, r = comm.Get_size(), comm.Get_rank()
    with GroupAverager(N, comm, group_size=S, sync_every=T, mode="sync") as ga:
        for t in range(steps):
            out = ga.step(x_of(r, t, dtype))
            st = ga.stats
            kind, phase, bits, group = wagma.schedule(t, r, P, S, T)
            mpi_assert(out.dtype == dtype and st.kind == kind and st.group == group and st.iteration == t,
                       f"t={t}: stats {st} vs schedule {kind} {group}", comm)
            ref = np.mean([x_of(q, t, np.float64) for q in group], axis=0)
            tol = 1e-6 if dtype == np.float32 else 1e-14
            mpi_assert(np.allclose(out, ref, rtol=tol, atol=tol),
                       f"t={t} {kind}: max error {np.abs(out - ref).max():.3g}", comm)
            outs = allgather_array(out, comm)
            same = all(outs[q].tobytes() == out.tobytes() for q in group)
            mpi_assert(same, f"t={t} {kind}: group {group} members differ in bits", comm)
            if kind == "global":
                mpi_assert(all(o.tobytes() == outs[0].tobytes() for o in outs), "global differs", comm)
            mpi_assert(P == 1 or len(group) == 1 or st.bytes_sent > 0, "no bytes counted", comm)
        mpi_assert(ga.iteration == steps, "iteration counter", comm)


def check_wait_avoiding_delay(comm, T=4, late=1, delay=0.5, k=4, steps=9):
    """Rank ``late`` sleeps ``delay`` s before call k (a phase-0 group step: its group is {late-1, late}
    at S=2); its partner proceeds with the late rank's older snapshot."""
    P, r = comm.Get_size(), comm.Get_rank()
    S = 2
    recs = []
    with GroupAverager(N, comm, group_size=S, sync_every=T, mode="wait_avoiding") as ga:
        assert wagma.step_kind(k, T) == "group" and wagma.phase_of(k, P, S) == 0
        for t in range(steps):
            if r == late and t == k:
                time.sleep(delay)  # the injected straggler: the thing under test
            out = ga.step(x_of(r, t))
            st = ga.stats
            recs.append((t, st.kind, st.group, st.staleness, st.versions, out.copy()))
        pending, alive = ga.pending_requests, ga.thread_alive
    mpi_assert(ga.pending_requests == 0 and not ga.thread_alive,
               f"after close: pending {ga.pending_requests}, thread alive {ga.thread_alive} "
               f"(before close: {pending}, {alive})", comm)
    problems = []
    for t, kind, group, stale, versions, out in recs:
        if kind == "global":
            ref = np.mean([x_of(q, t, np.float64) for q in range(P)], axis=0)
        else:
            if sorted(versions) != group or versions[r] > t or min(versions.values()) < 0:
                problems.append(f"t={t}: versions {versions} for group {group}")
                continue
            ref = (sum(x_of(q, versions[q], np.float64) for q in group if q != r)
                   + x_of(r, t, np.float64)) / len(group)
            if stale != t - min(versions.values()):
                problems.append(f"t={t}: staleness {stale} vs versions {versions}")
        if not 0 <= stale <= T - 1:
            problems.append(f"t={t}: staleness {stale} outside [0, {T - 1}]")
        if not np.allclose(out, ref, rtol=1e-5, atol=1e-6):
            problems.append(f"t={t}: max error {np.abs(out - ref).max():.3g} (versions {versions})")
    mpi_assert(not problems, "; ".join(problems[:5]), comm)
    if P >= 2:
        # The partner of the late rank did not wait for it: it averaged with an older snapshot.
        partner = late ^ 1
        if r == partner:
            _, _, group, stale, versions, _ = recs[k]
            ok = stale >= 1 and versions[late] < k
            msg = f"partner at call {k}: staleness {stale}, versions {versions}"
        else:
            ok, msg = True, ""
        mpi_assert(ok, msg, comm)
    return recs


def check_wait_avoiding_random_delays(comm, T=5, steps=25, seed=7):
    """Random delays (0-20 ms, heavy-tailed) on the odd ranks: bound and values hold throughout."""
    P, r = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(seed + r)
    S = min(P, 4) if P >= 4 else max(1, P)
    worst = 0
    with GroupAverager(N, comm, group_size=S, sync_every=T, mode="wait_avoiding") as ga:
        bad = []
        for t in range(steps):
            if r % 2 == 1:
                time.sleep(min(0.02, 0.002 * rng.pareto(1.5)))
            out = ga.step(x_of(r, t))
            st = ga.stats
            worst = max(worst, st.staleness)
            if st.kind == "group" and st.versions:
                ref = (sum(x_of(q, v, np.float64) for q, v in st.versions.items() if q != r)
                       + x_of(r, t, np.float64)) / len(st.group)
            else:
                ref = np.mean([x_of(q, t, np.float64) for q in st.group], axis=0)
            if not np.allclose(out, ref, rtol=1e-5, atol=1e-6) or not 0 <= st.staleness <= T - 1:
                bad.append(f"t={t} staleness {st.staleness} versions {st.versions}")
    mpi_assert(not bad, "; ".join(bad[:5]), comm)
    return worst


# ---------------------------------------------------------------------- tests
def test_bad_arguments_same_error_on_every_rank(wcomm):
    P = wcomm.Get_size()
    cases = [dict(group_size=3), dict(group_size=2 * P), dict(sync_every=0), dict(mode="eager"),
             dict(sync_every=2.5)]
    if not wagma.is_pow2(P):
        cases = [dict()]
    for kw in cases:
        with pytest.raises(ValueError) as ei:
            GroupAverager(N, wcomm, **kw)
        text = str(ei.value)
        _same_text_everywhere(text, wcomm)
        mpi_assert("GroupAverager: bad arguments" in text and f"rank {P - 1}" in text, text, wcomm)
        if not wagma.is_pow2(P):
            mpi_assert("power of two" in text and f"{P} ranks" in text, text, wcomm)
    with pytest.raises(ValueError) as ei:
        GroupAverager(0, wcomm)
    mpi_assert("numel" in str(ei.value), str(ei.value), wcomm)
    if wagma.is_pow2(P) and P >= 2:
        with pytest.raises(ValueError) as ei:
            GroupAverager(N, wcomm, group_size=1 if wcomm.Get_rank() == 0 else 2)
        _same_text_everywhere(str(ei.value), wcomm)
        mpi_assert("disagree" in str(ei.value), str(ei.value), wcomm)
    # The communicator is still usable: no rank was left inside a collective.
    mpi_assert(wcomm.allreduce(1) == P, "communicator broken", wcomm)


@pytest.mark.parametrize("S", [1, 2, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sync_mode_exact_group_and_global_averages(wcomm, S, dtype):
    _pow2_or_skip(wcomm)
    if S > wcomm.Get_size():
        pytest.skip(f"group size {S} > {wcomm.Get_size()} ranks")
    check_sync_exact(wcomm, S, dtype)


def test_sync_every_1_and_S_equal_P_is_plain_averaging(wcomm):
    _pow2_or_skip(wcomm)
    P, r = wcomm.Get_size(), wcomm.Get_rank()
    for kw in (dict(group_size=1, sync_every=1), dict(group_size=P, sync_every=1000)):
        with GroupAverager(N, wcomm, **kw) as ga:
            for t in range(3):
                out = ga.step(x_of(r, t))
                ref = np.mean([x_of(q, t, np.float64) for q in range(P)], axis=0)
                mpi_assert(np.allclose(out, ref, rtol=1e-6, atol=1e-6) and ga.stats.group == list(range(P)),
                           f"{kw} t={t}", wcomm)


def test_returns_the_kind_it_was_given(wcomm):
    _pow2_or_skip(wcomm)
    torch = pytest.importorskip("torch")
    r = wcomm.Get_rank()
    with GroupAverager(N, wcomm, group_size=2 if wcomm.Get_size() > 1 else 1, sync_every=2) as ga:
        x = torch.from_numpy(x_of(r, 0))
        out = ga.step(x)
        mpi_assert(isinstance(out, torch.Tensor) and out.shape == (N,), type(out).__name__, wcomm)
        buf = torch.from_numpy(x_of(r, 1))
        out2 = ga.step(buf, out=buf)  # a global step, in place
        ref = np.mean([x_of(q, 1, np.float64) for q in range(wcomm.Get_size())], axis=0)
        mpi_assert(out2.data_ptr() == buf.data_ptr() and np.allclose(buf.numpy(), ref, atol=1e-6),
                   "in-place global step", wcomm)


def test_bad_step_input(wcomm):
    _pow2_or_skip(wcomm)
    P, r = wcomm.Get_size(), wcomm.Get_rank()
    S = 2 if P >= 2 else 1
    with GroupAverager(N, wcomm, group_size=S, sync_every=3, mode="sync") as ga:
        # First step: checked collectively, same StepError everywhere, nothing changes.
        bad = x_of(r, 0)[:-1] if r == P - 1 else x_of(r, 0)
        with pytest.raises(StepError) as ei:
            ga.step(bad)
        _same_text_everywhere(str(ei.value), wcomm)
        mpi_assert(f"rank {P - 1}" in str(ei.value) and "length" in str(ei.value) and ga.iteration == 0,
                   str(ei.value), wcomm)
        ga.step(x_of(r, 0))
        # A sync group step (t=1): the group of the bad rank raises the same error; the round is used up.
        bad_group = wagma.group_of(P - 1, 1, P, S, 3)
        v = x_of(r, 1)
        if r == P - 1:
            v = v.astype(np.float64)
        if r in bad_group:
            with pytest.raises(StepError) as ei:
                ga.step(v)
            text = str(ei.value)
        else:
            ga.step(v)
            text = ""
        texts = wcomm.allgather(text)
        mpi_assert(all((texts[q] == texts[P - 1]) == (q in bad_group) or P == 1 for q in range(P))
                   and ga.iteration == 2, f"{texts}", wcomm)
        # A global step (t=2) with a non-float input on rank 0: refused everywhere, counter kept.
        g = x_of(r, 2).astype(np.int32) if r == 0 else x_of(r, 2)
        with pytest.raises(StepError) as ei:
            ga.step(g)
        _same_text_everywhere(str(ei.value), wcomm)
        mpi_assert(ga.iteration == 2 and "rank 0" in str(ei.value), str(ei.value), wcomm)
        out = ga.step(x_of(r, 2))
        ref = np.mean([x_of(q, 2, np.float64) for q in range(P)], axis=0)
        mpi_assert(ga.stats.kind == "global" and np.allclose(out, ref, atol=1e-6), "recovered", wcomm)


def test_wait_avoiding_injected_delay_staleness_bound(wcomm):
    _pow2_or_skip(wcomm)
    if wcomm.Get_size() < 2:
        pytest.skip("needs a partner")
    check_wait_avoiding_delay(wcomm)


def test_wait_avoiding_random_delays(wcomm):
    _pow2_or_skip(wcomm)
    check_wait_avoiding_random_delays(wcomm)


def test_close_is_clean_and_idempotent(wcomm):
    _pow2_or_skip(wcomm)
    r = wcomm.Get_rank()
    ga = GroupAverager(N, wcomm, group_size=min(2, wcomm.Get_size()), sync_every=4, mode="wait_avoiding")
    for t in range(6):
        ga.step(x_of(r, t))
    mpi_assert(ga.pending_requests == 0, f"pending between rounds: {ga.pending_requests}", wcomm)
    ga.close()
    ga.close()
    mpi_assert(ga.pending_requests == 0 and not ga.thread_alive, "not clean", wcomm)
    with pytest.raises(RuntimeError):
        ga.step(x_of(r, 6))


def test_resume_from_state(wcomm):
    _pow2_or_skip(wcomm)
    P, r = wcomm.Get_size(), wcomm.Get_rank()
    S = min(2, P)
    kw = dict(group_size=S, sync_every=4, mode="sync")
    with GroupAverager(N, wcomm, **kw) as ga:
        full = [ga.step(x_of(r, t)).tobytes() for t in range(10)]
    with GroupAverager(N, wcomm, **kw) as ga:
        for t in range(6):
            ga.step(x_of(r, t))
        state = ga.state_dict()
    with GroupAverager(N, wcomm, **kw) as ga2:
        ga2.load_state_dict(state)
        mpi_assert(ga2.iteration == 6, "iteration", wcomm)
        resumed = [ga2.step(x_of(r, t)).tobytes() for t in range(6, 10)]
        mpi_assert(resumed == full[6:], "resumed run differs from the uninterrupted one", wcomm)
        with pytest.raises(ValueError):
            ga2.load_state_dict(dict(state, group_size=S * 2))
    # wait-avoiding: the schedule position resumes, the thread restarts cleanly
    with GroupAverager(N, wcomm, group_size=S, sync_every=4, mode="wait_avoiding") as ga3:
        ga3.step(x_of(r, 0))
        ga3.load_state_dict(dict(state, mode="wait_avoiding"))
        kinds = []
        for t in range(6, 10):
            ga3.step(x_of(r, t))
            kinds.append(ga3.stats.kind)
        mpi_assert(kinds == [wagma.step_kind(t, 4) for t in range(6, 10)] and ga3.stats.iteration == 9, kinds, wcomm)


@pytest.mark.parametrize("fault", ["dtype", "iteration", "missing-key", "group_size"])
def test_corrupt_state_on_one_rank_changes_nothing(wcomm, fault):
    _pow2_or_skip(wcomm)
    P, r = wcomm.Get_size(), wcomm.Get_rank()
    bad = P - 1
    with GroupAverager(N, wcomm, group_size=min(2, P), sync_every=4) as ga:
        for t in range(3):
            ga.step(x_of(r, t))
        d = ga.state_dict()
        if r == bad:
            d = {"dtype": dict(d, dtype="<U3"), "iteration": dict(d, iteration=-2),
                 "missing-key": {k: v for k, v in d.items() if k != "dtype"},
                 "group_size": dict(d, group_size=3)}[fault]
        before = ga.state_dict()
        msg = same_error_everywhere(lambda: ga.load_state_dict(d), wcomm)
        mpi_assert(f"rank {bad}" in msg and "state unchanged" in msg, msg, wcomm)
        mpi_assert(ga.state_dict() == before, "a refused load changed the averager", wcomm)
        ga.step(x_of(r, 3))   # the ranks go on together
        mpi_assert(ga.iteration == 4, f"iteration {ga.iteration}", wcomm)


def test_torch_wrapper_refuses_one_ranks_bad_state_everywhere(wcomm):
    _pow2_or_skip(wcomm)
    torch = pytest.importorskip("torch")
    from exdyna_mpi.adapters.torch import GroupAveragingOptimizer

    P, r = wcomm.Get_size(), wcomm.Get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = GroupAveragingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                                  group_size=min(2, P), sync_every=3, comm=wcomm)
    g = torch.Generator().manual_seed(r)
    try:
        for _ in range(2):
            x, y = torch.randn(5, 8, generator=g), torch.randint(0, 3, (5,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        def bits(sd):   # tensors by their bytes (a pickle's bytes also depend on storage sharing)
            state = {k: {n: v.numpy().tobytes() if torch.is_tensor(v) else v for n, v in st.items()}
                     for k, st in sd["state"].items()}
            return repr((state, sd["param_groups"], sd["group_averager"]))

        before = pickle.dumps(opt.state_dict())
        want = bits(opt.state_dict())
        for fault in ("optimizer", "averager", "missing"):
            d = pickle.loads(before)
            if r == P - 1:
                if fault == "optimizer":
                    d["param_groups"] = d["param_groups"] + d["param_groups"]   # torch refuses
                elif fault == "averager":
                    d["group_averager"]["iteration"] = -1
                else:
                    del d["group_averager"]
            msg = same_error_everywhere(lambda: opt.load_state_dict(d), wcomm)
            mpi_assert(f"rank {P - 1}" in msg, f"{fault}: {msg}", wcomm)
            mpi_assert(bits(opt.state_dict()) == want, f"{fault}: a refused load changed the state", wcomm)
        opt.load_state_dict(pickle.loads(before))
    finally:
        opt.close()


def test_torch_wrapper_local_step_then_group_average(wcomm):
    _pow2_or_skip(wcomm)
    torch = pytest.importorskip("torch")
    from exdyna_mpi.adapters.torch import GroupAveragingOptimizer

    P, r = wcomm.Get_size(), wcomm.Get_rank()
    S = min(2, P)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    lr = 0.1
    opt = GroupAveragingOptimizer(torch.optim.SGD(model.parameters(), lr=lr), model, group_size=S,
                                  sync_every=3, comm=wcomm)
    g = torch.Generator().manual_seed(r)
    for t in range(4):
        x, y = torch.randn(5, 8, generator=g), torch.randint(0, 3, (5,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        before = opt.flat_params.numpy().copy()
        grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy()
        opt.step()
        local = allgather_array((before - np.float32(lr) * grad).astype(np.float32), wcomm)
        group = wagma.group_of(r, t, P, S, 3)
        ref = local[group].astype(np.float64).mean(axis=0)
        now = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        mpi_assert(np.allclose(now, ref, rtol=1e-5, atol=1e-6) and opt.stats.group == group,
                   f"t={t}: max error {np.abs(now - ref).max():.3g}", wcomm)
    sd = opt.state_dict()
    mpi_assert(sd["group_averager"]["iteration"] == 4, "averager state missing", wcomm)
    opt.load_state_dict(sd)
    opt.synchronize_model()
    allp = allgather_array(opt.flat_params.numpy(), wcomm)
    mpi_assert(all(a.tobytes() == allp[0].tobytes() for a in allp), "not identical after sync", wcomm)
    opt.close()


# ---------------------------------------------------------------------- launched jobs (serial lane)
def _launch(n, *args, timeout=120):
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("launches its own mpiexec: serial lane only")
    exe = MPIEXEC
    if exe is None:
        pytest.skip("no mpiexec on PATH")
    cmd = ["timeout", "-k", "5", str(timeout), exe, "-n", str(n), sys.executable, "-m", "mpi4py",
           "-m", "tests.mpi.wagma_job", *args]   # from ROOT, as a module: it imports tests.mpi
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, f"rc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout, time.perf_counter() - t0


def test_exit_without_close_does_not_hang():
    out, _ = _launch(2, "--exit-without-close", timeout=60)
    assert "WAGMA-JOB exit-without-close P=2" in out


def test_p8_sync_exact_and_wait_avoiding_bound():
    out, _ = _launch(8, "--checks")
    assert "WAGMA-JOB OK P=8" in out, out
