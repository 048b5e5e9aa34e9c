"""Service-level targets and output budgets (issue 19): the rules of the SLO-aware policies.

A request may carry a TTFT target (its first token within ``ttft_slo`` of arriving), a
TPOT target (at most ``tpot_slo`` between two of its output tokens) and a predicted output
length (``predicted_output_len``; ``max_tokens`` stays the hard cap).  The scheduler counts
**steps**: a step trace's targets (``arrival_step`` only) are steps already, a timed trace's
(``arrival_time``, even with ``arrival_step`` as imported traces have) are seconds, turned into
steps by the knob ``slo_step_s`` (rule SLO.TARGET_STEPS; ``batchspec sweep`` and ``simulate``
set it to the cost model's time for a step of the whole token budget).  The simulator judges attainment in
seconds (:mod:`spec.metrics`).

Step arithmetic, with ``a`` the step a request arrived in (the engine's clock then):

* its first token meets the target iff it is sampled in a step ``<= a + ttft - 1``, its
  **TTFT deadline** (a first token sampled in step ``a`` took one step);
* two consecutive tokens sampled in steps ``s1 < s2`` meet the TPOT target iff
  ``s2 - s1 <= tpot``; the next token is **due** in step ``last + tpot``.

The policies are phases and rule choices of :func:`spec.config.step_plan`: ``policy=edf``
(QUEUE.EDF, EDF.AT_RISK_FIRST), ``policy=sprpt`` (QUEUE.SPRPT with QUEUE.AGING),
``preemption_victim=slo-slack`` (PREEMPT.VICTIM_SLO_SLACK) and ``slo_admission``
(SLO.FEASIBLE, SLO.REFUSE, SLO.DEFER).  Standard library only.
"""
from __future__ import annotations

import math

from spec.rules import declare, rule

#: A request without a target: due never, infinitely much slack.
NEVER = math.inf

#: The rejection reason of a request refused by SLO admission control.
SLO_INFEASIBLE = "slo_infeasible"


@rule("SLO.TARGET_STEPS", knobs=("slo_step_s",))
def target_steps(value: float | None, timed: bool, slo_step_s: float) -> int | None:
    """A target in the scheduler's unit, steps: a step trace's target as given; a timed
    trace's seconds as ``max(1, floor(seconds / slo_step_s))`` steps — rounding down, so a
    step count the scheduler meets is never longer than the target at the modelled step
    time.  None: no target."""
    if value is None:
        return None
    if not timed:
        return int(value)
    return max(1, math.floor(value / slo_step_s + 1e-9))


def ttft_deadline(arrival_step: int, ttft: int | None) -> int | None:
    """The last step in which the first token may be sampled: ``arrival + ttft - 1``."""
    return None if ttft is None else arrival_step + ttft - 1


@rule("QUEUE.EDF", knobs=("policy", "slo_admission"))
def edf_key(req) -> tuple:
    """Under policy="edf" the next candidate is the waiting request whose next token is due
    first: its TTFT deadline (arrival + ttft_slo - 1, in steps), or, for a preempted request
    whose first token is already out, its next token's (last token step + tpot_slo); ties go
    to the earlier arrival, then the id.  A request without the target is due never and comes
    after those with one; a request deferred by SLO admission control (SLO.DEFER) comes after
    every one that was not.

    Earliest-deadline-first is the classic optimal order for meeting deadlines on one
    resource (Liu & Layland 1973); DistServe, SLOs-Serve and Andes serve LLM requests by
    their TTFT and TPOT deadlines.
    """
    return (req.deferred, due_step(req), req.arrival_seq, req.request_id)


@rule("QUEUE.SPRPT", knobs=("policy", "aging_steps"))
def predicted_remaining(req) -> int:
    """Under policy="sprpt" the base key of a waiting request (rule QUEUE.AGING ages it) is
    its predicted remaining output: ``max(predicted - outputs, 0)``, where ``predicted`` is
    the trace's ``predicted_output_len``, else ``max_tokens``, capped at ``max_tokens``.

    Shortest-(predicted)-remaining-processing-time first minimises mean latency when the
    prediction ranks requests well (Fu et al., learning-to-rank scheduling, NeurIPS'24;
    vLLM's SJF scorer proposals); without aging a stream of short requests starves a long one.
    """
    predicted = req.max_tokens if req.predicted_output is None else min(req.predicted_output, req.max_tokens)
    return max(predicted - len(req.output_token_ids), 0)


