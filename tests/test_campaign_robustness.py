"""Campaigns that fail safe (#14) and report early (#18, #20).

* bad options are refused before any work, one line, exit 2;
* workers die with their parent whatever kills it (kill -9), and ignore Ctrl-C: the
  parent prints one line and exits 130;
* a ``--resume`` state that is missing, empty, truncated, foreign, of another
  campaign or of the wrong types is refused with its field named;
* a report writer that crashes keeps what it can, the campaign goes on, and
  ``--resume`` writes the missing report;
* a finding is written the moment it is shrunk; a divergence whose signature an
  earlier trace already reports is counted, not shrunk; ``--max-findings``; the
  time to the first finding is in the state.

The process tests are Linux-only (they read /proc) and take a few seconds each.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fuzz.campaign as campaign
from fuzz.campaign import (
    INCOMPLETE,
    CampaignConfig,
    CampaignState,
    StateError,
    run_campaign,
    state_path,
    validate_options,
)
from fuzz.replay import ENGINES, register_engine, replay_command
from spec.io import OptionError, write_trace
from spec.scheduler import SpecEngine

ROOT = Path(__file__).resolve().parents[1]
LINUX = sys.platform.startswith("linux")


class WrongVictim(SpecEngine):
    """Planted bug (LMD-01): under FCFS the victim is the oldest running request."""

    name = "robust-wrong-victim"

    def _schedule_running(self, out, scheduled, budget, cap):
        import spec.scheduler as s

        real = s.fcfs_victim
        s.fcfs_victim = lambda running: running[0]
        try:
            return super()._schedule_running(out, scheduled, budget, cap)
        finally:
            s.fcfs_victim = real


class NoneIds(SpecEngine):
    """An engine whose log names a finished request ``None`` (it crashed the report writer)."""

    name = "robust-none-ids"

    def step(self):
        record = super().step()
        if record.finished:
            record.finished = [(None, reason) for _, reason in record.finished]
        return record


register_engine("robust-wrong-victim", lambda t: WrongVictim.from_trace(t))
register_engine("robust-none-ids", lambda t: NoneIds.from_trace(t))


def _cfg(tmp_path, **kw) -> CampaignConfig:
    return CampaignConfig(**{"seed": 3, "engine": "robust-wrong-victim", "workers": 1, "corpus": str(tmp_path),
                             "shrink_tries": 8, "profile": None, **kw})


# -- options ----------------------------------------------------------------------


@pytest.mark.parametrize("option, bad", [
    ("--seconds", {"seconds": float("nan")}), ("--seconds", {"seconds": -1.0}), ("--seconds", {"seconds": float("inf")}),
    ("--workers", {"workers": -1}), ("--workers", {"workers": 0}), ("--workers", {"workers": 10**9}),
    ("--timeout", {"timeout": -1.0}), ("--timeout", {"timeout": 0}), ("--timeout", {"timeout": float("nan")}),
    ("--traces", {"traces": -5}), ("--traces", {"traces": True}), ("--max-findings", {"max_findings": 0}),
    ("--shard", {"shard": (2, 2)}), ("--level", {"level": "bogus"}), ("--profile", {"profile": "bogus"}),
    ("--engine", {"engine": "bogus"}), ("--engine", {"engine": "no_such_module:factory"}),
    ("--engine", {"engine": "json:loads"}),  # importable, but raises when constructed
    ("--set", {"knobs": {"num_blocks": 0}}), ("--set", {"knobs": {"block_size": 0}}),
    ("--set", {"knobs": {"max_num_seqs": 0}}), ("--set", {"knobs": {"watermark": float("nan")}}),
    ("--set", {"knobs": {"no_such_knob": 1}}),
])
def test_bad_options_are_refused_before_any_work(tmp_path, option, bad):
    corpus = tmp_path / "corpus"
    with pytest.raises(OptionError) as e:
        validate_options(CampaignConfig(**{"engine": "spec", "corpus": str(corpus), "traces": 16, **bad}))
    assert e.value.option == option and "\n" not in str(e.value)
    assert not corpus.exists()  # nothing was started


def test_the_cli_refuses_an_unknown_engine_in_one_line_before_the_campaign(tmp_path):
    out = subprocess.run([sys.executable, "-m", "batchspec.cli", "fuzz", "--engine", "bogus", "--traces", "16",
                          "--corpus", str(tmp_path / "c")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "--engine" in lines[0] and "bogus" in lines[0]
    assert not (tmp_path / "c").exists()


# -- --resume states --------------------------------------------------------------


def _good_state(cfg: CampaignConfig) -> dict:
    return json.loads(json.dumps(CampaignState(cfg.seed, cfg.engine, cfg.level, cfg.shard, profile=cfg.profile,
                                               knobs=dict(cfg.knobs)).__dict__))


CORRUPTIONS = {
    "empty": ("file", lambda good: ""),
    "truncated": ("file", lambda good: json.dumps(good)[:40]),
    "a list": ("file", lambda good: "[1, 2]"),
    "foreign JSON": ("format", lambda good: json.dumps({"format": "batchspec-trace", "version": 1})),
    "another seed": ("seed", lambda good: json.dumps({**good, "seed": 99})),
    "another engine": ("engine", lambda good: json.dumps({**good, "engine": "gpu"})),
    "other knobs": ("knobs", lambda good: json.dumps({**good, "knobs": {"policy": "priority"}})),
    "covered as a string": ("covered", lambda good: json.dumps({**good, "covered": "ADMIT.NEW"})),
    "covered unknown rule": ("covered", lambda good: json.dumps({**good, "covered": ["NO.SUCH_RULE"]})),
    "negative traces": ("traces", lambda good: json.dumps({**good, "traces": -3})),
    "boolean traces": ("traces", lambda good: json.dumps({**good, "traces": True})),
    "NaN seconds": ("seconds", lambda good: json.dumps({**good, "seconds": float("nan")})),
    "bad shard": ("shard", lambda good: json.dumps({**good, "shard": [0]})),
    "unknown field": ("color", lambda good: json.dumps({**good, "color": "red"})),
    "finding count as text": ("findings.x.count", lambda good: json.dumps(
        {**good, "findings": {"x": {"signature": ["decision", "scheduled", "-"], "count": "7", "first_trace": 0,
                                    "seed": 1, "options": {}, "requests": 2}}})),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_a_corrupt_or_foreign_state_is_refused_with_its_field_named(tmp_path, kind):
    cfg = _cfg(tmp_path, engine="spec", traces=16, resume=True)
    field, corrupt = CORRUPTIONS[kind]
    path = state_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(corrupt(_good_state(cfg)))
    with pytest.raises(StateError) as e:
        validate_options(cfg)
    assert e.value.field == field and str(path) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(StateError):
        run_campaign(cfg)


def test_resume_without_a_state_says_so(tmp_path):
    with pytest.raises(StateError, match="no campaign state"):
        run_campaign(_cfg(tmp_path, engine="spec", traces=16, resume=True))
    out = subprocess.run([sys.executable, "-m", "batchspec.cli", "fuzz", "--engine", "spec", "--traces", "16", "--resume",
                          "--corpus", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "--resume" in out.stderr and "no campaign state" in out.stderr


# -- reports --------------------------------------------------------------------


def test_a_crashing_report_writer_keeps_the_finding_and_resume_completes_it(tmp_path, monkeypatch):
    import fuzz.corpus

    def broken(*args, **kwargs):
        raise RuntimeError("report writer broke")

    monkeypatch.setattr(fuzz.corpus, "triage_report", broken)
    cfg = _cfg(tmp_path, traces=32)
    state = run_campaign(cfg)  # no exception: the campaign went on
    assert state.traces == 32 and state.findings
    name, entry = next((n, e) for n, e in state.findings.items() if e.get("requests"))
    assert entry["report"].startswith("incomplete") and "report writer broke" in entry["report"]
    assert (tmp_path / f"{name}.jsonl").exists() and (tmp_path / cfg.engine / f"{name}.log.jsonl").exists()
    assert (tmp_path / f"{name}.md").read_text().startswith(INCOMPLETE)

    monkeypatch.undo()  # the writer is fixed: --resume writes the report
    resumed = run_campaign(_cfg(tmp_path, traces=32, resume=True))
    assert resumed.findings[name]["report"] == "ok"
    report = (tmp_path / f"{name}.md").read_text()
    assert not report.startswith(INCOMPLETE) and f"# Finding `{name}`" in report


def test_an_engine_log_the_writer_cannot_render_does_not_end_the_campaign(tmp_path):
    state = run_campaign(_cfg(tmp_path, engine="robust-none-ids", traces=16))
    assert state.traces == 16 and state.findings and state.errors == 0
    for name, entry in state.findings.items():
        assert (tmp_path / f"{name}.jsonl").exists() and (tmp_path / f"{name}.md").exists()


# -- reports as soon as they exist ------------------------------------------------


def test_findings_are_saved_when_shrunk_and_duplicates_are_not_shrunk(tmp_path, monkeypatch):
    seen = []  # (round, a report already exists) at each outcome's arrival
    real = campaign._Round.on_result

    def on_result(self, outcome):
        seen.append((self.state.next_round, any(Path(self.cfg.corpus).glob("*.md"))))
        return real(self, outcome)

    monkeypatch.setattr(campaign._Round, "on_result", on_result)
    outcomes = []
    cfg = _cfg(tmp_path, seed=6, traces=32, workers=2)  # seed 6: five traces of its first round share a signature
    state = run_campaign(cfg, on_round=lambda st, outs: outcomes.extend(outs))
    assert state.findings
    first_round = state.first_finding["trace"] // campaign.ROUND
    # the first report existed while later traces of its own round were still arriving (not written at the merge)
    assert any(r == first_round and has_report for r, has_report in seen)
    assert not seen[0][1]
    by_raw: dict = {}
    for o in sorted(outcomes, key=lambda o: o.index):
        if o.raw_signature is not None:
            by_raw.setdefault(o.raw_signature, []).append(o)
    assert any(len(v) > 1 for v in by_raw.values()), "the planted bug should diverge on several traces"
    for raw, group in by_raw.items():
        shrunk = [o.index for o in group if o.shrunk is not None]
        assert shrunk == [group[0].index], f"{raw}: only its first trace is shrunk, got {shrunk}"
    first = json.loads(state_path(cfg).read_text())["first_finding"]
    assert first["seconds"] > 0 and 1 <= first["traces"] <= 32


def test_findings_and_their_shrinking_do_not_depend_on_the_worker_count(tmp_path):
    """Which trace of a signature is shrunk is decided in trace order, so 1 and 3 workers agree
    on every finding: its count, its example, the traces it was first seen in."""
    runs = []
    for workers in (1, 3):
        outcomes = []
        state = run_campaign(_cfg(tmp_path / str(workers), seed=6, traces=32, workers=workers),
                             on_round=lambda st, outs: outcomes.extend(outs))
        shrunk = sorted(o.index for o in outcomes if o.shrunk is not None)
        runs.append((state.traces, state.covered, state.findings, shrunk))
    assert runs[0][2] and runs[0] == runs[1]


def test_max_findings_stops_the_campaign_with_the_same_findings_for_any_worker_count(tmp_path):
    states = [run_campaign(_cfg(tmp_path / str(w), traces=64, workers=w, max_findings=1)) for w in (1, 2)]
    for w, state in zip((1, 2), states):
        assert len(state.findings) == 1 and state.traces < 64
        saved = sorted(p.stem for p in (tmp_path / str(w)).glob("*.jsonl"))
        assert saved == sorted(state.findings)  # a finding cut off by the limit is not left in the corpus
    (a, b) = states
    assert (a.traces, a.findings.keys()) == (b.traces, b.findings.keys())
    assert a.first_finding and a.first_finding["trace"] <= a.traces


# -- exit codes for engines that cannot be built ----------------------------------------


def test_an_engine_that_cannot_be_constructed_is_exit_2_not_a_finding(tmp_path, capsys):
    from fuzz.generate import random_trace

    def explode(trace):
        raise ValueError("constructor broke")

    register_engine("robust-explodes", explode)
    try:
        path = tmp_path / "t.jsonl"
        write_trace(random_trace(1), path)
        assert replay_command(str(path), "robust-explodes") == 2
        err = capsys.readouterr().err
        assert "could not be constructed" in err and "constructor broke" in err and "Traceback" not in err
        with pytest.raises(OptionError, match="could not be constructed"):
            validate_options(CampaignConfig(engine="robust-explodes", corpus=str(tmp_path / "c"), traces=16))
    finally:
        del ENGINES["robust-explodes"]


# -- processes ----------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


CAMPAIGN = """
import sys, time
from fuzz.campaign import CampaignConfig, run_campaign
from fuzz.replay import register_engine
from spec.scheduler import SpecEngine

