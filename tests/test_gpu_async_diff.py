"""Async scheduling (knob ``async_scheduling``, profile ``vllm-v1-async``; issue #15 item 1):
the spec's hand-worked scenarios, the decision-log field ``outputs_step``, and gpu_engine's
independent implementation against the spec at the exact level on 500 random traces."""
from __future__ import annotations

import json

import pytest
from async_scenarios import SCENARIOS, trace, view

from fuzz.generate import random_trace
from fuzz.replay import replay
from spec.config import ConfigError, resolve
from spec.formats import StepRecord
from spec.protocol import drive
from spec.rules import HITS
from spec.scheduler import SpecEngine


def _spec(t):
    engine = SpecEngine.from_trace(t, check_invariants=True)
    return drive(engine, t, 1000)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_spec_scenarios_worked_by_hand(name):
    t, expected = SCENARIOS[name]
    assert view(_spec(t)) == expected


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_gpu_engine_scenarios_worked_by_hand(name):
    import fuzz.engines  # noqa: F401  (registers gpu)

    t, expected = SCENARIOS[name]
    result = replay(t, "gpu", "exact")
    assert view(result.engine_records) == expected
    assert result.agreed, result.describe()


def test_abort_is_reported_and_sync_profile_is_unchanged():
    t, _ = SCENARIOS["abort_drops_the_token_in_flight"]
    assert _spec(t)[2].aborted == ["B"]
    sync = _spec(trace([{"id": "A", "arrival_step": 0, "prompt_len": 4, "max_tokens": 2}], profile="vllm-v1"))
    assert [(r.scheduled, r.finished, r.outputs_step) for r in sync] == \
        [([("A", 4)], [], None), ([("A", 1)], [("A", "max_tokens")], None)]


def test_outputs_step_is_written_only_under_async_and_validates():
    from spec.io import _check_schema

    rec = StepRecord(step=3, scheduled=[("A", 1)], sampled={"A": 7}, outputs_step=2)
    obj = rec.to_json("decisions")
    assert obj["outputs_step"] == 2 and StepRecord.from_json(obj).outputs_step == 2
    _check_schema("log-record", json.loads(json.dumps(obj)), "log", 2)
    assert "outputs_step" not in StepRecord(step=0).to_json("exact")
    with pytest.raises(Exception):
        _check_schema("log-record", {**obj, "outputs_step": -2}, "log", 2)


def test_async_is_refused_outside_what_it_is_specified_with():
    assert resolve({"profile": "vllm-v1-async"}).async_scheduling
    for knob, value in (("batching", "prefill-first"), ("preemption_mode", "swap"), ("admission", "estimate"),
                        ("cache_register", "computed")):
        with pytest.raises(ConfigError) as e:
            resolve({"profile": "vllm-v1-async", knob: value})
        assert e.value.field == knob and "async_scheduling" in e.value.problem


def test_gpu_engine_refuses_async_with_its_model():
    from gpu_engine.engine import GpuEngine

    with pytest.raises(ValueError, match="async_scheduling"):
        GpuEngine(resolve({"profile": "vllm-v1-async"}), model="tiny")


#: 500 random traces with async scheduling on (the generator's vllm-v1 family draws), in chunks.
CHUNKS = [range(k, k + 100) for k in range(0, 500, 100)]


@pytest.mark.parametrize("seeds", CHUNKS, ids=lambda r: f"{r.start}-{r.stop - 1}")
def test_gpu_engine_agrees_with_the_spec_on_random_async_traces(seeds):
    import fuzz.engines  # noqa: F401

    before = {k: HITS[k] for k in ("ASYNC.LAST_TOKEN_IN_FLIGHT", "ASYNC.STALE_OUTPUT", "ASYNC.ABORT_DROPS_OUTPUT",
                                   "ASYNC.CACHE_AFTER_OUTPUT")}
    diverged = []
    for seed in seeds:
        result = replay(random_trace(seed, async_scheduling=True), "gpu", "exact")
        if not result.agreed:
            diverged.append(f"seed {seed}: {result.describe()}")
    assert not diverged, f"{len(diverged)} of {len(seeds)} diverge:\n" + "\n\n".join(diverged[:3])
    # the chunk reached the async rules that differ from synchronous scheduling (not a vacuous pass)
    assert all(HITS[k] > v for k, v in before.items()), {k: HITS[k] - v for k, v in before.items()}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_vllms_recorded_logs_are_the_hand_worked_scenarios(name):
    """tests/corpus/vllm/vllm-async-*.log.jsonl were written by vLLM 0.32's AsyncScheduler
    (fuzz/vllm_adapter.record_log; re-checked live under the `vllm` marker): vLLM does what the
    scenario says, without vLLM installed here."""
    from pathlib import Path

    from spec.io import load_log

    log = load_log(Path(__file__).parent / "corpus" / "vllm" / f"vllm-async-{name.replace('_', '-')}.log.jsonl")
    assert view(log.records) == SCENARIOS[name][1]
