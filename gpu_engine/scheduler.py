"""Tensor-resident scheduler state and the vectorized step (vLLM V1 decisions and the rest of the map).

State (one row per request slot, capacity grows by doubling)
    ``prompt_len, num_tokens, num_output_tokens, num_computed_tokens, status, priority,
    arrival, arrival_step, max_tokens, ignore_eos, num_blocks, num_cached_blocks, queue_key,
    tenant, swap_key, cpu_blocks, stop_at``   int64 columns (``stop_at``: the length at
                                 which max_tokens or max_model_len stops the request)
    ``token_ids[slot, pos]``     prompt + output tokens
    ``block_table[slot, i]``     the request's blocks, ``num_blocks`` of them
    ``stop_ids[slot, j]``        stop token ids (-1 padded)
    ``running``                  slots in admission order (an int64 array)
    ``waiting``                  implicit: every slot with a finite ``queue_key``; the
                                 queue order is ascending key (FCFS and VTC: a deque counter,
                                 victims get keys below the head, retracted requests above the
                                 tail; priority / spf / sprpt: (priority, prompt length or
                                 predicted remaining output, arrival), aged per step by
                                 :meth:`Scheduler._queue_keys`; edf: (deferred, due step, arrival),
                                 :func:`formulas.edf_keys`)
    ``swapped``                  implicit: every slot with a finite ``swap_key`` (swap-in order)
    ``pool``                     :class:`~gpu_engine.block_pool.BlockPool`

The knobs (``spec.config.SchedulerConfig``) it implements are listed in
:data:`gpu_engine.engine.SUPPORTED`: phase order ``batching`` (continuous,
prefill-first, static), ``kv_reservation`` (step, full, sequence), ``policy`` (fcfs,
priority, spf, vtc, sprpt, edf) with ``aging_steps``, the SLO knobs (issue 19:
``preemption_victim`` "slo-slack", ``slo_admission`` "refuse"/"defer", EDF's at-risk
decodes served before the running walk; per-slot token times in the ``ttft_deadline``
... ``deferred`` columns, kept by :meth:`Scheduler._note_tokens`), ``preemption_mode`` (recompute, swap to
a counted CPU pool), ``admission`` (budget, SGLang's estimate with retraction), and
nano-vllm's: ``prefill_chunking`` ("first-continues": the prefills the last step cut,
kept in ``cut``, continue before any admission, and only a batch's first admission may
be cut), ``max_num_seqs_scope`` ("step": :meth:`Scheduler._room` and the running walk
count the step's batch), ``cache_register`` ("computed": blocks are registered in
:meth:`Scheduler.update`, after the step), ``free_block_order`` ("tail") and
``cache_duplicates`` ("latest") in :class:`~gpu_engine.block_pool.BlockPool`; and speculative decoding
(``num_speculative_tokens`` K, ``spec_cache_at_output``): K drafts proposed per slot (column
``proposed``) join a decode's demand, a one-token admission is padded to ``1 + K``
(:func:`formulas.draft_padding`), each verification's accepted count comes from the trace
(:func:`formulas.accepted_count`), and the output rolls rejected drafts back and appends the
accepted ones under the stop rules (:meth:`Scheduler.update`, :meth:`Scheduler.apply_async_verified`).

A step is a bounded number of array ops plus short host loops only over rare
events (one iteration per preemption point, per prefix-cache conflict round,
per swapped-out victim, per VTC admission) and over the requests that touch
the host hash map (prefix lookups at admission; hashing and registering a
block when one fills up).  The closed forms are in :mod:`gpu_engine.formulas`.

Host-side (Python) state: request ids and trace requests per slot, each
request's block-hash chain, the prefix-cache map (in the pool), the VTC
counters (:mod:`gpu_engine.fairness`), SGLang's ``new_token_ratio`` and, for
the exact-level log only, a mirror of the block tables.  Floats (VTC counters,
the estimate admission's remaining tokens) are accumulated on the host in a
fixed sequential order, so that they round exactly as a sequential loop does.
"""
from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from spec.config import SchedulerConfig
from spec.formats import FINISH_EOS, FINISH_MAX_MODEL_LEN, FINISH_MAX_TOKENS, FINISH_STOP_TOKEN, TraceRequest

from gpu_engine import formulas as F
from gpu_engine import xp
from gpu_engine.block_pool import BlockPool, hash_block
from gpu_engine.fairness import TenantCounters
from gpu_engine.formulas import INF_KEY, cdiv
from gpu_engine.radix import RadixBlockPool
from gpu_engine.xp import Array, Backend

FREE, WAITING, RUNNING, PREEMPTED, SWAPPED = 0, 1, 2, 3, 4
REASONS = {F.STOP_EOS: FINISH_EOS, F.STOP_TOKEN: FINISH_STOP_TOKEN,
           F.STOP_MAX_MODEL_LEN: FINISH_MAX_MODEL_LEN, F.STOP_MAX_TOKENS: FINISH_MAX_TOKENS}
COLUMNS = ("prompt_len", "num_tokens", "num_output_tokens", "num_computed_tokens", "status", "priority", "arrival",
           "arrival_step", "max_tokens", "ignore_eos", "num_blocks", "num_cached_blocks", "queue_key", "tenant",
           "swap_key", "cpu_blocks", "stop_at", "placeholders", "preemptions",
           # service-level targets (issue 19), in steps (formulas.NEVER: no target / not yet)
           "ttft_deadline", "tpot", "first_token", "last_token", "slo_missed", "deferred", "at_risk_served",
           # speculative decoding: drafts proposed for the next step, verifications so far, and
           # whether the request's last scheduled chunk left its prefill incomplete
           "proposed", "verifications", "mid_prefill")
def salt_root(cache_salt: str | None) -> int | None:
    """The parent hash of a salted request's first block (None without a salt): the first
    8 bytes of sha256 over the salt, so only requests with equal salts share any block."""
    if not cache_salt:
        return None
    return int.from_bytes(hashlib.sha256(b"gpu_engine salt:" + cache_salt.encode()).digest()[:8], "little") & ((1 << 63) - 1)


PRIORITY_SHIFT = 1 << 32  # priority / spf key = base * 2^32 + arrival (arrivals are unique)
SLO_INFEASIBLE = "slo_infeasible"  # the rejection reason of a request SLO admission control refuses
TOUCH_EVERY, TOUCH_MAX = 32, 128  # CACHE.TOUCH_WAITING: SGLang's waiting-prefix refresh interval and reach


@dataclass
class _ReserveRound:
    """One admission round's ESTIMATE.IGNORE_EOS_RESERVE state: free tokens less the immediate
    charges so far, the slots continued or admitted in it (in order), the sorted simulation."""

    free: int
    fresh: list
    states: list | None = None


@dataclass
class Batch:
    """What one ``schedule()`` decided (arrays in batch order) and its bookkeeping lists."""

    slots: Array
    num_scheduled: Array
    start: Array  # num_computed_tokens before the step
    samples: Array  # bool: prefill complete after this step
    all_sample: bool = False  # every scheduled request samples (samples.all())
    new: list[str] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    swapped_out: list[str] = field(default_factory=list)
    swapped_in: list[str] = field(default_factory=list)
    cache_hits: dict[str, int] = field(default_factory=dict)
    hit_blocks: dict[str, list[int]] = field(default_factory=dict)  # logged state: admitted -> prefix-hit block ids
    refused: list[tuple[str, str]] = field(default_factory=list)  # SLO admission control: (id, "slo_infeasible")
    estimate_rem: float | None = None  # logged state: rem_total_tokens when the first head was tested
    estimate_parts: dict[str, float] | None = None  # logged state: its terms (free, outputs, running, chunks)
    drafts: dict[str, int] = field(default_factory=dict)  # speculative decoding: request -> drafts scheduled
    accepts: dict[int, int] = field(default_factory=dict)  # slot -> drafts its verification accepts
    accepted: dict[str, int] = field(default_factory=dict)  # after the update: request -> drafts accepted
    token_cap: int | None = None  # logged state: the per-request token cap the phases applied (long-prefill knob set)
    admit_stop: str | None = None  # logged state: the gate the walk of the waiting queue stopped at


