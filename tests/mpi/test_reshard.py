"""Resume at another number of ranks (``load_state_dict(dicts, reshard=True)``), on 2..4 ranks.

Within one run: a state is trained on the first ``P_old`` ranks (``COMM_WORLD`` or a ``Split``),
every old rank's dict gathered to every rank, then loaded on the first ``P_new`` ranks (4->3, 3->4,
4->2 at P=4; 3->2, 2->3 at P=3; 2->1, 1->2 at P=2). Checked against references computed here:

- the sparsifier layer (exdyna, micro, topk, oktopk, dense): each new residual is the old ones'
  sum in old-rank order / P_old (bit for bit, NumPy), the same on every new rank; the iteration and
  ExDyna's threshold carried; the outputs of a few more steps identical on every new rank;
- ``DistributedOptimizer`` with SGD + momentum (the momentum after the exchange, and moved before
  it: the velocity the mean) and with AdamW's default (``adam="auto"``): the wrapped optimizer's
  and the Adam path's state old rank 0's, the residual the mean, parameters bit-identical on every
  new rank after more steps;
- ``ExDynaHookState`` (scope model and bucket, and with ``optimizer=``) and ``DiLoCo`` alike;
- refusals, the same ``CollectiveError`` text on every rank and the state unchanged: a missing old
  rank, one given twice, a dict of another density, ranks given different sequences, a class
  that cannot reshard, and ``reshard=False`` at another rank count (today's refusal).
"""
import numpy as np
import pytest
from mpi4py import MPI

import exdyna_mpi
from exdyna_mpi.sparsifiers.baselines.dense import DenseAllreduce
from tests.conftest import mpi_assert, state_content

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
N = 3000


def _pairs():
    """The (P_old, P_new) pairs this world size can make."""
    return {4: [(4, 3), (3, 4), (4, 2)], 3: [(3, 2), (2, 3)], 2: [(2, 1), (1, 2)]}.get(WORLD.Get_size(), [])


PAIRS = _pairs()
needs_two = pytest.mark.skipif(WORLD.Get_size() < 2, reason="resharding needs two rank counts (P >= 2)")


def _first(n):
    """A communicator over the first ``n`` ranks of the world (``COMM_NULL`` elsewhere); collective."""
    return WORLD.Split(0 if WORLD.Get_rank() < n else MPI.UNDEFINED, WORLD.Get_rank())


def _gather(d, comm):
    """Every old rank's ``d`` on every world rank (``d`` is None off the old communicator)."""
    return [x for x in WORLD.allgather(d if comm != MPI.COMM_NULL else None) if x is not None]


def _free(*comms):
    for c in comms:
        if c != MPI.COMM_NULL:
            c.Free()


def _grad(rank, t, n=N):
    return np.random.default_rng(1000 * t + rank).standard_normal(n).astype(np.float32)


def _refusal(call, comm):
    """Run ``call()`` on every rank of ``comm``: it must raise ``CollectiveError`` with the same text
    on every rank. Returns the text."""
    msg = ""
    try:
        call()
    except exdyna_mpi.CollectiveError as e:
        msg = str(e)
    msgs = comm.allgather(msg)
    mpi_assert(msgs[0] and all(m == msgs[0] for m in msgs), f"errors differ or missing: {msgs}", comm)
    return msgs[0]


def _mean(vectors, dtype=np.float32):
    """The reference rule: the sum in old-rank order, then / P_old, in the vectors' dtype."""
    acc = np.zeros_like(np.asarray(vectors[0], dtype=dtype))
    for v in vectors:
        acc = acc + np.asarray(v, dtype=dtype)
    return acc / dtype(len(vectors))


def _broken(dicts):
    """A sequence to refuse and the text that names why: the last old rank missing (one old rank:
    given twice)."""
    return (dicts[:-1], "is missing") if len(dicts) > 1 else (dicts + dicts, "is given 2 times")


