"""Compare two decision logs and report the first decision on which they differ.

Records are aligned by ``record.step``.  A step that has a record on one side
only counts as an idle step on the other (the driver skips idle steps and
writes no record for them).  At each step the fields of
:func:`spec.formats.fields_at` are compared in a fixed order — the order in
which a reader would ask (who ran, who was admitted, preempted, finished,
then memory) — and the first difference wins.  ``sampled`` is compared by its
keys only: which requests sampled is a scheduling decision, the token values
are the engine's output, which the spec adopts in a differential run.

The report (:class:`Divergence`) carries both values and the spec's own reason
for its value: the rule id and text from the spec record's ``reasons``, for
the request the two sides disagree about when there is one.

The optional state fields (:data:`spec.formats.STATE_FIELDS`: computed tokens,
VTC counters, the estimate admission's remaining tokens, prefix-cache
registrations and hit blocks) are compared too, at each step after the level's
own fields, whenever both logs carry them: a bug in that state then shows at
the step where the state first differed, named by the rule that defines it,
instead of at the later decision it spoils.  Floats (counters, the estimate)
are equal within a relative 1e-9.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from spec.formats import ADMIT_STOPS, LEVEL_FIELDS, LEVELS, STATE_FIELDS, StepRecord, fields_at

#: Kinds of divergence.
DECISION = "decision"  # a field of one step record differs
NON_TERMINATION = "non-termination"  # one side did not finish within max_steps
ERROR = "error"  # one side raised while running the trace
SPAN = "span"  # gpu_engine's simulator fast path (decode spans) differs from the steps it stands for
TOKENS = "tokens"  # gpu_engine's model samples another token than the reference engine (same weights)

_MEMORY_FIELDS = set(LEVEL_FIELDS["memory"]) | set(LEVEL_FIELDS["exact"])
_EMPTY = {"blocks": {}, "cache_hits": {}, "block_ids": {}, "evicted": [], "num_evicted": 0}


class LevelError(ValueError):
    """A log does not carry the fields the comparison level needs."""


#: Divergence kinds whose ``rule`` is the place in the engine's code where it raised or hung
#: (``Type at FILE:LINE``, ``stuck in FILE:FUNCTION``: fuzz.campaign.engine_failure), not a spec rule.
CRASH_KINDS = (ERROR, "hang")


@dataclass
class Divergence:
    """The first step and field on which the spec and an engine disagree."""

    step: int
    field: str
    spec_value: Any
    engine_value: Any
    request: str | None = None  # the request the two values disagree about, if one
    rule: str | None = None  # the spec's rule id for its value
    reason: str | None = None  # the spec's reason text
    kind: str = DECISION
    engine: str = "engine"
    context: list[dict] = field(default_factory=list)  # the spec's other reasons at that step

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "step": self.step, "field": self.field, "request": self.request,
            "spec": _plain(self.spec_value), self.engine: _plain(self.engine_value),
            "rule": self.rule, "reason": self.reason,
        }

    def describe(self) -> str:
        """A readable, multi-line explanation of the divergence."""
        who = f" about request {self.request}" if self.request else ""
        if self.kind == NON_TERMINATION:
            head = f"non-termination at step {self.step}{who}: {self.field}"
        elif self.kind == ERROR:
            head = f"error at step {self.step}: {self.field}"
        elif self.kind == SPAN:
            head = f"decode-span divergence at step {self.step}, field `{self.field}`{who}"
        elif self.kind == TOKENS:
            head = f"token divergence at step {self.step}{who}"
        else:
            head = f"first divergence at step {self.step}, field `{self.field}`{who}"
        lines = [
            head,
            f"  spec:   {_show(self.spec_value)}",
            f"  {self.engine + ':':7} {_show(self.engine_value)}",
        ]
        if self.kind in (SPAN, TOKENS):
            lines.append(f"  {self.reason}")
        elif self.rule and self.kind in CRASH_KINDS:  # (the place the engine raised or hung, not a spec rule)
            lines.append(f"  where the engine {'hung' if self.kind == 'hang' else 'raised'}: {self.rule}")
        elif self.rule:
            lines.append(f"  spec's rule: {self.rule}" + (f" — {self.reason}" if self.reason else ""))
        elif self.kind == DECISION:
            lines.append("  spec's rule: (no reason recorded for this request at this step)")
        others = [r for r in self.context if r.get("rule") != self.rule or r.get("text") != self.reason]
        if others:
            lines.append("  spec's other decisions at this step:")
            for r in others[:8]:
                lines.append(f"    {r.get('rule')}" + (f" [{r['request']}]" if r.get("request") else "") + f": {r.get('text')}")
            if len(others) > 8:
                lines.append(f"    … {len(others) - 8} more")
        return "\n".join(lines)


def _plain(value: Any) -> Any:
    """JSON-friendly: tuples become lists."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _show(value: Any) -> str:
    text = repr(_plain(value))
    return text if len(text) <= 400 else text[:400] + " …"


def _value(record: StepRecord, name: str, synthesized: bool) -> Any:
    """The comparable value of one field; ``None`` means "not known" (skip)."""
    if name == "sampled":
        return sorted(record.sampled)
    value = getattr(record, name)
    if name in _MEMORY_FIELDS:
        if synthesized:
            return None  # an idle step the driver skipped: its memory state was not written
        if value is None:
            return _EMPTY.get(name)
    return _plain(value)


def _check_level(records: list[StepRecord], level: str, side: str) -> None:
    need = LEVELS.index(level)
    for rec in records:
        if LEVELS.index(rec.level()) < need:
            raise LevelError(f"{side} log record at step {rec.step} carries the {rec.level()!r} level; "
                             f"comparing at {level!r} needs {', '.join(fields_at(level))}")


def _involved(name: str, spec_value: Any, engine_value: Any) -> str | None:
    """The request the two values first disagree about."""
    if isinstance(spec_value, dict) or isinstance(engine_value, dict):
        a, b = spec_value or {}, engine_value or {}
        for key in list(a) + [k for k in b if k not in a]:
            if a.get(key) != b.get(key):
                return key
        return None
    if isinstance(spec_value, list) and isinstance(engine_value, list) and name != "evicted":
        for x, y in zip(spec_value, engine_value):
            if x != y:
                return _rid(x)
        longer = spec_value if len(spec_value) > len(engine_value) else engine_value
        if len(spec_value) != len(engine_value):
            return _rid(longer[min(len(spec_value), len(engine_value))])
    return None


def _rid(item: Any) -> str | None:
    if isinstance(item, str):
        return item
    if isinstance(item, (list, tuple)) and item and isinstance(item[0], str):
        return item[0]
    return None


#: The rule that defines each state field's value, named when the step's reasons cite none.
STATE_RULES = {
    "computed": "BUDGET.TOKENS",
    "vtc_counters": "VTC.CHARGE",
    "vtc_lifts": "VTC.LIFT",
    "estimate_rem": "ESTIMATE.ADMIT",
    "estimate_parts": "ESTIMATE.ADMIT",
    "cache_registered": "CACHE.REGISTER_AT_ALLOCATION",
    "hit_blocks": "CACHE.HIT",
    "drafts": "SPEC.DRAFT_SCHEDULE",
    "accepted": "SPEC.ACCEPT",
    "token_cap": "BUDGET.LONG_PREFILL",
    "ref_counts": "CACHE.TOUCH",
    "cached_blocks": "CACHE.EVICT_LRU",
    "admit_stop": "ADMIT.NEW",
    "placeholders": "ASYNC.PLACEHOLDER",
    "waiting": "ARRIVE.QUEUED",
}
_FLOAT_FIELDS = ("vtc_counters", "vtc_lifts", "estimate_rem", "estimate_parts")

#: The rule behind each term of the estimate's ``rem`` (state field ``estimate_parts``), in the
#: order a report looks for the term that differs: the running requests' remaining outputs (before
#: the ratio scales them), the two reserves, then the free tokens.
ESTIMATE_TERMS = {"outputs": "ESTIMATE.REMAINING", "running": "ESTIMATE.RUNNING_RATIO",
                  "chunks": "ESTIMATE.CONTINUED_CHUNK", "free": "ESTIMATE.ADMIT"}


def state_fields_at(level: str) -> tuple[str, ...]:
    """The optional state fields compared at ``level`` (when both logs carry them)."""
    return tuple(name for name, lowest in STATE_FIELDS.items() if LEVELS.index(level) >= LEVELS.index(lowest))


