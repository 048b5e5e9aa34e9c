"""The findings corpus: one minimized, explained, replayable trace per divergence signature.

A finding is a **group** of divergences that share a cause: the same kind, field
and spec rule at the first divergence of the *shrunk* trace (:func:`fuzz.shrink.signature`;
request ids and step numbers do not enter it).  A group is saved as four files
named after its signature:

* ``NAME.jsonl``             the smallest shrunk trace of the group (its header ``description``
                      says what it shows);
* ``ENGINE/NAME.log.jsonl``  the engine's decision log on it (what the engine did);
* ``NAME.md``                the triage report: the divergence, the knobs the trace sets apart
                      from its profile (the one the spec's rule depends on first), the
                      spec's rule and reason, the step table around it on both sides,
                      the invariants the engine's log breaks, and a replay command
                      that runs as printed;
* ``NAME.group.json``        the group: how many divergent traces fell in it, and the size of
                      the example kept.

The trace file is the commit point and is created with an atomic, no-overwrite
link, so several workers (or machines sharing a directory) save each group
once; a later, smaller example of the group replaces it (atomic rename).  ``tests/corpus/`` is replayed by pytest in CI; ``batchspec replay
NAME.jsonl --engine E`` exits 1 while the divergence is there, 0 once it is
fixed — usable with ``git bisect run``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from fuzz.diff import CRASH_KINDS, SPAN, TOKENS
from fuzz.replay import ReplayResult
from fuzz.shrink import Signature
from spec.config import resolve
from spec.formats import DecisionLog, StepRecord
from spec.io import atomic_write_lines, write_log


def slug(sig: Signature) -> str:
    return re.sub(r"[^a-z0-9]+", "-", "-".join(sig).lower()).strip("-")


def _batch(rec: StepRecord | None) -> str:
    if rec is None:
        return "(idle)"
    parts = [f"{rid}:{n}" for rid, n in rec.scheduled]
    events = []
    if rec.new or rec.resumed:
        events.append("+" + ",".join(rec.new + [f"{r}(resumed)" for r in rec.resumed]))
    if rec.preempted:
        events.append("preempt " + ",".join(rec.preempted))
    if rec.finished:
        events.append("done " + ",".join(r for r, _ in rec.finished))
    if rec.aborted:
        events.append("abort " + ",".join(rec.aborted))
    free = "" if rec.num_free_blocks is None else f" free={rec.num_free_blocks}"
    return (" ".join(parts) or "-") + ("; " + "; ".join(events) if events else "") + free


def step_window(result: ReplayResult, around: int, width: int = 3) -> str:
    """A Markdown table of both sides' steps around the divergence."""
    spec = {r.step: r for r in result.spec_records}
    eng = {r.step: r for r in result.engine_records}
    steps = sorted(s for s in set(spec) | set(eng) if around - width <= s <= around + width)
    div = result.divergence
    # the step an engine raised or hung in has no engine record: say so, rather than "(idle)"
    crashed = div.step if div is not None and div.kind in CRASH_KINDS and div.step not in eng else None
    if crashed is not None and crashed not in steps:
        steps = sorted([*steps, crashed])
    lines = [f"| step | spec | {result.engine} |", "|---:|---|---|"]
    for s in steps:
        mark = " ◀" if s == around else ""
        theirs = f"({'hung' if div.kind == 'hang' else 'raised'}: {div.rule or div.engine_value})" if s == crashed \
            else _batch(eng.get(s))
        lines.append(f"| {s}{mark} | {_batch(spec.get(s))} | {theirs} |")
    return "\n".join(lines)


#: Engines every ``batchspec`` command knows by name.
BUILT_IN_ENGINES = ("spec", "vllm", "gpu", "gpu-model", "reference")


