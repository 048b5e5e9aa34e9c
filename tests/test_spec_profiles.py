"""Scenario tests for the baseline profiles and reservation styles (issue 8), worked by hand,
and an exhaustive small-bound check that reservation to completion never preempts."""
import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from invariants.strategies import for_profile, traces
from scenario_helpers import R, rules_for, scheduled, steps
from spec.config import PROFILES
from spec.formats import Trace, TraceRequest
from spec.scheduler import run


def test_naive_serves_one_request_at_a_time():
    recs = steps({"profile": "naive", "max_num_seqs": 1}, R("A", 8, 3), R("B", 2, 1))
    assert scheduled(recs) == {0: [("A", 8)], 1: [("A", 1)], 2: [("A", 1)], 3: [("B", 2)]}
    assert "ADMIT.MAX_NUM_SEQS" in rules_for(recs[0], "B")  # head-of-line blocking behind A


def test_static_batching_holds_a_short_request_hostage():
    # A (6 tokens out) and B (1) are admitted together; C arrives at step 1 and waits until
    # the whole batch is done (step 5), though memory and budget are free all along.
    cfg = {"profile": "static", "max_num_batched_tokens": 32, "num_blocks": 17}
    recs = steps(cfg, R("A", 4, 6), R("B", 4, 1), R("C", 4, 1, at=1))
    assert recs[0].new == ["A", "B"] and recs[0].finished == [("B", "max_tokens")]
    # A reserved its whole life at once: min(4 + 6 - 1, 63) = 9 slots = 3 blocks, never more
    assert all(recs[s].block_ids == {"A": [1, 2, 3]} for s in range(5))
    assert [recs[s].new for s in range(1, 6)] == [[], [], [], [], []]
    assert "BATCH.STATIC" in rules_for(recs[1], "C")
    assert recs[5].finished == [("A", "max_tokens")] and recs[6].new == ["C"]


def test_prefill_first_pauses_decodes_while_it_admits():
    cfg = {"profile": "vllm-v0", "max_model_len": 64, "max_num_batched_tokens": 64}
    recs = steps(cfg, R("A", 4, 4), R("B", 4, 2, at=2))
    assert scheduled(recs) == {0: [("A", 4)], 1: [("A", 1)], 2: [("B", 4)], 3: [("A", 1), ("B", 1)], 4: [("A", 1)]}
    assert "BATCH.PREFILL_FIRST" in rules_for(recs[2], "A")


def test_full_reservation_waits_where_step_reservation_preempts():
    trace = (R("A", 4, 8), R("B", 4, 8))
    v1 = steps({"num_blocks": 5}, *trace)
    assert any(r.preempted for r in v1.values())  # vllm-v1 admits both and later preempts B
    orca = steps({"profile": "orca", "num_blocks": 5, "max_num_batched_tokens": 64}, *trace)
    # A reserves min(4 + 8 - 1, 4095) = 11 slots = 3 of the 4 blocks; B cannot reserve its 3
    assert orca[0].new == ["A"] and orca[0].block_ids == {"A": [1, 2, 3]}
    assert "KV.NO_FREE_BLOCKS" in rules_for(orca[0], "B")
    assert not any(r.preempted for r in orca.values())
    assert orca[7].finished == [("A", "max_tokens")] and orca[8].new == ["B"]


def test_tgi_is_prefill_first_with_full_reservation():
    cfg = {"profile": "tgi", "num_blocks": 9, "max_model_len": 64, "max_num_batched_tokens": 64}
    recs = steps(cfg, R("A", 4, 4), R("B", 4, 4, at=1))
    assert recs[1].scheduled == [("B", 4)] and recs[1].block_ids == {"A": [1, 2], "B": [3, 4]}
    assert not any(r.preempted for r in recs.values())


def _exhaustive_traces():
    """Every trace of 2 requests (prompt 1-3, max_tokens 1-3, arrival 0-1) on 1-4 usable blocks
    of size 1-2, and of 3 simultaneous requests on 1-2 usable blocks of size 1."""
    shapes = list(itertools.product((1, 2, 3), (1, 2, 3), (0, 1)))
    for bs, n in itertools.product((1, 2), (2, 3, 4, 5)):
        for (p1, m1, a1), (p2, m2, a2) in itertools.product(shapes, repeat=2):
            if a2 >= a1:
                yield bs, n, [(p1, m1, a1), (p2, m2, a2)]
    for n in (2, 3):
        for reqs in itertools.product(itertools.product((1, 2, 3), (1, 2, 3)), repeat=3):
            yield 1, n, [(p, m, 0) for p, m in reqs]


def test_full_reservation_never_preempts_exhaustively():
    runs = 0
    for profile in ("static", "orca", "tgi"):
        for bs, n, reqs in _exhaustive_traces():
            cfg = {"profile": profile, "block_size": bs, "num_blocks": n, "max_model_len": 16, "max_num_batched_tokens": 16}
            requests = [TraceRequest(id=f"r{i}", prompt_len=p, max_tokens=m, arrival_step=a) for i, (p, m, a) in enumerate(reqs)]
            records = run(Trace(config=cfg, requests=requests, vocab_size=64), check_invariants=True)
            assert not any(r.preempted for r in records), (profile, bs, n, reqs)
            runs += 1
    assert runs > 10_000


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(traces(), st.sampled_from(sorted(PROFILES)))
def test_every_profile_keeps_every_invariant(trace, profile):
    cfg = for_profile(trace.config, profile)
    records = run(Trace(config=cfg, requests=trace.requests, vocab_size=trace.vocab_size), check_invariants=True)
    ended = {rid for r in records for rid, _ in r.finished} | {rid for r in records for rid in r.aborted} \
        | {rid for r in records for rid, _ in r.rejected}
    assert ended == {r.id for r in trace.requests}
