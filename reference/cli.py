"""``batchspec generate TRACE``: run a trace through the reference engine and report.

:func:`cli_generate` does the work and returns a :class:`GenerateResult`
(records, per-request outputs, timing); ``batchspec.cli`` renders it.
:func:`main` is a plain-text stand-alone front end: ``python -m reference TRACE``.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from reference.engine import ENGINE_LEVELS, ReferenceEngine
from reference.model import TinyLlama
from reference.sampling import SamplingParams
from spec.formats import DecisionLog, StepRecord, Trace
from spec.io import load_trace, write_log
from spec.protocol import drive


@dataclass
class GenerateResult:
    """What one reference run produced."""

    trace: Trace
    records: list[StepRecord]
    outputs: dict[str, list[int]]  # request -> sampled tokens, in order
    status: dict[str, str]  # request -> finish reason, "aborted", "rejected: <why>" or "unfinished"
    model: TinyLlama
    sampling: SamplingParams
    level: str
    seconds: float  # wall time of the run (model and scheduler), excluding model construction
    num_computed: int  # token positions the model computed, recomputation included

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.outputs.values())

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second of wall time."""
        return self.num_generated / self.seconds if self.seconds > 0 else float("inf")

    def log(self) -> DecisionLog:
        return DecisionLog(engine=ReferenceEngine.name, level=self.level, records=self.records,
                           trace=self.trace.source, config=dict(self.trace.config))


def _status(records: list[StepRecord], trace: Trace) -> dict[str, str]:
    status = {r.id: "unfinished" for r in trace.requests}
    for rec in records:
        status.update({rid: why for rid, why in rec.finished})
        status.update({rid: "aborted" for rid in rec.aborted})
        status.update({rid: f"rejected: {why}" for rid, why in rec.rejected})
    return status


def cli_generate(trace: Trace | str | Path, model=None, seed: int = 0, sampling: SamplingParams | str | None = None,
                 level: str = "memory", check_invariants: bool = False, max_steps: int | None = None,
                 log_path: str | Path | None = None, on_step=None) -> GenerateResult:
    """Run ``trace`` (a :class:`Trace` or a file) through the reference engine.

    ``model``: ``None`` (the tiny model from ``seed``), a model folder, a
    ``TinyLlamaConfig`` (weights from ``seed``) or a ``TinyLlama``.
    ``sampling``: ``SamplingParams`` or its text form (``"greedy"``,
    ``"temperature=0.8,top_p=0.9,seed=1"``).  ``log_path`` writes the decision log.
    """
    if not isinstance(trace, Trace):
        trace = load_trace(trace, steps=True)
    if not isinstance(sampling, SamplingParams):
        sampling = SamplingParams.parse(sampling)
    engine = ReferenceEngine.from_trace(trace, model, sampling, seed, level, check_invariants)
    started = time.perf_counter()
    records = drive(engine, trace, max_steps or engine.spec.config.max_steps, on_step=on_step)
    seconds = time.perf_counter() - started
    result = GenerateResult(trace, records, {r.id: engine.outputs.get(r.id, []) for r in trace.requests},
                            _status(records, trace), engine.model, sampling, level, seconds, engine.num_computed)
    if log_path is not None:
        write_log(result.log(), log_path)
    return result


# ----------------------------------------------------------------------------- plain text


def format_steps(records: list[StepRecord]) -> str:
    """One line per executed step: batch (``id:tokens``), admissions, preemptions, finishes, sampled tokens."""
    lines = [f"{'step':>5}  {'free':>5}  batch | events | sampled"]
    for r in records:
        batch = " ".join(f"{rid}:{n}" for rid, n in r.scheduled) or "-"
        events = [f"+{x}" for x in r.new] + [f"+{x}(resumed)" for x in r.resumed] + [f"!{x}(preempted)" for x in r.preempted]
        events += [f"-{x}({why})" for x, why in r.finished] + [f"-{x}(aborted)" for x in r.aborted]
        events += [f"-{x}(rejected: {why})" for x, why in r.rejected]
        sampled = " ".join(f"{rid}={t}" for rid, t in r.sampled.items())
        free = "" if r.num_free_blocks is None else r.num_free_blocks
        lines.append(f"{r.step:>5}  {free:>5}  {batch} | {' '.join(events)} | {sampled}")
    return "\n".join(lines)


def format_outputs(result: GenerateResult) -> str:
    """Per request: prompt length, status, and the output token ids."""
    lines = []
    for req in result.trace.requests:
        out = result.outputs[req.id]
        lines.append(f"{req.id}: prompt {req.prompt_len} tokens, {len(out)} out ({result.status[req.id]}): {out}")
    return "\n".join(lines)


def format_summary(result: GenerateResult) -> str:
    c = result.model.config
    return (
        f"reference engine, model {c.num_hidden_layers}L h{c.hidden_size} vocab {c.vocab_size} "
        f"({result.model.num_parameters():,} parameters, {str(result.model.dtype).removeprefix('torch.')}), "
        f"sampling {result.sampling.describe()}: {len(result.records)} steps, {result.num_generated} tokens out, "
        f"{result.num_computed} positions computed in {result.seconds:.2f} s = {result.tokens_per_s:.1f} tokens/s"
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m reference TRACE [--model DIR] [--seed N] [--sampling S] [--log PATH]``."""
    p = argparse.ArgumentParser(prog="python -m reference", description=__doc__.splitlines()[0])
    p.add_argument("trace", help="trace file (JSON lines)")
    p.add_argument("--model", help="model folder (config.json + model.safetensors); default: the tiny model")
    p.add_argument("--seed", type=int, default=0, help="weight seed of the tiny model (default 0)")
    p.add_argument("--sampling", default="greedy", help='"greedy" or "temperature=T,top_k=K,top_p=P,seed=S"')
    p.add_argument("--level", choices=ENGINE_LEVELS, default="memory", help="decision log level")
    p.add_argument("--log", help="write the decision log here")
    p.add_argument("--quiet", action="store_true", help="no step table")
    args = p.parse_args(argv)
    try:
        result = cli_generate(args.trace, args.model, args.seed, args.sampling, args.level, log_path=args.log)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(format_steps(result.records))
        print()
    print(format_outputs(result))
    print(format_summary(result))
    return 0
