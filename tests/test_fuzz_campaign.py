"""Fuzz campaigns: determinism, sharding, resume, and hangs and crashes as findings."""
import json
import os
import time

from fuzz.campaign import CampaignConfig, CampaignState, Pool, Task, run_campaign, state_path
from fuzz.corpus import corpus_traces
from fuzz.replay import register_engine
from spec.scheduler import SpecEngine


class Sleepy(SpecEngine):
    """An engine that hangs on its 5th step."""

    name = "sleepy"

    def step(self):
        self.n = getattr(self, "n", 0) + 1
        if self.n == 5:
            time.sleep(3600)
        return super().step()


class Dies(SpecEngine):
    """An engine whose process dies on its 3rd step (a segfault, say)."""

    name = "dies"

    def step(self):
        self.n = getattr(self, "n", 0) + 1
        if self.n == 3:
            os._exit(1)
        return super().step()


class WrongVictim(SpecEngine):
    """Planted bug (LMD-01): under FCFS the victim is the oldest running request."""

    name = "wrong-victim"

    def _schedule_running(self, out, scheduled, budget, cap):
        import spec.scheduler as s

        real = s.fcfs_victim
        s.fcfs_victim = lambda running: running[0]
        try:
            return super()._schedule_running(out, scheduled, budget, cap)
        finally:
            s.fcfs_victim = real


register_engine("sleepy", lambda t: Sleepy.from_trace(t))
register_engine("dies", lambda t: Dies.from_trace(t))
register_engine("wrong-victim", lambda t: WrongVictim.from_trace(t))


def summary(state: CampaignState):
    return state.traces, state.steps, state.covered, {k: (v["count"], v["requests"]) for k, v in state.findings.items()}


def test_same_seed_same_campaign_whatever_the_worker_count(tmp_path):
    a = run_campaign(CampaignConfig(seed=7, engine="spec", traces=24, workers=1, corpus=str(tmp_path / "a")))
    b = run_campaign(CampaignConfig(seed=7, engine="spec", traces=24, workers=2, corpus=str(tmp_path / "b")))
    assert summary(a) == summary(b) and a.traces == 24 and not a.findings


def test_planted_bug_is_found_shrunk_and_saved(tmp_path):
    state = run_campaign(CampaignConfig(seed=3, engine="wrong-victim", traces=48, workers=2, corpus=str(tmp_path),
                                        shrink_tries=150))
    assert state.findings, "the wrong victim rule was not caught"
    name, finding = next(iter(state.findings.items()))
    assert finding["requests"] is not None and finding["requests"] <= 6
    traces = corpus_traces(tmp_path)
    assert [p.stem for p in traces] == list(state.findings)
    assert (tmp_path / f"{name}.md").exists() and (tmp_path / "wrong-victim" / f"{name}.log.jsonl").exists()


def test_shards_split_one_campaign(tmp_path):
    seen = []
    for i in range(2):
        run_campaign(CampaignConfig(seed=1, engine="spec", traces=16, workers=1, shard=(i, 2), corpus=str(tmp_path)),
                     on_round=lambda st, outs: seen.extend(o.index for o in outs))
    assert sorted(seen) == list(range(32))


def test_resume_continues_where_the_campaign_stopped(tmp_path):
    cfg = CampaignConfig(seed=5, engine="spec", traces=16, workers=1, corpus=str(tmp_path))
    run_campaign(cfg)
    saved = json.loads(state_path(cfg).read_text())
    assert saved["traces"] == 16 and saved["next_round"] == 1
    more = run_campaign(CampaignConfig(seed=5, engine="spec", traces=32, workers=1, corpus=str(tmp_path), resume=True))
    whole = run_campaign(CampaignConfig(seed=5, engine="spec", traces=32, workers=1, corpus=str(tmp_path / "whole")))
    assert summary(more) == summary(whole)


def test_hang_and_crash_are_findings_and_the_campaign_goes_on():
    pool = Pool(1)
    try:
        outs = pool.run([Task(0, 11, {}, "sleepy", "exact", 0), Task(1, 12, {}, "dies", "exact", 0),
                         Task(2, 13, {}, "spec", "exact", 0)], timeout=10)
    finally:
        pool.close()
    kinds = [o.signature[0] if o.signature else None for o in outs]
    assert kinds == ["hang", "crash", None]
    assert outs[2].steps > 0  # the replacement worker carried on


def test_every_steering_option_yields_a_valid_trace():
    from fuzz.campaign import STEERING
    from fuzz.generate import random_trace
    from spec.config import resolve

    for options in STEERING.values():
        for seed in range(20):
            resolve(random_trace(seed, **options).config)  # raises ConfigError on a bad combination


def test_a_rule_with_known_knobs_is_steered_towards_its_knob_values_and_the_trace_is_valid():
    from fuzz.campaign import rule_targets, steer
    from fuzz.capabilities import RULE_NEEDS
    from fuzz.generate import random_trace
    from spec.config import resolve

    for rule, needs in RULE_NEEDS.items():
        wanted = {k: v for k, v in needs.items() if isinstance(v, tuple) and k != "request_features"}
        if not wanted:
            continue
        [opts] = rule_targets([rule])
        assert all(opts[k] in v for k, v in wanted.items()), rule
        assert opts in [steer([rule], i) for i in range(1, 33, 2)], rule
        for seed in range(5):
            cfg = random_trace(seed, **opts).config
            resolve(cfg)  # raises ConfigError on a bad combination
            assert all(cfg[k] == opts[k] for k in wanted), (rule, seed)
    # the family's options come with it: the no-chunking cap keeps the no-chunking family's small budget
    [exclusive] = rule_targets(["ADMIT.NO_CHUNKING_EXCLUSIVE"])
    assert exclusive["max_num_batched_tokens"] == 64 and exclusive["no_chunking_cap"] == "exclusive"


def test_profile_all_spreads_a_campaign_over_the_whole_map():
    from fuzz.campaign import ALL_PROFILES, trace_profile
    from spec.config import PROFILES

    picks = [trace_profile(ALL_PROFILES, k) for k in range(4 * len(PROFILES))]
    assert picks.count(None) == len(picks) // 2  # half: the vllm-v1 family, steered and unsteered
    assert {p for p in picks if p} == set(PROFILES) - {"vllm-v1"}
    assert {k % 2 for k, p in enumerate(picks) if p is None} == {0, 1}  # steering still reaches the default family
    assert trace_profile("tgi", 7) == "tgi" and trace_profile(None, 7) is None
