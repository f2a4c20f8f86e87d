"""jobs/e2e.py's methods built: a ``Method`` from a ``MethodSpec`` (jobs/e2e_methods.py), the model
initialised from the run's seed on every rank, at the method's learning rate.

``build`` dispatches on ``spec.kind``: torch's DDP (with torch's hooks), DDP with the library's
``exdyna_hook``, the library's ``DistributedOptimizer``, DiLoCo as torchft runs it (``DiLoCoOuter``,
written here), the library's ``DiLoCo`` and its ``GroupAveragingOptimizer``, and torch's FSDP2
(``fully_shard`` on every block and the root) with its own reduce-scatter or the library's
``ShardedExchange``. Each ``Method`` carries
``resolved``: the options the harness passed to the entry point (the recipe's from the run's
arguments included) and, for the library's entry points, the configuration they resolved (their
``state_dict()`` record: sparsifier, options, recipe, Adam path) and the sparsifier's own options.

Example::

    from e2e_build import build
    from e2e_methods import METHODS
    m = build(METHODS["exdyna"], wl, args, comm, numel)
    m.step(wl, 0, args.clip)
    m.close()
"""
import contextlib
import enum
import hashlib
import math
from collections.abc import Mapping

import numpy as np

from e2e_methods import Kind, Outer, TorchHook


class Method:
    """One method's training state and how it takes a step.

    ``runner`` runs forward and backward (the model, or DDP around it); ``opt`` is what the loop steps;
    ``stride``: batches per optimiser step (gradient accumulation takes several, with DDP's ``no_sync``
    on all but the last); ``outer``: DiLoCo's outer step (None otherwise); ``stats()``: the library's
    last ``Stats`` (None for torch's own methods); ``collectives``: collective calls per step, for the
    latency term of the performance model (an estimate, see ``collectives``); ``resolved``: what the
    entry point was given and resolved (module docstring).
    """

    def __init__(self, runner, model, opt, *, resolved, stats=None, stride=1, outer=None, loop_clips=True,
                 collectives=None):
        self.runner, self.model, self.opt, self.loop_clips = runner, model, opt, loop_clips
        self.stats = stats or (lambda: None)
        self.stride, self.outer, self.resolved = stride, outer, resolved
        self.collectives = collectives

    def step(self, wl, step, clip):
        """One optimiser step on batches ``step`` .. ``step + stride - 1``; ``clip``: the norm that
        ``clip_grad_norm_`` holds the model's gradient to before the optimiser step (None: off), for
        every method alike, as a user's training loop does it (DDP: the averaged gradient; the
        library's optimizer: this rank's gradient, before the exchange; DiLoCo: the local one). The
        model-scope hook clips inside (``loop_clips=False``): the same rank's gradient, before the
        exchange."""
        import torch

        self.opt.zero_grad()
        for i in range(self.stride):
            x, y = wl.batch_at(step + i)
            last = i == self.stride - 1
            with contextlib.nullcontext() if last else self.runner.no_sync():
                loss = wl.loss(self.runner, x, y)
                (loss if self.stride == 1 else loss / self.stride).backward()
        if clip and self.loop_clips:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.opt.step()
        if self.outer is not None:
            self.outer.after_inner_step()

    def evaluated(self):
        """A context in which ``model`` holds the parameters to evaluate (DiLoCo: the global ones)."""
        return self.outer.global_model() if self.outer is not None else contextlib.nullcontext()

    def param_hash(self):
        with self.evaluated():
            return param_hash(self.model)

    def close(self):
        """Stop what the method started (the hook's worker, a deadline exchange's pending messages, an
        overlapped exchange still in flight)."""
        getattr(self.opt, "flush", lambda: None)()
        hook = getattr(self.runner, "_exdyna_hook_state", None)
        if hook is not None:
            hook.close()
        getattr(getattr(self.opt, "sparsifier", self.opt), "close", lambda: None)()


