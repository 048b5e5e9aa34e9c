"""Running simulations: profile specs, one run, comparisons, and arrival-rate sweeps.

The semantics (the discrete-event loop, the cost model, the metric
definitions) are in :mod:`spec.simulate`, :mod:`spec.costmodel` and
:mod:`spec.metrics`; this module is the harness around them:

* ``name`` or ``name:knob=value,knob=value`` names a configuration to simulate
  (:func:`parse_profile_spec`), e.g. ``vllm-v1:enable_chunked_prefill=false``;
* the configuration of a run is, from weakest to strongest: the profile's
  knobs; the cost model's deployment knobs (``num_blocks``, ``max_model_len``)
  unless the trace header sets them; the trace header's knobs; the spec's knobs;
  then ``--set`` knobs for every run (:func:`run_config`);
* :func:`sweep` runs every (profile, rate) pair in worker processes (each
  keeps a prompt cache, so a trace's prompts are synthesized once per worker)
  and :func:`capacity` reads the boundary off the results.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import sys
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable

from spec.config import PROFILES, ConfigError, SchedulerConfig, resolve
from spec.costmodel import PRESETS, CostModel
from spec.formats import Trace
from spec.metrics import Metrics, summarize
from spec.simulate import SimResult, mean_rate, scale_to_rate, simulate

#: Per worker process: synthesized prompts and their block hashes, shared by every run.
_PROMPT_CACHE: dict = {}


class UnknownProfile(ConfigError):
    """A profile spec names a profile that does not exist (yet)."""


def parse_value(text: str) -> Any:
    """``true``/``false``, an integer, a number, or else the text itself."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


def parse_knobs(text: str) -> dict[str, Any]:
    """``knob=value,knob=value`` to a dict (values through :func:`parse_value`)."""
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        if not eq or not name.strip():
            raise ConfigError(part, "expected knob=value")
        out[name.strip()] = parse_value(value)
    return out


@dataclass(frozen=True)
class ProfileSpec:
    """A profile name plus knob overrides, as written on the command line."""

    text: str
    profile: str
    knobs: tuple[tuple[str, Any], ...] = ()


def parse_profile_spec(text: str) -> ProfileSpec:
    """``vllm-v1`` or ``vllm-v1:enable_chunked_prefill=false,max_num_batched_tokens=8192``."""
    name, _, knobs = text.strip().partition(":")
    if not name:
        raise ConfigError("profile", f"empty profile name in {text!r}")
    return ProfileSpec(text.strip(), name, tuple(parse_knobs(knobs).items()))


def split_profiles(text: str) -> list[str]:
    """Split ``a,b:k=v,k2=v2,c`` into specs: a comma starts a new spec only before a name
    without ``=`` (so knob lists may contain commas)."""
    specs: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if specs and "=" in part and ":" not in part:
            specs[-1] += "," + part
        else:
            specs.append(part)
    return specs


def run_config(trace: Trace, spec: ProfileSpec | None, cost: CostModel, overrides: dict[str, Any] | None = None) -> SchedulerConfig:
    """The configuration of one run (precedence in the module docstring); raise ConfigError."""
    raw = dict(trace.config)
    if spec is not None:
        if spec.profile not in PROFILES:
            raise UnknownProfile("profile", f"unknown profile {spec.profile!r} (known: {', '.join(sorted(PROFILES))})")
        raw = {k: v for k, v in raw.items() if k not in ("profile",)}
        raw["profile"] = spec.profile
        raw.update(dict(spec.knobs))
    for knob, value in cost.knobs.items():
        raw.setdefault(knob, value)
    raw.update(overrides or {})
    config = resolve(raw)
    if "slo_step_s" not in raw and any(r.ttft_slo is not None or r.tpot_slo is not None for r in trace.requests):
        config = dataclasses.replace(config, slo_step_s=modelled_step_s(cost, config))
    return config


def modelled_step_s(cost: CostModel, config: SchedulerConfig) -> float:
    """The step the SLO rules model (SLO.FEASIBLE: the whole token budget of prefill), timed by
    the cost model: what a timed trace's targets in seconds are divided by to get the
    scheduler's steps (knob ``slo_step_s``) unless the run sets it."""
    from spec.costmodel import StepShape

    budget = config.max_num_batched_tokens
    return max(cost.step_ns(StepShape(budget, 0, budget)) / 1e9, 1e-9)


