"""Every plot is written, as a valid PNG or SVG, and draws what it is given."""
import xml.etree.ElementTree as ET

import pytest

pytest.importorskip("matplotlib")

from batchspec import plots  # noqa: E402
from batchspec.cli import example_path  # noqa: E402
from fuzz.sweep import capacity, parse_profile_spec, sweep, with_arrival_times  # noqa: E402
from spec.costmodel import preset  # noqa: E402
from spec.io import load_trace  # noqa: E402
from spec.scheduler import SpecEngine  # noqa: E402
from spec.simulate import simulate  # noqa: E402
from test_sim_sweep import FLAT, synthetic  # noqa: E402


@pytest.fixture(scope="module")
def quickstart():
    trace = load_trace(example_path())
    return simulate(with_arrival_times(trace), preset("unit"), SpecEngine.from_trace(trace), keep_records=100)


def valid_png(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    return data


def valid_svg(path):
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg")
    return root


def test_batch_timeline(tmp_path, quickstart):
    valid_png(plots.batch_timeline(quickstart, tmp_path / "t.png"))
    svg = valid_svg(plots.batch_timeline(quickstart, tmp_path / "t.svg"))
    text = ET.tostring(svg, encoding="unicode")
    assert "preempted" in text and "prefill chunk" in text  # the legend is there
    with pytest.raises(ValueError, match="keep_records"):
        plots.batch_timeline(simulate(with_arrival_times(load_trace(example_path())), preset("unit")), tmp_path / "x.png")


def test_kv_occupancy_and_cdfs(tmp_path, quickstart):
    valid_png(plots.kv_occupancy(quickstart, tmp_path / "kv.png"))
    other = simulate(with_arrival_times(load_trace(example_path())), preset("h200-llama-8b-bf16"))
    valid_svg(plots.latency_cdfs({"unit": quickstart, "h200": other}, tmp_path / "cdf.svg"))
    with pytest.raises(ValueError, match=".png or .svg"):
        plots.kv_occupancy(quickstart, tmp_path / "kv.pdf")


def test_capacity_plot(tmp_path):
    specs = [parse_profile_spec("vllm-v1:max_num_seqs=2"), parse_profile_spec("vllm-v1:max_num_seqs=4")]
    points = sweep(synthetic(n=120), specs, [10, 40, 120], FLAT, stop_after_unbounded=None)
    caps = capacity(points, 0.3)
    valid_png(plots.capacity_plot(points, caps, 0.3, tmp_path / "cap.png"))
    text = ET.tostring(valid_svg(plots.capacity_plot(points, caps, 0.3, tmp_path / "cap.svg")), encoding="unicode")
    assert "max_num_seqs=2" in text and "SLO" in text


def test_downsample_keeps_peaks():
    xs = list(range(10_000))
    ys = [0] * 10_000
    ys[5123] = 9
    dx, dy = plots._downsample(xs, ys, n=100)
    assert len(dx) <= 100 and max(dy) == 9 and 5123 in dx