def _same_everywhere(x, comm, what):
    got = comm.allgather(np.ascontiguousarray(x).tobytes())
    mpi_assert(all(g == got[0] for g in got), f"{what} differs between ranks", comm)


# ---------------------------------------------------------------------------------- sparsifier layer
def _old_sparsifier(name, n_old, steps=3, density=0.02):
    comm = _first(n_old)
    d = None
    if comm != MPI.COMM_NULL:
        sp = exdyna_mpi.make(name, N, density, comm)
        for t in range(steps):
            sp.step(_grad(comm.Get_rank(), t))
        d = sp.state_dict()
        sp.close()
    dicts = _gather(d, comm)
    _free(comm)
    return dicts


@needs_two
@pytest.mark.parametrize("pair", PAIRS, ids=[f"{a}to{b}" for a, b in PAIRS])
@pytest.mark.parametrize("name", ["exdyna", "micro", "topk", "oktopk", "dense"])
def test_sparsifier_residual_is_the_mean_and_steps_go_on_alike(name, pair):
    n_old, n_new = pair
    dicts = _old_sparsifier(name, n_old)
    ref = _mean([d["residual"] for d in sorted(dicts, key=lambda d: d["rank"])])
    comm = _first(n_new)
    if comm != MPI.COMM_NULL:
        sp = exdyna_mpi.make(name, N, 0.02, comm)
        sp.load_state_dict(list(reversed(dicts)), reshard=True)   # any order: the ranks say which
        mpi_assert(np.array_equal(sp.residual, ref), f"{name}: residual != mean of the old residuals", comm)
        mpi_assert(sp.iteration == dicts[0]["iteration"] == 3, f"{name}: iteration {sp.iteration}", comm)
        new_avg = np.sum(comm.allgather(sp.residual), axis=0, dtype=np.float64) / n_new
        old_avg = np.sum([d["residual"] for d in dicts], axis=0, dtype=np.float64) / n_old
        mpi_assert(np.allclose(new_avg, old_avg, rtol=1e-6, atol=1e-7), "the pending average is not kept", comm)
        if name in ("exdyna", "micro"):
            mpi_assert(sp.threshold == dicts[0]["controller_state"]["threshold"], "threshold not carried", comm)
        if name == "exdyna":
            mpi_assert(len(sp.state_dict()["layout"]["blk_part"]) == n_new, "the layout is not this rank count's", comm)
        for t in range(3, 6):
            out = sp.step(_grad(comm.Get_rank(), t))
            _same_everywhere(out, comm, f"{name}: the output at step {t}")
        mpi_assert(sp.iteration == 6, "the iteration does not go on", comm)
        sp.close()
    _free(comm)


@needs_two
def test_shrink_keeps_the_survivors_share():
    from exdyna_mpi.sparsifiers.reshard import reshard
    n_old = WORLD.Get_size()
    dicts = _old_sparsifier("exdyna", n_old)
    survivors = [d for d in dicts if d["rank"] != 0]   # old rank 0 died
    comm = _first(n_old - 1)
    if comm != MPI.COMM_NULL:
        sp = exdyna_mpi.make("exdyna", N, 0.02, comm)
        reshard(sp, survivors, complete=False)
        acc = np.zeros(N, np.float32)
        for d in survivors:
            acc = acc + d["residual"]
        mpi_assert(np.array_equal(sp.residual, acc / np.float32(n_old)), "residual != sum(known) / P_old", comm)
        mpi_assert(sp.iteration == 3, "iteration", comm)
        _refusal(lambda: sp.load_state_dict(survivors, reshard=True), comm)   # complete: refused
    _free(comm)


class _Counting(DenseAllreduce):
    """A sparsifier with its own entries and no rule for another rank count."""

    name = "counting"

    def extra_state(self):
        return {"seen": self.iteration}

    def load_extra_state(self, d):
        pass


