"""Profile specs, and the sweep finding a known capacity boundary on a synthetic trace."""
import random

import pytest

from fuzz.sweep import ProfileSpec, capacity, parse_profile_spec, split_profiles, sweep
from spec.config import ConfigError
from spec.costmodel import CostModel
from spec.formats import Trace, TraceRequest

#: Every step takes 10 ms; each request holds a batch slot for 5 steps (a prefill that
#: samples, then 4 decodes): with max_num_seqs = s the engine completes s / 0.05 requests/s.
FLAT = CostModel("flat-10ms", fixed_s=0.01)


def synthetic(n=300, seed=0) -> Trace:
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for i in range(n):
        reqs.append(TraceRequest(id=f"r{i}", prompt_len=16, max_tokens=5, arrival_time=round(t, 6)))
        t += rng.expovariate(10.0)
    return Trace(config={"profile": "vllm-v1"}, requests=reqs)


def test_profile_specs():
    assert split_profiles("vllm-v1,vllm-v1:enable_chunked_prefill=false,max_num_batched_tokens=8192,naive") == [
        "vllm-v1", "vllm-v1:enable_chunked_prefill=false,max_num_batched_tokens=8192", "naive"]
    spec = parse_profile_spec("vllm-v1:enable_chunked_prefill=false,max_num_batched_tokens=8192,watermark=0.01,policy=priority")
    assert spec == ProfileSpec(spec.text, "vllm-v1", (("enable_chunked_prefill", False), ("max_num_batched_tokens", 8192),
                                                      ("watermark", 0.01), ("policy", "priority")))
    with pytest.raises(ConfigError):
        parse_profile_spec("vllm-v1:max_num_seqs")


def test_sweep_finds_the_capacity_boundary():
    specs = [parse_profile_spec(t) for t in ("vllm-v1:max_num_seqs=2", "no-such-profile", "vllm-v1:max_num_seqs=4",
                                             "vllm-v1:max_num_seqz=4")]
    seen = []
    points = sweep(synthetic(), specs, [10, 20, 60, 160], FLAT, slos={"ttft": 0.5}, on_point=seen.append)
    assert len(seen) == len(points)
    errors = {p.profile: p.error for p in points if p.error}
    assert "unknown profile 'no-such-profile'" in errors["no-such-profile"]
    assert "max_num_seqz" in errors["vllm-v1:max_num_seqz=4"]
    two = {p.rate: p for p in points if p.profile == "vllm-v1:max_num_seqs=2"}
    four = {p.rate: p for p in points if p.profile == "vllm-v1:max_num_seqs=4"}
    assert two[160].skipped and two[160].metrics is None  # beyond its boundary: not run
    assert [two[r].metrics.unbounded_queue for r in (10, 20, 60)] == [False, False, True]
    assert [four[r].metrics.unbounded_queue for r in (10, 20, 60, 160)] == [False, False, False, True]
    caps = capacity(points, slo_s=0.5)
    c2, c4 = caps["vllm-v1:max_num_seqs=2"], caps["vllm-v1:max_num_seqs=4"]
    assert (c2.last_bounded_rate, c2.unbounded_rate) == (20, 60) and (c4.last_bounded_rate, c4.unbounded_rate) == (60, 160)
    assert c2.capacity_estimate == pytest.approx(40, rel=0.1) and c4.capacity_estimate == pytest.approx(80, rel=0.1)
    assert 20 < c2.slo_rate < 60 and c2.slo_bracket == (20, 60)
    assert 60 < c4.slo_rate < 160
    # p99 TTFT grows with the rate, and the SLO crossing sits where the curve meets 0.5 s
    ttfts = [two[r].metrics.ttft.p99 for r in (10, 20, 60)]
    assert ttfts == sorted(ttfts) and ttfts[1] < 0.5 < ttfts[2]


def test_parallel_sweep_matches_serial():
    trace = synthetic(n=80)
    specs = [parse_profile_spec("vllm-v1:max_num_seqs=2")]
    serial = sweep(trace, specs, [20, 60], FLAT, stop_after_unbounded=None)
    parallel = sweep(trace, specs, [20, 60], FLAT, jobs=2, stop_after_unbounded=None)
    assert [p.metrics for p in serial] == [p.metrics for p in parallel]
