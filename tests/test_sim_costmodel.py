"""The step cost model: presets, the formula, and calibration from measured steps."""
import json
import random

import pytest

from spec.costmodel import NS_PER_S, PRESETS, CostModel, StepShape, preset
from spec.io import FormatError

np = pytest.importorskip("numpy")
from fuzz.calibrate import calibration_trace, fit, load_rows, measure, nnls  # noqa: E402


def test_presets():
    assert preset("unit").step_ns(StepShape(1000, 50, 10**6)) == NS_PER_S  # 1 s whatever runs
    h200 = preset("h200-llama-8b-bf16")
    # 16.06 GB of weights at 80% of 4.8 TB/s, plus 0.3 ms of overhead
    assert h200.fixed_s == pytest.approx(8.03e9 * 2 / (4.8e12 * 0.8) + 300e-6)
    assert h200.per_kv_token_s == pytest.approx(131072 / (4.8e12 * 0.8))
    assert h200.knobs == {"num_blocks": 51898, "max_model_len": 8192}
    assert preset("a100-40gb-llama2-7b-fp16").knobs["num_blocks"] < 3000  # scarce KV memory
    for model in PRESETS.values():
        assert model.source and CostModel.from_json(json.loads(json.dumps(model.to_json()))) == model
    with pytest.raises(KeyError, match="unknown cost model"):
        preset("tpu")


def test_formula_and_rounding():
    m = CostModel("m", fixed_s=1e-3, per_prefill_token_s=1e-5, per_decode_seq_s=2e-5, per_kv_token_s=1e-8)
    assert m.step_seconds(StepShape(100, 10, 5000)) == pytest.approx(1e-3 + 1e-3 + 2e-4 + 5e-5)
    assert m.step_ns(StepShape(100, 10, 5000)) == 2_250_000
    assert CostModel("tiny", fixed_s=1e-9).step_ns(StepShape()) == 1
    for bad in ({"fixed_s": 0.0}, {"fixed_s": -1.0}, {"fixed_s": 1.0, "per_kv_token_s": float("nan")}):
        with pytest.raises(ValueError):
            CostModel.from_json({"name": "x", **bad})
    with pytest.raises(ValueError, match="unknown cost-model field"):
        CostModel.from_json({"fixed_s": 1.0, "per_token": 2})


def _rows(model, n=400, noise=0.0, seed=0):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        shape = StepShape(rng.choice([0, 0, rng.randint(1, 2048)]), rng.randint(0, 128), rng.randint(0, 200_000))
        t = model.step_seconds(shape) * (1 + rng.gauss(0, noise))
        rows.append((*shape, t))
    return rows


def test_calibration_recovers_known_coefficients():
    truth = preset("h200-llama-8b-bf16")
    exact = fit(_rows(truth)).model
    for name in ("fixed_s", "per_prefill_token_s", "per_decode_seq_s", "per_kv_token_s"):
        assert getattr(exact, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    noisy = fit(_rows(truth, n=2000, noise=0.02, seed=1))
    assert noisy.r_squared > 0.99 and noisy.median_relative_error < 0.03
    for name in ("fixed_s", "per_prefill_token_s", "per_decode_seq_s", "per_kv_token_s"):
        assert getattr(noisy.model, name) == pytest.approx(getattr(truth, name), rel=0.05)


def test_nnls_keeps_coefficients_non_negative():
    a = np.array([[1, 0.0], [1, 1.0], [1, 2.0], [1, 3.0]])
    b = np.array([3.0, 2.0, 1.0, 0.0])  # the unconstrained slope is -1
    x = nnls(a, b)
    assert x[1] == 0 and x[0] == pytest.approx(1.5)
    model = fit([(p, 0, 0, 1.0 - 1e-4 * p) for p in range(0, 1000, 50)]).model
    assert model.per_prefill_token_s == 0 and model.fixed_s > 0


def test_load_rows(tmp_path):
    good = tmp_path / "rows.json"
    good.write_text(json.dumps({"rows": [{"prefill_tokens": 1, "decode_seqs": 2, "kv_tokens": 3, "seconds": 0.1}] * 4}))
    assert load_rows(str(good)) == [(1, 2, 3, 0.1)] * 4
    csv = tmp_path / "rows.csv"
    csv.write_text("prefill_tokens,decode_seqs,kv_tokens,seconds\n" + "1,2,3,0.5\n" * 4)
    assert load_rows(str(csv))[0] == (1, 2, 3, 0.5)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"prefill_tokens": 1, "decode_seqs": 2, "kv_tokens": 3, "seconds": -1}] * 4))
    with pytest.raises(FormatError, match="bad.json:1: seconds: must be a finite number >= 0"):
        load_rows(str(bad))
    bad.write_text(json.dumps([{"prefill_tokens": 1}]))
    with pytest.raises(FormatError, match="decode_seqs: missing"):
        load_rows(str(bad))


def test_measure_times_an_engine_and_reads_the_batch_shape():
    """measure() works on any engine; on the spec the 'time' is scheduler time, but the shapes are real."""
    from spec.scheduler import SpecEngine

    trace = calibration_trace(n=16, max_prompt=200, max_output=8)
    rows = measure(SpecEngine.from_trace(trace), trace, warmup=0)
    assert rows and all(t >= 0 for *_, t in rows)
    total_prompt = sum(r.prompt_len for r in trace.requests)
    assert sum(r[0] for r in rows) >= total_prompt - 16 * 16  # every prompt token prefilled (minus prefix hits)
    assert sum(r[1] for r in rows) > 0
