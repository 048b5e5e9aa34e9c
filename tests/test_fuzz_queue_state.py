"""Optional state fields of the waiting queue (issue 18 item 3): where a step's walk of the queue stopped
(``admit_stop``, in engine-neutral words: ``spec.formats.ADMIT_STOPS``), who waits in it (``waiting``), and
each request's tokens in flight under async scheduling (``placeholders``).  The spec and gpu_engine log them
from their own code; a report then names the gate an engine stopped at too early (``ADMIT.MAX_NUM_SEQS`` for a
wrong room count), the abort that left a request queued, the preemption that kept its placeholders — not the
admission or the token count that went wrong later."""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from fuzz.corpus import group_signature
from fuzz.diff import earlier_gate, first_divergence, gate_rule, stop_gate_blame
from fuzz.generate import random_trace
from fuzz.replay import FedSpec, make_engine, replay
from spec.config import resolve
from spec.formats import ADMIT_STOPS, StepRecord
from spec.protocol import drive
from spec.scheduler import SpecEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import mutation_score as ms  # noqa: E402  (its planting mechanism)

ROOT = Path(__file__).resolve().parents[1]

#: Configurations whose walks stop at every gate: vLLM's, chunked prefill off, first-continues,
#: SGLang's estimate, speculative padding, reservation to completion, the step's seat count.
SHAPES = [
    {}, {"enable_chunked_prefill": False}, {"prefill_chunking": "first-continues", "batching": "prefill-first"},
    {"profile": "sglang"}, {"num_speculative_tokens": 2}, {"kv_reservation": "full"},
    {"max_num_seqs_scope": "step"}, {"tight_memory": True},
]


def _logs(trace):
    max_steps = resolve(trace.config).max_steps
    engine = drive(make_engine("gpu", trace), trace, max_steps)
    spec = drive(FedSpec(SpecEngine.from_trace(trace, record_level="exact"), engine), trace, max_steps)
    return spec, engine


def test_the_spec_and_gpu_engine_stop_their_walks_at_the_same_gate():
    """Both sides log the field on their own; on traces of every shape they agree step for step,
    and between them the walks stop at every gate but the padded decode (rare: a one-token rest)."""
    words, compared = Counter(), 0
    for i, shape in enumerate(SHAPES):
        for seed in range(12):
            spec, engine = _logs(random_trace(100 * i + seed, **shape))
            theirs = {r.step: r.admit_stop for r in engine}
            for rec in spec:
                other = theirs.get(rec.step)
                if rec.admit_stop is not None and other is not None:
                    assert rec.admit_stop == other, (shape, seed, rec.step, rec.admit_stop, other)
                    words[rec.admit_stop] += 1
                    compared += 1
    assert compared > 1000
    assert set(words) >= set(ADMIT_STOPS) - {"pad"}, words


def test_the_log_schema_knows_each_word():
    schema = json.loads((ROOT / "spec" / "schemas" / "log-record.schema.json").read_text())
    field = schema.get("properties", schema)["admit_stop"]
    assert field["enum"] == list(ADMIT_STOPS)


def _step(admitted, stop, **kw):
    return StepRecord(step=7, scheduled=[(r, 16) for r in admitted], new=list(admitted), admit_stop=stop, **kw)


CONFIG = {"max_num_seqs": 4, "max_num_batched_tokens": 64}


