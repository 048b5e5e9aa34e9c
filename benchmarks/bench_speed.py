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

    python benchmarks/bench_speed.py [--nano-vllm PATH] [--before REV] [--traces 200] [--skip-sweep] [--spec-sweep]

``--before REV`` adds, side by side, gpu_engine as committed at ``REV`` to the overhead table
and the whole tree at ``REV`` to the campaign (alternating child processes).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import bench_fuzz  # noqa: E402
import bench_overhead  # noqa: E402
import bench_simulator  # noqa: E402

MUTANTS = "block_off_by_one,wrong_victim,hash_before_computed"


def load() -> str:
    return f"load average {os.getloadavg()[0]:.1f}"


#: Run in a child process, in the tree given as argv[1]: one default campaign, its figures as JSON.
CAMPAIGN = r"""
import json, os, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
os.chdir(sys.argv[1])
import fuzz.campaign as campaign
import fuzz.engines as engines
from fuzz.campaign import CampaignConfig, run_campaign
# the engine's share of the worker's time: every call into the engine under test is timed, in the
# worker (a forked child: it inherits these patches), and each task's total appended to a file
watched, run_task, spent = getattr(engines, "WatchedEngine", None), campaign.run_task, [0.0]
log = tempfile.NamedTemporaryFile("w", suffix=".engine-seconds", delete=False).name
if watched is not None:
    call = watched._call
    def timed(self, method, *args):
        t0 = time.perf_counter()
        try:
            return call(self, method, *args)
        finally:
            spent[0] += time.perf_counter() - t0
    def task(*args, **kwargs):
        spent[0] = 0.0
        try:
            return run_task(*args, **kwargs)
        finally:
            with open(log, "a") as f:
                f.write(f"{spent[0]!r}\n")
    watched._call, campaign.run_task = timed, task
with tempfile.TemporaryDirectory() as corpus:
    t0 = time.perf_counter()
    state = run_campaign(CampaignConfig(traces=int(sys.argv[2]), workers=1, corpus=corpus, profile="all"))
    wall = time.perf_counter() - t0
with open(log) as f:
    engine = sum(float(line) for line in f) if watched is not None else None
os.unlink(log)
# "seconds": the campaign's own clock, whose traces/s `batchspec fuzz` prints (imports and worker start excluded)
print(json.dumps({"traces": state.traces, "steps": state.steps, "wall": wall, "seconds": state.seconds, "engine": engine}))
"""


