"""Blind-spot hunt, round 4 (issue 18): the report names and steering targets its planted bugs needed.

Each report test builds the two logs a planted gpu_engine bug produced (shrunk by hand to the step
that differs) and checks the rule the first divergence names; the steering tests check that a
mechanism no profile combines is drawn where it binds."""
from __future__ import annotations

from fuzz.diff import as_configured, first_divergence
from spec.formats import StepRecord


def reason(rule: str, request: str, text: str = "") -> dict:
    return {"rule": rule, "request": request, "text": text}


def test_a_walk_that_goes_on_after_a_self_preemption_names_the_preemption_rule():
    """priority_self_preempt=continue: the spec's walk goes on after C preempted itself, the engine's
    stopped there (self_preempt_continue_ignored); with no self-preemption the budget cut it short."""
    spec = [StepRecord(5, scheduled=[("A", 1), ("B", 5)], preempted=["C"],
                       reasons=[reason("RUN.DECODE", "A"), reason("PREEMPT.VICTIM_LOWEST_PRIORITY", "C"),
                                reason("RUN.PREEMPT_FOR_BLOCKS", "C", "preempted itself; continuing"),
                                reason("RUN.DECODE", "B")])]
    eng = [StepRecord(5, scheduled=[("A", 1)], preempted=["C"])]
    assert first_divergence(spec, eng, "decisions").rule == "RUN.PREEMPT_FOR_BLOCKS"
    plain = [StepRecord(5, scheduled=[("A", 1), ("B", 5)], reasons=[reason("RUN.DECODE", "A"), reason("RUN.DECODE", "B")])]
    assert first_divergence(plain, [StepRecord(5, scheduled=[("A", 1)])], "decisions").rule == "BUDGET.TOKENS"


def test_a_spec_walk_stopped_at_max_num_seqs_scheduled_names_the_per_step_limit():
    """max_num_seqs_scope=step: the engine decoded one request more than the limit (step_scope_inclusive)."""
    spec = [StepRecord(7, scheduled=[("A", 1), ("B", 1)],
                       reasons=[reason("RUN.DECODE", "A"), reason("RUN.DECODE", "B"),
                                reason("BATCH.MAX_NUM_SEQS_PER_STEP", "C", "not reached: max_num_seqs scheduled")])]
    eng = [StepRecord(7, scheduled=[("A", 1), ("B", 1), ("C", 1)])]
    assert first_divergence(spec, eng, "decisions").rule == "BATCH.MAX_NUM_SEQS_PER_STEP"


def test_another_request_taken_where_the_spec_admission_stopped_names_the_queue_order():
    """The spec's head X failed its whole-sequence test (head-of-line blocking); the engine admitted Y:
    its queue put Y first (sprpt_ignores_outputs).  The engine admitting X itself is the test's business."""
    spec = [StepRecord(3, scheduled=[("A", 1)],
                       reasons=[reason("RUN.DECODE", "A"), reason("ADMIT.FULL_SEQUENCE", "X", "needs 4 blocks, 3 free")])]
    other = [StepRecord(3, scheduled=[("A", 1), ("Y", 9)], new=["Y"])]
    div = first_divergence(spec, other, "decisions")
    assert div.request == "Y" and as_configured(div.rule, {"policy": "sprpt"}) == "QUEUE.SPRPT", div.describe()
    assert as_configured(div.rule, {"policy": "spf", "aging_steps": 4}) == "QUEUE.AGING"
    same = [StepRecord(3, scheduled=[("A", 1), ("X", 9)], new=["X"])]
    assert first_divergence(spec, same, "decisions").rule == "ADMIT.FULL_SEQUENCE"


