"""Request state and the step function: the executable specification itself.

State (Lamport style; the invariants over it are in :mod:`spec.invariants`)
    ``waiting``   queue of requests not holding blocks (new or preempted)
    ``running``   list in admission order; every member holds blocks
    ``swapped``   preempted by swap (preemption_mode="swap"): hold CPU blocks, keep computed tokens
    ``kv``        the block pool and block tables (:mod:`spec.kv`)
    ``requests``  every request ever added, with its status

Actions
    ``add_request``        ARRIVE.* / REJECT.*: queue it, or reject what can never be served
    ``abort_request``      ABORT.*: the client cancels; blocks are freed at once
    ``schedule``           the configuration's phases, top to bottom (``SpecEngine.plan.phases``;
                           vllm-v1: ``schedule_running``, ``hold_after_preempt``, ``schedule_waiting``)
    ``update_from_output`` append sampled tokens, apply stop rules, free finished requests

One ``step()`` is ``schedule()``, the model's sampling, and
``update_from_output()``.  Every decision is tagged with a rule id
(:mod:`spec.rules`) and a human-readable reason in the step record.

The ``vllm-v1`` profile reproduces vLLM 0.32's V1 scheduler with synchronous
scheduling (docs/reference/vllm-v1.md §1, §3, §4).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from itertools import chain

from spec import async_sched, invariants, specdec
from spec.config import SchedulerConfig, resolve, step_plan
from spec.formats import (
    DEFAULT_EOS_TOKEN_ID,
    DEFAULT_VOCAB_SIZE,
    FINISH_EOS,
    FINISH_MAX_MODEL_LEN,
    FINISH_MAX_TOKENS,
    FINISH_STOP_TOKEN,
    LEVELS,
    StepRecord,
    Trace,
    TraceRequest,
)
from spec.kv import AllocFailure, KVCacheManager, cdiv, hash_block, salted_first_hash
from spec.protocol import drive
from spec.queues import make_queue
from spec.rules import declare, fired, phase, reason, rule
from spec.slo import (SLO_DEFER, SLO_INFEASIBLE, SLO_REFUSE, at_risk, feasible, note_token, slo_slack_victim,
                      target_steps, ttft_deadline)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, after a preemption
    SWAPPED = "swapped"  # preempted by swap: its computed blocks are in the CPU pool
    FINISHED = "finished"
    ABORTED = "aborted"
    REJECTED = "rejected"


#: Waiting again after a preemption: a request whose computed tokens were reset.
PREEMPTED_STATES = (Status.PREEMPTED, Status.SWAPPED)


@dataclass(eq=False)
class Request:
    """One request's scheduling state (vLLM's ``Request``, minus what plain text never uses)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_seq: int  # order of arrival: the "arrival_time" of tie-breaks
    priority: int
    eos_token_id: int | None  # None when the request ignores EOS
    stop_token_ids: frozenset[int]
    source: TraceRequest
    block_size: int
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    num_preemptions: int = 0
    finish_reason: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    arrival_step: int = 0  # the engine's step count when it arrived (its age, for QUEUE.AGING)
    # service-level targets in steps (issue 19, spec.slo); None: no target
    ttft_deadline: int | None = None  # last step in which its first token meets ttft_slo
    tpot_steps: int | None = None  # most steps between two of its tokens
    predicted_output: int | None = None  # the trace's predicted_output_len
    deferred: bool = False  # SLO.DEFER: behind every request that can still meet its deadline
    first_token_step: int | None = None
    last_token_step: int | None = None
    slo_missed: bool = False  # a token was sampled after it was due
    num_output_placeholders: int = 0  # async scheduling: sampled tokens still in flight (rule ASYNC.PLACEHOLDER)
    skip_prefix_cache: bool = False  # never reads the prefix cache (rule CACHE.SKIP_READ)
    cache_salt: str | None = None  # mixed into the first block's hash (rule CACHE.SALT)
    tie_time: float = 0.0  # vLLM's arrival_time: client_arrival_time, else arrival_seq (rule QUEUE.PRIORITY)
    spec_drafts: int = 0  # speculative decoding: drafts proposed for its next step (SPEC.PROPOSE)
    spec_verifications: int = 0  # batches with drafts scheduled so far (numbers them for SPEC.ACCEPT)
    prefill_chunk: bool = False  # its last scheduled chunk left its prefill incomplete (vLLM's is_prefill_chunk)
    abort_pending: bool = False  # aborted while running, freed after its next sample (ABORT.AFTER_NEXT_SAMPLE)

    def __post_init__(self) -> None:
        self._extend_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Tokens including those sampled but not yet known (async scheduling)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_output_placeholders

    @property
    def num_tokens_with_spec(self) -> int:
        """Tokens a running request is scheduled up to: known, in flight and proposed drafts
        (vLLM's ``num_tokens_with_spec + num_output_placeholders``; SPEC.DRAFT_SCHEDULE)."""
        return self.num_tokens_with_placeholders + self.spec_drafts

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids ``start .. end-1`` of prompt + outputs (slices, no per-token calls)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def append_output_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self._extend_block_hashes()

    def _extend_block_hashes(self) -> None:
        """Hash every newly full block (vLLM's per-request block hasher)."""
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= self.num_tokens:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if i else None
            h = hash_block(parent, self.tokens(i * bs, (i + 1) * bs))
            if i == 0 and self.cache_salt:
                h = salted_first_hash(h, self.cache_salt)
            self.block_hashes.append(h)


@dataclass
class ScheduledRequest:
    """One entry of a step's batch."""

    request_id: str
    num_tokens: int  # tokens computed in this step
    start: int  # first position computed (num_computed_tokens before the step)
    samples: bool = False  # prefill complete after this step: the model samples a token
    drafts: int = 0  # speculative decoding: draft tokens among num_tokens (SPEC.DRAFT_SCHEDULE, SPEC.PAD_ADMISSION)
    accepted: int = 0  # drafts the model will accept (SPEC.ACCEPT; 0 for a padded admission's dummies)


