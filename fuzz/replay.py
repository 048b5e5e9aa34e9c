"""Differential replay: run a trace through an engine and through the spec, then diff.

The engine runs first, alone, under :func:`spec.protocol.drive`.  The spec then
replays the same trace in lock step, **fed with the engine's sampled tokens**
(``SpecEngine.feed(record.sampled)`` before each of its steps): token values
matter to scheduling only through stop conditions and prefix hashing, and in a
differential run they are an input, not something the spec predicts
(DESIGN.md §3).  Whether those tokens are *right* is the reference engine's job.

:func:`first_divergence` then reports the first step and field on which the two
decision logs differ.  A side that does not finish within ``max_steps`` while
the other does is a divergence of kind ``non-termination`` (both stalling at
the same step, with the same decisions, is agreement, noted in the result);
a side that raises is a divergence of kind ``error``.
:func:`replay_records` diffs the spec against a log recorded earlier.

Engines are made by name through a registry (:func:`register_engine`), so that
the CLI, the conformance runner and users' adapters share one factory:
``spec`` and ``vllm`` are built in; :mod:`fuzz.engines` registers ``gpu``,
``gpu-model`` and ``reference``.
"""
from __future__ import annotations

import sys

import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from fuzz.diff import ERROR, NON_TERMINATION, Divergence, first_divergence
from spec.config import resolve
from spec.formats import StepRecord, Trace, TraceRequest
from spec.protocol import Engine, StepLimitError, drive

EngineFactory = Callable[[Trace], Engine]


class EngineUnavailable(RuntimeError):
    """An engine cannot be built here (a missing optional dependency, an unknown name)."""


class EngineConfigError(ValueError):
    """The engine refuses the trace's configuration (e.g. vLLM's own config validation)."""


@dataclass(frozen=True)
class EngineEntry:
    name: str
    factory: EngineFactory
    description: str


ENGINES: dict[str, EngineEntry] = {}


def register_engine(name: str, factory: EngineFactory, description: str = "") -> None:
    """Make ``factory(trace) -> Engine`` available as ``--engine name``."""
    ENGINES[name] = EngineEntry(name, factory, description)


