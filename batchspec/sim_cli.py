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

import argparse

from batchspec.render import readable
from spec.config import ConfigError
from spec.io import OptionError

console = Console()
if not console.is_terminal and not os.environ.get("COLUMNS"):  # piped or captured: wide enough for the sweep tables
    console = Console(width=150)
err_console = Console(stderr=True, soft_wrap=True)
BAD_INPUT = 2


# --------------------------------------------------------------------------
# Shared options.
# --------------------------------------------------------------------------


#: Largest rate, speed-up or SLO an option may give (per second / factor / seconds).
MAX_RATE = 1e6
#: Smallest rate or speed-up (one request in 11.6 days); smaller ones overflow the simulated clock.
MIN_RATE = 1e-6


def _window(text: str) -> tuple[float, float]:
    """``START:END`` in seconds (END may be empty: to the end); finite, 0 <= START < END."""
    start, sep, end = text.partition(":")
    try:
        if not sep:
            raise ValueError
        lo, hi = float(start or 0), float(end) if end else math.inf
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:END in seconds, got {text!r}") from None
    if not math.isfinite(lo) or math.isnan(hi) or (end and not math.isfinite(hi)) or not 0 <= lo < hi:
        raise argparse.ArgumentTypeError(f"expected finite 0 <= START < END, got {text!r}")
    return lo, hi


def _rates(text: str) -> list[float]:
    from spec.io import parse_float_value

    try:
        rates = [parse_float_value(r, "--rates", MIN_RATE, MAX_RATE) for r in text.split(",")]
    except OptionError as e:
        raise argparse.ArgumentTypeError(e.problem) from None
    if len(rates) > 1000:
        raise argparse.ArgumentTypeError(f"{len(rates)} rates exceed the limit of 1000")
    return rates


def _knobs_arg(text: str) -> dict:
    from spec.io import parse_knob_settings

    try:
        return parse_knob_settings(text, "--set", allow_profile=False)
    except OptionError as e:
        raise argparse.ArgumentTypeError(e.problem if e.option == "--set" else f"{e.option.split()[-1]}: {e.problem}") from None


def _slo_arg(text: str) -> dict[str, float]:
    from spec.io import parse_float_value

    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"expected ttft=S,tpot=S,e2e=S, got {part!r}")
        if name.strip() not in ("ttft", "tpot", "e2e"):
            raise argparse.ArgumentTypeError(f"unknown SLO {name.strip()!r} (known: ttft, tpot, e2e)")
        try:
            out[name.strip()] = parse_float_value(value, name.strip(), 0, MAX_RATE, exclusive_minimum=True)
        except OptionError as e:
            raise argparse.ArgumentTypeError(f"{e.option}: {e.problem}") from None
    return out


def _targets_arg(text: str) -> dict:
    """``ttft=S,tpot=S[,share=F][,class=NAME]``: one SLO class (issue 19)."""
    from batchspec.cli import text_option
    from spec.io import parse_float_value

    out: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = (x.strip() for x in part.partition("="))
        if not eq or name not in ("ttft", "tpot", "share", "class"):
            raise argparse.ArgumentTypeError(f"expected ttft=S,tpot=S,share=F,class=NAME, got {part!r}")
        if name == "class":
            out[name] = text_option(value)
            continue
        try:
            out[name] = parse_float_value(value, name, 0, 1.0 if name == "share" else MAX_RATE, exclusive_minimum=True)
        except OptionError as e:
            raise argparse.ArgumentTypeError(f"{e.option}: {e.problem}") from None
    if "ttft" not in out and "tpot" not in out:
        raise argparse.ArgumentTypeError("a class needs ttft=S and/or tpot=S")
    return out


def _plot_path(text: str) -> str:
    if Path(text).suffix.lower() not in (".png", ".svg"):
        raise argparse.ArgumentTypeError(f"{text}: plots are written as .png or .svg")
    return text


