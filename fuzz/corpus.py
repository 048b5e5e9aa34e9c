"""The findings corpus: one minimized, explained, replayable trace per divergence signature.

A finding is saved as three files named after its signature:

* ``NAME.jsonl``             the shrunk trace (its header ``description`` says what it shows);
* ``ENGINE/NAME.log.jsonl``  the engine's decision log on it (what the engine did);
* ``NAME.md``                the triage report: the divergence, the spec's rule and reason,
                      the step table around it on both sides, the invariants the
                      engine's log breaks, and the command that replays it.

The trace file is the commit point and is created with an atomic, no-overwrite
link, so several workers (or machines sharing a directory) save each signature
once.  ``tests/corpus/`` is replayed by pytest in CI; ``batchspec replay
NAME.jsonl --engine E`` exits 1 while the divergence is there, 0 once it is
fixed — usable with ``git bisect run``.
"""
from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from pathlib import Path

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
    lines = [f"| step | spec | {result.engine} |", "|---:|---|---|"]
    for s in steps:
        mark = " ◀" if s == around else ""
        lines.append(f"| {s}{mark} | {_batch(spec.get(s))} | {_batch(eng.get(s))} |")
    return "\n".join(lines)


def triage_report(result: ReplayResult, sig: Signature, name: str, provenance: str = "") -> str:
    """The Markdown report of one finding."""
    from invariants.log_checker import check_log

    div = result.divergence
    assert div is not None
    checked = check_log(DecisionLog(result.engine, result.level, result.engine_records),
                        resolve(result.trace.config), result.trace)
    broken = "\n".join(f"- `{v.invariant}` at step {v.step}" + (f" ({v.request})" if v.request else "") + f": {v.evidence}"
                       for v in checked.violations[:12]) or "- none: the engine's log is self-consistent; only the differential check sees this"
    spec_reasons = "\n".join(
        f"- `{r['rule']}`" + (f" [{r['request']}]" if r.get("request") else "") + f": {r['text']}"
        for rec in result.spec_records if rec.step == div.step for r in rec.reasons or []
    ) or "- (none recorded)"
    return f"""# Finding `{name}`

**{div.kind}** on field `{div.field}`{f" (request {div.request})" if div.request else ""}; spec rule `{div.rule or "-"}`.
Engine `{result.engine}`, compared at the `{result.level}` level. {provenance}

Replay it (exit 1 while the divergence is there, 0 once fixed):

```bash
batchspec replay {name}.jsonl --engine {result.engine} --level {result.level}
```

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


def _atomic_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def save_finding(corpus: str | os.PathLike, result: ReplayResult, sig: Signature, provenance: str = "") -> Path | None:
    """Save a shrunk finding once per signature; return its trace path, or None if already saved."""
    corpus = Path(corpus)
    corpus.mkdir(parents=True, exist_ok=True)
    name = slug(sig)
    trace_path = corpus / f"{name}.jsonl"
    if trace_path.exists():
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
        try:
            os.link(tmp, trace_path)  # fails if another worker saved this signature first
        except FileExistsError:
            return None
    finally:
        os.unlink(tmp)
    write_log(DecisionLog(result.engine, result.level, result.engine_records, trace=f"../{trace_path.name}",
                          config=trace.config), log_path(corpus, result.engine, name))
    _atomic_text(corpus / f"{name}.md", triage_report(dataclasses.replace(result, trace=trace), sig, name, provenance))
    return trace_path


def log_path(corpus: str | os.PathLike, engine: str, name: str) -> Path:
    """Where a corpus keeps ``engine``'s decision log for trace ``name`` (one folder per engine)."""
    return Path(corpus) / engine / f"{name}.log.jsonl"


def corpus_traces(corpus: str | os.PathLike) -> list[Path]:
    """The trace files of a corpus directory, sorted."""
    return sorted(Path(corpus).glob("*.jsonl"))