def with_targets(trace: Trace, classes: list[dict[str, Any]], predict: str = "none") -> Trace:
    """The trace with SLO classes given to every request without targets of its own, and a
    predicted output length.

    ``classes``: ``[{"class": name, "ttft": s, "tpot": s, "share": fraction}, ...]`` (targets
    in seconds; ``share`` defaults to what the earlier classes leave).  A request goes to the
    class its id hashes into (``crc32(id) mod 10^6 / 10^6`` against the cumulative shares:
    deterministic, independent of order), and gets the class's index as its ``priority``
    (0 = the first class, the most important) when it has none, so that ``priority``
    profiles serve the classes in the order given.  ``predict="oracle"``: the predicted
    output length is the request's ``max_tokens`` (an imported trace's real output length, a
    perfect predictor); ``"none"``: none (sprpt then ranks by max_tokens, the same here)."""
    import zlib

    if predict not in ("none", "oracle"):
        raise ValueError(f"predict must be none or oracle, got {predict!r}")
    bounds, total, names = [], 0.0, []
    for i, c in enumerate(classes):
        name = c.get("class") or ("default" if len(classes) == 1 else f"class{i}")
        total = min(1.0, total + c["share"]) if "share" in c else 1.0
        bounds.append(total)
        names.append(name)
    if bounds:
        bounds[-1] = 1.0
    reqs = []
    for r in trace.requests:
        if classes and r.ttft_slo is None and r.tpot_slo is None and r.slo_class is None:
            u = zlib.crc32(r.id.encode()) % 1_000_000 / 1_000_000
            i = next(k for k, b in enumerate(bounds) if u < b or k == len(bounds) - 1)
            r = dataclasses.replace(r, slo_class=names[i], ttft_slo=classes[i].get("ttft"), tpot_slo=classes[i].get("tpot"),
                                    priority=r.priority or i)
        if predict == "oracle" and r.predicted_output_len is None:
            r = dataclasses.replace(r, predicted_output_len=r.max_tokens)
        reqs.append(r)
    table = dict(trace.slo_classes or {})
    for name, c in zip(names, classes):
        table.setdefault(name, {k: c[k] for k in ("ttft", "tpot") if k in c})
    return dataclasses.replace(trace, requests=reqs, slo_classes=table or None)


def load_cost_model(name_or_path: str) -> CostModel:
    """A preset name, or a JSON file written by ``fuzz.calibrate`` (``CostModel.to_json``)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if os.path.exists(name_or_path):
        with open(name_or_path) as f:
            try:
                return CostModel.from_json(json.load(f))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{name_or_path}: not a cost model: {e}") from None
    raise ValueError(f"unknown cost model {name_or_path!r} (presets: {', '.join(PRESETS)}; or a JSON file)")


def run_one(trace: Trace, config: SchedulerConfig, cost: CostModel, keep_records: int = 0,
            on_step: Callable[[SimResult], None] | None = None, engine: str = "spec") -> SimResult:
    """One simulation with the fast engine settings and this process's prompt cache.

    ``engine="gpu"``: gpu_engine's decisions instead of the spec's
    (:func:`fuzz.sim_engine.run_gpu`; check them with :func:`check`)."""
    if engine not in ("spec", "gpu"):
        raise ValueError(f"unknown simulation engine {engine!r} (spec or gpu)")
    with no_full_collections():
        if engine == "gpu":
            from fuzz.sim_engine import run_gpu

            return run_gpu(trace, config, cost, keep_records=keep_records, on_step=on_step)
        from spec.scheduler import SpecEngine

        # (speculative decoding: BatchTracker reads the computed counts rejected drafts were rolled back to)
        engine = SpecEngine(config, trace.vocab_size, trace.eos_token_id, record_level="memory",
                            record_reasons=False, record_state=config.num_speculative_tokens > 0,
                            prompt_cache=_PROMPT_CACHE)
        return simulate(trace, cost, engine, keep_records=keep_records, on_step=on_step)


@contextlib.contextmanager
def no_full_collections():
    """No full (oldest-generation) collections of the cyclic garbage collector meanwhile.
    A simulation's garbage is freed by reference counting or dies young (the young
    generations are still collected), while each full collection re-scans the process's
    long-lived caches (synthesized prompts, hash chains): ~0.15 s a run of a 19k-request
    trace on gpu_engine's decisions."""
    old = gc.get_threshold()
    gc.set_threshold(old[0], old[1], 1 << 30)
    try:
        yield
    finally:
        gc.set_threshold(*old)


