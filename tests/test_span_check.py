"""The decode-span check: a campaign against gpu_engine also runs its simulator fast path (decode spans,
bulk tokens, the prompt cache), which a lock-step replay never takes, against the spec's simulation."""
import sys
from pathlib import Path

import pytest

import fuzz.campaign as campaign
from fuzz.campaign import Task, checks_spans
from fuzz.generate import random_trace
from fuzz.sim_engine import span_divergence

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import mutation_score as ms  # noqa: E402  (its planting mechanism: one line of one method changed)

#: A planted bug in the fast path only: a span's requests end it holding one block too many.
SPAN_BLOCKS = next(m for m in ms.MUTANTS if m.name == "span_blocks_one_more")
SEEDS = range(40)


def test_the_fast_path_equals_the_spec_on_fuzz_traces():
    assert [s for s in SEEDS if span_divergence(random_trace(s, max_steps=2000)) is not None] == []


def test_a_fast_path_bug_is_found_with_the_step_and_quantity_it_changes():
    with ms.planted(SPAN_BLOCKS):
        found = [(s, span_divergence(random_trace(s, max_steps=2000))) for s in SEEDS]
    found = [(s, d) for s, d in found if d is not None]
    assert found, "the planted decode-span bug went unseen on 40 traces"
    seed, d = found[0]
    assert d.kind == "span" and d.engine == "gpu_engine" and d.step >= 0
    assert d.spec_value != d.engine_value and d.field in d.reason
    # the lock-step replay of the same trace agrees: it never takes the fast path
    from fuzz.replay import replay
    with ms.planted(SPAN_BLOCKS):
        assert replay(random_trace(seed, max_steps=2000), "gpu", "exact").agreed


def test_one_trace_in_span_check_every_of_a_gpu_campaign_runs_the_check():
    tasks = [Task(i, i, {}, engine, "exact", 0) for engine in ("gpu", "vllm") for i in range(64)]
    checked = [t for t in tasks if checks_spans(t)]
    assert {t.engine for t in checked} == {"gpu"}
    assert len(checked) == 64 // campaign.SPAN_CHECK_EVERY


def test_a_campaign_reports_a_fast_path_bug_with_the_command_that_shows_it(tmp_path):
    reports = ms.first_reports(SPAN_BLOCKS, str(tmp_path))
    names = [n for n in reports if n.startswith("span-")]
    assert names, f"no span finding: {list(reports)}"
    report = reports[names[0]]
    assert f"batchspec simulate {tmp_path / names[0]}.jsonl --engine gpu --check-engine full --cost-model unit" in report
    assert "**engine-bug**" in report and "decode-span divergence at step" in report


@pytest.mark.parametrize("seed", [3, 5])
def test_the_check_command_agrees_on_an_unplanted_trace(tmp_path, seed):
    from batchspec.cli import main
    from spec.io import write_trace

    path = tmp_path / "t.jsonl"
    write_trace(random_trace(seed, max_steps=2000), str(path))
    assert main(["simulate", str(path), "--engine", "gpu", "--check-engine", "full", "--cost-model", "unit"]) == 0


def test_a_rolled_back_draft_is_simulated_alike_by_the_spec_and_gpu_engine():
    """The span check's first real finding (``batchspec fuzz --seed 11``, trace 1504): the spec's
    simulator counted a rejected draft as computed (its BatchTracker saw one sampled token, not the
    rollback), so the decode after it was taken for a prefill, and its step cost more."""
    from spec.formats import Trace, TraceRequest
    from fuzz.sweep import run_one, with_arrival_times
    from spec.config import resolve
    from spec.costmodel import preset

    trace = Trace(config={"profile": "vllm-v1", "block_size": 8, "enable_prefix_caching": False, "max_model_len": 7,
                          "max_num_batched_tokens": 2, "max_num_seqs": 1, "num_speculative_tokens": 1,
                          "spec_cache_at_output": True, "num_blocks": 2},
                  requests=[TraceRequest(id="A", arrival_step=0, prompt_len=4, max_tokens=3, spec_accept_rate=0.3)])
    assert span_divergence(trace) is None
    sim = run_one(with_arrival_times(trace), resolve(trace.config), preset("unit"))
    # steps: 2 prompt tokens, 2 more (it samples), a decode with its draft (2 tokens, rejected), a decode
    assert (sim.prefill_tokens, sim.decode_tokens) == (6, 1)
