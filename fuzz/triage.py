"""Regression triage between two engines: which traces do they decide differently, and who is right?

``batchspec triage-engines TRACES... --engine-a A --engine-b B [--profile P ...]`` runs one trace
set through two engines (two releases of vLLM, an engine before and after a change) and lists
the traces whose decision logs differ.  For each: the first differing step and field, both
values, and — for the trace's own profile and every ``--profile`` given — which of the two the
spec agrees with up to that step, with the spec's rule id behind the agreeing value: the rule
that separates the two engines.

Nothing here is a second differ.  The two logs are compared by :func:`fuzz.diff.first_divergence`
(engine A's log in the slot the spec's usually fills), and each log is checked against the spec
under a profile by :func:`fuzz.replay.replay_records`, the lock-step replay that feeds the spec
the log's own sampled tokens.  An engine is a registered name, ``MODULE:FACTORY``, or a
directory of decision logs recorded earlier (``DIR/<trace stem>.log.jsonl``, the corpus layout
of :func:`fuzz.corpus.log_path`).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuzz.diff import Divergence, as_configured, first_divergence, spec_reason, STATE_RULES
from fuzz.replay import SideError, Stepper, engine_log_violations, make_engine, replay_records
from spec.config import resolve
from spec.formats import StepRecord, Trace


class TriageInputError(ValueError):
    """Bad input to the triage command (exit 2): ``WHERE: problem``."""


@dataclass(frozen=True)
class ProfileChoice:
    """A profile to judge the two engines by: a profile name plus knobs over it (``label`` as given)."""

    label: str
    profile: str | None  # None: the trace's own profile
    knobs: dict[str, Any] = field(default_factory=dict)

    def config_for(self, trace: Trace) -> dict[str, Any]:
        """The trace's configuration under this choice: its own knobs, this profile, these knobs on top."""
        cfg = dict(trace.config or {})
        if self.profile is not None:
            cfg["profile"] = self.profile
        cfg.update(self.knobs)
        return cfg


def parse_profile(text: str) -> ProfileChoice:
    """``NAME`` or ``profile=NAME,KNOB=VALUE,...`` (or ``KNOB=VALUE,...`` over the trace's profile)."""
    from spec.config import PROFILES
    from spec.io import parse_knob_settings

    if "=" not in text:
        if text not in PROFILES:
            raise TriageInputError(f"--profile: unknown profile {text!r} (known: {', '.join(sorted(PROFILES))})")
        return ProfileChoice(text, text)
    knobs = parse_knob_settings(text, "--profile")
    profile = knobs.pop("profile", None)
    return ProfileChoice(text, profile, knobs)


@dataclass
class Verdict:
    """The spec under one profile, checked against both logs up to the step where they differ."""

    profile: str
    agrees_with: str  # "a", "b", "neither", or "n/a" (the profile does not accept the trace's knobs)
    rule: str | None = None
    reason: str | None = None
    spec_value: Any = None  # the spec's own value when it agrees with neither
    note: str = ""
    config: dict[str, Any] = field(default_factory=dict)  # the resolved knobs judged by
    reasons: list[dict] = field(default_factory=list)  # the spec's reasons at the differing step


@dataclass
class TraceDiff:
    """One trace on which the two engines' decisions differ."""

    name: str
    divergence: Divergence
    verdicts: list[Verdict]
    separating: str | None = None  # the rule that separates the engines (see :func:`separating_rule`)


def run_engine(trace: Trace, engine: str) -> tuple[list[StepRecord], tuple[int, str] | None]:
    """``engine``'s decision log on ``trace`` (driven as :func:`spec.protocol.drive` does), and the
    step and error text if it raised while the trace was driven (the records stop there)."""
    max_steps = resolve(trace.config).max_steps
    side = Stepper(make_engine(engine, trace), trace)
    records: list[StepRecord] = []
    try:
        while (k := side.next_step()) is not None and k < max_steps:
            records.append(side.run_step())
    except SideError as e:
        return records, (e.step, f"raised {e.text}")
    return records, None


def is_log_dir(engine: str) -> bool:
    """A directory of decision logs, not an engine: a directory that is not a registered engine's
    name (``spec`` is the engine even in the repository root; ``./spec`` is the directory)."""
    from fuzz.replay import ENGINES

    try:
        import fuzz.engines  # noqa: F401  (registers gpu, gpu-model, reference)
    except ImportError:
        pass
    return os.path.isdir(engine) and engine not in ENGINES


def engine_log(engine: str, trace: Trace, name: str) -> tuple[list[StepRecord], tuple[int, str] | None]:
    """The decision log of ``engine`` on the trace called ``name``: recorded (a directory) or run."""
    if is_log_dir(engine):
        from spec.io import load_log

        path = Path(engine) / f"{name}.log.jsonl"
        if not path.is_file():
            raise TriageInputError(f"{path}: no decision log for trace {name!r} in {engine}")
        return load_log(path).records, None
    return run_engine(trace, engine)