def replay_engine_arg(engine: str) -> str:
    """What to pass as ``--engine`` so that a printed ``batchspec replay`` command runs as printed:
    a built-in name or ``MODULE:FACTORY`` as is; an engine registered by a user's own code
    (a launcher script) as the ``MODULE:FACTORY`` of its factory, importable from the
    working directory."""
    from fuzz.replay import ENGINES

    if engine in BUILT_IN_ENGINES or ":" in engine or engine not in ENGINES:
        return engine
    factory = ENGINES[engine].factory
    module, qual = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if module == "__main__":  # a launcher run as a script: name its file as a module
        path = getattr(sys.modules.get("__main__"), "__file__", None)
        rel = None
        for candidate in ((Path(path).absolute(), Path(path).resolve()) if path else ()):
            try:  # as the user named it (symlinks kept), else the real file
                rel = candidate.relative_to(Path.cwd().absolute())
                break
            except ValueError:
                continue
        module = ".".join(rel.with_suffix("").parts) if rel is not None and rel.suffix == ".py" else None
    if module and qual.isidentifier() and all(part.isidentifier() for part in module.split(".")):
        return f"{module}:{qual}"
    return engine


def differing_knobs(trace_config: dict[str, Any]) -> dict[str, Any]:
    """The semantic knobs (not workload sizes) whose value in the trace differs from its profile's."""
    return {k: v for k, v in resolve(trace_config).overrides().items() if k != "profile" and k not in _SIZES}


def knob_sensitivity(result: ReplayResult, engine: str | None) -> list[str]:
    """The knobs that differ from the profile and without which the divergence goes away:
    the trace is replayed once per knob, that knob set back to the profile's value."""
    from fuzz.replay import off_replay_divergence, replay

    if not engine or result.divergence is None:
        return []
    out = []
    for knob in differing_knobs(result.trace.config):
        base = _profile_value(result.trace.config, knob)
        other = dataclasses.replace(result.trace, config={**result.trace.config, knob: base})
        kind = result.divergence.kind
        try:
            if kind in _OFF_REPLAY:  # (the replay agrees on it: only its own check tells)
                agreed = off_replay_divergence(kind, other) is None
            else:
                agreed = replay(other, engine, result.level).agreed
        except Exception:  # the engine refuses the profile's value, or the spec does: no verdict
            continue
        if agreed:
            out.append(knob)
    return out


def _profile_value(trace_config: dict[str, Any], knob: str) -> Any:
    from spec.config import PROFILES

    return getattr(PROFILES[resolve(trace_config).profile].config, knob)


def knob_lines(trace_config: dict[str, Any], div, sensitive: list[str] = ()) -> tuple[list[str], str | None]:
    """The trace's knob values that differ from its profile, as Markdown bullets, the knob the
    finding depends on first, and a line naming it.  The knob is the first semantic knob that
    differs among the spec rule's ``knobs``; failing that, the first of ``sensitive`` (knobs
    without which the divergence goes away, :func:`knob_sensitivity`); failing that, among the
    ``knobs`` of the other rules the spec cited for the same request at that step."""
    from spec.config import PROFILES
    from spec.rules import all_rules

    cfg = resolve(trace_config)
    base = PROFILES[cfg.profile].config
    differ = {k: v for k, v in cfg.overrides().items() if k != "profile"}
    rules = all_rules()
    semantic = differing_knobs(trace_config)

    def by_rules(rule_ids) -> tuple[str, str | None] | None:
        for rid in rule_ids:
            rule = rules.get(rid or "")
            hit = [k for k in (rule.knobs if rule else ()) if k in semantic]
            if hit:
                return hit[0], rid
        return None

    mine = [r.get("rule") for r in div.context if r.get("request") == div.request and r.get("rule") != div.rule]
    named = by_rules([div.rule]) or (((list(sensitive)[0], None)) if sensitive else None) or by_rules(mine)
    order = ([named[0]] if named else []) + sorted(k for k in semantic if not named or k != named[0]) \
        + sorted(k for k in differ if k not in semantic)
    lines = [f"- `{k}={json.dumps(differ[k])}` (profile `{cfg.profile}`: `{json.dumps(getattr(base, k))}`)"
             + (f" — **the spec's value here depends on it** (rule `{named[1]}`)" if named and named[1] and k == named[0]
                else " — **the divergence goes away without it**" if named and k == named[0] else "")
             + (" — the divergence goes away without it" if k in sensitive and not (named and k == named[0]) else "")
             + ("" if k in semantic else " — workload size") for k in order]
    lead = None
    if named:
        why = (f"rule `{named[1]}` changes with it" if named[1] else
               "with the profile's value the spec and the engine agree on this trace")
        lead = (f"This finding depends on the knob **`{named[0]}={json.dumps(differ[named[0]])}`** (profile "
                f"`{cfg.profile}` has `{json.dumps(getattr(base, named[0]))}`): {why}.")
    return lines, lead


