"""A tiny Llama-style decoder in plain PyTorch, computed the simplest correct way.

It is the numerics oracle: every request runs alone against its own dense,
contiguous KV cache (:class:`KVCache`), attention is an explicit
``softmax(q kᵀ / √d + causal mask) v``, and nothing is fused,
paged or batched.

Conventions (shared with ``gpu_engine``, which must load the same weights and
produce the same greedy tokens):

* parameter names are Hugging Face ``LlamaForCausalLM``'s
  (``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight``, …,
  ``model.norm.weight``, ``lm_head.weight``); no biases;
* ``config.json`` keys are Hugging Face's (:class:`TinyLlamaConfig`);
* RoPE is HF Llama's default: ``rotate_half``, non-interleaved halves, no scaling;
* seeded weights follow :func:`init_weights` exactly.

Weights are float32 (files, seeds); the model *computes* in float64 by
default.  Why: a float32 matmul's rounding depends on how many rows it is
given, so a prompt prefilled in chunks gets logits that differ in the last
bits from the same prompt in one piece (~2e-6 here), and a near-tie could
flip a token.  In float64 those differences are ~1e-15, far below any gap
between two logits, so a request's tokens are the same however the spec
chunks, batches or preempts it, and the invariance tests compare tokens with
``==``.  ``dtype=torch.float32`` computes like HF in float32
(a whole-prompt pass matches ``LlamaForCausalLM`` bit for bit).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class TinyLlamaConfig:
    """Model sizes, with Hugging Face ``LlamaConfig`` field names.  Defaults: the tiny model."""

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

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"TinyLlamaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    def to_json(self) -> dict:
        """HF-style ``config.json`` content (loadable by ``transformers.LlamaConfig`` too)."""
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **dataclasses.asdict(self),
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32"}

    @classmethod
    def from_json(cls, obj: dict) -> TinyLlamaConfig:
        """Read an HF ``config.json``; unknown keys are ignored, unsupported variants refused."""
        if obj.get("hidden_act", "silu") != "silu":
            raise ValueError(f"only hidden_act='silu' is supported, got {obj['hidden_act']!r}")
        if obj.get("attention_bias") or obj.get("mlp_bias"):
            raise ValueError("biases are not supported (attention_bias / mlp_bias must be false)")
        rope = obj.get("rope_parameters") or obj.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"only default (unscaled) RoPE is supported, got {rope!r}")
        kw = {f.name: obj[f.name] for f in dataclasses.fields(cls) if f.name in obj}
        if "rope_theta" not in kw and "rope_theta" in rope:  # transformers 5 nests it
            kw["rope_theta"] = rope["rope_theta"]
        if "head_dim" not in kw and "hidden_size" in obj and "num_attention_heads" in obj:
            kw["head_dim"] = obj["hidden_size"] // obj["num_attention_heads"]
        kw.setdefault("num_key_value_heads", obj.get("num_attention_heads", cls.num_key_value_heads))
        return cls(**kw)


def param_shapes(config: TinyLlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's HF name and shape, in the order :func:`init_weights` draws them."""
    c, h = config, config.hidden_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (c.intermediate_size, h),
            p + "mlp.up_proj.weight": (c.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, c.intermediate_size),
        })
    shapes["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes


def init_weights(config: TinyLlamaConfig, seed: int = 0) -> dict[str, Tensor]:
    """Deterministic float32 weights from ``seed`` (the contract every engine follows).

    One generator ``torch.Generator().manual_seed(seed)`` draws, in
    :func:`param_shapes` order: norm weights ``1 + 0.1·randn``; the embedding
    ``randn(vocab, hidden)``; every other matrix ``randn(out, in) / √in`` (unit
    scale activations, so logits are spread out and greedy ties are rare).
    """
    g = torch.Generator().manual_seed(seed)
    weights: dict[str, Tensor] = {}
    for name, shape in param_shapes(config).items():
        w = torch.randn(shape, generator=g, dtype=torch.float32)
        if name.endswith("norm.weight"):
            w = 1 + 0.1 * w
        elif name != "model.embed_tokens.weight":
            w = w / math.sqrt(shape[1])
        weights[name] = w
    return weights


# ----------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    """``w · x / sqrt(mean(x²) + eps)``, as HF's ``LlamaRMSNorm`` (in float32)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension's two halves (HF Llama's RoPE layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Cos and sin tables ``[n, head_dim]`` for absolute ``positions`` (HF default RoPE).

    Computed in ``dtype`` (HF always uses float32: identical in float32 mode,
    more accurate in float64 mode).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=dtype) / head_dim))
    freqs = positions.to(dtype)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class KVCache:
    """One request's keys and values: per layer, dense ``[kv_heads, length, head_dim]`` tensors.

    Appending concatenates; nothing is ever shared, paged or overwritten, so
    ``length`` is exactly the number of positions computed for the request.
    """

    def __init__(self, num_layers: int):
        self.keys: list[Tensor | None] = [None] * num_layers
        self.values: list[Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[1]

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add this chunk's ``k, v`` to ``layer``; return the layer's whole keys and values."""
        if self.keys[layer] is not None:
            k = torch.cat((self.keys[layer], k), dim=1)
            v = torch.cat((self.values[layer], v), dim=1)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class Attention(nn.Module):
    """Grouped-query self-attention over a request's cache plus this chunk, causal."""

    def __init__(self, c: TinyLlamaConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, layer: int) -> Tensor:
        c, n = self.c, x.shape[0]
        q = self.q_proj(x).view(n, c.num_attention_heads, c.head_dim).transpose(0, 1)  # [H, n, d]
        k = self.k_proj(x).view(n, c.num_key_value_heads, c.head_dim).transpose(0, 1)  # [KV, n, d]
        v = self.v_proj(x).view(n, c.num_key_value_heads, c.head_dim).transpose(0, 1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = cache.append(layer, k, v)  # [KV, T, d]: positions 0..T-1
        group = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)  # query head h reads kv head h // group
        scores = (q @ k.transpose(1, 2)) * c.head_dim**-0.5  # [H, n, T]
        key_pos = torch.arange(k.shape[1])
        scores = scores.masked_fill(key_pos[None, :] > positions[:, None], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v  # [H, n, d]
        return self.o_proj(out.transpose(0, 1).reshape(n, -1))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, c: TinyLlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x += attn(norm(x)); x += mlp(norm(x))``."""

    def __init__(self, c: TinyLlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, positions, cos, sin, cache, layer):
        x = x + self.self_attn(self.input_layernorm(x), positions, cos, sin, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Embedding, decoder layers, final norm (HF's ``model.*``)."""

    def __init__(self, c: TinyLlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class TinyLlama(nn.Module):
    """The decoder.  ``state_dict()`` keys are exactly HF ``LlamaForCausalLM``'s."""

    def __init__(self, config: TinyLlamaConfig, weights: dict[str, Tensor] | None = None,
                 dtype: torch.dtype = torch.float64):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.requires_grad_(False)
        self.eval()
        self.to(dtype)
        if weights is not None:
            self.load_weights(weights)

    @classmethod
    def from_seed(cls, config: TinyLlamaConfig | None = None, seed: int = 0, dtype=torch.float64) -> TinyLlama:
        config = config or TinyLlamaConfig()
        return cls(config, init_weights(config, seed), dtype)

    def load_weights(self, weights: dict[str, Tensor]) -> None:
        """Load an HF-named state dict; every parameter must be present with its shape."""
        expected = param_shapes(self.config)
        missing = sorted(set(expected) - set(weights))
        unexpected = sorted(set(weights) - set(expected) - {"lm_head.weight"})  # tied checkpoints may carry it
        if missing or unexpected:
            raise ValueError(f"weights do not match the config: missing {missing[:4]}, unexpected {unexpected[:4]}")
        for name, shape in expected.items():
            if tuple(weights[name].shape) != shape:
                raise ValueError(f"{name}: shape {tuple(weights[name].shape)}, config wants {shape}")
        dtype = self.lm_head.weight.dtype
        self.load_state_dict({k: weights[k].to(dtype) for k in expected}, strict=False)

    def num_parameters(self) -> int:
        """Distinct parameters (a tied head counted once)."""
        return sum(math.prod(s) for s in param_shapes(self.config).values())

    @torch.inference_mode()
    def forward(self, token_ids: list[int] | Tensor, cache: KVCache) -> Tensor:
        """Run tokens at positions ``cache.length ..`` and append their KV; return logits ``[n, vocab]``.

        A whole prompt, a prefill chunk and a one-token decode are the same
        call; the chunk's queries attend to every cached key plus the chunk's
        own earlier keys.
        """
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        start, n = cache.length, ids.shape[0]
        if start + n > self.config.max_position_embeddings:
            raise ValueError(f"position {start + n - 1} exceeds max_position_embeddings={self.config.max_position_embeddings}")
        if n and int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"token id {int(ids.max())} is outside the model's vocabulary ({self.config.vocab_size})")
        positions = torch.arange(start, start + n)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, self.dtype)
        x = self.model.embed_tokens(ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, positions, cos, sin, cache, i)
        return self.lm_head(self.model.norm(x))

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (weights, activations, KV cache, logits)."""
        return self.lm_head.weight.dtype

    def new_cache(self) -> KVCache:
        return KVCache(self.config.num_hidden_layers)

    def save_pretrained(self, folder: str | Path) -> Path:
        return save_pretrained(self, folder)

    @staticmethod
    def from_pretrained(folder: str | Path) -> TinyLlama:
        return load_pretrained(folder)


# ----------------------------------------------------------------------------- files


def save_pretrained(model: TinyLlama, folder: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (HF layout; never pickle)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(json.dumps(model.config.to_json(), indent=2) + "\n")
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if k in param_shapes(model.config)}
    save_file(weights, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    return folder


#: Limits on a model folder: the reference engine computes in float64 on a CPU, so its
#: checkpoints are small; a larger size is refused before any tensor is allocated.
MAX_WEIGHTS_BYTES = 8 * 1024**3
MAX_CONFIG = {"vocab_size": 262_144, "hidden_size": 16_384, "intermediate_size": 65_536, "num_hidden_layers": 256,
              "num_attention_heads": 256, "num_key_value_heads": 256, "head_dim": 1024,
              "max_position_embeddings": 1_048_576}
#: Parameters a model folder may describe (float64 on a CPU: 800 MB of weights).
MAX_PARAMETERS = 100_000_000


def _check_config_json(obj, path: str, text: str) -> TinyLlamaConfig:
    """``config.json`` field by field (types and ``MAX_CONFIG``), then :meth:`TinyLlamaConfig.from_json`."""
    from spec.io import FormatError, line_of

    if not isinstance(obj, dict):
        raise FormatError(path, 1, "(file)", f"expected a JSON object (an HF config), got {type(obj).__name__}")
    for name, limit in MAX_CONFIG.items():
        if name in obj:
            value = obj[name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise FormatError(path, line_of(text, name), name, f"expected an integer, got {value!r}")
            if not 1 <= value <= limit:
                raise FormatError(path, line_of(text, name), name, f"{value} is outside [1, {limit}] (MAX_CONFIG)")
    for name in ("rms_norm_eps", "rope_theta"):
        value = obj.get(name, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e12:
            raise FormatError(path, line_of(text, name), name, f"expected a finite number > 0, got {value!r}")
    if not isinstance(obj.get("tie_word_embeddings", False), bool):
        raise FormatError(path, line_of(text, "tie_word_embeddings"), "tie_word_embeddings", "expected true or false")
    try:
        config = TinyLlamaConfig.from_json(obj)
    except (ValueError, TypeError, AttributeError) as e:
        raise FormatError(path, 1, "(config)", str(e)) from None
    count = sum(math.prod(shape) for shape in param_shapes(config).values())
    if count > MAX_PARAMETERS:
        raise FormatError(path, 1, "(config)", f"{count:,} parameters exceed the limit MAX_PARAMETERS={MAX_PARAMETERS:,}")
    return config


def load_pretrained(folder: str | Path) -> TinyLlama:
    """Load a local HF-style folder (``config.json`` + ``model.safetensors``); no hub access ever.

    Every problem is a ``spec.io.FormatError`` naming the file: a folder that is not
    one, a ``config.json`` with a wrong or out-of-range field, a weights file that is
    not safetensors (pickles are never read), too large, or does not match the config.
    """
    from safetensors.torch import load_file

    from spec.io import FormatError, open_input, read_json_document

    folder = Path(folder)
    if not folder.is_dir():
        raise FormatError(str(folder), 0, "--model", "not a directory (a model folder holds "
                          f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).exists():
            raise FormatError(str(folder / name), 0, "(file)", f"missing (a model folder holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    obj, text = read_json_document(folder / CONFIG_FILE)
    config = _check_config_json(obj, str(folder / CONFIG_FILE), text)
    weights_path = str(folder / WEIGHTS_FILE)
    open_input(weights_path, "MAX_WEIGHTS_BYTES", MAX_WEIGHTS_BYTES).close()
    try:
        weights = load_file(weights_path)  # safetensors: a JSON header and raw tensors, never code
    except Exception as e:  # SafetensorError derives from Exception only
        raise FormatError(weights_path, 0, "(file)", f"not a safetensors file ({e})") from None
    for name, tensor in weights.items():
        if not tensor.is_floating_point():
            raise FormatError(weights_path, 0, name, f"expected floating-point weights, got {tensor.dtype}")
    try:
        return TinyLlama(config, weights)
    except ValueError as e:
        raise FormatError(weights_path, 0, "(weights)", str(e)) from None
