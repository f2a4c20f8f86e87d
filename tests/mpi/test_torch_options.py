"""DistributedOptimizer's training-recipe options, each against a reference computed here.

- ``clip_norm``: what enters the exchange is each rank's gradient clipped by
  ``torch.nn.utils.clip_grad_norm_`` (run here on a copy of the model); the dense exchange averages it.
- ``warmup_steps``: the first steps are the dense average (density 1), the sparsifier's iteration
  does not move; then the sparsifier runs.
- ``momentum_correction`` (+ masking): u <- m*u + g on each rank, the sparsifier accumulates u, the
  union mean comes out, and u is zeroed where the exchanged gradient is nonzero.
- state round trip: save mid-run (warm-up and sparse phase), load into fresh objects, same bits.
- ``density_warmup`` (DGC's decaying density): bit for bit the steps of hand-built sparsifiers of the
  stage densities whose residual is carried by hand (``memory.load`` before a stage's first step);
  stage boundaries, stats, the carry itself (also across a skipped step), resume mid-warm-up, bad
  values.
"""
import copy
import gc
import io
import os
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

import exdyna_mpi  # noqa: E402
from exdyna_mpi.adapters.torch import DistributedOptimizer  # noqa: E402
from tests.conftest import allgather_array, mpi_assert, same_error_everywhere  # noqa: E402

pytestmark = pytest.mark.mpi


def _model(seed=5):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5))


def _flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors]).numpy().copy()


def _batch(rank, s):
    gen = torch.Generator().manual_seed(1000 * rank + s)
    return torch.randn(16, 32, generator=gen) * (1 + s % 3), torch.randint(0, 5, (16,), generator=gen)


def _raw_grad(model, x, y, clip=None):
    """This rank's gradient at the model's current parameters, on a copy (optionally clipped)."""
    m = copy.deepcopy(model)
    for p in m.parameters():
        p.grad = None
    torch.nn.functional.cross_entropy(m(x), y).backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(list(m.parameters()), clip)
    return _flat(p.grad for p in m.parameters())


def _step(model, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def test_clip_norm_clips_each_ranks_gradient_like_clip_grad_norm(wcomm):
    rank = wcomm.Get_rank()
    model = _model()
    clip = 0.05   # well below these gradients' norms: clipping happens on every rank
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, sparsifier="dense",
                               density=1.0, comm=wcomm, clip_norm=clip)
    for s in range(3):
        x, y = _batch(rank, s)
        raw = _raw_grad(model, x, y)
        clipped = _raw_grad(model, x, y, clip=clip)
        mpi_assert(np.linalg.norm(raw) > 2 * clip, f"test premise: norm {np.linalg.norm(raw):.3g}", wcomm)
        _step(model, opt, x, y)
        ref = allgather_array(clipped, wcomm).astype(np.float64).mean(axis=0)
        out = opt.flat_grad.numpy()
        mpi_assert(np.allclose(out, ref, rtol=1e-5, atol=1e-8),
                   f"step {s}: out is not the mean of clipped gradients (max err {np.abs(out - ref).max():.3g})",
                   wcomm)
        unclipped = allgather_array(raw, wcomm).astype(np.float64).mean(axis=0)
        mpi_assert(not np.allclose(out, unclipped, rtol=1e-3), "nothing was clipped", wcomm)


def test_warmup_runs_dense_then_the_sparsifier(wcomm):
    rank = wcomm.Get_rank()
    model = _model()
    warm = 3
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, sparsifier="exdyna",
                               density=0.05, comm=wcomm, warmup_steps=warm)
    for s in range(warm + 2):
        x, y = _batch(rank, s)
        raw = _raw_grad(model, x, y)
        _step(model, opt, x, y)
        out = opt.flat_grad.numpy()
        ref = allgather_array(raw, wcomm).astype(np.float64).mean(axis=0)
        if s < warm:
            mpi_assert(opt.stats.density == 1.0 and np.allclose(out, ref, rtol=1e-5, atol=1e-8),
                       f"warm-up step {s}: not the dense average (density {opt.stats.density})", wcomm)
            mpi_assert(opt.sparsifier.iteration == 0 and not np.any(opt.sparsifier.residual),
                       f"warm-up step {s}: the sparsifier ran", wcomm)
        else:
            mpi_assert(opt.sparsifier.iteration == s - warm + 1, f"step {s}: iteration {opt.sparsifier.iteration}",
                       wcomm)
            mpi_assert(opt.stats.density < 0.5 and np.count_nonzero(out) < out.size // 2,
                       f"step {s}: not sparse (density {opt.stats.density})", wcomm)