#: Knobs that size the workload rather than choose a behaviour (never "the" knob of a finding).
_SIZES = ("num_blocks", "num_cpu_blocks", "max_steps", "block_size", "max_model_len", "max_num_batched_tokens",
          "max_num_seqs")


def triage_report(result: ReplayResult, sig: Signature, name: str, provenance: str = "",
                  engine: str | None = None, trace_path: str | None = None, sensitive: list[str] = ()) -> str:
    """The Markdown report of one finding.  ``engine`` is what ``--engine`` was given (default:
    the engine's name) and ``trace_path`` where the trace is saved, for the replay command;
    ``sensitive`` the knobs without which it goes away (:func:`knob_sensitivity`)."""
    from invariants.log_checker import check_log

    div = result.divergence
    assert div is not None
    knobs, lead = knob_lines(result.trace.config, div, list(sensitive))
    knob_section = "\n".join(knobs) or f"- none: every knob is profile `{result.trace.config.get('profile', 'vllm-v1')}`'s"
    command = (f"batchspec replay {trace_path or name + '.jsonl'} --engine {replay_engine_arg(engine or result.engine)} "
               f"--level {result.level}")
    if div.kind in _OFF_REPLAY:  # the replay agrees: the command of the check that differs
        command = _OFF_REPLAY[div.kind][1].format(trace=trace_path or name + ".jsonl")
    checked = check_log(DecisionLog(result.engine, result.level, result.engine_records),
                        resolve(result.trace.config), result.trace)
    broken = "\n".join(f"- `{v.invariant}` at step {v.step}" + (f" ({v.request})" if v.request else "") + f": {v.evidence}"
                       for v in checked.violations[:12]) or "- none: the engine's log is self-consistent; only the differential check sees this"
    spec_reasons = "\n".join(
        f"- `{r['rule']}`" + (f" [{r['request']}]" if r.get("request") else "") + f": {r['text']}"
        for rec in result.spec_records if rec.step == div.step for r in rec.reasons or []
    ) or "- (none recorded)"
    return f"""# Finding `{name}`

{_cause_lines(div, sig)}
Engine `{result.engine}`, compared at the `{result.level}` level. {provenance}
Finding group: `{"` · `".join(sig)}` — every divergent trace whose shrunk divergence shows this cause counts here
(`{name}.group.json`: how many, and the size of this example, the smallest so far).
{chr(10) + lead + chr(10) if lead else ""}
{_OFF_REPLAY[div.kind][0] if div.kind in _OFF_REPLAY else "Replay it (exit 1 while the divergence is there, 0 once fixed):"}

```bash
{command}
```

## Knobs this trace sets apart from its profile

{knob_section}

## The divergence

```text
{div.describe()}
```

## Both sides around step {div.step}

{step_window(result, div.step)}

## What the spec decided at step {div.step}, and why

{spec_reasons}

## Invariants the engine's log breaks on its own

{broken}

## The trace ({len(result.trace.requests)} requests)

```json
{chr(10).join(__import__("json").dumps(r.to_json()) for r in result.trace.requests)}
```
"""


#: A finding the lock-step replay agrees on (fuzz.replay.off_replay_divergence): what its report says
#: instead of "replay it", and the command that shows the difference.
_OFF_REPLAY = {
    SPAN: ("gpu_engine's steps agree with the spec's on this trace; its simulator fast path (decode spans, "
           "`simulate` / `sweep --engine gpu`) does not. Check it (exit 1 while they differ, 0 once fixed):",
           "batchspec simulate {trace} --engine gpu --check-engine full --cost-model unit"),
    TOKENS: ("gpu_engine's decisions agree with the spec's on this trace; the tokens its model samples do not equal "
             "the reference engine's (same weights, greedy). Check it (exit 1 while they differ, 0 once fixed):",
             "batchspec replay {trace} --engine gpu-model --check-tokens"),
}