def test_an_engine_that_stopped_short_is_named_by_its_own_gate():
    spec, engine = _step(["a", "b"], "budget"), _step(["a"], "seqs")
    assert stop_gate_blame("ADMIT.NEW", "new", spec, engine, CONFIG) == "ADMIT.MAX_NUM_SEQS"
    # the same gate on both sides, the engine's fired one head too soon
    assert stop_gate_blame("ADMIT.NEW", "new", _step(["a", "b"], "seqs"), engine, CONFIG) == "ADMIT.MAX_NUM_SEQS"
    # the blocks gate as configured: vLLM's whole-sequence check (on by default), else the free blocks
    assert stop_gate_blame("ADMIT.NEW", "new", spec, _step(["a"], "blocks"), CONFIG) == "ADMIT.FULL_SEQUENCE"
    step_only = {**CONFIG, "scheduler_reserve_full_isl": False}
    assert stop_gate_blame("ADMIT.NEW", "new", spec, _step(["a"], "blocks"), step_only) == "KV.NO_FREE_BLOCKS"
    reserve = {**CONFIG, "kv_reservation": "full"}
    assert stop_gate_blame("ADMIT.NEW", "new", spec, _step(["a"], "blocks"), reserve) == "ADMIT.RESERVE_FULL"
    step_scope = {**CONFIG, "max_num_seqs_scope": "step"}
    assert stop_gate_blame(None, "scheduled", spec, engine, step_scope) == "BATCH.MAX_NUM_SEQS_PER_STEP"


def test_an_engine_that_went_past_the_spec_gate_is_named_by_the_spec_gate():
    unchunked = {**CONFIG, "enable_chunked_prefill": False, "max_num_batched_tokens": 64, "max_model_len": 64}
    assert stop_gate_blame("ADMIT.NEW", "new", _step(["a"], "whole"), _step(["a", "b"], "empty"), unchunked) \
        == "ADMIT.NO_CHUNKING"


def test_the_same_admissions_name_the_gate_tested_first():
    """Both stopped at the same head; the side that stopped at the later gate passed the earlier one."""
    assert earlier_gate("blocks", "budget", None) == "budget"
    assert earlier_gate("seqs", "blocks", None) == "seqs"
    sglang = resolve({"profile": "sglang", "enable_chunked_prefill": False, "max_model_len": 2048})
    assert earlier_gate("whole", "estimate", sglang) == "estimate"  # (SGLang tests memory before the budget)
    assert earlier_gate("blocks", "whole", resolve({"enable_chunked_prefill": False, "max_model_len": 2048})) == "whole"
    assert earlier_gate("whole", "estimate", resolve({"max_model_len": 2048})) is None  # (no estimate there)
    assert earlier_gate("empty", "seqs", None) is None
    assert stop_gate_blame(None, "admit_stop", _step(["a"], "blocks"), _step(["a"], "seqs"), CONFIG) \
        == "ADMIT.MAX_NUM_SEQS"
    assert gate_rule("estimate", sglang) in ("ESTIMATE.ADMIT", "ESTIMATE.IGNORE_EOS_RESERVE")


def test_a_gate_does_not_override_a_named_cause_or_another_queue_order():
    spec, engine = _step(["a", "b"], "budget"), _step(["a"], "seqs")
    assert stop_gate_blame("CACHE.HIT", "new", spec, engine, CONFIG) is None  # (a cause already named stands)
    assert stop_gate_blame("ADMIT.NEW", "new", spec, _step(["b"], "seqs"), CONFIG) is None  # (another head first)
    assert stop_gate_blame("ADMIT.NEW", "new", spec, _step(["a"], None), CONFIG) is None  # (not logged)


def test_a_differing_stop_alone_is_a_divergence_at_its_step():
    """The same decisions, the walks stopped at different gates: the state shows the bug before a
    decision does (a record-level diff names vLLM's rule for the earlier gate)."""
    found = first_divergence([_step(["a"], "budget")], [_step(["a"], "blocks")], "decisions")
    assert found is not None and found.field == "admit_stop" and found.step == 7
    assert found.rule == "BUDGET.TOKENS"


