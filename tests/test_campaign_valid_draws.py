"""A campaign draws only configurations the spec's own config validation accepts (async with
its needs, no SLO policy or swap with async), inside the engine's envelope, so that
``batchspec fuzz`` never counts a "failed inside the harness" trace for a drawn combination."""
import pytest

from fuzz.campaign import CampaignConfig, campaign_envelope, run_campaign, trace_options, trace_seed
from fuzz.capabilities import refusal, repair
from fuzz.generate import random_trace
from spec.config import ASYNC_NEEDS, ConfigError, resolve
from spec.rules import all_rules

RULES = sorted(r.id for r in all_rules().values() if r.fires)


def _draws(cfg: CampaignConfig, n: int):
    envelope = campaign_envelope(cfg)
    for k in range(n):
        uncovered = RULES if k < n // 2 else RULES[::3]  # steering towards every family, then fewer
        yield k, envelope, trace_options(cfg, k, uncovered, envelope)


@pytest.mark.parametrize("engine,profile,knobs", [
    ("gpu", "all", {}), ("gpu", None, {}), ("gpu", "nano-vllm", {}), ("gpu", "all", {"async_scheduling": True}),
    ("spec", "all", {}), ("spec", "all", {"async_scheduling": True}),
])
def test_every_drawn_campaign_configuration_is_valid_and_inside_the_envelope(engine, profile, knobs):
    seen_async = 0
    for seed in (0, 1):
        cfg = CampaignConfig(seed=seed, engine=engine, profile=profile, knobs=dict(knobs))
        for k, envelope, options in _draws(cfg, 400):
            trace = random_trace(trace_seed(seed, k), **{"max_steps": 500, **options})
            try:
                config = resolve(trace.config)
            except ConfigError as e:
                pytest.fail(f"{engine} --profile {profile} seed {seed} trace {k}: {e} (options {options})")
            assert envelope.violations(config) == [], (k, options)
            for name, value in knobs.items():
                assert getattr(config, name) == value
            if config.async_scheduling:
                seen_async += 1
                assert all(getattr(config, n) == v for n, v in ASYNC_NEEDS.items())
                assert config.policy not in ("edf", "sprpt") and config.preemption_victim != "slo-slack"
    if engine == "gpu" and (profile == "all" or (profile is None and not envelope.everything)):
        # async is still drawn, with its needs pinned (by the rotation of profiles, or of the
        # envelope's knobs; an envelope of the whole map leaves the rest to the generator)
        assert seen_async > 0


def test_the_draws_do_not_depend_on_anything_but_the_seed_and_the_trace():
    cfg = CampaignConfig(seed=3, engine="gpu", profile="all")
    first = [o for _, _, o in _draws(cfg, 200)]
    again = [o for _, _, o in _draws(CampaignConfig(seed=3, engine="gpu", profile="all", workers=4), 200)]
    assert first == again


def test_repair_redraws_the_conflicting_knob_and_keeps_the_fixed_ones():
    options = {"async_scheduling": True, "preemption_mode": "swap", "policy": "sprpt", "kv_reservation": "full"}
    assert refusal(options) is not None
    fixed = repair(options, fixed={"async_scheduling"}, key="0:1")
    assert refusal(fixed) is None and fixed["async_scheduling"] is True
    assert fixed["preemption_mode"] == "recompute" and fixed["kv_reservation"] == "step" and fixed["policy"] != "sprpt"
    # async not fixed, the SLO policy fixed: async goes
    out = repair({"async_scheduling": True, "policy": "sprpt"}, fixed={"policy"}, key="0:2")
    assert out == {"async_scheduling": False, "policy": "sprpt"}


@pytest.mark.parametrize("seed", range(5))
def test_a_gpu_campaign_has_no_harness_failures(tmp_path, seed):
    state = run_campaign(CampaignConfig(seed=seed, engine="gpu", profile="all", traces=320, workers=1, corpus=str(tmp_path)))
    assert state.traces == 320 and state.outside_envelope == 0
    assert state.errors == 0, state.first_error


def test_a_profile_fixes_its_semantics_but_draws_pressured_sizes():
    from fuzz.generate import profile_knobs

    nano = profile_knobs("nano-vllm")
    assert nano["batching"] == "prefill-first" and nano["cache_register"] == "computed"
    for size in ("block_size", "max_num_batched_tokens", "max_num_seqs"):  # 256, 16,384, 512: drawn
        assert size not in nano
    assert profile_knobs("naive")["max_num_seqs"] == 1 and profile_knobs("sglang")["block_size"] == 1


