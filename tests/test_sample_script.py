"""Token values: SAMPLE.SCRIPTED (a scheduler-only engine samples the trace's script, compared by the
replay) and SAMPLE.MIN_TOKENS_MASKED (no stop token among the first min_tokens outputs, on any log)."""
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import fuzz.engines  # noqa: F401  (registers gpu)
from fuzz.generate import random_trace
from fuzz.replay import make_engine, replay
from gpu_engine.engine import GpuEngine
from invariants.log_checker import check_log
from spec.config import resolve
from spec.formats import DEFAULT_EOS_TOKEN_ID, DecisionLog, Trace, TraceRequest
from spec.scheduler import run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import mutation_score as ms  # noqa: E402  (its planting mechanism: one line of one method changed)

CONFIG = {"profile": "vllm-v1", "num_blocks": 64, "block_size": 4, "max_num_batched_tokens": 64}


def _trace(**request) -> Trace:
    fields = {"id": "A", "arrival_step": 0, "prompt_len": 6, "max_tokens": 8, **request}
    return Trace(config=dict(CONFIG), requests=[TraceRequest(**fields), TraceRequest(id="B", arrival_step=1, prompt_len=5, max_tokens=6)])


#: The planted sampler bug of the mutation score: each request samples the token of its *next* output index.
INDEX_AHEAD = next(m for m in ms.MUTANTS if m.name == "sample_index_ahead")


def test_gpu_engine_declares_that_it_samples_the_script_only_without_a_model():
    trace = _trace()
    assert make_engine("gpu", trace).samples_script is True
    assert GpuEngine.from_trace(trace, model="tiny").samples_script is False


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_correct_engine_agrees_token_for_token(seed):
    result = replay(random_trace(seed), "gpu", "exact")
    assert result.agreed, result.describe()


def test_a_sampler_that_reads_the_wrong_output_index_is_named_at_its_first_token():
    trace = _trace()
    with ms.planted(INDEX_AHEAD):
        result = replay(trace, "gpu", "exact")
    d = result.divergence
    assert d is not None and d.rule == "SAMPLE.SCRIPTED" and d.field == "sampled"
    assert d.step == 0 and d.request == "A"  # its prompt fits the budget: it samples output 0 in step 0
    assert d.spec_value == {"A": trace.requests[0].output_token(0, trace.vocab_size, trace.eos_token_id)}
    assert d.engine_value == {"A": trace.requests[0].output_token(1, trace.vocab_size, trace.eos_token_id)}


def test_the_same_bug_is_invisible_when_the_spec_takes_the_engines_tokens():
    # what the replay did before SAMPLE.SCRIPTED, and still does for an engine running a model
    trace = _trace()
    with ms.planted(INDEX_AHEAD):
        engine = make_engine("gpu", trace)
        engine.samples_script = False
        assert replay(trace, engine, "exact").agreed


def _eos_at(index: int, min_tokens: int) -> Trace:
    tokens = [7] * 8
    tokens[index] = DEFAULT_EOS_TOKEN_ID
    return _trace(output_tokens=tuple(tokens), min_tokens=min_tokens)


def test_a_stop_token_inside_min_tokens_breaks_the_invariant_on_any_log():
    # the log of a run without min_tokens (A stops on EOS at output 1), checked against the same trace
    # with min_tokens=3: the sampler should have masked that EOS (a VLLM-24 / TRT-09 class bug)
    unmasked = run(_eos_at(1, 0))
    assert ("A", "eos") in [f for r in unmasked for f in r.finished]
    strict = _eos_at(1, 3)
    found = [v for v in check_log(DecisionLog("engine", "exact", unmasked), resolve(strict.config), strict).violations]
    assert [(v.invariant, v.request) for v in found] == [("SAMPLE.MIN_TOKENS_MASKED", "A")]
    assert "output 1" in found[0].evidence


def test_a_stop_token_at_min_tokens_is_allowed():
    trace = _eos_at(3, 3)  # EOS is the 4th output: min_tokens=3 outputs exist before it
    records = run(trace)
    assert ("A", "eos") in [f for r in records for f in r.finished]
    assert check_log(DecisionLog("spec", "exact", records), resolve(trace.config), trace).violations == []


def test_the_spec_masks_a_scripted_stop_token_inside_min_tokens():
    trace = _eos_at(1, 3)
    records = run(trace)
    outputs = [r.sampled["A"] for r in records if "A" in r.sampled]
    assert DEFAULT_EOS_TOKEN_ID not in outputs[:3] and len(outputs) == 8  # masked: it runs to max_tokens
    assert check_log(DecisionLog("spec", "exact", records), resolve(trace.config), trace).violations == []


def test_ignore_eos_leaves_eos_unmasked_but_not_stop_tokens():
    ignoring = replace(_eos_at(1, 3).requests[0], ignore_eos=True)
    assert ignoring.output_token(1, 256, DEFAULT_EOS_TOKEN_ID) == DEFAULT_EOS_TOKEN_ID
    stop = replace(ignoring, output_tokens=(7, 9, 7), stop_token_ids=(9,))
    assert stop.output_token(1, 256, DEFAULT_EOS_TOKEN_ID) != 9
