"""Differential replay: run a trace through an engine and the spec in lock step, and diff.

Both sides are driven step by step under the contract of :func:`spec.protocol.drive`
(:class:`Stepper` is that driver, one step at a time): at each step number the
engine runs first, then the spec runs the same step **fed with the engine's
sampled tokens** (``SpecEngine.feed(record.sampled)``): token values matter to
scheduling only through stop conditions and prefix hashing, and in a
differential run they are an input, not something the spec predicts
(DESIGN.md §3).  Whether those tokens are *right* is the reference engine's job,
except for an engine that declares it samples the trace's script
(``samples_script``, a scheduler-only engine such as ``gpu``): the spec then
samples the script itself and token values are compared too (``SAMPLE.SCRIPTED``:
a sampler reading the wrong output index, a ``min_tokens`` mask one output short,
would otherwise move stops with no decision showing it).

The two records of each step are compared as soon as they exist
(:func:`fuzz.diff.first_divergence`), and the replay **stops at the first
divergence** (``after`` steps later, for a report's context): a diverging trace
costs only the steps up to its divergence, which is what shrinking pays for on
every candidate.  A side that does not finish within ``max_steps`` while the
other does is a divergence of kind ``non-termination`` (both stalling at the
same step, with the same decisions, is agreement, noted in the result); a side
that raises while the trace is driven (``add_request``, ``abort_request``,
``step``, ``has_unfinished_requests``) is a divergence of kind ``error``, with
the file and line it raised at.  An engine that cannot be *constructed* is not a
finding but a harness or input problem (:class:`EngineBuildError`, exit 2).
:func:`replay_records` diffs the spec against a log recorded earlier.

Engines are made by name through a registry (:func:`register_engine`), so that
the CLI, the conformance runner and users' adapters share one factory:
``spec`` and ``vllm`` are built in; :mod:`fuzz.engines` registers ``gpu``,
``gpu-model`` and ``reference``.
"""
from __future__ import annotations

import functools
import operator
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Callable

from fuzz.diff import ERROR, NON_TERMINATION, SPAN, TOKENS, Divergence, configured_rule, first_divergence
from spec.config import resolve
from spec.formats import LEVELS, StepRecord, Trace, TraceRequest, fields_at
from spec.protocol import Engine, arrival_order

EngineFactory = Callable[[Trace], Engine]


class EngineUnavailable(RuntimeError):
    """An engine cannot be built here (a missing optional dependency, an unknown name)."""


class EngineConfigError(ValueError):
    """The engine refuses the trace's configuration (e.g. vLLM's own config validation)."""


class EngineBuildError(EngineUnavailable):
    """The engine's factory raised: a harness or input problem (exit 2), not a finding.

    Only what happens while the trace is driven (adding, aborting, stepping) is the
    engine's behaviour on the trace; a constructor that raises has not run it."""


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
    except Exception as exc:  # a module that raises (or does not compile) when imported: not a finding either
        raise EngineUnavailable(f"engine {spec!r}: importing {module_name!r} raised {raised_at(exc)}") from exc
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
    try:
        engine = ENGINES[name].factory(trace)
    except (EngineUnavailable, EngineConfigError):
        raise
    except Exception as e:
        raise EngineBuildError(f"engine {name!r} could not be constructed: {raised_at(e)}") from e
    missing = [m for m in ENGINE_METHODS if not callable(getattr(engine, m, None))]
    if missing:
        raise EngineBuildError(f"engine {name!r}: its factory returned {type(engine).__name__}, not an engine "
                               f"(no {', '.join(missing)}; see spec.protocol.Engine)")
    return engine


#: What the harness calls on an engine (:class:`spec.protocol.Engine`).
ENGINE_METHODS = ("add_request", "abort_request", "step", "has_unfinished_requests")


def raised_at(e: BaseException) -> str:
    """``Type: message at FILE:LINE`` (the innermost frame): how a crash is reported."""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    return f"{type(e).__name__}: {e}{where}"


