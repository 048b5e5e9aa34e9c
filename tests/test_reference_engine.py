"""The reference engine: invariance of a request's tokens, protocol, logs, sampling."""
from __future__ import annotations

import collections

import pytest
import torch

from reference.engine import ReferenceEngine, generate_alone, torch_threads
from reference.model import TinyLlama, TinyLlamaConfig
from reference.sampling import SamplingParams, sample, token_seed
from spec.formats import DecisionLog, Trace, TraceRequest
from spec.io import load_log, write_log
from spec.protocol import Engine, drive
from spec.scheduler import SpecEngine


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: one torch thread is faster, and immune to a busy shared CPU."""
    with torch_threads(1):
        yield


MODEL = TinyLlama.from_seed(TinyLlamaConfig(), seed=0)
SEEDED = SamplingParams(temperature=1.0, top_k=100, top_p=0.95, seed=7)

# The request under study: 37-token prompt whose first 16 tokens are group "g"'s shared prefix.
X = TraceRequest(id="x", prompt_len=37, max_tokens=24, prefix_group="g", prefix_len=16, ignore_eos=True, arrival_step=1)


def others(n: int, step: int = 0, prompt_len: int = 20, max_tokens: int = 30, **kw) -> list[TraceRequest]:
    return [TraceRequest(id=f"o{i}", prompt_len=prompt_len + 3 * i, max_tokens=max_tokens, arrival_step=step, **kw)
            for i in range(n)]


def make_trace(requests, **knobs) -> Trace:
    config = {"profile": "vllm-v1", "block_size": 4, "num_blocks": 512, "max_num_batched_tokens": 512, **knobs}
    return Trace(config=config, requests=requests, vocab_size=512)


#: name -> (trace, what its records must show about x for the scenario to be what it claims)
SCENARIOS = {
    "alone": (make_trace([X]), lambda recs: ("x", 37) in recs[0].scheduled),
    "crowded": (make_trace(others(7, step=1) + [X], max_num_seqs=8),
                lambda recs: any(len(r.scheduled) == 8 for r in recs)),
    "chunked": (make_trace([X], max_num_batched_tokens=8),
                lambda recs: [n for r in recs[:5] for _, n in r.scheduled] == [8, 8, 8, 8, 5]),
    "preempted": (make_trace(others(2) + [X], num_blocks=34, max_num_batched_tokens=64),
                  lambda recs: any("x" in r.preempted for r in recs) and any("x" in r.resumed for r in recs)),
    "prefix-hit": (make_trace([TraceRequest(id="y", prompt_len=20, max_tokens=3, prefix_group="g", prefix_len=16,
                                            arrival_step=0), X]),
                   lambda recs: any((r.cache_hits or {}).get("x", 0) >= 16 for r in recs)),
    "all-at-once": (make_trace(others(5, step=0) + [X], num_blocks=40, max_num_batched_tokens=12,
                               long_prefill_token_threshold=6),
                    lambda recs: any("x" in r.preempted for r in recs)
                    and any(("x", 6) in r.scheduled for r in recs)),
}


def run(trace: Trace, sampling=None, **kw):
    engine = ReferenceEngine.from_trace(trace, model=MODEL, sampling=sampling, **kw)
    return engine, drive(engine, trace, max_steps=5000)


@pytest.mark.parametrize("sampling", [None, SEEDED], ids=["greedy", "seeded"])
def test_tokens_do_not_depend_on_batch_chunking_or_preemption(sampling):
    """x's output tokens equal a plain whole-prompt-then-decode run of x alone, in every scenario."""
    want = generate_alone(MODEL, X.prompt_token_ids(512), X.max_tokens, sampling or SamplingParams(), "x")
    assert len(want) == X.max_tokens
    for name, (trace, shows) in SCENARIOS.items():
        engine, records = run(trace, sampling)
        assert shows(records), f"scenario {name!r} does not exercise what it claims"
        assert engine.outputs["x"] == want, name
        assert engine.caches == {}, name  # every cache dropped once its request finished


def test_seeded_sampling_samples():
    """Seeded runs differ from greedy and between seeds, and repeat exactly for one seed."""
    prompt = X.prompt_token_ids(512)
    greedy = generate_alone(MODEL, prompt, 24)
    a = generate_alone(MODEL, prompt, 24, SEEDED, "x")
    b = generate_alone(MODEL, prompt, 24, SamplingParams(temperature=1.0, top_k=100, top_p=0.95, seed=8), "x")
    assert a == generate_alone(MODEL, prompt, 24, SEEDED, "x")
    assert a != greedy and a != b
    assert generate_alone(MODEL, prompt, 24, SamplingParams(temperature=1.0, top_k=1, seed=3), "x") == greedy


