"""The SGLang campaign's findings, triaged by hand (#21 item 3; docs/findings/README.md): SGLang's
documented knob values in fuzz.triage.DOCUMENTED point at the lines of its source that decide them,
and the automatic triage names them as documented deliberate differences."""
from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
from pathlib import Path

import pytest

from fuzz.replay import replay_records
from fuzz.triage import DELIBERATE, DOCUMENTED, classify
from spec.config import KNOB_CHOICES, ConfigError, resolve
from spec.io import load_log, load_trace
from spec.protocol import drive
from spec.scheduler import SpecEngine

ROOT = Path(__file__).resolve().parents[1]
FINDINGS = ROOT / "tests" / "corpus" / "sglang" / "findings"
SGLANG = [(key, value) for key, value in DOCUMENTED.items() if key[0] == "sglang"]
#: What the cited lines must contain (the decision itself, not a neighbouring function).
EVIDENCE = {"free_block_order": "self.free_pages = torch.cat((self.free_pages, free_index))",
            "no_chunking_cap": "input_tokens >= self.rem_input_tokens"}


def _wheel() -> Path | None:
    """SGLang's installed source, if this machine has it: ``$SGLANG_SRC`` (a site-packages folder),
    the running interpreter's (the SGLang venv), or the venv ``scripts/sglang-env.sh`` makes."""
    spec = importlib.util.find_spec("sglang")
    here = str(Path(spec.origin).parents[1]) if spec is not None and spec.origin else None
    root = os.environ.get("SGLANG_SRC") or here or next(iter(glob.glob(str(ROOT / ".venv-sglang/lib/python3*/site-packages"))), None)
    return Path(root) if root and (Path(root) / "sglang" / "srt").is_dir() else None


def test_sglangs_documented_values_are_its_findings_and_name_a_source_line():
    assert {knob for (_, knob, _), _ in SGLANG} >= {"free_block_order"}
    for (_, knob, value), (what, source) in SGLANG:
        path, _, lines = source.split(" ")[0].partition(":")
        assert path.startswith("sglang/srt/") and lines and "0.5.23" in source, source
        assert what and knob in EVIDENCE
        if knob in KNOB_CHOICES:  # a knob another change introduces is checked once it exists
            assert value in KNOB_CHOICES[knob]


@pytest.mark.skipif(_wheel() is None, reason="SGLang's source is not installed here (the SGLang venv)")
def test_the_cited_sglang_lines_hold_the_decision():
    for (_, knob, _), (_, source) in SGLANG:
        path, _, span = source.split(" ")[0].partition(":")
        lo, _, hi = span.partition("-")
        text = (_wheel() / path).read_text().splitlines()[int(lo) - 1:int(hi or lo)]
        assert any(EVIDENCE[knob] in line for line in text), (source, EVIDENCE[knob])


def test_sglangs_log_of_the_free_order_finding_is_the_spec_with_the_tail_free_order():
    """The campaign's finding decision-block-ids-kv-free-order (A's freed block goes behind the free
    ones, so B gets block 2 where the spec's cached-last order gave it block 1): SGLang's own log
    agrees with the spec once freed blocks go to the tail of the free list."""
    trace = load_trace(FINDINGS / "free-order-tail.jsonl", steps=True)
    log = load_log(FINDINGS / "free-order-tail.log.jsonl")
    assert log.records[1].block_ids == {"B": [2]}  # what the finding is about
    config = {**trace.config, "free_block_order": "tail"}
    try:
        resolve(config)
    except ConfigError:  # a profile whose pool orders frees itself (leaf-lru's KV.FREE_TO_RELEASE: the tail)
        config = trace.config
    tail = dataclasses.replace(trace, config=config)
    assert replay_records(tail, log.records, "exact", engine="sglang", after=0).divergence is None


def test_a_divergence_the_tail_free_order_explains_is_a_documented_sglang_difference():
    """The automatic triage of such a divergence: deliberate, documented, with SGLang's source line.
    The engine's log is the spec's own under free_block_order=tail (SGLang's order), judged against
    a trace that keeps the cached-last order."""
    trace = load_trace(FINDINGS / "free-order-tail.jsonl", steps=True)
    config = {**trace.config, "profile": "vllm-v1", "enable_chunked_prefill": False}
    for knob in ("new_token_ratio_decay_steps", "retract_decode_steps"):
        config.pop(knob)
    cached_last = dataclasses.replace(trace, config=config)
    engine_log = drive(SpecEngine.from_trace(dataclasses.replace(cached_last, config={**config, "free_block_order": "tail"})),
                       cached_last, 100)
    result = replay_records(cached_last, engine_log, "exact", engine="sglang", after=3)
    assert result.divergence is not None and result.divergence.field == "block_ids"
    triage = classify(result, "sglang")
    assert (triage["class"], triage["status"], triage["knob"]) == (DELIBERATE, "documented", {"free_block_order": "tail"})
    assert triage["source"] == DOCUMENTED[("sglang", "free_block_order", "tail")][1]
