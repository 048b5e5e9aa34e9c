"""Differential fuzz campaigns: many random traces, several workers, one corpus.

A campaign is a sequence of **rounds**.  Trace ``k`` of a campaign with seed
``S`` is ``random_trace(seed=hash(S, k), **options_k)``; shard ``i/n`` takes
the traces with ``k % n == i``, so machines can split one campaign.  The
options of round ``r`` are chosen from the rule-id coverage after round
``r - 1`` — half of each round targets rules not hit yet (:data:`STEERING`) —
and results are merged in trace order, so the same seed gives the same
traces, the same findings and the same report whatever the worker count.

Each trace runs in a worker process with a timeout.  An engine that raises
is a finding (kind ``error``); one that hangs past the timeout, or kills its
worker, is a finding too (kinds ``hang`` and ``crash``) and the worker is
replaced.  A divergence is shrunk in the worker (a deterministic budget of
replays) and saved once per signature in the corpus, with its triage report.

The campaign state (next trace, coverage, findings) is saved after every
round next to the corpus, so ``--resume`` continues after Ctrl-C.  With
``--ray ADDRESS`` the traces run as Ray tasks on an existing cluster instead
of local processes; they share the same corpus directory.
"""
from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fuzz.corpus import save_finding
from fuzz.generate import profile_knobs, random_trace
import fuzz.engines  # noqa: F401  (registers gpu, gpu-model, reference)
from fuzz.replay import ReplayResult, replay
from fuzz.shrink import shrink, signature
from spec.config import PROFILES
from spec.formats import Trace
from spec.rules import HITS, all_rules

#: Generator options that tend to exercise each family of rules.
STEERING: dict[str, dict[str, Any]] = {
    "PREEMPT.": {"tight_memory": True},
    "RUN.PREEMPT_FOR_BLOCKS": {"tight_memory": True},
    "KV.": {"tight_memory": True},
    "CACHE.": {"prefix_groups": True, "enable_prefix_caching": True, "clones": True},
    "ADMIT.NO_CHUNKING": {"enable_chunked_prefill": False, "max_model_len": 64, "max_num_batched_tokens": 64},
    "ADMIT.WATERMARK": {"watermark": 0.1, "tight_memory": True},
    "ADMIT.MAX_NUM_SEQS": {"max_num_seqs": 2},
    "ADMIT.FULL_SEQUENCE": {"tight_memory": True, "scheduler_reserve_full_isl": True},
    "BUDGET.LONG_PREFILL": {"long_prefill_token_threshold": 4},
    "QUEUE.PRIORITY": {"policy": "priority"},
    "REJECT.": {"rejections": True},
    "STOP.EOS": {"eos": True},
    "STOP.STOP_TOKEN": {"stop_tokens": True},
    "ABORT.": {"aborts": True},
}

MAX_STEPS = 3000  # random traces finish in a few hundred steps
ROUND = 16  # traces per round: the unit of steering, checkpointing and determinism


def trace_seed(campaign_seed: int, index: int) -> int:
    return zlib.crc32(f"{campaign_seed}:{index}".encode())


#: ``CampaignConfig.profile`` value that spreads a campaign over the whole map.
ALL_PROFILES = "all"


