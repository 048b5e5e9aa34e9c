"""Blind spots of the campaign found by planting new bugs in gpu_engine (issue 18 items 2-3).

* Steering keeps reaching every mechanism after its rules are covered: the default family
  never draws VTC, SPF, aging, swap or static batching itself, so without it a bug there is met
  by the handful of traces that covered its rules and no more.
* A queue-order bug (the other request taken from the waiting queue) names the policy's order
  rule, not the admitted request's own ``ADMIT.*`` reason; a swap-in the spec did not make names
  ``SWAP.IN``; a rejection the spec did not make names the engine's ``REJECT.*`` rule.
"""
from __future__ import annotations

import copy

from fuzz.campaign import _all_targets, steer
from fuzz.diff import as_configured, first_divergence
from fuzz.generate import random_trace
from spec.formats import StepRecord
from spec.rules import all_rules
from spec.scheduler import run


def test_every_steering_target_keeps_getting_traces_once_every_rule_is_covered():
    every = _all_targets(None)
    assert {"policy": "vtc"} in every and {"batching": "static"} in every and {"preemption_mode": "swap"} in every
    picks = [steer([], k) for k in range(8 * len(every))]
    for target in every:
        assert picks.count(dict(target)) >= 2, target
    assert sum(1 for p in picks if not p) >= len(picks) // 3  # the default family, unsteered, keeps its share


def test_uncovered_rules_are_still_targeted_while_the_rest_rotate():
    uncovered = ["QUEUE.SPF", "VTC.PICK"]
    picks = [steer(uncovered, k) for k in range(1, 64, 4)]  # slot 1
    assert picks[0].get("policy") == "spf" and any(p.get("policy") == "vtc" for p in picks)
    assert any(p.get("policy") not in ("spf", "vtc") for p in picks)  # the other half rotates


def test_aging_is_a_steering_target():
    assert {"policy": "priority", "aging_steps": 4} in _all_targets(None)
    cfg = random_trace(3, policy="priority", aging_steps=4).config
    assert cfg["aging_steps"] == 4


def _admitting_step(records: list[StepRecord], count: int = 2) -> int:
    return next(i for i, r in enumerate(records) if len(r.new) >= count and not r.preempted)


def _queue_swapped(records: list[StepRecord]) -> list[StepRecord]:
    """A copy where one step admits its first two new requests the other way round."""
    engine = copy.deepcopy(records)
    rec = engine[_admitting_step(engine)]
    a, b = rec.new[0], rec.new[1]
    rec.new[0], rec.new[1] = b, a
    order = {a: b, b: a}
    rec.scheduled = [(order.get(rid, rid), n) for rid, n in rec.scheduled]
    return engine


def _spec_run(predicate, **options) -> tuple[list[StepRecord], dict]:
    for seed in range(200):
        trace = random_trace(seed, **options)
        recs = run(trace)
        if predicate(recs):
            return recs, trace.config
    raise AssertionError(f"no suitable trace in 200 seeds for {options}")


def test_another_request_taken_from_the_queue_names_the_policys_order_rule():
    two = lambda recs: any(len(r.new) >= 2 and not r.preempted for r in recs)  # noqa: E731
    for options, rule in (({"policy": "priority"}, "QUEUE.PRIORITY"), ({"policy": "fcfs"}, "QUEUE.FCFS"),
                          ({"policy": "spf"}, "QUEUE.SPF"), ({"policy": "priority", "aging_steps": 4}, "QUEUE.AGING")):
        recs, config = _spec_run(two, **options)
        d = first_divergence(recs, _queue_swapped(recs), "exact", engine="gpu")
        assert d is not None and d.field in ("scheduled", "new"), options
        assert as_configured(d.rule, config) == rule, (options, d.rule)


