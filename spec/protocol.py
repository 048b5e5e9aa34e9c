"""The engine protocol (DESIGN.md §5) and the driver that replays a trace through it.

Every engine — the spec itself, the reference engine, ``gpu_engine``, an
adapter around vLLM, a log file written by an engine in another language —
looks the same to the harness:

* ``add_request(request)``: the request arrives (it may be rejected; the
  rejection is reported in the next step's record);
* ``abort_request(request_id)``: the client cancels it (ignored if it already
  finished or was rejected);
* ``step() -> StepRecord``: one scheduler iteration, model execution and
  output processing;
* ``has_unfinished_requests()``: anything still waiting, running or swapped out.

Step numbering (the contract every log writer follows): step ``k`` is the
``k``-th call of ``step()``.  Before it, the requests with ``arrival_step <= k``
are added in trace order, then the aborts with ``abort_at == k`` are applied in
trace order.  When nothing is waiting or running, the driver skips ahead to the
next arrival: idle steps are not executed and have no record.

Record contents (see :class:`spec.formats.StepRecord`):

* ``scheduled``: ``[request, tokens]`` in batch order; ``sampled``: the token
  each request sampled (a request samples when its prefill is complete).
* ``new`` / ``resumed``: admitted from waiting for the first time / after a
  preemption; ``preempted`` in preemption order; ``finished`` ``[request, reason]``
  in freeing order; ``aborted``; ``rejected`` ``[request, reason]``
  (``prompt_too_long`` or ``never_fits``).  Under preemption_mode="swap":
  ``swapped_out`` (the preempted requests that went to the CPU pool, a sub-list
  of ``preempted``) and ``swapped_in`` (the resumed requests that came back from
  it, a sub-list of ``resumed``); written only when non-empty.
* memory level, at the end of the step: ``num_free_blocks`` (free queue
  length, evictable cached blocks included, null block excluded); ``blocks``:
  block count of every request holding at least one block; ``cache_hits``:
  prefix-hit tokens of every request admitted in this step (0 included);
  ``num_evicted``: cached blocks whose hash was dropped because the block was
  popped for re-use; ``num_free_cpu_blocks`` (preemption_mode="swap" only): the
  CPU swap pool's free blocks; ``new_token_ratio`` (admission="estimate" only):
  SGLang's ratio after the step.
* ``outputs_step`` (async scheduling only): the step whose batch's outputs
  ``sampled`` and ``finished`` are.  Under async scheduling step ``k`` schedules
  its batch *before* the previous step's sampled tokens are applied, so its
  record carries the outputs of the step run before it (-1 for the first step:
  nothing was in flight).  An engine learns that step's number from the record
  it returned last, whose ``step`` the driver has set by then.
* exact level: ``block_ids`` (same keys as ``blocks``, block-table order) and
  ``evicted`` (block ids, in pop order).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Protocol, runtime_checkable

from spec.formats import StepRecord, Trace, TraceRequest


@runtime_checkable
class Engine(Protocol):
    """What the harness needs from an engine.

    Optional: ``samples_script = True`` declares that the engine samples the trace's scripted
    tokens (``TraceRequest.output_token``, rule SAMPLE.SCRIPTED), as a scheduler-only engine
    does; a differential replay then lets the spec sample its own and compares token values
    too.  Without it the spec takes the engine's tokens (an engine running a model)."""

    name: str

    def add_request(self, request: TraceRequest) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def step(self) -> StepRecord: ...

    def has_unfinished_requests(self) -> bool: ...


class StepLimitError(RuntimeError):
    """A run did not finish within the ``max_steps`` limit."""

    def __init__(self, limit: int, step: int, records: list[StepRecord]):
        super().__init__(
            f"limit max_steps={limit} reached at step {step} with requests still unfinished "
            "(the engine does not terminate on this trace; raise max_steps if it is just long)"
        )
        self.limit = limit
        self.step = step
        self.records = records


def arrival_order(trace: Trace) -> list[TraceRequest]:
    """Requests in the order they are added: by ``arrival_step``, then trace order."""
    missing = [r.id for r in trace.requests if r.arrival_step is None]
    if missing:
        raise ValueError(
            f"requests without arrival_step cannot be replayed step by step: {missing[:3]} "
            "(convert seconds to steps with `batchspec simulate` or an importer)"
        )
    return sorted(trace.requests, key=lambda r: r.arrival_step)  # stable: ties keep trace order


def drive(engine: Engine, trace: Trace, max_steps: int, on_step=None) -> list[StepRecord]:
    """Replay ``trace`` through ``engine``; return the step records.

    ``on_step(record)`` is called after every step (for progress display or to
    feed another engine in lock step).  Raises :class:`StepLimitError` when the
    run exceeds ``max_steps``.
    """
    pending = arrival_order(trace)
    aborts: dict[int, list[str]] = defaultdict(list)
    for r in trace.requests:
        if r.abort_at is not None:
            aborts[r.abort_at].append(r.id)
    records: list[StepRecord] = []
    i, step = 0, 0
    while i < len(pending) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests() and pending[i].arrival_step > step:
            step = pending[i].arrival_step  # nothing to do until the next arrival
        if step >= max_steps:
            raise StepLimitError(max_steps, step, records)
        while i < len(pending) and pending[i].arrival_step <= step:
            engine.add_request(pending[i])
            i += 1
        for rid in aborts.get(step, ()):
            engine.abort_request(rid)
        record = engine.step()
        record.step = step
        records.append(record)
        if on_step is not None:
            on_step(record)
        step += 1
    return records
