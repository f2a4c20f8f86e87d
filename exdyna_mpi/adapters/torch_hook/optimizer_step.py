"""What ``optimizer.step()`` runs when the hook's state was made with ``optimizer=``.

The state registers a step pre-hook and a step post-hook on the optimizer, so they run inside its
``step()`` whatever wraps it (LR schedulers, profilers, a GradScaler): after an exchange that
skipped the step (``nonfinite="skip"``) the gradients are held away, so nothing moves or decays;
an Adam path that owns the step applies the last exchange's update (with the gradients held away,
so the optimizer's own step changes nothing); the momentum the recipe moved is out of the param
groups only while ``step()`` runs. The post-hook gives everything back.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from exdyna_mpi import transport

from .._torch_common import _torch
from .._torch_options import give_back_momentum, take_momentum
from .iteration import IterationMachine, StepOrderError
from .worker import HookWorker

if TYPE_CHECKING:
    import torch

    from ..torch_adam import AdamPath
    from .._torch_options import Recipe

__all__ = ["OptimizerStep", "edited_grads"]

_STEP_HOOKS = "_exdyna_hook_step_hooks"   # the optimizer's attribute: the step hooks of the state that steps it


class OptimizerStep:
    """The step hooks one ``ExDynaHookState`` puts on its optimizer, and what they hold meanwhile.

    Args:
        optimizer: the optimizer (None: no ``optimizer=``; nothing is registered).
        adam: the Adam path, or None.
        recipe_config: the training recipe, or None.
        machine: the worker's iterations (the exchanged vector, whether an update is due).
        worker: the worker thread and communicators.

    Raises:
        RuntimeError: from ``before``: a step without an exchange since the last (an Adam path).
        CollectiveError: from ``before``: ``.grad`` edited since ``backward()`` on some rank.
    """

    __slots__ = ("optimizer", "adam", "recipe_config", "machine", "worker",
                 "order_error",   # backward thread: this iteration's misuse (an exchange before the last update)
                 "_stashed",      # .grad held away from the optimizer while it steps
                 "_momenta")      # the groups' own momentum while the optimizer steps without it

    def __init__(self, optimizer: torch.optim.Optimizer | None, adam: AdamPath | None, recipe_config: Recipe | None,
                 machine: IterationMachine, worker: HookWorker) -> None:
        self.optimizer, self.adam, self.recipe_config = optimizer, adam, recipe_config
        self.machine, self.worker = machine, worker
        self.order_error: StepOrderError | None = None
        self._stashed: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._momenta: list[Any] | None = None

    def register(self) -> None:
        """Put the step hooks on the optimizer, taking them from a state made earlier for it."""
        optimizer = self.optimizer
        assert optimizer is not None   # called with optimizer= only
        # one state steps an optimizer: a state made earlier for it gives its step hooks up
        for handle in getattr(optimizer, _STEP_HOOKS, ()):
            handle.remove()
        handles = (optimizer.register_step_pre_hook(self.before), optimizer.register_step_post_hook(self.after))
        setattr(optimizer, _STEP_HOOKS, handles)

    def begin_iteration(self) -> None:
        """Backward thread, at an iteration's first bucket: every bucket of it fails when the last
        exchange's Adam-path update is still to be applied."""
        self.order_error = None
        if self.machine.adam_due and self.adam is not None:
            self.order_error = StepOrderError(
                f"ExDynaHookState(adam={self.adam.mode!r}): a new exchange began before optimizer.step() "
                "applied the last one's update; call step() after each backward() (accumulate gradients "
                "under DDP's no_sync)")

    def before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The optimizer's step pre-hook: after a skipped exchange, hold every gradient away so the
        step moves nothing; else apply the last exchange's update when the Adam path owns the step
        (holding the gradients away so the optimizer's own step changes nothing), and take the
        momentum the recipe moved out of the param groups until the step returns.

        Raises:
            RuntimeError: an Adam path and no exchange since the last step.
            CollectiveError: ``.grad`` edited since ``backward()`` on some rank (nothing applied).
        """
        self._restore()   # a step that raised left them held
        adam, machine = self.adam, self.machine
        skipped = machine.scope.skipped
        if adam is not None and not machine.adam_due:
            raise RuntimeError(f"ExDynaHookState(adam={adam.mode!r}): optimizer.step() without an exchange since "
                               "the last step; run one DDP backward() (outside no_sync) before each step()")
        if skipped:   # the exchange skipped the step on every rank: nothing moves, nothing decays
            self._stashed = [(p, p.grad) for g in optimizer.param_groups for p in g["params"]]
        elif adam is not None and adam.owns_step:
            # the update comes from the exchanged vector: a .grad changed since backward() (a user's
            # clip_grad_norm_, a GradScaler's unscale_) would be silently lost, so it is refused (not
            # after an exchange refused for step order, whose backward left DDP's partial work in .grad),
            # unless the path reads only signs and the edit kept every sign (a positive rescale: a clip)
            problem = None if self.order_error is not None else edited_grads(adam.slices, machine.held_flat(),
                                                                             signs=adam.signs_only)

            def apply() -> None:   # on the worker, after its queued work: the vector and sparsifier are its
                transport.agree_problems(transport.Exchange(self.worker.working), problem,
                                         f"ExDynaHookState(adam={adam.mode!r}): optimizer.step() refused on every "
                                         "rank, nothing applied")
                adam.apply(machine.held_flat(), False, machine.last_sp)

            self.worker.call(apply)   # a refusal raises here: the update stays due, for a step with .grad put back
            self._stashed = [(p, p.grad) for p, *_ in adam.slices]
        machine.adam_due = False
        for p, _ in self._stashed:
            p.grad = None
        self._momenta = take_momentum(optimizer, self.recipe_config)

    def after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The optimizer's step post-hook: give the parameters their gradients and the param groups
        their momentum back (the user's optimizer state never keeps the hook's settings)."""
        self._restore()

    def _restore(self) -> None:
        for p, g in self._stashed:
            p.grad = g
        self._stashed = []
        if self._momenta is not None and self.optimizer is not None:
            give_back_momentum(self.optimizer, self._momenta)
            self._momenta = None


def edited_grads(slices: list[tuple[Any, Any, int, int]], flat: torch.Tensor, signs: bool = False) -> str | None:
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