def _cause_lines(div, sig: Signature) -> str:
    """The report's header: the group's cause first — the field and rule the finding is grouped and
    named by (:func:`group_signature`: the cause-first field of the divergent step) — then the raw
    first divergence the replay met, labelled as such (a wrong victim is grouped as ``preempted`` /
    ``PREEMPT.VICTIM_NEWEST`` though the first field that differs may be ``scheduled`` / ``RUN.DECODE``)."""
    kind, field_name, rule = (tuple(sig) + ("-", "-", "-"))[:3]
    label = lambda k: "engine code" if k in CRASH_KINDS else "spec rule"  # (a crash is grouped by its place)
    raw = (f"**{div.kind}** on field `{div.field}`{f' (request {div.request})' if div.request else ''}; "
           f"{label(div.kind)} `{div.rule or '-'}`")
    cause = f"**{kind}** on field `{field_name}`; {label(kind)} `{rule}` (the group's cause)."
    return f"{cause}\nFirst raw divergence (the first field that differs in this step): {raw}."


def _atomic_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


#: The decision fields of a step in cause-first order: a request preempted (or rejected, aborted,
#: admitted) differently also runs differently in that step, so the grouping names the first; a
#: request that runs differently may finish differently in it, so ``finished`` comes after ``scheduled``.
CAUSE_ORDER = ("rejected", "aborted", "preempted", "swapped_out", "swapped_in", "new", "resumed", "scheduled",
               "finished", "sampled")


def group_signature(result: ReplayResult) -> Signature:
    """The signature a finding is grouped (and named) by: that of :func:`fuzz.shrink.signature`, but
    with the *cause-first* field of the divergent step (:data:`CAUSE_ORDER`) and the spec's rule for
    it — a wrong victim shows as ``preempted`` / ``PREEMPT.VICTIM_NEWEST`` whether the request it
    leaves running was decoding or prefilling (``RUN.DECODE`` / ``RUN.PREFILL_CHUNK`` in ``scheduled``).
    A memory-only divergence keeps its field, with the rule of the step's memory event behind the
    spec's value (:func:`fuzz.diff.memory_rule`: a preemption's release, an abort, a prefix hit, an
    allocation), not the rule for what the request involved did in that step (``ADMIT.NEW``,
    ``RUN.PREFILL_CHUNK``), which is as incidental to a block-accounting bug as its id."""
    from fuzz.diff import (DECISION, PRE_DECISION_FIELDS, _involved, _token_stop_between, _value, as_configured,
                           budget_giveback_rule, configured_rule, decision_cause, field_rule, ghost, hit_differs,
                           pending_abort_stop, spec_reason, stop_in_drafts)
    from fuzz.shrink import signature
    from spec.formats import StepRecord, fields_at

    div = result.divergence
    assert div is not None
    if div.kind != DECISION or div.field in PRE_DECISION_FIELDS:  # (state fixed before the step's decisions)
        return signature(div)
    spec = next((r for r in result.spec_records if r.step == div.step), None)
    eng = next((r for r in result.engine_records if r.step == div.step), None)
    compared = set(fields_at(result.level))
    config = result.trace.config if result.trace is not None else {}  # (the trace's policy names a queue rule)
    late = ghost(spec, eng, [r for r in result.spec_records if r.step < div.step])
    if late is not None and (late[0] in compared or late[0] == "computed"):  # the engine runs or holds a request the spec ended
        return (div.kind, late[0], late[2])
    for name in CAUSE_ORDER:
        if name not in compared:
            continue
        a = _value(spec or StepRecord(div.step), name, spec is None)
        b = _value(eng or StepRecord(div.step), name, eng is None)
        if a is None or b is None or a == b:
            continue
        if name == "sampled":
            request = next(iter(sorted(set((spec or StepRecord(0)).sampled) ^ set((eng or StepRecord(0)).sampled))), None)
        else:
            request = _involved(name, a, b)
        if hit_differs(spec, eng, request):  # admitted on both sides with another prefix hit: the hit decided it
            return (div.kind, name, "CACHE.HIT")
        if name == "finished":  # the stop rule of whichever side finished it: the same bug either way round
            between = (pending_abort_stop(spec, eng, request) or _token_stop_between(spec, eng, request)
                       or stop_in_drafts(spec, eng, request)
                       if spec and eng else None)  # (an abort pending; a token's and a length; in its drafts)
            return (div.kind, name, between or _cause_rule(spec, request, name) or _stop_rule(eng, request) or "-")
        if name in _CAUSE_FAMILIES:  # only a rule that decides this field names it (else "-", not an unrelated one)
            own = as_configured(field_rule(name, spec, eng, request), config) if spec and eng else None
            rule = _cause_rule(spec, request, name) or own or _victim_count_rule(name, spec, eng)
            return (div.kind, name, rule or "-")
        giveback = budget_giveback_rule(spec, request)  # the budget this request got came from a victim's tokens
        previous = next((r for r in reversed(result.spec_records) if r.step < div.step), None)
        before = [r for r in result.spec_records if r.step < div.step]
        cause = giveback[0] if giveback else decision_cause(name, spec, eng, request, previous, before)
        cause = cause or spec_reason(spec, request, name)[0]
        return (div.kind, name, configured_rule(cause, name, spec, eng, request, config) or "-")
    if div.field in _MEMORY_FIELDS:  # the memory event behind the spec's value (fuzz.diff.memory_rule)
        from fuzz.diff import configured_rule, memory_rule

        history = [r for r in result.spec_records if r.step < div.step]
        rule = configured_rule(memory_rule(div.field, spec, eng, div.request, history)[0], div.field, spec, eng,
                               div.request, result.trace.config)
        return (div.kind, div.field, rule or "-")
    return signature(div)