def _spec_factory(trace: Trace) -> Engine:
    from spec.scheduler import SpecEngine

    return SpecEngine.from_trace(trace, check_invariants=False)


def _vllm_factory(trace: Trace) -> Engine:
    from fuzz.vllm_adapter import VllmEngine

    return VllmEngine(trace)


register_engine("spec", _spec_factory, "the specification itself (spec.scheduler.SpecEngine)")
def _vllm_release_factory(trace: Trace) -> Engine:
    from fuzz.vllm_adapter import VllmEngine

    return VllmEngine(trace, release_as_is=True)


register_engine("vllm", _vllm_factory, "vLLM's V1 Scheduler in-process (0.32 or 0.33, as installed), fake model "
                "outputs (extra `vllm`)")
register_engine("vllm-release", _vllm_release_factory, "vllm, the installed release as it is: knobs the release "
                "decides (priority_self_preempt) are not checked against the trace (for comparing releases)")


class FedSpec:
    """The spec engine, fed the tokens an engine sampled at each step.

    ``drive`` does not tell an engine the step number before ``step()``; it is
    recovered from what the driver does: step ``k`` follows step ``k-1``, except
    after an idle gap, when the driver jumps to the arrival step of the requests
    it adds next.  So the step about to run is
    ``max(previous + 1, latest arrival_step added since)``.  In a lock-step
    replay :func:`replay` fills ``tokens[k]`` just before the spec runs step ``k``.
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


class SideError(Exception):
    """One side raised while its trace was driven; ``step`` is where, ``text`` what and where in the code."""

    def __init__(self, step: int, text: str):
        super().__init__(text)
        self.step, self.text = step, text


class Stepper:
    """:func:`spec.protocol.drive`, one step at a time (same contract: arrivals, then aborts,
    then ``step()``; idle steps skipped), so that two engines can run in lock step.

    :meth:`next_step` is the number of the step the engine would run next, or ``None``
    once it has finished; a number ``>= max_steps`` means it hit the step limit there."""

    def __init__(self, engine: Engine, trace: Trace):
        self.engine = engine
        self.pending = arrival_order(trace)
        self.aborts: dict[int, list[str]] = {}
        for r in trace.requests:
            if r.abort_at is not None:
                self.aborts.setdefault(r.abort_at, []).append(r.id)
        self.i = 0
        self.step = 0

    def next_step(self) -> int | None:
        try:
            busy = self.engine.has_unfinished_requests()
        except Exception as e:
            raise SideError(self.step, raised_at(e)) from e
        if not busy and self.i >= len(self.pending):
            return None
        if not busy and self.pending[self.i].arrival_step > self.step:
            self.step = self.pending[self.i].arrival_step  # nothing to do until the next arrival
        return self.step

    def run_step(self) -> StepRecord:
        step = self.step
        try:
            while self.i < len(self.pending) and self.pending[self.i].arrival_step <= step:
                self.engine.add_request(self.pending[self.i])
                self.i += 1
            for rid in self.aborts.get(step, ()):
                self.engine.abort_request(rid)
            record = self.engine.step()
            record.step = step
        except Exception as e:  # an engine that crashes on a trace is a finding, not a harness failure
            raise SideError(step, raised_at(e)) from e
        self.step = step + 1
        return record


class RecordedSide:
    """A decision log recorded earlier, served as a :class:`Stepper` would serve a live engine.
    A log whose last record is at step ``max_steps - 1`` is taken as a run cut off by the limit."""

    def __init__(self, records: list[StepRecord], max_steps: int):
        self.records = list(records)
        self.i = 0
        self.stuck = max_steps if self.records and self.records[-1].step >= max_steps - 1 else None

    def next_step(self) -> int | None:
        return self.records[self.i].step if self.i < len(self.records) else self.stuck

    def run_step(self) -> StepRecord:
        self.i += 1
        return self.records[self.i - 1]


@dataclass
class ReplayResult:
    """The outcome of one differential replay (the records stop shortly after a divergence)."""

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


def _raised(side: str, error: SideError, engine: str) -> Divergence:
    value = f"raised {error.text}"
    return Divergence(error.step, f"{side} raised", value if side == "spec" else "ran",
                      value if side == "engine" else "ran", kind=ERROR, engine=engine)


def _limit(spec_at: int | None, eng_at: int | None, engine: str) -> Divergence | None:
    """Both sides have finished or hit the step limit: a side stuck where the other is not
    is a non-termination; both stuck at the same step agree (they stall the same way)."""
    if spec_at == eng_at:
        return None
    step = min(s for s in (spec_at, eng_at) if s is not None)
    what = lambda at: f"still running at max_steps={at}" if at is not None else "finished"
    return Divergence(step, "termination", what(spec_at), what(eng_at), kind=NON_TERMINATION, engine=engine)


def _same(spec: StepRecord | None, engine: StepRecord | None, fields: Callable[[StepRecord], tuple],
          optional: tuple[str, ...]) -> bool:
    """Both records exist, every compared field is equal as stored, and every optional state field
    (:func:`fuzz.diff.state_fields_at`) is equal or not logged by one side: then they agree, and the
    full comparison (:func:`fuzz.diff.first_divergence`, which also knows that an absent memory
    field means empty and compares ``sampled`` by its keys) is not needed — the common case."""
    if spec is None or engine is None or fields(spec) != fields(engine):
        return False
    if optional:  # one tuple compare first: every state field equal (or unlogged by both), the common case
        get = _getter(optional)
        try:
            if get(spec) == get(engine):
                return True
        except AttributeError:  # a record type without some state field: field by field below
            pass
    for name in optional:
        a, b = getattr(spec, name, None), getattr(engine, name, None)
        if a is not None and b is not None and a != b:
            return False
    return True


@functools.lru_cache(maxsize=None)
def _getter(names: tuple[str, ...]) -> Callable[[StepRecord], tuple]:
    """``names``' values of a record as one tuple (``operator.attrgetter``; a single name too)."""
    get = operator.attrgetter(*names)
    return get if len(names) > 1 else lambda record: (get(record),)


