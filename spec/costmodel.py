"""The step cost model: how long one engine step takes, in modelled time (DESIGN.md §2.1).

The spec decides *what* runs in each step; this module says *how long* the
step takes, so that a trace whose arrivals are in seconds can be replayed as a
deterministic discrete-event simulation (:mod:`spec.simulate`).

The formula (one line, linear, documented term by term)::

    step_seconds = fixed_s
                 + per_prefill_token_s * prefill_tokens
                 + per_decode_seq_s    * decode_seqs
                 + per_kv_token_s      * kv_tokens
                 + per_prefill_step_s  * (1 if prefill_tokens > 0 else 0)

``prefill_tokens``
    tokens computed in the step that are not a decode: prompt chunks, and the
    recomputation of a preempted request's prompt and outputs.
``decode_seqs``
    requests that compute exactly their newest sampled token (one each).
``kv_tokens``
    KV-cache tokens the attention reads: for every scheduled request, its
    context after the step (``start + tokens``), prefix-cache hits included.
``per_prefill_step_s``
    paid once by a step that computes any prefill token (0 in every preset).
    Measured on a real vLLM server (issue 17, docs/server.md): a step that
    mixes a prompt chunk into the decodes costs a fixed extra beyond its tokens
    (the attention backend's separate prefill path and metadata, and the front
    end's work on the request that just arrived, on the same cores).

Why these terms: a decoder step streams the weights once (``fixed_s``, the
memory-bound floor, plus launch and scheduling overhead); every prompt token is
a row of every matmul (compute-bound, ``per_prefill_token_s``); a decode row
costs less, because the weight stream hides most of it (``per_decode_seq_s``,
plus sampling); attention reads each sequence's KV (``per_kv_token_s``, memory
bound).  The model is additive where real hardware overlaps (a roofline is a
``max``), and it ignores prefill attention's quadratic FLOPs; both errors are
small at the batch sizes of the profiles and are what :func:`fuzz.calibrate.fit`
absorbs when it is fitted to measured steps.

Time is kept in **integer nanoseconds**: a step's duration is the formula
rounded once (``round`` half to even) to a whole nanosecond, so the simulated
clock is an exact integer sum, identical on every machine and in any language
that evaluates the formula in the same order (IEEE-754 doubles).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

NS_PER_S = 1_000_000_000


class StepShape(NamedTuple):
    """What a step's batch looked like, as far as its cost is concerned (a tuple: one per step)."""

    prefill_tokens: int = 0
    decode_seqs: int = 0
    kv_tokens: int = 0


@dataclass(frozen=True)
class CostModel:
    """Coefficients of the step formula, and the deployment they describe.

    ``knobs`` are scheduler knobs the modelled deployment implies (the KV pool
    its memory holds, the model's context length); simulations apply them under
    any knob the user sets explicitly.  ``source`` says where the numbers come from.
    """

    name: str
    fixed_s: float
    per_prefill_token_s: float = 0.0
    per_decode_seq_s: float = 0.0
    per_kv_token_s: float = 0.0
    knobs: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    per_prefill_step_s: float = 0.0  # last: positional construction keeps its meaning

    def __post_init__(self) -> None:
        for name in COEFFICIENTS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0 or value == float("inf"):
                raise ValueError(f"cost model {self.name!r}: {name} must be a finite number >= 0, got {value!r}")
        if self.fixed_s * NS_PER_S < 1:
            raise ValueError(f"cost model {self.name!r}: fixed_s must be at least 1 ns, so that every step takes time")

    def step_seconds(self, shape: StepShape) -> float:
        """The formula of the module docstring, in seconds (a float)."""
        return (
            self.fixed_s
            + self.per_prefill_token_s * shape.prefill_tokens
            + self.per_decode_seq_s * shape.decode_seqs
            + self.per_kv_token_s * shape.kv_tokens
            + self.per_prefill_step_s * (1 if shape.prefill_tokens > 0 else 0)  # + 0.0 when unset: bit-identical
        )

    def step_ns(self, shape: StepShape) -> int:
        """The step's duration in whole nanoseconds (at least 1): the simulator's clock unit."""
        return max(1, round(self.step_seconds(shape) * NS_PER_S))

    def to_json(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "fixed_s": self.fixed_s,
            "per_prefill_token_s": self.per_prefill_token_s,
            "per_decode_seq_s": self.per_decode_seq_s,
            "per_kv_token_s": self.per_kv_token_s,
            "knobs": dict(self.knobs),
            "source": self.source,
        }
        if self.per_prefill_step_s:  # written only when set: older readers keep reading the presets' files
            out["per_prefill_step_s"] = self.per_prefill_step_s
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "CostModel":
        known = set(FILE_FIELDS)
        unknown = sorted(set(obj) - known)
        if unknown:
            raise ValueError(f"unknown cost-model field {unknown[0]!r} (known: {', '.join(sorted(known))})")
        if "fixed_s" not in obj:
            raise ValueError("cost model: missing required field 'fixed_s'")
        return cls(
            name=str(obj.get("name", "custom")),
            fixed_s=obj["fixed_s"],
            per_prefill_token_s=obj.get("per_prefill_token_s", 0.0),
            per_decode_seq_s=obj.get("per_decode_seq_s", 0.0),
            per_kv_token_s=obj.get("per_kv_token_s", 0.0),
            knobs=dict(obj.get("knobs", {})),
            source=str(obj.get("source", "")),
            per_prefill_step_s=obj.get("per_prefill_step_s", 0.0),
        )


