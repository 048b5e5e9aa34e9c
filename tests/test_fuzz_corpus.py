"""Corpus traces with a recorded vLLM 0.32 decision log, replayed against the spec in normal CI.

Each ``tests/corpus/NAME.jsonl`` that has ``tests/corpus/vllm/NAME.log.jsonl``
is a finding of the vLLM conformance work (docs/conformance.md): the spec,
fed the tokens vLLM sampled, must make every decision vLLM made.  No vLLM is
needed here; ``tests/test_vllm_conformance.py`` (marker ``vllm``) checks that
the stored logs are still what the live vLLM writes.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fuzz.replay import replay_records
from spec.io import load_log, load_trace

CORPUS = Path(__file__).parent / "corpus"
PAIRS = sorted((t, CORPUS / "vllm" / f"{t.stem}.log.jsonl") for t in CORPUS.glob("*.jsonl")
               if (CORPUS / "vllm" / f"{t.stem}.log.jsonl").exists())


def test_corpus_has_recorded_vllm_logs():
    assert len(PAIRS) >= 3


@pytest.mark.parametrize("trace_path,log_path", PAIRS, ids=[t.stem for t, _ in PAIRS])
def test_spec_makes_vllms_decisions(trace_path, log_path):
    trace, log = load_trace(trace_path), load_log(log_path)
    assert trace.description, "a corpus trace explains itself in its header's description"
    assert log.engine == "vllm-0.32.0" and log.level == "exact"
    result = replay_records(trace, log.records, "exact", engine="vllm")
    assert result.agreed, result.describe()


def test_stall_traces_stall_on_both_sides():
    for name in ("vllm-stall-never-fits", "vllm-self-preempt-livelock"):
        trace = load_trace(CORPUS / f"{name}.jsonl")
        result = replay_records(trace, load_log(CORPUS / "vllm" / f"{name}.log.jsonl").records, "exact", engine="vllm")
        assert result.agreed and result.notes and "max_steps=40" in result.notes[0]
        # The profile's default rejects the request at arrival instead.
        default = dataclasses.replace(trace, config={k: v for k, v in trace.config.items() if k != "reject_unservable"})
        from spec.scheduler import run

        assert run(default)[0].rejected == [("big", "never_fits")]


def test_priority_self_preempt_knob_is_what_separates_vllm_032_from_033():
    trace = load_trace(CORPUS / "vllm-priority-self-preempt.jsonl")
    records = load_log(CORPUS / "vllm" / "vllm-priority-self-preempt.log.jsonl").records
    assert replay_records(trace, records, "exact").agreed
    as_033 = dataclasses.replace(trace, config={**trace.config, "priority_self_preempt": "continue"})
    d = replay_records(as_033, records, "exact", engine="vllm").divergence
    assert d is not None and (d.step, d.field) == (2, "scheduled")
    assert d.spec_value == [["B", 1]] and d.engine_value == []
