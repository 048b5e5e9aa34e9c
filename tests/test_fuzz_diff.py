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


# -- optional state fields (issue 18): compared when both logs carry them ---------------------------

from fuzz.diff import state_fields_at  # noqa: E402
from spec.formats import STATE_FIELDS  # noqa: E402
from spec.protocol import drive  # noqa: E402
from spec.scheduler import SpecEngine  # noqa: E402


def _state_log(trace, level="exact", **kw):
    return drive(SpecEngine.from_trace(trace, record_level=level, **kw), trace, 100_000)


def _first_seed(want, **options):
    for seed in range(200):
        trace = random_trace(seed, **options)
        if want(_state_log(trace)):
            return trace
    raise AssertionError("no suitable trace in 200 seeds")


def test_the_spec_logs_each_state_field_at_its_level():
    trace = _first_seed(lambda rs: any(r.cache_registered for r in rs) and any(r.hit_blocks for r in rs),
                        enable_prefix_caching=True, prefix_groups=True)
    for level in ("decisions", "memory", "exact"):
        for rec in _state_log(trace, level):
            for name in STATE_FIELDS:
                if name in ("vtc_counters", "vtc_lifts", "estimate_rem", "estimate_parts", "drafts", "accepted", "token_cap", "placeholders"):
                    continue  # only under policy=vtc / admission=estimate / speculative decoding / a long-prefill
                    # cap / async scheduling
                carried = rec.to_json(level).get(name) is not None
                if name == "admit_stop" and rec.admit_stop is None:
                    continue  # only in a step whose walk of a non-empty waiting queue ran
                assert carried == (name in state_fields_at(level)), (level, name)
        assert any(r.admit_stop is not None for r in _state_log(trace, level)), level
    assert all(r.computed is None for r in _state_log(trace, record_reasons=False))  # the simulator's fast mode


def _with_computed(records, value=None):
    out = copy.deepcopy(records)
    for rec in out:
        rec.computed = None if value is None else {rid: value for rid, _ in rec.scheduled}
    return out


def test_a_state_field_is_compared_only_when_both_logs_carry_it(records):
    engine = _with_computed(records, 10**6)
    assert first_divergence(_with_computed(records), engine, "exact") is None
    assert first_divergence(_with_computed(records, 1), engine, "exact").field == "computed"


def test_floats_are_equal_within_a_relative_tolerance(records):
    spec_side, engine = copy.deepcopy(records), copy.deepcopy(records)
    spec_side[0].vtc_counters, engine[0].vtc_counters = {"a": 0.1 + 0.2}, {"a": 0.3}
    assert first_divergence(spec_side, engine, "decisions") is None
    engine[0].vtc_counters = {"a": 0.3001}
    d = first_divergence(spec_side, engine, "decisions")
    assert (d.step, d.field, d.rule) == (spec_side[0].step, "vtc_counters", "VTC.CHARGE")


def test_memory_state_is_not_compared_at_the_decisions_level(records):
    spec_side, engine = copy.deepcopy(records), copy.deepcopy(records)
    spec_side[1].estimate_rem, engine[1].estimate_rem = 12.0, 13.0
    spec_side[1].cache_registered, engine[1].cache_registered = {"x": [0]}, {"x": [1]}
    assert first_divergence(spec_side, engine, "decisions") is None
    d = first_divergence(spec_side, engine, "memory")
    assert (d.field, d.rule) == ("estimate_rem", "ESTIMATE.ADMIT")


@pytest.mark.parametrize("term, rule", [("outputs", "ESTIMATE.REMAINING"), ("running", "ESTIMATE.RUNNING_RATIO"),
                                        ("chunks", "ESTIMATE.CONTINUED_CHUNK"), ("free", "ESTIMATE.ADMIT")])
