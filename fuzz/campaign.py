"""Differential fuzz campaigns: many random traces, several workers, one corpus.

A campaign is a sequence of **rounds**.  Trace ``k`` of a campaign with seed
``S`` is ``random_trace(seed=hash(S, k), **options_k)``; shard ``i/n`` takes
the traces with ``k % n == i``, so machines can split one campaign.  The
options of round ``r`` are chosen from the rule-id coverage after round
``r - 1`` — half of each round targets rules not hit yet (:data:`STEERING`) —
and results are merged in trace order, so the same seed gives the same
traces, the same findings and the same report whatever the worker count.

Each trace runs in a worker process with a timeout.  An engine that raises
inside a step is a finding (kind ``error``, with file and line); one that hangs
past the timeout, or kills its worker, is a finding too (kinds ``hang`` and
``crash``) and the worker is replaced.  An engine that cannot be constructed is
not a finding: :func:`validate_options` refuses it before the campaign (exit 2).

Reports as soon as they exist: a diverging trace is replayed only up to its
divergence (lock step, :func:`fuzz.replay.replay`); a divergence whose raw
signature an earlier trace already has is counted, not shrunk again (the pool
answers the worker's question in trace order, so the answer does not depend on
the worker count); a new finding is shrunk in the worker and saved by the
parent the moment it arrives, not when its round ends; ``max_findings`` ends
the campaign after that many findings; the time and traces to the first
finding are kept in the state (``first_finding``).

Failing safe: options are checked before any work (:func:`validate_options`,
which ``batchspec fuzz`` calls); workers die with their parent whatever kills it
(``PR_SET_PDEATHSIG`` and a watchdog thread) and ignore Ctrl-C, which the parent
turns into one line (:class:`CampaignInterrupted`); a report writer that raises
keeps what could be written (:func:`save_finding_safely`) and the campaign goes on.

The campaign state (next round, coverage, findings) is saved after every round
next to the corpus, so ``--resume`` continues after Ctrl-C; a state that is
missing, corrupt, or from another campaign is refused with its field named
(:class:`StateError`), and a resumed campaign first writes the reports that
could not be written (:func:`complete_reports`).  With ``--ray ADDRESS`` the
traces run as Ray tasks on an existing cluster instead of local processes;
they share the same corpus directory.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fuzz.corpus import save_finding
from fuzz.diff import SPAN, TOKENS
from spec.io import OptionError
from fuzz.generate import BUDGET_EDGE_SHARE, EDGE_SHARE, PAD_EDGE_SHARE, TURNS_SHARE, profile_knobs, random_trace
from fuzz.pairs import BY_NAME as INTERACTION_BY_NAME, reachable_interactions, trace_pairs
import fuzz.engines  # noqa: F401  (registers gpu, gpu-model, reference)
from fuzz.replay import EngineConfigError, ReplayResult, replay, with_off_replay_check
from fuzz.shrink import shrink, signature
from spec.config import PROFILES, resolve
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
    # (aging's knob is a positive number, no plain value in RULE_NEEDS; 4 steps: ages differ between requests)
    "QUEUE.AGING": {"policy": "priority", "aging_steps": 4},
    # a length-ordered queue re-sorts preempted victims: memory pressure makes victims, and the
    # generator's most requests a queue to re-sort them among (twice the divergent traces of 2-12)
    "QUEUE.SPF": {"policy": "spf", "tight_memory": True, "n_requests": 12},
    "QUEUE.SPRPT": {"policy": "sprpt", "tight_memory": True, "n_requests": 12},
    "REJECT.": {"rejections": True},
    "STOP.EOS": {"eos": True},
    "STOP.STOP_TOKEN": {"stop_tokens": True},
    "ABORT.": {"aborts": True},
    # an abort that empties a tenant's fair queue: its next arrival must be lifted again (VTC.LIFT)
    "VTC.LIFT": {"policy": "vtc", "aborts": True},
    # a preempted request's return to its tenant's queue (no lift: its tenant never left)
    "VTC.QUEUE": {"policy": "vtc", "tight_memory": True},
    # a low, fast-decaying estimate admits more than memory holds: a decode must retract; few
    # retract_decode_steps, so that the ratio a retraction sets, min(1, (outputs + steps x n) /
    # (sum max_tokens + 1)), is below 1 (with SGLang's 20 and outputs of 1-40 it is 1 on both sides)
    "RETRACT.": {"admission": "estimate", "tight_memory": True, "new_token_ratio_init": 0.2,
                 "new_token_ratio_decay_steps": 4, "retract_decode_steps": 2},
    # an eviction order shows only when cached blocks are popped again: a short pool
    "CACHE.EVICT": {"prefix_groups": True, "enable_prefix_caching": True, "clones": True, "tight_memory": True},
    # the estimate's rules bind when memory is short and prefills are cut: a continued chunk's charge,
    # the admission hold a cut releases, the ignore_eos reserve's simulation
    "ESTIMATE.": {"admission": "estimate", "tight_memory": True, "enable_chunked_prefill": True,
                  "max_num_batched_tokens": 16},
    # the ignore_eos reserve simulates the ignore_eos requests' outputs: many of them
    "ESTIMATE.IGNORE_EOS_RESERVE": {"ignore_eos": True},
    # SLO admission control acts on waiting requests that can no longer make their deadline: a small
    # budget and a short pool keep a queue of them (deferral re-keys them behind the rest), the most
    # requests a long one (a preempted request not yet sampled is deferred, never refused)
    "SLO.": {"policy": "edf", "slo_admission": "defer", "tight_memory": True, "enable_chunked_prefill": True,
             "max_num_batched_tokens": 16, "n_requests": 12},
    "SLO.REFUSE": {"policy": "edf", "slo_admission": "refuse", "tight_memory": True, "enable_chunked_prefill": True,
                   "max_num_batched_tokens": 16, "n_requests": 12},
    # SGLang's eager eviction needs both: a retraction, and cached leaves to evict
    "CACHE.EVICT_ON_RETRACT": {"admission": "estimate", "tight_memory": True, "new_token_ratio_init": 0.2,
                               "new_token_ratio_decay_steps": 4, "prefix_groups": True},
    # (entries below come last: the rotation, _all_targets, keeps the earlier targets' places)
    # whether the walk goes on after a self-preemption is a priority knob (vLLM 0.33 goes on) that no
    # profile sets with the priority policy: steered traces take it
    "RUN.PREEMPT": {"tight_memory": True, "policy": "priority", "priority_self_preempt": "continue"},
    # a per-step limit binds where more requests run than it lets decode: small, and a prefill-first
    # batch (nano-vllm) admitting beside them (continuous batching's admission stops at the limit)
    "BATCH.MAX_NUM_SEQS_PER_STEP": {"max_num_seqs_scope": "step", "max_num_seqs": 2, "batching": "prefill-first"},
    # only a batch's first admission may be cut: the budget left decides who else fits whole, a small one often
    "ADMIT.CHUNK_ONLY_FIRST": {"prefill_chunking": "first-continues", "batching": "prefill-first",
                               "enable_chunked_prefill": True, "max_num_batched_tokens": 16},
}

#: Mechanism pairs no rule family draws together, by name: in the rotation every campaign goes round
#: (:func:`_all_targets`), after the families' targets, without standing in for any rule's own target.
#: Coverage of gpu_engine over default campaigns found their branches never ran (0 times in 3,000
#: traces), or ran where a bug there shows in ~1 trace in 150.  A CPU pool that holds every victim,
#: so a swap really happens.
COMBINATIONS: dict[str, dict[str, Any]] = {
    # SGLang's page_size > 1 (its profile's is 1): a request whose last tokens fill no new page inserts no
    # new node at its finish, so only that insert's walk makes its nodes recent, the recency leaf-LRU
    # eviction orders by (10x the divergent traces of one-token pages)
    "radix tree x paged blocks": {"cache_eviction": "leaf-lru", "cache_register": "prefill-and-finish",
                                  "cache_dedup": "on-insert", "free_block_order": "cached-last",
                                  "cache_duplicates": "first", "enable_prefix_caching": True, "prefix_groups": True,
                                  "clones": True, "tight_memory": True, "n_requests": 12},
    # swapped-out requests return in priority order
    "swap-in x priority": {"preemption_mode": "swap", "policy": "priority", "num_cpu_blocks": 256,
                           "tight_memory": True, "n_requests": 12},
    "swap-in x VTC charge": {"policy": "vtc", "preemption_mode": "swap", "num_cpu_blocks": 256, "tight_memory": True},
    "SLO admission x prefill-first": {"policy": "edf", "slo_admission": "defer", "batching": "prefill-first",
                                      "tight_memory": True, "enable_chunked_prefill": True,
                                      "max_num_batched_tokens": 16, "n_requests": 12},
    # a request preempted with its token in flight that this token stops (EOS drawn) leaves its tenant's queue
    "VTC x async scheduling": {"policy": "vtc", "async_scheduling": True, "tight_memory": True, "n_requests": 12,
                               "eos": True},
    # a prefill continued first in the next step (nano-vllm, SGLang) under a long-prefill cap: the profiles
    # that continue prefills fix the cap at 0, so no target drew the two together
    "continued prefill x long-prefill cap": {"prefill_chunking": "first-continues", "batching": "prefill-first",
                                             "enable_chunked_prefill": True, "long_prefill_token_threshold": 4,
                                             "max_num_batched_tokens": 16},
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


#: Traces ``k`` with ``k % 4`` in these are steered towards an interaction (fuzz.pairs) instead of a
#: rule family: half the campaign (k % 4 == 0 stays unsteered, k % 4 == 1 targets rule families).
INTERACTION_SLOTS = (2, 3)


def interaction_target(targets: list[str], index: int) -> str | None:
    """The interaction trace ``index`` is steered towards, or None (not an interaction slot,
    or nothing to target): the ``targets`` (least met first, :func:`interaction_targets`) in turn."""
    if not targets or index % 4 not in INTERACTION_SLOTS:
        return None
    return targets[(index // 4 * 2 + index % 4 - INTERACTION_SLOTS[0]) % len(targets)]


def interaction_targets(reachable: list[str], met: dict[str, int]) -> list[str]:
    """The reachable interactions to steer towards in the next round: those not met yet, else all of
    them, least met first (ties in :data:`fuzz.pairs.INTERACTIONS` order) — interaction bugs need
    the interaction met many times, with different details, not once."""
    unmet = [name for name in reachable if not met.get(name)]
    return unmet or sorted(reachable, key=lambda name: met.get(name, 0))


def steer(uncovered: list[str], index: int, profile: str | None = None) -> dict[str, Any]:
    """Options for trace ``index`` (``index % 4`` is its slot; slots 2 and 3 are usually an
    interaction's, :func:`interaction_target`).  Slot 1, while rules are uncovered, targets an
    uncovered rule's family in turn every other time; its other traces, all of them once every
    rule is covered, every other slot-0 trace and slot 3 go round every steering target in turn
    (:func:`_all_targets`); the rest are the default family as drawn.  A mechanism whose rules
    fired once (VTC, SPF, aging, swap, static batching, ...) so keeps getting traces: the default
    family never draws its knobs, and a bug there needs it met many times, not once.

    With ``profile``, every trace names it, and steering never overrides a knob
    the profile fixes (a campaign against ``tgi`` stays a campaign against ``tgi``)."""
    slot, turn = index % 4, index // 4
    targets = _steer_targets(tuple(uncovered), profile)
    every = _all_targets(profile)
    out: dict[str, Any] = {}
    if slot == 1 and targets and turn % 2 == 0:
        out = dict(targets[(turn // 2) % len(targets)])
    elif every and slot == 1:
        out = dict(every[(turn // 2 if targets else turn) % len(every)])
    elif every and slot == 0 and turn % 2 == 1:  # (offset: not the target slot 1 has at the same time)
        out = dict(every[(turn // 2 + len(every) // 2) % len(every)])
    elif every and slot == 3:
        out = dict(every[(turn + len(every) // 3) % len(every)])
    return {"profile": profile, **out} if profile else out


@functools.lru_cache(maxsize=16)
def _all_targets(profile: str | None) -> tuple[dict[str, Any], ...]:
    """Every distinct steering target that sets a knob away from ``vllm-v1``'s default, as if no rule
    were covered (:func:`_steer_targets`), then the :data:`COMBINATIONS`; generator switches alone
    (tight memory, aborts, EOS, ...) are left to the default family, which draws them in a third to
    two thirds of its traces."""
    from fuzz.generate import _KNOBS
    from spec.config import VLLM_V1

    base = VLLM_V1.config
    fixed = profile_knobs(profile) if profile else {}
    pairs = [o for o in ({k: v for k, v in c.items() if k not in fixed} for c in COMBINATIONS.values()) if o]
    out: list[dict[str, Any]] = []
    for opts in list(_steer_targets(tuple(sorted(r.id for r in all_rules().values() if r.fires)), profile)) + pairs:
        moves = any(k in _KNOBS and getattr(base, k) != v for k, v in opts.items())
        if moves and opts not in out:
            out.append(opts)
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _steer_targets(uncovered: tuple[str, ...], profile: str | None) -> tuple[dict[str, Any], ...]:
    """The steering targets of :func:`steer`, in turn: the families with an uncovered rule, then
    single rules.  The same for every trace of a round with the same profile (cached: a round
    asks once per profile, not once per trace); callers copy the target they take."""
    fixed = profile_knobs(profile) if profile else {}
    targets = [opts for prefix, opts in STEERING.items() if any(r.startswith(prefix) for r in uncovered)]
    targets += [opts for opts in rule_targets(list(uncovered)) if opts not in targets]
    if fixed:  # steering options that would change the profile are dropped
        targets = [o for o in ({k: v for k, v in t.items() if k not in fixed} for t in targets) if o]
    return tuple(targets)


def rule_targets(uncovered: list[str]) -> list[dict[str, Any]]:
    """Steering towards single uncovered rules whose knobs are known (:data:`fuzz.capabilities.RULE_NEEDS`),
    one target per rule (:func:`rule_target`).  A family's options alone miss a rule that needs a knob
    value no family sets (SGLang's ``ignore_eos_admission=reserve`` without prefix caching); a rule new to
    the map is steered towards without a :data:`STEERING` entry of its own."""
    out: list[dict[str, Any]] = []
    for rule in uncovered:
        opts = rule_target(rule)
        if opts is not None and opts not in out:
            out.append(dict(opts))
    return out


@functools.lru_cache(maxsize=None)
def rule_target(rule: str) -> dict[str, Any] | None:
    """Generator options for ``rule``: the options of every family it belongs to (more specific
    prefixes win) and the knob values it fires with, alone when the spec accepts that combination,
    else over the knobs of the first profile (by name) with which it does — a knob value that only
    makes sense inside one engine's configuration (``prefill_chunking=first-continues`` needs
    prefill-first batching) is steered towards inside it.  None when the rule's needs are not plain
    knob values."""
    from fuzz.capabilities import RULE_NEEDS
    from spec.config import ConfigError

    needs = {k: v[0] for k, v in RULE_NEEDS.get(rule, {}).items() if isinstance(v, tuple) and k != "request_features"}
    if not needs:
        return None
    family: dict[str, Any] = {}
    for prefix in sorted((p for p in STEERING if rule.startswith(p)), key=len):
        family.update(STEERING[prefix])
    for base in [{}] + [profile_knobs(name) for name in sorted(PROFILES)]:
        opts = {**base, **family, **needs}
        try:
            cfg = random_trace(0, **opts).config
            resolve(cfg)
        except (ConfigError, TypeError, ValueError):
            continue
        if all(cfg.get(k) == v for k, v in needs.items()):
            return opts
    return None


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
    step_seconds: float | None = None  # an engine call running longer is a hang, caught inside it (WatchedEngine)
    shared_livelocks: bool = False  # a livelock the spec shares is a finding too (a real engine's, which it models)


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
    triage: dict | None = None  # a shrunk finding's automatic triage (fuzz.triage.classify)
    detail: str = ""  # the engine's traceback, or its livelock's cycle, for the report
    pairs: list[str] = field(default_factory=list)  # automatic rule pairs the spec's run showed (fuzz.pairs)
    interactions: list[str] = field(default_factory=list)  # curated interactions it met (fuzz.pairs.INTERACTIONS)


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
    try:
        result = task_replay(task, trace)
    except EngineConfigError as e:  # the engine's own validation refuses a drawn configuration: not run
        return Outcome(task.index, task.seed, task.options, outside=f"the engine refuses it: {e}")
    if result.agreed and checks_spans(task):
        result = with_off_replay_check(result, SPAN)
    small = model_check_trace(trace) if result.agreed and checks_model(task) else None
    if small is not None:
        checked = task_replay(task, small)
        checked = with_off_replay_check(checked, TOKENS) if checked.agreed else checked
        if not checked.agreed:  # (the finding is the smaller trace's: shrinking starts there)
            trace, result = small, checked
    rules = sorted(HITS)
    out = Outcome(task.index, task.seed, task.options, rules, len(result.spec_records), original_requests=len(trace.requests))
    out.pairs, out.interactions = trace_pairs(result.spec_records, resolve(trace.config).max_num_batched_tokens)
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
            # bug to the same smallest trace, whose signature names the group (one finding per bug).
            # An engine crash may shrink to a decision divergence: the state it crashed on, seen earlier;
            # one located in the engine's code (exception type and line) shrinks to that same crash.
            if task.envelope is not None and not task.envelope.admits(t.config):
                return False
            steps = livelock_limit(t, result.divergence.step) if sig[0] == "livelock" else limit
            r = task_replay(task, dataclasses.replace(t, config={**t.config, "max_steps": steps}), shrinking=True,
                            livelocks=sig[0] == "livelock")
            if sig[0] in (SPAN, TOKENS):  # the replay agrees; the fast path, or the model's tokens, do not
                return r.agreed and not with_off_replay_check(r, sig[0]).agreed
            if r.agreed:
                return False
            if sig[0] in ("error", "hang") and sig[2] != "-":
                return signature(r.divergence) == sig
            return r.divergence.kind == sig[0] or (sig[0], r.divergence.kind) == ("error", "decision")

        small, out.shrink_tries = shrink(trace, same, seconds=SHRINK_SECONDS, max_tries=task.shrink_tries)
        out.shrunk = task_replay(task, small, after=REPORT_CONTEXT, livelocks=sig[0] == "livelock")
        if sig[0] in (SPAN, TOKENS):
            out.shrunk = with_off_replay_check(out.shrunk, sig[0])
        if not out.shrunk.agreed:
            from fuzz.corpus import group_signature

            out.signature = group_signature(out.shrunk)  # cause-first field and rule: one finding per bug
            out.triage, out.detail = triage_of(task, out.shrunk)
    out.seconds = time.perf_counter() - t0
    return out


#: One trace in this many of a campaign against ``gpu`` also runs gpu_engine's simulator fast path
#: (:func:`fuzz.sim_engine.span_divergence`: ~1.5x a replay's cost, so ~10 % of the campaign's time).
SPAN_CHECK_EVERY = 16


def checks_spans(task: Task) -> bool:
    """Whether this trace also checks gpu_engine's decode spans against the spec's steps."""
    return task.engine == "gpu" and task.index % SPAN_CHECK_EVERY == 0


#: One trace in this many of a campaign against ``gpu`` also runs gpu_engine's model against the
#: reference engine (:func:`fuzz.engines.token_divergence`), on its leading requests up to
#: :data:`MODEL_CHECK_TOKENS` (~0.6 s: ~5 % of the campaign's time); the first is trace 8, early in any campaign.
MODEL_CHECK_EVERY, MODEL_CHECK_FIRST = 512, 8
MODEL_CHECK_TOKENS = 300  # prompt + max_tokens over the requests the model check runs (the tiny model on CPU)


def checks_model(task: Task) -> bool:
    """Whether this trace also checks gpu_engine's model tokens against the reference engine's."""
    return task.engine == "gpu" and task.index % MODEL_CHECK_EVERY == MODEL_CHECK_FIRST


def model_check_trace(trace: Trace) -> Trace | None:
    """The trace's leading requests (trace order) while their prompts and outputs total at most
    :data:`MODEL_CHECK_TOKENS`; None when the first alone is larger."""
    keep, total = [], 0
    for r in trace.requests:
        total += r.prompt_len + r.max_tokens
        if total > MODEL_CHECK_TOKENS:
            break
        keep.append(r)
    return dataclasses.replace(trace, requests=keep) if keep else None


#: Built-in engines: the spec's own decisions re-implemented (a stall they share with the spec is the
#: spec's modelled behaviour, e.g. vLLM's); any other engine's livelock is a finding even when shared.
BUILT_IN_ENGINES = frozenset({"spec", "gpu", "gpu-model", "reference"})
LIVELOCK_MARGIN = 400  # steps past the last event: 3 cycles of find_livelock's longest period (64), and room


def livelock_limit(trace: Trace, cycle_start: int) -> int:
    """The step limit a shrinking candidate of a livelock runs to: past its last arrival or abort
    and twice the original cycle's first step, room for :func:`fuzz.triage.find_livelock`'s longest
    cycle three times over and more (its 3,000-step default made each candidate of a leak that
    livelocks cost a second).  The shrunk trace is replayed to its own limit for the report."""
    events = [r.arrival_step or 0 for r in trace.requests] + [r.abort_at or 0 for r in trace.requests]
    return min(MAX_STEPS, max([2 * cycle_start, *events]) + LIVELOCK_MARGIN)


SHRINK_STEP_SECONDS = 2.0  # while shrinking a hang, a call this long is the hang again (not the full limit)


def task_replay(task: Task, trace: Trace, after: int | None = 0, shrinking: bool = False,
                livelocks: bool = True) -> ReplayResult:
    """:func:`fuzz.replay.replay` with a real engine's failures caught where they happen.

    The engine runs under :class:`fuzz.engines.WatchedEngine`: a call that does not return within
    ``task.step_seconds`` is interrupted inside the engine and becomes a divergence of kind ``hang``
    at that step, grouped by the place it was stuck; a call that raises keeps its traceback, and the
    divergence (kind ``error``) is grouped by the exception's type and place (two assertions are
    two bugs).  A log that ends in a no-progress cycle becomes a ``livelock`` at the cycle's first
    step (:func:`fuzz.triage.livelock_divergence`); with ``livelocks``, an engine that diverges on a
    decision is run on alone to the step limit, and a livelock it ends in is the finding (a wrong
    decision on the way to it is a note).  Raises :class:`EngineConfigError` when the
    engine refuses the configuration."""
    from fuzz.engines import WatchedEngine
    from fuzz.replay import make_engine
    from fuzz.triage import engine_run_livelock, find_livelock, livelock_divergence
    from spec.config import resolve as resolve_config

    seconds = task.step_seconds
    if seconds and shrinking:
        seconds = min(seconds, SHRINK_STEP_SECONDS)
    max_steps = resolve_config(trace.config).max_steps
    engine = WatchedEngine(make_engine(task.engine, trace), seconds)
    result = engine_failure(replay(trace, engine, task.level, after=after), engine)
    result = livelock_divergence(result, max_steps, shared=task.shared_livelocks)
    if livelocks and result.divergence is not None and result.divergence.kind == "decision":
        records = engine_alone(task, trace, seconds, max_steps)
        cycle = find_livelock(records, max_steps)
        if cycle is not None:
            result = engine_run_livelock(result, records, cycle)
    return result


def engine_alone(task: Task, trace: Trace, seconds: float | None, max_steps: int) -> list:
    """The engine's log on ``trace`` run alone up to the step limit ([] if it fails on the way)."""
    from fuzz.engines import WatchedEngine
    from fuzz.replay import SideError, Stepper, make_engine

    side, records = Stepper(WatchedEngine(make_engine(task.engine, trace), seconds), trace), []
    try:
        while (k := side.next_step()) is not None and k < max_steps:
            records.append(side.run_step())
    except SideError:
        return []
    return records