def _close(a: Any, b: Any) -> bool:
    """Equal, floats within a relative 1e-9 (engines may sum in another order)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))
    return a == b


#: State fields whose value the step fixes before it decides anything: the per-request token cap
#: (from the queue lengths the step began with) and the VTC lifts of the tenants whose requests
#: arrived (arrivals come before the schedule).  One that differs is the cause of whatever the step
#: then decides differently, so it is compared first (the rest describe the state after the step).
PRE_DECISION_FIELDS = ("token_cap", "vtc_lifts")


def _state_divergence(step: int, s: StepRecord | None, e: StepRecord | None, level: str, engine: str,
                      history: Callable[[], list[StepRecord]] = list, only: tuple[str, ...] | None = None) -> Divergence | None:
    """The first state field both records carry and that differs (of ``only``, when given), or None.
    ``history()``: the spec's records before this step (who held a block, who the spec had ended),
    made only when a field differs."""
    if s is None or e is None:
        return None  # an idle step on one side: its state was not written
    for name in state_fields_at(level):
        if only is not None and name not in only:
            continue
        a, b = getattr(s, name), getattr(e, name)
        if name == "waiting" and a is not None and b is not None:  # (a set: an engine may log it in queue order)
            a, b = sorted(a, key=str), sorted(b, key=str)
        if a is None or b is None or (_close(a, b) if name in _FLOAT_FIELDS else _plain(a) == _plain(b)):
            continue
        if name in ("ref_counts", "cached_blocks"):  # a block's references or cache entries: the step's event on it
            rule, who, text = (ref_rule if name == "ref_counts" else cache_rule)(s, e, history())
            return Divergence(step, name, _plain(a), _plain(b), who, rule, text, DECISION, engine, list(s.reasons or []))
        gone = _still_counted(s, a, b) if name == "computed" else None
        if gone is not None:  # a request the step ended, still running on the engine's side
            return Divergence(step, name, _plain(a), _plain(b), gone[0], gone[1], gone[2], DECISION, engine,
                              list(s.reasons or []))
        if name == "admit_stop":  # the earlier of the two gates (the side that passed it broke it)
            word = earlier_gate(a, b, None)
            rule = (word == a and estimate_refusal(s, word)) or DEFAULT_GATE_RULES.get(word or "", STATE_RULES[name])
            return Divergence(step, name, a, b, None, rule, f"the spec's walk of the waiting queue stopped at "
                              f"'{a}', the engine's at '{b}' ({ADMIT_STOPS.get(word or '', 'another gate')})",
                              DECISION, engine, list(s.reasons or []))
        if name == "waiting":  # the event that should have put the request in the queue or taken it out
            request, rule, text = waiting_rule(s, a, b, history())
            return Divergence(step, name, _plain(a), _plain(b), request, rule, text, DECISION, engine, list(s.reasons or []))
        if name == "estimate_parts":  # the term of rem that differs, and the rule that defines it
            term = next((t for t in ESTIMATE_TERMS if not _close(a.get(t), b.get(t))), "free")
            return Divergence(step, name, _plain(a), _plain(b), None, ESTIMATE_TERMS[term],
                              f"the estimate's '{term}' term as the admission round began: the spec's "
                              f"{a.get(term)}, the engine's {b.get(term)}", DECISION, engine, list(s.reasons or []))
        if name == "vtc_lifts":  # a tenant's lift at its arrival to an empty queue (VTC.LIFT's own figure)
            tenant = sorted(_differing_tenants(a, b))[0]
            return Divergence(step, name, _plain(a), _plain(b), None, "VTC.LIFT",
                              f"tenant {tenant!r} arrived to its empty queue: the spec's lift left its counter at "
                              f"{a.get(tenant)}, the engine's at {b.get(tenant)}", DECISION, engine, list(s.reasons or []))
        if name == "placeholders":  # the step's event on that request's tokens in flight
            request = _involved(name, a, b)
            rule, text = placeholder_rule(s, request)
            return Divergence(step, name, _plain(a), _plain(b), request, rule, text, DECISION, engine, list(s.reasons or []))
        request = _involved(name, a, b) if name not in ("vtc_counters", "estimate_rem", "token_cap") else None
        rule, text, context = spec_reason(s, request, name)
        if name == "computed" and request is not None:  # a victim's reset, or a request the spec ended
            cause = computed_rule(s, request, history())
            if cause is None and request in (s.accepted or {}):  # its drafts were verified in this step
                cause = (("SPEC.ACCEPT", f"{request}'s verification accepted another number of drafts")
                         if (e.accepted or {}).get(request) != s.accepted[request] else
                         ("SPEC.ROLLBACK", f"{request}'s rejected drafts were taken back from its computed tokens"))
            if cause is not None:
                return Divergence(step, name, _plain(a), _plain(b), request, cause[0], cause[1], DECISION, engine, context)
        families = _FAMILIES[name]
        if request is None:  # a per-tenant or per-step figure: the step's first reason of its family
            about = _differing_tenants(a, b) if name == "vtc_counters" else None
            cited = next((r for r in context if str(r.get("rule", "")).startswith(families)
                          and (about is None or r.get("tenant") in about)), None)
            rule, text = (cited.get("rule"), cited.get("text")) if cited else (None, None)
        if rule is None or not rule.startswith(families):
            rule, text = STATE_RULES[name], f"the spec's {name} after step {step} (no reason of this rule recorded)"
        if name == "computed" and request in _hit_admissions(s):  # its computed tokens start after the hit
            rule, text = "CACHE.HIT", f"{request} was admitted with a prefix hit of {s.cache_hits[request]} tokens"
        return Divergence(step, name, _plain(a), _plain(b), request, rule, text, DECISION, engine, context)
    return None


def waiting_rule(record: StepRecord, ours: list, theirs: list,
                 history: list[StepRecord]) -> tuple[str | None, str, str]:
    """``(request, rule, why)`` for waiting queues that hold other requests after a step.  A request
    only the engine still queues: the rule that ended it (an abort, a stop, a refusal: :func:`ended_rule`,
    also for an entry the engine no longer names, then the step's own abort or finish), or its
    admission in this step.  A request only the spec queues: its preemption in this step (the rule
    that freed it: its requeue follows), else its arrival (``ARRIVE.QUEUED``)."""
    extra = [rid for rid in theirs if rid not in ours]
    if extra:
        rid = extra[0]
        if rid is None:  # (an entry released under its id but still queued: the step's own end of a request)
            rid = next(iter(list(record.aborted) + [r for r, _ in record.finished]), None)
        ended = ended_rule(list(history) + [record], rid)
        if ended is not None:
            return rid, ended, f"the spec ended {rid} ({ended}); the engine still queues it"
        if rid in record.new or rid in record.resumed:
            rule = "ADMIT.RESUMED" if rid in record.resumed else "ADMIT.NEW"
            return rid, rule, f"the spec admitted {rid} in this step; the engine still queues it"
        return rid, "ARRIVE.QUEUED", f"the engine queues {rid}, which the spec's queue does not hold"
    rid = next((r for r in ours if r not in theirs), None)
    if rid in record.preempted:
        rule = _preempt_rule(record, rid)
        return rid, rule, f"{rid} was preempted in this step ({rule}) and waits again; the engine does not queue it"
    return rid, "ARRIVE.QUEUED", f"{rid} waits in the spec's queue, not in the engine's"


def placeholder_rule(record: StepRecord, request: str | None) -> tuple[str, str]:
    """``(rule, why)`` behind the spec's placeholders (tokens in flight) for ``request`` after a step:
    its preemption in the step zeroed them (``ASYNC.PREEMPT_ZEROES_PLACEHOLDERS``), a stale output
    of the step was dropped without giving one back (``ASYNC.STALE_OUTPUT``), else each scheduled
    sampler adds one and each applied output takes one back (``ASYNC.PLACEHOLDER``)."""
    if request in record.preempted:
        return ("ASYNC.PREEMPT_ZEROES_PLACEHOLDERS",
                f"{request} was preempted in this step: its placeholders are forgotten with its computed tokens")
    if any(r.get("rule") == "ASYNC.STALE_OUTPUT" and r.get("request") == request for r in record.reasons or ()):
        return ("ASYNC.STALE_OUTPUT",
                f"{request}'s output in this step was stale (scheduled before its preemption): dropped, nothing given back")
    return "ASYNC.PLACEHOLDER", f"the spec's tokens in flight for {request} after step {record.step}"


def _still_counted(spec: StepRecord, ours: dict, theirs: dict) -> tuple[str, str, str] | None:
    """``(request, rule, why)`` when the engine's computed tokens still count a request the spec's
    step finished or aborted: under its id, or under no id at all (an engine that released the
    request's name but kept its slot running).  The rule is the one that ended it."""
    ended = [rid for rid, _ in spec.finished] + list(spec.aborted)
    extra = [k for k in theirs if k not in ours and (k is None or k in ended)]
    if not extra or not ended:
        return None
    rid = extra[0] if extra[0] is not None else ended[0]
    rule = ended_rule([spec], rid)
    if rule is None:
        return None
    return rid, rule, f"the spec's step ended {rid} ({rule}); the engine still counts it as running"


def _differing_tenants(a: dict, b: dict) -> list[str]:
    """The tenants whose VTC counters differ: a VTC reason (a lift at arrival, a victim's return
    without one) about one of them explains the difference (else the charges do, VTC.CHARGE)."""
    return [t for t in set(a) | set(b) if not _close(a.get(t), b.get(t))]


#: Rule-id families that explain each field, best first.
_FAMILIES = {
    "scheduled": ("EDF.", "RUN.", "ADMIT.", "BUDGET.", "PREEMPT.", "KV.", "CACHE."),
    "new": ("ADMIT.", "KV.", "BUDGET.", "CACHE."),
    "resumed": ("ADMIT.", "KV.", "BUDGET.", "CACHE."),
    "preempted": ("PREEMPT.", "RUN.", "KV."),
    "finished": ("STOP.",),
    "aborted": ("ABORT.",),
    "rejected": ("REJECT.", "SLO.", "ARRIVE."),  # (SLO admission control refuses after arrival)
    "sampled": ("SAMPLE.", "RUN.", "ADMIT.", "STOP."),
    "cache_hits": ("CACHE.", "ADMIT."),
    "computed": ("RUN.", "ADMIT.", "BUDGET.", "CACHE."),
    "vtc_counters": ("VTC.",),
    "vtc_lifts": ("VTC.LIFT",),
    "estimate_rem": ("ESTIMATE.",),
    "estimate_parts": ("ESTIMATE.",),
    "cache_registered": ("CACHE.",),
    "hit_blocks": ("CACHE.",),
    "drafts": ("SPEC.", "RUN.", "ADMIT.", "BUDGET."),
    "accepted": ("SPEC.ACCEPT", "SPEC.ROLLBACK"),
    "token_cap": ("BUDGET.LONG_PREFILL",),
    "admit_stop": ("ADMIT.", "BUDGET.", "KV.", "ESTIMATE.", "BATCH.", "SPEC."),
    "placeholders": ("ASYNC.",),
    "waiting": ("ABORT.", "STOP.", "ADMIT.", "PREEMPT.", "RETRACT.", "QUEUE.", "ARRIVE.", "REJECT."),
    "ref_counts": ("CACHE.", "KV."),
    "cached_blocks": ("CACHE.", "RETRACT.", "PREEMPT.", "KV."),
}


def computed_rule(record: StepRecord, request: str, history: list[StepRecord]) -> tuple[str, str] | None:
    """``(rule, why)`` behind the spec's computed tokens for ``request`` when an event of the step
    or before it set them: a preemption at this step (``PREEMPT.RECOMPUTE`` resets them to 0,
    ``SWAP.OUT`` keeps them, ``RETRACT.TO_TAIL`` resets), or an end the spec had already decided
    (the engine still counts a request the spec aborted or finished: :func:`ended_rule`)."""
    if request in record.preempted:
        rule = _preempt_rule(record, request)
        return rule, f"{request} was preempted in this step ({rule}): its computed tokens are what that rule leaves"
    ended = ended_rule(list(history) + [record], request)
    if ended is not None and request not in (record.computed or {}):
        return ended, f"the spec ended {request} ({ended}); it still counts on the engine's side"
    return None


# -- the rule behind a memory value (issue 18 item 3) ------------------------------------------------
#
# A block-accounting field (free blocks, blocks held, block ids, evictions, CPU blocks) is not decided
# by the rule the step's reasons cite for the request involved (``RUN.DECODE``, ``ADMIT.NEW``: what the
# request did, incidental to an accounting bug): it is the sum of the step's memory events, each
# defined by its own rule.  :func:`memory_rule` names the event that explains the spec's value.


def _preempt_rule(record: StepRecord, request: str) -> str:
    """How the spec preempted ``request`` at this step: swapped out, retracted, or recomputed."""
    if request in record.swapped_out:
        return "SWAP.OUT"
    mine = [str(r.get("rule", "")) for r in record.reasons or () if r.get("request") == request]
    return "RETRACT.TO_TAIL" if any(r.startswith("RETRACT.") for r in mine) else "PREEMPT.RECOMPUTE"


def _hit_admissions(record: StepRecord) -> list[str]:
    return [rid for rid in list(record.new) + list(record.resumed) if (record.cache_hits or {}).get(rid, 0) > 0]


def _last_release(history: list[StepRecord], block: int) -> tuple[str, str] | None:
    """``(request, rule)`` of the last event before now that released ``block`` to the free queue
    (a preemption, retraction, abort or finish of a request that held it), from the spec's records."""
    event = _release_event(history, block)
    return event[1:] if event else None


def _release_event(history: list[StepRecord], block: int) -> tuple[int, str, str] | None:
    """``(step, request, rule)`` of the last release of ``block`` in ``history`` (see :func:`_last_release`)."""
    held_by: dict[int, str] = {}
    last = None
    for rec in history:
        gone = set(rec.preempted) | set(rec.aborted) | {r for r, _ in rec.finished}
        for rid in gone:
            if held_by.get(block) == rid:
                last = (rec.step, rid, _preempt_rule(rec, rid) if rid in rec.preempted else
                        "ABORT.FREE" if rid in rec.aborted else "KV.FREE_ORDER")
        held_by = {b: rid for rid, ids in (rec.block_ids or {}).items() for b in ids}
    return last


def one_release(spec: StepRecord, engine: StepRecord, request: str | None, history: list[StepRecord]) -> str | None:
    """Why, when the first block on which the two sides' tables for ``request`` differ is, on both
    sides, a block one request released in one event: the blocks of that release re-entered the
    free queue in another order, which the order a request returns its blocks decides
    (``KV.FREE_REVERSED``), not where the queue puts a release (``KV.FREE_ORDER``).  None otherwise."""
    if not history:
        return None
    ours, theirs = (spec.block_ids or {}).get(request) or [], (engine.block_ids or {}).get(request) or []
    pos = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), None)
    if pos is None:
        return None
    records = list(history) + [spec]  # (a release of this step counts: a victim's blocks re-used at once)
    x, y = _release_event(records, ours[pos]), _release_event(records, theirs[pos])
    if x is None or y is None or x[:2] != y[:2]:
        return None
    return (f"blocks {ours[pos]} (spec) and {theirs[pos]} ({request}'s table position {pos}) were both released by "
            f"{x[1]} at step {x[0]} ({x[2]}): the order of one request's release")


