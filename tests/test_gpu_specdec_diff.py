"""Speculative decoding in gpu_engine (knob ``num_speculative_tokens`` K > 0; issue #15 item 4):
its own implementation (array columns ``proposed``, ``verifications``, ``mid_prefill``; the
closed forms :func:`gpu_engine.formulas.draft_padding`, ``scheduled_drafts``, ``accepted_count``)
against the spec at the exact level on 500 random traces, under both ``spec_cache_at_output``
values, and on 500 with async scheduling; plus what it refuses by name (its model)."""
from __future__ import annotations

import pytest

from fuzz.generate import random_trace
from fuzz.replay import replay
from spec.config import resolve
from spec.rules import HITS

#: the SPEC.* rules a chunk must reach (not a vacuous pass): drafts rolled back, admissions
#: padded, stops inside accepted drafts
REACHED = ("SPEC.ROLLBACK", "SPEC.PAD_ADMISSION", "SPEC.STOP_IN_DRAFTS", "SPEC.PREEMPT_DISCARDS")

#: 500 random traces with speculative decoding (K = 1..4), in chunks; the first half with
#: spec_cache_at_output off (vLLM 0.32), the second with it on (0.33)
CHUNKS = [range(k, k + 125) for k in range(0, 500, 125)]


def _replay_chunk(seeds, **knobs) -> tuple[list[str], int, int]:
    import fuzz.engines  # noqa: F401  (registers gpu)

    diverged, drafts, accepted = [], 0, 0
    for seed in seeds:
        trace = random_trace(seed, num_speculative_tokens=1 + seed % 4, **knobs)
        result = replay(trace, "gpu", "exact")
        drafts += sum(sum((r.drafts or {}).values()) for r in result.engine_records)
        accepted += sum(sum((r.accepted or {}).values()) for r in result.engine_records)
        if not result.agreed:
            diverged.append(f"seed {seed}: {result.describe()}")
    return diverged, drafts, accepted


@pytest.mark.parametrize("seeds", CHUNKS, ids=lambda r: f"{r.start}-{r.stop - 1}")
def test_gpu_engine_agrees_with_the_spec_on_random_speculative_traces(seeds):
    at_output = seeds.start >= 250
    before = {k: HITS[k] for k in REACHED + (("SPEC.CACHE_AT_OUTPUT",) if at_output else ())}
    diverged, drafts, accepted = _replay_chunk(seeds, spec_cache_at_output=at_output)
    assert not diverged, f"{len(diverged)} of {len(seeds)} diverge:\n" + "\n\n".join(diverged[:3])
    # gpu_engine logged drafts, some accepted and some rejected
    assert 0 < accepted < drafts
    assert all(HITS[k] > v for k, v in before.items()), {k: HITS[k] - v for k, v in before.items()}


#: the rules only async scheduling with drafts reaches
ASYNC_REACHED = ("SPEC.ASYNC_DRAFT_PLACEHOLDERS", "SPEC.ROLLBACK", "SPEC.PAD_ADMISSION", "ASYNC.STALE_OUTPUT")


@pytest.mark.parametrize("seeds", CHUNKS, ids=lambda r: f"{r.start}-{r.stop - 1}")
def test_gpu_engine_agrees_with_the_spec_on_random_async_speculative_traces(seeds):
    before = {k: HITS[k] for k in ASYNC_REACHED}
    diverged, drafts, accepted = _replay_chunk(seeds, async_scheduling=True, spec_cache_at_output=seeds.start >= 250)
    assert not diverged, f"{len(diverged)} of {len(seeds)} diverge:\n" + "\n\n".join(diverged[:3])
    assert 0 < accepted < drafts
    assert all(HITS[k] > v for k, v in before.items()), {k: HITS[k] - v for k, v in before.items()}


def test_the_cuda_code_path_agrees_too():
    """The array code as torch ops (``use_numpy=False``), run on CPU."""
    from gpu_engine.engine import GpuEngine

    for seed in range(40):
        trace = random_trace(seed, num_speculative_tokens=1 + seed % 4, spec_cache_at_output=seed % 2 == 1,
                             async_scheduling=seed % 4 >= 2)
        result = replay(trace, GpuEngine.from_trace(trace, use_numpy=False), "exact")
        assert result.agreed, f"seed {seed}: {result.describe()}"


def test_acceptance_draws_are_the_trace_formats():
    """gpu_engine's own acceptance rule gives the counts the trace format defines."""
    from gpu_engine.formulas import accepted_count
    from spec import specdec
    from spec.formats import TraceRequest

    for script, rate in (((3, 0, 1), None), ((), 0.5), ((), 0.0), ((), 1.0), ((), None)):
        tr = TraceRequest("a", 4, 4, spec_accept=script, spec_accept_rate=rate)
        for j in range(12):
            for drafts in range(5):
                assert accepted_count("a", script, rate, j, drafts) == specdec.accepted_drafts(tr, j, drafts)


def test_gpu_engine_refuses_speculative_decoding_with_its_model():
    from gpu_engine.engine import GpuEngine

    with pytest.raises(ValueError, match="num_speculative_tokens"):
        GpuEngine(resolve({"profile": "vllm-v1", "num_speculative_tokens": 2}), model="tiny")


def test_the_gpu_envelope_draws_speculative_decoding():
    from fuzz import capabilities as caps

    env = caps.for_engine("gpu")
    assert env.allows("num_speculative_tokens", 3) and env.allows("spec_cache_at_output", True)
    assert env.allows("num_speculative_tokens", 2) and env.allows("async_scheduling", True)
    # with its model gpu_engine refuses drafts: that envelope keeps K at its default
    model = caps.for_engine("gpu-model")
    assert model.allows("num_speculative_tokens", 0) and not model.allows("num_speculative_tokens", 3)


def test_logged_state_agrees_too():
    """With the optional state fields logged (computed tokens after rollbacks, cache
    registrations of verified blocks, hit blocks), from gpu_engine's own arrays."""
    from fuzz.diff import first_divergence
    from gpu_engine.engine import GpuEngine
    from spec.protocol import drive
    from spec.scheduler import SpecEngine

    for seed in range(30):
        trace = random_trace(seed, num_speculative_tokens=1 + seed % 4, async_scheduling=seed % 3 == 0,
                             spec_cache_at_output=seed % 2 == 0)
        spec = drive(SpecEngine.from_trace(trace, record_level="exact"), trace, 100_000)
        mine = drive(GpuEngine.from_trace(trace, level="exact", log_state=True), trace, 100_000)
        assert any(r.computed for r in mine)
        d = first_divergence(spec, mine, "exact", "gpu")
        assert d is None, f"seed {seed}: {d}"
