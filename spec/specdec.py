"""Speculative decoding (knob ``num_speculative_tokens`` K > 0): the rules SPEC.*.

A drafter proposes K tokens after a request's output; the next step schedules
them together with the request's one regular decode token (``1 + K`` tokens,
vLLM's ``num_tokens_with_spec``), the model verifies them, and the step's
output is the accepted drafts plus one sampled (bonus) token.  The scheduler
sees speculative decoding only through token counts: drafts consume budget and
KV slots when scheduled, and rejected drafts are rolled back from
``num_computed_tokens`` when the step's output arrives.

The drafter is vLLM's ``ngram`` method (the one that needs no weights):
``num_lookahead_tokens = 0`` and no extra draft slots in the token budget
(``max_num_new_slots_for_drafting = 0``), so no lookahead KV slot is reserved
beyond the scheduled drafts (rule SPEC.LOOKAHEAD_SLOTS).

**What the trace scripts** (spec.formats): a request's drafts are the tokens its
own token rule samples next, so an accepted draft is exactly the token the model
samples at that position: output index ``i`` is ``TraceRequest.output_token(i)``
whether it was a draft or the bonus token.  How many of a verification's drafts
are accepted is the request's ``spec_accept`` list (the j-th verification accepts
``spec_accept[j mod len]``, at most the drafts scheduled), or its
``spec_accept_rate`` (each draft accepted with that probability from a seeded
hash, up to the first rejection), or, with neither, every draft (rule SPEC.ACCEPT).

Checked against vLLM 0.32's ``Scheduler`` and ``AsyncScheduler`` built with
``speculative_config={"method": "ngram", "num_speculative_tokens": K}``, drafts
fed by the adapter (fuzz/vllm_adapter.py).
"""
from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

from spec.rules import declare, fired, rule

if TYPE_CHECKING:  # pragma: no cover
    from spec.formats import TraceRequest
    from spec.scheduler import Request


LOOKAHEAD = declare(
    "SPEC.LOOKAHEAD_SLOTS",
    """A step allocates KV slots for the tokens it schedules, drafts included, and no
    lookahead slot beyond them: the n-gram drafter writes no KV of its own
    (vLLM's ``num_lookahead_tokens`` is 0 for ``ngram``; a draft model or EAGLE would
    reserve K more).  Nor does it take draft slots out of the token budget
    (``max_num_new_slots_for_drafting`` is 0): drafts are paid from
    ``max_num_batched_tokens`` like any token.""",
    __name__,
    knobs=("num_speculative_tokens",),
    fires=False,
)

CACHE_VERIFIED = declare(
    "SPEC.CACHE_VERIFIED",
    """Only blocks full of *known* tokens enter the prefix cache: an allocation caches
    up to ``num_tokens`` (prompt plus outputs), never a block whose tail holds
    unverified drafts (vLLM caps ``num_tokens_to_cache`` at ``request.num_tokens``).
    A block of accepted drafts is cached by the next allocation that covers it
    (async: when the output arrives, ASYNC.CACHE_AFTER_OUTPUT).""",
    __name__,
    knobs=("num_speculative_tokens", "enable_prefix_caching"),
    fires=False,
)

STOP_IN_DRAFTS = declare(
    "SPEC.STOP_IN_DRAFTS",
    """A step's output tokens (accepted drafts, then the bonus token) are appended one
    by one, the stop rules checked after each; the first that stops the request
    finishes it and the tokens after it are dropped (vLLM's
    ``_update_request_with_output`` trims ``new_token_ids``).  So EOS, a stop token,
    max_tokens or max_model_len can end a request in the middle of its accepted drafts.""",
    __name__,
    knobs=("num_speculative_tokens",),
)


@rule("SPEC.PROPOSE", knobs=("num_speculative_tokens",))
def propose(req: "Request", k: int) -> None:
    """After a step's output, a running request that sampled in it (its prefill is
    complete) gets K draft proposals for its next step (vLLM's
    ``update_draft_token_ids`` after the engine core's step; the n-gram drafter caps
    them at ``max_model_len - num_tokens``, which the scheduler's own cap,
    BUDGET.MAX_MODEL_LEN, always undercuts).  A request that was not scheduled keeps
    its proposals; preemption discards them (SPEC.PREEMPT_DISCARDS)."""
    req.spec_drafts = k