class DiLoCoOuter:
    """DiLoCo's outer step, as torchft's ``DiLoCo`` takes it: every ``h`` inner steps the pseudo-gradient
    ``global - local`` is averaged over the ranks (one dense float32 allreduce), set as the gradient of
    the global parameters and applied by the outer optimiser (Nesterov SGD); the local model then
    restarts from the new global parameters, the inner optimiser keeping its own state.
    """

    def __init__(self, model, h, lr=0.7, momentum=0.9):
        import torch
        import torch.distributed as dist

        self.h, self.count, self.ranks = h, 0, dist.get_world_size()
        self.params = list(model.parameters())
        self.glob = [torch.nn.Parameter(p.detach().clone()) for p in self.params]
        self.outer = torch.optim.SGD(self.glob, lr=lr, momentum=momentum, nesterov=True)

    def after_inner_step(self):
        self.count += 1
        if self.count % self.h == 0:
            self.sync()

    def sync(self):
        import torch
        import torch.distributed as dist

        with torch.no_grad():
            delta = torch.cat([(g - p).reshape(-1) for g, p in zip(self.glob, self.params)])
            dist.all_reduce(delta)
            delta /= self.ranks
            off = 0
            for g in self.glob:
                g.grad = delta[off:off + g.numel()].view_as(g)
                off += g.numel()
        self.outer.step()
        with torch.no_grad():
            for g, p in zip(self.glob, self.params):
                p.copy_(g)

    @contextlib.contextmanager
    def global_model(self):
        import torch

        with torch.no_grad():
            local = [p.detach().clone() for p in self.params]
            for g, p in zip(self.glob, self.params):
                p.copy_(g)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, x in zip(self.params, local):
                    p.copy_(x)


class GlobalView:
    """Evaluation of the library's ``DiLoCo`` on its global parameters (``DiLoCoOuter``'s interface)."""

    def __init__(self, opt):
        self.global_model = opt.global_model

    def after_inner_step(self):
        pass


def make_optimizer(params, args, lr, momentum=None):
    """The run's optimiser: AdamW with betas (0.9, 0.95) (GPT practice; ``momentum`` replaces beta1)
    or SGD with momentum."""
    import torch

    if args.optimizer == "adamw":
        beta1 = 0.9 if momentum is None else momentum
        return torch.optim.AdamW(params, lr=lr, betas=(beta1, 0.95), weight_decay=args.weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=args.momentum if momentum is None else momentum,
                           weight_decay=args.weight_decay)