def check(trace: Trace, config: SchedulerConfig, cost: CostModel, result: SimResult, mode: str) -> int:
    """``--check-engine``: compare a gpu_engine run with the spec's on the same input; raise
    :class:`fuzz.sim_engine.EngineMismatch` on the first difference, return the steps compared.
    ``full``: the whole run (the spec re-simulates it); ``sampled``: the first
    :data:`~fuzz.sim_engine.CHECK_REQUESTS` arrivals; ``off``: nothing (0)."""
    from fuzz.sim_engine import CHECK_REQUESTS, check_run

    if mode == "off":
        return 0
    return check_run(trace, config, cost, None if mode == "full" else CHECK_REQUESTS, gpu_result=result)


def with_arrival_times(trace: Trace) -> Trace:
    """A step-arrival trace (``arrival_step`` only) read as seconds: step k arrives at k s.

    Under the ``unit`` cost model (1 s per step) the simulation then follows
    :func:`spec.protocol.drive`'s step numbering.
    """
    if all(r.arrival_time is not None for r in trace.requests):
        return trace
    if any(r.arrival_time is None and r.arrival_step is None for r in trace.requests):
        raise ValueError("every request needs arrival_time or arrival_step")
    reqs = [r if r.arrival_time is not None else dataclasses.replace(r, arrival_time=float(r.arrival_step)) for r in trace.requests]
    return dataclasses.replace(trace, requests=reqs)


# --------------------------------------------------------------------------
# Sweeps.
# --------------------------------------------------------------------------


@dataclass
class SweepPoint:
    profile: str
    rate: float
    metrics: Metrics | None = None
    error: str | None = None
    skipped: str | None = None
    cpu_s: float = 0.0
    checked_steps: int = 0  # steps on which gpu_engine's decisions were compared with the spec's


@dataclass
class Capacity:
    """Where a profile stops keeping up (from a sweep's points, ascending rate)."""

    profile: str
    slo_s: float
    slo_rate: float | None  # interpolated rate at which p99 TTFT crosses the SLO (None: never in range)
    slo_bracket: tuple[float | None, float | None]  # last rate within the SLO, first rate above it
    unbounded_rate: float | None  # first rate at which the queue grows without bound
    last_bounded_rate: float | None
    capacity_estimate: float | None  # the sustained rate at the first unbounded rate


def _sweep_job(trace: Trace, spec: ProfileSpec, rate: float, cost: CostModel, overrides: dict[str, Any],
               slos: dict[str, float], engine: str = "spec", check_mode: str = "off") -> tuple[Metrics, float, int]:
    import time

    t0 = time.process_time()
    config = run_config(trace, spec, cost, overrides)
    scaled = scale_to_rate(trace, rate)
    result = run_one(scaled, config, cost, engine=engine)
    checked = check(scaled, config, cost, result, check_mode) if engine == "gpu" else 0
    return summarize(result, slos), time.process_time() - t0, checked


def _check_job(trace: Trace, spec: ProfileSpec, rate: float, cost: CostModel, overrides: dict[str, Any]) -> tuple[int, float]:
    """A sampled check on its own (independent of the point's run): (steps compared, CPU seconds)."""
    import time

    t0 = time.process_time()
    config = run_config(trace, spec, cost, overrides)
    return check(scale_to_rate(trace, rate), config, cost, None, "sampled"), time.process_time() - t0


#: Per worker process of a parallel sweep: the trace, sent once (not with every job).
_TRACE: list = []


def _keep_trace(trace: Trace) -> None:
    """A worker's start: keep the trace; one torch thread.  (A worker forked from a process
    whose torch already ran parallel code deadlocks in its first parallel torch op unless it
    runs single-threaded; a simulation is single-threaded work anyway.)"""
    _TRACE[:] = [trace]
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def _pooled(job: Callable, *args):
    """``job(trace, *args)`` in a worker, on the trace :func:`_keep_trace` kept."""
    return job(_TRACE[0], *args)


