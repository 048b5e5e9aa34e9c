"""Hand-worked async-scheduling scenarios (rules ASYNC.*), shared by the spec / gpu_engine tests
(tests/test_gpu_async_diff.py) and the vLLM conformance suite (tests/test_vllm_conformance.py).

Each scenario is a tiny trace and the records worked out by hand from vLLM's AsyncScheduler
and EngineCore.step_with_batch_queue: step k schedules its batch, then applies the outputs of
step k-1 (``outputs_step``).  Only the fields a scenario is about are checked.
"""
from __future__ import annotations

from spec.formats import Trace, TraceRequest


def trace(requests: list[dict], **config) -> Trace:
    return Trace(config={"profile": "vllm-v1-async", "num_blocks": 64, "block_size": 4, **config},
                 requests=[TraceRequest(**r) for r in requests])


def view(records) -> list[tuple]:
    """(step, outputs_step, scheduled, sorted sampled ids, finished) of each record."""
    return [(r.step, r.outputs_step, r.scheduled, sorted(r.sampled), r.finished) for r in records]


#: name -> (trace, expected view).  Worked by hand:
SCENARIOS = {
    # max_tokens=2: step 0 prefills (token 0 in flight), step 1 decodes (token 1 in flight) and
    # applies token 0; at step 2 the known output (1) plus the one in flight reach max_tokens:
    # ASYNC.LAST_TOKEN_IN_FLIGHT keeps A out of the batch, and applying token 1 finishes it.
    # (Synchronously A would finish at step 1.)
    "last_token_in_flight": (
        trace([{"id": "A", "arrival_step": 0, "prompt_len": 4, "max_tokens": 2}]),
        [(0, -1, [("A", 4)], [], []),
         (1, 0, [("A", 1)], ["A"], []),
         (2, 1, [], ["A"], [("A", "max_tokens")])],
    ),
    # EOS as the second output cannot be foreseen: step 2 schedules one more decode of A, then
    # applying step 1's EOS finishes A; that decode's token is dropped (ASYNC.ABORT_DROPS_OUTPUT)
    # and no step runs after it, since nothing is left unfinished.
    "eos_gets_one_more_decode": (
        trace([{"id": "A", "arrival_step": 0, "prompt_len": 4, "max_tokens": 10, "output_tokens": [7, 2]}]),
        [(0, -1, [("A", 4)], [], []),
         (1, 0, [("A", 1)], ["A"], []),
         (2, 1, [("A", 1)], ["A"], [("A", "eos")])],
    ),
    # max_model_len 8, a 6-token prompt: positions 6 and 7 hold outputs 0 and 1.  Step 1 computes
    # position 6 (output 0 in flight); at step 2 num_computed = 7 counts the placeholder of
    # output 1, so BUDGET.MAX_MODEL_LEN allows 8 - 7 - 1 = 0 tokens (ASYNC.PLACEHOLDERS_COUNT):
    # A is skipped, and applying output 1 (8 tokens) finishes it by max_model_len.
    "placeholders_count_against_max_model_len": (
        trace([{"id": "A", "arrival_step": 0, "prompt_len": 6, "max_tokens": 100}], max_model_len=8),
        [(0, -1, [("A", 6)], [], []),
         (1, 0, [("A", 1)], ["A"], []),
         (2, 1, [], ["A"], [("A", "max_model_len")])],
    ),
    # An abort at step 2 frees B at once; B's token in flight from step 1 is dropped (not in
    # step 2's sampled), A's is applied.
    "abort_drops_the_token_in_flight": (
        trace([{"id": "A", "arrival_step": 0, "prompt_len": 4, "max_tokens": 3},
               {"id": "B", "arrival_step": 0, "prompt_len": 4, "max_tokens": 9, "abort_at": 2}]),
        [(0, -1, [("A", 4), ("B", 4)], [], []),
         (1, 0, [("A", 1), ("B", 1)], ["A", "B"], []),
         (2, 1, [("A", 1)], ["A"], []),
         (3, 2, [], ["A"], [("A", "max_tokens")])],
    ),
}
