"""The collective contract of the torch entry points (``DistributedOptimizer``, the DDP hook with
``optimizer=``, ``DiLoCo``), each against a reference computed here, on real model code: an MLP, a
CNN with BatchNorm, a two-layer GPT-2 from ``transformers`` with tied embeddings.

- one agreed configuration at construction: a rank that differs in any option (the Adam path, an
  optimizer hyperparameter, the recipe, the density, a sparsifier option, the local-step period,
  the outer optimizer, the model itself), or holds a bad one, gives the same ``CollectiveError`` on
  every rank, naming the rank and the option, and nothing changed (no broadcast ran);
- every step a transaction: a NaN in one rank's gradient is refused (``nonfinite="raise"``) or
  skipped (``"skip"``) on every rank with nothing changed, and the run goes on to the bits of a
  straight run that never saw that batch (parameters and state dicts), for momentum SGD with
  weight decay, AdamW on the default Adam path and ``adam="frozen"``;
- every load all or nothing, and a resume in torch's usual order (the optimizer's state loaded
  before the entry point is built) bit-exact; the user's optimizer state keeps its own settings;
  dicts of another recipe, Adam path or period, or missing a part on one rank, are refused on
  every rank with nothing changed;
- both PyTorch entry points treat every parameter torch hands them alike (tied embeddings, a module
  never called, a frozen parameter, two param groups): a parameter without a gradient is neither
  updated nor decayed, and both end with the same bits; BatchNorm buffers follow
  ``broadcast_buffers``;
- transformers' own loop (``clip_grad_norm_`` between ``backward()`` and ``step()``) runs through
  the hook on the default AdamW path and gives the bits of the same loop without the clip;
- the hook's ``state_dict()`` goes through ``torch.save`` / ``torch.load(weights_only=True)`` and
  resumes bit-exactly.

A run that may fail on one rank only gathers every rank's outcome before asserting, so all ranks
fail together.
"""
import copy
import hashlib
import io
import pickle
import re

import pytest
from mpi4py import MPI

from tests.conftest import mpi_assert, require, state_content

torch = require("torch")

import exdyna_mpi  # noqa: E402
from exdyna_mpi.adapters.torch import (DiLoCo, DistributedOptimizer, ExDynaHookState, exdyna_hook,  # noqa: E402
                                       nesterov_sgd, plain_sgd)
from tests import entry_models as em  # noqa: E402

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.usefixtures("gloo")]

WORLD = MPI.COMM_WORLD
BUCKET_MB = 0.001   # ~1 KB buckets: several per iteration, and DDP rebuilds them after the first


# ------------------------------------------------------------------ models, runs and comparisons


def _raw(t):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _bits(tensors):
    """The tensors' own bytes, concatenated (any dtype)."""
    return b"".join(_raw(t) for t in tensors)


_content = state_content


def _digest(obj):
    return hashlib.sha256(pickle.dumps(_content(obj))).hexdigest()


def _same_on_every_rank(data, what):
    digests = WORLD.allgather(hashlib.sha256(data).hexdigest())
    mpi_assert(len(set(digests)) == 1, f"{what} differ between ranks")


def _refused_everywhere(call, cls=exdyna_mpi.CollectiveError, close=None):
    """Run ``call()``, which must raise ``cls`` on every rank with one message; returns the message.

    Whatever happens on each rank (an error of another kind, or none) is gathered first, so every
    rank fails together; what ``call()`` made where it did not raise is given to ``close``."""
    made = err = None
    try:
        made = call()
    except Exception as e:   # every outcome is reported on every rank
        err = e
    if made is not None and close is not None:
        close(made)
    got = WORLD.allgather((None if err is None else type(err).__name__, "" if err is None else str(err),
                           isinstance(err, cls)))
    mpi_assert(all(ok for *_, ok in got), f"expected {cls.__name__} on every rank, got "
                                          f"{[(name, msg[:400]) for name, msg, _ in got]}")
    mpi_assert(all(msg == got[0][1] for _, msg, _ in got), f"the ranks' messages differ: {[m for _, m, _ in got]}")
    return got[0][1]


def _no_errors(err, what):
    """``err`` (an exception or None) is None on every rank."""
    got = WORLD.allgather(None if err is None else f"{type(err).__name__}: {str(err)[:400]}")
    mpi_assert(all(g is None for g in got), f"{what}: {got}")


