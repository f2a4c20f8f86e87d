"""A DDP communication hook: ``ddp.register_comm_hook(ExDynaHookState(...), exdyna_hook)``.

DDP hands the hook one bucket of gradients at a time (in bucket-index order, on every rank) and
waits, at the end of ``backward()``, for the futures the hook returned. The hook only works out where
the bucket's parameters sit and enqueues the work; one worker thread per state runs the exchanges in
FIFO order, so every rank issues its collectives in the same order while the backward thread goes on.

Two scopes:

- ``scope="model"`` (default): one sparsifier over the whole model's gradient, so density and
  threshold hold for the model as a whole. The buckets of an iteration are copied into one
  model-wide vector laid out in the *canonical order*: the order in which the parameters appear
  across the buckets of the first iteration a model is seen (DDP's first iteration after
  construction uses its initial bucket assignment, the same for the same model and
  ``bucket_cap_mb``). Later iterations (DDP rebuilds its buckets after the first, in another order)
  find each parameter's offset by identity. The exchange runs when the bucket with ``is_last()``
  arrives: it does not overlap with backward, it only keeps the backward thread free.
- ``scope="bucket"``: one sparsifier per bucket, keyed by the tuple of its parameters' canonical
  indices (not by bucket index, which DDP gives to other parameters after a rebuild). Each exchange
  starts as soon as its bucket arrives, overlapping backward. A key seen for the first time (DDP's
  rebuild after the first iteration) gets a fresh sparsifier whose error-feedback residual is
  carried over, parameter by parameter, from the sparsifiers that held those parameters; its
  threshold controller starts afresh. The first iteration of a model not seen before (a resumed run:
  new model, new DDP, initial buckets) while the state holds sparsifiers, after a load or unpickle,
  is exchanged with the held grouping instead (all buckets gathered first), so that a resumed run
  reproduces the uninterrupted one bit for bit once DDP rebuilds to that grouping.

The collectives run on a private duplicate of ``comm`` that the worker makes, so the user's own
calls on ``comm`` never meet them.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

import exdyna_mpi
from exdyna_mpi import transport
from exdyna_mpi.transport.group import GroupTransport

from ._torch_common import _flat_layout, _from_torch, _to_torch, _torch
from ._torch_config import EntryConfig, agree_entry, layout_text, optimizer_items
from ._torch_options import (RECIPE_DEFAULTS, Recipe, TrainingOptions, check_state, give_back_momentum, recipe_for,
                             take_momentum)
from .torch_adam import AdamPath, make_adam_path
from .torch_adam import check_mode as check_adam_mode

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI

__all__ = ["ExDynaHookState", "exdyna_hook"]

SCOPES = ("model", "bucket")
_VERSION = 1
Key = tuple[int, ...]
Layout = list[tuple[int, tuple[int, ...]]]
Run = tuple[int, int, int]   # (offset in the bucket, offset in the model-wide vector, length)
_STEP_HOOKS = "_exdyna_hook_step_hooks"   # the optimizer's attribute: the step hooks of the state that steps it


class _LayoutError(ValueError):
    """The model's parameters do not match the state's layout. The layout comes from the model,
    which DDP checks to be the same on every rank, so every rank raises it together."""


class _StepOrderError(RuntimeError):
    """An exchange began while the last one's Adam-path update was still to be applied by
    ``optimizer.step()``. Every rank runs the same training loop, so every rank raises it together."""


#: the errors every rank raises together (their causes are the same on every rank): delivered to the
#: futures, so backward() raises them everywhere, without ending the job
_SAME_EVERYWHERE = (_LayoutError, _StepOrderError)


class _Job:
    """One bucket of one iteration, as the backward thread saw it."""

    __slots__ = ("buf", "fut", "key", "runs", "last", "new_model", "total", "copied", "error")

    def __init__(self, buf: torch.Tensor, fut: torch.futures.Future[torch.Tensor], key: Key, runs: list[Run],
                 last: bool, new_model: bool, total: int, error: BaseException | None) -> None:
        self.buf = buf              # the bucket's flat buffer; the result is written back into it
        self.fut = fut
        self.key = key              # canonical indices of its parameters, in bucket order
        self.runs = runs            # (offset in buf, offset in the model-wide vector, length), merged
        self.last = last
        self.new_model = new_model  # first iteration of a model not seen before
        self.total = total          # the model's numel (0 while the first iteration derives it)
        self.copied = False
        self.error = error          # a layout error found on the backward thread


class ExDynaHookState:
    """The state of ``exdyna_hook``: the sparsifier(s), the canonical parameter layout, the worker.

    Args:
        sparsifier: any name of ``exdyna_mpi.available()`` (``"dense"`` gives the plain MPI average);
            ``density`` and ``options`` go to it.
        comm: default ``MPI.COMM_WORLD``; must span the same ranks, in the same order, as DDP's
            process group.
        scope: ``"model"`` or ``"bucket"`` (module docstring).
        optimizer: the optimizer that steps on the hook's gradients. Given, the hook runs
            ``DistributedOptimizer``'s training recipe (``_torch_options.py``) around the exchange,
            with the same options and defaults: ``momentum_correction="auto"`` moves an SGD's
            momentum before the exchange (the optimizer steps without its ``momentum``, taken out of
            the param groups by its step hooks while ``step()`` runs and put back after) and adds ExDyna's
            quotas; ``momentum_masking``, ``clip_norm``, ``warmup_steps``, ``density_warmup`` and
            ``density_warmup_steps`` as there. The model-wide vector is then laid out in the
            optimizer's parameter order, so DDP with this hook and ``DistributedOptimizer`` with the
            same options produce the same parameters bit for bit (tested for momentum SGD with and
            without the warm-ups and clipping, and for AdamW). Needs ``scope="model"`` and the
            optimizer holding exactly DDP's parameters. Without it (the default) the hook is the
            plain sparse average, whatever the optimizer, and the recipe options are refused.
        adam: with ``optimizer=`` a ``torch.optim.Adam``/``AdamW``, ``DistributedOptimizer``'s Adam path, with its
            default: ``"auto"`` runs ``"demo-age"`` for Adam/AdamW with ``"exdyna"`` and ``"live"`` (the optimizer steps
            on the exchanged gradient) otherwise; ``"update"``, ``"demo"``, ``"demo-age"``, ``"frozen"``,
            ``"frozen-gradient"``: see ``DistributedOptimizer``. The paths that apply their own update take over
            ``optimizer.step()`` through the optimizer's step hooks: ``step()`` applies the exchanged update to every
            parameter and the optimizer's own step sees no gradient (``.grad`` is back once it returns). Each ``step()``
            needs one exchange (one DDP ``backward()`` outside ``no_sync``) since the last, and an exchange refuses to
            start while the last one's update has not been applied (a state made later with the same optimizer takes its
            step over: the newest one counts). The path's state (moments, step count) is in ``state_dict()`` under
            ``"adam"``; with ``adam="demo"``/``"demo-age"`` the momentum is the sparsifier's residual. The update comes
            from the exchanged vector, not from ``.grad``: clip with ``clip_norm=`` (before the exchange). Under
            ``"demo"``/``"demo-age"`` (the AdamW default) ``.grad`` holds the exchanged signs and the update reads only
            them, so the standard loop's ``clip_grad_norm_`` (a positive rescale: every sign kept) changes nothing and
            is accepted. Under the other paths a ``.grad`` edited between ``backward()`` and ``step()`` (a binding
            ``clip_grad_norm_``, a ``GradScaler``'s unscaling), whose change would be lost, makes ``step()`` raise
            ``CollectiveError`` on every rank with nothing applied; with ``.grad`` put back, ``step()`` applies the
            update.

    Raises:
        CollectiveError: a bad option on any rank, or ranks that differ (on every rank).
        CollectiveError: from ``optimizer.step()`` (an Adam path that owns the step): ``.grad``
            edited since ``backward()`` on some rank.
        RuntimeError: MPI without ``MPI_THREAD_MULTIPLE``: the exchanges run on a worker thread
            while the main thread may call MPI.

    ``state.stats``: the last exchange's ``exdyna_mpi.Stats`` (``scope="bucket"``: a dict from bucket
    key to ``Stats``). ``state.step``: iterations completed. ``state.error``: the exception of the
    last failed exchange (DDP re-raises it from ``backward()`` inside a ``RuntimeError``).
    ``state.close()`` stops the worker (collective: it frees the private communicator).

    ``state_dict()`` / ``load_state_dict()`` checkpoint it (every rank its own: residuals differ):
    CPU tensors and plain values, for ``torch.save`` / ``torch.load(weights_only=True)``; the dict
    records the configuration, and a load into another configuration is refused on every rank.

    Construction is collective over ``comm`` (a ``CollectiveError`` on every rank when any rank's
    arguments are refused or the ranks' configurations differ: ``_torch_config.py``). With
    ``optimizer=``, the optimizer's param groups keep the user's own settings: the momentum the
    recipe moves is out of them only while ``optimizer.step()`` runs, and after an exchange that
    skipped the step (``nonfinite="skip"``) the step moves nothing (no decay, no momentum).
    Pickling keeps the same, without communicator, thread or futures; after unpickling ``comm`` is
    ``MPI.COMM_WORLD`` unless ``state.comm`` is set before the first iteration. A state with
    ``optimizer=`` is not picklable (it holds the optimizer): save its ``state_dict()``.

    Example::

        >>> ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
        >>> opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        >>> state = ExDynaHookState("exdyna", density=0.01, optimizer=opt)   # DistributedOptimizer's recipe
        >>> ddp.register_comm_hook(state, exdyna_hook)
        >>> loss_fn(ddp(x), y).backward()     # .grad holds the averaged sparse gradient
        >>> opt.step()
        >>> state.stats.density, state.stats.bytes_sent
        >>> torch.save({"model": model.state_dict(), "hook": state.state_dict()}, f"ckpt.{rank}")
    """

    def __init__(self, sparsifier: str = "exdyna", density: float = 0.01, comm: MPI.Comm | None = None, *,
                 scope: str = "model", optimizer: torch.optim.Optimizer | None = None, clip_norm: float | None = None,
                 warmup_steps: int = 0, momentum_correction: float | str = "auto", momentum_masking: bool = True,
                 density_warmup: Sequence[float] | None = None, density_warmup_steps: int | None = None,
                 adam: str = "auto", **options: Any) -> None:
        who = "ExDynaHookState"
        recipe_args = dict(clip_norm=clip_norm, warmup_steps=warmup_steps, momentum_correction=momentum_correction,
                           momentum_masking=momentum_masking, density_warmup=density_warmup,
                           density_warmup_steps=density_warmup_steps)

        def plan() -> tuple[tuple[dict[str, Any], Recipe | None, list[Any] | None, AdamPath | None], EntryConfig]:
            """Every check, on this rank only, and the configuration they give; changes nothing."""
            opts = dict(options)
            if scope not in SCOPES:
                raise ValueError(f"{who}: scope must be one of {SCOPES}, got {scope!r}")
            if sparsifier not in exdyna_mpi.available():
                raise ValueError(f"{who}: unknown sparsifier {sparsifier!r}; "
                                 f"available: {', '.join(exdyna_mpi.available())}")
            recipe: Recipe | None = None
            params: list[torch.Tensor] | None = None
            adam_path: AdamPath | None = None
            items = {"entry": who, "sparsifier": sparsifier, "density": repr(density), "scope": scope}
            if optimizer is None:
                given = [k for k, v in recipe_args.items() if v != RECIPE_DEFAULTS[k]]   # none may differ
                given += ["adam"] if adam not in ("auto", "live") else []
                if given:
                    raise ValueError(f"{who}: {', '.join(given)} belong to the training recipe, which runs only "
                                     "with optimizer= (the optimizer that steps on the hook's gradients)")
                items.update((f"option.{k}", repr(v)) for k, v in sorted(opts.items()))
            else:
                if scope != "model":
                    raise ValueError(f"{who}: optimizer= needs scope='model' (the recipe clips and "
                                     "momentum-corrects the model's whole gradient before one exchange)")
                params, _ = _flat_layout([p for g in optimizer.param_groups for p in g["params"]], who)
                check_adam_mode(optimizer, adam, warmup_steps, who)
                adam_path = make_adam_path(optimizer, params, adam, who, sparsifier=sparsifier)
                if adam_path is not None:
                    opts = adam_path.sparsifier_options(sparsifier, opts)
                recipe = recipe_for(optimizer, sparsifier, density, opts, who=who, **recipe_args)
                opts = recipe.options
                items.update(recipe.items())
                items.update({"adam": "live" if adam_path is None else adam_path.mode, **optimizer_items(optimizer),
                              "layout": layout_text(params)})
            if not GroupTransport.thread_multiple():
                raise RuntimeError(f"{who} needs MPI initialised with MPI_THREAD_MULTIPLE (mpi4py's default, "
                                   "see mpi4py.rc.thread_level): its exchanges run on a worker thread")
            return (opts, recipe, params, adam_path), EntryConfig.of(who, items)

        self._user_comm = comm
        if getattr(self, "_unpickling", False):   # one rank's business: the first iteration's loads agree
            (options, recipe, params, adam_path), config = plan()
        else:
            (options, recipe, params, adam_path), config = agree_entry(self.comm, who, plan)
        self._config = config
        self.sparsifier, self.density, self.scope, self.options = sparsifier, density, scope, dict(options)
        self.optimizer = optimizer
        self._recipe_config: Recipe | None = recipe
        self._recipe: TrainingOptions | None = None   # built by the worker, on the private communicator
        self._adam: AdamPath | None = adam_path        # adam= other than "live" (optimizer= given)
        self._adam_due = False    # an exchange ran whose Adam-path update optimizer.step() has yet to apply
        self._last_sp: Any = None   # the sparsifier of the last model-wide exchange (a warm-up's or the main one)
        self._stashed: list[tuple[torch.Tensor, torch.Tensor | None]] = []   # .grad held away from the optimizer
        self._momenta: list[Any] | None = None   # the groups' own momentum while the optimizer steps without it
        self.step = 0
        self.stats: Any = None
        self.error: BaseException | None = None
        #: the canonical layout, (numel, shape) per parameter; None until the first iteration
        self.layout: Layout | None = None
        self._offsets: list[int] = [0]
        # backward thread: id(param) -> (weak reference, canonical index), for the model seen last
        self._index: dict[int, tuple[weakref.ref, int]] | None = None
        self._in_iter = False
        self._deriving = False
        self._iter_error: _StepOrderError | None = None   # backward thread: this iteration's misuse
        self._new_index: dict[int, tuple[weakref.ref, int]] = {}
        self._new_layout: Layout = []
        self._new_total = 0
        self._iter_dtype: Any = None
        # worker thread
        self._worker = transport.Worker("exdyna-ddp-hook")       # the thread and the private communicator
        self._to_load: dict[str, Any] | None = None   # sparsifier states waiting for the worker
        self._after_load = False
        self._iter_started = False
        self._pending: list[_Job] = []
        self._failed: BaseException | None = None
        self._regroup = False
        self._sp: Any = None                          # scope="model"
        self._flat: torch.Tensor | None = None
        self._sps: dict[Key, Any] = {}                # scope="bucket": key -> sparsifier
        self._owner: dict[int, Key] = {}              # canonical index -> the key holding its residual
        self._covered = 0                             # optimizer=: parameters seen in this iteration's buckets
        if recipe is not None and params is not None:   # optimizer= given: both set above
            # the optimizer's order is the canonical one: the model-wide vector is laid out as
            # DistributedOptimizer's flat gradient, so both entry points exchange the same vector
            self._set_layout([(p.numel(), tuple(p.shape)) for p in params])
            self._index = {id(p): (weakref.ref(p), i) for i, p in enumerate(params)}
        if optimizer is not None:
            # one state steps an optimizer: a state made earlier for it gives its step hooks up
            for handle in getattr(optimizer, _STEP_HOOKS, ()):
                handle.remove()
            # the optimizer's own step() applies the Adam path's update, steps without the momentum
            # the recipe moved and moves nothing after a skipped exchange: its step hooks run inside
            # it, whatever wraps step() (LR schedulers, profilers, a GradScaler)
            handles = (optimizer.register_step_pre_hook(self._before_optimizer_step),
                       optimizer.register_step_post_hook(self._after_optimizer_step))
            setattr(optimizer, _STEP_HOOKS, handles)

    # ------------------------------------------------------------------ the Adam path's step
    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The optimizer's step pre-hook (``optimizer=`` given): after a skipped exchange, hold every
        gradient away so the step moves nothing; else apply the last exchange's update when the Adam
        path owns the step (holding the gradients away so the optimizer's own step changes nothing),
        and take the momentum the recipe moved out of the param groups until the step returns."""
        self._restore_optimizer()   # a step that raised left them held
        adam = self._adam
        skipped = self.stats is not None and bool(getattr(self.stats, "skipped", False))
        if adam is not None and not self._adam_due:
            raise RuntimeError(f"ExDynaHookState(adam={adam.mode!r}): optimizer.step() without an exchange since "
                               "the last step; run one DDP backward() (outside no_sync) before each step()")
        if skipped:   # the exchange skipped the step on every rank: nothing moves, nothing decays
            self._stashed = [(p, p.grad) for g in optimizer.param_groups for p in g["params"]]
        elif adam is not None and adam.owns_step:
            # the update comes from the exchanged vector: a .grad changed since backward() (a user's
            # clip_grad_norm_, a GradScaler's unscale_) would be silently lost, so it is refused (not
            # after an exchange refused for step order, whose backward left DDP's partial work in .grad),
            # unless the path reads only signs and the edit kept every sign (a positive rescale: a clip)
            problem = None if self._iter_error is not None else _edited_grads(adam.slices, self._held_flat(),
                                                                            signs=adam.signs_only)

            def apply() -> None:   # on the worker, after its queued work: the vector and sparsifier are its
                transport.agree_problems(transport.Exchange(self._working_comm()), problem,
                                         f"ExDynaHookState(adam={adam.mode!r}): optimizer.step() refused on every "
                                         "rank, nothing applied")
                adam.apply(self._held_flat(), False, self._last_sp)

            self._call(apply)   # a refusal raises here: the update stays due, for a step with .grad put back
            self._stashed = [(p, p.grad) for p, *_ in adam.slices]
        self._adam_due = False
        for p, _ in self._stashed:
            p.grad = None
        self._momenta = take_momentum(optimizer, self._recipe_config)

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The optimizer's step post-hook: give the parameters their gradients and the param groups
        their momentum back (the user's optimizer state never keeps the hook's settings)."""
        self._restore_optimizer()

    def _restore_optimizer(self) -> None:
        for p, g in self._stashed:
            p.grad = g
        self._stashed = []
        if self._momenta is not None and self.optimizer is not None:
            give_back_momentum(self.optimizer, self._momenta)
            self._momenta = None

    # ------------------------------------------------------------------ communicator and worker
    @property
    def comm(self) -> MPI.Comm:
        """The ranks of the exchange (``MPI.COMM_WORLD`` unless given); settable before the first iteration.

        Raises:
            RuntimeError: set while the private communicator exists (from the first iteration or a
                load until ``close()``).
        """
        return transport.world() if self._user_comm is None else self._user_comm

    @comm.setter
    def comm(self, comm: MPI.Comm) -> None:
        if self._comm is not None:
            raise RuntimeError("ExDynaHookState.comm: set it before the first iteration (or after close())")
        self._user_comm = comm

    @property
    def _comm(self) -> MPI.Comm | None:
        """The worker's private communicator (None before the first iteration or load)."""
        return self._worker.comm

    def _working_comm(self) -> MPI.Comm:
        """The worker's communicator once it has one, else ``comm`` (a call before the first iteration)."""
        return self._comm if self._comm is not None else self.comm

    def _submit(self, fn: Callable[[], None] | None) -> None:
        self._worker.submit(fn)

    def _call(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the worker after the work queued so far (directly when there is no worker);
        its exception is raised here."""
        return self._worker.call(fn, self.comm, "ExDynaHookState: the worker's queued exchanges")

    def close(self) -> None:
        """Stop the worker and free the private communicator; the state stays usable. Idempotent.

        Runs after the work queued so far; closes the sparsifiers (a deadline exchange completes its
        late messages). Collective once an iteration has run or a state was loaded. The next
        iteration restarts the worker and rebuilds the sparsifiers from their state.
        """
        if not self._worker.running and self._comm is None:
            return

        def stop():
            if self._sp is not None or self._sps or self._recipe is not None:
                self._to_load = self._snapshot()
            for sp in [self._sp, *(self._sps[k] for k in sorted(self._sps))]:
                _close(sp)
            if self._recipe is not None:
                self._recipe.close()
            self._sp, self._sps, self._owner, self._flat, self._recipe = None, {}, {}, None, None
            self._worker.free()

        self._call(stop)
        self._worker.stop(None)

    # ------------------------------------------------------------------ checkpoints
    def _snapshot(self) -> dict[str, Any]:
        d = {"version": _VERSION, "scope": self.scope, "sparsifier": self.sparsifier, "density": self.density,
             "layout": None if self.layout is None else [[n, list(s)] for n, s in self.layout], "step": self.step}
        if self._to_load is not None:   # loaded, not built yet
            d["state"] = self._to_load["state"]
        elif self.scope == "model":
            d["state"] = None if self._sp is None else self._sp.state_dict()
        else:
            d["state"] = [[list(k), self._sps[k].state_dict()] for k in sorted(self._sps)]
        if self._recipe_config is not None:
            if self._to_load is not None:
                d["recipe"] = self._to_load.get("recipe")
            else:   # None: no iteration yet
                d["recipe"] = None if self._recipe is None else _recipe_to_host(self._recipe.state_dict())
        if self._adam is not None:
            d["adam"] = _recipe_to_host(self._adam.state_dict())
        return d

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, taken after the work queued so far. Call it between iterations.

        Returns:
            The configuration it runs (under ``"config"``), the sparsifier(s)' state dicts, the
            canonical layout, the step counter and, with ``optimizer=``, the recipe's state under
            ``"recipe"`` (and with ``adam=``, the Adam path's under ``"adam"``): CPU tensors and
            plain Python values, so ``torch.save`` and ``torch.load(weights_only=True)`` round-trip it.
        """
        return _to_torch(dict(self._call(self._snapshot), config=self._config.record()))

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output between iterations. Collective over ``comm``.

        Every rank loads its own rank's dict, all or nothing: every rank checks its dict (version,
        scope, sparsifier, density, layout, step, bucket keys), the ranks agree once, then the
        sparsifiers are rebuilt from the dicts (each ``Sparsifier.load_state_dict`` checks its
        residual and extra state and agrees again). A model whose parameters do not match the layout
        raises (every rank) at the first iteration, from ``backward()``. Set ``comm`` before loading.

        Args:
            d: this rank's ``state_dict()`` output.

        Raises:
            CollectiveError: any rank's problem (a ``ValueError``, raised on every rank, naming the
                ranks and causes); every rank's state stays as it was.
        """
        problem, got, layout = self._check_dict(d)
        self._call(lambda: self._load(problem, got, layout))

    def _check_dict(self, d: Any) -> tuple[str | None, dict[str, Any] | None, Layout | None]:
        """This rank's checks of a ``state_dict()`` output: (its problem or None, the fields, the layout)."""
        try:
            got = {k: d[k] for k in ("version", "scope", "sparsifier", "density", "layout", "step", "state")}
            got["state"] = _from_torch(got["state"])   # the sparsifiers' states as they load: NumPy
            mismatch = self._config.mismatch(d.get("config"))
            recipe_state = d.get("recipe")
            if isinstance(recipe_state, dict):
                d = dict(d, recipe={k: _from_torch(v) if k in ("dense", "stage_state") else v
                                    for k, v in recipe_state.items()})
        except (KeyError, TypeError, AttributeError) as e:
            return f"not a state_dict() output ({e!r})", None, None
        for key, mine in (("version", _VERSION), ("scope", self.scope), ("sparsifier", self.sparsifier),
                          ("density", self.density)):
            if got[key] != mine:
                return f"the dict has {key}={got[key]!r}, this state has {mine!r}", None, None
        try:
            layout = None if got["layout"] is None else _as_layout(got["layout"])
            got["step"] = int(got["step"])
        except (TypeError, ValueError) as e:
            return f"malformed layout or step ({e})", None, None
        if layout is not None and any(n < 0 or n != int(np.prod(shape)) for n, shape in layout):
            return "malformed layout (an element count that does not match its shape)", None, None
        if self.layout is not None and layout is not None and layout != self.layout:
            return (f"the dict's parameter layout ({len(layout)} parameters, {sum(n for n, _ in layout)} elements) "
                    f"differs from this state's ({len(self.layout)} parameters, {self._offsets[-1]} elements)",
                    None, None)
        if layout is None and got["state"]:
            return "sparsifier state without a layout", None, None
        got["recipe"] = d.get("recipe") if isinstance(d, dict) else None
        if self._recipe_config is None and got["recipe"] is not None:
            return "the dict holds training-recipe state (saved with optimizer=), this state runs no recipe", None, None
        if self._recipe_config is not None:
            if "recipe" not in d:
                return "the dict has no training-recipe state (saved without optimizer=)", None, None
            if got["recipe"] is not None:
                try:
                    got["recipe_at"] = check_state(got["recipe"], self._recipe_config, self._offsets[-1])
                except (KeyError, TypeError, ValueError, AttributeError) as e:
                    return f"malformed training-recipe state ({e})", None, None
        got["adam"] = d.get("adam") if isinstance(d, dict) else None
        if self._adam is None and got["adam"] is not None:
            return "the dict holds Adam-path state (saved with adam=), this state runs none", None, None
        if self._adam is not None:
            if got["adam"] is None:
                return f"the dict has no Adam-path state, this state runs adam={self._adam.mode!r}", None, None
            try:
                self._adam.check(got["adam"])
                got["adam_step"] = int(got["adam"]["step"])
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                return f"malformed Adam-path state ({e})", None, None
        if self.scope == "bucket" and got["state"]:
            try:
                keys = [tuple(int(i) for i in key) for key, _ in got["state"]]
            except (TypeError, ValueError) as e:
                return f"malformed bucket state ({e})", None, None
            if sorted(i for key in keys for i in key) != list(range(len(_known_layout(layout)))):
                return "the bucket keys do not partition the layout", None, None
            got["state"] = [[key, sd] for key, (_, sd) in zip(keys, got["state"])]
        if mismatch:   # after the checks that name a missing or malformed part
            return mismatch, None, None
        return None, got, layout

    def _load(self, problem: str | None, got: dict[str, Any] | None, layout: Layout | None) -> None:
        """Worker (or the caller, before the first iteration): agree, rebuild, then install."""
        comm = self._working_comm()
        shape: tuple[Any, ...] | None
        if got is None:
            shape = None
        elif self.scope == "bucket" and got["state"]:
            shape = (got["step"], layout, [key for key, _ in got["state"]])
        else:
            shape = (got["step"], layout, bool(got["state"]), got.get("recipe_at"), got.get("adam_step"))
        every = transport.Exchange(comm).gather_objects((problem, shape))
        parts = [f"rank {r}: {p}" for r, (p, _) in enumerate(every) if p]
        if not parts and any(sh != every[0][1] for _, sh in every):
            parts = ["the ranks' dicts differ in step, layout or sparsifiers: "
                     + ", ".join(f"rank {r}: step {sh[0]}" for r, (_, sh) in enumerate(every))]
        if parts:
            raise exdyna_mpi.CollectiveError("ExDynaHookState.load_state_dict refused on all ranks, state "
                                             "unchanged: " + "; ".join(parts))
        assert got is not None   # _check_dict gives no fields only with a problem, refused above
        if got["state"] or self._recipe_config is not None:
            self._worker.open(self.comm)
        try:
            built, recipe = self._rebuilt(got, layout)
        except exdyna_mpi.CollectiveError:
            raise
        except BaseException as e:   # noqa: BLE001 - one rank's failure: the others may wait in a collective
            transport.abort_job(self.comm, e, "ExDynaHookState", "loading a state dict")
        old = [sp for sp in [self._sp, *self._sps.values()] if sp is not None]
        self._install(built, recipe)
        if self._adam is not None:   # checked by _check_dict on every rank, agreed above
            self._adam.load_state_dict(got["adam"])
            self._adam_due = False
        if layout is not None and self.layout is None:
            self._set_layout(layout)
        self.step = got["step"]
        self._to_load = None
        self._after_load = True
        for sp in old:
            _close(sp)

    def _rebuilt(self, d: dict[str, Any], layout: Layout | None) -> tuple[list[tuple[Key | None, Any]], Any]:
        """(``_built`` of ``d["state"]``, the recipe loaded with ``d["recipe"]``), collective; on any
        failure whatever was built is closed and nothing is kept."""
        built = self._built(d["state"], _known_layout(layout)) if d["state"] else []
        try:
            return built, self._loaded_recipe(d.get("recipe"))
        except BaseException:
            for _, sp in built:
                _close(sp)
            raise

    def _built(self, state: Any, layout: Layout) -> list[tuple[Key | None, Any]]:
        """(bucket key or None, sparsifier) for each entry of a dict's ``state``, each loaded with its
        entry (collective). On any failure the ones already built are closed, and nothing is kept."""
        built: list[tuple[Key | None, Any]] = []
        try:
            if self.scope == "model":
                built.append((None, self._loaded(sum(n for n, _ in layout), state)))
            else:
                for key, sd in state:
                    built.append((key, self._loaded(sum(layout[i][0] for i in key), sd)))
        except BaseException:
            for _, sp in built:
                _close(sp)
            raise
        return built

    def _install(self, built: list[tuple[Key | None, Any]], recipe: Any) -> None:
        """Hold ``built`` and ``recipe`` (``_rebuilt`` output) in place of the sparsifiers held so far
        (closing the recipe held so far; the caller closes the old sparsifiers)."""
        if self._recipe is not None:
            self._recipe.close()
        self._recipe = recipe
        self._sp, self._sps, self._owner, self._flat = None, {}, {}, None
        for key, sp in built:
            if key is None:
                self._sp = sp
            else:
                self._sps[key] = sp
                self._owner.update((i, key) for i in key)

    def _loaded(self, numel: int, sd: Any) -> Any:
        """A sparsifier of ``numel`` elements loaded with ``sd`` (collective; closed if the load refuses)."""
        sp = self._make(numel)
        try:
            sp.load_state_dict(sd)
        except exdyna_mpi.CollectiveError as e:
            _close(sp)
            raise exdyna_mpi.CollectiveError(f"ExDynaHookState.load_state_dict refused on all ranks, state "
                                             f"unchanged: {e}") from e
        return sp

    def __getstate__(self) -> dict[str, Any]:
        if self.optimizer is not None:
            raise TypeError("ExDynaHookState with optimizer= cannot be pickled (it holds the optimizer): "
                            "save state_dict() and load it into a state built with the new optimizer")
        return {"config": (self.sparsifier, self.density, self.scope, self.options), "state": self.state_dict()}

    def __setstate__(self, s: dict[str, Any]) -> None:
        sparsifier, density, scope, options = s["config"]
        self._unpickling = True
        type(self).__init__(self, sparsifier, density, scope=scope, **options)
        self._unpickling = False
        # unpickling is one rank's business, not a collective: the sparsifiers are built (and
        # their states checked, collectively) by the worker at the first iteration
        problem, got, layout = self._check_dict(s["state"])
        if problem or got is None:
            raise ValueError(f"ExDynaHookState: cannot unpickle: {problem}")
        if layout is not None:
            self._set_layout(layout)
        self.step = got["step"]
        self._to_load = got if got["state"] else None
        self._after_load = True

    def _set_layout(self, layout: Layout) -> None:
        self.layout = list(layout)
        self._offsets = [0] + np.cumsum([n for n, _ in layout], dtype=np.int64).tolist()

    # ------------------------------------------------------------------ backward thread
    def _canonical(self, p: torch.Tensor) -> int | None:
        """``p``'s canonical index in the model seen last; None if it was not in that model."""
        got = None if self._index is None else self._index.get(id(p))
        return got[1] if got is not None and got[0]() is p else None

    def _known(self, p: torch.Tensor) -> bool:
        return self._canonical(p) is not None

    def _held_layout(self) -> Layout:
        """The canonical layout, where the caller runs only once it is set."""
        return _known_layout(self.layout)

    def _held_flat(self) -> torch.Tensor:
        """The model-wide vector, where the caller runs only after the iteration's buckets were gathered."""
        if self._flat is None:
            raise RuntimeError("ExDynaHookState: the model-wide vector is read before any bucket was gathered")
        return self._flat

    def _locate(self, params: list[torch.Tensor], buf: torch.Tensor) -> tuple[Key, list[Run], bool]:
        """The bucket's key, its copy runs (buffer offset, model offset, length) and whether this
        iteration derives the canonical order afresh (the first iteration of a new model)."""
        if not self._in_iter:   # the first bucket of an iteration decides
            self._in_iter = True
            fixed = self.optimizer is not None   # the optimizer's order, never derived from buckets
            self._deriving = not fixed and (self._index is None or not all(self._known(p) for p in params))
            self._new_index, self._new_layout, self._new_total = {}, [], 0
            self._iter_dtype = buf.dtype
            self._covered = 0
            self._iter_error = None
            if self._adam_due and self._adam is not None:   # every bucket of this iteration fails with it
                self._iter_error = _StepOrderError(
                    f"ExDynaHookState(adam={self._adam.mode!r}): a new exchange began before optimizer.step() "
                    "applied the last one's update; call step() after each backward() (accumulate gradients "
                    "under DDP's no_sync)")
        if self.scope == "model" and buf.dtype != self._iter_dtype:
            raise _LayoutError(f"ExDynaHookState: scope='model' needs one gradient dtype, got {self._iter_dtype} "
                               f"and {buf.dtype} (use scope='bucket')")
        held = sum(p.numel() for p in params)
        if held != buf.numel():
            raise _LayoutError(f"ExDynaHookState: a bucket of {buf.numel()} elements holds parameters of "
                               f"{held} (sparse gradients are not supported)")
        key: list[int] = []
        runs: list[Run] = []
        src = 0
        for p in params:
            n = p.numel()
            if self._deriving:
                i = len(self._new_layout)
                entry = (n, tuple(p.shape))
                if id(p) in self._new_index:
                    raise _LayoutError("ExDynaHookState: a parameter appears in two buckets of one iteration")
                if self.layout is not None and (i >= len(self.layout) or self.layout[i] != entry):
                    have = self.layout[i] if i < len(self.layout) else "nothing"
                    raise _LayoutError(f"ExDynaHookState: the model's parameter {i} (in bucket order) is {entry} "
                                       f"(numel, shape), the state's layout has {have}: a state belongs to one "
                                       "architecture and bucket_cap_mb")
                self._new_index[id(p)] = (weakref.ref(p), i)
                self._new_layout.append(entry)
                dst = self._new_total
                self._new_total += n
            else:
                known = self._canonical(p)
                if known is None:
                    raise _LayoutError("ExDynaHookState: a bucket holds a parameter that is not among the "
                                       "optimizer's parameters" if self.optimizer is not None else
                                       "ExDynaHookState: a bucket holds a parameter that was not in this model's "
                                       "first iteration")
                i = known
                dst = self._offsets[i]
            key.append(i)
            if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)   # contiguous: one copy
            else:
                runs.append((src, dst, n))
            src += n
        self._covered += len(params)
        if self._iter_error is not None:
            raise self._iter_error
        return tuple(key), runs, self._deriving

    def _end_iteration(self) -> None:
        """Backward thread, at the last bucket: install the derived index (and the layout)."""
        self._in_iter = False
        if self.optimizer is not None and self._covered != len(self._held_layout()):   # set by __init__
            raise _LayoutError(f"ExDynaHookState: DDP's buckets hold {self._covered} parameters, the optimizer "
                               f"{len(self._held_layout())} that require grad: optimizer= needs the same parameters")
        if not self._deriving:
            return
        if self.layout is not None and len(self._new_layout) != len(self.layout):
            raise _LayoutError(f"ExDynaHookState: the model has {len(self._new_layout)} parameters, the state's "
                               f"layout {len(self.layout)}")
        if self.layout is None:
            self._set_layout(self._new_layout)
        self._index = self._new_index

    # ------------------------------------------------------------------ worker: errors
    def _deliver(self, jobs: list[_Job], e: BaseException) -> None:
        """Fail the futures of ``jobs``. A collective error (every rank raises it together) is only
        delivered; any other ends the job, since other ranks may wait for this one in a collective."""
        self.error = e
        collective = isinstance(e, (exdyna_mpi.CollectiveError, *_SAME_EVERYWHERE))
        for j in jobs:
            if not j.fut.done():
                # torch annotates the argument as the future's value type; it takes the exception
                j.fut.set_exception(e)   # type: ignore[arg-type]
        if not collective:
            transport.abort_job(self.comm, e, "ExDynaHookState", "the exchange")

    def _make(self, numel: int) -> Any:
        return exdyna_mpi.make(self.sparsifier, numel, self.density, self._comm, **self.options)

    # ------------------------------------------------------------------ worker: iterations
    def _run(self, job: _Job) -> None:
        try:
            if not self._iter_started:
                self._iter_started = True
                self._start_iteration(job)
            if job.error is not None:
                raise job.error
            if self._failed is None:
                if self.scope == "model" or self._regroup:
                    self._pending.append(job)
                    self._gather(job)
                else:
                    self._bucket_step(job)
        except BaseException as e:   # noqa: BLE001 - delivered to the futures
            self._failed = e
        if self._failed is not None:
            # a collective error fails the whole iteration on every rank; anything else aborts
            self._deliver(self._pending + [job], self._failed)
            self._pending = []
        if job.last:
            self._finish(job)

    def _start_iteration(self, job: _Job) -> None:
        self._worker.open(self.comm)
        if self._to_load is not None:
            # an unpickled or closed state (keys checked when it was taken in); on a refusal nothing is
            # installed and it stays to load: the next iteration retries
            self._install(*self._rebuilt(self._to_load, self.layout))
            self._to_load = None
        if self._recipe_config is not None and self._recipe is None:
            self._recipe = self._loaded_recipe(None)
        self._regroup = (self.scope == "bucket" and bool(self._sps) and job.new_model and self._after_load
                         and job.key not in self._sps)
        self._after_load = False
        if self.scope == "bucket":
            self.stats = {}

    def _gather(self, job: _Job) -> None:
        """Copy the bucket into the model-wide vector (once the model's size is known: at the last
        bucket of the very first iteration)."""
        torch = _torch()
        if not job.total:
            return
        if self._flat is None or self._flat.numel() != job.total or self._flat.dtype != job.buf.dtype:
            self._flat = torch.empty(job.total, dtype=job.buf.dtype, device=job.buf.device)
        with torch.no_grad():
            for src, dst, n in job.runs:
                self._flat[dst:dst + n].copy_(job.buf[src:src + n])
        job.copied = True

    def _finish(self, last: _Job) -> None:
        """After the last bucket: exchange (scope="model" or a regrouped iteration), write each
        bucket's slice of the result into its buffer, complete the futures."""
        torch = _torch()
        jobs, failed = self._pending, self._failed
        self._pending, self._failed, self._iter_started = [], None, False
        if failed is not None:
            return
        try:
            if self.scope == "model" or self._regroup:
                for j in jobs:
                    if not j.copied:
                        j.total = last.total
                        self._gather(j)
                flat = self._held_flat()
                if self.scope == "model":
                    if self._sp is None:
                        self._sp = self._make(flat.numel())
                    self.stats = self._model_step(flat)
                else:
                    self._regrouped_step()
                with torch.no_grad():
                    for j in jobs:
                        for src, dst, n in j.runs:
                            j.buf[src:src + n].copy_(flat[dst:dst + n])
            # counted before the futures complete: the caller reads ``step`` once backward() returns;
            # a model-wide exchange skipped on every rank (nonfinite="skip") changed nothing, this included
            if not (self.scope == "model" and getattr(self.stats, "skipped", False)):
                self.step += 1
            for j in jobs + [last]:
                if not j.fut.done():
                    j.fut.set_result(j.buf)
        except BaseException as e:   # noqa: BLE001 - delivered to the futures
            self._deliver(jobs, e)
        finally:
            self._regroup = False

    def _model_step(self, flat: torch.Tensor) -> exdyna_mpi.Stats:
        """The model-wide exchange, in place; with ``optimizer=``, inside the training recipe (and
        the Adam path) exactly as ``DistributedOptimizer.synchronize`` runs it."""
        recipe, adam = self._recipe, self._adam
        if recipe is None:
            self._sp.step(flat, out=flat)
            return self._sp.stats
        prepare = None if adam is None else (lambda g, dense: adam.prepare(self.optimizer, g, dense))
        with _torch().no_grad():
            sp = recipe.exchange(self._sp, flat, prepare)   # _torch_options.py
        self._last_sp = sp
        self._adam_due = adam is not None
        return sp.stats

    def _loaded_recipe(self, d: dict[str, Any] | None) -> TrainingOptions | None:
        """A fresh recipe object (None without ``optimizer=``), loaded with ``d`` unless None.
        Collective (it makes its sparsifiers on the private communicator); closed if the load refuses."""
        if self._recipe_config is None:
            return None
        recipe = TrainingOptions(self._recipe_config, [shape for _, shape in self._held_layout()], self._offsets[-1],
                                 self._comm, who="ExDynaHookState")
        if d is not None:
            try:
                recipe.load_state_dict(d)
            except BaseException:
                recipe.close()
                raise
        return recipe

    # ------------------------------------------------------------------ worker: scope="bucket"
    def _key_numel(self, key: Key) -> int:
        layout = self._held_layout()
        return sum(layout[i][0] for i in key)

    def _bucket_step(self, job: _Job) -> None:
        sp = self._sps.get(job.key)
        if sp is None:
            sp = self._adopt(job.key)
        sp.step(job.buf, out=job.buf)
        self.stats[job.key] = sp.stats
        if not job.last:   # the last one completes in _finish, once the iteration is counted
            job.fut.set_result(job.buf)

    def _adopt(self, key: Key) -> Any:
        """A sparsifier for a key seen for the first time, its residual carried over from the
        sparsifiers that held those parameters. Collective: the same keys come in the same order on
        every rank, so every rank loads (or not) together."""
        sp = self._make(self._key_numel(key))
        owners = sorted({self._owner[i] for i in key if i in self._owner})
        layout = self._held_layout()
        if owners:
            held = {k: (self._sps[k].residual, self._key_offsets(k)) for k in owners}
            res = np.zeros(sp.numel, dtype=np.result_type(*[r.dtype for r, _ in held.values()]))
            pos = 0
            for i in key:
                n = layout[i][0]
                if i in self._owner:
                    r, offs = held[self._owner[i]]
                    res[pos:pos + n] = r[offs[i]:offs[i] + n]
                pos += n
            d = sp.state_dict()
            d["residual"], d["dtype"] = res, res.dtype.str
            sp.load_state_dict(d)
        for i in key:
            self._owner[i] = key
        self._sps[key] = sp
        live = set(self._owner.values())
        for k in sorted(k for k in self._sps if k not in live):
            _close(self._sps.pop(k))   # holds no parameter any more (same order on every rank: collective)
        return sp

    def _key_offsets(self, key: Key) -> dict[int, int]:
        """Canonical index -> offset in the key's vector."""
        offs: dict[int, int] = {}
        pos = 0
        layout = self._held_layout()
        for i in key:
            offs[i] = pos
            pos += layout[i][0]
        return offs

    def _regrouped_step(self) -> None:
        """Exchange the model-wide vector with the held grouping, key by key in sorted order (the
        same order on every rank)."""
        torch = _torch()
        layout, flat = self._held_layout(), self._held_flat()
        with torch.no_grad():
            for key in sorted(self._sps):
                sp = self._sps[key]
                runs = [(self._offsets[i], layout[i][0]) for i in key]
                v = torch.cat([flat[o:o + n] for o, n in runs])
                sp.step(v, out=v)
                pos = 0
                for o, n in runs:
                    flat[o:o + n].copy_(v[pos:pos + n])
                    pos += n
                self.stats[key] = sp.stats


