"""Small builders for hand-worked scenario traces."""
from __future__ import annotations

from spec.formats import StepRecord, Trace, TraceRequest
from spec.scheduler import run

BASE = dict(
    profile="vllm-v1",
    block_size=4,
    num_blocks=17,  # 16 usable
    max_num_batched_tokens=32,
    max_num_seqs=8,
    max_model_len=64,
    enable_prefix_caching=False,
)


def R(rid: str, prompt, max_tokens: int, at: int = 0, **kw) -> TraceRequest:
    """A request; ``prompt`` is a length or a list of token ids."""
    if isinstance(prompt, int):
        return TraceRequest(id=rid, prompt_len=prompt, max_tokens=max_tokens, arrival_step=at, **kw)
    return TraceRequest(id=rid, prompt_len=len(prompt), prompt=tuple(prompt), max_tokens=max_tokens, arrival_step=at, **kw)


def trace(config: dict, *requests: TraceRequest) -> Trace:
    return Trace(config={**BASE, **config}, requests=list(requests), vocab_size=1000, eos_token_id=2)


def steps(config: dict, *requests: TraceRequest, **kw) -> dict[int, StepRecord]:
    """Run with every invariant checked; records by step number."""
    return {r.step: r for r in run(trace(config, *requests), check_invariants=True, **kw)}


def scheduled(records: dict[int, StepRecord]) -> dict[int, list[tuple[str, int]]]:
    return {s: r.scheduled for s, r in records.items()}


def rules_for(record: StepRecord, request_id: str) -> list[str]:
    return [x["rule"] for x in record.reasons or [] if x.get("request") == request_id]
