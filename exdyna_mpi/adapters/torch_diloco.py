"""DiLoCo for PyTorch: local steps, then an outer step on the averaged parameter delta, exchanged
by any sparsifier of ``exdyna_mpi.available()`` with error feedback.

    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    opt = DiLoCo(inner, model, sync_every=4, sparsifier="exdyna", density=0.03)
    for x, y in batches:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

How it runs (DiLoCo, Douglas et al. 2023; torchft's ``DiLoCo``):

1. ``step()`` runs the inner optimizer on this rank's own gradient: no communication.
2. Every ``sync_every`` inner steps, the outer step: the pseudo-gradient ``delta = global - local``
   (one flat vector in the optimizer's parameter order) is averaged over the ranks by the
   sparsifier. ``"dense"`` is DiLoCo as published (the exact mean); ``"exdyna"`` and the others send
   a sparse part and keep the rest in their error-feedback residual, which joins the next outer
   step's delta (SparseLoCo's recipe). ``wire_dtype="bfloat16"`` among ``options`` sends 16-bit
   values, the rounding kept by the sender.
3. The averaged delta is the gradient of the global parameters, and the outer optimizer steps
   them; the local model restarts from the new global parameters. The inner optimizer keeps its
   state across outer steps. By default the outer step follows the exchange: with ``"dense"``,
   DiLoCo's Nesterov SGD (lr 0.7, momentum 0.9, the paper's values) and plain error feedback; with
   a sparse one, SparseLoCo's recipe: the residual decayed by 0.95 after each outer exchange and
   the average applied as it is (SGD at lr 1), the decayed residual taking the place of the outer
   momentum. On the AdamW LM of docs/e2e.md, Nesterov momentum on top of the sparse exchange's
   error feedback ended 28 % above the recipe (results/e2e/2026-11-27-sloco.md).

Every rank holds the same global parameters, and after each outer step the same model, bit for
bit: the averaged delta is bit-identical on every rank and the outer step is elementwise. Buffers
(BatchNorm statistics) stay local, as in torchft. With DDP inside a node, wrap the inner optimizer
of the DDP model and pass a ``comm`` over all ranks: the ranks of a node hold the same delta.

Construction broadcasts rank 0's parameters and buffers. ``state_dict()`` holds the inner
optimizer's state, the global parameters, the outer optimizer's momentum, the position in the
period and the sparsifier's residual, so a run resumed between any two inner steps (with the
model's own ``state_dict()``) continues bit for bit.
"""
from __future__ import annotations

import contextlib
import copy
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import exdyna_mpi
from exdyna_mpi import transport

from ._torch_common import _broadcast_model, _flat_layout, _from_torch, _to_torch, _torch, _wrapped_params
from ._torch_config import EntryConfig, agree_entry, layout_text, optimizer_items
from ._torch_elastic import Elastic, elastic_problem, guarded_step, recover
from ._torch_diloco_reshard import reshard_diloco

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI

__all__ = ["DiLoCo", "nesterov_sgd", "plain_sgd"]

_KEY = "diloco"
_VERSION = 1


