"""Adam under sparse exchange: the paths that ``adam=`` selects in ``DistributedOptimizer`` and in
``ExDynaHookState`` given ``optimizer=``.

Error feedback keeps the *sum* of the applied gradients right only for an optimiser that is linear
in the gradient. Adam is not: it divides each coordinate by a second moment that the sparse bursts
themselves inflate (a coordinate sent once in many steps arrives as one large accumulated value).
Each path makes the exchanged quantity one that error feedback handles soundly:

- ``"update"`` (``LocalUpdateAdam``, ``local_update.py``): Adam on each rank's own gradient, its
  update exchanged with error feedback and the average applied on every rank. No warm-up.
- ``"frozen"`` / ``"frozen-gradient"`` (``FrozenVarianceAdam``, ``frozen.py``): a dense warm-up of
  exact Adam, then the second moment frozen, which makes Adam linear (the gradient divided by it
  before the exchange, or after it). Needs ``warmup_steps >= 1``.
- ``"demo"`` (``DecoupledMomentum``, ``decoupled.py``): DeMo's decoupled momentum, the sparsifier's
  residual being the momentum and the sign of the exchanged average applied.
- ``"demo-age"`` (``AgedDecoupledMomentum``, ``decoupled.py``): ``"demo"`` with each sign scaled by
  the root of the steps since the coordinate last moved.
- ``"live"``: no path; the wrapped optimizer (any) steps on the sparse average of the raw gradient.
- ``"auto"`` (the default): ``"demo-age"`` for a ``torch.optim.Adam``/``AdamW`` with a sparsifier
  that declares the tuned defaults (ExDyna) where that path accepts the optimizer, its values on
  the wire as float8 e4m3fn (``AUTO_WIRE``) where ``wire_dtype`` is unset and the parameters are
  float32; ``"live"`` elsewhere.

Every path implements ``AdamPath`` (``base.py``); ``registry.py`` maps each name to its class
(``ADAM_PATHS``), and ``check_mode`` / ``make_adam_path`` read what each class declares. The
parameters stay bit-identical on every rank; each path's state is in the entry point's
``state_dict()`` under ``ADAM_KEY``. ``amsgrad``, ``maximize`` and complex parameters are refused.
Measurements of the paths against DDP's AdamW: docs/training.md.

Example::

    >>> from exdyna_mpi.adapters.torch_adam import ADAM_PATHS, check_mode, make_adam_path
    >>> check_mode(adamw, "frozen", warmup_steps=30, who="DistributedOptimizer")
    >>> ADAM_PATHS["frozen"].needs_warmup
    True
"""
from .base import ADAM_KEY, AdamPath, is_adam
from .decoupled import AgedDecoupledMomentum, DecoupledMomentum
from .frozen import FrozenVarianceAdam
from .local_update import LocalUpdateAdam
from .registry import (ADAM_PATHS, AUTO, AUTO_MODE, AUTO_WIRE, CHOICES, LIVE, MODES, PATH_CLASSES, check_mode,
                       make_adam_path, tuned_defaults)

__all__ = ["ADAM_KEY", "ADAM_PATHS", "AUTO", "AUTO_MODE", "AUTO_WIRE", "CHOICES", "LIVE", "MODES", "PATH_CLASSES",
           "AdamPath", "AgedDecoupledMomentum", "DecoupledMomentum", "FrozenVarianceAdam", "LocalUpdateAdam",
           "check_mode", "is_adam", "make_adam_path", "tuned_defaults"]
