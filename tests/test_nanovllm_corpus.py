"""The ``nano-vllm`` profile against decision logs recorded from nano-vllm's real
scheduler (issue #16, item 3).  Needs no nano-vllm checkout: the logs were recorded
once by ``fuzz/nanovllm_adapter.py`` and are replayed here against the spec.

* ``tests/corpus/nano-vllm/corpus.jsonl`` — fuzzed traces (tight memory, shared
  prefixes, prompts longer than the budget, max_num_seqs from 1 up, EOS), each with
  nano-vllm's log: every field must be equal at the exact level.
* ``never-fits.jsonl`` — the same kinds of trace plus one request that can never fit:
  nano-vllm raises in ``schedule()``, the spec rejects the request at arrival.
* ``findings/`` — minimal traces of what nano-vllm does and the spec deliberately does
  not (docs/conformance.md), each with nano-vllm's log and the expected divergence.
"""
from __future__ import annotations

import json
from collections import Counter
from functools import lru_cache
from pathlib import Path

import pytest

from fuzz.replay import replay_records
from spec.config import resolve
from spec.formats import StepRecord, Trace, TraceRequest
from spec.io import load_log, load_trace
from spec.scheduler import run

CORPUS = Path(__file__).parent / "corpus" / "nano-vllm"


def _entry(line: str) -> tuple[Trace, list[StepRecord], str | None]:
    obj = json.loads(line)
    header, *requests = obj["trace"]
    trace = Trace(config=header["config"], vocab_size=header["vocab_size"], eos_token_id=header["eos_token_id"],
                  name=header.get("name"),
                  requests=[TraceRequest.from_json(r) for r in requests])
    log_header, *records = obj["log"]
    assert log_header["engine"].startswith("nano-vllm-") and log_header["level"] == "exact"
    return trace, [StepRecord.from_json(r) for r in records], obj["error"]


@lru_cache(maxsize=None)
def entries(name: str) -> list[tuple[Trace, list[StepRecord], str | None]]:
    return [_entry(line) for line in (CORPUS / name).read_text().splitlines() if line.strip()]


def test_corpus_covers_what_the_issue_asks_for():
    corpus = entries("corpus.jsonl")
    assert len(corpus) >= 300
    seen: Counter = Counter()
    for trace, records, error in corpus:
        cfg = resolve(trace.config)
        assert cfg.profile == "nano-vllm" and error is None
        seen[f"max_num_seqs={cfg.max_num_seqs}"] += 1
        seen["block_size=256"] += cfg.block_size == 256
        seen["prompt longer than the budget"] += any(r.prompt_len > cfg.max_num_batched_tokens for r in trace.requests)
        for rec in records:
            seen["preempted"] += len(rec.preempted)
            seen["prefix hits"] += sum(1 for v in rec.cache_hits.values() if v)
            seen["evicted"] += len(rec.evicted)
            seen["cut prefill"] += sum(1 for rid, _ in rec.scheduled if rid not in rec.sampled)
            seen["eos"] += sum(1 for _, why in rec.finished if why == "eos")
            seen["decode batch capped by max_num_seqs"] += (
                not rec.new and not rec.resumed and len(rec.scheduled) == cfg.max_num_seqs
                and len(rec.blocks) > cfg.max_num_seqs)
    for what in ("max_num_seqs=1", "max_num_seqs=2", "block_size=256", "prompt longer than the budget", "preempted",
                 "prefix hits", "evicted", "cut prefill", "eos", "decode batch capped by max_num_seqs"):
        assert seen[what] > 0, f"the corpus never shows: {what}"


def test_corpus_replays_against_the_nano_vllm_profile_with_every_field_equal():
    disagree = []
    for trace, records, _ in entries("corpus.jsonl"):
        result = replay_records(trace, records, "exact", engine="nano-vllm")
        if not result.agreed:
            disagree.append(f"{trace.name}: {result.divergence.describe()}")
    assert not disagree, f"{len(disagree)} traces diverge; first:\n{disagree[0]}"


