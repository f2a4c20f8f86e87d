"""Sparsifier layer: the step template and its roles, ExDyna and MiCRO, the baselines, the factory.

- ``base``: ``Sparsifier`` (the step template); ``stats``: ``Stats``;
- ``config``: ``Option`` (an option a class declares), ``SparsifierConfig`` (the arguments a
  constructor resolved, ``Sparsifier.config``);
- ``roles``: ``ErrorFeedback`` (memory), ``Selector`` (the protocol every sparsifier implements),
  ``Selection``, ``Step``; ``step_words``: the first collective (``StepWords``, ``RankWords``, its
  two paths); ``step_guard``: a step's refusal, skip and non-finite exits; ``checkpoint``: state dicts;
- ``exdyna``: ``ExDyna``, ``MiCRO``; ``baselines/``: the comparison set;
- ``registry``: ``make``, ``available``, ``register``.

A new sparsifier: subclass ``Sparsifier``, implement ``report_size``/``select``/``combine``, declare
its ``OPTIONS``, and ``register`` it (examples/topk_sparsifier.py, docs/architecture.md).
"""
from ..algorithm.layout import Balance
from .base import Sparsifier
from .config import Option, SparsifierConfig, nonneg_int, positive_int
from .exdyna import ExDyna, MiCRO
from .registry import REGISTRY, available, make, register
from .roles import ErrorFeedback, Selection, Step
from .stats import Stats

__all__ = ["REGISTRY", "Balance", "ErrorFeedback", "ExDyna", "MiCRO", "Option", "Selection", "Sparsifier",
           "SparsifierConfig", "Stats", "Step", "available", "make", "nonneg_int", "positive_int", "register"]
