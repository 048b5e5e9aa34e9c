"""Async scheduling (knob ``async_scheduling``; profile ``vllm-v1-async``): the rules ASYNC.*.

vLLM overlaps scheduling with execution: its engine core keeps a batch queue of two
(``max_concurrent_batches = 2``) and, in each call of ``step_with_batch_queue``,
schedules step N+1 *before* it waits for step N's sampled tokens, then applies
them (``update_from_output``).  The scheduler (``AsyncScheduler``) therefore
decides with some tokens unknown: each is an **output placeholder**, counted in
the request's ``num_computed_tokens`` but not in its token list.

The rules here are the differences from synchronous scheduling; everything else
(budgets, admission, preemption victims, the block pool) is unchanged.  One
``SpecEngine.step()`` under this knob is: schedule step N+1 (placeholders count),
then apply the outputs of step N, the batch in flight (rule
ASYNC.OUTPUTS_NEXT_STEP); its record carries step N+1's batch and step N's
``sampled`` and ``finished``, and says so in ``outputs_step``.

A run ends, as with synchronous scheduling, when no request is unfinished: a batch
still in flight then holds only outputs that would be dropped (vLLM's engine core
applies it in one more call that decides nothing; that call has no record here).

Checked against vLLM 0.32's ``AsyncScheduler`` driven as its engine core drives
it (fuzz/vllm_adapter.py, ``--profile vllm-v1-async``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from spec.rules import declare, fired, reason, rule

if TYPE_CHECKING:  # pragma: no cover
    from spec.scheduler import Request, SpecEngine


@dataclass(frozen=True)
class InFlight:
    """One sampled token of the batch in flight: whose, which output index, and the
    request's preemption count when it was scheduled (a later preemption makes it stale)."""

    request_id: str
    index: int
    preemptions: int
    drafts: int = 0  # speculative decoding: drafts scheduled with it (SPEC.DRAFT_SCHEDULE)
    accepted: int = 0  # of which the model accepts (SPEC.ACCEPT): it delivers 1 + accepted tokens


SAME_STEP = declare(
    "STEP.OUTPUTS_SAME_STEP",
    """With synchronous scheduling a step's sampled tokens are applied at the end of
    that same step, before the next step is scheduled: every decision sees every
    token sampled so far (vLLM's EngineCore.step: schedule, execute, update).""",
    __name__,
    knobs=("async_scheduling",),
    fires=False,
)

PLACEHOLDERS_COUNT = declare(
    "ASYNC.PLACEHOLDERS_COUNT",
    """A placeholder counts as a computed token: a running request is scheduled the
    tokens it lacks *including* its placeholders (``num_tokens + placeholders -
    num_computed_tokens``: 1 for a decode whose previous token is still in flight),
    and BUDGET.MAX_MODEL_LEN caps it at ``max_model_len - num_computed_tokens - 1``
    with the placeholders inside ``num_computed_tokens``: a request whose in-flight
    token reaches ``max_model_len`` is not scheduled again (vLLM: num_new_tokens
    becomes 0, the request is skipped, not ended).  Blocks are allocated for the
    placeholder positions as for any token.""",
    __name__,
    knobs=("async_scheduling", "max_model_len"),
)

ABORT_DROPS = declare(
    "ASYNC.ABORT_DROPS_OUTPUT",
    """An abort frees the request at once (ABORT.FREE), even with a token in flight;
    when that token arrives it is dropped: outputs of a request that has finished or
    was aborted since its batch was scheduled are never applied (vLLM skips a
    finished request in update_from_output).  So a request stopped by EOS or a stop
    token has usually been scheduled one more decode, whose token is dropped.""",
    __name__,
    knobs=("async_scheduling",),
)


@rule("ASYNC.PLACEHOLDER", knobs=("async_scheduling",))
def add_placeholder(req: "Request") -> None:
    """A request whose prefill is complete after the step samples a token that is not
    known until the step's outputs are applied, one step later: it becomes an output
    placeholder (``num_output_placeholders += 1``, vLLM's AsyncScheduler
    ``_update_after_schedule``).  Whether the step samples is decided against the token
    count *with* the placeholders from earlier steps (``num_computed_tokens >=
    num_tokens + placeholders``)."""
    req.num_output_placeholders += 1


@rule("ASYNC.LAST_TOKEN_IN_FLIGHT", knobs=("async_scheduling",), applies=bool)
def last_token_in_flight(req: "Request") -> bool:
    """A running request whose last output token is already in flight is not scheduled
    again: with ``p > 0`` placeholders, when ``num_computed_tokens + 2 - p >= prompt +
    max_tokens`` (its known outputs plus the one in flight reach max_tokens) it is
    skipped — the running phase goes on with the next request, and the request keeps
    its blocks until its output arrives and finishes it (vLLM: "avoid scheduling an
    extra step when we are sure that the previous step has reached max_tokens").
    EOS and stop tokens cannot be foreseen: those requests get one more decode."""
    p = req.num_output_placeholders
    return p > 0 and req.num_computed_tokens + 2 - p >= len(req.prompt_token_ids) + req.max_tokens