# --------------------------------------------------------------------------
# Cost-model files (written by ``batchspec calibrate``).
# --------------------------------------------------------------------------

#: Largest coefficient a cost-model file may set, in seconds: no real engine spends an
#: hour on a step or a token, and larger values overflow the nanosecond clock's float.
MAX_COEFFICIENT_S = 3600.0
COEFFICIENTS = ("fixed_s", "per_prefill_token_s", "per_decode_seq_s", "per_kv_token_s", "per_prefill_step_s")
FILE_FIELDS = ("name", *COEFFICIENTS, "knobs", "source")


def load_file(path: str) -> CostModel:
    """Read and validate a cost-model JSON file; raise ``spec.io.FormatError`` naming the field.

    Strict: an object with ``fixed_s`` and only the fields of :meth:`CostModel.to_json`;
    coefficients finite numbers in ``[0, MAX_COEFFICIENT_S]`` (not bools, not strings);
    ``knobs`` scheduler knobs of the right types and ranges.
    """
    from spec.config import ConfigError, resolve
    from spec.io import FormatError, check_knob, line_of, read_json_document, OptionError

    path = str(path)
    obj, text = read_json_document(path)

    def bad(field_name: str, problem: str) -> FormatError:
        return FormatError(path, line_of(text, field_name), field_name, problem)

    if not isinstance(obj, dict):
        raise FormatError(path, 1, "(file)", f"expected a JSON object (a cost model), got {type(obj).__name__}")
    for key in obj:
        if key not in FILE_FIELDS:
            raise bad(key, f"unknown field (known: {', '.join(FILE_FIELDS)})")
    if "fixed_s" not in obj:
        raise FormatError(path, 1, "fixed_s", "missing required field")
    for key in COEFFICIENTS:
        value = obj.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad(key, f"expected a number of seconds, got {value!r}")
        if not 0 <= value <= MAX_COEFFICIENT_S:
            raise bad(key, f"{value!r} is outside [0, {MAX_COEFFICIENT_S:g}] (the limit MAX_COEFFICIENT_S)")
    if obj["fixed_s"] * NS_PER_S < 1:
        raise bad("fixed_s", f"{obj['fixed_s']!r} is below 1 ns: every step must take time")
    for key in ("name", "source"):
        if key in obj and not isinstance(obj[key], str):
            raise bad(key, f"expected a string, got {obj[key]!r}")
    name = obj.get("name", "custom")
    if not name or len(name) > 256 or any(ord(c) < 32 or 0x7f <= ord(c) <= 0x9f for c in name):
        raise bad("name", f"{name!r}: 1 to 256 characters, no control characters")
    knobs = obj.get("knobs", {})
    if not isinstance(knobs, dict):
        raise bad("knobs", f"expected an object of scheduler knobs, got {type(knobs).__name__}")
    try:
        for key, value in knobs.items():
            resolve({key: value}) if key != "profile" else None  # known knob, right type
            check_knob(key, value, "knobs")
        if "profile" in knobs:
            raise ConfigError("profile", "a cost model describes a deployment, not a profile")
    except ConfigError as e:
        raise bad(f"knobs.{e.field}", e.problem) from None
    except OptionError as e:
        raise bad(f"knobs.{e.option.split()[-1]}", e.problem) from None
    return CostModel.from_json(obj)


# --------------------------------------------------------------------------
# Presets, derived from public spec-sheet numbers by a stated roofline.
# --------------------------------------------------------------------------

