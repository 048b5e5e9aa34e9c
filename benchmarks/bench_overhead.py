"""Per-step scheduling overhead: gpu_engine vs. the spec vs. vLLM's and nano-vllm's schedulers.

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
* ``nano-vllm``: ``Scheduler.schedule()`` + ``Scheduler.postprocess(seqs, tokens)``
  of a nano-vllm checkout (``--nano-vllm PATH`` or ``$NANO_VLLM``; needs ``xxhash``).
  Only its ``engine`` modules are imported (its package ``__init__`` pulls in the
  model runner), and its ``Config`` (which loads a model folder) is replaced by
  the five numbers the scheduler reads.  Its block size is set to 16 like the
  others (its default is 256).  Column skipped, with a note, when not given.

Usage::

    python benchmarks/bench_overhead.py [--sizes 16,64,256,1024] [--steps 40] [--nano-vllm PATH]
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
    def __init__(self, trace, level, engine_class=GpuEngine):
        self.engine = engine_class.from_trace(trace, level=level)
        be = self.engine.sched.be
        self.engine._synthesize = lambda batch: be.asarray(
            [TOKEN] * (len(batch.slots) if batch.all_sample else int(batch.samples.sum())))
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


def nano_vllm_modules(path: str) -> dict:
    """nano-vllm's scheduler, block manager and sequence modules from a checkout at ``path``.

    The ``nanovllm`` and ``nanovllm.engine`` packages are registered as empty
    namespaces so that their ``__init__`` (which imports the model runner, CUDA
    kernels and flash-attn) does not run; the engine modules are nano-vllm's own.
    """
    import importlib
    import types

    root = os.path.join(os.path.abspath(path), "nanovllm")
    if not os.path.isfile(os.path.join(root, "engine", "scheduler.py")):
        raise FileNotFoundError(f"{path}: no nanovllm/engine/scheduler.py")
    for name, folder in (("nanovllm", root), ("nanovllm.engine", os.path.join(root, "engine"))):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [folder]
            sys.modules[name] = pkg
    return {name: importlib.import_module(f"nanovllm.{name}")
            for name in ("engine.sequence", "engine.scheduler", "sampling_params")}


class NanoSide:
    """nano-vllm's Scheduler + BlockManager driven as its LLMEngine.step does, minus the model."""

    def __init__(self, trace, modules):
        from types import SimpleNamespace

        cfg = resolve(trace.config)
        seq_mod = modules["engine.sequence"]
        seq_mod.Sequence.block_size = cfg.block_size  # what LLMEngine sets from its config
        config = SimpleNamespace(max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                                 eos=trace.eos_token_id, kvcache_block_size=cfg.block_size,
                                 num_kvcache_blocks=cfg.num_blocks)
        self.sched = modules["engine.scheduler"].Scheduler(config)
        params = modules["sampling_params"].SamplingParams
        for r in trace.requests:
            sp = params(max_tokens=r.max_tokens, ignore_eos=r.ignore_eos)
            self.sched.add(seq_mod.Sequence(r.prompt_token_ids(trace.vocab_size), sp))

    def step(self):
        seqs, is_prefill = self.sched.schedule()
        self.sched.postprocess(seqs, [TOKEN] * len(seqs), is_prefill)
        return seqs

    def running(self):
        return len(self.sched.running)

    def decoding(self):
        return all(s.num_tokens - s.num_cached_tokens == 1 for s in self.sched.running)


def gpu_engine_at(rev: str):
    """gpu_engine as committed at git revision ``rev``, importable beside the working tree's: its
    files (``git show``, read only) in a temporary package ``gpu_engine_before``; returns its
    ``GpuEngine``.  It uses the working tree's ``spec`` data formats, as the live one does."""
    import importlib
    import subprocess
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tempfile.mkdtemp(prefix="bench-gpu-before-")
    os.makedirs(os.path.join(out, "gpu_engine_before"))
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, "gpu_engine/"], cwd=root, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in names:
        if name.endswith(".py"):
            text = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=root, capture_output=True, text=True,
                                  check=True).stdout
            text = text.replace("from gpu_engine", "from gpu_engine_before").replace("import gpu_engine", "import gpu_engine_before")
            with open(os.path.join(out, "gpu_engine_before", os.path.basename(name)), "w") as f:
                f.write(text)
    sys.path.insert(0, out)
    return importlib.import_module("gpu_engine_before").GpuEngine


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


