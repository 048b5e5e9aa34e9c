"""docs/engine-guide.md: its example engine and every command of its tested script work as the guide says."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "docs" / "engine-guide.md"
MARKER = "<!-- tested-by: tests/test_engine_guide.py -->"


def guide_script() -> list[tuple[str, int]]:
    """The lines of the guide's tested bash block, each with the exit status its comment promises (default 0)."""
    text = GUIDE.read_text()
    assert MARKER in text, "the guide's tested script lost its marker"
    block = re.search(r"```bash\n(.*?)```", text[text.index(MARKER):], re.S).group(1)
    out = []
    for line in block.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        command, _, comment = line.partition("  #")
        m = re.search(r"exit (\d+)", comment)
        out.append((command.strip(), int(m.group(1)) if m else 0))
    return out


def runnable(command: str) -> str:
    """A guide command with `python` and `batchspec` resolved to this interpreter."""
    python, batchspec = shlex.quote(sys.executable), f"{shlex.quote(sys.executable)} -m batchspec.cli"
    command = re.sub(r"(^|\s)python ", rf"\1{python} ", command)
    return re.sub(r"(^|\s)batchspec ", rf"\1{batchspec} ", command)


def load_toy(bug: str = ""):
    """Import examples/toy_engine.py as a fresh module (its planted bug is read at import)."""
    old = os.environ.get("TOY_BUG")
    os.environ["TOY_BUG"] = bug
    try:
        spec = importlib.util.spec_from_file_location(f"toy_engine_{bug or 'ok'}", REPO / "examples" / "toy_engine.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        if old is None:
            os.environ.pop("TOY_BUG", None)
        else:
            os.environ["TOY_BUG"] = old


def test_the_toy_engine_implements_the_protocol():
    from spec.io import load_trace
    from spec.protocol import Engine

    toy = load_toy()
    trace = load_trace(REPO / "docs" / "examples" / "hol-blocking.jsonl")
    assert isinstance(toy.ToyEngine(trace), Engine)
    with pytest.raises(ValueError, match="one request at a time"):
        toy.ToyEngine(load_trace(REPO / "docs" / "examples" / "continuous-batching.jsonl"))


def test_the_toy_engine_imports_no_scheduling_logic():
    source = (REPO / "examples" / "toy_engine.py").read_text()
    imports = set(re.findall(r"^\s*from (\S+) import", source, re.M)) | set(re.findall(r"^\s*import (\S+)", source, re.M))
    assert not {"spec.scheduler", "spec.kv", "spec.queues", "spec.rules"} & imports


@pytest.mark.parametrize("seed", range(3))
def test_the_toy_engine_agrees_with_the_spec_on_naive_traces(seed):
    """In process, a few seeds beyond the script's campaign (which uses seed 0)."""
    from fuzz.generate import random_trace
    from fuzz.replay import replay

    toy = load_toy()
    for k in range(12):
        trace = random_trace(1000 * seed + k, profile="naive", max_steps=3000)
        result = replay(trace, toy.ToyEngine(trace), level="exact")
        assert result.agreed, result.describe()


def test_the_guides_script_runs_as_documented(tmp_path):
    """Every line of the guide's tested script, with the exit status the guide promises: the toy engine agrees
    with the spec (replay, a fuzz campaign inside its declared envelope with no harness failure, check-log,
    replay of its log); a profile outside the envelope is refused; the planted bugs are found, each as exactly
    one finding group, shrunk, saved with a triage report that names the knob and prints a replay command that
    runs as printed, replay as a divergence, are fixed by removing them, and the priority bug's log breaks
    QUEUE.ADMISSION_ORDER on its own."""
    (tmp_path / "docs").symlink_to(REPO / "docs")
    (tmp_path / "examples").symlink_to(REPO / "examples")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "COLUMNS": "120"}
    env.pop("TOY_BUG", None)
    script = guide_script()
    assert len(script) >= 8
    outputs = {}
    for command, want in script:
        done = subprocess.run(["bash", "-c", runnable(command)], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == want, f"{command}\nexit {done.returncode}, the guide says {want}\n{done.stdout}\n{done.stderr}"
        outputs[command] = done.stdout + done.stderr
    findings = sorted(p.name for p in (tmp_path / "findings-toy-bug").glob("*.jsonl"))
    assert len(findings) == 1, findings
    name = findings[0][: -len(".jsonl")]
    report = (tmp_path / "findings-toy-bug" / f"{name}.md").read_text()
    assert "QUEUE.ADMISSION_ORDER" in report
    assert (tmp_path / "findings-toy-bug" / "toy" / f"{name}.log.jsonl").exists()
    assert not list((tmp_path / "findings-toy").glob("*.jsonl")), "the unmodified toy engine has no findings"

    # the capability-declaring engine: a campaign inside its envelope, stated in the summary, with no harness failure
    clean = next(c for c in outputs if "--corpus findings-toy " in c + " ")
    assert "engine toy implements: profile naive; policy fcfs|priority" in " ".join(outputs[clean].split())
    assert "failed inside the harness" not in outputs[clean]
    [state_file] = (tmp_path / "findings-toy").glob(".campaign-*.json")
    state = json.loads(state_file.read_text())
    assert state["traces"] == 64 and state["errors"] == 0 and state["outside_envelope"] == 0
    refused = next(c for c in outputs if "--profile tgi" in c)
    assert "outside engine toy's capabilities" in outputs[refused] and "batching='prefill-first'" in outputs[refused]

    # a planted bug that shows in several ways: exactly one finding group, named by the knob that exposes it
    groups = sorted((tmp_path / "findings-toy-cap").glob("*.jsonl"))
    assert len(groups) == 1, groups
    group = json.loads(groups[0].with_suffix(".group.json").read_text())
    assert group["count"] > 1 and group["example_requests"] == 1
    cap_report = groups[0].with_suffix(".md").read_text()
    # either knob exposes the lone cap: chunking on makes the spec cap too, threshold 0 stops the toy capping
    assert ("This finding depends on the knob **`long_prefill_token_threshold=" in cap_report
            or "This finding depends on the knob **`enable_chunked_prefill=false`**" in cap_report), cap_report

    # every report's replay command runs as printed (copy-paste), exit 1 with the bug and 0 without it
    for folder, bug in (("findings-toy-bug", "priority"), ("findings-toy-cap", "lone_cap")):
        [md] = (tmp_path / folder).glob("*.md")
        command = re.search(r"Replay it.*?```bash\n(.*?)\n```", md.read_text(), re.S).group(1)
        assert command.startswith(f"batchspec replay {folder}/") and "--engine examples.toy_engine:ToyEngine" in command
        for planted, want in ((bug, 1), ("", 0)):
            done = subprocess.run(["bash", "-c", runnable(command)], cwd=tmp_path, env={**env, "TOY_BUG": planted},
                                  capture_output=True, text=True, timeout=120)
            assert done.returncode == want, f"TOY_BUG={planted} {command}: exit {done.returncode}\n{done.stdout}{done.stderr}"

    # the guide's regression-corpus test, on the finding: agrees without the bug, diverges with it
    from fuzz.corpus import corpus_traces
    from fuzz.replay import replay
    from spec.io import load_trace

    corpus = corpus_traces(tmp_path / "findings-toy-bug")
    fixed, buggy = load_toy(), load_toy("priority")
    for path in corpus:
        trace = load_trace(path)
        assert replay(trace, fixed.ToyEngine(trace), level="exact").agreed
        assert not replay(trace, buggy.ToyEngine(trace), level="exact").agreed


@pytest.mark.parametrize("seed", range(2))
def test_the_toy_engine_agrees_inside_its_declared_envelope(seed):
    """The toy's capabilities are what it implements: random traces drawn inside them agree with the spec."""
    from fuzz.campaign import CampaignConfig, trace_options
    from fuzz.capabilities import parse
    from fuzz.generate import random_trace
    from fuzz.replay import replay

    toy = load_toy()
    envelope = parse(toy.CAPABILITIES)
    cfg = CampaignConfig(seed=seed, engine="toy")
    for k in range(16):
        trace = random_trace(1000 * seed + k, **{"max_steps": 3000, **trace_options(cfg, k, [], envelope)})
        assert envelope.admits(trace.config)
        result = replay(trace, toy.ToyEngine(trace), level="exact")
        assert result.agreed, result.describe()


def test_an_engine_named_module_colon_factory_needs_no_registration():
    """`--engine examples.toy_engine:ToyEngine` imports the factory from the working directory."""
    env = dict(os.environ, TOY_BUG="")
    ok = subprocess.run([sys.executable, "-m", "batchspec.cli", "replay", "docs/examples/hol-blocking.jsonl",
                         "--engine", "examples.toy_engine:ToyEngine"], cwd=REPO, env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "agree" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "batchspec.cli", "replay", "docs/examples/hol-blocking.jsonl",
                          "--engine", "examples.toy_engine:NoSuchFactory"], cwd=REPO, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "NoSuchFactory" in bad.stdout + bad.stderr