#: Assumptions shared by the derived presets (not measurements; calibrate to replace them).
MEMORY_EFFICIENCY = 0.8  # fraction of peak HBM bandwidth a weight / KV stream achieves
PREFILL_MFU = 0.5  # fraction of peak dense matmul FLOP/s a prefill achieves
STEP_OVERHEAD_S = 300e-6  # CPU scheduling, sampling and kernel launches per step
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of device memory it may use
ACTIVATION_RESERVE_BYTES = 2e9  # activations and workspace kept out of the KV pool


def roofline(
    name: str,
    *,
    params: float,
    bytes_per_param: float,
    kv_bytes_per_token: float,
    hbm_bytes_per_s: float,
    peak_flops: float,
    device_bytes: float,
    max_model_len: int,
    block_size: int = 16,
    source: str,
) -> CostModel:
    """A preset from a model's size and a device's spec sheet.

    * ``fixed_s``: stream the weights once at ``MEMORY_EFFICIENCY`` of peak
      bandwidth, plus ``STEP_OVERHEAD_S``;
    * ``per_prefill_token_s``: ``2 * params`` FLOPs at ``PREFILL_MFU`` of peak;
    * ``per_decode_seq_s``: ``2 * params`` FLOPs at peak (the weight stream
      hides the rest of a decode row's cost);
    * ``per_kv_token_s``: one token's K and V, all layers, at ``MEMORY_EFFICIENCY``;
    * ``num_blocks``: what ``GPU_MEMORY_UTILIZATION`` of the device holds after
      the weights and ``ACTIVATION_RESERVE_BYTES``, in blocks of ``block_size``
      tokens (the null block included, as vLLM counts it).
    """
    weights = params * bytes_per_param
    kv_pool = GPU_MEMORY_UTILIZATION * device_bytes - weights - ACTIVATION_RESERVE_BYTES
    return CostModel(
        name=name,
        fixed_s=weights / (hbm_bytes_per_s * MEMORY_EFFICIENCY) + STEP_OVERHEAD_S,
        per_prefill_token_s=2 * params / (peak_flops * PREFILL_MFU),
        per_decode_seq_s=2 * params / peak_flops,
        per_kv_token_s=kv_bytes_per_token / (hbm_bytes_per_s * MEMORY_EFFICIENCY),
        knobs={"num_blocks": int(kv_pool // (kv_bytes_per_token * block_size)), "max_model_len": max_model_len},
        source=source,
    )


def _kv_bytes(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of one token over all layers."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


PRESETS: dict[str, CostModel] = {
    "unit": CostModel(
        name="unit",
        fixed_s=1.0,
        source="every step takes exactly 1 s whatever it runs: simulated seconds count steps (for tests and examples)",
    ),
    "h200-llama-8b-bf16": roofline(
        "h200-llama-8b-bf16",
        params=8.03e9,
        bytes_per_param=2,
        kv_bytes_per_token=_kv_bytes(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2),
        hbm_bytes_per_s=4.8e12,
        peak_flops=989e12,
        device_bytes=141e9,
        max_model_len=8192,
        source=(
            "roofline from public numbers: NVIDIA H200 SXM spec sheet (141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s dense BF16); "
            "Llama 3 8B model card and config (8.03e9 parameters, 32 layers, 8 KV heads of dim 128, 8192 context); "
            "efficiencies are assumptions (spec/costmodel.py: MEMORY_EFFICIENCY, PREFILL_MFU, STEP_OVERHEAD_S)"
        ),
    ),
    "a100-40gb-llama2-7b-fp16": roofline(
        "a100-40gb-llama2-7b-fp16",
        params=6.74e9,
        bytes_per_param=2,
        kv_bytes_per_token=_kv_bytes(layers=32, kv_heads=32, head_dim=128, dtype_bytes=2),
        hbm_bytes_per_s=1.555e12,
        peak_flops=312e12,
        device_bytes=40e9,
        max_model_len=4096,
        source=(
            "roofline from public numbers: NVIDIA A100 40GB spec sheet (1,555 GB/s HBM2, 312 TFLOP/s dense FP16); "
            "Llama 2 7B config (6.74e9 parameters, 32 layers, 32 KV heads of dim 128, 4096 context); "
            "efficiencies are assumptions (spec/costmodel.py); the vLLM paper's setting, with scarce KV memory"
        ),
    ),
}


def preset(name: str) -> CostModel:
    """A named preset; raise ``KeyError`` with the known names."""
    if name not in PRESETS:
        raise KeyError(f"unknown cost model {name!r} (known: {', '.join(PRESETS)})")
    return PRESETS[name]
