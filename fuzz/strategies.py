"""Hypothesis strategies for traces (``traces()``, ``configs()``), for users' own properties.

They live in :mod:`invariants.strategies` (the invariant checkers use them too,
and ``invariants`` may not import ``fuzz``); this is the documented import path.
"""
from invariants.strategies import configs, traces

__all__ = ["configs", "traces"]
