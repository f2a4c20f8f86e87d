"""``torch.compile``d models trained through the three PyTorch entry points (``DistributedOptimizer``,
the DDP hook, ``DiLoCo``) on 1..4 ranks, against the same model trained eagerly in the same test
(same seeds, same batches).

- ``backend="aot_eager"`` (AOTAutograd's forward and backward graphs, run by eager kernels): every
  entry point ends with the eager run's parameters, bit for bit, and every rank holds the same bits:
  ``DistributedOptimizer`` with ExDyna on an MLP and on an MLP with BatchNorm (running statistics
  too), the model as one graph (``fullgraph=True``); the DDP hook (model scope) with the model
  compiled outside DDP and inside it; ``DiLoCo`` with ExDyna's outer exchange, its global model
  evaluated mid-period through the compiled model;
- DDP's own behaviour under compile: DDPOptimizer splits the graph at bucket boundaries (more than
  one graph compiled), and the hook still gets every bucket of every iteration in index order, the
  last one flagged, each parameter exactly once, carrying that parameter's local gradient as eager
  computes it, bit for bit; with ``scope="bucket"`` the state follows the compiled DDP's rebuilt
  buckets (ranks identical); ``no_sync`` accumulates without calling the hook, and the synced
  iterations give eager's bits;
- compiled autograd: through ``DistributedOptimizer`` the backward is compiled, every ``.grad``
  stays a view of the flat buffer and the bits are eager's; through DDP, DDP's C++ reducer refuses
  it (torch's message) on every rank before any bucket reaches the hook, and the hook's state
  trains on afterwards;
- a compiled training step (``zero_grad``, forward, backward and ``step`` in one compiled function):
  the exchange inside ``DistributedOptimizer.step`` and ``DiLoCo.step`` runs eagerly (a graph
  break) and the bits are eager's; the DDP hook called per parameter (DDP's Python reducer) says why
  it cannot work;
- the default backend (inductor, C++ built with the host's compiler): through every entry point,
  ranks end bit-identical and training moved the parameters; inductor's fused kernels round
  differently from eager's, so its parameters are checked close to eager's (``INDUCTOR_ATOL``), not
  equal.
"""
import hashlib

import numpy as np
import pytest
from mpi4py import MPI

from tests.conftest import mpi_assert, require

torch = require("torch")
dist = pytest.importorskip("torch.distributed")
dynamo = pytest.importorskip("torch._dynamo")

import exdyna_mpi  # noqa: E402
from exdyna_mpi.adapters.torch import DiLoCo, DistributedOptimizer, ExDynaHookState, exdyna_hook  # noqa: E402
from tests import entry_models  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("gloo")]

DENSITY = 0.05
STEPS = 4
WIDE = 512        # 1.08 MB of parameters: with 1 MiB buckets, DDP and DDPOptimizer form two
BUCKET_MB = 1     # DDPOptimizer refuses buckets under its 1 MiB first bucket (an AssertionError in torch)
# Inductor vs eager: its fused kernels change the float32 rounding of the local gradients (by about
# 1e-8, a few units in the last place, measured), which the few steps carry into the parameters
# (O(0.1)) only where ExDyna sends: measured up to 3e-8 at P = 1..4, on a handful of coordinates.
# 1e-5 leaves a margin of 300x, while a lost, doubled or misplaced update moves a coordinate by a
# step (the moved coordinates' median move is 4e-3 to 4e-2 here) and fails it. (A gradient within
# rounding of ExDyna's threshold could be sent by one run and not the other, which this would not
# absorb; none was.)
INDUCTOR_ATOL = 1e-5


def _inductor_config():
    """Inductor compiling in the calling process (this changes where it compiles, not what): with a
    pool of compile workers per rank, a cold compile took twice as long at P = 4 on two cores."""
    from torch._inductor import config

    return config.patch(compile_threads=1)


class Counting:
    """A ``torch.compile`` backend that counts the graphs dynamo hands it and compiles each with
    the named backend (``"aot_eager"``, ``"inductor"``): a test can tell that compiling happened."""

    def __init__(self, name):
        from torch._dynamo.backends.registry import lookup_backend

        self.name, self.compile, self.graphs = name, lookup_backend(name), 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.compile(gm, example_inputs)


