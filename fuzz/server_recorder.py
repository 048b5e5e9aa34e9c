"""A vLLM scheduler that writes batchspec's decision log while a real server runs.

Loaded by vLLM's own configuration, inside its engine-core process::

    python -m vllm.entrypoints.openai.api_server --model DIR \\
        --scheduler-cls fuzz.server_recorder.RecordingScheduler ...
    # with BATCHSPEC_DECISION_DIR=OUT in the server's environment

:class:`RecordingScheduler` is vLLM 0.32's ``Scheduler`` unchanged — every
decision is the parent's — with the observation the in-process adapter
(:mod:`fuzz.vllm_adapter`) makes around it: the statuses before ``schedule()``
(new or resumed admissions), prefix hits as ``num_computed_tokens`` after it,
preemption and finish order from ``_preempt_request`` / ``_free_request``,
sampled tokens from ``_update_request_with_output``, evictions from the block
pool, and the memory/exact fields from the KV manager
(:func:`fuzz.vllm_adapter.memory_fields`).  It writes, under ``$BATCHSPEC_DECISION_DIR``:

``decisions.jsonl``
    a batchspec decision log (``spec/schemas/log-*.schema.json``, level ``exact``),
    one record per scheduling step, flushed as each step ends; the header's
    ``config`` is the ``vllm-v1`` profile with the server's knobs (``num_blocks``
    from the KV cache vLLM sized, ``block_size``, ``max_num_seqs``, ...).
``events.jsonl``
    what the decision log has no field for: every request as the scheduler first
    saw it (``arrive``: the step it arrived before, its prompt token ids, ``max_tokens``,
    ``ignore_eos``, the wall clock), and every step's wall time (``step``: the clock
    at ``schedule()`` and at the end of ``update_from_output()``, which brackets
    the model's forward pass).

Two normalisations, both about step numbering, not decisions:

* request ids: the API server names a request ``cmpl-<id>-<n>-<8 hex>`` (its own
  prefix, the prompt index, a random suffix); the log uses ``<id>``, the id the
  client sent (:func:`client_id`);
* the engine core calls ``schedule()`` once more after the last request finished
  only to report the finished ids to the front end (``has_requests()`` counts
  them); that step schedules nothing and nothing is unfinished, so it is not a
  scheduling step and is not written (the spec's driver has no such step either).

A step is numbered by the records written before it, and a request's arrival step
is the number of steps written before ``add_request``: the engine core adds
requests only between steps, so this is exactly when the scheduler first saw it.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from fuzz.server import DECISIONS_FILE, DIR_ENV, EVENTS_FILE
from fuzz.vllm_adapter import VLLM_VERSION, finish_reason, memory_fields
from spec.formats import DecisionLog, StepRecord

_SERVER_ID = re.compile(r"^(?:cmpl|chatcmpl)-(?P<id>.+?)(?:-\d+)?-[0-9a-f]{8}$")


def client_id(request_id: str) -> str:
    """The id the client sent, from the API server's ``cmpl-<id>-<index>-<random 8 hex>``."""
    m = _SERVER_ID.match(request_id)
    return m.group("id") if m else request_id


def server_knobs(vllm_config, num_blocks: int) -> dict:
    """The ``vllm-v1`` knobs the running server was configured with (the spec's names)."""
    sc, cc, mc = vllm_config.scheduler_config, vllm_config.cache_config, vllm_config.model_config
    return {
        "profile": "vllm-v1", "num_blocks": num_blocks, "block_size": cc.block_size,
        "enable_prefix_caching": bool(cc.enable_prefix_caching), "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens, "max_model_len": mc.max_model_len,
        "enable_chunked_prefill": bool(sc.enable_chunked_prefill),
        "long_prefill_token_threshold": sc.long_prefill_token_threshold, "policy": sc.policy,
    }


