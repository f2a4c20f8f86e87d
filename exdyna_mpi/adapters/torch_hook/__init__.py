"""A DDP communication hook: ``ddp.register_comm_hook(ExDynaHookState(...), exdyna_hook)``.

DDP hands the hook one bucket of gradients at a time and waits, at the end of ``backward()``, for
the futures the hook returned. The hook only works out where the bucket's parameters sit and
enqueues the work; one worker thread per state runs the exchanges in FIFO order, so every rank
issues its collectives in the same order while the backward thread goes on. The collectives run on
a private duplicate of ``comm`` that the worker makes, so the user's own calls on ``comm`` never
meet them. Import it as ``from exdyna_mpi.adapters.torch import ExDynaHookState, exdyna_hook``.

The modules, each holding one job of the state:

- ``state.py``: ``ExDynaHookState``, the configuration and the public methods; ``exchange(bucket)``
  is the one the hook calls;
- ``hook.py``: ``exdyna_hook``;
- ``layout.py``: the canonical parameter layout (pure: no MPI, no torch);
- ``scopes.py``: ``ModelScope`` and ``BucketScope``, what differs between ``scope="model"`` and
  ``scope="bucket"`` (residual adoption when DDP regroups the parameters included);
- ``iteration.py``: the worker's iterations, from a bucket's job to its future;
- ``checkpoint.py``: ``state_dict()`` / ``load_state_dict()``, checked then applied all or nothing;
- ``optimizer_step.py``: what ``optimizer.step()`` runs with ``optimizer=`` (the Adam path's update);
- ``worker.py``: the worker thread, ``comm`` and the private communicator.
"""
from .hook import exdyna_hook
from .state import ExDynaHookState

__all__ = ["ExDynaHookState", "exdyna_hook"]
