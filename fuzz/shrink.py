"""Shrinking: make a failing trace as small as possible while it still fails the same way.

"The same way" is the divergence **signature** — (kind, field, spec rule id) —
so a shrink never wanders from a victim-rule bug to an unrelated crash.

Passes, repeated until none makes progress (or the time budget runs out):

1. delta debugging over requests (ddmin: drop halves, quarters, ... then single ones);
2. each request: drop its abort, stop tokens, prescribed outputs, priority, prefix
   group; shorten its prompt and max_tokens; move its arrival earlier;
3. the configuration: fewer blocks, smaller budgets, features switched off;
4. cosmetics: requests renamed A, B, C, ..., arrivals shifted to start at step 0.

Every candidate is checked by re-running the whole differential replay, so the
result is a trace that still reproduces the finding from scratch.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator

from fuzz.diff import Divergence
from spec.config import ConfigError, resolve
from spec.formats import Trace, TraceRequest
from spec.io import FormatError, check_request

Signature = tuple[str, str, str]
Predicate = Callable[[Trace], bool]


def signature(div: Divergence) -> Signature:
    """What makes two findings the same finding: kind, field, and the spec's rule id."""
    return (div.kind, div.field, div.rule or "-")


def _with(trace: Trace, requests: list[TraceRequest] | None = None, **config) -> Trace:
    return dataclasses.replace(
        trace,
        requests=list(trace.requests if requests is None else requests),
        config={**trace.config, **config},
    )


def _valid(trace: Trace) -> bool:
    try:
        resolve(trace.config)
    except ConfigError:
        return False
    last = 0
    for r in trace.requests:
        if r.arrival_step is None or r.arrival_step < last or (r.abort_at is not None and r.abort_at < r.arrival_step):
            return False
        try:  # (what reading the shrunk trace back would refuse: min_tokens above max_tokens, ...)
            check_request(r, "<shrunk trace>", 0, trace.vocab_size)
        except FormatError:
            return False
        last = r.arrival_step
    return bool(trace.requests)


