"""The DDP hook with ``optimizer=``: the same training recipe as ``DistributedOptimizer``, bit for bit.

- SGD with momentum (``momentum_correction="auto"`` moves the momentum before the exchange and adds
  ExDyna's quotas), the same with clipping, a dense warm-up and a density warm-up, a bfloat16 model,
  AdamW (no recipe runs; also with bfloat16 values on the wire) and the Adam paths that own the
  step (``adam="update"`` with clipping and on bfloat16, ``"demo"``, also with bfloat16 wire values,
  ``"demo-age"``, also on bfloat16, ``"frozen"`` after a dense warm-up): after every step, the DDP
  model's parameters equal those of the same model trained by ``DistributedOptimizer`` with the same
  options, on every rank, with several DDP buckets and DDP's rebuild after the first iteration;
- resume through the hook in the middle of the warm-ups: the same bits as the straight run (the
  Adam paths' state included);
- the Adam paths give ``.grad`` back after ``step()`` and refuse a step without an exchange, an
  exchange before the last update was applied, and a ``.grad`` edited after ``backward()`` (a user's
  clip: on every rank, nothing applied); ``adam="auto"``, both entry points' default, runs ``"demo-age"``
  for AdamW through both;
- refusals: recipe options without ``optimizer=``, ``scope="bucket"`` with it, a dict without the
  recipe's state (or with it, into a state without a recipe), a corrupt velocity on one rank (the
  same error on every rank, state unchanged), pickling, and an optimizer that does not hold DDP's
  parameters (``backward()`` raises on every rank).
"""
import pickle

import numpy as np
import pytest
from mpi4py import MPI

from tests.conftest import backward_error, mpi_assert, require, same_error_everywhere, state_content

torch = require("torch")

import exdyna_mpi  # noqa: E402
from exdyna_mpi.adapters.torch import DistributedOptimizer, ExDynaHookState, exdyna_hook  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("gloo")]

BUCKET_MB = 0.001   # ~1 KB buckets: several per iteration, and DDP rebuilds them after the first


def _model(seed=0, width=24):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                               torch.nn.Tanh(), torch.nn.Linear(width, 4))


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=g) * (1 + step % 3), torch.randint(0, 4, (16,), generator=g)


def _params(model):
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).numpy().copy()


