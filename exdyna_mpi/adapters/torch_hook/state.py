"""``ExDynaHookState``: the state a DDP communication hook exchanges through (``exdyna_hook``).

The state holds the configuration the ranks agreed and the parts that do the work, each in its own
module: the canonical parameter layout (``layout.py``), the scope's sparsifiers (``scopes.py``), the
worker's iterations (``iteration.py``), the state dict (``checkpoint.py``) and, with ``optimizer=``,
the optimizer's step hooks (``optimizer_step.py``). ``exchange`` is the one method the hook calls.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import exdyna_mpi
from exdyna_mpi import transport

from ..torch_adam import AdamPath, check_mode as check_adam_mode, make_adam_path
from .._torch_common import _flat_layout, _to_torch, _torch
from .._torch_config import EntryConfig, agree_entry, layout_text, optimizer_items
from .._torch_options import RECIPE_DEFAULTS, Recipe, recipe_for
from .checkpoint import Checkpoint
from .reshard import check_resharded
from .iteration import SAME_EVERYWHERE, IterationMachine, Job
from .layout import Key, LayoutError, ParamLayout, Place
from .optimizer_step import OptimizerStep
from .scopes import SCOPES, SparsifierFactory
from .worker import HookWorker

if TYPE_CHECKING:
    import torch
    import torch.distributed
    from mpi4py import MPI

__all__ = ["ExDynaHookState"]

WHO = "ExDynaHookState"
#: what the constructor's checks give: (the sparsifier's options, the recipe, the optimizer's
#: parameters, the Adam path), and the configuration the ranks agree on
Plan = tuple[tuple[dict[str, Any], Recipe | None, list[Any] | None, AdamPath | None], EntryConfig]


class ExDynaHookState:
    """The state of ``exdyna_hook``: the sparsifier(s), the canonical parameter layout, the worker.

    Args:
        sparsifier: any name of ``exdyna_mpi.available()`` (``"dense"`` gives the plain MPI average);
            ``density`` and ``options`` go to it.
        comm: default ``MPI.COMM_WORLD``; must span the same ranks, in the same order, as DDP's
            process group.
        scope: ``"model"`` or ``"bucket"`` (``scopes.py``).
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

    __slots__ = (
        # The fields below are the hyperparameters, agreed by the ranks at construction and fixed after it.
        "sparsifier",
        "density",
        "scope",            # "model" or "bucket": the name; the scope object below does the work
        "options",
        "optimizer",
        "_config",          # EntryConfig: the configuration the ranks agreed (recorded in state dicts)
        "_adam",            # AdamPath | None: adam= other than "live" (optimizer= given)
        # The fields below are the parts that hold the internal state, one job each.
        "_worker",          # HookWorker: the worker thread, comm and the worker's private communicator
        "_layout",          # ParamLayout: the canonical parameter layout (the backward thread's)
        "_scope",           # ModelScope | BucketScope: the sparsifier(s) and all that differs by scope
        "_machine",         # IterationMachine: the worker's iterations; step, error, the recipe
        "_checkpoint",      # Checkpoint: state_dict() and load_state_dict()
        "_optimizer_step",  # OptimizerStep: what optimizer.step() runs (optimizer= given)
        # The field below is set while __setstate__ constructs: construction is then one rank's business.
        "_unpickling",
    )

    def __init__(self, sparsifier: str = "exdyna", density: float = 0.01, comm: MPI.Comm | None = None, *,
                 scope: str = "model", optimizer: torch.optim.Optimizer | None = None, clip_norm: float | None = None,
                 warmup_steps: int = 0, momentum_correction: float | str = "auto", momentum_masking: bool = True,
                 density_warmup: Sequence[float] | None = None, density_warmup_steps: int | None = None,
                 adam: str = "auto", **options: Any) -> None:
        recipe_args = dict(clip_norm=clip_norm, warmup_steps=warmup_steps, momentum_correction=momentum_correction,
                           momentum_masking=momentum_masking, density_warmup=density_warmup,
                           density_warmup_steps=density_warmup_steps)

        def plan() -> Plan:
            return _plan(sparsifier, density, scope, optimizer, adam, recipe_args, options)

        self._worker = HookWorker(comm)
        if getattr(self, "_unpickling", False):   # one rank's business: the first iteration's loads agree
            (options, recipe, params, adam_path), config = plan()
        else:
            (options, recipe, params, adam_path), config = agree_entry(self._worker.comm, WHO, plan)
        self._config = config
        self.sparsifier, self.density, self.scope, self.options = sparsifier, density, scope, dict(options)
        self.optimizer = optimizer
        self._adam = adam_path
        # with optimizer= the optimizer's order is the canonical one: the model-wide vector is laid out
        # as DistributedOptimizer's flat gradient, so both entry points exchange the same vector
        self._layout = ParamLayout(params)
        self._scope = SCOPES[scope](SparsifierFactory(sparsifier, density, self.options, self._worker), self._layout)
        self._machine = IterationMachine(self._scope, self._layout, self._worker, recipe, adam_path, optimizer)
        self._checkpoint = Checkpoint(config, sparsifier, density, self._scope, self._layout, self._machine, recipe,
                                      adam_path, self._worker)
        self._optimizer_step = OptimizerStep(optimizer, adam_path, recipe, self._machine, self._worker)
        if optimizer is not None:
            self._optimizer_step.register()

    # ------------------------------------------------------------------ what users read
    @property
    def comm(self) -> MPI.Comm:
        """The ranks of the exchange (``MPI.COMM_WORLD`` unless given); settable before the first iteration.

        Raises:
            RuntimeError: set while the private communicator exists (from the first iteration or a
                load until ``close()``).
        """
        return self._worker.comm

    @comm.setter
    def comm(self, comm: MPI.Comm) -> None:
        self._worker.set_comm(comm)

    @property
    def step(self) -> int:
        """Iterations completed (a model-wide exchange skipped on every rank does not count)."""
        return self._machine.step

    @property
    def stats(self) -> Any:
        """The last exchange's ``exdyna_mpi.Stats`` (``scope="bucket"``: a dict from bucket key to ``Stats``)."""
        return self._scope.stats

    @property
    def error(self) -> BaseException | None:
        """The exception of the last failed exchange (DDP re-raises it from ``backward()``)."""
        return self._machine.error

    @property
    def layout(self) -> list[tuple[int, tuple[int, ...]]] | None:
        """The canonical layout, (numel, shape) per parameter; None until the first iteration (or a load)."""
        return self._layout.entries

    # the parts' state, as the tests inspect it
    @property
    def _comm(self) -> MPI.Comm | None:
        return self._worker.private

    @property
    def _sp(self) -> Any:
        return self._scope.sp

    @property
    def _sps(self) -> dict[Key, Any]:
        return self._scope.sps

    # ------------------------------------------------------------------ the hook's one call
    def exchange(self, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Queue one of DDP's buckets for its exchange, and return its future: what ``exdyna_hook`` does.

        On the calling (backward) thread it only works out where the bucket's parameters sit in the
        canonical layout; the worker thread exchanges the bucket (``scope="bucket"``: at once;
        ``scope="model"``: with the whole model once the iteration's last bucket is in), writes the
        result into ``bucket.buffer()`` and completes the future. A cause every rank shares (a model
        that does not match the layout, an exchange begun before the last Adam-path update was
        applied) fails the future on every rank; any other error in the exchange aborts the job.

        Args:
            bucket: DDP's ``torch.distributed.GradBucket``; DDP hands the buckets of an iteration in
                bucket-index order, the same on every rank.

        Returns:
            A ``torch.futures.Future`` of the bucket's gradient averaged over the ranks (its buffer).

        Raises:
            RuntimeError: ``bucket`` is not a ``GradBucket`` (DDP's Python reducer calls hooks per
                parameter with ``(grad, param)``; docs/compile.md).

        Example::

            >>> # xdoctest: +SKIP
            >>> def logging_hook(state, bucket):   # exdyna_hook, with a line per bucket
            ...     print(bucket.index(), bucket.buffer().numel())
            ...     return state.exchange(bucket)
            >>> ddp.register_comm_hook(ExDynaHookState("exdyna", density=0.01), logging_hook)
        """
        if not callable(getattr(bucket, "buffer", None)):
            # DDP's Python reducer (torch._dynamo.config.optimize_ddp="python_reducer", which compiled
            # autograd needs) calls a hook once per parameter with (grad, param) and ignores its result
            raise RuntimeError(
                f"{WHO}: the hook was called with {type(bucket).__name__}, not a torch.distributed.GradBucket: "
                "DDP's Python reducer (torch._dynamo.config.optimize_ddp='python_reducer', which compiled "
                "autograd needs) calls communication hooks once per parameter and ignores the future they "
                "return. The hook exchanges DDP's buckets: keep DDP's C++ reducer (the default) and compile "
                "without compiled autograd, or use DistributedOptimizer, which trains under compiled autograd")
        # ``torch`` in the annotation is the module (for the checker); the object comes from ``_torch()``
        fut: torch.futures.Future[torch.Tensor] = _torch().futures.Future()
        buf, last = bucket.buffer(), bucket.is_last()
        place = Place((), [], False)
        error: LayoutError | RuntimeError | None = None
        try:
            place = self._locate(bucket.parameters(), buf)
            if last:
                self._layout.end()
        except SAME_EVERYWHERE as e:
            error = e
            if last:
                self._layout.abandon()
        job = Job(buf, fut, place.key, place.runs, last, place.new_model, self._layout.total, error)
        self._worker.submit(lambda: self._machine.run(job))
        return fut

    def _locate(self, params: list[torch.Tensor], buf: torch.Tensor) -> Place:
        """The bucket's place in the layout; at an iteration's first bucket, the iteration begins."""
        if self._layout.begin(params):
            self._scope.begin_buckets(buf.dtype)
            self._optimizer_step.begin_iteration()
        self._scope.check_bucket(buf.dtype)
        place = self._layout.locate(params, buf.numel())
        if self._optimizer_step.order_error is not None:   # every bucket of this iteration fails with it
            raise self._optimizer_step.order_error
        return place

    # ------------------------------------------------------------------ life cycle and checkpoints
    def close(self) -> None:
        """Stop the worker and free the private communicator; the state stays usable. Idempotent.

        Runs after the work queued so far; closes the sparsifiers (a deadline exchange completes its
        late messages). Collective once an iteration has run or a state was loaded. The next
        iteration restarts the worker and rebuilds the sparsifiers from their state.
        """
        if not self._worker.running and self._worker.private is None:
            return

        def stop() -> None:
            if self._machine.holds():
                self._machine.to_load = self._checkpoint.save()
            self._machine.release()
            self._worker.free()

        self._worker.call(stop)
        self._worker.stop()

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, taken after the work queued so far. Call it between iterations.

        Returns:
            The configuration it runs (under ``"config"``), the sparsifier(s)' state dicts, the
            canonical layout, the step counter and, with ``optimizer=``, the recipe's state under
            ``"recipe"`` (and with ``adam=``, the Adam path's under ``"adam"``): CPU tensors and
            plain Python values, so ``torch.save`` and ``torch.load(weights_only=True)`` round-trip it.
        """
        return _to_torch(dict(self._worker.call(self._checkpoint.save), config=self._config.record()))

    def load_state_dict(self, d: Any, reshard: bool = False) -> None:
        """Restore ``state_dict()`` output between iterations. Collective over ``comm``.

        Every rank loads its own rank's dict, all or nothing: every rank checks its dict (version,
        scope, sparsifier, density, layout, step, bucket keys), the ranks agree once, then the
        sparsifiers are rebuilt from the dicts (each ``Sparsifier.load_state_dict`` checks its
        residual and extra state and agrees again). A model whose parameters do not match the layout
        raises (every rank) at the first iteration, from ``backward()``. Set ``comm`` before loading.

        With ``reshard=True`` the run resumes at another number of ranks: ``d`` is every old rank's
        ``state_dict()`` (the same sequence on every rank); the step, layout and bucket keys are
        shared, each sparsifier's residual (and the recipe's velocity) the mean over the old ranks
        (``torch_hook/reshard.py``, docs/faults.md).

        Args:
            d: this rank's ``state_dict()`` output (``reshard=True``: every old rank's).
            reshard: load dicts saved at another number of ranks.

        Raises:
            CollectiveError: any rank's problem (a ``ValueError``, raised on every rank, naming the
                ranks and causes); every rank's state stays as it was.
        """
        if reshard:
            self._reshard_load(d, complete=True)
            return
        checked = self._checkpoint.check(d)
        self._worker.call(lambda: self._checkpoint.load(checked))

    def _reshard_load(self, dicts: Any, complete: bool) -> None:
        """``load_state_dict(dicts, reshard=True)``; ``complete=False``: the survivors' dicts only
        (the elastic shrink). Collective, all or nothing."""
        checked = check_resharded(self._checkpoint, dicts, complete)
        self._worker.call(lambda: self._checkpoint.load(checked))

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
        self._checkpoint.take_unpickled(s["state"])


def _plan(sparsifier: str, density: float, scope: str, optimizer: Any, adam: str, recipe_args: dict[str, Any],
          options: dict[str, Any]) -> Plan:
    """Every check of the constructor's arguments, on this rank only, and the configuration they
    give; changes nothing.

    Raises:
        ValueError: an argument refused on this rank.
        RuntimeError: MPI without ``MPI_THREAD_MULTIPLE``.
    """
    who = WHO
    opts = dict(options)
    if scope not in SCOPES:
        raise ValueError(f"{who}: scope must be one of {tuple(SCOPES)}, got {scope!r}")
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
        warmup_steps = recipe_args["warmup_steps"]
        check_adam_mode(optimizer, adam, warmup_steps, who)
        adam_path = make_adam_path(optimizer, params, adam, who, sparsifier=sparsifier)
        if adam_path is not None:
            opts = adam_path.sparsifier_options(sparsifier, opts)
        recipe = recipe_for(optimizer, sparsifier, density, opts, who=who, **recipe_args)
        opts = recipe.options
        items.update(recipe.items())
        items.update({"adam": "live" if adam_path is None else adam_path.mode, **optimizer_items(optimizer),
                      "layout": layout_text(params)})
    if not transport.thread_multiple():
        raise RuntimeError(f"{who} needs MPI initialised with MPI_THREAD_MULTIPLE (mpi4py's default, "
                           "see mpi4py.rc.thread_level): its exchanges run on a worker thread")
    return (opts, recipe, params, adam_path), EntryConfig.of(who, items)
