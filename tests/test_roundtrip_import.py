"""Round trips: whatever `batchspec import` writes, every other command accepts.

Each bundled trace sample (batchspec/data/traces/) is imported, first rows only,
with the command a user would type; the written trace is then run by the spec
(with its decision log checked), replayed against gpu_engine and simulated in
modelled time.  Every command must exit 0: an imported trace that a command
refuses, or that replay blames on the engine, is a bug in one of them.
"""
import pytest

from batchspec.cli import main
from batchspec.data import trace_samples
from spec.io import load_trace

#: Rows imported from each sample: enough for queueing, preemption and rejections, quick to run.
ROWS = 10
#: Length-only tables have no arrival times; the importer needs a rate for them.
LENGTH_TABLES = ("sharegpt_8k_lengths_llama2_tokenizer.csv", "arxiv_summarization_lengths_llama2_tokenizer.csv")


def test_every_sample_is_bundled():
    names = {p.name for p in trace_samples()}
    assert len(names) == 8 and set(LENGTH_TABLES) <= names


def batchspec(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("sample", trace_samples(), ids=lambda p: p.name)
def test_imported_sample_runs_replays_and_simulates(sample, tmp_path, capsys):
    trace_path = tmp_path / "imported.jsonl"
    rate = ["--rate", "2"] if sample.name in LENGTH_TABLES else []
    code, out = batchspec(capsys, "import", sample, "--first", ROWS, *rate, "-o", trace_path)
    assert code == 0, out
    trace = load_trace(trace_path)
    assert len(trace.requests) == ROWS
    # both clocks are written: seconds for the simulator, steps for the step-by-step commands
    assert all(r.arrival_time is not None and r.arrival_step is not None for r in trace.requests)
    assert [r.arrival_step for r in trace.requests] == sorted(r.arrival_step for r in trace.requests)

    log = tmp_path / "spec.log.jsonl"
    code, out = batchspec(capsys, "run", trace_path, "--log", log)
    assert code == 0, out
    code, out = batchspec(capsys, "check-log", log, "--trace", trace_path)
    assert code == 0, out
    code, out = batchspec(capsys, "replay", trace_path, "--engine", "gpu")
    assert code == 0 and "agree" in out, out
    code, out = batchspec(capsys, "simulate", trace_path)
    assert code == 0 and "TTFT" in out, out


def test_step_seconds_sets_the_step_clock(tmp_path, capsys):
    sample = next(p for p in trace_samples() if p.name == "burstgpt_1_first400.csv")
    one, tenth = tmp_path / "one.jsonl", tmp_path / "tenth.jsonl"
    assert batchspec(capsys, "import", sample, "--first", 5, "-o", one)[0] == 0
    assert batchspec(capsys, "import", sample, "--first", 5, "--step-seconds", "0.1", "-o", tenth)[0] == 0
    a, b = load_trace(one).requests, load_trace(tenth).requests
    assert [r.arrival_time for r in a] == [r.arrival_time for r in b]
    assert [r.arrival_step for r in b] == [10 * r.arrival_step for r in a]
    assert a[-1].arrival_step == pytest.approx(a[-1].arrival_time, abs=1)


def test_arrivals_beyond_max_steps_are_refused_before_writing(tmp_path, capsys):
    sample = next(p for p in trace_samples() if p.name == "burstgpt_1_first400.csv")
    out = tmp_path / "t.jsonl"
    code, text = batchspec(capsys, "import", sample, "--first", 50, "--set", "max_steps=100", "-o", out)
    assert code == 2 and "--step-seconds" in text and "max_steps" in text
    assert not out.exists()
    for bad in ("0", "-1", "nan", "inf"):
        code, text = batchspec(capsys, "import", sample, "--first", 5, "--step-seconds", bad, "-o", out)
        assert code == 2 and "--step-seconds" in text and not out.exists()
