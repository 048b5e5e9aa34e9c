"""SGLang's real scheduler behind the engine protocol (optional extra ``sglang``).

:class:`SglangEngine` drives the scheduling code of the PyPI package
``sglang==0.5.23`` in-process on a CPU with a fake model, the way
:mod:`fuzz.vllm_adapter` drives vLLM's.  What runs is SGLang's own code:

* ``Scheduler.get_next_batch_to_run`` (merge of the last prefill batch into the
  running batch, ``_get_new_batch_prefill_raw`` with the ``PrefillAdder`` —
  ``new_token_ratio`` estimate, ``rem_total_tokens``, the in-flight chunked
  request first — then, when no prefill batch can be formed,
  ``update_running_batch``: ``check_decode_mem``, ``retract_decode`` and the
  ratio's decay or reset);
* ``ScheduleBatch.init_new`` / ``prepare_for_extend`` / ``prepare_for_decode``
  (allocation of KV slots, eviction from the tree when the pool runs short);
* SGLang's default tree cache (``UnifiedRadixCache`` with its default tree core,
  token-granular matching at ``page_size`` 1, LRU eviction of unlocked leaves),
  the ``ReqToTokenPool`` and the ``TokenToKVPoolAllocator``;
* ``SchedulerBatchResultProcessor.process_batch_result_prefill`` / ``_decode``
  (appending the sampled token, ``check_finished``, caching a finished
  request's KV in the tree and freeing the rest);
* at arrival, ``Scheduler.init_req_max_new_tokens`` and
  ``validate_input_length`` (SGLang's clip of ``max_new_tokens`` to the context
  and to the pool, and its refusal of too long prompts).

What the adapter supplies instead of SGLang, because it is not scheduling:

* the **model**: every request in a batch whose prefill is complete samples one
  token, the one the trace prescribes (``TraceRequest.output_token``);
* the **plumbing** of a server (``Scheduler.__init__`` spawns a model worker on
  a GPU, IPC sockets, metrics, load reporting): the scheduler object is made
  with ``Scheduler.__new__`` and given the attributes its scheduling methods
  read, each set to what SGLang sets for a plain decoder-only model with the
  defaults (no LoRA, no speculative decoding, no disaggregation, no hierarchical
  cache, no grammar, DP attention off).  Metrics, load publishing and output
  streaming are inert objects (:class:`_Inert`);
* the **model configuration** SGLang reads from a checkpoint
  (:class:`_ModelConfig`), and the sizes ``TpModelWorker.get_worker_info``
  derives from it: ``max_total_num_tokens = num_blocks - 1`` (slot 0 is
  SGLang's padding slot), ``max_req_len = min(max_model_len - 1,
  max_total_num_tokens - 1)``, ``max_req_input_len = max_req_len - 5``,
  ``max_running_requests = max_num_seqs``.

Only modules that cannot load without a GPU are stubbed (:func:`install_gpu_stubs`):
``sgl_kernel``, ``flashinfer``, ``tvm_ffi`` (CUDA kernels and their FFI) and
``torchvision`` (whose PyPI wheel is a CUDA build) — as SGLang's own
``_platform_stubs`` does for Triton on machines without it.  Nothing in the
scheduling path calls them.

The overlap scheduler (SGLang's default) is **not** driven: it processes a
step's results after scheduling the next step on a GPU stream with future
token ids, which this fake model cannot reproduce; the adapter runs SGLang's
normal (synchronous) event loop, ``disable_overlap_schedule=True``
(docs/conformance.md, SGLang section).

SGLang is imported lazily, inside the class, so that this module imports
without it.  Install it in its own virtual environment: ``scripts/sglang-env.sh``.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types
import warnings
from collections import Counter
from dataclasses import fields
from typing import Any

from fuzz.replay import EngineConfigError, EngineUnavailable
from spec.config import PROFILES, SchedulerConfig, resolve
from spec.formats import (
    FINISH_EOS,
    FINISH_MAX_MODEL_LEN,
    FINISH_MAX_TOKENS,
    FINISH_STOP_TOKEN,
    StepRecord,
    Trace,
    TraceRequest,
)

#: The SGLang release the ``sglang`` profile is checked against.
SGLANG_VERSION = "0.5.23"

#: Knobs the adapter maps onto SGLang's configuration (see :meth:`SglangEngine._server_args`);
#: ``max_steps`` is applied by the driver.
MAPPED_KNOBS = frozenset({
    "num_blocks", "enable_prefix_caching", "max_num_batched_tokens", "max_num_seqs", "max_model_len",
    "enable_chunked_prefill", "max_steps", *("new_token_ratio_init", "new_token_ratio_min_factor",
                                             "new_token_ratio_decay_steps", "retract_decode_steps"),
})

#: The environment variables SGLang reads the ratio's constants from (``sglang/srt/environ.py``; the
#: tracker reads the first three when the scheduler is built, the last at each retraction).
RATIO_ENV = {
    "new_token_ratio_init": "SGLANG_INIT_NEW_TOKEN_RATIO",  # x schedule_conservativeness 1.0
    "new_token_ratio_min_factor": "SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR",
    "new_token_ratio_decay_steps": "SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS",
    "retract_decode_steps": "SGLANG_RETRACT_DECODE_STEPS",
}

#: Why SGLang has only the ``sglang`` profile's value of some other knobs.
FIXED_BY_SGLANG = {
    "block_size": "the adapter runs SGLang's default page_size 1 (one KV slot per token)",
    "policy": "the adapter runs SGLang's default schedule_policy fcfs",
    "reject_unservable": "SGLang always refuses a prompt longer than max_req_input_len at arrival",
    "batching": "SGLang runs a prefill batch whenever one can be formed, else decodes",
    "admission": "SGLang admits against its new_token_ratio estimate",
    "null_block": "SGLang's KV slot 0 is its padding slot",
}

#: What SGLang itself does for knobs the ``sglang`` profile may still claim otherwise: a trace
#: asking for this value is run as faithfully as one asking for the profile's (docs/conformance.md).
SGLANG_BEHAVIOUR: dict[str, Any] = {}  # (none since the profile's radix-cache knobs, #8 and #13)

#: GPU-only modules replaced by inert stubs when they are not importable here.
GPU_ONLY_MODULES = ("sgl_kernel", "flashinfer", "tvm_ffi", "torchvision")

_UNAVAILABLE = ("SGLang is not importable here ({why}). Create its virtual environment with scripts/sglang-env.sh "
                "and run batchspec from it (docs/conformance.md, SGLang section)")

_SGL: dict[str, Any] = {}  # lazily imported SGLang names, shared by every engine of the process


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports any submodule of the stubbed roots as a :class:`_StubModule`."""

    def __init__(self, roots: set[str]):
        self.roots = roots

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"  # transformers parses the version of an importable torchvision
        return module

    def exec_module(self, module) -> None:
        pass