def test_slo_refusals_only_one_side_made_name_slo_admission_control():
    """The engine refused a request the spec found feasible (slo_feasible_off_by_one): the feasibility
    test; the engine admitted a request the spec refused in that very step: the refusal."""
    spec = [StepRecord(4, scheduled=[("A", 1)], reasons=[reason("ARRIVE.QUEUED", "B"), reason("RUN.DECODE", "A")])]
    eng = [StepRecord(4, scheduled=[("A", 1)], rejected=[("B", "slo_infeasible")])]
    assert first_divergence(spec, eng, "decisions").rule == "SLO.FEASIBLE"
    refused = [StepRecord(4, scheduled=[("A", 1)], rejected=[("B", "slo_infeasible")],
                          reasons=[reason("RUN.DECODE", "A"), reason("SLO.REFUSE", "B", "cannot finish prefill")])]
    runs = [StepRecord(4, scheduled=[("A", 1), ("B", 15)], new=["B"])]
    assert first_divergence(refused, runs, "decisions").rule == "SLO.REFUSE"


def test_a_registration_blame_names_the_configured_registration_rule():
    """The state field's default rule, CACHE.REGISTER_AT_ALLOCATION, as the trace's configuration
    registers blocks (finish_not_registered, cache_at_output_always)."""
    rule = "CACHE.REGISTER_AT_ALLOCATION"
    assert as_configured(rule, {}) == rule
    assert as_configured(rule, {"cache_register": "computed"}) == "CACHE.REGISTER_WHEN_COMPUTED"
    assert as_configured(rule, {"profile": "sglang"}) == "CACHE.REGISTER_PREFILL_AND_FINISH"
    assert as_configured(rule, {"num_speculative_tokens": 2}) == "SPEC.CACHE_AT_OUTPUT"
    assert as_configured(rule, {"num_speculative_tokens": 2, "async_scheduling": True}) == rule


def test_steering_draws_the_knob_values_that_bind_where_no_profile_does():
    """vLLM 0.33's self-preemption rule under the priority policy (its profile is FCFS), and the
    per-step limit under prefill-first batching with a small max_num_seqs (nano-vllm's 512 never binds),
    are in the rotation every campaign goes round."""
    from fuzz.campaign import STEERING, _all_targets, rule_target

    targets = _all_targets(None)
    assert any(t.get("policy") == "priority" and t.get("priority_self_preempt") == "continue" for t in targets)
    step = rule_target("BATCH.MAX_NUM_SEQS_PER_STEP")
    assert step["max_num_seqs_scope"] == "step" and step["batching"] == "prefill-first" and step["max_num_seqs"] <= 2
    assert step in [dict(t) for t in targets]
    # queue mechanisms (a length order re-sorting victims, SLO admission control) need a queue: the most requests
    assert all(STEERING[prefix]["n_requests"] == 12 for prefix in ("QUEUE.SPF", "QUEUE.SPRPT", "SLO.", "SLO.REFUSE"))


def test_half_the_traces_free_to_be_priority_take_the_033_self_preemption_where_the_engine_has_it():
    """A campaign draws priority_self_preempt=continue for about half the traces whose policy is free
    or priority (the default family's priority traces then meet it), by a hash of the trace's key; never
    where the envelope lacks it (vLLM 0.32), the policy is another, or the knob is fixed."""
    from fuzz.campaign import _self_preempt_draw
    from fuzz.capabilities import for_engine

    gpu = for_engine("gpu")
    drawn = [_self_preempt_draw(gpu, f"0:{k}", {}, set()).get("priority_self_preempt") for k in range(400)]
    assert 120 < drawn.count("continue") < 280 and set(drawn) == {"continue", None}
    assert drawn == [_self_preempt_draw(gpu, f"0:{k}", {}, set()).get("priority_self_preempt") for k in range(400)]
    assert not any(_self_preempt_draw(gpu, f"0:{k}", {"policy": "fcfs"}, set()).get("priority_self_preempt")
                   for k in range(100))
    assert not any(_self_preempt_draw(gpu, f"0:{k}", {}, {"priority_self_preempt"}) for k in range(100))
    vllm = for_engine("vllm")
    assert not any(_self_preempt_draw(vllm, f"0:{k}", {}, set()) for k in range(100))


