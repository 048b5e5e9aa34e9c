"""Data formats: traces and decision logs (DESIGN.md §3).

Standard library only, and free of scheduling logic, so that every engine
(including the independent ``gpu_engine``) can share these types.

A **trace** is JSON lines: one header object, then one object per request.
A **decision log** is JSON lines: one header object, then one ``StepRecord``
per engine step.  Both are versioned; the JSON Schemas that validate them are
shipped in ``spec/schemas/`` and applied by :mod:`spec.io`.

Token values matter to scheduling only through stop conditions and prefix
hashing, so a trace may give a prompt as a length (plus a shared-prefix
group) and leave the sampled tokens to a documented synthetic rule
(:func:`synthetic_token`).  Every engine derives the same tokens from it.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

TRACE_FORMAT = "batchspec-trace"
LOG_FORMAT = "batchspec-log"
FORMAT_VERSION = 1

#: Comparison levels, each a superset of the previous one.
LEVELS = ("decisions", "memory", "exact")

#: Explicit size limits; errors name the limit that was hit ("exceeds the limit NAME=VALUE").
#: Readers enforce them while streaming, so a huge file is refused without being loaded.
LIMITS = {
    "requests": 1_000_000,  # requests in one trace
    "prompt_len": 1_048_576,  # tokens in one prompt
    "max_tokens": 1_048_576,  # output tokens of one request
    "num_blocks": 4_194_304,  # KV blocks in the pool
    "line_bytes": 16 * 1024 * 1024,  # bytes in one JSON line (a 1M-token explicit prompt is ~8 MB)
    "trace_bytes": 128 * 1024 * 1024,  # bytes in one trace file (1M requests of ~100 bytes)
    "log_bytes": 256 * 1024 * 1024,  # bytes in one decision log
    "json_bytes": 16 * 1024 * 1024,  # bytes in one JSON document (cost model, calibration rows, state)
    "json_depth": 16,  # nesting of arrays / objects in one JSON value (the formats need 4)
    "int_abs": 2**53 - 1,  # any integer in an input file (exact in an IEEE double, so in every language)
    "steps": 10_000_000,  # upper bound for the max_steps knob, arrival_step, abort_at and log steps
    "arrival_time": 1e9,  # seconds (about 31 years)
    "priority": 2**31 - 1,  # |priority|
    "vocab_size": 16_777_216,  # tokens in the vocabulary
    "token_list": 65_536,  # entries of stop_token_ids (and of spec_accept)
    "num_speculative_tokens": 64,  # draft tokens per step (the num_speculative_tokens knob)
}

#: Optional request fields of service-level targets and output budgets (issue 19), written only when set.
SLO_REQUEST_FIELDS = ("slo_class", "ttft_slo", "tpot_slo", "predicted_output_len")

#: Token ids below this are reserved (0 pad, 1 bos, 2 eos by default); synthetic
#: prompt and output tokens never use them, so they never stop a request by accident.
FIRST_SYNTHETIC_TOKEN = 3
DEFAULT_VOCAB_SIZE = 32000
DEFAULT_EOS_TOKEN_ID = 2

# Finish reasons, as vLLM's statuses split them (FINISHED_STOPPED / LENGTH_CAPPED / ABORTED).
FINISH_EOS = "eos"
FINISH_STOP_TOKEN = "stop_token"
FINISH_MAX_TOKENS = "max_tokens"
FINISH_MAX_MODEL_LEN = "max_model_len"
FINISH_REASONS = (FINISH_EOS, FINISH_STOP_TOKEN, FINISH_MAX_TOKENS, FINISH_MAX_MODEL_LEN)


def _mix(label: str, index: int, vocab_size: int) -> int:
    span = vocab_size - FIRST_SYNTHETIC_TOKEN
    return FIRST_SYNTHETIC_TOKEN + zlib.crc32(f"{label}#{index}".encode()) % span


def synthetic_token(request_id: str, index: int, vocab_size: int) -> int:
    """The ``index``-th output token of a request whose trace gives no token there.

    ``crc32("<id>#out<index>") mod (vocab_size - 3) + 3``: deterministic, the
    same in every process and language, and never one of the reserved ids.
    """
    return _mix(f"{request_id}#out", index, vocab_size)


def min_tokens_token(req: "TraceRequest", index: int, token: int, vocab_size: int, eos_token_id: int) -> int:
    """The token sampled at output ``index < min_tokens`` when the model's choice was ``token``.

    vLLM enforces ``min_tokens`` in the sampler, not the scheduler: its min-tokens logits
    processor masks EOS (unless ``ignore_eos``) and every ``stop_token_ids`` entry until the
    request has ``min_tokens`` outputs, so such a token is never sampled there.  The model
    then samples its next choice, defined here as the first of ``synthetic_token(id, index)``,
    ``crc32("<id>#min<index>#<k>")``-mixed candidates (k = 1, 2, ...), then the synthetic range
    in order, that is not masked.  The scheduler's own stop check is unchanged.
    """
    masked = set(req.stop_token_ids)
    if not req.ignore_eos:
        masked.add(eos_token_id)
    if token not in masked:
        return token
    candidates = [synthetic_token(req.id, index, vocab_size)]
    candidates += [_mix(f"{req.id}#min{index}", k, vocab_size) for k in range(1, 64)]
    for t in candidates:
        if t not in masked:
            return t
    for t in range(FIRST_SYNTHETIC_TOKEN, vocab_size):
        if t not in masked:
            return t
    return token  # every token is masked: nothing else can be sampled


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace (one JSON line after the header)."""

    id: str
    max_tokens: int
    prompt_len: int
    prompt: tuple[int, ...] | None = None  # explicit token ids; else synthesized
    arrival_step: int | None = None  # differential traces arrive at a step
    arrival_time: float | None = None  # real traces arrive at a time in seconds
    prefix_group: str | None = None  # requests of one group share a prompt prefix
    prefix_len: int = 0  # length of that shared prefix
    priority: int = 0  # smaller is more important (vLLM's convention)
    tenant: str = "default"
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    abort_at: int | None = None  # step at which the client aborts it
    output_tokens: tuple[int, ...] = ()  # tokens the synthetic model emits first
    # service-level targets (issue 19): steps in a step trace (arrival_step only), seconds in a
    # timed trace (arrival_time, with or without arrival_step); a class named in the header's ``slo_classes`` fills the
    # targets the request does not give itself (spec.io resolves it when loading).
    slo_class: str | None = None
    ttft_slo: float | None = None  # first token within this many steps (seconds) of arrival
    tpot_slo: float | None = None  # at most this many steps (seconds) between two output tokens
    predicted_output_len: int | None = None  # a predictor's guess of the output length; max_tokens stays the cap
    # request features vLLM's scheduler sees (issue 15 item 3), written only when set
    skip_prefix_cache: bool = False  # never reads the prefix cache (vLLM: prompt_logprobs); its blocks are still cached
    cache_salt: str | None = None  # mixed into the hash of the first block, so only equal salts share a prefix
    min_tokens: int = 0  # the sampler cannot emit EOS or a stop token among the first min_tokens outputs
    # the arrival_time vLLM's Request carries (the client's clock, seconds): priority ties go to
    # the smaller one, whatever order the requests reached the scheduler in; None: the order of arrival
    client_arrival_time: float | None = None
    # speculative decoding (issue 15 item 2, rule SPEC.ACCEPT), written only when set: drafts accepted
    # at the request's j-th verification, spec_accept[j mod len] (at most those scheduled); or each
    # draft accepted with probability spec_accept_rate (a seeded draw, up to the first rejection);
    # neither: every draft.  A draft is the token the request's token rule samples at its position.
    spec_accept: tuple[int, ...] = ()
    spec_accept_rate: float | None = None

    def prompt_token_ids(self, vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[int]:
        """The prompt's token ids: explicit, or synthesized from the id and prefix group.

        Tokens ``0..prefix_len-1`` come from the group (so they are equal across
        the group and hit each other's prefix cache); the rest from the id.
        """
        if self.prompt is not None:
            return list(self.prompt)
        shared = min(self.prefix_len, self.prompt_len) if self.prefix_group else 0
        head = [_mix(f"{self.prefix_group}#pre", i, vocab_size) for i in range(shared)]
        tail = [_mix(f"{self.id}#in", i, vocab_size) for i in range(shared, self.prompt_len)]
        return head + tail

    def tie_time(self, arrival_index: int) -> float:
        """The time that breaks priority ties (vLLM's ``Request.arrival_time``): the trace's
        ``client_arrival_time``, else the request's arrival index (0, 1, 2, ... in the order
        requests reach the scheduler, rejected ones included) as seconds."""
        return float(arrival_index) if self.client_arrival_time is None else float(self.client_arrival_time)

    def output_token(self, index: int, vocab_size: int = DEFAULT_VOCAB_SIZE, eos_token_id: int | None = None) -> int:
        """Token number ``index`` the scheduler-only model samples for this request.

        Explicit ``output_tokens`` first, then the synthetic rule; among the first
        ``min_tokens`` outputs a stop token is masked (:func:`min_tokens_token`), which
        needs the trace's ``eos_token_id``.
        """
        token = self.output_tokens[index] if index < len(self.output_tokens) else synthetic_token(self.id, index, vocab_size)
        if index < self.min_tokens:
            if eos_token_id is None:
                raise ValueError(f"request {self.id!r} has min_tokens: output_token() needs the trace's eos_token_id")
            token = min_tokens_token(self, index, token, vocab_size, eos_token_id)
        return token

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id}
        if self.arrival_step is not None:
            out["arrival_step"] = self.arrival_step
        if self.arrival_time is not None:
            out["arrival_time"] = self.arrival_time
        if self.prompt is not None:
            out["prompt"] = list(self.prompt)
        else:
            out["prompt_len"] = self.prompt_len
            if self.prefix_group is not None:
                out["prefix_group"] = self.prefix_group
                out["prefix_len"] = self.prefix_len
        out["max_tokens"] = self.max_tokens
        for name, default in (("priority", 0), ("tenant", "default"), ("ignore_eos", False)):
            if getattr(self, name) != default:
                out[name] = getattr(self, name)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.abort_at is not None:
            out["abort_at"] = self.abort_at
        if self.output_tokens:
            out["output_tokens"] = list(self.output_tokens)
        for name in SLO_REQUEST_FIELDS:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.skip_prefix_cache:
            out["skip_prefix_cache"] = True
        if self.cache_salt is not None:
            out["cache_salt"] = self.cache_salt
        if self.min_tokens:
            out["min_tokens"] = self.min_tokens
        if self.client_arrival_time is not None:
            out["client_arrival_time"] = self.client_arrival_time
        if self.spec_accept:
            out["spec_accept"] = list(self.spec_accept)
        if self.spec_accept_rate is not None:
            out["spec_accept_rate"] = self.spec_accept_rate
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "TraceRequest":
        prompt = obj.get("prompt")
        return cls(
            id=obj["id"],
            max_tokens=obj["max_tokens"],
            prompt_len=len(prompt) if prompt is not None else obj["prompt_len"],
            prompt=tuple(prompt) if prompt is not None else None,
            arrival_step=obj.get("arrival_step"),
            arrival_time=obj.get("arrival_time"),
            prefix_group=obj.get("prefix_group"),
            prefix_len=obj.get("prefix_len", 0),
            priority=obj.get("priority", 0),
            tenant=obj.get("tenant", "default"),
            ignore_eos=obj.get("ignore_eos", False),
            stop_token_ids=tuple(obj.get("stop_token_ids", ())),
            abort_at=obj.get("abort_at"),
            output_tokens=tuple(obj.get("output_tokens", ())),
            **{name: obj.get(name) for name in SLO_REQUEST_FIELDS},
            skip_prefix_cache=obj.get("skip_prefix_cache", False),
            cache_salt=obj.get("cache_salt"),
            min_tokens=obj.get("min_tokens", 0),
            client_arrival_time=obj.get("client_arrival_time"),
            spec_accept=tuple(obj.get("spec_accept", ())),
            spec_accept_rate=obj.get("spec_accept_rate"),
        )


