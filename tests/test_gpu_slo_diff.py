"""gpu_engine vs. the spec on the SLO-aware map (issue 19), at the ``exact`` level.

gpu_engine implements every SLO policy independently (its own array formulas in
:mod:`gpu_engine.formulas`, never the spec's rules): ``sprpt`` (its waiting-queue key), ``edf``
(the EDF queue key, at-risk decodes served before the running walk), the ``slo-slack`` victim
order and SLO admission control (``refuse`` / ``defer``).  ``BATCHSPEC_SLO_TRACES`` (default
500) sets how many random traces each profile replays; the fuzzer draws targets and
predictions on most requests (:func:`fuzz.generate._draw_slo`).

The hand-worked scenarios at the end run gpu_engine alone; every expected value is worked
out in the comment above it from the rules' statements (spec/slo.py), not read off a run,
and each is set against what FCFS (``vllm-v1``) does on the same trace."""
from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuzz.engines  # noqa: F401  (registers gpu)
from fuzz.generate import random_trace
from fuzz.replay import replay
from gpu_engine import GpuEngine
from gpu_engine import formulas as F
from gpu_engine.engine import check_supported
from spec.config import ConfigError, resolve
from spec.formats import Trace, TraceRequest
from spec.protocol import drive
from spec.rules import HITS

NUM_TRACES = int(os.environ.get("BATCHSPEC_SLO_TRACES", "500"))
MAX_STEPS = 3000


@pytest.mark.parametrize("knobs", [{}, {"aging_steps": 0}, {"aging_steps": 1}])
def test_sprpt_agrees_exactly(knobs):
    HITS.clear()
    seen: Counter = Counter()
    count = NUM_TRACES if not knobs else NUM_TRACES // 5
    for seed in range(count):
        trace = random_trace(seed, profile="sprpt", max_steps=MAX_STEPS, **knobs)
        result = replay(trace, "gpu", "exact")
        assert result.agreed, f"sprpt {knobs} seed {seed}: {result.divergence.describe()}"
        seen["predicted"] += sum(r.predicted_output_len is not None for r in trace.requests)
        seen["admitted"] += sum(len(rec.new) for rec in result.engine_records)
        seen["preempted"] += sum(len(rec.preempted) for rec in result.engine_records)
    assert seen["predicted"] and seen["admitted"] and seen["preempted"]
    assert HITS["QUEUE.SPRPT"] and (HITS["QUEUE.AGING"] or knobs.get("aging_steps") == 0)


#: Rules each EDF profile's traces must exercise (fired in the spec, counted by spec.rules.HITS).
EDF_MUST_FIRE = {
    "edf": ("QUEUE.EDF", "EDF.AT_RISK_FIRST", "PREEMPT.VICTIM_SLO_SLACK", "SLO.TARGET_STEPS"),
    "edf-ac": ("QUEUE.EDF", "EDF.AT_RISK_FIRST", "PREEMPT.VICTIM_SLO_SLACK", "SLO.FEASIBLE", "SLO.REFUSE"),
}  # (SLO.DEFER: slo_admission="defer" in test_slo_knobs_cross_the_map)


@pytest.mark.parametrize("profile", sorted(EDF_MUST_FIRE))
def test_edf_agrees_exactly(profile):
    HITS.clear()
    seen: Counter = Counter()
    for seed in range(NUM_TRACES):
        trace = random_trace(seed, profile=profile, max_steps=MAX_STEPS)
        result = replay(trace, "gpu", "exact")
        assert result.agreed, f"{profile} seed {seed}: {result.divergence.describe()}"
        seen["refused"] += sum(why == "slo_infeasible" for rec in result.engine_records for _, why in rec.rejected)
        seen["preempted"] += sum(len(rec.preempted) for rec in result.engine_records)
    assert seen["preempted"] and (seen["refused"] or profile == "edf")
    assert not seen["refused"] or profile == "edf-ac"
    missing = [r for r in EDF_MUST_FIRE[profile] if not HITS[r]]
    assert not missing, f"{profile}: never fired {missing}"