#: Fields of the ``memory`` and ``exact`` levels (block accounting and identity).
_MEMORY_FIELDS = ("num_free_blocks", "blocks", "cache_hits", "num_evicted", "num_free_cpu_blocks", "new_token_ratio",
                  "block_ids", "evicted")


#: Rule families that decide each cause field, best first (retraction is SGLang's preemption).
_CAUSE_FAMILIES = {"preempted": ("PREEMPT.", "RETRACT.", "SWAP.", "RUN.PREEMPT"), "swapped_out": ("SWAP.", "PREEMPT."),
                   "swapped_in": ("SWAP.",), "rejected": ("REJECT.",), "aborted": ("ABORT.",), "finished": ("STOP.",)}


#: The spec's stop rule for each finish reason a log can give.
_STOP_RULES = {"eos": "STOP.EOS", "stop_token": "STOP.STOP_TOKEN", "max_tokens": "STOP.LENGTH", "max_model_len": "STOP.LENGTH"}


def _stop_rule(record, request: str | None) -> str | None:
    """The stop rule matching the reason ``record`` gives for finishing ``request`` (an engine's log)."""
    for rid, why in (record.finished if record else ()):
        if rid == request:
            return _STOP_RULES.get(why)
    return None


def _victim_count_rule(name: str, spec, engine) -> str | None:
    """The rule that decides how many victims a step takes, when the engine preempted the spec's
    victims and more (the extra one has no reason of its own in the spec's record): the step's
    retraction rule under SGLang's retraction, else ``RUN.PREEMPT_FOR_BLOCKS`` (victims are taken
    only until the request that needs blocks gets them)."""
    if name != "preempted" or spec is None or engine is None or not set(spec.preempted) < set(engine.preempted):
        return None
    retract = next((r["rule"] for r in spec.reasons or () if str(r.get("rule", "")).startswith("RETRACT.")), None)
    return retract or "RUN.PREEMPT_FOR_BLOCKS"


