"""Interaction coverage (issue 18 item 2) and reports that name the rule at fault (item 3).

Pairs and interactions are read from the spec's own step records (fuzz/pairs.py); the campaign
steers a share of its traces towards the interactions it met least; a memory divergence names the
memory event behind the spec's value (fuzz.diff.memory_rule)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


from fuzz import pairs as P
from spec.formats import StepRecord

ROOT = Path(__file__).resolve().parents[1]


def reason(rule, request=None):
    out = {"rule": rule, "text": "-"}
    if request is not None:
        out["request"] = request
    return out


def hand_made() -> list[StepRecord]:
    """A: admitted with a hit on B's prefix block 1 (shared), preempted while sharing it, aborted
    while waiting; C: swapped out, aborted while swapped; one step spends the whole budget of 4."""
    return [
        StepRecord(0, scheduled=[("B", 4)], new=["B"], block_ids={"B": [1, 2]}, cache_hits={"B": 0},
                   reasons=[reason("ADMIT.NEW", "B")]),
        StepRecord(1, scheduled=[("B", 1), ("A", 3)], new=["A"], cache_hits={"A": 4}, block_ids={"B": [1, 2], "A": [1, 3]},
                   reasons=[reason("RUN.DECODE", "B"), reason("ADMIT.NEW", "A")]),
        StepRecord(2, scheduled=[("B", 1)], preempted=["A", "C"], swapped_out=["C"], num_evicted=1,
                   block_ids={"B": [1, 2]},
                   reasons=[reason("RUN.DECODE", "B"), reason("PREEMPT.VICTIM_NEWEST", "A"), reason("SWAP.OUT", "C")]),
        StepRecord(3, aborted=["A", "C"], scheduled=[("B", 1)], block_ids={"B": [1, 2]},
                   reasons=[reason("ABORT.FREE", "A"), reason("ABORT.FREE", "C"), reason("RUN.DECODE", "B")]),
    ]


def test_facts_carry_the_states_a_request_is_in_across_steps():
    facts = P.step_facts(hand_made(), budget=4)
    assert "STATE.BUDGET_SPENT" in facts[1].of(None) and "STATE.BUDGET_SPENT" not in facts[2].of(None)
    assert "CACHE.HIT" in facts[1].of("A") and "CACHE.HIT" not in facts[0].of("B"), "a hit of 0 tokens is no hit"
    assert "STATE.SHARED_BLOCKS" in facts[2].of("A"), "A entered step 2 holding block 1, which B holds too"
    assert "STATE.SHARED_BLOCKS" not in facts[1].of("A"), "sharing is the state a step starts from"
    assert "STATE.PREEMPTED" in facts[3].of("A") and "STATE.SWAPPED" in facts[3].of("C")
    assert "CACHE.EVICT_LRU" in facts[2].of(None)


def test_automatic_pairs_are_rule_pairs_of_one_step_or_one_life():
    pairs = P.automatic_pairs(P.step_facts(hand_made(), budget=4))
    assert "step:ADMIT.NEW+RUN.DECODE" in pairs  # step 1: B decodes while A is admitted
    assert "life:ABORT.FREE+PREEMPT.VICTIM_NEWEST" in pairs  # A, steps 2 and 3
    assert "step:ABORT.FREE+ADMIT.NEW" not in pairs, "never in one step"
    assert not any("STATE." in p for p in pairs), "states are not rules"


def test_the_curated_interactions_of_the_hand_made_trace():
    met = set(P.interactions_met(P.step_facts(hand_made(), budget=4)))
    assert {"preempt x shared-prefix", "abort x preempted", "abort x swapped"} <= met
    assert "priority-preempt x spent-budget" not in met, "no priority victim"
    assert "chunked-prefill x prefix-hit" not in met, "A's prefill was never continued in chunks"


def test_the_family_prefilter_and_the_shared_block_scan_change_no_result():
    """interactions_met skips a predicate whose two families did not both fire in the trace (a
    speed-up): on steered traces it names exactly what asking every predicate names, and
    _shared finds exactly the requests a block-to-holders map finds."""
    from fuzz.generate import random_trace

    def holders_shared(block_ids):
        holders = {}
        for rid, blocks in (block_ids or {}).items():
            for b in blocks:
                holders.setdefault(b, set()).add(rid)
        return {rid for owners in holders.values() if len(owners) > 1 for rid in owners}

    assert all(getattr(i.met, "families", None) for i in P.INTERACTIONS), "every curated predicate names its families"
    met_any = 0
    for k, interaction in enumerate(P.INTERACTIONS):
        for seed in range(3):
            trace = random_trace(seed, **{key: v for key, v in interaction.steer.items()}, interaction=interaction.name)
            facts = P._spec_facts(trace)
            assert P.interactions_met(facts) == [i.name for i in P.INTERACTIONS if i.met(facts)]
            met_any += bool(P.interactions_met(facts))
    assert met_any >= 10, "steered traces meet interactions (else the comparison above says little)"
    for block_ids in ({"A": [1, 2], "B": [3]}, {"A": [1, 2], "B": [2, 3], "C": [4]}, {"A": [5, 5]},
                      {"A": [1], "B": [1], "C": [1]}, {}, None):
        assert P._shared(block_ids) == holders_shared(block_ids)


def test_a_shaped_trace_meets_its_interaction_and_stays_reproducible():
    """random_trace(seed, interaction=NAME) is the same trace every time, and the abort it times
    lands on a request that is swapped out at that step in the spec's own run."""
    from fuzz.generate import random_trace
    from spec.config import resolve

    opts = dict(interaction="abort x swapped", tight_memory=True, preemption_mode="swap", num_cpu_blocks=256,
                n_requests=6, watermark=0.0, scheduler_reserve_full_isl=False)
    met = 0
    for seed in range(6):
        trace = random_trace(seed, **opts)
        assert trace == random_trace(seed, **opts)
        facts = P._spec_facts(trace)
        met += "abort x swapped" in P.interactions_met(facts)
        assert resolve(trace.config).preemption_mode == "swap"
    assert met >= 4, f"only {met}/6 shaped traces met it"


