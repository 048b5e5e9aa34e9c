"""Every speed figure of issue 18, side by side, from one run.

1. **per-step scheduling overhead** (``bench_overhead.overhead_table``): steady decode
   of R running requests, gpu_engine vs the spec vs nano-vllm's scheduler (``--nano-vllm
   PATH`` or ``$NANO_VLLM``: a checkout; the column is skipped with a note otherwise)
   vs vLLM (when importable);
2. **campaign throughput**: a default campaign (``batchspec fuzz``: spec vs gpu_engine,
   every profile, exact level) on one worker, traces per second, and where a trace's
   time goes (``bench_fuzz.measure``: generating, the engine, the spec, the diff);
3. **time to first report**: campaigns against bugs planted in gpu_engine
   (``mutation_score.score`` with ``stop_on_finding``; ``--mutants``, default three), the
   seconds until the first finding was saved;
4. **sweep time** (``bench_simulator.sweep_timing``): the whole Azure conversation
   sample, ``vllm-v1``, 10 rates, 2 workers, ``--engine gpu`` with its sampled check
   (``--spec-sweep``: also on the spec's decisions, which takes minutes).

The machine is shared: the load average is printed with every section; ratios
measured in one run are what to compare.

    python benchmarks/bench_speed.py [--nano-vllm PATH] [--traces 200] [--skip-sweep] [--spec-sweep]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import bench_fuzz  # noqa: E402
import bench_overhead  # noqa: E402
import bench_simulator  # noqa: E402

MUTANTS = "block_off_by_one,wrong_victim,hash_before_computed"


def load() -> str:
    return f"load average {os.getloadavg()[0]:.1f}"


def campaign(traces: int) -> dict:
    """A default campaign (every profile, spec vs gpu, exact) on one worker."""
    from fuzz.campaign import CampaignConfig, run_campaign

    with tempfile.TemporaryDirectory() as corpus:
        t0 = time.perf_counter()
        state = run_campaign(CampaignConfig(traces=traces, workers=1, corpus=corpus, profile="all"))
        wall = time.perf_counter() - t0
    return {"traces": state.traces, "steps": state.steps, "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,64,256,1024")
    ap.add_argument("--nano-vllm", default=os.environ.get("NANO_VLLM"), metavar="PATH")
    ap.add_argument("--traces", type=int, default=200, help="traces of the campaign and of the breakdown")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--mutants", default=MUTANTS, help="planted bugs timed to their first report ('' skips)")
    ap.add_argument("--mutant-seconds", type=float, default=60.0)
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--spec-sweep", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"# bench_speed: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"python {platform.python_version()}, torch {torch.__version__}")

    print(f"\n## 1. per-step scheduling overhead ({load()})")
    table = bench_overhead.overhead_table([int(x) for x in args.sizes.split(",")], nano_vllm=args.nano_vllm,
                                          out=lambda line: print(line, flush=True))

    print(f"\n## 2. campaign throughput, one worker ({load()})")
    c = campaign(args.traces)
    print(f"default campaign (`batchspec fuzz --workers 1`, spec vs gpu, profile all): {c['traces']} traces, "
          f"{c['steps']:,} steps in {c['wall']:.1f} s: {c['traces'] / c['wall']:.1f} traces/s, "
          f"{c['steps'] / c['wall']:,.0f} steps/s")
    seeds = list(range(args.traces))
    rows = {name: bench_fuzz.measure(name, seeds) for name in ("spec", "gpu")}
    print(f"where a trace's time goes (bench_fuzz: {args.traces} random traces, drive + fed spec + diff):")
    print(f"{'pairing':<16}{'traces/s':>10}{'steps/s':>10}{'generate':>10}{'engine':>10}{'spec':>10}{'diff':>10}")
    for name, t in rows.items():
        total = t["generate"] + t["engine"] + t["spec"] + t["diff"]
        print(f"{'spec vs ' + name:<16}{args.traces / total:>10.1f}{t['steps'] / total:>10.0f}"
              + "".join(f"{100 * t[k] / total:>9.0f}%" for k in ("generate", "engine", "spec", "diff")))
    print(f"gpu_engine step / spec step on these traces: {rows['gpu']['engine'] / rows['spec']['engine']:.2f}x")

    firsts = {}
    if args.mutants:
        import mutation_score

        print(f"\n## 3. time to first report, planted bugs, one worker ({load()})")
        for m in mutation_score.MUTANTS:
            if m.name in args.mutants.split(","):
                r = mutation_score.score(m, args.mutant_seconds, 0, stop_on_finding=True)
                firsts[m.name] = r.get("first")
                first = f"{r['first']:.1f} s" if r.get("first") is not None else f"not within {args.mutant_seconds:g} s"
                print(f"{m.name}: first report after {first} ({r['traces']} traces)", flush=True)

    if not args.skip_sweep:
        print(f"\n## 4. sweep time ({load()})")
        gpu = bench_simulator.sweep_timing(args.jobs, "gpu")
        if args.spec_sweep:
            spec = bench_simulator.sweep_timing(args.jobs, "spec")
            same = "identical" if spec["metrics"] == gpu["metrics"] else "DIFFERENT"
            print(f"--engine gpu vs spec: {spec['wall'] / gpu['wall']:.1f}x less wall, "
                  f"{spec['cpu'] / gpu['cpu']:.1f}x less CPU; metrics at every rate: {same}")

    print("\n## summary")
    for r, t in table.items():
        nano = f", nano-vllm {t['nano']:.3f} ({t['gpu'] / t['nano']:.2f}x)" if "nano" in t else ""
        print(f"overhead at {r} running: gpu_engine {t['gpu']:.3f} ms, spec {t['spec']:.3f}{nano}")
    print(f"campaign: {c['traces'] / c['wall']:.1f} traces/s on one worker")
    for name, first in firsts.items():
        print(f"time to first report, {name}: " + (f"{first:.1f} s" if first is not None else "none"))
    if not args.skip_sweep:
        print(f"sweep (--engine gpu): {gpu['wall']:.0f} s wall, {gpu['cpu']:.0f} s CPU")


if __name__ == "__main__":
    main()