def _releasers(spec: StepRecord, before: dict[str, list[int]], block: int) -> list[tuple[str, str, str]]:
    """``(request, rule, how)`` for each request that held ``block`` before this step and released it
    in it, in the order a step releases: aborts before scheduling, preemptions in it, finishes after
    the model step — the earliest release of a block is blamed first."""
    finished = {r for r, _ in spec.finished}
    order = {**{r: 2 for r in finished}, **{r: 1 for r in spec.preempted}, **{r: 0 for r in spec.aborted}}
    out = []
    for rid in sorted((r for r, ids in before.items() if block in ids), key=lambda r: order.get(r, 3)):
        if rid in spec.preempted:
            rule = _preempt_rule(spec, rid)
            out.append((rid, rule, f"was preempted ({rule})"))
        elif rid in spec.aborted:
            out.append((rid, "ABORT.FREE", "was aborted"))
        elif rid in finished:
            out.append((rid, "KV.FREE_ORDER", "finished"))
    return out


def cache_rule(spec: StepRecord, engine: StepRecord | None, history: list[StepRecord]) -> tuple[str, str | None, str]:
    """``(rule, request, why)`` for prefix-cache entries that differ (``cached_blocks``): a block
    whose entry the engine dropped (or kept) when a request that held it was released in this step
    names that release's rule — a preempted, retracted, aborted or finished request's blocks keep
    their hash until they are popped (``PREEMPT.RECOMPUTE``, ``RETRACT.TO_TAIL``, ``ABORT.FREE``,
    ``KV.FREE_ORDER``); otherwise the rule that removes an entry, ``CACHE.EVICT_LRU`` (an entry
    leaves the cache only when its block is popped for re-use)."""
    from collections import Counter

    ours, theirs = Counter(spec.cached_blocks or ()), Counter((engine.cached_blocks if engine else None) or ())
    odd = sorted((ours - theirs) + (theirs - ours))
    before = (history[-1].block_ids if history else None) or {}
    for block in odd:
        for rid, rule, how in _releasers(spec, before, block):
            return rule, rid, f"block {block}'s cache entry: {rid} {how} and released it, cached until popped"
    block = odd[0] if odd else "?"
    return ("CACHE.EVICT_LRU", None, f"block {block}: {ours.get(block, 0)} cache entries (spec), {theirs.get(block, 0)} "
            f"(engine); an entry leaves the prefix cache only when its block is popped for re-use")


def ref_rule(spec: StepRecord, engine: StepRecord | None, history: list[StepRecord]) -> tuple[str, str | None, str]:
    """``(rule, request, why)`` for reference counts that differ (``ref_counts``): of the blocks whose
    count differs, the first an event of the spec's step touched — released by a request that held
    it (a preemption's rule, ``ABORT.FREE``, or ``KV.FREE_ORDER`` for a finish), or taken by a
    prefix hit (``CACHE.TOUCH``) or an allocation (``KV.NO_FREE_BLOCKS``).  A count no event of
    the step explains names ``CACHE.TOUCH``: besides an allocation, only a hit takes a reference."""
    ours, theirs = spec.ref_counts or {}, (engine.ref_counts if engine else None) or {}
    odd = [k for k in list(ours) + [k for k in theirs if k not in ours] if ours.get(k) != theirs.get(k)]
    before = (history[-1].block_ids if history else None) or {}
    now = spec.block_ids or {}
    hits = spec.hit_blocks or {}
    taken = _held(spec)
    for key in odd:
        block, extra = int(key), theirs.get(key, 0) > ours.get(key, 0)
        for rid, rule, how in _releasers(spec, before, block):
            # its release dropped its other blocks' references (those no one took again in this step):
            # this one's extra came from elsewhere
            if extra and any(str(b) not in odd and b not in taken for b in before[rid] if b != block):
                continue
            return rule, rid, f"block {block} was held by {rid}, {how} in this step"
        for rid in (r for r, ids in now.items() if block in ids):
            if block in hits.get(rid, ()):
                return "CACHE.TOUCH", rid, f"{rid}'s prefix hit took a reference on block {block}"
            if history and block not in before.get(rid, ()):
                return "KV.NO_FREE_BLOCKS", rid, f"block {block} was allocated to {rid} in this step"
    key = odd[0] if odd else "?"
    extra = theirs.get(key, 0) > ours.get(key, 0)
    return ("CACHE.TOUCH" if extra else "KV.FREE_ORDER", None,
            f"block {key}: {ours.get(key, 0)} references (spec), {theirs.get(key, 0)} (engine), and no release of the "
            f"spec's step explains it: " + ("besides an allocation only a prefix hit takes a reference" if extra
                                             else "only a release drops a reference"))


def _held(record: StepRecord) -> set[int]:
    """The block ids the record's requests hold."""
    return {b for ids in (record.block_ids or {}).values() for b in ids}


def _was_swapped(history: list[StepRecord], request: str) -> bool:
    swapped = False
    for rec in history:
        if request in rec.swapped_out:
            swapped = True
        if request in rec.swapped_in:
            swapped = False
    return swapped


def _hit_differs(spec: StepRecord, engine: StepRecord | None) -> str | None:
    """The first request both sides admitted in this step with prefix hits of different sizes
    (:func:`hit_differs`), or None."""
    both = set(spec.cache_hits or {}) & set((engine.cache_hits if engine else None) or {})
    return next((rid for rid in sorted(both) if hit_differs(spec, engine, rid)), None)


