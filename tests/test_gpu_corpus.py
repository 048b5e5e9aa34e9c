"""gpu_engine's own bugs, found by campaigns and fixed: each shrunk trace in tests/corpus/gpu-*.jsonl
must replay in agreement with the spec at the exact level (its header says what went wrong)."""
from __future__ import annotations

from pathlib import Path

import pytest

import fuzz.engines  # noqa: F401  (registers gpu)
from fuzz.replay import replay
from spec.io import load_trace

TRACES = sorted((Path(__file__).parent / "corpus").glob("gpu-*.jsonl"))


def test_the_gpu_corpus_is_there():
    assert len(TRACES) >= 3


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_gpu_engine_agrees_with_the_spec_on_a_fixed_bugs_trace(path):
    trace = load_trace(path)
    assert trace.description, "a corpus trace says what it reproduces"
    result = replay(trace, "gpu", "exact", after=None)
    assert result.agreed, result.describe()
