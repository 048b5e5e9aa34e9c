"""The nano-vllm adapter against a live nano-vllm checkout (issue #16, item 3).

Marked ``nanovllm``: normal CI deselects it (the recorded corpus is replayed by
``tests/test_nanovllm_corpus.py`` without a checkout).  Run it with a checkout of
nano-vllm at the commit the profile names and the ``nanovllm`` extra::

    BATCHSPEC_NANOVLLM=/path/to/nano-vllm python -m pytest -m nanovllm tests/test_nanovllm_adapter.py

If it is selected and the checkout cannot be used, it FAILS (never skips).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.nanovllm

CORPUS = Path(__file__).parent / "corpus" / "nano-vllm"


@pytest.fixture(scope="module")
def nanovllm_ready():
    from fuzz.nanovllm_adapter import nanovllm_modules
    from fuzz.replay import EngineUnavailable

    try:
        nanovllm_modules()
    except EngineUnavailable as e:
        pytest.fail(f"the `nanovllm` suite was selected but nano-vllm cannot be used: {e}", pytrace=False)


def test_recording_reproduces_the_committed_corpus(nanovllm_ready):
    """Recording is deterministic: the first 40 corpus traces re-recorded live give the committed logs."""
    from fuzz.nanovllm_adapter import _log_lines, corpus_trace, record

    lines = (CORPUS / "corpus.jsonl").read_text().splitlines()[:40]
    for k, line in enumerate(lines):
        committed = json.loads(line)
        trace = corpus_trace(k)
        records, error = record(trace)
        assert error is None and _log_lines(trace, records) == committed["log"], trace.name


def test_live_replay_agrees_with_the_profile(nanovllm_ready):
    from fuzz.nanovllm_adapter import NanoVllmEngine, corpus_trace
    from fuzz.replay import replay

    for k in range(300, 360):  # traces the committed corpus does not hold
        trace = corpus_trace(k)
        result = replay(trace, NanoVllmEngine(trace), "exact")
        assert result.agreed, f"{trace.name}: {result.divergence.describe()}"


def test_adapter_reads_one_request(nanovllm_ready):
    """A 10-token prompt in blocks of 4 with 6 blocks: blocks 0-2, three free, two decodes."""
    from fuzz.nanovllm_adapter import NanoVllmEngine
    from spec.formats import Trace, TraceRequest
    from spec.protocol import drive

    trace = Trace(config={"profile": "nano-vllm", "block_size": 4, "num_blocks": 6, "max_num_batched_tokens": 16},
                  requests=[TraceRequest(id="a", arrival_step=0, prompt_len=10, max_tokens=3, ignore_eos=True)])
    recs = drive(NanoVllmEngine(trace), trace, 100)
    assert recs[0].scheduled == [("a", 10)] and recs[0].new == ["a"] and recs[0].block_ids == {"a": [0, 1, 2]}
    assert recs[0].num_free_blocks == 3 and recs[0].cache_hits == {"a": 0}
    assert [r.scheduled for r in recs[1:]] == [[("a", 1)], [("a", 1)]]
    assert recs[-1].finished == [("a", "max_tokens")] and recs[-1].num_free_blocks == 6


def test_adapter_refuses_what_nano_vllm_cannot_express(nanovllm_ready):
    from fuzz.nanovllm_adapter import NanoVllmEngine
    from fuzz.replay import EngineConfigError
    from spec.formats import Trace, TraceRequest

    one = [TraceRequest(id="a", arrival_step=0, prompt_len=4, max_tokens=2)]
    with pytest.raises(EngineConfigError, match="policy"):
        NanoVllmEngine(Trace(config={"profile": "nano-vllm", "policy": "priority"}, requests=one))
    with pytest.raises(EngineConfigError, match="block_size=1"):
        NanoVllmEngine(Trace(config={"profile": "nano-vllm", "block_size": 1}, requests=one))
    stop = [TraceRequest(id="a", arrival_step=0, prompt_len=4, max_tokens=2, stop_token_ids=(7,))]
    with pytest.raises(EngineConfigError, match="stop_token_ids"):
        NanoVllmEngine(Trace(config={"profile": "nano-vllm"}, requests=stop))