@dataclass
class Trace:
    """A header (engine configuration and model vocabulary) and its requests.

    ``config`` is the raw knob mapping of the header: ``{"profile": ..., knob: value}``;
    :func:`spec.config.resolve` turns it into a validated ``SchedulerConfig``.
    """

    config: dict[str, Any]
    requests: list[TraceRequest]
    vocab_size: int = DEFAULT_VOCAB_SIZE
    eos_token_id: int = DEFAULT_EOS_TOKEN_ID
    name: str | None = None
    description: str | None = None
    source: str | None = None  # file the trace was read from, for messages
    #: SLO classes (issue 19): class name -> {"ttft": target, "tpot": target}, in the trace's units
    slo_classes: dict[str, dict[str, float]] | None = None

    def header_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": TRACE_FORMAT, "version": FORMAT_VERSION}
        if self.name:
            out["name"] = self.name
        if self.description:
            out["description"] = self.description
        out["config"] = dict(self.config)
        out["vocab_size"] = self.vocab_size
        out["eos_token_id"] = self.eos_token_id
        if self.slo_classes:
            out["slo_classes"] = {k: dict(v) for k, v in self.slo_classes.items()}
        return out

    def request(self, request_id: str) -> TraceRequest:
        for r in self.requests:
            if r.id == request_id:
                return r
        raise KeyError(request_id)