def test_more_admissions_are_not_a_queue_order_bug():
    recs, config = _spec_run(lambda rs: any(len(r.new) >= 2 and not r.preempted for r in rs), policy="priority")
    engine = copy.deepcopy(recs)
    rec = engine[_admitting_step(engine)]
    rec.new.append("ghost")  # one admission more, not another order
    d = first_divergence(recs, engine, "exact", engine="gpu")
    assert d is not None and as_configured(d.rule, config) not in ("QUEUE.PRIORITY", "QUEUE.ORDER")


def test_a_rejection_the_spec_did_not_make_names_the_engines_rejection_rule():
    recs, config = _spec_run(lambda rs: any(r.new for r in rs), policy="fcfs")
    engine = copy.deepcopy(recs)
    rec = next(r for r in engine if r.new)
    victim = rec.new[0]
    rec.rejected = list(rec.rejected) + [(victim, "never_fits")]
    d = first_divergence(recs, engine, "exact", engine="gpu")
    assert d is not None
    from fuzz.diff import field_rule

    spec_rec = next(r for r in recs if r.step == rec.step)
    assert field_rule("rejected", spec_rec, rec, victim) == "REJECT.NEVER_FITS"
    assert as_configured("REJECT.NEVER_FITS", {**config, "length_limits": "clip"}) == "REJECT.INPUT_LIMIT"
    assert as_configured("REJECT.NEVER_FITS", config) == "REJECT.NEVER_FITS"


def test_queue_order_placeholders_are_no_spec_rules():
    """The placeholders are resolved by as_configured: a report never names them."""
    ids = {r.id for r in all_rules().values()}
    assert "QUEUE.ORDER" not in ids and "QUEUE.ORDER_RESUMED" not in ids
    assert as_configured("QUEUE.ORDER_RESUMED", {"policy": "fcfs"}) == "QUEUE.VICTIM_TO_FRONT"
    assert as_configured("QUEUE.ORDER_RESUMED", {"policy": "fcfs", "admission": "estimate"}) == "RETRACT.TO_TAIL"
    assert as_configured("QUEUE.ORDER", {"policy": "vtc"}) == "VTC.PICK"


def _reason(rule, request=None):
    return {"rule": rule, "text": "-", **({"request": request} if request else {})}


def test_a_request_the_engine_resumes_in_the_step_the_spec_aborted_it_names_the_abort():
    mem = dict(num_free_blocks=3, blocks={}, num_evicted=0)
    before = StepRecord(1, scheduled=[("A", 4)], **mem)
    spec = StepRecord(2, scheduled=[("A", 4)], aborted=["B"], token_cap=0,
                      reasons=[_reason("ABORT.FREE", "B"), _reason("RUN.DECODE", "A")], **mem)
    # (B counted as eligible moves the long-prefill cap too: the abort, not the cap, is the cause)
    engine = StepRecord(2, scheduled=[("A", 4), ("B", 3)], resumed=["B"], aborted=["B"], token_cap=4, **mem)
    d = first_divergence([spec], [engine], "memory", history=[before])
    assert d is not None and d.rule == "ABORT.FREE" and d.request == "B"


def test_a_request_the_engine_still_holds_after_the_spec_ended_it_names_the_rule_that_ended_it():
    """Its count moves the long-prefill cap (eligible requests): the abort, not the cap, is the cause."""
    mem = dict(num_free_blocks=3, blocks={}, num_evicted=0)
    gone = StepRecord(1, aborted=["B"], reasons=[_reason("ABORT.FREE", "B")], **mem)
    spec = StepRecord(2, scheduled=[("A", 8)], token_cap=0, computed={"A": 8}, reasons=[_reason("RUN.PREFILL_CHUNK", "A")], **mem)
    engine = StepRecord(2, scheduled=[("A", 4)], token_cap=4, computed={"A": 4, "B": 0}, **mem)
    from fuzz.diff import ghost

    assert ghost(spec, engine, [gone]) == ("computed", "B", "ABORT.FREE")
    assert ghost(spec, StepRecord(2, scheduled=[("A", 4)], computed={"A": 4}, **mem), [gone]) is None
