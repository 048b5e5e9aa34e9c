"""The reference engine: the spec's decisions, executed by the tiny decoder the naive way.

Every scheduling and memory decision comes from :class:`spec.scheduler.SpecEngine`
(split step: ``schedule()`` then ``update_from_output()``).  In between, each
scheduled request runs *alone* against its own dense :class:`~reference.model.KVCache`:

* a prefill chunk appends its positions to the cache; a decode appends one;
* a request the spec starts at ``start > 0`` on a prefix-cache hit simply
  computes the hit positions privately too (numerically the same thing);
* a recompute-preempted request's cache is dropped, and rebuilt from
  prompt + outputs when it resumes; finished and aborted requests' caches are
  dropped.

No paging, no batching: a request's tokens cannot depend on its neighbours.
The engine writes the decision log (:class:`~spec.formats.StepRecord`) at the
``decisions`` or ``memory`` level, with each request's sampled token.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

from reference.model import KVCache, TinyLlama, TinyLlamaConfig, load_pretrained
from reference.sampling import GREEDY, SamplingParams, sample
from spec.formats import StepRecord, Trace, TraceRequest
from spec.scheduler import SpecEngine

ENGINE_LEVELS = ("decisions", "memory")


def default_model_config(vocab_size: int) -> TinyLlamaConfig:
    """The tiny model, its vocabulary widened to the trace's when that is larger."""
    return TinyLlamaConfig(vocab_size=max(TinyLlamaConfig.vocab_size, vocab_size))


def make_model(model=None, vocab_size: int = TinyLlamaConfig.vocab_size, seed: int = 0) -> TinyLlama:
    """A model from ``None`` (the tiny one, seeded), a folder, a config (seeded) or a ``TinyLlama``."""
    if isinstance(model, TinyLlama):
        return model
    if model is None:
        return TinyLlama.from_seed(default_model_config(vocab_size), seed)
    if isinstance(model, TinyLlamaConfig):
        return TinyLlama.from_seed(model, seed)
    if isinstance(model, (str, Path)):
        return load_pretrained(model)
    raise TypeError(f"model must be None, a folder, a TinyLlamaConfig or a TinyLlama, got {type(model).__name__}")


@contextmanager
def torch_threads(n: int | None):
    """Run the body with ``n`` torch intra-op threads (``None``: leave the setting alone)."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class ReferenceEngine:
    """The engine protocol (DESIGN.md §5) over the spec's scheduler and :class:`TinyLlama`."""

    name = "reference"

    def __init__(self, spec: SpecEngine, model: TinyLlama, sampling: SamplingParams = GREEDY,
                 level: str = "memory", keep_logits: bool = False, num_threads: int | None = 1):
        if model.config.vocab_size < spec.vocab_size:
            raise ValueError(
                f"the trace's vocab_size {spec.vocab_size} exceeds the model's {model.config.vocab_size}: "
                "prompt tokens would fall outside the embedding (use a model with a larger vocabulary)"
            )
        if spec.config.max_model_len > model.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {spec.config.max_model_len} exceeds the model's "
                f"max_position_embeddings {model.config.max_position_embeddings}"
            )
        if level not in ENGINE_LEVELS:
            raise ValueError(f"level must be one of {', '.join(ENGINE_LEVELS)}, got {level!r}")
        self.spec = spec
        self.model = model
        self.sampling = sampling
        self.level = level
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}  # every token sampled, by request
        self.caches: dict[str, KVCache] = {}  # requests with computed positions
        self.logits: dict[str, list[Tensor]] | None = {} if keep_logits else None
        self.num_computed = 0  # positions the model ran, recomputation included
        # One thread by default: the tiny model's matrices are too small to split, and
        # spinning worker threads on a shared CPU make it ~10x slower.
        self.num_threads = num_threads

    @classmethod
    def from_trace(cls, trace: Trace, model=None, sampling: SamplingParams | None = None, seed: int = 0,
                   level: str = "memory", check_invariants: bool = False, keep_logits: bool = False,
                   num_threads: int | None = 1) -> ReferenceEngine:
        """An engine for ``trace``: its knobs, vocabulary and EOS; ``model`` as in :func:`make_model`."""
        spec = SpecEngine.from_trace(trace, check_invariants=check_invariants)
        model = make_model(model, trace.vocab_size, seed)
        return cls(spec, model, sampling or GREEDY, level, keep_logits, num_threads)

    # -- protocol ----------------------------------------------------------

    def add_request(self, request: TraceRequest) -> None:
        self.spec.add_request(request)
        self.prompts[request.id] = request.prompt_token_ids(self.spec.vocab_size)
        self.outputs[request.id] = []

    def abort_request(self, request_id: str) -> None:
        self.spec.abort_request(request_id)
        self.caches.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.spec.has_unfinished_requests()

    def step(self) -> StepRecord:
        """Schedule (spec), run each scheduled request alone, sample, update (spec)."""
        out = self.spec.schedule()
        for rid in out.preempted:
            self.caches.pop(rid, None)  # recompute preemption: the KV is gone
        sampled: dict[str, int] = {}
        with torch_threads(self.num_threads):
            for s in out.scheduled:
                logits = self._run(s.request_id, s.start, s.start + s.num_tokens)
                if s.samples:
                    sampled[s.request_id] = self._sample(s.request_id, logits)
        record = self.spec.update_from_output(sampled)
        for rid in [r for r, _ in record.finished] + record.aborted:
            self.caches.pop(rid, None)
        return self._at_level(record)

    # -- execution ---------------------------------------------------------

    def _run(self, rid: str, start: int, end: int) -> Tensor:
        """Compute positions ``[len(cache), end)`` of ``rid``; return the last position's logits.

        ``len(cache) < start`` after a prefix-cache hit (the hit is recomputed
        privately); ``len(cache) > start`` would mean the spec forgot computed
        tokens without a preemption, which this oracle refuses.
        """
        cache = self.caches.setdefault(rid, self.model.new_cache())
        if cache.length > start:
            raise RuntimeError(f"{rid}: the spec schedules from position {start}, but {cache.length} are computed")
        tokens = (self.prompts[rid] + self.outputs[rid])[cache.length:end]
        self.num_computed += len(tokens)
        return self.model(tokens, cache)[-1]

    def _sample(self, rid: str, logits: Tensor) -> int:
        index = len(self.outputs[rid])
        token = sample(logits, self.sampling, rid, index)
        self.outputs[rid].append(token)
        if self.logits is not None:
            self.logits.setdefault(rid, []).append(logits.clone())
        return token

    def _at_level(self, record: StepRecord) -> StepRecord:
        """Keep what an engine's log carries at ``self.level``; the spec's reasons are its own."""
        record.reasons = None
        record.block_ids = record.evicted = None
        if self.level == "decisions":
            record.num_free_blocks = record.blocks = record.cache_hits = record.num_evicted = None
        return record


def generate_alone(model: TinyLlama, prompt: list[int], max_tokens: int, sampling: SamplingParams = GREEDY,
                   request_id: str = "r", eos_token_id: int | None = None) -> list[int]:
    """One request, whole prompt at once, then one decode per token: the simplest possible run."""
    cache, out = model.new_cache(), []
    with torch_threads(1):
        logits = model(prompt, cache)[-1]
        while len(out) < max_tokens:
            out.append(sample(logits, sampling, request_id, len(out)))
            if out[-1] == eos_token_id or len(out) == max_tokens:
                break
            logits = model([out[-1]], cache)[-1]
    return out