def _bits(model):
    """The parameters' own bits (bfloat16 included, which NumPy has no dtype for)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat.view(torch.int16 if flat.element_size() == 2 else torch.int32).numpy().copy()


_content = state_content


#: name -> (optimizer factory, density, recipe options[, parameter dtype, sparsifier options])
CASES = {
    "sgd-momentum-auto": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 0.01, {}),
    "sgd-bf16": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 0.01, dict(clip_norm=0.5), torch.bfloat16),
    "adamw-wire16": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1), 0.02,
                     dict(adam="live"), torch.float32, dict(wire_dtype="bfloat16")),
    "sgd-clip-warmups": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4), 0.01,
                         dict(clip_norm=0.5, warmup_steps=2, density_warmup=(0.25, 0.05), density_warmup_steps=2)),
    "sgd-own-momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 0.01, dict(momentum_correction=0)),
    "adamw-clip": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1), 0.02,
                   dict(clip_norm=1.0, adam="live")),
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1), 0.02,
              dict(adam="live")),
    # the Adam paths that apply their own update (through the optimizer's step hooks)
    "adamw-update-clip": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1), 0.02,
                          dict(adam="update", clip_norm=1.0)),
    "adamw-update-bf16": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1), 0.02,
                          dict(adam="update"), torch.bfloat16),
    "adamw-demo": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.99, 0.95), weight_decay=0.1), 0.02,
                   dict(adam="demo")),
    "adamw-demo-wire16": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1), 0.02,
                          dict(adam="demo"), torch.float32, dict(wire_dtype="bfloat16")),
    "adamw-demo-age": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.99, 0.95), weight_decay=0.1), 0.02,
                       dict(adam="demo-age")),
    "adamw-demo-age-bf16": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.99, 0.95), weight_decay=0.1), 0.02,
                            dict(adam="demo-age"), torch.bfloat16),
    "adam-frozen": (lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3), 0.02,
                    dict(adam="frozen", warmup_steps=2)),
    # both entry points' default, adam="auto": "demo-age" for AdamW with ExDyna
    "adamw-auto-clip": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.99, 0.95), weight_decay=0.1), 0.02,
                        dict(clip_norm=1.0)),
}


def _case(case):
    """(optimizer factory, density, recipe options, dtype, sparsifier options) of ``case``."""
    make_opt, density, recipe, *rest = CASES[case]
    dtype, options = (rest + [torch.float32, {}][len(rest):])[:2]
    return make_opt, density, recipe, dtype, options


def _typed_model(case, seed):
    return _model(seed=seed).to(_case(case)[3])


def _hook_run(case, model):
    make_opt, density, recipe, _, options = _case(case)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
    opt = make_opt(model.parameters())
    state = ExDynaHookState("exdyna", density, optimizer=opt, **recipe, **options)
    ddp.register_comm_hook(state, exdyna_hook)
    return ddp, opt, state


def _backward(net, opt, step):
    x, y = _batch(step, MPI.COMM_WORLD.Get_rank())
    x = x.to(next(net.parameters()).dtype)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(net(x), y).backward()


def _step(net, opt, step):
    _backward(net, opt, step)
    opt.step()


@pytest.mark.parametrize("case", sorted(CASES))
def test_hook_with_optimizer_equals_distributed_optimizer(case):
    comm = MPI.COMM_WORLD
    make_opt, density, recipe, _, options = _case(case)
    plain = _typed_model(case, comm.Get_rank())   # both entry points start from rank 0's parameters
    wrapped = DistributedOptimizer(make_opt(plain.parameters()), plain, sparsifier="exdyna", density=density,
                                   **recipe, **options)
    hooked = _typed_model(case, comm.Get_rank())
    torch.nn.parallel.DistributedDataParallel(hooked)   # broadcast rank 0's parameters, as the wrapper did
    ddp, opt, state = _hook_run(case, hooked)
    start = _params(hooked)
    try:
        for s in range(8):
            _step(plain, wrapped, s)
            _step(ddp, opt, s)
            same = np.array_equal(_bits(plain), _bits(hooked))
            mpi_assert(same, f"{case} step {s}: the hook's parameters differ from DistributedOptimizer's "
                             f"(max diff {np.abs(_params(plain) - _params(hooked)).max():.3g})")
    finally:
        state.close()
    mpi_assert(not np.array_equal(start, _params(hooked)), f"{case}: training changed nothing")
    digests = comm.allgather(_params(hooked).tobytes())
    mpi_assert(len(set(digests)) == 1, f"{case}: parameters differ between ranks")
    mpi_assert(state.step == 8 and isinstance(state.stats, exdyna_mpi.Stats), f"step {state.step}")
    # the recipe moves the momentum before the exchange, but the user's optimizer keeps its own setting
    mpi_assert(all(g["momentum"] == 0.9 for g in opt.param_groups if "momentum" in g),
               f"{case}: the optimizer's momentum {[g.get('momentum') for g in opt.param_groups]}")
    if case == "sgd-momentum-auto":
        mpi_assert(state.options.get("max_imbalance") == 0.2, f"auto quotas missing: {state.options}")
    if case == "adamw-auto-clip":
        mpi_assert(state._adam is not None and state._adam.mode == "demo-age"
                   and wrapped._exdyna_adam.mode == "demo-age",
                   "adam='auto' did not run 'demo-age' through both entry points")


def _edit_refused(ddp, opt, state, step, edit, who):
    """Backward, ``edit(model)`` on the ranks ``who`` holds, then ``step()``: the refusal every rank
    raises (asserted the same everywhere), after checking that nothing moved."""
    comm = MPI.COMM_WORLD
    model = ddp.module
    _backward(ddp, opt, step)
    grads = [p.grad.clone() for p in model.parameters()]
    before, adam_step = _bits(model), state._adam.step
    if comm.Get_rank() in who:
        edit(model)
    msg = same_error_everywhere(opt.step)
    mpi_assert(np.array_equal(before, _bits(model)) and state._adam.step == adam_step,
               "a refused step changed the parameters or the Adam path's state")
    for p, g in zip(model.parameters(), grads):
        p.grad.copy_(g)
    return msg


def test_a_grad_edit_that_changes_the_update_is_refused_everywhere():
    """The default path for AdamW (``"demo-age"``) computes its update from the signs of the
    exchanged vector. The standard loop's ``clip_grad_norm_`` between ``backward()`` and ``step()``
    (a positive rescale, binding or not: every sign kept) changes no bit and passes, on every rank
    or on one. An edit that flips a sign would be lost, so ``step()`` refuses it on every rank,
    nothing applied, naming the ranks that edited; with ``.grad`` put back the same ``step()`` goes
    on. A path that reads the values (``adam="update"``) refuses even a clip. The run equals one
    that never saw the edits."""
    comm = MPI.COMM_WORLD
    last = comm.Get_size() - 1
    case = "adamw-auto-clip"
    model, ref = _typed_model(case, 6), _typed_model(case, 6)
    (ddp, opt, state), (ref_ddp, ref_opt, ref_state) = _hook_run(case, model), _hook_run(case, ref)

    def clip(m):
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)

    def flip(m):   # the exchanged vector is mostly zeros: negate every parameter's
        for p in m.parameters():
            p.grad.neg_()

    try:
        for s in range(5):
            if s == 1:   # a binding clip on every rank, then one on the last rank only
                _backward(ddp, opt, s)
                clip(model)
                opt.step()
            elif s == 2 and last > 0:
                _backward(ddp, opt, s)
                if comm.Get_rank() == last:
                    clip(model)
                opt.step()
            elif s == 3:
                msg = _edit_refused(ddp, opt, state, s, flip, (last,))
                mpi_assert(f"rank {last}: .grad of" in msg and "clip_norm=" in msg and "adam='demo-age'" in msg
                           and (last == 0 or "rank 0" not in msg), msg)
                opt.step()
            else:
                _backward(ddp, opt, s)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)   # does not bind: no bit changes
                opt.step()
            _step(ref_ddp, ref_opt, s)
            mpi_assert(np.array_equal(_bits(model), _bits(ref)), f"step {s}: differs from the run without edits")
    finally:
        state.close()
        ref_state.close()
    model = _typed_model("adamw-update-clip", 6)
    ddp, opt, state = _hook_run("adamw-update-clip", model)
    try:
        _step(ddp, opt, 0)
        msg = _edit_refused(ddp, opt, state, 1, clip, range(comm.Get_size()))
        mpi_assert("clip_norm=" in msg and "adam='update'" in msg and f"rank {last}" in msg, msg)
        opt.step()
    finally:
        state.close()


@pytest.mark.parametrize("case", ["sgd-clip-warmups", "sgd-bf16", "adamw-wire16", "adamw-update-bf16", "adamw-demo",
                                  "adamw-demo-age-bf16", "adam-frozen"])
@pytest.mark.parametrize("at", [1, 3, 5])
def test_resume_through_the_hook_is_bit_exact(case, at):
    """``at`` falls in the dense warm-up (1), the density warm-up (3) and after it (5)."""
    steps = 8
    model = _typed_model(case, 7)
    ddp, opt, state = _hook_run(case, model)
    try:
        for s in range(steps):
            _step(ddp, opt, s)
    finally:
        state.close()
    straight = _bits(model)

    model = _typed_model(case, 7)
    ddp, opt, state = _hook_run(case, model)
    try:
        for s in range(at):
            _step(ddp, opt, s)
        ckpt = pickle.dumps({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()})
    finally:
        state.close()
    del model, ddp, opt, state

    ckpt = pickle.loads(ckpt)
    model = _typed_model(case, 99)
    model.load_state_dict(ckpt["model"])
    ddp, opt, state = _hook_run(case, model)
    opt.load_state_dict(ckpt["opt"])
    state.load_state_dict(ckpt["hook"])
    try:
        for s in range(at, steps):
            _step(ddp, opt, s)
    finally:
        state.close()
    mpi_assert(np.array_equal(straight, _bits(model)), f"{case} resumed at {at}: parameters differ from the "
                                                       "straight run")
    mpi_assert(state.step == steps, f"step {state.step}")


def test_the_hooks_adam_path_owns_the_step_and_gives_the_gradients_back():
    """After ``step()`` every parameter has its ``.grad`` (the exchanged average) again, the wrapped
    AdamW holds no state of its own (its step saw no gradient), and ranks agree."""
    comm = MPI.COMM_WORLD
    for case in ("adamw-update-clip", "adamw-demo", "adamw-demo-age"):
        model = _typed_model(case, 5)
        ddp, opt, state = _hook_run(case, model)
        try:
            for s in range(3):
                _step(ddp, opt, s)
                mpi_assert(all(p.grad is not None for p in model.parameters()), f"{case}: .grad not given back")
        finally:
            state.close()
        mpi_assert(len(opt.state) == 0, f"{case}: the optimizer's own step ran ({len(opt.state)} states)")
        saved = state.state_dict()
        mpi_assert(saved["adam"]["mode"] == CASES[case][2]["adam"] and saved["adam"]["step"] == 3,
                   f"{case}: adam state {saved['adam']}")
        digests = comm.allgather(_params(model).tobytes())
        mpi_assert(len(set(digests)) == 1, f"{case}: parameters differ between ranks")


def test_a_later_state_takes_the_optimizers_step_over():
    """Two states made with one optimizer: only the newest applies its update at ``step()`` (the first
    one's hooks would otherwise apply a second update, or raise for want of an exchange)."""
    case = "adamw-demo"
    make_opt, density, recipe, _, options = _case(case)
    model = _typed_model(case, 4)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
    opt = make_opt(model.parameters())
    first = ExDynaHookState("exdyna", density, optimizer=opt, **recipe, **options)
    second = ExDynaHookState("exdyna", density, optimizer=opt, **recipe, **options)
    ddp.register_comm_hook(second, exdyna_hook)
    ref = _typed_model(case, 4)
    ref_ddp, ref_opt, ref_state = _hook_run(case, ref)
    try:
        for s in range(3):
            _step(ddp, opt, s)
            _step(ref_ddp, ref_opt, s)
        mpi_assert(np.array_equal(_bits(model), _bits(ref)), "the later state's run differs from a single state's")
    finally:
        first.close()
        second.close()
        ref_state.close()


def test_the_hooks_adam_path_refuses_misuse_everywhere():
    """``adam=`` without ``optimizer=`` or with an SGD; ``"frozen"`` without a warm-up; a step with no
    exchange since the last (local, on every rank); an exchange before the last update was applied
    (``backward()`` raises on every rank; a step then applies the pending update and training goes on);
    a dict of another path or without the path's state (the same error on every rank, state unchanged)."""
    comm = MPI.COMM_WORLD
    model = _model()
    with pytest.raises(ValueError, match="optimizer="):
        ExDynaHookState("exdyna", 0.01, adam="update")
    with pytest.raises(ValueError, match="needs torch.optim.Adam"):
        ExDynaHookState("exdyna", 0.01, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), adam="update")
    with pytest.raises(ValueError, match="warmup_steps >= 1"):
        ExDynaHookState("exdyna", 0.01, optimizer=torch.optim.Adam(model.parameters()), adam="frozen")
    with pytest.raises(ValueError, match="adam must be one of"):
        ExDynaHookState("exdyna", 0.01, optimizer=torch.optim.Adam(model.parameters()), adam="lamb")

    model = _typed_model("adamw-demo", 3)
    ddp, opt, state = _hook_run("adamw-demo", model)
    other = _typed_model("adamw-update-clip", 3)
    ddp2, opt2, state2 = _hook_run("adamw-update-clip", other)
    try:
        with pytest.raises(RuntimeError, match="without an exchange"):
            opt.step()
        _step(ddp, opt, 0)
        with pytest.raises(RuntimeError, match="without an exchange"):
            opt.step()
        x, y = _batch(1, comm.Get_rank())
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        raised = backward_error(ddp, x, y)   # the second exchange, before step()
        mpi_assert("before optimizer.step()" in raised, f"backward did not raise on every rank: {raised!r}")
        opt.step()                           # applies the first exchange's update
        _step(ddp, opt, 2)
        mpi_assert(state.step == 3 and state.stats is not None, f"step {state.step}")

        _step(ddp2, opt2, 0)
        saved = state.state_dict()
        before = pickle.dumps(_content(saved))
        msg = same_error_everywhere(lambda: state.load_state_dict({k: v for k, v in saved.items() if k != "adam"}))
        mpi_assert("no Adam-path state" in msg, msg)
        theirs = state2.state_dict()
        mixed = dict(saved, adam=theirs["adam"])
        msg = same_error_everywhere(lambda: state.load_state_dict(mixed))
        mpi_assert("adam='update'" in msg and "state unchanged" in msg, msg)
        bad = comm.Get_size() - 1
        d = pickle.loads(pickle.dumps(saved))
        if comm.Get_rank() == bad:
            d["adam"]["beta1"] = 0.9
        msg = same_error_everywhere(lambda: state.load_state_dict(d))
        mpi_assert(f"rank {bad}" in msg and "beta1" in msg, msg)
        mpi_assert(pickle.dumps(_content(state.state_dict())) == before, "a refused load changed the state")
        _step(ddp, opt, 3)   # nobody waits in a collective
        mpi_assert(state.step == 4, f"step {state.step}")   # state.error keeps the refused iteration's
    finally:
        state.close()
        state2.close()


