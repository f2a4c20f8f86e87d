"""The methods of jobs/e2e.py: one typed row per name that ``--methods`` takes.

A ``MethodSpec`` says which entry point runs a method (``kind``) and everything that sets its
arithmetic: the library's sparsifier and the entry point's options, the training-recipe option
taken from the run's arguments, the Adam path, the hook's scope, DiLoCo's inner steps and outer
optimiser, the optimiser's momentum where it is not the run's, and the one optimiser it needs.
``METHODS`` holds every row, in the order ``--help`` lists them; the harness (jobs/e2e_build.py)
dispatches on ``kind`` and reads the fields, and every run record carries its row
(``MethodSpec.as_dict``). docs/e2e.md describes each method in prose.

Example::

    from e2e_methods import METHODS, Kind, Outer
    spec = METHODS["sloco-h16"]
    assert spec.kind is Kind.DILOCO_LIB and spec.h == 16 and spec.outer is Outer.SGD
    defaults = [s.name for s in METHODS.values() if s.default]
"""
import dataclasses
import enum
from types import MappingProxyType
from typing import Any, Mapping

from exdyna_mpi.adapters.torch_adam import AUTO_WIRE  # the values adam="auto" sends, so -demoage-fp8 follows it

#: the method whose loss at the budget is the others' target (unless ``--target``); it runs first
REFERENCE = "ddp"
#: DGC's density warm-up: the densities of its stages, each an eighth of the step budget
DENSITY_WARMUP = (0.25, 0.0625, 0.015625)


class Kind(enum.Enum):
    """The entry point that runs a method."""

    DDP = "ddp"                  # torch's DistributedDataParallel over gloo, optionally with one of torch's hooks
    DDP_HOOK = "ddp-hook"        # DDP with the library's exdyna_hook
    LIBRARY = "library"          # the library's DistributedOptimizer, the exchange after backward
    DILOCO = "diloco"            # DiLoCo as torchft runs it (jobs/e2e_build.py's DiLoCoOuter)
    DILOCO_LIB = "diloco-lib"    # the library's DiLoCo
    WAGMA = "wagma"              # the library's GroupAveragingOptimizer (WAGMA-SGD)
    FSDP = "fsdp"                # torch's fully_shard over gloo (every block and the root), its own reduce-scatter
    FSDP_LIB = "fsdp-lib"        # fully_shard with the library's ShardedExchange: the sparse reduce-scatter


class TorchHook(enum.Enum):
    """One of torch's own DDP communication hooks."""

    BF16 = "bf16"                # bf16_compress_hook: values cast to bfloat16 for the allreduce
    POWERSGD = "powersgd"        # powerSGD_hook, one bucket


class Outer(enum.Enum):
    """DiLoCo's outer optimiser."""

    NESTEROV = "nesterov"        # Nesterov SGD, lr 0.7, momentum 0.9 (the DiLoCo paper, torchft)
    SGD = "sgd"                  # plain SGD at lr 1 (SparseLoCo: the decayed residual is the momentum)


