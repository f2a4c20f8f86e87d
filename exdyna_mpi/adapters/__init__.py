"""Framework adapters: thin layers that reach the sparsifiers through DLPack.

Each adapter is its own module and imports its framework only when used, so ``import exdyna_mpi``
never pulls in torch, JAX or TensorFlow:

- ``exdyna_mpi.adapters.torch``: the public torch API. ``DistributedOptimizer`` (one flat gradient
  buffer, sparsified in place before ``optimizer.step()``), ``broadcast_parameters``, ``FlatGrad``;
  ``ExDynaHookState`` / ``exdyna_hook`` (the DDP communication hook, the ``torch_hook`` package); and
  ``GroupAveragingOptimizer`` / ``FlatParams`` (WAGMA-SGD model averaging), defined in
  ``torch_wagma.py``; ``DiLoCo`` (local steps, then a sparse outer step on the parameter delta),
  in ``torch_diloco.py``. What they share (parameter checks, rank 0's broadcast, the wrapped optimizer
  class) is in ``_torch_common.py``, which imports neither: no import cycle.
- JAX and TensorFlow need no adapter: pass a flat gradient to ``Sparsifier.step`` (see
  ``docs/training.md`` and ``jobs/examples/``).
"""