def _optional_fields(level: str) -> tuple[str, ...]:
    """The optional state fields the diff compares at ``level`` when both logs carry them."""
    import fuzz.diff

    state_fields_at = getattr(fuzz.diff, "state_fields_at", None)
    return tuple(state_fields_at(level)) if state_fields_at else ()


def _lock_step(trace: Trace, eng, name: str, level: str, t0: float, after: int | None) -> ReplayResult:
    """Drive ``eng`` and the fed spec step by step; compare each step's records as they appear.

    ``after``: steps to go on running once a divergence is found (context for a report);
    ``None`` runs both sides to the end (a full decision log is wanted)."""
    from spec.scheduler import SpecEngine

    max_steps = resolve(trace.config).max_steps
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r} (known: {', '.join(LEVELS)})")
    names = operator.attrgetter(*fields_at(level))  # the compared fields of a record, as one tuple
    optional = _optional_fields(level)
    fed = FedSpec(SpecEngine.from_trace(trace), [])
    spec = Stepper(fed, trace)
    scripted = bool(getattr(getattr(eng, "engine", None), "samples_script", False))  # the spec samples the script itself
    eng_recs: list[StepRecord] = []
    spec_recs: list[StepRecord] = []
    found: Divergence | None = None
    stop_at: int | None = None  # the last step to run once a divergence is known
    notes: list[str] = []
    while True:
        try:
            e_next = eng.next_step()
        except SideError as err:
            found = found or _raised("engine", err, name)
            break
        try:
            s_next = spec.next_step()
        except SideError as err:
            found = found or _raised("spec", err, name)
            break
        live = [s for s in (e_next, s_next) if s is not None and s < max_steps]
        if not live:
            cut = _limit(s_next, e_next, name)
            found = found or cut
            if cut is None and s_next is not None and found is None:
                notes.append(f"both the spec and {name} reach max_steps={s_next} with requests unfinished: "
                             "they stall (or livelock) identically on this trace")
            break
        k = min(live)
        if stop_at is not None and k > stop_at:
            break
        try:
            e_rec = eng.run_step() if e_next == k else None
        except SideError as err:
            found = found or _raised("engine", err, name)
            if after != 0 and s_next == k:  # a report's replay: what the engine should have done there
                _spec_step_after_crash(spec, spec_recs)
            break
        if e_rec is not None:
            eng_recs.append(e_rec)
        if s_next == k:
            fed.tokens[k] = e_rec.sampled if e_rec is not None and not scripted else {}
            try:
                spec_recs.append(spec.run_step())
            except SideError as err:
                found = found or _raised("spec", err, name)
                break
        s_rec = spec_recs[-1] if spec_recs and spec_recs[-1].step == k else None
        if found is None and not _same(s_rec, e_rec, names, optional):
            found = first_divergence([s_rec] if s_rec else [], [e_rec] if e_rec else [], level, engine=name,
                                     history=spec_recs[:-1] if s_rec else spec_recs, tokens=scripted)
            if found is not None:
                found.rule = configured_rule(found.rule, found.field, s_rec, e_rec, found.request, trace.config)
                if after is not None:
                    stop_at = k + after
                    if after == 0:
                        break
    return ReplayResult(trace, name, level, eng_recs, spec_recs, found, time.perf_counter() - t0, notes)


