"""The discrete-event simulator: a trace with arrivals in seconds, run step by step in modelled time.

:func:`spec.protocol.drive` replays a trace whose arrivals are *steps*.  Real
traces carry *seconds*; this driver turns the spec (or any engine of the
protocol) into a serving simulator by giving every step a duration from a
:class:`~spec.costmodel.CostModel` (DESIGN.md §2.1):

1. ``now`` is when the next step starts (integer nanoseconds, from 0).
2. Every request with ``arrival_time <= now`` is added, in arrival order
   (ties keep trace order); then the aborts due at this step number.
3. If nothing is waiting or running, the clock jumps to the next arrival
   (idle time executes no step), and step 2 is repeated.
4. The engine runs one step.  The driver reads the batch's shape from the
   step record (:class:`BatchTracker`), and the step takes
   ``cost.step_ns(shape)``; a step that scheduled nothing takes no time.
5. Everything the record reports happens at the step's *end*: sampled tokens
   are emitted, finished requests complete, ``now`` advances to the end.
   Under async scheduling (a record with ``outputs_step``) the record's
   ``sampled`` and ``finished`` are those of step ``outputs_step``, the batch
   that was in flight: a token is emitted when the step that sampled it ends,
   which is when vLLM's engine core applies it (``step_with_batch_queue``
   schedules step N+1, then waits for step N's outputs and applies them:
   rule ASYNC.OUTPUTS_NEXT_STEP) — the *start* of the record's own step, not
   its end.  See :func:`output_time_ns`.

A request arriving while a step runs waits for the next step boundary (an
engine's scheduler only looks at its queue between steps).  No wall clock
enters any decision: the same trace, engine configuration and cost model give
the same events, to the nanosecond.

The driver is engine-agnostic: it only reads :class:`~spec.formats.StepRecord`
fields (``scheduled``, ``new``, ``resumed``, ``preempted``, ``finished``,
``aborted``, ``rejected``, ``sampled``, and at the memory level
``num_free_blocks`` and ``cache_hits``).  :func:`simulate` builds a fast
:class:`~spec.scheduler.SpecEngine` (no reasons, memory-level records, no
invariant checks) unless it is given an engine.
"""
from __future__ import annotations

import dataclasses
from array import array
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable

from spec.costmodel import NS_PER_S, CostModel, StepShape
from spec.formats import LIMITS, StepRecord, Trace, TraceRequest
from spec.protocol import Engine, StepLimitError


class StallError(RuntimeError):
    """The engine holds unfinished requests, schedules nothing, and nothing else can arrive."""


@dataclass
class RequestTimes:
    """What happened to one request, in simulated nanoseconds (None: never happened)."""

    id: str
    tenant: str
    prompt_len: int
    arrival_ns: int
    first_scheduled_ns: int | None = None  # start of the first step that ran it
    first_token_ns: int | None = None  # end of the step that sampled its first token
    last_token_ns: int | None = None
    finish_ns: int | None = None  # end of the step in which it finished
    outputs: int = 0  # tokens sampled
    preemptions: int = 0
    outcome: str | None = None  # a finish reason, "aborted", or "rejected: <why>"
    # service-level targets in seconds (issue 19): a timed trace's as given, a step trace's
    # steps read as seconds (its arrival step k arrives at k s); None: no target
    slo_class: str | None = None
    ttft_target_s: float | None = None
    tpot_target_s: float | None = None

    @classmethod
    def of(cls, r, arrival_ns: int) -> "RequestTimes":
        """A request's entry before it runs: its identity, arrival and targets."""
        return cls(r.id, r.tenant, r.prompt_len, arrival_ns, slo_class=r.slo_class,
                   ttft_target_s=None if r.ttft_slo is None else float(r.ttft_slo),
                   tpot_target_s=None if r.tpot_slo is None else float(r.tpot_slo))

    @property
    def completed(self) -> bool:
        return self.finish_ns is not None and self.outcome not in (None, "aborted") and not self.outcome.startswith("rejected")


@dataclass
class StepSample:
    """One executed step, kept for plots (only the first ``keep_records`` steps)."""

    record: StepRecord
    start_ns: int
    end_ns: int
    shape: StepShape
    parts: list[tuple[str, int, bool]]  # (request, tokens, is_decode) in batch order


