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
import signal
import sys
import threading
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
    envelope: Any = None  # fuzz.capabilities.Envelope: a trace outside it is not run
    known: tuple = ()  # raw signatures already grouped: counted, not shrunk again


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
    raw_signature: tuple[str, str, str] | None = None  # before shrinking (signature: the group's, after)
    outside: str | None = None  # why the trace was outside the engine's envelope (not run)


SHRINK_SECONDS = 120.0  # cap on shrinking one finding (the replay budget is the deterministic bound)
REPORT_CONTEXT = 3  # steps replayed past the divergence of a shrunk trace: the report's step window


#: ``on_detect(raw_signature) -> bool``: asked when a trace diverges; False: the signature is
#: already being reported from an earlier trace, so the divergence is counted, not shrunk.
OnDetect = Callable[[tuple[str, str, str]], bool]


def run_task(task: Task, on_detect: OnDetect | None = None) -> Outcome:
    """Generate, replay, and shrink on divergence (runs in a worker).

    A failure of the harness itself (not of the engine, which :func:`replay`
    reports as a divergence) comes back as ``Outcome.error`` and is counted.
    """
    try:
        return _run_task(task, on_detect)
    except Exception as e:
        return Outcome(task.index, task.seed, task.options, error=f"{type(e).__name__}: {e}")


def _run_task(task: Task, on_detect: OnDetect | None) -> Outcome:
    t0 = time.perf_counter()
    # a bounded step limit: a non-terminating engine is a finding, and must not cost 100k steps per replay
    trace = random_trace(task.seed, **{"max_steps": MAX_STEPS, **task.options})
    if task.envelope is not None and not task.envelope.everything:
        outside = task.envelope.violations(trace.config)
        if outside:  # never run a knob value the engine does not claim
            return Outcome(task.index, task.seed, task.options, outside="; ".join(outside))
    HITS.clear()
    result = replay(trace, task.engine, task.level)
    rules = sorted(HITS)
    out = Outcome(task.index, task.seed, task.options, rules, len(result.spec_records), original_requests=len(trace.requests))
    if not result.agreed:
        sig = signature(result.divergence)
        out.signature = out.raw_signature = sig
        # a manifestation grouped already (in an earlier round, or by an earlier trace of this
        # round: ``on_detect`` asks the pool): count it, spend no shrinking
        if sig in task.known or (on_detect is not None and not on_detect(sig)):
            out.seconds = time.perf_counter() - t0
            return out
        # candidates diverge early or not at all: cap their steps near the original divergence
        limit = MAX_STEPS if sig[0] == "non-termination" else min(MAX_STEPS, 2 * result.divergence.step + 200)

        def same(t: Trace) -> bool:
            # the same kind of divergence, anywhere: shrinking then leads the manifestations of one
            # bug to the same smallest trace, whose signature names the group (one finding per bug)
            if task.envelope is not None and not task.envelope.admits(t.config):
                return False
            r = replay(dataclasses.replace(t, config={**t.config, "max_steps": limit}), task.engine, task.level)
            return not r.agreed and r.divergence.kind == sig[0]

        small, out.shrink_tries = shrink(trace, same, seconds=SHRINK_SECONDS, max_tries=task.shrink_tries)
        out.shrunk = replay(small, task.engine, task.level, after=REPORT_CONTEXT)
        if not out.shrunk.agreed:
            out.signature = signature(out.shrunk.divergence)
    out.seconds = time.perf_counter() - t0
    return out


# -- local worker pool with per-task timeouts -----------------------------------


