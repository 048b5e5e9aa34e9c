"""The campaign on a Ray cluster (a local head started by the test).

Opt-in (marker ``ray``): ``pip install -e '.[ray]' && python -m pytest -m ray``.
Selected without Ray installed, it fails rather than skips.  Ray's command line is
found through the interpreter running the tests (a virtual environment need not be
activated, nor its ``bin`` be on PATH).
"""
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fuzz.campaign import CampaignConfig, run_campaign

pytestmark = pytest.mark.ray


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_cli() -> list[str]:
    """The ``ray`` command of this interpreter's installation: the script beside ``sys.executable``,
    else Ray's click entry point run by this interpreter."""
    script = Path(sys.executable).with_name("ray")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())"]


@pytest.fixture(scope="module")
def ray_head():
    try:
        import ray  # noqa: F401
    except ImportError:
        pytest.fail("the `ray` marker was selected but Ray is not installed: pip install -e '.[ray]'")
    port = free_port()
    subprocess.run([*ray_cli(), "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                    "--disable-usage-stats"], check=True, capture_output=True, timeout=120)
    yield f"127.0.0.1:{port}"
    import ray

    ray.shutdown()
    subprocess.run([*ray_cli(), "stop", "--force"], capture_output=True, timeout=120)


def test_ray_campaign_equals_the_local_one(ray_head, tmp_path):
    remote = run_campaign(CampaignConfig(seed=4, engine="gpu", traces=32, corpus=str(tmp_path / "r"), ray=ray_head))
    local = run_campaign(CampaignConfig(seed=4, engine="gpu", traces=32, workers=2, corpus=str(tmp_path / "l")))
    assert remote.errors == 0 and remote.traces == 32
    assert (remote.traces, remote.steps, remote.covered, remote.findings) == (local.traces, local.steps, local.covered, local.findings)