def test_steering_raises_interaction_coverage_at_equal_budget(tmp_path, monkeypatch):
    """The same seed and trace budget, with and without interaction steering: steering meets the
    curated interactions in more traces (spec vs spec: fast, deterministic)."""
    import fuzz.campaign as C

    def run(name):
        return C.run_campaign(C.CampaignConfig(seed=3, engine="spec", traces=48, workers=1, corpus=str(tmp_path / name)))

    steered = run("steered")
    monkeypatch.setattr(C, "interaction_target", lambda targets, index: None)
    plain = run("plain")
    assert steered.traces == plain.traces == 48
    met = lambda s: len([n for n, c in s.interactions.items() if c])  # noqa: E731
    assert met(steered) > met(plain) or (met(steered) == met(plain) == len(P.INTERACTIONS)
                                         and sum(steered.interactions.values()) > sum(plain.interactions.values()))
    assert sum(steered.interactions.values()) > sum(plain.interactions.values())
    assert steered.pairs and set(steered.reachable_interactions) == {i.name for i in P.INTERACTIONS}


def _mutation_score():
    spec = importlib.util.spec_from_file_location("mutation_score", ROOT / "benchmarks" / "mutation_score.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mutation_score", module)
    spec.loader.exec_module(module)
    return module


def test_a_symptom_only_bug_is_reported_under_the_rule_at_fault():
    """Aborting a swapped-out request without returning its CPU blocks shows only as a CPU block
    count (a symptom); the report names ABORT.FREE, the rule the engine broke, not the swap."""
    from fuzz.corpus import group_signature
    from fuzz.generate import random_trace
    from fuzz.replay import replay

    ms = _mutation_score()
    mutant = next(m for m in ms.MUTANTS if m.name == "abort_swapped_leaks_cpu")
    trace = random_trace(0, interaction="abort x swapped", tight_memory=True, preemption_mode="swap",
                         num_cpu_blocks=256, n_requests=6, watermark=0.0, scheduler_reserve_full_isl=False)
    assert replay(trace, "gpu", "exact").agreed, "the shipped engine agrees"
    with ms.planted(mutant):
        result = replay(trace, "gpu", "exact", after=3)
    assert not result.agreed and result.divergence.field == "num_free_cpu_blocks"
    assert group_signature(result)[2] in ms.AT_FAULT["abort_swapped_leaks_cpu"] == ("ABORT.FREE",)
    assert result.divergence.rule == "ABORT.FREE" and result.divergence.request in {r.id for r in trace.requests}


