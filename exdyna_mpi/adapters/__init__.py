"""Framework adapters: thin layers that reach the sparsifiers through DLPack.

Each adapter is its own module and imports its framework only when used, so ``import exdyna_mpi``
never pulls in torch, JAX or TensorFlow:

- ``exdyna_mpi.adapters.torch``: the public torch API. ``DistributedOptimizer`` (one flat gradient
  buffer, sparsified in place before ``optimizer.step()``; the methods it adds are in
  ``_torch_distributed.py``), ``broadcast_parameters``, ``FlatGrad`` (``_torch_flat.py``);
  ``ExDynaHookState`` / ``exdyna_hook`` (the DDP communication hook, the ``torch_hook`` package); and
  ``GroupAveragingOptimizer`` / ``FlatParams`` (WAGMA-SGD model averaging), defined in
  ``torch_wagma.py``; ``DiLoCo`` (local steps, then a sparse outer step on the parameter delta),
  in ``torch_diloco.py``. What they share (parameter checks, rank 0's broadcast, the wrapped optimizer
  class) is in ``_torch_common.py``, which imports neither: no import cycle.
- ``exdyna_mpi.adapters.torch_adam``: the Adam paths that both torch entry points' ``adam=`` selects
  (``AdamPath``, one class per family of modes, and the registry ``ADAM_PATHS`` that ``make_adam_path``
  and ``check_mode`` read).
- JAX and TensorFlow need no adapter: pass a flat gradient to ``Sparsifier.step`` (see
  ``docs/training.md`` and ``jobs/examples/``).
"""
