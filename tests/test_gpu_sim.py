"""The simulator on gpu_engine's decisions (``--engine gpu``): identical results to the spec's.

Every test compares gpu_engine's :class:`~spec.simulate.SimResult` (decode spans in
closed form, bulk token synthesis, engine-reported batch shapes) with the spec's on
the same run, request by request and step by step (:func:`fuzz.sim_engine.first_difference`).
"""
import dataclasses
import random

import pytest

from batchspec import sim_cli
from batchspec.data import TRACES
from fuzz import sim_engine as SE
from fuzz.importers import import_trace
from fuzz.sweep import parse_profile_spec, run_config, run_one, sweep
from gpu_engine import GpuEngine
from spec.costmodel import CostModel, preset
from spec.formats import _mix
from spec.formats import Trace, TraceRequest
from spec.simulate import scale_to_rate

COST = preset("h200-llama-8b-bf16")
AZURE = TRACES / "azure_llm_2023_conv.csv"


@pytest.fixture(scope="module")
def azure():
    trace, _ = import_trace(str(AZURE))
    return dataclasses.replace(trace, requests=trace.requests[:150])


def test_bulk_synthetic_tokens_equal_the_trace_rule():
    for label, lo, hi in (("r0#in", 0, 1200), ("r17#out", 95, 10_050), ("grp#pre", 0, 3), ("x", 999_990, 1_000_010)):
        assert SE.synthetic_range(label, lo, hi, 32000).tolist() == [_mix(label, i, 32000) for i in range(lo, hi)]
    req = TraceRequest(id="q", prompt_len=40, max_tokens=30, prefix_group="g", prefix_len=20, output_tokens=(5, 6))
    assert SE.prompt_tokens(req, 1000) == req.prompt_token_ids(1000)
    assert SE.output_tokens(req, 0, 30, 1000).tolist() == [req.output_token(i, 1000) for i in range(30)]


def _same(trace, profile, cost=COST, **knobs):
    config = run_config(trace, parse_profile_spec(profile), cost, knobs)
    spec = run_one(trace, config, cost)
    calls = []
    engine = SE.make_gpu_engine(trace, config)
    step = engine.step
    engine.step = lambda: calls.append(1) or step()
    gpu = SE.simulate_fast(trace, cost, engine)
    assert SE.first_difference(spec, gpu) is None, (profile, knobs)
    return spec, gpu, len(calls)


@pytest.mark.parametrize("rate", [0.5, 5.0, 40.0])
def test_azure_window_equals_the_spec_at_low_and_high_load(azure, rate):
    spec, gpu, engine_steps = _same(scale_to_rate(azure, rate), "vllm-v1")
    if rate <= 5:  # decode spans did most of the steps
        assert engine_steps < spec.steps / 3


@pytest.mark.parametrize("profile,knobs", [
    ("vllm-v1", {"num_blocks": 300}),  # tight memory: preemptions cut spans
    ("vllm-v0-swap", {"num_blocks": 300, "max_model_len": 4096}),  # swap: the driver's own batch tracker
    ("static", {}), ("sglang", {}), ("vtc", {"max_model_len": 4096}), ("priority-aging", {}), ("naive", {}),
    ("vllm-v1", {"kv_reservation": "full", "max_num_seqs": 4}),
    # nano-vllm's knobs (cut prefills continued first, whole-sequence reservation, FIFO free queue,
    # latest duplicate wins, max_num_seqs per step); spans only with registration at allocation
    ("nano-vllm", {"block_size": 16, "num_blocks": 300, "max_num_batched_tokens": 2048, "max_num_seqs": 8}),
    ("nano-vllm", {"block_size": 16, "num_blocks": 300, "max_num_batched_tokens": 2048, "cache_register": "allocation"}),
])
def test_profiles_equal_the_spec(azure, profile, knobs):
    _same(scale_to_rate(azure, 8.0), profile, **knobs)


