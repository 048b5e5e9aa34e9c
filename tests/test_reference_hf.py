"""Cross-check against a model nobody here wrote: Hugging Face ``LlamaForCausalLM``.

Same config, same (seeded, local) weights, eager attention, float32.  Stated
tolerance: logits agree to ``max |Δ| <= 1e-4`` (observed ~2e-6 for logits of
magnitude ~5; exactly 0 for a whole-prompt pass in the reference's float32
mode), and greedy tokens are identical.
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only, never the hub (read at import)
transformers = pytest.importorskip("transformers")

from reference.engine import ReferenceEngine, torch_threads
from reference.model import TinyLlama, TinyLlamaConfig, init_weights, load_pretrained, save_pretrained
from spec.formats import Trace, TraceRequest
from spec.protocol import drive


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: one torch thread is faster, and immune to a busy shared CPU."""
    with torch_threads(1):
        yield


ATOL = 1e-4
# The tiny default, and a variant: multi-query attention, tied head, head_dim != hidden/heads, other theta.
CONFIGS = {
    "tiny": TinyLlamaConfig(),
    "mqa-tied": TinyLlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                                num_attention_heads=4, num_key_value_heads=1, head_dim=8, max_position_embeddings=512,
                                rope_theta=500000.0, tie_word_embeddings=True),
}


def hf_model(config: TinyLlamaConfig, seed: int):
    """``LlamaForCausalLM`` built from the same config fields, loaded with the seeded weights."""
    hc = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, tie_word_embeddings=config.tie_word_embeddings, attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(hc).eval()
    missing, unexpected = model.load_state_dict(init_weights(config, seed), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied: lm_head is embed
    return model


@torch.no_grad()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0]


def random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_hf_whole_and_chunked(name, dtype):
    config = CONFIGS[name]
    ours, theirs = TinyLlama.from_seed(config, seed=5, dtype=dtype), hf_model(config, seed=5)
    for length in (1, 7, 64, 300):
        tokens = random_tokens(length, config.vocab_size, seed=length)
        want = hf_logits(theirs, tokens)
        whole = ours(tokens, ours.new_cache()).float()
        cache, cuts = ours.new_cache(), sorted({0, length // 3, length // 3 + 1, length - 1, length})
        chunked = torch.cat([ours(tokens[a:b], cache) for a, b in itertools.pairwise(cuts)]).float()
        for got in (whole, chunked):
            assert got.shape == want.shape
            assert (got - want).abs().max() <= ATOL
            assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_saved_folder_loads_in_hf(tmp_path):
    """``config.json`` + ``model.safetensors`` written by save_pretrained is a valid HF Llama folder."""
    config = CONFIGS["mqa-tied"]
    ours = TinyLlama.from_seed(config, seed=9, dtype=torch.float32)
    save_pretrained(ours, tmp_path)
    theirs, info = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", output_loading_info=True, local_files_only=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert theirs.config.rope_parameters["rope_theta"] == config.rope_theta
    tokens = random_tokens(40, config.vocab_size, seed=1)
    assert (hf_logits(theirs.eval(), tokens) - ours(tokens, ours.new_cache())).abs().max() <= ATOL


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_saved_folder_loads_here(tmp_path, name):
    """A folder written by ``transformers`` itself (its config.json keys, its safetensors) loads here."""
    config = CONFIGS[name]
    hf_model(config, seed=2).save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    assert ours.config == config
    tokens = random_tokens(30, config.vocab_size, seed=2)
    assert (hf_logits(hf_model(config, seed=2), tokens) - ours(tokens, ours.new_cache())).abs().max() <= ATOL


def engine_trace(crowded: bool, eos: int) -> Trace:
    """Prompts of several lengths.  Crowded: chunked prefill (16-token budget) and a KV pool
    small enough to force recompute preemptions.  Else: whole prompts, room for everyone."""
    lengths = [1, 5, 17, 40, 64, 3]
    requests = [TraceRequest(id=f"r{i}", prompt_len=n, max_tokens=14 + i, arrival_step=i // 2)
                for i, n in enumerate(lengths)]
    config = ({"num_blocks": 24, "block_size": 4, "max_num_batched_tokens": 16} if crowded else
              {"num_blocks": 256, "block_size": 4, "max_num_batched_tokens": 512, "max_model_len": 512,
               "enable_chunked_prefill": False})
    return Trace(config={"profile": "vllm-v1", **config}, requests=requests, vocab_size=512, eos_token_id=eos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("crowded", [False, True], ids=["plain", "chunked+preempted"])
def test_engine_tokens_and_logits_match_hf_generate(crowded, dtype):
    """Every request's greedy outputs through the engine equal HF ``generate`` on its prompt alone,
    and the logits each token was sampled from equal HF's teacher-forced logits."""
    config = TinyLlamaConfig()
    theirs = hf_model(config, seed=0)
    probe = engine_trace(crowded, eos=2)
    # EOS = HF's 4th greedy token for r2, so that stop handling is exercised too.
    r2 = probe.request("r2").prompt_token_ids(512)
    eos = theirs.generate(torch.tensor([r2]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(r2) + 3].item()
    trace = engine_trace(crowded, eos)
    engine = ReferenceEngine.from_trace(trace, model=TinyLlama.from_seed(config, 0, dtype), keep_logits=True)
    records = drive(engine, trace, max_steps=2000)
    scheduled = [n for r in records for _, n in r.scheduled]
    preempted = [p for r in records for p in r.preempted]
    if crowded:
        assert preempted, "the crowded trace must preempt"
        # r4's 64-token prompt is prefilled in pieces: some chunk of it samples nothing.
        assert any(rid == "r4" and n > 1 and rid not in r.sampled for r in records for rid, n in r.scheduled)
    else:
        assert not preempted and max(scheduled) == 64  # the longest prompt in one piece
    finished = dict(f for r in records for f in r.finished)
    assert finished.get("r2") == "eos"
    for req in trace.requests:
        prompt = req.prompt_token_ids(trace.vocab_size)
        out = theirs.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=req.max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
        want = out[0, len(prompt):].tolist()
        assert engine.outputs[req.id] == want, req.id
        teacher = hf_logits(theirs, prompt + want)[len(prompt) - 1:]
        got = torch.stack(engine.logits[req.id]).float()
        assert (got - teacher[: len(got)]).abs().max() <= ATOL, req.id
