"""Simulator speed: the Azure conversation sample under ``vllm-v1``, and a 10-rate sweep over it.

Three measurements (CPU seconds of the simulating process, and wall time;
these machines are shared, so CPU time is the steadier figure):

1. **side by side**, on the first ``--requests`` requests of the sample, each in
   its own process, interleaved ``--repeats`` times:
   ``before`` — the spec as committed at ``--before`` (default ``HEAD``) (``git show``, read only),
   default ``SpecEngine`` (reasons, exact-level records);
   ``after, defaults`` — the working tree, same engine settings;
   ``after, fast`` — the working tree with the simulator's settings
   (``record_level="memory"``, ``record_reasons=False``, a prompt cache), cold.
   Every run drives the same :func:`spec.simulate.simulate` loop and checks that
   the per-request times are identical.
2. **whole sample**: all 19,366 requests, ``after, fast``, cold then warm
   prompt cache; requests and request-steps simulated per second.
3. **sweep**: ``fuzz.sweep.sweep`` of ``vllm-v1`` over 10 rates with
   ``--jobs`` workers (what ``batchspec sweep`` runs), on gpu_engine's decisions
   (``--engine gpu``, with its sampled check against the spec) and, with
   ``--spec-sweep``, on the spec's (minutes); the capacity figures of both.
   ``--sweep-before REV``: instead, the same sweep by the tree as committed at REV
   and by the working tree, side by side (each in a child process, alternating
   ``--rounds`` times): wall and CPU of each, their ratio, and whether every rate's
   metrics are identical.

Usage::

    python benchmarks/bench_simulator.py [--requests 2000] [--repeats 2] [--jobs 2] [--skip-sweep] [--spec-sweep]
    python benchmarks/bench_simulator.py --skip-side-by-side --skip-whole --sweep-before REV [--rounds 2]
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TRACE = ROOT / "batchspec" / "data" / "traces" / "azure_llm_2023_conv.csv"
COST = "h200-llama-8b-bf16"
RATES = [0.25, 0.5, 1, 2, 4, 8, 12, 16, 24, 32]

#: Run in a child process: import the trace, simulate it once (or twice), print JSON.
CHILD = r"""
import json, sys, time, hashlib
sys.path.insert(0, sys.argv[1])          # the spec under test (HEAD copy or the working tree)
sys.path.insert(1, sys.argv[2])          # the working tree, for the importer and the driver
mode, n, warm = sys.argv[3], int(sys.argv[4]), sys.argv[5] == "warm"
from fuzz.importers import ImportOptions, import_trace
from spec.config import resolve
from spec.costmodel import preset
from spec.simulate import simulate
from spec.scheduler import SpecEngine
cost = preset(%r)
trace, _ = import_trace(%r, opts=ImportOptions(first=n or None, config={"profile": "vllm-v1", **cost.knobs}))
config = resolve(trace.config)
kw = {} if mode == "defaults" else dict(record_level="memory", record_reasons=False, prompt_cache={})
runs = 2 if warm else 1
for _ in range(runs):
    engine = SpecEngine(config, trace.vocab_size, trace.eos_token_id, **kw)
    t0, w0 = time.process_time(), time.perf_counter()
    result = simulate(trace, cost, engine)
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
digest = hashlib.sha256(repr(sorted((k, vars(v)) for k, v in result.requests.items())).encode()).hexdigest()
print(json.dumps({"cpu": cpu, "wall": wall, "steps": result.steps, "request_steps": sum(result.running),
                  "requests": len(trace.requests), "digest": digest}))
