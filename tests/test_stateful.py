"""Hypothesis stateful testing of the spec (bounded, fixed seed in CI)."""
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from invariants.stateful import machine_for
from spec.invariants import InvariantViolation
from spec.scheduler import SpecEngine

CI = settings(max_examples=40, stateful_step_count=30, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))

# Mutants must be found; shrinking is skipped to keep CI fast.
MUTANT = settings(CI, max_examples=300, phases=(Phase.explicit, Phase.generate))

TestVllmV1 = machine_for("vllm-v1").TestCase
TestVllmV1.settings = CI


def test_machine_catches_a_preemption_that_keeps_computed_tokens(monkeypatch):
    """Mutant (LMD-02 / VLLM-13): the victim frees its blocks but keeps num_computed_tokens."""
    original = SpecEngine._preempt

    def leaky(self, req, out):
        kept = req.num_computed_tokens
        original(self, req, out)
        req.num_computed_tokens = kept

    monkeypatch.setattr(SpecEngine, "_preempt", leaky)
    with pytest.raises((InvariantViolation, AssertionError, Flaky)) as e:
        run_state_machine_as_test(machine_for("vllm-v1"), settings=MUTANT)
    assert "computed" in str(e.value)


def test_machine_catches_an_abort_that_forgets_to_free(monkeypatch):
    """Mutant (VLLM-09 family): abort removes the request but leaks its blocks."""

    def leaky_finish(self, req, status, why):
        from spec.scheduler import Status

        if status != Status.ABORTED:
            self.kv.free(req.request_id)
        req.status = status
        req.finish_reason = why

    monkeypatch.setattr(SpecEngine, "_finish", leaky_finish)
    with pytest.raises((InvariantViolation, AssertionError, Flaky)) as e:
        run_state_machine_as_test(machine_for("vllm-v1"), settings=MUTANT)
    assert "holds" in str(e.value)