def test_momentum_correction_and_masking_match_a_reference(wcomm):
    rank, P = wcomm.Get_rank(), wcomm.Get_size()
    model = _model()
    m, lr = 0.9, 0.1
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), model, sparsifier="exdyna",
                               density=0.05, comm=wcomm, momentum_correction=m)
    sp = opt.sparsifier
    u = torch.zeros(opt.flat_grad.numel())
    masked_some = False
    for s in range(5):
        x, y = _batch(rank, s)
        g = torch.from_numpy(_raw_grad(model, x, y))
        u.mul_(m).add_(g)                              # the reference velocity, same float32 ops
        acc = sp.residual + u.numpy()                  # what ExDyna selects from on this rank
        before = _flat(model.parameters())
        _step(model, opt, x, y)
        out = opt.flat_grad.numpy().copy()
        res = sp.residual
        accs = allgather_array(acc, wcomm)
        sel = (allgather_array(res, wcomm) != accs).any(axis=0)   # the union: where EF was consumed
        ref = np.zeros_like(out)
        ref[sel] = accs[:, sel].astype(np.float64).sum(axis=0) / P
        mpi_assert(np.allclose(out, ref, rtol=1e-5, atol=1e-8) and not out[~sel].any(),
                   f"step {s}: out is not the union mean of residual + velocity", wcomm)
        mpi_assert(np.array_equal(res[~sel], acc[~sel]), f"step {s}: the residual did not accumulate u", wcomm)
        u.masked_fill_(torch.from_numpy(out != 0), 0.0)   # momentum-factor masking
        masked_some |= bool((out != 0).any())
        v = opt._exdyna_options.velocity
        mpi_assert(torch.equal(v, u), f"step {s}: velocity differs from the reference "
                   f"(max {(v - u).abs().max().item():.3g})", wcomm)
        mpi_assert(np.allclose(_flat(model.parameters()), before - np.float32(lr) * out, rtol=0, atol=1e-6),
                   f"step {s}: SGD did not apply the exchanged gradient", wcomm)
    mpi_assert(masked_some, "nothing was selected, masking untested", wcomm)


def test_momentum_correction_refuses_an_optimizer_with_momentum(wcomm):
    model = _model()
    with pytest.raises(ValueError, match="momentum=0"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                             sparsifier="exdyna", density=0.05, comm=wcomm, momentum_correction=0.9)


def _resume_matches_straight(opts, save_at, path, wcomm, on_save=None):
    """Eight steps straight, saving after step ``save_at``; a fresh model and optimizer resumed from
    that file and run to the end must hold the same parameter bits. Returns the resumed optimizer."""
    rank = wcomm.Get_rank()

    def fresh():
        model = _model(seed=7)
        return model, DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, weight_decay=1e-4),
                                           model, **opts)

    model, opt = fresh()
    for s in range(8):
        _step(model, opt, *_batch(rank, s))
        if s == save_at:
            state = opt.state_dict()
            if on_save is not None:
                on_save(s, state)
            torch.save({"model": model.state_dict(), "opt": state}, path)
    straight = _flat(model.parameters())

    model2, opt2 = fresh()
    ck = torch.load(path)   # weights_only=True: plain tensors and values only
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    for s in range(save_at + 1, 8):
        _step(model2, opt2, *_batch(rank, s))
    resumed = _flat(model2.parameters())
    mpi_assert(resumed.tobytes() == straight.tobytes(),
               f"resumed parameters differ (max {np.abs(resumed - straight).max():.3g})", wcomm)
    return opt2


