"""``adam="frozen"`` and ``adam="frozen-gradient"``: a dense warm-up of exact Adam, then Adam with its
second moment frozen, which makes it linear in the exchanged gradient."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._torch_common import _torch
from .base import AdamPath

if TYPE_CHECKING:
    import torch


class FrozenVarianceAdam(AdamPath):
    """``adam="frozen"`` / ``"frozen-gradient"``: Adam made linear after a warm-up by freezing the
    variance (the idea of 1-bit Adam and 0/1 Adam), so that error feedback is sound.

    1. The first ``warmup_steps`` steps exchange the dense average and the wrapped
       ``torch.optim.Adam`` / ``AdamW`` steps as usual (exact Adam on the averaged gradient).
    2. At the first sparse step the second moment freezes: ``denom = sqrt(v / (1 - beta2**t)) + eps``
       with ``t`` the warm-up's step count (torch's own formula at that step), and the first moment
       is carried over in preconditioned units, ``m = exp_avg / denom``.
    3. From then on each rank preconditions its own gradient, ``p = g / denom`` (the same ``denom``
       on every rank), and the sparsifier exchanges ``p`` with error feedback. Selection therefore
       ranks coordinates by the size of the *update* they would make, not of the raw gradient
       (``"frozen-gradient"`` exchanges ``g`` and divides after the exchange instead: the same
       arithmetic with a dense exchange, a different selection under sparsity).
    4. The update is Adam's with the frozen ``denom``: ``m = beta1 m + (1 - beta1) p_avg``,
       ``theta -= lr * m / (1 - beta1**t)``; AdamW's decoupled decay ``theta *= 1 - lr * wd`` first;
       ``torch.optim.Adam``'s coupled decay adds ``wd * theta / denom`` to ``p_avg`` after the
       exchange (parameters are identical on every rank, so it needs no communication).

    What is exact: the warm-up steps are torch's Adam bit for bit. After it the update is Adam with
    the second moment of step ``warmup_steps`` held fixed; with a dense exchange that differs from
    Adam only by the frozen variance. Every rank holds the same bits (the exchanged average is
    bit-identical and everything after it is elementwise).

    When to use it: where the variance settles early and a few dense steps are affordable; it needs
    ``warmup_steps >= 1`` (``needs_warmup``).

    State: the wrapped optimizer's own ``state`` stops changing at the freeze; this path's state
    (``m``, ``denom``, the step count) is in ``opt.state_dict()`` under ``"exdyna_adam"``.

    Args:
        optimizer: the wrapped ``torch.optim.Adam`` or ``AdamW``.
        params: the parameters in the flat gradient's order (``FlatGrad.params``).
        mode: ``"frozen"`` (precondition before the exchange) or ``"frozen-gradient"`` (after it).
        who: the entry point's name, for messages.

    Raises:
        ValueError: as ``AdamPath`` (a ``mode`` other than these two included).
    """

    modes = ("frozen", "frozen-gradient")
    needs_warmup = True

    def __init__(self, optimizer, params, mode: str = "frozen", who: str = "DistributedOptimizer") -> None:
        super().__init__(optimizer, params, mode, who)
        self.frozen = False
        self.step = 0            # Adam's t: the warm-up's steps, then one per frozen step
        self.m: torch.Tensor | None = None       # first moment in preconditioned units (flat)
        self.denom: torch.Tensor | None = None   # sqrt(v_hat) + eps at the freeze (flat)

    def freeze(self, optimizer, flat_like) -> None:
        """Read the wrapped optimizer's moments at the end of the warm-up and freeze them.

        Args:
            optimizer: the wrapped optimizer, after its warm-up steps.
            flat_like: a flat tensor of the gradient's length, dtype and device.

        Raises:
            RuntimeError: a parameter has no moments (no dense step reached it), or the parameters
                stepped different numbers of times.
        """
        torch = _torch()
        m = torch.zeros_like(flat_like)
        denom = torch.empty_like(flat_like)
        step: int | None = None
        with torch.no_grad():
            for p, g, off, n in self.slices:
                st = optimizer.state.get(p, {})
                if "exp_avg_sq" not in st:
                    raise RuntimeError(f"{self.who}: adam='frozen' needs at least one dense warm-up "
                                       "step with a gradient for every parameter (warmup_steps >= 1)")
                t = int(st["step"])
                step = t if step is None else step
                if t != step:
                    raise RuntimeError(f"{self.who}: adam='frozen': parameters stepped different "
                                       f"numbers of times in the warm-up ({step} and {t})")
                beta2, eps = g["betas"][1], g["eps"]
                d = denom[off:off + n]
                d.copy_(st["exp_avg_sq"].reshape(-1)).sqrt_().div_((1 - beta2 ** t) ** 0.5).add_(eps)
                torch.div(st["exp_avg"].reshape(-1), d, out=m[off:off + n])
        assert step is not None   # FlatGrad refuses an empty parameter list
        self.m, self.denom, self.step, self.frozen = m, denom, step, True

    @property
    def owns_step(self) -> bool:
        """From the freeze on (the warm-up's steps are the wrapped optimizer's)."""
        return self.frozen

    def place(self, device) -> None:
        if self.m is not None and self.denom is not None and self.m.device != device:   # loaded from a host copy
            self.m, self.denom = self.m.to(device), self.denom.to(device)

    def prepare(self, optimizer, flat, dense: bool) -> None:
        """Freeze at the first sparse step; then this rank's gradient into the exchanged units
        (``"frozen"``: divided by ``denom``)."""
        self.place(flat.device)
        if dense:
            return
        if not self.frozen:
            self.freeze(optimizer, flat)
        if self.mode == "frozen":
            flat.div_(self.denom)

    def update(self, flat, skipped: bool) -> None:
        """Adam's step with the frozen ``denom`` from the exchanged average ``flat``."""
        torch = _torch()
        m, denom = self.m, self.denom
        assert m is not None and denom is not None   # owns_step: called only once frozen
        with torch.no_grad():
            if self.mode == "frozen-gradient":
                flat.div_(denom)
            self.step += 1
            t = self.step
            for p, g, off, n in self.slices:
                if p.grad is None:   # as in _descend
                    continue
                beta1 = g["betas"][0]
                lr, wd = float(g["lr"]), float(g["weight_decay"])
                pv = flat[off:off + n].view_as(p)
                mv = m[off:off + n].view_as(p)
                if wd and not self.decoupled:
                    pv.addcdiv_(p, denom[off:off + n].view_as(p), value=wd)
                if wd and self.decoupled:
                    p.mul_(1 - lr * wd)
                mv.mul_(beta1).add_(pv, alpha=1 - beta1)
                p.add_(mv, alpha=-lr / (1 - beta1 ** t))

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "frozen": self.frozen, "step": self.step,
                "m": None if self.m is None else self.m.clone(),
                "denom": None if self.denom is None else self.denom.clone()}

    def check(self, d: dict[str, Any]) -> None:
        """Raise ``ValueError`` if ``d`` cannot be loaded (another mode, wrong lengths); changes nothing."""
        self._check_mode(d)
        if bool(d.get("frozen")):
            self._check_vectors(d, ("m", "denom"))

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Load a dict that ``check`` accepted."""
        self.frozen, self.step = bool(d["frozen"]), int(d["step"])
        self.m = None if d["m"] is None else d["m"].detach().clone()
        self.denom = None if d["denom"] is None else d["denom"].detach().clone()