@rule("ASYNC.PREEMPT_ZEROES_PLACEHOLDERS", knobs=("async_scheduling",))
def zero_placeholders(req: "Request") -> None:
    """A request preempted with tokens in flight forgets its placeholders together with
    its computed tokens; the in-flight token is *stale* but still delivered (rule
    ASYNC.STALE_OUTPUT): vLLM's ``_preempt_request`` sets ``num_output_placeholders = 0``
    and marks the in-flight share stale rather than dropping it."""
    req.num_output_placeholders = 0


@rule("ASYNC.STALE_OUTPUT", knobs=("async_scheduling",))
def stale_output(req: "Request") -> str:
    """The token of a request that was preempted after its batch was scheduled is still
    appended to its outputs when the batch's outputs arrive, and the stop rules apply
    (a request preempted with its last token in flight finishes from the waiting queue);
    but it changes no placeholder count and caches no block (the request no longer
    holds any).  vLLM delivers stale tokens so that a resumed request recomputes them."""
    return "stale: preempted after its batch was scheduled; the token is still appended"


@rule("ASYNC.CACHE_AFTER_OUTPUT", knobs=("async_scheduling", "enable_prefix_caching"))
def cache_after_output(eng: "SpecEngine", req: "Request") -> None:
    """When a running request's sampled token arrives, its full blocks up to
    ``num_computed_tokens - placeholders`` tokens enter the prefix cache (before the
    stop rules free it).  At allocation (CACHE.REGISTER_AT_ALLOCATION) only blocks of
    *known* tokens can be cached — a block whose last token is in flight has no hash
    yet — so this is where such a block is cached when no later allocation did it
    first (vLLM AsyncScheduler ``_update_request_with_output``: cache_blocks)."""
    eng.kv.cache_blocks(req, req.num_computed_tokens - req.num_output_placeholders)


def launch(eng: "SpecEngine", out) -> list[InFlight]:
    """The tokens the step just scheduled will sample: one per sampler, at its next
    output index (known outputs plus earlier placeholders)."""
    flight = []
    for s in out.scheduled:
        if s.samples:
            req = eng.requests[s.request_id]
            index = len(req.output_token_ids) + req.num_output_placeholders - 1 - s.drafts
            flight.append(InFlight(s.request_id, index, req.num_preemptions, s.drafts, s.accepted))
    return flight


@rule("ASYNC.OUTPUTS_NEXT_STEP", knobs=("async_scheduling",))
def apply_outputs(eng: "SpecEngine", flight: list[InFlight], fed: dict[str, int], reasons: list[dict],
                  accepted: dict[str, int] | None = None) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """Step N's sampled tokens are applied after step N+1 was scheduled, in step N's
    batch order: each token is appended, the request loses one placeholder, its blocks
    are cached (ASYNC.CACHE_AFTER_OUTPUT), the stop rules run and a finished request is
    freed at once.  Step N+1's batch, decided before, may therefore hold a decode of a
    request that this very update finishes (its token is dropped one step later,
    ASYNC.ABORT_DROPS_OUTPUT), and memory freed by a finish is first usable by step N+2.

    With speculative decoding a batch entry delivers ``1 + accepted`` tokens from output
    index ``len(outputs)`` on (the earlier batch's tokens are applied by then, however many
    drafts it had accepted): its rejected drafts are rolled back first (SPEC.ROLLBACK) and
    the tokens appended under the stop rules one by one (SPEC.STOP_IN_DRAFTS); ``accepted``
    collects the drafts accepted per request.

    Returns the finished requests (in freeing order) and the tokens applied (the first of each)."""
    from spec.scheduler import Status, check_stop
    from spec.specdec import append_outputs, output_tokens, rollback, verified

    finished: list[tuple[str, str]] = []
    took: dict[str, int] = {}
    for f in flight:
        req = eng.requests[f.request_id]
        if req.status not in (Status.RUNNING, Status.WAITING, Status.PREEMPTED):
            fired(ABORT_DROPS)
            continue
        stale = req.num_preemptions != f.preemptions
        # with drafts in flight the index depends on how many the batch before accepted: the
        # tokens go at the end of the outputs (f.index, fixed at launch, is the same without drafts)
        index = len(req.output_token_ids) if eng.num_spec else f.index
        token = fed[f.request_id] if f.request_id in fed else eng.scripted(req, index)
        took[f.request_id] = token
        was_running = req.status == Status.RUNNING
        if f.drafts:
            rollback(req, f.drafts, f.accepted, stale)
            if accepted is not None:
                accepted[f.request_id] = f.accepted
            reasons.append(reason("SPEC.ACCEPT", f.request_id, verified(f.drafts, f.accepted)))
        tokens, why = append_outputs(req, output_tokens(req, token, f.accepted, eng.vocab_size, eng.eos_token_id),
                                     lambda r, t: check_stop(r, t, eng.config))
        if stale:
            reasons.append(reason("ASYNC.STALE_OUTPUT", f.request_id, stale_output(req)))
        else:
            req.num_output_placeholders -= len(tokens)
        if was_running and not stale:
            cache_after_output(eng, req)
        if why is not None:
            if not was_running:
                eng.waiting.remove(req)
            eng._finish(req, Status.FINISHED, why)
            finished.append((req.request_id, why))
            rule_id = {"eos": "STOP.EOS", "stop_token": "STOP.STOP_TOKEN"}.get(why, "STOP.LENGTH")
            reasons.append(reason(rule_id, req.request_id, f"finished: {why} after {len(req.output_token_ids)} tokens"))
    return finished, took