@dataclass
class StepRecord:
    """What an engine decided in one step: one line of a decision log.

    Lists are ordered: ``scheduled`` in the order the engine batched the
    requests (continuing requests first, then admissions, for ``vllm-v1``);
    ``preempted`` in preemption order; ``finished`` in the order requests were
    freed.  Memory fields are the state at the end of the step (after frees).
    """

    step: int
    scheduled: list[tuple[str, int]] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[tuple[str, str]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)
    sampled: dict[str, int] = field(default_factory=dict)
    # decisions level, written only when non-empty (preemption_mode="swap")
    swapped_out: list[str] = field(default_factory=list)  # the preempted requests that were swapped to CPU
    swapped_in: list[str] = field(default_factory=list)  # the resumed requests that were swapped back in
    # memory level
    num_free_blocks: int | None = None
    blocks: dict[str, int] | None = None  # request -> number of blocks it holds
    cache_hits: dict[str, int] | None = None  # admitted request -> prefix-hit tokens
    num_evicted: int | None = None  # cached blocks evicted in this step
    num_free_cpu_blocks: int | None = None  # CPU swap pool, end of step (preemption_mode="swap" only)
    new_token_ratio: float | None = None  # SGLang's ratio, end of step (admission="estimate" only)
    # exact level
    block_ids: dict[str, list[int]] | None = None
    evicted: list[int] | None = None
    # written by the spec only: why each decision was made
    reasons: list[dict[str, Any]] | None = None
    # decisions level, written only by engines with async scheduling: the step whose batch's
    # outputs (``sampled``, ``finished``) this record applies; -1 when none was in flight.
    # Absent (None): the record's own step, as with synchronous scheduling.
    outputs_step: int | None = None
    # optional state where bugs hide, written when the engine logs it (see STATE_FIELDS)
    # running request, or one waiting after a preemption (swapped out too) -> num_computed_tokens, end of step
    computed: dict[str, int] | None = None
    vtc_counters: dict[str, float] | None = None  # policy="vtc": tenant -> virtual token counter, end of step
    # policy="vtc": tenant -> its counter right after VTC.LIFT, each tenant whose request arrived to its
    # empty queue in this step (lifted or not), before the step's charges
    vtc_lifts: dict[str, float] | None = None
    estimate_rem: float | None = None  # admission="estimate": rem_total_tokens as the admission round began
    # its terms, rem = free - running - chunks: free tokens, the running requests' estimated outputs
    # (ESTIMATE.RUNNING_RATIO), the continued chunks' charges (ESTIMATE.CONTINUED_CHUNK); and
    # ``outputs``, the running requests' remaining outputs before the ratio (ESTIMATE.REMAINING)
    estimate_parts: dict[str, float] | None = None
    cache_registered: dict[str, list[int]] | None = None  # request -> block ordinals registered in the prefix cache
    hit_blocks: dict[str, list[int]] | None = None  # admitted request -> ids of its prefix-hit blocks
    token_cap: int | None = None  # long_prefill_token_threshold > 0: the per-request token cap the step applied (0 none)
    admit_stop: str | None = None  # why the step's walk of the waiting queue stopped (ADMIT_STOPS), when it ran
    placeholders: dict[str, int] | None = None  # async scheduling: request -> tokens in flight, each request with any
    waiting: list[str] | None = None  # the requests in the waiting queue at the end of the step (sorted ids)
    ref_counts: dict[str, int] | None = None  # block id (as a string) -> reference count, each block a running request holds
    cached_blocks: list[int] | None = None  # the block id of each prefix-cache entry (sorted; a block twice: two entries)
    # speculative decoding (num_speculative_tokens > 0): request -> draft tokens scheduled in this
    # step's batch (padded admissions' dummy drafts included), and request -> drafts accepted among
    # the outputs this record applies (before a stop token trims them); only requests with drafts
    drafts: dict[str, int] | None = None
    accepted: dict[str, int] | None = None

    def to_json(self, level: str = "exact") -> dict[str, Any]:
        out: dict[str, Any] = {
            "step": self.step,
            "scheduled": [[r, n] for r, n in self.scheduled],
            "new": list(self.new),
            "resumed": list(self.resumed),
            "preempted": list(self.preempted),
            "finished": [[r, why] for r, why in self.finished],
            "aborted": list(self.aborted),
            "rejected": [[r, why] for r, why in self.rejected],
            "sampled": dict(self.sampled),
        }
        if self.swapped_out:
            out["swapped_out"] = list(self.swapped_out)
        if self.swapped_in:
            out["swapped_in"] = list(self.swapped_in)
        if self.outputs_step is not None:
            out["outputs_step"] = self.outputs_step
        if LEVELS.index(level) >= 1 and self.num_free_blocks is not None:
            out["num_free_blocks"] = self.num_free_blocks
            out["blocks"] = dict(self.blocks or {})
            out["cache_hits"] = dict(self.cache_hits or {})
            out["num_evicted"] = self.num_evicted or 0
            if self.num_free_cpu_blocks is not None:
                out["num_free_cpu_blocks"] = self.num_free_cpu_blocks
            if self.new_token_ratio is not None:
                out["new_token_ratio"] = self.new_token_ratio
        if LEVELS.index(level) >= 2 and self.block_ids is not None:
            out["block_ids"] = {r: list(b) for r, b in self.block_ids.items()}
            out["evicted"] = list(self.evicted or [])
        for name, lowest in STATE_FIELDS.items():
            value = getattr(self, name)
            if value is not None and LEVELS.index(level) >= LEVELS.index(lowest):
                out[name] = {k: list(v) if isinstance(v, list) else v for k, v in value.items()} \
                    if isinstance(value, dict) else list(value) if isinstance(value, list) else value
        if self.reasons is not None:
            out["reasons"] = self.reasons
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "StepRecord":
        return cls(
            step=obj["step"],
            scheduled=[(r, n) for r, n in obj.get("scheduled", [])],
            new=list(obj.get("new", [])),
            resumed=list(obj.get("resumed", [])),
            preempted=list(obj.get("preempted", [])),
            finished=[(r, why) for r, why in obj.get("finished", [])],
            aborted=list(obj.get("aborted", [])),
            rejected=[(r, why) for r, why in obj.get("rejected", [])],
            sampled=dict(obj.get("sampled", {})),
            swapped_out=list(obj.get("swapped_out", [])),
            swapped_in=list(obj.get("swapped_in", [])),
            outputs_step=obj.get("outputs_step"),
            num_free_blocks=obj.get("num_free_blocks"),
            blocks=obj.get("blocks"),
            cache_hits=obj.get("cache_hits"),
            num_evicted=obj.get("num_evicted"),
            num_free_cpu_blocks=obj.get("num_free_cpu_blocks"),
            new_token_ratio=obj.get("new_token_ratio"),
            block_ids=obj.get("block_ids"),
            evicted=obj.get("evicted"),
            reasons=obj.get("reasons"),
            computed=obj.get("computed"),
            vtc_counters=obj.get("vtc_counters"),
            vtc_lifts=obj.get("vtc_lifts"),
            estimate_rem=obj.get("estimate_rem"),
            estimate_parts=obj.get("estimate_parts"),
            cache_registered=obj.get("cache_registered"),
            hit_blocks=obj.get("hit_blocks"),
            token_cap=obj.get("token_cap"),
            admit_stop=obj.get("admit_stop"),
            placeholders=obj.get("placeholders"),
            waiting=obj.get("waiting"),
            ref_counts=obj.get("ref_counts"),
            cached_blocks=obj.get("cached_blocks"),
            drafts=obj.get("drafts"),
            accepted=obj.get("accepted"),
        )

    def level(self) -> str:
        """The highest comparison level this record carries."""
        if self.block_ids is not None:
            return "exact"
        if self.num_free_blocks is not None:
            return "memory"
        return "decisions"

    def is_idle(self) -> bool:
        return not (self.scheduled or self.finished or self.aborted or self.rejected or self.preempted)


