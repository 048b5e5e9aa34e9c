"""Hypothesis strategies for traces, importable by users writing their own properties.

``traces()`` draws a whole trace — configuration and requests — covering the
vllm-v1 knobs: tiny block sizes and pools (memory pressure, preemption), tight
budgets (chunked prefill), both queue policies, prefix groups (cache hits),
aborts, EOS / stop tokens, and requests that must be rejected.  Shrinking works
toward fewer requests, shorter prompts and simpler configurations.

    from hypothesis import given
    from fuzz.strategies import traces      # or invariants.strategies

    @given(traces())
    def test_my_engine_agrees(trace): ...
"""
from hypothesis import strategies as st

from spec.config import PROFILES
from spec.formats import Trace, TraceRequest

#: Knobs that make a profile what it is: kept from the profile when a drawn
#: configuration is applied to it (:func:`for_profile`).
PROFILE_KNOBS = ("batching", "kv_reservation", "policy", "aging_steps", "admission", "preemption_mode",
                 "num_cpu_blocks", "tenant_weights")


def for_profile(config: dict, profile: str) -> dict:
    """A drawn configuration applied to ``profile``: the profile's defining knobs win
    (except for vllm-v1, whose drawn knobs exercise every mode), and chunked prefill is
    turned off when either side has it off."""
    config = {**config, "profile": profile}
    base = PROFILES[profile].config
    if profile != "vllm-v1":
        for knob in PROFILE_KNOBS:
            config[knob] = getattr(base, knob)
    if not config.get("enable_chunked_prefill", True) or not base.enable_chunked_prefill:
        config["enable_chunked_prefill"] = False
        config["max_num_batched_tokens"] = max(config.get("max_num_batched_tokens", 1), config.get("max_model_len", 1))
    return config


@st.composite
def configs(draw):
    max_model_len = draw(st.integers(8, 96))
    chunked = draw(st.booleans())
    budget = draw(st.integers(1, 64))
    if not chunked:
        budget = max(budget, max_model_len)
    # the issue-8 modes: swap, SGLang's estimate admission, spf, VTC, priority aging
    policy = draw(st.sampled_from(["fcfs", "priority"]))
    extra = draw(st.sampled_from(["none", "none", "swap", "estimate", "spf", "vtc", "aging"]))
    modes: dict = {}
    if extra == "swap":
        modes = {"preemption_mode": "swap", "num_cpu_blocks": draw(st.integers(0, 12))}
    elif extra == "estimate":
        modes = {"admission": "estimate", "new_token_ratio_decay_steps": draw(st.sampled_from([600, 4])),
                 "retract_decode_steps": draw(st.sampled_from([20, 1]))}
    elif extra == "spf":
        modes = {"aging_steps": draw(st.sampled_from([0, 1, 3]))}
        policy = "spf"
    elif extra == "vtc":
        modes = {"tenant_weights": draw(st.sampled_from(["", "a=2", "a=1,b=3"]))}
        policy = "vtc"
    elif extra == "aging":
        modes = {"aging_steps": draw(st.sampled_from([1, 4]))}
        policy = "priority"
    return {
        "profile": "vllm-v1",
        "block_size": draw(st.sampled_from([1, 2, 4, 8])),
        "num_blocks": draw(st.integers(3, 32)),
        "max_num_batched_tokens": budget,
        "max_num_seqs": draw(st.integers(1, 6)),
        "max_model_len": max_model_len,
        "enable_chunked_prefill": chunked,
        "long_prefill_token_threshold": draw(st.sampled_from([0, 0, 3, 8])),
        "policy": policy,
        "enable_prefix_caching": draw(st.booleans()),
        "scheduler_reserve_full_isl": draw(st.booleans()),
        "watermark": draw(st.sampled_from([0.0, 0.0, 0.1, 0.3])),
        "priority_self_preempt": draw(st.sampled_from(["stop", "continue"])),
        "max_steps": 5000,
        **modes,
    }


@st.composite
def traces(draw):
    config = draw(configs())
    n = draw(st.integers(1, 8))
    arrivals = sorted(draw(st.lists(st.integers(0, 12), min_size=n, max_size=n)))
    requests = []
    for i, at in enumerate(arrivals):
        prompt_len = draw(st.integers(1, 60))
        group = draw(st.sampled_from([None, "g1", "g2"]))
        outputs = draw(st.lists(st.sampled_from([2, 5, 6, 7]), max_size=4))
        requests.append(
            TraceRequest(
                id=f"r{i}",
                prompt_len=prompt_len,
                max_tokens=draw(st.integers(1, 20)),
                arrival_step=at,
                prefix_group=group,
                prefix_len=draw(st.integers(0, prompt_len)) if group else 0,
                priority=draw(st.integers(0, 3)),
                tenant=draw(st.sampled_from(["a", "b", "default"])),
                ignore_eos=draw(st.booleans()),
                stop_token_ids=(6,) if draw(st.booleans()) else (),
                abort_at=at + draw(st.integers(0, 15)) if draw(st.integers(0, 4)) == 0 else None,
                output_tokens=tuple(outputs),
            )
        )
    return Trace(config=config, requests=requests, vocab_size=64, eos_token_id=2)
