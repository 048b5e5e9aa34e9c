"""Conformance runs: many seeded random traces, each replayed against the spec.

``batchspec conform --engine vllm --traces N --seed S`` replays the traces
``random_trace(S)``, ``random_trace(S + 1)``, … ``random_trace(S + N - 1)``
through the engine and the spec (:func:`fuzz.replay.replay`), and prints a
table of agreement by feature area (:data:`fuzz.generate.FEATURES`) and the
divergences found.  Trace ``i`` depends on its own seed only, so a divergent
trace is re-made with ``random_trace(seed)`` anywhere, or saved with
``--save-divergent DIR`` and replayed with ``batchspec replay``.

Only traces inside the engine's capability envelope (:mod:`fuzz.capabilities`: what
it declares, or ``--capabilities FILE``) are run: a seed whose trace falls outside is
redrawn inside it (:func:`trace_for`), so an engine is never held to a knob value it
does not claim, and an engine that implements the ``vllm-v1`` family (vLLM) gets
exactly the traces ``random_trace(seed)`` makes.

With vLLM each worker process pays about 6 s to import it; on a 2-core
machine two workers roughly halve a 2,000-trace run.  Workers are spawned
(not forked) so that no torch state is shared.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from fuzz.generate import FEATURES, REQUEST_FEATURES, SPEC_FEATURES, random_trace, trace_features

#: What puts a trace in each feature area, for the table.
AREAS = {**FEATURES, **REQUEST_FEATURES, **SPEC_FEATURES}


@dataclass
class TraceOutcome:
    """One trace of a conformance run."""

    seed: int
    agreed: bool
    features: list[str]
    steps: int
    requests: int
    divergence: dict[str, Any] | None = None  # Divergence.to_json()
    explanation: str | None = None  # Divergence.describe()


@dataclass
class AreaStats:
    traces: int = 0
    agreed: int = 0

    @property
    def percent(self) -> float:
        return 100.0 * self.agreed / self.traces if self.traces else 100.0


@dataclass
class ConformanceReport:
    """Every trace's outcome, and the summary by feature area."""

    engine: str
    level: str
    seed: int
    outcomes: list[TraceOutcome] = field(default_factory=list)
    seconds: float = 0.0
    workers: int = 1
    envelope: str = ""  # the engine's capability envelope the traces were drawn in
    capabilities: str | None = None  # the --capabilities FILE that replaced the engine's declaration, if any
    request_features: bool = False  # --request-features: the generator also drew them (issue 15 item 3)

    @property
    def n_traces(self) -> int:
        return len(self.outcomes)

    @property
    def n_agreed(self) -> int:
        return sum(o.agreed for o in self.outcomes)

    @property
    def divergent(self) -> list[TraceOutcome]:
        return [o for o in self.outcomes if not o.agreed]

    @property
    def all_agreed(self) -> bool:
        return bool(self.outcomes) and not self.divergent

    def areas(self) -> dict[str, AreaStats]:
        """Agreement per feature area, in the order of :data:`FEATURES`, then ``all``."""
        out = {name: AreaStats() for name in FEATURES}
        for o in self.outcomes:
            for name in o.features:
                stats = out.setdefault(name, AreaStats())
                stats.traces += 1
                stats.agreed += o.agreed
        out["all"] = AreaStats(self.n_traces, self.n_agreed)
        return out

    def command(self) -> str:
        """The command that reproduces this report (the same traces: the envelope decides which are drawn)."""
        import shlex

        extra = f" --capabilities {shlex.quote(self.capabilities)}" if self.capabilities else ""
        extra += " --request-features" if self.request_features else ""
        return (f"batchspec conform --engine {self.engine} --traces {self.n_traces} --seed {self.seed} "
                f"--level {self.level}{extra}")

    def to_json(self) -> dict[str, Any]:
        return {
            "command": self.command(), "engine": self.engine, "level": self.level, "seed": self.seed,
            "traces": self.n_traces, "agreed": self.n_agreed, "seconds": round(self.seconds, 1), "workers": self.workers,
            "envelope": self.envelope,
            "areas": {k: {"traces": v.traces, "agreed": v.agreed} for k, v in self.areas().items()},
            "divergences": [{"seed": o.seed, **(o.divergence or {})} for o in self.divergent],
        }