INTERACTION_MUTANTS = ["shared_prefix_freed_on_preempt", "victim_tokens_not_returned", "abort_preempted_left_queued",
                       "abort_swapped_leaks_cpu", "chunk_after_hit_off_by_one", "retraction_drops_prefix",
                       "reinsertion_reversed", "stale_finish_still_waiting", "swap_in_after_preempt"]


def test_every_interaction_mutant_lives_in_a_curated_interaction():
    ms = _mutation_score()
    assert sorted(m.name for m in ms.MUTANTS if m.interaction) == sorted(INTERACTION_MUTANTS)
    assert all(m.interaction in P.BY_NAME for m in ms.MUTANTS if m.interaction)
    assert set(ms.AT_FAULT) == {m.name for m in ms.MUTANTS}, "every mutant says which rules are at fault"


def test_every_mutant_still_plants_on_the_engine_as_it_is():
    """A patch that no longer fits gpu_engine (a changed signature or line) would be "caught" by the
    crash it causes, not by the bug it plants: each mutant is planted (PlantError if its line is gone)
    and run on a few traces without raising inside the patch."""
    from fuzz.generate import random_trace
    from fuzz.replay import replay

    ms = _mutation_score()
    for m in ms.MUTANTS:
        with ms.planted(m):
            for seed in range(3):
                div = replay(random_trace(seed), "gpu", "exact").divergence
                where = str(div.engine_value) if div is not None and div.kind == "error" else ""
                assert "mutation_score" not in where and "<mutant of" not in where and "TypeError" not in where, \
                    f"{m.name}: {where}"


def test_a_budget_given_back_by_a_victim_is_named_by_the_victim_rule():
    from fuzz.diff import budget_giveback_rule

    rec = StepRecord(4, scheduled=[("B", 3), ("C", 5)], preempted=["A"],
                     reasons=[reason("RUN.DECODE", "A"), reason("RUN.PREFILL_CHUNK", "B"),
                              reason("PREEMPT.VICTIM_LOWEST_PRIORITY", "A"), reason("RUN.PREFILL_CHUNK", "C")])
    assert budget_giveback_rule(rec, "C") == ("PREEMPT.VICTIM_LOWEST_PRIORITY", "A")
    assert budget_giveback_rule(rec, "B") is None, "B got its tokens before A gave any back"
    again = StepRecord(4, reasons=[reason("RUN.DECODE", "A"), reason("PREEMPT.VICTIM_LOWEST_PRIORITY", "A"),
                                   reason("ADMIT.RESUMED", "A")])
    assert budget_giveback_rule(again, "A") == ("PREEMPT.VICTIM_LOWEST_PRIORITY", "A"), \
        "the victim resumed in its own step runs on the tokens it gave back"
    unserved = StepRecord(4, reasons=[reason("PREEMPT.VICTIM_LOWEST_PRIORITY", "A"), reason("RUN.PREFILL_CHUNK", "C")])
    assert budget_giveback_rule(unserved, "C") is None, "a victim not served in the step gives nothing back"


