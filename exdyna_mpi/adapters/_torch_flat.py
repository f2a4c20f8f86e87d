"""``FlatGrad``: one contiguous gradient buffer whose views are the parameters' ``.grad``, so that
``backward()`` accumulates straight into what the sparsifier exchanges. Public through
``exdyna_mpi.adapters.torch``."""
from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

from ._torch_common import _flat_layout, _torch

if TYPE_CHECKING:
    import torch


class FlatGrad:
    """One contiguous gradient buffer; each parameter's ``.grad`` is a view into it.

    Args:
        params: the parameters (those that require grad), of one dtype and device.

    Raises:
        ValueError: no parameter requires grad, or they differ in dtype or device.

    Example::

        >>> fg = FlatGrad(model.parameters())
        >>> loss.backward()                 # accumulates into fg.flat
        >>> sp.step(fg.flat, out=fg.flat)   # averaged sparse gradient, in place
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        torch = _torch()
        self.params, self.numel = _flat_layout(params, "FlatGrad")
        self.flat = torch.zeros(self.numel, dtype=self.params[0].dtype, device=self.params[0].device)
        self._views: list[Any] = []
        self._ptrs: list[int] = []
        #: per parameter: whether a gradient reached it since ``zero()`` (a backward through it, or a
        #: ``.grad`` set from outside); a parameter that none reached on any rank, and whose slice of
        #: the buffer is zero, steps without ``.grad``
        self.used = bytearray(len(self.params))
        off = 0
        for i, p in enumerate(self.params):
            n = p.numel()
            self._views.append(self.flat[off:off + n].view_as(p))
            off += n
            p.register_post_accumulate_grad_hook(functools.partial(_mark_used, self.used, i))
        self.attach()

    def attach(self) -> None:
        """Point every ``.grad`` at its view (after someone replaced or dropped it)."""
        for i, (p, v) in enumerate(zip(self.params, self._views)):
            if p.grad is None or p.grad.data_ptr() != v.data_ptr():
                if p.grad is not None:
                    with _torch().no_grad():
                        v.copy_(p.grad)  # keep a gradient computed outside the buffer
                    self.used[i] = 1
                else:
                    v.zero_()
                p.grad = v

    def zero(self) -> None:
        """Zero the flat buffer and point every ``.grad`` back at its view."""
        self.flat.zero_()
        self.attach()
        self.used[:] = bytes(len(self.used))

    @property
    def views(self) -> list[Any]:
        """Each parameter's view of the flat buffer, in order."""
        return self._views

    @contextlib.contextmanager
    def without(self, unused: Sequence[int]) -> Iterator[None]:
        """A context in which the parameters ``unused`` have no ``.grad``.

        Torch's optimizers and the Adam paths then leave them alone (neither stepped nor decayed),
        as after DDP's backward with ``find_unused_parameters=True``. Their views come back on exit.

        Args:
            unused: indices into ``params``.

        Returns:
            A context manager (it yields None).
        """
        for i in unused:
            self.params[i].grad = None
        try:
            yield
        finally:
            for i in unused:
                self.params[i].grad = self._views[i]


def _mark_used(used: bytearray, i: int, p: Any) -> None:
    used[i] = 1