def test_the_log_checker_holds_an_engine_to_its_own_stop_words():
    """An engine's own log: a walk stopped by the budget ends a full batch; only the format's words."""
    from invariants.log_checker import check_log
    from spec.formats import DecisionLog

    trace = next(t for t in (random_trace(s, tight_memory=True) for s in range(40))
                 if any(r.admit_stop == "budget" for r in _logs(t)[1]))
    cfg = resolve(trace.config)
    engine = _logs(trace)[1]

    def flagged(records):
        report = check_log(DecisionLog("gpu", "exact", records), cfg, trace)
        return [v for v in report.violations if v.invariant == "LOG.STATE_CONSISTENT" and v.field == "admit_stop"]

    assert flagged(engine) == []
    at = next(i for i, r in enumerate(engine) if r.admit_stop == "budget" and r.scheduled)
    short = [StepRecord.from_json(r.to_json()) for r in engine]
    rid, n = short[at].scheduled[-1]
    short[at].scheduled[-1] = (rid, n - 1) if n > 1 else (rid, n)
    short[at].admit_stop = "budget" if n > 1 else "nowhere"
    assert flagged(short), "a 'budget' stop with tokens left (or an unknown word) must be flagged"
    words = [StepRecord.from_json(r.to_json()) for r in engine]
    words[at].admit_stop = "memory"
    assert flagged(words)


def test_a_head_the_engine_took_with_a_prefix_hit_is_not_blamed_on_the_spec_gate():
    spec = _step(["a"], "blocks")
    engine = _step(["a", "b"], "empty", cache_hits={"a": 0, "b": 32})
    assert stop_gate_blame("ADMIT.NEW", "new", spec, engine, CONFIG) is None
    engine.cache_hits = {"a": 0, "b": 0}
    assert stop_gate_blame("ADMIT.NEW", "new", spec, engine, CONFIG) == "ADMIT.FULL_SEQUENCE"


# -- the queue and the tokens in flight: two more state fields of the same kind ---------------------

def test_the_spec_and_gpu_engine_log_the_same_queue_and_tokens_in_flight():
    """``waiting`` on every profile (aborts included), ``placeholders`` under async scheduling: equal
    step for step, and not trivially (queues and tokens in flight are non-empty in many steps)."""
    from spec.config import PROFILES

    queued = in_flight = 0
    for i, profile in enumerate(sorted(PROFILES)):
        for seed in range(3):
            trace = random_trace(10 * i + seed, profile=profile, aborts=bool(seed % 2))
            spec, engine = _logs(trace)
            theirs = {r.step: r for r in engine}
            for rec in spec:
                other = theirs.get(rec.step)
                if other is None or rec.waiting is None:
                    continue
                assert rec.waiting == other.waiting, (profile, seed, rec.step)
                queued += bool(rec.waiting)
                if profile == "vllm-v1-async":
                    assert rec.placeholders == other.placeholders, (seed, rec.step)
                    in_flight += bool(rec.placeholders)
                else:
                    assert rec.placeholders is None and other.placeholders is None
    assert queued > 100 and in_flight > 20, (queued, in_flight)


def test_a_queue_that_differs_names_the_event_that_should_have_moved_the_request():
    from fuzz.diff import waiting_rule

    aborted = StepRecord(step=4, aborted=["x"], reasons=[{"rule": "ABORT.FREE", "request": "x"}])
    assert waiting_rule(aborted, ["y"], ["x", "y"], [])[:2] == ("x", "ABORT.FREE")
    assert waiting_rule(aborted, ["y"], ["y", None], [])[:2] == ("x", "ABORT.FREE")  # (released, still keyed)
    admitted = _step(["x"], "empty")
    assert waiting_rule(admitted, [], ["x"], [])[:2] == ("x", "ADMIT.NEW")
    preempted = StepRecord(step=4, preempted=["z"], reasons=[{"rule": "PREEMPT.VICTIM_NEWEST", "request": "z"}])
    assert waiting_rule(preempted, ["z"], [], [])[:2] == ("z", "PREEMPT.RECOMPUTE")
    assert waiting_rule(StepRecord(step=4), ["w"], [], [])[:2] == ("w", "ARRIVE.QUEUED")
    found = first_divergence([StepRecord(step=4, aborted=["x"], waiting=["y"])],
                             [StepRecord(step=4, aborted=["x"], waiting=["x", "y"])], "decisions")
    assert found is not None and (found.field, found.request, found.rule) == ("waiting", "x", "ABORT.FREE")