def _import_factory(spec: str) -> EngineFactory:
    """``module:attr`` -> the callable ``attr`` of ``module`` (imported from the working directory too,
    as uvicorn and gunicorn do), so ``--engine mypkg.engine:MyEngine`` needs no registration code."""
    import importlib
    import os

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr.isidentifier():
        raise EngineUnavailable(f"engine {spec!r}: expected MODULE:FACTORY, e.g. examples.toy_engine:ToyEngine")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EngineUnavailable(f"engine {spec!r}: cannot import {module_name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise EngineUnavailable(f"engine {spec!r}: {module_name} has no callable {attr!r}")
    return factory


def make_engine(name: str, trace: Trace) -> Engine:
    """A fresh engine configured from ``trace``'s header.  ``name`` is a registered engine
    or ``MODULE:FACTORY``, a callable ``factory(trace) -> Engine`` importable from here."""
    if name not in ENGINES and ":" in name:
        register_engine(name, _import_factory(name), f"{name} (imported)")
    if name not in ENGINES:
        try:  # the engines other packages provide register themselves there
            import fuzz.engines  # noqa: F401
        except ImportError:
            pass
    if name not in ENGINES:
        raise EngineUnavailable(f"unknown engine {name!r} (known: {', '.join(sorted(ENGINES))})")
    return ENGINES[name].factory(trace)


def _spec_factory(trace: Trace) -> Engine:
    from spec.scheduler import SpecEngine

    return SpecEngine.from_trace(trace, check_invariants=False)


def _vllm_factory(trace: Trace) -> Engine:
    from fuzz.vllm_adapter import VllmEngine

    return VllmEngine(trace)


register_engine("spec", _spec_factory, "the specification itself (spec.scheduler.SpecEngine)")
register_engine("vllm", _vllm_factory, "vLLM 0.32's V1 Scheduler in-process, fake model outputs (extra `vllm`)")


class FedSpec:
    """The spec engine, fed the tokens an engine sampled at each step.

    ``drive`` does not tell an engine the step number before ``step()``; it is
    recovered from what the driver does: step ``k`` follows step ``k-1``, except
    after an idle gap, when the driver jumps to the arrival step of the requests
    it adds next.  So the step about to run is
    ``max(previous + 1, latest arrival_step added since)``.
    """

    def __init__(self, spec: Engine, engine_records: list[StepRecord]):
        self.spec = spec
        self.name = getattr(spec, "name", "spec")
        self.tokens = {r.step: r.sampled for r in engine_records}
        self.previous = -1
        self.latest_arrival = -1

    def add_request(self, request: TraceRequest) -> None:
        self.latest_arrival = max(self.latest_arrival, request.arrival_step or 0)
        self.spec.add_request(request)

    def abort_request(self, request_id: str) -> None:
        self.spec.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.spec.has_unfinished_requests()

    def step(self) -> StepRecord:
        step = max(self.previous + 1, self.latest_arrival)
        self.previous = step
        self.spec.feed(self.tokens.get(step, {}))
        return self.spec.step()


@dataclass
class RunOutcome:
    """One side's run: its records, and how it ended."""

    records: list[StepRecord]
    stuck_at: int | None = None  # step at which max_steps was reached
    error: str | None = None  # the exception, if it raised
    error_step: int | None = None


def _run(engine: Engine, trace: Trace, max_steps: int) -> RunOutcome:
    records: list[StepRecord] = []
    try:
        return RunOutcome(drive(engine, trace, max_steps, on_step=records.append))
    except StepLimitError as e:
        return RunOutcome(e.records, stuck_at=e.step)
    except Exception as e:  # an engine that crashes on a trace is a finding, not a harness failure
        tb = traceback.extract_tb(e.__traceback__)
        where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
        step = records[-1].step + 1 if records else 0
        return RunOutcome(records, error=f"{type(e).__name__}: {e}{where}", error_step=step)


@dataclass
class ReplayResult:
    """The outcome of one differential replay."""

    trace: Trace
    engine: str
    level: str
    engine_records: list[StepRecord]
    spec_records: list[StepRecord]
    divergence: Divergence | None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def agreed(self) -> bool:
        return self.divergence is None

    @property
    def steps(self) -> int:
        return len(self.spec_records)

    def summary(self) -> str:
        name = self.trace.name or self.trace.source or "trace"
        if self.agreed:
            return (f"{name}: spec and {self.engine} agree at the {self.level} level "
                    f"({len(self.engine_records)} steps, {len(self.trace.requests)} requests)")
        return f"{name}: spec and {self.engine} diverge\n{self.divergence.describe()}"

    def describe(self) -> str:
        """The summary plus any notes (e.g. both sides stalled)."""
        return "\n".join([self.summary(), *(f"note: {n}" for n in self.notes)])


def _limit_divergence(spec: RunOutcome, eng: RunOutcome, engine: str) -> Divergence | None:
    """A crash, or a step limit reached by one side only, reported where it happened.

    When both sides reach ``max_steps`` at the same step they agree (both stall or
    livelock the same way); :func:`replay` then compares their records and notes it.
    """
    for side, out in (("engine", eng), ("spec", spec)):
        if out.error is not None:
            value = f"raised {out.error}"
            return Divergence(out.error_step or 0, f"{side} raised", value if side == "spec" else "ran",
                              value if side == "engine" else "ran", kind=ERROR, engine=engine)
    if spec.stuck_at == eng.stuck_at:  # neither stuck, or both at the same step
        return None
    step = min(s for s in (spec.stuck_at, eng.stuck_at) if s is not None)
    what = lambda out: f"still running at max_steps={out.stuck_at}" if out.stuck_at is not None else "finished"
    return Divergence(step, "termination", what(spec), what(eng), kind=NON_TERMINATION, engine=engine)


def _compare(trace: Trace, eng_out: RunOutcome, name: str, level: str, t0: float) -> ReplayResult:
    """Run the spec fed with the engine's tokens, then diff the two runs."""
    from spec.scheduler import SpecEngine

    max_steps = resolve(trace.config).max_steps
    spec_out = _run(FedSpec(SpecEngine.from_trace(trace), eng_out.records), trace, max_steps)
    cut = _limit_divergence(spec_out, eng_out, name)
    spec_recs, eng_recs = spec_out.records, eng_out.records
    if cut is not None:  # compare only what both sides ran before the limit or crash
        spec_recs = [r for r in spec_recs if r.step < cut.step]
        eng_recs = [r for r in eng_recs if r.step < cut.step]
    found = first_divergence(spec_recs, eng_recs, level, engine=name) or cut
    notes = []
    if found is None and spec_out.stuck_at is not None:
        notes.append(f"both the spec and {name} reach max_steps={spec_out.stuck_at} with requests unfinished: "
                     "they stall (or livelock) identically on this trace")
    return ReplayResult(trace, name, level, eng_out.records, spec_out.records, found, time.perf_counter() - t0, notes)


def replay(trace: Trace, engine: str | Engine = "vllm", level: str = "exact") -> ReplayResult:
    """Replay ``trace`` through ``engine`` (a name or an instance) and the spec; diff at ``level``."""
    t0 = time.perf_counter()
    eng = make_engine(engine, trace) if isinstance(engine, str) else engine
    eng_out = _run(eng, trace, resolve(trace.config).max_steps)
    return _compare(trace, eng_out, getattr(eng, "name", str(engine)), level, t0)


def replay_records(trace: Trace, engine_records: list[StepRecord], level: str = "exact", engine: str = "log") -> ReplayResult:
    """Diff the spec against a decision log recorded earlier (a corpus file, another
    language's engine).  A log whose last record is at step ``max_steps - 1`` is
    taken as a run cut off by the step limit."""
    t0 = time.perf_counter()
    max_steps = resolve(trace.config).max_steps
    records = list(engine_records)
    stuck = max_steps if records and records[-1].step >= max_steps - 1 else None
    return _compare(trace, RunOutcome(records, stuck_at=stuck), engine, level, t0)


def replay_command(trace_path: str, engine: str = "vllm", level: str = "exact",
                   log_path: str | None = None, spec_log_path: str | None = None, json_out: bool = False,
                   engine_log: str | None = None) -> int:
    """``batchspec replay TRACE --engine NAME --level L``: print the verdict.

    Exit status: 0 the spec and the engine agree, 1 they diverge, 2 bad input
    (an unreadable trace or config, a configuration the engine refuses, an
    engine that is not installed).  ``log_path`` / ``spec_log_path`` write the
    engine's and the spec's decision logs.  ``engine_log`` compares against a
    decision log recorded earlier instead of running an engine.
    """
    import json

    from rich.console import Console

    from fuzz.diff import LevelError
    from spec.config import ConfigError
    from spec.formats import DecisionLog
    from spec.io import FormatError, load_log, load_trace, write_log

    out, err = Console(), Console(stderr=True)
    try:
        trace = load_trace(trace_path)
        if engine_log:
            log = load_log(engine_log)
            result = replay_records(trace, log.records, level, engine=log.engine)
        else:
            result = replay(trace, engine, level)
    except (FormatError, ConfigError, LevelError, EngineUnavailable, EngineConfigError) as e:
        err.print(f"[red]error:[/] {e}", highlight=False)
        return 2
    if log_path:
        write_log(DecisionLog(result.engine, level, result.engine_records, trace=trace_path, config=trace.config), log_path)
    if spec_log_path:
        write_log(DecisionLog("spec", level, result.spec_records, trace=trace_path, config=trace.config), spec_log_path)
    broken = [] if result.agreed else engine_log_violations(result)
    if json_out:
        verdict = {"trace": trace_path, "engine": result.engine, "level": level, "agreed": result.agreed,
                   "steps": len(result.engine_records), "seconds": round(result.seconds, 3),
                   "divergence": result.divergence.to_json() if result.divergence else None,
                   "engine_log_violations": [v.__dict__ for v in broken]}
        out.print_json(json.dumps(verdict))
    else:
        out.print(result.describe(), highlight=False)
        if broken:
            out.print(f"the {result.engine} log alone also breaks {len(broken)} invariant(s):", highlight=False)
            for v in broken[:10]:
                out.print(f"  {v.invariant} at step {v.step}" + (f" [{v.request}]" if v.request else "") + f": {v.evidence}",
                          highlight=False)
    return 0 if result.agreed else 1


def engine_log_violations(result: ReplayResult) -> list:
    """The invariants the engine's own log breaks (black-box, :mod:`invariants.log_checker`)."""
    from invariants.log_checker import check_log
    from spec.formats import DecisionLog

    log = DecisionLog(result.engine, result.level, result.engine_records)
    return check_log(log, resolve(result.trace.config), result.trace).violations