def powersgd_start(steps):
    """PowerSGD's ``start_powerSGD_iter`` for a budget of ``steps``: plain allreduce for the first tenth
    (torch's advice: compress only once training has settled; its default is 1000)."""
    return max(2, steps // 10)


def collectives(spec, numel, stride=1):
    """Collective calls per step (an estimate for the model's latency term): DDP one per bucket (the
    first 1 MB, then 25 MB), PowerSGD three (P, Q, the uncompressed tensors), a library sparsifier
    five (counts, controller, indices, the two halves of the value sum), the dense average two,
    DiLoCo one per ``h`` steps (the library's: its exchange's calls per ``h``)."""
    if spec.kind is Kind.DILOCO:
        return 1.0 / spec.h
    if spec.kind is Kind.DILOCO_LIB:
        return (2.0 if spec.sparsifier == "dense" else 5.0) / spec.h
    if spec.torch_hook is TorchHook.POWERSGD:
        return 3.0
    if spec.kind in (Kind.DDP, Kind.DDP_HOOK):
        return (1 + math.ceil(max(0, 4 * numel - 2**20) / (25 * 2**20))) / stride
    return 2.0 if spec.sparsifier == "dense" else 5.0


def modelled_bytes(spec, stride, ranks, numel):
    """Bytes per batch each rank sends where neither the wire nor the library counts them: a ring
    allreduce of the model's gradient, 4-byte values (2 under torch's bf16 hook), once per ``stride``
    batches (accumulation) or per ``h`` (torchft's DiLoCo); None where no such count holds (PowerSGD,
    WAGMA)."""
    if spec.kind is Kind.DILOCO:
        per = 4 / spec.h
    elif spec.kind is Kind.DDP and spec.torch_hook is not TorchHook.POWERSGD:
        per = 2 if spec.torch_hook is TorchHook.BF16 else 4 / stride
    else:
        return None
    return 2 * (ranks - 1) / ranks * per * numel


def jsonable(value):
    """``value`` for a JSON record: numbers, text, None and booleans as they are, enums by value,
    sequences and mappings element by element, a function by its qualified name, anything else (a
    dtype) by its repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{value.__module__}.{value.__qualname__}"
    return repr(value)


def _resolved(entry, options, momentum=None, config=None, sparsifier=None):
    """``Method.resolved``: the entry point, the options passed to it, the optimiser's momentum (or
    beta1) where not the run's, the library's configuration record (None for torch's entry points) and
    its sparsifier's resolved options (where the entry point builds one at construction)."""
    out = {"entry": entry, "options": jsonable(options), "optimizer_momentum": momentum,
           "config": None if config is None else jsonable(config)}
    if sparsifier is not None:
        out["sparsifier_options"] = jsonable(sparsifier.options)
    return out


def library_options(spec, args):
    """``DistributedOptimizer``'s options for ``spec``: the Adam path, the table's options and the
    recipe's from ``args``."""
    options = {"adam": spec.adam} if spec.adam is not None else {}
    options.update(spec.options)
    if spec.recipe is not None:
        options.update(spec.recipe.options(args))
    return options


def hook_options(spec, args):
    """The hook's recipe options for ``spec``: at model scope (``optimizer=``), ``clip_norm=`` clips
    each rank's gradient before the exchange, where ``DistributedOptimizer``'s loop clips it (the
    Adam paths compute their update from the exchanged vector, and refuse a ``.grad`` clipped after
    ``backward()``), and ``adam=`` where the method names a path."""
    if spec.scope != "model":
        return {}
    return {"clip_norm": args.clip, **({"adam": spec.adam} if spec.adam is not None else {})}


def diloco_options(spec):
    """The library ``DiLoCo``'s options for ``spec``: the table's and the outer optimiser it names."""
    from exdyna_mpi.adapters.torch import nesterov_sgd, plain_sgd

    options = dict(spec.options)
    if spec.outer is not None:
        options["outer_optimizer"] = {Outer.NESTEROV: nesterov_sgd, Outer.SGD: plain_sgd}[spec.outer]
    return options


def merged_stats(stats):
    """One ``Stats``-like view of the hook's stats (``scope="bucket"``: a dict of them, summed)."""
    if not isinstance(stats, dict):
        return stats
    from types import SimpleNamespace

    parts = list(stats.values())
    seconds = {}
    for s in parts:
        for k, v in s.seconds.items():
            seconds[k] = seconds.get(k, 0.0) + v
    return SimpleNamespace(bytes_sent=sum(s.bytes_sent for s in parts),
                           counts=np.sum([np.asarray(s.counts, dtype=np.float64) for s in parts], axis=0),
                           seconds=seconds)


def bf16_compress_hook_gloo(state, bucket):
    """torch's ``bf16_compress_hook``, unchanged, under another name: DDP refuses to register the hook
    by that name unless the backend is NCCL ("required CUDA 11+ and NCCL 2.10+"), yet gloo reduces
    bfloat16 tensors correctly (tests/unit/test_e2e_cli.py checks the result against ddp's)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def _ddp(spec, model, args, comm, lr, numel):
    from torch.nn.parallel import DistributedDataParallel as DDP

    if spec.torch_hook is TorchHook.POWERSGD:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        # One bucket: see e2e.py's docstring (gloo and the hook's chained allreduce).
        options = {"bucket_cap_mb": 4 * numel / 2**20 + 1}
        hook = dict(spec.options, start_powerSGD_iter=powersgd_start(args.steps))
        ddp = DDP(model, **options)
        ddp.register_comm_hook(psgd.PowerSGDState(process_group=None, **hook), psgd.powerSGD_hook)
        options.update(hook)
    else:
        options = {"gradient_as_bucket_view": spec.bucket_view}
        ddp = DDP(model, **options)
        if spec.torch_hook is TorchHook.BF16:
            ddp.register_comm_hook(None, bf16_compress_hook_gloo)
    return Method(ddp, model, make_optimizer(ddp.parameters(), args, lr), stride=args.accum if spec.accumulate else 1,
                  resolved=_resolved("DistributedDataParallel", options))


def _ddp_hook(spec, model, args, comm, lr, numel):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from exdyna_mpi.adapters.torch import ExDynaHookState, exdyna_hook

    ddp = DDP(model)
    opt = make_optimizer(ddp.parameters(), args, lr, spec.beta1)
    options = hook_options(spec, args)
    # model scope: the optimizer's recipe, as DistributedOptimizer runs it (bucket scope has none)
    state = ExDynaHookState(spec.sparsifier, density=args.density, comm=comm, scope=spec.scope,
                            optimizer=opt if spec.scope == "model" else None, **options)
    ddp.register_comm_hook(state, exdyna_hook)
    ddp._exdyna_hook_state = state
    resolved = _resolved("ExDynaHookState", dict(options, scope=spec.scope), spec.beta1,
                         state.state_dict()["config"])
    return Method(ddp, model, opt, stats=lambda: merged_stats(state.stats), loop_clips=spec.scope != "model",
                  resolved=resolved)


def _library(spec, model, args, comm, lr, numel):
    from exdyna_mpi.adapters.torch import DistributedOptimizer

    options = library_options(spec, args)
    # momentum correction moves the momentum in front of the exchange: the wrapped SGD runs without it
    momentum = 0.0 if options.get("momentum_correction") else spec.beta1
    opt = DistributedOptimizer(make_optimizer(model.parameters(), args, lr, momentum), model,
                               sparsifier=spec.sparsifier, density=1.0 if spec.sparsifier == "dense" else args.density,
                               comm=comm, **options)
    resolved = _resolved("DistributedOptimizer", options, momentum, opt.state_dict()["exdyna_config"], opt.sparsifier)
    return Method(model, model, opt, stats=lambda: opt.stats, resolved=resolved)


def _diloco(spec, model, args, comm, lr, numel):
    opt = make_optimizer(model.parameters(), args, lr)
    outer = DiLoCoOuter(model, spec.h)
    options = {"h": spec.h, **{k: outer.outer.defaults[k] for k in ("lr", "momentum", "nesterov")}}
    return Method(model, model, opt, outer=outer, resolved=_resolved("DiLoCoOuter", options))


def _diloco_lib(spec, model, args, comm, lr, numel):
    from exdyna_mpi.adapters.torch import DiLoCo

    options = diloco_options(spec)
    opt = DiLoCo(make_optimizer(model.parameters(), args, lr), model, sync_every=spec.h, sparsifier=spec.sparsifier,
                 density=args.density, comm=comm, **options)
    resolved = _resolved("DiLoCo", dict(options, sync_every=spec.h), config=opt.state_dict()["diloco"]["config"],
                         sparsifier=opt.sparsifier)
    # stats of the step that just took an outer step (bytes per outer step), None between them
    return Method(model, model, opt, stats=lambda: opt.stats if opt.inner_steps == 0 else None,
                  outer=GlobalView(opt), resolved=resolved)


def _wagma(spec, model, args, comm, lr, numel):
    from exdyna_mpi.adapters.torch import GroupAveragingOptimizer

    # WAGMA-SGD as its authors run it: a local step, then the model averaged within rotating groups
    opt = GroupAveragingOptimizer(make_optimizer(model.parameters(), args, lr), model, comm=comm, **spec.options)
    return Method(model, model, opt, resolved=_resolved("GroupAveragingOptimizer", spec.options,
                                                        config=opt.state_dict()["exdyna_config"]))


def fully_sharded(model, **policy):
    """``model`` under FSDP2 as its users shard a transformer: ``fully_shard`` on every block (a model
    without ``blocks`` has only the root unit), then on the root, torch's defaults otherwise (parameters
    resharded after forward); ``policy``: ``MixedPrecisionPolicy``'s fields, dtypes by name. Returns the
    number of blocks sharded."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(**{k: getattr(torch, v) if isinstance(v, str) else v for k, v in policy.items()})
    blocks = list(getattr(model, "blocks", ()))
    for block in blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return len(blocks)


