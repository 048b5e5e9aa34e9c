"""Capability declarations (fuzz/capabilities.py): engines say which knob values they implement, and campaigns,
conform and the strategies draw only inside that envelope — and cover it."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from fuzz import capabilities as caps
from fuzz.campaign import CampaignConfig, campaign_envelope, run_campaign, trace_options
from fuzz.generate import profile_knobs, random_trace
from spec.config import PROFILES, resolve

REPO = Path(__file__).resolve().parent.parent

TOY_LIKE = {"profile": "naive", "knobs": {"policy": ["fcfs", "priority"], "enable_chunked_prefill": [True, False],
                                          "long_prefill_token_threshold": {"min": 0, "max": 16},
                                          "scheduler_reserve_full_isl": "any"}}


def drawn_configs(envelope, n: int, profile=None, knobs=None, seed: int = 0):
    cfg = CampaignConfig(seed=seed, engine="spec", profile=profile, knobs=knobs or {})
    for k in range(n):
        trace = random_trace(1000 + k, **{"max_steps": 3000, **trace_options(cfg, k, [], envelope)})
        yield resolve(trace.config)


# -- reading declarations --------------------------------------------------------------


def test_a_declaration_reads_lists_ranges_and_any():
    env = caps.parse(TOY_LIKE)
    assert env.profile == "naive" and not env.everything
    assert env.knobs["policy"] == ("fcfs", "priority")
    assert env.knobs["long_prefill_token_threshold"] == caps.Range(0, 16)
    assert env.knobs["scheduler_reserve_full_isl"] == (False, True)  # "any" of a boolean is both values
    assert env.allows("policy", "priority") and not env.allows("policy", "vtc")
    assert env.allows("long_prefill_token_threshold", 16) and not env.allows("long_prefill_token_threshold", 17)
    assert not env.allows("enable_prefix_caching", True), "an undeclared semantic knob keeps the profile's value"
    assert not env.allows("max_num_seqs", 2), "naive fixes max_num_seqs = 1"
    assert env.allows("block_size", 3) and env.allows("num_blocks", 9), "sizes the profile leaves alone are free"


@pytest.mark.parametrize("bad,needle", [
    ({"profile": "nope"}, "profile: unknown profile 'nope'"),
    ({"knobs": {"polcy": ["fcfs"]}}, "knobs.polcy: unknown knob"),
    ({"knobs": {"policy": ["lifo"]}}, "knobs.policy: 'lifo' is not a value of policy"),
    ({"knobs": {"block_size": [4.5]}}, "knobs.block_size: 4.5 is not a int"),
    ({"knobs": {"watermark": {"min": 0.5, "max": 0.1}}}, "knobs.watermark: min 0.5 > max 0.1"),
    ({"knobs": {"policy": {"min": 1}}}, "knobs.policy: a range is"),
    ({"knobs": {"policy": []}}, "knobs.policy: expected a non-empty list"),
    ({"profile": "naive", "colour": 1}, "colour: unknown field"),
    ({"format": "other"}, "format: expected 'batchspec-capabilities'"),
])
def test_a_bad_declaration_is_refused_naming_the_field(bad, needle):
    with pytest.raises(caps.CapabilityError, match="^x: " + needle.replace("(", r"\(").replace(".", r"\.")):
        caps.parse(bad, "x")


def test_a_capability_file_round_trips_and_bad_files_name_the_file(tmp_path):
    env = caps.parse(TOY_LIKE)
    path = tmp_path / "toy.capabilities.json"
    path.write_text(json.dumps(env.to_json()))
    again = caps.load(path)
    assert again.knobs == env.knobs and again.profile == env.profile
    broken = tmp_path / "broken.json"
    broken.write_text('{"profile": "naive",\n "knobs": ')
    with pytest.raises(caps.CapabilityError, match=rf"^{broken}:2: .*JSON"):
        caps.load(broken)
    with pytest.raises(caps.CapabilityError, match=rf"^{tmp_path / 'missing.json'}"):
        caps.load(tmp_path / "missing.json")
    bad_field = tmp_path / "bad.json"
    bad_field.write_text('{"profile": "naive", "knobs": {"policy": ["lifo"]}}')
    with pytest.raises(caps.CapabilityError, match=rf"^{bad_field}: knobs\.policy: 'lifo' is not a value"):
        caps.load(bad_field)


# -- the built-in engines' declarations -------------------------------------------------


def test_gpu_declaration_is_derived_from_gpu_engines_allow_list():
    from gpu_engine.engine import SUPPORTED
    from spec.config import KNOB_CHOICES, SchedulerConfig, knob_names

    env = caps.for_engine("gpu")
    assert env.source == "gpu_engine.engine.SUPPORTED"
    for knob in knob_names():
        if knob not in SUPPORTED:  # gpu_engine refuses any other value: so does the envelope
            assert not env.allows(knob, "not-the-default") and env.allows(knob, getattr(SchedulerConfig(), knob))
        elif SUPPORTED[knob] is not None:  # (an envelope of every value is the whole map: no per-knob list)
            allowed = set(KNOB_CHOICES.get(knob, SUPPORTED[knob])) if env.everything else set(env.knobs[knob])
            assert allowed == set(SUPPORTED[knob]), knob
    whole = {k: (frozenset(KNOB_CHOICES[k]) if k in KNOB_CHOICES else None) for k in knob_names()}
    assert caps._from_allow_list(whole, "t").everything, "an allow-list of every value is the whole map"
    narrower = {**whole, "policy": frozenset({"fcfs", "priority"})}
    narrower.pop("aging_steps")
    env = caps._from_allow_list(narrower, "test")
    assert not env.everything and env.knobs["policy"] == ("fcfs", "priority")
    assert not env.allows("aging_steps", 4) and env.allows("aging_steps", 0), "a knob off the list keeps its default"


def test_a_campaign_against_gpu_stays_inside_what_gpu_engine_implements():
    env = caps.for_engine("gpu")
    for cfg in drawn_configs(env, 64, profile="all"):
        assert env.admits(cfg), env.violations(cfg)
        from gpu_engine.engine import check_supported

        check_supported(cfg)  # gpu_engine's own refusal: never raised inside the envelope


def test_vllm_declares_the_knobs_its_adapter_maps():
    env = caps.for_engine("vllm")
    assert env.profile == "vllm-v1" and env.knobs["policy"] == ("fcfs", "priority")
    assert env.admits({"profile": "vllm-v1", "watermark": 0.1, "enable_prefix_caching": False})
    assert env.violations({"profile": "tgi"}), "vLLM V1 has no prefill-first batching"
    assert "vllm-v1" in env.profiles() and "tgi" not in env.profiles() and "sglang" not in env.profiles()


def test_spec_and_reference_implement_everything_and_an_undeclared_engine_gets_the_vllm_v1_family():
    assert caps.for_engine("spec").everything and caps.for_engine("reference").everything
    from fuzz.replay import register_engine

    register_engine("undeclared-test", lambda trace: None)
    assert caps.for_engine("undeclared-test") is caps.UNDECLARED


def test_a_module_factory_engine_declares_in_code():
    env = caps.for_engine("examples.toy_engine:ToyEngine")
    assert env.profile == "naive" and set(env.knobs) == {"policy", "enable_chunked_prefill",
                                                         "long_prefill_token_threshold", "scheduler_reserve_full_isl"}


def test_a_capabilities_attribute_may_be_a_callable_or_a_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"format": "batchspec-capabilities", "version": 1, "profile": "tgi"}))

    class FromFile:
        capabilities = str(path)

    class FromCall:
        @staticmethod
        def capabilities():
            return {"profile": "orca"}

    assert caps.declared(FromFile, "f").profile == "tgi"
    assert caps.declared(FromCall, "c").profile == "orca"


# -- campaigns draw inside the envelope and cover it -------------------------------------


def test_a_campaigns_knob_values_are_inside_the_envelope_and_cover_it():
    env = caps.parse(TOY_LIKE)
    seen = defaultdict(set)
    for cfg in drawn_configs(env, 48):
        assert env.admits(cfg), env.violations(cfg)
        for knob in env.knobs:
            seen[knob].add(getattr(cfg, knob))
        assert cfg.profile == "naive" and cfg.max_num_seqs == 1 and not cfg.enable_prefix_caching
    for knob in env.knobs:
        assert seen[knob] >= set(env.samples(knob)), (knob, seen[knob], env.samples(knob))
    assert {0, 16} <= seen["long_prefill_token_threshold"], "both ends of a range are drawn"
    assert seen["policy"] == {"fcfs", "priority"} and seen["enable_chunked_prefill"] == {True, False}


def test_n_consecutive_traces_take_all_n_values_of_a_knob():
    env = caps.parse({"profile": "vllm-v1", "knobs": {"policy": ["fcfs", "priority", "spf", "vtc"],
                                                      "batching": ["continuous", "prefill-first", "static"]}})
    cfg = CampaignConfig(engine="spec")
    for start in (0, 4, 8, 12):
        block = [trace_options(cfg, k, [], env)["policy"] for k in range(start, start + 4)]
        assert sorted(block) == ["fcfs", "priority", "spf", "vtc"]


def test_combinations_the_spec_refuses_are_not_drawn():
    env = caps.parse({"profile": "vllm-v1", "knobs": {"policy": ["fcfs", "priority"], "aging_steps": [0, 4],
                                                      "admission": ["budget", "estimate"], "kv_reservation": ["step", "full"]}})
    for cfg in drawn_configs(env, 40):  # resolve() inside drawn_configs would raise on a refused combination
        assert env.admits(cfg)


def test_profile_fixes_the_profiles_knobs_and_set_fixes_one_knob():
    """What docs/engine-guide.md says: --profile P holds every semantic knob at P's value (sizes drawn);
    --set knob=value fixes that knob in every trace; without either, the declared knobs vary."""
    env = caps.parse(TOY_LIKE)
    fixed = profile_knobs("naive")
    for cfg in drawn_configs(env, 24, profile="naive"):
        assert all(getattr(cfg, k) == v for k, v in fixed.items() if k != "max_steps")
    for cfg in drawn_configs(env, 24, profile="naive", knobs={"policy": "priority"}):
        assert cfg.policy == "priority" and cfg.long_prefill_token_threshold == 0
    sizes = {(c.block_size, c.max_num_batched_tokens) for c in drawn_configs(env, 24, profile="naive")}
    assert len(sizes) > 3, "sizes stay drawn under --profile"


def test_profile_all_draws_only_the_profiles_inside_the_envelope():
    env = caps.for_engine("vllm")
    profiles = {c.profile for c in drawn_configs(env, 64, profile="all")}
    assert profiles <= set(env.profiles()) and "vllm-v1" in profiles
    everything = {c.profile for c in drawn_configs(caps.EVERYTHING, 64, profile="all")}
    assert everything == set(PROFILES), "an engine that implements everything still gets the whole map"


def test_the_envelope_is_checked_against_profile_and_set_before_a_campaign():
    with pytest.raises(caps.CapabilityError, match="--profile tgi is outside engine examples.toy_engine:ToyEngine"):
        campaign_envelope(CampaignConfig(engine="examples.toy_engine:ToyEngine", profile="tgi"))
    with pytest.raises(caps.CapabilityError, match=r"--set asks .* enable_prefix_caching=True \(implements false only\)"):
        campaign_envelope(CampaignConfig(engine="examples.toy_engine:ToyEngine", knobs={"enable_prefix_caching": True}))
    assert campaign_envelope(CampaignConfig(engine="examples.toy_engine:ToyEngine", profile="naive",
                                            knobs={"policy": "priority"})).profile == "naive"


class _Strict:
    """The spec, as an engine that refuses (raises in its constructor) any trace outside TOY_LIKE."""

    capabilities = TOY_LIKE

    def __new__(cls, trace):
        from spec.scheduler import SpecEngine

        bad = caps.parse(TOY_LIKE).violations(trace.config)
        if bad:
            raise ValueError(f"outside the declared envelope: {bad}")
        return SpecEngine.from_trace(trace, check_invariants=False)


def test_a_campaign_never_runs_a_trace_outside_the_envelope(tmp_path):
    from fuzz.replay import register_engine

    register_engine("strict-test", _Strict)
    state = run_campaign(CampaignConfig(engine="strict-test", traces=32, workers=1, corpus=str(tmp_path), shrink_tries=20))
    assert state.traces == 32 and not state.findings and not state.errors, (state.findings, state.first_error)
    assert state.envelope == caps.parse(TOY_LIKE).describe()


def test_capabilities_file_overrides_the_declaration(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"profile": "vllm-v1", "knobs": {"policy": ["priority"]}}))
    state = run_campaign(CampaignConfig(engine="spec", traces=16, workers=1, corpus=str(tmp_path / "f"),
                                        capabilities=str(path)))
    assert state.envelope == "profile vllm-v1; policy priority" and not state.findings


def test_fuzz_cli_refuses_a_profile_outside_the_envelope_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "batchspec.cli", "fuzz", "--engine", "examples.toy_engine:ToyEngine",
                           "--profile", "tgi", "--traces", "4", "--corpus", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--profile tgi is outside engine" in done.stderr and "profiles inside: naive" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


# -- conform ------------------------------------------------------------------------------


def test_conform_draws_inside_the_envelope_and_keeps_vllms_seeds():
    from fuzz.conform import trace_for

    toy = caps.for_engine("examples.toy_engine:ToyEngine")
    for seed in range(40):
        assert toy.admits(trace_for(seed, toy).config)
        vllm = caps.for_engine("vllm")
        plain = random_trace(seed)
        if vllm.admits(plain.config):  # the vllm-v1 family: docs/conformance.md's seeds make the same traces
            assert trace_for(seed, vllm).config == plain.config


def test_conform_runs_a_declaring_engine_inside_its_envelope(tmp_path):
    done = subprocess.run([sys.executable, "-m", "batchspec.cli", "conform", "--engine", "examples.toy_engine:ToyEngine",
                           "--traces", "12", "--no-progress", "--json", str(tmp_path / "r.json")],
                          cwd=REPO, capture_output=True, text=True, env={**__import__("os").environ, "TOY_BUG": ""})
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["agreed"] == 12 and report["envelope"].startswith("profile naive; policy fcfs|priority")


def test_a_share_of_the_default_campaign_drafts_speculatively_inside_what_the_engine_allows():
    """Speculative decoding (vLLM as deployed) is drawn for about SPEC_DECODE_SHARE of the traces of
    a campaign against an engine that implements it, some of them async, each a configuration the
    spec accepts; never against an envelope without it, nor when --set or a profile fixes K."""
    n = 400
    gpu = list(drawn_configs(caps.for_engine("gpu"), n))
    drafting = [c for c in gpu if c.num_speculative_tokens]
    assert 0.5 * caps.SPEC_DECODE_SHARE * n < len(drafting) < 2 * caps.SPEC_DECODE_SHARE * n
    assert {c.num_speculative_tokens for c in drafting} == {1, 2, 3, 4}
    assert any(c.async_scheduling for c in drafting) and any(not c.async_scheduling for c in drafting)
    assert all(c.policy in ("fcfs", "priority") for c in drafting)
    assert list(drawn_configs(caps.for_engine("gpu"), 40)) == gpu[:40], "the same seed draws the same traces"
    assert not any(c.num_speculative_tokens for c in drawn_configs(caps.for_engine("gpu-model"), 200))
    assert not any(c.num_speculative_tokens for c in drawn_configs(caps.for_engine("gpu"), 200,
                                                                   knobs={"num_speculative_tokens": 0}))
    assert not any(c.num_speculative_tokens for c in drawn_configs(caps.for_engine("gpu"), 200, profile="sglang"))
