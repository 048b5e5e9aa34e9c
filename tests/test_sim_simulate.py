"""The discrete-event driver and the metric definitions, on hand-computed tiny traces."""
import math
import random
from dataclasses import replace

import pytest

from fuzz.generate import random_trace
from fuzz.sweep import run_config, run_one, with_arrival_times
from spec.config import resolve
from spec.costmodel import CostModel, StepShape, preset
from spec.formats import StepRecord, Trace, TraceRequest
from spec.io import load_trace
from spec.metrics import jain_index, percentile, summarize
from spec.protocol import drive
from spec.scheduler import SpecEngine, run
from spec.simulate import BatchTracker, StallError, scale_to_rate, simulate
from batchspec.cli import example_path

UNIT = preset("unit")


def tiny(requests, **knobs):
    return Trace(config={"profile": "vllm-v1", "num_blocks": 64, "block_size": 4, **knobs}, requests=requests)


def req(rid, t, prompt, out, **kw):
    return TraceRequest(id=rid, prompt_len=prompt, max_tokens=out, arrival_time=t, **kw)


def test_unit_cost_replays_the_step_driver_exactly():
    """With 1 s per step and arrival_step read as seconds, the simulator makes drive()'s steps."""
    trace = load_trace(example_path())
    records = run(trace)
    result = simulate(with_arrival_times(trace), UNIT, SpecEngine.from_trace(trace), keep_records=10_000)
    assert len(result.samples) == len(records)
    for rec, sample in zip(records, result.samples):
        assert sample.start_ns == rec.step * 10**9
        for name in ("scheduled", "new", "resumed", "preempted", "finished", "aborted", "rejected", "sampled", "num_free_blocks"):
            assert getattr(sample.record, name) == getattr(rec, name), (rec.step, name)


def test_hand_computed_metrics():
    """A: arrives 0, prompt 4, 3 outputs.  B: arrives 0.5, prompt 4, 2 outputs.  1 s per step.

    step 0 [0,1): A prefills 4 -> A's 1st token at 1.   B arrives at 0.5, waits for the boundary.
    step 1 [1,2): A decodes, B prefills -> A's 2nd and B's 1st token at 2.
    step 2 [2,3): A decodes, B decodes -> A's 3rd and B's 2nd token at 3: both finish.
    """
    trace = tiny([req("A", 0.0, 4, 3), req("B", 0.5, 4, 2)])
    result = simulate(trace, UNIT)
    a, b = result.requests["A"], result.requests["B"]
    s = 10**9
    assert (a.first_scheduled_ns, a.first_token_ns, a.finish_ns, a.outputs) == (0, 1 * s, 3 * s, 3)
    assert (b.first_scheduled_ns, b.first_token_ns, b.finish_ns, b.outputs) == (1 * s, 2 * s, 3 * s, 2)
    m = summarize(result, {"ttft": 1.2})
    assert (m.ttft.mean, m.ttft.p50, m.ttft.p99) == (1.25, 1.25, pytest.approx(1.495))  # TTFT 1 and 1.5
    assert m.queueing.p50 == 0.25 and m.queueing.max == 0.5
    assert m.e2e.mean == pytest.approx(2.75)  # 3 and 2.5
    assert m.tpot.count == 2 and m.tpot.mean == 1.0  # (3-1)/2 and (2.5-1.5)/1
    assert m.itl.count == 3 and m.itl.mean == 1.0  # A: 1, 1; B: 1
    assert m.duration_s == 3.0 and m.request_throughput == pytest.approx(2 / 3)
    assert m.output_token_throughput == pytest.approx(5 / 3) and m.total_token_throughput == pytest.approx(13 / 3)
    assert m.goodput == pytest.approx(1 / 3)  # only A meets TTFT <= 1.2
    assert (m.prefill_tokens, m.decode_tokens) == (8, 3)