@rule("SPEC.ASYNC_DRAFT_PLACEHOLDERS", knobs=("num_speculative_tokens", "async_scheduling"))
def draft_placeholders(req: "Request", k: int) -> None:
    """With async scheduling the drafts of a step are proposed on the worker, after the
    scheduler has already decided the next step: every scheduled request whose prefill
    is complete after the step gets K draft *placeholders* at once, and its next step
    schedules them without waiting for the output (vLLM's AsyncScheduler sets
    ``spec_token_ids = [-1] * K`` in ``_update_after_schedule``)."""
    req.spec_drafts = k


@rule("SPEC.DRAFT_SCHEDULE", knobs=("num_speculative_tokens", "max_num_batched_tokens", "max_model_len"))
def scheduled_drafts(req: "Request", n: int, start: int) -> int:
    """A running request is scheduled the tokens it lacks *including* its proposed
    drafts (``num_tokens + drafts + placeholders - num_computed_tokens``: 1 + K for a
    decode), cut like any request's by the long-prefill cap, the token budget and
    BUDGET.MAX_MODEL_LEN.  Of its ``n`` scheduled tokens, those past its known tokens
    and placeholders are drafts: ``n + start - num_tokens - placeholders`` (vLLM
    truncates ``spec_token_ids`` to that); the proposals are spent either way.
    max_tokens does not cap them: a request one token short of max_tokens still
    schedules (and allocates KV for) all its drafts."""
    drafts = n + start - req.num_tokens - req.num_output_placeholders
    req.spec_drafts = 0
    return max(0, min(drafts, n))


@rule("SPEC.PAD_ADMISSION", knobs=("num_speculative_tokens",), applies=lambda n: n is not None and n > 1)
def padded_admission(remaining: int, hit: int, k: int, running_prefill: bool, running_scheduled: bool,
                     budget: int, max_model_len: int) -> int | None:
    """An admitted request left with a single token to compute (a resumed request, or a
    new one whose prefix hit covers all but its last token) is padded to a uniform
    decode of ``1 + K`` tokens with K dummy drafts — when no running request scheduled in
    this step is mid-prefill, something else is scheduled (or it had a prefix hit), and
    ``hit + 1 + K + 1 <= max_model_len``.  If ``1 + K`` exceeds the budget left,
    admission stops (vLLM prefers not to schedule over scheduling unpadded: it keeps
    full CUDA graphs).  The dummy drafts are never accepted, but consume budget and
    KV slots.  Returns the tokens to schedule, or None to stop admission."""
    if remaining != 1 or running_prefill or not (running_scheduled or hit > 0):
        return remaining
    if padded_context(hit, k) > max_model_len:
        return remaining
    return 1 + k if 1 + k <= budget else None


def padded_context(hit: int, k: int) -> int:
    """The context a padded admission needs (SPEC.PAD_ADMISSION): its hit, its one token, its K
    dummy drafts and the token it samples — ``hit + 1 + K + 1``."""
    return hit + 1 + k + 1


def accept_rate_draw(request_id: str, verification: int, draft: int) -> float:
    """The seeded uniform draw in [0, 1) for one draft: ``crc32("<id>#acc<j>#<i>") / 2**32``."""
    return zlib.crc32(f"{request_id}#acc{verification}#{draft}".encode()) / 2**32


@rule("SPEC.ACCEPT", knobs=("num_speculative_tokens",))
def accepted_drafts(tr: "TraceRequest", verification: int, drafts: int) -> int:
    """How many of the ``drafts`` scheduled in a request's ``verification``-th batch with
    proposals (0, 1, ... counted when scheduled) the model accepts: the trace's
    ``spec_accept[verification mod len]``, or with ``spec_accept_rate`` p the number of
    leading drafts i whose draw ``accept_rate_draw(id, verification, i) < p``, or
    every draft; never more than were scheduled.  Dummy drafts of a padded admission
    are never accepted and take no verification number."""
    if tr.spec_accept:
        return min(drafts, tr.spec_accept[verification % len(tr.spec_accept)])
    if tr.spec_accept_rate is not None:
        n = 0
        while n < drafts and accept_rate_draw(tr.id, verification, n) < tr.spec_accept_rate:
            n += 1
        return n
    return drafts


