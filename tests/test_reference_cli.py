"""``batchspec generate`` back end (:func:`reference.cli_generate`) and ``python -m reference``."""
from __future__ import annotations

import pytest

from reference.bench import main as bench_main
from reference.cli import cli_generate, format_steps, main
from reference.engine import generate_alone, torch_threads
from reference.model import TinyLlama, TinyLlamaConfig, save_pretrained
from spec.formats import Trace, TraceRequest
from spec.io import load_log, write_trace


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with torch_threads(1):
        yield


def small_trace(vocab_size: int = 512) -> Trace:
    requests = [TraceRequest(id=f"q{i}", prompt_len=6 + 9 * i, max_tokens=8, arrival_step=i, ignore_eos=True)
                for i in range(4)]
    config = {"profile": "vllm-v1", "num_blocks": 16, "block_size": 4, "max_num_batched_tokens": 16}
    return Trace(config=config, requests=requests, vocab_size=vocab_size, name="small")


def test_cli_generate_from_file_writes_a_valid_log(tmp_path):
    write_trace(small_trace(), tmp_path / "t.jsonl")
    result = cli_generate(tmp_path / "t.jsonl", log_path=tmp_path / "log.jsonl")
    model = TinyLlama.from_seed(TinyLlamaConfig(), seed=0)
    for req in result.trace.requests:  # each output equals the request run alone
        assert result.outputs[req.id] == generate_alone(model, req.prompt_token_ids(512), req.max_tokens)
        assert result.status[req.id] == "max_tokens"
    assert result.num_generated == 32 and result.tokens_per_s > 0
    log = load_log(tmp_path / "log.jsonl")
    assert log.engine == "reference" and log.level == "memory" and len(log.records) == len(result.records)
    assert len(format_steps(result.records).splitlines()) == len(result.records) + 1


def test_cli_generate_takes_a_model_folder_and_sampling(tmp_path):
    config = TinyLlamaConfig(vocab_size=600, num_hidden_layers=1)
    save_pretrained(TinyLlama.from_seed(config, seed=4), tmp_path / "m")
    a = cli_generate(small_trace(), model=tmp_path / "m", sampling="temperature=0.9,top_p=0.9,seed=1", level="decisions")
    b = cli_generate(small_trace(), model=config, seed=4, sampling="temperature=0.9,top_p=0.9,seed=1")
    c = cli_generate(small_trace(), model=config, seed=4)
    assert a.outputs == b.outputs != c.outputs
    assert all(r.num_free_blocks is None for r in a.records)
    assert all(r.num_free_blocks is not None for r in b.records)


def test_main_prints_steps_outputs_and_speed(tmp_path, capsys):
    write_trace(small_trace(), tmp_path / "t.jsonl")
    assert main([str(tmp_path / "t.jsonl")]) == 0
    text = capsys.readouterr().out
    assert "q3: prompt 33 tokens, 8 out (max_tokens)" in text and "tokens/s" in text
    assert text.splitlines()[0].split()[:2] == ["step", "free"]


def test_main_reports_bad_input(tmp_path, capsys):
    config = TinyLlamaConfig(vocab_size=100)
    save_pretrained(TinyLlama.from_seed(config), tmp_path / "m")
    write_trace(small_trace(), tmp_path / "t.jsonl")
    assert main([str(tmp_path / "t.jsonl"), "--model", str(tmp_path / "m")]) == 2
    assert "exceeds the model's 100" in capsys.readouterr().err
    assert main([str(tmp_path / "t.jsonl"), "--sampling", "warmth=2"]) == 2
    assert "bad sampling option" in capsys.readouterr().err


def test_bench_runs(capsys):
    assert bench_main(["--requests", "2", "--max-tokens", "3", "--repeat", "1"]) == 0
    assert "6 tokens out" in capsys.readouterr().out
