"""``Stats``: what one step did, the same fields for every sparsifier plus each one's own."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

import numpy as np

__all__ = ["Stats"]


@dataclasses.dataclass(init=False, eq=False, repr=False, slots=True)
class Stats:
    """What the last step did (``Sparsifier.stats``).

    The common fields are attributes; a sparsifier's own fields (ExDyna: ``quota_moved``,
    ``deadline``; FFT: ``rel_error``; the union baselines: ``union``, ``build_up``, ...) are in
    ``extra``. Both read as ``stats["name"]``, and an extra field also as ``stats.name``
    (``__getattr__`` looks in ``extra`` when no field has the name). ``keys()`` and ``as_dict()``
    list the common fields first, in the order below, then the extra ones.

    Attributes:
        iteration: the step's index.
        bytes_sent: this rank's bytes of the step, sent.
        bytes_received: this rank's bytes of the step, received.
        seconds: phase timings (``{}`` for a skipped step).
        skipped: skipped on every rank (non-finite values, ``nonfinite="skip"``).
        counts: (P,) what each rank selected (its load).
        selected: the total selection.
        density: ``selected / numel``.
        threshold: the global threshold, where there is one.
        bounds: the partition boundaries of the step (ExDyna, MiCRO, Ok-Topk's regions).
        owned: the partition each rank owned.
        imbalance: ``max count x P / total - 1`` (None for a skipped step).
        extra: the sparsifier's own fields.

    Example::

        >>> sp.step(grad); st = sp.stats
        >>> st.density, st["bytes_sent"], st.extra.get("quota_moved")
    """

    #: the common fields, in this order in ``keys()`` and ``as_dict()``
    FIELDS: ClassVar[tuple[str, ...]] = ("iteration", "counts", "selected", "density", "threshold", "bounds", "owned",
                                         "bytes_sent", "bytes_received", "seconds", "skipped", "imbalance")

    iteration: int
    counts: np.ndarray | None
    selected: int | None
    density: float | None
    threshold: float | None
    bounds: np.ndarray | None
    owned: np.ndarray | None
    bytes_sent: int
    bytes_received: int
    seconds: dict[str, float]
    skipped: bool
    imbalance: float | None
    extra: dict[str, Any]

    def __init__(self, *, iteration: int, bytes_sent: int, bytes_received: int, seconds: dict[str, float],
                 skipped: bool, counts: np.ndarray | None = None, selected: int | None = None,
                 density: float | None = None, threshold: float | None = None, bounds: np.ndarray | None = None,
                 owned: np.ndarray | None = None, imbalance: float | None = None,
                 extra: Mapping[str, Any] | None = None, **more: Any) -> None:
        """Args: the fields (above); ``more``: extra fields given by name, added to ``extra``."""
        self.iteration = iteration
        self.counts = counts
        self.selected = selected
        self.density = density
        self.threshold = threshold
        self.bounds = bounds
        self.owned = owned
        self.bytes_sent = bytes_sent
        self.bytes_received = bytes_received
        self.seconds = seconds
        self.skipped = skipped
        self.imbalance = imbalance
        self.extra = {**(extra or {}), **more}

    def __getattr__(self, name: str) -> Any:
        # only reached when no field has the name: an extra field, else the usual AttributeError
        if name != "extra" and name in self.extra:
            return self.extra[name]
        raise AttributeError(f"'Stats' object has no attribute {name!r}")

    def __getitem__(self, key: str) -> Any:
        if key in self.FIELDS:
            return getattr(self, key)
        try:
            return self.extra[key]
        except KeyError:
            raise KeyError(key) from None

    def keys(self) -> list[str]:
        """The common fields' names, then the extra ones'."""
        return list(self.FIELDS) + list(self.extra)

    def as_dict(self) -> dict[str, Any]:
        """Every field by name, the extra ones included (a new dict)."""
        return {**{k: getattr(self, k) for k in self.FIELDS}, **self.extra}

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items() if k != "seconds")
        return f"Stats({body})"

