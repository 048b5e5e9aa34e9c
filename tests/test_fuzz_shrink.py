"""Shrinking and the findings corpus, on a planted bug in a copy of the spec."""
from fuzz.corpus import corpus_traces, log_path, save_finding, slug
from fuzz.generate import random_trace
from fuzz.replay import replay, replay_records
from fuzz.shrink import shrink, signature
from spec.io import load_log, load_trace
from spec.scheduler import SpecEngine


class KeepsComputedTokens(SpecEngine):
    """Planted bug (LMD-02): a preempted request keeps its computed-token count."""

    name = "mutant"

    def _preempt(self, req, out):
        kept = req.num_computed_tokens
        super()._preempt(req, out)
        req.num_computed_tokens = kept


def mutant_replay(trace):
    return replay(trace, KeepsComputedTokens.from_trace(trace), "exact")


def first_failing_trace():
    for seed in range(500):
        trace = random_trace(seed, tight_memory=True)
        try:
            result = mutant_replay(trace)
        except Exception:  # the mutant may break the spec's own bookkeeping: also a finding
            continue
        if not result.agreed and result.divergence.kind == "decision":
            return trace, result
    raise AssertionError("no seed exposes the planted bug")


def test_shrink_keeps_the_signature_and_gets_small():
    trace, result = first_failing_trace()
    sig = signature(result.divergence)
    small, tries = shrink(trace, lambda t: (not (r := mutant_replay(t)).agreed) and signature(r.divergence) == sig, seconds=60)
    assert tries > 0
    assert len(small.requests) <= min(6, len(trace.requests))
    again = mutant_replay(small)
    assert signature(again.divergence) == sig
    # the shrunk trace is no larger than the original in any request
    assert sum(r.prompt_len for r in small.requests) <= sum(r.prompt_len for r in trace.requests)


def test_corpus_saves_once_per_signature_and_replays(tmp_path):
    trace, _ = first_failing_trace()
    result = mutant_replay(trace)
    sig = signature(result.divergence)
    path = save_finding(tmp_path, result, sig, provenance="planted bug LMD-02")
    assert path is not None and path.name == slug(sig) + ".jsonl"
    assert save_finding(tmp_path, result, sig) is None  # once per signature
    assert corpus_traces(tmp_path) == [path]
    report = (tmp_path / f"{slug(sig)}.md").read_text()
    assert result.divergence.field in report and "batchspec replay" in report
    # the saved engine log still diverges from the spec; the spec itself agrees with the spec
    saved = load_trace(path)
    log = load_log(log_path(tmp_path, result.engine, slug(sig)))
    assert not replay_records(saved, log.records).agreed
    assert replay(saved, "spec").agreed


def test_each_reduction_is_kept_and_the_next_candidates_start_from_it():
    """A failure that needs max_tokens >= 7 and a prompt of >= 5 tokens: the shrinker lands on
    exactly those values in a few dozen tries (a candidate drawn from the request as it was
    before a reduction would undo it, and the shrinker would then creep down one token a pass)."""
    from spec.formats import Trace, TraceRequest

    trace = Trace(config={"profile": "vllm-v1", "num_blocks": 64, "block_size": 4},
                  requests=[TraceRequest(id="A", arrival_step=0, prompt_len=60, max_tokens=50)])
    fails = lambda t: any(r.max_tokens >= 7 and r.prompt_len >= 5 for r in t.requests)
    small, tries = shrink(trace, fails, max_tries=80)
    (req,) = small.requests
    assert (req.max_tokens, req.prompt_len) == (7, 5) and tries < 80


def test_a_shrunk_trace_always_reads_back(tmp_path):
    """The shrinker lowers max_tokens; a request's min_tokens follows it down, since a trace file whose
    min_tokens exceed max_tokens is refused when read (the report's replay command would exit 2)."""
    import dataclasses

    from spec.io import write_trace

    trace = random_trace(3)
    trace = dataclasses.replace(trace, requests=[dataclasses.replace(r, min_tokens=r.max_tokens) for r in trace.requests])
    small, _ = shrink(trace, lambda t: True, max_tries=400)  # (everything fails: as small as it gets)
    assert all(r.min_tokens <= r.max_tokens for r in small.requests)
    assert min(r.max_tokens for r in small.requests) < max(r.max_tokens for r in trace.requests)  # it did shrink them
    write_trace(small, tmp_path / "small.jsonl")
    assert len(load_trace(tmp_path / "small.jsonl").requests) == len(small.requests)