def test_cost_model_sets_step_durations():
    """fixed 1 ms + 0.5 ms per prefill token + 2 ms per decode + 0.01 ms per KV token read."""
    cost = CostModel("t", fixed_s=1e-3, per_prefill_token_s=0.5e-3, per_decode_seq_s=2e-3, per_kv_token_s=1e-5)
    result = simulate(tiny([req("A", 0.0, 4, 2)]), cost)
    # step 0: prefill 4 tokens, reads 4 KV tokens; step 1: one decode reading 5
    assert list(result.step_ns) == [round((1 + 2 + 0.04) * 1e6), round((1 + 2 + 0.05) * 1e6)]
    assert cost.step_ns(StepShape(4, 0, 4)) == 3_040_000


def test_idle_time_jumps_to_the_next_arrival_and_arrivals_wait_for_a_boundary():
    trace = tiny([req("A", 0.0, 4, 2), req("B", 0.25, 4, 1), req("C", 100.0, 4, 1)])
    result = simulate(trace, UNIT, keep_records=10)
    assert result.requests["B"].first_scheduled_ns == 10**9  # arrived mid-step 0
    assert result.requests["C"].first_scheduled_ns == 100 * 10**9  # nothing ran in between
    assert [s.start_ns // 10**9 for s in result.samples] == [0, 1, 100]


def test_batch_tracker_reads_hits_preemptions_and_recompute():
    tracker = BatchTracker([TraceRequest(id="A", prompt_len=10, max_tokens=5), TraceRequest(id="B", prompt_len=8, max_tokens=5)])
    # A is admitted with a 4-token prefix hit and computes the other 6: prefill, reads 10 KV tokens, samples
    shape, _ = tracker.shape(StepRecord(0, scheduled=[("A", 6)], new=["A"], cache_hits={"A": 4}, sampled={"A": 5}))
    assert shape == StepShape(prefill_tokens=6, decode_seqs=0, kv_tokens=10)
    shape, _ = tracker.shape(StepRecord(1, scheduled=[("A", 1)], sampled={"A": 7}))  # computes its 1st output
    assert shape == StepShape(0, 1, 11)
    shape, _ = tracker.shape(StepRecord(2, scheduled=[("B", 8)], new=["B"], preempted=["A"], sampled={"B": 3}))
    assert shape == StepShape(8, 0, 8)
    # A comes back and recomputes its prompt and both outputs: prefill, not decode
    shape, parts = tracker.shape(StepRecord(3, scheduled=[("B", 1), ("A", 12)], resumed=["A"], cache_hits={"A": 0},
                                            sampled={"A": 9, "B": 4}))
    assert shape == StepShape(prefill_tokens=12, decode_seqs=1, kv_tokens=9 + 12)
    assert parts == [("B", 1, True), ("A", 12, False)]


def test_batch_tracker_keeps_a_request_aborted_until_its_next_sample():
    """ABORT.AFTER_NEXT_SAMPLE (SGLang): A is listed aborted in the step its abort arrives, but runs once
    more, freed with that sample.  Its last step is a decode at its computed count, not a fresh 1-token
    prefill (a campaign on the sglang profile found gpu_engine's decode spans and the spec's simulation
    disagreeing on the prefill-token count until the tracker kept A's count)."""
    tracker = BatchTracker([TraceRequest(id="A", prompt_len=1, max_tokens=2), TraceRequest(id="B", prompt_len=2, max_tokens=1)])
    tracker.shape(StepRecord(0, scheduled=[("A", 1)], new=["A"], sampled={"A": 5}))
    tracker.shape(StepRecord(1, scheduled=[("B", 1)], new=["B"], aborted=["A"]))  # the abort arrives; A waits
    shape, parts = tracker.shape(StepRecord(2, scheduled=[("A", 1)], sampled={"A": 6}))
    assert shape == StepShape(prefill_tokens=0, decode_seqs=1, kv_tokens=2) and parts == [("A", 1, True)]


def test_deterministic_and_cache_independent():
    trace = scale_to_rate(Trace(config={"profile": "vllm-v1", "num_blocks": 40, "max_num_seqs": 8},
                                requests=[req(f"r{i}", i * 0.37, 20 + (i * 37) % 90, 1 + (i * 11) % 40,
                                              prefix_group="sys" if i % 3 == 0 else None, prefix_len=32 if i % 3 == 0 else 0)
                                          for i in range(120)]), 40.0)
    cost = preset("a100-40gb-llama2-7b-fp16")
    config = resolve(trace.config)
    runs = [run_one(trace, config, cost) for _ in range(2)]
    runs.append(simulate(trace, cost, SpecEngine(config)))  # default engine: reasons and exact records on
    for other in runs[1:]:
        assert other.requests == runs[0].requests
        assert list(other.step_ns) == list(runs[0].step_ns) and list(other.used_blocks) == list(runs[0].used_blocks)
    m = summarize(runs[0])
    assert m.preemptions > 0 and m.kv_util_peak > 0.5  # the pool is tight: the interesting paths ran


@pytest.mark.parametrize("seed", range(0, 200, 7))
def test_fast_engine_settings_decide_exactly_like_the_spec(seed):
    """record_level / record_reasons / prompt_cache leave every decision and block count unchanged."""
    trace = random_trace(seed)
    reference = run(trace)
    cache = {}
    for _ in range(2):  # the second run uses the warm prompt cache
        engine = SpecEngine.from_trace(trace, record_level="memory", record_reasons=False, prompt_cache=cache)
        fast = drive(engine, trace, engine.config.max_steps)
        assert len(fast) == len(reference)
        for a, b in zip(reference, fast):
            assert b.reasons is None and b.block_ids is None
            for name in ("scheduled", "new", "resumed", "preempted", "finished", "aborted", "rejected", "sampled",
                         "num_free_blocks", "blocks", "cache_hits", "num_evicted"):
                assert getattr(a, name) == getattr(b, name), (seed, a.step, name)


def test_works_with_the_gpu_engine_too():
    """The driver reads only step records: gpu_engine (scheduler-only) gives the same timeline."""
    gpu_engine = pytest.importorskip("gpu_engine")
    trace = tiny([req(f"r{i}", i * 0.003, 5 + (i * 7) % 30, 1 + i % 9) for i in range(14)], max_num_batched_tokens=32)
    cost = preset("h200-llama-8b-bf16")
    spec = simulate(trace, cost)
    gpu = simulate(trace, cost, gpu_engine.GpuEngine.from_trace(trace, level="memory"))
    assert gpu.requests == spec.requests and list(gpu.used_blocks) == list(spec.used_blocks)


def test_stall_is_reported():
    class Stuck:
        name = "stuck"

        def add_request(self, r): self.n = 1  # noqa: E704

        def abort_request(self, rid): pass  # noqa: E704

        def has_unfinished_requests(self): return True  # noqa: E704

        def step(self): return StepRecord(0)  # noqa: E704

    with pytest.raises(StallError, match="none scheduled"):
        simulate(tiny([req("A", 0.0, 4, 1)]), UNIT, Stuck())


def test_percentile_is_numpys_linear_interpolation():
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    for n in (1, 2, 3, 10, 101):
        xs = sorted(rng.uniform(0, 10) for _ in range(n))
        for p in (0, 1, 50, 95, 99, 100):
            assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)), rel=1e-12)
    assert math.isnan(percentile([], 50))
    assert percentile([1.0, 2.0], 50) == 1.5