class Shrinker:
    """Greedy shrinking under a time budget; ``fails(trace)`` must be deterministic."""

    def __init__(self, fails: Predicate, seconds: float = 30.0, max_tries: int = 2000):
        self.fails = fails
        self.deadline = time.monotonic() + seconds
        self.max_tries = max_tries  # the deterministic budget; ``seconds`` is only a safety cap
        self.tries = 0

    def out_of_time(self) -> bool:
        return self.tries >= self.max_tries or time.monotonic() > self.deadline

    def accept(self, candidate: Trace) -> bool:
        if self.out_of_time() or not _valid(candidate):
            return False
        self.tries += 1
        return self.fails(candidate)

    def shrink(self, trace: Trace) -> Trace:
        progress = True
        while progress and not self.out_of_time():
            progress = False
            for step in (self.drop_requests, self.simplify_requests, self.simplify_config):
                smaller = step(trace)
                if smaller is not trace:
                    trace, progress = smaller, True
        return self.tidy(trace)

    # -- 1. requests: ddmin ------------------------------------------------

    def drop_requests(self, trace: Trace) -> Trace:
        reqs = list(trace.requests)
        chunk = max(1, len(reqs) // 2)
        while chunk >= 1 and len(reqs) > 1:
            i, removed = 0, False
            while i < len(reqs) and len(reqs) > 1:
                candidate = _with(trace, reqs[:i] + reqs[i + chunk:])
                if self.accept(candidate):
                    reqs, trace, removed = candidate.requests, candidate, True
                else:
                    i += chunk
            if not removed:
                chunk //= 2
        return trace

    # -- 2. each request -------------------------------------------------

    def simplify_requests(self, trace: Trace) -> Trace:
        """Each request in turn: the first (smallest) candidate that still fails is taken, and the
        candidates are drawn again from the request it leaves — a later candidate made from the
        request as it was would undo the reduction just accepted."""
        for i in range(len(trace.requests)):
            progress = True
            while progress and not self.out_of_time():
                progress = False
                for smaller in _smaller_requests(trace, i):
                    candidate = _with(trace, trace.requests[:i] + [smaller] + trace.requests[i + 1:])
                    if self.accept(candidate):
                        trace, progress = candidate, True
                        break
        return trace

    # -- 3. configuration ----------------------------------------------------

    def simplify_config(self, trace: Trace) -> Trace:
        """Knob by knob, smallest candidate first; after each reduction the candidates are drawn
        again from the configuration it leaves (as for requests)."""
        progress = True
        while progress and not self.out_of_time():
            progress = False
            for knob, value in _smaller_configs(resolve(trace.config)):
                candidate = _with(trace, **{knob: value})
                if self.accept(candidate):
                    trace, progress = candidate, True
                    break
        return trace

    # -- 4. cosmetics ----------------------------------------------------------

    def tidy(self, trace: Trace) -> Trace:
        """Arrivals from step 0 and ids A, B, C ...; each kept only if the trace still fails
        (synthesized tokens depend on the id, so a rename can change the run)."""
        first = trace.requests[0].arrival_step or 0
        shifted = [dataclasses.replace(r, arrival_step=r.arrival_step - first,
                                       abort_at=None if r.abort_at is None else r.abort_at - first)
                   for r in trace.requests]
        names = [chr(ord("A") + i) if i < 26 else f"R{i}" for i in range(len(trace.requests))]
        for requests in (shifted, None):
            requests = requests or [dataclasses.replace(r, id=n) for r, n in zip(trace.requests, names)]
            candidate = _with(trace, requests)
            if self.accept(candidate):
                trace = candidate
        return trace


def _smaller_requests(trace: Trace, i: int) -> Iterator[TraceRequest]:
    r = trace.requests[i]
    rep = dataclasses.replace
    if r.abort_at is not None:
        yield rep(r, abort_at=None)
    if r.stop_token_ids:
        yield rep(r, stop_token_ids=())
    if r.output_tokens:
        yield rep(r, output_tokens=())
    if r.ignore_eos:
        yield rep(r, ignore_eos=False)
    if r.priority:
        yield rep(r, priority=0)
    if r.prefix_group is not None and r.prompt is None:
        yield rep(r, prefix_group=None, prefix_len=0)
    prev = trace.requests[i - 1].arrival_step if i else 0
    if r.arrival_step > prev:
        yield rep(r, arrival_step=prev, abort_at=r.abort_at)
        yield rep(r, arrival_step=r.arrival_step - 1)
    if r.min_tokens:
        yield rep(r, min_tokens=0)
    for n in _toward(r.max_tokens, 1):  # (min_tokens at most max_tokens, as a trace file must have it)
        yield rep(r, max_tokens=n, output_tokens=r.output_tokens[:n], min_tokens=min(r.min_tokens, n))
    if r.prompt is None:
        for n in _toward(r.prompt_len, 1):
            yield rep(r, prompt_len=n, prefix_len=min(r.prefix_len, n))
    elif len(r.prompt) > 1:
        for n in _toward(len(r.prompt), 1):
            yield rep(r, prompt=r.prompt[:n], prompt_len=n)


def _toward(value: int, floor: int) -> Iterator[int]:
    """Candidates from small to large: floor, then halving steps, then value - 1."""
    seen = set()
    for n in (floor, value // 4, value // 2, value - 1):
        if floor <= n < value and n not in seen:
            seen.add(n)
            yield n


def _smaller_configs(cfg) -> Iterator[tuple[str, object]]:
    if cfg.long_prefill_token_threshold:
        yield "long_prefill_token_threshold", 0
    if cfg.watermark:
        yield "watermark", 0.0
    if cfg.enable_prefix_caching:
        yield "enable_prefix_caching", False
    if cfg.policy != "fcfs":
        yield "policy", "fcfs"
    for n in _toward(cfg.num_blocks, 2):
        yield "num_blocks", n
    for n in _toward(cfg.max_num_seqs, 1):
        yield "max_num_seqs", n
    for n in _toward(cfg.max_num_batched_tokens, 1):
        yield "max_num_batched_tokens", n
    for n in _toward(cfg.max_model_len, 2):
        yield "max_model_len", n


def shrink(trace: Trace, fails: Predicate, seconds: float = 30.0, max_tries: int = 2000) -> tuple[Trace, int]:
    """Shrink ``trace`` while ``fails`` holds; return the result and the number of replays tried."""
    s = Shrinker(fails, seconds, max_tries)
    return s.shrink(trace), s.tries
