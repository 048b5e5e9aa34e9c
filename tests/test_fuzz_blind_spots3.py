"""Blind-spot hunt, round 3 (issue 18 items 2-3): what the campaign needed to catch and name the bugs
planted in mechanisms no earlier mutant touched (benchmarks/mutation_score.py, "round 3").

* steering: eviction rules get a short pool, the estimate's rules a short pool and cut prefills,
  SLO admission control its knob (``slo_admission``, which has no plain value in RULE_NEEDS);
* reports: a request admitted on both sides with different prefix hits names ``CACHE.HIT`` whatever
  field differs first; a release under ``free_block_order=tail`` names ``KV.FREE_TO_TAIL``; a request
  the engine still runs after the spec aborted it names the spec's own abort rule; computed tokens
  that differ after a verification name ``SPEC.ROLLBACK`` (or ``SPEC.ACCEPT`` when the accepted
  counts differ)."""
from __future__ import annotations

from fuzz.campaign import _steer_targets, rule_target
from fuzz.diff import as_configured, ended_rule, first_divergence, hit_differs
from spec.formats import StepRecord


def reason(rule, request=None):
    out = {"rule": rule, "text": "-"}
    if request is not None:
        out["request"] = request
    return out


def test_eviction_and_estimate_rules_are_steered_with_memory_pressure():
    assert rule_target("CACHE.EVICT_LEAF_LRU")["tight_memory"] is True
    assert rule_target("CACHE.EVICT_LRU")["tight_memory"] is True
    hold = rule_target("ESTIMATE.HOLD_UNTIL_DEPARTURE")
    assert hold["admission_hold"] == "until-departure" and hold["tight_memory"] is True
    assert hold["max_num_batched_tokens"] <= 16, "prompts of up to 80 tokens are cut: a continued chunk"


def test_slo_admission_control_is_steered_towards_its_knob():
    """SLO.DEFER's need is "any value but off" (no plain value for rule_target): its family sets it."""
    targets = _steer_targets(("SLO.DEFER",), None)
    assert any(t.get("slo_admission") == "defer" and t.get("policy") == "edf" for t in targets)
    assert any(t.get("slo_admission") == "refuse" for t in _steer_targets(("SLO.REFUSE",), None))


def test_a_different_prefix_hit_names_the_hit_whatever_differs_first():
    """Both sides admit B; the engine's hit (a salt it ignored) completes B's prefill at once, so B
    finishes on the engine's side only: the finish follows from the hit."""
    mem = dict(num_free_blocks=2, blocks={"B": 1}, num_evicted=0)
    spec = [StepRecord(0, scheduled=[("B", 1)], new=["B"], cache_hits={"B": 0}, reasons=[reason("ADMIT.NEW", "B")], **mem)]
    engine = [StepRecord(0, scheduled=[("B", 1)], new=["B"], cache_hits={"B": 4}, finished=[("B", "max_model_len")], **mem)]
    div = first_divergence(spec, engine, "memory")
    assert (div.field, div.request, div.rule) == ("finished", "B", "CACHE.HIT")
    assert not hit_differs(spec[0], StepRecord(0, scheduled=[("B", 1)], cache_hits={"B": 4}), "B"), \
        "admitted on one side only: the admission decides, not the hit"


def test_a_release_under_the_tail_free_order_names_free_to_tail():
    assert as_configured("KV.FREE_ORDER", {"profile": "nano-vllm"}) == "KV.FREE_TO_TAIL"
    assert as_configured("KV.FREE_ORDER", {"profile": "vllm-v1"}) == "KV.FREE_ORDER"


def test_a_request_run_after_the_spec_aborted_it_names_the_spec_abort_rule():
    history = [StepRecord(3, aborted=["A"], reasons=[reason("ABORT.CUT_PREFILL_AT_ONCE", "A")])]
    assert ended_rule(history, "A") == "ABORT.CUT_PREFILL_AT_ONCE"
    assert ended_rule([StepRecord(3, aborted=["A"])], "A") == "ABORT.FREE", "a log without reasons"