@pytest.mark.parametrize("save_at", [1, 4])   # inside the dense warm-up, and in the sparse phase
def test_options_state_round_trip_resumes_bit_exactly(save_at, wcomm, tmp_path_factory):
    rank = wcomm.Get_rank()
    path = os.path.join(str(tmp_path_factory.mktemp("ckpt")), f"ckpt.{rank}")
    opts = dict(sparsifier="exdyna", density=0.05, comm=wcomm, clip_norm=0.5, warmup_steps=3,
                momentum_correction=0.9)

    def on_save(s, state):
        mpi_assert("exdyna_options" in state and state["exdyna_options"]["step"] == s + 1,
                   "the options' state is not in the state dict", wcomm)

    opt2 = _resume_matches_straight(opts, save_at, path, wcomm, on_save)
    # options off: the state dict has no options entry (checkpoints of plain runs are unchanged)
    plain = DistributedOptimizer(torch.optim.SGD(_model().parameters(), lr=0.05), None, sparsifier="exdyna",
                                 density=0.05, comm=wcomm)
    mpi_assert("exdyna_options" not in plain.state_dict(), "plain optimizer grew an options entry", wcomm)
    with pytest.raises(ValueError, match="exdyna_options"):
        opt2.load_state_dict(plain.state_dict())


# ------------------------------------------------------------------ density warm-up (DGC)


def test_density_warmup_equals_hand_built_stages_with_the_residual_carried(wcomm):
    """Dense step, two sparse stages, then the configured sparsifier, against the same steps done
    here with explicitly made sparsifiers: each stage's residual is loaded into the next one's memory
    before its first step (the carry done by hand), SGD applied by a separate optimizer."""
    rank = wcomm.Get_rank()
    warm, stages, n, target, lr = 1, (0.3, 0.1), 2, 0.02, 0.1
    model, ref_model = _model(), _model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), model, sparsifier="exdyna",
                               density=target, comm=wcomm, warmup_steps=warm, density_warmup=stages,
                               density_warmup_steps=n)
    numel = opt.flat_grad.numel()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=lr)
    schedule = ([exdyna_mpi.make("dense", numel, 1.0, wcomm)] * warm
                + [d for d in stages for _ in range(n)] + [target] * 3)
    sp = None
    for s, what in enumerate(schedule):
        if not isinstance(what, float):
            sp = what
        elif sp is None or sp.density != what:
            new = exdyna_mpi.make("exdyna", numel, what, wcomm, device="cpu")
            if sp is not None and sp.name != "dense":
                new.memory.load(new.ops, np.float32, sp.residual)   # the carry, by hand
            sp = new
        x, y = _batch(rank, s)
        out = torch.from_numpy(sp.step(_raw_grad(ref_model, x, y)))
        for p, g in zip(ref_model.parameters(), out.split([p.numel() for p in ref_model.parameters()])):
            p.grad = g.view_as(p).clone()
        ref_opt.step()
        _step(model, opt, x, y)
        got, ref = _flat(model.parameters()), _flat(ref_model.parameters())
        mpi_assert(got.tobytes() == ref.tobytes(), f"step {s} (density {sp.density}): parameters differ from the "
                   f"hand-built stages (max {np.abs(got - ref).max():.3g})", wcomm)
        mpi_assert(np.array_equal(opt._exdyna_last.residual, sp.residual), f"step {s}: residuals differ", wcomm)
    mpi_assert(opt.sparsifier.iteration == 3, f"main iteration {opt.sparsifier.iteration}", wcomm)