def test_prefix_groups_eos_stop_tokens_and_aborts_equal_the_spec():
    """Shared prefixes (hits on blocks registered inside spans), EOS and stop tokens
    sampled mid-span (given output tokens), aborts, under a flat cost model."""
    rng = random.Random(3)
    reqs, t = [], 0.0
    for i in range(120):
        kw = {}
        if i % 7 == 0:
            kw["output_tokens"] = (40, 41, 2, 43)  # EOS (id 2) as the third token
        if i % 11 == 0:
            kw["stop_token_ids"] = (_mix(f"r{i}#out", 9, 1000),)  # its 10th synthetic token stops it
        reqs.append(TraceRequest(id=f"r{i}", prompt_len=rng.randint(20, 90), max_tokens=rng.randint(5, 60),
                                 prefix_group=f"g{i % 3}" if i % 2 else None, prefix_len=48, arrival_time=round(t, 4),
                                 abort_at=400 + i if i % 13 == 0 else None, **kw))
        t += rng.expovariate(4.0)
    trace = Trace(config={"profile": "vllm-v1", "block_size": 8, "num_blocks": 200}, requests=reqs, vocab_size=1000)
    spec, gpu, engine_steps = _same(trace, "vllm-v1", CostModel("flat", fixed_s=0.01, per_kv_token_s=1e-7))
    assert engine_steps < spec.steps and spec.requests["r0"].outcome == "eos"


def test_the_check_catches_a_span_that_is_accounted_wrong(azure, monkeypatch):
    trace = scale_to_rate(azure, 2.0)
    config = run_config(trace, parse_profile_spec("vllm-v1"), COST)
    assert SE.check_run(trace, config, COST, requests=100) > 0
    real = SE._span_step_ns
    monkeypatch.setattr(SE, "_span_step_ns", lambda cost, d, kv0, k: real(cost, d, kv0 + 1, k))  # one KV token off
    with pytest.raises(SE.EngineMismatch, match="differ from the spec's on the first 100 requests"):
        SE.check_run(trace, config, COST, requests=100)


def test_sweep_on_gpu_engine_gives_the_spec_sweeps_metrics(azure):
    specs = [parse_profile_spec("vllm-v1")]
    rates = [1.0, 6.0, 30.0]
    ours = sweep(azure, specs, rates, COST, engine="gpu", check_engine="sampled", stop_after_unbounded=None)
    theirs = sweep(azure, specs, rates, COST, stop_after_unbounded=None)
    assert [p.metrics for p in ours] == [p.metrics for p in theirs]
    assert [p.checked_steps > 0 for p in ours] == [True, False, True]  # lowest and highest rate


def test_a_parallel_gpu_sweep_equals_the_serial_one_with_its_checks_as_jobs(azure, monkeypatch):
    """Two workers, the sampled checks as jobs of their own, highest rates first (every point
    runs) or ascending (skipping beyond the boundary): the serial sweep's points, checks
    included; a check that fails in a worker makes its point an error."""
    import multiprocessing

    specs = [parse_profile_spec("vllm-v1")]
    rates = [1.0, 6.0, 30.0]
    for stop in (1, None):
        serial = sweep(azure, specs, rates, COST, engine="gpu", check_engine="sampled", stop_after_unbounded=stop)
        seen = []
        parallel = sweep(azure, specs, rates, COST, jobs=2, engine="gpu", check_engine="sampled",
                         stop_after_unbounded=stop, on_point=seen.append)
        assert [(p.rate, p.metrics, p.checked_steps, p.skipped) for p in parallel] == \
            [(p.rate, p.metrics, p.checked_steps, p.skipped) for p in serial]
        assert sorted(p.rate for p in seen) == rates
    assert [p.checked_steps > 0 for p in parallel] == [True, False, True]  # (every point ran: stop None)
    if multiprocessing.get_start_method() != "fork":
        pytest.skip("the failing check is planted by a monkeypatch, which only forked workers inherit")
    real = SE._span_step_ns
    monkeypatch.setattr(SE, "_span_step_ns", lambda cost, d, kv0, k: real(cost, d, kv0 + 1, k))  # one KV token off
    broken = sweep(azure, specs, rates, COST, jobs=2, engine="gpu", check_engine="sampled", stop_after_unbounded=None)
    assert [p.error is not None and "EngineMismatch" in p.error for p in broken] == [True, False, True]
    assert broken[1].metrics is not None


