"""The simulator on gpu_engine's decisions: ``simulate`` / ``compare`` / ``sweep --engine gpu``.

:func:`spec.simulate.simulate` runs the spec one step at a time.  A capacity
sweep of a real trace is millions of steps (at low rates each request decodes
alone, one token a step), so this module runs gpu_engine (scheduler-only)
under the same driver semantics, with three savings that change no decision:

* **decode spans**: while every running request decodes, nothing waits and no
  arrival, abort or failed allocation is due, consecutive steps differ only in
  their KV length, up to the step in which one stops;
  :meth:`gpu_engine.GpuEngine.decode_span` applies them in closed form, that
  last step's stops included, and the driver accounts for them in bulk
  (durations, inter-token gaps, KV occupancy, finishes), with the cost model
  evaluated in numpy in the same float operations as
  :meth:`spec.costmodel.CostModel.step_ns`;
* **token synthesis in bulk**: the trace's synthetic prompt and output tokens
  (``crc32("<label>#<index>")``, :mod:`spec.formats`) computed by a vectorized, affine
  CRC-32, identical to ``zlib.crc32`` (tested);
* **a per-process prompt cache**: a sweep replays the same requests at every
  rate; prompts and their block hashes are made once per worker.

The result is a :class:`spec.simulate.SimResult` equal to the spec's on the
same run.  :func:`check_run` verifies that: it simulates a window of the
trace (the first ``requests`` arrivals) with both the spec and gpu_engine and
compares every request's times and every step's shape (``--check-engine``:
``sampled`` checks a window at some rates, ``full`` the whole run at every
rate, ``off`` nothing).
"""
from __future__ import annotations

import dataclasses
import zlib
from array import array
from collections import defaultdict
from typing import Callable

import numpy as np

from spec.config import SchedulerConfig
from spec.costmodel import NS_PER_S, CostModel, StepShape
from spec.formats import FIRST_SYNTHETIC_TOKEN, LIMITS, Trace, TraceRequest
from spec.protocol import StepLimitError
from spec.simulate import (BatchTracker, RequestTimes, SimResult, StallError, StepSample, arrival_ns, made_progress,
                           output_time_ns, record_outputs)

ENGINES = ("spec", "gpu")
CHECKS = ("sampled", "full", "off")
CHECK_REQUESTS = 500  # the window a sampled check simulates with both engines


# --------------------------------------------------------------------------
# Synthetic tokens in bulk
# --------------------------------------------------------------------------


def _crc_table() -> np.ndarray:
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ np.uint32(0xEDB88320), t >> 1).astype(np.uint32)
    return t


_CRC = _crc_table()


def synthetic_range(label: str, start: int, stop: int, vocab_size: int) -> np.ndarray:
    """``[_mix(label, i, vocab_size) for i in range(start, stop)]`` as an int64 array.

    ``_mix`` is ``FIRST_SYNTHETIC_TOKEN + crc32(f"{label}#{i}") % span``: :func:`_synthetic_runs`
    with one run."""
    if stop <= start:
        return np.empty(0, dtype=np.int64)
    return _synthetic_runs([~zlib.crc32(f"{label}#".encode()) & 0xFFFFFFFF], [start], [stop], vocab_size)


def _zero_bytes(state: np.ndarray) -> np.ndarray:
    """One CRC-32 table step with a zero data byte."""
    return _CRC[state & np.uint32(0xFF)] ^ (state >> np.uint32(8))