class Net(torch.nn.Module):
    """``entry_models.mlp`` inside a module defined here: compiling ``DDP(Net())`` reaches this
    ``forward`` (dynamo does not trace torch's own ``Sequential.forward`` as a top-level frame)."""

    def __init__(self, seed=0, width=24):
        super().__init__()
        self.body = entry_models.mlp(seed=seed, width=width)

    def forward(self, x):
        return self.body(x)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles its own models: dynamo's caches (and its recompile limit) start empty."""
    dynamo.reset()
    yield
    dynamo.reset()


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def _buffers(model):
    """The floating-point buffers (BatchNorm's running statistics), flat; empty without any."""
    bufs = [b.detach().reshape(-1) for b in model.buffers() if b.is_floating_point()]
    return torch.cat(bufs).numpy().copy() if bufs else np.zeros(0, np.float32)


def _same_on_every_rank(flat):
    digests = MPI.COMM_WORLD.allgather(hashlib.sha256(flat.tobytes()).hexdigest())
    return len(set(digests)) == 1


def _bit_equal(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _diff(a, b):
    return float(np.abs(a.astype(np.float64) - b).max())


def _loss(net, x, y):
    return torch.nn.functional.cross_entropy(net(x), y)


# ---------------------------------------------------------------------------- DistributedOptimizer
class BatchNormNet(torch.nn.Module):
    """Linear-BatchNorm-Tanh-Linear: the compiled graph updates the running statistics in place, and
    ``DistributedOptimizer`` copies rank 0's into them after every step (``broadcast_buffers``)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.BatchNorm1d(24), torch.nn.Tanh(),
                                        torch.nn.Linear(24, 4))

    def forward(self, x):
        return self.body(x)


MODELS = {"mlp": entry_models.mlp, "batchnorm": BatchNormNet}


def _optimizer_run(kind, compile_with=None, fullgraph=True, steps=STEPS):
    """(parameters, losses) of ``steps`` steps through ``DistributedOptimizer`` with ExDyna."""
    rank = MPI.COMM_WORLD.Get_rank()
    model = MODELS[kind](seed=rank)   # construction broadcasts rank 0's
    net = model if compile_with is None else torch.compile(model, backend=compile_with, fullgraph=fullgraph)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                               sparsifier="exdyna", density=DENSITY)
    losses = []
    for step in range(steps):
        x, y = entry_models.mlp_batch(step, rank)
        opt.zero_grad()
        loss = _loss(net, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return np.concatenate([_flat(model), _buffers(model)]), losses


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_distributed_optimizer_compiled_model_has_eager_bits(kind):
    eager, eager_losses = _optimizer_run(kind)
    backend = Counting("aot_eager")
    got, losses = _optimizer_run(kind, backend)
    mpi_assert(backend.graphs >= 1, f"{kind}: nothing was compiled")
    mpi_assert(losses == eager_losses, f"{kind}: losses {losses} differ from eager's {eager_losses}")
    mpi_assert(_bit_equal(got, eager), f"{kind}: parameters or buffers differ from eager's by {_diff(got, eager):.3g}")
    mpi_assert(_same_on_every_rank(got), f"{kind}: parameters or buffers differ between ranks")


def test_distributed_optimizer_under_compiled_autograd_keeps_the_flat_buffer_and_eager_bits():
    """Forward and backward in one compiled function with compiled autograd: the backward graph is
    compiled too, and accumulates into the flat buffer (every ``.grad`` still a view of it)."""
    rank = MPI.COMM_WORLD.Get_rank()
    results = []
    for compiled in (False, True):
        # one parameter: compiled autograd compiles each parameter's post-accumulate-grad hook (the
        # flat buffer's bookkeeping) as a graph of its own, one to several seconds apiece
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 4, bias=False), torch.nn.Tanh())
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                                   sparsifier="exdyna", density=DENSITY)
        backend = Counting("aot_eager")

        def forward_backward(x, y):
            loss = _loss(model, x, y)
            loss.backward()
            return loss

        flat = opt.flat_grad
        lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
        views = True
        with dynamo.config.patch(compiled_autograd=compiled):   # read when torch.compile wraps the function
            run = torch.compile(forward_backward, backend=backend) if compiled else forward_backward
            for step in range(STEPS):
                x, y = entry_models.mlp_batch(step, rank)
                opt.zero_grad()
                run(x, y)
                views &= all(lo <= p.grad.data_ptr() < hi for p in model.parameters())
                opt.step()
        results.append((_flat(model), backend.graphs, views))
    (eager, _, _), (got, graphs, views) = results
    # the forward graph, compiled autograd's backward graph (and the hook's)
    mpi_assert(graphs >= 2, f"{graphs} graphs compiled: the backward was not compiled")
    mpi_assert(views, "compiled autograd replaced a .grad that views the flat buffer")
    mpi_assert(_bit_equal(got, eager), f"parameters differ from eager's by {_diff(got, eager):.3g}")
    mpi_assert(_same_on_every_rank(got), "parameters differ between ranks")


# ---------------------------------------------------------------------------- the DDP hook
def _ddp(model, bucket_mb=BUCKET_MB):
    return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)


def _compiled_ddp(model, order, backend, bucket_mb=BUCKET_MB):
    """(the DDP module, what the loop calls): ``torch.compile(DDP(model))`` ("outside", the order
    torch's DDP notes recommend) or ``DDP(torch.compile(model, fullgraph=True))`` ("inside");
    ``backend`` None: eager."""
    if backend is None:
        ddp = _ddp(model, bucket_mb)
        return ddp, ddp
    if order == "outside":
        ddp = _ddp(model, bucket_mb)
        return ddp, torch.compile(ddp, backend=backend)
    ddp = _ddp(torch.compile(model, backend=backend, fullgraph=True), bucket_mb)   # one graph, split by DDP
    return ddp, ddp


class Recorder:
    """A hook around ``exdyna_hook`` that records, per call, the bucket's index, whether it is the
    last, its parameters (as indices into the model's) and a copy of its buffer as DDP handed it."""

    def __init__(self, model):
        self.index = {id(p): i for i, p in enumerate(model.parameters())}
        self.calls = []

    def hook(self, state, bucket):   # DDP checks a hook's name and its parameters' names
        params = [self.index[id(p)] for p in bucket.parameters()]
        self.calls.append((bucket.index(), bucket.is_last(), params, bucket.buffer().detach().clone()))
        return exdyna_hook(state, bucket)

    def iterations(self):
        its, cur = [], []
        for call in self.calls:
            cur.append(call)
            if call[1]:
                its.append(cur)
                cur = []
        return its, cur


def _bucket_problems(model, recorder, steps):
    """What is wrong with the buckets the hook saw (empty: nothing), and each iteration's local
    gradient per parameter as the buckets carried it."""
    shapes = [p.shape for p in model.parameters()]
    its, rest = recorder.iterations()
    problems = [] if len(its) == steps and not rest else [f"{len(its)} iterations ({len(rest)} calls left over)"]
    grads = []
    for n, it in enumerate(its):
        indices = [c[0] for c in it]
        if indices != list(range(len(it))) or [c[1] for c in it] != [False] * (len(it) - 1) + [True]:
            problems.append(f"iteration {n}: bucket indices {indices}, last flags {[c[1] for c in it]}")
        held = sorted(i for c in it for i in c[2])
        if held != list(range(len(shapes))):
            problems.append(f"iteration {n}: the buckets hold parameters {held}")
        per_param = {}
        for _, _, params, buf in it:
            sizes = [shapes[i].numel() for i in params]
            if sum(sizes) != buf.numel():
                problems.append(f"iteration {n}: a buffer of {buf.numel()} for parameters of {sum(sizes)}")
                continue
            for i, g in zip(params, buf.split(sizes)):
                per_param[i] = g.numpy().copy()
        grads.append(per_param)
    return problems, grads


def _hook_run(order=None, backend=None, scope="model", steps=STEPS, micro=0, width=WIDE, bucket_mb=BUCKET_MB):
    """Train ``Net`` through DDP with the ExDyna hook; ``micro`` micro-batches under ``no_sync``
    before each synced one. Returns (parameters, the recorder, the state, hook calls under no_sync)."""
    rank = MPI.COMM_WORLD.Get_rank()
    model = Net(seed=rank, width=width)   # DDP broadcasts rank 0's
    ddp, net = _compiled_ddp(model, order, backend, bucket_mb)
    state = ExDynaHookState("exdyna", DENSITY, scope=scope)
    recorder = Recorder(model)
    ddp.register_comm_hook(state, recorder.hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    in_no_sync = 0
    try:
        for step in range(steps):
            opt.zero_grad()
            for m in range(micro):
                before = len(recorder.calls)
                with ddp.no_sync():
                    x, y = entry_models.mlp_batch(100 * (m + 1) + step, rank)
                    _loss(net, x, y).backward()
                in_no_sync += len(recorder.calls) - before
            x, y = entry_models.mlp_batch(step, rank)
            _loss(net, x, y).backward()
            opt.step()
    finally:
        state.close()
    return _flat(model), recorder, state, in_no_sync


@pytest.mark.parametrize("order", ["outside", "inside"])
def test_ddp_hook_compiled_model_has_eager_bits_and_gets_every_bucket(order):
    """With ``scope="model"`` the layout is fixed at the first iteration (one bucket, the same
    under compile), so the exchange, and the parameters, are eager's to the bit although DDP's
    rebuilt buckets differ: compiled backward graphs hand over their gradients in another order."""
    eager, eager_rec, _, _ = _hook_run()
    backend = Counting("aot_eager")
    got, rec, state, _ = _hook_run(order, backend)
    model = Net(width=WIDE)
    problems, grads = _bucket_problems(model, rec, STEPS)
    eager_problems, eager_grads = _bucket_problems(model, eager_rec, STEPS)
    mpi_assert(not eager_problems, f"the eager run's buckets: {eager_problems}")
    mpi_assert(backend.graphs >= 2, f"{order}: {backend.graphs} graphs: DDPOptimizer did not split the model")
    mpi_assert(not problems, f"{order}: {problems}")
    mpi_assert(max(len(it) for it in rec.iterations()[0]) > 1, f"{order}: one bucket per iteration")
    same_grads = all(set(g) == set(e) and all(_bit_equal(g[i], e[i]) for i in g) for g, e in zip(grads, eager_grads))
    mpi_assert(same_grads, f"{order}: a bucket carried another gradient than eager's")
    mpi_assert(state.step == STEPS, f"{order}: {state.step} iterations counted")
    mpi_assert(_bit_equal(got, eager), f"{order}: parameters differ from eager's by {_diff(got, eager):.3g}")
    mpi_assert(_same_on_every_rank(got), f"{order}: parameters differ between ranks")


def test_ddp_hook_bucket_scope_follows_the_rebuild_under_compile():
    """``scope="bucket"``: one sparsifier per bucket of the compiled DDP's rebuilt buckets (not
    eager's: compile changes the order in which gradients become ready); ranks stay identical."""
    backend = Counting("aot_eager")
    got, rec, state, _ = _hook_run("outside", backend, scope="bucket")
    problems, _ = _bucket_problems(Net(width=WIDE), rec, STEPS)
    last = rec.iterations()[0][-1]
    keys = sorted(tuple(k) for k in state.stats)
    mpi_assert(not problems, str(problems))
    mpi_assert(len(last) > 1 and state.step == STEPS, f"{len(last)} buckets, {state.step} iterations")
    mpi_assert(len(keys) == len(last) and sorted(i for k in keys for i in k) == list(range(len(state.layout))),
               f"bucket keys {keys} for {len(last)} buckets of {len(state.layout)} parameters")
    mpi_assert(not _bit_equal(got, _flat(Net(width=WIDE))), "training changed nothing")
    mpi_assert(_same_on_every_rank(got), "parameters differ between ranks")


def test_no_sync_under_compile_accumulates_without_the_hook():
    eager, _, eager_state, _ = _hook_run(micro=1, steps=3)
    got, rec, state, in_no_sync = _hook_run("outside", Counting("aot_eager"), micro=1, steps=3)
    problems, _ = _bucket_problems(Net(width=WIDE), rec, 3)
    mpi_assert(in_no_sync == 0, f"the hook ran {in_no_sync} times under no_sync")
    mpi_assert(not problems, str(problems))
    mpi_assert(state.step == 3 == eager_state.step, f"{state.step} iterations counted, eager {eager_state.step}")
    mpi_assert(_bit_equal(got, eager), f"parameters differ from eager's by {_diff(got, eager):.3g}")
    mpi_assert(_same_on_every_rank(got), "parameters differ between ranks")


def test_compiled_autograd_through_ddp_is_refused_before_the_hook_runs():
    """DDP's C++ reducer refuses compiled autograd (torch's message) on every rank before any
    bucket reaches the hook; the state is untouched and the eager loop trains on with it."""
    rank = MPI.COMM_WORLD.Get_rank()
    model = Net(width=24)
    ddp = _ddp(model)
    state = ExDynaHookState("exdyna", DENSITY)
    recorder = Recorder(model)
    ddp.register_comm_hook(state, recorder.hook)
    net = torch.compile(ddp, backend="aot_eager")

    def forward_backward(x, y):
        _loss(net, x, y).backward()

    x, y = entry_models.mlp_batch(0, rank)
    msg = ""
    try:
        with dynamo.config.patch(compiled_autograd=True):
            torch.compile(forward_backward, backend="aot_eager")(x, y)
    except RuntimeError as e:
        msg = str(e)
    refused = (len(recorder.calls), state.step, state.error)
    try:
        for step in range(1, 4):
            ddp.zero_grad()
            x, y = entry_models.mlp_batch(step, rank)
            _loss(ddp, x, y).backward()
    finally:
        state.close()
    mpi_assert("Compiled autograd is not compatible with C++ DDP Reducer" in msg, f"not refused: {msg!r}")
    mpi_assert(refused == (0, 0, None), f"the hook ran before the refusal: calls, step, error {refused}")
    mpi_assert(state.step == 3 and state.error is None, f"after the refusal: step {state.step}, {state.error!r}")
    mpi_assert(isinstance(state.stats, exdyna_mpi.Stats), f"stats {state.stats!r}")


# ---------------------------------------------------------------------------- DiLoCo
H = 3


def _diloco_run(compile_with=None, evaluate=True):
    """(parameters, outer steps, the global model's loss in the middle of the second period, if
    ``evaluate``)."""
    rank = MPI.COMM_WORLD.Get_rank()
    model = Net(seed=rank)
    net = model if compile_with is None else torch.compile(model, backend=compile_with, fullgraph=True)
    opt = DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1), model,
                 sync_every=H, sparsifier="exdyna", density=DENSITY)
    mid = None
    try:
        for step in range(2 * H):
            x, y = entry_models.mlp_batch(step, rank)
            opt.zero_grad()
            _loss(net, x, y).backward()
            opt.step()
            if evaluate and step == H:
                with opt.global_model(), torch.no_grad():
                    mid = _loss(net, *entry_models.mlp_batch(0, 0)).item()
    finally:
        opt.close()
    return _flat(model), opt.outer_steps, mid


def test_diloco_compiled_model_has_eager_bits():
    eager, eager_outer, eager_mid = _diloco_run()
    backend = Counting("aot_eager")
    got, outer, mid = _diloco_run(backend)
    mpi_assert(backend.graphs >= 1, "nothing was compiled")
    mpi_assert(outer == eager_outer == 2, f"{outer} outer steps, eager {eager_outer}")
    mpi_assert(mid == eager_mid, f"the global model's loss {mid} differs from eager's {eager_mid}")
    mpi_assert(_bit_equal(got, eager), f"parameters differ from eager's by {_diff(got, eager):.3g}")
    mpi_assert(_same_on_every_rank(got), "parameters differ between ranks")


# ---------------------------------------------------------------------------- inductor
def _inductor_run(entry, backend):
    """One entry point's run of the small ``Net`` (the same graph for all three: inductor compiles
    it once and its cache serves the others); eager when ``backend`` is None."""
    if entry == "DistributedOptimizer":
        rank = MPI.COMM_WORLD.Get_rank()
        model = Net(seed=rank)
        net = model if backend is None else torch.compile(model, backend=backend)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                                   sparsifier="exdyna", density=DENSITY)
        for step in range(STEPS):
            x, y = entry_models.mlp_batch(step, rank)
            opt.zero_grad()
            _loss(net, x, y).backward()
            opt.step()
        return _flat(model)
    if entry == "ddp_hook":
        # default buckets: one for this model, so DDPOptimizer keeps it as one graph
        return _hook_run(None if backend is None else "outside", backend, width=24, bucket_mb=25)[0]
    return _diloco_run(backend, evaluate=False)[0]


@pytest.mark.parametrize("entry", ["DistributedOptimizer", "ddp_hook", "DiLoCo"])
def test_inductor_compiled_model_trains_identically_on_every_rank(entry):
    backend = Counting("inductor")
    with _inductor_config():
        got = _inductor_run(entry, backend)
    eager = _inductor_run(entry, None)
    start = _flat(Net())
    mpi_assert(backend.graphs >= 1, f"{entry}: nothing was compiled")
    mpi_assert(_same_on_every_rank(got), f"{entry}: parameters differ between ranks")
    mpi_assert(not _bit_equal(got, start), f"{entry}: training changed nothing")
    mpi_assert(np.isfinite(got).all() and _diff(got, eager) <= INDUCTOR_ATOL,
               f"{entry}: inductor's parameters are {_diff(got, eager):.3g} from eager's")


# ---------------------------------------------------------------------------- a compiled training step
def _compiled_step_run(entry, backend=None):
    """The whole step (``zero_grad``, forward, backward, the entry point's ``step``) as one function,
    compiled with ``backend`` (eager when None): the exchange inside ``step`` runs eagerly (a graph
    break), the rest is compiled."""
    rank = MPI.COMM_WORLD.Get_rank()
    model = Net(seed=rank)
    if entry == "DistributedOptimizer":
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                                   sparsifier="exdyna", density=DENSITY)
    else:
        opt = DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), model, sync_every=H,
                     sparsifier="exdyna", density=DENSITY)

    def train_step(x, y):
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()

    step = train_step if backend is None else torch.compile(train_step, backend=backend)
    try:
        for t in range(2 * H):
            step(*entry_models.mlp_batch(t, rank))
    finally:
        getattr(opt, "close", lambda: None)()
    return _flat(model)


@pytest.mark.parametrize("entry", ["DistributedOptimizer", "DiLoCo"])
def test_a_compiled_training_step_has_eager_bits(entry):
    eager = _compiled_step_run(entry)
    backend = Counting("aot_eager")
    got = _compiled_step_run(entry, backend)
    mpi_assert(backend.graphs >= 1, f"{entry}: nothing was compiled")
    mpi_assert(_bit_equal(got, eager), f"{entry}: parameters differ from eager's by {_diff(got, eager):.3g}")
    mpi_assert(_same_on_every_rank(got), f"{entry}: parameters differ between ranks")


def test_the_hook_refuses_a_per_parameter_call():
    """DDP's Python reducer (compiled autograd's) calls a hook with ``(grad, param)`` per parameter
    and drops its future: the hook says so instead of failing on a tuple."""
    state = ExDynaHookState("exdyna", density=DENSITY)
    p = torch.nn.Parameter(torch.zeros(3))
    try:
        with pytest.raises(RuntimeError, match="Python reducer"):
            exdyna_hook(state, (torch.zeros(3), p))
        mpi_assert(state.step == 0, f"step {state.step}")
    finally:
        state.close()