def trace_profile(profile: str | None, k: int) -> str | None:
    """The profile trace ``k`` of a campaign is drawn for.  Under :data:`ALL_PROFILES`
    half the traces are the default ``vllm-v1`` family (``None``: every knob drawn and
    steered, k % 4 in {0, 1}) and the other half cycle through every other profile."""
    if profile != ALL_PROFILES:
        return profile
    if k % 4 < 2:
        return None
    others = sorted(p for p in PROFILES if p != "vllm-v1")
    return others[(k // 4 * 2 + k % 4 - 2) % len(others)]


def steer(uncovered: list[str], index: int, profile: str | None = None) -> dict[str, Any]:
    """Options for trace ``index``: every other trace targets one uncovered rule family.

    With ``profile``, every trace names it, and steering never overrides a knob
    the profile fixes (a campaign against ``tgi`` stays a campaign against ``tgi``)."""
    fixed = profile_knobs(profile) if profile else {}
    targets = [opts for prefix, opts in STEERING.items() if any(r.startswith(prefix) for r in uncovered)]
    if fixed:  # steering options that would change the profile are dropped
        targets = [o for o in ({k: v for k, v in t.items() if k not in fixed} for t in targets) if o]
    out = {} if not targets or index % 2 == 0 else dict(targets[(index // 2) % len(targets)])
    return {"profile": profile, **out} if profile else out


@dataclass
class Task:
    index: int
    seed: int
    options: dict[str, Any]
    engine: str
    level: str
    shrink_tries: int


@dataclass
class Outcome:
    index: int
    seed: int
    options: dict[str, Any]
    rules: list[str] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    signature: tuple[str, str, str] | None = None
    original_requests: int = 0
    shrunk: ReplayResult | None = None  # the replay of the shrunk trace, when it diverged
    shrink_tries: int = 0
    error: str | None = None


SHRINK_SECONDS = 120.0  # cap on shrinking one finding (the replay budget is the deterministic bound)


def run_task(task: Task, on_detect: Callable[[], None] | None = None) -> Outcome:
    """Generate, replay, and shrink on divergence (runs in a worker).

    A failure of the harness itself (not of the engine, which :func:`replay`
    reports as a divergence) comes back as ``Outcome.error`` and is counted.
    """
    try:
        return _run_task(task, on_detect)
    except Exception as e:
        return Outcome(task.index, task.seed, task.options, error=f"{type(e).__name__}: {e}")


def _run_task(task: Task, on_detect: Callable[[], None] | None) -> Outcome:
    t0 = time.perf_counter()
    # a bounded step limit: a non-terminating engine is a finding, and must not cost 100k steps per replay
    trace = random_trace(task.seed, **{"max_steps": MAX_STEPS, **task.options})
    HITS.clear()
    result = replay(trace, task.engine, task.level)
    rules = sorted(HITS)
    out = Outcome(task.index, task.seed, task.options, rules, len(result.spec_records), original_requests=len(trace.requests))
    if not result.agreed:
        sig = signature(result.divergence)
        out.signature = sig
        if on_detect:
            on_detect()  # shrinking may take longer than one trace's timeout
        # candidates diverge early or not at all: cap their steps near the original divergence
        limit = MAX_STEPS if sig[0] == "non-termination" else min(MAX_STEPS, 2 * result.divergence.step + 200)

        def same(t: Trace) -> bool:
            r = replay(dataclasses.replace(t, config={**t.config, "max_steps": limit}), task.engine, task.level)
            return not r.agreed and signature(r.divergence) == sig

        small, out.shrink_tries = shrink(trace, same, seconds=SHRINK_SECONDS, max_tries=task.shrink_tries)
        out.shrunk = replay(small, task.engine, task.level)
    out.seconds = time.perf_counter() - t0
    return out


# -- local worker pool with per-task timeouts -----------------------------------


def _worker(conn) -> None:
    try:
        import torch

        torch.set_num_threads(1)  # one core per worker; parallelism comes from the pool
    except ImportError:
        pass
    while True:
        task = conn.recv()
        if task is None:
            return
        conn.send(run_task(task, on_detect=lambda: conn.send("shrinking")))


class Pool:
    """Worker processes that can be killed and replaced when a trace hangs."""

    def __init__(self, workers: int):
        # fork: workers inherit the parent's engine registry (and test-time patches);
        # the parent itself never runs an engine, so no thread pool is forked mid-use.
        self.ctx = mp.get_context("fork" if hasattr(os, "fork") else "spawn")
        self.workers = [self._spawn() for _ in range(workers)]

    def _spawn(self):
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_worker, args=(child,), daemon=True)
        proc.start()
        child.close()  # else the pipe never reports EOF when the worker dies
        return [proc, parent, None, 0.0]  # process, pipe, task, deadline

    def run(self, tasks: list[Task], timeout: float) -> list[Outcome]:
        pending, results = list(tasks), {}
        while pending or any(w[2] for w in self.workers):
            for w in self.workers:
                if w[2] is None and pending:
                    w[2], w[3] = pending.pop(0), time.monotonic() + timeout
                    w[1].send(w[2])
            self._collect(results, timeout)
        return [results[t.index] for t in tasks]

    def _collect(self, results: dict[int, Outcome], timeout: float) -> None:
        conns = [w[1] for w in self.workers if w[2] is not None]
        for conn in mp.connection.wait(conns, timeout=0.05):
            w = next(w for w in self.workers if w[1] is conn)
            try:
                message = conn.recv()
            except EOFError:
                self._lost(w, results, "crash", "the worker process died")
                continue
            if message == "shrinking":  # the trace diverged within its timeout; shrinking has its own cap
                w[3] = time.monotonic() + timeout + SHRINK_SECONDS
                continue
            results[w[2].index] = message
            w[2] = None
        now = time.monotonic()
        for w in self.workers:
            if w[2] is not None and now > w[3]:
                self._lost(w, results, "hang", f"no result within {timeout:g} s")

    def _lost(self, w, results: dict[int, Outcome], kind: str, why: str) -> None:
        """Record the worker's task as a finding and replace the worker."""
        task = w[2]
        results[task.index] = Outcome(task.index, task.seed, task.options, signature=(kind, "engine", "-"), error=why)
        w[0].kill()
        w[0].join()
        w[:] = self._spawn()

    def close(self) -> None:
        for w in self.workers:
            try:
                w[1].send(None)
            except (BrokenPipeError, OSError):
                pass
            w[0].join(timeout=1)
            if w[0].is_alive():
                w[0].kill()


def _ray_runner(address: str):
    import ray  # optional extra

    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    remote = ray.remote(run_task)

    def run(tasks: list[Task], timeout: float) -> list[Outcome]:
        refs = [remote.remote(t) for t in tasks]
        out = []
        for t, ref in zip(tasks, refs):
            try:
                out.append(ray.get(ref, timeout=timeout))
            except ray.exceptions.GetTimeoutError:
                ray.cancel(ref, force=True)
                out.append(Outcome(t.index, t.seed, t.options, signature=("hang", "engine", "-"), error=f"no result within {timeout:g} s"))
            except ray.exceptions.RayError as e:  # the task's worker died: run_task itself never raises
                out.append(Outcome(t.index, t.seed, t.options, signature=("crash", "engine", "-"), error=str(e)[:2000]))
        return out

    return run


# -- the campaign ---------------------------------------------------------------


@dataclass
class CampaignState:
    seed: int
    engine: str
    level: str
    shard: tuple[int, int] = (0, 1)
    next_round: int = 0
    traces: int = 0
    steps: int = 0
    seconds: float = 0.0
    covered: list[str] = field(default_factory=list)
    findings: dict[str, dict] = field(default_factory=dict)  # signature slug -> summary
    errors: int = 0  # harness failures (not engine findings); each is a bug in batchspec
    first_error: str | None = None

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=1))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> "CampaignState":
        obj = json.loads(path.read_text())
        obj["shard"] = tuple(obj["shard"])
        return cls(**obj)


@dataclass
class CampaignConfig:
    seed: int = 0
    engine: str = "gpu"
    level: str = "exact"
    traces: int | None = None  # trace budget (this shard's)
    seconds: float | None = None  # time budget
    workers: int = 1
    shard: tuple[int, int] = (0, 1)
    corpus: str = "findings"
    timeout: float = 60.0
    shrink_tries: int = 400
    resume: bool = False
    ray: str | None = None
    stop_on_finding: bool = False  # end after the round that found the first finding
    profile: str | None = None  # fix this profile's knobs in every trace (fuzz.generate.random_trace(profile=)); "all": rotate
    knobs: dict[str, Any] = field(default_factory=dict)  # fixed in every trace, over the profile's and steering's


def state_path(cfg: CampaignConfig) -> Path:
    i, n = cfg.shard
    profile = f"-{cfg.profile}" if cfg.profile else ""
    knobs = "".join(f"-{k}={v}" for k, v in sorted(cfg.knobs.items()))
    return Path(cfg.corpus) / f".campaign-{cfg.engine}-{cfg.level}{profile}{knobs}-seed{cfg.seed}-shard{i}of{n}.json"


def run_campaign(cfg: CampaignConfig, on_round: Callable[[CampaignState, list[Outcome]], None] | None = None) -> CampaignState:
    """Run rounds until the trace or time budget is spent; return the final state."""
    Path(cfg.corpus).mkdir(parents=True, exist_ok=True)
    path = state_path(cfg)
    state = CampaignState.load(path) if cfg.resume and path.exists() else CampaignState(cfg.seed, cfg.engine, cfg.level, cfg.shard)
    rule_ids = sorted(r.id for r in all_rules().values() if r.fires)
    runner = _ray_runner(cfg.ray) if cfg.ray else None
    pool = None if runner else Pool(cfg.workers)
    start = time.monotonic() - state.seconds
    try:
        while not _spent(cfg, state, start):
            tasks = _round_tasks(cfg, state, rule_ids)
            outcomes = runner(tasks, cfg.timeout) if runner else pool.run(tasks, cfg.timeout)
            _merge(cfg, state, outcomes)
            state.next_round += 1
            state.seconds = time.monotonic() - start
            state.save(path)
            if on_round:
                on_round(state, outcomes)
    finally:
        state.seconds = time.monotonic() - start
        state.save(path)
        if pool:
            pool.close()
    return state


def _spent(cfg: CampaignConfig, state: CampaignState, start: float) -> bool:
    if cfg.stop_on_finding and state.findings:
        return True
    if cfg.traces is not None and state.traces >= cfg.traces:
        return True
    return cfg.seconds is not None and time.monotonic() - start >= cfg.seconds


def _round_tasks(cfg: CampaignConfig, state: CampaignState, all_rules: list[str]) -> list[Task]:
    i, n = cfg.shard
    uncovered = [r for r in all_rules if r not in set(state.covered)]
    budget = ROUND if cfg.traces is None else min(ROUND, cfg.traces - state.traces)
    tasks = []
    for k in range(state.next_round * ROUND, state.next_round * ROUND + budget):
        index = k * n + i
        tasks.append(Task(index, trace_seed(cfg.seed, index), {**steer(uncovered, k, trace_profile(cfg.profile, k)), **cfg.knobs}, cfg.engine, cfg.level,
                          cfg.shrink_tries))
    return tasks


def _merge(cfg: CampaignConfig, state: CampaignState, outcomes: list[Outcome]) -> None:
    from fuzz.corpus import slug

    covered = set(state.covered)
    for o in outcomes:  # in trace order: deterministic
        state.traces += 1
        state.steps += o.steps
        covered.update(o.rules)
        if o.error and o.signature is None:
            state.errors += 1
            state.first_error = state.first_error or f"trace {o.index} (seed {o.seed}, options {o.options}): {o.error}"
        if o.signature is None:
            continue
        name = slug(o.signature)
        entry = state.findings.setdefault(name, {"signature": list(o.signature), "count": 0, "first_trace": o.index,
                                                  "seed": o.seed, "options": o.options, "requests": None})
        entry["count"] += 1
        if o.shrunk is not None and entry["requests"] is None:
            small = o.shrunk.trace
            entry["requests"] = len(small.requests)
            entry["original_requests"] = o.original_requests
            if not o.shrunk.agreed:
                provenance = (f"Found by `batchspec fuzz --seed {cfg.seed}` (trace {o.index}, generator seed {o.seed}, "
                              f"options {o.options}); shrunk from {o.original_requests} to {len(small.requests)} requests.")
                save_finding(cfg.corpus, o.shrunk, o.signature, provenance)
        elif o.error:
            entry["error"] = o.error
    state.covered = sorted(covered)
