"""``adam="demo"`` and ``adam="demo-age"``: decoupled momentum in the sparsifier's residual, the sign
of the exchanged average applied (``"demo-age"``: scaled by the root of each coordinate's wait)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...sparsifiers.registry import REGISTRY
from .._torch_common import _torch
from .base import AdamPath

if TYPE_CHECKING:
    import torch


class DecoupledMomentum(AdamPath):
    """``adam="demo"``: DeMo's decoupled momentum (Peng et al. 2024) with ExDyna's selection.

    The sparsifier's error-feedback residual is the momentum. Each step a rank's gradient joins it
    (``m = beta1 m + g``, the decay applied after the previous exchange), the sparsifier sends the
    largest entries of ``m`` over its exclusive partitions and removes what it sent from ``m``, and
    every rank applies the sign of the exchanged average: AdamW's decay ``theta *= 1 - lr * wd``,
    then ``theta -= lr * sign(q_avg)`` (signSGD on the sent coordinates; the others do not move this
    step). ``torch.optim.Adam``'s coupled decay adds ``wd * theta`` to the gradient first. No second
    moment: the sign plays the part of Adam's normalisation. ``beta1`` (the groups' ``betas[0]``,
    the same in every group) is the momentum's decay; ``beta2`` and ``eps`` are not used.

    What changes from DeMo: the selection is ExDyna's (exclusive partitions, one owner per
    coordinate, its threshold holding the density) rather than a top-k of DCT chunks per rank, so
    a sent coordinate carries its owner's momentum, divided by P. The momentum is in the
    sparsifier's state (``"exdyna_sparsifier"``); this path keeps only its step count. A skipped
    exchange (``nonfinite="skip"``) changes nothing, the decay included.

    When to use it: a sign step with no state but the residual, only signs travelling back
    (``output="sign"`` where the sparsifier offers it). A sent coordinate moves by ``lr`` however
    long it waited, so its learning rate and ``betas[0]`` are tuned for it rather than taken over
    from AdamW (see docs/training.md); ``"demo-age"`` (``AgedDecoupledMomentum``) is the same
    exchange with a step scaled by each coordinate's wait.

    Args:
        optimizer: the wrapped ``torch.optim.Adam`` or ``AdamW``.
        params: the parameters in the flat gradient's order (``FlatGrad.params``).
        mode: ``"demo"``.
        who: the entry point's name, for messages.

    Raises:
        ValueError: as ``AdamPath``; param groups of different ``betas[0]``, or one outside ``[0, 1)``.
    """

    modes = ("demo",)
    signs_only = True
    #: the ``wire_dtype`` this path adds where the user gave none (``adam="auto"`` sets it: the
    #: tuned recipe's values on the wire); None: the gradient's
    default_wire: str | None = None

    def __init__(self, optimizer, params, mode: str = "demo", who: str = "DistributedOptimizer") -> None:
        super().__init__(optimizer, params, mode, who)
        betas = {float(g["betas"][0]) for g in optimizer.param_groups}
        if len(betas) != 1:
            raise ValueError(f"{self.who}: adam={self.mode!r} needs one betas[0] for every param group, "
                             f"got {sorted(betas)}")
        self.residual_decay = betas.pop()
        if not 0.0 <= self.residual_decay < 1.0:
            raise ValueError(f"{self.who}: adam={self.mode!r} needs 0 <= betas[0] < 1, got {self.residual_decay}")
        self.step = 0

    @property
    def owns_step(self) -> bool:
        """Always: the signs of the exchanged average step the parameters."""
        return True

    def prepare(self, optimizer, flat, dense: bool) -> None:
        """``torch.optim.Adam``'s coupled decay on this rank's gradient; the residual is the momentum."""
        self._couple_decay(flat)

    def sparsifier_options(self, sparsifier: str, options: dict[str, Any]) -> dict[str, Any]:
        """``output="sign"`` where the sparsifier offers it and ``options`` leave ``output`` unset:
        this path reads nothing but the sign of the exchanged average, so only signs travel on the
        gathering half of the value exchange (2 bits a value instead of 32; the same update to the
        bit). ``default_wire`` (set by ``adam="auto"``) where the sparsifier can send 8-bit values,
        ``options`` leave ``wire_dtype`` unset and every parameter is float32."""
        cls = REGISTRY.get(sparsifier)
        if cls is None:
            return options
        opts = dict(options)
        if "output" not in options and cls.CAPABILITIES.sign_output:
            opts["output"] = "sign"
        if self.default_wire is not None and "wire_dtype" not in options and cls.CAPABILITIES.wire_8bit \
                and all(p.dtype == _torch().float32 for p, *_ in self.slices):
            opts["wire_dtype"] = self.default_wire
        return opts

    def update(self, flat, skipped: bool) -> None:
        """``theta -= lr * sign(flat)`` on every parameter (after AdamW's decay)."""
        torch = _torch()
        if skipped:
            return
        self.step += 1
        self._descend(torch.sign(flat))

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "step": self.step, "beta1": self.residual_decay}

    def check(self, d: dict[str, Any]) -> None:
        """Raise ``ValueError`` if ``d`` cannot be loaded (another mode, another ``beta1``: the
        residual it saved is a momentum of that decay); changes nothing."""
        self._check_mode(d)
        self._check_step(d)
        if d.get("beta1") != self.residual_decay:
            raise ValueError(f"{self.who}.load_state_dict: exdyna_adam.beta1 is {d.get('beta1')!r}, "
                             f"this optimizer's betas[0] is {self.residual_decay}")

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Load a dict that ``check`` accepted."""
        self.step = int(d["step"])


class AgedDecoupledMomentum(DecoupledMomentum):
    """``adam="demo-age"``: ``"demo"`` with each sign scaled by the root of the coordinate's wait.

    Everything is ``DecoupledMomentum``'s (the momentum in the sparsifier's residual, ExDyna's
    selection, the signs gathered) except the step: a coordinate whose exchanged sign is not zero
    moves by ``lr * sqrt(a) * sign(q_avg)``, where ``a`` is the number of steps since it last moved
    (since the start for its first move). ``"demo"`` moves it by ``lr`` however long it waited.

    Why: at density ``d`` a coordinate moves about once in ``1/d`` steps, the largest ones every
    step. Under ``"demo"`` the rarely sent ones (small gradients, noisy ones) then move ``d`` times
    as far per step as the often sent ones, where Adam's normalisation would put them on one scale.
    Over ``a`` steps Adam moves a coordinate with a steady sign about ``a`` rates and one of pure
    noise about ``sqrt(a)`` (a random walk); ``sqrt(a)`` is the scale that does not amplify noise,
    and a coordinate sent every step moves exactly as under ``"demo"``.

    When to use it: ``"demo"``'s exchange and bytes with a step on Adam's scale, so a learning rate
    chosen for AdamW is the place to start; ``adam="auto"`` chooses it for an Adam/AdamW with a
    sparsifier that declares the tuned defaults (see docs/training.md for the evidence).

    State: the step at which each coordinate last moved (int32, 4 bytes a parameter, the same on
    every rank: it follows the exchanged average), in ``"exdyna_adam"`` with the step count.

    Args:
        optimizer: the wrapped ``torch.optim.Adam`` or ``AdamW``.
        params: the parameters in the flat gradient's order (``FlatGrad.params``).
        mode: ``"demo-age"``.
        who: the entry point's name, for messages.

    Raises:
        ValueError: as ``DecoupledMomentum``.
    """

    modes = ("demo-age",)

    def __init__(self, optimizer, params, mode: str = "demo-age", who: str = "DistributedOptimizer") -> None:
        super().__init__(optimizer, params, mode, who)
        self.moved: torch.Tensor | None = None   # flat int32: the step of each coordinate's last move (0: never)

    def place(self, device) -> None:
        if self.moved is not None and self.moved.device != device:   # loaded from a host copy
            self.moved = self.moved.to(device)

    def prepare(self, optimizer, flat, dense: bool) -> None:
        self.place(flat.device)
        super().prepare(optimizer, flat, dense)

    def update(self, flat, skipped: bool) -> None:
        """``theta -= lr * sqrt(a) * sign(flat)`` on every parameter (after AdamW's decay), ``a``
        each coordinate's steps since it last moved."""
        torch = _torch()
        if skipped:
            return
        if self.moved is None:
            self.moved = torch.zeros(self.numel, dtype=torch.int32, device=flat.device)
        self.step += 1
        with torch.no_grad():
            moves = flat != 0
            # the wait in float32 (exact below 2**24 steps), its root correctly rounded on every rank
            u = torch.sign(flat).to(torch.float32).mul_((self.step - self.moved).to(torch.float32).sqrt_())
            self.moved.masked_fill_(moves, self.step)
        self._descend(u)

    def state_dict(self) -> dict[str, Any]:
        return dict(super().state_dict(), moved=None if self.moved is None else self.moved.clone())

    def check(self, d: dict[str, Any]) -> None:
        """``DecoupledMomentum.check``, and ``moved``: None, or ``numel`` int32 steps in ``[0, step]``."""
        super().check(d)
        torch = _torch()
        moved = d.get("moved")
        if moved is None:
            return
        if not isinstance(moved, torch.Tensor) or moved.dtype != torch.int32 or moved.numel() != self.numel:
            raise ValueError(f"{self.who}.load_state_dict: exdyna_adam.moved must be {self.numel} int32 steps, got "
                             f"{getattr(moved, 'numel', lambda: None)()} of {getattr(moved, 'dtype', type(moved))}")
        if moved.numel() and (int(moved.min()) < 0 or int(moved.max()) > int(d["step"])):
            raise ValueError(f"{self.who}.load_state_dict: exdyna_adam.moved holds steps outside [0, {int(d['step'])}]")

    def load_state_dict(self, d: dict[str, Any]) -> None:
        super().load_state_dict(d)
        moved = d.get("moved")
        self.moved = None if moved is None else moved.detach().clone()
