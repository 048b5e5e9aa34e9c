"""The differ finds the first divergent step and field, and quotes the spec's reason."""
from __future__ import annotations

import copy

import pytest

from fuzz.diff import LevelError, first_divergence
from fuzz.generate import random_trace
from spec.formats import StepRecord, fields_at
from spec.scheduler import run


@pytest.fixture(scope="module")
def records() -> list[StepRecord]:
    """A spec run with preemption, prefix hits and evictions (exact level, with reasons)."""
    for seed in range(200):
        recs = run(random_trace(seed, enable_prefix_caching=True, tight_memory=True))
        if any(r.preempted for r in recs) and any(r.evicted for r in recs) and len(recs) > 12:
            return recs
    raise AssertionError("no suitable trace in 200 seeds")


def test_identical_logs_agree(records):
    for level in ("decisions", "memory", "exact"):
        assert first_divergence(records, copy.deepcopy(records), level) is None


def _first_busy(records, predicate) -> int:
    return next(i for i, r in enumerate(records) if predicate(r))


@pytest.mark.parametrize("field", ["scheduled", "new", "preempted", "finished", "num_free_blocks", "blocks", "block_ids", "evicted", "cache_hits"])
def test_planted_difference_is_found_at_its_step(records, field):
    engine = copy.deepcopy(records)
    i = _first_busy(engine, lambda r: bool(getattr(r, field)) if field != "num_free_blocks" else True)
    rec = engine[i]
    if field == "scheduled":
        rid, n = rec.scheduled[0]
        rec.scheduled[0] = (rid, n + 1)
    elif field in ("new", "preempted"):
        getattr(rec, field).append("ghost")
    elif field == "finished":
        rid, why = rec.finished[0]
        rec.finished[0] = (rid, "eos" if why != "eos" else "max_tokens")
    elif field == "num_free_blocks":
        rec.num_free_blocks += 1
    elif field in ("blocks", "cache_hits"):
        key = next(iter(getattr(rec, field)))
        getattr(rec, field)[key] += 1
    elif field == "block_ids":
        key = next(iter(rec.block_ids))
        rec.block_ids[key] = list(reversed(rec.block_ids[key])) + [999]
    elif field == "evicted":
        rec.evicted = list(rec.evicted) + [999]
    d = first_divergence(records, engine, "exact", engine="vllm")
    assert d is not None
    assert (d.step, d.field) == (rec.step, field)
    assert d.spec_value != d.engine_value
    text = d.describe()
    assert f"step {rec.step}" in text and field in text and "vllm:" in text


def test_reason_is_the_spec_rule_for_the_request(records):
    engine = copy.deepcopy(records)
    i = _first_busy(engine, lambda r: bool(r.preempted))
    victim = engine[i].preempted[0]
    engine[i].preempted = []
    d = first_divergence(records, engine, "decisions")
    assert d.step == engine[i].step and d.field == "preempted" and d.request == victim
    assert d.rule is not None and d.rule.startswith("PREEMPT.")
    assert d.rule in d.describe() and d.reason in d.describe()


def test_memory_fields_are_ignored_below_their_level(records):
    engine = copy.deepcopy(records)
    engine[3].num_free_blocks += 1
    engine[4].block_ids = {k: v[::-1] + [0] for k, v in engine[4].block_ids.items()}
    assert first_divergence(records, engine, "decisions") is None
    assert first_divergence(records, engine, "memory").field == "num_free_blocks"


def test_exact_only_difference_needs_exact_level(records):
    engine = copy.deepcopy(records)
    i = _first_busy(engine, lambda r: bool(r.block_ids))
    key = next(iter(engine[i].block_ids))
    engine[i].block_ids[key] = [b + 100 for b in engine[i].block_ids[key]]
    assert first_divergence(records, engine, "memory") is None
    assert first_divergence(records, engine, "exact").field == "block_ids"


def test_sampled_is_compared_by_keys_only():
    a = [StepRecord(0, scheduled=[("x", 4)], new=["x"], sampled={"x": 10})]
    b = [StepRecord(0, scheduled=[("x", 4)], new=["x"], sampled={"x": 11})]
    assert first_divergence(a, b, "decisions") is None
    c = [StepRecord(0, scheduled=[("x", 4)], new=["x"], sampled={})]
    d = first_divergence(a, c, "decisions")
    assert d.field == "sampled" and d.request == "x" and d.spec_value == {"x": 10} and d.engine_value == {}


def test_missing_record_is_an_idle_step():
    busy = StepRecord(0, scheduled=[("x", 1)], sampled={"x": 5})
    idle = StepRecord(1)
    later = StepRecord(5, scheduled=[("y", 2)], new=["y"])
    assert first_divergence([busy, idle, later], [busy, later], "decisions") is None
    d = first_divergence([busy, later], [busy], "decisions")
    assert d.step == 5 and d.field == "scheduled" and d.engine_value == []


def test_log_without_the_level_is_refused():
    spec = [StepRecord(0, scheduled=[("x", 1)], num_free_blocks=3, blocks={}, cache_hits={}, num_evicted=0, block_ids={}, evicted=[])]
    engine = [StepRecord(0, scheduled=[("x", 1)])]
    with pytest.raises(LevelError):
        first_divergence(spec, engine, "memory")
    assert first_divergence(spec, engine, "decisions") is None


def test_fields_compared_are_the_levels_fields():
    assert fields_at("exact")[-2:] == ("block_ids", "evicted")
    with pytest.raises(ValueError):
        first_divergence([], [], "everything")