def sweep(trace: Trace, specs: list[ProfileSpec], rates: list[float], cost: CostModel, *,
          overrides: dict[str, Any] | None = None, slos: dict[str, float] | None = None, jobs: int = 1,
          stop_after_unbounded: int | None = 1, on_point: Callable[[SweepPoint], None] | None = None,
          engine: str = "spec", check_engine: str = "sampled") -> list[SweepPoint]:
    """Simulate every profile at every rate; return the points (profiles in order, rates ascending).

    Profiles that do not resolve (unknown names, bad knobs) get one point with
    ``error`` and no runs.  With ``stop_after_unbounded = k``, once a profile's
    queue grew without bound at ``k`` rates, its higher rates are skipped
    (``skipped``): they can only be worse.  ``jobs`` worker processes run the
    points, lowest rates first; highest first when every point runs
    (``stop_after_unbounded=None``: see :func:`_sweep_parallel`).

    ``engine="gpu"`` simulates gpu_engine's decisions (:mod:`fuzz.sim_engine`);
    ``check_engine`` then compares them with the spec's: ``full`` every run whole,
    ``sampled`` the first arrivals of the lowest and the highest rate, ``off`` none.
    A mismatch makes that point an error.
    """
    overrides, slos = dict(overrides or {}), dict(slos or {})
    rates = sorted(set(rates))
    points: dict[tuple[str, float], SweepPoint] = {}
    runnable = []
    for spec in specs:
        try:
            run_config(trace, spec, cost, overrides)
            runnable.append(spec)
        except ConfigError as e:
            point = SweepPoint(spec.text, math.nan, error=str(e))
            points[(spec.text, math.nan)] = point
            if on_point:
                on_point(point)
    order = [(spec, rate) for rate in rates for spec in runnable]
    unbounded: dict[str, int] = {}
    sampled = {rates[0], rates[-1]} if rates else set()

    def check_mode(rate: float) -> str:
        if engine != "gpu" or check_engine == "off":
            return "off"
        return "full" if check_engine == "full" else ("sampled" if rate in sampled else "off")

    def finish(point: SweepPoint) -> None:
        points[(point.profile, point.rate)] = point
        if point.metrics is not None and point.metrics.unbounded_queue:
            unbounded[point.profile] = unbounded.get(point.profile, 0) + 1
        if on_point:
            on_point(point)

    def beyond(spec: ProfileSpec, rate: float) -> bool:
        if stop_after_unbounded is None or unbounded.get(spec.text, 0) < stop_after_unbounded:
            return False
        done = [r for (p, r), pt in points.items() if p == spec.text and pt.metrics is not None and pt.metrics.unbounded_queue]
        return rate > max(done)

    if jobs <= 1:
        for spec, rate in order:
            if beyond(spec, rate):
                finish(SweepPoint(spec.text, rate, skipped="beyond the capacity boundary"))
                continue
            try:
                metrics, cpu, checked = _sweep_job(trace, spec, rate, cost, overrides, slos, engine, check_mode(rate))
            except RuntimeError as e:  # gpu_engine differs from the spec: report it, keep sweeping
                if engine != "gpu" or type(e).__name__ != "EngineMismatch":
                    raise
                finish(SweepPoint(spec.text, rate, error=f"{type(e).__name__}: {e}"))
                continue
            finish(SweepPoint(spec.text, rate, metrics, cpu_s=cpu, checked_steps=checked))
    else:
        _sweep_parallel(trace, order, cost, overrides, slos, jobs, engine, check_mode, beyond, finish,
                        by_cost=stop_after_unbounded is None)
    order_index = {spec.text: i for i, spec in enumerate(specs)}
    return sorted(points.values(), key=lambda p: (order_index.get(p.profile, 0), p.rate if not math.isnan(p.rate) else -1))