class _StubModule(types.ModuleType):
    """A GPU-only module: any attribute is an inert :class:`_StubValue`."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubValue(f"{self.__name__}.{name}")


class _StubValue:
    """Stands for a kernel, a class or a constant of a stubbed module; calling it fails loudly
    unless it is used as a decorator (``@kernel`` at import time)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubValue(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        raise RuntimeError(f"{self._name} needs a GPU; the scheduling path must not call it")

    def __mro_entries__(self, bases):
        return (object,)


def install_gpu_stubs() -> list[str]:
    """Stub the modules of :data:`GPU_ONLY_MODULES` that cannot be imported here; return their names."""
    missing = {m for m in GPU_ONLY_MODULES if m not in sys.modules and importlib.util.find_spec(m) is None}
    if missing and not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder(missing))
    return sorted(missing)


def sglang_modules() -> dict[str, Any]:
    """Import SGLang's scheduling modules once per process (10-20 s) and return the names used."""
    if _SGL:
        return _SGL
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("SGLANG_LOGGING_LEVEL", "ERROR")
    if importlib.util.find_spec("sglang") is None:  # before any stub: a process without SGLang stays as it was
        raise EngineUnavailable(_UNAVAILABLE.format(why="No module named 'sglang'"))
    install_gpu_stubs()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "only CUDA supports AWQ" and similar platform notes
            import torch
            import sglang
            from sglang.srt.disaggregation.utils import DisaggregationMode
            from sglang.srt.managers.schedule_batch import (
                FINISH_ABORT,
                FINISH_LENGTH,
                FINISH_MATCHED_TOKEN,
                Req,
                ScheduleBatch,
            )
            from sglang.srt.managers.schedule_policy import PrefillAdder
            from sglang.srt.managers.scheduler import Scheduler
            from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
            from sglang.srt.managers.utils import GenerationBatchResult, validate_input_length
            from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
            from sglang.srt.mem_cache.cache_init_params import CacheInitParams
            from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
            from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
            from sglang.srt.runtime_context import get_context, get_memory, get_parallel, get_schedule
            from sglang.srt.sampling.sampling_params import SamplingParams
            from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise EngineUnavailable(_UNAVAILABLE.format(why=e)) from e
    version = getattr(sglang, "__version__", None)
    if version != SGLANG_VERSION:
        raise EngineUnavailable(f"SGLang {version} is installed; the adapter targets {SGLANG_VERSION}")
    for name in list(logging.root.manager.loggerDict):
        if name == "sglang" or name.startswith("sglang."):
            # refusals and retractions are decisions: recorded in the log, not printed
            logging.getLogger(name).setLevel(logging.CRITICAL)
    _SGL.update(
        torch=torch, DisaggregationMode=DisaggregationMode, FINISH_ABORT=FINISH_ABORT, FINISH_LENGTH=FINISH_LENGTH,
        FINISH_MATCHED_TOKEN=FINISH_MATCHED_TOKEN, Req=Req, ScheduleBatch=ScheduleBatch, Scheduler=Scheduler,
        PrefillAdder=PrefillAdder,
        SchedulerBatchResultProcessor=SchedulerBatchResultProcessor, GenerationBatchResult=GenerationBatchResult,
        validate_input_length=validate_input_length, TokenToKVPoolAllocator=TokenToKVPoolAllocator,
        CacheInitParams=CacheInitParams, ReqToTokenPool=ReqToTokenPool, TreeCacheBuildContext=TreeCacheBuildContext,
        create_tree_cache=create_tree_cache, get_context=get_context, get_schedule=get_schedule,
        get_memory=get_memory, get_parallel=get_parallel, SamplingParams=SamplingParams,
        SpeculativeAlgorithm=SpeculativeAlgorithm,
    )
    return _SGL


