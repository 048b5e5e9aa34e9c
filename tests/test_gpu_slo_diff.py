"""gpu_engine vs. the spec on the SLO-aware map (issue 19), at the ``exact`` level.

``sprpt`` (shortest predicted remaining output first, with aging) is implemented by
gpu_engine independently (its waiting-queue key); ``edf`` / ``edf-ac`` are not yet, and
gpu_engine refuses them by name.  ``BATCHSPEC_SLO_TRACES`` (default 500) sets how many
random traces the profile replays; the fuzzer draws predictions that are exact, off or
missing (:func:`fuzz.generate._draw_slo`)."""
from __future__ import annotations

import os
from collections import Counter

import pytest

import fuzz.engines  # noqa: F401  (registers gpu)
from fuzz.generate import random_trace
from fuzz.replay import replay
from gpu_engine.engine import check_supported
from spec.config import resolve
from spec.rules import HITS

NUM_TRACES = int(os.environ.get("BATCHSPEC_SLO_TRACES", "500"))
MAX_STEPS = 3000


@pytest.mark.parametrize("knobs", [{}, {"aging_steps": 0}, {"aging_steps": 1}])
def test_sprpt_agrees_exactly(knobs):
    HITS.clear()
    seen: Counter = Counter()
    count = NUM_TRACES if not knobs else NUM_TRACES // 5
    for seed in range(count):
        trace = random_trace(seed, profile="sprpt", max_steps=MAX_STEPS, **knobs)
        result = replay(trace, "gpu", "exact")
        assert result.agreed, f"sprpt {knobs} seed {seed}: {result.divergence.describe()}"
        seen["predicted"] += sum(r.predicted_output_len is not None for r in trace.requests)
        seen["admitted"] += sum(len(rec.new) for rec in result.engine_records)
        seen["preempted"] += sum(len(rec.preempted) for rec in result.engine_records)
    assert seen["predicted"] and seen["admitted"] and seen["preempted"]
    assert HITS["QUEUE.SPRPT"] and (HITS["QUEUE.AGING"] or knobs.get("aging_steps") == 0)


@pytest.mark.parametrize("knobs", [{"profile": "edf"}, {"profile": "edf-ac"},
                                   {"profile": "vllm-v1", "preemption_victim": "slo-slack"}])
def test_edf_is_refused_by_name(knobs):
    with pytest.raises(ValueError, match="gpu_engine does not implement"):
        check_supported(resolve(knobs))


def test_sprpt_torch_code_path():
    """The CUDA code path (array code as torch ops), run on CPU."""
    from gpu_engine import GpuEngine

    for seed in range(9000, 9005):
        trace = random_trace(seed, profile="sprpt", max_steps=MAX_STEPS)
        result = replay(trace, GpuEngine.from_trace(trace, use_numpy=False), "exact")
        assert result.agreed, f"sprpt seed {seed}: {result.divergence.describe()}"