def test_the_recorded_logs_hold_nano_vllms_own_cache_state():
    """The recorded logs carry the state nano-vllm's objects hold (read by the adapter from its
    BlockManager): the ordinals each ``hash_blocks`` call cached, the hit blocks, every held
    block's ``ref_count`` and the ``hash_to_block_id`` entries.  The replay above compares them
    with the spec's, and would see one wrong entry."""
    import dataclasses

    corpus = entries("corpus.jsonl")
    logged = Counter()
    for _, records, _ in corpus:
        logged["registered"] += sum(len(m) for r in records for m in r.cache_registered.values())
        logged["hit blocks"] += sum(len(b) for r in records for b in r.hit_blocks.values())
        logged["shared blocks"] += sum(n > 1 for r in records for n in r.ref_counts.values())
        logged["cache entries"] += sum(len(r.cached_blocks) for r in records)
        logged["computed"] += sum(len(r.computed) for r in records)
    assert min(logged.values()) > 100, logged
    trace, records, _ = next(c for c in corpus if any(len(r.cached_blocks) > 1 for r in c[1]))
    k = next(k for k, r in enumerate(records) if len(r.cached_blocks) > 1)
    wrong = list(records)
    wrong[k] = dataclasses.replace(records[k], cached_blocks=records[k].cached_blocks[1:])
    result = replay_records(trace, wrong, "exact", engine="nano-vllm")
    assert not result.agreed and (result.divergence.step, result.divergence.field) == (records[k].step, "cached_blocks")


@pytest.mark.parametrize("knobs", [
    {"free_block_order": "cached-last"}, {"cache_register": "allocation"}, {"cache_duplicates": "first"},
    {"kv_reservation": "step", "scheduler_reserve_full_isl": True}, {"max_num_seqs_scope": "running"},
    {"prefill_chunking": "any"},
], ids=lambda k: next(iter(k)))
def test_every_nano_vllm_knob_is_needed(knobs):
    """Each knob the profile adds for nano-vllm, set back to vLLM's value, breaks agreement
    on some recorded trace: none of them is decoration."""
    for trace, records, _ in entries("corpus.jsonl")[:150]:
        changed = Trace(config={**trace.config, **knobs}, requests=trace.requests, name=trace.name)
        if not replay_records(changed, records, "exact").agreed:
            return
    pytest.fail(f"{knobs}: the first 150 recorded traces agree without this knob value")


def test_spec_invariants_hold_on_the_nano_vllm_profile():
    for trace, _, _ in entries("corpus.jsonl")[::3]:
        run(trace, check_invariants=True)


def test_a_request_that_can_never_fit_crashes_nano_vllm_and_is_rejected_by_the_spec():
    bad = entries("never-fits.jsonl")
    assert len(bad) >= 10
    for trace, records, error in bad:
        assert error == "AssertionError:  at nanovllm/engine/scheduler.py:71", (trace.name, error)
        assert not any(rid == "huge" for r in records for rid, _ in r.finished)
        spec = run(trace)
        assert ("huge", "never_fits") in [x for r in spec for x in r.rejected]
        assert not replay_records(trace, records, "exact").agreed


#: finding -> (step, field) of the first divergence its description states.
FINDINGS = {
    "never-fits-prompt": (0, "scheduled"),
    "never-fits-growth": (0, "new"),  # nano-vllm admits A, which the spec rejected at arrival (REJECT.NEVER_FITS)
    "past-max-model-len": (1, "finished"),
    "decode-ignores-budget": (2, "scheduled"),
}


@pytest.mark.parametrize("name", sorted(FINDINGS))
def test_findings_diverge_where_their_description_says(name):
    trace = load_trace(CORPUS / "findings" / f"{name}.jsonl")
    log = load_log(CORPUS / "findings" / f"{name}.log.jsonl")
    assert trace.description and ("Finding" in trace.description or "Deliberate difference" in trace.description)
    result = replay_records(trace, log.records, "exact", engine="nano-vllm")
    assert not result.agreed
    assert (result.divergence.step, result.divergence.field) == FINDINGS[name], result.divergence.describe()
    assert f"step {FINDINGS[name][0]}" in trace.description


def test_findings_are_listed_in_the_conformance_doc():
    doc = (Path(__file__).parents[1] / "docs" / "conformance.md").read_text()
    for name in FINDINGS:
        assert f"tests/corpus/nano-vllm/findings/{name}.jsonl" in doc


def test_corpus_traces_are_valid_trace_files(tmp_path):
    """Each corpus trace, written out, loads with the trace reader's checks (arrival order, limits)."""
    from spec.io import write_trace

    for trace, _, _ in entries("corpus.jsonl") + entries("never-fits.jsonl"):
        path = tmp_path / "t.jsonl"
        write_trace(trace, path)
        assert [r.id for r in load_trace(path).requests] == [r.id for r in trace.requests]