def check_supported(cfg: SchedulerConfig) -> None:
    """Raise :class:`EngineConfigError` for knob values SGLang's default scheduler cannot express.

    Every knob the adapter does not map must keep the ``sglang`` profile's value.
    """
    base = PROFILES["sglang"].config
    for f in fields(cfg):
        if f.name == "profile" or f.name in MAPPED_KNOBS:
            continue
        if getattr(cfg, f.name) != getattr(base, f.name) and SGLANG_BEHAVIOUR.get(f.name) != getattr(cfg, f.name):
            why = FIXED_BY_SGLANG.get(f.name, "the adapter does not map this knob to SGLang")
            raise EngineConfigError(f"{f.name}={getattr(cfg, f.name)!r} cannot be run on SGLang {SGLANG_VERSION} "
                                    f"(only {getattr(base, f.name)!r}): {why}")


class _Inert:
    """A server component outside scheduling (metrics, load reports, output streaming):
    every method call does nothing, every counter reads 0."""

    def __init__(self, **attrs: Any):
        self.__dict__.update(attrs)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Zero(0)


class _Zero(int):
    """0 as a counter (``+=`` works), a no-op as a method, an inert component as an attribute."""

    def __call__(self, *args, **kwargs):
        return None

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Zero(0)


class _Fixed:
    """A component with exactly the given attributes: reading any other one is an error,
    so an attribute SGLang starts to read in a later release fails loudly here."""

    def __init__(self, name: str, **attrs: Any):
        self.__dict__["_name"] = name
        self.__dict__.update(attrs)

    def __getattr__(self, attr: str):
        raise AttributeError(f"{self._name}.{attr}: not provided by fuzz/sglang_adapter.py")


class _DpAttention:
    """DP attention off: the batch passes unchanged (SchedulerDPAttnAdapter without DP)."""

    def maybe_prepare_mlp_sync_batch(self, batch, need_sync: bool = False):
        return batch

    def maybe_convert_decode_to_extend(self, batch):
        return batch


class _NoNgramEmbedding:
    def prepare_for_forward(self, batch, chunked_req=None):
        return batch


class _NoGrammar:
    """No constrained decoding: no request ever waits for a grammar."""

    def has_waiting_grammars(self) -> bool:
        return False

    def abort_requests(self, abort_req) -> None:
        pass


def _sglang_rid(request_id: str) -> str:
    """The id SGLang sees: terminated, because ``Scheduler.abort_request`` aborts every request
    whose id *starts with* the aborted one (aborting ``r1`` would abort ``r10`` too)."""
    return request_id + "\0"


def _trace_rid(req) -> str:
    return req.rid[:-1]


def _model_config(vocab_size: int, max_model_len: int) -> _Fixed:
    """What SGLang reads from a plain decoder-only checkpoint's ModelConfig."""
    return _Fixed("model_config", is_multimodal=False, is_multimodal_gen=False, is_encoder_decoder=False,
                  vocab_size=vocab_size, context_len=max_model_len, hf_eos_token_id=None, attention_arch=None,
                  self_opened_think_start_ids=None, think_end_ids=None)