def engine_failure(result: ReplayResult, engine) -> ReplayResult:
    """An engine that raised (or hung, interrupted by the watchdog): the divergence names the place
    (``rule``: ``Type at FILE:LINE`` — for a hang, the function it was stuck in), its kind is ``hang``
    for a hang, and the full traceback is a note of the result (it goes in the report)."""
    from fuzz.diff import ERROR

    div = result.divergence
    if div is None or div.kind != ERROR or not str(div.engine_value).startswith("raised") or engine.where is None:
        return result
    file, line, function = engine.where
    if engine.hung:
        div = dataclasses.replace(div, kind="hang", field=engine.hung, rule=f"stuck in {os.path.basename(file)}:{function}")
    else:
        div = dataclasses.replace(div, rule=f"{engine.error_type} at {os.path.basename(file)}:{line}")
    notes = [*result.notes, f"engine traceback:\n{engine.traceback}"] if engine.traceback else result.notes
    return dataclasses.replace(result, divergence=div, notes=notes)


def triage_of(task: Task, result: ReplayResult) -> tuple[dict | None, str]:
    """The automatic triage of a shrunk finding and the detail its report shows (never raises:
    a triage that fails says so and the finding is kept)."""
    from fuzz.replay import raised_at
    from fuzz.triage import UNTRIAGED, classify, failure_detail

    try:
        return classify(result, task.engine), failure_detail(result)
    except Exception as e:  # noqa: BLE001
        return {"class": UNTRIAGED, "status": "candidate", "by": "auto", "why": f"automatic triage failed: {raised_at(e)}"}, ""