def due_step(req) -> float:
    """When the request's next token is due: its TTFT deadline before the first token, then
    ``last token step + tpot``; never without the target."""
    if req.first_token_step is None:
        return NEVER if req.ttft_deadline is None else req.ttft_deadline
    return NEVER if req.tpot_steps is None else req.last_token_step + req.tpot_steps


@rule("EDF.AT_RISK_FIRST", knobs=("policy",), applies=bool)
def at_risk(req, now: int) -> bool:
    """Under policy="edf" a running request that decodes (its prompt computed, a token out)
    and whose next token is due in this step — ``now >= last token step + tpot_slo``: its
    TPOT slack is spent — is served before every other running request and every prefill
    chunk (phase serve_at_risk), in running-list order.  Prefill chunks and admissions take
    only the budget the at-risk decodes leave (Andes' token-deadline slack; DistServe's
    observation that prefill interference is what breaks TPOT)."""
    return (req.first_token_step is not None and req.tpot_steps is not None
            and req.num_computed_tokens == req.num_tokens - 1 and now >= req.last_token_step + req.tpot_steps)


def missed(req, now: int) -> bool:
    """The request has missed a target already: a token sampled late, or its next token
    due before this step."""
    return req.slo_missed or due_step(req) < now


@rule("PREEMPT.VICTIM_SLO_SLACK", knobs=("preemption_victim",))
def slo_slack_victim(running: list, now: int):
    """Under preemption_victim="slo-slack" the victim is a running request that has
    already missed a target (a token sampled late, or its next token overdue), else the
    one with the most slack — the latest next-token due step (a request without targets
    has infinite slack); ties go to the newest in the running list.

    Preempting the request that can best afford the delay (or that is lost already) keeps
    the others' targets; the newest (vLLM) may be the one about to miss (SLOs-Serve, Andes)."""
    return max(reversed(running), key=lambda r: (missed(r, now), due_step(r)))


@rule("SLO.FEASIBLE", knobs=("slo_admission", "max_num_batched_tokens"), applies=lambda ok: not ok)
def feasible(now: int, tokens: int, budget: int, deadline: int | None) -> bool:
    """A waiting request can still meet its TTFT deadline iff, given the whole token budget
    ``B`` (max_num_batched_tokens) in every step from this one on, its first token would be
    sampled by the deadline: ``now + ceil(tokens / B) - 1 <= deadline``, ``tokens`` being all
    it must compute (prompt, plus outputs after a preemption; prefix hits are not counted,
    the cache may lose them).  Optimistic on purpose: a request refused by it could not
    have met its target under any schedule.  No deadline: always feasible."""
    if deadline is None:
        return True
    return now + -(-tokens // budget) - 1 <= deadline


SLO_REFUSE = declare(
    "SLO.REFUSE",
    """Under slo_admission="refuse", before admission every waiting request whose first
    token is not out and that is not feasible (SLO.FEASIBLE) is rejected
    (``slo_infeasible``): it would only take capacity from requests that can still meet
    their targets.  Serving a lost request is what makes goodput collapse under overload
    (SLOs-Serve, Andes).  A request that was admitted once and preempted before its first
    token is deferred instead (SLO.DEFER): its rejection would come after it was served.""",
    __name__,
    knobs=("slo_admission",),
)
SLO_DEFER = declare(
    "SLO.DEFER",
    """Under slo_admission="defer", such a request is not rejected but deferred: it stays
    waiting, behind every request that was not deferred (QUEUE.EDF), and is served best
    effort when nothing that can still meet its target waits.""",
    __name__,
    knobs=("slo_admission",),
)


def note_token(req, step: int) -> None:
    """Record that ``req`` sampled a token in ``step``: its first/last token steps, and
    whether this token missed its target (first token after the TTFT deadline, or a gap
    over tpot_slo)."""
    if req.first_token_step is None:
        req.first_token_step = step
        if req.ttft_deadline is not None and step > req.ttft_deadline:
            req.slo_missed = True
    elif req.tpot_steps is not None and step - req.last_token_step > req.tpot_steps:
        req.slo_missed = True
    req.last_token_step = step
