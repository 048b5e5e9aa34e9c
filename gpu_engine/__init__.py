"""The optimized engine: tensor-resident vLLM V1 scheduling, paged KV cache, paged attention.

An independent implementation (DESIGN.md §1): it imports only the spec's data
formats, protocol and knobs (``spec.formats``, ``spec.protocol``, ``spec.config``),
never its scheduling or memory logic, so that differential testing against the
spec means something.

* :mod:`gpu_engine.xp`         — array backend (torch tensors; numpy views of them on CPU)
* :mod:`gpu_engine.formulas`   — closed forms of the scheduler's sequential loops
* :mod:`gpu_engine.block_pool` — free-block queue, ref counts, block hashes
* :mod:`gpu_engine.fairness`   — VTC tenant counters (policy "vtc")
* :mod:`gpu_engine.scheduler`  — request state in tensors and the vectorized step
* :mod:`gpu_engine.model`      — Llama-style decoder over a paged KV cache
* :mod:`gpu_engine.attention`  — paged attention (Triton on GPU, torch fallback)
* :mod:`gpu_engine.engine`     — :class:`GpuEngine`, the engine protocol
"""
from gpu_engine.engine import GpuEngine, make_model
from gpu_engine.model import LlamaConfig, PagedLlama, load_pretrained, seeded_weights

__all__ = ["GpuEngine", "make_model", "LlamaConfig", "PagedLlama", "load_pretrained", "seeded_weights"]