def watch_settings(cfg: "CampaignConfig") -> tuple[float, bool]:
    """Each task's step time limit (a quarter of the per-trace timeout: a hang is caught inside the
    engine before the worker is killed) and whether shared livelocks are findings."""
    shared = cfg.shared_livelocks if cfg.shared_livelocks is not None else cfg.engine not in BUILT_IN_ENGINES
    return cfg.timeout / 4, shared


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
    # one core per worker; parallelism comes from the pool.  torch is not imported here for an
    # engine that does not use it (an import costs seconds per worker); one imported later reads this
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    # fewer garbage collections: a replay allocates many short-lived containers (records, step
    # states) and keeps its records to the end; at the default gen-0 threshold (700) the collector
    # took 10-20% of a worker's time.  What the worker inherited (imports) is left out of the scans.
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)

    def on_detect(sig) -> bool:  # ask the pool whether an earlier trace already reports this signature
        conn.send(("diverged", sig))
        answer = conn.recv()
        if not isinstance(answer, bool):  # the pool is closing (Ctrl-C): leave quietly
            os._exit(0)
        return answer

    while True:
        try:
            task = conn.recv()
            if task is None:
                return
            outcome = run_task(task, on_detect=on_detect)
            try:
                conn.send(("done", outcome))
            except (pickle.PicklingError, TypeError, AttributeError) as e:  # an engine's record that cannot travel
                conn.send(("done", Outcome(task.index, task.seed, task.options, error=f"outcome not picklable: {e}")))
        except (EOFError, OSError):  # the parent is gone or closing: no traceback, nothing to report to
            return


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


