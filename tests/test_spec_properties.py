"""Property tests: random traces through the spec with every invariant checked after each step."""
from collections import Counter

from hypothesis import HealthCheck, given, settings

from fuzz.strategies import traces
from spec.config import resolve
from spec.scheduler import run


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_random_traces_keep_every_invariant_and_end_every_request(trace):
    records = run(trace, check_invariants=True)  # raises on any invariant violation
    cfg = resolve(trace.config)
    ends = Counter()
    outputs = Counter()
    for rec in records:
        assert sum(n for _, n in rec.scheduled) <= cfg.max_num_batched_tokens
        ends.update(rid for rid, _ in rec.finished)
        ends.update(rec.aborted)
        ends.update(rid for rid, _ in rec.rejected)
        outputs.update(rec.sampled.keys())
        assert set(rec.sampled) <= {rid for rid, _ in rec.scheduled}
        held = {b for ids in rec.block_ids.values() for b in ids}  # shared prefix blocks once
        assert rec.num_free_blocks + len(held) == cfg.usable_blocks
    # every request ends exactly once: finished, aborted or rejected
    assert ends == Counter(r.id for r in trace.requests)
    for r in trace.requests:
        assert outputs[r.id] <= r.max_tokens


@settings(max_examples=60, deadline=None, derandomize=True)
@given(traces())
def test_same_trace_same_decisions(trace):
    assert [r.to_json() for r in run(trace)] == [r.to_json() for r in run(trace)]