@dataclass
class SimResult:
    """Everything the metrics need, recorded once per request and once per step."""

    requests: dict[str, RequestTimes]
    cost_model: CostModel
    usable_blocks: int | None
    steps: int = 0
    itl_ns: array = field(default_factory=lambda: array("q"))  # every gap between two tokens of a request
    step_end_ns: array = field(default_factory=lambda: array("q"))
    step_ns: array = field(default_factory=lambda: array("q"))  # each step's duration
    in_system: array = field(default_factory=lambda: array("l"))  # arrived, not finished/aborted/rejected (after the step)
    running: array = field(default_factory=lambda: array("l"))  # holding a place in the batch after the step
    used_blocks: array = field(default_factory=lambda: array("l"))  # usable_blocks - num_free_blocks after the step (-1: unknown)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    tenant_service: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # tokens computed per tenant
    samples: list[StepSample] = field(default_factory=list)

    @property
    def end_ns(self) -> int:
        return self.step_end_ns[-1] if self.step_end_ns else 0


class BatchTracker:
    """Mirror each request's computed-token count from the records alone, to size each batch.

    A scheduled entry ``(request, n)`` starts at the request's computed count:
    0 for a new or preempted request, its prefix-cache hit when admitted (the
    record's ``cache_hits``; 0 when the engine does not report hits).  It is a
    **decode** when it computes exactly the newest sampled token (``n == 1`` and
    ``start == prompt + outputs - 1`` with at least one output); anything else
    is **prefill** (a prompt chunk, or recomputation after a preemption).  It
    reads ``start + n`` KV tokens.

    Under async scheduling (records with ``outputs_step``) a token is in flight one
    step before the record that carries it: the newest token is counted from the
    moment its step is scheduled (an output placeholder, ASYNC.PLACEHOLDER), so a
    decode computes ``start == prompt + outputs + placeholders - 1``.  A preemption
    zeroes the placeholders; the stale token still arrives (ASYNC.STALE_OUTPUT).
    """

    def __init__(self, requests: Iterable[TraceRequest]):
        self.prompt_len = {r.id: r.prompt_len for r in requests}
        self.computed: dict[str, int] = {}
        self.outputs: dict[str, int] = defaultdict(int)
        self.placeholders: dict[str, int] = defaultdict(int)  # async: tokens in flight
        self.stale: dict[str, int] = defaultdict(int)  # async: in-flight tokens of a request preempted since

    def shape(self, record: StepRecord) -> tuple[StepShape, list[tuple[str, int, bool]]]:
        """The step's shape, and per scheduled request ``(id, tokens, is_decode)``."""
        computed, outputs, flight = self.computed, self.outputs, self.placeholders
        asynchronous = record.outputs_step is not None
        for rid in record.preempted:
            computed[rid] = 0
            if flight[rid]:  # ASYNC.PREEMPT_ZEROES_PLACEHOLDERS: the token still arrives, stale
                self.stale[rid] += flight.pop(rid)
        hits = record.cache_hits or {}
        for rid in record.new:
            computed[rid] = hits.get(rid, 0)
        for rid in record.resumed:
            computed[rid] = hits.get(rid, 0)
        prefill = decodes = kv = 0
        parts = []
        for rid, n in record.scheduled:
            start = computed.get(rid, 0)
            out = outputs[rid] + (flight[rid] if asynchronous else 0)
            decode = n == 1 and out > 0 and start == self.prompt_len[rid] + out - 1
            if decode:
                decodes += 1
            else:
                prefill += n
            kv += start + n
            computed[rid] = start + n
            if asynchronous and start + n >= self.prompt_len[rid] + out:
                flight[rid] += 1  # this step samples: its token is in flight until a later record
            parts.append((rid, n, decode))
        for rid in record.sampled:
            outputs[rid] += 1
            if asynchronous:
                if self.stale[rid]:
                    self.stale[rid] -= 1
                elif flight[rid]:
                    flight[rid] -= 1
        if record.computed and not asynchronous:  # speculative decoding: SPEC.ACCEPT, SPEC.ROLLBACK
            self._verified(record)
        for rid, _ in record.finished:
            computed.pop(rid, None)
            flight.pop(rid, None)  # a token still in flight for it is dropped (ASYNC.ABORT_DROPS_OUTPUT)
        for rid in record.aborted:  # (its count kept: under ABORT.AFTER_NEXT_SAMPLE it runs once more, a decode)
            flight.pop(rid, None)
        return StepShape(prefill, decodes, kv), parts

    def _verified(self, record: StepRecord) -> None:
        """A verification appends ``1 + accepted`` outputs and rolls the rejected drafts back, which
        ``sampled`` (one token a request) does not show: a request that sampled ends the step with
        ``computed = prompt + outputs - 1`` (its newest token not computed), read from the record's
        ``computed`` state field (the spec writes it when asked: SpecEngine(record_state=True))."""
        for rid in record.sampled:
            now = record.computed.get(rid)
            if now is not None and now >= self.prompt_len[rid]:
                self.computed[rid] = now
                self.outputs[rid] = now - self.prompt_len[rid] + 1