def test_cli_simulate_engine_gpu_reports_the_check(tmp_path, capsys):
    code = sim_cli.main(["simulate", str(AZURE), "--first", "150", "--engine", "gpu", "--check-engine", "full",
                         "--json", str(tmp_path / "m.json")])
    out = capsys.readouterr()
    assert code == 0 and "gpu_engine's decisions equal the spec's (full check" in out.err
    code = sim_cli.main(["simulate", str(AZURE), "--first", "150", "--json", str(tmp_path / "s.json")])
    capsys.readouterr()
    import json

    ours, theirs = json.loads((tmp_path / "m.json").read_text()), json.loads((tmp_path / "s.json").read_text())
    assert code == 0 and ours["metrics"] == theirs["metrics"]


def test_nano_vllm_decode_spans_only_with_registration_at_allocation(azure):
    """Under cache_register="computed" a block enters the cache after its step, which a
    span's closed form does not model: gpu_engine runs every step (and still equals the
    spec); with registration at allocation the spans run again."""
    knobs = {"block_size": 16, "num_blocks": 300, "max_num_batched_tokens": 2048}
    trace = scale_to_rate(azure, 2.0)
    spec, _, engine_steps = _same(trace, "nano-vllm", **knobs)
    assert engine_steps == spec.steps
    spec, _, engine_steps = _same(trace, "nano-vllm", cache_register="allocation", **knobs)
    assert engine_steps < spec.steps


def test_primed_tokens_equal_the_trace_rule():
    """Prompts and outputs synthesized in bulk runs (one affine CRC per index, :func:`_synthetic_runs`)
    equal each request's own token rule, across digit-count boundaries and shared prefixes."""
    reqs = [TraceRequest(id=f"p{i}", prompt_len=7 + 131 * i, max_tokens=3 + 97 * i, prefix_group="g" if i % 2 else None,
                         prefix_len=40) for i in range(12)]
    SE.prime_prompts(reqs, 5000)
    for r in reqs:
        assert SE.prompt_tokens(r, 5000) == r.prompt_token_ids(5000)
        assert SE.output_tokens(r, 0, r.max_tokens, 5000).tolist() == [r.output_token(i, 5000) for i in range(r.max_tokens)]


# -- decode spans that end with the step in which requests stop -------------------------------


def _stopping_requests(tpot_slo=None, at_risk=range(7)) -> list[TraceRequest]:
    """Requests that stop at different steps of one steady decode (max_model_len 64): EOS,
    a stop token, max_tokens, max_model_len, and two in the same step by max_tokens (one of
    them ignoring an EOS, the other's last token filling a block); a shared prefix, so that
    blocks are hit and registered.  ``tpot_slo``: the TPOT target of those in ``at_risk``."""
    plan = [(9, 5, (20, 2)), (12, 40, ()), (15, 9, (20, 21, 2)), (18, 30, ()), (21, 31, ()), (24, 31, (7, 2, 8)),
            (40, 30, ())]  # (prompt_len, max_tokens, given output tokens)
    reqs = []
    for i, (prompt_len, max_tokens, given) in enumerate(plan):
        kw = {"tpot_slo": tpot_slo} if tpot_slo and i in at_risk else {}
        if i == 3:  # its 4th synthetic token is a stop token
            kw["stop_token_ids"] = (_mix(f"s{i}#out", 3, 1000),)
        reqs.append(TraceRequest(id=f"s{i}", prompt_len=prompt_len, max_tokens=max_tokens, output_tokens=given,
                                 ignore_eos=i == 5, prefix_group="g" if i % 2 else None, prefix_len=8, arrival_step=0,
                                 **kw))
    return reqs