def nesterov_sgd(params: Iterable[torch.Tensor], lr: float = 0.7, momentum: float = 0.9) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer, ``DiLoCo``'s default with ``"dense"``.

    Args:
        params: the global parameters.
        lr: the outer learning rate (the paper's 0.7).
        momentum: Nesterov momentum (the paper's 0.9).

    Returns:
        ``torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=True)``.

    Raises:
        ValueError: from ``torch.optim.SGD`` (a negative ``lr``, say).

    Example::

        >>> opt = DiLoCo(inner, model, sync_every=16, sparsifier="exdyna", density=0.03,
        ...              outer_optimizer=nesterov_sgd, error_decay=1.0)   # Nesterov on a sparse exchange
    """
    return _torch().optim.SGD(params, lr=lr, momentum=momentum, nesterov=True)


def plain_sgd(params: Iterable[torch.Tensor], lr: float = 1.0) -> torch.optim.Optimizer:
    """SparseLoCo's outer optimizer, ``DiLoCo``'s default with a sparse exchange: the averaged delta
    applied as it is (the decayed residual takes the place of momentum).

    Args:
        params: the global parameters.
        lr: the outer learning rate (1: the average itself).

    Returns:
        ``torch.optim.SGD(params, lr=lr)``.

    Raises:
        ValueError: from ``torch.optim.SGD`` (a negative ``lr``, say).

    Example::

        >>> opt = DiLoCo(inner, model, sync_every=16, sparsifier="dense",
        ...              outer_optimizer=plain_sgd)   # a plain outer step on the exact mean
    """
    return _torch().optim.SGD(params, lr=lr)


#: ``error_decay`` where it is not given: SparseLoCo's for a sparse exchange, none for the dense one
SPARSE_ERROR_DECAY = 0.95


class DiLoCo:
    """Local steps of ``optimizer``, then an outer step on the sparsely averaged parameter delta.

    Args:
        optimizer: the inner optimizer (any ``torch.optim`` optimizer over the model's parameters).
        model: the ``torch.nn.Module`` whose parameters and buffers are broadcast from rank 0;
            without it, the optimizer's parameters.
        sync_every: inner steps per outer step (DiLoCo's H), an integer >= 1. A sparse exchange
            affords a short period: on the AdamW LM of docs/e2e.md, ``"exdyna"`` at d = 0.03 trained
            best at H = 4 and dense DiLoCo at H = 16 (docs/diloco.md); time your own.
        sparsifier: any name of ``exdyna_mpi.available()``; ``"dense"`` (the default) is DiLoCo's
            exact average.
        density: the sparsifier's density (ignored by ``"dense"``).
        comm: the ranks that average (default ``MPI.COMM_WORLD``).
        outer_optimizer: a factory ``params -> torch.optim.Optimizer`` for the global parameters;
            None (the default): ``nesterov_sgd`` (lr 0.7, momentum 0.9) with ``"dense"``,
            ``plain_sgd`` (lr 1) with any other sparsifier.
        error_decay: the error feedback's decay ``beta`` in (0, 1]: after each outer exchange the
            residual is multiplied by it, so the next one sends from ``beta * residual + delta``
            (SparseLoCo's accumulator, used there with a plain outer SGD at lr 1 in place of
            Nesterov momentum). None (the default): 0.95 with a sparse exchange, 1.0 (plain error
            feedback) with ``"dense"``, whose residual stays empty. Pass both to run DiLoCo's
            Nesterov step on a sparse exchange (``outer_optimizer=nesterov_sgd, error_decay=1.0``).
        broadcast: broadcast rank 0's model at construction (default True).
        elastic: survive a lost rank (Open MPI with ULFM, as ``DistributedOptimizer``'s
            ``elastic``): a failure in an outer step shrinks to the survivors, and ``step()`` raises
            ``exdyna_mpi.RanksLost`` once they have recovered. Refused without fault tolerance.
        **options: the sparsifier's options (``wire_dtype="bfloat16"``, ``max_imbalance``, ...).

    Construction is collective and agreed before the broadcast: the period, the error decay, the
    sparsifier and its options, the inner and outer optimizers' classes and settings, the
    parameters' layout and the model's buffers must be the same on every rank (``_torch_config.py``);
    ``state_dict()`` records them and a load into another configuration is refused. An outer
    exchange skipped on every rank (``nonfinite="skip"``) changes nothing: no outer step, no decay;
    the next ``step()`` tries it again.

    Raises:
        CollectiveError: a bad ``sync_every`` or ``error_decay``, parameters of mixed dtypes or
            devices, or ranks whose configurations differ (on every rank).

    Attributes:
        sparsifier: the sparsifier of the outer exchange; ``stats`` its last stats (``bytes_sent``
            per outer step), None before the first.
        inner_steps: inner steps since the last outer step; ``outer_steps``: outer steps taken.

    Example::

        >>> inner = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
        >>> opt = DiLoCo(inner, model, sync_every=4, sparsifier="exdyna", density=0.03,
        ...              wire_dtype="bfloat16")
        >>> for x, y in batches:
        ...     opt.zero_grad()
        ...     loss_fn(model(x), y).backward()
        ...     opt.step()                       # an outer step every 4 calls
        >>> opt.stats.bytes_sent                 # of the last outer step
        >>> torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"ckpt.{rank}")
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None, *,
                 sync_every: int, sparsifier: str = "dense", density: float = 0.01, comm: MPI.Comm | None = None,
                 outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
                 error_decay: float | None = None, broadcast: bool = True, elastic: bool = False,
                 **options: Any) -> None:
        torch = _torch()
        who = "DiLoCo"
        comm = transport.world() if comm is None else comm
        sparse = sparsifier != "dense"
        if outer_optimizer is None:
            outer_optimizer = plain_sgd if sparse else nesterov_sgd
        if error_decay is None:
            error_decay = SPARSE_ERROR_DECAY if sparse else 1.0

        def plan() -> tuple[tuple[list[Any], int], EntryConfig]:
            """Every check, on this rank only, and the configuration they give; changes nothing."""
            _, params = _wrapped_params(optimizer, model, comm, who)
            if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
                raise ValueError(f"sync_every must be an integer >= 1, got {sync_every!r}")
            if (isinstance(error_decay, bool) or not isinstance(error_decay, (int, float))
                    or not 0.0 < float(error_decay) <= 1.0):
                raise ValueError(f"error_decay must be a number in (0, 1], got {error_decay!r}")
            if sparsifier not in exdyna_mpi.available():
                raise ValueError(f"unknown sparsifier {sparsifier!r}; available: {', '.join(exdyna_mpi.available())}")
            if not isinstance(broadcast, bool):
                raise ValueError(f"broadcast must be True or False, got {broadcast!r}")
            problem = elastic_problem(elastic, who, options=options)
            if problem:
                raise RuntimeError(problem)
            params, numel = _flat_layout(params, who)
            # the outer optimizer's class and settings, read off one built over a one-element stand-in
            outer = outer_optimizer([torch.nn.Parameter(torch.zeros(1, dtype=params[0].dtype))])
            items = {"entry": who, "sync_every": repr(sync_every), "error_decay": repr(float(error_decay)),
                     "sparsifier": sparsifier, "density": repr(1.0 if sparsifier == "dense" else density),
                     **{f"option.{k}": repr(v) for k, v in sorted(options.items())},
                     **optimizer_items(optimizer, "inner"), **optimizer_items(outer, "outer"),
                     "layout": layout_text(params),
                     "buffers": layout_text(list(model.buffers()) if model is not None else []),
                     "broadcast": repr(broadcast), "elastic": repr(elastic)}
            return (params, numel), EntryConfig.of(who, items, unrecorded=("broadcast", "buffers", "elastic"))

        self._exchange = transport.Exchange(comm)
        (self.params, self.numel), self._config = agree_entry(comm, who, plan)
        # agreed: the sparsifier's own checks, then the broadcast, which meets the same sizes on every rank
        self.sparsifier = exdyna_mpi.make(sparsifier, self.numel, 1.0 if sparsifier == "dense" else density, comm,
                                          **options)
        if broadcast:
            _broadcast_model(model, self.params, comm)
        self.optimizer = optimizer
        self.sync_every = sync_every
        self.error_decay = float(error_decay)
        with torch.no_grad():
            self.global_params = torch.nn.Parameter(self._local_flat())
        self.outer = outer_optimizer([self.global_params])
        self.inner_steps = 0
        self.outer_steps = 0
        self.stats: exdyna_mpi.Stats | None = None
        self.comm = comm
        self._elastic = Elastic() if elastic else None
        # a torch.compile'd region that calls step() or sync() breaks its graph here: the outer
        # exchange (MPI, NumPy) runs eagerly
        self._eager_step = torch.compiler.disable(self._step)
        self._eager_sync = torch.compiler.disable(self._sync)

    # ------------------------------------------------------------------ training
    def _local_flat(self) -> torch.Tensor:
        return _torch().cat([p.detach().reshape(-1) for p in self.params])

    def _set_local(self, flat: torch.Tensor) -> None:
        """Copy ``flat`` (the optimizer's parameter order) into the model's parameters."""
        with _torch().no_grad():
            for p, v in zip(self.params, flat.split([p.numel() for p in self.params])):
                p.copy_(v.view_as(p))

    @contextlib.contextmanager
    def global_model(self) -> Iterator[None]:
        """A context in which the model holds the global parameters; the local ones come back on exit.

        For evaluating the global parameters in the middle of a period. Not collective.

        Returns:
            A context manager (it yields None).

        Example::

            >>> with opt.global_model():
            ...     val_loss = evaluate(model)
        """
        local = self._local_flat()
        self._set_local(self.global_params.detach())
        try:
            yield
        finally:
            self._set_local(local)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's parameter groups (set ``"lr"`` there for a schedule).

        Or give the inner optimizer itself to a ``torch.optim.lr_scheduler``.
        """
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad``.

        Args:
            set_to_none: passed to the inner optimizer's ``zero_grad``.
        """
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: None = None) -> exdyna_mpi.Stats | None:
        """The inner optimizer's step; every ``sync_every``-th call, then the outer step (collective).

        Args:
            closure: must be None.

        Returns:
            The outer exchange's stats when this call took an outer step, else None.

        Raises:
            ValueError: a closure was given.
            StepError: the outer exchange refused the step (as ``sync()``).
        """
        return self._eager_step(closure)

    def _step(self, closure: None) -> exdyna_mpi.Stats | None:
        if closure is not None:
            raise ValueError("DiLoCo.step: closures are not supported")
        self.optimizer.step()
        self.inner_steps += 1
        if self.inner_steps >= self.sync_every:
            return self.sync()
        return None

    def sync(self) -> exdyna_mpi.Stats:
        """The outer step now (collective).

        Averages ``global - local`` through the sparsifier (error feedback in its residual), steps the
        global parameters with the outer optimizer and restarts the local model from them.

        Returns:
            The sparsifier's stats of this exchange.

        Raises:
            StepError: a non-finite delta on some rank (raised on every rank; nothing changes).
            RanksLost: ``elastic=True`` and a rank was lost during the outer step: the survivors
                recovered (docs/faults.md, "Elastic training"); every local model restarts from
                the global parameters.
        """
        return self._eager_sync()

    def _sync(self) -> exdyna_mpi.Stats:
        return guarded_step(self, self._elastic, self._sync_once)

    def _sync_once(self) -> exdyna_mpi.Stats:
        torch = _torch()
        with torch.no_grad():
            delta = self._local_flat()
            torch.sub(self.global_params.detach(), delta, out=delta)   # global - local, in the same buffer
            self.sparsifier.step(delta, out=delta)
            if self.sparsifier.stats is not None and self.sparsifier.stats.skipped:
                # skipped on every rank (nonfinite="skip"): no outer step, no decay; the local
                # model and the period go on, and the next step() tries the exchange again
                self.stats = self.sparsifier.stats
                return self.stats
            # after the step, not before it: a refused step leaves the residual as it was
            self.sparsifier.scale_residual(self.error_decay)
            self.global_params.grad = delta
            self.outer.step()
            self.global_params.grad = None
        self._set_local(self.global_params.detach())
        self.inner_steps = 0
        self.outer_steps += 1
        self.stats = self.sparsifier.stats
        assert self.stats is not None   # the step above set them
        return self.stats

    # ------------------------------------------------------------------ elastic (_torch_elastic.py)
    def recover(self) -> exdyna_mpi.RanksLost:
        """Recover from a lost rank that the caller's own MPI call reported (``elastic=True``).

        As ``DistributedOptimizer.recover``. Collective over the survivors.

        Returns:
            The ``RanksLost`` (not raised here).

        Raises:
            RuntimeError: built without ``elastic=True``.
        """
        if self._elastic is None:
            raise RuntimeError("DiLoCo.recover: built without elastic=True")
        return recover(self, self._elastic)

    def _elastic_comm(self) -> MPI.Comm:
        return self.comm

    def _elastic_state(self) -> dict[str, Any]:
        return self.state_dict()

    def _elastic_shared(self) -> list[torch.Tensor]:
        return [self.global_params.data]

    def _elastic_rebuild(self, comm: MPI.Comm, dicts: list[dict[str, Any]]) -> None:
        old = self.sparsifier
        self.sparsifier = exdyna_mpi.make(old.name, old.numel, old.density, comm, **old.options)
        self.comm, self._exchange = comm, transport.Exchange(comm)
        reshard_diloco(self, dicts, complete=False)

    def close(self) -> None:
        """Close the sparsifier (collective in deadline mode). Idempotent."""
        self.sparsifier.close()

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the inner optimizer's and the outer step's.

        Save the model's own ``state_dict()`` beside it: between outer steps it holds the local model.

        Returns:
            ``{"inner": the inner optimizer's state, "diloco": global parameters, outer optimizer,
            position in the period, the sparsifier's state}``, as tensors and plain values
            (``torch.save`` / ``torch.load(weights_only=True)`` round-trip it).
        """
        return {"inner": self.optimizer.state_dict(),
                _KEY: {"version": _VERSION, "config": self._config.record(),
                       "sync_every": self.sync_every, "error_decay": self.error_decay,
                       "inner_steps": self.inner_steps,
                       "outer_steps": self.outer_steps, "global": self.global_params.detach().clone(),
                       "outer": copy.deepcopy(self.outer.state_dict()),
                       "sparsifier": _to_torch(self.sparsifier.state_dict())}}

    def _check(self, d: Any) -> tuple[str | None, dict[str, Any] | None]:
        """This rank's problem with ``d`` (None: none) and its outer part."""
        torch = _torch()
        try:
            own = d[_KEY]
            if own["version"] != _VERSION:
                return f"version {own['version']!r}, this DiLoCo writes {_VERSION}", None
            if own["sync_every"] != self.sync_every:
                return f"the dict has sync_every={own['sync_every']!r}, this DiLoCo {self.sync_every}", None
            if float(own.get("error_decay", 1.0)) != self.error_decay:   # (dicts before it had none: 1.0)
                return (f"the dict has error_decay={own.get('error_decay')!r}, this DiLoCo "
                        f"{self.error_decay}"), None
            mismatch = self._config.mismatch(own.get("config"))
            if mismatch:
                return mismatch, None
            inner_steps, outer_steps = int(own["inner_steps"]), int(own["outer_steps"])
            if inner_steps < 0 or outer_steps < 0:   # past sync_every after an outer exchange that skipped
                return f"inner_steps={inner_steps}, outer_steps={outer_steps} out of range", None
            g = own["global"]
            want = self.global_params.dtype
            if not isinstance(g, torch.Tensor) or tuple(g.shape) != (self.numel,) or g.dtype != want:
                return (f"global parameters of shape {tuple(getattr(g, 'shape', ()))} and dtype "
                        f"{getattr(g, 'dtype', None)}, the model has ({self.numel},) {self.global_params.dtype}"), None
            if not bool(torch.isfinite(g).all()):
                return "the global parameters hold non-finite values", None
            for st in own["outer"]["state"].values():
                for v in st.values():
                    if isinstance(v, torch.Tensor) and v.dim() and tuple(v.shape) != (self.numel,):
                        return f"the outer optimizer's state has a tensor of shape {tuple(v.shape)}", None
            d["inner"]   # noqa: B018 - present
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            return f"not a DiLoCo.state_dict() output ({e!r})", None
        return None, own

    def load_state_dict(self, d: Any, reshard: bool = False) -> None:
        """Restore ``state_dict()`` output; with the model's own state, the run goes on bit for bit.

        Collective and all or nothing: every rank checks its dict, the ranks agree once, then the
        sparsifier loads its state (it checks and agrees again).

        With ``reshard=True`` the run resumes at another number of ranks: ``d`` is every old rank's
        ``state_dict()`` (the same sequence on every rank); the global parameters, outer optimizer
        and ``outer_steps`` are old rank 0's (checked equal), the residual and the inner optimizer's
        floating state the mean over the old ranks, and every local model restarts from the global
        parameters with ``inner_steps = 0`` (the local steps since the last outer step are dropped;
        ``_torch_diloco_reshard.py``, docs/faults.md).

        Args:
            d: this rank's ``state_dict()`` output (``reshard=True``: every old rank's).
            reshard: load dicts saved at another number of ranks.

        Raises:
            CollectiveError: any rank's problem, naming each (raised on every rank; nothing changes).
        """
        if reshard:
            reshard_diloco(self, d, complete=True)
            return
        problem, own = self._check(d)   # own: None only with a problem
        inner_before = copy.deepcopy(self.optimizer.state_dict())
        outer_before = copy.deepcopy(self.outer.state_dict())
        if problem is None:
            assert own is not None
            try:   # torch's own checks of the inner and outer optimizers' dicts, on this rank
                self.optimizer.load_state_dict(d["inner"])
                self.outer.load_state_dict(own["outer"])
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                problem = f"an optimizer refused its state ({e})"
        words = [-1, -1] if own is None else [int(own["inner_steps"]), int(own["outer_steps"])]
        try:
            got = transport.agree_problems(self._exchange, problem,
                                           "DiLoCo.load_state_dict refused on all ranks, state unchanged", words)
            if (got != got[0]).any():
                raise exdyna_mpi.CollectiveError("DiLoCo.load_state_dict refused on all ranks, state unchanged: "
                                                 f"ranks hold different positions {got.tolist()}")
            assert own is not None   # agree_problems raised on every rank otherwise
            self.sparsifier.load_state_dict(_from_torch(own["sparsifier"]))
        except exdyna_mpi.CollectiveError:
            self.optimizer.load_state_dict(inner_before)
            self.outer.load_state_dict(outer_before)
            raise
        with _torch().no_grad():
            self.global_params.copy_(own["global"])
        self.inner_steps, self.outer_steps = int(own["inner_steps"]), int(own["outer_steps"])