def campaign(traces: int, tree: str = ROOT) -> dict:
    """A default campaign (every profile, spec vs gpu, exact) on one worker, run by the code in ``tree``
    (a child process, so that an older tree's modules do not mix with this one's)."""
    proc = subprocess.run([sys.executable, "-c", CAMPAIGN, tree, str(traces)], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    if proc.returncode:
        raise RuntimeError(f"campaign in {tree} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tree_at(rev: str) -> str:
    """The repository as committed at ``rev`` (``git archive``), in a temporary folder."""
    out = tempfile.mkdtemp(prefix="bench-speed-before-")
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
    return out


#: Run in a child process, in the tree given as argv[1]: replay every trace file in argv[2] as that
#: tree's campaign does (spec vs gpu, exact, lock step; under WatchedEngine where the tree has it).
REPLAYS = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
os.chdir(sys.argv[1])
import fuzz.engines
from fuzz.replay import make_engine, replay
from spec.io import load_trace
watched = getattr(fuzz.engines, "WatchedEngine", None)
paths = sorted(os.listdir(sys.argv[2]))
traces, bad = [], 0
for name in paths:
    try:
        traces.append(load_trace(os.path.join(sys.argv[2], name)))
    except Exception:
        bad += 1
n, steps, t0 = 0, 0, time.perf_counter()
for trace in traces:
    engine = make_engine("gpu", trace)
    result = replay(trace, watched(engine, 10.0) if watched else engine, "exact")
    n, steps = n + 1, steps + result.steps
print(json.dumps({"traces": n, "steps": steps, "wall": time.perf_counter() - t0, "unreadable": bad}))
"""


def replays_side_by_side(traces: int, before: str, rounds: int) -> dict:
    """The same ``random_trace`` traces (seeds 0..traces-1, written by this tree) replayed by each
    tree's campaign path, alternating child processes: throughput on identical work."""
    from fuzz.generate import random_trace
    from spec.io import write_trace

    folder = tempfile.mkdtemp(prefix="bench-speed-traces-")
    for seed in range(traces):
        write_trace(random_trace(seed), os.path.join(folder, f"{seed:05d}.jsonl"))
    trees = {"now": ROOT, "before": tree_at(before)}
    sums = {name: {"traces": 0, "steps": 0, "wall": 0.0, "unreadable": 0} for name in trees}
    for _ in range(rounds):
        for name, tree in trees.items():
            proc = subprocess.run([sys.executable, "-c", REPLAYS, tree, folder], capture_output=True, text=True,
                                  stdin=subprocess.DEVNULL)
            if proc.returncode:
                raise RuntimeError(f"replays in {tree} failed: {proc.stderr[-2000:]}")
            for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items():
                sums[name][k] += v
    shutil.rmtree(trees["before"], ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)
    return sums


def campaigns_side_by_side(traces: int, rounds: int, before: str | None) -> dict:
    """``rounds`` default campaigns of ``traces`` traces by the working tree and, with ``before``, by
    that revision, alternating (machine load hits both alike); summed figures per side."""
    trees = {"now": ROOT}
    if before:
        trees["before"] = tree_at(before)
    sums = {name: {"traces": 0, "steps": 0, "wall": 0.0, "seconds": 0.0, "engine": 0.0} for name in trees}
    for _ in range(rounds):
        for name, tree in trees.items():
            c = campaign(traces, tree)
            for k in sums[name]:
                sums[name][k] += c[k] or 0.0
    if before:
        shutil.rmtree(trees["before"], ignore_errors=True)
    return sums


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
    ap.add_argument("--before", metavar="REV",
                    help="also run the overhead table's gpu_engine and the campaign as committed at REV, side by side")
    ap.add_argument("--rounds", type=int, default=2, help="campaigns per side, alternating")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"# bench_speed: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"python {platform.python_version()}, torch {torch.__version__}")

    print(f"\n## 1. per-step scheduling overhead ({load()})")
    table = bench_overhead.overhead_table([int(x) for x in args.sizes.split(",")], nano_vllm=args.nano_vllm,
                                          out=lambda line: print(line, flush=True), before=args.before)

    print(f"\n## 2. campaign throughput, one worker ({load()})")
    sides = campaigns_side_by_side(args.traces, args.rounds, args.before)
    c = sides["now"]
    print(f"default campaign (`batchspec fuzz --workers 1`, spec vs gpu, profile all), {args.rounds} x "
          f"{args.traces} traces per side, alternating:")
    for name, f in sides.items():
        label = "working tree" if name == "now" else f"at {args.before}"
        print(f"  {label:<16} {f['traces']} traces, {f['steps']:,} steps ({f['steps'] / f['traces']:.0f} per trace) in "
              f"{f['seconds']:.1f} s of campaign ({f['wall']:.1f} s with start-up): {f['traces'] / f['seconds']:.1f} "
              f"traces/s, {f['steps'] / f['seconds']:,.0f} steps/s")
    free = c["traces"] / (c["seconds"] - c["engine"])
    print(f"  the engine under test takes {100 * c['engine'] / c['seconds']:.0f} % of the working tree's campaign time: "
          f"with a free engine the campaign would run {free:.1f} traces/s (the spec, generation, lock step, steering)")
    if args.before:
        b = sides["before"]
        print(f"  now / before: {(c['traces'] / c['seconds']) / (b['traces'] / b['seconds']):.2f}x traces/s, "
              f"{(c['steps'] / c['seconds']) / (b['steps'] / b['seconds']):.2f}x steps/s")
    if args.before:
        r = replays_side_by_side(args.traces, args.before, args.rounds)
        print(f"the same {args.traces} `random_trace` traces replayed as each tree's campaign does (spec vs gpu, "
              f"exact, lock step), {args.rounds} rounds alternating:")
        for name, f in r.items():
            label = "working tree" if name == "now" else f"at {args.before}"
            print(f"  {label:<16} {f['traces']} traces, {f['steps']:,} steps in {f['wall']:.1f} s: "
                  f"{f['traces'] / f['wall']:.1f} traces/s, {f['steps'] / f['wall']:,.0f} steps/s"
                  + (f" ({f['unreadable']} unreadable)" if f["unreadable"] else ""))
        print(f"  now / before: {(r['now']['steps'] / r['now']['wall']) / (r['before']['steps'] / r['before']['wall']):.2f}x "
              "steps/s on identical traces")
    seeds = list(range(args.traces))
    rows = {name: bench_fuzz.measure(name, seeds) for name in ("spec", "gpu")}
    print(f"where a trace's time goes (bench_fuzz: {args.traces} random traces, drive + fed spec + diff):")
    print(f"{'pairing':<16}{'traces/s':>10}{'steps/s':>10}{'generate':>10}{'engine':>10}{'spec':>10}{'diff':>10}")
    for name, t in rows.items():
        total = t["generate"] + t["engine"] + t["spec"] + t["diff"]
        print(f"{'spec vs ' + name:<16}{args.traces / total:>10.1f}{t['steps'] / total:>10.0f}"
              + "".join(f"{100 * t[k] / total:>9.0f}%" for k in ("generate", "engine", "spec", "diff")))
    print(f"gpu_engine step / spec step on these traces: {rows['gpu']['engine'] / rows['spec']['engine']:.2f}x")
    print(f"spec vs gpu with a free engine (generate + spec + diff only): "
          f"{bench_fuzz.without_engine(rows['gpu'], args.traces):.1f} traces/s")

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
        nano = f", nano-vllm {t['nano']:.3f} (gpu_engine {t['gpu'] / t['nano']:.2f}x it)" if "nano" in t else ""
        was = f" (at {args.before}: {t['gpu_before']:.3f})" if "gpu_before" in t else ""
        print(f"overhead at {r} running: gpu_engine {t['gpu']:.3f} ms{was}, spec {t['spec']:.3f}{nano}")
    print(f"campaign: {c['traces'] / c['seconds']:.1f} traces/s, {c['steps'] / c['seconds']:,.0f} steps/s on one worker"
          + (f" (at {args.before}: {sides['before']['traces'] / sides['before']['seconds']:.1f} traces/s, "
             f"{sides['before']['steps'] / sides['before']['seconds']:,.0f} steps/s)" if args.before else ""))
    print(f"  with a free engine (the campaign's own cost, engine calls removed): {free:.1f} traces/s")
    for name, first in firsts.items():
        print(f"time to first report, {name}: " + (f"{first:.1f} s" if first is not None else "none"))
    if not args.skip_sweep:
        print(f"sweep (--engine gpu): {gpu['wall']:.0f} s wall, {gpu['cpu']:.0f} s CPU")


if __name__ == "__main__":
    main()
