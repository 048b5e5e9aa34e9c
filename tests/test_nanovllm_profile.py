"""The rules the ``nano-vllm`` profile adds to the map, one small trace each (issue #16).

The expected step tables are worked out by hand from nano-vllm's scheduler as
docs/conformance.md describes it; the recorded corpus (tests/test_nanovllm_corpus.py)
checks the same rules against nano-vllm itself.
"""
from __future__ import annotations

import pytest

from spec.config import PROFILES, ConfigError, resolve
from spec.formats import Trace, TraceRequest
from spec.scheduler import run


def _run(requests, **config):
    trace = Trace(config={"profile": "nano-vllm", "block_size": 4, "num_blocks": 32, "max_num_batched_tokens": 8,
                          **config},
                  requests=[TraceRequest(**{"arrival_step": 0, "ignore_eos": True, **r}) for r in requests])
    return run(trace, check_invariants=True)


def test_phase_list_and_rules():
    plan = PROFILES["nano-vllm"].plan
    assert plan.phases == ("continue_prefill", "schedule_waiting", "end_prefill_batch", "schedule_running")
    assert plan.room == "BATCH.MAX_NUM_SEQS_PER_STEP" and plan.reservation == "ADMIT.RESERVE_SEQUENCE"
    assert plan.admission_checks == ("ADMIT.CHUNK_ONLY_FIRST",)


def test_a_cut_prefill_continues_first_and_the_next_request_joins_its_last_chunk():
    recs = _run([{"id": "A", "prompt_len": 12, "max_tokens": 2}, {"id": "B", "prompt_len": 3, "max_tokens": 2}])
    assert [r.scheduled for r in recs[:3]] == [[("A", 8)], [("A", 4), ("B", 3)], [("A", 1), ("B", 1)]]
    assert recs[0].sampled == {} and recs[0].block_ids == {"A": [0, 1, 2]}  # the whole prompt's blocks at once
    assert "RUN.CONTINUE_PREFILL_FIRST" in {x["rule"] for x in recs[1].reasons}


def test_only_the_first_request_of_a_prefill_batch_may_be_cut():
    recs = _run([{"id": "A", "prompt_len": 5, "max_tokens": 2}, {"id": "B", "prompt_len": 6, "max_tokens": 2}])
    assert [r.scheduled for r in recs[:3]] == [[("A", 5)], [("B", 6)], [("A", 1), ("B", 1)]]
    assert {"rule": "ADMIT.CHUNK_ONLY_FIRST", "request": "B"} in [
        {k: x[k] for k in ("rule", "request")} for x in recs[0].reasons if x["rule"] == "ADMIT.CHUNK_ONLY_FIRST"]


def test_max_num_seqs_bounds_each_step_not_the_running_list():
    recs = _run([{"id": i, "prompt_len": 2, "max_tokens": 3} for i in "ABC"], max_num_seqs=1)
    assert [r.scheduled for r in recs[:5]] == [[("A", 2)], [("B", 2)], [("C", 2)], [("A", 1)], [("A", 1)]]
    assert len(recs[2].blocks) == 3  # three requests hold blocks (run) with max_num_seqs = 1


def test_blocks_are_cached_once_computed_and_the_latest_copy_is_hit():
    recs = _run([{"id": "A", "prompt_len": 8, "max_tokens": 6, "prefix_group": "g", "prefix_len": 8},
                 {"id": "B", "prompt_len": 8, "max_tokens": 6, "prefix_group": "g", "prefix_len": 8},
                 {"id": "C", "prompt_len": 8, "max_tokens": 2, "prefix_group": "g", "prefix_len": 8, "arrival_step": 2}],
                max_num_batched_tokens=16)
    assert recs[0].cache_hits == {"A": 0, "B": 0}  # B's prefix is A's, but A's blocks are not computed yet
    assert recs[0].block_ids == {"A": [0, 1], "B": [2, 3]}
    admitted = next(r for r in recs if "C" in r.new)
    assert admitted.cache_hits == {"C": 4} and admitted.block_ids["C"][0] == 2  # B's copy, registered last


def test_freed_blocks_go_to_the_tail():
    """A's half-filled block has no hash: vLLM would put it at the head and re-use it first."""
    recs = _run([{"id": "A", "prompt_len": 3, "max_tokens": 1}, {"id": "B", "prompt_len": 3, "max_tokens": 2,
                                                                   "arrival_step": 1}], num_blocks=3)
    assert recs[0].finished == [("A", "max_tokens")] and recs[0].num_free_blocks == 3
    assert recs[1].block_ids == {"B": [1]}
    vllm_order = _run([{"id": "A", "prompt_len": 3, "max_tokens": 1}, {"id": "B", "prompt_len": 3, "max_tokens": 2,
                                                                         "arrival_step": 1}], num_blocks=3,
                      free_block_order="cached-last")
    assert vllm_order[1].block_ids == {"B": [0]}


def test_first_continues_needs_prefill_first_batching():
    with pytest.raises(ConfigError, match="prefill_chunking"):
        resolve({"profile": "vllm-v1", "prefill_chunking": "first-continues"})
    with pytest.raises(ConfigError, match="prefill_chunking"):
        resolve({"profile": "nano-vllm", "batching": "continuous"})