#: Fields compared at each level (DESIGN.md §3).  ``sampled`` is compared by
#: key (who sampled): its values are the engine's output, which the spec adopts.
LEVEL_FIELDS = {
    "decisions": ("scheduled", "new", "resumed", "preempted", "finished", "aborted", "rejected", "sampled",
                  "swapped_out", "swapped_in", "outputs_step"),
    "memory": ("num_free_blocks", "blocks", "cache_hits", "num_evicted", "num_free_cpu_blocks", "new_token_ratio"),
    "exact": ("block_ids", "evicted"),
}


#: Optional state fields (issue 18): the lowest level whose logs carry each.  An engine may
#: leave any of them out; the differ compares one only when both logs carry it, after the
#: level's own fields, so a divergence shows at the first step where any compared state
#: differed.  ``cache_registered`` names blocks by ordinal (position in the request), which
#: engines share; ``hit_blocks`` names block ids, which only the exact level compares, and so
#: does ``ref_counts`` (a reference taken or dropped wrongly shows at once, not at a later release)
#: and ``cached_blocks`` (a cache entry dropped or kept wrongly shows at once, not at a later hit).
STATE_FIELDS = {
    "computed": "decisions",
    "vtc_lifts": "decisions",
    "vtc_counters": "decisions",
    "estimate_parts": "memory",
    "estimate_rem": "memory",
    "cache_registered": "memory",
    "hit_blocks": "exact",
    "token_cap": "decisions",
    "admit_stop": "decisions",
    "placeholders": "decisions",
    "waiting": "decisions",
    "ref_counts": "exact",
    "cached_blocks": "exact",
    "drafts": "decisions",
    "accepted": "decisions",
}