def _spec_step_after_crash(spec: Stepper, spec_recs: list[StepRecord]) -> None:
    """The spec's own step where the engine raised (its own tokens: the engine sampled none), so a
    crash report shows what the step should have decided and by which rules; nothing if it raises."""
    try:
        spec_recs.append(spec.run_step())
    except SideError:
        pass


def replay(trace: Trace, engine: str | Engine = "vllm", level: str = "exact", after: int | None = 0) -> ReplayResult:
    """Replay ``trace`` through ``engine`` (a name or an instance) and the spec in lock step; diff at ``level``.

    The replay stops ``after`` steps past the first divergence (``None``: runs to the end).
    Raises :class:`EngineUnavailable` / :class:`EngineBuildError` when the engine cannot be made."""
    t0 = time.perf_counter()
    eng = make_engine(engine, trace) if isinstance(engine, str) else engine
    name = getattr(eng, "name", str(engine))
    return _lock_step(trace, Stepper(eng, trace), name, level, t0, after)


def replay_records(trace: Trace, engine_records: list[StepRecord], level: str = "exact", engine: str = "log",
                   after: int | None = 0) -> ReplayResult:
    """Diff the spec against a decision log recorded earlier (a corpus file, another
    language's engine).  A log whose last record is at step ``max_steps - 1`` is
    taken as a run cut off by the step limit."""
    t0 = time.perf_counter()
    max_steps = resolve(trace.config).max_steps
    return _lock_step(trace, RecordedSide(engine_records, max_steps), engine, level, t0, after)


def off_replay_divergence(kind: str, trace: Trace) -> Divergence | None:
    """The check behind a finding of ``kind`` that a lock-step replay cannot make (it agrees on such a
    trace): gpu_engine's decode spans against the spec's simulation (``span``,
    :func:`fuzz.sim_engine.span_divergence`), or its model's tokens against the reference engine's
    (``tokens``, :func:`fuzz.engines.token_divergence`)."""
    if kind == SPAN:
        from fuzz.sim_engine import span_divergence

        return span_divergence(trace)
    if kind == TOKENS:
        from fuzz.engines import token_divergence

        return token_divergence(trace)
    raise ValueError(f"no check outside the replay for findings of kind {kind!r}")


def with_off_replay_check(result: ReplayResult, kind: str) -> ReplayResult:
    """``result`` (a replay that agreed), with the divergence of the ``kind`` check if it finds one."""
    found = off_replay_divergence(kind, result.trace)
    return result if found is None else replace(result, divergence=found)