def _add_trace_args(p, rate_help: str, formats: tuple[str, ...] = ("auto", "batchspec")) -> None:
    from batchspec.cli import float_option, int_option, text_option
    from fuzz.importers import FORMATS
    from spec.formats import LIMITS

    choices = (*formats, *FORMATS)
    p.add_argument("trace", help="a batchspec trace, or any importable file (" + ", ".join(FORMATS) + ")")
    p.add_argument("--format", default="auto", choices=choices, metavar="FORMAT",
                   help="source format: " + ", ".join(choices) + " (default: auto, detected from the first line)")
    p.add_argument("--first", type=int_option(1, LIMITS["requests"]), metavar="N", help="keep the first N requests")
    p.add_argument("--window", type=_window, metavar="START:END", help="keep arrivals in START:END seconds from the source's start")
    p.add_argument("--speedup", type=float_option(MIN_RATE, MAX_RATE, exclusive_minimum=False), default=1.0, metavar="X",
                   help=f"divide arrival times by this factor ({MIN_RATE:g} to {MAX_RATE:g}, default 1)")
    p.add_argument("--rate", type=float_option(MIN_RATE, MAX_RATE, exclusive_minimum=False), metavar="R",
                   help=rate_help + f" ({MIN_RATE:g} to {MAX_RATE:g})")
    p.add_argument("--process", choices=("poisson", "gamma"), default="poisson",
                   help="length-only tables: arrival process, poisson (default) or gamma")
    p.add_argument("--cv", type=float_option(1e-3, 1000.0, exclusive_minimum=False), default=1.0, metavar="CV",
                   help="gamma process: coefficient of variation of the gaps (0.001 to 1000, default 1)")
    p.add_argument("--seed", type=int_option(0, 2**63 - 1), default=0, help="length-only tables: arrival process seed (default 0)")
    p.add_argument("--tenant-column", type=text_option, metavar="COLUMN",
                   help="CSV column whose values are the tenants (e.g. Model for BurstGPT)")


def _add_sim_args(p) -> None:
    from spec.costmodel import PRESETS

    p.add_argument("--cost-model", default="h200-llama-8b-bf16", metavar="NAME|FILE",
                   help="a preset (" + ", ".join(PRESETS) + "; default h200-llama-8b-bf16) or a JSON file from `batchspec calibrate`")
    p.add_argument("--set", dest="overrides", default={}, type=_knobs_arg, metavar="KNOB=VALUE,...",
                   help="knobs applied to every run (e.g. num_blocks=4096)")
    p.add_argument("--slo", default={}, type=_slo_arg, metavar="ttft=S,tpot=S,e2e=S",
                   help="goodput SLOs in seconds, e.g. ttft=2,tpot=0.1,e2e=30")
    p.add_argument("--targets", action="append", type=_targets_arg, metavar="ttft=S,tpot=S[,share=F,class=NAME]",
                   help="an SLO class (seconds; repeatable, requests split among classes by share, by a hash of "
                        "their id; a class's index is its priority): given to every request without targets of its "
                        "own; the SLO policies (edf, edf-ac) schedule by them, the metrics report attainment and "
                        "SLO goodput")
    p.add_argument("--predict", choices=("none", "oracle"), default="none",
                   help="predicted output length for sprpt: oracle = the request's real length (max_tokens)")
    p.add_argument("--json", metavar="FILE", help="write the metrics as JSON to this file")
    p.add_argument("--engine", choices=("spec", "gpu"), default="spec",
                   help="whose decisions to simulate: the spec's (default) or gpu_engine's (scheduler-only, "
                        "several times faster: decode spans in closed form)")
    p.add_argument("--check-engine", choices=("sampled", "full", "off"), default="sampled",
                   help="with --engine gpu, compare its decisions with the spec's: sampled (default: the first "
                        "500 arrivals; in a sweep at the lowest and highest rate), full (every run, whole), off")


def _import_options(args, rate_default: float | None = None):
    from fuzz.importers import ImportOptions

    return ImportOptions(
        speedup=args.speedup, first=args.first, window=args.window,
        tenant_column=args.tenant_column, rate=args.rate or rate_default, process=args.process, cv=args.cv, seed=args.seed,
    )