#: The SLO knobs crossed with the rest of the map gpu_engine implements: phase orders,
#: reservations, swap, caching variants, nano-vllm's step, and the SLO knobs on other policies.
CROSSED = [
    {"profile": "edf", "batching": "prefill-first"}, {"profile": "edf-ac", "batching": "static"},
    {"profile": "edf", "preemption_mode": "swap", "num_cpu_blocks": 6}, {"profile": "edf-ac", "kv_reservation": "full"},
    {"profile": "edf", "enable_prefix_caching": True, "cache_duplicates": "latest", "free_block_order": "tail"},
    {"profile": "edf-ac", "enable_prefix_caching": True, "cache_register": "computed"},
    {"profile": "edf", "max_num_seqs_scope": "step"}, {"profile": "edf-ac", "long_prefill_token_threshold": 3},
    {"profile": "edf-ac", "batching": "prefill-first", "prefill_chunking": "first-continues", "kv_reservation": "sequence"},
    {"profile": "edf", "slo_admission": "defer"}, {"profile": "edf-ac", "admit_after_preempt": True},
    {"profile": "edf", "preemption_victim": "policy"}, {"profile": "edf", "preemption_victim": "policy", "admission": "estimate"},
    {"profile": "vllm-v1", "preemption_victim": "slo-slack"}, {"profile": "priority-aging", "preemption_victim": "slo-slack"},
    {"profile": "vtc", "preemption_victim": "slo-slack"}, {"profile": "sprpt", "preemption_victim": "slo-slack"},
]