def test_the_estimate_term_that_differs_names_its_rule(records, term, rule):
    """Two estimates whose totals differ by one term: the report names that term's rule, at the
    step where it differed, before the total (which only says that the estimate differs)."""
    spec_side, engine = copy.deepcopy(records), copy.deepcopy(records)
    parts = {"free": 4096, "outputs": 500, "running": 300.5, "chunks": 48}
    spec_side[1].estimate_parts, engine[1].estimate_parts = dict(parts), {**parts, term: parts[term] + 16}
    spec_side[1].estimate_rem, engine[1].estimate_rem = 3747.5, 3747.5 + (16 if term == "free" else -16)
    assert first_divergence(spec_side, engine, "decisions") is None  # (memory-level state)
    d = first_divergence(spec_side, engine, "memory")
    assert (d.step, d.field, d.rule) == (spec_side[1].step, "estimate_parts", rule)
    assert term in d.reason
    engine[1].estimate_parts = dict(parts)  # the terms agree: the total is what differs
    assert first_divergence(spec_side, engine, "memory").field == "estimate_rem"


def test_a_state_difference_is_reported_at_its_own_earlier_step(records):
    """The state differs at step k, a decision only later: the report names step k and the
    rule behind the spec's value; a decision difference in the same step still comes first."""
    engine = copy.deepcopy(records)
    k = _first_busy(engine, lambda r: len(r.scheduled) > 0)
    rid = engine[k].scheduled[0][0]
    engine[k].computed = {**(engine[k].computed or {}), rid: 10**6}
    engine[-1].scheduled = engine[-1].scheduled[1:] + [("ghost", 1)]
    d = first_divergence(records, engine, "exact")
    assert (d.step, d.field, d.request) == (engine[k].step, "computed", rid)
    assert d.rule.split(".")[0] in ("RUN", "ADMIT", "BUDGET", "CACHE")
    engine[k].scheduled = [("ghost", 1)] + engine[k].scheduled
    assert first_divergence(records, engine, "exact").field == "scheduled"


# -- gpu_engine logs the same state from its own arrays; planted bugs surface at their cause --------

gpu = pytest.importorskip("gpu_engine.engine", reason="gpu_engine needs torch")


def _gpu_log(trace, level="exact"):
    return drive(gpu.GpuEngine.from_trace(trace, level=level, log_state=True), trace, 100_000)


@pytest.mark.parametrize("profile", ["vllm-v1", "vtc", "sglang", "vllm-v0-swap", "priority-aging"])
def test_gpu_engine_state_agrees_with_the_spec(profile):
    compared = set()
    for seed in range(8):
        trace = random_trace(seed, profile=profile)
        for level in ("decisions", "exact"):
            gpu_records = _gpu_log(trace, level)
            assert first_divergence(_state_log(trace, level), gpu_records, level, "gpu") is None
            compared |= {name for r in gpu_records for name in STATE_FIELDS if getattr(r, name)}
    assert "computed" in compared
    assert {"vtc": "vtc_counters", "sglang": "estimate_rem", "vllm-v1": "cache_registered"}.get(profile, "computed") in compared
    if profile == "sglang":
        assert "estimate_parts" in compared
    if profile == "vllm-v1":  # the block-level state: reference counts and cache entries, each engine's own
        assert {"ref_counts", "cached_blocks"} <= compared


def _divergences(trace, monkeypatch, owner, name, replacement):
    """The first divergence of gpu_engine with ``owner.name`` replaced: with the state
    fields in its log, and with them left out (what the report showed before)."""
    monkeypatch.setattr(owner, name, replacement)
    spec_records, gpu_records = _state_log(trace), _gpu_log(trace)
    with_state = first_divergence(spec_records, gpu_records, "exact", "gpu")
    bare = copy.deepcopy(gpu_records)
    for rec in bare:
        for field_name in STATE_FIELDS:
            setattr(rec, field_name, None)
    return with_state, first_divergence(spec_records, bare, "exact", "gpu")


def test_a_vtc_charge_bug_is_named_at_the_charge(monkeypatch):
    import numpy as np

    from gpu_engine.fairness import TenantCounters

    original = TenantCounters.charge

    def outputs_at_input_price(self, tenants, prompt_len, start, n):
        original(self, tenants, prompt_len, start, n)
        if len(tenants):
            out = n - np.clip(prompt_len - start, 0, n)
            np.add.at(self.counter, tenants, -(self.output_price - self.input_price) * out / self.weight[tenants])

    trace = _first_seed(lambda rs: any(r.vtc_counters and len(r.vtc_counters) > 1 for r in rs), profile="vtc")
    with_state, bare = _divergences(trace, monkeypatch, TenantCounters, "charge", outputs_at_input_price)
    assert with_state is not None and with_state.field == "vtc_counters" and with_state.rule.startswith("VTC.")
    assert bare is None or bare.step >= with_state.step


