"""Sparsifier layer: the step template and its roles, ExDyna and MiCRO, the baselines, the factory.

- ``base``: ``Sparsifier`` (the step template) and ``Stats``;
- ``roles``: ``ErrorFeedback`` (memory), ``Selector`` (the protocol every sparsifier implements),
  ``StepWords`` (the error words of the first collective), ``Selection``, ``Step``;
- ``exdyna``: ``ExDyna``, ``MiCRO``; ``baselines/``: the comparison set;
- ``registry``: ``make``, ``available``, ``register``.

A new sparsifier: subclass ``Sparsifier``, implement ``report_size``/``select``/``combine``, and
``register`` it (docs/architecture.md).
"""
from .base import Sparsifier, Stats
from .exdyna import ExDyna, MiCRO
from .registry import REGISTRY, available, make, register

__all__ = ["REGISTRY", "ExDyna", "MiCRO", "Sparsifier", "Stats", "available", "make", "register"]