def memory_rule(name: str, spec: StepRecord | None, engine: StepRecord | None, request: str | None,
                history: list[StepRecord] = ()) -> tuple[str | None, str | None, str | None]:
    """``(rule, request, why)``: the spec rule behind the spec's value of memory field ``name`` at this
    step — the event of the step that moves that figure — or ``(None, request, None)`` for a field
    that is not about memory.  ``history``: the spec's records before this step (for an eviction,
    the release that left the block cached; for CPU blocks, whether an aborted request was swapped).

    * a request both sides admitted in this step with prefix hits of different sizes: ``CACHE.HIT``
      for ``num_free_blocks``, and for its ``blocks`` / ``block_ids``;
    * ``blocks`` / ``block_ids`` of a request admitted with a prefix hit: ``CACHE.HIT``; of another
      request: ``KV.NO_FREE_BLOCKS`` (how many blocks an allocation takes) for a count, ``KV.FREE_ORDER``
      (which blocks the free queue hands out) for ids;
    * ``num_free_blocks`` when every request's block count agrees: the step's releases — a preemption
      (``PREEMPT.RECOMPUTE``, ``SWAP.OUT``, ``RETRACT.TO_TAIL``), an abort (``ABORT.FREE``), a prefix
      hit taking blocks off the free queue (``CACHE.TOUCH``), a finish (``KV.FREE_ORDER``) — else the
      allocation (``KV.NO_FREE_BLOCKS``);
    * ``num_evicted`` / ``evicted``: ``RETRACT.TO_TAIL`` when the block was left cached by a
      retraction (its prefix stays cached until popped), else ``CACHE.EVICT_LRU``;
    * ``num_free_cpu_blocks``: an abort of a swapped-out request (``ABORT.FREE``), else the step's swap
      out or in; ``cache_hits``: ``CACHE.HIT``; ``new_token_ratio``: ``ESTIMATE.RATIO``."""
    if name not in _MEMORY_FIELDS or spec is None:
        return None, request, None
    history = list(history)
    hit = set(_hit_admissions(spec))
    if name == "cache_hits":
        return "CACHE.HIT", request, None
    if name == "new_token_ratio":
        return "ESTIMATE.RATIO", request, None
    missed = _hit_differs(spec, engine)  # (a hit the two sides saw differently moves every figure after it)
    if name in ("blocks", "block_ids"):
        if request in hit or request == missed:
            return "CACHE.HIT", request, f"{request} was admitted with a prefix hit"
        if name == "block_ids" and engine is not None:
            same = one_release(spec, engine, request, history)
            if same is not None:
                return "KV.FREE_REVERSED", request, same
        return ("KV.NO_FREE_BLOCKS" if name == "blocks" else "KV.FREE_ORDER"), request, None
    if name == "num_free_blocks":
        if missed is not None:
            return "CACHE.HIT", missed, f"{missed}'s prefix hit differs: {(spec.cache_hits or {}).get(missed)} " \
                                        f"tokens for the spec, {(engine.cache_hits or {}).get(missed)} for the engine"
        if engine is not None and spec.ref_counts is not None and engine.ref_counts is not None \
                and spec.ref_counts != engine.ref_counts:  # a block's references differ: the event on that block
            return ref_rule(spec, engine, history)
        counts_agree = engine is None or (spec.blocks or {}) == (engine.blocks or {})
        if not counts_agree:  # an allocation differs: the first request whose count differs
            who = _involved("blocks", spec.blocks or {}, engine.blocks or {})
            return ("CACHE.HIT" if who in hit else "KV.NO_FREE_BLOCKS"), who, "its block count differs too"
        if spec.preempted:
            who = spec.preempted[0]
            return _preempt_rule(spec, who), who, f"{who} was preempted in this step and released its blocks"
        if spec.aborted:
            return "ABORT.FREE", spec.aborted[0], f"{spec.aborted[0]} was aborted in this step"
        if hit:
            who = sorted(hit)[0]
            return "CACHE.TOUCH", who, f"{who}'s prefix hit took blocks off the free queue"
        if spec.finished:
            return "KV.FREE_ORDER", spec.finished[0][0], f"{spec.finished[0][0]} finished and released its blocks"
        return "KV.NO_FREE_BLOCKS", request, None
    if name in ("num_evicted", "evicted"):
        ours, theirs = list(spec.evicted or []), list((engine.evicted if engine else None) or [])
        odd = [b for b in ours if b not in theirs] + [b for b in theirs if b not in ours]
        # blocks popped on one side only (a cached block popped, evicting, against an uncached one) too
        popped = sorted(_held(spec) ^ _held(engine)) if engine is not None else []
        for block in (odd + popped if history else ()):
            released = _last_release(history + [spec], block)  # (this step's release too)
            if released and released[1] == "RETRACT.TO_TAIL":
                return "RETRACT.TO_TAIL", released[0], f"block {block} was left cached when {released[0]} was retracted"
        return "CACHE.EVICT_LRU", request, None
    if name == "num_free_cpu_blocks":
        # (without the history — a lock-step diff sees one step — an abort is the likeliest release)
        gone = [rid for rid in spec.aborted if not history or _was_swapped(history, rid)]
        if gone:
            return "ABORT.FREE", gone[0], f"{gone[0]} was aborted while swapped out"
        if spec.swapped_out:
            return "SWAP.OUT", spec.swapped_out[0], None
        if spec.swapped_in:
            return "SWAP.IN", spec.swapped_in[0], None
        return "SWAP.OUT", request, None
    return None, request, None


def as_configured(rule: str | None, config: dict[str, Any]) -> str | None:
    """``rule`` as the trace's configuration spells it.  The memory blame names LRU eviction
    generically (``CACHE.EVICT_LRU``: it sees records, not the configuration); under
    ``cache_eviction=leaf-lru`` the spec's eviction rule is ``CACHE.EVICT_LEAF_LRU`` (SGLang's radix
    tree evicts whole leaves), so a report on an SGLang-profile trace names that one, and one request's
    release in another order names ``KV.FREE_IN_ORDER`` there (SGLang frees head first).  A different
    pick from the waiting queue (:data:`QUEUE_ORDER`) names the policy's order rule."""
    if rule not in ("CACHE.EVICT_LRU", "KV.FREE_REVERSED", "KV.FREE_ORDER", QUEUE_ORDER, QUEUE_ORDER_RESUMED,
                    "CACHE.REGISTER_AT_ALLOCATION", *_REJECT_RULES.values()):
        return rule
    from spec.config import ConfigError, resolve

    if rule == "CACHE.REGISTER_AT_ALLOCATION":  # the state field's default: when blocks enter the cache as configured
        try:
            cfg = resolve(config)
        except (ConfigError, TypeError, ValueError):
            return rule
        if cfg.cache_register != "allocation":
            return _REGISTER_RULES[cfg.cache_register]
        # (synchronous speculative decoding: accepted drafts' blocks enter at output or at the next allocation)
        return "SPEC.CACHE_AT_OUTPUT" if cfg.num_speculative_tokens and not cfg.async_scheduling else rule

    if rule == "KV.FREE_ORDER":  # under free_block_order=tail every release goes to the tail: KV.FREE_TO_TAIL
        try:
            return "KV.FREE_TO_TAIL" if resolve(config).free_block_order == "tail" else rule
        except (ConfigError, TypeError, ValueError):
            return rule

    if rule.startswith("REJECT."):  # under length_limits=clip one rule refuses at arrival: the input limit
        try:
            return "REJECT.INPUT_LIMIT" if resolve(config).length_limits == "clip" else rule
        except (ConfigError, TypeError, ValueError):
            return rule

    if rule in (QUEUE_ORDER, QUEUE_ORDER_RESUMED):  # the policy's order rule; QUEUE.AGING when aging moves keys
        try:
            cfg = resolve(config)
        except (ConfigError, TypeError, ValueError):
            return "QUEUE.FCFS"
        if cfg.policy == "fcfs" and rule == QUEUE_ORDER_RESUMED:  # a victim's place: the front, or the tail
            return "RETRACT.TO_TAIL" if cfg.admission == "estimate" else "QUEUE.VICTIM_TO_FRONT"
        return "QUEUE.AGING" if cfg.aging_steps else _QUEUE_RULES.get(cfg.policy, "QUEUE.FCFS")

    try:
        leaf = resolve(config).cache_eviction == "leaf-lru"
    except (ConfigError, TypeError, ValueError):
        return rule
    if not leaf:
        return rule
    return "CACHE.EVICT_LEAF_LRU" if rule == "CACHE.EVICT_LRU" else "KV.FREE_IN_ORDER"


def leaf_eviction_blame(name: str, spec: StepRecord | None, engine: StepRecord | None,
                        config: dict[str, Any]) -> str | None:
    """``CACHE.EVICT_LEAF_LRU`` for block ids that differ in a step whose evictions differ, under
    ``cache_eviction=leaf-lru``, else None.  The radix tree hands out content-free blocks oldest
    first (``KV.FREE_TO_RELEASE``), and which cached blocks lost their content in this step is the
    eviction's choice: the other blocks a request got are its symptom.  (Under ``block-lru`` the pop
    itself evicts, so the free queue's order, ``KV.FREE_ORDER``, stays the rule named.)"""
    if name != "block_ids" or spec is None or engine is None or spec.evicted is None or engine.evicted is None:
        return None
    if list(spec.evicted) == list(engine.evicted):
        return None
    from spec.config import ConfigError, resolve

    try:
        leaf = resolve(config).cache_eviction == "leaf-lru"
    except (ConfigError, TypeError, ValueError):
        return None
    return "CACHE.EVICT_LEAF_LRU" if leaf else None


#: Names a budget decision at its boundary can carry without saying which comparison decided it.
_GENERIC_BUDGET = ("ADMIT.NEW", "ADMIT.RESUMED", "BUDGET.TOKENS", None)


def budget_fit_blame(rule: str | None, name: str, spec: StepRecord | None, engine: StepRecord | None,
                     request: str | None, config: dict[str, Any]) -> str | None:
    """The budget gate at its boundary, for a report that names only the admission (``rule``:
    ``ADMIT.NEW``, ``ADMIT.RESUMED``, ``BUDGET.TOKENS`` or none): a request the spec admitted in
    this step with exactly the step's token budget left for it (the batch's tokens through it
    end on ``max_num_batched_tokens``), that the engine scheduled otherwise.  Whether a request
    asking for exactly what is left gets it is the gate's comparison: ``ADMIT.NO_CHUNKING`` with
    chunked prefill off, ``ADMIT.CHUNK_ONLY_FIRST`` behind the batch's first entry under
    ``prefill_chunking=first-continues``, else the token budget (``BUDGET.TOKENS``).  None otherwise
    (also for a request cut by a per-request cap: the uncapped tokens a gate compares are not logged)."""
    if rule not in _GENERIC_BUDGET or name not in _BUDGETED or spec is None or engine is None or request is None \
            or request not in list(spec.new) + list(spec.resumed):
        return None
    mine = dict(spec.scheduled).get(request)
    if mine is None or dict(engine.scheduled).get(request) == mine:
        return None
    from spec.config import ConfigError, resolve

    try:
        cfg = resolve(config)
    except (ConfigError, TypeError, ValueError):
        return None
    spent = 0
    for rid, n in spec.scheduled:
        spent += n
        if rid == request:
            break
    if spent != cfg.max_num_batched_tokens:
        return None
    if not cfg.enable_chunked_prefill:
        return "ADMIT.NO_CHUNKING"
    if cfg.prefill_chunking == "first-continues" and spec.scheduled[0][0] != request:  # (a batch of prefills only)
        return "ADMIT.CHUNK_ONLY_FIRST"
    return "BUDGET.TOKENS"


#: The rule behind each ``admit_stop`` word when the configuration is not known (vLLM V1's gates).
DEFAULT_GATE_RULES = {"budget": "BUDGET.TOKENS", "seqs": "ADMIT.MAX_NUM_SEQS", "whole": "ADMIT.NO_CHUNKING",
                      "first": "ADMIT.CHUNK_ONLY_FIRST", "estimate": "ESTIMATE.ADMIT", "pad": "SPEC.PAD_ADMISSION",
                      "blocks": "KV.NO_FREE_BLOCKS"}


def gate_order(cfg: Any | None) -> list[str]:
    """The ``admit_stop`` words in the order the spec tests a waiting head under ``cfg`` (None:
    vLLM V1's order): the budget, room in the batch, the configuration's admission checks in their
    own order (:func:`spec.config.admission_checks`), the padded decode, the blocks."""
    if cfg is None:
        return ["budget", "seqs", "whole", "first", "estimate", "pad", "blocks"]
    from spec.config import admission_checks
    from spec.scheduler import admit_stop_word

    return ["budget", "seqs", *(admit_stop_word(c) for c in admission_checks(cfg)), "pad", "blocks"]


def earlier_gate(a: str | None, b: str | None, cfg: Any | None) -> str | None:
    """Of two ``admit_stop`` words for the same head, the gate tested first: the side that stopped
    there failed it and the other side passed it, so that gate is where the two sides differ.
    None when either walk ran out of waiting requests (they did not stop at the same head)."""
    order = gate_order(cfg)
    if a not in order or b not in order:
        return None
    return min(a, b, key=order.index)