def test_an_engine_running_a_request_the_spec_ended_is_named_by_the_rule_that_ended_it():
    from fuzz.diff import first_divergence

    spec = [StepRecord(3, aborted=["A"], scheduled=[("B", 1)], reasons=[reason("ABORT.FREE", "A"), reason("RUN.DECODE", "B")]),
            StepRecord(4, scheduled=[("B", 1), ("C", 4)], new=["C"], reasons=[reason("ADMIT.NEW", "C")])]
    eng = [StepRecord(3, aborted=["A"], scheduled=[("B", 1)]),
           StepRecord(4, scheduled=[("B", 1), ("A", 4)], resumed=["A"])]
    div = first_divergence(spec, eng, "decisions")
    assert (div.field, div.request, div.rule) == ("resumed", "A", "ABORT.FREE"), div.describe()


def test_a_token_count_that_differs_is_named_by_the_token_rule_or_the_hit():
    from fuzz.diff import first_divergence

    mem = dict(num_free_blocks=3, blocks={}, num_evicted=0)
    spec = [StepRecord(2, scheduled=[("A", 8)], new=["A"], cache_hits={"A": 4}, reasons=[reason("ADMIT.NEW", "A")], **mem)]
    short = [StepRecord(2, scheduled=[("A", 7)], new=["A"], cache_hits={"A": 4}, **mem)]
    hit = [StepRecord(2, scheduled=[("A", 4)], new=["A"], cache_hits={"A": 8}, **mem)]
    assert first_divergence(spec, short, "memory").rule == "BUDGET.TOKENS"
    assert first_divergence(spec, hit, "memory").rule == "CACHE.HIT"
    other = [StepRecord(2, scheduled=[("B", 8)], new=["B"], cache_hits={"B": 4}, **mem)]
    # another request taken from the queue: the queue's order decided it (the policy's rule, as_configured)
    from fuzz.diff import as_configured

    assert as_configured(first_divergence(spec, other, "memory").rule, {"policy": "fcfs"}) == "QUEUE.FCFS"
    assert as_configured(first_divergence(spec, other, "memory").rule, {"policy": "priority"}) == "QUEUE.PRIORITY"


# -- the blame walks to the event behind a block's references, a release's order, the cap (issue 18 item 3) --


def _exact(step, **kw):
    base = dict(num_free_blocks=4, blocks={}, cache_hits={}, num_evicted=0, block_ids={}, evicted=[])
    return StepRecord(step, **{**base, **kw})


def test_a_reference_count_names_the_event_of_the_step_on_that_block():
    """Shared block 1 (A and B) loses one reference too many when A is preempted: the counts differ
    at the preemption, named by it, not at the later release that frees the block.  A reference no
    event explains (the engine holds block 9, which nobody holds) names CACHE.TOUCH."""
    from fuzz.diff import first_divergence

    before = _exact(0, scheduled=[("A", 4), ("B", 4)], new=["A", "B"], block_ids={"A": [1, 2], "B": [1, 3]},
                    blocks={"A": 2, "B": 2}, ref_counts={"1": 2, "2": 1, "3": 1})
    spec = [before, _exact(1, scheduled=[("B", 1)], preempted=["A"], block_ids={"B": [1, 3]}, blocks={"B": 2},
                           ref_counts={"1": 1, "3": 1}, reasons=[reason("PREEMPT.VICTIM_NEWEST", "A")])]
    dropped = [before, _exact(1, scheduled=[("B", 1)], preempted=["A"], block_ids={"B": [1, 3]}, blocks={"B": 2},
                              ref_counts={"3": 1})]
    div = first_divergence(spec, dropped, "exact")
    assert (div.step, div.field, div.rule, div.request) == (1, "ref_counts", "PREEMPT.RECOMPUTE", "A"), div.describe()
    leaked = [before, _exact(1, scheduled=[("B", 1)], preempted=["A"], block_ids={"B": [1, 3]}, blocks={"B": 2},
                             ref_counts={"1": 1, "3": 1, "9": 1})]
    assert first_divergence(spec, leaked, "exact").rule == "CACHE.TOUCH"
    # the same, seen one step at a time (a lock-step replay): the spec's history comes separately
    assert first_divergence(spec[1:], dropped[1:], "exact", history=spec[:1]).rule == "PREEMPT.RECOMPUTE"