class Scheduler:
    """vLLM V1's scheduler and KV-cache manager over tensors (see module docstring)."""

    def __init__(self, config: SchedulerConfig, device="cpu", capacity: int = 16, use_numpy: bool | None = None,
                 host_tables: bool = False):
        c = self.config = config
        self.be = Backend(device, use_numpy)
        self.bs = c.block_size
        self.caching = c.enable_prefix_caching
        #: priority ties: slot -> its time (client_arrival_time, else its arrival index), and
        #: with client times (any request gave one) its rank by (time, id) among live requests
        self.tie_times: dict[int, float] = {}
        self.tie_rank: dict[int, int] = {}
        self.client_times = False
        #: requests admitted into running at once: max_num_active_seqs when set (vLLM), else max_num_seqs
        self.admit_limit = c.max_num_active_seqs or c.max_num_seqs
        # SGLang's radix cache: whole leaf nodes evicted (CACHE.EVICT_LEAF_LRU), a duplicate of a cached
        # block freed when it would be registered (CACHE.DEDUP_ON_INSERT), blocks registered after a
        # prefill and at finish only (CACHE.REGISTER_PREFILL_AND_FINISH)
        self.leaf_lru = c.cache_eviction == "leaf-lru"
        self.dedup = c.cache_dedup == "on-insert"
        self.prefill_finish = c.cache_register == "prefill-and-finish"
        self.owed_pops: list | None = None  # KV.BATCH_ALLOCATION: (slots, need, held, total) to pop
        self.stash: list[tuple[int, str]] = []  # CACHE.REGISTER_PREFILL_AND_FINISH: cut prefills to register
        self.continuing: set[str] = set()  # the prefills this step continues (the last step cut them)
        if self.leaf_lru:
            self.pool = RadixBlockPool(self.be, c.num_blocks, c.null_block, c.enable_prefix_caching)
        else:
            self.pool = BlockPool(self.be, c.num_blocks, c.null_block, c.enable_prefix_caching,
                                  free_to_tail=c.free_block_order == "tail", latest_wins=c.cache_duplicates == "latest")
        # nano-vllm's knobs: blocks enter the cache after the step that computed them
        # (CACHE.REGISTER_WHEN_COMPUTED), max_num_seqs bounds a step's batch (BATCH.MAX_NUM_SEQS_PER_STEP),
        # only a prefill batch's first request may be cut and a cut prefill continues first
        # (ADMIT.CHUNK_ONLY_FIRST, RUN.CONTINUE_PREFILL_FIRST)
        self.register_computed = c.cache_register != "allocation"  # (not at allocation)
        # CACHE.DEDUP_ON_INSERT at allocation (block-LRU pool): a request's registration frees the copies
        # it de-duplicates, which the next request's fit and pops see: allocate one request at a time
        self.one_at_a_time = self.dedup and not self.leaf_lru and not self.register_computed
        # registration at allocation that changes what the next request pops (de-duplication frees copies;
        # cache_duplicates="latest" takes a hash over from a free cached block): allocate in order
        self.allocate_in_order = self.one_at_a_time or (self.pool.latest_wins and not self.register_computed)
        self.step_scope = c.max_num_seqs_scope == "step"
        self.first_continues = c.prefill_chunking == "first-continues"
        # SGLang's knobs: a cut prefill (the last of its batch) continues first too
        # (RUN.CONTINUE_PREFILL_FIRST); max_tokens clipped and the input limit at arrival
        # (ARRIVE.CLIP_MAX_TOKENS, REJECT.INPUT_LIMIT); ignore_eos ignores stop tokens too
        # (STOP.IGNORE_EOS_SCOPE); an aborted running request is freed after its next sample
        # (ABORT.AFTER_NEXT_SAMPLE: the slots in ``abort_pending``)
        self.continues = c.prefill_chunking != "any"
        self.clip = c.length_limits == "clip"
        self.ignore_eos_stops = c.ignore_eos_scope == "eos-and-stop-tokens"
        self.abort_after_sample = c.abort_running == "after-next-sample"
        self.abort_pending: set[int] = set()
        self.continued_blocks = 0  # blocks the continued prefills of this step allocated (ESTIMATE.CONTINUED_CHUNK)
        # ESTIMATE.HOLD_UNTIL_DEPARTURE: request ids of the batch admission waits on (None: not held)
        self.plan_hold = c.admission_hold == "until-departure"
        self.hold: frozenset | None = None
        self.touch_rounds = 0  # CACHE.TOUCH_WAITING: open admission rounds so far
        self._pre_batch = 0  # requests running when the step began (the hold needs a running batch)
        self.cut: list[tuple[int, str]] = []  # (slot, request id) of the prefills the last step cut
        self.watermark_blocks = c.watermark_blocks
        self.capacity, self.token_width, self.block_width, self.stop_width = 0, 0, 0, 0
        self.t: dict[str, object] = {}
        #: per slot: the end of the columns of ``token_ids`` any of its requests may have written (its
        #: token room, the widest so far); past it the row is zero (:meth:`_copy_rows`)
        self.row_ends: list[int] = []
        self._grow(capacity, 128, 8, 1)  # (room for a small trace: fewer reallocations while it arrives)
        self.running = self.be.empty_int()
        self.num_waiting = 0
        self.free_slots: list[int] = list(range(capacity - 1, -1, -1))
        self.ids = np.full(capacity, None, dtype=object)  # request id of each slot
        self.sources: list[TraceRequest | None] = [None] * capacity
        self.hashes: list[list[int]] = [[] for _ in range(capacity)]
        self.slot_of: dict[str, int] = {}
        self.host_tables: list[list[int]] | None = [[] for _ in range(capacity)] if host_tables else None
        self.seen: set[str] = set()
        self.num_arrivals = 0
        self.num_with_stop_ids = 0  # queued or running requests that have stop token ids
        self.head_key = -1  # FCFS: next key for a prepended victim (decreasing)
        self.tail_key = 0  # FCFS: next key for an arrival (increasing)
        self.clock = 0  # steps executed so far (the engine advances it): ages for QUEUE.AGING
        self.keyed = c.policy in ("priority", "spf", "sprpt", "edf")  # queue order by key, not by insertion
        #: CPU, FCFS without aging or VTC: the waiting queue's (key, slot) entries in key order, on the
        #: host (:meth:`_queue_head`); an entry is live while its slot still has that key
        self.fifo: deque | None = deque() if (self.be.numpy and not self.keyed and not c.aging_steps
                                              and c.policy != "vtc" and c.slo_admission == "off") else None
        # SLO-aware scheduling (issue 19): EDF order and at-risk decodes first, the slack victim,
        # admission control; each needs the per-request token times kept by :meth:`_note_tokens`
        self.edf = c.policy == "edf"
        self.slack_victim = c.preemption_victim == "slo-slack"
        self.slo = self.edf or self.slack_victim
        self.tc = TenantCounters(c) if c.policy == "vtc" else None  # VTC counters (host side)
        self.estimate = c.admission == "estimate"  # SGLang: new_token_ratio admission + retraction
        # SGLang's add_one_req_ignore_eos (ESTIMATE.IGNORE_EOS_RESERVE): ignore_eos candidates, cache off
        self.eos_reserve = self.estimate and c.ignore_eos_admission == "reserve" and not c.enable_prefix_caching
        # SGLang's input cap without chunking (ADMIT.NO_CHUNKING_EXCLUSIVE): behind the first, tokens < budget left
        self.cap_exclusive = not c.enable_chunked_prefill and c.no_chunking_cap == "exclusive"
        self.ratio = c.new_token_ratio_init
        self.swap = c.preemption_mode == "swap"
        self.cpu_free = c.num_cpu_blocks  # CPU swap pool: only a count (no block ids are logged)
        self.num_swapped = 0  # swapped slots: finite ``swap_key``, swap-in order ascending
        self.eos_token_id = -1  # set by the engine (used by decode spans' stop check)
        # True when every running request decodes one token next step (the last step scheduled
        # all of them, each sampled, nobody was preempted): phase 1 then takes :meth:`_decode_all`
        self.steady = False
        self._ones: dict[int, tuple] = {}  # length -> read-only (ones, all-True) arrays for steady batches
        self._steady_batch = None  # (num_tokens, start, samples) of this step's :meth:`_decode_all`
        self._slack = None  # (sampling slots, clock, min(stop_at - num_tokens)) of the last update
        self._empty = self.be.empty_int()  # a step's empty phases (shared: nothing writes into a 0-length array)
        self._plan = None  # a steady decode streak's block events by phase: see _phase_plan
        # knobs under which a steady step with nothing waiting is phase 1 alone (:meth:`_steady_step`)
        self._steady_knobs = not (self.continues or self.plan_hold or self.slo or self.estimate
                                  or c.slo_admission != "off" or (self.leaf_lru and c.batching == "prefill-first"))
        self.log_state = False  # the engine logs the optional state fields (set by GpuEngine)
        self.registered: dict[str, list[int]] = {}  # logged state: request -> block ordinals registered this step
        # async scheduling: a step's sampled tokens are known one step later; until then each is a
        # placeholder (column ``placeholders``, counted as computed), see :meth:`apply_async`
        self.asynchronous = c.async_scheduling
        # speculative decoding (K = num_speculative_tokens > 0): K drafts proposed after each output,
        # scheduled with the next decode, verified and the rejected ones rolled back in :meth:`update`
        self.num_spec = c.num_speculative_tokens
        self.cache_at_output = bool(self.num_spec and c.spec_cache_at_output and not c.async_scheduling)
        self._pad_others = (False, False)  # (a running request runs in this step, one of them is mid-prefill)
        self.draft_token = None  # f(slot, output index) -> the token there (set by the engine)

    # ------------------------------------------------------------------ storage

    def _grow(self, capacity: int, token_width: int, block_width: int, stop_width: int) -> None:
        """(Re)allocate the per-slot tensors, keeping their contents."""
        be, old = self.be, self.t
        shapes = {name: (capacity,) for name in COLUMNS}
        shapes.update(token_ids=(capacity, token_width), block_table=(capacity, block_width),
                      stop_ids=(capacity, stop_width))
        fills = {"queue_key": INF_KEY, "swap_key": INF_KEY, "block_table": -1, "stop_ids": -1}
        new = {}
        for name, shape in shapes.items():
            t = be.tensor(shape, fills.get(name, 0))
            if name in old:
                src = old[name]
                if len(shape) == 1:
                    t[: src.shape[0]] = src
                elif name == "token_ids" and be.device.type == "cpu":
                    self._copy_rows(be.view(t), be.view(src))
                else:
                    t[: src.shape[0], : src.shape[1]] = src
            new[name] = t
        self.t = new
        for name, t in new.items():
            setattr(self, name, be.view(t))
        if capacity > self.capacity:
            extra = capacity - self.capacity
            self.row_ends += [0] * extra
            if self.capacity:
                self.free_slots = list(range(capacity - 1, self.capacity - 1, -1)) + self.free_slots
                self.ids = np.concatenate([self.ids, np.full(extra, None, dtype=object)])
                self.sources += [None] * extra
                self.hashes += [[] for _ in range(extra)]
                if self.host_tables is not None:
                    self.host_tables += [[] for _ in range(extra)]
        self.capacity, self.token_width, self.block_width, self.stop_width = capacity, token_width, block_width, stop_width

    def _copy_rows(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Copy each slot's token row up to its :attr:`row_ends` (past it the row is still zero:
        nothing was written there).  On CPU the new table is lazily zeroed memory
        (:meth:`Backend.tensor`): copying whole rows would map every page of the old table's
        width, ~1 GB at 16k slots of 8,192 tokens, where the requests' tokens fill a fraction."""
        for s, end in enumerate(self.row_ends):
            if end:
                dst[s, :end] = src[s, :end]

    def _ensure(self, num_tokens: int, num_blocks: int, num_stop: int) -> None:
        cap, tw, bw, sw = self.capacity, self.token_width, self.block_width, self.stop_width
        if not self.free_slots:
            cap *= 2
        while tw < num_tokens:
            tw *= 2
        while bw < num_blocks:
            bw *= 2
        while sw < num_stop:
            sw *= 2
        if (cap, tw, bw, sw) != (self.capacity, self.token_width, self.block_width, self.stop_width):
            self._grow(cap, tw, bw, sw)

    # ------------------------------------------------------------------ arrivals

    def rejection(self, req: TraceRequest) -> str | None:
        """REJECT.*: a prompt with no room for one output token, or a request whose
        peak footprint ``min(prompt + max_tokens - 1, L - 1)`` exceeds the pool."""
        c = self.config
        if not c.reject_unservable:
            return None
        if self.clip:  # REJECT.INPUT_LIMIT: min(L, pool) - 6 tokens or more, or no room for an output
            if req.prompt_len >= c.max_model_len - 6:
                return "prompt_too_long"
            if req.prompt_len >= self._capacity() - 6 or self._output_room(req.prompt_len) < 1:
                return "never_fits"
            return None
        if req.prompt_len + 1 > c.max_model_len:
            return "prompt_too_long"
        peak = min(req.prompt_len + req.max_tokens - 1, c.max_model_len - 1)
        if cdiv(peak, self.bs) > c.usable_blocks:
            return "never_fits"
        if self.estimate:  # it could fail ESTIMATE.ADMIT in an empty engine once retracted
            o = max(min(req.max_tokens, c.max_model_len - req.prompt_len) - 1, 0)
            if req.prompt_len + o + min(req.max_tokens - o, c.clip_max_new_tokens) + self.bs >= c.usable_blocks * self.bs:
                return "never_fits"
        return None

    def _capacity(self) -> int:
        """The longest sequence any request may have: min(L, usable blocks x block size)."""
        return min(self.config.max_model_len, self.config.usable_blocks * self.bs)

    def _output_room(self, p: int) -> int:
        """min(L - p - 2, pool - ceil_B(p) - B - 1): the most outputs under length_limits=clip."""
        bs = self.bs
        return min(self.config.max_model_len - p - 2, self.config.usable_blocks * bs - cdiv(p, bs) * bs - bs - 1)

    def _max_tokens(self, req: TraceRequest) -> int:
        """ARRIVE.CLIP_MAX_TOKENS: max_tokens, cut to :meth:`_output_room` under length_limits=clip."""
        return min(req.max_tokens, self._output_room(req.prompt_len)) if self.clip else req.max_tokens

    def _stops(self, req: TraceRequest) -> tuple[int, ...]:
        """The stop token ids that stop ``req`` (none with ignore_eos under STOP.IGNORE_EOS_SCOPE)."""
        return () if self.ignore_eos_stops and req.ignore_eos else tuple(req.stop_token_ids)

    def add(self, req: TraceRequest, prompt: list[int], chain: list[int] | None = None, future=None) -> None:
        """Queue a request (already checked by :meth:`rejection`); ``prompt`` its token ids,
        ``chain`` (optional, copied) the block hashes of ``prompt``'s full blocks, ``future``
        (optional) the tokens it will sample, written after the prompt ahead of time."""
        c = self.config
        longest = max(min(req.prompt_len + req.max_tokens, c.max_model_len), req.prompt_len + 1)
        stops, max_tokens = self._stops(req), self._max_tokens(req)
        # drafts take KV slots past the tokens a request will ever hold: at most 1 + 2K beyond them
        # (K proposed, plus under async the K drafts and the token of the step in flight)
        slots = longest + 2 * self.num_spec + 1 if self.num_spec else longest
        self._ensure(longest, cdiv(min(slots, c.max_model_len), self.bs) + 1, len(stops))
        s = self.free_slots.pop()
        if self.row_ends[s] < slots:
            self.row_ends[s] = min(slots, self.token_width)
        self.ids[s], self.sources[s] = req.id, req
        self.slot_of[req.id] = s
        p = len(prompt)
        self.token_ids[s, :p] = self.be.asarray(prompt)
        if future is not None and len(future):
            self.token_ids[s, p:p + len(future)] = self.be.asarray(future)
        self.stop_ids[s, :] = -1
        if stops:
            self.stop_ids[s, : len(stops)] = self.be.asarray(list(stops))
            self.num_with_stop_ids += 1
        arrival = self.num_arrivals
        self.num_arrivals += 1
        for name, v in (("prompt_len", p), ("num_tokens", p), ("num_output_tokens", 0), ("num_computed_tokens", 0),
                        ("status", WAITING), ("priority", req.priority), ("arrival", arrival),
                        ("arrival_step", self.clock), ("tenant", self.tc.tenant(req.tenant) if self.tc else 0),
                        ("max_tokens", max_tokens), ("ignore_eos", int(req.ignore_eos)),
                        ("num_blocks", 0), ("num_cached_blocks", 0),
                        ("stop_at", min(p + max_tokens, c.max_model_len)), ("placeholders", 0), ("preemptions", 0),
                        ("proposed", 0), ("verifications", 0), ("mid_prefill", 0)):
            getattr(self, name)[s] = v
        if not self.caching:
            self.hashes[s] = []
        else:
            self.hashes[s] = list(chain) if chain is not None else self._chain([], prompt, salt_root(req.cache_salt))
        self._slo_arrival(s, req)
        self.tie_times[s] = req.tie_time(arrival)
        if req.client_arrival_time is not None and not self.client_times:
            self.client_times = True
        if self.client_times:
            self._rank_ties()
        self._enqueue(s, front=False, arrival=True)

    def _rank_ties(self) -> None:
        """Priority ties under client arrival times (vLLM's ``Request.arrival_time``, which
        need not follow the order of arrival): every live request's rank by (time, id), the
        tie-break of the priority queue's key; queued keys are rebuilt (only traces that
        give such times pay for it)."""
        order = sorted(self.tie_times, key=lambda t: (self.tie_times[t], self.ids[t]))
        self.tie_rank = {t: i for i, t in enumerate(order)}
        if self.config.policy == "priority" and not self.config.aging_steps:
            for t in order:
                if int(self.queue_key[t]) < INF_KEY:
                    self.queue_key[t] = int(self.priority[t]) * PRIORITY_SHIFT + self.tie_rank[t]

    def _chain(self, chain: list[int], tokens: list[int], root: int | None = None) -> list[int]:
        """Extend a block-hash chain over the full blocks of ``tokens`` (prompt + outputs);
        ``root`` is the parent of block 0 (:func:`salt_root`: a request's cache_salt)."""
        bs = self.bs
        for i in range(len(chain), len(tokens) // bs):
            chain.append(hash_block(chain[-1] if chain else root, tokens[i * bs:(i + 1) * bs]))
        return chain

    def _root(self, s: int) -> int | None:
        """The parent hash of slot ``s``'s first block: its cache_salt's, else none."""
        return salt_root(self.sources[s].cache_salt)

    def _enqueue(self, s: int, front: bool, arrival: bool = False) -> None:
        """Waiting queue insert: FCFS tail (arrival) or head (victim); priority / spf / sprpt by
        key (:meth:`_base_key`, then arrival)."""
        if self.keyed:
            tie = self.tie_rank[s] if self.client_times and self.config.policy == "priority" \
                and not self.config.aging_steps else int(self.arrival[s])  # aging keeps the arrival order
            key = self._edf_key(s) if self.edf else self._base_key(s) * PRIORITY_SHIFT + tie
        elif front:
            key, self.head_key = self.head_key, self.head_key - 1
        else:
            key, self.tail_key = self.tail_key, self.tail_key + 1
        self.queue_key[s] = key
        self.num_waiting += 1
        if self.fifo is not None:  # (a head key is below every key, a tail key above)
            (self.fifo.appendleft if front else self.fifo.append)((key, s))
        if self.tc is not None:  # an arrival may lift its tenant's counter; a victim does not
            (self.tc.arrive if arrival else self.tc.requeue)(int(self.tenant[s]))

    def _base_key(self, s: int) -> int:
        """A waiting slot's queue key before aging: the priority number; the prompt length
        under "spf"; under "sprpt" (issue 19) the output it is still predicted to produce,
        ``max(min(predicted, max_tokens) - outputs, 0)`` with predicted = the request's
        ``predicted_output_len``, else ``max_tokens``.  A waiting request's outputs do not
        change (async scheduling is refused with sprpt), so the key is fixed at insertion."""
        policy = self.config.policy
        if policy == "spf":
            return int(self.prompt_len[s])
        if policy == "sprpt":
            cap = int(self.max_tokens[s])
            guess = self.sources[s].predicted_output_len
            return max((cap if guess is None else min(guess, cap)) - int(self.num_output_tokens[s]), 0)
        return int(self.priority[s])

    # ------------------------------------------------------------------ service-level targets (issue 19)

    def _slo_arrival(self, s: int, req: TraceRequest) -> None:
        """A request's targets in steps (:func:`formulas.target_steps`: a timed trace's seconds
        turned into steps by ``slo_step_s``) and its token times (none yet)."""
        timed, step_s = req.arrival_time is not None, self.config.slo_step_s
        ttft = F.target_steps(req.ttft_slo, timed, step_s)
        self.ttft_deadline[s] = F.NEVER if ttft >= F.NEVER else self.clock + ttft - 1
        self.tpot[s] = F.target_steps(req.tpot_slo, timed, step_s)
        self.first_token[s] = self.last_token[s] = -1
        self.slo_missed[s] = self.deferred[s] = self.at_risk_served[s] = 0

    def _due(self, slots: Array) -> Array:
        """When each slot's next token is due (:func:`formulas.due_steps`)."""
        return F.due_steps(self.first_token[slots], self.last_token[slots], self.ttft_deadline[slots], self.tpot[slots])

    def _edf_key(self, s: int) -> int:
        """A waiting slot's EDF queue key (:func:`formulas.edf_keys`): deferred last, then the
        due step of its next token, then arrival.  Fixed while it waits: a waiting request
        samples nothing (async scheduling is refused with edf), only deferral changes it."""
        one = self.be.asarray([s])
        return int(F.edf_keys(self.deferred[one], self._due(one), self.arrival[one])[0])

    def _note_tokens(self, slots: Array) -> None:
        """The slots sampled a token in this step (the clock): first/last token steps, misses."""
        first, last, missed = F.note_tokens(self.first_token[slots], self.last_token[slots], self.slo_missed[slots],
                                            self.ttft_deadline[slots], self.tpot[slots], self.clock)
        self.first_token[slots], self.last_token[slots], self.slo_missed[slots] = first, last, missed

    def _slo_admission(self, batch: Batch) -> None:
        """SLO admission control before admission: every waiting request whose first token is
        not out, not deferred yet, and that can no longer make its TTFT deadline with the whole
        budget from now on (:func:`formulas.feasible`) is refused (``slo_infeasible``; under
        "refuse", a request never admitted) or deferred behind the rest (re-keyed).  Refusals
        are listed in queue order."""
        waiting = xp.nonzero(self.queue_key < INF_KEY)
        if not len(waiting):
            return
        open_ = waiting[(self.first_token[waiting] < 0) & (self.deferred[waiting] == 0)]
        lost = open_[~F.feasible(self.clock, self.num_tokens[open_], self.config.max_num_batched_tokens,
                                 self.ttft_deadline[open_])]
        if not len(lost):
            return
        lost = lost[xp.stable_argsort(self.queue_key[lost])]
        refuse = self.config.slo_admission == "refuse"
        for s, status in zip(xp.to_list(lost), xp.to_list(self.status[lost])):
            if refuse and status == WAITING:  # (one admitted once and preempted since is deferred)
                self.queue_key[s] = INF_KEY
                self.num_waiting -= 1
                batch.refused.append((self.ids[s], SLO_INFEASIBLE))
                self._release(s)
            else:
                self.deferred[s] = 1
                self.queue_key[s] = self._edf_key(s)

    def _serve_at_risk(self, budget: int):
        """EDF: before the running walk, the running decodes whose next token is due now
        (:func:`formulas.at_risk`) each get their token, in running order, while budget and
        max_num_seqs allow and their block (if they need one) is free
        (:func:`formulas.at_risk_grants`); one whose block is missing is left to the walk,
        which preempts for it.  Marks them in ``at_risk_served`` (the walk skips them)."""
        run, c = self.running, self.config
        comp, ntok = self.num_computed_tokens[run], self.num_tokens[run]
        risky = xp.nonzero(F.at_risk(self.first_token[run], self.last_token[run], self.tpot[run], comp, ntok, self.clock))
        empty = self.be.empty_int()
        if not len(risky) or budget <= 0:
            return empty, empty, budget
        cand = run[risky]
        ones = cand * 0 + 1
        need = F.block_demand(comp[risky], ones, self.num_blocks[cand], self.bs, c.max_model_len)
        take = F.at_risk_grants(need, self.pool.num_free, min(budget, c.max_num_seqs))
        if not len(take):
            return empty, empty, budget
        slots, n = cand[take], ones[take]
        self._allocate_cached(slots, need[take], xp.minimum(comp[risky][take] + 1, ntok[risky][take]))
        self.at_risk_served[slots] = 1
        return slots, n, budget - len(take)

    def abort(self, request_id: str) -> bool:
        """Remove a waiting or running request and free its blocks at once."""
        s = self.slot_of.get(request_id)
        if s is None or s in self.abort_pending:
            return False
        cut = any(t == s and self.ids[t] == rid for t, rid in self.cut)  # (a cut prefill goes at once)
        if int(self.status[s]) == RUNNING and self.abort_after_sample and not cut:  # freed after its next sample
            self.abort_pending.add(s)
            return True
        if int(self.status[s]) == RUNNING:
            self._free_tables(self.be.asarray([s]))
            self.status[s] = FREE
            self.running = self.running[self.status[self.running] == RUNNING]
        elif int(self.status[s]) == SWAPPED:
            self.cpu_free += int(self.cpu_blocks[s])
            self.cpu_blocks[s] = 0
            self.swap_key[s] = INF_KEY
            self.num_swapped -= 1
        else:
            self.queue_key[s] = INF_KEY
            self.num_waiting -= 1
            if self.tc is not None:
                self.tc.leave([int(self.tenant[s])])
        self._release(s)
        return True

    def _victim_ties(self, run: Array) -> Array:
        """The second part of the priority victim key, max (priority, arrival time): the
        arrival (unique), or with client arrival times their dense rank among ``run``, so an
        exact tie goes to the earliest in the running list (stable order)."""
        if not self.client_times:
            return self.arrival[run]
        times = [self.tie_times[s] for s in xp.to_list(run)]
        dense = {t: i for i, t in enumerate(sorted(set(times)))}
        return self.be.asarray([dense[t] for t in times])

    def _release(self, s: int) -> None:
        self.tie_times.pop(s, None)
        self.abort_pending.discard(s)
        if self._stops(self.sources[s]):
            self.num_with_stop_ids -= 1
        self.status[s] = FREE
        self.num_blocks[s] = 0
        del self.slot_of[self.ids[s]]
        self.ids[s] = self.sources[s] = None
        self.hashes[s] = []
        self.free_slots.append(s)

    def has_unfinished(self) -> bool:
        return len(self.running) > 0 or self.num_waiting > 0 or self.num_swapped > 0

    # ------------------------------------------------------------------ memory helpers

    def _host_step(self) -> bool:
        """Whether this step may take the CPU's host-side shortcuts (short walks on host ints,
        the FCFS head from :attr:`fifo`, short block-table runs): on CPU, on even steps.  Odd
        steps run the closed forms, which are all the CUDA path runs, so that a fuzz campaign
        on CPU checks both implementations of the same decision."""
        return self.be.numpy and self.clock % 2 == 0

    def _walks(self, n: int) -> bool:
        """Whether a CPU window or walk segment of ``n`` requests is walked on host ints
        (:func:`formulas.admission_walk`, :func:`formulas.running_walk`): when short, on a
        host step (:meth:`_host_step`)."""
        return n <= xp.WALK and self._host_step()

    def _table_entries(self, slots: Array, counts: Array, offset: Array, reverse: bool = False,
                       total: int | None = None):
        """(rows, cols) of ``counts[i]`` consecutive block-table entries of each slot
        starting at ``offset[i]`` (or, reversed, ending just before ``offset[i]``).
        ``total`` (optional): ``sum(counts)``, known to the caller, with every count >= 1."""
        if len(slots) == 1 and self.be.numpy:  # (one request, most calls on CPU: two ranges)
            k, o = int(counts[0]), int(offset[0])
            cols = o - 1 - self.be.arange(k) if reverse else self.be.arange(k, o)
            return cols * 0 + int(slots[0]), cols
        few = self._walks(len(slots))  # a few CPU requests: counts read on the host
        cnt = counts.tolist() if few and total is None else None
        if total is not None:
            one_each = total == len(slots)
        elif few:
            one_each = len(cnt) > 0 and cnt.count(1) == len(cnt)
        else:
            one_each = len(counts) and int(counts.min()) == 1 and int(counts.max()) == 1
        if one_each:  # common: one block each
            return slots, (offset - 1 if reverse else offset)
        if few:
            cnt = cnt if cnt is not None else counts.tolist()
            if sum(cnt) <= xp.SMALL:  # short runs: built on host ints
                return self._entries_host(slots.tolist(), cnt, offset.tolist(), reverse)
        # entry g of the flat run (request r's i-th: g = excl[r] + i) is column offset[r] + i, or
        # reversed offset[r] - 1 - i: one repeat of a per-request term, plus or minus g
        rows = xp.repeat(slots, counts)
        excl = xp.exclusive_cumsum(counts)
        flat = self.be.arange(len(rows))
        if reverse:
            return rows, xp.repeat(offset - 1 + excl, counts) - flat
        return rows, xp.repeat(offset - excl, counts) + flat

    def _entries_host(self, slots: list, counts: list, offset: list, reverse: bool):
        """:meth:`_table_entries` of a few short runs, as host lists turned into arrays."""
        rows = [s for s, k in zip(slots, counts) for _ in range(k)]
        if reverse:
            cols = [o - 1 - i for o, k in zip(offset, counts) for i in range(k)]
        else:
            cols = [o + i for o, k in zip(offset, counts) for i in range(k)]
        return self.be.asarray(rows), self.be.asarray(cols)

    def _free_tables(self, slots: Array) -> None:
        """Free whole block tables, requests in the given order, each tail first (vLLM: the
        leading blocks, shared most, stay cached longest) or, on a radix pool, head first
        (SGLang frees a request's slots as one slice of its row)."""
        held = self.num_blocks[slots]
        if self.pool.release_head_first:
            rows, cols = self._table_entries(slots, held, held * 0)
        else:
            rows, cols = self._table_entries(slots, held, held, reverse=True)
        groups = xp.repeat(self.be.arange(len(slots)), held) if len(slots) > 1 else None  # (None: one table)
        self.pool.free(self.block_table[rows, cols], groups)
        self.num_blocks[slots] = 0
        self.num_cached_blocks[slots] = 0
        if self.host_tables is not None:
            for s in xp.to_list(slots):
                self.host_tables[s] = []

    def _allocate(self, slots: Array, need: Array, total: int | None = None, held: Array | None = None) -> None:
        """Pop ``need[i]`` new blocks for each slot, in order, onto its block table
        (``total``: ``sum(need)`` with every ``need[i] > 0``, and ``held``: the slots'
        ``num_blocks``, when the caller knows them)."""
        if total is None:
            some = xp.nonzero(need)
            if len(some) == 0:
                return
            if len(some) < len(need):
                slots, need = slots[some], need[some]
            total = xp.total(need)
        if held is None:
            held = self.num_blocks[slots]
        if self.owed_pops is not None:  # KV.BATCH_ALLOCATION: taken once the prefill batch is formed
            self.owed_pops.append((xp.copy(slots), xp.copy(need), xp.copy(held), total))
            self.pool.owed += total
            self.num_blocks[slots] = held + need
            return
        self._place(slots, need, held, total)

    def _place(self, slots: Array, need: Array, held: Array, total: int) -> None:
        """Pop ``total`` blocks onto the slots' tables, ``need[i]`` each after their ``held``."""
        blocks = self.pool.pop(total)
        rows, cols = self._table_entries(slots, need, held, total=total)
        self.block_table[rows, cols] = blocks
        self.num_blocks[slots] = held + need
        if self.host_tables is not None:
            self._mirror(slots, need, blocks)

    def _take_deferred(self) -> None:
        """KV.BATCH_ALLOCATION: the prefill batch's promised blocks, popped in batch order (leaves
        evicted for them only now, after every candidate's lookup)."""
        owed, self.owed_pops = self.owed_pops, None
        for slots, need, held, total in owed:
            self.pool.owed -= total
            self._place(slots, need, held, total)

    def _mirror(self, slots: Array, counts: Array, blocks: Array) -> None:
        """Append to the host copy of the block tables (kept only for the exact log,
        so that writing it needs no device-to-host copy of whole tables).  A table is
        replaced, never changed in place, so that every record may keep the list it got."""
        flat, i = xp.to_list(blocks), 0
        for s, k in zip(xp.to_list(slots), xp.to_list(counts)):
            self.host_tables[s] = self.host_tables[s] + flat[i:i + k]  # (a new list: records share the old one)
            i += k

    def _cache_blocks(self, slots: Array, upto_tokens: Array, full: Array | None = None) -> None:
        """Register the newly full blocks covering the first ``upto_tokens`` tokens (``full``:
        their count per slot, when the caller knows the slots hold all of them)."""
        if not self.caching:
            return
        if self.leaf_lru:  # every call walks the tree from the root, new blocks or not
            for s, u in zip(xp.to_list(slots), xp.to_list(upto_tokens)):
                self._insert_tree(s, u)
            return
        if full is None:
            full = xp.minimum(upto_tokens // self.bs, self.num_blocks[slots])  # (hashes past max_model_len: no block)
        cached = self.num_cached_blocks[slots]
        todo = xp.nonzero(full > cached)
        if len(todo) == 0:
            return
        self._register_full(slots[todo], cached[todo], full[todo])

    def _register_full(self, ts: Array, lo: Array, hi: Array) -> None:
        """Register blocks ``lo[i] .. hi[i] - 1`` of each slot ``ts[i]`` (all full, hashed)."""
        ts_l, lo_l, hi_l = xp.to_list(ts), xp.to_list(lo), xp.to_list(hi)  # (the hash map is on the host)
        if self.leaf_lru or self.dedup:
            for s, a, b in zip(ts_l, lo_l, hi_l):
                self._insert_tree(s, b * self.bs) if self.leaf_lru else self._register_dedup(s, a, b)
            return
        chains = self.hashes
        if sum(hi_l) - sum(lo_l) == len(ts_l):  # one new full block each (the steady state; every hi > lo)
            blocks = self.block_table[ts, lo]
            hashes = [chains[s][a] for s, a in zip(ts_l, lo_l)]
        else:
            count = hi - lo
            rows, cols = self._table_entries(ts, count, lo, total=sum(b - a for a, b in zip(lo_l, hi_l)))
            blocks = self.block_table[rows, cols]
            hashes = [h for s, a, b in zip(ts_l, lo_l, hi_l) for h in chains[s][a:b]]
        self.pool.register(blocks, hashes)
        self.num_cached_blocks[ts] = hi
        if self.log_state:
            for s, a, b in zip(ts_l, lo_l, hi_l):
                self.registered.setdefault(self.ids[s], []).extend(range(a, b))

    def _rebind(self, s: int, i: int, cached: int) -> None:
        """CACHE.DEDUP_ON_INSERT: entry ``i`` of slot ``s``'s table becomes the cached block with
        the same content (a reference more); its own block is freed."""
        own = int(self.block_table[s, i])
        self.pool.touch(self.be.asarray([cached]))
        self.block_table[s, i] = cached
        if self.host_tables is not None:
            table = list(self.host_tables[s])
            table[i] = cached
            self.host_tables[s] = table
        self.pool.free(self.be.asarray([own]), self.be.asarray([0]))

    def _register_dedup(self, s: int, lo: int, hi: int) -> None:
        """CACHE.DEDUP_ON_INSERT over the hash map: blocks ``lo .. hi - 1`` of slot ``s`` in
        order, each rebound to the earliest cached block with its hash, else registered."""
        new = []
        for i in range(lo, hi):
            h = self.hashes[s][i]
            first = self.pool.entry.get(h)  # the earliest cached block with this hash
            if first is not None and first != int(self.block_table[s, i]):
                self._rebind(s, i, first)
            else:
                self.pool.register([int(self.block_table[s, i])], [h])
                new.append(i)
        self.num_cached_blocks[s] = max(int(self.num_cached_blocks[s]), hi)
        if self.log_state and new:
            self.registered.setdefault(self.ids[s], []).extend(new)

    def _insert_tree(self, s: int, upto: int) -> None:
        """CACHE.EVICT_LEAF_LRU's insert of slot ``s``'s full blocks up to token ``upto``: walked
        into the radix trie from the root; duplicates rebound (CACHE.DEDUP_ON_INSERT); a path past
        the prompt inserted again up to the prompt's end (which splits it there)."""
        end = min(upto // self.bs, len(self.hashes[s]), int(self.num_blocks[s]))
        if end <= 0:
            return
        chain = self.hashes[s]
        dups, first = self.pool.insert(chain[:end], xp.to_list(self.block_table[s, :end]))
        for i, cached in dups:
            self._rebind(s, i, cached)
        prompt = int(self.prompt_len[s]) // self.bs
        if 0 < prompt < end:
            self.pool.insert(chain[:prompt], xp.to_list(self.block_table[s, :prompt]))
        self.num_cached_blocks[s] = max(int(self.num_cached_blocks[s]), end)
        if self.log_state and end > first:
            self.registered.setdefault(self.ids[s], []).extend(range(first, end))

    def _cache_allocated(self, slots: Array, upto_tokens: Array) -> None:
        """CACHE.REGISTER_AT_ALLOCATION: an allocation's newly full blocks enter the cache at
        once; under cache_register="computed" they wait for :meth:`_cache_computed`."""
        if not self.register_computed:
            self._cache_blocks(slots, upto_tokens)

    def _allocate_cached(self, slots: Array, need: Array, upto_tokens: Array) -> None:
        """:meth:`_allocate` then :meth:`_cache_allocated` for ``slots``.  Under
        cache_duplicates="latest" with registration at allocation, one request's registration
        can take a hash from a free cached block that a later request of the same call then
        pops (so popping it evicts nothing); under cache_dedup="on-insert" it frees the copies
        it de-duplicates, which a later request then pops (instead of evicting a cached block):
        the requests go one at a time, in order."""
        if not (self.allocate_in_order and len(slots) > 1):
            self._allocate(slots, need)
            self._cache_allocated(slots, upto_tokens)
            return
        for j in range(len(slots)):
            self._allocate(slots[j:j + 1], need[j:j + 1])
            self._cache_allocated(slots[j:j + 1], upto_tokens[j:j + 1])

    def _cache_computed(self, batch: Batch) -> None:
        """CACHE.REGISTER_WHEN_COMPUTED: after the step, each request of the batch (batch
        order) registers every block full of computed tokens, before finished requests free."""
        if self.register_computed and not self.prefill_finish and len(batch.slots):
            self._cache_blocks(batch.slots, self.num_computed_tokens[batch.slots])

    def _preempt(self, victims: Array, batch: Batch) -> None:
        """Preempt victims in order: free their GPU tables (all at once, in order), then
        SWAP.OUT those the CPU pool still has room for (``cdiv(computed, bs)`` CPU
        blocks each, in order: a host loop over the victims) and recompute the rest
        (reset, back to the waiting queue; SWAP.FALLBACK_RECOMPUTE under "swap")."""
        self._free_tables(victims)
        recompute = xp.to_list(victims)
        if self.swap:
            need = xp.to_list(cdiv(self.num_computed_tokens[victims], self.bs))
            swapped, recompute = [], []
            for v, k in zip(xp.to_list(victims), need):
                if k <= self.cpu_free:
                    self.cpu_free -= k
                    swapped.append(v)
                    self.cpu_blocks[v] = k
                else:
                    recompute.append(v)
            if swapped:
                sw = self.be.asarray(swapped)
                self.status[sw] = SWAPPED
                self.swap_key[sw] = self._swap_keys(sw)
                self.num_swapped += len(swapped)
                batch.swapped_out += [self.ids[v] for v in swapped]
            if not recompute:
                return
        rc = self.be.asarray(recompute)
        self.status[rc] = PREEMPTED
        self.num_computed_tokens[rc] = 0
        self.placeholders[rc] = 0  # async: a token in flight is delivered stale (apply_async)
        self.proposed[rc] = 0  # a preempted request's drafts are discarded
        self.preemptions[rc] += 1
        for s in recompute:  # RETRACT.TO_TAIL under admission="estimate", else to the front
            self._enqueue(s, front=not self.estimate)

    def _swap_keys(self, slots: Array) -> Array:
        """Swap-in order: arrival, or (priority, arrival) under "priority"."""
        if self.config.policy == "priority":
            return self.priority[slots] * PRIORITY_SHIFT + self.arrival[slots]
        return self.arrival[slots]

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> Batch:
        """One ``schedule()``.  The phases depend on ``batching``:

        * "continuous": phase 1 (running, in order), then phase 2 (admissions)
          unless phase 1 preempted (and ``admit_after_preempt`` is off);
        * "prefill-first": phase 2 first with the whole budget; a step that admits
          anybody is that prefill batch alone, otherwise phase 1 alone;
        * "static": phase 2 only into an empty engine (nothing running at the start
          of the step), phase 1 otherwise.
        """
        self.continuing = {rid for _, rid in self.stash}  # (a continued prefill's last chunk may be one token)
        if self.steady and self._steady_knobs and not (self.num_waiting or self.num_swapped or self.stash):
            batch = self._steady_step()
            if batch is not None:
                return batch
        c = self.config
        self.pool.evicted = []
        if self.stash:  # CACHE.REGISTER_PREFILL_AND_FINISH: the last step's cut prefills, still running
            stash, self.stash = self.stash, []
            for s, rid in stash:
                if self.ids[s] == rid and int(self.status[s]) == RUNNING:
                    self._cache_blocks(self.be.asarray([s]), self.be.asarray([int(self.num_computed_tokens[s])]))
        # KV.BATCH_ALLOCATION: a prefill batch's blocks are taken after it is formed (leaf-lru)
        self.owed_pops = [] if self.leaf_lru and c.batching == "prefill-first" else None
        eligible = len(self.running) + self.num_waiting
        cap = c.long_prefill_token_threshold if eligible > 1 else 0
        if cap and c.long_prefill_token_threshold_adaptive:  # floored at an even split of the budget
            cap = max(cap, c.max_num_batched_tokens // eligible)
        budget = c.max_num_batched_tokens
        empty = self._empty
        batch = Batch(empty, empty, empty, empty)
        if c.long_prefill_token_threshold:
            batch.token_cap = cap
        slots1 = n1 = slots_in = n_in = slots_c = n_c = slots2 = n2 = empty
        starved = not len(self.running) and (self.num_waiting > 0 or self.num_swapped > 0)
        cut_continues = any(self.ids[s] == rid and int(self.status[s]) == RUNNING for s, rid in self.cut)
        had_cut = self.plan_hold and cut_continues
        self._pre_batch = len(self.running)
        if self.continues:  # RUN.CONTINUE_PREFILL_FIRST: before any admission
            slots_c, n_c, budget = self._continue_prefill(budget, cap)
        if c.slo_admission != "off" and c.batching == "prefill-first":  # (every step, before admission)
            self._slo_admission(batch)
        held = c.batching == "prefill-first" and not self.num_swapped and self._held(had_cut)
        if c.batching == "prefill-first" and self.num_waiting and not self.num_swapped and not held:
            self._touch_waiting(cut_continues)
            slots2, n2, budget = self._schedule_waiting(batch, budget, cap, len(slots_c), (slots_c, n_c))
        if self.owed_pops is not None:
            self._take_deferred()
        if not len(slots2) and not len(slots_c):  # (a step that continued a prefill is a prefill batch)
            if len(self.running):
                if self.estimate:
                    self._retract_before_running(batch, budget, cap)
                slots1, n1, budget = self._running_phase(batch, budget, cap)
                if self.estimate:
                    if batch.preempted:  # RETRACT.BATCH_ORDER
                        slots1, n1 = self._retraction_order(slots1, n1)
                    self._next_ratio(bool(batch.preempted))
            if self.num_swapped and not batch.preempted:
                slots_in, n_in, budget = self._schedule_swapped(batch, budget, cap, len(slots1))
            if c.slo_admission != "off" and c.batching != "prefill-first":  # (every step, gates or not)
                self._slo_admission(batch)
            admit = not (c.batching == "prefill-first" or (c.batching == "static" and not starved)
                         or (batch.preempted and not c.admit_after_preempt) or self.num_swapped)
            admit = admit and not self._held(had_cut)
            if admit and self.num_waiting:
                self._touch_waiting(cut_continues)
                if self.num_spec:  # what decides a padded admission (formulas.draft_padding)
                    self._pad_others = (len(slots1) > 0, len(slots1) > 0 and xp.any_true(self.mid_prefill[slots1] > 0))
                slots2, n2, budget = self._schedule_waiting(batch, budget, cap, len(slots1) + len(slots_in))
        fast, self._steady_batch = self._steady_batch, None
        if fast is not None and not len(slots_in) and not len(slots2):  # the steady batch alone
            ntok, start, samples = fast
            slots, n = slots1, n1
            self.num_computed_tokens[slots] = ntok
            batch.all_sample = True
        else:
            slots, n = self.be.cat([slots1, slots_in, slots_c, slots2]), self.be.cat([n1, n_in, n_c, n2])
            start = self.num_computed_tokens[slots]
            done = start + n
            self.num_computed_tokens[slots] = done
            samples = done >= self.num_tokens[slots] + self.placeholders[slots]
            batch.all_sample = xp.all_true(samples)
            if self.num_spec:  # (against the placeholders before this step's)
                self._schedule_drafts(batch, slots, n, start, samples, len(slots1) + len(slots_in) + len(slots_c))
            if self.asynchronous:  # each sampled token is in flight until the next step applies it
                self.placeholders[slots[samples]] += 1
        batch.slots, batch.num_scheduled, batch.start, batch.samples = slots, n, start, samples
        if self.continues or self.plan_hold or self.abort_after_sample:  # continued first in the next step; a cut
            # releases the hold; an abort frees a cut prefill at once (ABORT.CUT_PREFILL_AT_ONCE)
            self.cut = [(s, self.ids[s]) for s in xp.to_list(slots[~samples])] if not batch.all_sample else []
        self.steady = (batch.all_sample and not batch.preempted and len(slots) == len(self.running)
                       and not self.asynchronous and not self.num_spec)  # (the steady closed form: one known token each)
        return batch

    def _steady_step(self) -> Batch | None:
        """:meth:`schedule` of a steady decode step with nothing waiting, swapped out or stashed,
        under knobs whose other phases then have nothing to do (``_steady_knobs``): phase 1's
        :meth:`_decode_all` and its bookkeeping alone, without walking the phase gates.  None
        (nothing changed) when its allocation would fail: the full schedule then runs."""
        c, run = self.config, self.running
        budget = c.max_num_batched_tokens
        if len(run) > budget or (self.step_scope and len(run) > c.max_num_seqs):
            return None
        self.pool.evicted = []
        fast = self._decode_all(budget)
        if fast is None:
            return None
        cap = c.long_prefill_token_threshold if len(run) > 1 else 0  # (what schedule() would note)
        if cap and c.long_prefill_token_threshold_adaptive:
            cap = max(cap, budget // len(run))
        slots, n = fast[0], fast[1]
        batch = Batch(slots, n, self._empty, self._empty, all_sample=True,
                      token_cap=cap if c.long_prefill_token_threshold else None)
        self._pre_batch = len(run)
        if self.tc is not None:  # VTC.CHARGE, before the step's computed tokens move
            self._charge(slots, self.num_computed_tokens[slots], n)
        ntok, batch.start, batch.samples = self._steady_batch
        self._steady_batch = None
        self.num_computed_tokens[slots] = ntok
        if self.abort_after_sample:  # (nothing was cut)
            self.cut = []
        return batch

    def _schedule_drafts(self, batch: Batch, slots: Array, n: Array, start: Array, samples: Array,
                         num_running: int) -> None:
        """Speculative decoding after a step's schedule: the drafts among each request's tokens
        (:func:`formulas.scheduled_drafts`; in the first ``num_running`` entries, the running
        walk's, proposed drafts, whose proposals are now spent; after them, an admission's
        dummy drafts), and for each real verification the drafts its model accepts (numbered
        per request; dummies take no number and are never accepted).  Async: a sampler's
        drafts are placeholders too and it gets K draft placeholders for its next step at once."""
        d = F.scheduled_drafts(start, n, self.num_tokens[slots], self.placeholders[slots])
        if num_running:
            self.proposed[slots[:num_running]] = 0
        self.mid_prefill[slots] = xp.as_int(~samples)
        some = xp.nonzero(d > 0)
        for j, k in zip(xp.to_list(some), xp.to_list(d[some])):
            slot = int(slots[j])
            rid = self.ids[slot]
            batch.drafts[rid] = k
            if j >= num_running:
                batch.accepts[slot] = 0
                continue
            v, src = int(self.verifications[slot]), self.sources[slot]
            batch.accepts[slot] = F.accepted_count(rid, src.spec_accept, src.spec_accept_rate, v, k)
            self.verifications[slot] = v + 1
        if self.asynchronous:
            smp = slots[samples]
            self.placeholders[smp] += d[samples]
            self.proposed[smp] = self.num_spec

    def _retract_evicting(self, victims: Array, batch: Batch, num_run: int) -> None:
        """CACHE.EVICT_ON_RETRACT: for each victim in order, every unlocked leaf is evicted, the
        victim freed, then leaves evicted until ``remaining x retract_decode_steps`` tokens' blocks
        hold no content."""
        steps = self.config.retract_decode_steps
        for k, v in enumerate(xp.to_list(victims), 1):
            self.pool.evict_all()
            self._preempt(self.be.asarray([v]), batch)
            self.pool.make_room(cdiv((num_run - k) * steps, self.bs))

    def _retract_before_running(self, batch: Batch, budget: int, cap: int) -> None:
        """RETRACT.BATCH_TEST (admission="estimate"): while the blocks the running walk would
        allocate do not fit the free ones, retract the victim rule's pick (one request always
        stays); the survivors then run in retraction order.  SGLang tests the whole decode batch
        (check_decode_mem) and retracts (retract_decode) before it allocates anything."""
        limit = self.config.max_num_seqs if self.step_scope else None
        retracted = False
        while len(self.running) > 1:
            run = self.running
            failed = self._segment(run, self.num_computed_tokens[run], self.num_tokens[run], budget, cap, limit,
                                   False)[-1]
            if not failed:
                break
            self.running = self._preempt_victims(run[self._victim_order(run)[:1]], batch, run)
            retracted = True
        if retracted:  # RETRACT.BATCH_ORDER
            self._retraction_order(self.be.empty_int(), self.be.empty_int())

    def _preempt_victims(self, victims: Array, batch: Batch, run: Array) -> Array:
        """Preempt ``victims`` (of the running slots ``run``), in order, logged in the batch; SGLang's
        retraction evicts eagerly on its radix pool (CACHE.EVICT_ON_RETRACT).  Returns ``run``
        without them."""
        if self.leaf_lru and self.estimate:
            self._retract_evicting(victims, batch, len(run))
        else:
            self._preempt(victims, batch)
        batch.preempted += [self.ids[v] for v in xp.to_list(victims)]
        return run[self.status[run] == RUNNING]

    def _touch_waiting(self, cut_continues: bool) -> None:
        """CACHE.TOUCH_WAITING (leaf-lru with caching): an open admission round with room for a
        request, or with a prefill the last step cut continuing, is counted; the 1st and every
        32nd looks up the first 128 waiting requests' whole token runs in the trie, the queue
        head last."""
        if not (self.leaf_lru and self.caching):
            return
        if len(self.running) >= self.config.max_num_seqs and not cut_continues:
            return
        due, self.touch_rounds = self.touch_rounds % TOUCH_EVERY == 0, self.touch_rounds + 1
        if not due:
            return
        for s in reversed(xp.to_list(self._queue_head(min(self.num_waiting, TOUCH_MAX)))):
            self.pool.lookup(self.hashes[s], int(self.num_tokens[s]) // self.bs)

    def _held(self, had_cut: bool) -> bool:
        """ESTIMATE.HOLD_UNTIL_DEPARTURE at the admission gate: held while every request of the
        batch it waits on still runs, something runs and no prefill the last step cut continues;
        then it waits on the batch as it is now.  Released otherwise."""
        if self.hold is None:
            return False
        run = [self.ids[s] for s in xp.to_list(self.running)]
        left = any(rid not in self.slot_of or int(self.status[self.slot_of[rid]]) != RUNNING for rid in self.hold)
        if not run or had_cut or left:
            self.hold = None
            return False
        self.hold = frozenset(run)
        return True

    def _estimate_refused(self, e: int, cand: Array, rest: Array, n: Array, budget: int, cap: int,
                          scheduled: int) -> bool:
        """Whether ESTIMATE.ADMIT is the test that stopped admission at window candidate ``e``
        (the first whose estimate fails): the spec tests the budget left, ADMIT.NO_CHUNKING and
        ADMIT.CHUNK_ONLY_FIRST before it, and blocks after it."""
        if e >= len(cand):
            return False
        left = budget - (xp.total(n[:e]) if e else 0)
        r = int(rest[e])
        if left <= 0:
            return False
        # (ADMIT.NO_CHUNKING runs before the estimate; ADMIT.NO_CHUNKING_EXCLUSIVE after it)
        if not self.config.enable_chunked_prefill and not self.cap_exclusive and (min(r, cap) if cap > 0 else r) > left:
            return False
        return not (self.first_continues and scheduled + e > 0 and r > left)

    def _room(self, scheduled: int) -> int:
        """How many more requests may join this step's batch: max_num_seqs minus the running
        requests (ADMIT.MAX_NUM_SEQS), or minus the ``scheduled`` ones already in the batch
        under max_num_seqs_scope="step" (BATCH.MAX_NUM_SEQS_PER_STEP)."""
        return self.admit_limit - (scheduled if self.step_scope else len(self.running))

    def _continue_prefill(self, budget: int, cap: int):
        """RUN.CONTINUE_PREFILL_FIRST: the prefills the last step cut (still running), in that
        step's batch order, each the tokens it still lacks cut to the cap and to the budget
        left, ``n_j = min(capT(rest_j), max(B - excl(capT(rest))_j, 0))`` (0 once it is spent).
        Their blocks were reserved at admission (ADMIT.RESERVE_SEQUENCE); otherwise each
        allocates its chunk's blocks if the free queue has them (nothing happens if not)."""
        c, be = self.config, self.be
        live = [s for s, rid in self.cut if self.ids[s] == rid and int(self.status[s]) == RUNNING]
        self.cut = []
        self.continued_blocks = 0
        if not live:
            empty = be.empty_int()
            return empty, empty, budget
        slots = be.asarray(live)
        comp, ntok = self.num_computed_tokens[slots], self.num_tokens[slots]
        rest = ntok - comp
        want = xp.minimum(rest, cap) if cap > 0 else rest
        n = xp.minimum(want, xp.maximum(budget - xp.exclusive_cumsum(want), 0))
        need = F.block_demand(comp, n, self.num_blocks[slots], self.bs, c.max_model_len)
        keep = []
        for j, k in enumerate(xp.to_list(need)):  # (one or two requests: a host loop)
            if k > self.pool.num_free:
                continue  # KV.NO_FREE_BLOCKS: not continued in this step
            keep.append(j)
            one = slots[j:j + 1]
            if k:
                self._allocate(one, need[j:j + 1])
                self.continued_blocks += k
            self._cache_allocated(one, xp.minimum(comp[j:j + 1] + n[j:j + 1], ntok[j:j + 1]))
        if len(keep) < len(live):
            idx = be.asarray(keep)
            slots, n = slots[idx], n[idx]
        return slots, n, budget - xp.total(n)

    def _estimate_rem(self, continued) -> tuple[float, dict[str, float]]:
        """ESTIMATE.ADMIT's ``rem`` as the admission round begins: free tokens as before this step's
        continued prefills allocated, minus ``ratio_i x remaining_i`` summed in running order
        (ratio 1 for ignore_eos: ESTIMATE.RUNNING_RATIO) over the running requests not continued
        in this step, minus each continued chunk's ``ceil_B(n) + B (+ min(max_tokens, clip) if it
        completes the prompt)`` (ESTIMATE.CONTINUED_CHUNK); host float64, sequential.  With its
        terms, for the log (``free``, ``outputs`` before the ratio, ``running``, ``chunks``)."""
        c, h, bs = self.config, self.be.host, self.bs
        slots_c, n_c = continued if continued is not None else (self.be.empty_int(), self.be.empty_int())
        run = self.running
        if len(slots_c):
            run = run[~xp.isin(run, slots_c)]
        ratio = np.where(h(self.ignore_eos[run]) == 1, 1.0, self.ratio)
        rest = self._remaining_output(run)
        held = (ratio * rest).astype(np.float64)
        free = (self.pool.num_free + self.continued_blocks) * bs
        running = float(np.add.accumulate(held)[-1]) if len(held) else 0.0
        rem, chunks = free - running, 0
        for s, n in zip(xp.to_list(slots_c), xp.to_list(n_c)):
            last = int(self.num_computed_tokens[s]) + n >= int(self.num_tokens[s])
            charge = cdiv(n, bs) * bs + bs + (min(int(self.max_tokens[s]), c.clip_max_new_tokens) if last else 0)
            rem, chunks = rem - charge, chunks + charge
        return rem, {"free": free, "outputs": int(rest.sum()), "running": running, "chunks": chunks}

    def _retraction_order(self, slots: Array, n: Array):
        """RETRACT.BATCH_ORDER after a retraction: the running slots sorted by (outputs, -prompt),
        descending and stable (SGLang keeps its batch in the order it retracted from), and the
        running phase's ``slots``/``n`` in that order too."""
        run = xp.to_list(self.running)
        key = {s: (int(self.num_output_tokens[s]), -int(self.prompt_len[s])) for s in run}
        order = sorted(run, key=key.__getitem__, reverse=True)
        self.running = self.be.asarray(order) if order else self.be.empty_int()
        rank = {s: i for i, s in enumerate(order)}
        pos = sorted(range(len(slots)), key=lambda j: rank.get(int(slots[j]), len(order)))
        if not pos:
            return slots, n
        idx = self.be.asarray(pos)
        return slots[idx], n[idx]

    def _next_ratio(self, retracted: bool) -> None:
        """ESTIMATE.RATIO after a running phase: linear decay to the floor, or, after a
        retraction, ``min(1, (sum outputs + retract_decode_steps x n) / (sum max_tokens + 1))``
        over the n requests still running (unchanged when none is)."""
        c = self.config
        if not retracted:
            self.ratio = max(self.ratio - c.new_token_ratio_decay, c.new_token_ratio_min)
        elif len(self.running):
            outputs = xp.total(self.num_output_tokens[self.running])
            self.ratio = min(1.0, (outputs + c.retract_decode_steps * len(self.running))
                             / (xp.total(self.max_tokens[self.running]) + 1))

    def _estimate_ok(self, extend: Array, slots: Array, rem: float, locked: Array) -> tuple[np.ndarray, np.ndarray]:
        """ESTIMATE.ADMIT for a window: ``(ok, rem_before)``, host float64.

        ``rem_before[j]`` = ``rem`` minus, one subtraction at a time, what each earlier
        candidate reserves (``ceil_B(extend) + min(max_tokens, clip) + block_size + locked``:
        SGLang tests the remaining output but reserves the whole requested one, which differ for
        a request resumed after a retraction): an accumulate, i.e. the same float roundings as a
        sequential loop.  ``locked``: the tokens of each candidate's hit that sit evictable
        (ESTIMATE.OWN_HIT_LOCKED), needed and charged."""
        bs = self.bs
        ext = self.be.host(extend)
        lock = self.be.host(locked)
        out = self._remaining_output(slots)
        whole = np.minimum(self.be.host(self.max_tokens[slots]), self.config.clip_max_new_tokens)
        steps = np.empty(len(ext) + 1)
        steps[0] = rem
        steps[1:] = -(cdiv(ext, bs) * bs + whole + bs + lock).astype(np.float64)
        before = np.add.accumulate(steps)
        return ext + out + bs + lock < before[:-1], before

    def _remaining_output(self, slots: Array) -> np.ndarray:
        """ESTIMATE.REMAINING: ``min(max(max_tokens - outputs, 0), clip_max_new_tokens)`` (host)."""
        h = self.be.host
        left = np.maximum(h(self.max_tokens[slots]) - h(self.num_output_tokens[slots]), 0)
        return np.minimum(left, self.config.clip_max_new_tokens)

    def _note_cap(self, batch: Batch, cap: int) -> None:
        """Logged state ``token_cap``: the per-request cap a phase applies, as it applies it
        (the largest, were two phases of one step to apply different caps)."""
        if batch.token_cap is not None:
            batch.token_cap = max(batch.token_cap, cap)

    def _schedule_swapped(self, batch: Batch, budget: int, cap: int, scheduled: int = 0):
        """SWAP.IN: the swapped queue's head prefix that fits (:func:`formulas.swap_in`)
        rejoins the running list's tail, computing its next chunk in this step
        (``scheduled``: requests already in this step's batch)."""
        self._note_cap(batch, cap)
        c = self.config
        width = min(self.num_swapped, self._room(scheduled))
        empty = self.be.empty_int()
        if width <= 0 or budget <= 0:
            return empty, empty, budget
        cand = xp.smallest_k(self.swap_key, width)
        comp, ntok = self.num_computed_tokens[cand], self.num_tokens[cand]
        count, n, need = F.swap_in(
            F.token_demand(ntok, comp, cap, c.max_model_len), comp, ntok, budget=budget, free=self.pool.num_free,
            watermark=self.watermark_blocks, num_running=len(self.running), full_isl=c.scheduler_reserve_full_isl,
            block_size=self.bs, max_model_len=c.max_model_len)
        if not count:
            return empty, empty, budget
        adm, n, comp = cand[:count], n[:count], comp[:count]
        self._allocate_cached(adm, need[:count], xp.minimum(xp.minimum(comp, c.max_model_len) + n, ntok[:count]))
        self.status[adm] = RUNNING
        self.swap_key[adm] = INF_KEY
        self.cpu_free += xp.total(self.cpu_blocks[adm])
        self.cpu_blocks[adm] = 0
        self.num_swapped -= count
        self.running = self.be.cat([self.running, adm])
        names = [self.ids[s] for s in xp.to_list(adm)]
        batch.resumed += names
        batch.swapped_in += names
        if self.tc is not None:
            self._charge(adm, comp, n)
        return adm, n, budget - xp.total(n)

    def _running_phase(self, batch: Batch, budget: int, cap: int):
        """Phase 1 (:meth:`_schedule_running`, after EDF's at-risk decodes), its given-back
        victims dropped, charged under VTC."""
        served = self._serve_at_risk(budget) if self.edf else None
        if served is not None:
            budget = served[2]
        slots1, n1, budget, unscheduled = self._schedule_running(batch, budget, cap, served)
        if served is not None and len(served[0]):
            self.at_risk_served[served[0]] = 0
        if unscheduled:
            keep = ~xp.isin(slots1, self.be.asarray(unscheduled))
            slots1, n1 = slots1[keep], n1[keep]
        if self.tc is not None:
            self._charge(slots1, self.num_computed_tokens[slots1], n1)
        return slots1, n1, budget

    def _charge(self, slots: Array, start: Array, n: Array) -> None:
        """VTC.CHARGE, in batch order (host floats: see :mod:`gpu_engine.fairness`)."""
        h = self.be.host
        self.tc.charge(h(self.tenant[slots]), h(self.prompt_len[slots]), h(start), h(n))

    def _victim_order(self, run: Array) -> Array:
        """Positions in ``run`` in the order the victim rule picks them.

        FCFS: ``running[-1]`` each time, i.e. the list from the tail.  Priority:
        ``max(priority, arrival)`` each time, i.e. descending key (keys are unique
        because arrivals are, so the tie rule never applies)."""
        if self.estimate:  # fewest outputs, then longest prompt, then latest in the list
            key = self.num_output_tokens[run] * PRIORITY_SHIFT - self.prompt_len[run]
            rev = self.be.arange(len(run))[::-1] if self.be.numpy else self.be.arange(len(run)).flip(0)
            return rev[xp.stable_argsort(key[rev])]
        if self.slack_victim:  # PREEMPT.VICTIM_SLO_SLACK: missed first, then the most slack
            due = self._due(run)
            return F.slack_victim_order(xp.where(due < self.clock, 1, self.slo_missed[run]), due)
        if self.config.policy == "priority":
            key = self.priority[run] * PRIORITY_SHIFT + self._victim_ties(run)
            return xp.stable_argsort(-key)
        return self.be.arange(len(run))[::-1] if self.be.numpy else self.be.arange(len(run)).flip(0)

    def _freed_in_order(self, victims: Array) -> Array:
        """Blocks each request would return if all were freed in this order
        (shared prefix blocks return with their last holder)."""
        held = self.num_blocks[victims]
        if not self.caching:  # nothing is shared
            return held
        rows, cols = self._table_entries(victims, held, held * 0)
        blocks = self.block_table[rows, cols]
        position = xp.repeat(self.be.arange(len(victims)), held)
        last = self.pool._last
        last[blocks] = -1
        xp.scatter_max(last, blocks, position)
        return F.freed_by_position(position, last[blocks], len(victims))

    def _schedule_running(self, batch: Batch, budget: int, cap: int, served=None):
        """Phase 1 in segments: each segment is the closed form up to the next failed
        allocation; a failure is one preemption event (the only Python loop).
        ``served``: EDF's at-risk decodes, already in the batch (the walk skips them)."""
        self._note_cap(batch, cap)
        c = self.config
        limit = c.max_num_seqs if self.step_scope else None  # BATCH.MAX_NUM_SEQS_PER_STEP
        early = served is not None and len(served[0]) > 0
        if self.steady and not early and len(self.running) <= budget and (limit is None or len(self.running) <= limit):
            fast = self._decode_all(budget)
            if fast is not None:
                return fast
        run, i = self.running, 0
        seg_slots, seg_n = ([served[0]], [served[1]]) if early else ([], [])
        unscheduled = []
        num_scheduled = len(served[0]) if early else 0
        give_back = c.policy == "priority" or self.estimate or self.slack_victim or early
        while i < len(run) and budget > 0 and (limit is None or num_scheduled < limit):
            seg = run[i:i + 1] if self.one_at_a_time else run[i:]
            comp = self.num_computed_tokens[seg]
            ntok = self.num_tokens[seg]
            n, need, f, take, failed = self._segment(seg, comp, ntok, budget, cap,
                                                     None if limit is None else limit - num_scheduled, early)
            ts, tn = seg[take], n[take]
            self._allocate_cached(ts, need[take], xp.minimum(comp[take] + tn, ntok[take]))
            seg_slots.append(ts)
            seg_n.append(tn)
            budget -= xp.total(tn)
            num_scheduled += len(ts)
            if not failed:
                if self.one_at_a_time and f == len(seg) and i + 1 < len(run):
                    i += 1
                    continue
                break
            # -- preemption event at run[i + f] --
            p = i + f
            r, nr, dr = int(run[p]), int(n[f]), int(need[f])
            order = self._victim_order(run)
            self_pos = int(xp.nonzero(order == p)[0])
            count, self_preempted = F.victims_needed(self._freed_in_order(run[order]), self.pool.num_free, dr, self_pos)
            vpos = order[:count]
            victims = run[vpos]
            if give_back:  # a victim scheduled earlier (in the walk or at risk) gives its tokens back
                for ss, sn in zip(seg_slots, seg_n):
                    hit = xp.isin(ss, victims)
                    if xp.any_true(hit):
                        budget += xp.total(sn[hit])
                        unscheduled += xp.to_list(ss[hit])
                        num_scheduled -= xp.total(hit * 1)
            shift = int((vpos < p).sum())
            run = self._preempt_victims(victims, batch, run)
            i = p - shift
            if self_preempted:
                if self.estimate or (c.policy == "priority" and c.priority_self_preempt == "continue"):
                    continue
                break
            one = self.be.asarray([r])
            self._allocate(one, self.be.asarray([dr]))
            self._cache_allocated(one, xp.minimum(comp[f:f + 1] + nr, ntok[f:f + 1]))
            seg_slots.append(one)
            seg_n.append(self.be.asarray([nr]))
            budget -= nr
            num_scheduled += 1
            i += 1
        self.running = run
        return self.be.cat(seg_slots), self.be.cat(seg_n), budget, unscheduled

    def _segment(self, seg: Array, comp: Array, ntok: Array, budget: int, cap: int, limit: int | None, early: bool):
        """One segment of phase 1's walk, up to its first failed allocation: ``(n, need, f, take,
        failed)``: grants and new blocks (of the reached requests, or at least up to ``f``), the
        first request whose allocation fails (else the number reached; ``limit``: only while
        fewer were granted tokens), the positions before it granted tokens, and whether one
        failed.  A short CPU segment (no async, drafts or at-risk decodes) is walked on host
        ints (:func:`formulas.running_walk`, the same values)."""
        c = self.config
        if self._walks(len(seg)) and not (self.asynchronous or self.num_spec or early):
            n, need, f, failed = F.running_walk(ntok.tolist(), comp.tolist(), self.num_blocks[seg].tolist(),
                                                budget=budget, cap=cap, max_model_len=c.max_model_len,
                                                block_size=self.bs, free=self.pool.num_free, limit=limit)
            take = self.be.asarray([j for j in range(f) if n[j] > 0])
            return self.be.asarray(n), self.be.asarray(need), f, take, failed
        if self.asynchronous:
            demand = self._async_demand(seg, comp, ntok + self.proposed[seg] if self.num_spec else ntok, cap)
        elif self.num_spec:  # its proposed drafts too (spent once it is scheduled)
            demand = F.token_demand(ntok + self.proposed[seg], comp, cap, c.max_model_len)
        else:
            demand = F.token_demand(ntok, comp, cap, c.max_model_len)
        if early:  # served at risk: nothing more this step
            demand = xp.where(self.at_risk_served[seg] > 0, 0, demand)
        n, reached = F.grant_tokens(demand, budget)
        if limit is not None:  # reached while fewer than max_num_seqs were scheduled (a prefix too)
            reached = reached & (xp.exclusive_cumsum((n > 0) * 1) < limit)
        k = xp.total(reached)  # reached is a prefix
        need = F.block_demand(comp[:k], n[:k], self.num_blocks[seg[:k]], self.bs, c.max_model_len)
        f = F.first_overflow(need, self.pool.num_free)
        return n, need, f, xp.nonzero(n[:f] > 0), f < k

    def _async_demand(self, seg: Array, comp: Array, ntok: Array, cap: int) -> Array:
        """Async scheduling: tokens in flight count as tokens to compute past (``num_tokens +
        placeholders``); a request with a placeholder whose known outputs plus that one reach
        ``max_tokens`` (``computed + 2 - placeholders >= prompt + max_tokens``) asks for none."""
        ph = self.placeholders[seg]
        demand = F.token_demand(ntok + ph, comp, cap, self.config.max_model_len)
        done = (ph > 0) & (comp + 2 - ph >= self.prompt_len[seg] + self.max_tokens[seg])
        return xp.where(done, 0, demand)

    def _decode_all(self, budget: int):
        """Phase 1 in the steady state: every running request decodes (``num_tokens =
        computed + 1``, so its demand is 1: ``num_tokens <= L - 1`` while it runs) and the
        budget covers them all.  The same rules as the general walk (:func:`formulas.block_demand`,
        :meth:`_allocate`, :meth:`_cache_blocks`), minus its segment and preemption
        bookkeeping; ``None`` when an allocation would fail (the general walk then finds
        the preemption point, nothing having changed)."""
        run = self.running
        ones, all_true = self._steady_arrays(len(run))
        ntok = self.num_tokens[run]
        plan = self._phase_plan(run)
        if plan is not None:  # the same requests as last step, one token further (see _phase_plan)
            grow, todo = plan
            held = self.num_blocks[run[grow]] if len(grow) else grow
        else:
            held = self.num_blocks[run]
            grow = xp.nonzero(F.decode_grows(ntok, held, self.bs))  # (each of them needs one block)
            held = held[grow]
        if len(grow) > self.pool.num_free:
            self._plan = None
            return None
        if self.allocate_in_order:  # (request by request: see _allocate_cached)
            self._allocate_cached(run, xp.as_int(F.decode_grows(ntok, self.num_blocks[run], self.bs)), ntok)
        else:
            if len(grow):
                self._allocate(run[grow], ones[:len(grow)], len(grow), held)
            if not self.register_computed:  # CACHE.REGISTER_AT_ALLOCATION; every t < L, so t // bs blocks are held
                if plan is None:
                    self._cache_blocks(run, ntok, ntok // self.bs)
                elif self.caching and len(todo):
                    ts = run[todo]
                    lo = self.num_cached_blocks[ts]
                    self._register_full(ts, lo, lo + ones[:len(todo)])
        self._steady_batch = (ntok, self.num_computed_tokens[run], all_true)  # (computed = t - 1: a gather, not a subtraction)
        self._note_steady(run)
        return run, ones, budget - len(run), []

    def _note_steady(self, run: Array) -> None:
        """After a steady step's schedule: start or extend the streak :meth:`_phase_plan` reads."""
        plan, clock = self._plan, self.clock
        if plan is not None and plan[0] is run and plan[1] == clock - 1:
            plan[1] = clock
        else:  # (run, last steady clock, phases by token phase, the clock they are for; 0/-1/-2: not yet made)
            self._plan = [run, clock, None, 0]

    def _phase_plan(self, run: Array):
        """Steady decode continued: the last step (clock - 1) was steady decode of this same
        running array, so each request gained exactly one token since, and nothing else changed
        its blocks.  Then with ``t`` its tokens at this step's start and ``p = t mod bs``, its
        block events are periodic in the step number: it pops a block iff ``t - 1`` is a multiple
        of bs (:func:`formulas.decode_grows` with ``held = cdiv(t - 1, bs)``), registers one iff
        ``t`` is (``num_cached_blocks = (t - 1) // bs``), and the token appended in this step's
        update fills one iff ``t + 1`` is.  The positions by phase are made once per streak (on
        its third step, checked against ``held`` and ``num_cached_blocks`` that the closed forms
        hold: not under full reservation, registration when computed, or latest-wins), then
        each step is two look-ups: ``(pops, registers)``; None otherwise (:meth:`update` looks
        up the fills itself)."""
        plan, clock, bs = self._plan, self.clock, self.bs
        if plan is None or plan[0] is not run or plan[1] != clock - 1 or len(run) < 4:
            return None
        if plan[2] is None:
            if plan[3] == 0:  # the streak's second step: build next time (short streaks pay nothing)
                plan[3] = -1
                return None
            if plan[3] == -2:  # (the closed forms do not hold for this streak)
                return None
            t = self.num_tokens[run]
            exact = (not self.pool.latest_wins and not self.register_computed
                     and xp.all_true(self.num_blocks[run] == F.cdiv(t - 1, bs))
                     and (not self.caching or xp.all_true(self.num_cached_blocks[run] == (t - 1) // bs)))
            if not exact:
                plan[3] = -2
                return None
            groups: dict[int, list[int]] = {}
            for i, p in enumerate(xp.to_list(t % bs)):
                groups.setdefault(p, []).append(i)
            plan[2], plan[3] = {p: self.be.asarray(g) for p, g in groups.items()}, clock
        phases, d, empty = plan[2], clock - plan[3], self._empty
        return phases.get((1 - d) % bs, empty), phases.get(-d % bs, empty)

    def _steady_arrays(self, n: int) -> tuple:
        """Read-only ``ones(n)`` and ``all-True(n)`` arrays, made once per length."""
        got = self._ones.get(n)
        if got is None:
            ones, true = self.be.asarray([1] * n), self.be.asarray([True] * n, dtype=xp.BOOL)
            if self.be.numpy:
                ones.flags.writeable = true.flags.writeable = False
            got = self._ones[n] = (ones, true)
        return got

    def _schedule_waiting(self, batch: Batch, budget: int, cap: int, scheduled: int = 0, continued=None):
        """Phase 2 in rounds: a window of queue heads, their prefix hits looked up on
        the host, then :func:`formulas.admission`.  A window is cut before the first
        candidate whose hits an earlier admission in the same window could change
        (see :meth:`_lookup_window`); the next round looks it up again.
        ``scheduled``: requests already in this step's batch (:meth:`_room`,
        ADMIT.CHUNK_ONLY_FIRST)."""
        self._note_cap(batch, cap)
        if budget <= 0 or self._room(scheduled) <= 0:  # no round would run (nothing else below has effects)
            if self.log_state:
                batch.admit_stop = self._walk_ended(budget)
            return self._empty, self._empty, budget
        out_slots, out_n = [], []
        continued = continued if continued is not None else (self._empty, self._empty)
        rem = parts = None
        if self.estimate:  # SGLang's rem_total_tokens, fixed as the admission round begins
            rem, parts = self._estimate_rem(continued)
        if self.eos_reserve:  # the round's reserve simulation (built at its first ignore_eos candidate)
            self._round = _ReserveRound(self._free_now(continued), xp.to_list(continued[0]))
        # speculative decoding: one candidate per round (a padded admission pops more blocks than
        # the window's conflict test assumes)
        # leaf-lru: one candidate per round (a lookup splits and stamps the tree, the spec's per head)
        # dedup at allocation: one candidate per round (see one_at_a_time)
        single = self.num_spec or self.leaf_lru or self.one_at_a_time
        window = 1 if single else 8
        while budget > 0 and self.num_waiting > 0 and self._room(scheduled) > 0:
            if self.tc is not None:  # VTC: one admission per round, each charge moves the pick
                keys = xp.where(self.tenant == self.tc.pick(), self.queue_key, INF_KEY)
                cand = xp.smallest_k(keys, 1)
            else:
                # rounds of growing windows (8, 16, ...): a round ends at the first candidate that
                # fails, so looking up the hits of a long queue's whole head is mostly wasted when
                # the budget admits a few long prompts; more rounds change no decision (each starts
                # from the state the last one left, as the cut at a conflict already does)
                width = min(self.num_waiting, self._room(scheduled), budget, window)
                window *= 1 if single else 2
                cand = self._queue_head(width)
            ntok = self.num_tokens[cand]
            before_round, e = (budget, scheduled), None  # (what the logged refusal is tested against)
            if self.caching:
                cand, ntok, hits, nhit, evictable = self._lookup_window(cand, ntok)
            else:
                hits = self.be.empty_int()
                nhit = evictable = ntok * 0
            count, n, need = self._admission(cand, ntok, nhit, evictable, budget, cap)
            formula = count  # (the admission formula's own first refusal, for the logged stop)
            if rem is not None:
                if batch.estimate_rem is None:
                    batch.estimate_rem, batch.estimate_parts = rem, parts
                ok, before = self._estimate_ok(ntok - nhit * self.bs, cand, rem, evictable * self.bs)
                if self.eos_reserve:
                    ok = self._reserve_window(ok, before, cand, ntok - nhit * self.bs)
                e = xp.first_true(~ok)
                count = min(count, e)
                rem = float(before[count])
            if self.first_continues:
                count = min(count, self._first_cut_only(ntok - nhit * self.bs, budget, cap, scheduled))
            if self.cap_exclusive:
                count = min(count, self._leaves_budget(ntok - nhit * self.bs, budget, cap, scheduled))
            # ESTIMATE.HOLD_UNTIL_DEPARTURE: the estimate refused the head, with a batch running since the step began
            hold = (self.plan_hold and rem is not None and count == e and self._pre_batch > len(continued[0])
                    and self._estimate_refused(e, cand, ntok - nhit * self.bs, n, budget, cap, scheduled))
            if count:
                self._admit(batch, cand[:count], ntok[:count], n[:count], need[:count], hits, nhit[:count], evictable[:count])
                out_slots.append(cand[:count])
                out_n.append(n[:count])
                if self.eos_reserve:
                    self._round.fresh += xp.to_list(cand[:count])
                budget -= xp.total(n[:count])
                scheduled += count
            if hold:
                self.hold = frozenset(self.ids[s] for s in xp.to_list(self.running))
            if count < len(cand) or count == 0:
                if self.log_state:
                    batch.admit_stop = self._refusal(count, cand, ntok, nhit, evictable, *before_round, cap, e,
                                                     formula) if count < len(cand) else self._walk_ended(budget)
                break
        else:  # (the loop's own test ended the walk: no candidate was refused)
            if self.log_state:
                batch.admit_stop = self._walk_ended(budget)
        return self.be.cat(out_slots), self.be.cat(out_n), budget

    def _walk_ended(self, budget: int) -> str:
        """Logged state ``admit_stop`` when no candidate was refused: nobody left waiting, the
        budget spent, else the batch full (max_num_seqs), in that order."""
        return "empty" if not self.num_waiting else "budget" if budget <= 0 else "seqs"

    def _refusal(self, j: int, cand: Array, ntok: Array, nhit: Array, evictable: Array, budget: int, scheduled: int,
                 cap: int, e: int | None, formula: int) -> str | None:
        """Logged state ``admit_stop``: the gate that refused the round's candidate ``j`` (all before
        it admitted; ``budget`` and ``scheduled`` as the round began; ``e`` and ``formula``: the first
        refusal of the estimate and of :func:`formulas.admission`), tested in this engine's order: the
        budget spent, the configuration's admission tests (no chunking, only the first cut, the memory
        estimate, SGLang's exclusive budget), the padded decode, the blocks (:meth:`_admission` on the
        candidate alone, chunk test off, when chunked prefill is off: else the blocks are all the formula
        tests besides those).  A refusal by the formula that the blocks do not explain is its chunk test;
        one by no test at all is None (not logged: no gate can be named)."""
        bs = self.bs
        rest = xp.to_list(ntok - nhit * bs)
        pad = self._draft_padding(ntok, nhit)
        pad = xp.to_list(pad) if pad is not None else [0] * len(rest)
        asks = [min(r + p, cap) if cap > 0 else r + p for r, p in zip(rest, pad)]
        left, own = max(budget - sum(asks[:j]), 0), rest[j]
        whole = not self.config.enable_chunked_prefill and not self.cap_exclusive
        if left <= 0:
            return "budget"
        if whole and (min(own, cap) if cap > 0 else own) > left:
            return "whole"
        if self.first_continues and self._first_cut_only(ntok - nhit * bs, budget, cap, scheduled) == j:
            return "first"
        if e == j:
            return "estimate"
        if self.cap_exclusive and self._leaves_budget(ntok - nhit * bs, budget, cap, scheduled) == j:
            return "whole"
        if pad[j] and asks[j] > left:
            return "pad"
        if formula != j:
            return None
        if not whole:  # (the formula's other tests, the budget left and the padding, passed above)
            return "blocks"
        one = slice(j, j + 1)
        if self._admission(cand[one], ntok[one], nhit[one], evictable[one], left, cap, chunked=True)[0] == 0:
            return "blocks"
        return "whole"

    def _admission(self, cand: Array, ntok: Array, nhit: Array, evictable: Array, budget: int, cap: int,
                   chunked: bool | None = None):
        """:func:`formulas.admission` over a window; a short CPU window without draft padding
        is walked on host ints instead (:func:`formulas.admission_walk`: the same values).
        ``chunked``: in place of the configuration's (the logged stop's blocks-only probe)."""
        c, reserve = self.config, self._reservation(cand)
        walk = dict(budget=budget, free=self.pool.num_free, watermark=self.watermark_blocks,
                    num_running=len(self.running), cap=cap, chunked=c.enable_chunked_prefill,
                    full_isl=c.scheduler_reserve_full_isl, block_size=self.bs, max_model_len=c.max_model_len)
        if chunked is not None:
            walk["chunked"] = chunked
        if self._walks(len(cand)) and not self.num_spec:
            count, n, need = F.admission_walk(ntok.tolist(), nhit.tolist(), evictable.tolist(),
                                              reserve=None if reserve is None else reserve.tolist(), **walk)
            return count, self.be.asarray(n), self.be.asarray(need)
        return F.admission(ntok, nhit * self.bs, nhit, evictable, reserve=reserve,
                           pad=self._draft_padding(ntok, nhit), **walk)

    def _leaves_budget(self, rest: Array, budget: int, cap: int, scheduled: int) -> int:
        """ADMIT.NO_CHUNKING_EXCLUSIVE: the window's candidates before the first one that is not the
        batch's first (``scheduled + j > 0``) and whose tokens ``rest_j`` are at least the budget left
        if all before it were admitted, ``max(B - excl(capT(rest))_j, 0)``."""
        want = xp.minimum(rest, cap) if cap > 0 else rest
        left = xp.maximum(budget - xp.exclusive_cumsum(want), 0)
        behind = self.be.arange(len(rest)) + scheduled > 0
        return xp.first_true((rest > left) | (behind & (rest >= left)))

    def _free_now(self, continued) -> int:
        """Free tokens as the admission round begins (before this step's continued prefills took
        theirs) less each continued chunk's ``ceil_B(n) + B``: SGLang's remaining_current, which
        reserves no outputs."""
        bs = self.bs
        free = (self.pool.num_free + self.continued_blocks) * bs
        return free - sum(cdiv(n, bs) * bs + bs for n in xp.to_list(continued[1]))

    def _reserve_entry(self, s: int) -> tuple[float, int] | None:
        """Slot ``s`` in the reserve simulation: ``(max_tokens x r - outputs, prompt + outputs)``,
        r = 1 for ignore_eos else the ratio; None when nothing is left."""
        out = int(self.num_output_tokens[s])
        r = 1.0 if int(self.ignore_eos[s]) else self.ratio
        left = int(self.max_tokens[s]) * r - out
        return (left, int(self.prompt_len[s]) + out) if left > 0 else None

    def _reserve_window(self, ok: np.ndarray, before: np.ndarray, cand: Array, extend: Array) -> np.ndarray:
        """ESTIMATE.IGNORE_EOS_RESERVE over a window, in queue order up to its first refusal: each
        ignore_eos candidate's ``ok`` is replaced by SGLang's test (its paged tokens within
        ``min(free now, rem)``, then, unless it would run alone, the simulation of every request's
        remaining output, shortest first, keeping one token per request still growing); each
        candidate passed charges the round's free tokens its ``ceil_B(extend) + B``."""
        rnd, bs = self._round, self.bs
        ok = ok.copy()
        slots, ext = xp.to_list(cand), xp.to_list(extend)
        for j, (s, x) in enumerate(zip(slots, ext)):
            paged = cdiv(x, bs) * bs + bs
            if int(self.ignore_eos[s]):
                ok[j] = self._reserve_ok(rnd, s, paged, float(before[j]), not len(self.running) and not j, slots[:j])
            if not ok[j]:
                break
            rnd.free -= paged
        return ok

    def _reserve_ok(self, rnd: "_ReserveRound", s: int, paged: int, rem: float, alone: bool, earlier: list) -> bool:
        if paged > min(rnd.free, rem):
            return False
        entry = self._reserve_entry(s)
        if rnd.states is None:  # the candidate, the running batch, then this round's chunks and admissions
            fresh = rnd.fresh + earlier
            base = [t for t in xp.to_list(self.running) if t not in fresh]
            rnd.states = sorted((e for e in [entry] + [self._reserve_entry(t) for t in base + fresh] if e),
                                key=lambda e: e[0])
        elif entry is not None:  # SGLang's insertion: before the first entry not shorter, else before the last
            at = next((i for i, e in enumerate(rnd.states) if entry[0] <= e[0]), max(len(rnd.states) - 1, 0))
            rnd.states.insert(at, entry)
        if alone:
            return True
        free, gone, n = rnd.free - paged, 0, len(rnd.states)
        for i, (left, held) in enumerate(rnd.states):
            if free + gone - left * (n - i) <= (n - i):  # SGLang's IGNORE_EOS_RESERVE_TOKENS = 1 per request
                return False
            gone += held
        return True

    def _draft_padding(self, ntok: Array, nhit: Array) -> Array | None:
        """Speculative decoding: each candidate's dummy drafts (:func:`formulas.draft_padding`)."""
        if not self.num_spec:
            return None
        hit = nhit * self.bs
        return F.draft_padding(ntok - hit, hit, self.num_spec, *self._pad_others, self.config.max_model_len)

    def _first_cut_only(self, rest: Array, budget: int, cap: int, scheduled: int) -> int:
        """ADMIT.CHUNK_ONLY_FIRST: the window's candidates before the first one that is not the
        batch's first (``scheduled + j > 0``) and whose tokens after its hit (``rest_j``, uncapped)
        exceed the budget left if all before it were admitted, ``max(B - excl(capT(rest))_j, 0)``."""
        want = xp.minimum(rest, cap) if cap > 0 else rest
        left = xp.maximum(budget - xp.exclusive_cumsum(want), 0)
        behind = self.be.arange(len(rest)) + scheduled > 0
        return xp.first_true(behind & (rest > left))

    def _reservation(self, slots: Array) -> Array | None:
        """ADMIT.RESERVE_FULL: slots reserved to completion at admission,
        ``min(prompt + max_tokens - 1, L - 1)``; ADMIT.RESERVE_SEQUENCE: the whole current
        sequence, ``num_tokens`` (None under kv_reservation="step")."""
        if self.config.kv_reservation == "sequence":
            return self.num_tokens[slots]
        if self.config.kv_reservation != "full":
            return None
        return xp.minimum(self.prompt_len[slots] + self.max_tokens[slots] - 1, self.config.max_model_len - 1)

    def _queue_head(self, width: int) -> Array:
        """The ``width`` first waiting slots in queue order: ``smallest_k`` over the queue keys,
        or, on CPU under FCFS, the first live entries of :attr:`fifo` (the same slots: FCFS keys
        only enter at the head or the tail).  A sweep's queue holds thousands: a partition of
        every slot's key each round costs ~30 µs a step where the host queue costs ~1.  Short
        tables use the keys except on host steps (:meth:`_host_step`), so that a CPU fuzz campaign
        runs both."""
        q = self.fifo
        if q is None or (self.capacity <= xp.SORT_ALL and not self._host_step()):
            return xp.smallest_k(self._queue_keys(), width)
        keys = self.queue_key
        while keys[q[0][1]] != q[0][0]:  # (admitted, aborted or refused since: not waiting under that key)
            q.popleft()
        out = []
        for key, s in q:
            if keys[s] == key:
                out.append(s)
                if len(out) == width:
                    break
        return np.array(out, dtype=np.int64)

    def _queue_keys(self) -> Array:
        """The waiting order's keys this step (INF_KEY: not waiting).  QUEUE.AGING: with
        ``aging_steps`` = A > 0 the base key drops by ``(clock - arrival_step) // A``,
        one vectorized op over every slot (ties still go to the earlier arrival)."""
        a = self.config.aging_steps
        if not a:
            return self.queue_key
        waiting = self.queue_key < INF_KEY
        aged = self.queue_key - ((self.clock - self.arrival_step) // a) * PRIORITY_SHIFT
        return xp.where(waiting, aged, INF_KEY)

    def _lookup_window(self, cand: Array, ntok: Array):
        """Prefix hits of the window's candidates, cut at the first one whose lookup
        could be changed by an earlier candidate of the same window:

        (a) its first missing hash is in an earlier candidate's chain (that one would
            register it at allocation: same-step sharing);
        (b) it hits a free cached block, and the earlier candidates could pop past
            every uncached free block (their pops could evict it);
        (c) it hits a free cached block an earlier candidate also hits (that one's
            touch changes whether this one consumes a free block).
        (d) under cache_duplicates="latest" with registration at allocation: it hits a
            hash an earlier candidate registers past its own hits (that one's block
            would replace the hit block in the cache map).

        Candidate 0 never conflicts, so every round makes progress."""
        pool, bs = self.pool, self.bs
        slots, tok = xp.to_list(cand), xp.to_list(ntok)
        # a request that skips the prefix cache (vLLM: prompt_logprobs) looks nothing up
        hit_lists = [[] if self.sources[s].skip_prefix_cache else pool.lookup(self.hashes[s], (t - 1) // bs)
                     for s, t in zip(slots, tok)]
        flat = [b for h in hit_lists for b in h]
        free_hit = set()
        if flat:
            fa = self.be.asarray(flat)
            free_hit = set(xp.to_list(fa[pool.ref_cnt[fa] == 0]))
        cut = len(slots)
        if len(slots) > 1:
            res = self._reservation(cand)
            reserve = [0] * len(slots) if res is None else xp.to_list(res)
            chains: set[int] = set()
            fresh: set[int] = set()  # hashes earlier candidates register at allocation past their hits
            replaces = pool.latest_wins and not self.register_computed
            touched: set[int] = set()
            pops, uncached = 0, None
            for j, (s, t, h) in enumerate(zip(slots, tok, hit_lists)):
                chain = self.hashes[s]
                mine = [b for b in h if b in free_hit]
                if j:
                    if len(h) < (t - 1) // bs and chain[len(h)] in chains:
                        cut = j
                        break
                    if mine and (touched.intersection(mine)):
                        cut = j
                        break
                    if replaces and h and not fresh.isdisjoint(chain[:len(h)]):
                        cut = j
                        break
                    if mine and pops:
                        uncached = pool.num_free_uncached() if uncached is None else uncached
                        if pops > uncached:
                            cut = j
                            break
                chains.update(chain)
                if replaces:
                    fresh.update(chain[len(h):])
                touched.update(mine)
                pops += cdiv(max(min(t, self.config.max_model_len), reserve[j]), bs)
        hit_lists = hit_lists[:cut]
        nhit = self.be.asarray([len(h) for h in hit_lists])
        evictable = self.be.asarray([sum(b in free_hit for b in h) for h in hit_lists])
        hits = self.be.asarray([b for h in hit_lists for b in h])
        return cand[:cut], ntok[:cut], hits, nhit, evictable

    def _admit(self, batch: Batch, adm: Array, ntok: Array, n: Array, need: Array,
               hits: Array, nhit: Array, evictable: Array) -> None:
        """Commit the admitted prefix: touch hits, pop new blocks, register, run."""
        if len(hits):
            own = hits[: xp.total(nhit)]
            self.pool.touch(own)
            rows, cols = self._table_entries(adm, nhit, nhit * 0)
            self.block_table[rows, cols] = own
            if self.host_tables is not None:
                self._mirror(adm, nhit, own)
            if self.log_state:
                flat, i = xp.to_list(own), 0
                for s, k in zip(xp.to_list(adm), xp.to_list(nhit)):
                    if k:
                        batch.hit_blocks[self.ids[s]] = flat[i:i + k]
                    i += k
        self.num_blocks[adm] = nhit
        self.num_cached_blocks[adm] = nhit
        hit_tokens = nhit * self.bs
        self._allocate_cached(adm, need - evictable, xp.minimum(hit_tokens + n, ntok))
        was = xp.to_list(self.status[adm])
        self.status[adm] = RUNNING
        self.num_computed_tokens[adm] = hit_tokens
        self.queue_key[adm] = INF_KEY
        self.num_waiting -= len(adm)
        self.running = self.be.cat([self.running, adm])
        for s, w, k in zip(xp.to_list(adm), was, xp.to_list(hit_tokens)):
            rid = self.ids[s]
            (batch.resumed if w == PREEMPTED else batch.new).append(rid)
            batch.cache_hits[rid] = k
        if self.tc is not None:
            self.tc.leave(xp.to_list(self.tenant[adm]))
            self._charge(adm, hit_tokens, n)

    # ------------------------------------------------------------------ update

    def update(self, batch: Batch, tokens: Array, eos_token_id: int) -> list[tuple[str, str]]:
        """Append each sampled token (``tokens`` aligned with the sampling requests in
        batch order), apply the stop rules, free finished requests in batch order."""
        self._cache_computed(batch)
        if self.num_spec:
            return self._update_verified(batch, tokens, eos_token_id)
        smp = batch.slots if batch.all_sample else batch.slots[batch.samples]
        if len(smp) == 0:
            return self._settle_inserting(batch, smp, smp, None, None, None) if self.prefill_finish else []
        c = self.config
        pos = self.num_tokens[smp]
        self.token_ids[smp, pos] = tokens
        # (+ an array of ones: cheaper than + 1 on small numpy arrays)
        ones = self._steady_arrays(len(smp))[0] if len(smp) <= xp.SMALL else 1
        ntok = pos + ones
        self.num_tokens[smp] = ntok
        self.num_output_tokens[smp] = self.num_output_tokens[smp] + ones
        if self.slo:
            self._note_tokens(smp)
        # cheap screen first: most steps stop nobody (stop_at: the max_tokens / max_model_len length)
        maybe = self._length_slack(smp, ntok) <= 0 or xp.contains(tokens, eos_token_id)
        if self.num_with_stop_ids and not maybe:
            maybe = xp.any_true((self.stop_ids[smp] == tokens[:, None]).any(1))
        if maybe:
            nout = self.num_output_tokens[smp]
            stop_hit = (self.stop_ids[smp] == tokens[:, None]).any(1)
            code = F.stop_codes(tokens, self.ignore_eos[smp] == 0, stop_hit, ntok, nout,
                                self.max_tokens[smp], eos_token_id, c.max_model_len)
            fin_mask = code > 0
        else:
            fin_mask = None
        pending = xp.isin(smp, self.be.asarray(sorted(self.abort_pending))) if self.abort_pending else None
        if pending is not None and fin_mask is not None:  # ABORT.AFTER_NEXT_SAMPLE: no stop rule for them
            fin_mask = fin_mask & ~pending
        if self.caching and not self.prefill_finish:
            plan = self._plan  # a steady decode streak knows which samplers fill a block (see _phase_plan)
            steady = fin_mask is None and plan is not None and plan[2] is not None and plan[0] is smp and plan[1] == self.clock
            grow = plan[2].get((-1 - (self.clock - plan[3])) % self.bs, self._empty) if steady else None
            self._hash_filled(smp, ntok, fin_mask, grow)
        if self.prefill_finish:
            return self._settle_inserting(batch, smp, ntok, fin_mask, code if fin_mask is not None else None, pending)
        # ABORT.AFTER_NEXT_SAMPLE: the aborted requests that sampled go with the finished ones, in batch order
        gone_mask = fin_mask if pending is None else pending if fin_mask is None else fin_mask | pending
        if gone_mask is None or not xp.any_true(gone_mask):
            return []
        gone = smp[gone_mask]
        finished = xp.to_list(fin_mask[gone_mask]) if fin_mask is not None else [False] * len(gone)
        codes = xp.to_list(code[gone_mask]) if fin_mask is not None else [0] * len(gone)  # (read for finished only)
        self._free_tables(gone)
        out = []
        for s, done, why in zip(xp.to_list(gone), finished, codes):
            if done:
                out.append((self.ids[s], self._reason(s, why)))
            self._release(s)
        self.running = self.running[self.status[self.running] == RUNNING]
        return out

    def _hash_filled(self, smp: Array, ntok: Array, fin_mask, grow: Array | None = None) -> None:
        """Hash the blocks this step's new tokens filled, in sampler order (a finished request's
        last one never); ``grow``: the samplers that filled one, when a steady plan knows them."""
        if grow is None:
            full = ntok % self.bs == 0
            if fin_mask is not None:
                full &= ~fin_mask
            grow = xp.nonzero(full)
        if len(grow):
            self._extend_chains(smp[grow], ntok[grow])

    def _settle_inserting(self, batch: Batch, smp: Array, ntok: Array, fin_mask, code, pending) -> list:
        """CACHE.REGISTER_PREFILL_AND_FINISH after the outputs: each sampler in batch order registers
        its computed blocks if it prefilled in this step (a resumed or new request, or a chunk, a
        continued one's last chunk included however short: ``continuing``),
        finished, or is freed after this sample (an abort); a finished or aborted one is then freed,
        in batch order as SGLang releases them; the cut prefills register when the next step
        begins (``stash``, :meth:`schedule`)."""
        if self.caching:
            self._hash_filled(smp, ntok, fin_mask)
        slots = xp.to_list(batch.slots)
        resumed = set(batch.resumed)
        start, before = xp.to_list(batch.start), xp.to_list(self.num_tokens[batch.slots])
        samples = [True] * len(slots) if batch.all_sample else xp.to_list(batch.samples)
        fin = dict(zip(xp.to_list(smp), xp.to_list(fin_mask))) if fin_mask is not None else {}
        why = dict(zip(xp.to_list(smp), xp.to_list(code))) if code is not None else {}
        out, freed = [], False
        for s, st, nt, sm in zip(slots, start, before, samples):
            if not sm:
                continue
            outs = int(self.num_output_tokens[s]) - 1  # (before this step's token)
            done, aborted = fin.get(s, False), s in self.abort_pending
            if done or aborted or self.ids[s] in resumed or self.ids[s] in self.continuing or outs == 0 or st < nt - 2:
                self._cache_blocks(self.be.asarray([s]), self.be.asarray([int(self.num_computed_tokens[s])]))
            if done or aborted:
                self._free_tables(self.be.asarray([s]))
                if done:
                    out.append((self.ids[s], self._reason(s, why[s])))
                self._release(s)
                freed = True
        if freed:
            self.running = self.running[self.status[self.running] == RUNNING]
        self.stash = [(s, self.ids[s]) for s, sm in zip(slots, samples) if not sm]
        return out

    def _update_verified(self, batch: Batch, tokens: Array, eos_token_id: int) -> list[tuple[str, str]]:
        """:meth:`update` with speculative decoding, one sampling request at a time in batch
        order: append its sampled token; if it had drafts, take the rejected ones back from
        its computed tokens and, unless that token stopped it, append the accepted drafts
        (the tokens its own rule samples next) one by one under the stop rules, the first
        stop dropping the rest; with ``spec_cache_at_output`` cache its full blocks up to
        ``min(computed, num_tokens - 1)``; then propose K drafts if it still runs, or free it.
        ``batch.accepted`` becomes request -> drafts accepted (the record's field)."""
        smp = batch.slots[batch.samples]
        finished, accepted = [], {}
        be = self.be
        for s, first in zip(xp.to_list(smp), xp.to_list(tokens)):
            one = be.asarray([s])
            code = self._append_checked(s, one, first, eos_token_id)
            rid = self.ids[s]
            if rid in batch.drafts:
                k, a = batch.drafts[rid], batch.accepts[s]
                accepted[rid] = a
                if int(self.num_computed_tokens[s]) > 0:
                    self.num_computed_tokens[s] -= k - a
                for _ in range(a if code == F.STOP_NONE else 0):
                    code = self._append_checked(s, one, self.draft_token(s, int(self.num_output_tokens[s])), eos_token_id)
                    if code != F.STOP_NONE:
                        break
            if self.cache_at_output:
                upto = min(int(self.num_computed_tokens[s]), int(self.num_tokens[s]) - 1)
                self._cache_blocks(one, be.asarray([upto]))
            if code == F.STOP_NONE:
                self.proposed[s] = self.num_spec
                continue
            self._free_tables(one)
            finished.append((rid, self._reason(s, code)))
            self._release(s)
        batch.accepted = accepted
        if finished:
            self.running = self.running[self.status[self.running] == RUNNING]
        return finished

    def _append_checked(self, s: int, one: Array, token: int, eos_token_id: int) -> int:
        """Append one output token to slot ``s`` (hashing a block it fills) and return its stop
        code (:func:`formulas.stop_codes`'s order)."""
        pos = int(self.num_tokens[s])
        self.token_ids[s, pos] = token
        ntok = pos + 1
        self.num_tokens[s] = ntok
        self.num_output_tokens[s] += 1
        if self.caching and ntok % self.bs == 0:
            self._extend_chains(one, self.be.asarray([ntok]))
        if token == eos_token_id and not int(self.ignore_eos[s]):
            return F.STOP_EOS
        if token in xp.to_list(self.stop_ids[s]):
            return F.STOP_TOKEN
        if ntok >= self.config.max_model_len:
            return F.STOP_MAX_MODEL_LEN
        return F.STOP_MAX_TOKENS if int(self.num_output_tokens[s]) >= int(self.max_tokens[s]) else F.STOP_NONE

    def _reason(self, s: int, code: int) -> str:
        """A stop code's finish reason; a max_tokens cut at arrival (ARRIVE.CLIP_MAX_TOKENS) that is
        reached finishes with max_model_len."""
        if self.clip and code == F.STOP_MAX_TOKENS and int(self.max_tokens[s]) < self.sources[s].max_tokens:
            return FINISH_MAX_MODEL_LEN
        return REASONS[code]

    def _length_slack(self, smp: Array, ntok: Array) -> int:
        """``min(stop_at - num_tokens)`` over the sampling requests after this update (<= 0:
        one reached its length limit).  When they are the same array as in the last update,
        one step earlier, each gained exactly one token since and ``stop_at`` is fixed: the
        last value minus one, no array op (steady decode)."""
        last = self._slack
        if last is not None and last[0] is smp and last[1] == self.clock - 1:
            slack = last[2] - 1
        else:
            slack = xp.smallest_value(self.stop_at[smp] - ntok)
        self._slack = (smp, self.clock, slack)
        return slack

    def apply_async(self, flight: list[tuple[str, int, int]], tokens: list[int], eos_token_id: int
                    ) -> tuple[list[tuple[str, str]], dict[str, int]]:
        """Async scheduling: apply the sampled tokens of the batch in flight (scheduled one step
        earlier), in its batch order.  ``flight``: (request id, output index, preemptions at
        schedule time) of each sampler.  A request that has finished or been aborted since
        drops its token; one preempted since (stale) still appends it, without a placeholder
        to give back; a running one gives back its placeholder and caches its blocks up to
        ``computed - placeholders``.  Then the stop rules; finished requests are freed in
        batch order.  Returns (finished, tokens applied)."""
        live = [(i, self.slot_of[rid]) for i, (rid, _, _) in enumerate(flight) if rid in self.slot_of]
        if not live:
            return [], {}
        be, c = self.be, self.config
        smp = be.asarray([s for _, s in live])
        tok = be.asarray([tokens[i] for i, _ in live])
        stale = be.asarray([flight[i][2] for i, _ in live]) != self.preemptions[smp]
        running = self.status[smp] == RUNNING
        pos = self.num_tokens[smp]
        self.token_ids[smp, pos] = tok
        ntok = pos + 1
        self.num_tokens[smp] = ntok
        self.num_output_tokens[smp] += 1
        fresh = smp[~stale]
        self.placeholders[fresh] -= 1
        if self.caching:
            grow = xp.nonzero(ntok % self.bs == 0)
            if len(grow):
                self._extend_chains(smp[grow], ntok[grow])
            cache = smp[running & ~stale]
            if len(cache):
                self._cache_blocks(cache, self.num_computed_tokens[cache] - self.placeholders[cache])
        stop_hit = (self.stop_ids[smp] == tok[:, None]).any(1)
        code = F.stop_codes(tok, self.ignore_eos[smp] == 0, stop_hit, ntok, self.num_output_tokens[smp],
                            self.max_tokens[smp], eos_token_id, c.max_model_len)
        applied = {flight[i][0]: t for (i, _), t in zip(live, xp.to_list(tok))}
        fin_mask = code > 0
        if not xp.any_true(fin_mask):
            return [], applied
        out = []
        for s, why, was_running in zip(xp.to_list(smp[fin_mask]), xp.to_list(code[fin_mask]),
                                       xp.to_list(running[fin_mask])):
            if was_running:
                self._free_tables(be.asarray([s]))
            else:  # preempted with its last token in flight: it finishes from the waiting queue
                self.queue_key[s] = INF_KEY
                self.num_waiting -= 1
                if self.tc is not None:
                    self.tc.leave([int(self.tenant[s])])
            out.append((self.ids[s], self._reason(s, why)))
            self._release(s)
        self.running = self.running[self.status[self.running] == RUNNING]
        return out, applied

    def apply_async_verified(self, flight: list[tuple[str, int, int, int]], eos_token_id: int
                             ) -> tuple[list[tuple[str, str]], dict[str, int], dict[str, int]]:
        """Async scheduling with speculative decoding: apply the batch in flight, in its batch
        order.  ``flight``: (request id, preemptions at schedule time, drafts, drafts accepted)
        of each sampler.  A request gone since drops its output; otherwise its rejected drafts
        are rolled back from computed tokens and placeholders (not when stale: preemption
        zeroed both), then ``1 + accepted`` tokens from its next output index on are appended
        under the stop rules one by one, a running fresh one gives back a placeholder per
        token appended and caches its blocks up to ``computed - placeholders``; finished
        requests are freed in batch order.  Returns (finished, first tokens applied, drafts
        accepted per request)."""
        finished, applied, accepted = [], {}, {}
        be = self.be
        for rid, preemptions, k, a in flight:
            s = self.slot_of.get(rid)
            if s is None:
                continue  # finished or aborted since: its output is dropped
            one = be.asarray([s])
            stale = preemptions != int(self.preemptions[s])
            running = int(self.status[s]) == RUNNING
            if k:
                accepted[rid] = a
                if not stale and k > a:
                    if int(self.num_computed_tokens[s]) > 0:
                        self.num_computed_tokens[s] -= k - a
                    if int(self.placeholders[s]) > 0:
                        self.placeholders[s] -= k - a
            first = self.draft_token(s, int(self.num_output_tokens[s]))
            applied[rid] = first
            code, count = self._append_checked(s, one, first, eos_token_id), 1
            while code == F.STOP_NONE and count <= a:
                code = self._append_checked(s, one, self.draft_token(s, int(self.num_output_tokens[s])), eos_token_id)
                count += 1
            if not stale:
                self.placeholders[s] -= count
                if running:
                    self._cache_blocks(one, self.num_computed_tokens[one] - self.placeholders[one])
            if code == F.STOP_NONE:
                continue
            if running:
                self._free_tables(one)
            else:  # preempted with its tokens in flight: it finishes from the waiting queue
                self.queue_key[s] = INF_KEY
                self.num_waiting -= 1
                if self.tc is not None:
                    self.tc.leave([int(self.tenant[s])])
            finished.append((rid, self._reason(s, code)))
            self._release(s)
        if finished:
            self.running = self.running[self.status[self.running] == RUNNING]
        return finished, applied, accepted

    def _extend_chains(self, slots: Array, ntok: Array) -> None:
        """Hash each newly full block: the last output token completed it, so it is
        block ``ntok // bs - 1`` (one gather of those blocks' tokens for all requests)."""
        bs, tok = self.bs, self.token_ids
        slots, ntok = xp.to_list(slots), xp.to_list(ntok)
        if self.be.numpy:  # row slices of the CPU array: no gather
            raws = [tok[s, t - bs:t].tolist() for s, t in zip(slots, ntok)]
        else:  # one gather and one device-to-host copy for all
            cols = self.be.asarray(ntok)[:, None] - bs + self.be.arange(bs)[None, :]
            raws = self.be.host(tok[self.be.asarray(slots)[:, None], cols]).tolist()
        for s, t, block in zip(slots, ntok, raws):
            chain = self.hashes[s]
            if len(chain) != t // bs - 1:  # cannot happen; recompute the chain to be safe
                row = self.be.host(self.token_ids[s, :t])
                self.hashes[s] = self._chain(chain, row.tolist(), self._root(s))
                continue
            chain.append(hash_block(chain[-1] if chain else self._root(s), block))

    # ------------------------------------------------------------------ decode spans (simulators)

    def span_ready(self) -> bool:
        """Whether the next steps are pure steady decode that :meth:`decode_span` may run:
        every running request decodes, nothing waits or is swapped out (so no step admits,
        swaps in or re-orders anything), and no per-step state beyond the requests'
        own (VTC counters, SGLang's ratio) changes."""
        return (self.steady and self.num_waiting == 0 and self.num_swapped == 0 and self.tc is None
                and not self.estimate and 0 < len(self.running) <= self.config.max_num_batched_tokens
                and not self.register_computed and not self.abort_pending)  # (a span registers blocks at allocation)

    def decode_span(self, k_max: int, outputs) -> tuple[int, list[int], list[tuple[str, str]]]:
        """Run up to ``k_max`` steady decode steps at once (:meth:`span_ready` must hold):
        ``(k, allocs, finished)`` with ``allocs[j]`` the blocks popped in step ``j`` and
        ``finished`` the requests its last step stopped, with their finish reasons.

        The span runs through the first step in which a request stops (``stop_at``, EOS, a
        stop token) and ends with it, or ends before the first allocation the free queue
        cannot serve (a preemption).  Within it, each step's decisions are the closed forms
        of the per-step path: request ``i`` (``t_i`` tokens) needs ``cdiv(t_i + j, bs)``
        blocks in step ``j`` (:func:`formulas.block_demand` with ``n = 1``), so it pops block
        ``b`` in step ``max(b * bs - t_i + 1, 0)``; its block ``m`` fills when token
        ``(m + 1) * bs - 1`` is appended (step ``(m + 1) * bs - 1 - t_i``, hashed then) and
        is registered in the next step's schedule.  Pops and registrations are applied in
        (step, batch order), the order the per-step path applies them.  A last step that
        stops requests is applied as :meth:`update` applies one (:meth:`_span_finish`): their
        stop codes by :func:`formulas.stop_codes`, the block their last token fills not
        hashed, their tables freed in batch order after the step's pops and registrations.
        ``outputs(slot, first, count)`` gives the tokens a request samples (its output
        indices ``first .. first + count - 1``).  Returns ``(0, [], [])`` when no step
        qualifies, or only one that no length limit stops (``k_max = 1``) or that stops nobody:
        run it as a step.
        """
        bs = self.bs
        run = self.running
        slots = xp.to_list(run)
        t = xp.to_list(self.num_tokens[run])
        stop_at = xp.to_list(self.stop_at[run])
        k = min([k_max] + [st - tt for st, tt in zip(stop_at, t)])  # through the first length stop
        if k < 1 or (k == 1 and k_max == 1 and min(st - tt for st, tt in zip(stop_at, t)) > 1):
            return 0, [], []  # (one step that no length limit ends: a span only if it samples a stop; left to step())
        nout = xp.to_list(self.num_output_tokens[run])
        eos_ok = xp.to_list(self.ignore_eos[run] == 0)
        toks, rows, stopping = [], [], []  # each request's tokens as a list (hashing), and as given (written back)
        for s, o, e in zip(slots, nout, eos_ok):
            got = outputs(s, o, k)
            out = got.tolist() if isinstance(got, np.ndarray) else list(got)
            stops = set(self._stops(self.sources[s]))
            if e:
                stops.add(self.eos_token_id)
            if stops and not stops.isdisjoint(out[:k]):  # through the first step that samples one
                k = next(j for j, tok in enumerate(out[:k]) if tok in stops) + 1
            toks.append(out)
            rows.append(got if isinstance(got, np.ndarray) else out)
            stopping.append(stops)
        held = xp.to_list(self.num_blocks[run])
        rank = self._span_order(run, k) if self.edf else range(len(slots))
        if rank is None:
            return 0, [], []
        pops = sorted((max(b * bs - ti + 1, 0), rank[i], b, i) for i, (ti, h) in enumerate(zip(t, held))
                      for b in range(h, cdiv(ti + k - 1, bs)))
        free = self.pool.num_free
        for n_before, (j, _, _, _) in enumerate(pops):  # an allocation past the free blocks: a preemption
            if n_before >= free and j < k:
                k = j
                break
        # the requests the last step stops (none when a failed allocation cut the span)
        ending = [i for i in range(len(slots)) if k and (t[i] + k >= stop_at[i] or toks[i][k - 1] in stopping[i])]
        if k < 2 and not ending:
            return 0, [], []
        pops = [e for e in pops if e[0] < k]
        allocs = [0] * k
        for j, _, _, _ in pops:
            allocs[j] += 1
        if pops:
            blocks = xp.to_list(self.pool.pop(len(pops)))
            for (j, _, b, i), block in zip(pops, blocks):
                self.block_table[slots[i], b] = block
                if self.host_tables is not None:
                    self.host_tables[slots[i]] = self.host_tables[slots[i]] + [block]  # (see _mirror)
            self.pool.evicted = []
        if self.caching:
            self._span_cache(slots, t, toks, k, rank, ending)
        if self.slo:  # k tokens each, one a step: the first in this step, the last in step clock + k - 1
            self._note_tokens(run)  # (the later gaps are one step: no miss, every tpot being >= 1)
            self.last_token[run] = self.clock + k - 1
        for i, s in enumerate(slots):
            ti = t[i]
            self.token_ids[s, ti:ti + k] = self.be.asarray(rows[i][:k])  # (an array: no list to convert)
            self.num_blocks[s] = max(held[i], cdiv(ti + k - 1, bs))
        self.num_tokens[run] += k
        self.num_output_tokens[run] += k
        self.num_computed_tokens[run] = self.num_tokens[run] - 1
        if not ending:
            return k, allocs, []
        return k, allocs, self._span_finish(run, [toks[i][k - 1] for i in range(len(slots))], ending, rank)

    def _span_finish(self, run: Array, last: list[int], ending: list[int], rank) -> list[tuple[str, str]]:
        """The stops of a decode span's last step, as :meth:`update` applies them: each running
        request's stop code (:func:`formulas.stop_codes` on its last sampled token, ``last[i]``),
        then the stopped ones (``ending``: the candidates) freed in batch order (``rank``:
        EDF serves the at-risk decodes first) and released."""
        c = self.config
        tokens = self.be.asarray(last)
        stop_hit = (self.stop_ids[run] == tokens[:, None]).any(1)
        code = xp.to_list(F.stop_codes(tokens, self.ignore_eos[run] == 0, stop_hit, self.num_tokens[run],
                                       self.num_output_tokens[run], self.max_tokens[run], self.eos_token_id,
                                       c.max_model_len))
        slots = xp.to_list(run)
        done = sorted((i for i in ending if code[i] > 0), key=lambda i: rank[i])
        if not done:  # (cannot happen: the candidates are exactly the requests with a stop code)
            return []
        self._free_tables(self.be.asarray([slots[i] for i in done]))
        out = []
        for i in done:
            s = slots[i]
            out.append((self.ids[s], self._reason(s, code[i])))
            self._release(s)
        self.running = self.running[self.status[self.running] == RUNNING]
        return out

    def _span_order(self, run: Array, k: int) -> list[int] | None:
        """EDF in a decode span: each step serves the at-risk decodes first (their blocks are
        popped and registered first), then the rest, each group in running order; ``rank[i]``
        is request ``i``'s place in that order.  Every step of a steady span has the same
        at-risk set: each request's last token came one step earlier, so it is at risk iff
        its tpot is <= 1.  None (no span) if this step's set differs from that."""
        tpot = self.tpot[run]
        later = xp.to_list(tpot <= 1)
        now = xp.to_list(F.at_risk(self.first_token[run], self.last_token[run], tpot, self.num_tokens[run] - 1,
                                   self.num_tokens[run], self.clock))
        if now != later:
            return None
        order = sorted(range(len(later)), key=lambda i: (not later[i], i))
        rank = [0] * len(order)
        for place, i in enumerate(order):
            rank[i] = place
        return rank

    def _span_cache(self, slots: list[int], t: list[int], toks: list[list[int]], k: int, rank=None,
                    ending: list[int] = ()) -> None:
        """Prefix-cache bookkeeping of a decode span: extend each hash chain over the blocks
        its appended tokens fill (not the one the last token of a request stopped in the last
        step fills, ``ending``: :meth:`update` never hashes that), register blocks in (step,
        allocation order): running order, or ``rank`` (EDF: at-risk decodes first)."""
        bs = self.bs
        regs = []
        for i, (s, ti) in enumerate(zip(slots, t)):
            chain = self.hashes[s]
            last = (ti + k - (i in ending)) // bs  # full blocks after the span's last (hashed) append
            if len(chain) < last:
                lo = len(chain) * bs
                known = xp.to_list(self.token_ids[s, lo:ti]) if lo < ti else []
                row = known + toks[i][:ti + k - max(lo, ti)]
                for m in range(len(chain), last):
                    part = row[(m * bs - lo):((m + 1) * bs - lo)]
                    chain.append(hash_block(chain[-1] if chain else self._root(s), part))
            cached = int(self.num_cached_blocks[s])
            for m in range(cached, (ti + k - 1) // bs):  # registered in step (m + 1) * bs - t_i
                regs.append((max((m + 1) * bs - ti, 0), i if rank is None else rank[i], i, m))
            if (ti + k - 1) // bs > cached:
                self.num_cached_blocks[s] = (ti + k - 1) // bs
        regs.sort()
        if regs:
            rows, cols = self.be.asarray([slots[i] for _, _, i, _ in regs]), self.be.asarray([m for _, _, _, m in regs])
            self.pool.register(self.block_table[rows, cols], [self.hashes[slots[i]][m] for _, _, i, m in regs])

    # ------------------------------------------------------------------ views for records

    def tables(self) -> list[list[int]]:
        """Block tables of the running requests, in running order (for the exact log)."""
        if self.host_tables is not None:  # (never changed in place: each record may keep them as they are)
            tables = self.host_tables
            return [tables[s] for s in xp.to_list(self.running)]
        run = self.running
        held = self.num_blocks[run]
        width = int(held.max()) if len(run) else 0
        flat = self.block_table[run, :width].reshape(-1)
        flat = xp.to_list(flat[(self.be.arange(width)[None, :] < held[:, None]).reshape(-1)])
        out, i = [], 0
        for k in xp.to_list(held):
            out.append(flat[i:i + k])
            i += k
        return out
