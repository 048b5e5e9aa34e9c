"""``batchspec fuzz --set async_scheduling=true``: the campaign draws the other knobs consistent
with it (the knobs async scheduling is specified with are pinned over steering and the
profile rotation); a --set that truly conflicts is refused on one line naming the knob and the fix."""
from __future__ import annotations

import subprocess
import sys

import pytest

from fuzz.campaign import ALL_PROFILES, CampaignConfig, trace_options, validate_options
from fuzz.capabilities import UNDECLARED
from fuzz.generate import random_trace
from spec.config import ASYNC_NEEDS, resolve
from spec.rules import all_rules

RULES = sorted(r.id for r in all_rules().values() if r.fires)  # every rule uncovered: steering is at its widest


@pytest.mark.parametrize("profile", [None, ALL_PROFILES, "vllm-v1"])
def test_every_trace_of_an_async_campaign_is_async_and_valid(profile, tmp_path):
    cfg = CampaignConfig(engine="spec", traces=4, profile=profile, knobs={"async_scheduling": True}, corpus=str(tmp_path))
    validate_options(cfg)
    for k in range(80):
        trace = random_trace(k, **{"max_steps": 2000, **trace_options(cfg, k, RULES, UNDECLARED)})
        config = resolve(trace.config)
        assert config.async_scheduling
        assert all(getattr(config, name) == value for name, value in ASYNC_NEEDS.items())


def test_an_async_campaign_runs_from_the_command_line(tmp_path):
    """The default engine (gpu), whose declared envelope draws knobs such as swap preemption."""
    proc = subprocess.run([sys.executable, "-m", "batchspec.cli", "fuzz", "--set", "async_scheduling=true",
                           "--traces", "6", "--corpus", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr


@pytest.mark.parametrize("argv, knob, fix", [
    (["--set", "async_scheduling=true,preemption_mode=swap"], "preemption_mode", "drop preemption_mode from --set"),
    (["--profile", "tgi", "--set", "async_scheduling=true"], "batching", "--set batching too"),
])
def test_a_set_that_truly_conflicts_is_refused_on_one_line(argv, knob, fix, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "batchspec.cli", "fuzz", "--engine", "spec", "--traces", "2",
                           "--corpus", str(tmp_path), *argv], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "COLUMNS": "60"})
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert f"--set: {knob}:" in err and fix in err
