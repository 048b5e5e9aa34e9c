"""gpu_engine vs. the spec: identical decision logs at the ``exact`` level.

Scheduler-only mode (synthetic tokens, the same rule the spec uses), on random
traces that exercise every knob: chunked prefill on/off, long-prefill caps,
tight memory (preemption chains, self-preemption), shared prefixes (prefix
hits, same-step sharing, evictions), priorities, aborts, stop tokens and EOS,
rejections, watermark, the null block.  ``BATCHSPEC_GPU_TRACES`` (default 500)
sets how many traces a run checks; ``BATCHSPEC_GPU_SEED`` shifts the seeds.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from spec.config import resolve
from spec.formats import Trace, TraceRequest, fields_at
from spec.protocol import Engine, StepLimitError, drive
from spec.scheduler import SpecEngine

from gpu_engine import GpuEngine

NUM_TRACES = int(os.environ.get("BATCHSPEC_GPU_TRACES", "500"))
SEED0 = int(os.environ.get("BATCHSPEC_GPU_SEED", "0"))
CHUNKS = 10


def random_trace(seed: int) -> Trace:
    """A small random trace; sizes are drawn so that memory is often tight."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8, 16])
    mml = rng.choice([32, 64, 128, 256])
    chunked = rng.random() < 0.8
    cfg = {
        "profile": "vllm-v1", "block_size": bs,
        "num_blocks": rng.randint(2, 48) if rng.random() < 0.7 else rng.randint(48, 400),
        "max_num_batched_tokens": rng.choice([4, 8, 16, 32, 64, 256]),
        "max_num_seqs": rng.randint(1, 12), "max_model_len": mml,
        "enable_chunked_prefill": chunked,
        "long_prefill_token_threshold": rng.choice([0, 0, 0, 4, 16]),
        "policy": rng.choice(["fcfs", "priority"]),
        "enable_prefix_caching": rng.random() < 0.7,
        "scheduler_reserve_full_isl": rng.random() < 0.7,
        "watermark": rng.choice([0.0, 0.0, 0.05, 0.2]),
        "reject_unservable": rng.random() < 0.85,
        "admit_after_preempt": rng.random() < 0.2,
        "priority_self_preempt": rng.choice(["stop", "continue"]),
        "null_block": rng.random() < 0.85,
        "max_steps": 400,
    }
    if not chunked:  # the config refuses a budget below max_model_len without chunking
        cfg["max_num_batched_tokens"] = max(cfg["max_num_batched_tokens"], mml)
    vocab = rng.choice([12, 40, 1000])  # small vocabularies make stop tokens fire
    groups = [f"g{i}" for i in range(rng.randint(1, 3))]
    requests = []
    for i in range(rng.randint(1, 16)):
        p = rng.randint(1, min(mml + 4, 120))
        if not cfg["reject_unservable"]:
            p = min(p, mml - 1)  # prompts >= max_model_len are only meaningful with rejection on
        g = rng.choice(groups) if rng.random() < 0.5 else None
        requests.append(TraceRequest(
            id=str(i) if rng.random() < 0.5 else f"r{i}", max_tokens=rng.randint(1, 30), prompt_len=p,
            arrival_step=rng.randint(0, 12), prefix_group=g, prefix_len=rng.randint(0, p) if g else 0,
            priority=rng.randint(0, 3), ignore_eos=rng.random() < 0.5,
            stop_token_ids=tuple(rng.sample(range(3, vocab), 1)) if rng.random() < 0.2 else (),
            abort_at=rng.randint(0, 20) if rng.random() < 0.15 else None,
            output_tokens=tuple(rng.choice([2, 5, 7]) for _ in range(rng.randint(0, 3))) if rng.random() < 0.2 else (),
        ))
    return Trace(config=cfg, requests=requests, vocab_size=vocab, eos_token_id=2, name=f"random-{seed}")


def replay(engine, trace: Trace):
    try:
        return drive(engine, trace, resolve(trace.config).max_steps), False
    except StepLimitError as e:
        return e.records, True