def _load(args, rate_default: float | None = None):
    """The trace (imported in memory if needed), with arrival times in seconds."""
    from fuzz.importers import detect, load_any
    from fuzz.sweep import with_arrival_times
    from spec.io import check_input_file

    check_input_file(args.trace)  # a directory or a FIFO is refused before a reader opens it
    fmt = _detect(args.trace, detect) if args.format == "auto" else args.format
    trace, report = load_any(args.trace, fmt, _import_options(args, rate_default if fmt == "lengths" else None))
    if report is not None:
        dropped = sum(report.dropped.values())
        console.print(f"[dim]{Path(args.trace).name}: {report.format}, {report.requests:,} requests"
                      + (f" ({dropped:,} rows dropped)" if dropped else "") + f", {report.rate:.3g}/s over {report.span_s:,.0f} s[/]")
    trace = with_arrival_times(trace)
    targets = getattr(args, "targets", None) or []
    if targets or getattr(args, "predict", "none") != "none":
        from fuzz.sweep import with_targets  # issue 19: SLO classes and predicted lengths

        trace = with_targets(trace, targets, args.predict)
    return trace, fmt


def _detect(path: str, detect) -> str:
    """``batchspec`` when the first line is a JSON object with a ``format`` tag (parsed strictly:
    deep nesting, NaN or duplicate keys are refused here), else the importers' detection."""
    from spec.formats import LIMITS
    from spec.io import FormatError, open_input, parse_json

    with open_input(path, "trace_bytes", limit_bytes=2**63) as f:
        first = f.readline(LIMITS["line_bytes"] + 1)
    if not first.strip():
        raise FormatError(path, 1, "(file)", "empty file: expected a header line or a CSV header")
    if b"\0" in first:
        raise FormatError(path, 1, "(line)", "binary data (NUL bytes), not a trace")
    if first.lstrip().startswith(b"{"):
        obj = parse_json(first, path, 1, truncated=not first.endswith(b"\n"))
        if isinstance(obj, dict) and "format" in obj:
            return "batchspec"
    return detect(path)


def _cost(args):
    """A preset by name, or a cost-model file validated field by field (:func:`spec.costmodel.load_file`)."""
    from spec.costmodel import PRESETS, load_file

    if args.cost_model in PRESETS:
        return PRESETS[args.cost_model]
    if not os.path.exists(args.cost_model) and os.sep not in args.cost_model and not args.cost_model.endswith(".json"):
        raise OptionError("--cost-model", f"unknown cost model {args.cost_model!r} (presets: {', '.join(PRESETS)}; or a JSON file)")
    return load_file(args.cost_model)


def _check_outputs(args, outputs: dict, inputs: dict) -> None:
    """Refuse, before the simulation runs, outputs that would overwrite an input or a directory,
    and plots when matplotlib is not installed (the ``plot`` extra)."""
    from spec.io import check_outputs

    plots = {k: v for k, v in outputs.items() if k not in ("--json", "-o/--output") and v}
    if os.path.exists(args.cost_model):
        inputs = {**inputs, "--cost-model": args.cost_model}
    check_outputs(outputs, inputs)
    if plots:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise OptionError(next(iter(plots)), "plots need matplotlib, which is not installed (pip install 'batchspec[plot]')")


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
        except RuntimeError as e:  # --engine gpu differs from the spec (fuzz.sim_engine.EngineMismatch): a finding
            if type(e).__name__ != "EngineMismatch":
                raise
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
    if m.slo_attainment is not None:  # issue 19: per-request targets
        rows.append(("SLO attained (both targets) / SLO goodput (req/s)", f"{m.slo_attainment:.1%} / {m.slo_goodput:,.3f}"))
        for name, c in m.slo_classes.items():
            rows.append((f"  class {name}: requests, TTFT / TPOT / both attained",
                         f"{c.requests:,}, {c.ttft_attained:.0%} / {c.tpot_attained:.0%} / {c.attained:.0%}"))
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
    from spec.io import check_input_file, check_outputs, write_trace

    check_outputs({"-o/--output": args.output}, {"TRACE": args.trace})
    check_input_file(args.trace)
    opts = _import_options(args)
    config = {"profile": args.profile, **args.overrides}
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
    console.print(readable(table))
    for note in report.notes:
        console.print(f"  {note}")
    return 0