def test_a_late_cache_registration_is_named_at_the_registration(monkeypatch):
    from gpu_engine.scheduler import Scheduler

    original = Scheduler._cache_blocks

    def second_block_late(self, slots, upto_tokens, full=None):  # a request's second block is cached a step late
        upto = upto_tokens.copy() if hasattr(upto_tokens, "copy") else upto_tokens.clone()
        upto[(upto // self.bs) == 2] = self.bs
        original(self, slots, upto)  # (full: recounted from the changed upto)

    trace = _first_seed(lambda rs: any(1 in ordinals for r in rs for ordinals in (r.cache_registered or {}).values()),
                        profile="vllm-v1", prefix_groups=True)
    with_state, bare = _divergences(trace, monkeypatch, Scheduler, "_cache_blocks", second_block_late)
    assert with_state is not None and with_state.field == "cache_registered" and with_state.rule.startswith("CACHE.")
    assert bare is None or bare.step >= with_state.step


def test_an_eviction_blame_names_the_eviction_rule_of_the_traces_configuration():
    from fuzz.corpus import group_signature
    from fuzz.diff import as_configured
    from fuzz.replay import ReplayResult
    from spec.formats import Trace, TraceRequest

    assert as_configured("CACHE.EVICT_LRU", {"profile": "sglang"}) == "CACHE.EVICT_LEAF_LRU"
    assert as_configured("CACHE.EVICT_LRU", {"profile": "vllm-v1"}) == "CACHE.EVICT_LRU"
    assert as_configured("KV.FREE_ORDER", {"profile": "sglang"}) == "KV.FREE_ORDER"  # other rules untouched
    # a memory-level finding on an SGLang-profile trace: its group names the leaf eviction rule
    records = lambda n: [StepRecord(0, scheduled=[("a", 4)], new=["a"], num_free_blocks=5, blocks={"a": 1},
                                    cache_hits={"a": 0}, num_evicted=n)]
    spec_recs, eng_recs = records(0), records(1)
    div = first_divergence(spec_recs, eng_recs, "memory")
    assert div is not None and div.field == "num_evicted"
    for profile, rule in (("sglang", "CACHE.EVICT_LEAF_LRU"), ("vllm-v1", "CACHE.EVICT_LRU")):
        trace = Trace(config={"profile": profile}, requests=[TraceRequest(id="a", prompt_len=4, max_tokens=2)])
        result = ReplayResult(trace, "engine", "memory", eng_recs, spec_recs, div)
        assert group_signature(result) == ("decision", "num_evicted", rule)


def test_a_prefix_hit_seen_differently_is_named_before_the_free_count_it_moves():
    """Both sides admitted r2, the engine with a hit of 8 tokens: the free count that differs in the
    same step names CACHE.HIT for r2, not the allocation (KV.NO_FREE_BLOCKS) it changed."""
    base = dict(step=12, scheduled=[("r3", 17), ("r2", 1)], new=["r3", "r2"], blocks={"r2": 1}, num_evicted=0)
    spec_side = StepRecord(**base, cache_hits={"r3": 0, "r2": 0}, num_free_blocks=13)
    engine = StepRecord(**{**base, "blocks": {"r2": 3}}, cache_hits={"r3": 0, "r2": 8}, num_free_blocks=11)
    d = first_divergence([spec_side], [engine], "memory")
    assert (d.field, d.request, d.rule) == ("num_free_blocks", "r2", "CACHE.HIT")
    engine.cache_hits = {"r3": 0, "r2": 0}  # the same hits: the allocation is what differs
    assert first_divergence([spec_side], [engine], "memory").rule == "KV.NO_FREE_BLOCKS"


def _victim_step(tokens_r3):
    reasons = [{"rule": "RUN.DECODE", "text": "1 tokens (9 left)", "request": "r1"},
               {"rule": "PREEMPT.VICTIM_LOWEST_PRIORITY", "text": "preempted so that r2 gets blocks", "request": "r1"},
               {"rule": "RUN.DECODE", "text": "1 tokens (9 left)", "request": "r2"},
               {"rule": "RUN.PREFILL_CHUNK", "text": f"{tokens_r3} tokens (0 left)", "request": "r3"}]
    return StepRecord(step=18, scheduled=[("r2", 1), ("r3", tokens_r3)], preempted=["r1"], reasons=reasons)


def test_a_running_request_skipped_after_a_preemption_names_the_walk_not_the_giveback():
    """The engine left r3 out after preempting r1.  r3 was served more than r1 gave back, so the
    budget cannot explain it: the running walk (RUN.PREEMPT_FOR_BLOCKS).  Served exactly what r1 gave
    back, it is the give-back (the victim rule) unless the budget shows room for r3 anyway."""
    from fuzz.diff import configured_rule

    engine = StepRecord(step=18, scheduled=[("r2", 1)], preempted=["r1"])
    d = first_divergence([_victim_step(9)], [engine], "decisions")
    assert (d.field, d.request, d.rule) == ("scheduled", "r3", "RUN.PREEMPT_FOR_BLOCKS")
    d = first_divergence([_victim_step(1)], [engine], "decisions")
    assert d.rule == "PREEMPT.VICTIM_LOWEST_PRIORITY"
    config = {"profile": "vllm-v1", "policy": "priority"}
    assert configured_rule(d.rule, "scheduled", _victim_step(1), engine, "r3",
                           {**config, "max_num_batched_tokens": 3}) == "RUN.PREEMPT_FOR_BLOCKS"  # 1 + 1 + 1 fit
    assert configured_rule(d.rule, "scheduled", _victim_step(1), engine, "r3",
                           {**config, "max_num_batched_tokens": 2}) != "RUN.PREEMPT_FOR_BLOCKS"  # no room without it


def test_other_draft_counts_name_the_draft_rules():
    """A request scheduled with drafts the spec does not give it: discarded drafts kept over a
    preemption since it last sampled (SPEC.PREEMPT_DISCARDS), else the draft schedule; an admission
    padded on one side only, the padding (SPEC.PAD_ADMISSION)."""
    before = [StepRecord(step=1, scheduled=[("A", 5)], sampled={"A": 7}), StepRecord(step=2, preempted=["A"]),
              StepRecord(step=3, scheduled=[("A", 8)], resumed=["A"], drafts={})]
    spec_side = StepRecord(step=4, scheduled=[("A", 6)], drafts={},
                           reasons=[{"rule": "RUN.PREFILL_CHUNK", "text": "6 tokens (2 left)", "request": "A"}])
    engine = StepRecord(step=4, scheduled=[("A", 8)], drafts={"A": 2})
    d = first_divergence(before + [spec_side], before[:2] + [copy.deepcopy(before[2]), engine], "decisions")
    assert (d.step, d.field, d.request, d.rule) == (4, "scheduled", "A", "SPEC.PREEMPT_DISCARDS")
    d = first_divergence([before[0], spec_side], [before[0], engine], "decisions")  # no preemption in between
    assert d.rule == "SPEC.DRAFT_SCHEDULE"
    spec_side.drafts = engine.drafts = None  # (drafts not logged: the token rule)
    assert first_divergence([before[0], spec_side], [before[0], engine], "decisions").rule != "SPEC.DRAFT_SCHEDULE"
    admitted = StepRecord(step=4, scheduled=[("A", 6), ("B", 1)], new=["B"], drafts={})
    padded = StepRecord(step=4, scheduled=[("A", 6), ("B", 3)], new=["B"], drafts={"B": 2})
    d = first_divergence([before[0], admitted], [before[0], padded], "decisions")
    assert (d.request, d.rule) == ("B", "SPEC.PAD_ADMISSION")  # an admission's drafts are the padding's dummies


def test_a_lift_that_differs_is_named_at_the_arrival():
    """vtc_lifts: each tenant's counter right after its lift, compared before the counters (which
    the step's charges also move): a wrong lift names VTC.LIFT at the arrival, the tenant in the text."""
    spec_side = StepRecord(step=4, vtc_lifts={"t0": 1.0}, vtc_counters={"t0": 2.0, "t1": 24.3})
    engine = StepRecord(step=4, vtc_lifts={"t0": 24.3}, vtc_counters={"t0": 25.3, "t1": 24.3})
    d = first_divergence([spec_side], [engine], "decisions")
    assert (d.field, d.rule) == ("vtc_lifts", "VTC.LIFT") and "'t0'" in d.reason
    engine.vtc_lifts = {"t0": 1.0}  # the same lift: the charge is what differs
    assert first_divergence([spec_side], [engine], "decisions").field == "vtc_counters"


def test_a_chunk_past_the_cap_both_logs_apply_names_the_cap_rule():
    """Both logs say the step capped prefills at 4 tokens (token_cap); the engine continued r5 with 5:
    the cap rule, not the token budget."""
    spec_side = StepRecord(step=1, scheduled=[("r5", 4)], token_cap=4,
                           reasons=[{"rule": "RUN.CONTINUE_PREFILL_FIRST", "text": "4 tokens (1 left)", "request": "r5"}])
    engine = StepRecord(step=1, scheduled=[("r5", 5)], token_cap=4)
    assert first_divergence([spec_side], [engine], "decisions").rule == "BUDGET.LONG_PREFILL"
    engine.scheduled = [("r5", 3)]  # fewer tokens than the cap: not the cap's doing
    assert first_divergence([spec_side], [engine], "decisions").rule != "BUDGET.LONG_PREFILL"


def test_a_token_stop_against_a_length_stop_names_the_token_rule():
    """Both sides finish A in the same step, one on EOS (or a stop token), the other on a length: the
    token's stop rule, whichever side stopped on it."""
    spec_side = StepRecord(step=2, scheduled=[("A", 1)], sampled={"A": 9}, finished=[("A", "max_model_len")],
                           reasons=[{"rule": "STOP.LENGTH", "text": "finished: max_model_len", "request": "A"}])
    engine = StepRecord(step=2, scheduled=[("A", 1)], sampled={"A": 9}, finished=[("A", "eos")])
    assert first_divergence([spec_side], [engine], "decisions").rule == "STOP.EOS"
    spec_side.finished, engine.finished = [("A", "stop_token")], [("A", "max_tokens")]
    assert first_divergence([spec_side], [engine], "decisions").rule == "STOP.STOP_TOKEN"


def test_a_batch_in_another_order_after_a_retraction_names_the_retraction_order():
    """The same requests and counts in another order, the spec having retracted a request before:
    SGLang's batch runs in retraction order (RETRACT.BATCH_ORDER); without a retraction, not that rule."""
    retracted = StepRecord(step=1, scheduled=[("a", 1), ("b", 1)], preempted=["c"],
                           reasons=[{"rule": "RETRACT.VICTIM_FEWEST_OUTPUTS", "text": "retracted", "request": "c"}])
    spec_side = StepRecord(step=2, scheduled=[("b", 1), ("a", 1)])
    engine = StepRecord(step=2, scheduled=[("a", 1), ("b", 1)])
    d = first_divergence([retracted, spec_side], [copy.deepcopy(retracted), engine], "decisions")
    assert (d.step, d.field, d.rule) == (2, "scheduled", "RETRACT.BATCH_ORDER")
    plain = StepRecord(step=1, scheduled=[("a", 1), ("b", 1)])
    assert first_divergence([plain, spec_side], [plain, engine], "decisions").rule != "RETRACT.BATCH_ORDER"


def test_a_request_taken_in_a_step_the_spec_held_after_a_preemption_names_the_hold():
    """The spec preempted B and, holding admission after a preemption, took nobody in; the engine
    swapped S back in in that step: the report names ADMIT.NONE_AFTER_PREEMPT whatever rule the
    spec's victim took — unless the configuration admits after a preemption."""
    from fuzz.diff import configured_rule

    spec = StepRecord(step=5, scheduled=[("A", 1)], preempted=["B"])
    engine = StepRecord(step=5, scheduled=[("A", 1), ("S", 1)], preempted=["B"], resumed=["S"], swapped_in=["S"])
    config = {"profile": "vllm-v0-swap"}
    assert configured_rule("PREEMPT.VICTIM_NEWEST", "scheduled", spec, engine, "S", config) == "ADMIT.NONE_AFTER_PREEMPT"
    assert configured_rule("PREEMPT.VICTIM_NEWEST", "scheduled", spec, engine, "S",
                           {**config, "admit_after_preempt": True}) != "ADMIT.NONE_AFTER_PREEMPT"
