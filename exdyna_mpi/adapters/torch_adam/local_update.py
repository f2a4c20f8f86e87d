"""``adam="update"``: Adam on each rank, its update exchanged with error feedback."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._torch_common import _torch
from .base import AdamPath

if TYPE_CHECKING:
    import torch


class LocalUpdateAdam(AdamPath):
    """``adam="update"``: each rank runs Adam on its own gradient and the sparsifier exchanges the
    update it gives, so the parameters are linear in what is exchanged and error feedback is sound
    with live moments.

    1. Each rank runs Adam's moment arithmetic on its own gradient (after the recipe's clipping):
       ``m_r = beta1 m_r + (1 - beta1) g_r``, ``v_r = beta2 v_r + (1 - beta2) g_r**2``
       (``torch.optim.Adam``'s coupled decay adds ``wd * theta`` to ``g_r`` first), and its update at
       unit learning rate, ``u_r = (m_r / (1 - beta1**t)) / (sqrt(v_r / (1 - beta2**t)) + eps)``.
    2. The sparsifier exchanges ``u_r`` with error feedback: what a rank does not send this step
       stays in its residual, in update units, and is sent later. Selection ranks coordinates by the
       size of the step Adam wants to make, not by the raw gradient.
    3. Every rank applies the same averaged update: AdamW's decay ``theta *= 1 - lr * wd``, then
       ``theta -= lr * u_avg``, with ``lr`` read from the param group at that step (schedulers work).

    What changes from Adam: the moments are each rank's own (its ``1/P`` of the batch), so ``v_r``
    holds each rank's gradient noise and the update is the mean of ``P`` per-rank Adam steps rather
    than one Adam step on the mean gradient (with ``P = 1`` and the dense exchange it is Adam). This
    is DiLoCo's inner step with one local step and no outer optimiser: the parameters move by the
    sum of what the ranks' Adam steps ask, less what the residuals still hold.

    When to use it: an Adam whose live moments matter and no warm-up is wanted, where the update's
    values (not only their signs) should travel. The wrapped optimizer's ``lr``, betas, eps and
    weight decay are read each step; its own ``state`` is not used.

    State: the moments differ between ranks and live in each rank's ``opt.state_dict()`` under
    ``"exdyna_adam"``; the parameters are bit-identical on every rank. The new moments are committed
    only once the exchange succeeds, so a refused or skipped step (``nonfinite="skip"``) leaves them
    as they were. ``warmup_steps`` still gives dense exchanges of ``u_r`` first.

    Args:
        optimizer: the wrapped ``torch.optim.Adam`` or ``AdamW``.
        params: the parameters in the flat gradient's order (``FlatGrad.params``).
        mode: ``"update"``.
        who: the entry point's name, for messages.

    Raises:
        ValueError: as ``AdamPath``.
    """

    modes = ("update",)
    rank_local = ("m", "v")   # each rank's own moments

    def __init__(self, optimizer, params, mode: str = "update", who: str = "DistributedOptimizer") -> None:
        super().__init__(optimizer, params, mode, who)
        self.step = 0            # Adam's t: steps completed
        # this rank's first and second moments (flat, allocated at the first step)
        self.m: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self._next: tuple[torch.Tensor, torch.Tensor] | None = None   # (m, v) of the step in flight

    @property
    def owns_step(self) -> bool:
        """Always: the averaged update steps the parameters."""
        return True

    def prepare(self, optimizer, flat, dense: bool) -> None:
        """This rank's Adam update at unit learning rate, written over its gradient ``flat``; the new
        moments wait in scratch buffers until ``update`` commits them."""
        torch = _torch()
        if self.m is None or self.v is None:
            self.m, self.v = torch.zeros_like(flat), torch.zeros_like(flat)
        self.place(flat.device)
        if self._next is None or self._next[0].device != flat.device:
            self._next = (torch.empty_like(flat), torch.empty_like(flat))
        m, v = self.m, self.v
        m2, v2 = self._next
        t = self.step + 1
        self._couple_decay(flat)
        with torch.no_grad():
            for p, g, off, n in self.slices:
                beta1, beta2 = g["betas"]
                eps = g["eps"]
                gv = flat[off:off + n]
                mv, vv = m2[off:off + n], v2[off:off + n]
                torch.mul(m[off:off + n], beta1, out=mv).add_(gv, alpha=1 - beta1)
                torch.mul(v[off:off + n], beta2, out=vv).addcmul_(gv, gv, value=1 - beta2)
                # u = (m / bc1) / (sqrt(v / bc2) + eps), written over this rank's gradient
                torch.sqrt(vv, out=gv).div_((1 - beta2 ** t) ** 0.5).add_(eps)
                torch.div(mv, gv, out=gv).div_(1 - beta1 ** t)

    def place(self, device) -> None:
        if self.m is not None and self.v is not None and self.m.device != device:   # loaded from a host copy
            self.m, self.v = self.m.to(device), self.v.to(device)

    def update(self, flat, skipped: bool) -> None:
        """Commit the step's moments, then descend by the averaged update ``flat``."""
        if skipped or self._next is None:   # the exchange skipped the step everywhere: nothing changes
            return
        # the step's moments become the state; the old buffers are the next step's scratch
        self.m, self.v, self._next = self._next[0], self._next[1], (self.m, self.v)
        self.step += 1
        self._descend(flat)

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "step": self.step,
                "m": None if self.m is None else self.m.clone(),
                "v": None if self.v is None else self.v.clone()}

    def check(self, d: dict[str, Any]) -> None:
        """Raise ``ValueError`` if ``d`` cannot be loaded (another mode, wrong lengths, non-finite
        moments); changes nothing."""
        self._check_mode(d)
        self._check_step(d)
        if d["step"] > 0:
            self._check_vectors(d, ("m", "v"))

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Load a dict that ``check`` accepted."""
        self.step = int(d["step"])
        fresh = self.step == 0 or d.get("m") is None
        self.m = None if fresh else d["m"].detach().clone()
        self.v = None if fresh else d["v"].detach().clone()
