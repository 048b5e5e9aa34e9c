"""Property tests: random traces through the spec with every invariant checked after each step."""
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spec.config import resolve
from spec.formats import Trace, TraceRequest
from spec.scheduler import run


@st.composite
def configs(draw):
    max_model_len = draw(st.integers(8, 96))
    chunked = draw(st.booleans())
    budget = draw(st.integers(1, 64))
    if not chunked:
        budget = max(budget, max_model_len)
    return {
        "profile": "vllm-v1",
        "block_size": draw(st.sampled_from([1, 2, 4, 8])),
        "num_blocks": draw(st.integers(3, 32)),
        "max_num_batched_tokens": budget,
        "max_num_seqs": draw(st.integers(1, 6)),
        "max_model_len": max_model_len,
        "enable_chunked_prefill": chunked,
        "long_prefill_token_threshold": draw(st.sampled_from([0, 0, 3, 8])),
        "policy": draw(st.sampled_from(["fcfs", "priority"])),
        "enable_prefix_caching": draw(st.booleans()),
        "scheduler_reserve_full_isl": draw(st.booleans()),
        "watermark": draw(st.sampled_from([0.0, 0.0, 0.1, 0.3])),
        "priority_self_preempt": draw(st.sampled_from(["stop", "continue"])),
        "max_steps": 5000,
    }


@st.composite
def traces(draw):
    config = draw(configs())
    n = draw(st.integers(1, 8))
    arrivals = sorted(draw(st.lists(st.integers(0, 12), min_size=n, max_size=n)))
    requests = []
    for i, at in enumerate(arrivals):
        prompt_len = draw(st.integers(1, 60))
        group = draw(st.sampled_from([None, "g1", "g2"]))
        outputs = draw(st.lists(st.sampled_from([2, 5, 6, 7]), max_size=4))
        requests.append(
            TraceRequest(
                id=f"r{i}",
                prompt_len=prompt_len,
                max_tokens=draw(st.integers(1, 20)),
                arrival_step=at,
                prefix_group=group,
                prefix_len=draw(st.integers(0, prompt_len)) if group else 0,
                priority=draw(st.integers(0, 3)),
                ignore_eos=draw(st.booleans()),
                stop_token_ids=(6,) if draw(st.booleans()) else (),
                abort_at=at + draw(st.integers(0, 15)) if draw(st.integers(0, 4)) == 0 else None,
                output_tokens=tuple(outputs),
            )
        )
    return Trace(config=config, requests=requests, vocab_size=64, eos_token_id=2)


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
