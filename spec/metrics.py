"""Serving metrics of a simulation, each defined precisely (DESIGN.md §2.1).

All times are simulated (:mod:`spec.simulate`), reported in seconds.  Per
request, with ``arrival`` its arrival time:

``TTFT``            time to first token: end of the step that sampled its first
                    token − arrival.
``TPOT``            time per output token after the first:
                    ``(e2e − TTFT) / (outputs − 1)``, for requests with at least 2
                    outputs (vLLM's ``benchmark_serving`` definition).
``ITL``             inter-token latency: every gap between two consecutive tokens of
                    one request (one value per gap, all requests pooled).
``e2e``             end-to-end latency: end of the step in which it finished − arrival.
``queueing delay``  start of the first step that ran any of it − arrival.

Only *completed* requests (finished by a stop rule, including length caps)
count in TTFT / TPOT / e2e / queueing; rejected and aborted ones are counted
apart.  Statistics are the mean and the 50th, 95th and 99th **percentiles**
of :func:`percentile` (linear interpolation between order statistics, the
"type 7" definition numpy and vLLM's benchmark use).

Over the run, ``duration`` is the first arrival to the end of the last step:

* request throughput = completed / duration; output-token throughput =
  Σ outputs of completed requests / duration; total-token throughput adds
  their prompt tokens;
* goodput = completed requests that meet *every* given SLO (``ttft``,
  ``tpot``, ``e2e``, seconds) / duration (DistServe's definition, as vLLM's
  benchmark computes it: a request with one output has TPOT 0);
* per-request targets (issue 19: a trace's ``ttft_slo`` / ``tpot_slo``, by class or per
  request, seconds): a request *attains* its targets when it completed with TTFT ≤ its
  TTFT target and TPOT ≤ its TPOT target (a missing target always holds); rejected,
  aborted and unfinished requests attain nothing.  Per class (``slo_class``, or
  ``(per request)``): requests, TTFT attainment, TPOT attainment (among completed ones
  with 2+ outputs) and attainment of both, each a share of the class's requests;
  over all requests with a target: ``slo_attainment`` and ``slo_goodput`` = requests
  attaining both / duration, next to request throughput;
* preemptions: total, and requests preempted at least once;
* queue growth and sustained rate (:func:`queue_growth`): whether the engine
  keeps up with the arrivals, and how many requests per second it serves when not;
* KV utilization: blocks held by requests / usable blocks, after each step
  (cached blocks that nobody holds count as free, as in vLLM's usage
  metric); mean weighted by step duration, and peak;
* per tenant: requests, completed, service (tokens the engine computed for
  it: prefill chunks, recomputation and decodes), mean TTFT; and Jain's
  fairness index of the service, ``(Σx)² / (n·Σx²)``: 1 when every tenant got
  the same service, ``1/n`` when one got all of it.
"""
from __future__ import annotations

import bisect
import math
import operator
from collections import Counter
from collections.abc import Sequence as _Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Iterable, Sequence

from spec.costmodel import NS_PER_S
from spec.simulate import SimResult

#: Percentiles reported for every latency.
PERCENTILES = (50, 95, 99)

#: Fewer arrivals than this in the measured window make the queue growth unknown (NaN).
MIN_ARRIVALS_FOR_GROWTH = 50