def test_density_warmup_stages_stats_and_the_carry(wcomm):
    """Step counts per stage, the stage's stats, the previous stage dropped, and the residual handed
    on at each boundary: the new sparsifier's residual off the selection is old residual + gradient
    (a dropped carry leaves the gradient alone there)."""
    rank, P = wcomm.Get_rank(), wcomm.Get_size()
    stages, n, target = (0.2, 0.05), 3, 0.01
    model = _model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, sparsifier="topk",
                               density=target, comm=wcomm, density_warmup=stages, density_warmup_steps=n)
    numel = opt.flat_grad.numel()
    prev_ref = prev_res = None
    for s in range(len(stages) * n + 2):
        i = s // n
        d = stages[i] if i < len(stages) else target
        x, y = _batch(rank, s)
        g = _raw_grad(model, x, y)
        _step(model, opt, x, y)
        sp = opt._exdyna_last
        out = opt.flat_grad.numpy().copy()
        mpi_assert((sp is opt.sparsifier) == (i == len(stages)) and sp.density == d,
                   f"step {s}: sparsifier of density {sp.density}, expected {d}", wcomm)
        mpi_assert(sp.iteration == s - i * n + 1, f"step {s}: stage iteration {sp.iteration}", wcomm)
        # top-k never selects zeros, so a rank with fewer nonzeros than k (one rank: the first step)
        # falls short of d; the stages are 4-5x apart, so half of d still tells them apart
        mpi_assert(opt.stats is sp.stats and d / 2 <= opt.stats.density <= P * d + P / numel,
                   f"step {s}: stats density {opt.stats.density}, stage density {d}", wcomm)
        if prev_ref is not None and prev_ref() is not sp:   # a boundary: the carry
            sel = out != 0
            mpi_assert(np.any(prev_res[~sel] != 0), "test premise: nothing to carry", wcomm)
            mpi_assert(np.array_equal(sp.residual[~sel], (prev_res + g)[~sel]),
                       f"step {s}: the residual did not carry", wcomm)
            mpi_assert(opt._exdyna_options.carry is None, f"step {s}: the carry was not released", wcomm)
            gc.collect()
            mpi_assert(prev_ref() is None, f"step {s}: the previous stage's sparsifier is still alive", wcomm)
        prev_ref, prev_res = weakref.ref(sp), sp.residual
    mpi_assert(opt.sparsifier.iteration == 2, f"main iteration {opt.sparsifier.iteration}", wcomm)


def test_density_warmup_carry_survives_a_skipped_step(wcomm):
    """nonfinite="skip": the first step of the next sparsifier is skipped everywhere; the carry is
    kept (in the checkpoint too) and handed over on the next good step, nothing lost."""
    rank = wcomm.Get_rank()

    def fresh():
        model = _model()
        return model, DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, sparsifier="topk",
                                           density=0.01, comm=wcomm, density_warmup=(0.1,), density_warmup_steps=1,
                                           nonfinite="skip")

    def step(model, opt, s):
        x, y = _batch(rank, s)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if s == 1 and rank == 0:
            opt.flat_grad[3] = float("nan")
        opt.step()

    model, opt = fresh()
    step(model, opt, 0)
    stage_res = opt._exdyna_last.residual
    step(model, opt, 1)
    mpi_assert(opt.stats.skipped and opt._exdyna_options.carry is not None, "skipped step lost the carry", wcomm)
    ckpt = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, ckpt)
    g = _raw_grad(model, *_batch(rank, 2))
    step(model, opt, 2)
    sel = opt.flat_grad.numpy() != 0
    res = opt.sparsifier.residual
    mpi_assert(opt.sparsifier.iteration == 1 and np.array_equal(res[~sel], (stage_res + g)[~sel]),
               "the carry did not reach the configured sparsifier after the skipped step", wcomm)
    step(model, opt, 3)

    model2, opt2 = fresh()   # resumed from the checkpoint with the carry pending
    ckpt.seek(0)
    ck = torch.load(ckpt)
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    step(model2, opt2, 2)
    step(model2, opt2, 3)
    mpi_assert(_flat(model2.parameters()).tobytes() == _flat(model.parameters()).tobytes(),
               "resumed with a pending carry: parameters differ", wcomm)


@pytest.mark.parametrize("save_at", [1, 2, 4, 5])   # mid stage 0, end of stage 0, end of the warm-up, after
def test_density_warmup_resumes_bit_exactly(save_at, wcomm, tmp_path_factory):
    rank = wcomm.Get_rank()
    path = os.path.join(str(tmp_path_factory.mktemp("ckpt")), f"ckpt.{rank}")
    opts = dict(sparsifier="exdyna", density=0.05, comm=wcomm, clip_norm=0.5, warmup_steps=1,
                momentum_correction=0.9, density_warmup=[0.3, 0.1], density_warmup_steps=2)

    _resume_matches_straight(opts, save_at, path, wcomm)


