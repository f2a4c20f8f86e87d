"""Framework adapters: thin layers that reach the sparsifiers through DLPack.

Each adapter is its own module and imports its framework only when used, so ``import exdyna_mpi``
never pulls in torch, JAX or TensorFlow:

- ``exdyna_mpi.adapters.torch``: ``DistributedOptimizer`` (one flat gradient buffer, sparsified in
  place before ``optimizer.step()``), ``broadcast_parameters``, ``FlatGrad``.
- JAX and TensorFlow need no adapter: pass a flat gradient to ``Sparsifier.step`` (see
  ``docs/training.md`` and ``jobs/examples/``).
"""