def _side_rule(records: list[StepRecord], step: int, request: str | None,
               field_name: str) -> tuple[str | None, str | None, list[dict]]:
    """The spec's rule id and text for its value at ``step`` (its record there, if it ran that step),
    and all the spec's reasons at that step."""
    rec = next((r for r in records if r.step == step), None)
    rule, text, reasons = spec_reason(rec, request, field_name)
    if rule is None and field_name in STATE_RULES:
        rule = STATE_RULES[field_name]
    return rule, text, reasons


def separating_rule(verdicts: list[Verdict]) -> str | None:
    """The rule that separates the two engines: when one profile's spec agrees with A and another's
    with B, the first rule the spec cites at the differing step whose declared knobs
    (:data:`spec.rules.RULES`) include a knob on which the two profiles differ; else the rule
    behind the value the spec agrees with (under the first profile that agrees with either)."""
    from spec.rules import RULES

    sides = [v for v in verdicts if v.agrees_with in ("a", "b")]
    for v in sides:
        for w in sides:
            if w.agrees_with == v.agrees_with:
                continue
            knobs = {k for k in set(v.config) | set(w.config) if v.config.get(k) != w.config.get(k)}
            for r in v.reasons:
                rule = RULES.get(str(r.get("rule")))
                if rule is not None and knobs & set(rule.knobs):
                    return rule.id
    return sides[0].rule if sides else None


def judge(trace: Trace, a: list[StepRecord], b: list[StepRecord], div: Divergence, choice: ProfileChoice,
          level: str) -> Verdict:
    """Which of the two logs the spec under ``choice`` agrees with through the step where they differ."""
    from spec.config import ConfigError

    cfg = choice.config_for(trace)
    label = choice.label if choice.profile is not None or choice.knobs else f"{cfg.get('profile', 'vllm-v1')} (the trace's)"
    try:
        resolved = resolve(cfg).to_json()
    except ConfigError as e:
        return Verdict(label, "n/a", note=f"the trace's knobs do not fit this profile: {e}")
    judged = dataclasses.replace(trace, config=cfg)
    firsts: dict[str, Divergence | None] = {}
    for side, records in (("a", a), ("b", b)):
        result = replay_records(judged, records, level, engine=side, after=0)
        firsts[side] = result.divergence
        if result.divergence is None or result.divergence.step > div.step:
            rule, text, reasons = _side_rule(result.spec_records, div.step, div.request, div.field)
            return Verdict(label, side, rule, text, config=resolved, reasons=reasons)
    # neither: the spec's own value at that step, from the side that kept agreeing longest
    side = max(firsts, key=lambda s: firsts[s].step)
    first = firsts[side]
    where = ", ".join(f"{s.upper()} from step {firsts[s].step} (`{firsts[s].field}`)" for s in ("a", "b"))
    return Verdict(label, "neither", first.rule, first.reason, first.spec_value,
                   note=f"the spec differs from both: {where}", config=resolved)


def triage_trace(trace: Trace, name: str, engine_a: str, engine_b: str, choices: list[ProfileChoice],
                 level: str = "exact", save: str | None = None) -> TraceDiff | None:
    """The first difference between the two engines on ``trace`` with the spec's verdicts, or None.
    ``save``: write the trace to ``SAVE/traces/`` and each engine's log to ``SAVE/a/``, ``SAVE/b/``."""
    a, a_err = engine_log(engine_a, trace, name)
    b, b_err = engine_log(engine_b, trace, name)
    if save:
        save_logs(save, trace, name, {"a": (engine_a, a), "b": (engine_b, b)}, level)
    crash = min((e[0] for e in (a_err, b_err) if e is not None), default=None)
    if crash is None:
        div = first_divergence(a, b, level, engine="b")
    else:  # compare up to the step one side raised at; agreeing that far, the crash is the difference
        div = first_divergence([r for r in a if r.step < crash], [r for r in b if r.step < crash], level, engine="b")
        if div is None and a_err != b_err:
            div = Divergence(crash, "raised", a_err[1] if a_err else "ran", b_err[1] if b_err else "ran",
                             kind="error", engine="b")
    if div is None:
        return None
    div.rule = as_configured(div.rule, trace.config)  # (a queue-order or eviction blame as the trace's policy names it)
    own = ProfileChoice("", None)
    verdicts = [judge(trace, a, b, div, c, level) for c in [own, *choices]]
    return TraceDiff(name, div, verdicts, separating_rule(verdicts))


def save_logs(folder: str, trace: Trace, name: str, logs: dict[str, tuple[str, list[StepRecord]]], level: str) -> None:
    """The trace and both decision logs, in the layout ``--engine-a DIR`` reads back
    (``FOLDER/a/<name>.log.jsonl``; the trace in ``FOLDER/traces/<name>.jsonl``)."""
    from spec.formats import DecisionLog
    from spec.io import write_log, write_trace

    trace_path = Path(folder) / "traces" / f"{name}.jsonl"
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    write_trace(trace, trace_path)
    for side, (engine, records) in logs.items():
        path = Path(folder) / side / f"{name}.log.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_log(DecisionLog(_engine_label(engine), level, records, trace=str(trace_path), config=trace.config), path)


