"""gpu_engine's model mode: weights, the paged forward, paged attention, greedy tokens.

* the seeded-weight rule gives the reference engine's weights (shared convention);
* the paged batched forward matches Hugging Face ``LlamaForCausalLM`` on the same weights;
* paged attention over a scattered block table equals dense causal attention;
* on random traces, gpu_engine (model mode) samples exactly the reference
  engine's greedy tokens for every request, and makes the spec's decisions.
"""
from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
import torch

from spec.formats import Trace, TraceRequest
from spec.protocol import drive

from gpu_engine import GpuEngine, LlamaConfig, PagedLlama, seeded_weights
from gpu_engine.attention import paged_attention_torch
from gpu_engine.model import load_pretrained

reference = pytest.importorskip("reference")


def test_seeded_weights_follow_the_shared_rule():
    from reference.model import TinyLlamaConfig, init_weights

    mine, theirs = seeded_weights(LlamaConfig(), seed=3), init_weights(TinyLlamaConfig(), seed=3)
    assert list(mine) == list(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def _dense_attention(q, k, v, positions):
    """Plain causal GQA attention over contiguous K/V (the textbook formula)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    mask = torch.arange(k.shape[0])[None, :] > positions[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(mask[None], float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_attention_equals_dense(block_size):
    g = torch.Generator().manual_seed(block_size)
    H, KVH, D, N = 4, 2, 16, 64
    lens, starts = [37, 5, 16, 1], [30, 0, 15, 0]  # chunk of 7, prefill of 5, decode, single-token prompt
    k_cache = torch.randn(N, block_size, KVH, D, generator=g, dtype=torch.float64)
    v_cache = torch.randn(N, block_size, KVH, D, generator=g, dtype=torch.float64)
    perm = torch.randperm(N, generator=g)
    tables, qs, expect, used = [], [], [], 0
    width = max(-(-L // block_size) for L in lens)
    for L, s in zip(lens, starts):
        nb = -(-L // block_size)
        blocks = perm[used:used + nb]
        used += nb
        tables.append(torch.cat([blocks, torch.zeros(width - nb, dtype=torch.long)]))
        k = k_cache[blocks].reshape(-1, KVH, D)[:L]
        v = v_cache[blocks].reshape(-1, KVH, D)[:L]
        q = torch.randn(L - s, H, D, generator=g, dtype=torch.float64)
        qs.append(q)
        expect.append(_dense_attention(q, k, v, torch.arange(s, L)))
    qstart = torch.tensor([0] + list(torch.tensor([L - s for L, s in zip(lens, starts)]).cumsum(0)))
    out = paged_attention_torch(torch.cat(qs), k_cache, v_cache, torch.stack(tables), torch.tensor(starts), qstart,
                                torch.tensor(lens), 1 / math.sqrt(D))
    assert torch.allclose(out, torch.cat(expect), atol=1e-12)


def _hf_model(weights, config: LlamaConfig):
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.LlamaConfig(**{k: v for k, v in config.to_json().items() if k not in ("architectures",)})
    model = transformers.LlamaForCausalLM(hf_config).to(torch.float64).eval()
    model.load_state_dict({k: v.to(torch.float64) for k, v in weights.items()}, strict=False)
    return model


def test_paged_forward_matches_hugging_face_llama():
    config = LlamaConfig()
    weights = seeded_weights(config, seed=1)
    hf = _hf_model(weights, config)
    prompt = [random.Random(0).randrange(3, config.vocab_size) for _ in range(23)]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    # three requests' worth of pages; the prompt runs as a chunk of 10, a chunk of 12, then a decode
    model = PagedLlama(config, weights, dtype=torch.float64)
    model.allocate_kv_cache(num_blocks=12, block_size=4)
    table = torch.tensor([[9, 2, 7, 4, 11, 1]])
    from gpu_engine.model import AttentionMetadata

    for start, end in ((0, 10), (10, 22), (22, 23)):
        pos = torch.arange(start, end)
        meta = AttentionMetadata(block_table=table, seq_start=torch.tensor([start]),
                                 query_start=torch.tensor([0, end - start]), seq_lens=torch.tensor([end]),
                                 token_seq=torch.zeros(end - start, dtype=torch.int32), token_pos=pos.to(torch.int32))
        got = model.forward(torch.tensor(prompt[start:end]), pos, table[0, pos // 4] * 4 + pos % 4, meta,
                            torch.tensor([end - start - 1]))
        # HF computes RoPE tables in float32 even for a float64 model: agreement to ~1e-7
        assert (got[0] - want[end - 1]).abs().max() < 1e-5, (start, end)


def test_load_from_a_local_folder(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    config = LlamaConfig(num_hidden_layers=1, vocab_size=300)
    weights = seeded_weights(config, seed=2)
    (tmp_path / "config.json").write_text(json.dumps(config.to_json()))
    safetensors.save_file(weights, str(tmp_path / "model.safetensors"))
    loaded_config, loaded = load_pretrained(tmp_path)
    assert loaded_config == config
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)


def _token_trace(seed: int) -> Trace:
    """A small trace for the tiny model (vocab 512): chunked prefill, shared prefixes,
    preemption under tight memory, both queue policies."""
    rng = random.Random(seed)
    cfg = {"profile": "vllm-v1", "block_size": rng.choice([2, 4, 16]), "num_blocks": rng.randint(12, 40),
           "max_num_batched_tokens": rng.choice([8, 16, 64]), "max_num_seqs": rng.randint(2, 6),
           "max_model_len": 96, "policy": rng.choice(["fcfs", "priority"]),
           "long_prefill_token_threshold": rng.choice([0, 6]), "enable_prefix_caching": rng.random() < 0.8}
    reqs = []
    for i in range(rng.randint(2, 6)):
        p = rng.randint(1, 40)
        reqs.append(TraceRequest(id=f"q{i}", prompt_len=p, max_tokens=rng.randint(1, 12), arrival_step=rng.randint(0, 4),
                                 prefix_group="g" if rng.random() < 0.5 else None, prefix_len=rng.randint(0, p),
                                 priority=rng.randint(0, 2), ignore_eos=rng.random() < 0.5))
    return Trace(config=cfg, requests=reqs, vocab_size=512, eos_token_id=2, name=f"tokens-{seed}")


def _tokens(records):
    out: dict[str, list[int]] = {}
    for r in records:
        for rid, t in r.sampled.items():
            out.setdefault(rid, []).append(t)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_greedy_tokens_equal_the_reference_engine(seed):
    from reference.engine import ReferenceEngine

    trace = _token_trace(seed)
    ref = drive(ReferenceEngine.from_trace(trace, level="memory"), trace, 500)
    mine = drive(GpuEngine.from_trace(trace, model="tiny", dtype=torch.float64, level="memory", log_state=True), trace, 500)
    assert _tokens(mine) == _tokens(ref)
    assert [r.to_json("memory") for r in mine] == [dataclasses.replace(r, reasons=None).to_json("memory") for r in ref]
    assert sum(len(t) for t in _tokens(ref).values()) > 0


def test_float32_greedy_tokens_equal_the_reference_engine():
    from reference.engine import ReferenceEngine

    trace = _token_trace(11)
    ref = drive(ReferenceEngine.from_trace(trace, level="memory"), trace, 500)
    mine = drive(GpuEngine.from_trace(trace, model="tiny", level="memory"), trace, 500)
    assert _tokens(mine) == _tokens(ref)


def test_torch_code_path_samples_the_same_tokens():
    trace = _token_trace(3)
    numpy_path = drive(GpuEngine.from_trace(trace, model="tiny"), trace, 500)
    torch_path = drive(GpuEngine.from_trace(trace, model="tiny", use_numpy=False), trace, 500)
    assert _tokens(torch_path) == _tokens(numpy_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_model_mode_tokens_equal_cpu():
    trace = _token_trace(5)
    cpu = drive(GpuEngine.from_trace(trace, model="tiny"), trace, 500)
    gpu = drive(GpuEngine.from_trace(trace, model="tiny", device="cuda"), trace, 500)
    assert _tokens(gpu) == _tokens(cpu)