def _engine_state(engine) -> tuple:
    s = engine.sched
    run = s.running
    return (s.tables(), s.pool.queue.ids(), dict(s.pool.entry), {h: list(b) for h, b in s.pool.duplicates.items()},
            [s.hashes[x] for x in run.tolist()], s.num_cached_blocks[run].tolist(), s.pool.ref_cnt.tolist(),
            s.num_tokens[run].tolist(), s.clock)


@pytest.mark.parametrize("profile,tpot,at_risk", [("vllm-v1", None, ()), ("edf", 1, range(7)), ("edf", 1, (1, 3, 5)),
                                                  ("edf", 3, range(7))])
def test_a_span_ending_in_stops_equals_its_steps(profile, tpot, at_risk):
    """gpu_engine's decode spans run through the step in which requests stop (max_tokens,
    max_model_len, EOS, a stop token): the finished requests, their reasons, and the engine's
    memory state (tables, free queue order, cache map, hash chains) after each such step equal
    running the steps one by one.  Under EDF a decode with a one-step TPOT is at risk in every
    step, so the batch (and the free order of the stopped) puts those first: with (1, 3, 5) at
    risk, s5 is freed before s4."""
    trace = Trace(config={"profile": profile, "block_size": 4, "num_blocks": 120, "max_model_len": 64,
                          "enable_prefix_caching": True}, requests=_stopping_requests(tpot, at_risk), vocab_size=1000,
                  eos_token_id=2)

    def run(spans: bool):
        engine = GpuEngine.from_trace(trace)
        for r in trace.requests:
            engine.add_request(r)
        finishes, spanned = {}, 0
        while engine.has_unfinished_requests():
            k = engine.decode_span(10_000)[0] if spans else 0
            if k:
                spanned += bool(engine.span_finished)
                got = engine.span_finished
            else:
                got = engine.step().finished
            if got:
                finishes[engine.sched.clock] = (got, _engine_state(engine))
        return finishes, spanned

    stepped, _ = run(False)
    spanned, ended_in_stops = run(True)
    assert spanned == stepped
    assert sum(len(f) for f, _ in stepped.values()) == len(trace.requests)
    assert ended_in_stops >= 3, "too few spans ended with a stop to test them"
    reasons = {rid: why for f, _ in stepped.values() for rid, why in f}
    assert reasons == {"s0": "eos", "s1": "max_tokens", "s2": "eos", "s3": "stop_token", "s4": "max_tokens",
                       "s5": "max_tokens", "s6": "max_model_len"}
    together = ["s5", "s4"] if at_risk == (1, 3, 5) else ["s4", "s5"]  # (batch order)
    assert any([rid for rid, _ in f] == together for f, _ in spanned.values())


@pytest.mark.parametrize("rate", [0.3, 3.0])
def test_simulated_stops_in_spans_equal_stepping_one_by_one(azure, rate):
    """The simulator's accounting of a span's last step (finish times and reasons, the step's
    running and in-system counts and used blocks after its finishes) equals the same run with
    every step taken one by one (spans off), and the spec's; most finishes fell in spans."""
    trace = scale_to_rate(dataclasses.replace(azure, requests=azure.requests[:60]), rate)
    config = run_config(trace, parse_profile_spec("vllm-v1"), COST)
    engine = SE.make_gpu_engine(trace, config)
    span, in_spans = engine.decode_span, []

    def counted(k):
        got = span(k)
        in_spans.extend(engine.span_finished)
        return got
    engine.decode_span = counted
    fast = SE.simulate_fast(trace, COST, engine)
    slow_engine = SE.make_gpu_engine(trace, config)
    slow_engine.decode_span = lambda k: (0, [])
    slow = SE.simulate_fast(trace, COST, slow_engine)
    assert SE.first_difference(slow, fast) is None
    assert SE.first_difference(run_one(trace, config, COST), fast) is None
    assert len(in_spans) > len(trace.requests) / 2