def _progress(label: str):
    return Progress(TextColumn(f"[bold]{label}[/]"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console, transient=True)


def _simulate_with_progress(trace, config, cost, label: str, keep_records: int = 0, engine: str = "spec",
                            check_engine: str = "off"):
    from fuzz.sweep import check, run_one

    with _progress(label) as bar:
        task = bar.add_task(label, total=len(trace.requests), info="")

        def on_step(result) -> None:
            if result.steps % 2000 == 0:
                bar.update(task, completed=_arrived_done(result), info=f"step {result.steps:,}, t={result.end_ns / 1e9:,.0f} s")

        result = run_one(trace, config, cost, keep_records=keep_records, on_step=on_step, engine=engine)
    if engine == "gpu" and check_engine != "off":
        steps = check(trace, config, cost, result, check_engine)
        err_console.print(f"[dim]{label}: gpu_engine's decisions equal the spec's ({check_engine} check, "
                          f"{steps:,} steps compared)[/]", highlight=False)
    return result


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
    from fuzz.sweep import parse_profile_spec, run_config
    from spec.metrics import summarize
    from spec.simulate import scale_to_rate

    _check_outputs(args, {"--json": args.json, "--timeline": args.timeline, "--kv-plot": args.kv_plot, "--cdf": args.cdf},
                   {"TRACE": args.trace})
    trace, fmt = _load(args, rate_default=1.0)
    if args.rate and fmt != "lengths":
        trace = scale_to_rate(trace, args.rate)
    cost = _cost(args)
    spec = parse_profile_spec(args.profile) if args.profile else None
    config = run_config(trace, spec, cost, args.overrides)
    label = spec.text if spec else config.profile
    result = _simulate_with_progress(trace, config, cost, label, keep_records=args.timeline_start + args.timeline_steps if args.timeline else 0,
                                     engine=args.engine, check_engine=args.check_engine)
    m = summarize(result, dict(args.slo))
    console.print(metrics_table({label: m}, f"{Path(args.trace).name} — {label} — cost model {cost.name}"))
    if args.json:  # before the plots: a plotting error never loses the metrics
        _write_json(args.json, {"trace": args.trace, "profile": label, "config": config.to_json(), "cost_model": cost.to_json(), "metrics": m})
    _plots(args, {label: result}, cost)
    return 0


@_guarded
def cmd_compare(args) -> int:
    from fuzz.sweep import UnknownProfile, parse_profile_spec, run_config, split_profiles
    from spec.metrics import summarize
    from spec.simulate import scale_to_rate

    _check_outputs(args, {"--json": args.json, "--cdf": args.cdf}, {"TRACE": args.trace})
    trace, fmt = _load(args, rate_default=1.0)
    if args.rate and fmt != "lengths":
        trace = scale_to_rate(trace, args.rate)
    cost, overrides, slos = _cost(args), args.overrides, dict(args.slo)
    results, metrics = {}, {}
    for text in split_profiles(args.profiles):
        spec = parse_profile_spec(text)
        try:
            config = run_config(trace, spec, cost, overrides)
        except UnknownProfile as e:
            err_console.print(f"[yellow]skipped[/] {text}: {e}", highlight=False)
            continue
        results[text] = _simulate_with_progress(trace, config, cost, text, engine=args.engine, check_engine=args.check_engine)
        metrics[text] = summarize(results[text], slos)
    if not metrics:
        err_console.print("[red]error:[/] no profile could be simulated")
        return BAD_INPUT
    console.print(metrics_table(metrics, f"{Path(args.trace).name} — cost model {cost.name}"))
    if args.json:  # before the plots: a plotting error never loses the metrics
        _write_json(args.json, {"trace": args.trace, "cost_model": cost.to_json(), "metrics": metrics})
    _plots(args, results, cost)
    return 0


@_guarded
def cmd_sweep(args) -> int:
    import time

    from fuzz.sweep import capacity, default_rates, parse_profile_spec, split_profiles, sweep

    _check_outputs(args, {"--json": args.json, **{f"--plot {p}": p for p in args.plot or []},
                          **{f"--slo-plot {p}": p for p in args.slo_plot or []}}, {"TRACE": args.trace})
    trace, fmt = _load(args, rate_default=1.0)
    cost, overrides, slos = _cost(args), args.overrides, dict(args.slo)
    slos.setdefault("ttft", args.slo_ttft)
    specs = [parse_profile_spec(t) for t in split_profiles(args.profiles)]
    rates = args.rates or default_rates(trace)
    t0 = time.perf_counter()
    with _progress("sweep") as bar:
        task = bar.add_task("sweep", total=len(specs) * len(set(rates)), info="")

        def on_point(p) -> None:
            what = "unknown / invalid" if p.error and math.isnan(p.rate) else f"{p.rate:g}/s"
            bar.update(task, advance=len(set(rates)) if p.error and math.isnan(p.rate) else 1, info=f"{p.profile} @ {what}")

        points = sweep(trace, specs, rates, cost, overrides=overrides, slos=slos, jobs=args.jobs or os.cpu_count() or 1,
                       stop_after_unbounded=None if args.all_rates else 1, on_point=on_point,
                       engine=args.engine, check_engine=args.check_engine)
    wall = time.perf_counter() - t0
    for p in points:
        if p.error and math.isnan(p.rate):
            err_console.print(f"[yellow]skipped profile[/] {p.profile}: {p.error}", highlight=False)
    table = Table(title=f"{Path(args.trace).name}: TTFT against arrival rate — cost model {cost.name}")
    targeted = any(p.metrics is not None and p.metrics.slo_attainment is not None for p in points)
    for col in ("profile", "rate/s", "TTFT p50", "p95", "p99 (s)", "TPOT p99 (ms)", "req/s", "goodput", "preempt",
                "queue growth") + (("SLO attained", "SLO goodput/s") if targeted else ()):
        table.add_column(col, justify="left" if col == "profile" else "right",
                         min_width=None)
    skipped: dict[str, list[str]] = {}
    for p in points:
        if math.isnan(p.rate):
            continue
        if p.skipped:
            skipped.setdefault(p.profile, []).append(f"{p.rate:g}")
            continue
        if p.metrics is None:
            table.add_row(p.profile, f"{p.rate:g}", f"[red]{p.error}[/]", "", "", "", "", "", "", "", *(("", "") if targeted else ()))
            continue
        m = p.metrics
        growth = "-" if math.isnan(m.queue_growth) else f"{m.queue_growth:+.0%}" + (" [red]unbounded[/]" if m.unbounded_queue else "")
        table.add_row(p.profile, f"{p.rate:g}", f"{m.ttft.p50:.3g}", f"{m.ttft.p95:.3g}", f"{m.ttft.p99:.3g}",
                      f"{m.tpot.p99 * 1000:.1f}", f"{m.request_throughput:.3g}", f"{m.goodput:.3g}" if m.goodput is not None else "-",
                      f"{m.preemptions:,}", growth, *((f"{m.slo_attainment:.0%}", f"{m.slo_goodput:.3g}")
                                                      if targeted and m.slo_attainment is not None else
                                                      (("-", "-") if targeted else ())))
    console.print(readable(table, compact=True, width=console.width))
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
    console.print(readable(ct, compact=True, width=console.width))
    cpu = sum(p.cpu_s for p in points)
    runs = sum(1 for p in points if p.metrics is not None)
    console.print(f"{runs} simulations in {wall:,.0f} s wall ({cpu:,.0f} s of simulation CPU time, {args.jobs or os.cpu_count()} workers)")
    if args.engine == "gpu" and args.check_engine != "off":
        checked = sum(p.checked_steps for p in points)
        console.print(f"gpu_engine's decisions equal the spec's on the {checked:,} steps compared ({args.check_engine} check)")
    if args.json:  # before the plots: a plotting error never loses the points
        _write_json(args.json, {"trace": args.trace, "cost_model": cost.to_json(), "slo_ttft": args.slo_ttft,
                                "points": points, "capacity": caps})
    if args.plot:
        from batchspec import plots

        for path in args.plot:
            console.print("capacity plot: " + plots.capacity_plot(points, caps, args.slo_ttft, path,
                          title=f"{Path(args.trace).name} — p50/p95/p99 TTFT vs arrival rate — cost model {cost.name}"))
    if targeted:
        _slo_report(args, points, cost)
    return 0


def _slo_report(args, points, cost) -> None:
    """Issue 19: SLO attainment per class at every rate, and the --slo-plot."""
    classes = sorted({c for p in points if p.metrics is not None for c in p.metrics.slo_classes})
    table = Table(title="SLO attainment per class (requests meeting both targets) and SLO goodput")
    for col in ("profile", "rate/s", *classes, "all", "SLO goodput/s", "req/s"):
        table.add_column(col, justify="left" if col == "profile" else "right")
    for p in points:
        m = p.metrics
        if m is None or m.slo_attainment is None:
            continue
        table.add_row(p.profile, f"{p.rate:g}", *(f"{m.slo_classes[c].attained:.0%}" if c in m.slo_classes else "-"
                                                  for c in classes),
                      f"{m.slo_attainment:.0%}", f"{m.slo_goodput:.3g}", f"{m.request_throughput:.3g}")
    console.print(readable(table, compact=True, width=console.width))
    if args.slo_plot:
        from batchspec import plots

        for path in args.slo_plot:
            console.print("SLO plot: " + plots.slo_plot(points, path, title=f"{Path(args.trace).name} — SLO goodput and "
                                                                              f"attainment vs arrival rate — cost model {cost.name}"))


@_guarded
def cmd_calibrate(args) -> int:
    from fuzz.calibrate import fit, load_rows

    from spec.io import check_outputs

    check_outputs({"-o/--output": args.output}, {"ROWS": args.rows})
    result = fit(load_rows(args.rows), name=args.name, knobs=args.overrides, prefill_step=args.prefill_step,
                 robust=args.robust)
    _write_json(args.output, result.model.to_json())
    table = Table(title=f"cost model {args.name} fitted to {result.rows:,} steps → {args.output}")
    for col in ("fixed", "per prefill token", "per decode seq", "per KV token read", "R²", "median / max error"):
        table.add_column(col, justify="right")
    m = result.model
    table.add_row(f"{m.fixed_s * 1e3:.4g} ms", f"{m.per_prefill_token_s * 1e6:.4g} µs", f"{m.per_decode_seq_s * 1e6:.4g} µs",
                  f"{m.per_kv_token_s * 1e9:.4g} ns", f"{result.r_squared:.4f}",
                  f"{result.median_relative_error:.1%} / {result.max_relative_error:.1%}")
    console.print(readable(table))
    if args.prefill_step:
        console.print(f"per step with prefill: {m.per_prefill_step_s * 1e3:.4g} ms", highlight=False)
    return 0


def add_parsers(sub, command=None) -> None:
    """Register ``import``, ``simulate``, ``compare``, ``sweep`` and ``calibrate`` on ``batchspec``'s sub-parsers.

    ``command(name, help)`` makes a sub-parser the way ``batchspec.cli`` makes its own (epilog, formatting).
    """
    from batchspec.cli import MAX_WORKERS, float_option, int_option, text_option
    from spec.config import PROFILES

    command = command or (lambda name, help_text: sub.add_parser(name, help=help_text, description=help_text))
    im = command("import", "import a public trace (Azure, Mooncake, BurstGPT, length tables, Vidur, LLMServingSim)")
    _add_trace_args(im, rate_help="length-only tables: mean arrivals per second of the generated process", formats=("auto",))
    im.add_argument("-o", "--output", required=True, metavar="FILE", help="the batchspec trace to write (JSON lines)")
    im.add_argument("--profile", default="vllm-v1", choices=sorted(PROFILES), metavar="PROFILE",
                    help="profile written in the trace header (default vllm-v1); one of " + ", ".join(sorted(PROFILES)))
    im.add_argument("--set", dest="overrides", default={}, type=_knobs_arg, metavar="KNOB=VALUE,...",
                    help="knobs written in the trace header (e.g. num_blocks=4096)")
    im.add_argument("--step-seconds", type=float_option(1e-6, 3600.0, exclusive_minimum=False), default=1.0, metavar="S",
                    help="seconds per step for arrival_step, the clock of run / replay / fuzz (default 1)")
    im.set_defaults(fn=cmd_import)

    sm = command("simulate", "simulate a trace in modelled time and print its serving metrics")
    _add_trace_args(sm, rate_help="scale arrivals to this mean rate (requests/s)")
    _add_sim_args(sm)
    sm.add_argument("--profile", metavar="PROFILE[:KNOB=VALUE,...]", help="name or name:knob=value,... (default: the trace header's)")
    sm.add_argument("--timeline", type=_plot_path, metavar="FILE", help="write the batch timeline of the first steps (.png or .svg)")
    sm.add_argument("--timeline-steps", type=int_option(1, 100_000), default=40, metavar="N", help="steps shown by --timeline (default 40)")
    sm.add_argument("--timeline-start", type=int_option(0, 10_000_000), default=0, metavar="STEP",
                    help="first step shown by --timeline (default 0)")
    sm.add_argument("--kv-plot", type=_plot_path, metavar="FILE", help="write KV occupancy over time (.png or .svg)")
    sm.add_argument("--cdf", type=_plot_path, metavar="FILE", help="write latency CDFs (.png or .svg)")
    sm.set_defaults(fn=cmd_simulate)

    cp = command("compare", "simulate a trace under several profiles, side by side")
    _add_trace_args(cp, rate_help="scale arrivals to this mean rate (requests/s)")
    _add_sim_args(cp)
    cp.add_argument("--profiles", required=True, type=text_option, metavar="P1,P2:KNOB=VALUE,...",
                    help="comma-separated: name or name:knob=value,...")
    cp.add_argument("--cdf", type=_plot_path, metavar="FILE", help="write latency CDFs of every profile (.png or .svg)")
    cp.set_defaults(fn=cmd_compare)

    sw = command("sweep", "sweep arrival rates: TTFT percentiles and the capacity boundary per profile")
    _add_trace_args(sw, rate_help="length-only tables: base rate of the generated process (then scaled)")
    _add_sim_args(sw)
    sw.add_argument("--profiles", default="vllm-v1", type=text_option, metavar="P1,P2:KNOB=VALUE,...",
                    help="comma-separated: name or name:knob=value,... (default vllm-v1)")
    sw.add_argument("--rates", type=_rates, metavar="R1,R2,...",
                    help=f"comma-separated arrival rates, each {MIN_RATE:g} to {MAX_RATE:g} (default: 10 rates, 1/8x to 64x the trace's own)")
    sw.add_argument("--slo-ttft", type=float_option(0, MAX_RATE), default=2.0, metavar="S", help="SLO on p99 TTFT in seconds (default 2)")
    sw.add_argument("--jobs", type=int_option(0, MAX_WORKERS), default=0, metavar="N", help="worker processes (default 0: all cores)")
    sw.add_argument("--all-rates", action="store_true", help="also run rates beyond a profile's first unbounded one")
    sw.add_argument("--plot", action="append", type=_plot_path, metavar="FILE", help="write the capacity plot (.png or .svg); repeatable")
    sw.add_argument("--slo-plot", action="append", type=_plot_path, metavar="FILE",
                    help="with --targets: write SLO goodput and per-class attainment against rate (.png or .svg); repeatable")
    sw.set_defaults(fn=cmd_sweep)

    ca = command("calibrate", "fit the step cost model to measured step times (JSON or CSV rows)")
    ca.add_argument("rows", help="rows of prefill_tokens, decode_seqs, kv_tokens, seconds: JSON (a list, or {\"rows\": [...]}) "
                    "or CSV with those columns (see fuzz/calibrate.py)")
    ca.add_argument("-o", "--output", required=True, metavar="FILE", help="the cost model JSON to write (use it with --cost-model)")
    ca.add_argument("--name", default="calibrated", type=text_option, help="the cost model's name (default: calibrated)")
    ca.add_argument("--set", dest="overrides", default={}, type=_knobs_arg, metavar="KNOB=VALUE,...",
                    help="deployment knobs to store with it, e.g. num_blocks=40000")
    ca.add_argument("--prefill-step", action="store_true",
                    help="also fit a fixed cost of any step that computes prompt tokens (per_prefill_step_s)")
    ca.add_argument("--robust", action="store_true",
                    help="fit the typical step: leave out steps more than 3 MADs off the fit (stalls by other processes)")
    ca.set_defaults(fn=cmd_calibrate)


def build_parser():
    """A parser with only these commands (``python -m batchspec.sim_cli``; tests)."""
    from batchspec.cli import Parser

    p = Parser(prog="batchspec", description=__doc__.split("\n")[0])
    add_parsers(p.add_subparsers(dest="command", required=True, parser_class=Parser))
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one of these commands with ``batchspec.cli``'s exit codes."""
    from batchspec.cli import run

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    return run(args)


if __name__ == "__main__":
    import sys

    sys.exit(main())