def test_slo_knobs_cross_the_map():
    HITS.clear()
    count = max(NUM_TRACES // 5, len(CROSSED))
    for seed in range(count):
        knobs = CROSSED[seed % len(CROSSED)]
        trace = random_trace(seed, max_steps=MAX_STEPS, **knobs)
        result = replay(trace, "gpu", "exact")
        assert result.agreed, f"{knobs} seed {seed}: {result.divergence.describe()}"
    for rule_id in ("SLO.DEFER", "PREEMPT.VICTIM_SLO_SLACK", "SWAP.OUT", "RUN.CONTINUE_PREFILL_FIRST", "EDF.AT_RISK_FIRST"):
        assert HITS[rule_id], rule_id


def test_edf_torch_code_path():
    """The CUDA code path (array code as torch ops), run on CPU."""
    for profile in ("sprpt", "edf", "edf-ac"):
        for seed in range(9000, 9005):
            trace = random_trace(seed, profile=profile, max_steps=MAX_STEPS)
            result = replay(trace, GpuEngine.from_trace(trace, use_numpy=False), "exact")
            assert result.agreed, f"{profile} seed {seed}: {result.divergence.describe()}"


def test_slo_policies_with_async_scheduling_are_refused_by_name():
    """The spec refuses them (a token in flight would change a waiting key or a token time);
    gpu_engine names the same knob if handed such a configuration unvalidated."""
    import dataclasses

    from spec.config import SchedulerConfig

    with pytest.raises(ConfigError, match="async_scheduling"):
        resolve({"profile": "edf", "async_scheduling": True})
    for knobs in ({"policy": "edf"}, {"policy": "sprpt"}, {"preemption_victim": "slo-slack"}):
        cfg = dataclasses.replace(SchedulerConfig(), async_scheduling=True, **knobs)
        with pytest.raises(ValueError, match=f"gpu_engine does not implement {next(iter(knobs))}"):
            check_supported(cfg)
    for name in ("edf", "edf-ac"):
        check_supported(resolve({"profile": name}))


# -- hand-worked scenarios: gpu_engine alone ----------------------------------------------------

BASE = dict(block_size=4, num_blocks=17, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=64,
            enable_prefix_caching=False)


def R(rid: str, prompt_len: int, max_tokens: int, **kw) -> TraceRequest:
    return TraceRequest(id=rid, prompt_len=prompt_len, max_tokens=max_tokens, arrival_step=0, ignore_eos=True, **kw)


def gpu_run(config: dict, *requests: TraceRequest) -> dict:
    trace = Trace(config={**BASE, **config}, requests=list(requests), vocab_size=1000, eos_token_id=2)
    return {r.step: r for r in drive(GpuEngine.from_trace(trace), trace, 200)}


def admissions(records: dict) -> list[tuple[int, list[str]]]:
    return [(s, r.new) for s, r in sorted(records.items()) if r.new]


def test_edf_admits_the_earliest_deadline_first():
    # One request at a time.  Deadlines: a 0+20-1 = 19, b 0+5-1 = 4, c none.  EDF: b, a, c.
    # Each: a 4-token prompt (one step, first token) and a second token in the next step,
    # so b is admitted at 0 and finishes at 1, a at 2, c at 4.  FCFS: arrival order.
    reqs = (R("a", 4, 2, ttft_slo=20), R("b", 4, 2, ttft_slo=5), R("c", 4, 2))
    assert admissions(gpu_run({"profile": "edf", "max_num_seqs": 1}, *reqs)) == [(0, ["b"]), (2, ["a"]), (4, ["c"])]
    assert admissions(gpu_run({"profile": "vllm-v1", "max_num_seqs": 1}, *reqs)) == [(0, ["a"]), (2, ["b"]), (4, ["c"])]


def test_edf_serves_at_risk_decodes_first():
    # Budget 3.  b (12 tokens, deadline 9) comes before a (no TTFT target) and prefills
    # 3 tokens a step in steps 0-3 (first token at 3); a (1 token, tpot 1) is admitted at
    # step 4 behind b's decode and samples its first token.  At step 5 a's next token is due
    # (last at 4, tpot 1): EDF serves it before b; FCFS keeps the running order b, a.
    reqs = (R("b", 12, 4, ttft_slo=10), R("a", 1, 4, tpot_slo=1))
    edf = gpu_run({"profile": "edf", "max_num_batched_tokens": 3}, *reqs)
    assert [edf[s].scheduled for s in (3, 4, 5)] == [[("b", 3)], [("b", 1), ("a", 1)], [("a", 1), ("b", 1)]]
    fcfs = gpu_run({"profile": "vllm-v1", "max_num_batched_tokens": 3}, *reqs)
    assert fcfs[5].scheduled == [("b", 1), ("a", 1)]


def test_slack_victim_is_the_request_with_the_most_slack():
    # 3 usable blocks of 4 tokens.  Step 0: x and y (4-token prompts) take one block each and
    # sample their first token; 1 block free.  Step 1: x (5 tokens) takes the free block; y then
    # lacks one.  FCFS preempts the newest, y itself.  slo-slack: x has no targets (infinite
    # slack), y's next token is due at 0 + 2 = 2 >= now (not missed): x is the victim, gives
    # back its token and its 2 blocks, and y decodes.
    reqs = (R("x", 4, 6), R("y", 4, 6, tpot_slo=2))
    small = {"num_blocks": 4, "watermark": 0.0}
    fcfs = gpu_run({"profile": "vllm-v1", **small}, *reqs)
    assert (fcfs[1].scheduled, fcfs[1].preempted) == ([("x", 1)], ["y"])
    slack = gpu_run({"profile": "vllm-v1", "preemption_victim": "slo-slack", **small}, *reqs)
    assert (slack[1].scheduled, slack[1].preempted) == ([("y", 1)], ["x"])


@pytest.mark.parametrize("admission, step0, step1", [
    # Budget 4.  a: 8 tokens, deadline 0 (ttft 1): it needs cdiv(8, 4) = 2 steps, 0 + 2 - 1 = 1 > 0:
    # infeasible.  b: 4 tokens, deadline 4: feasible.  edf: a is due first, admitted at 0 (4 of
    # its 8 tokens); at 1 its last 4 take the whole budget, so b still waits.
    ("off", (["a"], []), ([], [])),
    # edf-ac refuses a at step 0 (rejected slo_infeasible) and admits b.
    ("refuse", (["b"], [("a", "slo_infeasible")]), ([], [])),
    # defer keeps a behind b: b (4 tokens) takes the budget at 0; a is admitted at 1 (b decodes 1, a takes 3).
    ("defer", (["b"], []), (["a"], [])),
])
def test_slo_admission_control(admission, step0, step1):
    reqs = (R("a", 8, 2, ttft_slo=1), R("b", 4, 2, ttft_slo=5))
    records = gpu_run({"profile": "edf", "slo_admission": admission, "max_num_batched_tokens": 4,
                       "max_model_len": 16, "enable_chunked_prefill": True}, *reqs)
    assert (records[0].new, records[0].rejected) == step0
    assert (records[1].new, records[1].rejected) == step1
    assert admissions(gpu_run({"profile": "vllm-v1", "max_num_batched_tokens": 4, "max_model_len": 16}, *reqs))[0] \
        == (0, ["a"])


# -- the simulator on gpu_engine's decisions: decode spans under EDF --------------------------


@pytest.mark.parametrize("profile, rate", [("edf", 2.0), ("edf", 30.0), ("edf-ac", 30.0)])
def test_simulated_edf_with_decode_spans_equals_the_spec(profile, rate):
    """``batchspec sweep --engine gpu``: gpu_engine runs steady decodes as closed-form spans
    (at-risk decodes, tpot <= 1 step, pop and register their blocks first in each step) and
    keeps the token times the SLO rules read; the simulated run equals the spec's, request by
    request and step by step.  Targets as the README's sweep gives them (seconds, a tight
    class with a one-step TPOT and a loose one)."""
    import dataclasses

    from batchspec.data import TRACES
    from fuzz import sim_engine as SE
    from fuzz.importers import import_trace
    from fuzz.sweep import parse_profile_spec, run_config, run_one, with_targets
    from spec.costmodel import preset
    from spec.simulate import scale_to_rate

    cost = preset("h200-llama-8b-bf16")
    trace, _ = import_trace(str(TRACES / "azure_llm_2023_conv.csv"))
    trace = dataclasses.replace(trace, requests=trace.requests[:100])
    step_s = cost.step_ns(__import__("spec.costmodel", fromlist=["StepShape"]).StepShape(0, 1, 0)) / 1e9
    trace = with_targets(scale_to_rate(trace, rate), [{"class": "tight", "ttft": 0.3, "tpot": step_s, "share": 0.5},
                                                      {"class": "loose", "ttft": 2.0, "tpot": 0.2}])
    config = run_config(trace, parse_profile_spec(profile), cost, {"num_blocks": 400})
    spec = run_one(trace, config, cost)
    engine = SE.make_gpu_engine(trace, config)
    calls = []
    step = engine.step
    engine.step = lambda: calls.append(1) or step()
    gpu = SE.simulate_fast(trace, cost, engine)
    assert SE.first_difference(spec, gpu) is None
    assert len(calls) < spec.steps, "no decode span ran"


def _span_state(use_span: bool, tpots: tuple, k: int):
    """Two requests in steady decode (2-token blocks, so every other step pops a block), then
    ``k`` decode steps as one span or one by one: block tables, free queue, cache map, token
    times."""
    reqs = [R(f"r{i}", 3, 30, tpot_slo=t) if t else R(f"r{i}", 3, 30) for i, t in enumerate(tpots)]
    trace = Trace(config={**BASE, "profile": "edf", "block_size": 2, "num_blocks": 40, "enable_prefix_caching": True},
                  requests=reqs, vocab_size=1000, eos_token_id=2)
    engine = GpuEngine.from_trace(trace)
    for r in reqs:
        engine.add_request(r)
    for _ in range(3):
        engine.step()
    s = engine.sched
    assert s.span_ready()
    if use_span:
        got, _ = engine.decode_span(k)
        assert got == k
    else:
        for _ in range(k):
            engine.step()
    run = s.running
    return (s.tables(), s.pool.queue.ids(), dict(s.pool.entry), {h: list(b) for h, b in s.pool.duplicates.items()},
            s.last_token[run].tolist(), s.slo_missed[run].tolist(), s.clock if not use_span else s.clock + 0)


@pytest.mark.parametrize("tpots", [(None, 1), (1, None), (1, 1), (3, 1), (None, None)])
def test_edf_decode_span_equals_its_steps(tpots):
    # With tpot 1 a decode is at risk in every step (its last token one step earlier), so EDF
    # serves it first: in a span it pops and registers its blocks before the others in each
    # step, exactly as the per-step path does.  (None, 1): the second request's blocks first.
    k = 7
    assert _span_state(True, tpots, k) == _span_state(False, tpots, k)


# -- the SLO formulas against the sequential loops they replace ---------------------------------

ARRAYS = [lambda v: np.asarray(v, dtype=np.int64), lambda v: torch.as_tensor(np.asarray(v, dtype=np.int64))]


def _ints(x) -> list[int]:
    return [int(v) for v in x.tolist()]


@pytest.mark.parametrize("arr", ARRAYS)
@settings(max_examples=120, deadline=None)
@given(need=st.lists(st.integers(0, 1), max_size=10), free=st.integers(0, 6), limit=st.integers(0, 8))
def test_at_risk_grants_equal_the_loop(arr, need, free, limit):
    granted = []
    for i, k in enumerate(need):  # the spec's serve_at_risk walk over the at-risk decodes
        if len(granted) >= limit:
            break
        if k > free:
            continue  # allocation fails: left to the running walk
        free -= k
        granted.append(i)
    assert _ints(F.at_risk_grants(arr(need), free + sum(need[i] for i in granted), limit)) == granted


@pytest.mark.parametrize("arr", ARRAYS)
@settings(max_examples=120, deadline=None)
@given(keys=st.lists(st.tuples(st.integers(0, 1), st.sampled_from([0, 1, 2, 5, F.NEVER])), min_size=1, max_size=8))
def test_slack_victim_order_equals_repeated_picks(arr, keys):
    running = list(range(len(keys)))
    picks = []
    while running:  # the rule, one victim at a time: max (missed, due), the latest in the list on a tie
        victim = max(reversed(running), key=lambda i: keys[i])
        picks.append(victim)
        running.remove(victim)
    order = F.slack_victim_order(arr([m for m, _ in keys]), arr([d for _, d in keys]))
    assert _ints(order) == picks


@pytest.mark.parametrize("arr", ARRAYS)
@settings(max_examples=120, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 1), st.sampled_from([0, 3, 7, (1 << 29) - 3, F.NEVER])),
                     min_size=1, max_size=8))
def test_edf_keys_order_like_the_tuple(arr, rows):
    keys = _ints(F.edf_keys(arr([d for d, _ in rows]), arr([u for _, u in rows]), arr(list(range(len(rows))))))
    by_key = sorted(range(len(rows)), key=lambda i: keys[i])
    by_tuple = sorted(range(len(rows)), key=lambda i: (rows[i][0], rows[i][1], i))  # (deferred, due, arrival)
    assert by_key == by_tuple and max(keys) < F.INF_KEY


def test_target_steps_worked_examples():
    # a step trace's targets are steps; a timed trace's 0.25 s at 0.1 s a step is 2.5 -> 2
    # steps, 0.05 s is half a step -> at least 1, 0.3 s at 0.1 s is 3 (not 2.9999...)
    assert F.target_steps(4, False, 0.1) == 4 and F.target_steps(None, True, 0.1) == F.NEVER
    assert [F.target_steps(v, True, 0.1) for v in (0.25, 0.05, 0.3)] == [2, 1, 3]
    # (feasible: with budget 4, 8 tokens need two steps, so from step 3 the first token is out at 4)
    assert _ints(F.feasible(3, np.asarray([8, 8, 4]), 4, np.asarray([4, 3, F.NEVER]))) == [1, 0, 1]