def _cause_rule(record, request: str | None, field_name: str) -> str | None:
    """The spec's rule for ``request`` at this step from the families that decide ``field_name``."""
    mine = [r for r in ((record.reasons if record else None) or []) if request is not None and r.get("request") == request]
    for family in _CAUSE_FAMILIES.get(field_name, ()):
        for r in mine:
            if str(r.get("rule", "")).startswith(family):
                return r["rule"]
    return None


def size(trace) -> tuple[int, int]:
    """How big an example is: requests, then tokens (prompt + max_tokens); smaller is better."""
    return len(trace.requests), sum(r.prompt_len + r.max_tokens for r in trace.requests)


def save_finding(corpus: str | os.PathLike, result: ReplayResult, sig: Signature, provenance: str = "",
                 engine: str | None = None, hits: int = 1) -> Path | None:
    """Save a shrunk finding as its group's example: the first of the group, or one smaller
    than the example kept; count ``hits`` divergent traces in the group either way.  Return
    the trace path when this example was written, None when a smaller or equal one is kept.
    ``engine`` is what ``--engine`` was given (for the replay command)."""
    corpus = Path(corpus)
    corpus.mkdir(parents=True, exist_ok=True)
    name = slug(sig)
    trace_path = corpus / f"{name}.jsonl"
    group = read_group(corpus, name)
    kept = group.get("example_size")
    new_size = list(size(result.trace))
    replace = trace_path.exists() and kept is not None and new_size < kept
    if trace_path.exists() and not replace:
        record_hits(corpus, name, sig, hits)
        return None
    div = result.divergence
    trace = dataclasses.replace(
        result.trace, name=name,
        description=f"{div.kind} on {div.field} (spec rule {div.rule or '-'}) against engine {result.engine} "
                    f"at the {result.level} level. {provenance}".strip(),
    )
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=corpus)
    os.close(fd)
    try:
        atomic_write_lines(tmp, [trace.header_json(), *(r.to_json() for r in trace.requests)])
        if replace:
            os.replace(tmp, trace_path)
        else:
            try:
                os.link(tmp, trace_path)  # fails if another worker saved this group first
            except FileExistsError:
                record_hits(corpus, name, sig, hits)
                return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    write_log(DecisionLog(result.engine, result.level, result.engine_records, trace=f"../{trace_path.name}",
                          config=trace.config), log_path(corpus, result.engine, name))
    _atomic_text(corpus / f"{name}.md", triage_report(dataclasses.replace(result, trace=trace), sig, name, provenance,
                                                      engine=engine, trace_path=str(trace_path),
                                                      sensitive=knob_sensitivity(result, engine)))
    record_hits(corpus, name, sig, hits, example_size=new_size)
    return trace_path


def group_path(corpus: str | os.PathLike, name: str) -> Path:
    return Path(corpus) / f"{name}.group.json"


def read_group(corpus: str | os.PathLike, name: str) -> dict[str, Any]:
    """A group's record (``count``, ``example_size``, ``signature``); empty if none yet."""
    try:
        return json.loads(group_path(corpus, name).read_text())
    except (OSError, ValueError):
        return {}


def record_hits(corpus: str | os.PathLike, name: str, sig: Signature, hits: int,
                example_size: list[int] | None = None) -> None:
    """Add ``hits`` divergent traces to group ``name`` (and note the example's size)."""
    group = read_group(corpus, name)
    group["signature"] = list(sig)
    group["count"] = group.get("count", 0) + hits
    if example_size is not None:
        group["example_size"] = example_size
        group["example_requests"] = example_size[0]
    _atomic_text(group_path(corpus, name), json.dumps(group, indent=1) + "\n")


def log_path(corpus: str | os.PathLike, engine: str, name: str) -> Path:
    """Where a corpus keeps ``engine``'s decision log for trace ``name`` (one folder per engine)."""
    return Path(corpus) / engine / f"{name}.log.jsonl"


def corpus_traces(corpus: str | os.PathLike) -> list[Path]:
    """The trace files of a corpus directory, sorted: regular files only (a FIFO or a
    directory named ``*.jsonl`` would block or fail the replay of the whole corpus)."""
    return sorted(p for p in Path(corpus).glob("*.jsonl") if p.is_file())