def _die_with_parent(parent_pid: int) -> None:
    """A worker must not outlive ``batchspec fuzz``, whatever kills it (kill -9 included).

    Linux: the kernel sends SIGKILL when the parent dies (``prctl(PR_SET_PDEATHSIG)``).
    Everywhere: a watchdog thread exits when the parent's pid is gone (re-parented).
    Ctrl-C goes to the whole process group: workers ignore SIGINT, the parent handles it
    (one line, no worker tracebacks)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            PR_SET_PDEATHSIG = 1
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _worker(conn, parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    try:
        import torch

        torch.set_num_threads(1)  # one core per worker; parallelism comes from the pool
    except ImportError:
        pass

    def on_detect(sig) -> bool:  # ask the pool whether an earlier trace already reports this signature
        conn.send(("diverged", sig))
        return conn.recv()

    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        conn.send(("done", run_task(task, on_detect=on_detect)))


@dataclass
class _Slot:
    """One worker process and the task it runs."""

    proc: Any
    conn: Any
    task: Task | None = None
    deadline: float = 0.0
    asked: tuple | None = None  # a raw signature the worker waits to hear about (shrink or not)


class Pool:
    """Worker processes that can be killed and replaced when a trace hangs.

    Tasks are handed out in trace order.  When a trace diverges its worker asks whether to
    shrink; the answer is "no" when an earlier trace of the campaign (an earlier round, or a
    lower index in this one) diverged with the same raw signature — it is counted, not shrunk
    again.  The answer waits until every lower-index trace of the round has diverged or
    finished, so that it is the same for any worker count (determinism)."""

    def __init__(self, workers: int):
        # fork: workers inherit the parent's engine registry (and test-time patches);
        # the parent itself never runs an engine, so no thread pool is forked mid-use.
        self.ctx = mp.get_context("fork" if hasattr(os, "fork") else "spawn")
        self.slots = [self._spawn() for _ in range(workers)]

    def _spawn(self) -> _Slot:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_worker, args=(child, os.getpid()), daemon=True)
        proc.start()
        child.close()  # else the pipe never reports EOF when the worker dies
        return _Slot(proc, parent)

    def run(self, tasks: list[Task], timeout: float, on_result: Callable[[Outcome], None] | None = None,
            stop: Callable[[], bool] | None = None) -> list[Outcome]:
        """Run ``tasks``; return their outcomes in task order.  ``on_result(outcome)`` is called as each
        arrives (a finding is saved the moment it is shrunk); once ``stop()`` is true no further task
        is started, and only the outcomes of the tasks started are returned."""
        pending, results = list(tasks), {}
        self.detected: dict[int, tuple | None] = {}  # task index -> raw signature (None: agreed)
        self.order = [t.index for t in tasks]
        self.known = set(tasks[0].known) if tasks else set()
        started = []
        while pending or any(w.task for w in self.slots):
            for w in self.slots:
                if w.task is None and pending and not (stop and stop()):
                    w.task, w.deadline = pending.pop(0), time.monotonic() + timeout
                    started.append(w.task)
                    w.conn.send(w.task)
            if stop and stop():
                pending.clear()
            self._collect(results, timeout, on_result)
            self._answer()
        return [results[t.index] for t in started]

    def _collect(self, results: dict[int, Outcome], timeout: float, on_result) -> None:
        conns = [w.conn for w in self.slots if w.task is not None]
        for conn in mp.connection.wait(conns, timeout=0.05):
            w = next(w for w in self.slots if w.conn is conn)
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):
                self._lost(w, results, "crash", "the worker process died", on_result)
                continue
            if kind == "diverged":  # within its timeout; shrinking has its own cap
                w.asked = payload
                self.detected[w.task.index] = payload
                w.deadline = time.monotonic() + timeout + SHRINK_SECONDS
                continue
            results[w.task.index] = payload
            self.detected.setdefault(w.task.index, payload.raw_signature)
            w.task, w.asked = None, None
            if on_result:
                on_result(payload)
        now = time.monotonic()
        for w in self.slots:
            if w.task is not None and now > w.deadline:
                self._lost(w, results, "hang", f"no result within {timeout:g} s", on_result)

    def _answer(self) -> None:
        """Tell each worker waiting on a divergence whether to shrink it, once every lower-index trace
        of the round has diverged or finished."""
        for w in self.slots:
            if w.asked is None:
                continue
            earlier = self.order[:self.order.index(w.task.index)]
            if any(i not in self.detected for i in earlier):
                continue
            seen = w.asked in self.known or any(self.detected[i] == w.asked for i in earlier)
            try:
                w.conn.send(not seen)
            except (BrokenPipeError, OSError):
                pass  # the worker died: the next collect reports it
            w.asked = None

    def _lost(self, w: _Slot, results: dict[int, Outcome], kind: str, why: str, on_result) -> None:
        """Record the worker's task as a finding and replace the worker."""
        task = w.task
        results[task.index] = Outcome(task.index, task.seed, task.options, signature=(kind, "engine", "-"), error=why)
        self.detected[task.index] = None  # its divergence, if any, was not shrunk: a later trace may be
        w.proc.kill()
        w.proc.join()
        w.conn.close()
        fresh = self._spawn()
        w.proc, w.conn, w.task, w.asked = fresh.proc, fresh.conn, None, None
        if on_result:
            on_result(results[task.index])

    def close(self) -> None:
        for w in self.slots:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 1.0
        for w in self.slots:
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join()


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
    envelope: str = ""  # the engine's declared envelope (fuzz.capabilities), as the summary states it
    outside_envelope: int = 0  # traces drawn outside it, not run (0 unless a knob draw escaped it)
    raw_groups: dict[str, str] = field(default_factory=dict)  # raw signature slug -> its group (finding)

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
    capabilities: Any = None  # --capabilities FILE (or an Envelope / dict): overrides the engine's declaration


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
    envelope = campaign_envelope(cfg)
    state.envelope = envelope.describe()
    runner = _ray_runner(cfg.ray) if cfg.ray else None
    pool = None if runner else Pool(cfg.workers)
    start = time.monotonic() - state.seconds
    try:
        while not _spent(cfg, state, start):
            tasks = _round_tasks(cfg, state, rule_ids, envelope)
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