""" % (COST, str(TRACE))


def head_spec(rev: str) -> str:
    """A copy of spec/ as committed at ``rev``, plus the new simulator modules it lacks."""
    out = Path(tempfile.mkdtemp(prefix="bench-head-"))
    (out / "spec" / "schemas").mkdir(parents=True)
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "spec"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in names:
        data = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=ROOT, capture_output=True, check=True).stdout
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    for new in ("simulate.py", "costmodel.py", "metrics.py"):  # the driver is the same for both sides
        if not (out / "spec" / new).exists():
            shutil.copy(ROOT / "spec" / new, out / "spec" / new)
    return str(out)


def child(spec_root: str, mode: str, n: int, warm: bool = False) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, spec_root, str(ROOT), mode, str(n), "warm" if warm else "cold"],
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


BEFORE = "before, defaults"


def side_by_side(n: int, repeats: int, rev: str) -> None:
    head = head_spec(rev)
    rows: dict[str, list[dict]] = {BEFORE: [], "after, defaults": [], "after, fast": []}
    for _ in range(repeats):  # interleaved: machine noise hits every variant alike
        rows[BEFORE].append(child(head, "defaults", n))
        rows["after, defaults"].append(child(str(ROOT), "defaults", n))
        rows["after, fast"].append(child(str(ROOT), "fast", n))
    shutil.rmtree(head, ignore_errors=True)
    digests = {r["digest"] for runs in rows.values() for r in runs}
    base = min(r["cpu"] for r in rows[BEFORE])
    print(f"\n## side by side: first {n} requests of {TRACE.name}, vllm-v1, cost model {COST}, best of {repeats}")
    print(f"{'variant':<26} {'CPU s':>8} {'wall s':>8} {'steps':>9} {'µs/step':>8} {'speed-up':>9}")
    for name, runs in rows.items():
        best = min(runs, key=lambda r: r["cpu"])
        print(f"{name:<26} {best['cpu']:>8.2f} {best['wall']:>8.2f} {best['steps']:>9,} "
              f"{1e6 * best['cpu'] / best['steps']:>8.0f} {base / best['cpu']:>8.2f}x")
    print(f"identical per-request times in every run: {'yes' if len(digests) == 1 else 'NO'}")


def whole_sample() -> None:
    print(f"\n## whole sample: {TRACE.name}, vllm-v1 (fast settings), cost model {COST}")
    for warm in (False, True):
        r = child(str(ROOT), "fast", 0, warm)
        print(f"{'warm' if warm else 'cold'} prompt cache: {r['requests']:,} requests, {r['steps']:,} steps, "
              f"{r['request_steps']:,} request-steps in {r['cpu']:.1f} s CPU ({r['wall']:.1f} s wall): "
              f"{r['requests'] / r['cpu']:,.0f} requests/s, {r['request_steps'] / r['cpu']:,.0f} request-steps/s")


def sweep_timing(jobs: int, engine: str = "spec", check: str = "sampled", out=print) -> dict:
    """Time a 10-rate sweep of the whole sample; return its figures (wall, cpu, capacity, metrics)."""
    from fuzz.importers import import_trace
    from fuzz.sweep import capacity, parse_profile_spec, sweep
    from spec.costmodel import preset

    trace, _ = import_trace(str(TRACE))
    t0 = time.perf_counter()
    points = sweep(trace, [parse_profile_spec("vllm-v1")], RATES, preset(COST), jobs=jobs, stop_after_unbounded=None,
                   slos={"ttft": 2.0}, engine=engine, check_engine=check)
    wall = time.perf_counter() - t0
    bad = [p for p in points if p.metrics is None]
    if bad:
        raise RuntimeError(f"sweep point {bad[0].rate}/s failed: {bad[0].error}")
    cpu = sum(p.cpu_s for p in points)
    cap = capacity(points, 2.0)["vllm-v1"]
    checked = sum(p.checked_steps for p in points)
    what = f"--engine {engine}" + (f" --check-engine {check} ({checked:,} steps compared with the spec)" if engine == "gpu" else "")
    out(f"\n## sweep: vllm-v1 over {len(RATES)} rates ({', '.join(map(str, RATES))} requests/s), {jobs} workers, {what}")
    out(f"{wall:,.0f} s wall, {cpu:,.0f} s of simulation CPU (load average {os.getloadavg()[0]:.1f}); "
        f"p99 TTFT crosses 2 s at {cap.slo_rate:.3g}/s, queue unbounded from {cap.unbounded_rate}/s")
    for p in points:
        out(f"  {p.rate:>6g}/s  {p.cpu_s:7.1f} s CPU  {p.metrics.steps:>9,} steps  p99 TTFT {p.metrics.ttft.p99:8.3f} s")
    return {"wall": wall, "cpu": cpu, "slo_rate": cap.slo_rate, "unbounded": cap.unbounded_rate,
            "metrics": [p.metrics for p in points], "checked": checked}


#: Run in a child process: one --engine gpu sweep by the tree at argv[1], its figures and a digest of its metrics as JSON.
SWEEP_CHILD = r"""
import hashlib, json, sys, time
sys.path.insert(0, sys.argv[1])
from fuzz.importers import import_trace
from fuzz.sweep import parse_profile_spec, sweep
from spec.costmodel import preset
trace, _ = import_trace(sys.argv[2])
rates = json.loads(sys.argv[4])
t0 = time.perf_counter()
points = sweep(trace, [parse_profile_spec("vllm-v1")], rates, preset(sys.argv[3]), jobs=int(sys.argv[5]),
               stop_after_unbounded=None, slos={"ttft": 2.0}, engine="gpu", check_engine="sampled")
