"""The reference decoder on its own: weight contract, files, chunk invariance, errors."""
from __future__ import annotations

import json
import math

import pytest
import torch

from reference.engine import torch_threads
from reference.model import (
    TinyLlama,
    TinyLlamaConfig,
    init_weights,
    load_pretrained,
    param_shapes,
    rope_cos_sin,
    save_pretrained,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: one torch thread is faster, and immune to a busy shared CPU."""
    with torch_threads(1):
        yield


SMALL = TinyLlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=8, max_position_embeddings=128)


def contract_weights(c: TinyLlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    """The seeded-weights rule, restated from the contract independently of init_weights."""
    g = torch.Generator().manual_seed(seed)
    norm = lambda: 1 + 0.1 * torch.randn(c.hidden_size, generator=g)
    mat = lambda o, i: torch.randn(o, i, generator=g) / math.sqrt(i)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    w = {"model.embed_tokens.weight": torch.randn(c.vocab_size, c.hidden_size, generator=g)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = mat(q, c.hidden_size)
        w[p + "self_attn.k_proj.weight"] = mat(kv, c.hidden_size)
        w[p + "self_attn.v_proj.weight"] = mat(kv, c.hidden_size)
        w[p + "self_attn.o_proj.weight"] = mat(c.hidden_size, q)
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "mlp.gate_proj.weight"] = mat(c.intermediate_size, c.hidden_size)
        w[p + "mlp.up_proj.weight"] = mat(c.intermediate_size, c.hidden_size)
        w[p + "mlp.down_proj.weight"] = mat(c.hidden_size, c.intermediate_size)
    w["model.norm.weight"] = norm()
    if not c.tie_word_embeddings:
        w["lm_head.weight"] = mat(c.vocab_size, c.hidden_size)
    return w


@pytest.mark.parametrize("config", [TinyLlamaConfig(), TinyLlamaConfig(tie_word_embeddings=True, num_hidden_layers=3)])
def test_seeded_weights_follow_the_contract(config):
    got, want = init_weights(config, seed=11), contract_weights(config, seed=11)
    assert list(got) == list(want)  # same names, same draw order
    for name in want:
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], want[name]), name
    other = init_weights(config, seed=12)
    assert not torch.equal(other["model.embed_tokens.weight"], got["model.embed_tokens.weight"])


def test_tiny_default_sizes_and_parameter_count():
    c = TinyLlamaConfig()
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (512, 64, 128, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.max_position_embeddings) == (4, 2, 16, 4096)
    model = TinyLlama.from_seed(c)
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())
    assert set(model.state_dict()) == set(param_shapes(c))


@pytest.mark.parametrize("tied", [False, True])
def test_save_and_load_round_trip(tmp_path, tied):
    config = TinyLlamaConfig(**{**SMALL.__dict__, "tie_word_embeddings": tied})
    model = TinyLlama.from_seed(config, seed=3)
    save_pretrained(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is tied
    loaded = load_pretrained(tmp_path)
    assert loaded.config == config
    tokens = [5, 9, 33, 2, 60]
    assert torch.equal(model(tokens, model.new_cache()), loaded(tokens, loaded.new_cache()))
    if tied:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_config_reads_transformers5_json():
    """transformers 5 nests rope_theta in rope_parameters and may omit head_dim."""
    obj = {"vocab_size": 100, "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 6, "num_key_value_heads": 3, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}
    c = TinyLlamaConfig.from_json(obj)
    assert (c.rope_theta, c.head_dim, c.num_key_value_heads) == (500000.0, 8, 3)
    with pytest.raises(ValueError, match="RoPE"):
        TinyLlamaConfig.from_json({**obj, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}})
    with pytest.raises(ValueError, match="multiple"):
        TinyLlamaConfig(num_attention_heads=4, num_key_value_heads=3)


def test_chunked_prefill_matches_whole_prompt():
    """Any split of a sequence into chunks gives the same logits (float64 compute: to ~1e-12)."""
    model = TinyLlama.from_seed(SMALL, seed=1)
    tokens = torch.randint(3, SMALL.vocab_size, (50,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = model(tokens, model.new_cache())
    cache, parts = model.new_cache(), []
    for a, b in [(0, 1), (1, 9), (9, 10), (10, 37), (37, 50)]:
        parts.append(model(tokens[a:b], cache))
    chunked = torch.cat(parts)
    assert cache.length == 50
    assert torch.allclose(chunked, whole, rtol=0, atol=1e-12)
    assert torch.equal(chunked.argmax(-1), whole.argmax(-1))


def test_attention_is_causal():
    """Changing a later token never changes an earlier position's logits."""
    model = TinyLlama.from_seed(SMALL, seed=2)
    a = model([7, 8, 9, 10], model.new_cache())
    b = model([7, 8, 9, 11], model.new_cache())
    assert torch.equal(a[:3], b[:3])
    assert not torch.equal(a[3], b[3])


def test_rope_tables_are_hf_default():
    """cos/sin of ``p · theta^(-2i/d)``, the frequency table repeated over both halves."""
    cos, sin = rope_cos_sin(torch.tensor([0, 1, 5, 1000]), 8, 10000.0, torch.float64)
    for row, p in enumerate([0, 1, 5, 1000]):
        for i in range(8):
            angle = p * 10000.0 ** (-2 * (i % 4) / 8)
            assert math.isclose(cos[row, i], math.cos(angle), abs_tol=1e-12)
            assert math.isclose(sin[row, i], math.sin(angle), abs_tol=1e-12)


def test_bad_inputs_are_refused():
    model = TinyLlama.from_seed(SMALL)
    with pytest.raises(ValueError, match="vocabulary"):
        model([SMALL.vocab_size], model.new_cache())
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model([3] * (SMALL.max_position_embeddings + 1), model.new_cache())
    weights = init_weights(SMALL, 0)
    del weights["model.norm.weight"]
    with pytest.raises(ValueError, match="missing"):
        TinyLlama(SMALL, weights)