def test_a_free_count_with_references_that_differ_names_the_block_event():
    """When the free count differs and the logs carry reference counts, the blame is the block's:
    a finished request released blocks 1 and 2, the engine still holds a reference on 2 while 1 went
    back, so its release worked; the extra reference came from a prefix hit's touch."""
    from fuzz.diff import first_divergence

    before = _exact(0, scheduled=[("A", 8)], new=["A"], block_ids={"A": [1, 2]}, blocks={"A": 2}, ref_counts={"1": 1, "2": 1})
    spec = [before, _exact(1, scheduled=[("A", 1)], finished=[("A", "max_tokens")], num_free_blocks=6, ref_counts={})]
    eng = [before, _exact(1, scheduled=[("A", 1)], finished=[("A", "max_tokens")], num_free_blocks=5, ref_counts={"2": 1})]
    div = first_divergence(spec, eng, "exact")
    assert (div.field, div.rule) == ("num_free_blocks", "CACHE.TOUCH"), div.describe()
    both = [before, _exact(1, scheduled=[("A", 1)], finished=[("A", "max_tokens")], num_free_blocks=4,
                           ref_counts={"1": 1, "2": 1})]
    assert first_divergence(spec, both, "exact").rule == "KV.FREE_ORDER", "nothing of A's went back: its release"


def test_blocks_of_one_release_in_another_order_name_the_release_order():
    """A returns blocks 1, 2, 3; B is then given them.  In another order (2 before 3): KV.FREE_REVERSED,
    the order a request returns its blocks.  Blocks from elsewhere (7, never released): KV.FREE_ORDER."""
    from fuzz.diff import first_divergence

    before = _exact(0, scheduled=[("A", 12)], new=["A"], block_ids={"A": [1, 2, 3]}, blocks={"A": 3})
    done = _exact(1, scheduled=[("A", 1)], finished=[("A", "eos")])
    spec = [before, done, _exact(2, scheduled=[("B", 8)], new=["B"], block_ids={"B": [3, 2]}, blocks={"B": 2})]
    reversed_ = [before, done, _exact(2, scheduled=[("B", 8)], new=["B"], block_ids={"B": [1, 2]}, blocks={"B": 2})]
    elsewhere = [before, done, _exact(2, scheduled=[("B", 8)], new=["B"], block_ids={"B": [7, 6]}, blocks={"B": 2})]
    assert first_divergence(spec, reversed_, "exact").rule == "KV.FREE_REVERSED"
    assert first_divergence(spec, elsewhere, "exact").rule == "KV.FREE_ORDER"


def test_a_cap_that_differs_names_the_long_prefill_rule():
    """A lone request capped at 8 tokens (the spec caps only when several are eligible): both logs
    carry the cap the step applied, so the token count is named by BUDGET.LONG_PREFILL."""
    from fuzz.diff import first_divergence

    spec = [StepRecord(0, scheduled=[("A", 32)], new=["A"], token_cap=0, reasons=[reason("ADMIT.NEW", "A")])]
    capped = [StepRecord(0, scheduled=[("A", 8)], new=["A"], token_cap=8)]
    same_cap = [StepRecord(0, scheduled=[("A", 8)], new=["A"], token_cap=0)]
    assert first_divergence(spec, capped, "decisions").rule == "BUDGET.LONG_PREFILL"
    assert first_divergence(spec, same_cap, "decisions").rule == "BUDGET.TOKENS"