def output_time_ns(record: StepRecord, start_ns: int, end_ns: int) -> int:
    """When the tokens and finishes a record reports happen on the simulated clock.

    Synchronous scheduling: at the end of the record's step, whose batch sampled them.
    Async scheduling (``outputs_step`` set): they are the outputs of the step before,
    which ended when this record's step started; vLLM's engine core schedules step N+1
    and then applies step N's outputs as soon as they are ready (ASYNC.OUTPUTS_NEXT_STEP),
    so a token is emitted at ``start_ns`` — when the step that sampled it ended — not
    one step later.  Timing it at the record's end would charge every token the
    duration of the next batch as well."""
    return start_ns if record.outputs_step is not None else end_ns


def record_outputs(record: StepRecord, times: dict, itl_ns: list, emitted_ns: int) -> None:
    """Time a record's sampled tokens (first token, inter-token gaps) and its finishes at
    ``emitted_ns`` (see :func:`output_time_ns`)."""
    for rid in record.sampled:
        t = times[rid]
        if t.last_token_ns is None:
            t.first_token_ns = emitted_ns
        else:
            itl_ns.append(emitted_ns - t.last_token_ns)
        t.last_token_ns = emitted_ns
        t.outputs += 1
    for rid, why in record.finished:
        t = times[rid]
        t.outcome, t.finish_ns = why, emitted_ns


def made_progress(record: StepRecord, ran: bool) -> bool:
    """Whether a step did anything: scheduled a batch, or (async) applied the outputs of the
    batch in flight — a step that only applies them schedules nothing yet frees memory and
    finishes requests, so it is no stall."""
    return ran or bool(record.sampled) or bool(record.finished)


def arrival_ns(request: TraceRequest) -> int:
    """A request's arrival on the simulated clock: ``round(arrival_time * 1e9)``."""
    if request.arrival_time is None:
        raise ValueError(f"request {request.id!r} has no arrival_time (seconds); import the trace or give --rate")
    return round(request.arrival_time * NS_PER_S)