def fsdp_collectives(blocks, reduce_scatter):
    """Collective calls per step under ``fully_sharded`` (an estimate, as ``collectives``): each block's
    parameters gathered for forward and again for backward, the root's once (FSDP keeps the root
    unsharded between them), and ``reduce_scatter`` calls per unit for its gradient."""
    return 2.0 * blocks + 1 + reduce_scatter * (blocks + 1)


def _fsdp(spec, model, args, comm, lr, numel):
    blocks = fully_sharded(model, **spec.options)
    return Method(model, model, make_optimizer(model.parameters(), args, lr),
                  resolved=_resolved("fully_shard", {"mp_policy": dict(spec.options), "units": blocks + 1}),
                  collectives=fsdp_collectives(blocks, 1))


def _fsdp_lib(spec, model, args, comm, lr, numel):
    from exdyna_mpi.adapters.torch_fsdp import ShardedExchange

    blocks = fully_sharded(model)
    sharded = ShardedExchange(model, args.density, comm=comm, sparsifier=spec.sparsifier, **spec.options)
    first = next(iter(sharded.units.values())).sparsifier
    # the sparse reduce-scatter: the threshold words, the counts, the union's indices, one Alltoallv
    return Method(model, model, make_optimizer(model.parameters(), args, lr),
                  resolved=_resolved("ShardedExchange", dict(spec.options, units=len(sharded.units)), sparsifier=first),
                  collectives=fsdp_collectives(blocks, 4))