class RecordingScheduler(Scheduler):
    """vLLM's ``Scheduler``, deciding as it does, writing each step's decisions (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        folder = Path(os.environ.get(DIR_ENV) or ".")
        folder.mkdir(parents=True, exist_ok=True)
        self._bs_decisions = open(folder / DECISIONS_FILE, "w")
        self._bs_events = open(folder / EVENTS_FILE, "w")
        knobs = server_knobs(self.vllm_config, self.kv_cache_config.num_blocks)
        self._bs_max_model_len = knobs["max_model_len"]
        header = DecisionLog(f"vllm-{VLLM_VERSION}-server", "exact", [], config=knobs).header_json()
        self._bs_write(self._bs_decisions, header)
        self._bs_step = 0
        self._bs_reset()
        pool = self.kv_cache_manager.block_pool
        maybe_evict = pool._maybe_evict_cached_block

        def on_evict(block):  # an instance attribute: vLLM's BlockPool class is untouched
            evicted = maybe_evict(block)
            if evicted:
                self._bs_evicted.append(block.block_id)
            return evicted

        pool._maybe_evict_cached_block = on_evict

    # -- bookkeeping ----------------------------------------------------------

    def _bs_reset(self) -> None:
        self._bs_preempted: list[str] = []
        self._bs_freed: list = []
        self._bs_evicted: list[int] = []
        self._bs_sampled: dict[str, int] = {}
        self._bs_in_update = False

    @staticmethod
    def _bs_write(f, obj) -> None:
        f.write(json.dumps(obj, separators=(",", ":")) + "\n")
        f.flush()  # a step at a time: the log is complete up to the last step that ended

    # -- observed vLLM methods (each calls the parent and only records) ------------

    def add_request(self, request) -> None:
        params = request.sampling_params
        self._bs_write(self._bs_events, {
            "arrive": client_id(request.request_id), "step": self._bs_step, "t": time.perf_counter(),
            "prompt": list(request.prompt_token_ids or []), "max_tokens": params.max_tokens,
            "ignore_eos": bool(params.ignore_eos),
        })
        super().add_request(request)

    def _preempt_request(self, request, *args, **kwargs):
        self._bs_preempted.append(client_id(request.request_id))
        return super()._preempt_request(request, *args, **kwargs)

    def _free_request(self, request, *args, **kwargs):
        if self._bs_in_update:
            self._bs_freed.append((client_id(request.request_id), finish_reason(request, self._bs_max_model_len)))
        return super()._free_request(request, *args, **kwargs)

    def _update_request_with_output(self, request, new_token_ids, *args, **kwargs):
        if new_token_ids:
            self._bs_sampled[client_id(request.request_id)] = new_token_ids[0]
        return super()._update_request_with_output(request, new_token_ids, *args, **kwargs)

    def schedule(self, *args, **kwargs):
        self._bs_t0 = time.perf_counter()
        before = {rid: r.status for rid, r in self.requests.items()}
        out = super().schedule(*args, **kwargs)
        admitted = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        self._bs_admitted = {rid: before.get(rid) for rid in out.num_scheduled_tokens if before.get(rid) in admitted}
        # a prefix hit is what an admission had computed before its chunk: read it now, since a
        # request that finishes in this step is gone from self.requests after update_from_output
        self._bs_hits = {rid: self.requests[rid].num_computed_tokens - out.num_scheduled_tokens[rid]
                         for rid in self._bs_admitted}
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        self._bs_in_update = True
        try:
            result = super().update_from_output(scheduler_output, model_runner_output)
        finally:
            self._bs_in_update = False
        self._bs_record(scheduler_output)
        return result

    # -- the record ---------------------------------------------------------------

    def _bs_record(self, out) -> None:
        """One decision-log record for the step just finished (the adapter's fields)."""
        scheduled = list(out.num_scheduled_tokens.items())
        new = [rid for rid, _ in scheduled if self._bs_admitted.get(rid) == RequestStatus.WAITING]
        resumed = [rid for rid, _ in scheduled if self._bs_admitted.get(rid) == RequestStatus.PREEMPTED]
        hits = {client_id(rid): n for rid, n in self._bs_hits.items()}
        record = StepRecord(
            step=self._bs_step, scheduled=[(client_id(r), n) for r, n in scheduled],
            new=[client_id(r) for r in new], resumed=[client_id(r) for r in resumed],
            preempted=self._bs_preempted, finished=self._bs_freed, sampled=self._bs_sampled, cache_hits=hits,
            evicted=self._bs_evicted, num_evicted=len(self._bs_evicted),
        )
        memory_fields(self, record, rename=client_id)
        if record.is_idle() and self.get_num_unfinished_requests() == 0:
            self._bs_reset()  # the finish-report step (module docstring): not a scheduling step
            return
        self._bs_write(self._bs_decisions, record.to_json("exact"))
        self._bs_write(self._bs_events, {"step": self._bs_step, "t0": self._bs_t0, "t1": time.perf_counter(),
                                          "busy": self.get_num_unfinished_requests() > 0})
        self._bs_step += 1
        self._bs_reset()