@needs_two
def test_refusals_are_collective_and_change_nothing():
    n_old = WORLD.Get_size()
    dicts = _old_sparsifier("exdyna", n_old)
    comm = _first(n_old - 1)
    if comm != MPI.COMM_NULL:
        sp = exdyna_mpi.make("exdyna", N, 0.02, comm)
        for t in range(2):
            sp.step(_grad(comm.Get_rank(), 10 + t))
        before = state_content(sp.state_dict())
        other = [dict(d, density=0.05) if d["rank"] == 1 else d for d in dicts]
        mine = [dict(d, residual=d["residual"] + np.float32(comm.Get_rank())) if d["rank"] == 0 else d
                for d in dicts]
        cases = {
            "is missing": dicts[1:],
            "is given 2 times": dicts + dicts[:1],
            "density=0.05": other,
            "different sequences": mine,
            "has nranks=": dicts[0],   # reshard=False at another rank count: today's refusal
        }
        for text, given in cases.items():
            if text == "different sequences" and comm.Get_size() == 1:
                continue
            msg = _refusal(lambda: sp.load_state_dict(given, reshard=text != "has nranks="), comm)
            mpi_assert(text in msg, f"{text!r} not in {msg!r}", comm)
            mpi_assert(state_content(sp.state_dict()) == before, f"{text}: the state changed", comm)
        sp.close()
    _free(comm)
    old = _first(n_old)
    d = None
    if old != MPI.COMM_NULL:
        c = _Counting(N, 1.0, old)
        c.step(_grad(old.Get_rank(), 0))
        d = c.state_dict()
    cdicts = _gather(d, old)
    _free(old)
    comm = _first(n_old - 1)
    if comm != MPI.COMM_NULL:
        c = _Counting(N, 1.0, comm)
        before = state_content(c.state_dict())
        msg = _refusal(lambda: c.load_state_dict(cdicts, reshard=True), comm)
        mpi_assert("counting: cannot be resharded" in msg, msg, comm)
        mpi_assert(state_content(c.state_dict()) == before, "the state changed", comm)
    _free(comm)


# ---------------------------------------------------------------------------------- torch entry points
try:
    import torch
    from exdyna_mpi.adapters.torch import DiLoCo, DistributedOptimizer, ExDynaHookState, exdyna_hook
except ImportError:   # the sparsifier layer's tests above still run
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed")


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(rank, t):
    g = torch.Generator().manual_seed(100 * t + rank)
    return torch.randn(16, 12, generator=g), torch.randint(0, 4, (16,), generator=g)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def _train(model, opt, rank, steps, start=0):
    for t in range(start, start + steps):
        x, y = _batch(rank, t)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _distributed(kind, comm, density):
    model = _model()
    base = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if kind == "sgd"
            else torch.optim.AdamW(model.parameters(), lr=1e-3))
    return model, DistributedOptimizer(base, model, comm=comm, sparsifier="exdyna", density=density)


def _wrapped(sd):
    return state_content({k: v for k, v in sd.items() if not k.startswith("exdyna_")})


@needs_two
@needs_torch
@pytest.mark.parametrize("pair", PAIRS, ids=[f"{a}to{b}" for a, b in PAIRS])
@pytest.mark.parametrize("kind,density", [("sgd", 0.05), ("sgd", 0.01), ("adamw", 0.05)],
                         ids=["sgd-momentum-after", "sgd-momentum-moved", "adamw-auto"])