@pytest.mark.parametrize("bad", [
    dict(density_warmup=(0.3, 0.1)),                                 # no steps
    dict(density_warmup_steps=3),                                    # steps without stages
    dict(density_warmup=(0.3, 0.05), density_warmup_steps=2),       # = the main density
    dict(density_warmup=(0.3, 0.01), density_warmup_steps=2),       # below it
    dict(density_warmup=(1.5,), density_warmup_steps=2),             # > 1
    dict(density_warmup=(float("nan"),), density_warmup_steps=2),
    dict(density_warmup=("0.3",), density_warmup_steps=2),           # not a number
    dict(density_warmup=0.3, density_warmup_steps=2),                # not a tuple
    dict(density_warmup=(), density_warmup_steps=2),
    dict(density_warmup=(0.3,), density_warmup_steps=0),
    dict(density_warmup=(0.3,), density_warmup_steps=1.5),
    dict(density_warmup=(0.3,), density_warmup_steps="2"),
])
def test_density_warmup_bad_values_raise_on_every_rank(bad, wcomm):
    model = _model()
    with pytest.raises(ValueError, match="density_warmup"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, sparsifier="exdyna",
                             density=0.05, comm=wcomm, **bad)
    wcomm.Barrier()   # every rank got here: nobody was left in a collective


@pytest.mark.parametrize("density, moved", [(0.015, 0.9), (0.01, 0.9), (0.005, 0.8)])
def test_auto_momentum_correction_moves_the_sgd_momentum_by_the_density_rule(density, moved, wcomm):
    """``"auto"`` (the default) on SGD(momentum=0.9) steps bit-identically to ``momentum_correction=
    moved, max_imbalance=0.2`` on SGD(momentum=0): 0.9 for 0.01 <= d < 0.02, min(0.9, 0.8) below,
    with ExDyna's quotas; the optimizer's param groups keep their own momentum (the step runs without it)."""
    rank = wcomm.Get_rank()
    runs = []
    for kw, sgd_m in (({}, 0.9), ({"momentum_correction": moved, "max_imbalance": 0.2}, 0.0)):
        model = _model()
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=sgd_m)
        opt = DistributedOptimizer(base, model, sparsifier="exdyna", density=density, comm=wcomm, **kw)
        mpi_assert(opt._exdyna_options.momentum == moved and all(g["momentum"] == sgd_m for g in base.param_groups)
                   and opt.sparsifier.options["max_imbalance"] == 0.2,
                   f"{kw}: momentum {opt._exdyna_options.momentum}, groups {base.param_groups[0]['momentum']}, "
                   f"max_imbalance {opt.sparsifier.options['max_imbalance']}", wcomm)
        for s in range(4):
            _step(model, opt, *_batch(rank, s))
        runs.append(_flat(model.parameters()))
    mpi_assert(runs[0].tobytes() == runs[1].tobytes(), "'auto' differs from the explicit rule", wcomm)


@pytest.mark.parametrize("kw, quota", [({}, 0.2), ({"max_imbalance": None}, None), ({"max_imbalance": 0.05}, 0.05),
                                       ({"controller": "faithful"}, None), ({"momentum_correction": 0.9}, None),
                                       ({"momentum_correction": 0}, None)])
def test_auto_quotas_come_only_with_auto_momentum_and_yield_to_given_options(kw, quota, wcomm):
    model = _model()
    sgd_m = 0.0 if kw.get("momentum_correction") else 0.9
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=sgd_m), model,
                               sparsifier="exdyna", density=0.01, comm=wcomm, **kw)
    got = opt.sparsifier.options.get("max_imbalance")
    mpi_assert(got == quota, f"{kw}: max_imbalance {got}, expected {quota}", wcomm)


@pytest.mark.parametrize("case", ["dense", "topk", "adam", "no-momentum", "nesterov", "two-momenta", "d=0.02",
                                  "d=0.05"])
