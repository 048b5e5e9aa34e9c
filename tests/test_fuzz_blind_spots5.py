"""Blind-spot hunt, round 5 (issue 18): report names a fourth blind hunt's planted bugs needed.

Each test builds the two logs a planted gpu_engine bug produced (shrunk by hand to the step that
differs) and checks the rule the first divergence and the finding's group name; each also checks
the case the rule must leave alone."""
from __future__ import annotations

from fuzz.diff import first_divergence
from report_helpers import grouped, reason
from spec.formats import StepRecord


def test_a_stop_token_against_a_length_stop_names_the_token_rule_in_the_group_too():
    """stop_ids_kept_on_reuse: a reused slot kept the last request's stop ids, so the engine stopped B
    on a "stop token" where the spec stopped it at max_model_len.  The stop rules run EOS, stop
    tokens, then length: the side that stopped on the token fired it where the other did not."""
    spec = [StepRecord(1, scheduled=[("B", 1)], new=["B"], finished=[("B", "max_model_len")],
                       reasons=[reason("ADMIT.NEW", "B"), reason("STOP.LENGTH", "B", "finished: max_model_len")])]
    eng = [StepRecord(1, scheduled=[("B", 1)], new=["B"], finished=[("B", "stop_token")])]
    div, sig = grouped(spec, eng)
    assert div.rule == "STOP.STOP_TOKEN" and sig == ("decision", "finished", "STOP.STOP_TOKEN")
    # one side alone finishing it: that side's stop rule, as before
    _, alone = grouped(spec, [StepRecord(1, scheduled=[("B", 1)], new=["B"])])
    assert alone == ("decision", "finished", "STOP.LENGTH")


def test_a_request_deferred_before_but_refused_by_a_gate_now_names_the_gate():
    """full_sequence_ignores_evictable_hits: r11, deferred by SLO admission control in an earlier step,
    reached the head; the spec's whole-sequence test refused it and admitted nobody, the engine's
    (short by the evictable hit blocks) let it in.  The gate decided, not the deferral."""
    earlier = [StepRecord(20, scheduled=[("r10", 1)], reasons=[reason("RUN.DECODE", "r10"), reason("SLO.DEFER", "r11")])]
    spec = earlier + [StepRecord(22, scheduled=[("r10", 1)],
                                 reasons=[reason("RUN.DECODE", "r10"),
                                          reason("ADMIT.FULL_SEQUENCE", "r11", "needs 20 blocks for its whole sequence, 13 free")])]
    eng = earlier + [StepRecord(22, scheduled=[("r10", 1), ("r11", 13)], new=["r11"])]
    div, sig = grouped(spec, eng, config={"policy": "edf", "slo_admission": "defer"})
    assert div.rule == "ADMIT.FULL_SEQUENCE" and sig[2] == "ADMIT.FULL_SEQUENCE", (div.describe(), sig)
    # the spec admitted another request ahead of it: the refusal may be the deferral's order (SLO.DEFER)
    spec2 = earlier + [StepRecord(22, scheduled=[("r10", 1), ("r12", 2)], new=["r12"],
                                  reasons=[reason("RUN.DECODE", "r10"), reason("ADMIT.NEW", "r12"),
                                           reason("BUDGET.EXHAUSTED", "r11", "head not admitted: token budget spent")])]
    eng2 = earlier + [StepRecord(22, scheduled=[("r10", 1), ("r11", 2)], new=["r11"])]
    div2, sig2 = grouped(spec2, eng2, config={"policy": "edf", "slo_admission": "defer"})
    assert div2.rule == "SLO.DEFER" and sig2[2] == "SLO.DEFER", (div2.describe(), sig2)


def test_a_lift_that_differs_in_the_step_it_decides_names_the_lift():
    """vtc_lift_lowers: C's tenant arrived to an empty queue and the engine's lift lowered its counter,
    so the engine picked C where the spec picked B in the same step.  The lift is fixed before the
    step decides anything: it is the cause, not VTC.PICK."""
    spec = [StepRecord(1, scheduled=[("B", 1)], new=["B"], vtc_lifts={"t2": 2.0},
                       reasons=[reason("ADMIT.NEW", "B"), reason("BUDGET.EXHAUSTED", "C")])]
    eng = [StepRecord(1, scheduled=[("C", 1)], new=["C"], vtc_lifts={"t2": 0.0})]
    div, sig = grouped(spec, eng, config={"policy": "vtc"})
    assert (div.field, div.rule) == ("vtc_lifts", "VTC.LIFT") and sig == ("decision", "vtc_lifts", "VTC.LIFT")
    # equal lifts: the pick itself differs
    same = [StepRecord(1, scheduled=[("C", 1)], new=["C"], vtc_lifts={"t2": 2.0})]
    assert first_divergence(spec, same, "decisions").field != "vtc_lifts"


def test_a_cap_that_differs_after_an_abort_names_the_abort_not_the_cap():
    """The aborts come before the schedule and move the queue lengths the long-prefill cap is computed
    from: when the aborts differ, the cap is not the cause."""
    spec = [StepRecord(3, scheduled=[("A", 8)], aborted=["B"], token_cap=8, reasons=[reason("ABORT.FREE", "B")])]
    eng = [StepRecord(3, scheduled=[("A", 4)], token_cap=4)]
    assert first_divergence(spec, eng, "decisions").field != "token_cap"
    eng_same = [StepRecord(3, scheduled=[("A", 4)], aborted=["B"], token_cap=4)]
    div = first_divergence(spec, eng_same, "decisions")
    assert (div.field, div.rule) == ("token_cap", "BUDGET.LONG_PREFILL")


def test_a_whole_life_reservation_is_drawn_with_prefix_caching_where_no_profile_combines_them():
    """The default family's traces that reserve KV for a request's whole life take prefix caching (and
    shared prefixes) in about half the cases, and about one in twelve of those free to choose take both;
    by a hash of the trace's key; never a rotated profile's, a fixed knob, or another reservation, nor
    where the engine's envelope has no whole-life reservation (vLLM)."""
    from fuzz.campaign import _reserved_cache_draw
    from fuzz.capabilities import for_engine

    gpu = for_engine("gpu")
    full = [_reserved_cache_draw(gpu, f"0:{k}", {"kv_reservation": "full"}, set()) for k in range(400)]
    cached = [o for o in full if o.get("enable_prefix_caching")]
    assert 120 < len(cached) < 280 and all(o["prefix_groups"] for o in cached)
    free = [_reserved_cache_draw(gpu, f"0:{k}", {}, set()) for k in range(1200)]
    both = [o for o in free if o]
    assert 50 < len(both) < 150
    assert all(o == {"kv_reservation": "full", "enable_prefix_caching": True, "prefix_groups": True} for o in both)
    assert free == [_reserved_cache_draw(gpu, f"0:{k}", {}, set()) for k in range(1200)]
    for options, fixed in (({"profile": "tgi"}, set()), ({"kv_reservation": "step"}, set()),
                           ({"kv_reservation": "full"}, {"enable_prefix_caching"}),
                           ({"kv_reservation": "full", "enable_prefix_caching": False}, set())):
        assert all(_reserved_cache_draw(gpu, f"0:{k}", options, fixed) == options for k in range(200)), options
    vllm = for_engine("vllm")
    assert not any(_reserved_cache_draw(vllm, f"0:{k}", {}, set()) for k in range(400))
