"""The simulator's commands: ``import``, ``simulate``, ``compare``, ``sweep``, ``calibrate`` (parsing and printing only).

``batchspec.cli`` calls :func:`add_parsers` on its sub-parser set.  The logic
lives in :mod:`fuzz.importers`, :mod:`fuzz.sweep`, :mod:`spec.simulate`,
:mod:`spec.metrics` and :mod:`batchspec.plots`.  Exit codes follow
``batchspec.cli``: 0 success, 2 bad input (``FILE:LINE: FIELD: PROBLEM``).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from spec.config import ConfigError

console = Console()
if not console.is_terminal:  # piped or captured: wide enough for the sweep tables
    console = Console(width=150)
err_console = Console(stderr=True, soft_wrap=True)
BAD_INPUT = 2


# --------------------------------------------------------------------------
# Shared options.
# --------------------------------------------------------------------------


def _window(text: str) -> tuple[float, float]:
    start, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return float(start or 0), float(end) if end else math.inf
    except ValueError:
        raise ValueError(f"--window must be START:END in seconds, got {text!r}") from None


def _add_trace_args(p, rate_help: str) -> None:
    p.add_argument("trace", help="a batchspec trace, or any importable file (azure, mooncake, burstgpt, lengths, vidur, llmservingsim)")
    p.add_argument("--format", default="auto", help="source format when the file is not a batchspec trace (default: detect)")
    p.add_argument("--first", type=int, help="keep the first N requests")
    p.add_argument("--window", help="keep arrivals in START:END seconds from the source's start")
    p.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by this factor")
    p.add_argument("--rate", type=float, help=rate_help)
    p.add_argument("--process", choices=("poisson", "gamma"), default="poisson", help="length-only tables: arrival process")
    p.add_argument("--cv", type=float, default=1.0, help="gamma process: coefficient of variation of the gaps")
    p.add_argument("--seed", type=int, default=0, help="length-only tables: arrival process seed")
    p.add_argument("--tenant-column", help="CSV column whose values are the tenants (e.g. Model for BurstGPT)")


def _add_sim_args(p) -> None:
    p.add_argument("--cost-model", default="h200-llama-8b-bf16",
                   help="a preset (h200-llama-8b-bf16, a100-40gb-llama2-7b-fp16, unit) or a JSON file from calibration")
    p.add_argument("--set", dest="overrides", default="", help="knob=value,... applied to every run (e.g. num_blocks=4096)")
    p.add_argument("--slo", default="", help="goodput SLOs in seconds, e.g. ttft=2,tpot=0.1,e2e=30")
    p.add_argument("--json", help="write the metrics as JSON to this file")


def _import_options(args, rate_default: float | None = None):
    from fuzz.importers import ImportOptions

    return ImportOptions(
        speedup=args.speedup, first=args.first, window=_window(args.window) if args.window else None,
        tenant_column=args.tenant_column, rate=args.rate or rate_default, process=args.process, cv=args.cv, seed=args.seed,
    )


def _load(args, rate_default: float | None = None):
    """The trace (imported in memory if needed), with arrival times in seconds."""
    from fuzz.importers import detect, load_any
    from fuzz.sweep import with_arrival_times

    fmt = detect(args.trace) if args.format == "auto" else args.format
    trace, report = load_any(args.trace, fmt, _import_options(args, rate_default if fmt == "lengths" else None))
    if report is not None:
        dropped = sum(report.dropped.values())
        console.print(f"[dim]{Path(args.trace).name}: {report.format}, {report.requests:,} requests"
                      + (f" ({dropped:,} rows dropped)" if dropped else "") + f", {report.rate:.3g}/s over {report.span_s:,.0f} s[/]")
    return with_arrival_times(trace), fmt


def _slos(text: str) -> dict[str, float]:
    from fuzz.sweep import parse_knobs

    slos = {k: float(v) for k, v in parse_knobs(text).items()}
    unknown = set(slos) - {"ttft", "tpot", "e2e"}
    if unknown:
        raise ValueError(f"--slo: unknown SLO {sorted(unknown)[0]!r} (known: ttft, tpot, e2e)")
    return slos


def _cost(args):
    from fuzz.sweep import load_cost_model

    return load_cost_model(args.cost_model)


def _write_json(path: str, obj) -> None:
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, default=_json_default)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _json_default(o):
    import dataclasses

    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if isinstance(o, float) and math.isnan(o):
        return None
    raise TypeError(type(o).__name__)


def _guarded(fn):
    """Bad option values are bad input (exit 2), a stalled engine exits 1; FormatError /
    ConfigError / StepLimitError reach ``cli.main``, which maps them as for every command."""

    def run(args) -> int:
        from spec.simulate import StallError

        try:
            return fn(args)
        except StallError as e:  # the engine stopped making progress: a finding, not bad input
            err_console.print(f"[red]error:[/] {e}", highlight=False)
            return 1
        except (ValueError, KeyError) as e:
            from spec.io import FormatError

            if isinstance(e, (FormatError, ConfigError)):
                raise
            err_console.print(f"[red]error:[/] {e}", highlight=False)
            return BAD_INPUT

    run.__name__ = fn.__name__
    return run


# --------------------------------------------------------------------------
# Tables.
# --------------------------------------------------------------------------


def _ms(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x * 1000:,.1f}" if x < 10 else f"{x:,.1f} s"


def _metric_rows(m) -> list[tuple[str, str]]:
    rows = [("requests (completed / rejected)", f"{m.requests:,} ({m.completed:,} / {m.rejected:,})"),
            ("simulated duration", f"{m.duration_s:,.1f} s in {m.steps:,} steps")]
    for name, st in (("TTFT", m.ttft), ("TPOT", m.tpot), ("ITL", m.itl), ("e2e latency", m.e2e), ("queueing delay", m.queueing)):
        rows.append((f"{name} mean / p50 / p95 / p99 (ms)", f"{_ms(st.mean)} / {_ms(st.p50)} / {_ms(st.p95)} / {_ms(st.p99)}"))
    rows += [
        ("throughput (req/s)", f"{m.request_throughput:,.3f}"),
        ("output / total tokens per s", f"{m.output_token_throughput:,.0f} / {m.total_token_throughput:,.0f}"),
        ("goodput (req/s within " + (", ".join(f"{k}≤{v:g}s" for k, v in m.slos.items()) or "no SLO") + ")",
         "-" if m.goodput is None else f"{m.goodput:,.3f}"),
        ("preemptions (requests preempted)", f"{m.preemptions:,} ({m.preempted_requests:,})"),
        ("KV utilization mean / peak", "-" if m.kv_util_mean is None else f"{m.kv_util_mean:.1%} / {m.kv_util_peak:.1%}"),
        ("prefill / decode tokens computed", f"{m.prefill_tokens:,} / {m.decode_tokens:,}"),
        ("queue growth (share of arrivals)", "- (too few arrivals)" if math.isnan(m.queue_growth)
         else f"{m.queue_growth:+.1%}" + (" [red]unbounded[/]" if m.unbounded_queue else "")),
    ]
    if len(m.tenants) > 1:
        rows.append(("Jain fairness (tenant service)", f"{m.jain_fairness:.3f}"))
        for name, t in m.tenants.items():
            rows.append((f"  tenant {name}: requests, service tokens, mean TTFT",
                         f"{t.requests:,}, {t.service_tokens:,}, {_ms(t.mean_ttft)} ms"))
    return rows


def metrics_table(columns: dict[str, object], title: str) -> Table:
    table = Table(title=title, show_lines=False)
    table.add_column("metric", style="bold")
    for name in columns:
        table.add_column(name, justify="right", overflow="fold")
    per = {name: dict(_metric_rows(m)) for name, m in columns.items()}
    for key, _ in _metric_rows(next(iter(columns.values()))):
        table.add_row(key, *(per[name].get(key, "-") for name in columns))
    return table


# --------------------------------------------------------------------------
# Commands.
# --------------------------------------------------------------------------


@_guarded
def cmd_import(args) -> int:
    from fuzz.importers import import_trace
    from fuzz.sweep import parse_knobs
    from spec.io import write_trace

    opts = _import_options(args)
    config = {"profile": args.profile, **parse_knobs(args.overrides)}
    from dataclasses import replace

    trace, report = import_trace(args.trace, args.format, replace(opts, config=config, step_seconds=args.step_seconds))
    if not trace.requests:
        err_console.print(f"[red]error:[/] {args.trace}: no requests left after sampling; nothing written")
        return BAD_INPUT
    write_trace(trace, args.output)
    table = Table(title=f"imported {Path(args.trace).name} ({report.format}) → {args.output}")
    table.add_column("rows read", justify="right")
    table.add_column("requests", justify="right")
    table.add_column("dropped", justify="left")
    table.add_column("span", justify="right")
    table.add_column("rate", justify="right")
    dropped = "; ".join(f"{n:,} {why}" for why, n in report.dropped.items()) or "-"
    table.add_row(f"{report.rows:,}", f"{report.requests:,}", dropped, f"{report.span_s:,.1f} s", f"{report.rate:.3g}/s")
    console.print(table)
    for note in report.notes:
        console.print(f"  {note}")
    return 0


def _progress(label: str):
    return Progress(TextColumn(f"[bold]{label}[/]"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console, transient=True)


def _simulate_with_progress(trace, config, cost, label: str, keep_records: int = 0):
    from fuzz.sweep import run_one

    with _progress(label) as bar:
        task = bar.add_task(label, total=len(trace.requests), info="")

        def on_step(result) -> None:
            if result.steps % 2000 == 0:
                bar.update(task, completed=_arrived_done(result), info=f"step {result.steps:,}, t={result.end_ns / 1e9:,.0f} s")

        return run_one(trace, config, cost, keep_records=keep_records, on_step=on_step)


def _arrived_done(result) -> int:
    return sum(1 for t in result.requests.values() if t.outcome is not None)


def _plots(args, results: dict, cost) -> None:
    from batchspec import plots

    first = next(iter(results.values()))
    label = next(iter(results))
    if getattr(args, "timeline", None):
        console.print("timeline: " + plots.batch_timeline(first, args.timeline, max_steps=args.timeline_steps,
                                                          first_step=args.timeline_start,
                                                          title=f"{Path(args.trace).name} — {label} — {cost.name}"))
    if getattr(args, "kv_plot", None):
        console.print("KV occupancy: " + plots.kv_occupancy(first, args.kv_plot, title=f"{Path(args.trace).name} — {label} — {cost.name}"))
    if getattr(args, "cdf", None):
        console.print("latency CDFs: " + plots.latency_cdfs(results, args.cdf, title=f"{Path(args.trace).name} — {cost.name}"))


@_guarded
def cmd_simulate(args) -> int:
    from fuzz.sweep import parse_knobs, parse_profile_spec, run_config
    from spec.metrics import summarize
    from spec.simulate import scale_to_rate

    trace, fmt = _load(args, rate_default=1.0)
    if args.rate and fmt != "lengths":
        trace = scale_to_rate(trace, args.rate)
    cost = _cost(args)
    spec = parse_profile_spec(args.profile) if args.profile else None
    config = run_config(trace, spec, cost, parse_knobs(args.overrides))
    label = spec.text if spec else config.profile
    result = _simulate_with_progress(trace, config, cost, label, keep_records=args.timeline_start + args.timeline_steps if args.timeline else 0)
    m = summarize(result, _slos(args.slo))
    console.print(metrics_table({label: m}, f"{Path(args.trace).name} — {label} — cost model {cost.name}"))
    _plots(args, {label: result}, cost)
    if args.json:
        _write_json(args.json, {"trace": args.trace, "profile": label, "config": config.to_json(), "cost_model": cost.to_json(), "metrics": m})
    return 0


@_guarded
def cmd_compare(args) -> int:
    from fuzz.sweep import UnknownProfile, parse_knobs, parse_profile_spec, run_config, split_profiles
    from spec.metrics import summarize
    from spec.simulate import scale_to_rate

    trace, fmt = _load(args, rate_default=1.0)
    if args.rate and fmt != "lengths":
        trace = scale_to_rate(trace, args.rate)
    cost, overrides, slos = _cost(args), parse_knobs(args.overrides), _slos(args.slo)
    results, metrics = {}, {}
    for text in split_profiles(args.profiles):
        spec = parse_profile_spec(text)
        try:
            config = run_config(trace, spec, cost, overrides)
        except UnknownProfile as e:
            err_console.print(f"[yellow]skipped[/] {text}: {e}", highlight=False)
            continue
        results[text] = _simulate_with_progress(trace, config, cost, text)
        metrics[text] = summarize(results[text], slos)
    if not metrics:
        err_console.print("[red]error:[/] no profile could be simulated")
        return BAD_INPUT
    console.print(metrics_table(metrics, f"{Path(args.trace).name} — cost model {cost.name}"))
    _plots(args, results, cost)
    if args.json:
        _write_json(args.json, {"trace": args.trace, "cost_model": cost.to_json(), "metrics": metrics})
    return 0


@_guarded
def cmd_sweep(args) -> int:
    import time

    from fuzz.sweep import capacity, default_rates, parse_knobs, parse_profile_spec, split_profiles, sweep

    trace, fmt = _load(args, rate_default=1.0)
    cost, overrides, slos = _cost(args), parse_knobs(args.overrides), _slos(args.slo)
    slos.setdefault("ttft", args.slo_ttft)
    specs = [parse_profile_spec(t) for t in split_profiles(args.profiles)]
    rates = [float(r) for r in args.rates.split(",")] if args.rates else default_rates(trace)
    if any(not r > 0 for r in rates):
        raise ValueError(f"--rates must all be > 0, got {args.rates}")
    t0 = time.perf_counter()
    with _progress("sweep") as bar:
        task = bar.add_task("sweep", total=len(specs) * len(set(rates)), info="")

        def on_point(p) -> None:
            what = "unknown / invalid" if p.error and math.isnan(p.rate) else f"{p.rate:g}/s"
            bar.update(task, advance=len(set(rates)) if p.error and math.isnan(p.rate) else 1, info=f"{p.profile} @ {what}")

        points = sweep(trace, specs, rates, cost, overrides=overrides, slos=slos, jobs=args.jobs or os.cpu_count() or 1,
                       stop_after_unbounded=None if args.all_rates else 1, on_point=on_point)
    wall = time.perf_counter() - t0
    for p in points:
        if p.error and math.isnan(p.rate):
            err_console.print(f"[yellow]skipped profile[/] {p.profile}: {p.error}", highlight=False)
    table = Table(title=f"{Path(args.trace).name}: TTFT against arrival rate — cost model {cost.name}")
    for col in ("profile", "rate/s", "TTFT p50", "p95", "p99 (s)", "TPOT p99 (ms)", "req/s", "goodput", "preempt", "queue growth"):
        table.add_column(col, justify="left" if col == "profile" else "right")
    skipped: dict[str, list[str]] = {}
    for p in points:
        if math.isnan(p.rate):
            continue
        if p.skipped:
            skipped.setdefault(p.profile, []).append(f"{p.rate:g}")
            continue
        if p.metrics is None:
            table.add_row(p.profile, f"{p.rate:g}", f"[red]{p.error}[/]", "", "", "", "", "", "", "")
            continue
        m = p.metrics
        growth = "-" if math.isnan(m.queue_growth) else f"{m.queue_growth:+.0%}" + (" [red]unbounded[/]" if m.unbounded_queue else "")
        table.add_row(p.profile, f"{p.rate:g}", f"{m.ttft.p50:.3g}", f"{m.ttft.p95:.3g}", f"{m.ttft.p99:.3g}",
                      f"{m.tpot.p99 * 1000:.1f}", f"{m.request_throughput:.3g}", f"{m.goodput:.3g}" if m.goodput is not None else "-",
                      f"{m.preemptions:,}", growth)
    console.print(table)
    for profile, rates_ in skipped.items():
        console.print(f"[dim]{profile}: not run at {', '.join(rates_)}/s (beyond its capacity boundary; --all-rates runs them)[/]")
    caps = capacity(points, args.slo_ttft)
    ct = Table(title=f"capacity boundary (SLO: p99 TTFT ≤ {args.slo_ttft:g} s)")
    for col in ("profile", "p99 TTFT crosses the SLO at", "queue unbounded from", "sustained rate when overloaded"):
        ct.add_column(col, justify="left" if col == "profile" else "right")
    for name, c in caps.items():
        if c.slo_rate is None:
            crossing = f"> {max(p.rate for p in points if p.profile == name and p.metrics):g}/s (not reached)"
        elif c.slo_bracket[0] is None:
            crossing = f"≤ {c.slo_rate:g}/s (already at the lowest rate)"
        else:
            crossing = f"≈ {c.slo_rate:.3g}/s (between {c.slo_bracket[0]:g} and {c.slo_bracket[1]:g})"
        unbounded = f"{c.unbounded_rate:g}/s (bounded at {c.last_bounded_rate:g})" if c.unbounded_rate and c.last_bounded_rate else \
            (f"{c.unbounded_rate:g}/s (lowest rate)" if c.unbounded_rate else "not in range")
        ct.add_row(name, crossing, unbounded, f"{c.capacity_estimate:.3g}/s" if c.capacity_estimate else "-")
    console.print(ct)
    cpu = sum(p.cpu_s for p in points)
    runs = sum(1 for p in points if p.metrics is not None)
    console.print(f"{runs} simulations in {wall:,.0f} s wall ({cpu:,.0f} s of simulation CPU time, {args.jobs or os.cpu_count()} workers)")
    if args.plot:
        from batchspec import plots

        for path in args.plot:
            console.print("capacity plot: " + plots.capacity_plot(points, caps, args.slo_ttft, path,
                          title=f"{Path(args.trace).name} — p50/p95/p99 TTFT vs arrival rate — cost model {cost.name}"))
    if args.json:
        _write_json(args.json, {"trace": args.trace, "cost_model": cost.to_json(), "slo_ttft": args.slo_ttft,
                                "points": points, "capacity": caps})
    return 0


@_guarded
def cmd_calibrate(args) -> int:
    from fuzz.calibrate import fit, load_rows

    result = fit(load_rows(args.rows), name=args.name, knobs=_knobs_or_empty(args.overrides))
    _write_json(args.output, result.model.to_json())
    table = Table(title=f"cost model {args.name} fitted to {result.rows:,} steps → {args.output}")
    for col in ("fixed", "per prefill token", "per decode seq", "per KV token read", "R²", "median / max error"):
        table.add_column(col, justify="right")
    m = result.model
    table.add_row(f"{m.fixed_s * 1e3:.4g} ms", f"{m.per_prefill_token_s * 1e6:.4g} µs", f"{m.per_decode_seq_s * 1e6:.4g} µs",
                  f"{m.per_kv_token_s * 1e9:.4g} ns", f"{result.r_squared:.4f}",
                  f"{result.median_relative_error:.1%} / {result.max_relative_error:.1%}")
    console.print(table)
    return 0


def _knobs_or_empty(text: str) -> dict:
    from fuzz.sweep import parse_knobs

    return parse_knobs(text) if text else {}


def add_parsers(sub) -> None:
    """Register ``import``, ``simulate``, ``compare``, ``sweep`` and ``calibrate`` on ``batchspec``'s sub-parsers."""
    im = sub.add_parser("import", help="import a public trace (Azure, Mooncake, BurstGPT, length tables, Vidur, LLMServingSim)")
    _add_trace_args(im, rate_help="length-only tables: mean arrivals per second of the generated process")
    im.add_argument("-o", "--output", required=True, help="the batchspec trace to write (JSON lines)")
    im.add_argument("--profile", default="vllm-v1", help="profile written in the trace header")
    im.add_argument("--set", dest="overrides", default="", help="knob=value,... written in the trace header")
    im.add_argument("--step-seconds", type=float, default=1.0,
                    help="seconds per step for arrival_step, the clock of run / replay / fuzz (default 1)")
    im.set_defaults(fn=cmd_import)

    sm = sub.add_parser("simulate", help="simulate a trace in modelled time and print its serving metrics")
    _add_trace_args(sm, rate_help="scale arrivals to this mean rate (requests/s)")
    _add_sim_args(sm)
    sm.add_argument("--profile", help="name or name:knob=value,... (default: the trace header's)")
    sm.add_argument("--timeline", help="write the batch timeline of the first steps (.png or .svg)")
    sm.add_argument("--timeline-steps", type=int, default=40, help="steps shown by --timeline")
    sm.add_argument("--timeline-start", type=int, default=0, help="first step shown by --timeline")
    sm.add_argument("--kv-plot", help="write KV occupancy over time (.png or .svg)")
    sm.add_argument("--cdf", help="write latency CDFs (.png or .svg)")
    sm.set_defaults(fn=cmd_simulate)

    cp = sub.add_parser("compare", help="simulate a trace under several profiles, side by side")
    _add_trace_args(cp, rate_help="scale arrivals to this mean rate (requests/s)")
    _add_sim_args(cp)
    cp.add_argument("--profiles", required=True, help="comma-separated: name or name:knob=value,...")
    cp.add_argument("--cdf", help="write latency CDFs of every profile (.png or .svg)")
    cp.set_defaults(fn=cmd_compare)

    sw = sub.add_parser("sweep", help="sweep arrival rates: TTFT percentiles and the capacity boundary per profile")
    _add_trace_args(sw, rate_help="length-only tables: base rate of the generated process (then scaled)")
    _add_sim_args(sw)
    sw.add_argument("--profiles", default="vllm-v1", help="comma-separated: name or name:knob=value,...")
    sw.add_argument("--rates", help="comma-separated arrival rates (default: 10 rates, 1/8x to 64x the trace's own)")
    sw.add_argument("--slo-ttft", type=float, default=2.0, help="SLO on p99 TTFT in seconds (default 2)")
    sw.add_argument("--jobs", type=int, default=0, help="worker processes (default: all cores)")
    sw.add_argument("--all-rates", action="store_true", help="also run rates beyond a profile's first unbounded one")
    sw.add_argument("--plot", action="append", help="write the capacity plot (.png or .svg); repeatable")
    sw.set_defaults(fn=cmd_sweep)

    ca = sub.add_parser("calibrate", help="fit the step cost model to measured step times (JSON or CSV rows)")
    ca.add_argument("rows", help="rows of prefill_tokens, decode_seqs, kv_tokens, seconds (see fuzz/calibrate.py)")
    ca.add_argument("-o", "--output", required=True, help="the cost model JSON to write (use it with --cost-model)")
    ca.add_argument("--name", default="calibrated", help="the cost model's name")
    ca.add_argument("--set", dest="overrides", default="", help="deployment knobs to store with it, e.g. num_blocks=40000")
    ca.set_defaults(fn=cmd_calibrate)


def build_parser():
    """A parser with only these commands (``python -m batchspec.sim_cli``; tests)."""
    import argparse

    p = argparse.ArgumentParser(prog="batchspec", description=__doc__.split("\n")[0])
    add_parsers(p.add_subparsers(dest="command", required=True))
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one of these commands with ``batchspec.cli``'s exit codes."""
    from batchspec.cli import run

    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    import sys

    sys.exit(main())