def gate_rule(word: str | None, cfg: Any) -> str | None:
    """The spec rule of the gate an ``admit_stop`` word names under ``cfg``: the budget
    (``BUDGET.TOKENS``), the plan's room rule, its no-chunking or estimate check, the padded
    decode, or its reservation rule for blocks (``KV.NO_FREE_BLOCKS``, ``ADMIT.FULL_SEQUENCE``,
    ``ADMIT.RESERVE_*``)."""
    from spec.config import step_plan
    from spec.scheduler import admit_stop_word

    plan = step_plan(cfg)
    checks: dict[str, str] = {}
    for check in plan.admission_checks:  # (the first check of each word: the one tested first)
        checks.setdefault(admit_stop_word(check), check)
    if word == "seqs":
        active = cfg.max_num_active_seqs and cfg.max_num_active_seqs < cfg.max_num_seqs
        return "ADMIT.MAX_NUM_ACTIVE_SEQS" if active else plan.room
    if word == "blocks":
        return plan.reservation
    return checks.get(word or "") or DEFAULT_GATE_RULES.get(word or "")


def _walk_admissions(record: StepRecord) -> list[str]:
    """The requests a step's walk of the waiting queue admitted, in batch order (not swap-ins)."""
    admitted = (set(record.new) | set(record.resumed)) - set(record.swapped_in)
    return [rid for rid, _ in record.scheduled if rid in admitted]


def stop_gate_blame(rule: str | None, name: str, spec: StepRecord | None, engine: StepRecord | None,
                    config: dict[str, Any]) -> str | None:
    """The admission gate at fault, for a report that names only the admission (``rule``:
    ``ADMIT.NEW``, ``ADMIT.RESUMED``, ``BUDGET.TOKENS`` or none) or the ``admit_stop`` state
    itself, when both logs say where their walk of the waiting queue stopped:

    * the engine admitted the spec's first requests and stopped short: the gate it stopped at,
      the same word as the spec's or not (it refused a head the spec admitted: ``seqs`` under a
      wrong count names ``ADMIT.MAX_NUM_SEQS``) — but a head the spec admitted with one token of
      its own, unpadded because its padded decode would pass ``max_model_len``, refused by the
      engine's budget or blocks names the padding (``SPEC.PAD_ADMISSION``: the engine padded it);
    * the engine admitted past the spec's stop: the spec's gate, which the engine let through (unless
      the engine admitted that head with a prefix hit: the hit may be what differs; a head the spec's
      estimate refused only for its own hit's locked blocks names ``ESTIMATE.OWN_HIT_LOCKED``);
    * the same admissions, stopped at different gates: the gate tested first (:func:`earlier_gate`).

    Admissions in another order are the queue's, not a gate's: None."""
    if spec is None or engine is None or spec.admit_stop is None or engine.admit_stop is None:
        return None
    if name != "admit_stop" and (name not in _BUDGETED or rule not in _GENERIC_BUDGET):
        return None
    from spec.config import ConfigError, resolve

    try:
        cfg = resolve(config)
    except (ConfigError, TypeError, ValueError):
        return None
    ours, theirs = _walk_admissions(spec), _walk_admissions(engine)
    if len(theirs) < len(ours) and ours[:len(theirs)] == theirs:
        word = engine.admit_stop
        if word in ("budget", "blocks", "pad") and _unpadded_past_context(spec, ours[len(theirs)], cfg):
            return "SPEC.PAD_ADMISSION"  # (the engine asked for the padded decode the context refuses)
    elif len(ours) < len(theirs) and theirs[:len(ours)] == ours:
        head = theirs[len(ours)]
        if spec.admit_stop == "estimate" and estimate_refusal(spec, "estimate", head) == "ESTIMATE.OWN_HIT_LOCKED":
            return "ESTIMATE.OWN_HIT_LOCKED"  # refused only for its own hit's locked blocks: the lock let it through
        if (engine.cache_hits or {}).get(head):
            return None  # (its prefix hit may be what let it through: the hit the spec saw is not logged)
        word = spec.admit_stop
    elif ours == theirs and spec.admit_stop != engine.admit_stop:
        word = earlier_gate(spec.admit_stop, engine.admit_stop, cfg)
    else:
        return None
    return (word == spec.admit_stop and estimate_refusal(spec, word)) or gate_rule(word, cfg)


def estimate_refusal(spec: StepRecord, word: str | None, request: str | None = None) -> str | None:
    """Where the spec's walk stopped at the memory estimate (``word``: ``estimate``) and the engine's
    went on past that test, the spec's own reason names which of the estimate's tests refused the
    head (``ESTIMATE.ADMIT``, ``ESTIMATE.IGNORE_EOS_RESERVE``, or ``ESTIMATE.OWN_HIT_LOCKED`` when
    the candidate's own hit tipped it): that test is the one the engine passed.  None otherwise."""
    if word != "estimate":
        return None
    return next((str(r["rule"]) for r in reversed(spec.reasons or ()) if r.get("rule") in _ESTIMATE_TESTS
                 and r.get("request") is not None and (request is None or r.get("request") == request)), None)


#: The estimate's tests of one candidate, each a refusal reason of the spec's.
_ESTIMATE_TESTS = ("ESTIMATE.ADMIT", "ESTIMATE.IGNORE_EOS_RESERVE", "ESTIMATE.OWN_HIT_LOCKED")


def _unpadded_past_context(spec: StepRecord, head: str, cfg: Any) -> bool:
    """Whether the spec admitted ``head`` with one token of its own and no dummy drafts because
    SPEC.PAD_ADMISSION's context test refused them (``hit + 1 + K + 1 > max_model_len``; the hit
    from the spec's ``cache_hits``, 0 where not logged)."""
    from spec.specdec import padded_context

    k = cfg.num_speculative_tokens
    if not k or head not in spec.new or dict(spec.scheduled).get(head) != 1 or (spec.drafts or {}).get(head):
        return False
    return padded_context((spec.cache_hits or {}).get(head, 0), k) > cfg.max_model_len


def configured_rule(rule: str | None, name: str, spec: StepRecord | None, engine: StepRecord | None,
                    request: str | None, config: dict[str, Any]) -> str | None:
    """The rule a report names for field ``name``, once the trace's configuration is known (a
    record-level blame sees none): block ids after another radix-tree eviction
    (:func:`leaf_eviction_blame`), a request the engine admitted or resumed in a step the spec's
    preemption held (:func:`held_after_preempt`), the admission gate where the two walks of the waiting queue
    stopped differently (:func:`stop_gate_blame`), an admission that ended exactly on the budget
    (:func:`budget_fit_blame`), else ``rule`` as the configuration spells it (:func:`as_configured`)."""
    return leaf_eviction_blame(name, spec, engine, config) or held_after_preempt(name, spec, engine, request, config) or \
        stop_gate_blame(rule, name, spec, engine, config) or \
        walk_skip_blame(rule, name, spec, engine, request, config) or \
        budget_fit_blame(rule, name, spec, engine, request, config) or as_configured(rule, config)


def held_after_preempt(name: str, spec: StepRecord | None, engine: StepRecord | None, request: str | None,
                       config: dict[str, Any]) -> str | None:
    """``ADMIT.NONE_AFTER_PREEMPT`` where the engine admitted or resumed (a swap-in too) ``request`` in
    a step in which the spec preempted and, holding admission after a preemption (the configuration's
    ``admit_after_preempt`` off), took nobody in: whatever rule the spec's step applied to its
    victims, the hold is what the engine broke.  None otherwise."""
    if name not in _BUDGETED or spec is None or engine is None or not spec.preempted or spec.new or spec.resumed:
        return None
    if request not in list(engine.new) + list(engine.resumed) or request in dict(spec.scheduled):
        return None
    from spec.config import ConfigError, resolve

    try:
        held = not resolve(config).admit_after_preempt
    except (ConfigError, TypeError, ValueError):
        return None
    return "ADMIT.NONE_AFTER_PREEMPT" if held else None


def walk_skip_blame(rule: str | None, name: str, spec: StepRecord | None, engine: StepRecord | None,
                    request: str | None, config: dict[str, Any]) -> str | None:
    """``RUN.PREEMPT_FOR_BLOCKS`` for a report that names a victim's give-back for a running request
    the engine left out, when the engine's batch with the victims' tokens still had room for it
    under max_num_batched_tokens (:func:`walk_skipped`); None otherwise."""
    if name != "scheduled" or not str(rule or "").startswith("PREEMPT.VICTIM_"):
        return None
    from spec.config import ConfigError, resolve

    try:
        budget = resolve(config).max_num_batched_tokens
    except (ConfigError, TypeError, ValueError):
        return None
    return "RUN.PREEMPT_FOR_BLOCKS" if walk_skipped(spec, engine, request, budget) else None


def ended_rule(history: Iterable[StepRecord], request: str | None) -> str | None:
    """The spec rule that ended ``request`` before this step (it was aborted, rejected or finished in
    the spec's ``history``), or None: an engine that still runs it broke that rule, whatever the
    step's own reasons say about the requests it crowded out."""
    for rec in history:
        if request in rec.aborted:  # the spec's own abort rule for it (a cut prefill freed at once, ...)
            mine = [str(r.get("rule")) for r in rec.reasons or () if r.get("request") == request
                    and str(r.get("rule", "")).startswith("ABORT.")]
            return mine[0] if mine else "ABORT.FREE"
        for rid, why in list(rec.finished) + list(rec.rejected):
            if rid == request:
                mine = [str(r.get("rule")) for r in rec.reasons or () if r.get("request") == request
                        and str(r.get("rule", "")).startswith(("STOP.", "REJECT.", "SLO.REFUSE"))]
                # (a log without reasons, e.g. another engine's as the reference: a refusal's own reason)
                return mine[0] if mine else _REJECT_RULES.get(why) if (rid, why) in rec.rejected else None
    return None


def ghost(spec: StepRecord | None, engine: StepRecord | None, history: list[StepRecord]) -> tuple[str, str, str] | None:
    """``(field, request, rule)`` for a request the engine runs at this step (scheduled, admitted or
    resumed), or still holds (its optional ``computed`` state: a preempted request it keeps queued,
    which counts towards the long-prefill cap's eligible requests), that the spec had already ended
    (:func:`ended_rule`) before or at this step (an abort comes before the step's schedule), or None."""
    history = list(history) + ([spec] if spec is not None else [])
    if engine is None or not history:
        return None
    mine = {r for r, _ in (spec.scheduled if spec else ())}
    held = [r for r in (engine.computed or {}) if spec is None or r not in (spec.computed or {})]
    for name, ids in (("resumed", engine.resumed), ("new", engine.new), ("scheduled", [r for r, _ in engine.scheduled]),
                      ("computed", held)):
        for rid in ids:
            rule = None if rid in mine else ended_rule(history, rid)
            if rule is not None:
                return name, rid, rule
    return None