@dataclass
class SchedulerOutput:
    """The decisions of one ``schedule()`` call."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    swapped_out: list[str] = field(default_factory=list)  # the preempted ones that were swapped
    swapped_in: list[str] = field(default_factory=list)  # the resumed ones that were swapped in
    cache_hits: dict[str, int] = field(default_factory=dict)
    reasons: list[dict] = field(default_factory=list)
    hit_blocks: dict[str, list[int]] = field(default_factory=dict)  # admitted request -> its prefix-hit block ids
    estimate_rem: float | None = None  # admission="estimate": rem_total_tokens as the admission round began
    estimate_parts: dict[str, float] | None = None  # its terms: free, outputs, running, chunks (rem = free - running - chunks)
    drafts: dict[str, int] = field(default_factory=dict)  # speculative decoding: request -> drafts scheduled
    padded: set[str] = field(default_factory=set)  # admissions padded with dummy drafts (SPEC.PAD_ADMISSION)
    token_cap: int | None = None  # logged state: the step's per-request token cap (BUDGET.LONG_PREFILL), when set
    admit_stop: str | None = None  # logged state: why the walk of the waiting queue stopped (formats.ADMIT_STOPS)

    @property
    def samplers(self) -> list[str]:
        return [s.request_id for s in self.scheduled if s.samples]


@dataclass
class StepState:
    """What the phases of one ``schedule()`` call share."""

    out: SchedulerOutput
    budget: int  # tokens left in this step (rule BUDGET.TOKENS)
    cap: int  # per-request token cap (rule BUDGET.LONG_PREFILL), 0 = none
    starved: bool  # nothing ran at the start, something waited
    start: dict[str, int]  # request -> first position computed in this step
    scheduled: dict[str, int] = field(default_factory=dict)  # request -> tokens, in batch order
    ran: bool = False  # the running phase found running requests
    admission_held: bool = False  # a gate phase (hold_*) has closed admission for this step
    step_ends: bool = False  # a phase ended the step (prefill-first)
    rem: float | None = None  # admission="estimate": SGLang's rem_total_tokens for this round
    continued: dict[str, int] = field(default_factory=dict)  # continued prefill -> blocks it took (RUN.CONTINUE_*)
    cur_rem: int | None = None  # ESTIMATE.IGNORE_EOS_RESERVE: free tokens less this round's immediate charges
    eos_states: list | None = None  # ESTIMATE.IGNORE_EOS_RESERVE: (tokens left, tokens held), built once a round


# --------------------------------------------------------------------------
# Rules: small functions, each the statement of one decision.
# --------------------------------------------------------------------------


@rule("REJECT.PROMPT_TOO_LONG", knobs=("max_model_len", "reject_unservable"), applies=bool)
def prompt_too_long(prompt_len: int, cfg: SchedulerConfig) -> bool:
    """A prompt that leaves no room for one output token is rejected at arrival.

    ``prompt_len + 1 > max_model_len``: the request could never sample a token
    (vLLM's front end refuses such prompts before they reach the scheduler).
    """
    return prompt_len + 1 > cfg.max_model_len


@rule("REJECT.NEVER_FITS", knobs=("num_blocks", "block_size", "reject_unservable", "admission"), applies=bool)
def never_fits(prompt_len: int, max_tokens: int, cfg: SchedulerConfig) -> bool:
    """A request whose longest sequence needs more blocks than the whole pool is rejected.

    Its peak KV footprint is ``min(prompt + max_tokens - 1, max_model_len - 1)``
    slots (the last sampled token is never computed).  Without this rule it would
    be admitted, grow, and preempt itself forever; vLLM avoids it only by refusing
    a ``max_model_len`` the cache cannot hold at start-up.

    Under admission="estimate" a request is also rejected if it could fail
    ESTIMATE.ADMIT in an empty engine: with ``o = max(min(max_tokens, max_model_len -
    prompt) - 1, 0)`` outputs (the most it can have when retracted), ``prompt + o +
    min(max_tokens - o, clip_max_new_tokens) + block_size >= usable_blocks x
    block_size``.  SGLang would leave such a request waiting forever.
    """
    peak = min(prompt_len + max_tokens - 1, cfg.max_model_len - 1)
    if cdiv(peak, cfg.block_size) > cfg.usable_blocks:
        return True
    if cfg.admission == "estimate":
        o = max(min(max_tokens, cfg.max_model_len - prompt_len) - 1, 0)
        need = prompt_len + o + min(max_tokens - o, cfg.clip_max_new_tokens) + cfg.block_size
        return need >= cfg.usable_blocks * cfg.block_size
    return False


#: SGLang's margins below min(max_model_len, pool): max_req_len = min(context_len - 1, pool - 1)
#: and max_req_input_len = max_req_len - 5 (refused at or above it), max_new_tokens <=
#: max_req_len - prompt - 1 (rules REJECT.INPUT_LIMIT, ARRIVE.CLIP_MAX_TOKENS).
INPUT_LIMIT_MARGIN = 6
OUTPUT_LIMIT_MARGIN = 2


def length_capacity(cfg: SchedulerConfig) -> int:
    """The longest sequence a request may ever have: ``min(max_model_len, usable_blocks x block_size)``."""
    return min(cfg.max_model_len, cfg.usable_blocks * cfg.block_size)


def output_room(prompt_len: int, cfg: SchedulerConfig) -> int:
    """The most output tokens a request may be given under length_limits="clip":
    ``min(max_model_len - prompt - 2, pool - ceil_B(prompt) - B - 1)`` with pool =
    usable_blocks x B (SGLang's max_req_len bound, then its allocator's
    max_new_tokens_for_memory; at block size 1 both are ``min(max_model_len, pool) - prompt - 2``)."""
    bs = cfg.block_size
    pool = cfg.usable_blocks * bs
    return min(cfg.max_model_len - prompt_len - OUTPUT_LIMIT_MARGIN, pool - cdiv(prompt_len, bs) * bs - bs - 1)


@rule("REJECT.INPUT_LIMIT", knobs=("length_limits", "max_model_len", "num_blocks", "block_size", "reject_unservable"),
      applies=bool)
def input_limit(prompt_len: int, cfg: SchedulerConfig) -> str | None:
    """Under length_limits="clip" a prompt of ``min(max_model_len, pool) - 6`` tokens or more
    is refused at arrival (pool = usable_blocks x block_size): SGLang's
    ``max_req_input_len = min(context_len - 1, pool - 1) - 5`` and ``validate_input_length``,
    which refuses ``prompt >= max_req_input_len``.  What passes leaves room for at least five
    output tokens, and ARRIVE.CLIP_MAX_TOKENS makes every admitted request fit the pool, so
    REJECT.NEVER_FITS is not needed.  With blocks of more than one token a prompt that would
    leave no room for one output token (:func:`output_room` < 1) is refused too (SGLang would
    give it max_new_tokens = 0).  Returns the reason: ``prompt_too_long`` when max_model_len
    alone refuses it, else ``never_fits`` (the pool's bound); None to admit."""
    if prompt_len >= cfg.max_model_len - INPUT_LIMIT_MARGIN:
        return "prompt_too_long"
    if prompt_len >= length_capacity(cfg) - INPUT_LIMIT_MARGIN or output_room(prompt_len, cfg) < 1:
        return "never_fits"
    return None


@rule("ARRIVE.CLIP_MAX_TOKENS", knobs=("length_limits", "max_model_len", "num_blocks", "block_size"),
      applies=lambda got: got[1])
def clipped_max_tokens(prompt_len: int, max_tokens: int, cfg: SchedulerConfig) -> tuple[int, bool]:
    """Under length_limits="clip" an arriving request's max_tokens is cut to
    :func:`output_room`, ``min(max_model_len, pool) - prompt - 2`` at block size 1 (SGLang's
    init_req_max_new_tokens: ``min(max_new_tokens, max_req_len - prompt - 1)``, then the
    allocator's ``pool - ceil_page(prompt) - page_size - 1``), so that ESTIMATE.ADMIT admits it
    in an empty engine, retracted or not.  Such a request is admitted rather than rejected
    and finishes early, two tokens short of the limit, with reason ``max_model_len``
    (SGLang's FINISH_LENGTH before the asked max_tokens).  Every later use of max_tokens
    (the estimate's remaining output, the ratio's reset) sees the cut value.  Returns the
    value and whether it was cut."""
    limit = output_room(prompt_len, cfg)
    return min(max_tokens, limit), limit < max_tokens


@rule("STOP.IGNORE_EOS_SCOPE", knobs=("ignore_eos_scope",), applies=bool)
def ignored_stop_tokens(ignore_eos: bool, stop_token_ids) -> frozenset[int]:
    """Under ignore_eos_scope="eos-and-stop-tokens" a request with ``ignore_eos`` ignores its
    stop token ids too: only its length stops it (SGLang's Req._check_token_based_finish
    returns before any token test when ignore_eos is set; vLLM ignores EOS only).  Returns
    the stop token ids the request ignores."""
    return frozenset(stop_token_ids) if ignore_eos else frozenset()


@rule("BUDGET.LONG_PREFILL", knobs=("long_prefill_token_threshold",), applies=bool)
def long_prefill_cap(cfg: SchedulerConfig, num_eligible: int) -> int:
    """With more than one request eligible, no request takes more than
    ``long_prefill_token_threshold`` tokens in one step (0 = no cap).

    It keeps one long prompt from taking the whole budget; a request that is
    alone is never capped.  ``eligible`` is counted before the step schedules
    (running + waiting; swapped-out requests do not count).
    """
    return cfg.long_prefill_token_threshold if num_eligible > 1 else 0


@rule("BUDGET.LONG_PREFILL_ADAPTIVE", knobs=("long_prefill_token_threshold_adaptive", "long_prefill_token_threshold"),
      applies=lambda grew: grew[1])
def adaptive_long_prefill_cap(cfg: SchedulerConfig, cap: int, num_eligible: int) -> tuple[int, bool]:
    """With ``long_prefill_token_threshold_adaptive``, a nonzero long-prefill cap is raised to
    a fair share of the step's budget, ``max_num_batched_tokens // eligible``: the cap never
    cuts a request below what an even split of the budget would give it (vLLM 0.32).
    Returns the cap and whether the floor raised it."""
    if not (cap > 0 and cfg.long_prefill_token_threshold_adaptive):
        return cap, False
    share = cfg.max_num_batched_tokens // num_eligible
    return max(cap, share), share > cap


@rule("BUDGET.TOKENS", knobs=("max_num_batched_tokens", "enable_chunked_prefill"))
def chunk_size(remaining: int, cap: int, budget: int) -> int:
    """A request is scheduled the tokens it still lacks, cut to the per-request cap
    and then to what is left of the step's token budget.

    ``remaining`` is ``num_tokens - num_computed_tokens``: 1 for a decode, the rest
    of the prompt (plus outputs, after a preemption) for a prefill.  A prefill cut
    by the budget continues next step: chunked prefill.
    """
    n = cap if 0 < cap < remaining else remaining
    return min(n, budget)


@rule("BUDGET.MAX_MODEL_LEN", knobs=("max_model_len",))
def model_len_cap(n: int, num_computed_tokens: int, cfg: SchedulerConfig) -> int:
    """A running request never computes past position ``max_model_len - 1``."""
    return min(n, cfg.max_model_len - num_computed_tokens - 1)


@rule("PREEMPT.VICTIM_NEWEST", knobs=("policy",))
def fcfs_victim(running: list[Request]) -> Request:
    """Under FCFS (and "spf", "vtc") the victim is the last request in the running
    list: the most recently admitted, which under FCFS is the latest arrival.  It may be the request that
    needs the memory itself."""
    return running[-1]


@rule("PREEMPT.VICTIM_LOWEST_PRIORITY", knobs=("policy",))
def priority_victim(running: list[Request]) -> Request:
    """Under "priority" the victim is the running request with the largest
    (priority, arrival time): the least important, then the latest (the trace's
    ``client_arrival_time`` when given, else the order of arrival; the first in the running
    list on a tie).  It may already be scheduled in this step; its tokens are then given
    back to the budget."""
    return max(running, key=lambda r: (r.priority, r.tie_time))


#: Victim rules by id; each entry calls the rule by its module name when it runs, so the
#: plan's choice stays a rule id and a test can plant a wrong rule under the same name.
VICTIM_RULES = {
    "PREEMPT.VICTIM_NEWEST": lambda running: fcfs_victim(running),
    "PREEMPT.VICTIM_LOWEST_PRIORITY": lambda running: priority_victim(running),
    "RETRACT.VICTIM_FEWEST_OUTPUTS": lambda running: fewest_outputs_victim(running),
    "PREEMPT.VICTIM_SLO_SLACK": lambda running, now: slo_slack_victim(running, now),
}


def pick_victim(rule_id: str, running: list[Request], now: int = 0) -> Request:
    """The request to preempt, by the plan's victim rule (``now``: the step, for SLO slack)."""
    if rule_id == "PREEMPT.VICTIM_SLO_SLACK":
        return VICTIM_RULES[rule_id](running, now)
    return VICTIM_RULES[rule_id](running)


@rule("RETRACT.VICTIM_FEWEST_OUTPUTS", knobs=("admission",))
def fewest_outputs_victim(running: list[Request]) -> Request:
    """Under admission="estimate" (SGLang) the request retracted when a step lacks
    memory is the running one with the fewest output tokens; ties go to the longest
    prompt, then to the latest in the running list.

    SGLang sorts the batch by (outputs, -prompt) and pops the smallest: a request
    that has produced little loses little work, and a long prompt frees the most
    memory.  The victim may be the request that needs the memory; the running
    phase then goes on with the next request (SGLang retracts before decoding and
    the rest of the batch still decodes).
    """
    return min(reversed(running), key=lambda r: (len(r.output_token_ids), -len(r.prompt_token_ids)))


@rule("CACHE.REGISTER_PREFILL_AND_FINISH", knobs=("cache_register",))
def prefilled(req: Request, s: ScheduledRequest, starting: set[str]) -> bool:
    """Under cache_register="prefill-and-finish", a request's computed blocks enter the prefix
    cache after a step in which it computed prompt tokens (a new or resumed request, or a
    chunk: ``starting`` holds the step's resumed requests and the prefills the last step cut,
    whose last chunk may be a single token, as a decode's is), and when it finishes or an abort
    frees it after its next sample (before its blocks are freed); a decode step that does not
    end it registers nothing.  Samplers register in batch order, after their output; a prefill
    the step cut (no output) when the next step begins.

    SGLang inserts a request into its radix tree after each extend batch (checkpoint_kv_cache,
    the chunked request when the next step begins) and in release_kv_cache at finish (an abort
    of a running request is a finish, FINISH_ABORT); decoded tokens stay private to the request
    until then, so a retracted request frees them.
    """
    return s.request_id in starting or not req.output_token_ids or s.start < req.num_tokens - 1


#: SGLang's WAITING_PREFIX_REFRESH_INTERVAL and WAITING_QUEUE_PREFIX_MATCH_MAX (managers/schedule_policy.py).
TOUCH_WAITING_INTERVAL, TOUCH_WAITING_MAX = 32, 128


@rule("CACHE.TOUCH_WAITING", knobs=("cache_eviction", "enable_prefix_caching"))
def touch_waiting_due(rounds: int) -> bool:
    """Under cache_eviction="leaf-lru", the admission rounds that reach the queue's ordering
    look up the cached prefix of the first 128 waiting requests (prompt and outputs), from
    the 128th to the head, on the 1st round and every 32nd after: each lookup stamps its
    matched path most recent and splits the node it ends in, as a lookup at admission does,
    so a waiting request's cached prefix outlives newer leaves (the head's most of all).  A
    round reaches the ordering when somebody waits and admission is open: not held
    (ESTIMATE.HOLD_UNTIL_DEPARTURE, SGLang's batch_is_full) and room for another request
    (fewer running than max_num_seqs), or a prefill the last step cut continues.
    ``rounds``: such rounds before this one.  Returns whether this one looks up.

    SGLang's SchedulePolicy.calc_priority ends with _touch_waiting_prefixes
    (SGLANG_ENABLE_WAITING_PREFIX_REFRESH, on by default, LRU eviction, a cache-agnostic
    policy such as fcfs): touch_waiting_prefix matches each request's key in the tree."""
    return rounds % TOUCH_WAITING_INTERVAL == 0


@rule("CACHE.EVICT_ON_RETRACT", knobs=("cache_eviction", "admission", "retract_decode_steps"))
def retract_eviction_target(remaining: list[Request], cfg: SchedulerConfig) -> int:
    """Under cache_eviction="leaf-lru" with admission="estimate", a retraction evicts eagerly:
    first every unlocked leaf (the decode that could not fit had tried to evict all it could),
    then, once the victim is freed, leaves until ``len(remaining running) x
    retract_decode_steps`` tokens' blocks are free of cached content.  Returns that many blocks.

    SGLang's check_decode_mem evicts before it gives up, and release_req evicts for the
    remaining requests' next retract_decode_steps decodes at once ("use the newly evictable
    memory instantly"), so the victim's own cached prompt is often evicted with it.
    """
    return cdiv(len(remaining) * cfg.retract_decode_steps, cfg.block_size)


@rule("RETRACT.BATCH_ORDER", knobs=("admission",))
def retraction_order(running: list[Request]) -> list[Request]:
    """Under admission="estimate", a step whose running phase retracted requests leaves the running
    list — and that step's batch — in retraction order: most output tokens first, ties to the
    shorter prompt, then the earlier in the list.  SGLang's retract_decode sorts the batch by
    ``(outputs, -prompt)``, descending and stable, pops its victims from the end and keeps the
    rest in that order (filter_batch(keep_indices=sorted_indices)); later steps decode, sum the
    estimate and retract again in it."""
    return sorted(running, key=lambda r: (len(r.output_token_ids), -len(r.prompt_token_ids)), reverse=True)


@rule("RETRACT.BATCH_TEST", knobs=("admission",), applies=lambda fits: not fits)
def batch_fits(need: int, free: int) -> bool:
    """Under admission="estimate", before the running phase allocates anything, the blocks
    that every request it would serve needs for this step are tested at once against the
    free (and evictable) blocks; while they do not fit, the request the victim rule picks
    (RETRACT.VICTIM_FEWEST_OUTPUTS) is retracted, until they fit or one request is left.
    Only then do the survivors allocate, in retraction order (RETRACT.BATCH_ORDER).

    SGLang's update_running_batch asks check_decode_mem for the whole decode batch and
    retract_decode pops victims until it passes; prepare_for_decode allocates afterwards.
    The victims are those a request-by-request walk would retract, but no victim has taken a
    block for this step first, so which free blocks the survivors get differs."""
    return need <= free


@rule("ESTIMATE.REMAINING", knobs=("admission", "clip_max_new_tokens"))
def remaining_output(req: Request, cfg: SchedulerConfig) -> int:
    """A request's remaining output, as SGLang counts it: ``min(max(max_tokens -
    outputs, 0), clip_max_new_tokens)`` tokens."""
    return min(max(req.max_tokens - len(req.output_token_ids), 0), cfg.clip_max_new_tokens)


@rule("ESTIMATE.RUNNING_RATIO", knobs=("admission",))
def running_ratio(req: Request, ratio: float) -> float:
    """The share of a running request's remaining output ESTIMATE.ADMIT reserves: the
    new_token_ratio, or all of it (1.0) for a request that ignores EOS, whose output cannot
    stop early (SGLang's _get_running_request_total_token_offset)."""
    return 1.0 if req.source.ignore_eos else ratio


@rule("ESTIMATE.OWN_HIT_LOCKED", knobs=("admission", "enable_prefix_caching"), applies=bool)
def own_hit_locked(hit_blocks, block_size: int) -> int:
    """Under admission="estimate", while a waiting request's admission is tested its own prefix
    hit is locked: the hit blocks that sit evictable in the free queue (reference count 0) do
    not count as free memory for it, and once it is admitted they are in use.  ESTIMATE.ADMIT
    adds their tokens to what the candidate needs and charges them with its admission
    (SGLang's add_one_req tests under ``_lock_node(req.last_node)``, and the admitted request's
    lock removes them from evictable_size).  Returns those tokens."""
    return sum(1 for b in hit_blocks if b.ref_cnt == 0) * block_size


@rule("ESTIMATE.CONTINUED_CHUNK", knobs=("admission", "prefill_chunking"))
def continued_chunk_charge(n: int, last: bool, req: Request, cfg: SchedulerConfig) -> int:
    """Under admission="estimate", a prefill continued first in a step (RUN.CONTINUE_PREFILL_FIRST)
    is charged to ``rem`` as ``ceil_B(n) + block_size`` for its chunk of ``n`` tokens, plus, when
    the chunk completes the prompt, ``min(max_tokens, clip_max_new_tokens)`` for its output
    (SGLang's add_chunked_req; the in-flight chunked request is not in the running batch, so
    the running estimate leaves it out)."""
    bs = cfg.block_size
    return cdiv(n, bs) * bs + bs + (min(req.max_tokens, cfg.clip_max_new_tokens) if last else 0)


@rule("ESTIMATE.ADMIT", knobs=("admission", "new_token_ratio_init"), applies=lambda ok: not ok)
def estimate_admits(need: int, rem: float) -> bool:
    """Under admission="estimate" a waiting request is admitted only if
    ``extend + remaining_output + block_size < rem``, where ``extend`` is the tokens
    it must compute (after its prefix hit) and

        rem = free_blocks x block_size                       (free + evictable)
              - sum over running r of  new_token_ratio x remaining_output(r)
              - sum over requests admitted earlier in this step of
                    (ceil_B(extend) + min(max_tokens, clip_max_new_tokens) + block_size)

    with ``free_blocks`` counted when the step's admission round begins (after the
    running phase's allocations under continuous batching; SGLang's PrefillAdder:
    rem_total_tokens), the running sum taken in running-list order in floating point.
    Running requests are expected to need only a fraction of their remaining output;
    a request admitted now is tested with its whole remaining output and charged its
    whole requested output (:func:`admission_output_charge`: a resumed request's
    earlier outputs count again).  A request that fails stops admission (head-of-line).
    """
    return need < rem


def admission_output_charge(req: Request, cfg: SchedulerConfig) -> int:
    """ESTIMATE.ADMIT's charge to ``rem`` for the output of a request it admits whole:
    ``min(max_tokens, clip_max_new_tokens)``, its whole requested output, even for a request
    resumed after a retraction, whose test counted only the outputs it has left.  SGLang's
    add_one_req tests ``max_new_tokens - len(output_ids)`` but _select_prefill_admission
    reserves ``min(sampling_params.max_new_tokens, CLIP_MAX_NEW_TOKENS)``, so a resumed
    request holds back more than it can use until the round ends."""
    return min(req.max_tokens, cfg.clip_max_new_tokens)


#: SGLang's IGNORE_EOS_RESERVE_TOKENS: the tokens ESTIMATE.IGNORE_EOS_RESERVE keeps free per
#: request still growing at every point of its simulation.
IGNORE_EOS_RESERVE_TOKENS = 1


def eos_reserve_state(req: Request, ratio: float) -> tuple[float, int] | None:
    """One request's entry in ESTIMATE.IGNORE_EOS_RESERVE's simulation: ``(tokens left, tokens
    held)`` = ``(max_tokens x r - outputs, prompt + outputs)`` with r = 1 for a request that
    ignores EOS, else new_token_ratio (max_tokens as cut at arrival, not clipped); None when
    nothing is left (SGLang's add_req_state skips it)."""
    left = req.max_tokens * (1.0 if req.source.ignore_eos else ratio) - len(req.output_token_ids)
    return (left, len(req.prompt_token_ids) + len(req.output_token_ids)) if left > 0 else None


def insert_eos_state(states: list, state: tuple[float, int] | None) -> None:
    """Insert a later candidate's entry into the round's sorted simulation as SGLang does: before
    the first entry with at least as many tokens left — or, when there is none, before the *last*
    entry (SGLang's insertion loop leaves its index at the last position)."""
    if state is None:
        return
    i = 0
    for i in range(len(states)):
        if state[0] <= states[i][0]:
            break
    states.insert(i, state)


@rule("ESTIMATE.IGNORE_EOS_RESERVE", knobs=("ignore_eos_admission", "admission", "enable_prefix_caching"),
      applies=lambda ok: not ok)
def ignore_eos_reserve_admits(paged: int, cur_rem: int, rem: float, states: list, alone: bool) -> bool:
    """Under ignore_eos_admission="reserve", with the prefix cache off, a waiting request that
    ignores EOS is admitted by this test instead of ESTIMATE.ADMIT (SGLang's
    add_one_req_ignore_eos, schedule_policy.py 1241-1304 in 0.5.23):

    * ``paged = ceil_B(extend) + block_size`` must fit both what the round has left,
      ``paged <= min(cur_rem, rem)``, where ``rem`` is ESTIMATE.ADMIT's and ``cur_rem`` the free
      tokens less only the immediate part (``ceil_B(extend) + block_size``) of every chunk
      continued or admitted in this round (no output reserved);
    * then SGLang simulates the requests' growth: ``states`` — the candidate, the running
      requests and those continued or admitted in this round (each ``(max_tokens x r -
      outputs, prompt + outputs)``, r = 1 when it ignores EOS, else new_token_ratio), sorted
      by tokens left when the round's first such candidate is tested, later candidates
      inserted (:func:`insert_eos_state`).  Going through them shortest first, with k = the
      requests not yet finished, ``cur_rem - paged + freed - left_i x k`` must stay above
      ``IGNORE_EOS_RESERVE_TOKENS x k``, ``freed`` summing the tokens the finished ones held.

    Why: an ignore_eos request will produce every one of its max_tokens, so SGLang checks that
    the batch can grow to the end with each request finishing in turn, plus a token of slack
    per request for corner cases.  The refusal holds admission like ESTIMATE.ADMIT's.
    **Not copied**: a request that would run ``alone`` (nothing running, nothing continued or
    admitted in this round) skips the simulation.  SGLang clips max_tokens at arrival so that
    such a request leaves exactly the reserve, and its ``<=`` then refuses it in every step
    while nothing runs: it waits forever (docs/findings/sglang-ignore-eos-no-cache-stall.md)."""
    if paged > min(cur_rem, rem):
        return False
    if alone:
        return True
    left, freed, n = cur_rem - paged, 0, len(states)
    for i, (tokens_left, held) in enumerate(states):
        k = n - i
        if left + freed - tokens_left * k <= IGNORE_EOS_RESERVE_TOKENS * k:
            return False
        freed += held
    return True


@rule("ESTIMATE.RATIO", knobs=("new_token_ratio_init", "new_token_ratio_min_factor", "new_token_ratio_decay_steps",
                               "retract_decode_steps"))
def next_ratio(ratio: float, retracted: bool, remaining: list[Request], cfg: SchedulerConfig) -> float:
    """The new_token_ratio after a step whose running phase served running requests:

    * no retraction: ``max(ratio - decay, min)`` with ``min = init x min_factor``
      and ``decay = (init - min) / decay_steps`` (SGLang: 0.7, 0.098, 600 steps);
    * a retraction: ``min(1, (sum outputs + retract_decode_steps x n) / (sum max_tokens + 1))``
      over the n requests still running (max_tokens as cut at arrival, ARRIVE.CLIP_MAX_TOKENS;
      SGLang's estimate_new_token_ratio_after_retract adds 1 against a zero division) — the
      ratio jumps back up so that admission turns cautious again.

    The update happens right after the running phase, so that step's admissions
    (continuous batching) already use the new value.  A step that runs no running
    phase (a prefill-first step that admitted) leaves the ratio alone.
    It starts at ``init`` and is reset to ``init`` whenever the engine becomes empty
    — a step ends, or an abort leaves, with nothing running, waiting or swapped
    (SGLang resets it when the scheduler goes idle).  As the
    engine keeps decoding without running out, the ratio falls and admission grows
    bolder: outputs usually stop well before max_tokens.
    """
    if not retracted:
        return max(ratio - cfg.new_token_ratio_decay, cfg.new_token_ratio_min)
    if not remaining:
        return ratio
    outputs = sum(len(r.output_token_ids) for r in remaining)
    return min(1.0, (outputs + cfg.retract_decode_steps * len(remaining)) / (sum(r.max_tokens for r in remaining) + 1))


@rule("ESTIMATE.HOLD_UNTIL_DEPARTURE", knobs=("admission_hold",), applies=bool)
def admission_still_held(held: frozenset[str], requests: dict, running: list[Request], cut_continues: bool) -> bool:
    """Under admission_hold="until-departure", once ESTIMATE.ADMIT has refused the queue head in
    a step that began with requests running (a prefill continued in the step not counted), no
    waiting request is tested again (nobody is admitted) until one of ``held`` — the running
    requests as of the last step — has left the running list (finished, aborted or
    retracted), the engine runs empty, or a prefill the previous step cut continues.  This is SGLang's
    running_batch.batch_is_full: set on the running batch when add_one_req answers NO_TOKEN,
    cleared only when that batch shrinks (the merge of a prefill batch that leaves the
    chunked request out included); set on an empty running batch it is lost when the next
    prefill batch replaces it.  Memory that frees up as the ratio decays admits nobody
    meanwhile; a finishing request reopens admission.  Returns whether admission stays held."""
    if not running or cut_continues:
        return False
    return all(rid in requests and requests[rid].status == Status.RUNNING for rid in held)


@rule("VTC.CHARGE", knobs=("vtc_input_price", "vtc_output_price", "tenant_weights"))
def vtc_cost(req: Request, start: int, n: int, cfg: SchedulerConfig) -> float:
    """Under "vtc" every scheduled chunk charges its tenant's counter, at the moment it
    is scheduled: ``(input_price x prompt tokens computed + output_price x output
    tokens computed) / weight``, positions below the prompt length being prompt tokens.

    So a decode costs ``output_price``, a prefill ``input_price`` per token, and
    recomputing after a preemption is charged again (it is work done again).  The
    running phase's chunks are charged together when that phase ends (so a victim's
    given-back tokens are never charged), in running-list order; each admission or
    swap-in is charged as it is made, so the next pick already sees it.  The
    counter measures service received; admission always serves the tenant with the
    least (rule VTC.PICK), which is what bounds the service gap between tenants.
    """
    prompt = max(0, min(start + n, len(req.prompt_token_ids)) - start)
    return cfg.vtc_input_price * prompt + cfg.vtc_output_price * (n - prompt)


@rule("SAMPLE.SCRIPTED")
def scripted_token(source: TraceRequest, index: int, vocab_size: int, eos_token_id: int | None) -> int:
    """The token output ``index`` of a request samples when no model runs (the spec on its own,
    a scheduler-only engine): the trace's ``output_tokens`` first, then the synthetic rule
    ``crc32("<id>#out<index>")``; among the first ``min_tokens`` outputs EOS (unless
    ``ignore_eos``) and the stop token ids are masked, as vLLM's min-tokens logits processor
    masks them in its sampler.

    Token values reach scheduling only through stop conditions and prefix hashes, and an
    engine with a model samples its own (the replay feeds them to the spec).  An engine that
    samples this script must sample exactly it: a sampler that reads the wrong output index,
    or whose stop-token mask ends one output early or late (real sampler bugs), otherwise
    moves a stop without any scheduling decision showing it."""
    return source.output_token(index, vocab_size, eos_token_id)


@rule("STOP.EOS", applies=bool)
def stopped_by_eos(req: Request, token: int) -> bool:
    """Sampling the EOS token finishes the request, unless it ignores EOS."""
    return req.eos_token_id is not None and token == req.eos_token_id


@rule("STOP.STOP_TOKEN", applies=bool)
def stopped_by_stop_token(req: Request, token: int) -> bool:
    """Sampling one of the request's stop token ids finishes it."""
    return token in req.stop_token_ids


@rule("STOP.LENGTH", knobs=("max_model_len",), applies=bool)
def length_capped(req: Request, cfg: SchedulerConfig) -> str | None:
    """A request finishes when its sequence reaches ``max_model_len`` tokens or its
    output reaches ``max_tokens`` (vLLM checks these after EOS and stop tokens)."""
    if req.num_tokens >= cfg.max_model_len:
        return FINISH_MAX_MODEL_LEN
    if len(req.output_token_ids) >= req.max_tokens:
        return FINISH_MAX_TOKENS
    return None


def check_stop(req: Request, token: int, cfg: SchedulerConfig) -> str | None:
    """vLLM's ``check_stop`` order: EOS, stop tokens, then length."""
    if stopped_by_eos(req, token):
        return FINISH_EOS
    if stopped_by_stop_token(req, token):
        return FINISH_STOP_TOKEN
    return length_capped(req, cfg)


@rule("ADMIT.RESERVE_FULL", knobs=("kv_reservation",), applies=bool)
def reservation(req: Request, cfg: SchedulerConfig) -> int:
    """Under kv_reservation="full", admission allocates blocks for the request's whole
    life at once: ``min(prompt + max_tokens - 1, max_model_len - 1)`` slots.

    A running request then never needs another block, so nothing is ever preempted
    (Orca, TGI, TensorRT-LLM GUARANTEED_NO_EVICT) — at the price of memory held for
    tokens that may never be generated.  Returns 0 under "step" (vLLM's per-step
    allocation, where ADMIT.FULL_SEQUENCE is the admission gate instead).
    """
    if cfg.kv_reservation != "full":
        return 0
    return min(len(req.prompt_token_ids) + req.max_tokens - 1, cfg.max_model_len - 1)


def admit_stop_word(check: str) -> str:
    """The ``admit_stop`` word (spec.formats.ADMIT_STOPS) an admission check's refusal logs:
    ``whole`` for the no-chunking tests, ``first`` for ADMIT.CHUNK_ONLY_FIRST, ``estimate`` for
    SGLang's memory estimate.  Engines log the gate they stopped at in these words, so that a
    report can name the gate an engine stopped at too early, not the admission it then missed."""
    if check.startswith("ESTIMATE."):
        return "estimate"
    return "first" if check == "ADMIT.CHUNK_ONLY_FIRST" else "whole"


@rule("BATCH.PREFILL_FIRST", knobs=("batching",))
def prefill_batch_first(running: list[Request], out: SchedulerOutput, scheduled: dict[str, int]) -> None:
    """Under batching="prefill-first", a step that admits anybody is a prefill-only
    batch: the running requests skip it and decode again only in a step that admits
    nobody (vLLM V0, TGI).  New requests start sooner; running ones stall meanwhile.
    Under prefill_chunking="first-continues" a step that continues a cut prefill is a
    prefill batch too (nano-vllm)."""
    for req in running:
        if req.request_id not in scheduled:
            out.reasons.append(reason("BATCH.PREFILL_FIRST", req.request_id, "waits: this step is a prefill batch"))


@rule("ADMIT.RESERVE_SEQUENCE", knobs=("kv_reservation",))
def sequence_reservation(req: Request) -> int:
    """Under kv_reservation="sequence", admission allocates blocks for the request's whole
    current sequence (prompt plus any outputs so far) at once, even when the budget lets
    it compute only a chunk now; decode tokens get blocks as they come.

    So a cut prefill never needs another block before it completes, and admission fails
    (head-of-line) unless the free queue holds them all (nano-vllm's can_allocate and
    allocate: ``num_blocks`` of the sequence minus the prefix hits already in use).
    """
    return req.num_tokens


@rule("BATCH.STATIC", knobs=("batching",))
def static_batch_busy(waiting, out: SchedulerOutput) -> None:
    """Under batching="static", requests are admitted only into an empty engine; while
    any of the batch is still running nobody joins, even when memory and budget are free."""
    if len(waiting):
        out.reasons.append(reason("BATCH.STATIC", waiting.peek().request_id, "waits: the current static batch is still running"))


BUDGET_EXHAUSTED = declare(
    "BUDGET.EXHAUSTED",
    """A step schedules nothing more once its token budget is spent: the running
    requests not reached yet wait for the next step (neither scheduled nor
    preempted), and no waiting request is admitted.""",
    __name__,
    knobs=("max_num_batched_tokens",),
)
RUN_DECODE = declare("RUN.DECODE", "A running request whose prompt is computed decodes one token.", __name__)
RUN_PREFILL = declare(
    "RUN.PREFILL_CHUNK",
    "A running request whose prompt is not yet computed continues its prefill with the next chunk.",
    __name__,
    knobs=("enable_chunked_prefill", "max_num_batched_tokens", "long_prefill_token_threshold"),
)
RUN_ORDER = declare(
    "RUN.RUNNING_FIRST",
    """Each step serves the running requests first, in admission order, then admits
    waiting ones with what is left of the budget (vLLM V1, Sarathi).  Decodes and
    prefill chunks are not separate phases: each request just catches up its
    computed tokens.""",
    __name__,
    fires=False,
)
RUN_NO_BLOCKS = declare(
    "RUN.PREEMPT_FOR_BLOCKS",
    """When a running request cannot get the blocks for this step, requests are
    preempted (by the victim rule) until it can; if it is itself the victim, the
    running phase ends (under "priority" with priority_self_preempt=continue, it
    goes on with the next running request).""",
    __name__,
    knobs=("policy", "priority_self_preempt"),
)
PREEMPT_RECOMPUTE = declare(
    "PREEMPT.RECOMPUTE",
    """A preempted request frees all its blocks, forgets its computed tokens (it
    keeps its outputs) and goes back to the waiting queue; when resumed it
    recomputes prompt and outputs, re-using whatever is still in the prefix cache.""",
    __name__,
    knobs=("preemption_mode",),
)
SWAP_OUT = declare(
    "SWAP.OUT",
    """Under preemption_mode="swap", a victim's computed KV is copied to the CPU pool:
    it takes ``ceil(computed / block_size)`` CPU blocks (computed as of the start of
    the step: tokens it was scheduled in this step are given back), frees all its GPU blocks
    (cached ones stay hit-able in the free queue), keeps its computed tokens and
    joins the swapped queue.  Swapping costs a copy over PCIe instead of recomputing
    the whole sequence (vLLM V0 _preempt_by_swap).""",
    __name__,
    knobs=("preemption_mode", "num_cpu_blocks"),
)
SWAP_FALLBACK = declare(
    "SWAP.FALLBACK_RECOMPUTE",
    """When the CPU pool has fewer free blocks than a victim needs, the victim is
    preempted by recompute instead (rule PREEMPT.RECOMPUTE).  vLLM V0 raises
    "Aborted due to the lack of CPU swap space" here; the spec cannot crash, and
    waiting is no option: the running request needs GPU memory now, and CPU blocks
    are freed only by swap-ins, which need GPU memory too.  Recompute is what V0
    itself does for single-sequence groups by default.""",
    __name__,
    knobs=("preemption_mode", "num_cpu_blocks"),
)
SWAP_IN = declare(
    "SWAP.IN",
    """After the running phase of a step that preempted nobody, swapped requests are
    swapped back in, in arrival order (by (priority, arrival, id) under "priority"),
    before any waiting request is admitted: each needs fresh GPU blocks for its
    computed tokens plus this step's chunk (chunk = BUDGET.TOKENS of what it still
    lacks, usually 1 decode token), under the same gates as an admission (its whole
    sequence when scheduler_reserve_full_isl; the watermark when others run; no
    prefix-cache lookup), frees its CPU blocks, rejoins the running list's tail
    (listed in both ``resumed`` and ``swapped_in``) and computes the chunk in the same
    step.  The first that does not fit, or meets a spent budget or max_num_seqs,
    stops the swap-ins (vLLM V0 _schedule_swapped: swapped before waiting, FCFS).
    Under prefill-first batching a step with swapped requests is never a prefill
    step: the running requests decode, then the swap-ins follow.""",
    __name__,
    knobs=("preemption_mode",),
)
SWAP_BEFORE_WAITING = declare(
    "SWAP.BEFORE_WAITING",
    """No waiting request is admitted while any request is swapped out: swapped
    requests already hold work and come first (vLLM V0 schedules prefills only when
    the swapped queue is empty).""",
    __name__,
    knobs=("preemption_mode",),
)
RETRACT_TO_TAIL = declare(
    "RETRACT.TO_TAIL",
    """Under admission="estimate" a retracted request is preempted by recompute (its
    prefix stays cached) and joins the *tail* of the waiting queue, as SGLang's
    _add_request_to_queue does (FCFS does not re-sort it); the retraction resets
    new_token_ratio (rule ESTIMATE.RATIO).""",
    __name__,
    knobs=("admission",),
)
ADMIT_AFTER_PREEMPT = declare(
    "ADMIT.NONE_AFTER_PREEMPT",
    """No waiting request is admitted in a step that preempted: memory was just
    found short, so a preempted request cannot come back in the same step.""",
    __name__,
    knobs=("admit_after_preempt",),
)
ADMIT_MAX_SEQS = declare(
    "ADMIT.MAX_NUM_SEQS",
    "Admission stops when max_num_seqs requests are running.",
    __name__,
    knobs=("max_num_seqs",),
)
ADMIT_MAX_ACTIVE = declare(
    "ADMIT.MAX_NUM_ACTIVE_SEQS",
    """Admission stops when max_num_active_seqs requests are running, when it is set
    (below max_num_seqs): vLLM's admission limit into RUNNING, separate from max_num_seqs,
    which sizes the model runner.  Requests already running are never limited by it.""",
    __name__,
    knobs=("max_num_active_seqs",),
)
ADMIT_NO_CHUNKING = declare(
    "ADMIT.NO_CHUNKING",
    """With chunked prefill off, a waiting request whose tokens exceed the remaining
    budget blocks admission (head-of-line) until a step has room for all of them.""",
    __name__,
    knobs=("enable_chunked_prefill",),
)
ADMIT_NO_CHUNKING_EXCLUSIVE = declare(
    "ADMIT.NO_CHUNKING_EXCLUSIVE",
    """Under no_chunking_cap="exclusive", with chunked prefill off, a waiting request that is
    not the first of the step's batch must leave part of the token budget: it stops admission
    (head-of-line) when its tokens (after its prefix hit) are at least the budget left, and it
    is tested after the memory estimate (SGLang's _select_prefill_admission refuses
    ``input_tokens >= rem_input_tokens`` once the batch holds a request, after
    _check_prefill_budget; so a request both refuse holds admission, ESTIMATE.HOLD_UNTIL_DEPARTURE).
    The first request needs only to fit the budget.""",
    __name__,
    knobs=("enable_chunked_prefill", "no_chunking_cap"),
)
ADMIT_CHUNK_ONLY_FIRST = declare(
    "ADMIT.CHUNK_ONLY_FIRST",
    """Under prefill_chunking="first-continues", only the first request of a step's prefill
    batch may be cut by the token budget: a later request whose tokens (after its prefix
    hit) exceed what is left of the budget stops admission (head-of-line), as nano-vllm's
    "only allow chunked prefill for the first seq" does.""",
    __name__,
    knobs=("prefill_chunking",),
)
RUN_CONTINUE_PREFILL = declare(
    "RUN.CONTINUE_PREFILL_FIRST",
    """Under prefill_chunking="first-continues" or "last-continues", a prefill cut by the budget
    in the previous step is continued first, before any admission: it takes the tokens it
    still lacks, cut to the budget, and the step is a prefill batch (nano-vllm keeps the cut
    request at the head of its waiting queue, holding its blocks; SGLang adds its chunked_req
    to the prefill batch before the waiting queue).  Under kv_reservation="step" it allocates
    its chunk's blocks now; when they are not free it is not continued in this step.""",
    __name__,
    knobs=("prefill_chunking",),
)
BATCH_SEQS_PER_STEP = declare(
    "BATCH.MAX_NUM_SEQS_PER_STEP",
    """Under max_num_seqs_scope="step", max_num_seqs bounds the requests scheduled in one
    step, not the requests running: a prefill batch admits at most max_num_seqs requests
    (a continued prefill counts), and a decode step serves the first max_num_seqs running
    requests while the rest wait, neither scheduled nor preempted (nano-vllm).""",
    __name__,
    knobs=("max_num_seqs", "max_num_seqs_scope"),
)
ADMIT_NEW = declare("ADMIT.NEW", "A waiting request that fits is admitted and joins the running list's tail.", __name__)
ADMIT_RESUMED = declare(
    "ADMIT.RESUMED", "A preempted request that fits is resumed: it recomputes prompt and outputs.", __name__
)
ARRIVE = declare("ARRIVE.QUEUED", "An arriving request that can be served joins the waiting queue.", __name__)
ABORT = declare(
    "ABORT.FREE",
    "An aborted waiting or running request leaves its queue and frees its blocks at once; aborts of finished requests are ignored.",
    __name__,
    knobs=("abort_running",),
)
ABORT_AFTER_SAMPLE = declare(
    "ABORT.AFTER_NEXT_SAMPLE",
    """Under abort_running="after-next-sample" an aborted running request is reported aborted
    at once but stays in the running list, holding its blocks, until it samples once more
    (scheduled as usual); it is freed with that step's result, in batch order among the
    requests that finish in that step, not listed as finished, and no stop rule is applied to
    that token.  SGLang's abort_request sets ``to_finish = FINISH_ABORT`` on a running request
    ("it will still run one decode forward pass"), and the batch's results are applied request
    by request, each finished one (an abort is one more finish reason) released in its turn.
    Waiting requests still leave at once (ABORT.FREE).""",
    __name__,
    knobs=("abort_running",),
)
ABORT_CUT_PREFILL = declare(
    "ABORT.CUT_PREFILL_AT_ONCE",
    """Under abort_running="after-next-sample", an aborted running request whose prefill the last
    step cut (it would be continued next, RUN.CONTINUE_PREFILL_FIRST) is freed at once, as a
    waiting request is (ABORT.FREE): it computes no more chunks and samples nothing.  SGLang's
    abort_request only marks its in-flight chunked_req, and process_pending_chunked_abort frees it
    at the top of the next scheduling step, before the chunk would launch (scheduler.py 3778-3823
    in 0.5.23); only a request that has sampled runs once more (ABORT.AFTER_NEXT_SAMPLE).""",
    __name__,
    knobs=("abort_running",),
)
WAIT_QUEUED = declare(
    "WAIT.QUEUED",
    """Admission takes the queue head only: when the head cannot be admitted, every
    request behind it stays queued (no skipping: an earlier arrival is never passed).""",
    __name__,
    knobs=("policy",),
)


# --------------------------------------------------------------------------
# The engine.
# --------------------------------------------------------------------------


class SpecEngine:
    """The specification as an engine (the protocol of :mod:`spec.protocol`).

    ``check_invariants=True`` checks every predicate of :mod:`spec.invariants`
    after each step.  ``trace_queue=True`` adds a WAIT.QUEUED reason for every
    request left waiting (for ``batchspec explain``).

    For long simulations (:mod:`spec.simulate`), three options make steps
    cheaper without changing any decision: ``record_level`` ("exact", "memory"
    or "decisions") leaves out the record fields above that level (per-step
    block tables); ``record_reasons=False`` writes no reasons (``record.reasons``
    is None, and the per-step RUN.* / BUDGET.EXHAUSTED reasons are not even
    built); ``prompt_cache`` (a dict the caller keeps across engines) re-uses
    each synthesized prompt and its block hashes instead of rebuilding them.
    ``record_state`` (default: as ``record_reasons``) writes the optional state fields
    of :data:`spec.formats.STATE_FIELDS` (computed tokens, VTC counters, the estimate's
    remaining tokens, cache registrations and hit blocks), which the differ compares.
    """

    name = "spec"

    def __init__(
        self,
        config: SchedulerConfig,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        eos_token_id: int = DEFAULT_EOS_TOKEN_ID,
        check_invariants: bool = False,
        trace_queue: bool = False,
        record_level: str = "exact",
        record_reasons: bool = True,
        prompt_cache: dict | None = None,
        record_state: bool | None = None,
    ):
        if record_level not in LEVELS:
            raise ValueError(f"record_level must be one of {', '.join(LEVELS)}, got {record_level!r}")
        self.config = config
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.check_invariants = check_invariants
        self.trace_queue = trace_queue
        self.record_level = record_level
        self.record_reasons = record_reasons
        self.prompt_cache = prompt_cache
        self.kv = KVCacheManager(config)
        self.record_state = record_reasons if record_state is None else record_state
        if self.record_state:
            self.kv.registered = {}
        self.clock = 0  # steps executed so far: the number of the step being scheduled
        self.waiting = make_queue(config.policy, config.aging_steps, self._now, config.weights())
        self.vtc = config.policy == "vtc"
        self.running: list[Request] = []
        self.swapped: list[Request] = []  # preempted by swap, in swap-in order (rule SWAP.IN)
        self.cpu_free = config.num_cpu_blocks
        self.cpu_blocks: dict[str, int] = {}  # swapped request -> CPU blocks it holds
        self.new_token_ratio = config.new_token_ratio_init  # admission="estimate" (rule ESTIMATE.RATIO)
        self.plan_hold = config.admission_hold == "until-departure"
        self.hold: frozenset[str] | None = None  # ESTIMATE.HOLD_UNTIL_DEPARTURE: the batch when the head was refused
        self._compose(step_plan(config))
        self.requests: dict[str, Request] = {}
        self.rejected: dict[str, str] = {}
        self._fed: dict[str, int] | None = None
        self._last: SchedulerOutput | None = None
        self.in_flight: list | None = None  # async scheduling: the sampled tokens of the batch in flight
        self._last_record: StepRecord | None = None  # async scheduling: its step number names outputs_step
        self.previous: SchedulerOutput | None = None  # the last step's decisions
        self._begin_step()

    def _now(self) -> int:
        return self.clock

    def _compose(self, plan) -> None:
        """Bind the plan's phases and rule choices (:func:`spec.config.step_plan`) to this engine."""
        self.plan = plan
        by_phase = {getattr(m, "phase_name", None): name for name, m in vars(SpecEngine).items()}
        self.phases = [getattr(self, by_phase[p]) for p in plan.phases]
        checks = {"ADMIT.NO_CHUNKING": self._check_no_chunking, "ADMIT.CHUNK_ONLY_FIRST": self._check_chunk_only_first,
                  "ESTIMATE.ADMIT": self._check_estimate, "ESTIMATE.IGNORE_EOS_RESERVE": self._check_estimate,
                  "ADMIT.NO_CHUNKING_EXCLUSIVE": self._check_no_chunking_exclusive}
        #: ESTIMATE.IGNORE_EOS_RESERVE tests the ignore_eos candidates in place of ESTIMATE.ADMIT
        self.eos_reserve = "ESTIMATE.IGNORE_EOS_RESERVE" in plan.admission_checks
        #: (the admit_stop word each check logs when it refuses the head)
        self.admission_checks = [(admit_stop_word(c), checks[c]) for c in plan.admission_checks]
        self.seqs_full = self._step_full if plan.room == "BATCH.MAX_NUM_SEQS_PER_STEP" else self._running_full
        self.allocate_admission = {"ADMIT.RESERVE_FULL": self._allocate_reserved,
                                   "ADMIT.RESERVE_SEQUENCE": self._allocate_sequence}.get(plan.reservation,
                                                                                           self._allocate_step)
        self.free_victim = self._preempt_by_swap if plan.preempt == "SWAP.OUT" else self._preempt_by_recompute
        self._free_planned = self.free_victim  # (CACHE.EVICT_ON_RETRACT wraps it below)
        self.requeue = self._requeue_tail if plan.requeue == "RETRACT.TO_TAIL" else self.waiting.prepend
        self.on_schedule = [self._charge] if "VTC.CHARGE" in plan.on_schedule else []
        refusals = {"REJECT.PROMPT_TOO_LONG": self._refuse_prompt_too_long, "REJECT.NEVER_FITS": self._refuse_never_fits,
                    "REJECT.INPUT_LIMIT": self._refuse_input_limit}
        self.refusals = [refusals[r] for r in plan.refusals]
        shapes = {"ARRIVE.CLIP_MAX_TOKENS": self._clip_max_tokens, "STOP.IGNORE_EOS_SCOPE": self._ignore_stop_tokens}
        self.on_arrival = [shapes[r] for r in plan.on_arrival]
        clipped = "ARRIVE.CLIP_MAX_TOKENS" in plan.on_arrival
        stop = self._check_stop_clipped if clipped else (lambda req, token: check_stop(req, token, self.config))
        #: the stop rules for a sampled token; run on each step's batch after its outputs are applied
        self.check_stop, self.after_outputs = stop, []
        if plan.abort_running == "ABORT.AFTER_NEXT_SAMPLE":  # no stop rule for the token it samples when aborted
            self.check_stop = lambda req, token: None if req.abort_pending else stop(req, token)
        estimate = self.config.admission == "estimate"
        #: run when a step ends or an abort leaves the engine (the ratio's reset when idle)
        self.on_idle = [self._reset_ratio] if estimate else []
        #: run on each step's batch once it is computed (CACHE.REGISTER_WHEN_COMPUTED)
        self.on_computed = [self._register_computed] if self.config.cache_register == "computed" else []
        asynchronous = plan.outputs == "ASYNC.OUTPUTS_NEXT_STEP"
        #: tests that keep a running request out of the step (ASYNC.LAST_TOKEN_IN_FLIGHT)
        self.running_checks = [RUNNING_CHECKS[c] for c in plan.running_checks]
        #: one step: schedule, then apply this step's outputs (sync) or the previous step's (async)
        self.run_step = self._step_async if asynchronous else self._step_sync
        #: run on each step's batch once decided (ASYNC.PLACEHOLDER) and on each preempted request
        self.after_schedule = [self._add_placeholders] if asynchronous else []
        self.on_preempt = [async_sched.zero_placeholders] if asynchronous else []
        self._compose_speculative(plan)
        self._touch_rounds = 0  # CACHE.TOUCH_WAITING: admission rounds that reached the queue's ordering
        if self.config.cache_register == "prefill-and-finish":  # CACHE.REGISTER_PREFILL_AND_FINISH
            self.on_computed, self._prefilled, self._cut, self._continued = [self._note_prefills], set(), [], set()
            self.verify_drafts.append(self._register_at_output)
            self.after_outputs.append(self._note_cut_prefills)
        if self.config.cache_eviction == "leaf-lru" and plan.requeue == "RETRACT.TO_TAIL":
            self.free_victim = self._retract_evicting  # CACHE.EVICT_ON_RETRACT
        #: record fields only some configurations have
        self.record_extras = ([self._record_cpu_pool] if plan.preempt == "SWAP.OUT" else []) + \
            ([self._record_ratio] if estimate else [])

    def _compose_speculative(self, plan) -> None:
        """Bind the plan's SPEC.* rules (:func:`spec.config.speculative_rules`); without
        speculative decoding every hook is empty and a step applies one token per sampler."""
        rules = set(plan.speculative)
        self.num_spec = self.config.num_speculative_tokens if rules else 0
        #: run on a running request just scheduled ``n`` tokens (SPEC.DRAFT_SCHEDULE)
        self.on_run_scheduled = [self._schedule_drafts] if "SPEC.DRAFT_SCHEDULE" in rules else []
        #: size a waiting request's chunk before the budget cuts it (SPEC.PAD_ADMISSION)
        self.admission_sizes = [self._pad_admission] if "SPEC.PAD_ADMISSION" in rules else []
        if "SPEC.ACCEPT" in rules:
            self.after_schedule.append(self._number_verifications)
        if "SPEC.ASYNC_DRAFT_PLACEHOLDERS" in rules:
            self.after_schedule.append(self._draft_placeholders)
        #: run on a sampler's output after its first token: verified drafts (SPEC.ROLLBACK), then
        #: the blocks they filled cached (SPEC.CACHE_AT_OUTPUT)
        self.verify_drafts = ([self._verify_drafts] if "SPEC.ROLLBACK" in rules else []) + \
            ([self._cache_at_output] if "SPEC.CACHE_AT_OUTPUT" in rules else [])
        #: run on each request still running after its output was applied (SPEC.PROPOSE)
        self.after_output = [self._propose] if "SPEC.PROPOSE" in rules else []
        if "SPEC.PREEMPT_DISCARDS" in rules:
            self.on_preempt.append(specdec.discard_drafts)
        self._accepted: dict[str, int] = {}  # drafts accepted among the outputs this step applied
        self.decision_extras = [self._record_drafts] if rules else []

    @classmethod
    def from_trace(cls, trace: Trace, **kw) -> "SpecEngine":
        return cls(resolve(trace.config), trace.vocab_size, trace.eos_token_id, **kw)

    def _begin_step(self) -> None:
        self._aborted: list[str] = []
        self._rejected: list[tuple[str, str]] = []
        self._reasons: list[dict] = []
        self._lifts: dict[str, float] = {}  # policy="vtc": tenant -> its counter after this step's VTC.LIFT

    # -- protocol --------------------------------------------------------

    def add_request(self, tr: TraceRequest) -> None:
        if tr.id in self.requests or tr.id in self.rejected:
            raise ValueError(f"duplicate request id {tr.id!r}")
        cfg = self.config
        why = next(filter(None, (refuse(tr) for refuse in self.refusals)), None)
        if why:
            self.rejected[tr.id] = why[1]
            self._rejected.append((tr.id, why[1]))
            self._reasons.append(reason(why[0], tr.id, why[2]))
            return
        prompt, hashes = self._prompt(tr)
        shape = {"max_tokens": tr.max_tokens, "stop_token_ids": frozenset(tr.stop_token_ids)}
        for hook in self.on_arrival:
            hook(tr, shape)
        req = Request(
            request_id=tr.id,
            prompt_token_ids=prompt,
            arrival_seq=len(self.requests) + len(self.rejected),
            priority=tr.priority,
            eos_token_id=None if tr.ignore_eos else self.eos_token_id,
            **shape,
            source=tr,
            block_size=cfg.block_size,
            block_hashes=list(hashes),
            arrival_step=self.clock,
            skip_prefix_cache=tr.skip_prefix_cache,
            cache_salt=tr.cache_salt,
            tie_time=tr.tie_time(len(self.requests) + len(self.rejected)),
            **self._slo_fields(tr),
        )
        self.requests[tr.id] = req
        self.waiting.add(req)
        what = f"queued ({cfg.policy}), {len(self.waiting)} waiting"
        if self.vtc:
            what += f"; tenant {tr.tenant!r} counter {self.waiting.counters[tr.tenant]:g}"
        self._reasons.append(reason(ARRIVE, tr.id, what))
        # (a counter bug there is a VTC.LIFT bug, not a charge's; a lift that moved nothing decided nothing)
        if self.vtc and self.waiting.lifted is not None:  # (logged state: the lift as tested, moved or not)
            self._lifts[self.waiting.lifted[0]] = self.waiting.lifted[2]
        if self.vtc and self.waiting.lifted is not None and self.waiting.lifted[1] != self.waiting.lifted[2]:
            tenant, before, after = self.waiting.lifted
            self._reasons.append(reason("VTC.LIFT", tr.id, f"tenant {tenant!r} was not backlogged: counter "
                                        f"{before:g} -> {after:g}", tenant=tenant))

    # -- arrival rules (chosen by the plan: StepPlan.refusals, StepPlan.on_arrival) --------

    def _refuse_prompt_too_long(self, tr: TraceRequest) -> tuple[str, str, str] | None:
        if prompt_too_long(tr.prompt_len, self.config):
            return ("REJECT.PROMPT_TOO_LONG", "prompt_too_long",
                    f"prompt {tr.prompt_len} + 1 > max_model_len {self.config.max_model_len}")
        return None

    def _refuse_never_fits(self, tr: TraceRequest) -> tuple[str, str, str] | None:
        if never_fits(tr.prompt_len, tr.max_tokens, self.config):
            return ("REJECT.NEVER_FITS", "never_fits", f"needs more than the {self.config.usable_blocks} usable blocks")
        return None

    def _refuse_input_limit(self, tr: TraceRequest) -> tuple[str, str, str] | None:
        why = input_limit(tr.prompt_len, self.config)
        if not why:
            return None
        limit = length_capacity(self.config) - INPUT_LIMIT_MARGIN
        if tr.prompt_len >= limit:  # (the text names the test that refused it)
            text = f"prompt {tr.prompt_len} >= min(max_model_len, pool) - {INPUT_LIMIT_MARGIN} = {limit}"
        else:
            text = (f"prompt {tr.prompt_len} leaves room for {output_room(tr.prompt_len, self.config)} output "
                    f"tokens in {self.config.block_size}-token blocks (at least 1 needed)")
        return ("REJECT.INPUT_LIMIT", why, text)

    def _clip_max_tokens(self, tr: TraceRequest, shape: dict) -> None:
        shape["max_tokens"], cut = clipped_max_tokens(tr.prompt_len, shape["max_tokens"], self.config)
        if cut:
            self._reasons.append(reason("ARRIVE.CLIP_MAX_TOKENS", tr.id, f"max_tokens {tr.max_tokens} cut to "
                                                                         f"{shape['max_tokens']}"))

    def _ignore_stop_tokens(self, tr: TraceRequest, shape: dict) -> None:
        shape["stop_token_ids"] -= ignored_stop_tokens(tr.ignore_eos, shape["stop_token_ids"])

    def _check_stop_clipped(self, req: Request, token: int) -> str | None:
        """ARRIVE.CLIP_MAX_TOKENS: a request that reaches a max_tokens cut at arrival finishes
        with reason max_model_len (it did not get the max_tokens it asked for)."""
        why = check_stop(req, token, self.config)
        if why == FINISH_MAX_TOKENS and req.max_tokens < req.source.max_tokens:
            return FINISH_MAX_MODEL_LEN
        return why

    def _free_abort_pending(self, req: Request) -> bool:
        """ABORT.AFTER_NEXT_SAMPLE: a running request the client aborted is freed with the result
        of the first step it samples in since, in batch order with the requests that finish in
        that step (SGLang releases each request of a batch's result in turn, an abort being one
        more finish reason); not listed as finished.  Whether it was freed now."""
        if req.status != Status.RUNNING:
            return False
        self._finish(req, Status.ABORTED, None)
        return True

    def _slo_fields(self, tr: TraceRequest) -> dict:
        """A request's targets in steps (SLO.TARGET_STEPS) and its predicted output length."""
        timed, step_s = tr.arrival_time is not None, self.config.slo_step_s
        return {"ttft_deadline": ttft_deadline(self.clock, target_steps(tr.ttft_slo, timed, step_s)),
                "tpot_steps": target_steps(tr.tpot_slo, timed, step_s), "predicted_output": tr.predicted_output_len}

    def _prompt(self, tr: TraceRequest) -> tuple[list[int], list[bytes]]:
        """The prompt's token ids and the hashes of its full blocks (none yet without a cache:
        ``Request`` hashes them).  With ``prompt_cache``, both are computed once per
        request content and shared (never mutated) by every engine that uses the cache."""
        if self.prompt_cache is None:
            return tr.prompt_token_ids(self.vocab_size), []
        key = (tr.id, tr.prompt, tr.prompt_len, tr.prefix_group, tr.prefix_len, self.vocab_size, self.config.block_size,
               tr.cache_salt)
        if key not in self.prompt_cache:
            ints = self.prompt_cache.setdefault("token ints", list(range(self.vocab_size)))  # one int object per id:
            prompt = [ints[t] if t < len(ints) else t for t in tr.prompt_token_ids(self.vocab_size)]  # 8 bytes a token
            probe = Request(tr.id, prompt, 1, 0, 0, None, frozenset(), tr, self.config.block_size, cache_salt=tr.cache_salt)
            self.prompt_cache[key] = (prompt, probe.block_hashes)
        return self.prompt_cache[key]

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.status not in (Status.WAITING, Status.PREEMPTED, Status.RUNNING, Status.SWAPPED):
            return
        if req.abort_pending:  # already aborted (ABORT.AFTER_NEXT_SAMPLE)
            return
        after_sample = req.status == Status.RUNNING and self.plan.abort_running == "ABORT.AFTER_NEXT_SAMPLE"
        rule_id = ABORT
        if after_sample and request_id in self.cut_prefills():  # freed at once, as a waiting request
            rule_id, after_sample = ABORT_CUT_PREFILL, False
        if after_sample:
            req.abort_pending = True  # freed with the result of the next step it samples in
            self._aborted.append(request_id)
            self._reasons.append(reason(ABORT_AFTER_SAMPLE, request_id, "aborted by the client; freed after it "
                                                                        "samples once more"))
            return
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.SWAPPED:
            self.swapped.remove(req)
            self.cpu_free += self.cpu_blocks.pop(request_id)
        else:
            self.waiting.remove(req)
        self._finish(req, Status.ABORTED, None)
        self._when_idle()
        self._aborted.append(request_id)
        self._reasons.append(reason(rule_id, request_id, "aborted by the client"))

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or bool(self.swapped)

    def feed(self, sampled: dict[str, int]) -> None:
        """Impose the tokens the next step samples (differential replay: the engine's)."""
        self._fed = dict(sampled)

    def step(self) -> StepRecord:
        return self.run_step()

    def _step_sync(self) -> StepRecord:
        """STEP.OUTPUTS_SAME_STEP: schedule, sample, apply the outputs."""
        out = self.schedule()
        fed, self._fed = self._fed or {}, None
        tokens = {rid: fed[rid] if rid in fed else self._synthetic_token(rid) for rid in out.samplers}
        return self.update_from_output(tokens)

    def _step_async(self) -> StepRecord:
        """ASYNC.OUTPUTS_NEXT_STEP: schedule this step, then apply the outputs of the batch
        in flight (the previous step's); this step's batch is in flight until the next."""
        out = self.schedule()
        self._last, self.previous = None, out
        fed, self._fed = self._fed or {}, None
        flight, self.in_flight = self.in_flight, async_sched.launch(self, out)
        reasons: list[dict] = []
        finished, took = async_sched.apply_outputs(self, flight or [], fed, reasons, self._accepted)
        out.reasons.extend(reasons)
        record = self._close_step(out, finished, took)
        record.outputs_step = self._last_record.step if self._last_record is not None else -1
        self._last_record = record
        return record

    def _add_placeholders(self, out: SchedulerOutput) -> None:
        for rid in out.samplers:
            async_sched.add_placeholder(self.requests[rid])

    def _synthetic_token(self, request_id: str) -> int:
        req = self.requests[request_id]
        return self.scripted(req, len(req.output_token_ids))

    def scripted(self, req: Request, index: int) -> int:
        """SAMPLE.SCRIPTED for ``req``'s output ``index`` (this engine's vocabulary and EOS)."""
        return scripted_token(req.source, index, self.vocab_size, self.eos_token_id)

    # -- schedule --------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch: run the configuration's phases top to bottom
        (``self.plan.phases``, see :func:`spec.config.step_plan`), then build the batch."""
        st = StepState(
            out=SchedulerOutput(),
            budget=self.config.max_num_batched_tokens,
            cap=self._long_prefill_cap(len(self.running) + len(self.waiting)),
            starved=not self.running and (len(self.waiting) > 0 or bool(self.swapped)),
            start={r.request_id: r.num_computed_tokens for r in self.running},
        )
        if self.config.long_prefill_token_threshold:  # the cap every phase of this step applies
            st.out.token_cap = st.cap
        for run_phase in self.phases:
            run_phase(st)
            if st.step_ends:
                break
        return self._finish_schedule(st.out, st.scheduled, st.start, st.starved)

    # -- phases, in the order the profiles use them --------------------------

    @phase("schedule_running")
    def _phase_running(self, st: StepState) -> None:
        """Serve the running requests in running-list order, each the tokens it still
        lacks within the budget (RUN.*, BUDGET.*), preempting by the plan's victim rule
        when blocks run out (RUN.PREEMPT_FOR_BLOCKS)."""
        st.ran = bool(self.running)
        st.budget = self._schedule_running(st.out, st.scheduled, st.budget, st.cap)

    @phase("retract_before_running")
    def _phase_retract_before_running(self, st: StepState) -> None:
        """SGLang: the running phase's whole demand is tested before it allocates; victims are
        retracted until it fits (RETRACT.BATCH_TEST), the survivors then in retraction order."""
        retracted = False
        while len(self.running) > 1:
            need, free = self._running_demand(st), self.kv.pool.num_free_blocks
            if batch_fits(need, free):
                break
            victim = pick_victim(self.plan.victim, self.running, self.clock)
            self.running.remove(victim)
            self._preempt(victim, st.out)
            st.out.reasons.append(reason(self.plan.victim, victim.request_id,
                                         f"retracted: the running requests need {need} blocks, {free} free"))
            retracted = True
        if retracted:
            self.running = retraction_order(self.running)

    def _running_demand(self, st: StepState) -> int:
        """The blocks the running phase would allocate now: its walk's grants, none allocated."""
        cfg, budget, count, need = self.config, st.budget, len(st.scheduled), 0
        for req in self.running:
            if budget <= 0 or count >= cfg.max_num_seqs:
                break
            if req.request_id in st.scheduled or (self.running_checks and any(c(req) for c in self.running_checks)):
                continue
            # (the rules' own functions, uncounted: the walk that follows applies them)
            n = model_len_cap.__wrapped__(chunk_size.__wrapped__(req.num_tokens_with_spec - req.num_computed_tokens,
                                                                 st.cap, budget), req.num_computed_tokens, cfg)
            if n > 0:
                need += self.kv.blocks_needed(req, n)
                budget -= n
                count += 1
        return need

    @phase("continue_prefill")
    def _phase_continue_prefill(self, st: StepState) -> None:
        """A prefill the budget cut in the previous step continues first, before any
        admission (RUN.CONTINUE_PREFILL_FIRST); its blocks were reserved at admission
        (ADMIT.RESERVE_SEQUENCE), or are allocated now for its chunk."""
        for rid in self.cut_prefills():
            req = self.requests[rid]
            n = chunk_size(req.num_tokens - req.num_computed_tokens, st.cap, st.budget)
            new = self.kv.allocate_slots(req, n)  # ADMIT.RESERVE_SEQUENCE: allocates nothing new
            if isinstance(new, AllocFailure):  # (kv_reservation=step) it waits for a step with blocks
                st.out.reasons.append(reason(new.rule, rid, "not continued: " + new.text))
                continue
            st.scheduled[rid] = n
            st.continued[rid] = len(new)
            st.budget -= n
            st.out.reasons.append(reason(RUN_CONTINUE_PREFILL, rid, f"{n} tokens ({st.budget} left)"))

    def cut_prefills(self) -> list[str]:
        """Running requests whose prefill the previous step cut (they sampled nothing)."""
        prev = self.previous
        if prev is None:
            return []
        return [s.request_id for s in prev.scheduled
                if not s.samples and self.requests[s.request_id].status == Status.RUNNING]

    @phase("hold_after_preempt")
    def _phase_hold_after_preempt(self, st: StepState) -> None:
        """A step that preempted admits nobody (ADMIT.NONE_AFTER_PREEMPT)."""
        if st.admission_held or not st.out.preempted:
            return
        st.admission_held = True
        if len(self.waiting):
            head = self.waiting.peek().request_id
            st.out.reasons.append(reason(ADMIT_AFTER_PREEMPT, head, f"{len(st.out.preempted)} preempted; no admissions"))

    @phase("touch_waiting_prefixes")
    def _phase_touch_waiting(self, st: StepState) -> None:
        """CACHE.TOUCH_WAITING (rule in :func:`touch_waiting_due`): in a round that reaches the
        queue's ordering, every 32nd such round looks up the first 128 waiting requests' cached
        prefixes, the head last."""
        full = len(self.running) >= self.config.max_num_seqs and not self.cut_prefills()
        if not len(self.waiting) or st.admission_held or full:
            return
        due, self._touch_rounds = touch_waiting_due(self._touch_rounds), self._touch_rounds + 1
        if not due:
            return
        bs = self.config.block_size
        for req in reversed(list(self.waiting)[:TOUCH_WAITING_MAX]):
            self.kv.pool.lookup(req.block_hashes[: req.num_tokens // bs])

    @phase("schedule_waiting")
    def _phase_waiting(self, st: StepState) -> None:
        """Admit from the head of the waiting queue while the head fits: room in the
        batch, the plan's admission checks, then blocks (ADMIT.*, CACHE.HIT); the first
        head that does not fit stops admission (WAIT.QUEUED)."""
        if not st.admission_held:
            st.budget = self._schedule_waiting(st)

    @phase("hold_static_batch")
    def _phase_hold_static(self, st: StepState) -> None:
        """Under static batching nobody joins while any of the batch runs (BATCH.STATIC)."""
        if not st.admission_held and not st.starved:
            st.admission_held = True
            static_batch_busy(self.waiting, st.out)

    @phase("hold_for_swapped")
    def _phase_hold_for_swapped(self, st: StepState) -> None:
        """Nobody is admitted while a request is swapped out (SWAP.BEFORE_WAITING)."""
        if st.admission_held or not self.swapped:
            return
        st.admission_held = True
        if len(self.waiting):
            st.out.reasons.append(reason(SWAP_BEFORE_WAITING, self.waiting.peek().request_id,
                                         f"{len(self.swapped)} swapped out; no admissions"))

    @phase("end_prefill_batch")
    def _phase_end_prefill_batch(self, st: StepState) -> None:
        """Prefill-first: a step that admitted anybody is a prefill-only batch and ends
        here; the running requests wait for a step that admits nobody (BATCH.PREFILL_FIRST)."""
        if st.scheduled:
            prefill_batch_first(self.running, st.out, st.scheduled)
            st.step_ends = True

    @phase("hold_until_departure")
    def _phase_hold_until_departure(self, st: StepState) -> None:
        """SGLang: after ESTIMATE.ADMIT refused the head, nobody is admitted until a request of the
        batch leaves, the engine runs empty or a cut prefill continues (ESTIMATE.HOLD_UNTIL_DEPARTURE)."""
        if self.hold is None or st.admission_held:
            return
        if not admission_still_held(self.hold, self.requests, self.running, bool(self.cut_prefills())):
            self.hold = None
            return
        st.admission_held = True
        self.hold = frozenset(r.request_id for r in self.running)  # the batch now (its members since)
        if len(self.waiting):
            st.out.reasons.append(reason("ESTIMATE.HOLD_UNTIL_DEPARTURE", self.waiting.peek().request_id,
                                         "the head was refused; waits until a running request leaves"))

    @phase("stash_cut_prefills")
    def _phase_stash_cut_prefills(self, st: StepState) -> None:
        """SGLang, under cache_register="prefill-and-finish": a prefill the last step cut enters the
        prefix cache as this step begins, before anything is looked up or allocated, unless an
        abort freed it meanwhile (CACHE.REGISTER_PREFILL_AND_FINISH; SGLang's stash_chunked_request)."""
        cut, self._cut = self._cut, []
        self._continued = set(cut)  # (their chunks this step are prefill chunks, however short)
        for rid in cut:
            req = self.requests.get(rid)
            if req is not None and req.status == Status.RUNNING:
                self.kv.register_computed(req)

    @phase("defer_prefill_blocks")
    def _phase_defer_prefill_blocks(self, st: StepState) -> None:
        """SGLang, under cache_eviction="leaf-lru": the blocks of this step's prefill batch are
        taken once the batch is formed (KV.BATCH_ALLOCATION), so allocations are deferred."""
        self.kv.pool.deferring = True

    @phase("take_prefill_blocks")
    def _phase_take_prefill_blocks(self, st: StepState) -> None:
        """SGLang, under cache_eviction="leaf-lru": the prefill batch's blocks are taken, in batch
        order, after every candidate was looked up (KV.BATCH_ALLOCATION)."""
        self.kv.take_deferred()

    @phase("charge_vtc")
    def _phase_charge_vtc(self, st: StepState) -> None:
        """VTC: the running phase's chunks are charged to their tenants, in running order (VTC.CHARGE)."""
        for rid, n in st.scheduled.items():
            self._charge(self.requests[rid], st.start[rid], n)

    @phase("update_ratio")
    def _phase_update_ratio(self, st: StepState) -> None:
        """SGLang: after a running phase that served anybody, new_token_ratio decays, or
        jumps back up after a retraction (ESTIMATE.RATIO), which also leaves the batch in
        retraction order (RETRACT.BATCH_ORDER)."""
        if st.ran:
            if st.out.preempted:  # RETRACT.BATCH_ORDER: the survivors, and this step's batch, in retraction order
                self.running = retraction_order(self.running)
                order = [r.request_id for r in self.running if r.request_id in st.scheduled]
                st.scheduled = {rid: st.scheduled[rid] for rid in order + [x for x in st.scheduled if x not in order]}
            self.new_token_ratio = next_ratio(self.new_token_ratio, bool(st.out.preempted), self.running, self.config)

    @phase("swap_in")
    def _phase_swap_in(self, st: StepState) -> None:
        """In a step that preempted nobody, swapped-out requests come back first, oldest
        first (SWAP.IN)."""
        if self.swapped and not st.out.preempted:
            st.budget = self._schedule_swapped(st)

    @phase("serve_at_risk")
    def _phase_serve_at_risk(self, st: StepState) -> None:
        """EDF: before the running phase, every running decode whose TPOT slack is spent (its
        next token due in this step) is served, in running-list order, while budget and
        blocks last (EDF.AT_RISK_FIRST); one that lacks a block is left to the running phase,
        which preempts by the victim rule.  Prefill chunks and admissions get what is left."""
        for req in self.running:
            if st.budget <= 0 or len(st.scheduled) >= self.config.max_num_seqs:
                break
            if not at_risk(req, self.clock):
                continue
            if isinstance(self.kv.allocate_slots(req, 1), AllocFailure):
                continue
            st.scheduled[req.request_id] = 1
            st.budget -= 1
            st.out.reasons.append(reason("EDF.AT_RISK_FIRST", req.request_id,
                                         f"next token due (last at step {req.last_token_step}, tpot {req.tpot_steps})"))

    @phase("slo_admission")
    def _phase_slo_admission(self, st: StepState) -> None:
        """SLO admission control: every waiting request whose first token is not out and that
        can no longer sample it by its TTFT deadline, even with the whole token budget from
        this step on (SLO.FEASIBLE), is refused (SLO.REFUSE: rejected, slo_infeasible) or
        deferred behind the feasible ones (SLO.DEFER), before anybody is admitted.  Under
        "refuse" a request that was admitted once (preempted since) is deferred, not refused."""
        refuse = self.config.slo_admission == "refuse"
        budget = self.config.max_num_batched_tokens
        for req in list(self.waiting):
            if req.deferred or req.first_token_step is not None:
                continue
            if feasible(self.clock, req.num_tokens, budget, req.ttft_deadline):
                continue
            rid = req.request_id
            if refuse and req.status == Status.WAITING:  # a preempted request was admitted once: deferred
                self.waiting.remove(req)
                del self.requests[rid]
                self.rejected[rid] = SLO_INFEASIBLE
                self._rejected.append((rid, SLO_INFEASIBLE))
                req.status = Status.REJECTED
                st.out.reasons.append(reason(SLO_REFUSE, rid, f"{req.num_tokens} tokens cannot finish prefill by step "
                                                              f"{req.ttft_deadline} (budget {budget})"))
            else:
                self.waiting.defer(req)
                st.out.reasons.append(reason(SLO_DEFER, rid, f"deadline step {req.ttft_deadline} out of reach; "
                                                             "deferred behind feasible requests"))

    # -- what the phases share ------------------------------------------------

    def _charge(self, req: Request, start: int, n: int) -> None:
        """VTC: charge the chunk ``start .. start+n-1`` to the request's tenant (rule VTC.CHARGE)."""
        self.waiting.charge(req.source.tenant, vtc_cost(req, start, n, self.config))

    def _finish_schedule(self, out: SchedulerOutput, scheduled: dict[str, int], start: dict[str, int],
                         starved: bool) -> SchedulerOutput:
        """Advance computed tokens (before execution, as vLLM does) and build the batch."""
        for rid, n in scheduled.items():
            req = self.requests[rid]
            req.num_computed_tokens += n
            samples = req.num_computed_tokens >= req.num_tokens_with_placeholders
            req.prefill_chunk = not samples
            out.scheduled.append(ScheduledRequest(rid, n, start[rid], samples, out.drafts.get(rid, 0)))
        if len(self.waiting) > 1:
            fired(WAIT_QUEUED)
        if self.trace_queue:
            self._explain_queue(out)
        if self.check_invariants:
            invariants.check_schedule(self, out, starved)
        for hook in self.after_schedule:
            hook(out)
        self._last = out
        return out

    def _schedule_running(self, out: SchedulerOutput, scheduled: dict[str, int], budget: int, cap: int) -> int:
        """Walk the running list in order, preempting when blocks run out; return the budget left."""
        cfg = self.config
        i = 0
        # max_num_seqs never binds here when it bounds the running list (rule BATCH.MAX_NUM_SEQS_PER_STEP)
        while i < len(self.running) and budget > 0 and len(scheduled) < cfg.max_num_seqs:
            req = self.running[i]
            if req.request_id in scheduled:  # served by an earlier phase (EDF.AT_RISK_FIRST)
                i += 1
                continue
            if self.running_checks and any(check(req) for check in self.running_checks):
                i += 1
                continue
            n = chunk_size(req.num_tokens_with_spec - req.num_computed_tokens, cap, budget)
            n = model_len_cap(n, req.num_computed_tokens, cfg)
            if n <= 0:
                if req.num_output_placeholders:  # its in-flight token reaches max_model_len
                    fired(async_sched.PLACEHOLDERS_COUNT)
                i += 1
                continue
            alloc = self.kv.allocate_slots(req, n)
            while isinstance(alloc, AllocFailure):
                victim = pick_victim(self.plan.victim, self.running, self.clock)
                index = self.running.index(victim)
                self.running.pop(index)
                if index < i:
                    i -= 1
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id)
                    out.drafts.pop(victim.request_id, None)
                self._preempt(victim, out)
                out.reasons.append(reason(self.plan.victim, victim.request_id,
                                          f"preempted so that {req.request_id} gets blocks ({alloc.text})"))
                if victim is req:
                    break
                alloc = self.kv.allocate_slots(req, n)
            if isinstance(alloc, AllocFailure):
                go_on = self.plan.self_preempt == "continue"
                out.reasons.append(reason(RUN_NO_BLOCKS, req.request_id, "preempted itself; " + (
                    "continuing with the next running request" if go_on else "running phase ends")))
                if go_on:
                    continue
                break
            scheduled[req.request_id] = n
            budget -= n
            if self.record_reasons:
                kind = RUN_DECODE if req.num_computed_tokens + 1 >= req.num_tokens_with_placeholders else RUN_PREFILL
                out.reasons.append(reason(kind, req.request_id, f"{n} tokens ({budget} left)"))
            for hook in self.on_run_scheduled:
                hook(out, req, n)
            i += 1
        if i < len(self.running) and self.record_reasons:
            why = self._why_running_stopped(budget, scheduled)
            for req in self.running[i:]:
                if req.request_id not in scheduled:
                    out.reasons.append(reason(why[0], req.request_id, f"not reached: {why[1]}"))
        return budget

    def _why_running_stopped(self, budget: int, scheduled: dict[str, int]) -> tuple[str, str]:
        """The rule that ended the running phase before the running list's end: the token
        budget (BUDGET.EXHAUSTED), max_num_seqs scheduled (BATCH.MAX_NUM_SEQS_PER_STEP), or
        else a request that preempted itself (RUN.PREEMPT_FOR_BLOCKS)."""
        if budget <= 0:
            return BUDGET_EXHAUSTED, "token budget spent"
        if len(scheduled) >= self.config.max_num_seqs:
            return BATCH_SEQS_PER_STEP, "max_num_seqs scheduled"
        return RUN_NO_BLOCKS, "the running phase ended when a request preempted itself"

    def _no_room_to_join(self, st: StepState, rid: str, budget: int, what: str) -> bool:
        """Nothing more joins the batch this step once the token budget is spent
        (BUDGET.EXHAUSTED) or max_num_seqs is reached (the plan's room rule); the
        reason is recorded against ``rid``, the request that was next in line."""
        if budget <= 0:
            st.out.reasons.append(reason(BUDGET_EXHAUSTED, rid, f"{what}: token budget spent"))
            return True
        full = self.seqs_full(st)
        if full:
            st.out.reasons.append(reason(self.plan.room, rid, full))
            return True
        return False

    def _long_prefill_cap(self, num_eligible: int) -> int:
        """BUDGET.LONG_PREFILL, floored by BUDGET.LONG_PREFILL_ADAPTIVE."""
        return adaptive_long_prefill_cap(self.config, long_prefill_cap(self.config, num_eligible), num_eligible)[0]

    def _running_full(self, st: StepState) -> str | None:
        """ADMIT.MAX_NUM_SEQS: max_num_seqs requests are running (ADMIT.MAX_NUM_ACTIVE_SEQS:
        max_num_active_seqs, when set lower)."""
        n, active = len(self.running), self.config.max_num_active_seqs
        if active and n >= active:
            fired(ADMIT_MAX_ACTIVE)
            return f"{n} running = max_num_active_seqs"
        return f"{n} running = max_num_seqs" if n >= self.config.max_num_seqs else None

    def _step_full(self, st: StepState) -> str | None:
        """BATCH.MAX_NUM_SEQS_PER_STEP: max_num_seqs requests are scheduled in this step."""
        n = len(st.scheduled)
        return f"{n} scheduled in this step = max_num_seqs" if n >= self.config.max_num_seqs else None

    def _schedule_waiting(self, st: StepState) -> int:
        """Admit from the head of the waiting queue while everything fits; return the budget left.
        Where the walk stopped is logged state (``admit_stop``: the word of the test that refused the head;
        ``empty`` when it admitted everybody; none when nobody waited)."""
        out, budget = st.out, st.budget
        out.admit_stop = "empty" if len(self.waiting) else None
        while len(self.waiting):
            req = self.waiting.peek()
            rid = req.request_id
            if self._no_room_to_join(st, rid, budget, "head not admitted"):
                out.admit_stop = "budget" if budget <= 0 else "seqs"
                break
            hit_blocks, hit = self.kv.get_computed_blocks(req)
            remaining = req.num_tokens - hit
            refused = next((word for word, check in self.admission_checks if not check(st, req, remaining, budget)), None)
            if refused is not None:
                out.admit_stop = refused
                break
            for size in self.admission_sizes:
                remaining = size(st, req, remaining, hit, budget)
            if remaining is None:
                out.admit_stop = "pad"
                break
            n = chunk_size(remaining, st.cap, budget)
            alloc = self.allocate_admission(req, n, hit_blocks, hit)
            if isinstance(alloc, AllocFailure):
                out.reasons.append(reason(alloc.rule, rid, alloc.text))
                out.drafts.pop(rid, None)
                out.padded.discard(rid)
                out.admit_stop = "blocks"
                break
            self.waiting.pop()
            self.running.append(req)
            resumed = req.status == Status.PREEMPTED
            (out.resumed if resumed else out.new).append(rid)
            req.status = Status.RUNNING
            req.num_computed_tokens = hit
            st.start[rid] = hit
            st.scheduled[rid] = n
            out.cache_hits[rid] = hit
            if hit and self.record_state:
                out.hit_blocks[rid] = [b.block_id for b in hit_blocks]
            budget -= n
            for on_schedule in self.on_schedule:
                on_schedule(req, hit, n)
            what = f"{n} tokens" + (f" after a prefix hit of {hit}" if hit else "")
            out.reasons.append(reason(ADMIT_RESUMED if resumed else ADMIT_NEW, rid, what))
        return budget

    # -- admission checks and allocations (chosen by the plan) -----------------

    def _check_no_chunking(self, st: StepState, req: Request, remaining: int, budget: int) -> bool:
        """ADMIT.NO_CHUNKING: with chunked prefill off, the head's tokens must fit the budget at once."""
        cap = st.cap
        if (cap if 0 < cap < remaining else remaining) > budget:
            st.out.reasons.append(reason(ADMIT_NO_CHUNKING, req.request_id,
                                         f"needs {remaining} tokens at once, budget {budget}"))
            return False
        return True

    def _check_no_chunking_exclusive(self, st: StepState, req: Request, remaining: int, budget: int) -> bool:
        """ADMIT.NO_CHUNKING_EXCLUSIVE: behind the batch's first request, tokens < the budget left."""
        if remaining > budget or (st.scheduled and remaining >= budget):
            st.out.reasons.append(reason(ADMIT_NO_CHUNKING_EXCLUSIVE, req.request_id,
                                         f"needs {remaining} tokens at once, budget {budget} left"))
            return False
        return True

    def _check_chunk_only_first(self, st: StepState, req: Request, remaining: int, budget: int) -> bool:
        """ADMIT.CHUNK_ONLY_FIRST: a request after the first of the batch must fit the budget whole."""
        if st.scheduled and remaining > budget:
            st.out.reasons.append(reason(ADMIT_CHUNK_ONLY_FIRST, req.request_id,
                                         f"needs {remaining} tokens at once behind the batch's first, budget {budget}"))
            return False
        return True

    def _check_estimate(self, st: StepState, req: Request, remaining: int, budget: int) -> bool:
        """ESTIMATE.ADMIT: SGLang's rem_total_tokens test, ``rem`` fixed when the round's
        first head reaches it and charged by every admission after."""
        cfg, bs = self.config, self.config.block_size
        if st.rem is None:
            st.rem = st.out.estimate_rem = self._estimate_rem(st)
            st.cur_rem = self._estimate_cur_rem(st)
        locked = own_hit_locked(self.kv.get_computed_blocks(req)[0], bs)  # ESTIMATE.OWN_HIT_LOCKED
        paged = cdiv(remaining, bs) * bs + bs + locked  # the admission's immediate charge
        if self.eos_reserve and req.source.ignore_eos:
            ok, rule_id = self._ignore_eos_reserve(st, req, paged), "ESTIMATE.IGNORE_EOS_RESERVE"
            why = f"{paged} tokens now, {st.cur_rem} free this round; its batch's outputs leave no reserve"
        else:
            need = remaining + remaining_output(req, cfg) + bs + locked
            ok, rule_id = estimate_admits(need, st.rem), "ESTIMATE.ADMIT"
            why = f"needs {need} tokens, {st.rem:.3f} estimated free"
            if not ok and locked and estimate_admits(need - locked, st.rem):  # its own locked hit tips it
                rule_id, why = "ESTIMATE.OWN_HIT_LOCKED", f"{why}, {locked} of them its own hit's evictable blocks"
        if not ok:
            fresh = set(st.continued) | set(st.out.new) | set(st.out.resumed)  # not in SGLang's running batch yet
            if self.plan_hold and any(rid not in fresh for rid in st.start):  # ESTIMATE.HOLD_UNTIL_DEPARTURE
                self.hold = frozenset(r.request_id for r in self.running)
            st.out.reasons.append(reason(rule_id, req.request_id,
                                         f"{why} (new_token_ratio {self.new_token_ratio:.6f})"))
            return False
        st.rem -= paged + admission_output_charge(req, cfg)
        st.cur_rem -= paged
        return True

    def _estimate_cur_rem(self, st: StepState) -> int:
        """ESTIMATE.IGNORE_EOS_RESERVE's ``cur_rem`` as the admission round begins: free tokens (as
        before this step's continued chunks took theirs) less each continued chunk's
        ``ceil_B(n) + block_size`` — no outputs reserved (SGLang's remaining_current)."""
        bs = self.config.block_size
        free = (self.kv.pool.num_free_blocks + sum(st.continued.values())) * bs
        return free - sum(cdiv(st.scheduled[rid], bs) * bs + bs for rid in st.continued)

    def _ignore_eos_reserve(self, st: StepState, req: Request, paged: int) -> bool:
        """ESTIMATE.IGNORE_EOS_RESERVE for ``req``: the round's simulation, built at its first
        ignore_eos candidate (the candidate, the running requests, then the chunks continued and
        the requests admitted in this round, sorted by tokens left), later candidates inserted."""
        ratio = self.new_token_ratio
        state = eos_reserve_state(req, ratio)
        if st.eos_states is None:
            fresh = list(st.continued) + st.out.new + st.out.resumed  # SGLang's can_run_list
            running = [r for r in self.running if r.request_id not in fresh]
            others = running + [self.requests[rid] for rid in fresh]
            st.eos_states = [x for x in [state] + [eos_reserve_state(r, ratio) for r in others] if x is not None]
            st.eos_states.sort(key=lambda x: x[0])
        else:
            insert_eos_state(st.eos_states, state)
        return ignore_eos_reserve_admits(paged, st.cur_rem, st.rem, st.eos_states, not self.running)

    def _estimate_rem(self, st: StepState) -> float:
        """ESTIMATE.ADMIT's ``rem`` as the admission round begins: free tokens (as before this
        step's continued chunks took theirs), minus each running request's estimated remaining
        output (ESTIMATE.RUNNING_RATIO; a continued prefill is not running yet), minus each
        continued chunk's charge (ESTIMATE.CONTINUED_CHUNK), in that order.  The terms are logged
        too (state field ``estimate_parts``: ``free``, ``running``, ``chunks``, and ``outputs``, the
        running requests' remaining outputs before the ratio, ESTIMATE.REMAINING), so that a report
        names the term that differs, not only the total."""
        cfg, ratio = self.config, self.new_token_ratio
        free = (self.kv.pool.num_free_blocks + sum(st.continued.values())) * cfg.block_size
        running_now = [r for r in self.running if r.request_id not in st.continued]
        left = [remaining_output(r, cfg) for r in running_now]
        outputs = sum(left)
        running = sum(running_ratio(r, ratio) * n for r, n in zip(running_now, left))
        rem, chunks = free - running, 0
        for rid in st.continued:
            req = self.requests[rid]
            charge = continued_chunk_charge(st.scheduled[rid], req.num_computed_tokens + st.scheduled[rid] >= req.num_tokens,
                                            req, cfg)
            rem, chunks = rem - charge, chunks + charge
        st.out.estimate_parts = {"free": free, "outputs": outputs, "running": running, "chunks": chunks}
        return rem

    def _allocate_step(self, req: Request, n: int, hit_blocks: list, hit: int):
        """Blocks for this step's chunk (the whole current sequence must fit under
        ADMIT.FULL_SEQUENCE; the watermark applies beside running requests)."""
        cfg = self.config
        watermark = cfg.watermark_blocks if self.running else 0
        return self.kv.allocate_slots(req, n, hit_blocks, hit, cfg.scheduler_reserve_full_isl, watermark)

    def _allocate_reserved(self, req: Request, n: int, hit_blocks: list, hit: int):
        """ADMIT.RESERVE_FULL: blocks for the request's whole life at once."""
        cfg = self.config
        watermark = cfg.watermark_blocks if self.running else 0
        reserve = reservation(req, cfg)
        return self.kv.allocate_slots(req, n, hit_blocks, hit, cfg.scheduler_reserve_full_isl and not reserve,
                                      watermark, reserve)

    def _allocate_sequence(self, req: Request, n: int, hit_blocks: list, hit: int):
        """ADMIT.RESERVE_SEQUENCE: blocks for the whole current sequence at once."""
        watermark = self.config.watermark_blocks if self.running else 0
        return self.kv.allocate_slots(req, n, hit_blocks, hit, False, watermark, sequence_reservation(req))

    def _schedule_swapped(self, st: StepState) -> int:
        """Swap-ins (rule SWAP.IN): resume swapped requests in order while they fit; return the budget left."""
        cfg, out, budget = self.config, st.out, st.budget
        while self.swapped:
            req = self.swapped[0]
            rid = req.request_id
            if self._no_room_to_join(st, rid, budget, "not swapped in"):
                break
            n = chunk_size(req.num_tokens - req.num_computed_tokens, st.cap, budget)
            n = model_len_cap(n, req.num_computed_tokens, cfg)
            watermark = cfg.watermark_blocks if self.running else 0
            alloc = self.kv.allocate_slots(req, n, (), 0, cfg.scheduler_reserve_full_isl, watermark)
            if isinstance(alloc, AllocFailure):
                out.reasons.append(reason(alloc.rule, rid, "not swapped in: " + alloc.text))
                break
            self.swapped.pop(0)
            self.cpu_free += self.cpu_blocks.pop(rid)
            self.running.append(req)
            req.status = Status.RUNNING
            st.start[rid] = req.num_computed_tokens
            st.scheduled[rid] = n
            budget -= n
            out.resumed.append(rid)
            out.swapped_in.append(rid)
            for on_schedule in self.on_schedule:
                on_schedule(req, req.num_computed_tokens, n)
            out.reasons.append(reason(SWAP_IN, rid, f"{n} tokens; {self.cpu_free} CPU blocks free"))
        return budget

    def _explain_queue(self, out: SchedulerOutput) -> None:
        head = None
        for pos, req in enumerate(self.waiting):
            if head is None:
                head = req.request_id
                continue
            out.reasons.append(reason(WAIT_QUEUED, req.request_id, f"position {pos} behind {head}"))

    # -- preemption (the plan picks how a victim is freed and requeued) --------

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        req.num_preemptions += 1
        out.preempted.append(req.request_id)
        self.free_victim(req, out)

    def _preempt_by_recompute(self, req: Request, out: SchedulerOutput) -> None:
        """PREEMPT.RECOMPUTE: free every block, forget the computed tokens, requeue."""
        fired(PREEMPT_RECOMPUTE)
        self.kv.free(req.request_id)
        req.status = Status.PREEMPTED
        req.num_computed_tokens = 0
        for hook in self.on_preempt:
            hook(req)
        self.requeue(req)
        if self.vtc:  # (its tenant never left: a counter changed here would be a lift the rule forbids)
            tenant = req.source.tenant
            out.reasons.append(reason("VTC.QUEUE", req.request_id, f"back in tenant {tenant!r}'s queue, no lift: "
                                      f"counter {self.waiting.counters[tenant]:g}", tenant=tenant))

    def _preempt_by_swap(self, req: Request, out: SchedulerOutput) -> None:
        """SWAP.OUT, or SWAP.FALLBACK_RECOMPUTE when the CPU pool is too small."""
        need = cdiv(req.num_computed_tokens, self.config.block_size)
        if need > self.cpu_free:
            out.reasons.append(reason(SWAP_FALLBACK, req.request_id, f"needs {need} CPU blocks, {self.cpu_free} free"))
            self._preempt_by_recompute(req, out)
            return
        self.kv.free(req.request_id)
        self.cpu_free -= need
        self.cpu_blocks[req.request_id] = need
        req.status = Status.SWAPPED
        self.swapped.append(req)
        self.swapped.sort(key=self._swap_key)
        out.swapped_out.append(req.request_id)
        out.reasons.append(reason(SWAP_OUT, req.request_id, f"{need} CPU blocks, {self.cpu_free} left"))

    def _requeue_tail(self, req: Request) -> None:
        """RETRACT.TO_TAIL: a retracted request joins the waiting queue's tail."""
        fired(RETRACT_TO_TAIL)
        self.waiting.requeue_tail(req)

    def _swap_key(self, req: Request) -> tuple:
        if self.config.policy == "priority":
            return (req.priority, req.arrival_seq, req.request_id)
        return (req.arrival_seq,)

    # -- output ----------------------------------------------------------

    def update_from_output(self, sampled: dict[str, int]) -> StepRecord:
        """Append each sampled token, apply the stop rules and free finished requests
        (in scheduled order, so their blocks reach the free queue in that order)."""
        out = self._last
        if out is None:
            raise RuntimeError("update_from_output() before schedule()")
        self._last = None
        self.previous = out
        for hook in self.on_computed:
            hook(out)
        finished: list[tuple[str, str]] = []
        took: dict[str, int] = {}
        aborted_now = False
        for s in out.scheduled:
            if not s.samples:
                continue
            req = self.requests[s.request_id]
            token = sampled[s.request_id]
            took[s.request_id] = token
            req.append_output_token(token)
            note_token(req, self.clock)
            why = self.check_stop(req, token)
            for verify in self.verify_drafts:
                why = verify(req, s, why)
            if why is None:
                for hook in self.after_output:
                    hook(req)
            if why is not None:
                self._finish(req, Status.FINISHED, why)
                finished.append((req.request_id, why))
                rule_id = {FINISH_EOS: "STOP.EOS", FINISH_STOP_TOKEN: "STOP.STOP_TOKEN"}.get(why, "STOP.LENGTH")
                out.reasons.append(reason(rule_id, req.request_id, f"finished: {why} after {len(req.output_token_ids)} tokens"))
            elif req.abort_pending:
                aborted_now = self._free_abort_pending(req) or aborted_now
        if aborted_now:
            self.running = [r for r in self.running if r.status == Status.RUNNING]
        for hook in self.after_outputs:
            hook(out)
        return self._close_step(out, finished, took)

    def _close_step(self, out: SchedulerOutput, finished: list[tuple[str, str]], took: dict[str, int]) -> StepRecord:
        """End the step: drop finished requests from the running list and write the record."""
        if finished:
            self.running = [r for r in self.running if r.status == Status.RUNNING]
        self.clock += 1
        self._when_idle()
        record = self._record(out, finished, took)
        if self.check_invariants:
            invariants.check_state(self)
        self._begin_step()
        return record

    # -- speculative decoding (the plan's SPEC.* rules; spec.specdec) -----------

    def _schedule_drafts(self, out: SchedulerOutput, req: Request, n: int) -> None:
        """SPEC.DRAFT_SCHEDULE: the drafts among a running request's ``n`` scheduled tokens."""
        drafts = specdec.scheduled_drafts(req, n, req.num_computed_tokens)
        if drafts:
            out.drafts[req.request_id] = drafts
            if self.record_reasons:
                out.reasons.append(reason("SPEC.DRAFT_SCHEDULE", req.request_id, f"{drafts} of its {n} tokens are drafts"))

    def _pad_admission(self, st: StepState, req: Request, remaining: int, hit: int, budget: int) -> int | None:
        """SPEC.PAD_ADMISSION: an admission left with one token becomes a 1 + K decode."""
        admitted = set(st.out.new) | set(st.out.resumed)
        ran = [rid for rid in st.scheduled if rid not in admitted]
        prefill = any(self.requests[rid].prefill_chunk for rid in ran)
        n = specdec.padded_admission(remaining, hit, self.num_spec, prefill, bool(ran), budget, self.config.max_model_len)
        rid = req.request_id
        if n is None:
            st.out.reasons.append(reason("SPEC.PAD_ADMISSION", rid, f"a padded decode needs {1 + self.num_spec} "
                                                                    f"tokens, budget {budget}: not admitted"))
        elif n > remaining:
            st.out.drafts[rid] = n - remaining
            st.out.padded.add(rid)
            st.out.reasons.append(reason("SPEC.PAD_ADMISSION", rid, f"padded to {n} tokens with {n - remaining} dummy drafts"))
        return n

    def _number_verifications(self, out: SchedulerOutput) -> None:
        """SPEC.ACCEPT: each batch with proposed drafts takes the request's next verification
        number, which decides how many of them the model accepts."""
        for s in out.scheduled:
            if s.drafts and s.request_id not in out.padded:
                req = self.requests[s.request_id]
                s.accepted = specdec.accepted_drafts(req.source, req.spec_verifications, s.drafts)
                req.spec_verifications += 1

    def _draft_placeholders(self, out: SchedulerOutput) -> None:
        """Async: a scheduled request's drafts are placeholders too (ASYNC.PLACEHOLDER counts
        1 + drafts), and it gets K draft placeholders for its next step
        (SPEC.ASYNC_DRAFT_PLACEHOLDERS)."""
        for s in out.scheduled:
            if s.samples:
                req = self.requests[s.request_id]
                req.num_output_placeholders += s.drafts
                specdec.draft_placeholders(req, self.num_spec)

    def _propose(self, req: Request) -> None:
        specdec.propose(req, self.num_spec)

    def _verify_drafts(self, req: Request, s: ScheduledRequest, why: str | None) -> str | None:
        """After the step's first token: roll back the rejected drafts (SPEC.ROLLBACK), then,
        unless that token stopped the request, append the accepted drafts' successors one by
        one under the stop rules (SPEC.STOP_IN_DRAFTS).  vLLM's order (rollback, then the
        tokens) does not matter here: the stop rules do not read computed tokens."""
        if not s.drafts:
            return why
        specdec.rollback(req, s.drafts, s.accepted, False)
        self._accepted[s.request_id] = s.accepted
        self._reasons.append(reason("SPEC.ACCEPT", s.request_id, specdec.verified(s.drafts, s.accepted)))
        if why is not None or not s.accepted:
            if why is not None and s.accepted:
                specdec.fired(specdec.STOP_IN_DRAFTS)
            return why
        more = specdec.draft_tokens(req, len(req.output_token_ids), s.accepted, self.vocab_size, self.eos_token_id)
        return specdec.append_outputs(req, more, lambda r, t: check_stop(r, t, self.config))[1]

    def _cache_at_output(self, req: Request, s: ScheduledRequest, why: str | None) -> str | None:
        """SPEC.CACHE_AT_OUTPUT: a running request's full blocks up to its computed tokens are cached
        once its output is applied, before a stop frees it."""
        specdec.cache_at_output(self.kv, req)
        return why

    def _record_drafts(self, record: StepRecord, out: SchedulerOutput) -> None:
        """The decisions-level fields ``drafts`` (this step's batch) and ``accepted`` (the
        outputs this record applies)."""
        record.drafts = {s.request_id: s.drafts for s in out.scheduled if s.drafts}
        record.accepted, self._accepted = self._accepted, {}

    def _note_prefills(self, out: SchedulerOutput) -> None:
        """CACHE.REGISTER_PREFILL_AND_FINISH: which requests of the batch computed prompt tokens."""
        starting = set(out.resumed) | self._continued
        self._prefilled = {s.request_id for s in out.scheduled if prefilled(self.requests[s.request_id], s, starting)}

    def _register_at_output(self, req: Request, s: ScheduledRequest, why: str | None) -> str | None:
        """CACHE.REGISTER_PREFILL_AND_FINISH: a sampler's blocks enter the cache after its output,
        before it is freed when it finishes, if it prefilled in this step, finishes, or is freed
        after this sample because the client aborted it (ABORT.AFTER_NEXT_SAMPLE)."""
        if why is not None or req.abort_pending or s.request_id in self._prefilled:
            self.kv.register_computed(req)
        return why

    def _note_cut_prefills(self, out: SchedulerOutput) -> None:
        """CACHE.REGISTER_PREFILL_AND_FINISH: the prefills this step cut, registered when the next
        step begins (phase stash_cut_prefills)."""
        self._cut = [s.request_id for s in out.scheduled if not s.samples]

    def _retract_evicting(self, req: Request, out: SchedulerOutput) -> None:
        """CACHE.EVICT_ON_RETRACT (rule in :func:`retract_eviction_target`); the victim itself is freed
        as any victim is under the plan (recompute, or SWAP.OUT under preemption_mode="swap")."""
        self.kv.pool.evict_all()
        self._free_planned(req, out)
        self.kv.pool.make_room(retract_eviction_target(self.running, self.config))

    def _register_computed(self, out: SchedulerOutput) -> None:
        for s in out.scheduled:
            self.kv.register_computed(self.requests[s.request_id])

    def _when_idle(self) -> None:
        if self.on_idle and not self.has_unfinished_requests():
            for hook in self.on_idle:
                hook()

    def _reset_ratio(self) -> None:
        """ESTIMATE.RATIO: an engine that becomes empty restarts from new_token_ratio_init."""
        self.new_token_ratio = self.config.new_token_ratio_init

    def _record_cpu_pool(self, record: StepRecord) -> None:
        record.num_free_cpu_blocks = self.cpu_free

    def _record_ratio(self, record: StepRecord) -> None:
        record.new_token_ratio = self.new_token_ratio

    def _finish(self, req: Request, status: Status, why: str | None) -> None:
        self.kv.free(req.request_id)
        req.status = status
        req.finish_reason = why

    def _record(self, out: SchedulerOutput, finished: list[tuple[str, str]], sampled: dict[str, int]) -> StepRecord:
        """The step's record, with the fields up to ``record_level`` (reasons if recorded)."""
        evicted = self.kv.pool.take_evicted()
        record = StepRecord(
            step=-1,
            scheduled=[(s.request_id, s.num_tokens) for s in out.scheduled],
            new=out.new,
            resumed=out.resumed,
            preempted=out.preempted,
            finished=finished,
            aborted=self._aborted,
            rejected=self._rejected,
            sampled=sampled,
            reasons=self._reasons + out.reasons if self.record_reasons else None,
        )
        if out.swapped_out or out.swapped_in:
            record.swapped_out, record.swapped_in = out.swapped_out, out.swapped_in
        for extra in self.decision_extras:
            extra(record, out)
        if self.record_state:
            self._record_state(record, out)
        if self.record_level == "decisions":
            return record
        tables = self.kv.req_blocks
        held = [(r.request_id, tables[r.request_id]) for r in self.running if tables.get(r.request_id)]
        record.num_free_blocks = self.kv.pool.num_free_blocks
        record.blocks = {rid: len(t) for rid, t in held}
        record.cache_hits = out.cache_hits
        record.num_evicted = len(evicted)
        for extra in self.record_extras:
            extra(record)
        if self.record_level == "exact":
            record.block_ids = {rid: [b.block_id for b in t] for rid, t in held}
            record.evicted = evicted
        return record

    def _record_state(self, record: StepRecord, out: SchedulerOutput) -> None:
        """The optional state fields (spec.formats.STATE_FIELDS) up to ``record_level``: the
        state a bug corrupts before any decision shows it."""
        record.computed = {r.request_id: r.num_computed_tokens for r in self.running}
        for req in chain(self.waiting, self.swapped):  # a victim's reset shows when it is preempted
            if req.status in PREEMPTED_STATES:
                record.computed[req.request_id] = req.num_computed_tokens
        record.token_cap = out.token_cap
        record.admit_stop = out.admit_stop
        record.waiting = sorted(r.request_id for r in self.waiting)  # (a request lost or left behind shows at once)
        if self.plan.outputs == "ASYNC.OUTPUTS_NEXT_STEP":  # ASYNC.PLACEHOLDER, zeroed at a preemption
            record.placeholders = {r.request_id: r.num_output_placeholders
                                   for r in chain(self.running, self.waiting, self.swapped) if r.num_output_placeholders}
        if self.vtc:
            record.vtc_counters = dict(self.waiting.counters)
            record.vtc_lifts = dict(self._lifts)
        registered = self.kv.take_registered()
        if self.record_level == "decisions":
            return
        record.estimate_rem = out.estimate_rem
        record.estimate_parts = out.estimate_parts
        record.cache_registered = registered if self.config.enable_prefix_caching else None
        if self.record_level == "exact":
            record.hit_blocks = out.hit_blocks
            # each held block's reference count, read from the block (KV.FREE_ORDER, CACHE.TOUCH)
            record.ref_counts = {b.log_key: b.ref_cnt for t in self.kv.req_blocks.values() for b in t}
            cache = getattr(self.kv.pool, "cached", None)  # hash -> blocks (CACHE.REGISTER_*, CACHE.EVICT_LRU)
            if self.config.enable_prefix_caching and cache is not None:
                record.cached_blocks = sorted(chain.from_iterable(cache.values()))  # each hash's block ids


#: Running-phase checks by rule id (StepPlan.running_checks).
RUNNING_CHECKS = {"ASYNC.LAST_TOKEN_IN_FLIGHT": lambda req: async_sched.last_token_in_flight(req)}


def run(trace: Trace, check_invariants: bool = False, trace_queue: bool = False, on_step=None) -> list[StepRecord]:
    """Run a trace through the spec alone (tokens from the trace's synthetic rule)."""
    engine = SpecEngine.from_trace(trace, check_invariants=check_invariants, trace_queue=trace_queue)
    return drive(engine, trace, engine.config.max_steps, on_step=on_step)
