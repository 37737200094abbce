"""Picklable factory of fake engines for data-parallel replica processes (they import this module)."""

from __future__ import annotations

from fake_engine import FakeEngine

STEP_S = 0.05  # slow enough that a stream is still running when a test aborts it or kills its replica


class ReplicaFakeEngine(FakeEngine):
    """The letter-generating FakeEngine (tests/fake_engine.py), whose add history a test
    can read from the server process (``ReplicaEngine.call_engine``)."""

    def steps_before_adds(self) -> list[int]:
        """Engine steps run before each add_request, in order."""
        return list(self.added_at_step)


def fake_replica(config) -> ReplicaFakeEngine:
    """One replica's engine."""
    return ReplicaFakeEngine(max_model_len=config.max_model_len, step_s=STEP_S)
