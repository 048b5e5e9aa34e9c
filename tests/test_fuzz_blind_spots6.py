"""Blind-spot hunt, round 6 (issue 18): report names that a fifth blind hunt and the fourth's
leftovers needed.

Each test builds the two logs a planted gpu_engine bug produced (shrunk by hand to the step that
differs) and checks the rule the first divergence and the finding's group name; each also checks
the case the rule must leave alone."""
from __future__ import annotations

from fuzz.corpus import group_signature
from fuzz.diff import first_divergence
from fuzz.replay import ReplayResult
from spec.formats import StepRecord, Trace


def reason(rule: str, request: str, text: str = "") -> dict:
    return {"rule": rule, "request": request, "text": text}


def grouped(spec: list[StepRecord], eng: list[StepRecord], level: str = "decisions", config: dict | None = None):
    div = first_divergence(spec, eng, level)
    assert div is not None
    return div, group_signature(ReplayResult(Trace(config=config or {}, requests=[]), "gpu", level, eng, spec, div))


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