def test_another_request_at_the_same_queue_place_names_the_order_even_when_one_side_admits_more():
    """The spec resumed victim R second, the engine took C there and nothing after it (R's smaller
    key was lost: sprpt_ignores_outputs): the queue's order, a preempted request's."""
    spec = [StepRecord(9, scheduled=[("A", 4), ("R", 6), ("C", 3)], new=["A", "C"], resumed=["R"],
                       reasons=[reason("ADMIT.NEW", "A"), reason("ADMIT.RESUMED", "R"), reason("ADMIT.NEW", "C")])]
    eng = [StepRecord(9, scheduled=[("A", 4), ("C", 9)], new=["A", "C"])]
    div = first_divergence(spec, eng, "decisions")
    assert div.request == "R" and as_configured(div.rule, {"policy": "sprpt"}) == "QUEUE.SPRPT", div.describe()
    longer = [StepRecord(9, scheduled=[("A", 4), ("R", 6), ("C", 3), ("D", 2)], new=["A", "C", "D"], resumed=["R"])]
    assert first_divergence(spec, longer, "decisions").rule != "QUEUE.ORDER", "the same order, one more admitted"


def test_a_request_the_spec_deferred_in_that_step_taken_by_the_engine_names_the_deferral():
    """SLO admission control (defer) moved R0 behind R1 this step; the engine took R0 (its feasibility
    test kept R0 in place: slo_feasible_off_by_one)."""
    spec = [StepRecord(0, scheduled=[("R1", 1)], new=["R1"],
                       reasons=[reason("SLO.DEFER", "R0", "deadline out of reach"), reason("ADMIT.NEW", "R1")])]
    eng = [StepRecord(0, scheduled=[("R0", 11)], new=["R0"])]
    assert first_divergence(spec, eng, "decisions").rule == "SLO.DEFER"


def test_a_refusal_where_the_spec_deferred_names_the_deferral():
    """slo_admission=refuse defers a request admitted once (preempted before its first token); the
    engine refused it (slo_refuses_preempted): the grouping names SLO.DEFER, not '-'."""
    from fuzz.corpus import group_signature
    from fuzz.replay import ReplayResult
    from spec.formats import Trace

    spec = [StepRecord(6, scheduled=[("A", 1)], reasons=[reason("RUN.DECODE", "A"), reason("SLO.DEFER", "B")])]
    eng = [StepRecord(6, scheduled=[("A", 1)], rejected=[("B", "slo_infeasible")])]
    div = first_divergence(spec, eng, "decisions")
    assert div.rule == "SLO.DEFER", div.describe()
    result = ReplayResult(Trace(config={"policy": "edf", "slo_admission": "refuse"}, requests=[]), "gpu", "decisions",
                          eng, spec, div)
    assert group_signature(result)[2] == "SLO.DEFER"


def test_a_request_the_spec_walk_reached_past_a_self_preemption_names_the_preemption_rule():
    """The spec went on past R5's self-preemption to decode R8 and resumed R5 with what was left; the
    engine stopped at R5 and resumed it with the whole budget (self_preempt_continue_ignored)."""
    spec = [StepRecord(24, scheduled=[("R8", 5), ("R5", 11)], preempted=["R5"], resumed=["R5"],
                       reasons=[reason("PREEMPT.VICTIM_LOWEST_PRIORITY", "R5"),
                                reason("RUN.PREEMPT_FOR_BLOCKS", "R5", "preempted itself; continuing"),
                                reason("RUN.DECODE", "R8"), reason("ADMIT.RESUMED", "R5")])]
    eng = [StepRecord(24, scheduled=[("R5", 16)], preempted=["R5"], resumed=["R5"])]
    div = first_divergence(spec, eng, "decisions")
    assert (div.request, div.rule) == ("R8", "RUN.PREEMPT_FOR_BLOCKS"), div.describe()
