"""``GpuEngine``: the engine protocol (DESIGN.md §5) over the tensor scheduler.

Two modes:

* **scheduler-only** (``model=None``): no forward pass; each sampling request's
  token is the trace's synthetic rule ``request.output_token(index, vocab)``.
  This is what differential fuzzing runs.
* **model** (``model=`` a :class:`~gpu_engine.model.PagedLlama`, a
  :class:`~gpu_engine.model.LlamaConfig` (seeded weights), a local folder, or
  ``"tiny"``): one flattened batch per step through the paged decoder, greedy
  (argmax of the last position's logits).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from spec.config import SchedulerConfig, resolve
from spec.formats import (DEFAULT_EOS_TOKEN_ID, DEFAULT_VOCAB_SIZE, LEVELS, StepRecord, Trace, TraceRequest,
                          min_tokens_token)

from gpu_engine import xp
from gpu_engine.formulas import INF_KEY
from gpu_engine.model import AttentionMetadata, LlamaConfig, PagedLlama
from gpu_engine.scheduler import FREE, PREEMPTED, SWAPPED, Batch, Scheduler, salt_root

# _record_state finds the victims (PREEMPTED or SWAPPED) with one ``status >= PREEMPTED``:
# they must stay the last two statuses.
assert SWAPPED == PREEMPTED + 1


def make_model(model, device="cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
               vocab_size: int | None = None) -> PagedLlama:
    """``"tiny"`` / a ``LlamaConfig`` (seeded weights) / a folder / a ``PagedLlama``."""
    if isinstance(model, PagedLlama):
        return model
    if model == "tiny":
        model = LlamaConfig(vocab_size=max(LlamaConfig.vocab_size, vocab_size or 0))
    if isinstance(model, LlamaConfig):
        return PagedLlama.from_seed(model, seed, device=device, dtype=dtype)
    if isinstance(model, (str, Path)):
        return PagedLlama.from_pretrained(model, device=device, dtype=dtype)
    raise TypeError(f"model must be None, 'tiny', a LlamaConfig, a folder or a PagedLlama, got {model!r}")


#: Knobs gpu_engine implements: name -> the values it accepts (None: any value).
#: Every other knob of :class:`SchedulerConfig` must keep its default, so a knob
#: added to the spec later is refused until it is implemented here.
SUPPORTED: dict[str, frozenset | None] = {
    "profile": None, "num_blocks": None, "block_size": None, "null_block": None, "enable_prefix_caching": None,
    "max_num_batched_tokens": None, "max_num_seqs": None, "max_model_len": None, "enable_chunked_prefill": None,
    "long_prefill_token_threshold": None, "scheduler_reserve_full_isl": None, "watermark": None,
    "reject_unservable": None, "admit_after_preempt": None, "max_steps": None, "aging_steps": None,
    "tenant_weights": None, "vtc_input_price": None, "vtc_output_price": None, "num_cpu_blocks": None,
    "new_token_ratio_init": None, "new_token_ratio_min_factor": None, "new_token_ratio_decay_steps": None,
    "retract_decode_steps": None, "clip_max_new_tokens": None,
    "admission": frozenset({"budget", "estimate"}),
    "batching": frozenset({"continuous", "prefill-first", "static"}),
    "policy": frozenset({"fcfs", "priority", "spf", "vtc", "sprpt", "edf"}),  # sprpt, edf: issue 19
    "preemption_victim": frozenset({"policy", "slo-slack"}), "slo_admission": frozenset({"off", "refuse", "defer"}),
    "slo_step_s": None,  # a timed trace's targets in steps (the SLO rules; sprpt ignores it)
    "kv_reservation": frozenset({"step", "full", "sequence"}),
    # nano-vllm's (issue 16 item 5)
    "free_block_order": frozenset({"cached-last", "tail"}),
    "cache_register": frozenset({"allocation", "computed", "prefill-and-finish"}),
    "cache_duplicates": frozenset({"first", "latest"}),
    "cache_eviction": frozenset({"block-lru", "leaf-lru"}),
    "cache_dedup": frozenset({"off", "on-insert"}),
    "max_num_seqs_scope": frozenset({"running", "step"}),
    "prefill_chunking": frozenset({"any", "first-continues", "last-continues"}),
    # SGLang's (issue 16 item 2)
    "length_limits": frozenset({"reject", "clip"}),
    "ignore_eos_scope": frozenset({"eos", "eos-and-stop-tokens"}),
    "abort_running": frozenset({"at-once", "after-next-sample"}),
    "admission_hold": frozenset({"off", "until-departure"}),
    "ignore_eos_admission": frozenset({"estimate", "reserve"}),
    "no_chunking_cap": frozenset({"inclusive", "exclusive"}),
    "preemption_mode": frozenset({"recompute", "swap"}),
    "priority_self_preempt": frozenset({"stop", "continue"}),
    "async_scheduling": frozenset({False, True}),  # True: scheduler-only mode (no model)
    "max_num_active_seqs": None, "long_prefill_token_threshold_adaptive": None,
    # speculative decoding (issue 15 item 4): scheduler-only mode (no model)
    "num_speculative_tokens": None, "spec_cache_at_output": None,
}

#: Request fields of the trace format gpu_engine does not implement yet (issue 15 item 3),
#: with the value that means "not used"; a request that sets one is refused, naming it.
UNSUPPORTED_REQUEST_FIELDS: dict = {}


def check_request_supported(request: TraceRequest) -> None:
    """Raise ``ValueError`` naming the first request field gpu_engine does not implement."""
    for name, unused in UNSUPPORTED_REQUEST_FIELDS.items():
        if getattr(request, name) != unused:
            raise ValueError(f"gpu_engine does not implement the request field {name} "
                             f"(request {request.id!r}: {name}={getattr(request, name)!r})")


def check_supported(config: SchedulerConfig) -> None:
    """Raise ``ValueError`` naming the first knob value gpu_engine does not implement."""
    if config.async_scheduling:  # an in-flight token would change a waiting key / a token time (the spec refuses these too)
        if config.policy in ("sprpt", "edf"):
            raise ValueError(f"gpu_engine does not implement policy={config.policy!r} with async_scheduling=True")
        if config.preemption_victim == "slo-slack":
            raise ValueError("gpu_engine does not implement preemption_victim='slo-slack' with async_scheduling=True")
    default = type(config)()
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name not in SUPPORTED:
            if value != getattr(default, f.name):
                raise ValueError(f"gpu_engine does not implement the knob {f.name}={value!r} "
                                 f"(only its default {getattr(default, f.name)!r})")
        elif SUPPORTED[f.name] is not None and value not in SUPPORTED[f.name]:
            raise ValueError(f"gpu_engine does not implement {f.name}={value!r} "
                             f"(implemented: {', '.join(sorted(map(str, SUPPORTED[f.name])))})")


class GpuEngine:
    """The optimized engine: tensor-resident scheduling (vLLM V1 and the knobs in
    :data:`SUPPORTED`), paged KV, batched forward.  A configuration with a knob value
    it does not implement is refused with a ``ValueError`` naming the knob.

    ``level`` ("decisions", "memory" or "exact") chooses which record fields are
    filled (the cheaper levels skip building block tables for the log).
    ``use_numpy=False`` runs the scheduler's array code as torch ops even on CPU
    (the CUDA code path, testable without a GPU); the default uses numpy views
    on CPU and torch on CUDA.
    ``log_state=True`` also logs the optional state fields (``spec.formats.STATE_FIELDS``:
    computed tokens, VTC counters, the estimate's rem, cache registrations, hit blocks),
    each from this engine's own arrays, for the differ to compare (off by default: it
    costs host work every step).

    ``prompt_cache`` (a dict the caller keeps, e.g. one per simulator process):
    synthesized prompts and their block-hash chains, shared by every engine given
    the same dict, so a trace replayed at many rates synthesizes and hashes each
    prompt once.  ``output_tokens`` (settable): ``f(request, first, count)`` giving a
    request's synthetic output tokens in bulk, for :meth:`decode_span`.
    """

    name = "gpu_engine"

    def __init__(self, config: SchedulerConfig, vocab_size: int = DEFAULT_VOCAB_SIZE,
                 eos_token_id: int = DEFAULT_EOS_TOKEN_ID, device="cpu", model=None,
                 level: str = "exact", dtype: torch.dtype = torch.float32, seed: int = 0,
                 use_numpy: bool | None = None, prompt_cache: dict | None = None, log_state: bool = False):
        if level not in LEVELS:
            raise ValueError(f"level must be one of {', '.join(LEVELS)}, got {level!r}")
        check_supported(config)
        self.config, self.vocab_size, self.eos_token_id, self.level = config, vocab_size, eos_token_id, level
        self.device = torch.device(device)
        self.sched = Scheduler(config, self.device, use_numpy=use_numpy, host_tables=level == "exact")
        self.model = None if model is None else make_model(model, self.device, dtype, seed, vocab_size)
        self.samples_script = model is None  # scheduler-only: tokens are the trace's script (a replay compares them)
        if self.model is not None:
            mc = self.model.config
            if mc.vocab_size < vocab_size:
                raise ValueError(f"trace vocab_size {vocab_size} exceeds the model's {mc.vocab_size}")
            if config.max_model_len > mc.max_position_embeddings:
                raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                                 f"max_position_embeddings {mc.max_position_embeddings}")
            self.model.allocate_kv_cache(config.num_blocks, config.block_size)
        self._aborted: list[str] = []
        self._rejected: list[tuple[str, str]] = []
        self._names_key = None  # (slots array, its request ids): see _names
        self._scheduled_key = None  # (ids list, num_scheduled array, pairs): see _scheduled
        self._ref_key = None  # (the pool's ref counts as bytes, their dict): see _ref_counts
        self._block_names: list[str] = []  # str(block id), by block id: see _ref_counts
        self.prompt_cache = prompt_cache
        self.prompt_tokens = None  # f(request) -> its prompt token ids (default: the trace's rule)
        self.output_tokens = None
        self.want_shape = False  # set by a simulator: step() leaves the batch's shape in last_shape
        self.last_shape = (0, 0, 0)  # (prefill tokens, decode requests, KV tokens read)
        self.sched.eos_token_id = eos_token_id
        self.sched.log_state = log_state  # the optional state fields of spec.formats.STATE_FIELDS
        self.num_steps = 0
        if config.async_scheduling and self.model is not None:
            raise ValueError("gpu_engine implements async_scheduling=True in scheduler-only mode (no model)")
        if config.num_speculative_tokens and self.model is not None:
            raise ValueError("gpu_engine implements num_speculative_tokens > 0 in scheduler-only mode (no model)")
        self.sched.draft_token = self._draft_token
        self.run_step = self._step_async if config.async_scheduling else self._step_sync
        self._flight: tuple[list, list] = ([], [])  # async: (request, index, preemptions), tokens of the batch in flight
        self._last_record: StepRecord | None = None
        self.span_finished: list[tuple[str, str]] = []  # the requests the last decode span stopped

    @classmethod
    def from_trace(cls, trace: Trace, **kw) -> "GpuEngine":
        for request in trace.requests:  # refuse the whole trace up front, before any step
            check_request_supported(request)
        return cls(resolve(trace.config), trace.vocab_size, trace.eos_token_id, **kw)

    # -- protocol ------------------------------------------------------------

    def add_request(self, request: TraceRequest) -> None:
        s = self.sched
        if request.id in s.seen:
            raise ValueError(f"duplicate request id {request.id!r}")
        check_request_supported(request)
        s.seen.add(request.id)
        why = s.rejection(request)
        if why is not None:
            s.num_arrivals += 1  # a rejected request still takes an arrival number
            self._rejected.append((request.id, why))
            return
        future = None
        if self.output_tokens is not None and self.model is None:  # every token it can sample, written ahead
            longest = max(min(request.prompt_len + request.max_tokens, self.config.max_model_len), request.prompt_len + 1)
            future = self.output_tokens(request, 0, longest - request.prompt_len)
            if request.min_tokens:  # the sampler's mask of stop tokens (trace format rule)
                future = list(future)
                for i in range(min(request.min_tokens, len(future))):
                    future[i] = min_tokens_token(request, i, int(future[i]), self.vocab_size, self.eos_token_id)
        if self.prompt_cache is None:
            prompt = self._prompt(request)
            s.add(request, prompt.tolist() if isinstance(prompt, np.ndarray) else prompt, future=future)
            return
        key = (request.id, request.prompt_len, None if request.prompt is None else tuple(request.prompt),
               request.prefix_group, request.prefix_len, self.vocab_size, s.bs if s.caching else 0, request.cache_salt)
        got = self.prompt_cache.get(key)
        if got is None:
            prompt = self._prompt(request)  # (an int64 array is kept as it is; the chain hashes a list)
            tokens = prompt.tolist() if isinstance(prompt, np.ndarray) and s.caching else prompt
            chain = s._chain([], tokens, salt_root(request.cache_salt)) if s.caching else []
            got = self.prompt_cache[key] = (np.asarray(prompt, dtype=np.int64), chain)
        s.add(request, got[0], chain=got[1], future=future)

    def abort_request(self, request_id: str) -> None:
        if self.sched.abort(request_id):
            self._aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.sched.has_unfinished()

    def step(self) -> StepRecord:
        return self.run_step()

    def _step_async(self) -> StepRecord:
        """Async scheduling: schedule this step, then apply the batch in flight (the previous
        step's); this step's tokens are drawn now, at each sampler's output index (known
        outputs + placeholders - 1), and applied by the next step."""
        s = self.sched
        batch = s.schedule()
        names = self._names(batch.slots)
        smp = xp.to_list(batch.slots[batch.samples])
        if s.num_spec:
            return self._step_async_verified(batch, names, smp)
        flight = [(s.ids[i], int(s.num_output_tokens[i] + s.placeholders[i] - 1), int(s.preemptions[i])) for i in smp]
        if self.output_tokens is not None:  # written ahead into the token table at add_request
            tokens = [int(s.token_ids[i, int(s.prompt_len[i]) + k]) for i, (_, k, _) in zip(smp, flight)]
        else:
            tokens = [s.sources[i].output_token(k, self.vocab_size, self.eos_token_id) for i, (_, k, _) in zip(smp, flight)]
        (prev, prev_tokens), self._flight = self._flight, (flight, tokens)
        finished, applied = s.apply_async(prev, prev_tokens, self.eos_token_id)
        return self._async_record(batch, names, applied, finished)

    def _step_async_verified(self, batch: Batch, names: list[str], smp: list[int]) -> StepRecord:
        """:meth:`_step_async` with speculative decoding: a batch entry's tokens are drawn when
        they are applied, from the request's next output index on (how many drafts the batch
        before accepted decides where they go)."""
        s = self.sched
        flight = [(s.ids[i], int(s.preemptions[i]), batch.drafts.get(s.ids[i], 0), batch.accepts.get(i, 0)) for i in smp]
        (prev, _), self._flight = self._flight, (flight, [])
        finished, applied, batch.accepted = s.apply_async_verified(prev, self.eos_token_id)
        return self._async_record(batch, names, applied, finished)

    def _async_record(self, batch: Batch, names: list[str], applied: dict, finished) -> StepRecord:
        """The step's record under async scheduling: this step's batch with the previous
        step's outputs (``outputs_step``), applied now."""
        self.num_steps += 1
        self.sched.clock += 1
        record = self._record(batch, names, list(applied), np.asarray(list(applied.values()), dtype=np.int64), finished)
        record.outputs_step = self._last_record.step if self._last_record is not None else -1
        self._last_record = record
        return record

    def _step_sync(self) -> StepRecord:
        s = self.sched
        batch = s.schedule()
        if batch.refused:  # SLO admission control's rejections (before the record is written)
            self._rejected += batch.refused
        names = self._names(batch.slots)  # read before finished slots are released
        samplers = names if batch.all_sample else s.ids[s.be.host(batch.slots[batch.samples])].tolist()
        if self.want_shape:
            self.last_shape = self._shape(batch)
        tokens = self._execute(batch) if self.model is not None else self._synthesize(batch)
        finished = s.update(batch, tokens, self.eos_token_id)
        self.num_steps += 1
        s.clock += 1
        if s.estimate and not s.has_unfinished():  # idle: ESTIMATE.RATIO resets
            s.ratio = self.config.new_token_ratio_init
        return self._record(batch, names, samplers, tokens, finished)

    def _names(self, slots) -> list[str]:
        """Request ids of ``slots``; a steady batch (the running array itself, unchanged
        since the last step) reuses the last list instead of gathering again."""
        key = self._names_key
        if key is not None and slots is key[0]:
            return key[1]
        names = self.sched.ids[self.sched.be.host(slots)].tolist()
        self._names_key = (slots, names)
        return names

    def _scheduled(self, names: list[str], n) -> list[tuple[str, int]]:
        """The record's (request, tokens) pairs; a steady batch (the same ids list and the
        same array of ones as the last step) copies the last list instead of zipping again."""
        key = self._scheduled_key
        if key is not None and names is key[0] and n is key[1]:
            return list(key[2])
        pairs = list(zip(names, xp.to_list(n)))
        self._scheduled_key = (names, n, pairs)
        return list(pairs)

    def _prompt(self, request: TraceRequest) -> list[int] | np.ndarray:
        """The prompt's token ids: ``prompt_tokens(request)`` when set (a list, or an int64
        array), else the trace's own."""
        if self.prompt_tokens is not None:
            return self.prompt_tokens(request)
        return request.prompt_token_ids(self.vocab_size)

    # -- decode spans (simulators) ---------------------------------------------

    def decode_span(self, k_max: int) -> tuple[int, list[int]]:
        """Run up to ``k_max`` steady decode steps at once, without records (for a
        simulator that accounts for them in bulk): ``(k, allocs)``, ``allocs[j]`` the
        blocks popped in step ``j``; the span's last step may stop requests, which
        :attr:`span_finished` then lists as a record's ``finished`` would (request,
        reason).  ``(0, [])`` when the next step is not part of such a span (see
        :meth:`~gpu_engine.scheduler.Scheduler.decode_span`); scheduler-only mode."""
        s = self.sched
        self.span_finished = []
        if self.model is not None or self._aborted or self._rejected or not s.span_ready():
            return 0, []  # (an abort or a rejection since the last step belongs in the next step's record)
        k, allocs, self.span_finished = s.decode_span(k_max, self._span_outputs)
        if k:
            self.num_steps += k
            s.clock += k
        return k, allocs

    def span_bound(self) -> int:
        """Steps up to and including the first in which a running request reaches its length
        limit (a bound on a span, which may end with that step)."""
        s = self.sched
        if not len(s.running):
            return 0
        return int((s.stop_at[s.running] - s.num_tokens[s.running]).min())

    def _span_outputs(self, slot: int, first: int, count: int):
        req = self.sched.sources[slot]
        if self.output_tokens is not None:  # written ahead at add_request
            p = req.prompt_len
            return self.sched.token_ids[slot, p + first:p + first + count]
        return [req.output_token(i, self.vocab_size, self.eos_token_id) for i in range(first, first + count)]

    # -- execution -------------------------------------------------------------

    def _shape(self, batch: Batch) -> tuple[int, int, int]:
        """(prefill tokens, decode requests, KV tokens) of a batch, before its update: a decode
        computes exactly the newest sampled token (``n = 1``, ``start = num_tokens - 1``,
        at least one output), anything else is prefill; it reads ``start + n`` KV tokens."""
        s, slots, n, start = self.sched, batch.slots, batch.num_scheduled, batch.start
        if not len(slots):
            return 0, 0, 0
        dec = (n == 1) & (start == s.num_tokens[slots] - 1) & (s.num_output_tokens[slots] > 0)
        tokens, decodes = xp.total(n), xp.total(dec)
        return tokens - decodes, decodes, xp.total(start) + tokens

    def _synthesize(self, batch: Batch):
        """Scheduler-only mode: the trace's synthetic token for each sampling request
        (written ahead into the token table when ``output_tokens`` is set)."""
        s = self.sched
        smp = batch.slots if batch.all_sample else batch.slots[batch.samples]
        if self.output_tokens is not None:
            return s.token_ids[smp, s.num_tokens[smp]]
        idx = xp.to_list(s.num_output_tokens[smp])
        if self.output_tokens is not None:
            out = self.output_tokens
            toks = [int(out(s.sources[i], k, 1)[0]) for i, k in zip(xp.to_list(smp), idx)]
        else:
            toks = [s.sources[i].output_token(k, self.vocab_size, self.eos_token_id) for i, k in zip(xp.to_list(smp), idx)]
        return s.be.asarray(toks)

    def _draft_token(self, slot: int, index: int) -> int:
        """Speculative decoding: the draft at output ``index``, the token the request's own rule
        samples there (so an accepted draft is the token the model would sample)."""
        s = self.sched
        if self.output_tokens is not None:  # written ahead into the token table at add_request
            return int(s.token_ids[slot, int(s.prompt_len[slot]) + index])
        return s.sources[slot].output_token(index, self.vocab_size, self.eos_token_id)

    def _execute(self, batch: Batch):
        """Model mode: one flattened forward over the batch, greedy sampling."""
        s, be = self.sched, self.sched.be
        slots, n, start = batch.slots, batch.num_scheduled, batch.start
        if len(slots) == 0:
            return be.empty_int()
        rows = xp.repeat(slots, n)
        within = be.arange(len(rows)) - xp.repeat(xp.exclusive_cumsum(n), n)
        positions = xp.repeat(start, n) + within
        bs = self.config.block_size
        input_ids = s.token_ids[rows, positions]
        slot_mapping = s.block_table[rows, positions // bs] * bs + positions % bs
        seq_lens = start + n
        width = int(((seq_lens + bs - 1) // bs).max())
        query_start = be.cat([be.asarray([0]), n.cumsum(0)])
        last = query_start[1:] - 1
        t = (lambda a: be.storage(a).to(self.device)) if be.numpy else (lambda a: a)
        meta = AttentionMetadata(
            block_table=t(xp.copy(s.block_table[slots, :width])), seq_start=t(start), query_start=t(query_start),
            seq_lens=t(seq_lens), token_seq=t(xp.repeat(be.arange(len(slots)), n)).to(torch.int32),
            token_pos=t(positions).to(torch.int32))
        logits = self.model.forward(t(input_ids), t(positions), t(slot_mapping), meta, t(last[batch.samples]))
        out = logits.argmax(-1)
        return out.numpy() if be.numpy else out

    # -- decision log ------------------------------------------------------------

    def _record(self, batch: Batch, names: list[str], samplers: list[str], tokens, finished) -> StepRecord:
        s = self.sched
        rec = StepRecord(step=self.num_steps - 1, scheduled=self._scheduled(names, batch.num_scheduled),
                         new=batch.new, resumed=batch.resumed, preempted=batch.preempted, finished=finished,
                         aborted=self._aborted, rejected=self._rejected, sampled=dict(zip(samplers, xp.to_list(tokens))),
                         swapped_out=batch.swapped_out, swapped_in=batch.swapped_in)
        self._aborted, self._rejected = [], []
        if s.num_spec:  # this step's drafts, and those its outputs accepted
            rec.drafts, rec.accepted = batch.drafts, batch.accepted
        if s.log_state:
            self._record_state(rec, batch)
        if self.level != "decisions":
            ids = self._names(s.running)
            held = xp.to_list(s.num_blocks[s.running])
            rec.num_free_blocks = s.pool.num_free
            rec.blocks = {r: k for r, k in zip(ids, held) if k}
            rec.cache_hits = batch.cache_hits
            rec.num_evicted = len(s.pool.evicted)
            if s.swap:
                rec.num_free_cpu_blocks = s.cpu_free
            if s.estimate:
                rec.new_token_ratio = s.ratio
            if self.level == "exact":
                rec.block_ids = {r: t for r, t, k in zip(ids, s.tables(), held) if k}
                rec.evicted = list(s.pool.evicted)
        return rec

    def _record_state(self, rec: StepRecord, batch: Batch) -> None:
        """The optional state fields up to ``level``, from this engine's own arrays: computed
        tokens, VTC counters, the estimate's rem, cache registrations (ordinals), hit blocks."""
        s = self.sched
        rec.computed = dict(zip(self._names(s.running), xp.to_list(s.num_computed_tokens[s.running])))
        waiting = xp.nonzero(s.status >= PREEMPTED)  # victims: reset, or swapped out (one compare: see below)
        if len(waiting):
            rec.computed.update(zip(self._names(waiting), xp.to_list(s.num_computed_tokens[waiting])))
        rec.token_cap = batch.token_cap
        rec.admit_stop = batch.admit_stop
        # the queue as its keys hold it (a slot released but still keyed is logged without a name)
        queued = self._names(xp.nonzero(s.queue_key < INF_KEY))
        rec.waiting = sorted(queued) if None not in queued else sorted(queued, key=lambda r: (r is None, r or ""))
        if s.asynchronous:  # each live request's tokens in flight
            live = xp.nonzero((s.status > FREE) & (s.placeholders != 0))
            rec.placeholders = dict(zip(self._names(live), xp.to_list(s.placeholders[live])))
        if s.tc is not None:
            rec.vtc_counters = {name: float(s.tc.counter[t]) for name, t in s.tc.index.items()}
            names = {t: name for name, t in s.tc.index.items()}
            rec.vtc_lifts, s.tc.lifts = {names[t]: value for t, value in s.tc.lifts.items()}, {}
        registered, s.registered = s.registered, {}
        if self.level == "decisions":
            return
        rec.estimate_rem = batch.estimate_rem
        rec.estimate_parts = batch.estimate_parts
        rec.cache_registered = registered if s.caching else None
        if self.level == "exact":
            rec.hit_blocks = batch.hit_blocks
            rec.ref_counts = self._ref_counts(s.pool.ref_cnt)  # the pool's own reference counts, not the tables'
            if s.caching:  # the pool's own cache map: the block of each hash entry
                rec.cached_blocks = sorted(s.pool.cached_blocks())

    def _ref_counts(self, ref_cnt) -> dict[str, int]:
        """Block id (as a string) -> reference count of each referenced block, in block order.
        A pool array byte-for-byte equal to the last record's (no block taken, touched or freed
        since: most decode steps) gives a copy of the last dict instead of a scan."""
        snap = ref_cnt.tobytes() if xp.is_np(ref_cnt) else None
        last = self._ref_key
        if snap is not None and last is not None and snap == last[0]:
            return dict(last[1])
        held, counts = xp.nonzero_items(ref_cnt)
        names = self._block_names
        if len(names) < len(ref_cnt):
            names += [str(b) for b in range(len(names), len(ref_cnt))]
        out = dict(zip(map(names.__getitem__, held), counts))
        self._ref_key = (snap, out) if snap is not None else None
        return dict(out)