def _digit_states(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """For every ``i`` in ``lo .. hi - 1``: the CRC-32 state after the decimal digits of ``i``
    starting from state 0, and the number of those digits."""
    idx = np.arange(lo, hi, dtype=np.int64)
    ndig = np.ones(hi - lo, dtype=np.int64)
    for d in range(1, 20):
        ndig += idx >= 10 ** d
    states = np.zeros(hi - lo, dtype=np.uint32)
    for d in np.unique(ndig).tolist():
        sel = np.flatnonzero(ndig == d)
        i, state = idx[sel], np.zeros(len(sel), dtype=np.uint32)
        for pos in range(d):
            byte = ((i // 10 ** (d - 1 - pos)) % 10 + 48).astype(np.uint32)
            state = _CRC[(state ^ byte) & 0xFF] ^ (state >> np.uint32(8))
        states[sel] = state
    return states, ndig


def _synthetic_runs(bases: list[int], los: list[int], his: list[int], vocab_size: int) -> np.ndarray:
    """``FIRST_SYNTHETIC_TOKEN + crc32(label_j + "#" + str(i)) % span`` for ``i`` in ``los[j] ..
    his[j] - 1``, run after run (``bases[j]``: the inverted CRC state after ``label_j + "#"``),
    as one int64 array.

    One CRC-32 table step, ``s' = (s >> 8) ^ T[(s ^ b) & 0xFF]``, is affine over GF(2) in the
    state and the byte (``T`` is linear), so from state ``s`` the digits of ``i`` lead to
    ``Z_d(s) ^ D(i)``: ``D(i)`` the state they lead to from 0 (once per index, shared by every
    label), ``Z_d`` ``d`` steps with zero bytes (once per run and digit count).  Per token that
    is two gathers and an xor, in uint32 until the final widening."""
    lengths = np.asarray(his, dtype=np.int64) - np.asarray(los, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    first, top = min(los), max(his)
    digit_state, ndig = _digit_states(first, top)
    width = int(ndig[-1]) + 1
    zeros = np.zeros((len(bases), width), dtype=np.uint32)  # [run, d] = Z_d(base of run)
    state = np.asarray(bases, dtype=np.uint32)
    for d in range(1, width):
        state = _zero_bytes(state)
        zeros[:, d] = state
    # token g, the i-th of run r, has index los[r] - first + i = g - (starts[r] - los[r] + first)
    starts = np.cumsum(lengths) - lengths
    index = np.arange(total, dtype=np.int64)
    index -= np.repeat(starts - np.asarray(los, dtype=np.int64) + first, lengths)
    cell = np.repeat(np.arange(len(bases), dtype=np.int64) * width, lengths)  # zeros' flat [run, digits]
    cell += ndig[index]
    crc = zeros.ravel().take(cell)
    crc ^= digit_state.take(index)
    crc = ~crc % np.uint32(vocab_size - FIRST_SYNTHETIC_TOKEN)
    return crc.astype(np.int64) + FIRST_SYNTHETIC_TOKEN


#: Per worker process: synthesized prompts by request key (see :func:`prime_prompts`), until handed
#: to an engine (whose prompt cache keeps them); the keys handed.
_PROMPTS: dict = {}
_HANDED: set = set()
_PRIME_CHUNK = 1 << 21  # tokens synthesized per vectorized pass


def _prompt_key(request: TraceRequest, vocab_size: int):
    return (request.id, request.prompt_len, request.prefix_group, request.prefix_len, vocab_size)


def prime_prompts(requests: list[TraceRequest], vocab_size: int) -> None:
    """Synthesize the prompts of many requests in a few vectorized passes (the per-request
    cost of :func:`synthetic_range` is mostly fixed), into this process's cache."""
    todo = [r for r in requests if r.prompt is None and _prompt_key(r, vocab_size) not in _PROMPTS
            and _prompt_key(r, vocab_size) not in _HANDED]
    i = 0
    while i < len(todo):
        chunk, total = [], 0
        while i < len(todo) and (not chunk or total + todo[i].prompt_len <= _PRIME_CHUNK):
            chunk.append(todo[i])
            total += todo[i].prompt_len
            i += 1
        bases, los, his = [], [], []
        for r in chunk:
            shared = min(r.prefix_len, r.prompt_len) if r.prefix_group else 0
            for label, lo, hi in ((f"{r.prefix_group}#pre", 0, shared), (f"{r.id}#in", shared, r.prompt_len)):
                if hi > lo:
                    bases.append(~zlib.crc32(f"{label}#".encode()) & 0xFFFFFFFF)
                    los.append(lo)
                    his.append(hi)
        flat = _synthetic_runs(bases, los, his, vocab_size)
        start = 0
        for r in chunk:
            _PROMPTS[_prompt_key(r, vocab_size)] = flat[start:start + r.prompt_len]
            start += r.prompt_len
    _prime_outputs(requests, vocab_size)


def _prime_outputs(requests: list[TraceRequest], vocab_size: int) -> None:
    """Every output token of many requests at once, into :data:`_OUTPUT_CACHE`."""
    todo = [r for r in requests if _output_key(r, vocab_size) not in _OUTPUT_CACHE and r.max_tokens > 0]
    if not todo:
        return
    lengths = [r.max_tokens for r in todo]
    bases = [~zlib.crc32(f"{r.id}#out#".encode()) & 0xFFFFFFFF for r in todo]
    flat = _synthetic_runs(bases, [0] * len(todo), lengths, vocab_size)
    start = 0
    for r, n in zip(todo, lengths):
        tokens = flat[start:start + n].copy()
        given = r.output_tokens[:n]
        tokens[:len(given)] = given
        _OUTPUT_CACHE[_output_key(r, vocab_size)] = tokens
        start += n


def _output_key(request: TraceRequest, vocab_size: int):
    return (request.id, request.max_tokens, request.output_tokens, vocab_size)


def prompt_tokens(request: TraceRequest, vocab_size: int) -> list[int]:
    """``request.prompt_token_ids(vocab_size)``, synthesized in bulk."""
    got = prompt_array(request, vocab_size)
    return got if isinstance(got, list) else got.tolist()


def prompt_array(request: TraceRequest, vocab_size: int) -> np.ndarray | list[int]:
    """:func:`prompt_tokens` as an int64 array (a list when the trace gives the prompt), for
    gpu_engine, which keeps the array as it is (no list made and turned back into an array)."""
    if request.prompt is not None:
        return list(request.prompt)
    key = _prompt_key(request, vocab_size)
    _HANDED.add(key)
    cached = _PROMPTS.pop(key, None)  # (primed; the engine's cache keeps it)
    if cached is not None:
        return cached
    shared = min(request.prefix_len, request.prompt_len) if request.prefix_group else 0
    head = synthetic_range(f"{request.prefix_group}#pre", 0, shared, vocab_size) if shared else np.empty(0, np.int64)
    tail = synthetic_range(f"{request.id}#in", shared, request.prompt_len, vocab_size)
    return np.concatenate([head, tail])


#: Per worker process: each request's output tokens (all ``max_tokens`` of them), made once.
_OUTPUT_CACHE: dict = {}


def output_tokens(request: TraceRequest, first: int, count: int, vocab_size: int) -> np.ndarray:
    """``[request.output_token(i, vocab_size) for i in range(first, first + count)]`` (an array),
    from this process's cache of every output token the request can sample."""
    key = _output_key(request, vocab_size)
    tokens = _OUTPUT_CACHE.get(key)
    if tokens is None:
        tokens = synthetic_range(f"{request.id}#out", 0, max(request.max_tokens, first + count), vocab_size)
        given = request.output_tokens[:len(tokens)]
        tokens[:len(given)] = given
        _OUTPUT_CACHE[key] = tokens
    if first + count > len(tokens):  # past max_tokens (cannot be sampled): the rule itself
        return np.array([request.output_token(i, vocab_size) for i in range(first, first + count)], dtype=np.int64)
    return tokens[first:first + count]


# --------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------

#: Per worker process: prompts and block-hash chains, shared by every gpu_engine run.
_PROMPT_CACHE: dict = {}


def make_gpu_engine(trace: Trace, config: SchedulerConfig):
    """gpu_engine, scheduler-only, memory-level records (what the driver reads),
    with this process's prompt cache and bulk token synthesis."""
    from gpu_engine import GpuEngine

    # the driver reads the batch shape and free blocks from the engine itself (want_shape), except under
    # swap preemption, where BatchTracker's view of a swapped-in request's start is the reference, and
    # under async scheduling, where a batch's shape counts the tokens in flight (BatchTracker), which
    # gpu_engine's own shape, taken in synchronous steps only, does not report
    level = "memory" if config.preemption_mode == "swap" or config.async_scheduling else "decisions"
    engine = GpuEngine(config, trace.vocab_size, trace.eos_token_id, level=level, prompt_cache=_PROMPT_CACHE)
    engine.want_shape = level == "decisions"
    vocab = trace.vocab_size
    order = sorted(trace.requests, key=arrival_ns)
    position = {r.id: i for i, r in enumerate(order)}

    def prompt(req: TraceRequest) -> np.ndarray | list[int]:
        key = _prompt_key(req, vocab)
        if req.prompt is None and key not in _PROMPTS and key not in _HANDED and req.id in position:
            at = position[req.id]  # prime the next arrivals with it, a bounded number of tokens at a time
            prime_prompts(order[at:at + 4000], vocab)
        return prompt_array(req, vocab)

    engine.prompt_tokens = prompt
    engine.output_tokens = lambda req, first, count: output_tokens(req, first, count, vocab)
    return engine


def xp_total(a) -> int:
    return int(a.sum())


def _span_step_ns(cost: CostModel, decodes: int, kv0: int, k: int) -> np.ndarray:
    """``cost.step_ns(StepShape(0, decodes, kv0 + j * decodes))`` for ``j < k``, in the same
    float64 operations and rounding (half to even) as :meth:`CostModel.step_ns`."""
    kv = kv0 + decodes * np.arange(k, dtype=np.int64)
    seconds = (cost.fixed_s + cost.per_prefill_token_s * 0) + cost.per_decode_seq_s * decodes + cost.per_kv_token_s * kv
    return np.maximum(np.rint(seconds * NS_PER_S), 1).astype(np.int64)


def simulate_fast(trace: Trace, cost: CostModel, engine, *, usable_blocks: int | None = None,
                  max_steps: int = LIMITS["steps"], keep_records: int = 0,
                  on_step: Callable[[SimResult], None] | None = None) -> SimResult:
    """:func:`spec.simulate.simulate` (same events, same :class:`SimResult`), with decode
    spans run in bulk when ``engine`` offers ``decode_span`` (gpu_engine)."""
    if usable_blocks is None and hasattr(engine, "config"):
        usable_blocks = engine.config.usable_blocks
    pending = sorted(trace.requests, key=arrival_ns)
    arrivals = [arrival_ns(r) for r in pending]
    aborts: dict[int, list[str]] = defaultdict(list)
    for r in trace.requests:
        if r.abort_at is not None:
            aborts[r.abort_at].append(r.id)
    abort_steps = sorted(aborts)
    times = {r.id: RequestTimes.of(r, a) for r, a in zip(pending, arrivals)}  # (with its SLO targets)
    tenant_of = {r.id: r.tenant for r in pending}
    result = SimResult(times, cost, usable_blocks)
    tracker = BatchTracker(pending)
    running: dict[str, None] = {}  # insertion-ordered set
    in_system = 0
    now, i, step = 0, 0, 0
    own_shape = getattr(engine, "want_shape", False)  # the engine reports shapes: no tracker past keep_records
    # spans need the engine's shapes: BatchTracker counts a swapped-in request's chunks from 0 (as the
    # spec's simulator does), which a span of decodes would not reproduce
    spans = own_shape and hasattr(engine, "decode_span")
    tenants = {r.tenant for r in pending}
    one_tenant = next(iter(tenants)) if len(tenants) == 1 else None
    while i < len(pending) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests() and arrivals[i] > now:
            now = arrivals[i]
        if step >= max_steps:
            raise StepLimitError(max_steps, step, [])
        while i < len(pending) and arrivals[i] <= now:
            engine.add_request(pending[i])
            in_system += 1
            i += 1
        for rid in aborts.get(step, ()):
            engine.abort_request(rid)
        if spans and step >= keep_records:
            k = _span(engine, result, None, cost, now, step,
                      arrivals[i] if i < len(pending) else None, abort_steps, max_steps, in_system, len(running),
                      usable_blocks, tenant_of)
            if k:
                for rid, _ in engine.span_finished:  # (its last step's stops, accounted by _span)
                    running.pop(rid, None)
                in_system -= len(engine.span_finished)
                now = result.step_end_ns[-1]
                step += k
                if on_step is not None:
                    on_step(result)
                continue
        record = engine.step()
        record.step = step
        if own_shape and step >= keep_records:
            shape, parts = StepShape(*engine.last_shape), None
            ran = bool(record.scheduled)
        else:
            shape, parts = tracker.shape(record)
            ran = bool(parts)
        end = now + (cost.step_ns(shape) if ran else 0)
        if record.rejected or record.aborted or record.preempted:
            for rid, why in record.rejected:
                times[rid].outcome, times[rid].finish_ns = f"rejected: {why}", now
            for rid in record.aborted:
                times[rid].outcome, times[rid].finish_ns = "aborted", now
                running.pop(rid, None)
            for rid in record.preempted:
                times[rid].preemptions += 1
                running.pop(rid, None)
            in_system -= len(record.rejected) + len(record.aborted)
        for rid in record.new:
            times[rid].first_scheduled_ns = now
        running.update(dict.fromkeys(record.new))
        running.update(dict.fromkeys(record.resumed))
        service = result.tenant_service
        if one_tenant is not None:
            if ran:
                service[one_tenant] += shape.prefill_tokens + shape.decode_seqs
        else:
            for rid, n in record.scheduled:
                service[tenant_of[rid]] += n
        result.decode_tokens += shape.decode_seqs
        result.prefill_tokens += shape.prefill_tokens
        record_outputs(record, times, result.itl_ns, output_time_ns(record, now, end))
        for rid, _ in record.finished:
            running.pop(rid, None)
        in_system -= len(record.finished)
        result.steps += 1
        result.step_end_ns.append(end)
        result.step_ns.append(end - now)
        result.in_system.append(in_system)
        result.running.append(len(running))
        free = record.num_free_blocks if not own_shape else engine.sched.pool.num_free
        result.used_blocks.append(usable_blocks - free if free is not None and usable_blocks is not None else -1)
        if step < keep_records:
            result.samples.append(StepSample(record, now, end, shape, parts))
        if on_step is not None:
            on_step(result)
        if not made_progress(record, ran) and engine.has_unfinished_requests():
            if i >= len(pending):
                raise StallError(
                    f"step {step}: {in_system} requests unfinished, none scheduled, no arrival left "
                    "(the engine cannot make progress; see the liveness invariant LIVE.NO_IDLE_STALL)"
                )
            end = max(end, arrivals[i])
        now = end
        step += 1
    return result


def _span(engine, result: SimResult, tracker: BatchTracker, cost: CostModel, now: int, step: int,
          next_arrival: int | None, abort_steps: list[int], max_steps: int, in_system: int, num_running: int,
          usable_blocks: int | None, tenant_of: dict[str, str]) -> int:
    """Run a decode span from ``step`` if one qualifies; account for its steps; return its length.

    The span may not reach a step that starts at or after the next arrival (that step
    adds it), a step with aborts, or ``max_steps``.  Every step of it schedules each
    running request for one decode token (its shape: no prefill, ``R`` decodes, KV
    ``sum(computed + 1)`` growing by ``R`` a step) and samples each once.  Its last step
    may stop requests (``engine.span_finished``): finished at that step's end, as
    :func:`spec.simulate.record_outputs` times a record's finishes, and that step's
    counts and used blocks taken after them, as for any step (the caller drops them
    from its running set and ``in_system``)."""
    sched = engine.sched
    if not sched.span_ready():
        return 0
    bound = min(engine.span_bound(), max_steps - step)
    nxt = next((a for a in abort_steps if a > step), None)
    if nxt is not None:
        bound = min(bound, nxt - step)
    if bound < 1:
        return 0
    names = engine._names(sched.running)
    decodes = len(names)
    if tracker is None:  # decode state: computed + 1 = num_tokens
        kv0 = xp_total(sched.num_tokens[sched.running])
    else:
        kv0 = sum(tracker.computed[r] for r in names) + decodes
    if next_arrival is not None and cost.per_kv_token_s >= 0:
        # no step is shorter than the first (the KV only grows): fewer than (arrival - now) / first
        # steps end before the arrival, so the steps past that many + 1 need no duration
        first = (cost.fixed_s + cost.per_prefill_token_s * 0) + cost.per_decode_seq_s * decodes + cost.per_kv_token_s * kv0
        first = max(round(first * NS_PER_S) - 1, 1)  # (one ns less: a bound, whatever the rounding)
        bound = min(bound, -(-(next_arrival - now) // first) + 1)
    step_ns = _span_step_ns(cost, decodes, kv0, bound)
    ends = now + np.cumsum(step_ns)
    if next_arrival is not None:  # step j starts at ends[j-1]; one starting at or after the arrival adds it
        bound = min(bound, int(np.searchsorted(ends, next_arrival, side="left")) + 1)
    free0 = sched.pool.num_free
    k, allocs = engine.decode_span(bound)
    if not k:
        return 0
    step_ns, ends = step_ns[:k], ends[:k]
    times = result.requests
    end = int(ends[-1])
    for rid in names:
        t = times[rid]
        t.last_token_ns = end
        t.outputs += k
        if tracker is not None:
            tracker.computed[rid] += k
            tracker.outputs[rid] += k
        result.tenant_service[tenant_of[rid]] += k
    finished = engine.span_finished
    for rid, why in finished:
        times[rid].outcome, times[rid].finish_ns = why, end
    # (each per-step series is written whole, from C: the int64 arrays' bytes straight into
    # SimResult's array("q") fields, a repeated array("l") into the count series)
    result.itl_ns.frombytes((step_ns if decodes == 1 else np.repeat(step_ns, decodes)).tobytes())
    result.decode_tokens += decodes * k
    result.steps += k
    result.step_end_ns.frombytes(ends.tobytes())
    result.step_ns.frombytes(step_ns.tobytes())
    result.in_system += array("l", (in_system,)) * k
    result.running += array("l", (num_running,)) * k
    if finished:  # the last step's counts after its finishes
        result.in_system[-1] -= len(finished)
        result.running[-1] -= len(finished)
    if usable_blocks is None:
        result.used_blocks += array("l", (-1,)) * k
    else:  # (C longs, the array's own item type)
        used = np.asarray(allocs, dtype=np.int64).cumsum() + (usable_blocks - free0)
        if finished:  # the last step's after its finishes freed their blocks
            used[-1] = usable_blocks - sched.pool.num_free
        result.used_blocks.frombytes(used.astype("l", copy=False).tobytes())
    return k


# --------------------------------------------------------------------------
# Runs and checks
# --------------------------------------------------------------------------


class EngineMismatch(RuntimeError):
    """gpu_engine's simulation differs from the spec's on the same run."""


def run_gpu(trace: Trace, config: SchedulerConfig, cost: CostModel, keep_records: int = 0,
            on_step: Callable[[SimResult], None] | None = None) -> SimResult:
    """One simulation on gpu_engine's decisions (decode spans, this process's caches)."""
    return simulate_fast(trace, cost, make_gpu_engine(trace, config), keep_records=keep_records, on_step=on_step)


@dataclasses.dataclass(frozen=True)
class SimDifference:
    """The first thing two simulations of one run disagree on: ``what`` (a request time or a
    per-step series), the request or the step index it concerns, and both values."""

    what: str
    spec: object
    gpu: object
    request: str | None = None
    index: int | None = None  # the simulated step (per-step series)
    fields: dict | None = None  # a request's: every time that differs, name -> (spec, gpu)

    @property
    def text(self) -> str:
        if self.request is not None:
            return f"request {self.request}: " + ", ".join(f"{k} spec {a} gpu {b}" for k, (a, b) in self.fields.items())
        if self.index is not None:
            return f"{self.what} differs first at index {self.index}: spec {self.spec}, gpu {self.gpu}"
        return f"{self.what}: spec {self.spec}, gpu {self.gpu}"


def difference(spec: SimResult, gpu: SimResult) -> SimDifference | None:
    """The first thing two simulations of one run disagree on (None: identical)."""
    for rid, t in spec.requests.items():
        other = gpu.requests.get(rid)
        if other is None or vars(t) != vars(other):
            diff = {k: (v, getattr(other, k, None)) for k, v in vars(t).items() if getattr(other, k, None) != v}
            first = next(iter(diff))
            return SimDifference(first, *diff[first], request=rid, fields=diff)
    for name in ("step_ns", "step_end_ns", "in_system", "running", "used_blocks", "itl_ns"):
        a, b = getattr(spec, name), getattr(gpu, name)
        if a != b:
            j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return SimDifference(name, a[j] if j < len(a) else "(end)", b[j] if j < len(b) else "(end)", index=j)
    for name in ("steps", "prefill_tokens", "decode_tokens"):
        if getattr(spec, name) != getattr(gpu, name):
            return SimDifference(name, getattr(spec, name), getattr(gpu, name))
    if dict(spec.tenant_service) != dict(gpu.tenant_service):
        return SimDifference("tenant_service", dict(spec.tenant_service), dict(gpu.tenant_service))
    return None


def first_difference(spec: SimResult, gpu: SimResult) -> str | None:
    """:func:`difference` as one line (None: identical)."""
    found = difference(spec, gpu)
    return None if found is None else found.text


def check_run(trace: Trace, config: SchedulerConfig, cost: CostModel, requests: int | None = CHECK_REQUESTS,
              gpu_result: SimResult | None = None) -> int:
    """Simulate the first ``requests`` arrivals (None: all, reusing ``gpu_result`` when
    given) with the spec and with gpu_engine; raise :class:`EngineMismatch` on the first
    difference; return the number of steps compared."""
    from fuzz.sweep import run_one

    window = trace
    if requests is not None and requests < len(trace.requests):
        first = sorted(trace.requests, key=arrival_ns)[:requests]
        window = dataclasses.replace(trace, requests=first)
        gpu_result = None
    spec = run_one(window, config, cost)
    gpu = gpu_result if gpu_result is not None else run_gpu(window, config, cost)
    why = first_difference(spec, gpu)
    if why is not None:
        what = "the whole run" if window is trace else f"the first {len(window.requests)} requests"
        raise EngineMismatch(f"gpu_engine's decisions differ from the spec's on {what}: {why}")
    return spec.steps


# --------------------------------------------------------------------------
# The fast path under a fuzz campaign
# --------------------------------------------------------------------------

def span_divergence(trace: Trace):
    """gpu_engine's simulator fast path (decode spans, bulk token synthesis, the per-process prompt
    cache) on a fuzz trace, against the spec's simulation of it, one step per second of the ``unit``
    cost model (arrival steps read as seconds): a :class:`fuzz.diff.Divergence` of kind ``span``
    at the first difference, or None.

    A lock-step replay drives gpu_engine one ``step()`` at a time and never takes this path; a bug
    in it would reach ``simulate`` / ``sweep --engine gpu`` with no campaign to see it.  A trace the
    spec cannot simulate (a stall, the step limit) has nothing to compare: None.  The finding
    replays with ``batchspec simulate TRACE --engine gpu --check-engine full --cost-model unit``."""
    from fuzz.diff import SPAN, Divergence
    from fuzz.replay import raised_at
    from fuzz.sweep import run_one, with_arrival_times
    from spec.config import resolve
    from spec.costmodel import preset

    timed, cost = with_arrival_times(trace), preset("unit")
    config = resolve(trace.config)
    try:
        spec = run_one(timed, config, cost)
    except (StallError, StepLimitError):
        return None
    try:
        gpu = run_gpu(timed, config, cost)
    except Exception as e:  # noqa: BLE001 (the engine's crash on its fast path is the finding)
        return Divergence(0, "error", None, raised_at(e), None, None,
                          "gpu_engine raised on its decode-span path", SPAN, "gpu_engine")
    found = difference(spec, gpu)
    if found is None:
        return None
    return Divergence(_span_step(spec, found), found.what, found.spec, found.gpu, found.request, None,
                      f"decode spans: {found.text}", SPAN, "gpu_engine")


def _span_step(spec: SimResult, found: SimDifference) -> int:
    """The step a simulated difference is at: one step per second, each ending a second after it starts
    (for a request, its earliest differing time; its other fields, such as a preemption count, are no time)."""
    if found.index is not None and found.index < len(spec.step_end_ns):
        return max(int(spec.step_end_ns[found.index] // NS_PER_S) - 1, 0)
    times = [v for name, pair in (found.fields or {}).items() if name.endswith("_ns") for v in pair if isinstance(v, int)]
    return max(min(times) // NS_PER_S - 1, 0) if times else 0
