"""``AdamPath``: the interface every ``adam=`` mode implements, and what the modes share (the checks,
the flat layout over the optimizer's param groups, the descent step, the state-dict checks)."""
from __future__ import annotations

from typing import Any, ClassVar

from .._torch_common import _torch

#: the key of an Adam path's state in the entry points' ``state_dict()``
ADAM_KEY = "exdyna_adam"


def is_adam(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a ``torch.optim.Adam`` or ``AdamW`` (subclasses included).

    Args:
        optimizer: any object.

    Returns:
        True for an instance of ``torch.optim.Adam`` or ``torch.optim.AdamW``.
    """
    torch = _torch()
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


class AdamPath:
    """The interface of an Adam path: the state and arithmetic that ``adam=<mode>`` runs around the
    sparse exchange, in place of (or, during a warm-up, beside) the wrapped optimizer's own step.

    ``DistributedOptimizer`` (and ``ExDynaHookState`` given ``optimizer=``) drive it each step:

    1. ``prepare(optimizer, flat, dense)``: this rank's gradient, in place, into the units the
       sparsifier exchanges (with its error feedback);
    2. the exchange, which replaces ``flat`` by the average over the ranks;
    3. when ``owns_step``: ``apply(flat, skipped, sp)`` (``update``, then ``decay_residual``) steps
       every parameter from that average, the same on every rank; otherwise the wrapped optimizer
       steps on it.

    A subclass declares what it runs and needs in class attributes, which the registry
    (``registry.py``) and ``check_mode`` read: ``modes`` (the ``adam=`` names it runs),
    ``needs_adam`` (only for ``torch.optim.Adam``/``AdamW``) and ``needs_warmup`` (a dense warm-up,
    ``warmup_steps >= 1``, before its first sparse step).

    Args:
        optimizer: the wrapped ``torch.optim.Adam`` or ``AdamW``.
        params: the parameters in the flat gradient's order (``FlatGrad.params``).
        mode: one of the class's ``modes``.
        who: the entry point's name, for messages.

    Raises:
        ValueError: ``mode`` is not one of the class's ``modes``; ``amsgrad``, ``maximize`` or
            complex parameters (not supported).

    Example::

        >>> path = make_adam_path(adamw, params, "demo-age", sparsifier="exdyna")
        >>> path.prepare(adamw, flat, dense=False)   # this rank's gradient, in the exchanged units
        >>> sp.step(flat, out=flat)                   # the sparse average, in place
        >>> path.apply(flat, bool(sp.stats.skipped), sp)
    """

    #: the ``adam=`` names this class runs (the registry's keys)
    modes: ClassVar[tuple[str, ...]] = ()
    #: whether the class runs only for a ``torch.optim.Adam``/``AdamW`` (``check_mode`` refuses others)
    needs_adam: ClassVar[bool] = True
    #: whether the class needs a dense warm-up (``warmup_steps >= 1``) before its first sparse step
    needs_warmup: ClassVar[bool] = False
    #: what the sparsifier's residual is multiplied by after each exchange that was not skipped (None:
    #: left alone); ``DistributedOptimizer.step`` applies it
    residual_decay: float | None = None
    #: the keys of ``state_dict()`` whose tensors are this rank's own (they differ between ranks): at
    #: another rank count they become the mean over the old ranks; every other entry is the same on
    #: every rank and is carried (``load_state_dict(dicts, reshard=True)``)
    rank_local: ClassVar[tuple[str, ...]] = ()
    #: whether ``update`` reads only the signs of the exchanged average (an edit of ``.grad`` that
    #: keeps every sign then changes nothing: the DDP hook accepts it)
    signs_only = False

    def __init__(self, optimizer, params, mode: str, who: str = "DistributedOptimizer") -> None:
        torch = _torch()
        self.who = who
        if mode not in self.modes:
            raise ValueError(f"{type(self).__name__} runs adam=" + " or ".join(repr(m) for m in self.modes)
                             + f", got {mode!r}")
        for g in optimizer.param_groups:
            if g.get("amsgrad") or g.get("maximize"):
                raise ValueError(f"{self.who}: adam={mode!r} does not support amsgrad or maximize")
        if any(torch.is_complex(p) for p in params):
            raise ValueError(f"{self.who}: adam={mode!r} does not support complex parameters")
        self.mode = mode
        self.decoupled = isinstance(optimizer, torch.optim.AdamW)
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        self.slices = []   # (param, its group, offset, numel) in the flat order
        off = 0
        for p in params:
            self.slices.append((p, group_of[id(p)], off, p.numel()))
            off += p.numel()
        self.numel = off

    @property
    def owns_step(self) -> bool:
        """Whether ``update`` (not the wrapped optimizer) steps the parameters this step."""
        raise NotImplementedError

    def prepare(self, optimizer, flat, dense: bool) -> None:
        """Turn this rank's gradient into the exchanged units, in place.

        Args:
            optimizer: the wrapped optimizer (its moments are read where a path starts from them).
            flat: this rank's flat gradient, in the parameters' order; overwritten.
            dense: whether this step's exchange is a dense warm-up step.
        """
        raise NotImplementedError

    def update(self, flat, skipped: bool) -> None:
        """Step every parameter from the exchanged average; identical on every rank.

        Args:
            flat: the exchanged average, in the parameters' order.
            skipped: whether the exchange skipped the step (then nothing changes).
        """
        raise NotImplementedError

    def apply(self, flat, skipped: bool, sp) -> None:
        """``update``, then ``decay_residual``; nothing for a skipped exchange.

        Args:
            flat: the exchanged average.
            skipped: whether the exchange skipped the step.
            sp: the sparsifier that ran the exchange.
        """
        if skipped:
            return
        self.update(flat, skipped)
        self.decay_residual(sp, skipped)

    def decay_residual(self, sp, skipped: bool) -> None:
        """Scale the residual of ``sp`` by ``residual_decay`` when the path sets one (the decoupled
        momentum: the residual is the momentum) and the step was not skipped.

        Args:
            sp: the sparsifier that ran the step.
            skipped: whether the exchange skipped the step.
        """
        if self.residual_decay is not None and not skipped:
            sp.scale_residual(self.residual_decay)

    def sparsifier_options(self, sparsifier: str, options: dict[str, Any]) -> dict[str, Any]:
        """The sparsifier's options this path runs with.

        Args:
            sparsifier: the sparsifier's registered name.
            options: the options the user gave.

        Returns:
            ``options`` (``DecoupledMomentum`` adds ``output="sign"``).
        """
        return options

    def place(self, device) -> None:
        """Move this path's tensors to ``device`` (a state loaded as host copies); a no-op where they are.

        ``prepare`` calls it, so a resumed path follows the gradient to its device.

        Args:
            device: the flat gradient's device.
        """

    def state_dict(self) -> dict[str, Any]:
        """This rank's state of the path.

        Returns:
            Tensors and plain values, saved under ``"exdyna_adam"``.
        """
        raise NotImplementedError

    def check(self, d: dict[str, Any]) -> None:
        """Check a ``state_dict()`` output; changes nothing.

        Args:
            d: the dict to check.

        Raises:
            ValueError: ``d`` cannot be loaded.
        """
        raise NotImplementedError

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Load a dict that ``check`` accepted.

        Args:
            d: a ``state_dict()`` output.
        """
        raise NotImplementedError

    def _couple_decay(self, flat) -> None:
        """``torch.optim.Adam``'s coupled weight decay, ``g += wd * theta``, on this rank's flat
        gradient (AdamW's decay is decoupled: nothing here)."""
        if self.decoupled:
            return
        with _torch().no_grad():
            for p, g, off, n in self.slices:
                wd = float(g["weight_decay"])
                if wd:
                    flat[off:off + n].add_(p.detach().reshape(-1), alpha=wd)

    def _descend(self, u) -> None:
        """Every parameter: AdamW's decoupled decay ``theta *= 1 - lr * wd``, then ``theta -= lr * u``
        (``u`` flat, in the parameters' order; ``lr`` read from the group at this step)."""
        with _torch().no_grad():
            for p, g, off, n in self.slices:
                if p.grad is None:   # no gradient reached it (DDP's unused parameters): torch leaves it alone
                    continue
                lr, wd = float(g["lr"]), float(g["weight_decay"])
                if wd and self.decoupled:
                    p.mul_(1 - lr * wd)
                p.add_(u[off:off + n].view_as(p), alpha=-lr)

    def _check_step(self, d) -> None:
        if int(d.get("step", -1)) < 0:
            raise ValueError(f"{self.who}.load_state_dict: exdyna_adam.step is {d.get('step')!r}")

    def _check_mode(self, d) -> None:
        if not isinstance(d, dict) or d.get("mode") != self.mode:
            mode = d.get("mode") if isinstance(d, dict) else None
            raise ValueError(f"{self.who}.load_state_dict: the dict is of adam={mode!r}, "
                             f"this optimizer runs adam={self.mode!r}")

    def _check_vectors(self, d, keys) -> None:
        torch = _torch()
        for key in keys:
            v = d.get(key)
            if v is None or v.numel() != self.numel:
                raise ValueError(f"{self.who}.load_state_dict: exdyna_adam.{key} has "
                                 f"{None if v is None else v.numel()} elements, the model {self.numel}")
            if not bool(torch.isfinite(v).all()):
                raise ValueError(f"{self.who}.load_state_dict: exdyna_adam.{key} holds non-finite values")
