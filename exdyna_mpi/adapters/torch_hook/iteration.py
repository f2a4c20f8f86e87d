"""The worker thread's side of the hook: one iteration's buckets, from the first job to the futures.

DDP hands the hook one bucket of gradients at a time (in bucket-index order, on every rank) and
waits, at the end of ``backward()``, for the futures the hook returned. The backward thread only
works out where the bucket's parameters sit (``layout.py``) and queues a ``Job``; the worker runs
the jobs in FIFO order, so every rank issues its collectives in the same order while the backward
thread goes on. ``IterationMachine.run`` takes each job: at the iteration's first it starts the
iteration (the private communicator, a pending load, the recipe), then the scope exchanges the
bucket at once or the machine gathers it into the model-wide vector, and at the last it exchanges
the gathered vector, writes each bucket's slice back, counts the step and completes the futures.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import exdyna_mpi

from .._torch_common import _torch
from .._torch_options import TrainingOptions
from .._torch_reshard import load_recipe_state
from .layout import Entry, Key, LayoutError, ParamLayout, Run, required
from .scopes import BucketScope, Built, ModelScope, Prepare, close_sparsifier
from .worker import HookWorker

if TYPE_CHECKING:
    import torch

    from ..torch_adam import AdamPath
    from .._torch_options import Recipe

__all__ = ["SAME_EVERYWHERE", "IterationMachine", "Job", "StepOrderError"]


class StepOrderError(RuntimeError):
    """An exchange began while the last one's Adam-path update was still to be applied by
    ``optimizer.step()``. Every rank runs the same training loop, so every rank raises it together."""


#: the errors every rank raises together (their causes are the same on every rank): delivered to the
#: futures, so backward() raises them everywhere, without ending the job
SAME_EVERYWHERE = (LayoutError, StepOrderError)


class Job:
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


class IterationMachine:
    """The worker's iterations: runs each ``Job``, holds what lives across iterations.

    Args:
        scope: the scope object (``scopes.py``).
        layout: the canonical layout.
        worker: the worker thread and communicators.
        recipe_config: the training recipe (``optimizer=`` given), else None.
        adam: the Adam path (``adam=`` other than ``"live"``), else None.
        optimizer: the optimizer that steps on the hook's gradients, else None.

    Raises:
        Nothing from ``run``: a job's error fails its iteration's futures (see ``deliver``).
    """

    __slots__ = (
        # The fields below are the configuration, fixed when the state is made.
        "scope", "layout", "worker", "recipe_config", "adam", "optimizer",
        # The fields below live across iterations (the checkpoint saves and restores them).
        "step",         # iterations completed
        "error",        # the exception of the last failed exchange
        "recipe",       # TrainingOptions | None: built by the worker, on the private communicator
        "to_load",      # a checked state dict whose sparsifiers the next iteration builds (unpickled, closed)
        "flat",         # the model-wide vector
        # The fields below are the last model-wide exchange's, for optimizer.step().
        "adam_due",     # an exchange ran whose Adam-path update optimizer.step() has yet to apply
        "last_sp",      # the sparsifier that ran it (a warm-up's or the main one)
        # The fields below are the iteration in progress.
        "_started",
        "_pending",     # its jobs gathered so far (and the failed ones to deliver)
        "_failed",      # the error that failed it
    )

    def __init__(self, scope: ModelScope | BucketScope, layout: ParamLayout, worker: HookWorker,
                 recipe_config: Recipe | None, adam: AdamPath | None, optimizer: Any) -> None:
        self.scope, self.layout, self.worker = scope, layout, worker
        self.recipe_config, self.adam, self.optimizer = recipe_config, adam, optimizer
        self.step = 0
        self.error: BaseException | None = None
        self.recipe: TrainingOptions | None = None
        self.to_load: dict[str, Any] | None = None
        self.flat: torch.Tensor | None = None
        self.adam_due = False
        self.last_sp: Any = None
        self._started = False
        self._pending: list[Job] = []
        self._failed: BaseException | None = None

    def held_flat(self) -> torch.Tensor:
        """The model-wide vector, where the caller runs only after the iteration's buckets were gathered.

        Raises:
            RuntimeError: no bucket was gathered.
        """
        if self.flat is None:
            raise RuntimeError("ExDynaHookState: the model-wide vector is read before any bucket was gathered")
        return self.flat

    # ------------------------------------------------------------------ one job
    def run(self, job: Job) -> None:
        """Take one job (on the worker, in the order the hooks were called)."""
        try:
            if not self._started:
                self._started = True
                self._start(job)
            if job.error is not None:
                raise job.error
            if self._failed is None:
                if self.scope.exchange_bucket(job.key, job.buf):
                    if not job.last:   # the last one completes in _finish, once the iteration is counted
                        job.fut.set_result(job.buf)
                else:
                    self._pending.append(job)
                    self._gather(job)
        except BaseException as e:   # noqa: BLE001 - delivered to the futures
            self._failed = e
        if self._failed is not None:
            # a collective error fails the whole iteration on every rank; anything else aborts
            self.deliver(self._pending + [job], self._failed)
            self._pending = []
        if job.last:
            self._finish(job)

    def deliver(self, jobs: list[Job], e: BaseException) -> None:
        """Fail the futures of ``jobs``. A collective error (every rank raises it together) is only
        delivered; any other ends the job, since other ranks may wait for this one in a collective."""
        self.error = e
        collective = isinstance(e, (exdyna_mpi.CollectiveError, *SAME_EVERYWHERE))
        for j in jobs:
            if not j.fut.done():
                # torch annotates the argument as the future's value type; it takes the exception
                j.fut.set_exception(e)   # type: ignore[arg-type]
        if not collective:
            self.worker.abort(e, "the exchange")

    def _start(self, job: Job) -> None:
        self.worker.open()
        if self.to_load is not None:
            # an unpickled or closed state (keys checked when it was taken in); on a refusal nothing is
            # installed and it stays to load: the next iteration retries
            self.install(*self.rebuilt(self.to_load, self.layout.entries))
            self.to_load = None
        if self.recipe_config is not None and self.recipe is None:
            self.recipe = self.loaded_recipe(None)
        self.scope.begin_iteration(job.new_model, job.key)

    def _gather(self, job: Job) -> None:
        """Copy the bucket into the model-wide vector (once the model's size is known: at the last
        bucket of the very first iteration)."""
        torch = _torch()
        if not job.total:
            return
        if self.flat is None or self.flat.numel() != job.total or self.flat.dtype != job.buf.dtype:
            self.flat = torch.empty(job.total, dtype=job.buf.dtype, device=job.buf.device)
        with torch.no_grad():
            for src, dst, n in job.runs:
                self.flat[dst:dst + n].copy_(job.buf[src:src + n])
        job.copied = True

    def _finish(self, last: Job) -> None:
        """After the last bucket: exchange the gathered vector (where the scope gathers), write each
        bucket's slice of the result into its buffer, complete the futures."""
        torch = _torch()
        jobs, failed = self._pending, self._failed
        self._pending, self._failed, self._started = [], None, False
        if failed is not None:
            return
        try:
            if self.scope.gathers:
                for j in jobs:
                    if not j.copied:
                        j.total = last.total
                        self._gather(j)
                flat = self.held_flat()
                ran = self.scope.exchange_gathered(flat, self.recipe, self._prepare())
                if self.recipe is not None:   # the Adam path's update is now due at optimizer.step()
                    self.last_sp = ran
                    self.adam_due = self.adam is not None
                with torch.no_grad():
                    for j in jobs:
                        for src, dst, n in j.runs:
                            j.buf[src:src + n].copy_(flat[dst:dst + n])
            # counted before the futures complete: the caller reads ``step`` once backward() returns;
            # a model-wide exchange skipped on every rank (nonfinite="skip") changed nothing, this included
            if not self.scope.skipped:
                self.step += 1
            for j in jobs + [last]:
                if not j.fut.done():
                    j.fut.set_result(j.buf)
        except BaseException as e:   # noqa: BLE001 - delivered to the futures
            self.deliver(jobs, e)
        finally:
            self.scope.end_iteration()

    def _prepare(self) -> Prepare:
        """The Adam path's step before the exchange, or None."""
        adam = self.adam
        return None if adam is None else (lambda g, dense: adam.prepare(self.optimizer, g, dense))

    # ------------------------------------------------------------------ what the worker holds
    def loaded_recipe(self, d: dict[str, Any] | None) -> TrainingOptions | None:
        """A fresh recipe object (None without ``optimizer=``), loaded with ``d`` unless None.
        Collective (it makes its sparsifiers on the private communicator); closed if the load refuses."""
        if self.recipe_config is None:
            return None
        recipe = TrainingOptions(self.recipe_config, [shape for _, shape in self.layout.held()], self.layout.total,
                                 self.worker.private, who="ExDynaHookState")
        if d is not None:
            try:
                load_recipe_state(recipe, d)   # a ReshardedRecipe d: load_state_dict(reshard=True)
            except BaseException:
                recipe.close()
                raise
        return recipe

    def rebuilt(self, d: dict[str, Any], entries: list[Entry] | None) -> tuple[Built, TrainingOptions | None]:
        """(the sparsifiers of ``d["state"]``, the recipe loaded with ``d["recipe"]``), collective; on
        any failure whatever was built is closed and nothing is kept."""
        built = self.scope.build(d["state"], required(entries)) if d["state"] else []
        try:
            return built, self.loaded_recipe(d.get("recipe"))
        except BaseException:
            for _, sp in built:
                close_sparsifier(sp)
            raise

    def install(self, built: Built, recipe: TrainingOptions | None) -> None:
        """Hold ``built`` and ``recipe`` (``rebuilt`` output) in place of the sparsifiers held so far
        (closing the recipe held so far; the caller closes the old sparsifiers)."""
        if self.recipe is not None:
            self.recipe.close()
        self.recipe = recipe
        self.scope.install(built)
        self.flat = None

    def holds(self) -> bool:
        """Whether any sparsifier or recipe is held."""
        return self.scope.holds() or self.recipe is not None

    def release(self) -> None:
        """Close and drop the sparsifiers and the recipe (collective, in the same order on every rank)."""
        self.scope.close()
        if self.recipe is not None:
            self.recipe.close()
        self.flat, self.recipe = None, None