def test_distributed_optimizer_reshards(kind, density, pair):
    n_old, n_new = pair
    old = _first(n_old)
    got = None
    if old != MPI.COMM_NULL:
        model, opt = _distributed(kind, old, density)
        _train(model, opt, old.Get_rank(), 4)
        got = (opt.state_dict(), model.state_dict())
    olds = sorted(_gather(got, old), key=lambda g: g[0]["exdyna_sparsifier"]["rank"])
    _free(old)
    dicts = [d for d, _ in olds]
    comm = _first(n_new)
    if comm != MPI.COMM_NULL:
        model, opt = _distributed(kind, comm, density)
        model.load_state_dict(olds[0][1])
        opt.load_state_dict(dicts, reshard=True)
        sd = opt.state_dict()
        res = [d["exdyna_sparsifier"]["residual"].numpy() for d in dicts]
        mpi_assert(np.array_equal(sd["exdyna_sparsifier"]["residual"].numpy(), _mean(res)), "residual", comm)
        mpi_assert(sd["exdyna_sparsifier"]["iteration"] == 4, "iteration", comm)
        mpi_assert(opt.sparsifier.threshold == dicts[0]["exdyna_sparsifier"]["controller_state"]["threshold"],
                   "threshold", comm)
        mpi_assert(_wrapped(sd) == _wrapped(dicts[0]), "the wrapped optimizer's state is not old rank 0's", comm)
        if kind == "sgd" and density < 0.02:   # the momentum moved before the exchange: the velocity
            vel = [d["exdyna_options"]["velocity"].numpy() for d in dicts]
            mpi_assert(np.array_equal(sd["exdyna_options"]["velocity"].numpy(), _mean(vel)), "velocity", comm)
            mpi_assert(sd["exdyna_options"]["step"] == 4, "recipe step", comm)
        if kind == "sgd" and density >= 0.02:   # the momentum after the exchange: in SGD's own state
            mpi_assert(len(sd["state"]) > 0, "no momentum buffers to compare", comm)
        if kind == "adamw":
            mpi_assert(state_content(sd["exdyna_adam"]) == state_content(dicts[0]["exdyna_adam"]),
                       "the Adam path's state is not old rank 0's", comm)
            mpi_assert(sd["exdyna_adam"]["mode"] == "demo-age", sd["exdyna_adam"]["mode"], comm)
        _train(model, opt, comm.Get_rank(), 3, start=4)
        _same_everywhere(_flat(model), comm, "parameters after more steps")
    _free(comm)


RECIPES = {"adam-update": ("adamw", dict(adam="update")), "overlap": ("sgd", dict(overlap=True)),
           "density-stages": ("sgd", dict(warmup_steps=2, density_warmup=(0.1, 0.05), density_warmup_steps=2))}


@needs_two
@needs_torch
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_paths_reshard(recipe):
    kind, kw = RECIPES[recipe]
    n_old, n_new = PAIRS[0]

    def build(comm):
        model = _model()
        base = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if kind == "sgd"
                else torch.optim.AdamW(model.parameters(), lr=1e-3))
        return model, DistributedOptimizer(base, model, comm=comm, sparsifier="exdyna", density=0.01, **kw)

    old = _first(n_old)
    got = None
    if old != MPI.COMM_NULL:
        model, opt = build(old)
        _train(model, opt, old.Get_rank(), 3)   # density-stages: two dense steps, then stage 0 is live
        got = (opt.state_dict(), model.state_dict())
    olds = sorted(_gather(got, old), key=lambda g: g[0]["exdyna_sparsifier"]["rank"])
    _free(old)
    dicts = [d for d, _ in olds]
    comm = _first(n_new)
    if comm != MPI.COMM_NULL:
        model, opt = build(comm)
        model.load_state_dict(olds[0][1])
        opt.load_state_dict(dicts, reshard=True)
        sd = opt.state_dict()
        if recipe == "adam-update":   # each rank's own moments: their mean
            for key in ("m", "v"):
                ref = _mean([d["exdyna_adam"][key].numpy() for d in dicts])
                mpi_assert(np.array_equal(sd["exdyna_adam"][key].numpy(), ref), f"adam {key}", comm)
        if recipe == "density-stages":   # the live stage's sparsifier resharded, its residual the mean
            mpi_assert(sd["exdyna_options"]["stage"] == 0, "stage", comm)
            ref = _mean([d["exdyna_options"]["stage_state"]["residual"].numpy() for d in dicts])
            mpi_assert(np.array_equal(sd["exdyna_options"]["stage_state"]["residual"].numpy(), ref), "stage", comm)
        if recipe == "overlap":   # the pending exchanged average, the same on every old rank: carried
            mpi_assert(torch.equal(sd["exdyna_overlap"]["pending"], dicts[0]["exdyna_overlap"]["pending"]),
                       "pending", comm)
        _train(model, opt, comm.Get_rank(), 3, start=3)
        if recipe == "overlap":
            opt.flush()
        _same_everywhere(_flat(model), comm, "parameters after more steps")
    _free(comm)


