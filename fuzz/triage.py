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

from fuzz.diff import Divergence, first_divergence, spec_reason, STATE_RULES
from fuzz.replay import SideError, Stepper, make_engine, replay_records
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
