"""The vLLM speculative-decoding campaigns' one finding (#21; docs/findings/README.md): a request that
vLLM preempts near max_model_len and never resumes — a stall the spec shares, outside the
configurations vLLM accepts (its KV cache must hold max_model_len in usable blocks at start-up).

The recorded log (tests/corpus/vllm-findings/) is vLLM 0.32.0's, cut to 40 steps; 0.33.0's is the same."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fuzz.replay import replay_records
from fuzz.triage import find_livelock
from invariants.log_checker import check_log
from spec.config import resolve
from spec.io import load_log, load_trace
from spec.protocol import StepLimitError, drive
from spec.scheduler import SpecEngine

CORPUS = Path(__file__).parent / "corpus" / "vllm-findings"
NAME = "specdec-padded-resume-stall"


def _trace():
    return load_trace(CORPUS / f"{NAME}.jsonl", steps=True)


def _smallest_pool_vllm_accepts(trace):
    """The trace on the smallest pool vLLM's start-up check accepts: max_model_len in usable blocks
    (vllm/v1/core/kv_cache_utils.py check_enough_kv_cache_memory, the null block held back)."""
    cfg = resolve(trace.config)
    blocks = -(-cfg.max_model_len // cfg.block_size) + 1  # + the null block
    return dataclasses.replace(trace, config={**trace.config, "num_blocks": blocks})


def test_vllms_log_stalls_from_step_14_and_the_spec_stalls_the_same_way():
    trace = _trace()
    log = load_log(CORPUS / f"{NAME}.log.jsonl")
    cfg = resolve(trace.config)
    cycle = find_livelock(log.records, cfg.max_steps)
    assert cycle is not None and (cycle.start, cycle.period) == (14, 1)
    assert log.records[13].preempted == ["A"] and log.records[12].blocks == {"A": 7}
    assert {v.invariant for v in check_log(log, cfg, trace).violations} == {"LIVE.NO_IDLE_STALL", "LIVE.EVERY_REQUEST_ENDS"}
    # the spec models the stall: its decisions are vLLM's, step for step (a livelock-shared finding)
    assert replay_records(trace, log.records, "exact", engine="vllm", after=0).divergence is None


def test_the_stall_needs_a_pool_smaller_than_max_model_len_which_vllm_refuses_at_start_up():
    trace = _trace()
    cfg = resolve(trace.config)
    assert cfg.usable_blocks * cfg.block_size < cfg.max_model_len  # 28 < 30: outside vLLM's configurations
    assert trace.requests[0].prompt_len + trace.requests[0].max_tokens <= cfg.usable_blocks * cfg.block_size  # A fits
    roomy = _smallest_pool_vllm_accepts(trace)
    try:
        records = drive(SpecEngine.from_trace(roomy), roomy, resolve(roomy.config).max_steps)
    except StepLimitError as e:  # pragma: no cover - the assertion below says what went wrong
        records = e.records
    assert any(("A", "max_tokens") in r.finished for r in records), "A is served once the pool holds max_model_len"


@pytest.mark.vllm
def test_the_installed_vllm_serves_the_request_on_a_pool_it_accepts():
    from fuzz.replay import replay

    result = replay(_smallest_pool_vllm_accepts(_trace()), "vllm-release", "exact", after=None)
    assert result.agreed, result.describe()
    assert any(("A", "max_tokens") in r.finished for r in result.engine_records)