_BUILDERS = {Kind.DDP: _ddp, Kind.DDP_HOOK: _ddp_hook, Kind.LIBRARY: _library, Kind.DILOCO: _diloco,
             Kind.DILOCO_LIB: _diloco_lib, Kind.WAGMA: _wagma, Kind.FSDP: _fsdp, Kind.FSDP_LIB: _fsdp_lib}


def build(spec, wl, args, comm, numel):
    """The ``Method`` of ``spec``, the model initialised from ``args.seed`` on every rank, at the
    method's learning rate (``args.lr_of``, else ``--lr``)."""
    import torch

    torch.manual_seed(args.seed)
    model = wl.model()
    m = _BUILDERS[spec.kind](spec, model, args, comm, args.lr_of.get(spec.name, args.lr), numel)
    if m.collectives is None:
        m.collectives = collectives(spec, numel, m.stride)
    return m


def prime_library(spec, wl, args, comm, numel):
    """One untimed step of a library method on a throwaway model: Numba compiles the sparsifier's
    kernels on first use (seconds), a cost paid once per process, not per training step."""
    if spec.kind in (Kind.LIBRARY, Kind.DDP_HOOK, Kind.DILOCO_LIB, Kind.FSDP_LIB):
        m = build(spec, wl, args, comm, numel)
        m.step(wl, 0, args.clip)
        if spec.kind is Kind.DILOCO_LIB:
            m.opt.sync()   # the outer exchange, whose kernels the first step did not reach
        m.close()


def param_hash(model):
    """The sha256 of the model's parameters, whole: FSDP's shards (DTensors) are gathered first, a
    collective every rank makes in the same order."""
    import torch

    with torch.no_grad():
        flat = torch.cat([getattr(p, "full_tensor", p.detach)().detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()
