"""Tokens per second of the reference engine on a stated trace: ``python -m reference.bench``.

The trace (:func:`bench_trace`) is fixed: 32 requests arriving 4 per step,
prompts of 16..140 synthetic tokens, 64 output tokens each (EOS ignored),
``vllm-v1`` with 256-token steps and 64 sequences, memory for all.  The
speed is the baseline that ``gpu_engine`` is measured against.
"""
from __future__ import annotations

import argparse

from reference.cli import cli_generate, format_summary
from spec.formats import Trace, TraceRequest


def bench_trace(num_requests: int = 32, max_tokens: int = 64) -> Trace:
    requests = [TraceRequest(id=f"b{i}", prompt_len=16 + (i * 37) % 125, max_tokens=max_tokens,
                             arrival_step=i // 4, ignore_eos=True) for i in range(num_requests)]
    config = {"profile": "vllm-v1", "num_blocks": 1024, "block_size": 16, "max_num_batched_tokens": 256,
              "max_num_seqs": 64}
    return Trace(config=config, requests=requests, vocab_size=512, name=f"bench-{num_requests}x{max_tokens}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m reference.bench", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3, help="runs; the fastest is reported")
    args = p.parse_args(argv)
    trace = bench_trace(args.requests, args.max_tokens)
    best = min((cli_generate(trace) for _ in range(args.repeat)), key=lambda r: r.seconds)
    print(f"trace {trace.name}: {len(trace.requests)} requests, "
          f"{sum(r.prompt_len for r in trace.requests)} prompt tokens")
    print(format_summary(best))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
