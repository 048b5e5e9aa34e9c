"""vLLM 0.32 and 0.33 behind one adapter (issue #15 item 5).

The profile half runs in normal CI.  The ``vllm``-marked half runs on whichever release is
installed (``.venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_releases.py``; for 0.33,
``PYTHONPATH=DIR`` where the 0.33.0 wheel was installed with ``pip install --no-deps --target DIR``):
the release is one the adapter accepts, it refuses the other release's value of a release knob,
and the trace on which the two releases differ agrees with the spec under the release's own profile.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from spec.config import PROFILES, resolve

TRACE = Path(__file__).parent / "corpus" / "vllm-priority-self-preempt.jsonl"


def test_0_33_profile_is_vllm_v1_with_the_release_knobs():
    old, new = resolve({"profile": "vllm-v1"}).to_json(), resolve({"profile": "vllm-v1-0.33"}).to_json()
    changed = {k for k in old if old[k] != new[k]}
    assert changed == {"profile", "priority_self_preempt", "spec_cache_at_output"}
    assert (old["priority_self_preempt"], new["priority_self_preempt"]) == ("stop", "continue")
    # speculative decoding only (SPEC.CACHE_AT_OUTPUT): when accepted drafts' blocks are cached
    assert (old["spec_cache_at_output"], new["spec_cache_at_output"]) == (False, True)
    assert PROFILES["vllm-v1-0.33"].version == "0.33.0" and PROFILES["vllm-v1"].version == "0.32.0"


@pytest.fixture(scope="module")
def release():
    from fuzz.replay import EngineUnavailable
    from fuzz.vllm_adapter import installed_release

    try:
        return installed_release()
    except EngineUnavailable as e:
        pytest.fail(f"the `vllm` suite was selected but vLLM cannot be used: {e}", pytrace=False)


@pytest.mark.vllm
def test_installed_release_runs_its_own_profile_and_refuses_the_other(release):
    from fuzz.replay import EngineConfigError, replay
    from fuzz.vllm_adapter import RELEASES, VllmEngine
    from spec.io import load_trace

    assert release in RELEASES
    own = RELEASES[release]
    other = next(p for r, p in RELEASES.items() if r != release)
    trace = load_trace(TRACE, steps=True)
    as_profile = lambda p: dataclasses.replace(trace, config={**trace.config, "profile": p})
    with pytest.raises(EngineConfigError, match=f"vLLM {release}"):
        VllmEngine(as_profile(other))
    assert replay(as_profile(own), "vllm").agreed
    # the release as it is, judged by the other release's profile: the knob's rule separates them
    result = replay(as_profile(other), "vllm-release")
    assert not result.agreed
    assert result.divergence.step == 2 and result.divergence.field == "scheduled"