def trace_for(seed: int, envelope=None, features: bool = False):
    """The trace of ``seed`` for an engine with ``envelope``: ``random_trace(seed)`` when it lies
    inside; else the generator's own draws with the knobs the envelope pins to one value (e.g.
    ``async_scheduling: [true]``) when that lies inside; else the seed's trace drawn inside it
    (the envelope's knob values for slot ``seed``).  ``features``: the generator also draws the
    request features vLLM's scheduler sees (``random_trace(..., request_features=True)``)."""
    draw = {"request_features": True} if features else {}
    trace = random_trace(seed, **draw)
    if envelope is None or envelope.everything or envelope.admits(trace.config):
        return trace
    pinned = {k: v[0] for k, v in envelope.knobs.items() if isinstance(v, tuple) and len(v) == 1}
    pinned.update(_rotated(seed, envelope))
    if pinned and envelope.profile == "vllm-v1":
        trace = random_trace(seed, **pinned, **draw)
        if envelope.admits(trace.config):
            return trace
    return random_trace(seed, **envelope.options(seed, seed=0), **draw)


def _rotated(seed: int, envelope) -> dict[str, Any]:
    """Knobs the envelope lists several values of, none of them the profile's (the generator
    never draws them, e.g. ``num_speculative_tokens: [1, 2, 3, 4]``): the value for ``seed``,
    in turn, so the run covers each."""
    from spec.config import PROFILES

    base = PROFILES[envelope.profile].config
    return {k: v[seed % len(v)] for k, v in envelope.knobs.items()
            if isinstance(v, tuple) and len(v) > 1 and getattr(base, k) not in v}


def check_one(seed: int, engine: str, level: str, envelope=None, features: bool = False) -> TraceOutcome:
    """Replay the trace of ``seed`` (:func:`trace_for`) through ``engine`` and the spec."""
    from fuzz.replay import replay

    trace = trace_for(seed, envelope, features)
    result = replay(trace, engine, level)
    d = result.divergence
    return TraceOutcome(
        seed=seed, agreed=result.agreed, features=sorted(trace_features(trace, result.spec_records)),
        steps=len(result.spec_records), requests=len(trace.requests),
        divergence=d.to_json() if d else None, explanation=d.describe() if d else None,
    )


def _check_chunk(args: tuple[list[int], str, str, Any]) -> list[TraceOutcome]:
    seeds, engine, level, envelope, features = args
    return [_check(s, engine, level, envelope, features) for s in seeds]


def _check(seed: int, engine: str, level: str, envelope, features: bool = False) -> TraceOutcome:
    """:func:`check_one`, with the envelope only when it restricts anything."""
    if features:
        return check_one(seed, engine, level, None if envelope is None or envelope.everything else envelope, features)
    return check_one(seed, engine, level) if envelope is None or envelope.everything else check_one(seed, engine, level, envelope)