def test_recipe_options_need_the_optimizer_and_the_model_scope():
    with pytest.raises(ValueError, match="optimizer="):
        ExDynaHookState("exdyna", 0.01, clip_norm=1.0)
    with pytest.raises(ValueError, match="optimizer="):
        ExDynaHookState("exdyna", 0.01, momentum_correction=0.9)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="scope='model'"):
        ExDynaHookState("exdyna", 0.01, scope="bucket", optimizer=opt)
    with pytest.raises(ValueError, match="clip_norm"):
        ExDynaHookState("exdyna", 0.01, optimizer=opt, clip_norm=-1.0)
    with pytest.raises(ValueError, match="momentum counts twice"):
        ExDynaHookState("exdyna", 0.01, optimizer=opt, momentum_correction=0.5)
    mpi_assert(opt.param_groups[0]["momentum"] == 0.9, "a refused state moved the optimizer's momentum")
    state = ExDynaHookState("exdyna", 0.01, optimizer=opt)
    with pytest.raises(TypeError, match="pickled"):
        pickle.dumps(state)


def test_a_dict_without_the_recipe_or_with_a_bad_velocity_is_refused_everywhere():
    comm = MPI.COMM_WORLD
    model = _model(seed=3)
    ddp, opt, state = _hook_run("sgd-momentum-auto", model)
    plain = ExDynaHookState("exdyna", 0.01)
    try:
        for s in range(3):
            _step(ddp, opt, s)
        saved = state.state_dict()
        before = pickle.dumps(_content(saved))
        msg = same_error_everywhere(lambda: state.load_state_dict({k: v for k, v in saved.items() if k != "recipe"}))
        mpi_assert("no training-recipe state" in msg, msg)
        msg = same_error_everywhere(lambda: plain.load_state_dict(saved))
        mpi_assert("runs no recipe" in msg, msg)
        bad = comm.Get_size() - 1
        d = pickle.loads(pickle.dumps(saved))
        if comm.Get_rank() == bad:
            d["recipe"]["velocity"] = d["recipe"]["velocity"][:-1]
        msg = same_error_everywhere(lambda: state.load_state_dict(d))
        mpi_assert(f"rank {bad}" in msg and "velocity" in msg and "state unchanged" in msg, msg)
        mpi_assert(pickle.dumps(_content(state.state_dict())) == before, "a refused load changed the state")
        _step(ddp, opt, 3)   # nobody waits in a collective
        mpi_assert(state.step == 4 and state.error is None, f"step {state.step}, error {state.error!r}")
    finally:
        state.close()
        plain.close()


def test_an_optimizer_without_ddps_parameters_fails_backward_everywhere():
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)   # the first layer only
    state = ExDynaHookState("exdyna", 0.01, optimizer=opt)
    ddp.register_comm_hook(state, exdyna_hook)
    try:
        raised = backward_error(ddp, *_batch(0, MPI.COMM_WORLD.Get_rank()))
    finally:
        state.close()
    mpi_assert("optimizer's parameters" in raised, f"backward did not raise on every rank: {raised!r}")