class Recipe(enum.Enum):
    """A training-recipe option whose value comes from the run's arguments."""

    MOMENTUM_CORRECTION = "momentum-correction"   # DGC's, with --momentum (the wrapped SGD runs without it)
    DENSITY_WARMUP = "density-warmup"             # DGC's density warm-up, stages an eighth of --steps each
    ADAM_WARMUP = "adam-warmup"                   # --adam-warmup dense Adam steps before the variance freezes

    def options(self, args: Any) -> dict[str, Any]:
        """The entry point's options for this recipe under ``args`` (the method's own: its budget)."""
        if self is Recipe.MOMENTUM_CORRECTION:
            return {"momentum_correction": args.momentum}
        if self is Recipe.DENSITY_WARMUP:
            return {"density_warmup": DENSITY_WARMUP, "density_warmup_steps": max(1, args.steps // 8)}
        return {"warmup_steps": args.adam_warmup}


def _plain(value: Any) -> Any:
    """``value`` as JSON holds it: enums by value, mappings as dicts, tuples as lists."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """One method of the harness.

    Attributes:
        name: the name ``--methods`` takes.
        kind: the entry point that runs it.
        description: one line on what it is.
        default: in the protocol's default set (``--methods`` not given).
        sparsifier: the library's sparsifier (``DDP_HOOK``, ``LIBRARY``, ``DILOCO_LIB``, ``FSDP_LIB``).
        options: keyword options of the entry point as the table fixes them (``DistributedOptimizer``'s,
            ``DiLoCo``'s, ``GroupAveragingOptimizer``'s, ``PowerSGDState``'s, ``ShardedExchange``'s), the
            sparsifier's among them; for ``FSDP``, ``MixedPrecisionPolicy``'s (dtypes by name).
        recipe: the recipe option set from the run's arguments (``Recipe.options``), if any.
        adam: the Adam path named (``adam=``); None: the entry point's default.
        beta1: the run's optimiser's momentum (SGD) or ``betas[0]`` (AdamW) where not the run's:
            DeMo's momentum decay, which ``adam="demo"`` reads from ``betas[0]``.
        scope: the hook's scope (``DDP_HOOK``): ``"model"``, the optimizer's recipe on the whole
            gradient, or ``"bucket"``, a plain sparsifier per bucket.
        torch_hook: torch's own DDP hook (``DDP``), if any.
        bucket_view: DDP's ``gradient_as_bucket_view=True``.
        accumulate: gradient accumulation, ``--accum`` batches per optimiser step (``DDP``).
        h: DiLoCo's inner steps per outer step.
        outer: DiLoCo's outer optimiser; None: the library's default for the exchange.
        same_arithmetic: the method whose bits this one computes (it takes that method's tuned rate).
        optimizer: the one ``--optimizer`` it runs under (it moves SGD's momentum, or is an Adam
            path); None: either.

    Raises:
        ValueError: a field that the kind does not read is set, or one that it needs is missing.
    """

    name: str
    kind: Kind
    description: str
    default: bool = False
    sparsifier: str | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    recipe: Recipe | None = None
    adam: str | None = None
    beta1: float | None = None
    scope: str | None = None
    torch_hook: TorchHook | None = None
    bucket_view: bool = False
    accumulate: bool = False
    h: int | None = None
    outer: Outer | None = None
    same_arithmetic: str | None = None
    optimizer: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))
        k = self.kind
        needs = {"sparsifier": k in (Kind.DDP_HOOK, Kind.LIBRARY, Kind.DILOCO_LIB, Kind.FSDP_LIB),
                 "h": k in (Kind.DILOCO, Kind.DILOCO_LIB), "scope": k is Kind.DDP_HOOK}
        for field, needed in needs.items():
            if needed != (getattr(self, field) is not None):
                raise ValueError(f"{self.name}: {field} {'missing' if needed else 'set'} for kind {k.value}")
        if k is not Kind.DDP and (self.torch_hook or self.bucket_view or self.accumulate):
            raise ValueError(f"{self.name}: torch_hook, bucket_view and accumulate are DDP's")
        if self.recipe is not None and k is not Kind.LIBRARY:
            raise ValueError(f"{self.name}: a recipe option is DistributedOptimizer's")
        if k is Kind.DILOCO and self.outer is not Outer.NESTEROV:
            raise ValueError(f"{self.name}: torchft's DiLoCo steps with Nesterov SGD")
        if self.outer is not None and k not in (Kind.DILOCO, Kind.DILOCO_LIB):
            raise ValueError(f"{self.name}: an outer optimiser is DiLoCo's")
        if self.adam is not None and k not in (Kind.LIBRARY, Kind.DDP_HOOK):
            raise ValueError(f"{self.name}: an Adam path is DistributedOptimizer's or the hook's")
        if self.optimizer not in (None, "sgd", "adamw"):
            raise ValueError(f"{self.name}: optimizer {self.optimizer!r} is not sgd or adamw")

    def as_dict(self) -> dict[str, Any]:
        """The row as plain JSON values (enums by value): what a run record stores as ``method_spec``."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _ddp(name: str, description: str, **fields: Any) -> MethodSpec:
    return MethodSpec(name, Kind.DDP, description, **fields)


def _library(name: str, sparsifier: str, description: str, **fields: Any) -> MethodSpec:
    return MethodSpec(name, Kind.LIBRARY, description, sparsifier=sparsifier, **fields)


def _diloco(name: str, h: int, description: str, **fields: Any) -> MethodSpec:
    return MethodSpec(name, Kind.DILOCO, description, h=h, outer=Outer.NESTEROV, **fields)


def _diloco_lib(name: str, h: int, sparsifier: str, description: str, **fields: Any) -> MethodSpec:
    return MethodSpec(name, Kind.DILOCO_LIB, description, h=h, sparsifier=sparsifier, **fields)


def _fsdp(name: str, description: str, **fields: Any) -> MethodSpec:
    return MethodSpec(name, Kind.FSDP, description, **fields)


def _hook(name: str, scope: str, description: str, **fields: Any) -> MethodSpec:
    return MethodSpec(name, Kind.DDP_HOOK, description, sparsifier="exdyna", scope=scope, **fields)


_BF16 = {"wire_dtype": "bfloat16"}
#: the outer delta by ExDyna with plain error feedback under DiLoCo's Nesterov step (not the
#: library's default for a sparse exchange, which is SparseLoCo's)
_EXDYNA_OUTER = {"outer": Outer.NESTEROV, "options": {"error_decay": 1.0}}
#: SparseLoCo's recipe (Sarfi et al. 2025): the error feedback decayed by 0.95 before the delta joins it,
#: and a plain outer SGD at lr 1 (the decayed accumulator is the outer momentum); the library's default
#: for a sparse exchange, spelt out so that these methods keep it if that default moves
_SLOCO = {"error_decay": 0.95}
#: the default's momentum correction off, and with it the quotas it brings
_MC_OFF = {"momentum_correction": 0.0}

_SPECS = (
    # the protocol's default set: the library's default against what users would run instead
    _ddp("ddp", "torch DDP over gloo, default buckets (25 MB, the first 1 MB), allreduce overlapped with backward",
         default=True),
    _ddp("ddp-bv", "DDP with gradient_as_bucket_view=True: ddp's arithmetic, one copy fewer", default=True,
         bucket_view=True, same_arithmetic="ddp"),
    _ddp("ddp-accum", "DDP with gradient accumulation: --accum batches per optimiser step, no_sync on all but the last",
         default=True, accumulate=True),
    _ddp("ddp-bf16", "DDP with torch's bf16_compress_hook: values cast to bfloat16 for the allreduce", default=True,
         torch_hook=TorchHook.BF16),
    _ddp("ddp-powersgd", "DDP with torch's powerSGD_hook: rank 4, error feedback, warm start, one bucket",
         default=True, torch_hook=TorchHook.POWERSGD, options={"matrix_approximation_rank": 4}),
    _diloco("diloco-h16", 16, "DiLoCo as torchft runs it: 16 local steps, then the mean delta by Nesterov SGD",
            default=True),
    _diloco("diloco-h64", 64, "DiLoCo as torchft runs it: 64 local steps, then the mean delta by Nesterov SGD",
            default=True),
    _library("exdyna", "exdyna", "DistributedOptimizer with ExDyna at --density, the defaults for the optimiser",
             default=True),
    # the library's other sparsifiers and recipe parts; the deadline exchange; WAGMA-SGD; the DDP hook
    _library("dense", "dense", "DistributedOptimizer's dense average (allreduce) at density 1"),
    _hook("ddp-exdyna", "model", "DDP with exdyna_hook at model scope: exdyna's recipe on the hook's worker"),
    _library("topk", "topk", "DistributedOptimizer with Top-k at --density"),
    _library("oktopk", "oktopk", "DistributedOptimizer with Ok-Topk at --density"),
    _library("micro", "micro", "DistributedOptimizer with MiCRO at --density"),
    _library("exdyna-q", "exdyna", "ExDyna with max_imbalance=0.05, no momentum correction",
             options={"max_imbalance": 0.05, **_MC_OFF}),
    _library("exdyna-deadline", "exdyna", "ExDyna's deadline exchange: deadline_ms='auto', max_loss=0.01",
             options={"deadline_ms": "auto", "max_loss": 0.01}),
    MethodSpec("wagma", Kind.WAGMA, "WAGMA-SGD: groups of 2, wait-avoiding, a global average every 10 steps",
               options={"group_size": 2, "sync_every": 10, "mode": "wait_avoiding"}),
    _hook("ddp-exdyna-bucket", "bucket", "DDP with exdyna_hook at bucket scope: a plain sparsifier per bucket"),
    _library("exdyna-bf16", "exdyna", "ExDyna with bfloat16 values on the wire (error feedback keeps the rounding)",
             options=_BF16),
    _library("dense-bf16", "dense", "the dense average with bfloat16 values on the wire", options=_BF16),
    _library("exdyna-mc", "exdyna", "ExDyna with momentum correction at --momentum (DGC's masking), no quotas",
             options={"max_imbalance": None}, recipe=Recipe.MOMENTUM_CORRECTION, optimizer="sgd"),
    _library("exdyna-q02", "exdyna", "ExDyna with max_imbalance=0.2, no momentum correction",
             options={"max_imbalance": 0.2, **_MC_OFF}),
    _library("exdyna-dw", "exdyna", "ExDyna with DGC's density warm-up (25, 6.25, 1.5625 %), no momentum correction",
             options=_MC_OFF, recipe=Recipe.DENSITY_WARMUP),
    _library("exdyna-mcq", "exdyna", "ExDyna with momentum correction at --momentum and max_imbalance=0.05",
             options={"max_imbalance": 0.05}, recipe=Recipe.MOMENTUM_CORRECTION, optimizer="sgd"),
    _library("exdyna-plain", "exdyna", "ExDyna with no momentum correction and no quotas",
             options={**_MC_OFF, "max_imbalance": None}),
    _library("exdyna-mcq02", "exdyna", "ExDyna with momentum correction at --momentum and max_imbalance=0.2",
             options={"max_imbalance": 0.2}, recipe=Recipe.MOMENTUM_CORRECTION, optimizer="sgd"),
    _library("exdyna-adam", "exdyna", "adam='frozen': --adam-warmup dense steps, then the gradient over the frozen "
             "variance", adam="frozen", recipe=Recipe.ADAM_WARMUP, optimizer="adamw"),
    _library("exdyna-adam-g", "exdyna", "adam='frozen-gradient': the division by the frozen variance after the "
             "exchange", adam="frozen-gradient", recipe=Recipe.ADAM_WARMUP, optimizer="adamw"),
    _library("exdyna-adam-u", "exdyna", "adam='update': Adam's moments on each rank, its update exchanged by ExDyna",
             adam="update", optimizer="adamw"),
    _library("dense-adam-u", "dense", "adam='update' averaged densely: the per-rank moments without sparsity",
             adam="update", optimizer="adamw"),
    _diloco_lib("diloco-exdyna-h16", 16, "exdyna", "the library's DiLoCo, H=16, the delta by ExDyna under Nesterov SGD",
                **_EXDYNA_OUTER),
    _diloco_lib("diloco-exdyna-h64", 64, "exdyna", "the library's DiLoCo, H=64, the delta by ExDyna under Nesterov SGD",
                **_EXDYNA_OUTER),
    _diloco_lib("diloco-exdyna-bf16-h16", 16, "exdyna", "diloco-exdyna-h16 with bfloat16 values on the wire",
                outer=Outer.NESTEROV, options={**_BF16, "error_decay": 1.0}),
    _diloco_lib("diloco-dense-h16", 16, "dense", "the library's DiLoCo, H=16, the exact mean delta (its dense "
                "default: Nesterov SGD)"),
    _diloco_lib("sloco-h16", 16, "exdyna", "SparseLoCo's recipe, H=16: ExDyna on the delta, residual decayed by 0.95, "
                "SGD at lr 1", outer=Outer.SGD, options=_SLOCO),
    _diloco_lib("sloco-ef-h16", 16, "exdyna", "sloco-h16 without the residual's decay", outer=Outer.SGD),
    _diloco_lib("sloco-h64", 64, "exdyna", "SparseLoCo's recipe with 64 inner steps", outer=Outer.SGD, options=_SLOCO),
    _diloco_lib("sloco-bf16-h16", 16, "exdyna", "sloco-h16 with bfloat16 values on the wire", outer=Outer.SGD,
                options={**_BF16, **_SLOCO}),
    _diloco_lib("sloco-h4", 4, "exdyna", "SparseLoCo's recipe with 4 inner steps", outer=Outer.SGD, options=_SLOCO),
    _diloco_lib("sloco-h8", 8, "exdyna", "SparseLoCo's recipe with 8 inner steps", outer=Outer.SGD, options=_SLOCO),
    _diloco("diloco-h4", 4, "DiLoCo as torchft runs it: 4 local steps, then the mean delta by Nesterov SGD"),
    _diloco("diloco-h8", 8, "DiLoCo as torchft runs it: 8 local steps, then the mean delta by Nesterov SGD"),
    _library("exdyna-demo", "exdyna", "adam='demo': DeMo's decoupled momentum (the residual, decayed by 0.9), "
             "lr * sign applied", adam="demo", optimizer="adamw"),
    _library("exdyna-demo99", "exdyna", "adam='demo' at beta1 0.99", adam="demo", beta1=0.99, optimizer="adamw"),
    _library("exdyna-demo999", "exdyna", "adam='demo' at beta1 0.999", adam="demo", beta1=0.999, optimizer="adamw"),
    _hook("ddp-exdyna-demo999", "model", "exdyna-demo999 through DDP and the model-scope hook", adam="demo",
          beta1=0.999, optimizer="adamw"),
    _library("exdyna-demo999-ov", "exdyna", "exdyna-demo999 with overlap=True: each update applied one step late",
             adam="demo", beta1=0.999, options={"overlap": True}, optimizer="adamw"),
    _library("exdyna-demo999-mean", "exdyna", "exdyna-demo999 gathering the 32-bit means, not their signs",
             adam="demo", beta1=0.999, options={"output": "mean"}, same_arithmetic="exdyna-demo999",
             optimizer="adamw"),
    _library("exdyna-demo999-bf16", "exdyna", "exdyna-demo999 with its values summed in bfloat16", adam="demo",
             beta1=0.999, options=_BF16, optimizer="adamw"),
    _library("exdyna-live", "exdyna", "adam='live' by name: the raw gradient exchanged, AdamW's moments from the "
             "average", adam="live"),
    _library("exdyna-demoage", "exdyna", "adam='demo-age': each sign scaled by the root of its age", adam="demo-age",
             optimizer="adamw"),
    _library("exdyna-demoage-fp8", "exdyna", "exdyna-demoage with float8 e4m3fn values: what adam='auto' runs",
             adam="demo-age", options={"wire_dtype": AUTO_WIRE}, optimizer="adamw"),
    _library("exdyna-demoage999", "exdyna", "adam='demo-age' at beta1 0.999", adam="demo-age", beta1=0.999,
             optimizer="adamw"),
    _library("exdyna-demoage999-bf16", "exdyna", "exdyna-demoage999 with bfloat16 values", adam="demo-age",
             beta1=0.999, options=_BF16, optimizer="adamw"),
    _library("exdyna-demoage999-int8", "exdyna", "exdyna-demoage999 with 8-bit values (a scale per 128)",
             adam="demo-age", beta1=0.999, options={"wire_dtype": "int8"}, optimizer="adamw"),
    _library("exdyna-demoage999-fp8", "exdyna", "exdyna-demoage999 with float8 e4m3fn values (a scale per 128)",
             adam="demo-age", beta1=0.999, options={"wire_dtype": "float8_e4m3fn"}, optimizer="adamw"),
    # sharded data parallelism: FSDP2 with its own reduce-scatter, and with the library's sparse one
    _fsdp("fsdp", "torch fully_shard over gloo, every block and the root: parameters gathered, gradients "
          "reduce-scattered densely in float32"),
    _fsdp("fsdp-bf16", "fully_shard with MixedPrecisionPolicy(reduce_dtype=bfloat16): the reduce-scatter in "
          "bfloat16", options={"reduce_dtype": "bfloat16"}),
    MethodSpec("fsdp-exdyna", Kind.FSDP_LIB, "fully_shard with ShardedExchange: ExDyna's sparse reduce-scatter "
               "at --density, the optimiser on each rank's shard", sparsifier="exdyna"),
)

#: every method by name, in the order ``--help`` lists them
METHODS: dict[str, MethodSpec] = {s.name: s for s in _SPECS}
#: the protocol's default ``--methods``
DEFAULT_METHODS = tuple(s.name for s in _SPECS if s.default)