def overhead_table(sizes: list[int], steps: int = 40, vllm: bool = True, nano_vllm: str | None = None,
                   out=print, before: str | None = None) -> dict[int, dict[str, float]]:
    """Measure and print the overhead table; return ``{R: {engine: median ms}}``.
    ``before``: a git revision whose gpu_engine becomes a column too (``gpu_before``)."""
    old = gpu_engine_at(before) if before else None
    have_vllm, why = False, "not installed in this interpreter"
    if vllm:
        try:
            from fuzz.vllm_adapter import vllm_modules

            vllm_modules()
            have_vllm = True
        except Exception as e:  # noqa: BLE001 - any failure means "not available"
            why = f"unavailable ({type(e).__name__})"
    nano, nano_why = None, "not given (--nano-vllm PATH or $NANO_VLLM)"
    if nano_vllm:
        try:
            nano = nano_vllm_modules(nano_vllm)
        except Exception as e:  # noqa: BLE001 - a broken checkout or a missing xxhash: skip the column
            nano_why = f"unavailable ({type(e).__name__}: {e})"
    out(f"# vllm: {'yes' if have_vllm else why}; nano-vllm: {nano_vllm if nano else nano_why}")
    out("# per-step time, median of interleaved steps (ms); ratios = other / gpu_engine(decisions)")
    head = ["R", "gpu_engine", "gpu(exact)", "spec", "spec/gpu", "nano-vllm", "nano/gpu", "vllm", "vllm/gpu"]
    if old is not None:
        out(f"# gpu_engine at {before}: column 'before' (its time / gpu_engine's now)")
        head[2:2] = ["before", "before/gpu"]
    out("| " + " | ".join(head) + " |")
    out("|" + "---:|" * len(head))
    table = {}
    for r in sizes:
        trace = decode_trace(r, steps)
        sides = {"gpu": GpuSide(trace, "decisions"), "gpu_exact": GpuSide(trace, "exact"), "spec": SpecSide(trace)}
        if old is not None:
            sides["gpu_before"] = GpuSide(trace, "decisions", old)
        if nano is not None:
            sides["nano"] = NanoSide(trace, nano)
        if have_vllm:
            sides["vllm"] = VllmSide(trace)
        for side in sides.values():
            side.n = r
        n = max(16, steps * 64 // max(r, 64))
        t = table[r] = {k: statistics.median(v) * 1e3 for k, v in measure(sides, n).items()}
        g = t["gpu"]
        nv, nratio = (f"{t['nano']:.3f}", f"{t['nano'] / g:.2f}x") if nano is not None else ("n/a", "n/a")
        if have_vllm:
            vl, ratio = f"{t['vllm']:.3f}", f"{t['vllm'] / g:.1f}x"
        elif r == 256:
            vl, ratio = f"({VLLM_QUOTED_MS_AT_256} quoted)", f"{VLLM_QUOTED_MS_AT_256 / g:.1f}x"
        else:
            vl = ratio = "n/a"
        was = f" {t['gpu_before']:.3f} | {t['gpu_before'] / g:.2f}x |" if old is not None else ""
        out(f"| {r} | {g:.3f} |{was} {t['gpu_exact']:.3f} | {t['spec']:.3f} | {t['spec'] / g:.1f}x | {nv} | {nratio} "
            f"| {vl} | {ratio} |")
    return table


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,64,256,1024")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--before", metavar="REV", help="also time gpu_engine as committed at this git revision")
    ap.add_argument("--nano-vllm", default=os.environ.get("NANO_VLLM"), metavar="PATH",
                    help="a nano-vllm checkout (default: $NANO_VLLM); its scheduler becomes a column")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"# bench_overhead: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"python {platform.python_version()}, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}")
    exe = os.path.relpath(sys.executable) if not os.path.relpath(sys.executable).startswith("..") else "python"
    print(f"# command: {' '.join([exe] + sys.argv)}")
    overhead_table([int(x) for x in args.sizes.split(",")], args.steps, not args.no_vllm, args.nano_vllm,
                   out=lambda line: print(line, flush=True), before=args.before)


if __name__ == "__main__":
    main()