def _engine_label(engine: str) -> str:
    """The engine name a saved log carries (``vllm`` says which release)."""
    if engine.startswith("vllm"):
        try:
            from fuzz.vllm_adapter import installed_release

            return f"{engine}-{installed_release()}"
        except Exception:
            return engine
    return Path(engine).name if is_log_dir(engine) else engine


def _sides_json(div: Divergence) -> dict[str, Any]:
    """The divergence as JSON with the two values under ``a`` and ``b`` (not ``spec``/engine)."""
    out = div.to_json()
    out["a"], out["b"] = out.pop("spec"), out.pop(div.engine)
    out.pop("rule", None), out.pop("reason", None)  # engine A's own reasons, if any: the verdicts carry the spec's
    return out


def _show(value: Any) -> str:
    from fuzz.diff import _show as show

    return show(value)


def describe(diff: TraceDiff, engine_a: str, engine_b: str) -> str:
    d = diff.divergence
    who = f" about request {d.request}" if d.request else ""
    names = {"a": f"A ({engine_a})", "b": f"B ({engine_b})"}
    width = max(len(n) for n in names.values()) + 1
    lines = [f"{diff.name}: first difference at step {d.step}, field `{d.field}`{who}",
             f"  {names['a'] + ':':{width}} {_show(d.spec_value)}",
             f"  {names['b'] + ':':{width}} {_show(d.engine_value)}"]
    for v in diff.verdicts:
        if v.agrees_with in ("a", "b"):
            because = f" — rule {v.rule}" + (f": {v.reason}" if v.reason else "") if v.rule else " — (no rule recorded)"
            lines.append(f"  spec under {v.profile}: agrees with {names[v.agrees_with]}{because}")
        elif v.agrees_with == "neither":
            lines.append(f"  spec under {v.profile}: agrees with neither ({v.note}); spec's value "
                         f"{_show(v.spec_value)}" + (f", rule {v.rule}" if v.rule else ""))
        else:
            lines.append(f"  spec under {v.profile}: not applicable ({v.note})")
    lines.append(f"  separating rule: {diff.separating or '(none: no profile agrees with either)'}")
    return "\n".join(lines)


def gather_traces(paths: list[str], n_traces: int | None, seed: int, knobs: dict[str, Any]) -> list[tuple[str, Trace]]:
    """The trace set: files, directories of traces (their ``*.jsonl``), and ``n_traces`` seeded
    random traces ``random-<seed>`` = ``random_trace(seed, **knobs)``, the same whatever the engines
    (so that logs recorded in two environments line up)."""
    from fuzz.corpus import corpus_traces
    from spec.io import load_trace

    out: list[tuple[str, Trace]] = []
    for p in paths:
        files = corpus_traces(p) if os.path.isdir(p) else [Path(p)]
        if os.path.isdir(p) and not files:
            raise TriageInputError(f"{p}: no *.jsonl trace files in this directory")
        for f in files:
            out.append((Path(f).name.removesuffix(".jsonl"), load_trace(f, steps=True)))
    if n_traces:
        from fuzz.generate import random_trace

        for s in range(seed, seed + n_traces):
            out.append((f"random-{s}", random_trace(s, **knobs)))
    if not out:
        raise TriageInputError("TRACES: give trace files, directories of traces, or --traces N")
    return out