def _edited_grads(slices: list[tuple[Any, Any, int, int]], flat: torch.Tensor, signs: bool = False) -> str | None:
    """A problem when a parameter's ``.grad`` no longer holds the bits of its slice of the exchanged
    vector (DDP wrote exactly those), else None. Compared as integers, so NaNs compare equal; one
    device synchronisation for the whole model. A ``.grad`` that is None (a parameter DDP found
    unused, or a ``zero_grad(set_to_none=True)``) is not an edit. ``signs``: the update reads only
    the signs of the vector, so an edit that keeps every sign (``clip_grad_norm_``'s positive
    rescale) changes nothing and is not refused."""
    torch = _torch()
    words = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    differs = []
    for i, (p, _, off, n) in enumerate(slices):
        g = p.grad
        if g is None:
            continue
        if g.dtype != flat.dtype or g.numel() != n:
            return f".grad of parameter {i} is now {g.dtype} with {g.numel()} elements (the exchange gave " \
                   f"{flat.dtype}, {n})"
        if signs:
            differs.append((torch.sign(g.detach().reshape(-1)) != torch.sign(flat[off:off + n])).any())
            continue
        w = words[g.element_size()]
        differs.append((g.detach().reshape(-1).view(w) != flat[off:off + n].view(w)).any())
    edited = int(torch.stack(differs).sum()) if differs else 0
    if not edited:
        return None
    return (f".grad of {edited} of {len(slices)} parameters changed between backward() and optimizer.step() "
            "(a clip_grad_norm_, a GradScaler's unscale_ or another edit). This path computes its update "
            "from the exchanged vector, so the change would be lost: clip with ExDynaHookState(clip_norm=...) "
            "instead, or pass adam='live' to step on .grad")