class Slow(SpecEngine):
    name = "slow"
    def step(self):
        time.sleep(0.5)  # the workers are busy inside a step when the parent dies
        return super().step()

register_engine("slow", lambda t: Slow.from_trace(t))
run_campaign(CampaignConfig(engine="slow", seconds=120, workers=2, corpus=sys.argv[1], profile=None))
"""


@pytest.mark.skipif(not LINUX, reason="reads /proc; worker death on kill -9 relies on Linux's PR_SET_PDEATHSIG")
def test_workers_die_when_the_campaign_is_killed_with_sigkill(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CAMPAIGN, str(tmp_path)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        assert _wait_for(lambda: len(_children(proc.pid)) >= 2, 60), "the campaign started no workers"
        workers = _children(proc.pid)
        time.sleep(0.3)
        proc.kill()
        proc.wait(timeout=10)
        assert _wait_for(lambda: not any(_alive(w) for w in workers), 5), "workers outlived their parent"
    finally:
        proc.kill()


@pytest.mark.skipif(not LINUX, reason="reads /proc to find the workers")
def test_ctrl_c_prints_one_line_and_no_worker_tracebacks(tmp_path):
    corpus = tmp_path / "c"
    proc = subprocess.Popen([sys.executable, "-m", "batchspec.cli", "fuzz", "--engine", "spec", "--seconds", "120",
                             "--workers", "2", "--corpus", str(corpus)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            # as from a terminal: a test run started in the background (`cmd &`) ignores SIGINT,
                            # and its children inherit that
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert _wait_for(lambda: len(_children(proc.pid)) >= 2 and any(corpus.glob(".campaign-*.json")), 60)
        workers = _children(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole process group
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted:") and "state saved to" in lines[0]
    assert _wait_for(lambda: not any(_alive(w) for w in workers), 5)
    state = json.loads(next(corpus.glob(".campaign-*.json")).read_text())
    assert state["traces"] > 0