def simulate(
    trace: Trace,
    cost: CostModel,
    engine: Engine | None = None,
    *,
    usable_blocks: int | None = None,
    max_steps: int = LIMITS["steps"],
    keep_records: int = 0,
    on_step: Callable[[SimResult], None] | None = None,
) -> SimResult:
    """Run ``trace`` in modelled time; return per-request times and per-step samples.

    ``engine`` defaults to a fast :class:`~spec.scheduler.SpecEngine` for the
    trace's configuration.  ``usable_blocks`` (for KV utilization) defaults to
    the engine's ``config.usable_blocks`` when it has one.  ``on_step`` is
    called after every step (progress bars).  Raises :class:`StepLimitError`
    past ``max_steps`` and :class:`StallError` when the engine stops making
    progress for good.
    """
    if engine is None:
        from spec.scheduler import SpecEngine  # the default engine; the driver itself needs none of it

        engine = SpecEngine.from_trace(trace, record_level="memory", record_reasons=False)
    if usable_blocks is None and hasattr(engine, "config"):
        usable_blocks = engine.config.usable_blocks
    pending = sorted(trace.requests, key=arrival_ns)  # stable: ties keep trace order
    arrivals = [arrival_ns(r) for r in pending]
    aborts: dict[int, list[str]] = defaultdict(list)
    for r in trace.requests:
        if r.abort_at is not None:
            aborts[r.abort_at].append(r.id)
    times = {r.id: RequestTimes.of(r, a) for r, a in zip(pending, arrivals)}
    tenant_of = {r.id: r.tenant for r in pending}
    result = SimResult(times, cost, usable_blocks)
    tracker = BatchTracker(pending)
    running: set[str] = set()
    in_system = 0
    now, i, step = 0, 0, 0
    while i < len(pending) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests() and arrivals[i] > now:
            now = arrivals[i]  # idle: jump to the next arrival
        if step >= max_steps:
            raise StepLimitError(max_steps, step, [])
        while i < len(pending) and arrivals[i] <= now:
            engine.add_request(pending[i])
            in_system += 1
            i += 1
        for rid in aborts.get(step, ()):
            engine.abort_request(rid)
        record = engine.step()
        record.step = step
        shape, parts = tracker.shape(record)
        end = now + (cost.step_ns(shape) if parts else 0)
        # -- what the record says happened, at the step's start or end --
        if record.rejected or record.aborted or record.preempted:
            for rid, why in record.rejected:
                times[rid].outcome, times[rid].finish_ns = f"rejected: {why}", now
            for rid in record.aborted:
                times[rid].outcome, times[rid].finish_ns = "aborted", now
                running.discard(rid)
            for rid in record.preempted:
                times[rid].preemptions += 1
                running.discard(rid)
            in_system -= len(record.rejected) + len(record.aborted)
        for rid in record.new:
            times[rid].first_scheduled_ns = now
        running.update(record.new)
        running.update(record.resumed)
        service = result.tenant_service
        for rid, n, decode in parts:
            service[tenant_of[rid]] += n
        result.decode_tokens += shape.decode_seqs
        result.prefill_tokens += shape.prefill_tokens
        record_outputs(record, times, result.itl_ns, output_time_ns(record, now, end))
        running.difference_update(rid for rid, _ in record.finished)
        in_system -= len(record.finished)
        result.steps += 1
        result.step_end_ns.append(end)
        result.step_ns.append(end - now)
        result.in_system.append(in_system)
        result.running.append(len(running))
        free = record.num_free_blocks
        result.used_blocks.append(usable_blocks - free if free is not None and usable_blocks is not None else -1)
        if step < keep_records:
            result.samples.append(StepSample(record, now, end, shape, parts))
        if on_step is not None:
            on_step(result)
        if not made_progress(record, bool(parts)) and engine.has_unfinished_requests():
            if i >= len(pending):
                raise StallError(
                    f"step {step}: {in_system} requests unfinished, none scheduled, no arrival left "
                    "(the engine cannot make progress; see the liveness invariant LIVE.NO_IDLE_STALL)"
                )
            end = max(end, arrivals[i])  # nothing can run until something arrives
        now = end
        step += 1
    return result


# --------------------------------------------------------------------------
# Arrival processes and time scaling.
# --------------------------------------------------------------------------


def mean_rate(requests: list[TraceRequest]) -> float:
    """Arrivals per second: ``(n - 1) / (last arrival - first arrival)`` (the inverse mean gap)."""
    times = [r.arrival_time for r in requests if r.arrival_time is not None]
    if len(times) < 2 or max(times) == min(times):
        raise ValueError("a rate needs at least two distinct arrival times")
    return (len(times) - 1) / (max(times) - min(times))


def scale_to_rate(trace: Trace, rate: float) -> Trace:
    """The same trace with its arrival gaps scaled so that its mean rate is ``rate``.

    Times are shifted to start at 0 and multiplied by ``mean_rate / rate``: the
    order, the burst structure and the request mix are kept (scaling a Poisson
    process gives a Poisson process at the new rate).
    """
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    factor = mean_rate(trace.requests) / rate
    t0 = min(r.arrival_time for r in trace.requests)
    requests = [dataclasses.replace(r, arrival_time=(r.arrival_time - t0) * factor) for r in trace.requests]
    return dataclasses.replace(trace, requests=requests)