class SglangEngine:
    """SGLang 0.5.23's scheduler as an engine of the protocol (see the module docstring)."""

    name = "sglang"
    samples_script = True  # the fake model samples the trace's script: the replay compares token values

    def __init__(self, trace: Trace):
        self.sgl = sglang_modules()
        self.config = resolve(trace.config)
        check_supported(self.config)
        self.vocab_size = trace.vocab_size
        self.eos_token_id = trace.eos_token_id
        self.sources: dict[str, TraceRequest] = {}
        self.reqs: dict[str, Any] = {}
        self._rejected: list[tuple[str, str]] = []
        self._aborted: list[str] = []
        self._retracted: list[str] = []
        self._evicted: list[int] = []
        self._ever_retracted: set[str] = set()
        self._client_aborted: set[str] = set()
        self._admitted: set[str] = set()
        self._estimate: dict[str, float] | None = None  # this step's admission round, as SGLang's PrefillAdder began it
        self._registered: dict[str, list[int]] = {}  # this step's new tree slots, as ordinals of each request's row
        self._build()

    # -- construction ------------------------------------------------------

    def _server_args(self) -> dict[str, Any]:
        """SGLang's server arguments for this trace: its defaults, and the mapped knobs."""
        cfg = self.config
        return {
            "device": "cpu", "page_size": 1, "schedule_policy": "fcfs", "disable_overlap_schedule": True,
            "max_prefill_tokens": cfg.max_num_batched_tokens,
            "chunked_prefill_size": cfg.max_num_batched_tokens if cfg.enable_chunked_prefill else -1,
            "disable_radix_cache": not cfg.enable_prefix_caching,
            "max_running_requests": cfg.max_num_seqs,
        }

    def _build(self) -> None:
        s, cfg = self.sgl, self.config
        torch = s["torch"]
        for knob, var in RATIO_ENV.items():  # set for this engine; the next one sets its own
            os.environ[var] = repr(getattr(cfg, knob))
        self.server_args = s["get_context"]().override_server_args(**self._server_args()).install()
        schedule = s["get_schedule"]()
        self._check_config_kept(schedule)
        self.max_total_num_tokens = cfg.num_blocks - 1  # KV slot 0 is SGLang's padding slot
        self.req_to_token_pool = s["ReqToTokenPool"](size=cfg.max_num_seqs, max_context_len=cfg.max_model_len + 8,
                                                      device="cpu", enable_memory_saver=False)
        self.allocator = s["TokenToKVPoolAllocator"](
            size=self.max_total_num_tokens, dtype=torch.float32, device="cpu",
            kvcache=_Fixed("kvcache", size=self.max_total_num_tokens, device="cpu", dtype=torch.float32),
            need_sort=False,  # SGLang sorts free slots only under PD disaggregation
        )
        size = schedule.chunked_prefill_size
        chunked = size if size is not None and size > 0 else None  # init_chunked_prefill: -1 turns it off
        params = s["CacheInitParams"](disable=not cfg.enable_prefix_caching, req_to_token_pool=self.req_to_token_pool,
                                      token_to_kv_pool_allocator=self.allocator, page_size=1,
                                      eviction_policy=s["get_memory"]().radix_eviction_policy,
                                      chunked_prefill_size=chunked)
        self.tree_cache = s["create_tree_cache"](s["TreeCacheBuildContext"](
            server_args=self.server_args, params=params, is_hybrid_swa=False, is_hybrid_ssm=False,
            enable_hierarchical_cache=False, disable_radix_cache=not cfg.enable_prefix_caching, tp_worker=None,
            model_config=None, tp_size=1, tp_rank=0, tp_group=None))
        s["get_context"]().override("batchspec.sglang_adapter", pp_max_micro_batch_size=cfg.max_num_seqs)
        if "tp_rank" not in s["get_parallel"]()._stamp:  # one process, rank 0 of every group
            s["get_parallel"]().override_permanently(tp_rank=0)
        self.scheduler = self._scheduler(chunked)
        self._observe()

    def _check_config_kept(self, schedule) -> None:
        """SGLang's argument resolution may rewrite a value; make sure ours survived."""
        want = self._server_args()
        got = {k: getattr(schedule, k) for k in ("page_size", "schedule_policy", "max_prefill_tokens",
                                                 "chunked_prefill_size", "disable_overlap_schedule")}
        changed = {k: (want[k], v) for k, v in got.items() if want[k] != v}
        if changed:
            raise EngineConfigError(f"SGLang rewrote the configuration (ours, SGLang's): {changed}")

    def _scheduler(self, chunked_prefill_size: int | None):
        """``Scheduler.__new__`` plus what ``Scheduler.__init__`` sets for a plain model (see the module docstring)."""
        s, cfg = self.sgl, self.config
        sched = s["Scheduler"].__new__(s["Scheduler"])
        sched.server_args = self.server_args
        sched.tree_cache, sched.req_to_token_pool = self.tree_cache, self.req_to_token_pool
        sched.token_to_kv_pool_allocator = self.allocator
        sched.model_config = _model_config(self.vocab_size, cfg.max_model_len)
        sched.page_size = 1
        sched.scheduler_stage_metrics = None
        sched.init_running_status()
        # the scalar settings of Scheduler.__init__ for a plain decoder-only model with SGLang's defaults
        schedule = s["get_schedule"]()
        sched.enable_overlap = sched.enable_overlap_mlx = False
        sched.spec_algorithm = s["SpeculativeAlgorithm"].from_string(None)
        for flag in ("enable_hierarchical_cache", "enable_lmcache", "enable_hicache_storage", "enable_hisparse",
                     "enable_unified_cache_external_linker", "enable_lora", "enable_priority_scheduling",
                     "schedule_low_priority_values_first", "is_hybrid_swa", "is_hybrid_ssm", "require_mlp_sync",
                     "is_mixed_chunk"):
            setattr(sched, flag, False)
        for absent in ("dllm_config", "hisparse_coordinator", "max_new_tokens_limit", "sliding_window_size",
                       "truncation_align_size", "min_free_slots_delayer", "decode_offload_manager", "future_map",
                       "lora_drainer", "dynamic_chunk_sizer", "max_queued_requests", "model_worker", "draft_worker",
                       "_pending_chunked_abort_req", "chunked_req", "metrics_collector", "mm_receiver", "rust_server"):
            setattr(sched, absent, None)
        sched.schedule_policy = schedule.schedule_policy
        sched.priority_scheduling_preemption_threshold = schedule.priority_scheduling_preemption_threshold
        sched.disaggregation_mode = s["DisaggregationMode"].NULL
        sched.kv_shard_widening = 1
        sched.max_total_num_tokens = self.max_total_num_tokens
        # TpModelWorker.get_worker_info
        sched.max_req_len = min(cfg.max_model_len - 1, self.max_total_num_tokens - 1)
        sched.max_req_input_len = sched.max_req_len - 5
        sched.max_running_requests = cfg.max_num_seqs
        sched.max_prefill_tokens = schedule.max_prefill_tokens
        sched.device = "cpu"
        sched.processed_tokens_counter = 0
        sched.forward_ct = 0
        sched.is_generation = True
        # init_chunked_prefill for a text-only model (its multimodal branch reads the checkpoint)
        sched.chunked_prefill_size = chunked_prefill_size
        sched.prefill_decode_interval = sched._prefill_decode_interval_remaining = 0
        sched.prefill_decode_interval_min_bs = schedule.prefill_decode_interval_min_bs
        sched.metrics_reporter = _Inert(enable_metrics=False)
        sched.init_schedule_policy()
        adder = self._recording_adder()
        sched.get_prefill_adder_class = lambda: adder
        sched.tp_worker = _Fixed("tp_worker", model_runner=_Fixed("model_runner", attn_backend=object(),
                                                                   prefill_aware_swa=False))
        sched.dp_attn_adapter, sched.ngram_embedding_manager = _DpAttention(), _NoNgramEmbedding()
        sched.grammar_manager = _NoGrammar()
        sched.load_inquirer = sched.load_publisher = sched.pool_stats_observer = sched.output_streamer = _Inert()
        sched.ipc_channels = _Inert()  # the abort answer to the tokenizer process
        sched.init_beam_coordinator()
        sched.batch_result_processor = s["SchedulerBatchResultProcessor"](
            is_generation=True, disaggregation_mode=sched.disaggregation_mode, enable_overlap=False,
            enable_overlap_mlx=False, model_config=sched.model_config, token_to_kv_pool_allocator=self.allocator,
            tree_cache=self.tree_cache, hisparse_coordinator=None, req_to_token_pool=self.req_to_token_pool,
            decode_offload_manager=None, metrics_collector=None, metrics_reporter=sched.metrics_reporter,
            draft_worker=None, model_worker=None, logprob_result_processor=None,
            output_streamer=sched.output_streamer, beam_coordinator=sched.beam_coordinator,
            abort_request=sched.abort_request,
        )
        return sched

    def _recording_adder(self) -> type:
        """SGLang's ``PrefillAdder``, noting the terms of its ``rem_total_tokens`` as the admission
        round begins (state field ``estimate_parts``): ``free`` (available + evictable slots, read
        by its memory budget), ``running`` (its offset for the running batch, ratio applied),
        ``outputs`` (the same offsets with the ratio at 1: the remaining outputs, clipped) and
        ``chunks`` (what ``add_chunked_req`` charged for the continued prefill)."""
        engine = self

        class RecordingAdder(self.sgl["PrefillAdder"]):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                budget, ratio = self.memory_budget, self.new_token_ratio
                self.new_token_ratio = 1.0  # (SGLang's own offset, before the ratio scales it)
                try:
                    outputs = sum(self._get_running_request_total_token_offset(r) for r in self.running_batch.reqs)
                finally:
                    self.new_token_ratio = ratio
                # (integers the log's schema wants: SGLang's offsets are floats, ratio 1 gives whole counts)
                engine._estimate = {"free": int(budget._available_and_evictable()), "outputs": round(outputs),
                                    "running": budget.total_offset, "chunks": 0}

            def add_chunked_req(self, req):
                before = self.memory_budget.total_offset
                try:
                    return super().add_chunked_req(req)
                finally:
                    engine._estimate["chunks"] += round(self.memory_budget.total_offset - before)  # (ints added to a float)

        return RecordingAdder

    def _observe(self) -> None:
        """Record retraction order and evicted slots as SGLang makes them (instance attributes only)."""
        sched, tree, allocator = self.scheduler, self.tree_cache, self.allocator
        add_to_queue, free = sched._add_request_to_queue, allocator.free
        evicting = [0]  # depth: evict_for_alloc may call evict

        def on_add_to_queue(req, is_retracted: bool = False):
            if is_retracted:
                self._retracted.append(_trace_rid(req))
                self._ever_retracted.add(_trace_rid(req))
            return add_to_queue(req, is_retracted=is_retracted)

        def observed(method):
            def run(*args, **kwargs):
                evicting[0] += 1
                try:
                    return method(*args, **kwargs)
                finally:
                    evicting[0] -= 1
            return run

        def on_free(indices):
            if evicting[0]:
                self._evicted.extend(int(i) for i in indices.tolist())
            return free(indices)

        def registering(method):
            def run(req, *args, **kwargs):  # (ordinals of the row's slots the tree did not hold before)
                if req.kv.req_pool_idx is None:
                    return method(req, *args, **kwargs)
                row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :int(req.kv.kv_allocated_len)].tolist()
                before = set(tree.all_values_flatten().tolist())
                out = method(req, *args, **kwargs)
                new = set(tree.all_values_flatten().tolist()) - before
                ordinals = [i for i, slot in enumerate(row) if slot in new]
                if ordinals:
                    self._registered.setdefault(_trace_rid(req), []).extend(ordinals)
                return out
            return run

        sched._add_request_to_queue = on_add_to_queue
        if self.config.enable_prefix_caching:
            tree.checkpoint = registering(tree.checkpoint)  # (every insert of a request's tokens goes through it)
        for name in ("evict", "evict_for_alloc"):  # the allocator's evict_to_free_tokens calls the latter
            if hasattr(tree, name):
                setattr(tree, name, observed(getattr(tree, name)))
        allocator.free = on_free

    # -- protocol --------------------------------------------------------

    def add_request(self, tr: TraceRequest) -> None:
        """SGLang's arrival path (``_handle_generate_request``): clip ``max_new_tokens``, refuse a
        too long prompt or one the pool can never hold, queue the rest."""
        if tr.id in self.sources:
            raise ValueError(f"duplicate request id {tr.id!r}")
        s, sched = self.sgl, self.scheduler
        self.sources[tr.id] = tr
        if not self.has_unfinished_requests():
            # The event loop passed through Scheduler.on_idle while the engine was empty,
            # whose fully-idle branch resets the ratio (new_token_ratio_tracker.reset()).
            sched.new_token_ratio_tracker.reset()
        params = s["SamplingParams"](max_new_tokens=tr.max_tokens, ignore_eos=tr.ignore_eos,
                                     stop_token_ids=list(tr.stop_token_ids) or None)
        params.normalize(None)
        params.verify(self.vocab_size)
        from array import array

        req = s["Req"](_sglang_rid(tr.id), "", array("q", tr.prompt_token_ids(self.vocab_size)), params,
                       eos_token_ids={self.eos_token_id}, vocab_size=self.vocab_size)
        sched.init_req_max_new_tokens(req)
        if req.to_finish is None:
            error = s["validate_input_length"](req, sched.max_req_input_len, False)
            if error:
                req.set_finish_with_abort(error)
        if req.to_finish is not None:  # SGLang answers the client at once; the request never runs
            # SGLang has one refusal; name it by the limit that caused it (the context or the pool)
            context_limit = self.config.max_model_len - 1 - 5  # max_req_input_len without the pool's bound
            why = "prompt_too_long" if tr.prompt_len >= context_limit else "never_fits"
            self._rejected.append((tr.id, why))
            return
        self.reqs[tr.id] = req
        sched._add_request_to_queue(req)

    def abort_request(self, request_id: str) -> None:
        """``Scheduler.abort_request``: a waiting request leaves the queue at once, a running one
        finishes (``FINISH_ABORT``) at its next result."""
        req = self.reqs.get(request_id)
        if req is None or req.finished():
            return
        from sglang.srt.managers.io_struct import AbortReq

        self.scheduler.abort_request(AbortReq(rid=_sglang_rid(request_id)))
        self._aborted.append(request_id)
        self._client_aborted.add(request_id)  # a running one still decodes once; its finish is this abort

    def has_unfinished_requests(self) -> bool:
        sched = self.scheduler
        live = list(sched.running_batch.reqs) + (list(sched.last_batch.reqs) if sched.last_batch is not None else [])
        return bool(sched.waiting_queue) or sched.chunked_req is not None or any(not r.finished() for r in live)

    def step(self) -> StepRecord:
        """One iteration of SGLang's normal event loop: ``get_next_batch_to_run``, the fake
        model, ``process_batch_result``; one record."""
        sched = self.scheduler
        waiting_before = {_trace_rid(r) for r in sched.waiting_queue}
        self._estimate = None
        plan = sched.get_next_batch_to_run(running_batch=sched.running_batch, last_batch=sched.last_batch)
        sched.running_batch = plan.running_batch
        batch = plan.batch_to_run
        record = StepRecord(step=-1, preempted=self._retracted, aborted=self._aborted, rejected=self._rejected)
        if batch is not None:
            self._run(batch, waiting_before, record)
        sched.last_batch = batch
        if not self.has_unfinished_requests():
            # The event loop's next passes find no batch and run Scheduler.on_idle, whose
            # fully-idle branch resets the ratio before anything else can be scheduled.
            sched.new_token_ratio_tracker.reset()
        self._memory(record)
        self._state(record)
        self._rejected, self._aborted, self._retracted, self._evicted = [], [], [], []
        return record

    def _run(self, batch, waiting_before: set[str], record: StepRecord) -> None:
        s, sched = self.sgl, self.scheduler
        extend = batch.forward_mode.is_extend()
        for req in batch.reqs:
            n = (req.extend_end - req.prefix_len) if extend else 1
            record.scheduled.append((_trace_rid(req), n))
            if extend and _trace_rid(req) in waiting_before:
                (record.resumed if _trace_rid(req) in self._ever_retracted else record.new).append(_trace_rid(req))
                record.cache_hits = record.cache_hits or {}
                record.cache_hits[_trace_rid(req)] = req.prefix_len
                if req.prefix_len:  # its hit slots, written into its row when the batch was prepared
                    record.hit_blocks = record.hit_blocks or {}
                    row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :req.prefix_len]
                    record.hit_blocks[_trace_rid(req)] = [int(x) for x in row.tolist()]
        outputs_before = {_trace_rid(req): len(req.output_ids) for req in batch.reqs}
        finished_before = {_trace_rid(req) for req in batch.reqs if req.finished()}
        tokens = [self.sources[_trace_rid(req)].output_token(len(req.output_ids), self.vocab_size)
                  for req in batch.reqs]
        result = s["GenerationBatchResult"](next_token_ids=s["torch"].tensor(tokens, dtype=s["torch"].int64))
        if extend:
            sched.batch_result_processor.process_batch_result_prefill(batch, result)
        else:
            sched.batch_result_processor.process_batch_result_decode(batch, result)
        self.tree_cache.flush_pending_backups()
        sched.forward_ct += 1
        for req, token in zip(batch.reqs, tokens):
            if len(req.output_ids) > outputs_before[_trace_rid(req)]:
                record.sampled[_trace_rid(req)] = token
            if req.finished() and _trace_rid(req) not in finished_before | self._client_aborted:
                record.finished.append((_trace_rid(req), self._finish_reason(req)))
        if record.cache_hits is None:
            record.cache_hits = {}

    def _memory(self, record: StepRecord) -> None:
        """Free token slots (evictable tree slots included, as the spec counts cached blocks),
        slots held per request, the ratio; at the end of the step."""
        sched = self.scheduler
        holders = list(sched.running_batch.reqs)
        if sched.last_batch is not None and sched.last_batch.forward_mode.is_extend():
            holders += [r for r in sched.last_batch.reqs if r not in holders]  # merged into running next step
        tables: dict[str, list[int]] = {}
        for req in holders:
            if req.finished() or req.kv.req_pool_idx is None:
                continue
            n = int(req.kv.kv_allocated_len)
            row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].tolist()
            if row:
                tables[_trace_rid(req)] = [int(x) for x in row]
        record.num_free_blocks = int(self.allocator.available_size() + self.tree_cache.evictable_size())
        record.blocks = {rid: len(ids) for rid, ids in tables.items()}
        record.block_ids = tables
        record.num_evicted = len(self._evicted)
        record.evicted = list(self._evicted)
        record.new_token_ratio = float(sched.new_token_ratio_tracker.current)
        if record.cache_hits is None:
            record.cache_hits = {}

    def _state(self, record: StepRecord) -> None:
        """The state fields, read from SGLang's objects at the end of the step: ``waiting`` (its
        waiting queue), ``computed`` (each holder's allocated KV length, which at page size 1 is its
        computed tokens; a retracted request waiting again, its length after the release),
        ``ref_counts`` (how many holders' rows name each slot), ``cached_blocks`` (the slots in the
        radix tree), ``cache_registered`` (the slots the step's ``checkpoint`` calls added to the tree,
        as ordinals of each request's row: :meth:`_observe`), ``hit_blocks`` (set by :meth:`_run`) and
        the estimate's terms (``_estimate``)."""
        sched = self.scheduler
        record.waiting = sorted(_trace_rid(r) for r in sched.waiting_queue)
        computed = {rid: len(ids) for rid, ids in (record.block_ids or {}).items()}
        for req in sched.waiting_queue:
            if _trace_rid(req) in self._ever_retracted:
                computed[_trace_rid(req)] = int(req.kv.kv_allocated_len)
        record.computed = computed
        record.ref_counts = dict(Counter(str(slot) for ids in (record.block_ids or {}).values() for slot in ids))
        if self.config.enable_prefix_caching:
            record.cached_blocks = sorted(int(x) for x in self.tree_cache.all_values_flatten().tolist())
            record.cache_registered, self._registered = self._registered, {}
        if record.hit_blocks is None:
            record.hit_blocks = {}
        if self._estimate is not None:
            e = self._estimate
            record.estimate_parts = dict(e)
            record.estimate_rem = e["free"] - e["running"] - e["chunks"]

    def _finish_reason(self, req) -> str:
        """SGLang's finish reason, named the way spec.formats names them."""
        reason = req.finished_reason
        if isinstance(reason, self.sgl["FINISH_MATCHED_TOKEN"]):
            return FINISH_EOS if reason.matched == self.eos_token_id else FINISH_STOP_TOKEN
        if isinstance(reason, self.sgl["FINISH_LENGTH"]):
            asked = self.sources[_trace_rid(req)].max_tokens
            return FINISH_MAX_TOKENS if len(req.output_ids) >= asked else FINISH_MAX_MODEL_LEN
        if isinstance(reason, self.sgl["FINISH_ABORT"]):
            return "aborted"
        return type(reason).__name__.lower()


