"""Adam under sparse exchange: ``adam="update"`` (Adam on each rank, its update exchanged with error
feedback) and ``adam="frozen"`` (a dense warm-up, then a frozen second moment).

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

``adam="update"`` makes the exchanged quantity Adam's *update* instead of the gradient, so that
the parameters are linear in what is exchanged and error feedback is sound with live moments:

1. Each rank runs Adam's moment arithmetic on its own gradient (after the recipe's clipping):
   ``m_r = beta1 m_r + (1 - beta1) g_r``, ``v_r = beta2 v_r + (1 - beta2) g_r**2`` (``torch.optim.Adam``'s
   coupled decay adds ``wd * theta`` to ``g_r`` first), and its update at unit learning rate,
   ``u_r = (m_r / (1 - beta1**t)) / (sqrt(v_r / (1 - beta2**t)) + eps)``.
2. The sparsifier exchanges ``u_r`` with error feedback: what a rank does not send this step stays
   in its residual, in update units, and is sent later. Selection ranks coordinates by the size of
   the step Adam wants to make (close to SCAPE's first-moment masks), not by the raw gradient.
3. Every rank applies the same averaged update: AdamW's decay ``theta *= 1 - lr * wd``, then
   ``theta -= lr * u_avg``, with ``lr`` read from the param group at that step (schedulers work).

What changes from Adam: the moments are each rank's own (its ``1/P`` of the batch), so ``v_r``
holds each rank's gradient noise and the update is the mean of ``P`` per-rank Adam steps rather than
one Adam step on the mean gradient (with ``P = 1`` and the dense exchange it is Adam). This is
DiLoCo's inner step with one local step and no outer optimiser, and what error feedback over a
compressed *update* analyses: the parameters move by the sum of what the ranks' Adam steps ask,
less what the residuals still hold. The moments differ between ranks and live in each rank's
``opt.state_dict()`` under ``"exdyna_adam"``; the parameters are bit-identical on every rank. The
new moments are committed only once the exchange succeeds, so a refused or skipped step
(``nonfinite="skip"``) leaves them as they were. No warm-up is needed (``warmup_steps`` still gives
dense exchanges of ``u_r`` first).

What is exact in ``"frozen"``: the warm-up steps are torch's Adam bit for bit. After it the update is Adam with
the second moment of step ``warmup_steps`` held fixed; with a dense exchange that differs from
Adam only by the frozen variance. Every rank holds the same bits (the exchanged average is
bit-identical and everything after it is elementwise). ``amsgrad``, ``maximize`` and complex
parameters are refused. The wrapped optimizer's own ``state`` stops changing at the freeze; this
path's state (``m``, ``denom``, the step count) is in ``opt.state_dict()`` under
``"exdyna_adam"``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..sparsifiers.registry import REGISTRY
from ._torch_common import _torch

if TYPE_CHECKING:
    import torch

ADAM_KEY = "exdyna_adam"
MODES = ("live", "update", "frozen", "frozen-gradient", "demo", "demo-age")
#: what the entry points' ``adam=`` accepts: the paths, and ``"auto"`` (see ``make_adam_path``)
CHOICES = ("auto",) + MODES


def tuned_defaults(sparsifier: str | None) -> bool:
    """Whether the registered sparsifier ``sparsifier`` declares the tuned defaults
    (``Capabilities.tuned_defaults``): where ``"auto"`` chooses the aged decoupled momentum."""
    cls = REGISTRY.get(sparsifier) if isinstance(sparsifier, str) else None
    return cls is not None and cls.CAPABILITIES.tuned_defaults


def is_adam(optimizer) -> bool:
    """``torch.optim.Adam`` or ``AdamW`` (subclasses included)."""
    torch = _torch()
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


def check_mode(optimizer, mode: str, warmup_steps: Any, who: str) -> None:
    """Raise ``ValueError`` unless ``mode`` is one of ``CHOICES`` and an Adam path ``optimizer`` can
    run with this warm-up (``"frozen"`` freezes the variance of a dense warm-up: ``warmup_steps >= 1``;
    ``"auto"`` runs with any optimizer: see ``make_adam_path``)."""
    if mode not in CHOICES:
        raise ValueError(f"{who}: adam must be one of {CHOICES}, got {mode!r}")
    if mode not in ("live", "auto") and not is_adam(optimizer):
        raise ValueError(f"{who}: adam={mode!r} needs torch.optim.Adam or AdamW, got {type(optimizer).__name__}")
    if mode.startswith("frozen") and not (isinstance(warmup_steps, int) and warmup_steps >= 1):
        raise ValueError(f"{who}: adam={mode!r} freezes the variance after a dense warm-up: "
                         f"give warmup_steps >= 1, got {warmup_steps!r}")


def make_adam_path(optimizer, params, mode: str, who: str = "DistributedOptimizer",
                   sparsifier: str | None = None) -> "AdamPath | None":
    """The path ``DistributedOptimizer(adam=mode)`` (or ``ExDynaHookState(adam=mode)``, ``who`` in
    messages) runs: None for ``"live"`` (the wrapped optimizer steps on the exchanged gradient), else
    ``LocalUpdateAdam``, ``DecoupledMomentum`` or ``FrozenVarianceAdam``.

    ``"auto"`` (``DistributedOptimizer``'s default) is ``"demo-age"`` where it runs and was measured
    to win, a ``torch.optim.Adam``/``AdamW`` with a sparsifier whose ``CAPABILITIES`` declare
    ``tuned_defaults`` (ExDyna), and ``"live"`` elsewhere:
    for other optimizers and sparsifiers, and where ``AgedDecoupledMomentum`` refuses the optimizer
    (``amsgrad``, ``maximize``, complex parameters, more than one ``betas[0]`` or one outside
    ``[0, 1)``)."""
    if mode == "auto":
        if not is_adam(optimizer) or not tuned_defaults(sparsifier):
            return None
        try:
            return AgedDecoupledMomentum(optimizer, params, who)
        except ValueError:   # its refusals are the cases "auto" leaves to "live"
            return None
    if mode == "live":
        return None
    if mode == "demo":
        return DecoupledMomentum(optimizer, params, who)
    if mode == "demo-age":
        return AgedDecoupledMomentum(optimizer, params, who)
    if mode == "update":
        return LocalUpdateAdam(optimizer, params, mode, who)
    return FrozenVarianceAdam(optimizer, params, mode, who)


class AdamPath:
    """What the Adam paths share: the checks, the flat layout over the optimizer's param groups, and
    the protocol ``DistributedOptimizer`` drives each step: ``prepare`` (this rank's gradient into
    the exchanged units), the exchange, then ``update`` when ``owns_step`` (else the wrapped
    optimizer steps).

    Args:
        optimizer: the wrapped ``torch.optim.Adam`` or ``AdamW``.
        params: the parameters in the flat gradient's order (``FlatGrad.params``).
        mode: one of ``MODES`` but ``"live"``.
        who: the entry point's name, for messages.

    Raises:
        ValueError: ``amsgrad``, ``maximize`` or complex parameters (not supported).
    """

    #: what the sparsifier's residual is multiplied by after each exchange that was not skipped (None:
    #: left alone); ``DistributedOptimizer.step`` applies it
    residual_decay: float | None = None
    #: whether ``update`` reads only the signs of the exchanged average (an edit of ``.grad`` that
    #: keeps every sign then changes nothing: the DDP hook accepts it)
    signs_only = False

    def __init__(self, optimizer, params, mode: str, who: str = "DistributedOptimizer") -> None:
        torch = _torch()
        self.who = who
        if mode not in MODES[1:]:
            raise ValueError(f"{self.who}: adam must be one of {MODES}, got {mode!r}")
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
        """This rank's gradient ``flat`` into the exchanged units, in place (``dense``: a warm-up step)."""
        raise NotImplementedError

    def update(self, flat, skipped: bool) -> None:
        """Step every parameter with the exchanged average ``flat``; identical on every rank."""
        raise NotImplementedError

    def apply(self, flat, skipped: bool, sp) -> None:
        """``update``, then ``decay_residual``; nothing for a skipped exchange."""
        if skipped:
            return
        self.update(flat, skipped)
        self.decay_residual(sp, skipped)

    def decay_residual(self, sp, skipped: bool) -> None:
        """The residual decay of ``sp`` (the sparsifier that ran the step) when the path sets one
        (``adam="demo"``: the residual is the momentum) and the step was not skipped."""
        if self.residual_decay is not None and not skipped:
            sp.scale_residual(self.residual_decay)

    def sparsifier_options(self, sparsifier: str, options: dict[str, Any]) -> dict[str, Any]:
        """The sparsifier's options this path runs with: ``options`` (``DecoupledMomentum`` adds
        ``output="sign"``)."""
        return options

    def place(self, device) -> None:
        """Move this path's tensors to ``device`` (a state loaded as host copies); a no-op where they are.
        ``prepare`` calls it, so a resumed path follows the gradient to its device."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's state of the path (tensors and plain values), under ``"exdyna_adam"``."""
        raise NotImplementedError

    def check(self, d: dict[str, Any]) -> None:
        """Raise ``ValueError`` if ``d`` cannot be loaded; changes nothing."""
        raise NotImplementedError

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Load a dict that ``check`` accepted."""
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


class LocalUpdateAdam(AdamPath):
    """The state and arithmetic of ``adam="update"`` (module docstring): this rank's Adam moments,
    its update exchanged with error feedback, the average applied on every rank."""

    def __init__(self, optimizer, params, mode: str = "update", who: str = "DistributedOptimizer") -> None:
        super().__init__(optimizer, params, mode, who)
        self.step = 0            # Adam's t: steps completed
        # this rank's first and second moments (flat, allocated at the first step)
        self.m: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self._next: tuple[torch.Tensor, torch.Tensor] | None = None   # (m, v) of the step in flight

    @property
    def owns_step(self) -> bool:
        return True

    def prepare(self, optimizer, flat, dense: bool) -> None:
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
    """

    signs_only = True

    def __init__(self, optimizer, params, who: str = "DistributedOptimizer", mode: str = "demo") -> None:
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
        return True

    def prepare(self, optimizer, flat, dense: bool) -> None:
        self._couple_decay(flat)

    def sparsifier_options(self, sparsifier: str, options: dict[str, Any]) -> dict[str, Any]:
        """``output="sign"`` where the sparsifier offers it and ``options`` leave ``output`` unset:
        this path reads nothing but the sign of the exchanged average, so only signs travel on the
        gathering half of the value exchange (2 bits a value instead of 32; the same update to the
        bit, about 40 % fewer bytes at P = 4)."""
        cls = REGISTRY.get(sparsifier)
        if "output" in options or cls is None or not cls.CAPABILITIES.sign_output:
            return options
        return dict(options, output="sign")

    def update(self, flat, skipped: bool) -> None:
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

    State: the step at which each coordinate last moved (int32, 4 bytes a parameter, the same on
    every rank: it follows the exchanged average), in ``"exdyna_adam"`` with the step count.
    """

    def __init__(self, optimizer, params, who: str = "DistributedOptimizer") -> None:
        super().__init__(optimizer, params, who, mode="demo-age")
        self.moved: torch.Tensor | None = None   # flat int32: the step of each coordinate's last move (0: never)

    def place(self, device) -> None:
        if self.moved is not None and self.moved.device != device:   # loaded from a host copy
            self.moved = self.moved.to(device)

    def prepare(self, optimizer, flat, dense: bool) -> None:
        self.place(flat.device)
        super().prepare(optimizer, flat, dense)

    def update(self, flat, skipped: bool) -> None:
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


class FrozenVarianceAdam(AdamPath):
    """The state and arithmetic of ``adam="frozen"`` / ``"frozen-gradient"`` (module docstring).

    Args:
        optimizer: the wrapped ``torch.optim.Adam`` or ``AdamW``.
        params: the parameters in the flat gradient's order (``FlatGrad.params``).
        mode: ``"frozen"`` (precondition before the exchange) or ``"frozen-gradient"`` (after it).
        who: the entry point's name, for messages.
    """

    def __init__(self, optimizer, params, mode: str, who: str = "DistributedOptimizer") -> None:
        if mode == "update":
            raise ValueError("FrozenVarianceAdam runs adam='frozen' or 'frozen-gradient'")
        super().__init__(optimizer, params, mode, who)
        self.frozen = False
        self.step = 0            # Adam's t: the warm-up's steps, then one per frozen step
        self.m: torch.Tensor | None = None       # first moment in preconditioned units (flat)
        self.denom: torch.Tensor | None = None   # sqrt(v_hat) + eps at the freeze (flat)

    def freeze(self, optimizer, flat_like) -> None:
        """Read the wrapped optimizer's moments at the end of the warm-up and freeze them."""
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
        return self.frozen   # the warm-up's steps are the wrapped optimizer's

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