def _sgd(params, **kw):
    return torch.optim.SGD(params, **{"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4, **kw})


def _adamw(params, **kw):
    return torch.optim.AdamW(params, **{"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1, **kw})


OPTIMIZERS = {"sgd": _sgd, "adamw": _adamw}


def _ce(net, step, rank):
    x, y = em.mlp_batch(step, rank)
    return torch.nn.functional.cross_entropy(net(x), y)


def _hook(model, opt, density=0.01, sparsifier="exdyna", find_unused=False, **kw):
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB,
                                                    find_unused_parameters=find_unused)
    state = ExDynaHookState(sparsifier, density, optimizer=opt, **kw)
    ddp.register_comm_hook(state, exdyna_hook)
    return ddp, state


def _train(net, opt, steps, rank):
    for s in steps:
        opt.zero_grad()
        _ce(net, s, rank).backward()
        opt.step()


# ------------------------------------------------------------------ 1. one agreed configuration

MODEL_WORDS = ("param", "shape", "layout", "numel", "size")

#: name -> (optimizer, the entry point's options on every rank, the odd rank, its change, the word(s)
#: the message holds). The odd rank: "first" (rank 0), "last" (rank P-1) or "rank1" (a bad value
#: there, good ones elsewhere); the change: "opt" the optimizer's hyperparameters, "kw" the entry
#: point's options, "model" the model's (``em.mlp``).
RECIPE_CASES = {
    "adam": ("adamw", {"adam": "demo-age"}, "first", {"kw": {"adam": "demo"}}, "adam"),
    "adam-live": ("adamw", {}, "last", {"kw": {"adam": "live"}}, "adam"),
    "lr": ("sgd", {}, "last", {"opt": {"lr": 0.2}}, "lr"),
    "momentum": ("sgd", {}, "last", {"opt": {"momentum": 0.8}}, "momentum"),
    "weight_decay": ("sgd", {}, "first", {"opt": {"weight_decay": 1e-3}}, "weight_decay"),
    "nesterov": ("sgd", {}, "last", {"opt": {"nesterov": True}}, "nesterov"),
    "betas": ("adamw", {}, "last", {"opt": {"betas": (0.9, 0.99)}}, "betas"),
    "eps": ("adamw", {}, "last", {"opt": {"eps": 1e-6}}, "eps"),
    "adamw-weight_decay": ("adamw", {}, "last", {"opt": {"weight_decay": 0.01}}, "weight_decay"),
    "warmup_steps": ("sgd", {}, "last", {"kw": {"warmup_steps": 2}}, "warmup_steps"),
    "clip_norm": ("sgd", {}, "last", {"kw": {"clip_norm": 1.0}}, "clip_norm"),
    "clip_norm-value": ("sgd", {"clip_norm": 1.0}, "first", {"kw": {"clip_norm": 0.5}}, "clip_norm"),
    "density": ("sgd", {}, "last", {"kw": {"density": 0.02}}, "density"),
    "momentum_correction": ("sgd", {}, "last", {"kw": {"momentum_correction": 0}}, "momentum_correction"),
    "momentum_masking": ("sgd", {}, "last", {"kw": {"momentum_masking": False}}, "momentum_masking"),
    "density_warmup": ("sgd", {}, "last", {"kw": {"density_warmup": (0.1,), "density_warmup_steps": 2}},
                       "density_warmup"),
    "max_imbalance": ("sgd", {}, "last", {"kw": {"max_imbalance": 0.3}}, "max_imbalance"),
    "nonfinite": ("sgd", {}, "last", {"kw": {"nonfinite": "skip"}}, "nonfinite"),
    "wire_dtype": ("adamw", {}, "last", {"kw": {"wire_dtype": "bfloat16"}}, "wire_dtype"),
    "sparsifier": ("sgd", {}, "last", {"kw": {"sparsifier": "topk"}}, "sparsifier"),
    "extra-parameter": ("sgd", {}, "last", {"model": {"extra": True}}, MODEL_WORDS),
    "parameter-shape": ("sgd", {}, "last", {"model": {"width": 25}}, MODEL_WORDS),
    "bad-warmup_steps": ("sgd", {}, "rank1", {"kw": {"warmup_steps": -1}}, "warmup_steps"),
    "bad-clip_norm": ("sgd", {}, "rank1", {"kw": {"clip_norm": -1.0}}, "clip_norm"),
    "bad-density": ("sgd", {}, "rank1", {"kw": {"density": 1.5}}, "density"),
    "bad-adam": ("adamw", {}, "rank1", {"kw": {"adam": "lamb"}}, "adam"),
    "bad-frozen-without-warmup": ("adamw", {}, "rank1", {"kw": {"adam": "frozen"}}, ("frozen", "warmup_steps")),
    "bad-momentum_correction": ("sgd", {}, "rank1", {"kw": {"momentum_correction": "on"}}, "momentum_correction"),
    "bad-sparsifier-option": ("sgd", {}, "rank1", {"kw": {"no_such_option": 1}}, "no_such_option"),
}

DILOCO_CASES = {
    "sync_every": ({}, "last", {"kw": {"sync_every": 2}}, "sync_every"),
    "error_decay": ({}, "first", {"kw": {"error_decay": 0.9}}, "error_decay"),
    "outer-lr": ({}, "last", {"kw": {"outer_optimizer": lambda ps: plain_sgd(ps, lr=0.5)}}, "lr"),
    "outer-nesterov": ({}, "last", {"kw": {"outer_optimizer": nesterov_sgd}}, ("lr", "momentum", "nesterov")),
    "inner-lr": ({}, "last", {"opt": {"lr": 2e-2}}, "lr"),
    "inner-betas": ({}, "first", {"opt": {"betas": (0.8, 0.95)}}, "betas"),
    "density": ({}, "last", {"kw": {"density": 0.05}}, "density"),
    "sparsifier": ({}, "last", {"kw": {"sparsifier": "topk"}}, "sparsifier"),
    "wire_dtype": ({}, "last", {"kw": {"wire_dtype": "bfloat16"}}, "wire_dtype"),
    "extra-parameter": ({}, "last", {"model": {"extra": True}}, MODEL_WORDS),
    "parameter-shape": ({}, "last", {"model": {"width": 25}}, MODEL_WORDS),
    "bad-sync_every": ({}, "rank1", {"kw": {"sync_every": 0}}, "sync_every"),
    "bad-error_decay": ({}, "rank1", {"kw": {"error_decay": 1.5}}, "error_decay"),
    "bad-density": ({}, "rank1", {"kw": {"density": 0.0}}, "density"),
}

DILOCO_BASE = dict(sync_every=4, sparsifier="exdyna", density=0.03)


def _is_odd(odd, rank, size):
    return rank == {"first": 0, "last": size - 1, "rank1": 1}[odd]


def _groups(opt):
    return repr([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])


def _untouched(model, opt):
    """What a refused construction must leave as it was: the model, the optimizer's settings and
    state, and its step hooks."""
    return (_bits(model.parameters()), _bits(model.buffers()), _groups(opt), _digest(opt.state_dict()),
            len(getattr(opt, "_optimizer_step_pre_hooks", {})), len(getattr(opt, "_optimizer_step_post_hooks", {})))


def _check_construction_refused(entry, opt_name, base, odd, change, words, comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = change if _is_odd(odd, rank, size) else {}
    kw = {**base, **mine.get("kw", {})}
    model = em.mlp(seed=100 + rank, **mine.get("model", {}))   # ranks differ: a broadcast would show
    opt = OPTIMIZERS[opt_name](model.parameters(), **mine.get("opt", {}))
    before = _untouched(model, opt)
    if entry == "do":
        kw.setdefault("density", 0.01)
        msg = _refused_everywhere(lambda: DistributedOptimizer(opt, model, comm=comm, **kw))
    elif entry == "hook":
        sparsifier, density = kw.pop("sparsifier", "exdyna"), kw.pop("density", 0.01)
        msg = _refused_everywhere(lambda: ExDynaHookState(sparsifier, density, comm, optimizer=opt, **kw),
                                  close=lambda st: st.close())
    else:
        kw = {**DILOCO_BASE, **kw}
        msg = _refused_everywhere(lambda: DiLoCo(opt, model, comm=comm, **kw), close=lambda d: d.close())
    words = (words,) if isinstance(words, str) else words
    mpi_assert(any(w in msg for w in words), f"the message does not name {' or '.join(words)}: {msg}")
    named = {"first": r"\brank \d", "last": rf"\brank {size - 1}\b", "rank1": r"\brank 1\b"}[odd]
    mpi_assert(re.search(named, msg) is not None, f"the message does not name the rank ({named}): {msg}")
    mpi_assert(_untouched(model, opt) == before, "a refused construction changed the model or the optimizer")


@pytest.mark.parametrize("case", sorted(RECIPE_CASES))
@pytest.mark.parametrize("entry", ["do", "hook"])
def test_a_rank_with_another_configuration_is_refused_at_construction(entry, case, wcomm):
    _check_construction_refused(entry, *RECIPE_CASES[case], wcomm)


@pytest.mark.parametrize("case", sorted(DILOCO_CASES))
def test_a_rank_with_another_diloco_configuration_is_refused_at_construction(case, wcomm):
    _check_construction_refused("diloco", "adamw", *DILOCO_CASES[case], wcomm)


@pytest.mark.parametrize("entry", ["do", "hook", "diloco"])
def test_agreeing_ranks_construct(entry, wcomm):
    """The control: ranks that agree construct, and the entry points that broadcast start every
    rank from rank 0's parameters."""
    rank = wcomm.Get_rank()
    model = em.mlp(seed=100 + rank)
    ref = _bits(em.mlp(seed=100).parameters())   # rank 0's
    opt = _sgd(model.parameters()) if entry != "diloco" else _adamw(model.parameters())
    made = err = None
    try:
        if entry == "do":
            made = DistributedOptimizer(opt, model, density=0.01, comm=wcomm)
        elif entry == "hook":
            made = ExDynaHookState("exdyna", 0.01, wcomm, optimizer=opt)
        else:
            made = DiLoCo(opt, model, comm=wcomm, **DILOCO_BASE)
    except Exception as e:   # every outcome is reported on every rank
        err = e
    finally:
        if made is not None and entry != "do":
            made.close()
    _no_errors(err, f"{entry}: agreeing ranks were refused")
    if entry != "hook":
        mpi_assert(_bits(model.parameters()) == ref, f"{entry}: the ranks do not start from rank 0's parameters")


# ------------------------------------------------------------------ 2. every step a transaction

#: name -> (optimizer, options); the bad step comes after any dense warm-up
STEP_CASES = {
    "sgd": ("sgd", dict(density=0.01)),
    "adamw-auto": ("adamw", dict(density=0.02)),
    "adam-frozen": ("adamw", dict(density=0.02, adam="frozen", warmup_steps=2)),
}
BAD_STEP, STEPS = 3, 6


def _nan_first(g):
    g = g.clone()
    g.view(-1)[0] = float("nan")
    return g


class _Run:
    """One entry point training ``em.mlp`` on ``em.mlp_batch``; ``step(s, poison)`` reports what it
    raised (the phase and the exception) instead of raising."""

    def __init__(self, entry, case, nonfinite, comm):
        opt_name, kw = STEP_CASES[case]
        kw = dict(kw, nonfinite=nonfinite)
        self.model = em.mlp(seed=11)
        self.opt = OPTIMIZERS[opt_name](self.model.parameters())
        self.state = None
        if entry == "do":
            self.opt = DistributedOptimizer(self.opt, self.model, comm=comm, **kw)
            self.net = self.model
        else:
            self.net, self.state = _hook(self.model, self.opt, **kw)

    def step(self, s, poison=False):
        self.opt.zero_grad()
        handle = self.model[0].weight.register_hook(_nan_first) if poison else None
        try:
            _ce(self.net, s, WORLD.Get_rank()).backward()
        except Exception as e:   # the hook's refusal comes out of backward()
            return "backward", e
        finally:
            if handle is not None:
                handle.remove()
        try:
            self.opt.step()
        except Exception as e:
            return "step", e
        return None, None

    def snapshot(self):
        """Digests of the parameters and of each entry of the state dicts (a difference names its entry)."""
        got = {"parameters": hashlib.sha256(_bits(self.model.parameters())).hexdigest()}
        got.update((f"optimizer state[{k!r}]", _digest(v)) for k, v in self.opt.state_dict().items())
        if self.state is not None:
            got.update((f"hook state[{k!r}]", _digest(v)) for k, v in self.state.state_dict().items())
        return got

    def close(self):
        if self.state is not None:
            self.state.close()


def _differs(a, b):
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


@pytest.mark.parametrize("case", sorted(STEP_CASES))
@pytest.mark.parametrize("entry", ["do", "hook"])
@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_a_nan_on_one_rank_changes_nothing_and_the_run_goes_on(nonfinite, entry, case, wcomm):
    """The last rank's gradient holds a NaN at step 3: refused (``StepError`` from ``step()``; from
    ``backward()`` through the hook) or skipped on every rank, nothing changed (parameters, the
    optimizer's state, the recipe's velocity and step, the Adam path's and the sparsifier's state, the
    hook's step count),
    and the run ends with the bits and the state of a straight run of the other batches."""
    last = WORLD.Get_size() - 1
    run, ref = _Run(entry, case, nonfinite, wcomm), _Run(entry, case, nonfinite, wcomm)
    try:
        for s in range(STEPS):
            if s != BAD_STEP:
                for r in (run, ref):
                    phase, err = r.step(s)
                    _no_errors(err, f"step {s}: a good step raised in {phase}")
                continue
            before = run.snapshot()
            phase, err = run.step(s, poison=WORLD.Get_rank() == last)
            if nonfinite == "skip":
                _no_errors(err, f"nonfinite='skip': the bad step raised in {phase}")
                stats = run.opt.stats if run.state is None else run.state.stats
                mpi_assert(stats is not None and stats.skipped, "the bad step was not skipped")
            elif entry == "do":
                ok = phase == "step" and isinstance(err, exdyna_mpi.StepError)
                mpi_assert(ok, f"expected StepError from step(), got {phase}: {err!r}")
                msgs = WORLD.allgather(str(err))
                mpi_assert(len(set(msgs)) == 1 and f"rank {last}" in msgs[0], f"messages {msgs}")
            else:
                refused = run.state.error
                ok = phase == "backward" and isinstance(err, RuntimeError) and isinstance(refused, exdyna_mpi.StepError)
                mpi_assert(ok, f"expected backward() to raise with a StepError behind it, got {phase}: {err!r}, "
                               f"state.error {refused!r}")
                msgs = WORLD.allgather(str(refused))
                mpi_assert(len(set(msgs)) == 1 and f"rank {last}" in msgs[0], f"messages {msgs}")
            after = run.snapshot()
            changed = _differs(before, after)
            mpi_assert(not changed, f"the {'skipped' if nonfinite == 'skip' else 'refused'} step changed {changed}")
        got, want = run.snapshot(), ref.snapshot()
        changed = _differs(got, want)
        mpi_assert(not changed, f"differs from the straight run without the bad batch: {changed}")
        _same_on_every_rank(_bits(run.model.parameters()), "parameters")
    finally:
        run.close()
        ref.close()


# ------------------------------------------------------------------ 3. loads and resumes


def _fresh_sgd(model):
    return _sgd(model.parameters())


def _resumed(ck, make_opt, at, steps, rank, *, opt_first, **hook_kw):
    """A fresh model, optimizer and hook state resumed from ``ck`` (their state dicts) and trained
    from step ``at`` to ``steps``: ``(parameters' bits, optimizer digest, hook digest)``.
    ``opt_first``: the optimizer's state loaded before the hook state is built (torch's usual order)."""
    model = em.mlp(seed=99)
    model.load_state_dict(ck["model"])
    opt = make_opt(model.parameters())
    if opt_first:
        opt.load_state_dict(ck["opt"])
    ddp, state = _hook(model, opt, **hook_kw)
    try:
        if not opt_first:
            opt.load_state_dict(ck["opt"])
        state.load_state_dict(ck["hook"])
        _train(ddp, opt, range(at, steps), rank)
        return _bits(model.parameters()), _digest(opt.state_dict()), _digest(state.state_dict())
    finally:
        state.close()


def _same_as_uninterrupted(got, want):
    mpi_assert(got[0] == want[0], "resumed parameters differ from the uninterrupted run")
    mpi_assert(got[1:] == want[1:], "resumed optimizer or hook state differs from the uninterrupted run")
    _same_on_every_rank(got[0], "parameters")


def test_the_hook_resumes_in_torchs_order_bit_exactly():
    """The optimizer's state loaded first, then the hook's state built with the optimizer, then its
    dict loaded: the same bits as the uninterrupted run (momentum included)."""
    rank, steps, at = WORLD.Get_rank(), 8, 4
    model = em.mlp(seed=7)
    opt = _fresh_sgd(model)
    ddp, state = _hook(model, opt)
    try:
        _train(ddp, opt, range(at), rank)
        ckpt = pickle.dumps({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()})
        _train(ddp, opt, range(at, steps), rank)
        want = (_bits(model.parameters()), _digest(opt.state_dict()), _digest(state.state_dict()))
    finally:
        state.close()

    _same_as_uninterrupted(_resumed(pickle.loads(ckpt), _sgd, at, steps, rank, opt_first=True), want)


@pytest.mark.parametrize("entry", ["do", "hook"])
def test_the_users_optimizer_state_keeps_its_own_settings(entry, wcomm):
    """After steps with the momentum moved into the recipe, ``state_dict()``'s param groups are those
    of the same optimizer never wrapped (momentum 0.9 and all)."""
    model = em.mlp(seed=3)
    opt = _fresh_sgd(model)
    plain = _fresh_sgd(em.mlp(seed=3))
    state = None
    if entry == "do":
        opt, net = DistributedOptimizer(opt, model, density=0.01, comm=wcomm), model
    else:
        net, state = _hook(model, opt)
    try:
        _train(net, opt, range(3), wcomm.Get_rank())
        groups = opt.state_dict()["param_groups"]
    finally:
        if state is not None:
            state.close()
    mpi_assert(groups[0]["momentum"] == 0.9, f"{entry}: momentum {groups[0]['momentum']} in the optimizer's state")
    want = [{k: v for k, v in g.items() if k != "params"} for g in plain.state_dict()["param_groups"]]
    got = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    mpi_assert(got == want, f"{entry}: param groups {got}, the optimizer's own {want}")


@pytest.mark.parametrize("order", ["usual", "optimizer-first"])
def test_distributed_optimizer_resumes_bit_exactly(order, wcomm):
    """``"usual"``: wrap, then load the dict; ``"optimizer-first"``: the base optimizer loads the
    dict first (torch's order), is wrapped, then the wrapper loads it. Through ``torch.save`` and
    ``torch.load(weights_only=True)``."""
    rank, steps, at = wcomm.Get_rank(), 8, 4
    model = em.mlp(seed=7)
    opt = DistributedOptimizer(_fresh_sgd(model), model, density=0.01, comm=wcomm)
    _train(model, opt, range(at), rank)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _train(model, opt, range(at, steps), rank)
    want = (_bits(model.parameters()), _digest(opt.state_dict()))

    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    model = em.mlp(seed=99)
    model.load_state_dict(ck["model"])
    base = _fresh_sgd(model)
    if order == "optimizer-first":
        base.load_state_dict(ck["opt"])
    opt = DistributedOptimizer(base, model, density=0.01, comm=wcomm)
    opt.load_state_dict(ck["opt"])
    _train(model, opt, range(at, steps), rank)
    got = (_bits(model.parameters()), _digest(opt.state_dict()))
    mpi_assert(got[0] == want[0], f"{order}: resumed parameters differ from the uninterrupted run")
    mpi_assert(got[1] == want[1], f"{order}: resumed optimizer state differs from the uninterrupted run")
    _same_on_every_rank(got[0], "parameters")


def _do_untouched(model, opt):
    return _bits(model.parameters()), _digest(opt.state_dict())


def _load_refused(model, opt, d, wcomm):
    """``opt.load_state_dict(d)`` refused on every rank, nothing changed, and the next step runs on
    every rank (nobody was left in a collective). Returns the message."""
    before = _do_untouched(model, opt)
    msg = _refused_everywhere(lambda: opt.load_state_dict(d))
    mpi_assert(_do_untouched(model, opt) == before, "a refused load changed the state")
    err = None
    try:
        _train(model, opt, [20], wcomm.Get_rank())
    except Exception as e:   # every outcome is reported on every rank
        err = e
    _no_errors(err, "the step after a refused load")
    return msg


def test_a_dict_without_the_adam_paths_state_on_one_rank_is_refused_everywhere(wcomm):
    last = wcomm.Get_size() - 1
    model = em.mlp(seed=5)
    opt = DistributedOptimizer(_adamw(model.parameters()), model, density=0.02, comm=wcomm)   # "demo-age"
    _train(model, opt, range(3), wcomm.Get_rank())
    d = copy.deepcopy(opt.state_dict())
    _train(model, opt, [3], wcomm.Get_rank())
    if wcomm.Get_rank() == last:
        del d["exdyna_adam"]
    msg = _load_refused(model, opt, d, wcomm)
    mpi_assert(f"rank {last}" in msg and "exdyna_adam" in msg, msg)


def test_a_dict_of_another_adam_path_is_refused_everywhere(wcomm):
    rank = wcomm.Get_rank()
    model, other = em.mlp(seed=5), em.mlp(seed=5)
    opt = DistributedOptimizer(_adamw(model.parameters()), model, density=0.02, comm=wcomm, adam="demo-age")
    demo = DistributedOptimizer(_adamw(other.parameters()), other, density=0.02, comm=wcomm, adam="demo")
    _train(model, opt, range(3), rank)
    _train(other, demo, range(3), rank)
    msg = _load_refused(model, opt, copy.deepcopy(demo.state_dict()), wcomm)
    mpi_assert("demo" in msg and "adam" in msg, msg)


#: name -> (the recipe the dict was saved with, the recipe that loads it)
OTHER_RECIPES = {
    "clip_norm": (dict(clip_norm=0.5), dict(clip_norm=1.0)),
    "clip_norm-off": (dict(clip_norm=0.5), {}),
    "warmup_steps": (dict(warmup_steps=2), dict(warmup_steps=3)),
    "momentum_masking": (dict(momentum_masking=False), {}),
}


@pytest.mark.parametrize("who", ["all", "one"])
@pytest.mark.parametrize("case", sorted(OTHER_RECIPES))
def test_a_dict_of_another_recipe_is_refused_everywhere(case, who, wcomm):
    """The dict of a run with another recipe, loaded on every rank or on the last one only (the
    others load their own): refused on every rank, nothing changed."""
    rank, last = wcomm.Get_rank(), wcomm.Get_size() - 1
    saved_with, loads_with = OTHER_RECIPES[case]
    model, other = em.mlp(seed=5), em.mlp(seed=5)
    opt = DistributedOptimizer(_fresh_sgd(model), model, density=0.01, comm=wcomm, **loads_with)
    theirs = DistributedOptimizer(_fresh_sgd(other), other, density=0.01, comm=wcomm, **saved_with)
    _train(model, opt, range(4), rank)
    _train(other, theirs, range(4), rank)
    own = copy.deepcopy(opt.state_dict())
    _train(model, opt, [4], rank)
    d = copy.deepcopy(theirs.state_dict()) if who == "all" or rank == last else own
    msg = _load_refused(model, opt, d, wcomm)
    word = case.split("-")[0]
    mpi_assert(word in msg and (who == "all" or f"rank {last}" in msg), msg)


def test_a_diloco_dict_of_another_period_on_one_rank_is_refused_everywhere(wcomm):
    rank, last = wcomm.Get_rank(), wcomm.Get_size() - 1
    model, other = em.mlp(seed=5), em.mlp(seed=5)
    opt = DiLoCo(_adamw(model.parameters()), model, comm=wcomm, **dict(DILOCO_BASE, sync_every=2))
    theirs = DiLoCo(_adamw(other.parameters()), other, comm=wcomm, **dict(DILOCO_BASE, sync_every=3))
    try:
        _train(model, opt, range(3), rank)
        _train(other, theirs, range(3), rank)
        d = copy.deepcopy(theirs.state_dict() if rank == last else opt.state_dict())
        _train(model, opt, [3], rank)
        before = (_bits(model.parameters()), _digest(opt.state_dict()))
        msg = _refused_everywhere(lambda: opt.load_state_dict(d))
        mpi_assert((_bits(model.parameters()), _digest(opt.state_dict())) == before, "a refused load changed the state")
        mpi_assert("sync_every" in msg and f"rank {last}" in msg, msg)
        _train(model, opt, [4, 5], rank)   # an outer step: nobody was left in a collective
        _same_on_every_rank(_bits(model.parameters()), "parameters after the outer step")
    finally:
        opt.close()
        theirs.close()


# ------------------------------------------------------------------ 4. every parameter torch hands them


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_hook_and_optimizer_agree_on_a_gpt_with_unused_and_frozen_parameters(kind, wcomm):
    """Tied embeddings, a module never called, a frozen parameter, two param groups: a parameter
    without a gradient is neither updated nor decayed (as torch's own optimizers leave it), and
    DDP with the hook ends with the bits of ``DistributedOptimizer``."""
    require("transformers")
    rank = wcomm.Get_rank()
    if kind == "sgd":
        density = 0.01

        def make(m):
            return torch.optim.SGD(em.param_groups(m, 5e-4), lr=0.1, momentum=0.9)
    else:
        density = 0.02

        def make(m):
            return torch.optim.AdamW(em.param_groups(m, 0.1), lr=1e-3, betas=(0.9, 0.95))

    m_do, m_hook = em.GPTWithExtras(seed=3), em.GPTWithExtras(seed=3)
    unused0, frozen0 = _bits(m_do.unused.parameters()), _bits([m_do.logit_bias])
    start = _bits(m_do.parameters())
    do = DistributedOptimizer(make(m_do), m_do, density=density, comm=wcomm)
    opt = make(m_hook)
    ddp, state = _hook(m_hook, opt, density=density, find_unused=True)
    try:
        for s in range(5):
            ids = em.token_batch(s, rank)
            do.zero_grad()
            m_do(ids).backward()
            do.step()
            opt.zero_grad()
            ddp(ids).backward()
            opt.step()
            for name, m in (("DistributedOptimizer", m_do), ("the hook", m_hook)):
                mpi_assert(_bits(m.unused.parameters()) == unused0,
                           f"step {s}: {name} changed the parameters that never had a gradient")
                mpi_assert(_bits([m.logit_bias]) == frozen0, f"step {s}: {name} changed the frozen parameter")
            same = _bits(m_do.parameters()) == _bits(m_hook.parameters())
            mpi_assert(same, f"step {s}: the hook's parameters differ from DistributedOptimizer's")
    finally:
        state.close()
    mpi_assert(_bits(m_do.parameters()) != start, "training changed nothing")
    _same_on_every_rank(_bits(m_hook.parameters()), "parameters")


@pytest.mark.parametrize("kw", [{}, {"broadcast_buffers": True}, {"broadcast_buffers": False}],
                         ids=["default", "broadcast", "local"])
def test_batchnorm_buffers_follow_broadcast_buffers(kw, wcomm):
    """After every step the BatchNorm buffers are rank 0's (its own batch's statistics, as a copy of
    the model computes them here) on every rank; with ``broadcast_buffers=False`` each rank keeps
    its own batch's."""
    rank, size = wcomm.Get_rank(), wcomm.Get_size()
    shared = kw.get("broadcast_buffers", True)
    model = em.cnn(seed=2)
    err = None
    try:
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model,
                                   density=0.05, comm=wcomm, **kw)
    except Exception as e:   # every outcome is reported on every rank
        err = e
    _no_errors(err, f"DistributedOptimizer(..., {kw})")
    for s in range(4):
        ref = copy.deepcopy(model)
        with torch.no_grad():
            ref(em.cnn_batch(s, 0 if shared else rank)[0])   # train mode: the running statistics move
        x, y = em.cnn_batch(s, rank)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        mine = _bits(model.buffers())
        whose = "rank 0's" if shared else "this rank's own"
        mpi_assert(mine == _bits(ref.buffers()), f"step {s}: the buffers are not {whose} batch's statistics")
        digests = WORLD.allgather(hashlib.sha256(mine).hexdigest())
        want = 1 if shared else size
        mpi_assert(len(set(digests)) == want, f"step {s}: {len(set(digests))} distinct buffers over {size} ranks")
    _same_on_every_rank(_bits(model.parameters()), "parameters")


# ------------------------------------------------------------------ 5. transformers' loop


def test_transformers_loop_with_clip_grad_norm_runs_through_the_hook():
    """``backward()``, ``clip_grad_norm_(..., 1.0)``, ``step()``, ``zero_grad(set_to_none=True)``
    under the default AdamW path: no error, and the bits of the loop without the clip (a sign
    update does not change under a positive rescale)."""
    require("transformers")
    rank = WORLD.Get_rank()
    runs = []
    for clip in (True, False):
        model = em.gpt2(seed=4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        ddp, state = _hook(model, opt, density=0.02)
        runs.append((clip, model, ddp, opt, state))
    norms = []
    try:
        for s in range(5):
            ids = em.token_batch(s, rank)
            for clip, model, ddp, opt, state in runs:
                err = None
                try:
                    ddp(input_ids=ids, labels=ids).loss.backward()
                    if clip:
                        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                except Exception as e:   # every outcome is reported on every rank
                    err = e
                _no_errors(err, f"step {s} ({'with' if clip else 'without'} the clip)")
            mpi_assert(_bits(runs[0][1].parameters()) == _bits(runs[1][1].parameters()),
                       f"step {s}: the clipped loop's parameters differ from the unclipped one's")
        mpi_assert(max(norms) > 1.0, f"test premise: the clip never binds (norms {norms})")
        mpi_assert(runs[0][4].state_dict()["adam"]["mode"] == "demo-age", "the default path is not 'demo-age'")
    finally:
        for *_, state in runs:
            state.close()
    _same_on_every_rank(_bits(runs[0][1].parameters()), "parameters")


# ------------------------------------------------------------------ 9. torch.load(weights_only=True)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_the_hooks_state_dict_loads_with_weights_only_and_resumes(kind):
    rank, steps, at = WORLD.Get_rank(), 6, 3
    density = 0.01 if kind == "sgd" else 0.02
    model = em.mlp(seed=8)
    opt = OPTIMIZERS[kind](model.parameters())
    ddp, state = _hook(model, opt, density=density)
    buf = io.BytesIO()
    try:
        _train(ddp, opt, range(at), rank)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, buf)
        _train(ddp, opt, range(at, steps), rank)
        want = (_bits(model.parameters()), _digest(opt.state_dict()), _digest(state.state_dict()))
    finally:
        state.close()

    buf.seek(0)
    ck = err = None
    try:
        ck = torch.load(buf, weights_only=True)
    except Exception as e:   # every outcome is reported on every rank
        err = e
    _no_errors(err, "torch.load(weights_only=True) of the hook's state_dict()")
    _same_as_uninterrupted(_resumed(ck, OPTIMIZERS[kind], at, steps, rank, opt_first=False, density=density), want)
