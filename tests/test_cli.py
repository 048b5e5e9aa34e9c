"""The command line as a user runs it."""
import json
import subprocess
import sys

from spec.io import load_log


def batchspec(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "batchspec.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env={"COLUMNS": "160", "PATH": "/usr/bin:/bin"})


def test_run_bundled_example_prints_the_step_table_and_writes_a_log(tmp_path):
    proc = batchspec("run", "--log", str(tmp_path / "log.jsonl"))
    assert proc.returncode == 0, proc.stderr
    assert "quickstart" in proc.stdout and "A:10p B:6p" in proc.stdout
    log = load_log(tmp_path / "log.jsonl")
    assert log.level == "exact" and log.records[0].reasons
    rules = {r["rule"] for rec in log.records for r in rec.reasons}
    # the example exercises these mechanisms on purpose
    assert {"ADMIT.NEW", "ADMIT.RESUMED", "PREEMPT.VICTIM_NEWEST", "REJECT.PROMPT_TOO_LONG", "ABORT.FREE", "STOP.EOS"} <= rules


def test_explain_tells_a_requests_story():
    from batchspec.cli import example_path

    proc = batchspec("explain", str(example_path()), "C")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "PREEMPT.VICTIM_NEWEST" in out and "ADMIT.RESUMED" in out and "STOP.LENGTH" in out
    assert out.index("PREEMPT.VICTIM_NEWEST") < out.index("ADMIT.RESUMED")


def test_explain_unknown_request_is_bad_input():
    from batchspec.cli import example_path

    proc = batchspec("explain", str(example_path()), "nope")
    assert proc.returncode == 2 and "no request with id 'nope'" in proc.stderr


def test_profiles_lists_every_knob():
    from spec.config import knob_names

    proc = batchspec("profiles", "vllm-v1")
    assert proc.returncode == 0
    for knob in knob_names():
        assert knob in proc.stdout


def test_missing_file_is_bad_input(tmp_path):
    proc = batchspec("run", str(tmp_path / "nope.jsonl"))
    assert proc.returncode == 2 and "nope.jsonl:0: (file):" in proc.stderr.replace("\n", "")


def test_fuzz_set_refuses_an_unknown_knob_and_fixes_known_ones(tmp_path):
    bad = batchspec("fuzz", "--traces", "1", "--set", "no_such_knob=1", "--corpus", str(tmp_path))
    assert bad.returncode == 2 and "no_such_knob" in bad.stderr
    from fuzz.campaign import CampaignConfig, _round_tasks, CampaignState

    cfg = CampaignConfig(traces=16, profile="naive", knobs={"policy": "priority"})
    tasks = _round_tasks(cfg, CampaignState(seed=0, engine="gpu", level="exact"), ["QUEUE.FCFS"])
    assert tasks and all(t.options["policy"] == "priority" and t.options["profile"] == "naive" for t in tasks)