def test_stats_of_nanoseconds_equal_stats_of_the_seconds_bit_for_bit():
    """Stats.of_ns (the ITL's: distinct values and counts) gives exactly Stats.of over the values
    in seconds: mean through fsum, each percentile, the max; many repeats, few, huge values."""
    from spec.costmodel import NS_PER_S
    from spec.metrics import Stats

    rng = random.Random(7)
    s = 1 / NS_PER_S
    for n in (1, 2, 3, 7, 100, 5000):
        for hi in (3, 1000, 10**9, 10**15):
            ns = [rng.randint(0, hi) for _ in range(n)]
            assert Stats.of_ns(ns) == Stats.of(v * s for v in ns), (n, hi)
    ns = [4_826_405] * 999 + [42_133_545] * 20 + [1]  # fsum and a naive sum of the seconds differ here
    assert Stats.of_ns(ns) == Stats.of(v * s for v in ns)
    assert Stats.of_ns([]).count == 0 and math.isnan(Stats.of_ns([]).mean)


def test_jain_index():
    assert jain_index([5, 5, 5]) == 1.0
    assert jain_index([1, 0, 0]) == pytest.approx(1 / 3)
    assert jain_index([2, 1]) == pytest.approx(9 / 10)


def test_tenants_and_service():
    trace = tiny([req("a1", 0.0, 8, 4, tenant="a"), req("a2", 0.1, 8, 4, tenant="a"), req("b1", 0.2, 8, 2, tenant="b")])
    m = summarize(simulate(trace, UNIT))
    assert set(m.tenants) == {"a", "b"}
    assert m.tenants["a"].service_tokens == 2 * (8 + 3) and m.tenants["b"].service_tokens == 8 + 1
    assert sum(t.service_tokens for t in m.tenants.values()) == m.prefill_tokens + m.decode_tokens
    assert m.jain_fairness == pytest.approx(jain_index([22, 9]))