wall = time.perf_counter() - t0
print(json.dumps({"wall": wall, "cpu": sum(p.cpu_s for p in points), "errors": [p.error for p in points if p.error],
                  "checked": sum(p.checked_steps for p in points),
                  "digest": hashlib.sha256(repr([p.metrics for p in points]).encode()).hexdigest()}))
"""


def sweep_side_by_side(rev: str, jobs: int, rounds: int) -> None:
    """The --engine gpu sweep by the tree at ``rev`` and by the working tree, alternating child processes."""
    before = Path(tempfile.mkdtemp(prefix="bench-sweep-"))
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
    rows: dict[str, list[dict]] = {f"at {rev}": [], "working tree": []}
    try:
        for _ in range(rounds):
            for (name, runs), tree in zip(rows.items(), (before, ROOT)):
                proc = subprocess.run([sys.executable, "-c", SWEEP_CHILD, str(tree), str(TRACE), COST, json.dumps(RATES),
                                       str(jobs)], capture_output=True, text=True)
                if proc.returncode:
                    raise RuntimeError(proc.stderr)
                runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                runs[-1]["load"] = os.getloadavg()[0]
    finally:
        shutil.rmtree(before, ignore_errors=True)
    print(f"\n## sweep side by side: vllm-v1 over {len(RATES)} rates, {jobs} workers, --engine gpu --check-engine sampled, "
          f"{rounds} alternating rounds")
    print(f"{'tree':<22} {'wall s':>8} {'CPU s':>8} {'load':>6} {'steps checked':>14}")
    for name, runs in rows.items():
        for r in runs:
            print(f"{name:<22} {r['wall']:>8.1f} {r['cpu']:>8.1f} {r['load']:>6.1f} {r['checked']:>14,}")
    (a, b) = ([min(r[k] for r in runs) for k in ("wall", "cpu")] for runs in rows.values())
    same = len({r["digest"] for runs in rows.values() for r in runs}) == 1
    errors = [e for runs in rows.values() for r in runs for e in r["errors"]]
    print(f"best of {rounds}: wall {a[0]:.1f} -> {b[0]:.1f} s ({a[0] / b[0]:.2f}x), CPU {a[1]:.1f} -> {b[1]:.1f} s "
          f"({a[1] / b[1]:.2f}x); metrics at every rate identical: {'yes' if same else 'NO'}"
          + (f"; errors: {errors}" if errors else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="requests in the side-by-side runs")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--before", default="HEAD",
                    help="git revision whose spec/ is the 'before' side (e.g. 3fb9394, the spec before the simulator work)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--skip-side-by-side", action="store_true")
    ap.add_argument("--skip-whole", action="store_true")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--spec-sweep", action="store_true", help="also sweep on the spec's decisions (minutes) and compare")
    ap.add_argument("--sweep-before", metavar="REV",
                    help="instead: the --engine gpu sweep by the tree at REV and by the working tree, side by side")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds of --sweep-before")
    args = ap.parse_args()
    print(f"python {platform.python_version()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}")
    if not args.skip_side_by_side:
        side_by_side(args.requests, args.repeats, args.before)
    if not args.skip_whole:
        whole_sample()
    if args.sweep_before:
        sweep_side_by_side(args.sweep_before, args.jobs, args.rounds)
    elif not args.skip_sweep:
        gpu = sweep_timing(args.jobs, "gpu")
        if args.spec_sweep:
            spec = sweep_timing(args.jobs, "spec")
            same = "identical" if spec["metrics"] == gpu["metrics"] else "DIFFERENT"
            print(f"\n--engine gpu vs spec: {spec['wall'] / gpu['wall']:.1f}x less wall, {spec['cpu'] / gpu['cpu']:.1f}x less CPU; "
                  f"metrics at every rate: {same}")


if __name__ == "__main__":
    main()
