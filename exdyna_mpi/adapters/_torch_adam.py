"""Adam under sparse exchange: a dense warm-up, then a frozen second moment (``adam="frozen"``).

Error feedback keeps the *sum* of the applied gradients right only for an optimiser that is linear
in the gradient. Adam is not: it divides each coordinate by a second moment that the sparse bursts
themselves inflate (a coordinate sent once in many steps arrives as one large accumulated value).
1-bit Adam and 0/1 Adam (DeepSpeed) make Adam linear after a warm-up by freezing the variance; the
same idea makes error feedback sound here:

1. The first ``warmup_steps`` steps exchange the dense average and the wrapped ``torch.optim.Adam``
   / ``AdamW`` steps as usual (exact Adam on the averaged gradient).
2. At the first sparse step the second moment freezes: ``denom = sqrt(v / (1 - beta2**t)) + eps``
   with ``t`` the warm-up's step count (torch's own formula at that step), and the first moment
   is carried over in preconditioned units, ``m = exp_avg / denom``.
3. From then on each rank preconditions its own gradient, ``p = g / denom`` (the same ``denom`` on
   every rank), and the sparsifier exchanges ``p`` with error feedback. Selection therefore ranks
   coordinates by the size of the *update* they would make, not of the raw gradient
   (``adam="frozen-gradient"`` exchanges ``g`` and divides after the exchange instead: the same
   arithmetic with a dense exchange, a different selection under sparsity).
4. The update is Adam's with the frozen ``denom``: ``m = beta1 m + (1 - beta1) p_avg``,
   ``theta -= lr * m / (1 - beta1**t)``; AdamW's decoupled decay ``theta *= 1 - lr * wd`` first;
   ``torch.optim.Adam``'s coupled decay adds ``wd * theta / denom`` to ``p_avg`` after the
   exchange (parameters are identical on every rank, so it needs no communication).

What is exact: the warm-up steps are torch's Adam bit for bit. After it the update is Adam with
the second moment of step ``warmup_steps`` held fixed; with a dense exchange that differs from
Adam only by the frozen variance. Every rank holds the same bits (the exchanged average is
bit-identical and everything after it is elementwise). ``amsgrad``, ``maximize`` and complex
parameters are refused. The wrapped optimizer's own ``state`` stops changing at the freeze; this
path's state (``m``, ``denom``, the step count) is in ``opt.state_dict()`` under
``"exdyna_adam"``.
"""
from __future__ import annotations

from typing import Any

from ._torch_common import _torch

ADAM_KEY = "exdyna_adam"
MODES = ("live", "frozen", "frozen-gradient")


def is_adam(optimizer) -> bool:
    """``torch.optim.Adam`` or ``AdamW`` (subclasses included)."""
    torch = _torch()
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


class FrozenVarianceAdam:
    """The state and arithmetic of ``adam="frozen"`` / ``"frozen-gradient"`` (module docstring).

    Args:
        optimizer: the wrapped ``torch.optim.Adam`` or ``AdamW``.
        params: the parameters in the flat gradient's order (``FlatGrad.params``).
        mode: ``"frozen"`` (precondition before the exchange) or ``"frozen-gradient"`` (after it).
    """

    def __init__(self, optimizer, params, mode: str) -> None:
        torch = _torch()
        if mode not in MODES[1:]:
            raise ValueError(f"DistributedOptimizer: adam must be one of {MODES}, got {mode!r}")
        for g in optimizer.param_groups:
            if g.get("amsgrad") or g.get("maximize"):
                raise ValueError("DistributedOptimizer: adam='frozen' does not support amsgrad or maximize")
        if any(torch.is_complex(p) for p in params):
            raise ValueError("DistributedOptimizer: adam='frozen' does not support complex parameters")
        self.mode = mode
        self.decoupled = isinstance(optimizer, torch.optim.AdamW)
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        self.slices = []   # (param, its group, offset, numel) in the flat order
        off = 0
        for p in params:
            self.slices.append((p, group_of[id(p)], off, p.numel()))
            off += p.numel()
        self.numel = off
        self.frozen = False
        self.step = 0            # Adam's t: the warm-up's steps, then one per frozen step
        self.m = None            # first moment in preconditioned units (flat)
        self.denom = None        # sqrt(v_hat) + eps at the freeze (flat)

    def freeze(self, optimizer, flat_like) -> None:
        """Read the wrapped optimizer's moments at the end of the warm-up and freeze them."""
        torch = _torch()
        m = torch.zeros_like(flat_like)
        denom = torch.empty_like(flat_like)
        step = None
        with torch.no_grad():
            for p, g, off, n in self.slices:
                st = optimizer.state.get(p, {})
                if "exp_avg_sq" not in st:
                    raise RuntimeError("DistributedOptimizer: adam='frozen' needs at least one dense warm-up "
                                       "step with a gradient for every parameter (warmup_steps >= 1)")
                t = int(st["step"])
                step = t if step is None else step
                if t != step:
                    raise RuntimeError("DistributedOptimizer: adam='frozen': parameters stepped different "
                                       f"numbers of times in the warm-up ({step} and {t})")
                beta2, eps = g["betas"][1], g["eps"]
                d = denom[off:off + n]
                d.copy_(st["exp_avg_sq"].reshape(-1)).sqrt_().div_((1 - beta2 ** t) ** 0.5).add_(eps)
                torch.div(st["exp_avg"].reshape(-1), d, out=m[off:off + n])
        self.m, self.denom, self.step, self.frozen = m, denom, int(step), True

    def before(self, flat) -> None:
        """This rank's gradient into the exchanged units (``"frozen"``: divided by ``denom``)."""
        if self.mode == "frozen":
            flat.div_(self.denom)

    def update(self, flat) -> None:
        """Step every parameter with the exchanged average ``flat``; identical on every rank."""
        torch = _torch()
        with torch.no_grad():
            if self.mode == "frozen-gradient":
                flat.div_(self.denom)
            self.step += 1
            t = self.step
            for p, g, off, n in self.slices:
                beta1 = g["betas"][0]
                lr, wd = float(g["lr"]), float(g["weight_decay"])
                pv = flat[off:off + n].view_as(p)
                mv = self.m[off:off + n].view_as(p)
                if wd and not self.decoupled:
                    pv.addcdiv_(p, self.denom[off:off + n].view_as(p), value=wd)
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
        if not isinstance(d, dict) or d.get("mode") != self.mode:
            mode = d.get("mode") if isinstance(d, dict) else None
            raise ValueError(f"DistributedOptimizer.load_state_dict: the dict is of adam={mode!r}, "
                             f"this optimizer runs adam={self.mode!r}")
        if bool(d.get("frozen")):
            for key in ("m", "denom"):
                v = d.get(key)
                if v is None or v.numel() != self.numel:
                    raise ValueError(f"DistributedOptimizer.load_state_dict: exdyna_adam.{key} has "
                                     f"{None if v is None else v.numel()} elements, the model {self.numel}")

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Load a dict that ``check`` accepted."""
        self.frozen, self.step = bool(d["frozen"]), int(d["step"])
        self.m = None if d["m"] is None else d["m"].detach().clone()
        self.denom = None if d["denom"] is None else d["denom"].detach().clone()