def _close(sp: Any) -> None:
    """Close a sparsifier before it is dropped, so no request outlives its buffers (a no-op but in
    deadline mode, where it is collective: called in the same order on every rank)."""
    if sp is not None:
        sp.close()


def _recipe_to_host(d: dict[str, Any]) -> dict[str, Any]:
    """A ``TrainingOptions.state_dict()`` as host values: tensors as CPU copies (bfloat16 has no
    NumPy dtype), the sparsifiers' states as they are (NumPy)."""
    return {k: v.detach().cpu().clone() if isinstance(v, _torch().Tensor) else v for k, v in d.items()}


def _known_layout(layout: Layout | None) -> Layout:
    """``layout``, where one must be known: a sparsifier state or a recipe exists only with a layout
    (``_check_dict`` refuses a state without one; ``optimizer=`` sets it at construction)."""
    if layout is None:
        raise RuntimeError("ExDynaHookState: no parameter layout where one must be known")
    return layout


def _as_layout(raw: Any) -> Layout:
    return [(int(n), tuple(int(s) for s in shape)) for n, shape in raw]


# ``bucket`` and the return value carry no annotation: DDP's register_comm_hook compares them with
# the classes ``dist.GradBucket`` and ``Future[Tensor]``, and this module's postponed annotations are
# strings (torch is not imported when the module is).
def exdyna_hook(state: ExDynaHookState, bucket):  # -> torch.futures.Future[torch.Tensor]
    """DDP communication hook (``bucket``: a ``torch.distributed.GradBucket``; returns a
    ``torch.futures.Future[torch.Tensor]``): the bucket's gradient averaged over the ranks (the mean, as DDP's
    default allreduce hook gives) through ``state``'s sparsifier(s).

    Returns at once with a future that ``state``'s worker thread completes: with ``scope="bucket"``
    as soon as this bucket's exchange is done; with ``scope="model"`` after the iteration's last
    bucket has arrived and the one model-wide exchange is done (no overlap with backward for the
    exchange itself, but the backward thread never waits for it). A refused step (``StepError``:
    say, NaN in one rank's gradient) makes ``backward()`` raise on every rank; any other error in the
    exchange prints its traceback and aborts the MPI job rather than leave other ranks waiting.

    Args:
        state: the hook's ``ExDynaHookState`` (sparsifiers, recipe, worker thread).
        bucket: DDP's ``GradBucket``.

    Returns:
        A ``torch.futures.Future`` of the bucket's averaged gradient.

    Raises:
        Nothing itself: a refused step sets ``StepError`` on the future (``backward()`` raises it on
        every rank); any other error aborts the job.

    Example::

        >>> # xdoctest: +SKIP
        >>> state = ExDynaHookState("exdyna", density=0.01, scope="model")
        >>> ddp_model.register_comm_hook(state, exdyna_hook)
    """
    # ``torch`` in the annotation is the module (for the checker); the object comes from ``_torch()``
    fut: torch.futures.Future[torch.Tensor] = _torch().futures.Future()
    buf, last = bucket.buffer(), bucket.is_last()
    key: Key = ()
    runs: list[Run] = []
    new_model = False
    error: _LayoutError | _StepOrderError | None = None
    try:
        key, runs, new_model = state._locate(bucket.parameters(), buf)
        if last:
            state._end_iteration()
    except _SAME_EVERYWHERE as e:
        error = e
        if last:
            state._in_iter = False
    total = state._offsets[-1] if state.layout is not None else 0
    job = _Job(buf, fut, key, runs, last, new_model, total, error)
    state._submit(lambda: state._run(job))
    return fut