@rule("SPEC.ROLLBACK", knobs=("num_speculative_tokens",))
def rollback(req: "Request", drafts: int, accepted: int, stale: bool) -> None:
    """When a step's output arrives, the rejected drafts (``drafts - accepted``) are taken
    back from ``num_computed_tokens`` (and, with async scheduling, from the output
    placeholders, which counted them), before the tokens are appended.  The KV blocks
    allocated for them stay with the request — the next steps write over those slots —
    and none of them was cached (SPEC.CACHE_VERIFIED).  A stale output (the request was
    preempted after its batch was scheduled) rolls nothing back: preemption already
    zeroed both counts (vLLM's ``update_from_output``)."""
    rejected = drafts - accepted
    if stale or rejected <= 0:
        return
    if req.num_computed_tokens > 0:
        req.num_computed_tokens -= rejected
    if req.num_output_placeholders > 0:
        req.num_output_placeholders -= rejected


@rule("SPEC.PREEMPT_DISCARDS", knobs=("num_speculative_tokens",))
def discard_drafts(req: "Request") -> None:
    """A preempted request loses its proposed drafts (vLLM clears ``spec_token_ids``): when
    resumed it recomputes its tokens and may be padded (SPEC.PAD_ADMISSION) but proposes
    again only after its next output."""
    req.spec_drafts = 0


@rule("SPEC.CACHE_AT_OUTPUT", knobs=("spec_cache_at_output", "num_speculative_tokens", "enable_prefix_caching"))
def cache_at_output(kv, req: "Request") -> None:
    """With ``spec_cache_at_output`` (vLLM 0.33) and synchronous scheduling, when a running
    request's output is applied its full blocks up to its computed tokens (after the rollback,
    less the tokens a stop dropped: ``num_tokens - 1``) enter the prefix cache at once — the
    blocks its accepted drafts filled, before a stop frees the request — instead of at its next
    allocation (0.32, SPEC.CACHE_VERIFIED).  A request that stops there leaves those blocks
    cached, at the tail of the free queue, where later requests can hit them (vLLM 0.33
    ``update_from_output``: ``cache_blocks(request, num_computed_tokens - num_in_flight_tokens)``
    whenever speculative decoding is on, after ``_update_request_with_output`` took the dropped
    tokens back from ``num_computed_tokens``)."""
    kv.cache_blocks(req, min(req.num_computed_tokens, req.num_tokens - 1))


def verified(drafts: int, accepted: int) -> str:
    """The reason text of one verification (SPEC.ACCEPT, SPEC.ROLLBACK)."""
    rejected = drafts - accepted
    return f"{accepted} of {drafts} drafts accepted" + (f", {rejected} rolled back" if rejected else "")


def output_tokens(req: "Request", first: int, accepted: int, vocab_size: int, eos_token_id: int) -> list[int]:
    """The ``1 + accepted`` tokens a verified step appends to ``req``: ``first`` (the sampled
    token, or the engine's in a differential replay), then the token rule's next ones."""
    return [first] + draft_tokens(req, len(req.output_token_ids) + 1, accepted, vocab_size, eos_token_id)


def draft_tokens(req: "Request", index: int, count: int, vocab_size: int, eos_token_id: int) -> list[int]:
    """The ``count`` drafts from output index ``index`` on: the tokens the request's own
    token rule samples there (an accepted draft is the token the model samples)."""
    return [req.source.output_token(index + i, vocab_size, eos_token_id) for i in range(count)]


def append_outputs(req: "Request", tokens: list[int], stop) -> tuple[list[int], str | None]:
    """Append ``tokens`` one by one, checking the stop rules (``stop(req, token)``) after each
    (SPEC.STOP_IN_DRAFTS); return the tokens appended and the finish reason, if one stopped
    the request."""
    for i, token in enumerate(tokens):
        req.append_output_token(token)
        why = stop(req, token)
        if why is not None:
            if i + 1 < len(tokens):
                fired(STOP_IN_DRAFTS)
            return tokens[: i + 1], why
    return tokens, None