def test_a_victims_computed_tokens_name_its_preemption_or_its_end():
    """computed covers preempted requests: a victim that keeps its tokens differs at the step that
    preempted it (PREEMPT.RECOMPUTE); an aborted request the engine still counts names ABORT.FREE."""
    from fuzz.diff import first_divergence

    spec = [StepRecord(5, preempted=["A"], scheduled=[("B", 1)], computed={"A": 0, "B": 9},
                       reasons=[reason("PREEMPT.VICTIM_NEWEST", "A")])]
    kept = [StepRecord(5, preempted=["A"], scheduled=[("B", 1)], computed={"A": 12, "B": 9})]
    div = first_divergence(spec, kept, "decisions")
    assert (div.field, div.request, div.rule) == ("computed", "A", "PREEMPT.RECOMPUTE"), div.describe()
    spec = [StepRecord(6, aborted=["A"], scheduled=[("B", 1)], computed={"B": 10}, reasons=[reason("ABORT.FREE", "A")])]
    queued = [StepRecord(6, aborted=["A"], scheduled=[("B", 1)], computed={"A": 0, "B": 10})]
    assert first_divergence(spec, queued, "decisions").rule == "ABORT.FREE"


def test_several_victims_resumed_is_met_by_its_shape_and_catches_reversed_reinsertion():
    """The curated interaction "several victims x resume": its predicate on hand-made facts, its
    shape meeting it on steered traces, and reinsertion_reversed (victims of one step back in the
    queue in reverse order) caught on one, named by the queue rule at fault."""
    from fuzz.corpus import group_signature
    from fuzz.generate import random_trace
    from fuzz.replay import replay

    recs = [StepRecord(0, preempted=["A", "B"], reasons=[reason("PREEMPT.VICTIM_NEWEST", "A"), reason("PREEMPT.VICTIM_NEWEST", "B")]),
            StepRecord(1, resumed=["B"], reasons=[reason("ADMIT.RESUMED", "B")]),
            StepRecord(2, resumed=["A"], reasons=[reason("ADMIT.RESUMED", "A")])]
    name = "several victims x resume"
    assert name in P.interactions_met(P.step_facts(recs))
    assert name not in P.interactions_met(P.step_facts(recs[:2])), "only one of them resumed"
    interaction = P.BY_NAME[name]
    ms = _mutation_score()
    mutant = next(m for m in ms.MUTANTS if m.name == "reinsertion_reversed")
    met = caught = 0
    for seed in range(8):
        trace = random_trace(seed, interaction=name, **interaction.steer)
        met += name in P.interactions_met(P._spec_facts(trace))
        if caught or not replay(trace, "gpu", "exact").agreed:
            continue
        with ms.planted(mutant):
            result = replay(trace, "gpu", "exact", after=None)
        if not result.agreed:
            caught += 1
            assert group_signature(result)[2] in ms.AT_FAULT["reinsertion_reversed"], group_signature(result)
    assert met >= 3, f"only {met}/8 shaped traces met it"
    assert caught, "no shaped trace caught the reversed re-insertion"


def test_a_cache_entry_dropped_at_a_retraction_names_the_retraction():
    """A retracted request's cached blocks stay in the prefix cache until popped: an engine whose
    cache map loses them shows it at the retraction (cached_blocks), named RETRACT.TO_TAIL; an
    entry no release explains names CACHE.EVICT_LRU."""
    from fuzz.diff import first_divergence

    before = _exact(0, scheduled=[("A", 8)], new=["A"], block_ids={"A": [1, 2]}, blocks={"A": 2}, cached_blocks=[1, 2])
    spec = [before, _exact(1, preempted=["A"], cached_blocks=[1, 2], reasons=[reason("RETRACT.VICTIM_FEWEST_OUTPUTS", "A")])]
    dropped = [before, _exact(1, preempted=["A"], cached_blocks=[])]
    div = first_divergence(spec, dropped, "exact")
    assert (div.field, div.rule, div.request) == ("cached_blocks", "RETRACT.TO_TAIL", "A"), div.describe()
    stale = [before, _exact(1, preempted=["A"], cached_blocks=[1, 2, 7])]
    assert first_divergence(spec, stale, "exact").rule == "CACHE.EVICT_LRU"


