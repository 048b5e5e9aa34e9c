"""Seeded random traces for differential fuzzing (DESIGN.md §3, issue #3).

``random_trace(seed)`` builds a small trace — 2 to 12 requests, prompts of 1 to
80 tokens — whose configuration is drawn so that the interesting scheduler
paths are taken often: a token budget small enough to chunk prefills, a KV
pool tight enough to preempt, shared prompt prefixes for the prefix cache,
both queue policies, priorities, aborts, stop tokens, EOS, ``max_model_len``
caps and, now and then, a request that must be rejected at arrival.

Every draw comes from one ``random.Random(seed)``: the same seed gives the
same trace in every process and on every machine (no global random state, no
hash randomization, no clock).

The configurations also respect what vLLM's own config validation insists on
(``SchedulerConfig.verify_max_model_len`` in vLLM 0.32), so that every trace
is one vLLM accepts:

* chunked prefill off ⇒ ``max_num_batched_tokens >= max_model_len``;
* ``max_num_batched_tokens >= max_num_seqs``;
* ``long_prefill_token_threshold <= max_model_len``.

:func:`trace_features` tags a trace (and, given its decision log, what the run
actually exercised) with the feature areas of :data:`FEATURES`, for the
conformance summary table.
"""
from __future__ import annotations

import random
from dataclasses import fields, replace
from typing import Any, Iterable

from spec.config import PROFILES, VLLM_V1, SchedulerConfig, resolve
from spec.formats import DEFAULT_EOS_TOKEN_ID, DEFAULT_VOCAB_SIZE, FIRST_SYNTHETIC_TOKEN, StepRecord, Trace, TraceRequest

#: Feature areas of the conformance table, with what puts a trace in each.
FEATURES: dict[str, str] = {
    "chunked_prefill": "a prompt longer than the token budget or the long-prefill cap (split over steps)",
    "no_chunking": "enable_chunked_prefill off",
    "long_prefill_cap": "long_prefill_token_threshold > 0",
    "max_num_seqs": "max_num_seqs smaller than the number of requests",
    "tight_memory": "fewer usable KV blocks than all requests together need at their peak",
    "preemption": "the run preempted at least one request (recompute)",
    "prefix_caching": "enable_prefix_caching on",
    "prefix_hits": "the run admitted a request with a prefix-cache hit",
    "eviction": "the run evicted a cached block",
    "fcfs": "policy fcfs",
    "priority": "policy priority",
    "aborts": "a request with abort_at",
    "stop_tokens": "a request that can stop on a stop token id",
    "eos": "a request whose output contains the EOS token",
    "ignore_eos": "a request with ignore_eos whose output contains EOS",
    "max_model_len": "a request that hits max_model_len",
    "rejections": "a request rejected at arrival (prompt_too_long / never_fits)",
    "watermark": "watermark > 0",
    "reserve_first_chunk": "scheduler_reserve_full_isl off",
    "stress": "an extreme corner: a 4-12 token vocabulary (accidental prefix hits and stop tokens), block size 1-5, "
              "a 1-3 token budget, 13-32 requests, max_model_len 2-12, or a watermark of 0.3-0.7",
}

#: Feature areas of the request features vLLM's scheduler sees (issue 15 item 3), drawn only
#: with the switch ``request_features=True`` (engines that ignore the fields would diverge).
REQUEST_FEATURES = {
    "skip_prefix_cache": "a request that never reads the prefix cache (vLLM: prompt_logprobs)",
    "cache_salt": "a request with a cache_salt",
    "min_tokens": "a request with min_tokens > 0",
    "client_arrival_time": "policy priority and a request with client_arrival_time (vLLM's arrival_time: priority ties)",
    "max_num_active_seqs": "max_num_active_seqs below max_num_seqs and the number of requests",
    "adaptive_long_prefill": "long_prefill_token_threshold_adaptive with a long-prefill cap",
}

#: Feature areas of speculative decoding (issue 15 item 2), drawn when num_speculative_tokens > 0
#: is given (engines declare it in their capability envelope).
SPEC_FEATURES = {
    "spec_decode": "num_speculative_tokens > 0 (scripted acceptance: spec_accept or spec_accept_rate)",
    "async_spec_decode": "num_speculative_tokens > 0 with async_scheduling",
    "spec_rollback": "the run rolled back rejected drafts",
    "spec_padded_admission": "the run padded an admission with dummy drafts (SPEC.PAD_ADMISSION)",
}

BLOCK_SIZES = (4, 8, 16)
MAX_PROMPT = 80
_KNOBS = {f.name for f in fields(SchedulerConfig)} - {"profile"}
#: Generator switches accepted by :func:`random_trace` besides the knobs.
SWITCHES = ("n_requests", "aborts", "stop_tokens", "eos", "prefix_groups", "rejections", "tight_memory", "clones", "stress",
            "tenants", "slo", "request_features", "interaction", "ignore_eos", "edges", "budget_edge", "pad_edge",
            "turns")
#: Extreme corners a ``stress`` trace takes one to three of.
STRESS = ("vocab", "block", "budget", "many", "short", "watermark")