def _outcomes(seeds: list[int], engine: str, level: str, workers: int, envelope=None,
              features: bool = False) -> Iterator[TraceOutcome]:
    """Outcomes in seed order, from this process or from ``workers`` spawned ones."""
    if workers <= 1:
        for s in seeds:
            yield _check(s, engine, level, envelope, features)
        return
    import multiprocessing

    chunk = 25
    jobs = [(seeds[i:i + chunk], engine, level, envelope, features) for i in range(0, len(seeds), chunk)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        for batch in pool.imap(_check_chunk, jobs):
            yield from batch


def default_workers(n_traces: int, engine: str) -> int:
    """Two workers for a long vLLM run on this project's 2-core machines; else one."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if engine == "spec" or n_traces < 200:
        return 1
    return max(1, min(cores, 4))


def run_conformance(n_traces: int, seed: int = 0, level: str = "exact", engine: str = "vllm",
                    progress: bool = True, workers: int | None = None, capabilities=None,
                    features: bool = False) -> ConformanceReport:
    """Replay ``n_traces`` random traces from ``seed`` on, inside the engine's envelope
    (``capabilities`` overrides its declaration); collect a :class:`ConformanceReport`.
    ``features``: the traces also carry the request features (:func:`trace_for`)."""
    from fuzz.capabilities import for_engine
    from fuzz.replay import make_engine

    if n_traces < 1:
        raise ValueError("n_traces must be >= 1")
    envelope = for_engine(engine, capabilities)
    make_engine(engine, trace_for(seed, envelope, features))  # fail fast here, not in a worker, if the engine is missing
    workers = default_workers(n_traces, engine) if workers is None else workers
    report = ConformanceReport(engine, level, seed, workers=workers, envelope=envelope.describe(),
                               request_features=features)
    seeds = list(range(seed, seed + n_traces))
    t0 = time.perf_counter()
    stream = _outcomes(seeds, engine, level, workers, envelope, features)
    if progress:
        stream = _with_progress(stream, n_traces, engine, report)
    for outcome in stream:
        report.outcomes.append(outcome)
    report.seconds = time.perf_counter() - t0
    return report


def _with_progress(stream: Iterable[TraceOutcome], total: int, engine: str, report: ConformanceReport) -> Iterator[TraceOutcome]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[diverged]} diverged"), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(f"spec vs {engine}", total=total, diverged=0)
        for outcome in stream:
            yield outcome
            bar.update(task, advance=1, diverged=len(report.divergent) + (not outcome.agreed))


def render_table(report: ConformanceReport):
    """A rich table: agreement by feature area."""
    from rich.table import Table

    table = Table(title=f"spec vs {report.engine} at the {report.level} level — {report.n_traces} traces, "
                        f"seeds {report.seed}..{report.seed + report.n_traces - 1}, {report.seconds:.0f} s")
    if report.envelope:
        table.caption = f"engine {report.engine} implements: {report.envelope}"
    table.add_column("feature area")
    table.add_column("traces", justify="right")
    table.add_column("agree", justify="right")
    table.add_column("%", justify="right")
    table.add_column("what puts a trace in it", style="dim")
    for name, stats in report.areas().items():
        style = "bold" if name == "all" else ("red" if stats.agreed < stats.traces else None)
        table.add_row(name, str(stats.traces), str(stats.agreed), f"{stats.percent:.1f}",
                      AREAS.get(name, "every trace"), style=style)
    return table


def render_markdown(report: ConformanceReport) -> str:
    """The same table as Markdown, for the README and docs/conformance.md."""
    lines = [f"`{report.command()}` — {report.n_traces} traces, {report.n_agreed} agree, {report.seconds:.0f} s "
             f"({report.workers} worker{'s' if report.workers != 1 else ''})", "",
             "| feature area | traces | agree | % |", "| --- | ---: | ---: | ---: |"]
    for name, stats in report.areas().items():
        label = f"**{name}**" if name == "all" else name
        lines.append(f"| {label} | {stats.traces} | {stats.agreed} | {stats.percent:.1f} |")
    return "\n".join(lines)


def conform_command(engine: str = "vllm", traces: int = 2000, seed: int = 0, level: str = "exact",
                    workers: int | None = None, json_path: str | None = None, markdown: bool = False,
                    save_divergent: str | None = None, progress: bool = True, capabilities: str | None = None,
                    request_features: bool = False) -> int:
    """``batchspec conform``: exit 0 when every trace agrees, 1 on any divergence, 2 bad input."""
    import json
    from pathlib import Path

    from rich.console import Console

    from fuzz.capabilities import CapabilityError, for_engine
    from fuzz.replay import EngineUnavailable
    from spec.formats import LEVELS
    from spec.io import write_trace

    out, err = Console(), Console(stderr=True, soft_wrap=True)  # an error stays one line
    if level not in LEVELS or traces < 1:
        err.print(f"[red]error:[/] need --traces >= 1 and --level in {', '.join(LEVELS)}", soft_wrap=True)
        return 2
    try:
        envelope = for_engine(engine, capabilities)
        report = run_conformance(traces, seed, level, engine, progress=progress, workers=workers, capabilities=envelope,
                                 features=request_features)
        report.capabilities = capabilities
    except (EngineUnavailable, CapabilityError) as e:
        err.print(f"[red]error:[/] {e}", highlight=False, soft_wrap=True)
        return 2
    out.print(render_markdown(report) if markdown else render_table(report))
    for o in report.divergent[:20]:
        out.print(f"[bold red]seed {o.seed}[/] ({', '.join(o.features)})\n{o.explanation}", highlight=False)
    if len(report.divergent) > 20:
        out.print(f"… and {len(report.divergent) - 20} more divergent traces")
    if save_divergent and report.divergent:
        folder = Path(save_divergent)
        for o in report.divergent:
            write_trace(trace_for(o.seed, envelope, request_features), folder / f"seed-{o.seed}.jsonl")
        out.print(f"divergent traces written to {folder}/seed-N.jsonl (replay: batchspec replay FILE --engine {engine})",
                  highlight=False, soft_wrap=True)
    if json_path:
        from spec.io import atomic_write_text

        atomic_write_text(json_path, json.dumps(report.to_json(), indent=1) + "\n")
    # one line whatever the terminal width: it ends with the command to copy
    out.print(f"{report.n_agreed}/{report.n_traces} traces agree ({report.command()})", highlight=False, soft_wrap=True)
    return 0 if report.all_agreed else 1