def test_computed_tokens_after_a_verification_name_the_rollback():
    def rec(computed, accepted):
        return StepRecord(5, scheduled=[("A", 4)], sampled={"A": 7}, computed=computed, accepted=accepted,
                          reasons=[reason("RUN.DECODE", "A")])

    div = first_divergence([rec({"A": 12}, {"A": 1})], [rec({"A": 10}, {"A": 1})], "decisions")
    assert (div.field, div.rule) == ("computed", "SPEC.ROLLBACK")
    div = first_divergence([rec({"A": 12}, {"A": 1})], [rec({"A": 13}, {"A": 2})], "decisions")
    assert (div.field, div.rule) == ("computed", "SPEC.ACCEPT")


def test_an_admission_the_engine_still_holds_back_names_the_hold():
    """The spec held admission at step 4 (its head refused by the estimate while a batch ran) and
    released it at step 5 (a cut prefill continued); the engine admits nobody at step 5."""
    held = StepRecord(4, scheduled=[("A", 4)], reasons=[reason("ESTIMATE.HOLD_UNTIL_DEPARTURE", "B")])
    spec = StepRecord(5, scheduled=[("A", 4), ("B", 8)], new=["B"], reasons=[reason("ADMIT.NEW", "B")])
    engine = StepRecord(5, scheduled=[("A", 4)])
    div = first_divergence([spec], [engine], "decisions", history=[held])
    assert (div.field, div.request, div.rule) == ("scheduled", "B", "ESTIMATE.HOLD_UNTIL_DEPARTURE")
    div = first_divergence([spec], [engine], "decisions", history=[StepRecord(4, scheduled=[("A", 4)])])
    assert div.rule != "ESTIMATE.HOLD_UNTIL_DEPARTURE", "no hold the step before: the admission's own rule"


def test_the_ignore_eos_switch_makes_half_the_requests_ignore_eos_and_keeps_the_rest_of_the_trace():
    from fuzz.generate import random_trace

    many = few = 0
    for seed in range(40):
        plain, forced = random_trace(seed), random_trace(seed, ignore_eos=True)
        assert [(r.id, r.prompt_len, r.max_tokens, r.output_tokens) for r in plain.requests] == \
               [(r.id, r.prompt_len, r.max_tokens, r.output_tokens) for r in forced.requests]
        few += sum(r.ignore_eos for r in plain.requests)
        many += sum(r.ignore_eos for r in forced.requests)
    assert many > 3 * few
    assert rule_target("ESTIMATE.IGNORE_EOS_RESERVE")["ignore_eos"] is True, "the reserve simulates ignore_eos requests"


def test_the_ignore_eos_reserve_interaction_is_met_by_its_steered_traces():
    """SGLang's reserve admission of an ignore_eos request beside a running batch (the simulation over
    every request's remaining outputs) is rare in a drawn trace: its own options meet it."""
    from fuzz import pairs as P
    from fuzz.generate import random_trace

    name = "ignore_eos-reserve x running batch"
    steer = P.BY_NAME[name].steer
    met = sum(name in P.interactions_met(P._spec_facts(random_trace(seed, **steer, interaction=name)))
              for seed in range(10))
    assert met >= 4, f"only {met}/10 steered traces met it"


def test_the_same_refusals_in_another_order_name_the_queue_order():
    """SLO admission control refuses in queue order: an engine that lists the same refusals in another
    order ordered its queue differently (QUEUE.EDF under edf), whatever the refused requests' reasons."""
    spec = StepRecord(0, rejected=[("A", "slo_infeasible"), ("B", "slo_infeasible")],
                      reasons=[reason("ARRIVE.QUEUED", "A"), reason("SLO.REFUSE", "A"), reason("SLO.REFUSE", "B")])
    engine = StepRecord(0, rejected=[("B", "slo_infeasible"), ("A", "slo_infeasible")])
    div = first_divergence([spec], [engine], "decisions")
    assert div.field == "rejected" and as_configured(div.rule, {"profile": "edf"}) == "QUEUE.EDF"
    other = StepRecord(0, rejected=[("B", "slo_infeasible")])
    assert first_divergence([spec], [other], "decisions").rule != "QUEUE.ORDER", "another set: not the order"
