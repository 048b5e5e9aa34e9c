"""batchspec import / simulate / compare / sweep: exit codes, messages, files."""
import json

import pytest

from batchspec import sim_cli
from batchspec.cli import example_path
from batchspec.data import TRACES
from spec.io import load_trace


def cli(capsys, *argv):
    code = sim_cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_import_writes_a_valid_trace(tmp_path, capsys):
    out = tmp_path / "burst.jsonl"
    code, stdout, _ = cli(capsys, "import", TRACES / "burstgpt_1_first400.csv", "-o", out, "--set", "num_blocks=4096")
    assert code == 0 and "17 failed request" in stdout
    trace = load_trace(out)
    assert len(trace.requests) == 383 and trace.config == {"profile": "vllm-v1", "num_blocks": 4096}


def test_import_bad_input_exits_2_and_writes_nothing(tmp_path, capsys):
    src = tmp_path / "bad.csv"
    src.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,12,3\n0.5,many,3\n")
    out = tmp_path / "out.jsonl"
    code, _, err = cli(capsys, "import", src, "-o", out)
    assert code == 2 and f"{src}:3: num_prefill_tokens: expected an integer" in err
    assert not out.exists() and list(tmp_path.iterdir()) == [src]
    code, _, err = cli(capsys, "import", src, "-o", out, "--speedup", "0")
    assert code == 2 and "--speedup" in err


def test_simulate_prints_metrics_and_writes_plots(tmp_path, capsys):
    args = ["simulate", example_path(), "--cost-model", "unit", "--slo", "ttft=3", "--json", tmp_path / "m.json",
            "--timeline", tmp_path / "t.png", "--kv-plot", tmp_path / "kv.svg"]
    code, stdout, _ = cli(capsys, *args)
    assert code == 0
    for row in ("TTFT mean / p50 / p95 / p99", "goodput", "preemptions", "KV utilization", "throughput"):
        assert row in stdout
    data = json.loads((tmp_path / "m.json").read_text())
    assert data["metrics"]["completed"] == 6 and data["metrics"]["rejected"] == 1 and data["metrics"]["preemptions"] == 1
    assert (tmp_path / "t.png").stat().st_size > 5000 and (tmp_path / "kv.svg").exists()


def test_bad_options_exit_2(capsys):
    code, _, err = cli(capsys, "simulate", example_path(), "--cost-model", "tpu")
    assert code == 2 and "unknown cost model 'tpu'" in err
    code, _, err = cli(capsys, "simulate", example_path(), "--profile", "vllm-v1:num_blockz=3")
    assert code == 2 and "num_blockz" in err
    code, _, err = cli(capsys, "simulate", example_path(), "--slo", "latency=3")
    assert code == 2 and "unknown SLO" in err


def test_compare_and_sweep_skip_unknown_profiles(tmp_path, capsys):
    code, stdout, err = cli(capsys, "compare", example_path(), "--cost-model", "unit",
                            "--profiles", "vllm-v1,nonesuch,vllm-v1:max_num_seqs=1")
    assert code == 0 and "nonesuch" in err and "vllm-v1:max_num_seqs=1" in stdout
    src = tmp_path / "v.csv"
    src.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n" + "".join(f"{i * 0.1:.1f},16,4\n" for i in range(120)))
    code, stdout, err = cli(capsys, "sweep", src, "--cost-model", "unit", "--profiles", "vllm-v1,nonesuch",
                            "--rates", "0.05,1", "--jobs", "1", "--slo-ttft", "5", "--plot", tmp_path / "cap.png")
    assert code == 0 and "unknown profile 'nonesuch'" in err
    assert "capacity boundary" in stdout and (tmp_path / "cap.png").exists()


def test_registered_in_the_main_cli():
    from batchspec import cli as main_cli

    parser = main_cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert {"import", "simulate", "compare", "sweep"} <= set(commands)


def test_calibrate_command(tmp_path, capsys):
    pytest.importorskip("numpy")
    rows = [{"prefill_tokens": p, "decode_seqs": d, "kv_tokens": 100 * d, "seconds": 0.004 + 3e-5 * p + 2e-5 * d}
            for p in (0, 128, 512, 2048) for d in (1, 8, 64)]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    code, stdout, _ = cli(capsys, "calibrate", tmp_path / "rows.json", "-o", tmp_path / "c.json", "--name", "mine",
                          "--set", "num_blocks=5000")
    assert code == 0
    model = json.loads((tmp_path / "c.json").read_text())
    assert model["name"] == "mine" and model["knobs"] == {"num_blocks": 5000}
    assert model["fixed_s"] == pytest.approx(0.004, rel=1e-3) and model["per_prefill_token_s"] == pytest.approx(3e-5, rel=1e-3)
    code, stdout, _ = cli(capsys, "simulate", example_path(), "--cost-model", tmp_path / "c.json")
    assert code == 0 and "cost model mine" in stdout