@needs_two
@needs_torch
def test_distributed_optimizer_refusals_change_nothing():
    n_old = WORLD.Get_size()
    old = _first(n_old)
    d = None
    if old != MPI.COMM_NULL:
        model, opt = _distributed("sgd", old, 0.01)
        _train(model, opt, old.Get_rank(), 3)
        d = opt.state_dict()
    dicts = sorted(_gather(d, old), key=lambda d: d["exdyna_sparsifier"]["rank"])
    _free(old)
    comm = _first(n_old - 1)
    if comm != MPI.COMM_NULL:
        model, opt = _distributed("sgd", comm, 0.01)
        _train(model, opt, comm.Get_rank(), 2, start=10)
        before = state_content(opt.state_dict())
        bad_momentum = [dict(d, state={k: {"momentum_buffer": torch.ones(1)} for k in range(1)})
                        if i == 1 else d for i, d in enumerate(dicts)]
        for text, given, reshard in (("is missing", dicts[1:], True), ("nranks=", dicts[0], False),
                                     ("the wrapped optimizer's state differs", bad_momentum, True)):
            msg = _refusal(lambda: opt.load_state_dict(given, reshard=reshard), comm)
            mpi_assert(text in msg, f"{text!r} not in {msg!r}", comm)
            mpi_assert(state_content(opt.state_dict()) == before, f"{text}: the state changed", comm)
    _free(comm)


# ---------------------------------------------------------------------------------- the DDP hook
def _hooked(comm, pg, scope, with_opt):
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=pg, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state = ExDynaHookState("exdyna", 0.01 if with_opt else 0.05, comm=comm, scope=scope,
                            optimizer=opt if with_opt else None)
    ddp.register_comm_hook(state, exdyna_hook)
    return model, ddp, opt, state


def _hook_sparsifiers(state):
    return [state._sp] if state.scope == "model" else [state._sps[k] for k in sorted(state._sps)]


@needs_two
@needs_torch
@pytest.mark.usefixtures("gloo")
@pytest.mark.parametrize("pair", PAIRS, ids=[f"{a}to{b}" for a, b in PAIRS])
@pytest.mark.parametrize("scope,with_opt", [("model", False), ("bucket", False), ("model", True)],
                         ids=["model", "bucket", "model-optimizer"])
def test_hook_state_reshards(scope, with_opt, pair):
    import torch.distributed as dist
    n_old, n_new = pair
    old, pg_old = _first(n_old), dist.new_group(list(range(n_old)))
    got = None
    if old != MPI.COMM_NULL:
        model, ddp, opt, state = _hooked(old, pg_old, scope, with_opt)
        _train(ddp, opt, old.Get_rank(), 3)
        got = (state.state_dict(), model.state_dict(), opt.state_dict())
        state.close()
    olds = _gather(got, old)
    _free(old)
    first = olds[0][0]["state"] if scope == "model" else olds[0][0]["state"][0][1]
    olds.sort(key=lambda g: (g[0]["state"] if scope == "model" else g[0]["state"][0][1])["rank"])
    dicts = [g[0] for g in olds]
    comm, pg_new = _first(n_new), dist.new_group(list(range(n_new)))
    if comm != MPI.COMM_NULL:
        model, ddp, opt, state = _hooked(comm, pg_new, scope, with_opt)
        model.load_state_dict(olds[0][1])
        opt.load_state_dict(olds[0][2])
        state.load_state_dict(dicts, reshard=True)
        mpi_assert(state.step == 3, f"step {state.step}", comm)
        sps = _hook_sparsifiers(state)
        for j, sp in enumerate(sps):
            sds = [d["state"] if scope == "model" else d["state"][j][1] for d in dicts]
            mpi_assert(np.array_equal(sp.residual, _mean([sd["residual"].numpy() for sd in sds])),
                       f"sparsifier {j}: residual", comm)
            mpi_assert(sp.nranks == n_new and sp.iteration == sds[0]["iteration"] > 0, "rank count / iteration", comm)
        if scope == "model":
            mpi_assert(sps[0].threshold == first["controller_state"]["threshold"], "threshold", comm)
        if with_opt:
            vel = [d["recipe"]["velocity"].numpy() for d in dicts]
            mpi_assert(np.array_equal(state.state_dict()["recipe"]["velocity"].numpy(), _mean(vel)), "velocity", comm)
        _train(ddp, opt, comm.Get_rank(), 3, start=3)
        _same_everywhere(_flat(model), comm, "parameters after more steps")
        before = state_content(state.state_dict())
        bad, text = _broken(dicts)
        msg = _refusal(lambda: state.load_state_dict(bad, reshard=True), comm)
        mpi_assert(text in msg and state_content(state.state_dict()) == before, msg, comm)
        state.close()
    _free(comm)