def replay_command(trace_path: str, engine: str = "vllm", level: str = "exact",
                   log_path: str | None = None, spec_log_path: str | None = None, json_out: bool = False,
                   engine_log: str | None = None, check_tokens: bool = False) -> int:
    """``batchspec replay TRACE --engine NAME --level L``: print the verdict.

    Exit status: 0 the spec and the engine agree, 1 they diverge (a crash inside a
    step included), 2 bad input (an unreadable trace or config, a configuration
    the engine refuses, an engine that is not installed or whose constructor
    raises).  The replay stops at the first divergence unless a log is asked for.  ``log_path`` / ``spec_log_path`` write the
    engine's and the spec's decision logs.  ``engine_log`` compares against a
    decision log recorded earlier instead of running an engine.
    """
    import json

    from rich.console import Console

    from fuzz.diff import LevelError
    from spec.config import ConfigError
    from spec.formats import DecisionLog
    from spec.io import FormatError, load_log, load_trace, write_log

    out, err = Console(), Console(stderr=True, soft_wrap=True)  # an error stays one line
    if check_tokens and engine != "gpu-model":  # (refused before any work)
        err.print("[red]error:[/] --check-tokens compares gpu_engine's model with the reference engine: "
                  "use it with --engine gpu-model", highlight=False)
        return 2
    try:
        trace = load_trace(trace_path, steps=True)
        after = None if (log_path or spec_log_path) else 0  # a log asked for is written whole
        if engine_log:
            log = load_log(engine_log)
            result = replay_records(trace, log.records, level, engine=log.engine, after=after)
        else:
            result = replay(trace, engine, level, after=after)
        if check_tokens and result.agreed:  # gpu_engine's model against the reference engine
            result = with_off_replay_check(result, TOKENS)
    except (FormatError, ConfigError, LevelError, EngineUnavailable, EngineConfigError) as e:
        err.print(f"[red]error:[/] {e}", highlight=False)
        return 2
    if log_path:
        write_log(DecisionLog(result.engine, level, result.engine_records, trace=trace_path, config=trace.config), log_path)
    if spec_log_path:
        write_log(DecisionLog("spec", level, result.spec_records, trace=trace_path, config=trace.config), spec_log_path)
    broken = [] if result.agreed else engine_log_violations(result, cut=after is not None)
    if json_out:
        verdict = {"trace": trace_path, "engine": result.engine, "level": level, "agreed": result.agreed,
                   "steps": len(result.engine_records), "seconds": round(result.seconds, 3),
                   "divergence": result.divergence.to_json() if result.divergence else None,
                   "engine_log_violations": [v.__dict__ for v in broken]}
        out.print_json(json.dumps(verdict))
    else:
        out.print(result.describe(), highlight=False, markup=False)  # (ids in brackets are not markup)
        if broken:
            out.print(f"the {result.engine} log alone also breaks {len(broken)} invariant(s):", highlight=False, markup=False)
            for v in broken[:10]:
                out.print(f"  {v.invariant} at step {v.step}" + (f" [{v.request}]" if v.request else "") + f": {v.evidence}",
                          highlight=False, markup=False)
    return 0 if result.agreed else 1


def engine_log_violations(result: ReplayResult, cut: bool = False) -> list:
    """The invariants the engine's own log breaks (black-box, :mod:`invariants.log_checker`).
    ``cut``: the replay stopped a few steps past its divergence, so the requests the engine never
    got to finish are no evidence (``LIVE.EVERY_REQUEST_ENDS`` is left out)."""
    from invariants.log_checker import check_log
    from spec.formats import DecisionLog

    log = DecisionLog(result.engine, result.level, result.engine_records)
    found = check_log(log, resolve(result.trace.config), result.trace).violations
    return [v for v in found if not (cut and v.invariant == "LIVE.EVERY_REQUEST_ENDS")]