STATE_FORMAT = "batchspec-campaign"
MAX_STATE_BYTES = 64 << 20  # a state file holds counters and one entry per finding group


class StateError(OptionError):
    """A ``--resume`` state file that cannot be used: ``FILE: FIELD: problem`` (exit 2)."""

    def __init__(self, path: os.PathLike | str, field_name: str, problem: str):
        super().__init__("--resume", f"{path}: {field_name}: {problem}")
        self.path, self.field = str(path), field_name


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
    first_finding: dict | None = None  # {"seconds", "traces", "trace"}: when the first finding was saved
    pairs: list[str] = field(default_factory=list)  # automatic rule pairs seen (fuzz.pairs.automatic_pairs)
    interactions: dict[str, int] = field(default_factory=dict)  # curated interaction -> traces that met it
    reachable_interactions: list[str] = field(default_factory=list)  # the interactions the envelope can meet
    profile: str | None = None  # the options the state belongs to (checked on --resume)
    knobs: dict[str, Any] = field(default_factory=dict)
    format: str = STATE_FORMAT
    version: int = 1

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=1))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, cfg: "CampaignConfig | None" = None) -> "CampaignState":
        """Read a saved state, refusing (:class:`StateError`, naming the field) one that is empty,
        truncated, foreign, of the wrong types, or — with ``cfg`` — from another campaign."""
        obj = _read_state(path)
        _check_state_types(path, obj, cls)
        if "format" not in obj:  # written before states named their format: profile and knobs were not kept
            obj["version"] = 0
        obj["shard"] = tuple(obj["shard"])
        state = cls(**obj)
        if cfg is not None:
            _check_state_matches(path, state, cfg)
        return state