def test_a_batch_cut_short_before_a_running_request_names_the_token_rule():
    """The engine's batch is the spec's without its last running request: the budget walk ended
    earlier (BUDGET.TOKENS), not the request's own RUN.* rule."""
    from fuzz.diff import first_divergence

    spec = [StepRecord(3, scheduled=[("A", 3), ("B", 1)], reasons=[reason("RUN.DECODE", "A"), reason("RUN.PREFILL_CHUNK", "B")])]
    short = [StepRecord(3, scheduled=[("A", 3)])]
    assert first_divergence(spec, short, "decisions").rule == "BUDGET.TOKENS"
    admitted = [StepRecord(3, scheduled=[("A", 3), ("B", 1)], new=["B"], reasons=[reason("ADMIT.NEW", "B")])]
    assert first_divergence(admitted, [StepRecord(3, scheduled=[("A", 3)])], "decisions").rule == "ADMIT.NEW", \
        "an admission is decided by its own rules"


def test_a_block_released_twice_in_one_step_blames_the_earlier_release():
    """A and B share block 1; in one step A is preempted and B finishes, and the engine's count
    ends below zero: the preemption (during scheduling) released it before the finish (after the
    model step), so it is named, whichever request the record lists first."""
    from fuzz.diff import first_divergence

    before = _exact(0, scheduled=[("B", 4), ("A", 4)], new=["B", "A"], block_ids={"B": [1, 2], "A": [1, 3]},
                    blocks={"A": 2, "B": 2}, ref_counts={"1": 2, "2": 1, "3": 1})
    spec = [before, _exact(1, scheduled=[("B", 1)], preempted=["A"], finished=[("B", "eos")], ref_counts={},
                           reasons=[reason("PREEMPT.VICTIM_NEWEST", "A")])]
    eng = [before, _exact(1, scheduled=[("B", 1)], preempted=["A"], finished=[("B", "eos")], ref_counts={"1": -1})]
    assert first_divergence(spec, eng, "exact").rule == "PREEMPT.RECOMPUTE"


def test_a_victim_resumed_ahead_of_its_turn_names_the_queue_rule():
    """The engine resumes B while the spec, with A ahead of B, resumes nobody (A does not fit) and
    gives no reason about B: the order victims wait in (QUEUE.VICTIM_TO_FRONT).  A request the spec
    did consider keeps the spec's own reason (here: the watermark held it)."""
    from fuzz.corpus import group_signature
    from fuzz.replay import ReplayResult

    def named(spec):  # the finding's group, which asks `resumed` before `scheduled`
        result = ReplayResult(None, "e", "decisions", eng, spec, first_divergence(spec, eng, "decisions"), 0.0, [])
        return group_signature(result)[1:]

    from fuzz.diff import first_divergence

    spec = [StepRecord(7, scheduled=[("C", 1)], reasons=[reason("RUN.DECODE", "C"), reason("ADMIT.FULL_SEQUENCE", "A")])]
    eng = [StepRecord(7, scheduled=[("C", 1), ("B", 4)], resumed=["B"])]
    assert named(spec) == ("resumed", "QUEUE.VICTIM_TO_FRONT")
    held = [StepRecord(7, scheduled=[("C", 1)], reasons=[reason("RUN.DECODE", "C"), reason("ADMIT.WATERMARK", "B")])]
    assert named(held) == ("resumed", "ADMIT.WATERMARK")


def test_an_interaction_that_needs_recompute_is_unreachable_under_a_fixed_swap():
    """Async scheduling never swaps: with --set preemption_mode=swap the stale-output interaction (async)
    cannot be met, and steering towards it would only draw configurations the spec refuses."""
    from fuzz.capabilities import for_engine
    from fuzz.pairs import reachable_interactions

    envelope = for_engine("gpu")
    assert "stale output x preempted" in reachable_interactions(envelope)
    assert "stale output x preempted" not in reachable_interactions(envelope, None, {"preemption_mode": "swap"})
