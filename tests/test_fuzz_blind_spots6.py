"""Blind-spot hunt, round 6 (issue 18): report names that a fifth blind hunt and the fourth's
leftovers needed.

Each test builds the two logs a planted gpu_engine bug produced (shrunk by hand to the step that
differs) and checks the rule the first divergence and the finding's group name; each also checks
the case the rule must leave alone."""
from __future__ import annotations

from report_helpers import grouped, reason
from spec.formats import StepRecord


def test_a_stop_applied_to_a_request_whose_abort_is_pending_names_the_abort_rule():
    """pending_abort_takes_stop: r7's client abort arrived while it ran (ABORT.AFTER_NEXT_SAMPLE: freed
    with its next sample, as an abort); the engine applied the stop rules to that token and finished
    it by length.  No stop rule applies then, so the abort rule is at fault, not STOP.LENGTH."""
    spec = [StepRecord(31, scheduled=[("r7", 1)], aborted=["r7"],
                       reasons=[reason("RUN.DECODE", "r7"),
                                reason("ABORT.AFTER_NEXT_SAMPLE", "r7", "aborted by the client; freed after it samples once more")])]
    eng = [StepRecord(31, scheduled=[("r7", 1)], aborted=["r7"], finished=[("r7", "max_tokens")])]
    div, sig = grouped(spec, eng)
    assert div.field == "finished" and div.rule == "ABORT.AFTER_NEXT_SAMPLE", div.describe()
    assert sig == ("decision", "finished", "ABORT.AFTER_NEXT_SAMPLE")
    # no abort anywhere: the stop rule, as before
    plain = [StepRecord(31, scheduled=[("r7", 1)], reasons=[reason("RUN.DECODE", "r7")])]
    _, alone = grouped(plain, [StepRecord(31, scheduled=[("r7", 1)], finished=[("r7", "max_tokens")])])
    assert alone == ("decision", "finished", "STOP.LENGTH")


def test_a_length_stop_that_differs_in_a_step_that_accepted_drafts_names_the_drafts_stop_rule():
    """hunt 5's b20: the engine appended A's accepted drafts after its sampled token had already
    stopped it (max_tokens), so A ran on to max_model_len.  Outputs with drafts are appended one by
    one under the stop rules and the first stop drops the rest: SPEC.STOP_IN_DRAFTS, not STOP.LENGTH."""
    spec = [StepRecord(1, scheduled=[("A", 2)], finished=[("A", "max_tokens")],
                       reasons=[reason("SPEC.ACCEPT", "A", "1 of 1 drafts accepted"), reason("RUN.DECODE", "A"),
                                reason("STOP.LENGTH", "A", "finished: max_tokens after 2 tokens")])]
    eng = [StepRecord(1, scheduled=[("A", 2)], finished=[("A", "max_model_len")])]
    div, sig = grouped(spec, eng)
    assert div.rule == "SPEC.STOP_IN_DRAFTS" and sig == ("decision", "finished", "SPEC.STOP_IN_DRAFTS"), div.describe()
    # no draft accepted in the step: the length rule, as before
    none = [StepRecord(1, scheduled=[("A", 2)], finished=[("A", "max_tokens")],
                       reasons=[reason("SPEC.ACCEPT", "A", "0 of 1 drafts accepted"), reason("RUN.DECODE", "A")])]
    assert grouped(none, eng)[1] == ("decision", "finished", "STOP.LENGTH")


def test_a_request_the_engine_schedules_twice_after_a_self_preemption_names_the_walk_rule():
    """hunt 5's b17: r9 preempted itself and the running walk went on (priority_self_preempt=continue);
    the engine's index shift counted the requester among the victims, so it walked r11 twice.  The
    walk's going on after a self-preemption is RUN.PREEMPT_FOR_BLOCKS, not r11's token budget."""
    spec = [StepRecord(22, scheduled=[("r11", 26)], preempted=["r9"],
                       reasons=[reason("RUN.PREFILL_CHUNK", "r11", "26 tokens (7 left)"),
                                reason("PREEMPT.VICTIM_LOWEST_PRIORITY", "r9"),
                                reason("RUN.PREEMPT_FOR_BLOCKS", "r9", "preempted itself; continuing with the next running request")])]
    eng = [StepRecord(22, scheduled=[("r11", 26), ("r11", 7)], preempted=["r9"])]
    div, sig = grouped(spec, eng)
    assert div.rule == "RUN.PREEMPT_FOR_BLOCKS" and sig == ("decision", "scheduled", "RUN.PREEMPT_FOR_BLOCKS"), div.describe()
    # no self-preemption: a request scheduled twice is not put on the walk rule
    plain = [StepRecord(22, scheduled=[("r11", 26)], reasons=[reason("RUN.PREFILL_CHUNK", "r11", "26 tokens (7 left)")])]
    assert grouped(plain, [StepRecord(22, scheduled=[("r11", 26), ("r11", 7)])])[1][2] != "RUN.PREEMPT_FOR_BLOCKS"