# ---------------------------------------------------------------------------------- DiLoCo
def _diloco(comm):
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    return model, DiLoCo(inner, model, comm=comm, sync_every=2, sparsifier="exdyna", density=0.05)


@needs_two
@needs_torch
@pytest.mark.parametrize("pair", PAIRS, ids=[f"{a}to{b}" for a, b in PAIRS])
def test_diloco_reshards(pair):
    n_old, n_new = pair
    old = _first(n_old)
    got = None
    if old != MPI.COMM_NULL:
        model, dl = _diloco(old)
        _train(model, dl, old.Get_rank(), 5)   # two outer steps and one inner step since
        got = (dl.state_dict(), model.state_dict())
        dl.close()
    olds = sorted(_gather(got, old), key=lambda g: g[0]["diloco"]["sparsifier"]["rank"])
    _free(old)
    dicts = [g[0] for g in olds]
    comm = _first(n_new)
    if comm != MPI.COMM_NULL:
        model, dl = _diloco(comm)
        model.load_state_dict(olds[comm.Get_rank() % n_old][1])   # a local model that is dropped
        before_bad = state_content(dl.state_dict())
        bad, text = _broken(dicts)
        msg = _refusal(lambda: dl.load_state_dict(bad, reshard=True), comm)
        mpi_assert(text in msg and state_content(dl.state_dict()) == before_bad, msg, comm)
        dl.load_state_dict(dicts, reshard=True)
        own0 = dicts[0]["diloco"]
        mpi_assert(torch.equal(dl.global_params.detach(), own0["global"]), "global parameters", comm)
        mpi_assert(np.array_equal(_flat(model), own0["global"].numpy()), "local model != global", comm)
        mpi_assert(dl.inner_steps == 0 and dl.outer_steps == own0["outer_steps"] == 2, "steps", comm)
        mpi_assert(state_content(dl.outer.state_dict()) == state_content(own0["outer"]), "outer state", comm)
        res = [d["diloco"]["sparsifier"]["residual"].numpy() for d in dicts]
        mpi_assert(np.array_equal(dl.sparsifier.residual, _mean(res)), "residual", comm)
        inner = dl.optimizer.state_dict()["state"]
        for p, st in inner.items():
            for key in ("exp_avg", "exp_avg_sq"):
                ref = _mean([d["inner"]["state"][p][key].numpy() for d in dicts])
                mpi_assert(np.array_equal(st[key].numpy(), ref), f"inner {p}.{key}", comm)
            mpi_assert(torch.equal(st["step"], dicts[0]["inner"]["state"][p]["step"]), "inner step", comm)
        _train(model, dl, comm.Get_rank(), 2, start=5)   # one outer step
        _same_everywhere(_flat(model), comm, "the model after the outer step")
        dl.close()
    _free(comm)