def test_tokens_in_flight_that_differ_name_the_preemption_or_the_stale_output():
    from fuzz.diff import placeholder_rule

    assert placeholder_rule(StepRecord(step=3, preempted=["a"]), "a")[0] == "ASYNC.PREEMPT_ZEROES_PLACEHOLDERS"
    stale = StepRecord(step=3, reasons=[{"rule": "ASYNC.STALE_OUTPUT", "request": "a"}])
    assert placeholder_rule(stale, "a")[0] == "ASYNC.STALE_OUTPUT"
    assert placeholder_rule(StepRecord(step=3), "a")[0] == "ASYNC.PLACEHOLDER"


@pytest.mark.parametrize("name, rule, options", [
    ("room_counts_waiting", "ADMIT.MAX_NUM_SEQS", {}),  # (VLLM-06; ADMIT.NEW before admit_stop)
    ("abort_waiting_still_queued", "ABORT.FREE", {"aborts": True}),  # (SGL-08; a crash before waiting)
    ("placeholders_kept_on_preempt", "ASYNC.PREEMPT_ZEROES_PLACEHOLDERS", {"profile": "vllm-v1-async",
                                                                          "tight_memory": True}),
    # SGLang's estimate: the term of rem that differs (estimate_parts), the test that refused the head
    ("running_ratio_ignores_eos", "ESTIMATE.RUNNING_RATIO", {"profile": "sglang"}),
    ("estimate_unclipped", "ESTIMATE.REMAINING", {"profile": "sglang", "clip_max_new_tokens": 4}),
    ("continued_chunk_no_block", "ESTIMATE.CONTINUED_CHUNK", {"profile": "sglang", "tight_memory": True}),
    ("own_hit_unlocked", "ESTIMATE.OWN_HIT_LOCKED", {"profile": "sglang", "enable_prefix_caching": True,
                                                     "prefix_groups": True, "tight_memory": True}),
])
def test_planted_gate_queue_and_placeholder_bugs_are_named_where_they_happen(name, rule, options):
    """Each bug planted: the first diverging trace's finding names the rule at fault, and the same
    trace agrees unplanted."""
    found = ms.first_divergent(name, (random_trace(seed, **options) for seed in range(80)), kind="decision")
    assert found is not None
    trace, named = found[0], group_signature(found[1])[2]
    assert named == rule, named
    assert replay(trace, "gpu", "exact").divergence is None


def test_the_spec_names_the_lock_only_where_its_own_hit_tips_the_estimate():
    """ESTIMATE.OWN_HIT_LOCKED as a refusal reason: the candidate's need exceeds the estimate, and
    would not without its own hit's evictable blocks (figures from the reason's text)."""
    import re

    locked = 0
    for seed in range(60):
        trace = random_trace(seed, profile="sglang", enable_prefix_caching=True, prefix_groups=True, tight_memory=True)
        for rec in _logs(trace)[0]:
            for r in rec.reasons or ():
                m = re.match(r"needs (\d+) tokens, (-?[\d.]+) estimated free(, (\d+) of them)?", r["text"])
                if r["rule"] == "ESTIMATE.OWN_HIT_LOCKED":
                    need, rem, lock = int(m[1]), float(m[2]), int(m[4])
                    assert need >= rem - 1e-3 and rem > need - lock - 1e-3, r  # (refused: need >= rem; rem printed to 3 places)
                    locked += 1
                elif r["rule"] == "ESTIMATE.ADMIT" and m:
                    assert m[3] is None
    assert locked >= 3, locked


def test_a_queue_logged_in_queue_order_is_compared_as_a_set():
    """The format says sorted; an engine that logs its queue in its own order still agrees."""
    same = first_divergence([StepRecord(step=2, waiting=["a", "b"])], [StepRecord(step=2, waiting=["b", "a"])],
                            "decisions")
    assert same is None
    lost = first_divergence([StepRecord(step=2, waiting=["a", "b"])], [StepRecord(step=2, waiting=["b"])], "decisions")
    assert lost is not None and lost.field == "waiting" and lost.request == "a"
