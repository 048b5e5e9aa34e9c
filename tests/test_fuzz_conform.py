"""Conformance runs: the report, its per-area table and the command's exit status."""
from __future__ import annotations

import json

from fuzz.conform import conform_command, render_markdown, render_table, run_conformance
from fuzz.generate import FEATURES


def test_spec_conforms_to_itself_and_the_table_adds_up():
    report = run_conformance(40, seed=7, level="exact", engine="spec", progress=False)
    assert report.n_traces == 40 and report.all_agreed and not report.divergent
    areas = report.areas()
    assert list(areas)[: len(FEATURES)] == list(FEATURES) and areas["all"].traces == 40
    assert all(a.agreed == a.traces for a in areas.values())
    assert areas["fcfs"].traces + areas["priority"].traces == 40
    assert [o.seed for o in report.outcomes] == list(range(7, 47))
    assert "| **all** | 40 | 40 | 100.0 |" in render_markdown(report)
    assert render_table(report).row_count == len(areas)


def test_report_counts_divergences(monkeypatch):
    import fuzz.conform as conform
    from fuzz.conform import TraceOutcome

    real = conform.check_one

    def flaky(seed, engine, level):
        out = real(seed, engine, level)
        if seed % 5 == 0:
            out.agreed, out.divergence, out.explanation = False, {"step": 1, "field": "scheduled"}, "planted"
        return out

    monkeypatch.setattr(conform, "check_one", flaky)
    report = run_conformance(10, seed=0, engine="spec", progress=False)
    assert [o.seed for o in report.divergent] == [0, 5]
    assert report.areas()["all"].agreed == 8 and not report.all_agreed
    assert report.to_json()["divergences"][0]["seed"] == 0
    assert isinstance(report.outcomes[0], TraceOutcome)


def test_conform_command(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert conform_command("spec", traces=12, seed=3, json_path=str(out), progress=False) == 0
    data = json.loads(out.read_text())
    assert data["traces"] == 12 and data["agreed"] == 12
    assert data["command"] == "batchspec conform --engine spec --traces 12 --seed 3 --level exact"
    assert "12/12 traces agree" in capsys.readouterr().out
    assert conform_command("spec", traces=0) == 2
    assert conform_command("no-such-engine", traces=2, progress=False) == 2


CAPS = __import__("pathlib").Path(__file__).parent.parent / "examples" / "vllm-v1-async.capabilities.json"


def _conform_cli(*argv: str, columns: int = 40):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "batchspec.cli", "conform", "--no-progress", *argv], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "COLUMNS": str(columns)})


def test_the_reproduction_command_names_the_capabilities_file(tmp_path):
    """Run with --capabilities FILE, the printed command (and the JSON's) draws the same traces: it names FILE,
    and the summary line stays one line in a narrow terminal."""
    proc = _conform_cli("--engine", "spec", "--traces", "2", "--capabilities", str(CAPS), "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stderr
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("2/2 traces agree (batchspec conform --engine spec")
    assert summary.endswith(f"--capabilities {CAPS})")
    assert json.loads((tmp_path / "r.json").read_text())["command"].endswith(f"--capabilities {CAPS}")


def test_without_capabilities_the_command_has_none(tmp_path):
    proc = _conform_cli("--engine", "spec", "--traces", "1")
    assert "--capabilities" not in proc.stdout and proc.returncode == 0


def test_conform_errors_are_one_line_in_a_narrow_terminal(tmp_path):
    bad = tmp_path / "caps.json"
    bad.write_text('{"knobs": {"policy": ["nosuch"]}}')
    for argv in (["--engine", "nosuch", "--traces", "2"], ["--engine", "spec", "--traces", "2", "--capabilities", str(bad)]):
        proc = _conform_cli(*argv, columns=20)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