def test_a_nano_vllm_campaign_reaches_the_limits(tmp_path):
    state = run_campaign(CampaignConfig(seed=0, engine="gpu", profile="nano-vllm", traces=300, workers=1,
                                        corpus=str(tmp_path)))
    assert state.errors == 0, state.first_error
    covered = set(state.covered)
    assert "RUN.CONTINUE_PREFILL_FIRST" in covered
    assert any(r.startswith("PREEMPT.") for r in covered)
    assert "CACHE.HIT" in covered


def test_request_features_are_drawn_in_a_share_of_the_traces_of_an_engine_that_declares_them():
    from fuzz.capabilities import REQUEST_FEATURE_SHARE, for_engine

    assert for_engine("gpu").request_features and for_engine("spec").request_features
    cfg = CampaignConfig(seed=0, engine="gpu", profile="all")
    with_features = active = 0
    fields = set()
    for k, _, options in _draws(cfg, 400):
        trace = random_trace(trace_seed(0, k), **{"max_steps": 500, **options})
        config = resolve(trace.config)
        active += 0 < config.max_num_active_seqs
        if options.get("request_features"):
            with_features += 1
            fields |= {f for r in trace.requests for f in ("skip_prefix_cache", "cache_salt", "min_tokens",
                                                           "client_arrival_time")
                       if getattr(r, f) not in (None, False, 0)}
        else:
            assert not any(r.cache_salt or r.skip_prefix_cache or r.min_tokens for r in trace.requests)
    assert 0.5 * REQUEST_FEATURE_SHARE * 400 < with_features < 1.5 * REQUEST_FEATURE_SHARE * 400
    assert fields == {"skip_prefix_cache", "cache_salt", "min_tokens", "client_arrival_time"}
    assert active > 0  # max_num_active_seqs is drawn (the envelope's rotation and the features' own draw)


def test_an_engine_that_does_not_declare_request_features_never_gets_them():
    from fuzz.capabilities import for_engine

    envelope = for_engine("examples.toy_engine:ToyEngine")
    assert not envelope.request_features
    cfg = CampaignConfig(seed=0, engine="examples.toy_engine:ToyEngine")
    assert not any(o.get("request_features") for _, _, o in _draws(cfg, 200))


def test_rule_coverage_counts_only_the_rules_the_envelope_can_fire(tmp_path):
    from fuzz.capabilities import for_engine, reachable_rules

    gpu = set(reachable_rules(for_engine("gpu"), RULES, "all"))
    assert {"QUEUE.SPRPT", "VTC.PICK", "SWAP.OUT", "ASYNC.PLACEHOLDER", "CACHE.HIT"} <= gpu
    assert {"QUEUE.EDF", "EDF.AT_RISK_FIRST", "SLO.DEFER", "PREEMPT.VICTIM_SLO_SLACK"} <= gpu  # edf (issue 19)
    assert set(reachable_rules(for_engine("spec"), RULES, "all")) == set(RULES)
    toy = set(reachable_rules(for_engine("examples.toy_engine:ToyEngine"), RULES))
    assert not any(r.startswith(("CACHE.", "SWAP.", "ASYNC.", "VTC.", "QUEUE.EDF")) for r in toy - {"CACHE.BLOCK_HASH"})  # FCFS/priority, no cache
    assert {"ADMIT.NEW", "QUEUE.FCFS", "RUN.DECODE"} <= toy
    # what a campaign fires lies inside what was counted as reachable
    for engine, profile, reachable in (("gpu", "all", gpu), ("examples.toy_engine:ToyEngine", None, toy)):
        state = run_campaign(CampaignConfig(seed=1, engine=engine, profile=profile, traces=200, workers=1,
                                            corpus=str(tmp_path / engine.replace(":", "_"))))
        assert state.errors == 0, state.first_error
        assert set(state.covered) <= reachable, sorted(set(state.covered) - reachable)
    nano = set(reachable_rules(for_engine("gpu"), RULES, "nano-vllm"))
    assert "RUN.CONTINUE_PREFILL_FIRST" in nano and "QUEUE.SPF" not in nano and "BATCH.STATIC" not in nano


def test_the_fuzz_summary_states_coverage_over_the_reachable_rules(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "batchspec.cli", "fuzz", "--engine", "gpu", "--traces", "24", "--workers", "1",
                          "--corpus", str(tmp_path / "c")], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    from fuzz.capabilities import for_engine, reachable_rules

    n = len(reachable_rules(for_engine("gpu"), RULES, "all"))
    assert f"the {n} of {len(RULES)} its envelope can fire" in text
    assert "QUEUE.EDF" not in text and "harness" not in out.stderr
