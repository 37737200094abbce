"""Picklable factory of fake engines for data-parallel replica processes (they import this module)."""

from __future__ import annotations

from test_async_engine import FakeEngine

STEP_S = 0.02  # slow enough that a stream is still running when a test aborts it or kills its replica


def fake_replica(config) -> FakeEngine:
    """A letter-generating FakeEngine (tests/test_async_engine.py) as one replica's engine."""
    return FakeEngine(max_model_len=config.max_model_len, step_s=STEP_S)