def capabilities() -> dict[str, Any]:
    """The knob values the adapter runs SGLang with (fuzz/capabilities.py): the ``sglang`` profile,
    chunked prefill and the radix cache on or off, the prefill budget (``max_prefill_tokens`` and
    ``chunked_prefill_size``), ``max_running_requests`` and the ratio's decay and reset constants
    drawn from small to SGLang's defaults; pool sizes drawn by the generator."""
    return {"profile": "sglang", "knobs": {"enable_chunked_prefill": [False, True],
                                           "enable_prefix_caching": [True, False],
                                           "max_num_batched_tokens": {"min": 8, "max": 16384},
                                           "max_num_seqs": {"min": 1, "max": 1024},
                                           # a fast decay reaches the ratio's floor, and so retraction, in short traces
                                           "new_token_ratio_decay_steps": {"min": 1, "max": 600},
                                           "retract_decode_steps": {"min": 1, "max": 20}}}


def factory(trace: Trace) -> SglangEngine:
    """``--engine sglang`` (registered in :mod:`fuzz.engines`), declaring :func:`capabilities`."""
    return SglangEngine(trace)


factory.capabilities = capabilities


def record_log(trace: Trace, path: str, level: str = "exact") -> list[StepRecord]:
    """Run ``trace`` on SGLang and write its decision log."""
    from spec.formats import DecisionLog
    from spec.io import write_log
    from spec.protocol import StepLimitError, drive

    engine = SglangEngine(trace)
    try:
        records = drive(engine, trace, engine.config.max_steps)
    except StepLimitError as e:
        records = e.records
    write_log(DecisionLog(f"sglang-{SGLANG_VERSION}", level, records, trace=trace.source, config=trace.config), path)
    return records