def test_sampler_follows_its_distribution():
    """Inverse-CDF draws reproduce softmax(logits / T) after the top-k and top-p cuts."""
    logits = torch.log(torch.tensor([0.1, 0.5, 0.05, 0.3, 0.05], dtype=torch.float64))
    draws = 4000

    def freq(params):
        counts = collections.Counter(sample(logits, params, "q", i) for i in range(draws))
        return {t: c / draws for t, c in counts.items()}

    full = freq(SamplingParams(temperature=1.0))
    for token, p in enumerate([0.1, 0.5, 0.05, 0.3, 0.05]):
        assert abs(full.get(token, 0) - p) < 0.03
    top2 = freq(SamplingParams(temperature=1.0, top_k=2))
    assert set(top2) == {1, 3} and abs(top2[1] - 0.5 / 0.8) < 0.03
    nucleus = freq(SamplingParams(temperature=1.0, top_p=0.85))  # 0.5 + 0.3 < 0.85 <= 0.5 + 0.3 + 0.1
    assert set(nucleus) == {0, 1, 3}
    assert set(freq(SamplingParams(temperature=1.0, top_p=0.4))) == {1}
    cold = freq(SamplingParams(temperature=0.05))
    assert cold.get(1, 0) > 0.99
    assert sample(logits, SamplingParams(), "q", 0) == 1
    assert token_seed(0, "a", 1) != token_seed(0, "a", 2) != token_seed(1, "a", 2)


def test_engine_protocol_and_log_levels(tmp_path):
    trace, _ = SCENARIOS["preempted"]
    engine, records = run(trace, level="memory")
    assert isinstance(engine, Engine) and engine.name == "reference"
    assert all(r.num_free_blocks is not None and r.block_ids is None and r.reasons is None for r in records)
    assert {rid for r in records for rid in r.sampled} == {"o0", "o1", "x"}
    write_log(DecisionLog(engine="reference", level="memory", records=records), tmp_path / "log.jsonl")
    back = load_log(tmp_path / "log.jsonl")
    assert [r.to_json("memory") for r in back.records] == [r.to_json("memory") for r in records]
    _, plain = run(trace, level="decisions")
    assert all(r.num_free_blocks is None and r.blocks is None for r in plain)
    assert [r.to_json("decisions") for r in plain] == [r.to_json("decisions") for r in records]


class FedSpec:
    """The spec alone, fed the tokens another engine sampled at each step."""

    name = "spec-fed"

    def __init__(self, trace: Trace, tokens: list[dict[str, int]]):
        self.spec, self.tokens = SpecEngine.from_trace(trace, check_invariants=True), iter(tokens)

    def add_request(self, r):
        self.spec.add_request(r)

    def abort_request(self, rid):
        self.spec.abort_request(rid)

    def has_unfinished_requests(self):
        return self.spec.has_unfinished_requests()

    def step(self):
        self.spec.feed(next(self.tokens))
        return self.spec.step()


@pytest.mark.parametrize("name", ["preempted", "prefix-hit", "all-at-once"])
def test_decisions_are_the_specs(name):
    """Given the reference's tokens, the spec alone makes exactly the reference's decisions."""
    trace, _ = SCENARIOS[name]
    _, records = run(trace, SEEDED, check_invariants=True)
    alone = drive(FedSpec(trace, [r.sampled for r in records]), trace, max_steps=5000)
    for r in alone:
        r.reasons = None  # the spec's own annotations, not part of an engine's log
    assert [r.to_json("memory") for r in records] == [r.to_json("memory") for r in alone]


def test_eos_aborts_and_rejections():
    """EOS stops a request (unless it ignores EOS); aborts and rejections drop all state."""
    prompt = X.prompt_token_ids(512)
    first = generate_alone(MODEL, prompt, 1)[0]
    reqs = [TraceRequest(id="e", prompt=tuple(prompt), prompt_len=37, max_tokens=10, arrival_step=0),
            TraceRequest(id="i", prompt=tuple(prompt), prompt_len=37, max_tokens=10, arrival_step=0, ignore_eos=True),
            TraceRequest(id="a", prompt_len=30, max_tokens=50, arrival_step=0, abort_at=4),
            TraceRequest(id="big", prompt_len=600, max_tokens=5, arrival_step=1)]
    trace = make_trace(reqs, max_model_len=512)
    trace.eos_token_id = first
    engine, records = run(trace)
    finished = dict(f for r in records for f in r.finished)
    assert finished["e"] == "eos" and engine.outputs["e"] == [first]
    assert finished["i"] == "max_tokens" and len(engine.outputs["i"]) == 10
    assert any("a" in r.aborted for r in records) and "a" not in finished
    assert any(rid == "big" for r in records for rid, _ in r.rejected) and engine.outputs["big"] == []
    assert engine.caches == {} and not engine.has_unfinished_requests()


def test_vocabulary_must_cover_the_trace():
    trace = make_trace([X])
    trace.vocab_size = 1000
    with pytest.raises(ValueError, match="vocab_size 1000 exceeds the model's 512"):
        ReferenceEngine.from_trace(trace, model=MODEL)
    engine = ReferenceEngine.from_trace(trace)  # the default tiny model widens its vocabulary
    assert engine.model.config.vocab_size == 1000
