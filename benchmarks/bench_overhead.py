"""Per-step scheduling overhead: gpu_engine vs. the spec vs. vLLM's own scheduler.

Steady-state decode of R running requests (R = 16, 64, 256, 1024), block size
16, prefix caching on (vLLM's default), prompts of 32..47 tokens so that
requests cross block boundaries on different steps.  Every engine gets the
same trace and the same sampled tokens; their steps are interleaved (one
step of each in turn) so machine noise hits all of them alike, and the table
reports medians and the ratios measured in this one run.

What is timed, per step:

* ``gpu_engine``: ``GpuEngine.step()`` in scheduler-only mode: schedule,
  append tokens, stop checks, frees, and the decision log (``decisions`` level;
  the ``exact`` column adds every running request's block table to the log).
  The synthetic-token rule is replaced by a precomputed constant token, as
  for the other engines (a model would produce it).
* ``spec``: ``SpecEngine.schedule()`` + ``update_from_output(tokens)``.
* ``vllm``: ``Scheduler.schedule()`` + ``update_from_output(out, ModelRunnerOutput)``
  of vLLM 0.32 (only when ``import vllm`` works: run this script with
  ``.venv-vllm/bin/python``), built by :mod:`fuzz.vllm_adapter`.

Usage::

    python benchmarks/bench_overhead.py [--sizes 16,64,256,1024] [--steps 40]
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from spec.config import resolve  # noqa: E402
from spec.formats import Trace, TraceRequest  # noqa: E402
from spec.scheduler import SpecEngine  # noqa: E402

from gpu_engine import GpuEngine  # noqa: E402

TOKEN = 7
VLLM_QUOTED_MS_AT_256 = 2.9  # the figure: vLLM 0.32, 256 running, bs 16, this 2-core machine


def decode_trace(num_running: int, steps: int) -> Trace:
    prompts = [32 + i % 16 for i in range(num_running)]
    max_tokens = steps + 300  # warm-up and timed steps, never reached: nobody finishes
    blocks = num_running * -(-(max(prompts) + max_tokens) // 16) + 16  # nobody is rejected or preempted
    config = {"profile": "vllm-v1", "num_blocks": blocks, "block_size": 16, "max_num_seqs": num_running,
              "max_num_batched_tokens": max(2048, num_running), "max_model_len": 4096}
    requests = [TraceRequest(id=f"r{i}", prompt_len=p, max_tokens=max_tokens, ignore_eos=True, arrival_step=0)
                for i, p in enumerate(prompts)]
    return Trace(config=config, requests=requests, vocab_size=32000, eos_token_id=2, name=f"decode-{num_running}")


class GpuSide:
    def __init__(self, trace, level):
        self.engine = GpuEngine.from_trace(trace, level=level)
        be = self.engine.sched.be
        self.engine._synthesize = lambda batch: be.asarray([TOKEN] * int(batch.samples.sum()))
        for r in trace.requests:
            self.engine.add_request(r)

    def step(self):
        return self.engine.step()

    def running(self):
        return len(self.engine.sched.running)

    def decoding(self):
        s = self.engine.sched
        run = s.running
        return bool(((s.prompt_len[run] + s.num_output_tokens[run]) - s.num_computed_tokens[run] == 1).all())


class SpecSide:
    def __init__(self, trace):
        self.engine = SpecEngine.from_trace(trace)
        for r in trace.requests:
            self.engine.add_request(r)

    def step(self):
        out = self.engine.schedule()
        return self.engine.update_from_output({rid: TOKEN for rid in out.samplers})

    def running(self):
        return len(self.engine.running)

    def decoding(self):
        return all(r.num_tokens - r.num_computed_tokens == 1 for r in self.engine.running)


class VllmSide:
    def __init__(self, trace):
        from fuzz.vllm_adapter import VllmEngine, vllm_modules

        self.v = vllm_modules()
        self.engine = VllmEngine(trace)
        self.sched = self.engine.scheduler
        for r in trace.requests:
            self.engine.add_request(r)

    def step(self):
        out = self.sched.schedule()
        ids = list(out.num_scheduled_tokens)
        reqs = self.sched.requests
        runner = self.v["ModelRunnerOutput"](
            req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[[] if reqs[rid].is_prefill_chunk else [TOKEN] for rid in ids])
        return self.sched.update_from_output(out, runner)

    def running(self):
        return len(self.sched.running)

    def decoding(self):
        return all(r.num_tokens - r.num_computed_tokens == 1 for r in self.sched.running)


def measure(sides: dict, steps: int, rounds: int = 4) -> dict[str, list[float]]:
    """Warm every engine into steady decode, then time ``steps`` steps of each, in
    ``rounds`` alternating blocks (so drift and other load hit all engines alike,
    while each block runs with its own data in cache, as an engine would alone)."""
    for side in sides.values():
        for _ in range(300):
            if side.running() == side.n and side.decoding():
                break
            side.step()
        side.step()
    gc.collect()
    gc.freeze()  # the engines' long-lived objects are not re-scanned by every collection
    times = {name: [] for name in sides}
    per = max(1, steps // rounds)
    for _ in range(rounds):
        for name, side in sides.items():
            for _ in range(per):
                t0 = time.perf_counter()
                side.step()
                times[name].append(time.perf_counter() - t0)
    gc.unfreeze()
    return times


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,64,256,1024")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--no-vllm", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    have_vllm, why = False, "not installed in this interpreter"
    if not args.no_vllm:
        try:
            from fuzz.vllm_adapter import vllm_modules

            vllm_modules()
            have_vllm = True
        except Exception as e:  # noqa: BLE001 - any failure means "not available"
            why = f"unavailable ({type(e).__name__})"
    print(f"# bench_overhead: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"python {platform.python_version()}, torch {torch.__version__}, vllm: {'yes' if have_vllm else why}")
    exe = os.path.relpath(sys.executable) if not os.path.relpath(sys.executable).startswith("..") else "python"
    print(f"# command: {' '.join([exe] + sys.argv)}")
    print("# per-step time, median of interleaved steps (ms); ratios = other / gpu_engine(decisions)")
    head = ["R", "gpu_engine", "gpu(exact)", "spec", "spec/gpu", "vllm", "vllm/gpu", "vllm/gpu(exact)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in [int(x) for x in args.sizes.split(",")]:
        trace = decode_trace(r, args.steps)
        sides = {"gpu": GpuSide(trace, "decisions"), "gpu_exact": GpuSide(trace, "exact"), "spec": SpecSide(trace)}
        if have_vllm:
            sides["vllm"] = VllmSide(trace)
        for side in sides.values():
            side.n = r
        steps = max(16, args.steps * 64 // max(r, 64))
        t = {k: statistics.median(v) * 1e3 for k, v in measure(sides, steps).items()}
        g, ge = t["gpu"], t["gpu_exact"]
        if have_vllm:
            vl = f"{t['vllm']:.3f}"
            ratio, ratio_e = f"{t['vllm'] / g:.1f}x", f"{t['vllm'] / ge:.1f}x"
        elif r == 256:
            vl = f"({VLLM_QUOTED_MS_AT_256} quoted)"
            ratio, ratio_e = f"{VLLM_QUOTED_MS_AT_256 / g:.1f}x", f"{VLLM_QUOTED_MS_AT_256 / ge:.1f}x"
        else:
            vl = ratio = ratio_e = "n/a"
        print(f"| {r} | {g:.3f} | {ge:.3f} | {t['spec']:.3f} | {t['spec'] / g:.1f}x | {vl} | {ratio} | {ratio_e} |",
              flush=True)
        if r == 256:
            quoted_256 = g
    if "quoted_256" in locals():
        print(f"# against the issue's quoted vLLM figure ({VLLM_QUOTED_MS_AT_256} ms/step at 256 running): "
              f"{VLLM_QUOTED_MS_AT_256 / quoted_256:.1f}x")


if __name__ == "__main__":
    main()