def campaign_envelope(cfg: CampaignConfig):
    """The engine's envelope (:mod:`fuzz.capabilities`), checked against ``--profile`` and ``--set``:
    raises :class:`fuzz.capabilities.CapabilityError` when they ask for a knob value outside it."""
    from fuzz.capabilities import CapabilityError, for_engine
    from fuzz.generate import profile_knobs

    envelope = for_engine(cfg.engine, cfg.capabilities)
    bad = envelope.partial_violations(cfg.knobs)
    if bad:
        raise CapabilityError(f"--set asks engine {cfg.engine} for {'; '.join(bad)}")
    if cfg.profile not in (None, ALL_PROFILES):
        bad = envelope.partial_violations({k: v for k, v in profile_knobs(cfg.profile).items() if k not in cfg.knobs})
        if bad:
            raise CapabilityError(f"--profile {cfg.profile} is outside engine {cfg.engine}'s capabilities: {'; '.join(bad)} "
                                  f"(profiles inside: {', '.join(envelope.profiles()) or 'none'})")
    return envelope


def trace_options(cfg: CampaignConfig, k: int, uncovered: list[str], envelope) -> dict[str, Any]:
    """Generator options for trace ``k``: steering, the envelope's knob draws, then ``--set``.
    Under a declared envelope a profile outside it is not drawn (the envelope's own draw
    instead), and steering never asks for a knob value outside it."""
    from fuzz.generate import _KNOBS

    profile = trace_profile(cfg.profile, k)
    if profile is not None and not envelope.everything and profile not in envelope.profiles():
        profile = None
    options = steer(uncovered, k, profile)
    if envelope.everything:
        return {**options, **cfg.knobs}
    options = {key: v for key, v in options.items() if key not in _KNOBS or envelope.allows(key, v)}
    fixed = set(cfg.knobs) | (set(profile_knobs(profile)) if profile else set())
    drawn = envelope.options(k, cfg.seed, fixed=fixed)
    if profile:
        drawn["profile"] = profile
    return {**options, **drawn, **cfg.knobs}


def _round_tasks(cfg: CampaignConfig, state: CampaignState, all_rules: list[str], envelope=None) -> list[Task]:
    from fuzz.capabilities import UNDECLARED

    envelope = envelope or UNDECLARED
    i, n = cfg.shard
    uncovered = [r for r in all_rules if r not in set(state.covered)]
    budget = ROUND if cfg.traces is None else min(ROUND, cfg.traces - state.traces)
    known = tuple(tuple(raw.split("|")) for raw in state.raw_groups)
    tasks = []
    for k in range(state.next_round * ROUND, state.next_round * ROUND + budget):
        index = k * n + i
        tasks.append(Task(index, trace_seed(cfg.seed, index), trace_options(cfg, k, uncovered, envelope), cfg.engine, cfg.level,
                          cfg.shrink_tries, envelope, known))
    return tasks


def _merge(cfg: CampaignConfig, state: CampaignState, outcomes: list[Outcome]) -> None:
    """Fold a round's outcomes into the state, in trace order (deterministic).  Divergences
    are grouped by the signature of their *shrunk* trace (one finding per bug); a raw
    signature seen before joins its group unshrunk; the corpus keeps each group's smallest
    example and its count (:func:`fuzz.corpus.save_finding`)."""
    from fuzz.corpus import record_hits, size, slug

    covered = set(state.covered)
    for o in outcomes:  # in trace order: deterministic
        if o.outside is not None:
            state.outside_envelope += 1
            continue
        state.traces += 1
        state.steps += o.steps
        covered.update(o.rules)
        if o.error and o.signature is None:
            state.errors += 1
            state.first_error = state.first_error or f"trace {o.index} (seed {o.seed}, options {o.options}): {o.error}"
        if o.signature is None:
            continue
        raw = "|".join(o.raw_signature or o.signature)
        name = state.raw_groups.get(raw) if o.shrunk is None else slug(o.signature)
        name = name or slug(o.signature)
        state.raw_groups.setdefault(raw, name)
        entry = state.findings.setdefault(name, {"signature": list(o.signature), "count": 0, "first_trace": o.index,
                                                  "seed": o.seed, "options": o.options, "requests": None,
                                                  "raw_signatures": []})
        entry["count"] += 1
        if raw not in entry.setdefault("raw_signatures", []):
            entry["raw_signatures"].append(raw)
        if o.shrunk is not None and not o.shrunk.agreed:
            small = o.shrunk.trace
            if entry["requests"] is None or list(size(small)) < entry.get("size", [1 << 30]):
                entry["requests"] = len(small.requests)
                entry["size"] = list(size(small))
                entry["original_requests"] = o.original_requests
                provenance = (f"Found by `batchspec fuzz --seed {cfg.seed}` (trace {o.index}, generator seed {o.seed}, "
                              f"options {o.options}); shrunk from {o.original_requests} to {len(small.requests)} requests.")
                save_finding(cfg.corpus, o.shrunk, o.signature, provenance, engine=cfg.engine)
                continue
        elif o.error:
            entry["error"] = o.error
        record_hits(cfg.corpus, name, tuple(entry["signature"]), 1)  # (save_finding counts the ones it saves)
    state.covered = sorted(covered)
