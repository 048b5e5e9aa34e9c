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


# --------------------------------------------------------------------------
# A CLI that explains itself (issue 14): version, exit codes, help for everything, 80 columns.
# --------------------------------------------------------------------------


def _subparsers():
    from batchspec.cli import build_parser

    parser = build_parser()
    return parser, next(a for a in parser._actions if a.dest == "command").choices


def test_version_names_the_installed_package():
    from importlib.metadata import version

    proc = batchspec("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"batchspec {version('batchspec')}"


def test_top_level_help_explains_the_exit_codes_and_where_to_start():
    proc = batchspec("--help")
    assert proc.returncode == 0
    text = proc.stdout
    assert "exit codes:" in text
    for code, words in (("0", "success"), ("1", "a finding"), ("2", "bad input")):
        assert any(line.strip().startswith(f"{code}  {words}") for line in text.splitlines()), (code, text)
    assert "FILE:LINE: FIELD: problem" in text and "batchspec run" in text and "batchspec fuzz" in text


def test_every_option_and_positional_of_every_command_has_help():
    import argparse

    parser, commands = _subparsers()
    missing = []
    for name, sub in commands.items():
        assert sub.description, name
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, missing


def test_engine_help_explains_module_factory_and_format_help_lists_its_choices():
    parser, commands = _subparsers()
    engines = [a for sub in commands.values() for a in sub._actions if "--engine" in a.option_strings]
    open_ended = [a for a in engines if a.choices is None]  # any engine name (replay, conform, fuzz)
    assert open_ended and all("MODULE:FACTORY" in a.help for a in open_ended)
    assert all(choice in a.help for a in engines if a.choices for choice in a.choices)
    formats = [a for sub in commands.values() for a in sub._actions if "--format" in a.option_strings]
    assert formats
    for action in formats:
        assert action.choices and all(choice in action.help for choice in action.choices), action.help


def test_help_fits_80_columns():
    _, commands = _subparsers()
    for command in ["", *commands]:
        proc = subprocess.run([sys.executable, "-m", "batchspec.cli", *([command] if command else []), "--help"],
                              capture_output=True, text=True, env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"})
        assert proc.returncode == 0, command
        long = [line for line in proc.stdout.splitlines() if len(line) > 80]
        assert not long, (command, long)


def test_tables_stay_whole_in_80_columns(tmp_path):
    """Nothing cut off with "…" and no line wider than the terminal; every column still there."""
    from batchspec.cli import example_path

    runs = {
        "run": ["run"],
        "profiles": ["profiles", "vllm-v1"],
        "simulate": ["simulate", str(example_path()), "--cost-model", "unit"],
        "sweep": ["sweep", str(example_path()), "--cost-model", "unit", "--rates", "0.5,1", "--jobs", "1",
                  "--profiles", "vllm-v1,vllm-v1:max_num_seqs=2"],
    }
    outputs = {}
    for name, argv in runs.items():
        proc = subprocess.run([sys.executable, "-m", "batchspec.cli", *argv], capture_output=True, text=True,
                              env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"})
        assert proc.returncode == 0, (name, proc.stderr)
        assert "…" not in proc.stdout, (name, proc.stdout)
        assert all(len(line) <= 80 for line in proc.stdout.splitlines()), name
        outputs[name] = proc.stdout
    step_header = next(line for line in outputs["run"].splitlines() if "step" in line and "batch" in line)
    assert "free" in step_header
    assert "A(max_tokens)" in outputs["run"] and "F(prompt_too_long)" in outputs["run"]  # wrapped between words, not inside
    assert "growth" in outputs["sweep"] and "preempt" in outputs["sweep"]  # the last columns are still there


def test_a_bad_option_is_one_line_naming_the_option():
    proc = batchspec("run", "--max-rows", "0")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "argument --max-rows: must be >= 1, got 0" in proc.stderr and "Traceback" not in proc.stderr