#: Values of the optional state field ``admit_stop``: why a step's walk of the waiting queue
#: (admission from its head, in queue order) stopped.  Engines name their own gates with these
#: words, not with the spec's rule ids; the order is the order the gates are tested in, except
#: that a configuration's admission tests run in its own order (``spec.config.admission_checks``).
ADMIT_STOPS = {
    "empty": "nobody left waiting: the walk admitted every waiting request (no word when nobody waited)",
    "budget": "the step's token budget was spent before the next waiting request",
    "seqs": "the batch (or the running set) already holds max_num_seqs requests",
    "whole": "chunked prefill off: the next request's tokens do not fit the budget left at once",
    "first": "only the batch's first entry may be a cut prefill: the next one does not fit whole",
    "estimate": "the memory estimate (SGLang's remaining tokens) refuses the next request",
    "pad": "the next request's padded decode (speculative decoding) does not fit the budget left",
    "blocks": "the next request's KV blocks (with any watermark or reservation) are not free",
}


def fields_at(level: str) -> tuple[str, ...]:
    """All record fields compared at ``level`` (cumulative)."""
    out: tuple[str, ...] = ()
    for lv in LEVELS[: LEVELS.index(level) + 1]:
        out += LEVEL_FIELDS[lv]
    return out


@dataclass
class DecisionLog:
    """A decision log: who wrote it, at which level, and its step records."""

    engine: str
    level: str
    records: list[StepRecord]
    trace: str | None = None  # the trace file it replays, if known
    config: dict[str, Any] | None = None
    source: str | None = None

    def header_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": LOG_FORMAT, "version": FORMAT_VERSION, "engine": self.engine, "level": self.level}
        if self.trace is not None:
            out["trace"] = self.trace
        if self.config is not None:
            out["config"] = self.config
        return out
