"""Differential fuzz throughput: traces per second per core, scheduler-only mode.

Runs the same seeded traces (fuzz.generate.random_trace) through one process
and reports, side by side in one run, the throughput of each pairing and where
the time goes (generating, the engine, the spec fed with the engine's tokens,
the diff).  Ratios are what to compare across machines; absolute figures vary.

    python benchmarks/bench_fuzz.py [--traces 300] [--seed 0]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fuzz.engines  # noqa: E402,F401  (registers gpu)
from fuzz.diff import first_divergence  # noqa: E402
from fuzz.generate import random_trace  # noqa: E402
from fuzz.replay import FedSpec, make_engine  # noqa: E402
from spec.config import resolve  # noqa: E402
from spec.protocol import drive  # noqa: E402
from spec.scheduler import SpecEngine  # noqa: E402


def measure(engine_name: str, seeds: list[int]) -> dict[str, float]:
    t = {"generate": 0.0, "engine": 0.0, "spec": 0.0, "diff": 0.0, "steps": 0}
    for seed in seeds:
        t0 = time.perf_counter()
        trace = random_trace(seed)
        t1 = time.perf_counter()
        max_steps = resolve(trace.config).max_steps
        eng = drive(make_engine(engine_name, trace), trace, max_steps)
        t2 = time.perf_counter()
        spec = drive(FedSpec(SpecEngine.from_trace(trace), eng), trace, max_steps)
        t3 = time.perf_counter()
        assert first_divergence(spec, eng, "exact") is None
        t4 = time.perf_counter()
        t["generate"] += t1 - t0
        t["engine"] += t2 - t1
        t["spec"] += t3 - t2
        t["diff"] += t4 - t3
        t["steps"] += len(spec)
    return t


def without_engine(t: dict[str, float], traces: int) -> float:
    """Traces/s the pairing would reach if the engine under test cost nothing: the floor the spec,
    trace generation and the diff set on any campaign, however fast the engine gets."""
    return traces / (t["generate"] + t["spec"] + t["diff"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    try:
        import torch

        torch.set_num_threads(1)  # per core
    except ImportError:
        pass
    seeds = list(range(args.seed, args.seed + args.traces))
    rows = {name: measure(name, seeds) for name in ("spec", "gpu")}
    print(f"{args.traces} random traces (seeds {seeds[0]}..{seeds[-1]}), one core, exact level, "
          f"{rows['spec']['steps']} steps per pairing\n")
    print(f"{'pairing':<16}{'traces/s':>10}{'steps/s':>10}{'generate':>10}{'engine':>10}{'spec':>10}{'diff':>10}")
    for name, t in rows.items():
        total = t["generate"] + t["engine"] + t["spec"] + t["diff"]
        print(f"{'spec vs ' + name:<16}{args.traces / total:>10.1f}{t['steps'] / total:>10.0f}"
              + "".join(f"{100 * t[k] / total:>9.0f}%" for k in ("generate", "engine", "spec", "diff")))
    spec, gpu = rows["spec"], rows["gpu"]
    print(f"\ngpu_engine scheduler-only step / spec step (same traces): "
          f"{gpu['engine'] / spec['engine']:.2f}x the time")
    print(f"spec vs gpu with a free engine (generate + spec + diff only): {without_engine(gpu, args.traces):.1f} traces/s")


if __name__ == "__main__":
    main()