def triage_command(paths: list[str], engine_a: str, engine_b: str, profiles: list[str], level: str = "exact",
                   n_traces: int | None = None, seed: int = 0, knob_text: str = "", json_out: bool = False,
                   save: str | None = None) -> int:
    """``batchspec triage-engines``: exit 0 no trace differs, 1 some differ, 2 bad input."""
    import json
    import sys

    from fuzz.diff import LevelError
    from fuzz.replay import EngineConfigError, EngineUnavailable
    from spec.config import ConfigError
    from spec.io import FormatError, OptionError, parse_knob_settings

    try:
        choices = [parse_profile(p) for p in profiles]
        knobs = parse_knob_settings(knob_text, "--set")
        traces = gather_traces(paths, n_traces, seed, knobs)
        diffs = []
        for name, trace in traces:
            d = triage_trace(trace, name, engine_a, engine_b, choices, level, save)
            if d is not None:
                diffs.append(d)
    except (TriageInputError, OptionError, FormatError, ConfigError, LevelError, EngineUnavailable,
            EngineConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if json_out:
        print(json.dumps({"engine_a": engine_a, "engine_b": engine_b, "level": level, "traces": len(traces),
                          "differ": [{"trace": d.name, **_sides_json(d.divergence),
                                      "separating_rule": d.separating,
                                      "verdicts": [{k: v for k, v in dataclasses.asdict(v).items()
                                                    if k not in ("config", "reasons")} for v in d.verdicts]} for d in diffs]},
                         default=str, indent=1))
    else:
        for d in diffs:
            print(describe(d, engine_a, engine_b))
        print(f"{len(diffs)} of {len(traces)} traces differ between A ({engine_a}) and B ({engine_b}) "
              f"at the {level} level")
    return 1 if diffs else 0


# -- triage classes of campaign findings (issue #21) ---------------------------------------------
#
# Every finding of a campaign against an engine is one of three things, and its report says which:
#
# * ``spec-wrong``            — the spec decides what no engine should: fix the spec, add a scenario test;
# * ``deliberate-difference`` — the engine means to differ: a knob value the engine has and documents
#                               (the knob, the value, the engine's source line);
# * ``engine-bug``            — a crash, a hang, a livelock, an invariant the engine's own log breaks
#                               (lost or duplicated tokens, starvation, wasted work), a wrong decision.
#
# What can be decided mechanically is (:func:`classify`, ``by: auto``, ``status: candidate``); a
# person confirms or overrides it (``batchspec triage FINDING --class ...``, ``by: human``).
# ``untriaged`` is what the machine cannot tell apart: a decision divergence with a self-consistent
# engine log and no knob value that explains it is either a spec error or an engine bug.

SPEC_WRONG, DELIBERATE, ENGINE_BUG, UNTRIAGED = "spec-wrong", "deliberate-difference", "engine-bug", "untriaged"
CLASSES = (SPEC_WRONG, DELIBERATE, ENGINE_BUG, UNTRIAGED)

#: Divergence kinds that are failures of the engine whatever the spec says.
LIVELOCK, HANG, CRASH = "livelock", "hang", "crash"

#: Knob values an engine has deliberately and documents, where: (engine, knob, value) -> (what, source).
#: A divergence that goes away when the spec takes one of these values is a deliberate difference.
DOCUMENTED: dict[tuple[str, str, Any], tuple[str, str]] = {
    ("vllm", "priority_self_preempt", "continue"): (
        "vLLM 0.33 keeps scheduling after a request preempts itself under priority (0.32 stops)",
        "vllm/v1/core/sched/scheduler.py (0.33.0), Scheduler.schedule, the self-preemption branch; "
        "docs/reference/vllm-v1.md \"0.32 -> 0.33\""),
    ("vllm-release", "priority_self_preempt", "continue"): (
        "vLLM 0.33 keeps scheduling after a request preempts itself under priority (0.32 stops)",
        "vllm/v1/core/sched/scheduler.py (0.33.0), Scheduler.schedule; docs/reference/vllm-v1.md"),
    # SGLang 0.5.23, as fuzz/sglang_adapter.py runs it (page_size 1, no PD disaggregation): the
    # campaign's findings (docs/findings/README.md), checked against the wheel's source
    ("sglang", "free_block_order", "tail"): (
        "SGLang's token allocator (page_size 1) hands out its free list from the front and appends freed "
        "slots at its tail (with PD disaggregation it sorts them first; the paged allocator, page_size > 1, "
        "puts freed pages at the head: paged.py l. 375-380)",
        "sglang/srt/mem_cache/allocator/token.py:54-73 (0.5.23), TokenToKVPoolAllocator.alloc / free"),
    ("sglang", "no_chunking_cap", "exclusive"): (
        "without chunked prefill SGLang refuses a request after the batch's first whose input tokens reach "
        "the input budget left (input_tokens >= rem_input_tokens): a request that would exactly fill it waits",
        "sglang/srt/managers/schedule_policy.py:1627-1633 (0.5.23), PrefillAdder.add_one_req"),
}


@dataclass
class Livelock:
    """An engine's log that ends in a cycle of states with no progress."""

    start: int  # the step the cycle starts at (its first step)
    period: int  # steps per cycle
    end: int  # the last step logged (the step limit)

    def describe(self) -> str:
        what = "the same state every step" if self.period == 1 else f"a cycle of {self.period} states"
        return (f"from step {self.start} to the step limit ({self.end}) the engine repeats {what} "
                f"with no progress: no token sampled, no request finished, aborted or rejected")


def _state(record: StepRecord) -> str:
    import json

    out = record.to_json("exact")
    out.pop("step", None)
    out.pop("reasons", None)
    return json.dumps(out, sort_keys=True, default=str)


def _progress(record: StepRecord) -> bool:
    return bool(record.sampled or record.finished or record.aborted or record.rejected)


def find_livelock(records: list[StepRecord], max_steps: int, max_period: int = 64, min_cycles: int = 3) -> Livelock | None:
    """The no-progress cycle a log ends in, if it runs to the step limit in one.

    A livelock is a state the engine comes back to without having made progress: the log's
    records (every field but the step number) repeat with some period ``p`` up to the step
    limit, at least ``min_cycles`` times, and no record of the cycle samples a token or ends a
    request.  A stall (nothing scheduled, every step alike) is the case ``p = 1``.  The cycle's
    first step is the earliest step from which the log is periodic.  A log that finished, or
    that still makes progress at the limit, has none."""
    if not records or records[-1].step < max_steps - 1:
        return None
    states = [_state(r) for r in records]
    n = len(states)
    for p in range(1, max_period + 1):
        if n < p * min_cycles:
            break
        start = n - p
        while start - 1 >= 0 and states[start - 1] == states[start - 1 + p]:
            start -= 1
        if n - start < p * min_cycles:
            continue
        if any(_progress(r) for r in records[start:]):
            continue
        # consecutive steps: the cycle is in step numbers too (no idle gap inside it)
        if records[-1].step - records[start].step != n - 1 - start:
            continue
        return Livelock(records[start].step, p, records[-1].step)
    return None


def livelock_divergence(result, max_steps: int, shared: bool = True):
    """The result with a livelock of the engine as its divergence (kind ``livelock``, at the
    cycle's first step), when its log ends in one: the engine alone runs to the step limit
    (a ``non-termination``), or — with ``shared`` — the spec stalls identically (agreement,
    which a real engine's livelock still is: the spec models the engine, the engine is stuck).
    Otherwise the result unchanged."""
    from fuzz.diff import NON_TERMINATION

    div = result.divergence
    alone = div is not None and div.kind == NON_TERMINATION and str(div.engine_value).startswith("still running")
    both = div is None and shared and any("stall" in n for n in result.notes)
    if not (alone or both):
        return result
    cycle = find_livelock(result.engine_records, max_steps)
    if cycle is None:
        return result
    spec_side = "stalls the same way (the spec models this behaviour)" if both else (div.spec_value if div else "")
    found = Divergence(cycle.start, "livelock-shared" if both else "livelock", spec_side, cycle.describe(),
                       kind=LIVELOCK, engine=result.engine)
    return dataclasses.replace(result, divergence=found, notes=[*result.notes, f"livelock: {cycle.describe()}"])


def engine_run_livelock(result, records: list[StepRecord], cycle: Livelock):
    """The result of a decision divergence whose engine, run alone on to the step limit (``records``),
    ends in a livelock: the livelock is the finding (kind ``livelock`` at the cycle's first step; a
    wrong decision on the way there is a note), and the engine's log runs to the cycle's first
    repetition, for the report."""
    first = result.divergence
    keep = [r for r in records if r.step <= cycle.start + 2 * cycle.period]
    # the rule is the first differing decision's: a livelock is where the bug shows, not where it is (issue 18 item 3)
    found = Divergence(cycle.start, "livelock", f"(the logs first differ at step {first.step}, field {first.field})",
                       cycle.describe(), rule=first.rule, kind=LIVELOCK, engine=result.engine)
    notes = [*result.notes, f"livelock: {cycle.describe()}; the first differing decision was at step {first.step} "
                            f"(field {first.field})"]
    return dataclasses.replace(result, divergence=found, engine_records=keep, notes=notes)


def knob_alternatives(config: dict[str, Any]) -> list[tuple[str, Any]]:
    """Every other value of every knob with a finite set of values (booleans and named choices)."""
    from spec.config import KNOB_CHOICES, SchedulerConfig

    cfg = resolve(config)
    out = []
    for f in dataclasses.fields(SchedulerConfig):
        value = getattr(cfg, f.name)
        if f.name in KNOB_CHOICES:
            out += [(f.name, v) for v in KNOB_CHOICES[f.name] if v != value]
        elif isinstance(value, bool):
            out.append((f.name, not value))
    return out


def explaining_knobs(trace: Trace, engine_records: list[StepRecord], level: str, step: int) -> list[tuple[str, Any]]:
    """The knob values under which the spec agrees with the engine's log up to its last record,
    one knob changed at a time: the engine behaves as if it had that value.  A value under which
    the spec no longer logs a state field the engine's log carries (``policy=fcfs`` for a log with
    VTC counters) explains nothing: it switches off the mechanism whose state differed, so the
    comparison of that state is merely skipped."""
    from spec.config import ConfigError
    from spec.formats import STATE_FIELDS

    if not engine_records:
        return []
    last = engine_records[-1].step
    logged = {name for rec in engine_records for name in STATE_FIELDS if getattr(rec, name) is not None}
    out = []
    for knob, value in knob_alternatives(trace.config):
        config = {**trace.config, knob: value}
        try:
            resolve(config)
            again = replay_records(dataclasses.replace(trace, config=config), engine_records, level, after=0)
        except (ConfigError, ValueError, TypeError):
            continue
        kept = {name for rec in again.spec_records for name in logged if getattr(rec, name) is not None}
        if logged - kept:
            continue  # (that state is no longer compared: no agreement was shown)
        if again.divergence is None or again.divergence.step > max(last, step):
            out.append((knob, value))
    return out


#: Traces drawn with a finding's knobs on which a knob value that reproduces it is checked (:func:`contradicted`).
CONSISTENCY_TRACES = 8


def contradicted(trace: Trace, engine: str, level: str, values: list[tuple[str, Any]],
                 traces: int = CONSISTENCY_TRACES) -> dict[tuple[str, Any], str]:
    """Of the knob ``values`` under which the spec reproduces a finding's engine log, those the engine
    does not have: on some trace drawn with the finding's knobs (seeds 0 to ``traces - 1``), the
    engine agrees with the spec under the trace's own value and not under that one.  An engine that
    deliberately has the value decides by it everywhere; one with a bug at a boundary that happens to
    mimic it on one trace (a watermark ignored only at an exact fit) decides by the trace's own value
    elsewhere.  Maps each refuted value to the name of the trace that refutes it; an engine that
    cannot be run again (a recorded log) refutes nothing."""
    from fuzz.generate import random_trace
    from fuzz.replay import replay
    from spec.config import ConfigError

    out: dict[tuple[str, Any], str] = {}
    for seed in range(traces):
        try:
            other = random_trace(seed, **trace.config)
            mine = replay(other, engine, level)
        except Exception:  # noqa: BLE001  (no engine to run, or a draw this engine refuses: no evidence)
            continue
        if mine.divergence is not None:
            continue  # (it differs from the trace's own value here too: no evidence either way)
        for knob, value in values:
            if (knob, value) in out:
                continue
            try:
                again = replay_records(dataclasses.replace(other, config={**other.config, knob: value}),
                                       mine.engine_records, level, after=0)
            except (ConfigError, ValueError, TypeError):
                continue
            if again.divergence is not None:
                out[(knob, value)] = other.name
    return out


def classify(result, engine: str) -> dict[str, Any]:
    """The automatic triage of a finding (``by: auto``, ``status: candidate``): see the classes above.

    ``result`` is the replay of the finding's trace (:class:`fuzz.replay.ReplayResult`)."""
    from fuzz.diff import ERROR, SPAN, TOKENS

    div = result.divergence
    out: dict[str, Any] = {"class": UNTRIAGED, "status": "candidate", "by": "auto", "why": "", "knob": None,
                           "source": None, "invariants": []}
    if div is None:
        return {**out, "why": "the trace no longer diverges"}
    if div.kind == ERROR and str(div.spec_value).startswith("raised"):
        return {**out, "class": SPEC_WRONG, "why": f"the spec raised at step {div.step}: {div.spec_value}"}
    if div.kind in (ERROR, HANG, CRASH, LIVELOCK):
        what = {ERROR: "the engine raised", HANG: "the engine hung", CRASH: "the engine's process died",
                LIVELOCK: "the engine livelocks"}[div.kind]
        return {**out, "class": ENGINE_BUG, "why": f"{what} at step {div.step}: {div.engine_value}"}
    if div.kind == TOKENS:  # its decisions agree with the spec: its model's numerics differ
        return {**out, "class": ENGINE_BUG, "why": f"gpu_engine's model samples another token than the reference "
                                                   f"engine at step {div.step}: {div.reason}"}
    if div.kind == SPAN:  # its steps agree with the spec: only its closed form of them differs
        return {**out, "class": ENGINE_BUG, "why": f"gpu_engine's decode spans differ from its own steps at step {div.step}: "
                                                   f"{div.reason}"}
    # a knob value under which the spec decides as the engine's log does: the engine has that value.
    # First, because the log checker judges a log by the trace's knob values: the invariants tied to
    # a knob (no admission in a step that preempted, ...) break when the engine has another value.
    explained = explaining_knobs(result.trace, result.engine_records, result.level, div.step)
    undocumented = [kv for kv in explained if (engine, *kv) not in DOCUMENTED]
    refuted = contradicted(result.trace, engine, result.level, undocumented) if undocumented else {}
    explained = [kv for kv in explained if kv not in refuted]
    if refuted and not explained:
        (knob, value), name = next(iter(refuted.items()))
        out["why"] = (f"{knob}={value} reproduces this trace but not the engine: on {name}, drawn with this trace's "
                      f"knobs, the engine decides as {knob}={getattr(resolve(result.trace.config), knob)} and the spec "
                      f"under {knob}={value} does not (nor does any other value that reproduces it); ")
    if explained:
        # the likeliest explanation first: a documented value; then a knob the trace leaves at its
        # profile's value (one the trace sets describes the scenario, not the engine); then a knob
        # of the rule the spec applied where they differ (KV.FREE_ORDER: free_block_order)
        from spec.rules import all_rules

        rule = all_rules().get(div.rule or "")
        own = set(getattr(rule, "knobs", ()) or ())
        explained.sort(key=lambda kv: ((engine, *kv) not in DOCUMENTED, kv[0] in result.trace.config, kv[0] not in own))
        knob, value = explained[0]
        doc = DOCUMENTED.get((engine, knob, value))
        also = [f"{k}={v}" for k, v in explained if (k, v) != (knob, value)]
        why = (f"the spec agrees with the engine's log under {knob}={value}"
               + (f" (also: {', '.join(also[:4])})" if also else "")
               + (f": {doc[0]}" if doc else ": not documented for this engine yet — confirm, then document it"))
        return {**out, "class": DELIBERATE, "knob": {knob: value}, "source": doc[1] if doc else None,
                "status": "documented" if doc else "candidate", "why": why,
                "also": [{k: v} for k, v in explained if (k, v) != (knob, value)]}
    try:  # (the replay stops a few steps past the divergence: requests left unfinished there are no evidence)
        broken = engine_log_violations(result, cut=True)
    except Exception as e:  # noqa: BLE001  (a log the checker cannot read is no verdict)
        broken, out["why"] = [], out["why"] + f"the log checker failed: {type(e).__name__}: {e}; "
    if broken:
        ids = sorted({v.invariant for v in broken})
        first = broken[0]
        return {**out, "class": ENGINE_BUG, "invariants": ids,
                "why": f"the engine's own log breaks {', '.join(ids)} (first at step {first.step}: {first.evidence})"}
    # the report's "depends on the knob K" says the divergence needs the trace's own value of K (with the
    # profile's value spec and engine agree on the trace); that is no verdict on which side is right
    if refuted:  # (a value reproduces this trace, but the engine does not have it)
        return {**out, "why": out["why"] + "a decision divergence on a self-consistent engine log, not a deliberate "
                                           "difference: a person decides (spec-wrong or engine-bug)"}
    return {**out, "why": out["why"] + "a decision divergence on a self-consistent engine log that the spec does not "
                                       "reproduce with any one knob value changed (a knob the report says the "
                                       "divergence depends on only shows where it appears): a person decides "
                                       "(spec-wrong or engine-bug)"}


TRIAGE_BEGIN, TRIAGE_END = "<!-- batchspec: triage -->", "<!-- /batchspec: triage -->"


def triage_section(triage: dict[str, Any], extra: str = "") -> str:
    """The report's ``## Triage`` section (between markers, so that it can be rewritten)."""
    lines = [TRIAGE_BEGIN, "## Triage", "",
             f"**{triage['class']}** ({triage.get('status', 'candidate')}, by {triage.get('by', 'auto')}): {triage.get('why', '')}"]
    if triage.get("knob"):
        lines.append(f"- knob: `{', '.join(f'{k}={v}' for k, v in triage['knob'].items())}`")
    if triage.get("source"):
        lines.append(f"- engine source: {triage['source']}")
    if triage.get("invariants"):
        lines.append(f"- invariants broken: {', '.join(f'`{i}`' for i in triage['invariants'])}")
    lines.append("")
    lines.append("Set it by hand: `batchspec triage FINDING --class spec-wrong|deliberate-difference|engine-bug "
                 "--why TEXT [--source FILE:LINE]`.")
    if extra:
        lines += ["", extra.rstrip()]
    return "\n".join(lines + ["", TRIAGE_END, ""])


def write_triage(corpus: str | os.PathLike, name: str, triage: dict[str, Any], detail: str | None = None) -> None:
    """Record ``triage`` in finding ``name``'s group file (``triage``) and in its report's triage
    section.  ``detail`` (the engine's traceback, the livelock's cycle: :func:`failure_detail`) is
    kept in the group file too; None keeps the one recorded before."""
    import json
    import re

    from fuzz.corpus import group_path, read_group
    from spec.io import atomic_write_text

    group = read_group(corpus, name)
    group["triage"] = triage
    if detail is not None:
        group["detail"] = detail
    atomic_write_text(group_path(corpus, name), json.dumps(group, indent=1) + "\n")
    report = Path(corpus) / f"{name}.md"
    if not report.exists():
        return
    text = report.read_text()
    section = triage_section(triage, group.get("detail", ""))
    pattern = re.compile(re.escape(TRIAGE_BEGIN) + r".*?" + re.escape(TRIAGE_END) + r"\n?", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else _after_title(text, section)
    atomic_write_text(report, text)


def failure_detail(result) -> str:
    """What a report shows beyond the divergence for an engine failure: the full traceback of an
    engine that raised or hung, the cycle of a livelock (Markdown; empty for a decision divergence)."""
    out = []
    for note in result.notes:
        if note.startswith("engine traceback:"):
            out.append("### The engine's traceback\n\n```text\n" + note.split("\n", 1)[1].rstrip() + "\n```")
        elif note.startswith("livelock:"):
            out.append("### The livelock\n\n" + note.split(":", 1)[1].strip() + ".")
    return "\n\n".join(out)


def _after_title(text: str, section: str) -> str:
    """``section`` inserted after the report's first paragraph (its title and cause), where it is read first."""
    head, sep, rest = text.partition("\n## ")
    return f"{head.rstrip()}\n\n{section}\n{sep.lstrip(chr(10))}{rest}" if sep else f"{text.rstrip()}\n\n{section}"


# -- batchspec triage: a finding's class, automatic or set by hand --------------------------------


def finding_names(path: str) -> tuple[Path, list[str]]:
    """The corpus directory and the finding names ``path`` designates: a corpus directory (every
    finding with a group file), or one finding's trace, report or group file."""
    p = Path(path)
    if p.is_dir():
        return p, sorted(g.name.removesuffix(".group.json") for g in p.glob("*.group.json"))
    for suffix in (".group.json", ".jsonl", ".md"):
        if p.name.endswith(suffix):
            name = p.name.removesuffix(suffix)
            if (p.parent / f"{name}.group.json").is_file() or (p.parent / f"{name}.jsonl").is_file():
                return p.parent, [name]
    raise TriageInputError(f"{path}: not a corpus directory nor a finding's .jsonl, .md or .group.json "
                           f"(with its group file beside it)")


def saved_result(corpus: Path, name: str):
    """The finding's saved trace and engine log, replayed against the spec (no engine needed)."""
    from spec.io import load_log, load_trace

    logs = sorted(corpus.glob(f"*/{name}.log.jsonl"))
    if not logs:
        raise TriageInputError(f"{corpus / name}: no engine log saved for this finding (ENGINE/{name}.log.jsonl)")
    log = load_log(logs[0])
    trace = load_trace(corpus / f"{name}.jsonl", steps=True)
    return replay_records(trace, log.records, log.level, engine=log.engine, after=3)


def auto_triage(corpus: Path, name: str) -> dict[str, Any]:
    """The automatic class of a saved finding.  A crash, hang or livelock was classified when the
    engine ran (its log alone cannot show it again); a decision divergence is re-classified from the
    saved trace and log."""
    from fuzz.corpus import read_group

    group = read_group(corpus, name)
    kind = (group.get("signature") or ["?"])[0]
    old = group.get("triage")
    if kind in ("error", HANG, CRASH, LIVELOCK):
        return old or {"class": ENGINE_BUG, "status": "candidate", "by": "auto", "why": f"the engine's {kind}",
                       "knob": None, "source": None, "invariants": []}
    result = saved_result(corpus, name)
    engine = result.engine
    return classify(result, engine)


def set_triage(corpus: Path, name: str, cls: str, why: str, source: str | None) -> dict[str, Any]:
    """A person's verdict on a finding (``by: human``, ``status: confirmed``); knob and invariants kept."""
    from fuzz.corpus import read_group

    old = read_group(corpus, name).get("triage") or {}
    triage = {**old, "class": cls, "status": "confirmed", "by": "human", "why": why or old.get("why", ""),
              "source": source if source is not None else old.get("source")}
    write_triage(corpus, name, triage)
    return triage


def triage_findings_command(path: str, cls: str | None = None, why: str = "", source: str | None = None,
                            auto: bool = False, json_out: bool = False) -> int:
    """``batchspec triage PATH [--class C --why TEXT --source FILE:LINE] [--auto]``: show, compute or set
    the triage class of one finding or of every finding of a corpus.  Exit 0, or 2 on bad input."""
    import json
    import sys

    from fuzz.corpus import read_group
    from spec.io import FormatError

    try:
        if cls is not None and cls not in CLASSES:
            raise TriageInputError(f"--class: must be one of {', '.join(CLASSES)}, got {cls!r}")
        corpus, names = finding_names(path)
        if cls is not None and len(names) != 1:
            raise TriageInputError(f"{path}: --class sets one finding's class; give its .jsonl, .md or .group.json")
        rows = []
        for name in names:
            if cls is not None:
                triage = set_triage(corpus, name, cls, why, source)
            else:
                triage = read_group(corpus, name).get("triage")
                if auto and (triage is None or triage.get("by") != "human"):
                    triage = auto_triage(corpus, name)
                    write_triage(corpus, name, triage)
            rows.append((name, triage))
    except (TriageInputError, FormatError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if json_out:
        print(json.dumps({name: triage for name, triage in rows}, indent=1, default=str))
        return 0
    for name, triage in rows:
        if triage is None:
            print(f"{name}: not triaged (batchspec triage {corpus / name}.jsonl --auto, or --class ...)")
        else:
            print(f"{name}: {triage['class']} ({triage.get('status', 'candidate')}, by {triage.get('by', 'auto')}): "
                  f"{triage.get('why', '')}")
    counts = {c: sum(1 for _, t in rows if (t or {}).get("class", UNTRIAGED) == c) for c in CLASSES}
    print(", ".join(f"{n} {c}" for c, n in counts.items() if n) or "no findings")
    return 0