#: The stop rule of each finish reason that a sampled token decides (the rest are lengths: STOP.LENGTH).
_TOKEN_STOPS = {"eos": "STOP.EOS", "stop_token": "STOP.STOP_TOKEN"}


def _finish_reasons(spec: StepRecord, engine: StepRecord, request: str | None) -> tuple[str | None, str | None]:
    """Why each side finished ``request`` in this step (None where it did not)."""
    return dict(map(tuple, spec.finished)).get(request), dict(map(tuple, engine.finished)).get(request)


def _token_stop_between(spec: StepRecord, engine: StepRecord, request: str | None) -> str | None:
    """Both sides finish ``request`` in this step for different reasons, one of them a token's (EOS, a
    stop token) and the other a length: the token's stop rule — the side that stopped on the token
    fired it where the other did not (an EOS an ``ignore_eos`` request must not stop on), or the
    other side missed it or put the length first (the token rules state their order); None otherwise."""
    a, b = _finish_reasons(spec, engine, request)
    if a is None or b is None or a == b:
        return None
    tokens = [_TOKEN_STOPS[w] for w in (a, b) if w in _TOKEN_STOPS]
    return tokens[0] if len(tokens) == 1 else None


def pending_abort_stop(spec: StepRecord, engine: StepRecord, request: str | None) -> str | None:
    """``ABORT.AFTER_NEXT_SAMPLE`` when one side finishes ``request`` by a stop rule in this step and
    the other does not, and the spec cited that rule for it in this step: its client abort was
    pending, so the token it samples is freed as an abort and no stop rule applies to it.  None
    otherwise."""
    a, b = _finish_reasons(spec, engine, request)
    if request is None or (a is None) == (b is None):
        return None
    cited = any(r.get("rule") == "ABORT.AFTER_NEXT_SAMPLE" and r.get("request") == request for r in spec.reasons or ())
    return "ABORT.AFTER_NEXT_SAMPLE" if cited else None


def stop_in_drafts(spec: StepRecord, engine: StepRecord, request: str | None) -> str | None:
    """``SPEC.STOP_IN_DRAFTS`` when the two sides end ``request`` differently (another length
    reason, or one side only) in a step whose verification accepted some of its drafts (the
    spec's ``accepted``, or its ``SPEC.ACCEPT`` reason): its outputs are appended one by one under
    the stop rules, and the first stop drops the rest.  None otherwise."""
    a, b = _finish_reasons(spec, engine, request)
    if request is None or a == b:
        return None
    accepted = (spec.accepted or {}).get(request)
    if accepted is None:
        cited = [r for r in spec.reasons or () if r.get("rule") == "SPEC.ACCEPT" and r.get("request") == request]
        accepted = 0 if not cited or str(cited[0].get("text", "")).startswith("0 of") else 1
    return "SPEC.STOP_IN_DRAFTS" if accepted > 0 else None


def _drafts_differ(spec: StepRecord, engine: StepRecord, request: str) -> bool:
    """Both logs carry ``drafts`` and schedule ``request``, with other draft counts for it."""
    if spec.drafts is None or engine.drafts is None or request not in dict(spec.scheduled) \
            or request not in dict(engine.scheduled):
        return False
    return spec.drafts.get(request, 0) != engine.drafts.get(request, 0)


def _retraction_reordered(spec: StepRecord, engine: StepRecord, history: Iterable[StepRecord]) -> bool:
    """Whether both sides batched the same requests with the same token counts in another order, and
    the spec retracted a request at this step or before: SGLang's batch then runs in retraction
    order (RETRACT.BATCH_ORDER), which the per-request RUN.* reasons do not say."""
    if spec.scheduled == engine.scheduled or sorted(spec.scheduled) != sorted(engine.scheduled):
        return False
    return any(str(r.get("rule", "")).startswith("RETRACT.VICTIM") for rec in [*history, spec] for r in rec.reasons or ())


def _preempted_since_sample(history: Iterable[StepRecord], request: str) -> bool:
    """Whether ``request`` was preempted after the last step in which it sampled (the spec's records)."""
    for rec in reversed(list(history)):
        if request in rec.preempted:
            return True
        if request in rec.sampled:
            return False
    return False


def decision_cause(name: str, spec: StepRecord | None, engine: StepRecord | None, request: str | None,
                   previous: StepRecord | None = None, history: Iterable[StepRecord] = ()) -> str | None:
    """The rule behind the spec's value when the two sides decided the same thing differently in
    degree, not in kind — the request's own ``RUN.*`` / ``ADMIT.*`` reason says only that it ran:

    * ``finished``, a request one side stops and the other does not while its client abort is pending:
      ``ABORT.AFTER_NEXT_SAMPLE`` (no stop rule applies to the token it samples then);
    * ``finished``, a request the two sides end differently in a step that accepted some of its drafts:
      ``SPEC.STOP_IN_DRAFTS`` (the first stop among its appended outputs drops the rest);
    * ``scheduled``, a request the engine schedules twice in a step where a request preempted itself:
      the walk's going on after it (``RUN.PREEMPT_FOR_BLOCKS``);
    * ``scheduled``, the request on both sides with other draft counts (``drafts``, when both logs carry
      it): the drafts' rule — an admission's dummy drafts (``SPEC.PAD_ADMISSION``), discarded at a
      preemption since it last sampled (``SPEC.PREEMPT_DISCARDS``), else how drafts are scheduled
      (``SPEC.DRAFT_SCHEDULE``);
    * ``scheduled``, the same requests and counts on both sides in another order, after the spec
      retracted a request: the batch's retraction order (``RETRACT.BATCH_ORDER``);
    * ``scheduled``, the request on both sides with a different token count: its prefix hit when the
      two sides' hits differ (``CACHE.HIT``), else the token rule (``BUDGET.TOKENS``); a continuing
      request on one side only, where the other side's batch stops just before it: the token rule;
    * ``resumed``, both sides resuming but not the same requests in the same order, or the engine
      resuming a request the spec gives no reason about at this step (never reached: another was
      ahead of it): the order preempted requests wait in (``QUEUE.VICTIM_TO_FRONT``);
    * any of ``scheduled`` / ``new`` / ``resumed`` in a step whose per-request token cap differs
      (``token_cap``, when both logs carry it): the cap rule (``BUDGET.LONG_PREFILL``), whose
      statement says who is capped and who, alone, is not; the same for ``scheduled`` where both
      logs apply the same cap and the engine gave the request more than it, the spec not;
    * ``scheduled`` / ``new`` / ``resumed``, a request the spec admits where the engine admits nobody, right after a
      step in which the spec held admission (``previous``, the spec's record before): the spec released
      the hold the engine kept (``ESTIMATE.HOLD_UNTIL_DEPARTURE``);
    * ``scheduled`` / ``new`` / ``resumed`` where the spec's SLO admission control deferred a request
      (``history``: the spec's records before this step) that the engine took ahead of the spec's pick,
      or deferred one in this very step, admitted more than the engine and took neither side's head:
      the deferral re-ordered the queue (``SLO.DEFER``) — an engine that never defers blocks on it;
    * any of ``scheduled`` / ``new`` / ``resumed`` in a step that began with aborts of requests holding
      blocks, the engine ending it with fewer free blocks than the spec, short by no more than those
      requests held: the aborts' release (``ABORT.FREE``), which the step's batch was built after."""
    if spec is None or engine is None or request is None:
        return None
    if name in _BUDGETED and _abort_freed_less(spec, engine, previous):
        return "ABORT.FREE"
    if name in _BUDGETED and _deferral_decided(spec, engine, request, history):
        return "SLO.DEFER"
    if name in _BUDGETED and previous is not None and request in list(spec.new) + list(spec.resumed) \
            and not engine.new and not engine.resumed \
            and any(r.get("rule") == "ESTIMATE.HOLD_UNTIL_DEPARTURE" for r in previous.reasons or ()):
        return "ESTIMATE.HOLD_UNTIL_DEPARTURE"
    if name in _BUDGETED and spec.token_cap is not None and engine.token_cap is not None \
            and spec.token_cap != engine.token_cap:  # the per-request cap differs: the cap rule decided it
        return "BUDGET.LONG_PREFILL"
    if name == "scheduled" and spec.token_cap and spec.token_cap == engine.token_cap \
            and dict(spec.scheduled).get(request, 0) <= spec.token_cap < dict(engine.scheduled).get(request, 0):
        return "BUDGET.LONG_PREFILL"  # (the engine gave it more than the cap both say the step applied)
    if name == "finished":
        token_stop = (pending_abort_stop(spec, engine, request) or _token_stop_between(spec, engine, request)
                      or stop_in_drafts(spec, engine, request))
        if token_stop is not None:
            return token_stop
    if name == "scheduled" and [r for r, _ in engine.scheduled].count(request) > 1 and _self_preempted(spec):
        return "RUN.PREEMPT_FOR_BLOCKS"  # (the walk that went on after a self-preemption reached it twice)
    if name == "scheduled" and _drafts_differ(spec, engine, request):  # its drafts are what differ in its count
        if request in spec.new or request in spec.resumed:  # (an admission's drafts are dummies: the padding's)
            return "SPEC.PAD_ADMISSION"
        return "SPEC.PREEMPT_DISCARDS" if _preempted_since_sample(history, request) else "SPEC.DRAFT_SCHEDULE"
    if name == "scheduled" and _retraction_reordered(spec, engine, history):
        return "RETRACT.BATCH_ORDER"
    if hit_differs(spec, engine, request):  # admitted on both sides, with another prefix hit: all else follows
        return "CACHE.HIT"
    if name in _BUDGETED and _earlier_hit_differs(spec, engine, request):  # (its blocks decided what came after)
        return "CACHE.HIT"
    order = queue_order_cause(spec, engine, request) if name in _BUDGETED else None
    if order is not None:
        return order
    own = field_rule(name, spec, engine, request)
    if own is not None:
        return own
    if name == "scheduled":
        a, b = dict(spec.scheduled), dict(engine.scheduled)
        if request in a and request not in b and _after_self_preemption(spec, request):
            return "RUN.PREEMPT_FOR_BLOCKS"  # (the spec's walk went on past a self-preemption to it)
        if (request in a) != (request in b) and _walk_ended_early(spec, engine, request):
            # (after a request preempted itself, whether the walk goes on is the preemption rule's; a
            # spec walk that stopped at max_num_seqs scheduled says so in the request's own reason)
            if _self_preempted(spec):
                return "RUN.PREEMPT_FOR_BLOCKS"
            mine = {r.get("rule") for r in spec.reasons or () if r.get("request") == request}
            return "BATCH.MAX_NUM_SEQS_PER_STEP" if "BATCH.MAX_NUM_SEQS_PER_STEP" in mine else "BUDGET.TOKENS"
        if request not in a or request not in b or a[request] == b[request]:
            return None
        hit_a, hit_b = (spec.cache_hits or {}).get(request), (engine.cache_hits or {}).get(request)
        if request in list(spec.new) + list(spec.resumed) and hit_b is not None and hit_a != hit_b:
            return "CACHE.HIT"
        return "BUDGET.TOKENS"
    if name == "resumed" and list(spec.resumed) != list(engine.resumed):
        considered = {r.get("request") for r in spec.reasons or ()}
        if (spec.resumed and engine.resumed) or (request in engine.resumed and request not in considered):
            return "QUEUE.VICTIM_TO_FRONT"  # (the spec never reached it this step: another victim was ahead)
    return None


