"""A Llama-style decoder run as one flattened batch over a paged KV cache.

Parameters use Hugging Face ``LlamaForCausalLM`` names and ``config.json`` keys,
so the same weights load here and in the reference engine.  No biases, SiLU
MLP, RMSNorm in fp32, HF-default RoPE (``rotate_half``, not interleaved),
grouped-query attention.  The KV cache is one tensor
``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``; each step writes
the new tokens' K/V through a slot mapping and attends over block tables
(:mod:`gpu_engine.attention`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as Fn

from gpu_engine.attention import paged_attention


@dataclass(frozen=True)
class LlamaConfig:
    """Model sizes with HF ``LlamaConfig`` key names; defaults are the tiny test model."""

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    @classmethod
    def from_json(cls, obj: dict) -> "LlamaConfig":
        kw = {f.name: obj[f.name] for f in dataclasses.fields(cls) if f.name in obj}
        rope = obj.get("rope_parameters") or obj.get("rope_scaling") or {}
        if "rope_theta" not in kw and "rope_theta" in rope:
            kw["rope_theta"] = rope["rope_theta"]
        if "head_dim" not in kw and "hidden_size" in obj and "num_attention_heads" in obj:
            kw["head_dim"] = obj["hidden_size"] // obj["num_attention_heads"]
        kw.setdefault("num_key_value_heads", obj.get("num_attention_heads", cls.num_key_value_heads))
        return cls(**kw)

    def to_json(self) -> dict:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **dataclasses.asdict(self),
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}


def param_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes, in the order the seeded-weight rule draws them."""
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    out = {"model.embed_tokens.weight": (c.vocab_size, h)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                    p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                    p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,),
                    p + "mlp.gate_proj.weight": (c.intermediate_size, h),
                    p + "mlp.up_proj.weight": (c.intermediate_size, h),
                    p + "mlp.down_proj.weight": (h, c.intermediate_size)})
    out["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, h)
    return out


def seeded_weights(c: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """The project's seeded-weight rule (shared by convention with the reference engine).

    ``g = torch.Generator().manual_seed(seed)``; in :func:`param_shapes` order:
    norms ``1 + 0.1·randn``, the embedding ``randn``, every other matrix
    ``randn(out, in) / sqrt(in)``; float32.
    """
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in param_shapes(c).items():
        w = torch.randn(shape, generator=g, dtype=torch.float32)
        if name.endswith("norm.weight"):
            w = 1 + 0.1 * w
        elif name != "model.embed_tokens.weight":
            w = w / math.sqrt(shape[1])
        out[name] = w
    return out


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32}


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a ``.safetensors`` file with the standard library and torch only
    (8-byte little-endian header size, JSON header, raw little-endian data)."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        dtype = _ST_DTYPES[info["dtype"]]
        buf = bytearray(raw[base + a:base + b])
        t = torch.frombuffer(buf, dtype=dtype) if b > a else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(info["shape"])
    return out


def load_pretrained(folder: str | Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """A local HF-style folder: ``config.json`` + ``model.safetensors`` (never a hub)."""
    folder = Path(folder)
    config = LlamaConfig.from_json(json.loads((folder / "config.json").read_text()))
    return config, read_safetensors(folder / "model.safetensors")


@dataclass
class AttentionMetadata:
    """Per-step batch layout for paged attention (see :mod:`gpu_engine.attention`)."""

    block_table: torch.Tensor  # [S, B] rows of the batch's sequences
    seq_start: torch.Tensor  # [S] position of each sequence's first query token
    query_start: torch.Tensor  # [S + 1] offsets into the flattened batch
    seq_lens: torch.Tensor  # [S] context length after this step
    token_seq: torch.Tensor  # [T] int32 sequence index of each query token
    token_pos: torch.Tensor  # [T] int32 position of each query token


class PagedLlama:
    """The decoder: weights on a device, a paged KV cache, one batched forward per step."""

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], device="cpu",
                 dtype: torch.dtype = torch.float32, attention_backend: str = "auto"):
        missing = set(param_shapes(config)) - set(weights)
        if missing:
            raise ValueError(f"missing parameters: {sorted(missing)[:4]}")
        self.config, self.device, self.dtype = config, torch.device(device), dtype
        self.attention_backend = attention_backend
        self.w = {k: v.to(self.device, dtype) for k, v in weights.items() if k in param_shapes(config)}
        if config.tie_word_embeddings:
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        c = config
        self.rope_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # HF: fp32
        self.inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=self.rope_dtype,
                                                             device=self.device) / c.head_dim))
        self.kv_cache: torch.Tensor | None = None

    @classmethod
    def from_seed(cls, config: LlamaConfig | None = None, seed: int = 0, **kw) -> "PagedLlama":
        config = config or LlamaConfig()
        return cls(config, seeded_weights(config, seed), **kw)

    @classmethod
    def from_pretrained(cls, folder: str | Path, **kw) -> "PagedLlama":
        config, weights = load_pretrained(folder)
        return cls(config, weights, **kw)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        c = self.config
        self.kv_cache = torch.zeros((c.num_hidden_layers, 2, num_blocks, block_size, c.num_key_value_heads,
                                     c.head_dim), dtype=self.dtype, device=self.device)
        return self.kv_cache

    def _rms_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """HF ``LlamaRMSNorm``: normalise in fp32 (or fp64), scale in the model dtype."""
        xf = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return self.w[name] * xf.to(x.dtype)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(self.rope_dtype)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                meta: AttentionMetadata, logits_rows: torch.Tensor) -> torch.Tensor:
        """Run the flattened batch; return the logits of ``logits_rows`` (the last
        token of each sequence that samples).  K/V of every token are written to
        the paged cache at ``slot_mapping`` before each layer's attention."""
        c, w = self.config, self.w
        T, H, KVH, D = input_ids.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        x = w["model.embed_tokens.weight"][input_ids]
        cos, sin = self._rope(positions)
        cache = self.kv_cache
        nb, bs = cache.shape[2], cache.shape[3]
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            h = self._rms_norm(x, p + "input_layernorm.weight")
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(T, H, D)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(T, KVH, D)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(T, KVH, D)
            q = q * cos + self._rotate_half(q) * sin
            k = k * cos + self._rotate_half(k) * sin
            k_cache, v_cache = cache[i, 0], cache[i, 1]
            k_cache.view(nb * bs, KVH, D)[slot_mapping] = k
            v_cache.view(nb * bs, KVH, D)[slot_mapping] = v
            o = paged_attention(q, k_cache, v_cache, meta, backend=self.attention_backend)
            x = x + o.reshape(T, H * D) @ w[p + "self_attn.o_proj.weight"].T
            h = self._rms_norm(x, p + "post_attention_layernorm.weight")
            x = x + (Fn.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
                @ w[p + "mlp.down_proj.weight"].T
        x = self._rms_norm(x[logits_rows], "model.norm.weight")
        return x @ w["lm_head.weight"].T
