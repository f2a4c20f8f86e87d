"""Model-averaging layer: exchanges that average whole models instead of sparsifying gradients.

- ``wagma``: ``GroupAverager``, WAGMA-SGD's group averaging (sync and wait-avoiding), over the
  point-to-point calls of ``transport/group.py``.

Same rank as the sparsifiers: it uses ``arrays`` and ``transport`` (and ``sparsifiers.base.Stats``).
"""
from .wagma import GroupAverager

__all__ = ["GroupAverager"]