def _sweep_parallel(trace: Trace, order: list[tuple[ProfileSpec, float]], cost: CostModel, overrides: dict[str, Any],
                    slos: dict[str, float], jobs: int, engine: str, check_mode: Callable[[float], str],
                    beyond: Callable[[ProfileSpec, float], bool], finish: Callable[[SweepPoint], None],
                    by_cost: bool) -> None:
    """:func:`sweep`'s points in ``jobs`` worker processes (the trace sent to each once).

    A sampled check is a job of its own (it simulates a window, not the point's run), so the
    two workers share it.  ``by_cost`` (every point runs: no skipping beyond the capacity
    boundary): the highest rates first, the short checks last — the longest jobs start
    first, so the workers finish together; otherwise ascending rates, as the skipping
    needs.  A point is finished when its run and its check are both done."""
    tasks = [("run", spec, rate) for spec, rate in order]
    checks = [("check", spec, rate) for spec, rate in order if check_mode(rate) == "sampled"]
    if by_cost:
        tasks = sorted(tasks, key=lambda t: -t[2]) + checks
    else:  # each check right after its run (dropped with it when the run is skipped)
        tasks = [t for run in tasks for t in [run] + [c for c in checks if c[1:] == run[1:]]]
    pending: dict[tuple[str, float], dict] = {}  # (profile, rate) -> the parts done so far
    skipped: set[tuple[str, float]] = set()

    def done(spec: ProfileSpec, rate: float, **part) -> None:
        got = pending.setdefault((spec.text, rate), {})
        got.update(part)
        if "run" not in got or (check_mode(rate) == "sampled" and "check" not in got):
            return
        del pending[(spec.text, rate)]
        run, chk = got["run"], got.get("check", (0, 0.0))
        if isinstance(run, Exception) or isinstance(chk, Exception):
            e = run if isinstance(run, Exception) else chk  # a run failed (stall, step limit) or differs: report it
            finish(SweepPoint(spec.text, rate, error=f"{type(e).__name__}: {e}"))
        else:
            metrics, cpu, checked = run
            finish(SweepPoint(spec.text, rate, metrics, cpu_s=cpu + chk[1], checked_steps=checked + chk[0]))

    with ProcessPoolExecutor(max_workers=jobs, initializer=_keep_trace, initargs=(trace,)) as pool:
        running: dict[Future, tuple[str, ProfileSpec, float]] = {}
        while tasks or running:
            while tasks and len(running) < jobs:
                kind, spec, rate = tasks.pop(0)
                if (spec.text, rate) in skipped:
                    continue
                if kind == "run" and beyond(spec, rate):
                    skipped.add((spec.text, rate))
                    finish(SweepPoint(spec.text, rate, skipped="beyond the capacity boundary"))
                    continue
                if kind == "run":
                    mode = "off" if check_mode(rate) == "sampled" else check_mode(rate)
                    future = pool.submit(_pooled, _sweep_job, spec, rate, cost, overrides, slos, engine, mode)
                else:
                    future = pool.submit(_pooled, _check_job, spec, rate, cost, overrides)
                running[future] = (kind, spec, rate)
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                kind, spec, rate = running.pop(future)
                try:
                    done(spec, rate, **{kind: future.result()})
                except Exception as e:
                    done(spec, rate, **{kind: e})


def capacity(points: list[SweepPoint], slo_s: float) -> dict[str, Capacity]:
    """Per profile: where p99 TTFT crosses ``slo_s`` and where the queue becomes unbounded.

    The SLO crossing is interpolated between the last rate whose p99 TTFT is
    within the SLO and the next one above it, linearly in rate and in log(p99 TTFT)
    (latency grows exponentially fast near capacity; this is the straight segment
    of the log-scale plot).  The capacity estimate is the sustained rate
    (:func:`spec.metrics.queue_growth`) at the first unbounded rate: the
    completion rate the engine keeps up while overloaded.
    """
    out: dict[str, Capacity] = {}
    by_profile: dict[str, list[SweepPoint]] = {}
    for p in points:
        if p.metrics is not None:
            by_profile.setdefault(p.profile, []).append(p)
    for profile, pts in by_profile.items():
        pts.sort(key=lambda p: p.rate)
        below = above = None
        for p in pts:
            if p.metrics.ttft.p99 <= slo_s:
                if above is None:
                    below = p
            elif above is None:
                above = p
        slo_rate = None
        if above is not None and below is not None:  # straight line in (rate, log p99): the log-scale plot's segment
            y0, y1 = math.log(max(below.metrics.ttft.p99, 1e-9)), math.log(above.metrics.ttft.p99)
            slo_rate = below.rate + (math.log(slo_s) - y0) * (above.rate - below.rate) / (y1 - y0)
        elif above is not None:
            slo_rate = above.rate  # already above at the lowest rate swept: at most this
        first_unbounded = next((p for p in pts if p.metrics.unbounded_queue), None)
        bounded = [p.rate for p in pts if not p.metrics.unbounded_queue and (first_unbounded is None or p.rate < first_unbounded.rate)]
        out[profile] = Capacity(
            profile=profile,
            slo_s=slo_s,
            slo_rate=slo_rate,
            slo_bracket=(below.rate if below else None, above.rate if above else None),
            unbounded_rate=first_unbounded.rate if first_unbounded else None,
            last_bounded_rate=max(bounded) if bounded else None,
            capacity_estimate=first_unbounded.metrics.sustained_rate if first_unbounded else None,
        )
    return out


def default_rates(trace: Trace, count: int = 10) -> list[float]:
    """``count`` rates spaced by factors of 2 around the trace's own rate (1/8x .. 64x for 10)."""
    base = mean_rate(trace.requests)
    return [round(base * 2 ** (k - 3), 4) for k in range(count)]