def test_auto_momentum_correction_is_off_where_nothing_moves(case, wcomm):
    model = _model()
    params = list(model.parameters())
    if case == "adam":
        base = torch.optim.Adam(params, lr=1e-3)
    elif case == "two-momenta":
        base = torch.optim.SGD([{"params": params[:2], "momentum": 0.9}, {"params": params[2:], "momentum": 0.5}],
                               lr=0.1)
    else:
        base = torch.optim.SGD(params, lr=0.1, momentum={"no-momentum": 0.0}.get(case, 0.9),
                               nesterov=case == "nesterov")
    before = [dict((k, v) for k, v in g.items() if k != "params") for g in base.param_groups]
    density = float(case[2:]) if case.startswith("d=") else 0.01   # from d = 0.02 the SGD keeps its momentum
    opt = DistributedOptimizer(base, model, sparsifier=case if case in ("dense", "topk") else "exdyna",
                               density=density, comm=wcomm)   # "auto" is the default
    after = [dict((k, v) for k, v in g.items() if k != "params") for g in base.param_groups]
    quota = opt.sparsifier.options.get("max_imbalance")
    mpi_assert(opt._exdyna_options.momentum == 0.0 and not opt._exdyna_options.active and before == after
               and quota is None, f"{case}: momentum {opt._exdyna_options.momentum}, groups changed "
               f"{before != after}, max_imbalance {quota}", wcomm)


def test_momentum_correction_refuses_a_bad_string_on_every_rank(wcomm):
    model = _model()
    with pytest.raises(ValueError, match="'auto'"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, sparsifier="exdyna",
                             density=0.05, comm=wcomm, momentum_correction="on")


def test_auto_momentum_never_counts_twice_after_loading_a_dict_with_momentum(wcomm):
    """The param groups keep the SGD's own momentum (the user's state, in every checkpoint), and a
    loaded dict that carries it does not make it count twice: the run goes on bit for bit as one
    that never reloaded, with the user's momentum still in the groups."""
    rank = wcomm.Get_rank()
    runs = []
    for reload in (False, True):
        model = _model()
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                                   sparsifier="exdyna", density=0.01, comm=wcomm)
        for s in range(3):
            _step(model, opt, *_batch(rank, s))
            if reload and s == 1:
                sd = opt.state_dict()
                mpi_assert(sd["param_groups"][0]["momentum"] == 0.9, "the saved groups lost the momentum", wcomm)
                opt.load_state_dict(sd)
        mpi_assert(opt.param_groups[0]["momentum"] == 0.9 and opt._exdyna_options.momentum == 0.9,
                   f"momentum {opt.param_groups[0]['momentum']} after loading", wcomm)
        runs.append(_flat(model.parameters()))
    mpi_assert(runs[0].tobytes() == runs[1].tobytes(), "the reloaded run differs from the straight one", wcomm)


@pytest.mark.parametrize("kind", ["velocity", "step"])
def test_corrupt_options_state_on_one_rank_changes_nothing(kind, wcomm):
    """The last rank's recipe state is cut short (a local problem) or from another step (found only
    by the agreement, after the sparsifier has loaded): every rank raises the same error naming the
    cause, and the optimizer, the sparsifier and the recipe state are as before on every rank."""
    P, rank = wcomm.Get_size(), wcomm.Get_rank()
    if kind == "step" and P == 1:
        pytest.skip("needs two ranks to disagree")
    model = _model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model, sparsifier="exdyna",
                               density=0.05, comm=wcomm, warmup_steps=2, momentum_correction=0.9)
    for s in range(4):
        _step(model, opt, *_batch(rank, s))
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    _step(model, opt, *_batch(rank, 4))

    def snapshot():
        o = opt._exdyna_options
        return (opt.sparsifier.residual.tobytes(), opt.sparsifier.iteration, o.step,
                o.velocity.numpy().tobytes(), repr(opt.state_dict()["state"]))

    before = snapshot()
    buf.seek(0)
    d = torch.load(buf, weights_only=True)
    if rank == P - 1:
        if kind == "velocity":
            d["exdyna_options"]["velocity"] = d["exdyna_options"]["velocity"][:10]
        else:
            d["exdyna_options"]["step"] += 1
    msg = same_error_everywhere(lambda: opt.load_state_dict(d), wcomm)
    want = f"rank {P - 1}: exdyna_options is malformed" if kind == "velocity" else "different recipe steps"
    mpi_assert(want in msg, msg, wcomm)
    mpi_assert(snapshot() == before, "a refused load changed the state", wcomm)