def _abort_freed_less(spec: StepRecord, engine: StepRecord, previous: StepRecord | None) -> bool:
    """Whether this step's aborts (the same on both sides) let the engine keep blocks the spec freed:
    the aborted requests held blocks at the previous step's end, and the engine ends this step with
    fewer free blocks than the spec, short by at most what they held."""
    if not spec.aborted or list(spec.aborted) != list(engine.aborted) or previous is None or not previous.blocks:
        return False
    if spec.num_free_blocks is None or engine.num_free_blocks is None:
        return False
    held = sum(previous.blocks.get(rid, 0) for rid in spec.aborted)
    return 0 < spec.num_free_blocks - engine.num_free_blocks <= held


def _deferral_decided(spec: StepRecord, engine: StepRecord, request: str, history: Iterable[StepRecord]) -> bool:
    """:func:`decision_cause`'s ``SLO.DEFER`` case: the spec deferred a request the engine took
    instead of the spec's pick (in an earlier step: still waiting since), or deferred one in this
    step that neither side took while the spec admitted more than the engine."""
    a, b = list(spec.resumed) + list(spec.new), list(engine.resumed) + list(engine.new)
    if request not in a + b or a == b:
        return False
    now = _deferrals(spec)
    if len(a) > len(b) and any(d not in a + b for d in now):
        return True
    deferred: set[str] = set()
    for rec in history:
        deferred |= _deferrals(rec)
        deferred -= set(rec.new) | set(rec.resumed)
    taken = [y for x, y in zip(a, b) if x != y] + b[len(a):]
    if taken and not a and taken[0] not in now and _refused_now(spec, taken[0]):
        return False  # (deferred before, but a gate refused it in a step admitting nobody: after another
        # admission the refusal could be the deferred order's doing)
    return bool(taken) and taken[0] in deferred | now


def _refused_now(record: StepRecord, request: str) -> bool:
    """Whether the record gives ``request`` a reason of its own other than its arrival, its queue
    place or its SLO bookkeeping: the step's admission walk tested it (a block, budget or
    whole-sequence gate refused it)."""
    return any(r.get("request") == request and not str(r.get("rule", "")).startswith(("SLO.", "ARRIVE.", "QUEUE.", "EDF."))
               for r in record.reasons or ())


def _deferrals(record: StepRecord) -> set[str]:
    """The requests the record's SLO admission control deferred (``SLO.DEFER`` reasons)."""
    return {r.get("request") for r in record.reasons or () if r.get("rule") == "SLO.DEFER"}


def hit_differs(spec: StepRecord | None, engine: StepRecord | None, request: str | None) -> bool:
    """Whether both sides admitted (or resumed) ``request`` at this step with different prefix hits
    (``cache_hits``, memory levels): whatever else differs about it in that step — its tokens, a
    finish its first sample brings, the sample itself — follows from the hit (``CACHE.HIT``; a salt
    ignored in the hash chain shows so, as a hit the spec does not have)."""
    if spec is None or engine is None or request is None or spec.cache_hits is None or engine.cache_hits is None:
        return False
    if request not in list(spec.new) + list(spec.resumed) or request not in list(engine.new) + list(engine.resumed):
        return False
    return spec.cache_hits.get(request, 0) != engine.cache_hits.get(request, 0)


def _earlier_hit_differs(spec: StepRecord, engine: StepRecord, request: str | None) -> bool:
    """Whether a request admitted on both sides before ``request`` in the spec's batch of this step had
    another prefix hit (:func:`hit_differs`): the blocks that hit took or left decided the admissions
    after it (a request that must not read the cache but did, skip_prefix_cache)."""
    order = [rid for rid, _ in spec.scheduled]
    if request not in order:
        return False
    return any(hit_differs(spec, engine, rid) for rid in order[:order.index(request)])


#: What :func:`queue_order_cause` names: the waiting queue's order, whose rule depends on the policy
#: (:func:`as_configured`), for a new request or a preempted one taken back.
QUEUE_ORDER, QUEUE_ORDER_RESUMED = "QUEUE.ORDER", "QUEUE.ORDER_RESUMED"
_QUEUE_RULES = {"fcfs": "QUEUE.FCFS", "priority": "QUEUE.PRIORITY", "spf": "QUEUE.SPF", "sprpt": "QUEUE.SPRPT",
                "edf": "QUEUE.EDF", "vtc": "VTC.PICK"}


def queue_order_cause(spec: StepRecord | None, engine: StepRecord | None, request: str | None) -> str | None:
    """The queue order (:data:`QUEUE_ORDER`, or :data:`QUEUE_ORDER_RESUMED` where the first request
    the two sides take differently was preempted) when both sides took requests from the waiting queue
    at this step (the spec's counting the request its admission stopped at, where the engine took
    more: :func:`_blocked_head`), preempting none, and at some position not the same one, and
    ``request`` is one of them: the queue put another request first; whatever the request's own
    ``ADMIT.*`` reason says, the order decided it."""
    if spec is None or engine is None or spec.preempted or engine.preempted:
        return None
    a, b = list(spec.resumed) + list(spec.new), list(engine.resumed) + list(engine.new)
    if not b:
        return None
    a, b = _admission_order(spec, a), _admission_order(engine, b)
    head = _blocked_head(spec, a) if len(a) < len(b) else None
    if head is not None:  # the spec's admission stopped at its head; the engine took another there
        a.append(head)
    if request not in a + b:
        return None
    taken = [(x, y) for x, y in zip(a, b) if x != y]  # (where both took one: a longer tail is the tests' business)
    if not taken:
        return None
    x, y = taken[0]
    if x in spec.swapped_in or y in engine.swapped_in:  # (resumed from the CPU: the swapped queue's order)
        return "SWAP.IN"
    if y in _deferrals(spec):
        return "SLO.DEFER"  # (the engine took a request the spec deferred behind the rest in this very step)
    return QUEUE_ORDER_RESUMED if x in spec.resumed or y in engine.resumed else QUEUE_ORDER


def _blocked_head(record: StepRecord, taken: list[str]) -> str | None:
    """The request at which the step's admission stopped (head-of-line blocking): the first request
    not ``taken`` that an admission test refused in the step's reasons, or None."""
    for r in record.reasons or ():
        rule, rid = str(r.get("rule", "")), r.get("request")
        if rid is not None and rid not in taken and rule.startswith(_REFUSALS) and rule not in _ADMITTED:
            return rid
    return None


#: Reasons that refuse a waiting request's admission (a request admitted has one of :data:`_ADMITTED`).
_REFUSALS, _ADMITTED = ("ADMIT.", "KV.NO_FREE_BLOCKS", "ESTIMATE.ADMIT", "ESTIMATE.OWN_HIT_LOCKED"), ("ADMIT.NEW", "ADMIT.RESUMED")


#: The rejection rule of each reason a log gives for refusing a request at arrival.
_REJECT_RULES = {"prompt_too_long": "REJECT.PROMPT_TOO_LONG", "never_fits": "REJECT.NEVER_FITS"}
#: When blocks enter the prefix cache, by ``cache_register`` (:func:`as_configured`).
_REGISTER_RULES = {"computed": "CACHE.REGISTER_WHEN_COMPUTED", "prefill-and-finish": "CACHE.REGISTER_PREFILL_AND_FINISH"}


def field_rule(name: str, spec: StepRecord, engine: StepRecord, request: str | None) -> str | None:
    """The one rule that decides ``name`` for ``request`` where the spec gives no reason of that rule
    (the engine did it, the spec did not): a swap-in or swap-out (``SWAP.IN`` / ``SWAP.OUT``), and a
    rejection at arrival, by the engine's reason (``REJECT.*``; the spec queued it, so its own
    reason says ``ARRIVE.QUEUED``), or SLO admission control's refusal, by its feasibility test
    (``SLO.FEASIBLE``); the same refusals listed in another order, the waiting queue's order
    (:data:`QUEUE_ORDER`: SLO admission control refuses in queue order)."""
    mine = [str(r.get("rule", "")) for r in spec.reasons or () if r.get("request") == request]
    if name in ("swapped_in", "swapped_out"):
        own = "SWAP.IN" if name == "swapped_in" else "SWAP.OUT"
        return None if own in mine else own
    if name == "rejected" and spec.rejected and sorted(map(tuple, spec.rejected)) == sorted(map(tuple, engine.rejected)):
        return QUEUE_ORDER  # the same refusals in another order: a step lists its refusals in queue order
    if name == "rejected" and not any(r.startswith("REJECT.") for r in mine):
        slo = [r for r in mine if r.startswith("SLO.")]  # the spec's own SLO admission decision (it deferred it)
        why = dict(engine.rejected).get(request)  # (SLO admission control's refusal: the feasibility test's)
        return slo[0] if slo else "SLO.FEASIBLE" if why == "slo_infeasible" else _REJECT_RULES.get(why)
    return None


def _admission_order(record: StepRecord, admitted: list[str]) -> list[str]:
    """The admitted requests in the order the step's batch lists them (the order they were taken)."""
    where = {rid: i for i, (rid, _) in enumerate(record.scheduled)}
    return sorted(admitted, key=lambda rid: where.get(rid, len(where)))


def _walk_ended_early(spec: StepRecord, engine: StepRecord, request: str) -> bool:
    """Whether one side's batch is the other's cut short at ``request``, a continuing request (not
    admitted, resumed or preempted on either side): the same requests with the same tokens before
    it, then one side's walk over the running requests stopped — the token budget reached it on
    one side only."""
    short, long_ = sorted((list(spec.scheduled), list(engine.scheduled)), key=len)
    if long_[: len(short)] != short or long_[len(short)][0] != request:
        return False
    return not any(request in ids for rec in (spec, engine) for ids in (rec.new, rec.resumed, rec.preempted))