def _read_state(path: Path) -> dict:
    """The state file's JSON object, or :class:`StateError` (empty, truncated, too big, not an object)."""
    try:
        size = os.stat(path).st_size
        if not os.path.isfile(path):
            raise StateError(path, "file", "not a regular file")
        if size > MAX_STATE_BYTES:
            raise StateError(path, "file", f"{size} bytes is over the {MAX_STATE_BYTES}-byte limit of a campaign state")
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise StateError(path, "file", f"cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise StateError(path, "file", "not UTF-8 text (not a campaign state)") from None
    if not text.strip():
        raise StateError(path, "file", "empty (a campaign state is one JSON object; delete it to start afresh)")
    try:
        obj = json.loads(text)  # NaN / Infinity are read, then refused by the field's type check
    except RecursionError:
        raise StateError(path, "file", "nested too deeply (not a campaign state)") from None
    except json.JSONDecodeError as e:
        raise StateError(path, "file", f"line {e.lineno}: not valid JSON ({e.msg}): truncated or not a campaign state") from None
    if not isinstance(obj, dict):
        raise StateError(path, "file", f"expected a JSON object, got {type(obj).__name__} (not a campaign state)")
    if obj.get("format", STATE_FORMAT) != STATE_FORMAT or not {"seed", "engine", "level"} <= set(obj):
        raise StateError(path, "format", f"not a campaign state (expected format {STATE_FORMAT!r} with seed, engine, level)")
    return obj


def _type_problem(value: Any, annotation: str) -> str | None:
    """Why ``value`` (read from JSON) does not fit the dataclass ``annotation``; None if it does.
    Integers are not booleans; numbers are finite; unknown annotation shapes are not checked."""
    ann = annotation.replace(" ", "")
    if ann.endswith("|None"):
        return None if value is None else _type_problem(value, ann[:-5])
    if ann == "int":
        return None if isinstance(value, int) and not isinstance(value, bool) else f"expected an integer, got {value!r:.60}"
    if ann == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return None if ok else f"expected a finite number, got {value!r:.60}"
    if ann == "str":
        return None if isinstance(value, str) else f"expected a string, got {value!r:.60}"
    if ann.startswith("list[") or ann == "list":
        if not isinstance(value, list):
            return f"expected a list, got {type(value).__name__} {value!r:.60}"
        inner = ann[5:-1] if ann.startswith("list[") else ""
        return next((f"item {i}: {p}" for i, v in enumerate(value) if inner and (p := _type_problem(v, inner))), None)
    if ann.startswith("dict[") or ann == "dict":
        if not isinstance(value, dict):
            return f"expected an object, got {type(value).__name__} {value!r:.60}"
        inner = ann[5:-1].split(",", 1)[1] if ann.startswith("dict[") else ""
        return next((f"{k!r}: {p}" for k, v in value.items() if inner and (p := _type_problem(v, inner))), None)
    if ann.startswith("tuple[int,int]"):
        ok = isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        return None if ok else f"expected [i, n], got {value!r:.60}"
    return None


#: The fields of one finding entry a resumed campaign relies on, and their types.
_ENTRY_FIELDS = {"signature": "list[str]", "count": "int", "first_trace": "int", "seed": "int", "options": "dict",
                 "requests": "int | None"}


def _check_state_types(path: Path, obj: dict, cls) -> None:
    """Every field known and of its declared type; counters not negative; coverage made of rule ids."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, value in obj.items():
        if name not in fields:
            raise StateError(path, name, "unknown field (not a campaign state of this version)")
        problem = _type_problem(value, str(fields[name].type))
        if problem:
            raise StateError(path, name, problem)
    for name, f in fields.items():
        if name not in obj and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise StateError(path, name, "missing")
    for name in ("next_round", "traces", "steps", "seconds", "errors", "outside_envelope"):
        if isinstance(obj.get(name), (int, float)) and obj[name] < 0:
            raise StateError(path, name, f"must be >= 0, got {obj[name]}")
    i, n = obj.get("shard", (0, 1))
    if not 0 <= i < n:
        raise StateError(path, "shard", f"must be [i, n] with 0 <= i < n, got {[i, n]}")
    known = {r.id for r in all_rules().values()}
    bad = [r for r in obj.get("covered", []) if r not in known]
    if bad:
        raise StateError(path, "covered", f"unknown rule id {bad[0]!r}")
    for slug_, entry in obj.get("findings", {}).items():
        for key, ann in _ENTRY_FIELDS.items():
            problem = "missing" if key not in entry else _type_problem(entry[key], ann)
            if problem:
                raise StateError(path, f"findings.{slug_}.{key}", problem)
        if len(entry["signature"]) != 3 or entry["count"] < 0:
            raise StateError(path, f"findings.{slug_}", "expected a signature of 3 strings and a count >= 0")


def _check_state_matches(path: Path, state: "CampaignState", cfg: "CampaignConfig") -> None:
    """A state continues only the campaign it was saved by: same seed, engine, level, shard, profile, knobs."""
    for name, mine in (("seed", cfg.seed), ("engine", cfg.engine), ("level", cfg.level), ("shard", tuple(cfg.shard)),
                       ("profile", cfg.profile), ("knobs", dict(cfg.knobs))):
        theirs = getattr(state, name)
        if name in ("profile", "knobs") and state.version < 1:
            continue
        if theirs != mine:
            raise StateError(path, name, f"the state is for {name} {theirs!r}, this campaign has {mine!r}")


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
    stop_on_finding: bool = False  # the same as max_findings=1
    max_findings: int | None = None  # stop once this many findings (groups) are saved
    profile: str | None = None  # fix this profile's knobs in every trace (fuzz.generate.random_trace(profile=)); "all": rotate
    knobs: dict[str, Any] = field(default_factory=dict)  # fixed in every trace, over the profile's and steering's
    capabilities: Any = None  # --capabilities FILE (or an Envelope / dict): overrides the engine's declaration
    shared_livelocks: bool | None = None  # a livelock the spec shares is a finding (None: for non-built-in engines)


# batchspec.cli builds a CampaignConfig from its options and calls validate_options(cfg) before any
# work; argparse checks each option's type, this checks the campaign as a whole (and API callers).
MAX_SECONDS = 30 * 24 * 3600.0  # --seconds, --timeout: a month
MAX_TRACES = 100_000_000


def max_workers() -> int:
    """Worker processes a campaign may start here: 8 per CPU, at least 64 (a typo must not fork-bomb)."""
    return max(64, 8 * (os.cpu_count() or 1))


def validate_options(cfg: CampaignConfig) -> CampaignConfig:
    """Check every option of a campaign before any work; raise :class:`spec.io.OptionError`
    (``OPTION: problem``, exit 2) on the first bad one.

    Numbers are in range and finite; the profile exists; ``--set`` knobs give valid
    configurations (the first traces of the campaign are drawn and validated by the
    spec's own config validation); the engine exists and can be constructed on the
    campaign's first trace; ``--resume`` finds a state of this very campaign.
    """
    from fuzz.replay import EngineConfigError, EngineUnavailable, make_engine
    from spec.config import ConfigError, resolve
    from spec.formats import LEVELS

    def integer(option: str, value: Any, low: int, high: int | None = None) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            bound = f"between {low} and {high}" if high is not None else f">= {low}"
            raise OptionError(option, f"must be an integer {bound}, got {value!r}")

    def seconds(option: str, value: Any) -> None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or not 0 < value <= MAX_SECONDS:
            raise OptionError(option, f"must be a finite number of seconds in (0, {MAX_SECONDS:g}], got {value!r}")

    integer("--seed", cfg.seed, -(2**63), 2**63 - 1)
    if cfg.level not in LEVELS:
        raise OptionError("--level", f"must be one of {', '.join(LEVELS)}, got {cfg.level!r}")
    if cfg.traces is not None:
        integer("--traces", cfg.traces, 1, MAX_TRACES)
    if cfg.seconds is not None:
        seconds("--seconds", cfg.seconds)
    seconds("--timeout", cfg.timeout)
    integer("--workers", cfg.workers, 1, max_workers())
    integer("--shrink-tries", cfg.shrink_tries, 0, 1_000_000)
    if cfg.max_findings is not None:
        integer("--max-findings", cfg.max_findings, 1, MAX_TRACES)
    shard = tuple(cfg.shard)
    if len(shard) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in shard) or not 0 <= shard[0] < shard[1]:
        raise OptionError("--shard", f"must be I/N with 0 <= I < N, got {cfg.shard!r}")
    if os.path.exists(cfg.corpus) and not os.path.isdir(cfg.corpus):
        raise OptionError("--corpus", f"{cfg.corpus} is not a directory")
    if cfg.profile is not None and cfg.profile != ALL_PROFILES and cfg.profile not in PROFILES:
        raise OptionError("--profile", f"unknown profile {cfg.profile!r} (known: {ALL_PROFILES}, {', '.join(sorted(PROFILES))})")
    try:
        resolve({"profile": cfg.profile if cfg.profile in PROFILES else "vllm-v1", **cfg.knobs})
    except ConfigError as e:
        fix = (f"drop {e.field} from --set" if e.field in cfg.knobs else
               f"--set {e.field} too, or pick another --profile") if e.field != "profile" else "pick a known profile"
        raise OptionError("--set", f"{e} ({fix})") from None
    try:
        envelope = campaign_envelope(cfg)
    except (ValueError, EngineUnavailable) as e:  # fuzz.capabilities.CapabilityError, an unknown engine
        raise OptionError("--engine", str(e)) from None
    first = _first_traces(cfg, envelope)
    try:
        make_engine(cfg.engine, first)
    except (EngineUnavailable, EngineConfigError) as e:
        raise OptionError("--engine", str(e)) from None
    if cfg.resume:
        path = state_path(cfg)
        if not path.exists():
            raise OptionError("--resume", f"no campaign state {path} to resume (run without --resume first)")
        CampaignState.load(path, cfg)
    return cfg


def _first_traces(cfg: CampaignConfig, envelope) -> Trace:
    """Draw the first traces of the campaign (every profile it rotates through) and validate
    their configurations; return the first one.  A ``--set`` that breaks a drawn configuration
    is refused here, not counted as a harness failure on every trace of the campaign."""
    from spec.config import resolve

    rule_ids = sorted(r.id for r in all_rules().values() if r.fires)
    targets = reachable_interactions(envelope, cfg.profile if cfg.profile != ALL_PROFILES else None, cfg.knobs)
    i, n = cfg.shard
    first = None
    for k in range(2 * (len(PROFILES) + 2)):
        options = trace_options(cfg, k, rule_ids, envelope, targets)
        option = "--set" if cfg.knobs else "--profile"
        try:
            trace = random_trace(trace_seed(cfg.seed, k * n + i), **{"max_steps": MAX_STEPS, **options})
            resolve(trace.config)
        except Exception as e:  # noqa: BLE001  (a ConfigError, or a generator tripping on a knob value)
            raise OptionError(option, f"gives an invalid configuration for trace {k} "
                                      f"(profile {options.get('profile', 'vllm-v1')}): {e}") from None
        first = first or trace
    return first


def state_path(cfg: CampaignConfig) -> Path:
    i, n = cfg.shard
    profile = f"-{cfg.profile}" if cfg.profile else ""
    knobs = "".join(f"-{k}={v}" for k, v in sorted(cfg.knobs.items()))
    return Path(cfg.corpus) / f".campaign-{cfg.engine}-{cfg.level}{profile}{knobs}-seed{cfg.seed}-shard{i}of{n}.json"


class CampaignInterrupted(KeyboardInterrupt):
    """Ctrl-C: the state was saved; ``str()`` is the one line ``batchspec fuzz`` prints."""

    def __init__(self, state: "CampaignState", path: Path):
        found = len(state.findings)
        super().__init__(f"interrupted: {state.traces} traces run, {found} finding{'s' * (found != 1)}, state saved to "
                         f"{path}; continue with the same command plus --resume")
        self.state, self.path = state, path


def first_finding_text(state: "CampaignState") -> str:
    """The summary's "first finding" cell: seconds and traces until the first finding was saved."""
    f = state.first_finding
    return "-" if not f else f"{f['seconds']:.1f} s, {f['traces']} traces"


def finding_limit(cfg: CampaignConfig) -> int | None:
    return cfg.max_findings if cfg.max_findings is not None else (1 if cfg.stop_on_finding else None)


def run_campaign(cfg: CampaignConfig, on_round: Callable[[CampaignState, list[Outcome]], None] | None = None) -> CampaignState:
    """Run rounds until the trace, time or findings budget is spent; return the final state.

    Raises :class:`StateError` when ``cfg.resume`` finds no usable state, and
    :class:`CampaignInterrupted` on Ctrl-C (after saving the state)."""
    path = state_path(cfg)
    if cfg.resume and not path.exists():
        raise StateError(path, "file", "no campaign state to resume (run the campaign without --resume first)")
    Path(cfg.corpus).mkdir(parents=True, exist_ok=True)
    state = CampaignState.load(path, cfg) if cfg.resume else CampaignState(cfg.seed, cfg.engine, cfg.level, cfg.shard,
                                                                          profile=cfg.profile, knobs=dict(cfg.knobs))
    state.format, state.version = STATE_FORMAT, 1
    rule_ids = sorted(r.id for r in all_rules().values() if r.fires)
    envelope = campaign_envelope(cfg)
    state.envelope = envelope.describe()
    profile = cfg.profile if cfg.profile != ALL_PROFILES else None
    state.reachable_interactions = reachable_interactions(envelope, profile, cfg.knobs)
    if cfg.resume:
        complete_reports(cfg, state, envelope)
    runner = _ray_runner(cfg.ray) if cfg.ray else None
    pool = None if runner else Pool(cfg.workers)
    start = time.monotonic() - state.seconds
    interrupted = False
    try:
        while not _spent(cfg, state, start):
            tasks = _round_tasks(cfg, state, rule_ids, envelope)
            for task in tasks:
                task.step_seconds, task.shared_livelocks = watch_settings(cfg)
            live = _Round(cfg, state, start)
            if runner:
                outcomes = runner(tasks, cfg.timeout)
                for o in outcomes:
                    live.on_result(o)
            else:
                outcomes = pool.run(tasks, cfg.timeout, on_result=live.on_result, stop=live.limit_reached)
            _merge(cfg, state, outcomes, live)
            state.next_round += 1
            state.seconds = time.monotonic() - start
            state.save(path)
            if on_round:
                on_round(state, outcomes)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        state.seconds = time.monotonic() - start
        state.save(path)
        if pool:
            pool.close()
    if interrupted:
        raise CampaignInterrupted(state, path)
    return state


def _spent(cfg: CampaignConfig, state: CampaignState, start: float) -> bool:
    limit = finding_limit(cfg)
    if limit is not None and len(state.findings) >= limit:
        return True
    if cfg.traces is not None and state.traces >= cfg.traces:
        return True
    return cfg.seconds is not None and time.monotonic() - start >= cfg.seconds


class _Round:
    """What the parent does while a round runs: save each new finding the moment it is shrunk
    (its report exists seconds, not a round, after the divergence), note the time to the first
    finding, and tell the pool when ``--max-findings`` is reached.  The round's merge
    (:func:`_merge`) then folds the outcomes in trace order, as before."""

    def __init__(self, cfg: CampaignConfig, state: CampaignState, start: float):
        self.cfg, self.state, self.start = cfg, state, start
        self.received = 0
        self.new: set[str] = set()  # finding groups first seen in this round
        self.saved: set[str] = set()  # ... and saved by this round already
        self.problems: dict[str, str] = {}  # group -> why its report could not be written

    def on_result(self, o: Outcome) -> None:
        from fuzz.corpus import slug

        self.received += 1
        name = _new_group(o, self.state)
        if name is None or name in self.state.findings:
            return
        self.new.add(name)
        if o.shrunk is None and o.signature[0] in ("hang", "crash") and name not in self.saved:
            self.saved.add(name)
            try:
                save_lost_finding(self.cfg, o)
            except Exception as e:  # noqa: BLE001  (the finding is counted; its files are best effort)
                from fuzz.replay import raised_at

                self.problems[name] = raised_at(e)
        if o.shrunk is not None and not o.shrunk.agreed and name not in self.saved:
            self.saved.add(name)
            problem = save_finding_safely(self.cfg, o, hits=0)  # the merge counts the hit
            if problem:
                self.problems[name] = problem
        if self.state.first_finding is None:
            self.state.first_finding = {"seconds": round(time.monotonic() - self.start, 3),
                                        "traces": self.state.traces + self.received, "trace": o.index, "finding": slug(o.signature)}

    def limit_reached(self) -> bool:
        limit = finding_limit(self.cfg)
        return limit is not None and len(self.state.findings) + len(self.new) >= limit


def _new_group(o: Outcome, state: CampaignState) -> str | None:
    """The finding group an outcome may open: a shrunk divergence's, or a hang's or a crash's;
    None for an agreement, a harness error, or a divergence counted into an earlier trace's group."""
    from fuzz.corpus import slug

    if o.signature is None:
        return None
    if o.shrunk is not None or o.raw_signature is None:
        return slug(o.signature)
    return None


def provenance_of(cfg: CampaignConfig, o: Outcome) -> str:
    small = o.shrunk.trace
    return (f"Found by `batchspec fuzz --seed {cfg.seed}` (trace {o.index}, generator seed {o.seed}, "
            f"options {o.options}); shrunk from {o.original_requests} to {len(small.requests)} requests.")


INCOMPLETE = "<!-- batchspec: incomplete report -->"


def save_finding_safely(cfg: CampaignConfig, o: Outcome, hits: int = 1) -> str | None:
    """:func:`fuzz.corpus.save_finding`, but a report writer that raises (a bug in batchspec, or an
    engine log it cannot render) does not end the campaign: whatever could be written is kept —
    the trace, the engine's log, a short report saying what is missing — and the problem is
    returned (``--resume`` writes the missing report later).  None when all was written."""
    from fuzz.replay import raised_at

    provenance = provenance_of(cfg, o)
    try:
        written = save_finding(cfg.corpus, o.shrunk, o.signature, provenance, engine=cfg.engine, hits=hits)
    except Exception as e:
        problem = raised_at(e)
    else:
        if written is not None and o.triage:
            return record_triage(cfg, o)
        return None
    _save_what_can_be(cfg, o, provenance, problem)
    return problem


def record_triage(cfg: CampaignConfig, o: Outcome) -> str | None:
    """Write a saved finding's automatic triage into its group file and report (the problem, if it cannot)."""
    from fuzz.corpus import slug
    from fuzz.replay import raised_at
    from fuzz.triage import write_triage

    try:
        write_triage(cfg.corpus, slug(o.signature), o.triage, o.detail)
    except Exception as e:  # noqa: BLE001  (the finding itself is saved)
        return f"triage not written: {raised_at(e)}"
    return None


def save_lost_finding(cfg: CampaignConfig, o: Outcome) -> None:
    """A trace whose worker was killed (past the per-trace timeout, stuck where the watchdog cannot
    interrupt it) or died: the trace, re-made from its generator seed, and a short report, so that
    the finding can be replayed; it is not shrunk (each candidate could cost the timeout again)."""
    from fuzz.corpus import record_hits, size, slug
    from fuzz.triage import ENGINE_BUG, write_triage
    from spec.io import atomic_write_lines

    name = slug(o.signature)
    path = Path(cfg.corpus) / f"{name}.jsonl"
    if path.exists():
        return
    what = "hung (no result within the timeout; killed)" if o.signature[0] == "hang" else "died (its process ended)"
    trace = random_trace(o.seed, **{"max_steps": MAX_STEPS, **o.options})
    trace = dataclasses.replace(trace, name=name, description=f"the engine {what} on this trace: {o.error}. "
                                f"Found by `batchspec fuzz --seed {cfg.seed}` (trace {o.index}, generator seed {o.seed}).")
    atomic_write_lines(path, [trace.header_json(), *(r.to_json() for r in trace.requests)])
    _write_text(Path(cfg.corpus) / f"{name}.md",
                f"# Finding `{name}`\n\nEngine `{cfg.engine}` {what}: `{o.error}`.\n{trace.description}\n\n"
                f"```bash\nbatchspec replay {path} --engine {cfg.engine} --level {cfg.level}\n```\n\n"
                f"## The trace ({len(trace.requests)} requests, not shrunk)\n\n```json\n"
                + "\n".join(json.dumps(r.to_json()) for r in trace.requests) + "\n```\n")
    record_hits(cfg.corpus, name, o.signature, 0, example_size=list(size(trace)))
    write_triage(cfg.corpus, name, {"class": ENGINE_BUG, "status": "candidate", "by": "auto",
                                    "why": f"the engine {what}", "knob": None, "source": None, "invariants": []})


def _save_what_can_be(cfg: CampaignConfig, o: Outcome, provenance: str, problem: str) -> None:
    """After a crash of the report writer: each missing file of the finding, each on its own."""
    from fuzz.corpus import log_path, record_hits, size, slug
    from spec.formats import DecisionLog
    from spec.io import atomic_write_lines, write_log

    corpus, name, result = Path(cfg.corpus), slug(o.signature), o.shrunk
    trace = dataclasses.replace(result.trace, name=name, description=f"{' / '.join(o.signature)} against engine "
                                f"{result.engine} at the {result.level} level. {provenance}")
    trace_path = corpus / f"{name}.jsonl"
    steps = [
        (lambda: trace_path.exists(), lambda: atomic_write_lines(trace_path, [trace.header_json(), *(r.to_json() for r in trace.requests)])),
        (lambda: log_path(corpus, result.engine, name).exists(),
         lambda: write_log(DecisionLog(result.engine, result.level, result.engine_records, trace=f"../{trace_path.name}",
                                       config=trace.config), log_path(corpus, result.engine, name))),
        (lambda: False, lambda: _write_text(corpus / f"{name}.md", _fallback_report(cfg, name, result, problem))),
        (lambda: False, lambda: record_hits(corpus, name, o.signature, 0, example_size=list(size(trace)))),
    ]
    for done, write in steps:
        try:
            if not done():
                write()
        except Exception:  # noqa: BLE001  (each piece is kept or not on its own)
            pass


def _fallback_report(cfg: CampaignConfig, name: str, result: ReplayResult, problem: str) -> str:
    try:
        divergence = result.divergence.describe()
    except Exception as e:  # noqa: BLE001
        divergence = f"(cannot be described: {type(e).__name__}: {e})"
    return (f"{INCOMPLETE}\n# Finding `{name}` (report incomplete)\n\n"
            f"The triage report could not be written: `{problem}`.\n"
            f"The trace and the engine's log are saved; `batchspec fuzz ... --resume` with the same options writes "
            f"the full report once the cause is fixed.\n\n"
            f"```bash\nbatchspec replay {Path(cfg.corpus) / (name + '.jsonl')} --engine {cfg.engine} --level {result.level}\n```\n\n"
            f"## The divergence\n\n```text\n{divergence}\n```\n")


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def report_problem(corpus: str | os.PathLike, name: str) -> str | None:
    """Why finding ``name``'s saved report is incomplete, or None when it is whole."""
    report = Path(corpus) / f"{name}.md"
    if not (Path(corpus) / f"{name}.jsonl").exists():
        return "the trace file is missing"
    if not report.exists():
        return "the report is missing"
    with open(report, encoding="utf-8", errors="replace") as f:
        return "the report is incomplete" if f.readline().startswith(INCOMPLETE) else None


def complete_reports(cfg: CampaignConfig, state: CampaignState, envelope=None) -> int:
    """On ``--resume``: write the reports that could not be written before (the saved trace is
    replayed again; a missing trace is re-made from its generator seed and shrunk).  Returns
    how many were completed; a report that still cannot be written stays marked."""
    from fuzz.corpus import log_path, triage_report
    from fuzz.replay import raised_at
    from spec.formats import DecisionLog
    from spec.io import load_trace, write_log

    done = 0
    for name, entry in state.findings.items():
        if entry.get("requests") is None or report_problem(cfg.corpus, name) is None:
            continue
        trace_path = Path(cfg.corpus) / f"{name}.jsonl"
        try:
            if not trace_path.exists():
                o = run_task(Task(entry["first_trace"], entry["seed"], entry["options"], cfg.engine, cfg.level,
                                  cfg.shrink_tries, envelope))
                if o.shrunk is None or o.shrunk.agreed:
                    entry["report"] = "incomplete: the trace no longer diverges"
                    continue
                problem = save_finding_safely(cfg, o, hits=0)
            else:
                trace = load_trace(trace_path)
                result = replay(trace, cfg.engine, cfg.level, after=REPORT_CONTEXT)
                if result.agreed:
                    entry["report"] = "incomplete: the saved trace no longer diverges (fixed?)"
                    continue
                write_log(DecisionLog(result.engine, result.level, result.engine_records, trace=f"../{trace_path.name}",
                                      config=trace.config), log_path(cfg.corpus, result.engine, name))
                _write_text(trace_path.with_suffix(".md"), triage_report(result, tuple(entry["signature"]), name,
                                                                          trace.description or "", engine=cfg.engine,
                                                                          trace_path=str(trace_path)))
                problem = None
        except Exception as e:  # noqa: BLE001  (the campaign goes on; the report stays marked)
            problem = raised_at(e)
        entry["report"] = f"incomplete: {problem}" if problem else "ok"
        done += problem is None
    return done


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


def trace_options(cfg: CampaignConfig, k: int, uncovered: list[str], envelope,
                  interactions: list[str] | None = None) -> dict[str, Any]:
    """Generator options for trace ``k``: steering, the envelope's knob draws, then ``--set``.
    Under a declared envelope a profile outside it is not drawn (the envelope's own draw
    instead), and steering never asks for a knob value outside it.

    ``interactions``: the interactions to steer towards (:func:`interaction_targets`); a trace
    in an interaction slot (:func:`interaction_target`) takes that interaction's options
    instead of a rule family's, and its knobs win over the envelope's rotation (which would
    otherwise draw, say, ``policy=priority`` in one trace of five) — never over ``--set``,
    a fixed profile, or the envelope itself."""
    from fuzz.generate import _KNOBS

    profile = trace_profile(cfg.profile, k)
    if profile is not None and not envelope.everything and profile not in envelope.profiles():
        profile = None
    if profile is not None and cfg.profile == ALL_PROFILES and not _profile_takes(profile, cfg.knobs):
        profile = None  # a rotated profile that --set contradicts (tgi under async): the default family instead
    fixed = set(cfg.knobs) | (set(profile_knobs(profile)) if profile else set())
    target = interaction_target(interactions or [], k)
    pinned: dict[str, Any] = {}
    if target is not None:
        options = {key: v for key, v in INTERACTION_BY_NAME[target].steer.items() if key not in fixed}
        options = {**options, "interaction": target, **({"profile": profile} if profile else {})}
        pinned = {key: v for key, v in options.items() if key in _KNOBS and (envelope.everything or envelope.allows(key, v))}
    else:
        options = steer(uncovered, k, profile)
    if envelope.everything:
        return _valid(cfg, k, envelope, fixed | set(pinned), _pin_required(cfg.knobs, {**options, **cfg.knobs}))
    options = {key: v for key, v in options.items() if key not in _KNOBS or envelope.allows(key, v)}
    # under --profile all, the family traces (k % 4 in {0, 1}) take consecutive rotation slots: coverage
    slot = (k // 4) * 2 + k % 4 if cfg.profile == ALL_PROFILES and k % 4 < 2 else k
    drawn = envelope.options(slot, cfg.seed, fixed=fixed | set(pinned))
    if profile:
        drawn["profile"] = profile
    return _valid(cfg, k, envelope, fixed | set(pinned), _pin_required(cfg.knobs, {**options, **drawn, **pinned, **cfg.knobs}))


def _valid(cfg: CampaignConfig, k: int, envelope, fixed: set[str], options: dict[str, Any]) -> dict[str, Any]:
    """``options`` as a configuration the spec's own validation accepts: a knob that steering,
    the envelope's rotation or a profile combined into a refused combination (async with swap
    or an SLO policy, ...) is re-drawn from the campaign seed and trace number
    (:func:`fuzz.capabilities.repair`), so every worker count draws the same traces."""
    from fuzz.capabilities import draws_request_features, keyed_rng, repair, spec_decode_draw

    key = f"{cfg.seed}:{k}"

    def switch(options: dict[str, Any], name: str, share: float, applies: bool = True) -> dict[str, Any]:
        """``options`` with generator switch ``name`` on for ``share`` of the traces (a hash of ``key``
        and the name: any worker count draws the same), unless given already or not applicable."""
        if name in options or not applies or keyed_rng(key, name).random() >= share:
            return options
        return {**options, name: True}

    if "request_features" not in options and draws_request_features(envelope, key):
        options = {**options, "request_features": True}  # a share of the traces, against an engine that has them
    options = switch(options, "edges", EDGE_SHARE)  # a prompt at an arrival rule's boundary (fuzz.generate._edge_prompts)
    options = switch(options, "turns", TURNS_SHARE)  # a request continues another's conversation (fuzz.generate.next_turn)
    shaped = "interaction" in options
    options = switch(options, "budget_edge", BUDGET_EDGE_SHARE, not shaped)  # a prompt filling a step's budget
    options = spec_decode_draw(envelope, key, options, fixed)
    # a context where a padded admission flips (fuzz.generate.pad_edge)
    options = switch(options, "pad_edge", PAD_EDGE_SHARE, bool(options.get("num_speculative_tokens")) and not shaped)
    options = _self_preempt_draw(envelope, key, options, fixed)
    options = _reserved_cache_draw(envelope, key, options, fixed)
    return repair(options, fixed, envelope, key=key)


#: The share of the whole-life-reservation traces drawn with prefix caching, and of the default family's
#: other traces drawn with both (:func:`_reserved_cache_draw`).
RESERVED_CACHE_SHARE, RESERVE_AND_CACHE_SHARE = 0.5, 0.08


def _reserved_cache_draw(envelope, key: str, options: dict[str, Any], fixed: set[str]) -> dict[str, Any]:
    """Prefix caching with shared prompt prefixes under a whole-life KV reservation (``kv_reservation=full``):
    for :data:`RESERVED_CACHE_SHARE` of the default family's traces that reserve so and leave caching
    free, and for :data:`RESERVE_AND_CACHE_SHARE` of those that leave both free.  TGI v3 and
    TensorRT-LLM reserve so and cache prefixes; the admission test must then count what a hit gives
    and the cached free blocks it takes against the reservation.  No profile combines the two (Orca,
    TGI, static batching and VTC turn caching off, and a rotated profile's knobs are left alone), so
    without this draw the campaign almost never does (8 of ~2,350 traces of a 60 s campaign).
    Chosen by a hash of ``key``: any worker count draws the same traces."""
    from fuzz.capabilities import keyed_rng

    cache, reserve = "enable_prefix_caching", "kv_reservation"
    if "profile" in options or cache in fixed or cache in options or not envelope.allows(cache, True):
        return options
    if options.get(reserve) == "full":
        share, extra = RESERVED_CACHE_SHARE, {}
    elif reserve not in options and reserve not in fixed and envelope.allows(reserve, "full"):
        share, extra = RESERVE_AND_CACHE_SHARE, {reserve: "full"}
    else:
        return options
    if keyed_rng(key, "reserved_cache").random() >= share:
        return options
    return {**options, **extra, cache: True, "prefix_groups": True}


def _self_preempt_draw(envelope, key: str, options: dict[str, Any], fixed: set[str]) -> dict[str, Any]:
    """vLLM 0.33's ``priority_self_preempt=continue`` for half the traces that leave it and the policy
    free or priority (chosen by a hash of ``key``: any worker count draws the same traces), where the
    envelope allows it (vLLM 0.32's does not).  The knob acts only under the priority policy, which no
    profile sets with it: the default family's priority traces are where it meets self-preemptions."""
    from fuzz.capabilities import keyed_rng

    knob = "priority_self_preempt"
    if knob in fixed or knob in options or options.get("policy", "priority") != "priority" \
            or not envelope.allows(knob, "continue"):
        return options
    if keyed_rng(key, knob).random() >= 0.5:
        return options
    return {**options, knob: "continue"}


def _profile_takes(profile: str, knobs: dict[str, Any]) -> bool:
    """Whether ``profile`` is a valid configuration with the ``--set`` knobs over it."""
    from spec.config import ConfigError, resolve

    try:
        resolve({"profile": profile, **knobs})
    except ConfigError:
        return False
    return True


def _pin_required(fixed: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """The knob values a ``--set`` knob is only specified with replace steered or drawn ones:
    under ``async_scheduling=true`` the knobs of :data:`spec.config.ASYNC_NEEDS` (vLLM V1's
    AsyncScheduler) and no SLO policy, so that steering towards, say, swap preemption does not
    make every trace of an async campaign invalid.  Knobs given with ``--set`` are never changed
    (a conflict among them is refused by :func:`validate_options`)."""
    from fuzz.capabilities import async_pins

    if not fixed.get("async_scheduling"):
        return options
    out = {**options, **async_pins(fixed)}
    if out.get("policy") == "edf" and "policy" not in fixed:  # the SLO policies are synchronous only
        out["policy"] = "fcfs"
    if out.get("preemption_victim", "policy") != "policy" and "preemption_victim" not in fixed:
        out["preemption_victim"] = "policy"
    if out.get("slo_admission", "off") != "off" and out.get("policy") != "edf" and "slo_admission" not in fixed:
        out["slo_admission"] = "off"
    return out


def _round_tasks(cfg: CampaignConfig, state: CampaignState, all_rules: list[str], envelope=None) -> list[Task]:
    from fuzz.capabilities import UNDECLARED

    envelope = envelope or UNDECLARED
    i, n = cfg.shard
    uncovered = [r for r in all_rules if r not in set(state.covered)]
    targets = interaction_targets(state.reachable_interactions, state.interactions)
    budget = ROUND if cfg.traces is None else min(ROUND, cfg.traces - state.traces)
    known = tuple(tuple(raw.split("|")) for raw in state.raw_groups)
    tasks = []
    for k in range(state.next_round * ROUND, state.next_round * ROUND + budget):
        index = k * n + i
        tasks.append(Task(index, trace_seed(cfg.seed, index), trace_options(cfg, k, uncovered, envelope, targets),
                          cfg.engine, cfg.level, cfg.shrink_tries, envelope, known))
    return tasks


def _merge(cfg: CampaignConfig, state: CampaignState, outcomes: list[Outcome], live: _Round | None = None) -> None:
    """Fold a round's outcomes into the state, in trace order (deterministic).  Divergences
    are grouped by the signature of their *shrunk* trace (one finding per bug); a raw
    signature seen before joins its group unshrunk; the corpus keeps each group's smallest
    example and its count (:func:`fuzz.corpus.save_finding`).  With ``--max-findings N`` the
    merge ends at the outcome that brings the N-th finding: what ran after it is not counted
    (the same findings for any worker count), and a finding saved early from it is removed."""
    from fuzz.corpus import record_hits, size, slug

    live = live or _Round(cfg, state, time.monotonic())
    limit = finding_limit(cfg)
    covered, pairs = set(state.covered), set(state.pairs)
    for o in outcomes:  # in trace order: deterministic
        if limit is not None and len(state.findings) >= limit:
            break
        if o.outside is not None:
            state.outside_envelope += 1
            continue
        state.traces += 1
        state.steps += o.steps
        covered.update(o.rules)
        pairs.update(o.pairs)
        for name in o.interactions:
            state.interactions[name] = state.interactions.get(name, 0) + 1
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
                problem = save_finding_safely(cfg, o) or live.problems.get(name)
                entry["report"] = f"incomplete: {problem}" if problem else "ok"
                if o.triage:
                    entry["triage"] = o.triage["class"]
                continue
        elif o.error:
            entry["error"] = o.error
        record_hits(cfg.corpus, name, tuple(entry["signature"]), 1)  # (save_finding counts the ones it saves)
    state.covered = sorted(covered)
    state.pairs = sorted(pairs)
    for name in live.saved - set(state.findings):  # saved early from an outcome the limit cut off
        _remove_finding(cfg, name)


def _remove_finding(cfg: CampaignConfig, name: str) -> None:
    from fuzz.corpus import group_path, log_path

    for path in (Path(cfg.corpus) / f"{name}.jsonl", Path(cfg.corpus) / f"{name}.md", group_path(cfg.corpus, name),
                 log_path(cfg.corpus, cfg.engine, name)):
        with contextlib.suppress(OSError):
            os.unlink(path)