def test_kv_utilization_and_rejections():
    trace = tiny([req("A", 0.0, 20, 4), req("big", 0.0, 300, 4)], num_blocks=9)  # 8 usable blocks of 4 tokens
    result = simulate(trace, UNIT)
    m = summarize(result)
    assert (m.completed, m.rejected) == (1, 1)
    assert result.usable_blocks == 8 and max(result.used_blocks) == 6  # 24 slots at the peak
    assert m.kv_util_peak == 6 / 8


def test_queue_growth_separates_stable_from_overloaded():
    """Each request takes 5 steps of 10 ms on one of 2 slots: capacity 40 requests/s (spec.metrics.queue_growth)."""
    cost = CostModel("flat", fixed_s=0.01)
    base = Trace(config={"profile": "vllm-v1", "max_num_seqs": 2},
                 requests=[req(f"r{i}", i / 10, 16, 5) for i in range(300)])
    low = summarize(simulate(scale_to_rate(base, 20.0), cost))
    high = summarize(simulate(scale_to_rate(base, 80.0), cost))
    assert abs(low.queue_growth) < 0.02 and not low.unbounded_queue
    assert high.queue_growth == pytest.approx(1 - 40 / 80, abs=0.05) and high.unbounded_queue
    assert high.sustained_rate == pytest.approx(40, rel=0.05) and high.request_throughput == pytest.approx(40, rel=0.1)
    # the growth compares counts: a trace whose rate doubles half-way is judged by what arrives, not by a line
    ramp = Trace(config=base.config, requests=[req(f"r{i}", i / 30 if i < 150 else 5 + (i - 150) / 60, 16, 5) for i in range(300)])
    m = summarize(simulate(ramp, cost))  # 30/s (kept up with), then 60/s (not): capacity 40/s
    assert m.unbounded_queue and 30 < m.sustained_rate <= 40.5  # never more than the capacity


def test_scale_to_rate():
    trace = tiny([req("a", 10.0, 4, 1), req("b", 12.0, 4, 1), req("c", 14.0, 4, 1)])
    fast = scale_to_rate(trace, 2.0)  # 2 gaps of 2 s: 0.5/s; at 2/s the gaps are 0.5 s
    assert [r.arrival_time for r in fast.requests] == [0.0, 0.5, 1.0]
    with pytest.raises(ValueError):
        scale_to_rate(trace, 0)


def test_run_config_precedence():
    from fuzz.sweep import parse_profile_spec

    cost = preset("h200-llama-8b-bf16")
    trace = Trace(config={"profile": "vllm-v1", "num_blocks": 500}, requests=[])
    cfg = run_config(trace, parse_profile_spec("vllm-v1:max_num_seqs=4"), cost, {"watermark": 0.01})
    assert (cfg.num_blocks, cfg.max_model_len, cfg.max_num_seqs, cfg.watermark) == (500, 8192, 4, 0.01)
    cfg = run_config(replace(trace, config={"profile": "vllm-v1"}), None, cost)
    assert cfg.num_blocks == cost.knobs["num_blocks"]
