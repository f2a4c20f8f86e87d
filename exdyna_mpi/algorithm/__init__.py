"""Algorithm layer: pure host logic, deterministic and identical on every rank.

- ``layout``: ExDyna's block partitions, their rotation (``partition_of``, ``owners``) and
  rebalancing (``BlockLayout``, ``EqualLayout`` for MiCRO; ``Balance``, ExDyna's ``balance`` and its rules).
- ``quota``: per-rank selection quotas that bound one step's load imbalance (``max_imbalance``).
- ``controllers``: the threshold-controller protocol (``Controller``, ``PassPlan``, ``Window``,
  ``OwnedRange``) and its implementations (``measured``, the default; ``faithful``, ``symmetric``;
  ``DenseController`` at density 1).

Touches no per-element data and makes no MPI call.
"""
from .controllers import CONTROLLERS, Controller, OwnedRange, PassPlan, Window, make_controller, target_count
from .layout import Balance, BlockLayout, BlockLoad, EqualLayout, owners, partition_of
from .quota import quotas

__all__ = ["CONTROLLERS", "Balance", "BlockLayout", "BlockLoad", "Controller", "EqualLayout", "OwnedRange", "PassPlan",
           "Window", "make_controller", "owners", "partition_of", "quotas", "target_count"]
