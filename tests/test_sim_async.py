"""The simulator under async scheduling (item 4): a record's ``sampled`` and ``finished`` are the
outputs of step ``outputs_step`` (the batch in flight), emitted when that step ended — vLLM's
engine core applies step N's outputs right after scheduling step N+1 (ASYNC.OUTPUTS_NEXT_STEP) —
and the spec and gpu_engine simulations of one async run give the same metrics."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from fuzz import sim_engine as SE
from fuzz.generate import random_trace
from fuzz.sweep import parse_profile_spec, run_config, run_one
from spec.costmodel import preset
from spec.scheduler import SpecEngine
from spec.simulate import simulate

COST = preset("h200-llama-8b-bf16")


def _timed(seed: int, async_scheduling: bool = True):
    """A random trace whose arrivals are in seconds (10 ms a step), profile vllm-v1-async."""
    trace = random_trace(seed, async_scheduling=async_scheduling)
    requests = [dataclasses.replace(r, arrival_time=r.arrival_step * 0.01, arrival_step=None) for r in trace.requests]
    config = {**trace.config, "profile": "vllm-v1-async" if async_scheduling else "vllm-v1"}
    config.pop("async_scheduling", None)
    return dataclasses.replace(trace, requests=requests, config=config)


@pytest.mark.parametrize("seed", range(40))
def test_spec_and_gpu_simulations_of_an_async_run_are_equal(seed):
    trace = _timed(seed)
    config = run_config(trace, parse_profile_spec("vllm-v1-async"), COST, {})
    assert config.async_scheduling
    spec = run_one(trace, config, COST)
    gpu = SE.run_gpu(trace, config, COST)
    assert SE.first_difference(spec, gpu) is None


def test_async_decodes_are_counted_as_decodes():
    """One request, prompt 10, 5 tokens: one prefill step and 4 decodes (the decode of a token in flight
    counts its placeholder), as under synchronous scheduling; the 5th decode scheduled for the token in
    flight of max_tokens is not scheduled (ASYNC.LAST_TOKEN_IN_FLIGHT)."""
    from spec.formats import Trace, TraceRequest

    for profile in ("vllm-v1", "vllm-v1-async"):
        trace = Trace(config={"profile": profile, "num_blocks": 64},
                      requests=[TraceRequest(id="a", prompt_len=10, max_tokens=5, arrival_time=0.0)])
        result = simulate(trace, COST)
        assert (result.prefill_tokens, result.decode_tokens) == (10, 4), profile
        assert result.requests["a"].outputs == 5


def test_a_token_is_emitted_when_the_step_that_sampled_it_ends():
    """Every record's outputs are timed at the end of its outputs_step, i.e. at its own start."""
    for seed in range(10):
        trace = _timed(seed)
        engine = SpecEngine.from_trace(trace, record_level="memory", record_reasons=False)
        result = simulate(trace, COST, engine, keep_records=10**6)
        for sample in result.samples:
            rec = sample.record
            assert rec.outputs_step == rec.step - 1 or rec.outputs_step == -1
            for rid in rec.sampled:
                if rec.outputs_step >= 0:
                    assert result.step_end_ns[rec.outputs_step] == sample.start_ns
            for rid, _ in rec.finished:
                assert result.requests[rid].finish_ns == sample.start_ns


def test_simulate_check_engine_full_passes_under_async(tmp_path):
    path = tmp_path / "t.jsonl"
    from spec.io import write_trace

    write_trace(_timed(3), path)
    proc = subprocess.run([sys.executable, "-m", "batchspec.cli", "simulate", str(path), "--engine", "gpu",
                           "--check-engine", "full", "--profile", "vllm-v1-async"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