def _peak_slots(prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    """KV slots a request needs at its longest (the last sampled token is never computed)."""
    return min(prompt_len + max_tokens - 1, max_model_len - 1)


def _blocks(slots: int, block_size: int) -> int:
    return -(-slots // block_size)


def _draw_config(rng: random.Random, n: int) -> dict[str, Any]:
    """The header's knobs, before memory is sized to the drawn requests."""
    cfg: dict[str, Any] = {"profile": "vllm-v1"}
    cfg["block_size"] = rng.choice(BLOCK_SIZES)
    cfg["enable_prefix_caching"] = rng.random() < 0.6
    cfg["policy"] = "priority" if rng.random() < 0.4 else "fcfs"
    cfg["enable_chunked_prefill"] = rng.random() < 0.85
    tight_len = rng.random() < 0.25
    cfg["max_model_len"] = rng.randint(24, 96) if tight_len else rng.choice((128, 256, 4096))
    if cfg["enable_chunked_prefill"]:
        cfg["max_num_batched_tokens"] = rng.choice((4, 8, 12, 16, 24, 32, 48, 64, 128, 2048))
    else:  # vLLM: without chunking the budget must hold a whole max_model_len sequence
        cfg["max_num_batched_tokens"] = cfg["max_model_len"] + rng.choice((0, 0, 16, 200))
    if rng.random() < 0.3:
        cfg["max_num_seqs"] = rng.randint(1, max(1, n - 1))
    else:
        cfg["max_num_seqs"] = rng.choice((16, 128))
    cfg["max_num_seqs"] = min(cfg["max_num_seqs"], cfg["max_num_batched_tokens"])
    if rng.random() < 0.3:
        cfg["long_prefill_token_threshold"] = min(rng.randint(1, 40), cfg["max_model_len"])
    if rng.random() < 0.15:
        cfg["watermark"] = rng.choice((0.01, 0.05, 0.1, 0.2))
    if rng.random() < 0.15:
        cfg["scheduler_reserve_full_isl"] = False
    cfg["max_steps"] = 20_000
    return cfg


def _stress_config(rng: random.Random, cfg: dict[str, Any], stress: set[str]) -> None:
    """Push the drawn knobs to the extreme corners named in ``stress`` (keeping vLLM's constraints)."""
    if "block" in stress:
        cfg["block_size"] = rng.choice((1, 2, 3, 5))
    if "short" in stress:
        cfg["max_model_len"] = rng.randint(2, 12)
        if "long_prefill_token_threshold" in cfg:
            cfg["long_prefill_token_threshold"] = min(cfg["long_prefill_token_threshold"], cfg["max_model_len"])
    if "budget" in stress and cfg["enable_chunked_prefill"]:
        cfg["max_num_batched_tokens"] = rng.randint(1, 3)
        cfg["max_num_seqs"] = min(cfg["max_num_seqs"], cfg["max_num_batched_tokens"])
    if "watermark" in stress:
        cfg["watermark"] = rng.choice((0.3, 0.5, 0.7))


def _respect_vllm_limits(cfg: dict[str, Any], fixed: set[str]) -> None:
    """Re-establish vLLM's config constraints after knobs were fixed by the caller,
    adjusting only the knobs the caller left to the generator."""
    if not cfg.get("enable_chunked_prefill", True) and cfg["max_num_batched_tokens"] < cfg["max_model_len"]:
        if "max_num_batched_tokens" not in fixed:
            cfg["max_num_batched_tokens"] = cfg["max_model_len"]
        elif "max_model_len" not in fixed:
            cfg["max_model_len"] = cfg["max_num_batched_tokens"]
    if cfg.get("max_num_seqs", 128) > cfg["max_num_batched_tokens"]:
        if "max_num_seqs" not in fixed:
            cfg["max_num_seqs"] = cfg["max_num_batched_tokens"]
        elif "max_num_batched_tokens" not in fixed:
            cfg["max_num_batched_tokens"] = cfg["max_num_seqs"]
    if cfg.get("long_prefill_token_threshold", 0) > cfg["max_model_len"] and "long_prefill_token_threshold" not in fixed:
        cfg["long_prefill_token_threshold"] = cfg["max_model_len"]
    k = cfg.get("num_speculative_tokens", 0)
    if k and cfg["max_num_batched_tokens"] < 1 + k and "max_num_batched_tokens" not in fixed:
        cfg["max_num_batched_tokens"] = 1 + k  # a padded decode (SPEC.PAD_ADMISSION) must fit the budget
    if k and 0 < cfg.get("long_prefill_token_threshold", 0) < 1 + k and "long_prefill_token_threshold" not in fixed:
        # below 1 + K vLLM asserts on a padded admission; above max_model_len it refuses the config
        cfg["long_prefill_token_threshold"] = 1 + k if 1 + k <= cfg["max_model_len"] else 0
    if cfg.get("max_num_active_seqs", 0) > cfg["max_num_seqs"]:  # vLLM refuses more active than max_num_seqs
        if "max_num_seqs" not in fixed:
            cfg["max_num_seqs"] = min(cfg["max_num_active_seqs"], cfg["max_num_batched_tokens"])
        cfg["max_num_active_seqs"] = min(cfg["max_num_active_seqs"], cfg["max_num_seqs"])


#: Pool sizes the generator always draws (sized to the trace, tight on purpose), even for a profile.
SIZES = ("num_blocks", "num_cpu_blocks")
#: Knobs a profile leaves to the generator unless it sets them apart from ``vllm-v1``
#: (shapes and limits of the workload, and the tenants' VTC weights and prices).
DRAWN = ("block_size", "max_model_len", "max_num_batched_tokens", "max_num_seqs", "max_steps", "tenant_weights",
         "vtc_input_price", "vtc_output_price")


def profile_knobs(profile: str) -> dict[str, Any]:
    """The knobs a trace drawn for ``profile`` fixes at the profile's values: every
    semantic knob (queue policy, batching, reservation, admission, preemption,
    chunking, prefix caching, caps, watermark, ...), and the :data:`DRAWN` ones the
    profile sets *tighter* than ``vllm-v1`` (``max_num_seqs=1`` for ``naive``: one request
    at a time; ``block_size=1`` for ``sglang``: a token-granular cache) or to another
    non-numeric value.  A larger size (nano-vllm's 256-token blocks, 16,384-token budget and
    512 sequences; a 4,096-token budget) is a deployment default that traces of 2-12 short
    requests never reach: it is drawn in the default family's pressured ranges, so a
    profile's campaign still chunks, preempts and hits the prefix cache.  Pool sizes
    (:data:`SIZES`) are always drawn."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r} (known: {', '.join(sorted(PROFILES))})")
    cfg, base = PROFILES[profile].config, VLLM_V1.config
    return {f.name: getattr(cfg, f.name) for f in fields(SchedulerConfig)
            if f.name != "profile" and f.name not in SIZES
            and (f.name not in DRAWN or _tighter(getattr(cfg, f.name), getattr(base, f.name)))}


def _tighter(value: Any, default: Any) -> bool:
    """Whether a profile's workload size is part of what it stands for: below vllm-v1's
    (a numeric limit), or a different non-numeric value (tenant weights)."""
    if isinstance(value, (int, float)) and isinstance(default, (int, float)):
        return value < default
    return value != default


def _draw_prompts(rng: random.Random, n: int, want_groups: bool) -> list[dict[str, Any]]:
    """Prompt lengths and shared-prefix groups for ``n`` requests."""
    groups: list[tuple[str, int]] = []
    if want_groups:
        for g in range(rng.randint(1, 3)):
            groups.append((f"g{g}", rng.randint(1, 64)))
    out = []
    for _ in range(n):
        p: dict[str, Any] = {"prompt_len": rng.randint(1, MAX_PROMPT)}
        if groups and rng.random() < 0.6:
            name, plen = rng.choice(groups)
            p["prefix_group"] = name
            roll = rng.random()
            if roll < 0.2:  # the whole prompt is the shared prefix: a full-prompt hit candidate
                p["prompt_len"] = plen
            elif roll < 0.7:
                p["prompt_len"] = min(MAX_PROMPT, plen + rng.randint(0, 24))
            p["prefix_len"] = min(plen, p["prompt_len"])
        out.append(p)
    return out


def _draw_outputs(rng: random.Random, rid: str, max_tokens: int, eos: int, stops: tuple[int, ...],
                  want_eos: bool, vocab: int) -> tuple[int, ...]:
    """Output tokens that end the request early: EOS or a stop token at a random index."""
    choices = []
    if want_eos:
        choices.append(eos)
    if stops:
        choices.extend(stops)
    if not choices or max_tokens < 1 or rng.random() < 0.5 or vocab - FIRST_SYNTHETIC_TOKEN <= len(stops):
        return ()
    at = rng.randint(0, max(0, max_tokens - 1))
    head = []
    for _ in range(at):  # filler that is neither EOS nor one of this request's stop ids
        t = rng.randrange(FIRST_SYNTHETIC_TOKEN, vocab)
        while t in stops:
            t = rng.randrange(FIRST_SYNTHETIC_TOKEN, vocab)
        head.append(t)
    return tuple(head) + (rng.choice(choices),)


def _clone(rng: random.Random, requests: list[TraceRequest], vocab: int) -> None:
    """Make a later request repeat an earlier one's prompt *and* output tokens, so that
    after a preemption one can hit blocks the other filled with generated tokens."""
    if len(requests) < 2:
        return
    i = rng.randrange(1, len(requests))
    j = rng.randrange(0, i)
    base = requests[j]
    outs = list(base.output_tokens)
    while len(outs) < max(base.max_tokens, requests[i].max_tokens):
        outs.append(rng.randrange(FIRST_SYNTHETIC_TOKEN, vocab))
    requests[j] = replace(base, output_tokens=tuple(outs[: base.max_tokens]))
    prompt = tuple(base.prompt_token_ids(vocab))
    requests[i] = replace(requests[i], prompt=prompt, prompt_len=len(prompt), prefix_group=None, prefix_len=0,
                          output_tokens=tuple(outs[: requests[i].max_tokens]))


def next_turn(trace: Trace, rng: random.Random) -> Trace:
    """A multi-turn conversation: a request that arrives after an earlier one finished (in the
    spec's run, decisions only) gets as its prompt that request's prompt, the response it sampled
    and a few new tokens, with its cache salt — a chat client's next turn.  Its prefix hit then
    reaches blocks the earlier request filled with *generated* tokens (hashes chained through
    outputs, salted from the first block), which independent prompts never share.  The trace is
    unchanged when no request arrives after another finished, or the new prompt would not fit the
    context or the pool."""
    from fuzz.pairs import spec_run

    config = resolve(trace.config)
    # request -> (step it finished, steps it sampled in): its response's length, or under speculative
    # decoding (several tokens a step) the length of a prefix of it, which a next turn may quote as well
    done: dict[str, tuple[int, int]] = {}
    sampled: dict[str, int] = {}
    for rec in spec_run(trace, decisions_only=True):
        for rid in rec.sampled:
            sampled[rid] = sampled.get(rid, 0) + 1
        for rid, _ in rec.finished:
            done[rid] = (rec.step, sampled.get(rid, 0))
    pairs = [(x, y) for x in trace.requests if x.id in done for y in trace.requests
             if y.arrival_step is not None and y.arrival_step > done[x.id][0]]
    if not pairs:
        return trace
    long = [(x, y) for x, y in pairs if done[x.id][1] >= config.block_size]  # (a response that fills a block)
    x, y = rng.choice(long or pairs)
    response = [x.output_token(k, trace.vocab_size, trace.eos_token_id) for k in range(done[x.id][1])]
    turn = [rng.randrange(FIRST_SYNTHETIC_TOKEN, trace.vocab_size) for _ in range(rng.randint(1, 8))]
    prompt = (*x.prompt_token_ids(trace.vocab_size), *response, *turn)
    peak = _blocks(_peak_slots(len(prompt), y.max_tokens, config.max_model_len), config.block_size)
    if len(prompt) >= config.max_model_len or peak > config.usable_blocks:
        return trace
    turned = replace(y, prompt=prompt, prompt_len=len(prompt), prefix_group=None, prefix_len=0, cache_salt=x.cache_salt)
    return replace(trace, requests=[turned if r.id == y.id else r for r in trace.requests])


def _draw_tenants(rng: random.Random, cfg: dict[str, Any], requests: list[TraceRequest], options: dict[str, Any]) -> None:
    """Tenants (and, unless fixed, VTC weights and prices) for a fair-share trace.

    Drawn from their own generator (seeded from the trace seed), so that traces
    without tenants keep exactly the draws they always had."""
    k = options.get("tenants") or rng.choice((1, 2, 2, 3, 4))
    names = [f"t{i}" for i in range(k)]
    skew = [rng.choice((1, 1, 2, 4)) for _ in names]  # some tenants send more
    for i, r in enumerate(requests):
        requests[i] = replace(r, tenant=rng.choices(names, skew)[0])
    if cfg["policy"] != "vtc":
        return
    if "tenant_weights" not in options and rng.random() < 0.5:
        cfg["tenant_weights"] = ",".join(f"{t}={rng.choice((0.5, 1, 2, 3))}" for t in names if rng.random() < 0.7)
    if "vtc_input_price" not in options and rng.random() < 0.3:
        cfg["vtc_input_price"] = rng.choice((0.5, 1.0, 2.0))
    if "vtc_output_price" not in options and rng.random() < 0.3:
        cfg["vtc_output_price"] = rng.choice((1.0, 3.0, 4.0))


def _size_memory(rng: random.Random, cfg: dict[str, Any], peaks: list[int], tight: bool, reject: bool) -> int:
    """``num_blocks`` (null block included): tight enough to preempt when ``tight``,
    too small for the largest request when ``reject``."""
    bs = cfg["block_size"]
    need = [_blocks(p, bs) for p in peaks]
    largest, total = max(need), sum(need)
    if reject and largest > 1:
        usable = rng.randint(max(1, largest // 2), largest - 1)
    elif tight:
        usable = rng.randint(largest, max(largest, min(total, largest + largest // 3 + 1)))
    else:
        usable = total + rng.randint(0, 8)
    return usable + 1


def random_trace(seed: int, **options: Any) -> Trace:
    """A deterministic random trace for ``seed``.

    ``options`` may fix any knob of :class:`spec.config.SchedulerConfig`
    (``policy="priority"``, ``enable_prefix_caching=True`` …) or one of the
    generator switches :data:`SWITCHES`: ``n_requests`` (int), and
    ``aborts``, ``stop_tokens``, ``eos``, ``prefix_groups``, ``rejections``,
    ``tight_memory``, ``clones``, ``stress`` (bool: force the feature on or off),
    ``ignore_eos`` (bool: half the requests ignore EOS, not one in ten),
    ``tenants`` (int: that many tenants; drawn anyway under ``policy="vtc"``), ``edges`` (bool: a
    prompt at an arrival rule's boundary, :func:`_edge_prompts`), ``budget_edge`` (bool: a prompt
    that fills a step's token budget exactly or by one token more, :func:`budget_edge`), ``pad_edge`` (bool:
    a context length at which a padded speculative admission flips, :func:`pad_edge`), ``turns`` (bool: a
    later request continues an earlier one's conversation, :func:`next_turn`), ``interaction``
    (str: a curated interaction of :data:`fuzz.pairs.INTERACTIONS`; the drawn trace is then
    reworked towards it by :func:`fuzz.pairs.shape_trace`, e.g. an abort timed into a swap-out).
    A ``stress`` trace also takes one to three of the extreme corners :data:`STRESS`.

    ``profile`` (a name in :data:`spec.config.PROFILES`) draws the trace as usual,
    then names that profile in the header and fixes its knobs (:func:`profile_knobs`):
    sizes stay drawn, semantics are the profile's.  Knobs given in ``options`` still
    win, and vLLM's constraints are re-established on the knobs left to the
    generator.  Without ``profile`` the draws are unchanged.
    """
    profile = options.pop("profile", None)
    if profile is not None:
        options = {**profile_knobs(profile), **options}
    unknown = set(options) - _KNOBS - set(SWITCHES)
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; knobs or switches {SWITCHES}")
    rng = random.Random(seed)
    vocab, eos = DEFAULT_VOCAB_SIZE, DEFAULT_EOS_TOKEN_ID
    n = options.get("n_requests") or rng.randint(2, 12)

    def switch(name: str, p: float) -> bool:
        drawn = rng.random() < p  # always draw, so forcing one switch keeps the rest of the trace
        return bool(options[name]) if name in options else drawn

    want_aborts = switch("aborts", 0.3)
    want_stops = switch("stop_tokens", 0.3)
    want_eos = switch("eos", 0.3)
    want_groups = switch("prefix_groups", 0.5)
    want_reject = switch("rejections", 0.08)
    tight = switch("tight_memory", 0.7)
    want_clones = switch("clones", 0.15)
    stress = set(rng.sample(STRESS, rng.randint(1, 3))) if switch("stress", 0.12) else set()
    if "many" in stress and not options.get("n_requests"):
        n = rng.randint(13, 32)
    if "vocab" in stress:
        vocab = rng.randint(4, 12)

    cfg = _draw_config(rng, n)
    _stress_config(rng, cfg, stress)
    if profile is not None:
        cfg["profile"] = profile
    cfg.update({k: v for k, v in options.items() if k in _KNOBS})
    _respect_vllm_limits(cfg, fixed=set(options))
    prompts = _draw_prompts(rng, n, want_groups)
    for p in prompts:  # a tight max_model_len: most prompts still fit, rejections are drawn below
        if p["prompt_len"] >= cfg["max_model_len"]:
            p["prompt_len"] = rng.randint(1, cfg["max_model_len"] - 1)
            p["prefix_len"] = min(p.get("prefix_len", 0), p["prompt_len"])
    n_stops = 1 if vocab - FIRST_SYNTHETIC_TOKEN < 4 else rng.randint(1, 2)  # a tiny vocabulary keeps a non-stop token
    stops = tuple(sorted({rng.randrange(FIRST_SYNTHETIC_TOKEN, vocab) for _ in range(n_stops)})) if want_stops else ()

    requests: list[TraceRequest] = []
    step = 0
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        step += rng.choice((0, 0, 0, 1, 1, 2, 3, 6))
        long_out = rng.randint(8, 40) if tight else rng.randint(1, 40)
        max_tokens = rng.choice((1, 2, rng.randint(1, 12), long_out, long_out))
        if want_reject and rng.random() < 0.15:  # prompt_too_long: no room for one output token
            p = {"prompt_len": cfg["max_model_len"] + rng.randint(0, 4)} if cfg["max_model_len"] <= MAX_PROMPT + 4 else p
        my_stops = stops if stops and rng.random() < 0.7 else ()
        ignore_eos = rng.random() < (0.5 if options.get("ignore_eos") else 0.1)  # (one draw either way)
        out = _draw_outputs(rng, rid, max_tokens, eos, my_stops, want_eos, vocab)
        abort_at = step + rng.randint(0, 25) if want_aborts and rng.random() < 0.3 else None
        priority = rng.randint(0, 3) if rng.random() < 0.7 else 0
        requests.append(TraceRequest(
            id=rid, arrival_step=step, max_tokens=max_tokens, priority=priority,
            ignore_eos=ignore_eos, stop_token_ids=my_stops, abort_at=abort_at, output_tokens=out, **p,
        ))
    if want_clones:
        _clone(rng, requests, vocab)
    if cfg["policy"] == "vtc" or options.get("tenants"):
        _draw_tenants(random.Random(f"tenants:{seed}"), cfg, requests, options)
    if options.get("slo", _uses_slo(cfg)):
        requests = _draw_slo(random.Random(f"slo:{seed}"), requests)
    if cfg.get("num_speculative_tokens"):
        requests = _draw_spec_accept(random.Random(f"spec:{seed}"), requests, cfg["num_speculative_tokens"])
    if options.get("request_features"):
        feature_rng = random.Random(f"features:{seed}")
        requests = _draw_request_features(feature_rng, requests)
        _draw_feature_knobs(feature_rng, cfg, options)
    if "num_blocks" not in options:
        peaks = [_peak_slots(r.prompt_len, r.max_tokens, cfg["max_model_len"]) for r in requests
                 if r.prompt_len < cfg["max_model_len"]] or [1]
        cfg["num_blocks"] = _size_memory(rng, cfg, peaks, tight, want_reject)
    if cfg.get("preemption_mode") == "swap" and "num_cpu_blocks" not in options:
        swap_rng = random.Random(f"swap:{seed}")  # its own generator: other traces keep their draws
        cfg["num_cpu_blocks"] = swap_rng.choice((0, 1, 2, 4, 8, swap_rng.randint(0, cfg["num_blocks"]), 256))
    if options.get("edges"):  # (its own generator: the rest of the trace keeps its draws)
        requests = _edge_prompts(random.Random(f"edges:{seed}"), cfg, requests)
    if cfg.get("admission") == "estimate" and "clip_max_new_tokens" not in options:
        # SGLang's CLIP_MAX_NEW_TOKENS (4096) never binds on outputs of 1-40 tokens: half the estimate
        # traces clip the remaining-output estimate (ESTIMATE.REMAINING) for real; own generator (the
        # rest of the trace keeps its draws)
        clip_rng = random.Random(f"clip:{seed}")
        if clip_rng.random() < 0.5:
            cfg["clip_max_new_tokens"] = clip_rng.choice((2, 4, 8, 16))
    if profile is not None:  # the header names the profile and only the knobs that differ from it
        base = PROFILES[profile].config
        cfg = {k: v for k, v in cfg.items() if k == "profile" or k in SIZES or v != getattr(base, k)}
    trace = Trace(config=cfg, requests=requests, vocab_size=vocab, eos_token_id=eos,
                  name=f"random-{seed}", description=f"fuzz.generate.random_trace({seed})")
    if options.get("budget_edge"):
        trace = budget_edge(trace, random.Random(f"budget-edge:{seed}"))
    if options.get("turns"):
        trace = next_turn(trace, random.Random(f"turns:{seed}"))
    if options.get("pad_edge"):
        trace = pad_edge(trace, random.Random(f"pad-edge:{seed}"))
    if options.get("interaction"):  # steering towards two mechanisms at once (issue 18 item 2)
        from fuzz.pairs import shape_trace

        trace = shape_trace(trace, options["interaction"], seed)
    return trace


#: The share of a campaign's traces with a prompt moved to an arrival rule's boundary
#: (:func:`_edge_prompts`; plain ``random_trace(seed)`` never moves one: conformance runs keep their traces).
EDGE_SHARE = 0.25
#: The share of a campaign's traces (not shaped towards an interaction) with a prompt grown to fill
#: a step's token budget (:func:`budget_edge`: one more spec run per such trace).
BUDGET_EDGE_SHARE = 0.3
EDGE_MAX_PROMPT = 300  # (a longer prompt is a slow trace: thousands of chunked-prefill steps)


def _edge_prompts(rng: random.Random, cfg: dict[str, Any], requests: list[TraceRequest]) -> list[TraceRequest]:
    """One request's prompt moved to a length where an arrival rule flips, at it or one below: the
    longest prompt the context takes (``max_model_len - 1``) and the first it refuses; under
    ``length_limits=clip`` SGLang's input limits ``min(max_model_len, pool) - 6``; a peak
    (``prompt + max_tokens - 1``) that fills the pool exactly or overflows it by one slot.
    Off-by-one bugs live at these lengths, which uniform draws hit rarely (REJECT.*,
    ARRIVE.CLIP_MAX_TOKENS); lengths over :data:`EDGE_MAX_PROMPT` are left out.  (Two arrivals of
    one step that fill the token budget exactly were tried too: they barely moved the budget's
    off-by-ones, whose traces have decodes running beside them.)"""
    from spec.scheduler import INPUT_LIMIT_MARGIN, length_capacity

    try:
        config = resolve(cfg)
    except (ValueError, TypeError):
        return requests
    i = rng.randrange(len(requests))
    r = requests[i]
    pool, bs = config.usable_blocks * config.block_size, config.block_size
    if config.length_limits == "clip":  # (the clip's input limits replace the context's and the pool's refusals)
        limits = [config.max_model_len - INPUT_LIMIT_MARGIN, length_capacity(config) - INPUT_LIMIT_MARGIN]
    else:
        limits = [config.max_model_len, pool - r.max_tokens + 2]
        if config.admission == "estimate":  # REJECT.NEVER_FITS's empty-engine estimate: prompt + max_tokens + B
            limits.append(pool - r.max_tokens - bs + 1)
    limits = sorted({n for n in limits if 2 <= n <= EDGE_MAX_PROMPT})
    if not limits or r.prompt is not None:
        return requests
    out = list(requests)
    n = rng.choice(limits) - rng.randint(0, 1)
    out[i] = replace(r, prompt_len=n, prefix_len=min(r.prefix_len, n))
    return out


def budget_edge(trace: Trace, rng: random.Random) -> Trace:
    """A step whose token budget an admission fills exactly, or overflows by one token.

    The spec runs ``trace`` (decisions only); in each step the budget left before an admitted
    request ``x`` is ``max_num_batched_tokens`` minus the tokens batched ahead of it (running
    requests first, then admissions in order), and its slack is what ``x`` leaves of it.  One
    such ``x`` with slack is picked and either ``x``'s own prompt grows by the slack (or the
    slack + 1), or, when the step admitted another request ``y`` just before ``x``, ``y``'s
    prompt does: the run before the grown request's arrival is unchanged and its prompt keeps
    its tokens (a longer one only appends), so at that step ``x`` asks for exactly the budget
    left (admitted whole) or one token more (cut, or refused without chunking).  The second
    form keeps ``x`` as it is, so the exact fit meets whatever ``x`` asked for (a padded
    speculative admission's ``1 + K`` tokens, a resumed request's recompute).  Budget
    comparisons flip there (ADMIT.*, BUDGET.*, ``no_chunking_cap``, ``prefill_chunking``,
    SPEC.PAD_ADMISSION), which uniform prompt draws hit about once in the budget's size.
    Prompts stay within :data:`EDGE_MAX_PROMPT` and the context; the trace is unchanged when
    no admission qualifies or the run does not finish."""
    from fuzz.pairs import spec_run

    config = resolve(trace.config)
    records = spec_run(trace, decisions_only=True)
    by_id = {r.id: r for r in trace.requests}
    longest = min(EDGE_MAX_PROMPT, config.max_model_len - 1)
    found = []
    for rec in records:
        spent, admitted, before = 0, set(rec.new) | set(rec.resumed), None
        for rid, n in rec.scheduled:
            slack = config.max_num_batched_tokens - spent - n
            spent += n
            for grow in (rid if rid in admitted else None, before):  # x itself, or the admission before it
                r = by_id.get(grow)
                if r is not None and r.prompt is None and slack > 0 and r.prompt_len + slack + 1 <= longest:
                    found.append((grow, r.prompt_len + slack + rng.randint(0, 1)))
            before = rid if rid in admitted else None
    if not found:
        return trace
    rid, grown = rng.choice(found)
    return replace(trace, requests=[replace(r, prompt_len=grown) if r.id == rid else r for r in trace.requests])


#: The share of a campaign's traces in which a request continues another's conversation (:func:`next_turn`;
#: plain ``random_trace(seed)`` never does: conformance runs keep their traces).
TURNS_SHARE = 0.25
#: The share of a campaign's speculative-decoding traces (not shaped towards an interaction) whose
#: ``max_model_len`` is moved to where a padded admission flips (:func:`pad_edge`).
PAD_EDGE_SHARE = 0.5


def pad_edge(trace: Trace, rng: random.Random) -> Trace:
    """``max_model_len`` moved to where SPEC.PAD_ADMISSION's context test flips for one admission.

    A request admitted with one token left to compute (a prompt of one token, or one whose
    prefix hit covers all but its last) is padded to ``1 + K`` tokens only while
    ``hit + 1 + K + 1 <= max_model_len``.  The spec runs ``trace`` (decisions only); for one such
    new admission (a padded one where there is one: its other conditions hold, the context alone
    decides), ``max_model_len`` becomes ``prompt_len + K + 1`` (padded, the test holds
    exactly) or one less (refused by one token): uniform draws of ``max_model_len`` almost never
    land there.  A shorter context changes the run (longer prompts are refused), so the moved
    trace is run again: kept only when, at the exact fit, the request is padded (else the context
    is not what decides) and, one token less, still admitted with one token left; otherwise
    ``trace`` comes back unchanged (one to four spec runs in all).  Drawn traces pad rarely (about
    one in twenty): where the run pads nothing and caches prefixes, a later request is first made
    to repeat an earlier one's whole blocks plus one token (:func:`_hit_all_but_last`)."""
    from fuzz.pairs import spec_run
    from spec.config import ConfigError
    from spec.specdec import padded_context

    config = resolve(trace.config)
    k = config.num_speculative_tokens
    if not k:
        return trace
    by_id = {r.id: r for r in trace.requests}

    def ones(records: list[StepRecord]) -> list[tuple[str, int]]:
        return [(rid, rec.drafts.get(rid, 0)) for rec in records for rid, n in rec.scheduled if rid in rec.new
                and _one_left(n, rec.drafts.get(rid, 0), by_id[rid].prompt_len, rec, config.max_num_batched_tokens)]

    drawn = ones(spec_run(trace, decisions_only=True))
    found = sorted({rid for rid, drafts in drawn if drafts})
    if not found and config.enable_prefix_caching:  # none padded: make one request a candidate
        shaped = _hit_all_but_last(trace, rng, k, config.block_size)
        if shaped is not trace:
            trace, by_id = shaped, {r.id: r for r in shaped.requests}
            drawn = ones(spec_run(trace, decisions_only=True))
            found = sorted({rid for rid, drafts in drawn if drafts})
    found = found or sorted({rid for rid, _ in drawn})
    if not found:
        return trace
    rid = rng.choice(found)
    below = rng.randint(0, 1)

    def edged(mml: int) -> Trace | None:
        moved = replace(trace, config={**trace.config, "max_model_len": mml})
        try:
            resolve(moved.config)
        except ConfigError:
            return None
        return moved

    fits = padded_context(by_id[rid].prompt_len - 1, k)  # (its hit: all but the last token)
    exact = edged(fits)
    if exact is None or not any(r == rid and drafts for r, drafts in ones(spec_run(exact, decisions_only=True))):
        return trace  # (not padded even where the context allows it: the context does not decide)
    if not below:
        return exact
    past = edged(fits - 1)
    return past if past is not None and any(r == rid for r, _ in ones(spec_run(past, decisions_only=True))) else trace


def _hit_all_but_last(trace: Trace, rng: random.Random, k: int, block_size: int) -> Trace:
    """A later request ``y`` made to repeat an earlier request ``x``'s first whole blocks plus one
    token of its own (its prompt then a prefix hit but for its last token: a padding candidate), and
    ``x``'s prompt cut to at most K tokens past those blocks, so that ``x`` still fits the context
    :func:`pad_edge` gives ``y`` (``hit + K + 2``).  Unchanged when no such pair exists."""
    requests = trace.requests
    pairs = [(i, j) for i, x in enumerate(requests) for j, y in enumerate(requests)
             if x.prompt_len >= block_size and (y.arrival_step or 0) > (x.arrival_step or 0)]
    if not pairs:
        return trace
    i, j = rng.choice(pairs)
    x, y = requests[i], requests[j]
    whole = x.prompt_len // block_size * block_size
    x_len = whole + min(x.prompt_len - whole, k)
    x_ids = x.prompt_token_ids(trace.vocab_size)[:x_len]
    own = FIRST_SYNTHETIC_TOKEN + (x_ids[-1] + 1 - FIRST_SYNTHETIC_TOKEN) % (trace.vocab_size - FIRST_SYNTHETIC_TOKEN)
    out = list(requests)
    out[i] = replace(x, prompt_len=x_len, prefix_len=min(x.prefix_len, x_len),
                     prompt=tuple(x_ids) if x.prompt is not None else None)
    out[j] = replace(y, prompt=(*x_ids[:whole], own), prompt_len=whole + 1, prefix_group=None, prefix_len=0,
                     cache_salt=x.cache_salt, skip_prefix_cache=False)
    return replace(trace, requests=out)


def _one_left(n: int, drafts: int, prompt_len: int, rec: StepRecord, budget: int) -> bool:
    """Whether an admission of ``n`` tokens (``drafts`` of them dummy drafts) computed only its
    prompt's last token — a prompt of one token, or all the rest a prefix hit — and was not merely
    cut to one token by a budget it used up (the decisions level logs no hits)."""
    if n - drafts != 1:
        return False
    return drafts > 0 or prompt_len == 1 or sum(m for _, m in rec.scheduled) < budget


def _uses_slo(cfg: dict[str, Any]) -> bool:
    """Whether the drawn configuration schedules by SLO targets or predicted lengths (issue 19)."""
    return cfg.get("policy") in ("edf", "sprpt") or cfg.get("preemption_victim", "policy") != "policy" \
        or cfg.get("slo_admission", "off") != "off"


def _draw_slo(rng: random.Random, requests: list[TraceRequest]) -> list[TraceRequest]:
    """Targets (steps) and predicted output lengths on most requests, from their own generator
    (so the rest of the trace keeps its draws): TTFT 1-12 steps, TPOT 1-3, a prediction that is
    exact, off, or missing."""
    out = []
    for r in requests:
        ttft = rng.choice((None, 1, 2, rng.randint(1, 12), rng.randint(3, 12)))
        tpot = rng.choice((None, 1, 2, 3))
        pred = rng.choice((None, r.max_tokens, rng.randint(0, r.max_tokens + 4)))
        out.append(replace(r, ttft_slo=ttft, tpot_slo=tpot, predicted_output_len=pred))
    return out


def _draw_spec_accept(rng: random.Random, requests: list[TraceRequest], k: int) -> list[TraceRequest]:
    """Speculative decoding's scripted acceptance (rule SPEC.ACCEPT), from its own generator (so
    the rest of the trace keeps its draws): two in five requests a ``spec_accept`` list of 1-4
    counts in 0..K (0 and K favoured), two in five a ``spec_accept_rate``, the rest accept every
    draft."""
    out = []
    for r in requests:
        u = rng.random()
        if u < 0.4:
            script = tuple(rng.choice((0, k, rng.randint(0, k))) for _ in range(rng.randint(1, 4)))
            out.append(replace(r, spec_accept=script))
        elif u < 0.8:
            out.append(replace(r, spec_accept_rate=rng.choice((0.0, 0.3, 0.5, 0.8, 1.0))))
        else:
            out.append(r)
    return out


def _draw_request_features(rng: random.Random, requests: list[TraceRequest]) -> list[TraceRequest]:
    """The request features vLLM's scheduler sees (issue 15 item 3), from their own generator
    (so the rest of the trace keeps its draws): about a quarter of the requests skip the
    prefix cache, a third carry one of two salts, a third have ``min_tokens`` up to
    ``max_tokens`` (often 1-2, where a scripted EOS or stop token is masked), two in five
    a ``client_arrival_time`` (priority ties) out of arrival order."""
    out = []
    for r in requests:
        skip = rng.random() < 0.25
        salt = rng.choice(("s0", "s1")) if rng.random() < 0.35 else None
        low = rng.randint(0, min(2, r.max_tokens))
        min_tokens = rng.choice((low, rng.randint(0, r.max_tokens))) if rng.random() < 0.35 else 0
        # vLLM's arrival_time, out of the order of arrival, often tying with others (or with
        # the arrival indices that stand in for it on requests without one)
        tie = rng.choice((float(rng.randint(0, len(requests))), rng.randint(0, 2 * len(requests)) / 2)) if rng.random() < 0.4 else None
        out.append(replace(r, skip_prefix_cache=skip, cache_salt=salt, min_tokens=min_tokens, client_arrival_time=tie))
    return out


def _draw_feature_knobs(rng: random.Random, cfg: dict[str, Any], options: dict[str, Any]) -> None:
    """vLLM 0.32's admission limit below max_num_seqs and its adaptive long-prefill cap
    (knobs not given in ``options``), from the request features' own generator."""
    if "max_num_active_seqs" not in options and cfg.get("max_num_seqs_scope", "running") == "running" \
            and rng.random() < 0.3:
        cfg["max_num_active_seqs"] = rng.randint(1, min(cfg["max_num_seqs"], 8))
    if "long_prefill_token_threshold_adaptive" not in options and cfg.get("long_prefill_token_threshold") \
            and rng.random() < 0.5:
        cfg["long_prefill_token_threshold_adaptive"] = True


def trace_features(trace: Trace, records: Iterable[StepRecord] | None = None) -> set[str]:
    """The feature areas of :data:`FEATURES` that ``trace`` exercises.

    Static areas come from the trace; ``preemption``, ``prefix_hits``,
    ``eviction``, ``rejections`` and ``max_model_len`` are confirmed from the
    decision log ``records`` when given (what the run actually did).
    """
    cfg = resolve(trace.config).to_json()
    bs, budget, mml = cfg["block_size"], cfg["max_num_batched_tokens"], cfg["max_model_len"]
    tags = {"priority" if cfg["policy"] == "priority" else "fcfs"}
    cap = cfg["long_prefill_token_threshold"]
    if cap:
        tags.add("long_prefill_cap")
        if cfg["long_prefill_token_threshold_adaptive"]:
            tags.add("adaptive_long_prefill")
    if 0 < cfg["max_num_active_seqs"] < min(cfg["max_num_seqs"], len(trace.requests)):
        tags.add("max_num_active_seqs")
    if not cfg["enable_chunked_prefill"]:
        tags.add("no_chunking")
    if any(r.prompt_len > budget or (cap and r.prompt_len > cap) for r in trace.requests) and cfg["enable_chunked_prefill"]:
        tags.add("chunked_prefill")
    if cfg["max_num_seqs"] < len(trace.requests):
        tags.add("max_num_seqs")
    peaks = sum(_blocks(_peak_slots(r.prompt_len, r.max_tokens, mml), bs) for r in trace.requests if r.prompt_len < mml)
    if peaks > cfg["num_blocks"] - 1:
        tags.add("tight_memory")
    if cfg["enable_prefix_caching"]:
        tags.add("prefix_caching")
    if cfg["watermark"] > 0:
        tags.add("watermark")
    if not cfg["scheduler_reserve_full_isl"]:
        tags.add("reserve_first_chunk")
    if cfg["num_speculative_tokens"]:
        tags.add("spec_decode")
        if cfg["async_scheduling"]:
            tags.add("async_spec_decode")
    if (trace.vocab_size < 100 or bs not in BLOCK_SIZES or budget <= 3 or len(trace.requests) > 12
            or mml <= 12 or cfg["watermark"] >= 0.3):
        tags.add("stress")
    for r in trace.requests:
        if r.abort_at is not None:
            tags.add("aborts")
        if r.stop_token_ids and set(r.stop_token_ids) & set(r.output_tokens):
            tags.add("stop_tokens")
        if trace.eos_token_id in r.output_tokens:
            tags.add("ignore_eos" if r.ignore_eos else "eos")
        for name in ("skip_prefix_cache", "cache_salt", "min_tokens"):
            if getattr(r, name):
                tags.add(name)
        if r.client_arrival_time is not None and cfg["policy"] == "priority":
            tags.add("client_arrival_time")
    if records is None:
        return tags
    for rec in records:
        if rec.preempted:
            tags.add("preemption")
        if rec.rejected:
            tags.add("rejections")
        if any(h > 0 for h in (rec.cache_hits or {}).values()):
            tags.add("prefix_hits")
        if rec.num_evicted:
            tags.add("eviction")
        if any(why == "max_model_len" for _, why in rec.finished):
            tags.add("max_model_len")
        if rec.drafts and rec.accepted is not None and any(a < rec.drafts.get(r, 0) for r, a in rec.accepted.items()):
            tags.add("spec_rollback")
        if rec.drafts and set(rec.drafts) & (set(rec.new) | set(rec.resumed)):
            tags.add("spec_padded_admission")
    return tags