def first_divergence(spec_records, engine_records, level: str = "exact"):
    """``(step, field, spec value, engine value)`` of the first difference, or None."""
    for a, b in zip(spec_records, engine_records):
        da, db = a.to_json(level), b.to_json(level)
        for name in ("step",) + fields_at(level):
            if da.get(name) != db.get(name):
                return da["step"], name, da.get(name), db.get(name)
    if len(spec_records) != len(engine_records):
        return None, "length", len(spec_records), len(engine_records)
    return None


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_exact_agreement_on_random_traces(chunk):
    per = -(-NUM_TRACES // CHUNKS)
    seeds = range(SEED0 + chunk * per, SEED0 + min((chunk + 1) * per, NUM_TRACES))
    for seed in seeds:
        trace = random_trace(seed)
        spec, spec_limited = replay(SpecEngine.from_trace(trace), trace)
        mine, mine_limited = replay(GpuEngine.from_trace(trace), trace)
        assert first_divergence(spec, mine) is None, f"seed {seed}: {first_divergence(spec, mine)}"
        assert spec_limited == mine_limited, f"seed {seed}"


def test_exact_agreement_on_the_fuzz_generators_traces():
    """The shared generator (fuzz.generate, with its stress corners) as a second source."""
    generate = pytest.importorskip("fuzz.generate")
    from fuzz.diff import first_divergence as fuzz_divergence

    for seed in range(SEED0, SEED0 + 150):
        trace = generate.random_trace(seed)
        spec, _ = replay(SpecEngine.from_trace(trace), trace)
        mine, _ = replay(GpuEngine.from_trace(trace), trace)
        d = fuzz_divergence(spec, mine, "exact")
        assert d is None, f"fuzz.generate seed {seed}: {d.describe()}"


def test_torch_code_path_agrees_too():
    """The CUDA code path (array code as torch ops, ``use_numpy=False``), run on CPU."""
    for seed in range(SEED0 + 1000, SEED0 + 1030):
        trace = random_trace(seed)
        spec, _ = replay(SpecEngine.from_trace(trace), trace)
        mine, _ = replay(GpuEngine.from_trace(trace, use_numpy=False), trace)
        assert first_divergence(spec, mine) is None, f"seed {seed}: {first_divergence(spec, mine)}"


def test_random_traces_reach_the_interesting_cases():
    """The generator must keep producing what the agreement test is about."""
    seen = dict.fromkeys(("preempted", "resumed", "hit", "evicted", "aborted", "rejected", "eos", "stop_token",
                          "max_model_len", "max_tokens"), 0)
    for seed in range(SEED0, SEED0 + 150):
        trace = random_trace(seed)
        records, _ = replay(GpuEngine.from_trace(trace), trace)
        for r in records:
            seen["preempted"] += len(r.preempted)
            seen["resumed"] += len(r.resumed)
            seen["hit"] += sum(1 for v in r.cache_hits.values() if v)
            seen["evicted"] += len(r.evicted)
            seen["aborted"] += len(r.aborted)
            seen["rejected"] += len(r.rejected)
            for _, why in r.finished:
                if why in seen:
                    seen[why] += 1
    assert all(seen.values()), seen


def test_engine_protocol_and_levels():
    trace = random_trace(3)
    engine = GpuEngine.from_trace(trace, level="decisions")
    assert isinstance(engine, Engine)
    records, _ = replay(engine, trace)
    assert all(r.num_free_blocks is None and r.block_ids is None for r in records)
    records, _ = replay(GpuEngine.from_trace(trace, level="memory"), trace)
    assert all(r.num_free_blocks is not None and r.block_ids is None for r in records)
    with pytest.raises(ValueError):
        GpuEngine.from_trace(trace, level="everything")


def test_free_queue_order_matches_vllm_test_prefill():
    """vLLM's ``test_prefill``: free req0 ``[1,2,3,4]`` then req1 ``[1,2,3,5]`` (sharing
    three cached blocks) and the free queue reads ``[5,4,6,7,8,9,10,3,2,1]``."""
    common = [i + 3 for i in range(3) for _ in range(16)]  # three full blocks of 16
    req0 = TraceRequest(id="0", max_tokens=1, prompt_len=55, prompt=tuple(common + [7] * 7), arrival_step=0)
    req1 = TraceRequest(id="1", max_tokens=1, prompt_len=53, prompt=tuple(common + [8] * 5), arrival_step=0)
    cfg = {"profile": "vllm-v1", "num_blocks": 11, "block_size": 16}
    engine = GpuEngine.from_trace(Trace(config=cfg, requests=[req0, req1]))
    engine.add_request(req0)
    engine.add_request(req1)
    rec = engine.step()
    assert rec.cache_hits == {"0": 0, "1": 48}  # same-step sharing (vLLM D2)
    assert [r for r, _ in rec.finished] == ["0", "1"]
    assert engine.sched.pool.queue.ids() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    # a third request with the same prefix hits the earliest cached blocks, evictable ones
    req2 = TraceRequest(id="2", max_tokens=1, prompt_len=49, prompt=tuple(common + [9]), arrival_step=1)
    engine.add_request(req2)
    rec = engine.step()
    assert rec.cache_hits == {"2": 48} and rec.evicted == [] and rec.num_free_blocks == 10
    # touch took 3,2,1 out; 5 was popped; on free 5 went back to the head and 3,2,1 to the tail
    assert engine.sched.pool.queue.ids() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_state_makes_the_same_decisions():
    for seed in range(SEED0, SEED0 + 40):
        trace = random_trace(seed)
        cpu, _ = replay(GpuEngine.from_trace(trace), trace)
        gpu, _ = replay(GpuEngine.from_trace(trace, device="cuda"), trace)
        assert first_divergence(cpu, gpu) is None, f"seed {seed}: {first_divergence(cpu, gpu)}"