#: A queue is "growing without bound" when, over the last three quarters of the
#: arrival window, the number of requests in the system grows by more than this
#: share of the requests that arrived meanwhile (see :func:`queue_growth`).
UNBOUNDED_GROWTH = 0.05


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) of ascending values, by linear interpolation.

    With ``n`` values ``x[0] <= ... <= x[n-1]``: ``h = (n - 1) * p / 100``, and the
    result is ``x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)])``
    (Hyndman & Fan type 7; numpy's default).  NaN for no values.
    """
    n = len(sorted_values)
    if n == 0:
        return math.nan
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    h = (n - 1) * p / 100
    lo = math.floor(h)
    if lo + 1 >= n:
        return float(sorted_values[-1])
    return sorted_values[lo] + (h - lo) * (sorted_values[lo + 1] - sorted_values[lo])


@dataclass(frozen=True)
class Stats:
    """Mean and percentiles of one latency, in seconds (NaN when there are no values)."""

    count: int
    mean: float
    p50: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> "Stats":
        xs = sorted(values)
        if not xs:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        return cls(len(xs), math.fsum(xs) / len(xs), percentile(xs, 50), percentile(xs, 95), percentile(xs, 99), xs[-1])

    @classmethod
    def of_ns(cls, values_ns: Iterable[int]) -> "Stats":
        """``Stats.of(v * (1 / NS_PER_S) for v in values_ns)``, the same figures bit for bit, from
        the distinct values and their counts (a simulation's ITL has millions of values, mostly
        repeats: every request of a decode step waits the same step).

        Why it is the same: ``v -> v * s`` (``s > 0``) keeps the order, so the order statistics
        are the distinct values' in order, each repeated its count; and :func:`math.fsum` is the
        correctly rounded exact sum, which the exact integer sum of ``count * value`` (floats are
        binary fractions) divided once (int / int: correctly rounded too) gives again."""
        counts = Counter(values_ns)
        if not counts:
            return cls.of(())
        s = 1 / NS_PER_S
        keys = sorted(counts)
        runs = _Runs([k * s for k in keys], list(accumulate(counts[k] for k in keys)))
        ratios = [x.as_integer_ratio() for x in runs.values]
        denominator = max(q for _, q in ratios)  # (powers of two: each divides the largest)
        exact = sum(p * (denominator // q) * counts[k] for (p, q), k in zip(ratios, keys))
        n = len(runs)
        return cls(n, exact / denominator / n, percentile(runs, 50), percentile(runs, 95), percentile(runs, 99),
                   runs.values[-1])


class _Runs(_Sequence):
    """Ascending values given as distinct ``values`` and ``ends[i]``, the number of values up to
    and including ``values[i]``: indexable like the expanded list, without expanding it."""

    def __init__(self, values: list[float], ends: list[int]):
        self.values, self.ends = values, ends

    def __len__(self) -> int:
        return self.ends[-1]

    def __getitem__(self, i: int) -> float:
        if i < 0:
            i += len(self)
        return self.values[bisect.bisect_right(self.ends, i)]


@dataclass(frozen=True)
class TenantMetrics:
    requests: int
    completed: int
    service_tokens: int
    mean_ttft: float


@dataclass(frozen=True)
class SloClassMetrics:
    """SLO attainment of one class of requests (shares of ``requests``; NaN when empty)."""

    requests: int
    ttft_attained: float
    tpot_attained: float
    attained: float  # both targets
    goodput: float  # requests of the class attaining both, per second


@dataclass(frozen=True)
class Metrics:
    """The metrics table of one simulation (see the module docstring for each definition)."""

    requests: int
    completed: int
    rejected: int
    aborted: int
    unfinished: int
    duration_s: float
    steps: int
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2e: Stats
    queueing: Stats
    request_throughput: float
    output_token_throughput: float
    total_token_throughput: float
    goodput: float | None  # None when no SLO was given
    slos: dict[str, float]
    preemptions: int
    preempted_requests: int
    kv_util_mean: float | None
    kv_util_peak: float | None
    prefill_tokens: int
    decode_tokens: int
    tenants: dict[str, TenantMetrics] = field(default_factory=dict)
    jain_fairness: float = 1.0
    offered_rate: float = 0.0  # arrivals per second of the trace as simulated
    queue_growth: float = math.nan  # see queue_growth(): share of the window's arrivals left in the system
    sustained_rate: float = math.nan  # see queue_growth(): requests per second leaving the system meanwhile
    slo_classes: dict[str, SloClassMetrics] = field(default_factory=dict)  # per-request targets, by class
    slo_attainment: float | None = None  # share of requests with targets that attained both (None: no targets)
    slo_goodput: float | None = None  # requests attaining their own targets per second (None: no targets)

    @property
    def unbounded_queue(self) -> bool:
        return self.queue_growth > UNBOUNDED_GROWTH  # False when unknown (NaN)


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index ``(Σx)² / (n·Σx²)``; 1.0 for no values or all zero."""
    total, squares = math.fsum(values), math.fsum(x * x for x in values)
    return 1.0 if not values or squares == 0 else total * total / (len(values) * squares)


def queue_growth(result: SimResult) -> tuple[float, float]:
    """How fast requests pile up while they arrive: ``(growth, sustained_rate)``.

    The window is the last three quarters of the arrival window (the first
    quarter is warm-up).  With ``A`` the requests that arrive in it and ``ΔN``
    the change, over it, of the number of requests in the system (arrived, not
    yet finished, aborted or rejected; read after the last step that ended by
    each end), ``growth = ΔN / A`` is the share of the window's arrivals the
    engine did not keep up with: about 0 below capacity, about
    ``1 - capacity / rate`` above it (for any arrival pattern: it compares
    counts, not a fitted line).  ``sustained_rate = (A - ΔN) / window`` is the
    rate at which requests left the system meanwhile: the engine's capacity when
    it is overloaded.  A growth above :data:`UNBOUNDED_GROWTH` means the queue
    grows without bound at this rate.  ``(NaN, NaN)`` when fewer than
    :data:`MIN_ARRIVALS_FOR_GROWTH` requests arrive in the window.
    """
    nan = (math.nan, math.nan)
    arrivals = sorted(t.arrival_ns for t in result.requests.values())
    if len(arrivals) < 2 or arrivals[-1] == arrivals[0] or not result.step_end_ns:
        return nan
    first, last = arrivals[0], arrivals[-1]
    start = first + (last - first) // 4
    arrived = bisect.bisect_right(arrivals, last) - bisect.bisect_right(arrivals, start)
    if arrived < MIN_ARRIVALS_FOR_GROWTH:
        return nan

    def in_system(t: int) -> int:  # after the last step that ended by t (0 before any step)
        j = bisect.bisect_right(result.step_end_ns, t)
        return result.in_system[j - 1] if j else 0

    delta = in_system(last) - in_system(start)
    return delta / arrived, (arrived - delta) / ((last - start) / NS_PER_S)


def summarize(result: SimResult, slos: dict[str, float] | None = None) -> Metrics:
    """The :class:`Metrics` of one simulation; ``slos`` maps ``ttft``/``tpot``/``e2e`` to seconds."""
    slos = dict(slos or {})
    unknown = set(slos) - {"ttft", "tpot", "e2e"}
    if unknown:
        raise ValueError(f"unknown SLO {sorted(unknown)[0]!r} (known: ttft, tpot, e2e)")
    s = 1 / NS_PER_S
    times = list(result.requests.values())
    done = [t for t in times if t.completed]
    ttft = {t.id: (t.first_token_ns - t.arrival_ns) * s for t in done}
    e2e = {t.id: (t.finish_ns - t.arrival_ns) * s for t in done}
    tpot = {t.id: (e2e[t.id] - ttft[t.id]) / (t.outputs - 1) for t in done if t.outputs > 1}
    start = min((t.arrival_ns for t in times), default=0)
    duration = max(result.end_ns - start, 1) * s
    good = None
    if slos:
        limit = {"ttft": ttft, "e2e": e2e, "tpot": tpot}
        good = sum(1 for t in done if all(limit[k].get(t.id, 0.0) <= v for k, v in slos.items())) / duration
    kv_mean = kv_peak = None
    if result.usable_blocks and result.used_blocks and min(result.used_blocks) >= 0:
        weights = result.step_ns
        busy = sum(weights)
        used = result.used_blocks
        kv_mean = (sum(map(operator.mul, used, weights)) / busy if busy else 0.0) / result.usable_blocks
        kv_peak = max(used) / result.usable_blocks
    tenants = _tenants(result, ttft)
    classes, attainment, slo_goodput = _slo_attainment(times, ttft, tpot, duration)
    growth, sustained = queue_growth(result)
    arrivals = [t.arrival_ns for t in times]
    span = (max(arrivals) - min(arrivals)) * s if arrivals else 0.0
    return Metrics(
        requests=len(times),
        completed=len(done),
        rejected=sum(1 for t in times if t.outcome and t.outcome.startswith("rejected")),
        aborted=sum(1 for t in times if t.outcome == "aborted"),
        unfinished=sum(1 for t in times if t.outcome is None),
        duration_s=duration,
        steps=result.steps,
        ttft=Stats.of(ttft.values()),
        tpot=Stats.of(tpot.values()),
        itl=Stats.of_ns(result.itl_ns),
        e2e=Stats.of(e2e.values()),
        queueing=Stats.of((t.first_scheduled_ns - t.arrival_ns) * s for t in done),
        request_throughput=len(done) / duration,
        output_token_throughput=sum(t.outputs for t in done) / duration,
        total_token_throughput=sum(t.outputs + t.prompt_len for t in done) / duration,
        goodput=good,
        slos=slos,
        preemptions=sum(t.preemptions for t in times),
        preempted_requests=sum(1 for t in times if t.preemptions),
        kv_util_mean=kv_mean,
        kv_util_peak=kv_peak,
        prefill_tokens=result.prefill_tokens,
        decode_tokens=result.decode_tokens,
        tenants=tenants,
        jain_fairness=jain_index([m.service_tokens for m in tenants.values()]),
        offered_rate=(len(arrivals) - 1) / span if span > 0 else 0.0,
        queue_growth=growth,
        sustained_rate=sustained,
        slo_classes=classes,
        slo_attainment=attainment,
        slo_goodput=slo_goodput,
    )


#: The class of a request whose targets are its own (no ``slo_class``).
PER_REQUEST = "(per request)"


def _slo_attainment(times: list, ttft: dict[str, float], tpot: dict[str, float], duration: float
                    ) -> tuple[dict[str, SloClassMetrics], float | None, float | None]:
    """Per class: which requests attained their TTFT / TPOT targets (definitions in the module docstring)."""
    by_class: dict[str, list[tuple[bool, bool]]] = {}
    for t in times:
        if t.ttft_target_s is None and t.tpot_target_s is None:
            continue
        done = t.id in ttft
        ok_ttft = done and (t.ttft_target_s is None or ttft[t.id] <= t.ttft_target_s)
        ok_tpot = done and (t.tpot_target_s is None or tpot.get(t.id, 0.0) <= t.tpot_target_s)
        by_class.setdefault(t.slo_class or PER_REQUEST, []).append((ok_ttft, ok_tpot))
    if not by_class:
        return {}, None, None
    out = {}
    for name in sorted(by_class):
        rows = by_class[name]
        n = len(rows)
        both = sum(1 for a, b in rows if a and b)
        out[name] = SloClassMetrics(n, sum(a for a, _ in rows) / n, sum(b for _, b in rows) / n, both / n, both / duration)
    total = sum(m.requests for m in out.values())
    good = sum(round(m.attained * m.requests) for m in out.values())
    return out, good / total, good / duration


def _tenants(result: SimResult, ttft: dict[str, float]) -> dict[str, TenantMetrics]:
    by_tenant: dict[str, list] = {}
    for t in result.requests.values():
        by_tenant.setdefault(t.tenant, []).append(t)
    out = {}
    for name in sorted(by_tenant):
        members = by_tenant[name]
        firsts = [ttft[t.id] for t in members if t.id in ttft]
        out[name] = TenantMetrics(
            requests=len(members),
            completed=sum(1 for t in members if t.completed),
            service_tokens=result.tenant_service.get(name, 0),
            mean_ttft=math.fsum(firsts) / len(firsts) if firsts else math.nan,
        )
    return out
