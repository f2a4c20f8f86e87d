"""The registry of Adam paths: ``adam=`` names to the classes that run them, and the two names that
are not a path of their own.

- ``"live"`` (``LIVE``): no path (``make_adam_path`` returns None). The sparsifier exchanges the raw
  gradient and the wrapped optimizer, whatever it is, steps on the sparse average with its own
  moments.
- ``"auto"`` (``AUTO``, the entry points' default): ``AUTO_MODE`` (``"demo-age"``) for a
  ``torch.optim.Adam``/``AdamW`` with a sparsifier whose ``CAPABILITIES`` declare ``tuned_defaults``
  and which that path accepts; ``"live"`` everywhere else.
- every other name is a key of ``ADAM_PATHS``: the class declares it in ``modes``, with what it
  needs (``needs_adam``, ``needs_warmup``), which ``check_mode`` reads.
"""
from __future__ import annotations

from typing import Any

from ...sparsifiers.registry import REGISTRY
from .base import AdamPath, is_adam
from .decoupled import AgedDecoupledMomentum, DecoupledMomentum
from .frozen import FrozenVarianceAdam
from .local_update import LocalUpdateAdam

#: ``adam=`` without a path: the wrapped optimizer steps on the exchanged gradient
LIVE = "live"
#: ``adam=`` that chooses: ``AUTO_MODE`` where it runs and the sparsifier declares the tuned defaults, else ``LIVE``
AUTO = "auto"
#: the path ``AUTO`` chooses
AUTO_MODE = "demo-age"
#: the values' wire ``AUTO``'s path sends where the sparsifier can, the user left ``wire_dtype``
#: unset and the parameters are float32 (``DecoupledMomentum.default_wire``)
AUTO_WIRE = "float8_e4m3fn"

#: every path class, in the order of ``MODES``
PATH_CLASSES: tuple[type[AdamPath], ...] = (LocalUpdateAdam, FrozenVarianceAdam, DecoupledMomentum,
                                            AgedDecoupledMomentum)
#: each ``adam=`` name that has a path, to the class that runs it
ADAM_PATHS: dict[str, type[AdamPath]] = {mode: cls for cls in PATH_CLASSES for mode in cls.modes}
#: the modes: ``LIVE`` and every registered path
MODES = (LIVE,) + tuple(ADAM_PATHS)
#: what the entry points' ``adam=`` accepts: the modes, and ``AUTO`` (see ``make_adam_path``)
CHOICES = (AUTO,) + MODES


def tuned_defaults(sparsifier: str | None) -> bool:
    """Whether the registered sparsifier declares the tuned defaults (``Capabilities.tuned_defaults``).

    Where it does, ``adam="auto"`` chooses the aged decoupled momentum and ``momentum_correction="auto"``
    moves an SGD's momentum before the exchange.

    Args:
        sparsifier: a registered sparsifier's name (anything else: False).

    Returns:
        ``REGISTRY[sparsifier].CAPABILITIES.tuned_defaults``, False for an unknown name or None.
    """
    cls = REGISTRY.get(sparsifier) if isinstance(sparsifier, str) else None
    return cls is not None and cls.CAPABILITIES.tuned_defaults


def check_mode(optimizer: Any, mode: str, warmup_steps: Any, who: str) -> None:
    """Check that ``adam=mode`` can run with ``optimizer`` and this warm-up, from what the mode's class
    declares; ``"live"`` and ``"auto"`` run with any optimizer and warm-up.

    Args:
        optimizer: the optimizer the entry point wraps.
        mode: the ``adam=`` argument.
        warmup_steps: the entry point's ``warmup_steps``.
        who: the entry point's name, for messages.

    Raises:
        ValueError: ``mode`` is not one of ``CHOICES``; its class ``needs_adam`` and ``optimizer`` is
            not a ``torch.optim.Adam``/``AdamW``; its class ``needs_warmup`` and ``warmup_steps`` is
            not an integer >= 1.
    """
    if mode not in CHOICES:
        raise ValueError(f"{who}: adam must be one of {CHOICES}, got {mode!r}")
    cls = ADAM_PATHS.get(mode)
    if cls is None:   # LIVE or AUTO
        return
    if cls.needs_adam and not is_adam(optimizer):
        raise ValueError(f"{who}: adam={mode!r} needs torch.optim.Adam or AdamW, got {type(optimizer).__name__}")
    if cls.needs_warmup and not (isinstance(warmup_steps, int) and warmup_steps >= 1):
        raise ValueError(f"{who}: adam={mode!r} freezes the variance after a dense warm-up: "
                         f"give warmup_steps >= 1, got {warmup_steps!r}")


def make_adam_path(optimizer: Any, params: Any, mode: str, who: str = "DistributedOptimizer",
                   sparsifier: str | None = None) -> AdamPath | None:
    """The path ``DistributedOptimizer(adam=mode)`` (or ``ExDynaHookState(adam=mode)``) runs.

    ``"live"`` gives None: the wrapped optimizer steps on the exchanged gradient. ``"auto"`` gives
    ``AUTO_MODE``'s path (``AgedDecoupledMomentum``) for a ``torch.optim.Adam``/``AdamW`` with a
    sparsifier that declares ``tuned_defaults`` (``tuned_defaults``), and None (``"live"``) for
    other optimizers and sparsifiers and where that path refuses the optimizer (``amsgrad``,
    ``maximize``, complex parameters, more than one ``betas[0]`` or one outside ``[0, 1)``). Any
    other mode gives an instance of its class in ``ADAM_PATHS``. Call ``check_mode`` first.

    Args:
        optimizer: the wrapped optimizer.
        params: the parameters in the flat gradient's order (``FlatGrad.params``).
        mode: one of ``CHOICES``.
        who: the entry point's name, for messages.
        sparsifier: the sparsifier's registered name (read by ``"auto"``).

    Returns:
        The ``AdamPath``, or None for ``"live"`` (and where ``"auto"`` chooses it).

    Raises:
        ValueError: ``mode`` is not one of ``CHOICES``, or the path's class refuses the optimizer.
    """
    if mode == AUTO:
        if not is_adam(optimizer) or not tuned_defaults(sparsifier):
            return None
        try:
            path = ADAM_PATHS[AUTO_MODE](optimizer, params, AUTO_MODE, who)
        except ValueError:   # its refusals are the cases "auto" leaves to "live"
            return None
        if isinstance(path, DecoupledMomentum):
            path.default_wire = AUTO_WIRE
        return path
    if mode == LIVE:
        return None
    cls = ADAM_PATHS.get(mode)
    if cls is None:
        raise ValueError(f"{who}: adam must be one of {CHOICES}, got {mode!r}")
    return cls(optimizer, params, mode, who)