def _self_preempted(record: StepRecord) -> bool:
    """Whether a running request preempted itself in this step (the spec's ``RUN.PREEMPT_FOR_BLOCKS``
    reason, logged only then): the running walk then ends, or goes on (priority_self_preempt)."""
    return any(r.get("rule") == "RUN.PREEMPT_FOR_BLOCKS" for r in record.reasons or ())


def _after_self_preemption(record: StepRecord, request: str) -> bool:
    """Whether the spec's running walk reached ``request`` (its ``RUN.*`` reason) after a request
    preempted itself in this step (``RUN.PREEMPT_FOR_BLOCKS``: under priority_self_preempt=continue)."""
    seen = False
    for r in record.reasons or ():
        rule = str(r.get("rule", ""))
        if rule == "RUN.PREEMPT_FOR_BLOCKS":
            seen = True
        elif seen and r.get("request") == request and rule.startswith(("RUN.DECODE", "RUN.PREFILL_CHUNK")):
            return True
    return False


#: Fields whose value for a request is the tokens (or the admission) the step's budget left it.
_BUDGETED = ("scheduled", "new", "resumed")


def _victims_before(spec: StepRecord, request: str) -> tuple[int, int] | None:
    """``(given back, served)``: the tokens this step's victims were served before they were
    preempted ahead of ``request``'s own ``RUN.*`` reason, and the tokens ``request`` was served
    (from the reasons' ``"N tokens"``); None when ``request`` was not served after a victim."""
    served: dict[str, int] = {}
    given_back, victim = 0, False
    for r in spec.reasons or ():
        rule, rid = str(r.get("rule", "")), r.get("request")
        if rule.startswith("PREEMPT.VICTIM_"):
            given_back, victim = given_back + served.pop(rid, 0), True
        elif rule.startswith(("RUN.DECODE", "RUN.PREFILL_CHUNK")) and rid is not None:
            got = re.match(r"(\d+) tokens", str(r.get("text", "")))
            served[rid] = int(got[1]) if got else 0
            if rid == request:
                return (given_back, served[rid]) if victim else None
    return None


def walk_skipped(spec: StepRecord | None, engine: StepRecord | None, request: str | None,
                 budget: int | None = None) -> bool:
    """Whether the engine left out of its batch a running request the spec served after a
    preemption of the same step, where the budget cannot explain it: the spec served it more
    tokens than the victims gave back, or (``budget``: max_num_batched_tokens) the engine's batch
    plus the victims' tokens left room for it.  The running phase's walk, which goes on with the
    next request once the victim is out (``RUN.PREEMPT_FOR_BLOCKS``), skipped it — an engine that
    only kept the victims' tokens (``budget_giveback_rule``) would still have served it."""
    if spec is None or engine is None or request is None or request in dict(engine.scheduled):
        return False
    found = _victims_before(spec, request)
    if found is None or found[0] == 0:
        return False
    given_back, served = found
    room = budget is not None and sum(n for _, n in engine.scheduled) + given_back + served <= budget
    return given_back < served or room


def budget_giveback_rule(record: StepRecord | None, request: str | None) -> tuple[str, str] | None:
    """``(victim rule, victim)`` when the spec's tokens for ``request`` at this step came after a
    victim scheduled earlier in the same step gave its tokens back to the budget: the step's
    reasons show the victim served (``RUN.*``) and then preempted (its victim rule, whose statement
    says its tokens are given back), before ``request`` got its own tokens — ``request`` may be the
    victim itself, resumed in the same step (``admit_after_preempt``).  The budget that
    request was given is then the victim rule's doing (issue 18: a priority preemption in a step
    whose budget is spent), not the request's own ``RUN.*`` / ``ADMIT.*`` rule."""
    reasons = list((record.reasons if record else None) or [])
    served: set[str] = set()
    found = None
    for r in reasons:
        rule, rid = str(r.get("rule", "")), r.get("request")
        if rid == request and found is not None and rule.startswith(("RUN.", "ADMIT.")):
            return found
        if rule.startswith(("RUN.DECODE", "RUN.PREFILL_CHUNK")):
            served.add(rid)
        elif rule.startswith(("PREEMPT.VICTIM_", "RETRACT.VICTIM_")) and rid in served:  # (the victim itself too,
            # re-admitted later in the step with the tokens it gave back: admit_after_preempt)
            found = found or (rule, rid)
    return None


def spec_reason(record: StepRecord | None, request: str | None, field_name: str = "") -> tuple[str | None, str | None, list[dict]]:
    """The spec's rule id and text for ``request`` at this step, plus all the
    step's reasons as context.

    Of the reasons about ``request``, the first whose rule family explains
    ``field_name`` wins (a request admitted and then finished in one step has
    an ``ADMIT.*`` and a ``STOP.*`` reason); otherwise the last one.
    """
    reasons = list((record.reasons if record else None) or [])
    mine = [r for r in reasons if request is not None and r.get("request") == request]
    pick = None
    for family in _FAMILIES.get(field_name, ()):
        pick = next((r for r in mine if str(r.get("rule", "")).startswith(family)), None)
        if pick is not None:
            break
    if pick is None and mine:
        pick = mine[-1]
    if pick is None:
        return None, None, reasons
    return pick.get("rule"), pick.get("text"), reasons


def _wrong_token(spec: StepRecord | None, engine: StepRecord | None, name: str) -> Divergence | None:
    """SAMPLE.SCRIPTED: an engine that samples the trace's script (scheduler-only) sampled another
    token than the spec, which samples the script itself, for a request both sampled in the step."""
    if spec is None or engine is None:
        return None
    for rid in sorted(set(spec.sampled) & set(engine.sampled)):
        if spec.sampled[rid] != engine.sampled[rid]:
            return Divergence(spec.step, "sampled", {rid: spec.sampled[rid]}, {rid: engine.sampled[rid]}, rid,
                              "SAMPLE.SCRIPTED", f"the trace's script gives {rid} token {spec.sampled[rid]} here",
                              DECISION, name)
    return None


def _pre_decision_divergence(step: int, s: StepRecord | None, e: StepRecord | None, level: str, engine: str,
                             history: list[StepRecord]) -> Divergence | None:
    """A :data:`PRE_DECISION_FIELDS` state field that differs at this step, unless what comes before
    it in the step differs too: the arrivals' rejections, the aborts, or a request the engine still
    counts after the spec ended it (each moves the queue lengths the cap is computed from)."""
    if s is None or e is None or s.rejected != e.rejected or sorted(s.aborted) != sorted(e.aborted):
        return None
    if ghost(s, e, history) is not None:
        return None
    return _state_divergence(step, s, e, level, engine, lambda: history, PRE_DECISION_FIELDS)


def first_divergence(spec_records: Iterable[StepRecord], engine_records: Iterable[StepRecord],
                     level: str = "exact", engine: str = "engine", history: Iterable[StepRecord] = (),
                     tokens: bool = False) -> Divergence | None:
    """The first step and field where the logs differ at ``level``, or ``None``.

    ``history``: the spec's records before the first of ``spec_records``, not compared (a lock-step
    replay diffs one step at a time): the blame of a memory or state field looks back into them.
    ``tokens``: the engine samples the trace's script, as the spec does, so token values are
    compared too (``SAMPLE.SCRIPTED``), not only which requests sampled.
    Raises :class:`LevelError` if a log record lacks the fields ``level`` compares.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r} (known: {', '.join(LEVELS)})")
    spec_records, engine_records = list(spec_records), list(engine_records)
    _check_level(spec_records, level, "spec")
    _check_level(engine_records, level, engine)
    by_spec = {r.step: r for r in spec_records}
    by_engine = {r.step: r for r in engine_records}
    before = list(history)
    names = fields_at(level)
    for step in sorted(set(by_spec) | set(by_engine)):
        s, e = by_spec.get(step), by_engine.get(step)
        s_rec, e_rec = s or StepRecord(step), e or StepRecord(step)
        wrong = _wrong_token(s, e, engine) if tokens and "sampled" in names else None
        if wrong is not None:  # a token the script did not give: the cause of whatever else differs
            return wrong
        early = _pre_decision_divergence(step, s, e, level, engine, before + [by_spec[k] for k in sorted(by_spec) if k < step])
        if early is not None:  # state the step fixed before deciding: the cause of what it then decided
            return early
        for name in names:
            a, b = _value(s_rec, name, s is None), _value(e_rec, name, e is None)
            if a is None or b is None or a == b:
                continue
            if name == "sampled":  # report the token map, compared by its keys
                a, b = dict(s_rec.sampled), dict(e_rec.sampled)
                request = next(iter(sorted(set(a) ^ set(b))), None)
            else:
                request = _involved(name, a, b)
            rule, text, context = spec_reason(s, request, name)
            history = before + [by_spec[k] for k in sorted(by_spec) if k < step]
            late = ghost(s, e, history) if name in _BUDGETED else None
            if late is not None:  # the engine runs a request the spec had ended: the rule that ended it
                return Divergence(step, late[0], a if late[0] == name else _value(s_rec, late[0], s is None),
                                  b if late[0] == name else _value(e_rec, late[0], e is None), late[1], late[2],
                                  f"the spec ended {late[1]} before this step ({late[2]})", DECISION, engine, context)
            giveback = budget_giveback_rule(s, request) if name in _BUDGETED else None
            skipped = giveback is not None and name == "scheduled" and walk_skipped(s, e, request)
            previous = history[-1] if history and history[-1].step < step else None
            degree = decision_cause(name, s, e, request, previous, history) if giveback is None else None
            if skipped:  # not its budget: the walk never reached it
                rule, text = "RUN.PREEMPT_FOR_BLOCKS", f"{request} runs on after this step's preemption; the engine's running phase skipped it"
            elif giveback is not None:
                rule, text = giveback[0], f"{giveback[1]} was preempted after it was scheduled in this step: its tokens went back to the budget"
            elif degree is not None:
                rule, text = degree, f"the spec's {name} for {request} under {degree} ({text or 'no reason recorded'})"
            if name in _MEMORY_FIELDS:  # the memory event behind the value, not what the request did
                cause, who, why = memory_rule(name, s, e, request, history)
                if cause is not None:
                    rule, request = cause, who if who is not None else request
                    text = why or f"the spec's {name} after step {step}"
            return Divergence(step, name, a, b, request, rule, text, DECISION, engine, context)
        state = _state_divergence(step, s, e, level, engine, lambda: before + [by_spec[k] for k in sorted(by_spec) if k < step])
        if state is not None:
            return state
    return None
