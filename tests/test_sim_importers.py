"""Importers on the bundled trace samples (batchspec/data/traces/), and on bad input."""
import functools
import json
import statistics

import pytest

from batchspec.data import TRACES
from fuzz.importers import ImportOptions, arrival_process, detect, import_trace, parse_azure_timestamp
from spec.io import FormatError, load_trace, write_trace


@functools.lru_cache(maxsize=None)
def _imported(name, kw):
    return import_trace(str(TRACES / name), opts=ImportOptions(**dict(kw)))


def imported(name, **kw):
    """Each sample is imported once per options per test session (the traces are not mutated)."""
    return _imported(name, tuple(sorted(kw.items())))


def test_azure_conv_crlf_7_digit_timestamps():
    raw = (TRACES / "azure_llm_2023_conv.csv").read_bytes()
    assert b"\r\n" in raw and not raw.endswith(b"\n")  # the file really is CRLF with no final newline
    trace, report = imported("azure_llm_2023_conv.csv")
    assert report.format == "azure" and report.rows == len(trace.requests) == 19366 and not report.dropped
    first, second, last = trace.requests[0], trace.requests[1], trace.requests[-1]
    assert (first.id, first.prompt_len, first.max_tokens, first.arrival_time) == ("r0", 374, 44, 0.0)
    # 18:15:50.9951690 - 18:15:46.6805900, all 7 digits kept
    assert second.arrival_time == pytest.approx(4.3145790, abs=1e-9)
    assert (last.id, last.prompt_len, last.max_tokens) == ("r19365", 197, 183)
    assert last.arrival_time == pytest.approx(3501.72, abs=0.01)
    assert all(a.arrival_time <= b.arrival_time for a, b in zip(trace.requests, trace.requests[1:]))
    assert max(r.prompt_len for r in trace.requests) == 14050


def test_azure_code():
    trace, report = imported("azure_llm_2023_code.csv")
    assert len(trace.requests) == 8819
    assert trace.requests[0].prompt_len == 4808 and trace.requests[0].max_tokens == 10


def test_azure_timestamp_keeps_the_seventh_digit():
    a = parse_azure_timestamp("2023-11-16 18:17:03.9799600", "f", 2)
    b = parse_azure_timestamp("2023-11-16 18:17:03.0000001", "f", 3)
    assert a - b == 979_959_900  # nanoseconds, exact
    with pytest.raises(FormatError, match="f:4: TIMESTAMP"):
        parse_azure_timestamp("16/11/2023 18:17", "f", 4)


def test_mooncake_hash_ids_become_prefix_groups():
    trace, report = imported("mooncake_fast25_conversation_trace_head.jsonl")
    assert len(trace.requests) == 7978
    rows = [json.loads(line) for line in (TRACES / "mooncake_fast25_conversation_trace_head.jsonl").read_text().splitlines()]
    assert trace.requests[0].arrival_time == 0.0 and trace.requests[-1].arrival_time == pytest.approx(2430.0)
    note = next(n for n in report.notes if n.startswith("shared prefixes"))
    kept = float(note.split("(")[1].split("%")[0])
    assert 90 < kept <= 100  # most of the real reuse survives the cut into chains

    def lcp_tokens(a, b):
        k = 0
        while k < min(len(a["hash_ids"]), len(b["hash_ids"])) and a["hash_ids"][k] == b["hash_ids"][k]:
            k += 1
        return min(k * 512, a["input_length"], b["input_length"])

    by_group = {}
    for req, row in zip(trace.requests, rows):
        by_group.setdefault(req.prefix_group, []).append((req, row))
    multi = [members for members in by_group.values() if len(members) > 1]
    assert len(multi) > 100
    for members in multi[:200]:
        for (ra, a), (rb, b) in zip(members, members[1:]):
            # the modelled shared prefix never exceeds the real one (no invented cache hits)
            assert min(ra.prefix_len, rb.prefix_len) <= lcp_tokens(a, b)
    # requests of one group really share their first tokens
    (ra, a), (rb, b) = multi[0][0], multi[0][1]
    shared = min(ra.prefix_len, rb.prefix_len)
    assert shared > 0 and ra.prompt_token_ids()[:shared] == rb.prompt_token_ids()[:shared]


def test_mooncake_synthetic():
    trace, report = imported("mooncake_fast25_synthetic_trace.jsonl")
    assert len(trace.requests) == 3993 and trace.requests[-1].arrival_time == pytest.approx(1022.025)


def test_burstgpt_failure_rows_dropped_and_columns_by_name():
    t1, r1 = imported("burstgpt_1_first400.csv")
    assert r1.rows == 400 and len(t1.requests) == 383 and sum(r1.dropped.values()) == 17
    assert all(r.prompt_len > 0 and r.max_tokens > 0 for r in t1.requests)
    t3, r3 = imported("burstgpt_3_first400.csv", tenant_column="Model")
    assert len(t3.requests) == 399  # one zero-token row
    first = t3.requests[0]  # columns inserted at positions 2 and 3 are read by name
    assert (first.prompt_len, first.max_tokens, first.tenant) == (906, 446, "GPT-4")
    assert {r.tenant for r in t3.requests} == {"ChatGPT", "GPT-4"}
    assert t3.requests[1].arrival_time == 51.0  # 19440161.0 - 19440110.0


def test_length_tables_get_a_seeded_arrival_process():
    a, report = imported("sharegpt_8k_lengths_llama2_tokenizer.csv", rate=4.0, seed=7)
    assert len(a.requests) == 30731 and (a.requests[0].prompt_len, a.requests[0].max_tokens) == (74, 918)
    assert [r.arrival_time for r in a.requests[:50]] == [round(t, 9) for t in arrival_process(50, 4.0, seed=7)]
    assert report.rate == pytest.approx(4.0, rel=0.03)
    arxiv, _ = imported("arxiv_summarization_lengths_llama2_tokenizer.csv", rate=2.0, first=1000)
    assert len(arxiv.requests) == 1000 and arxiv.requests[0].prompt_len == 3772
    with pytest.raises(FormatError, match="rate"):
        imported("sharegpt_8k_lengths_llama2_tokenizer.csv")


def test_gamma_process_is_burstier_than_poisson():
    gaps = lambda ts: [b - a for a, b in zip(ts, ts[1:])]  # noqa: E731
    poisson = gaps(arrival_process(5000, 10.0, "poisson", seed=1))
    gamma = gaps(arrival_process(5000, 10.0, "gamma", cv=3.0, seed=1))
    assert statistics.mean(poisson) == pytest.approx(0.1, rel=0.05)
    assert statistics.mean(gamma) == pytest.approx(0.1, rel=0.15)
    assert statistics.stdev(gamma) / statistics.mean(gamma) > 2 * statistics.stdev(poisson) / statistics.mean(poisson)


def test_sampling_first_window_speedup():
    t, report = imported("azure_llm_2023_code.csv", window=(100.0, 200.0), speedup=2.0)
    full, _ = imported("azure_llm_2023_code.csv")
    inside = [r for r in full.requests if 100.0 <= r.arrival_time < 200.0]
    assert [r.id for r in t.requests] == [r.id for r in inside]  # ids name the source row
    assert t.requests[0].arrival_time == 0.0
    assert t.requests[-1].arrival_time == pytest.approx((inside[-1].arrival_time - inside[0].arrival_time) / 2, abs=1e-6)
    first, _ = imported("azure_llm_2023_code.csv", first=10)
    assert [r.id for r in first.requests] == [f"r{i}" for i in range(10)]


def test_detect():
    expected = {"azure_llm_2023_conv.csv": "azure", "mooncake_fast25_synthetic_trace.jsonl": "mooncake",
                "burstgpt_3_first400.csv": "burstgpt", "arxiv_summarization_lengths_llama2_tokenizer.csv": "lengths"}
    for name, fmt in expected.items():
        assert detect(str(TRACES / name)) == fmt


def test_vidur_and_llmservingsim(tmp_path):
    vidur = tmp_path / "trace.csv"
    vidur.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,591,140\n0.125,547,248\n0.5,12,1\n")
    trace, report = import_trace(str(vidur))
    assert report.format == "vidur"
    assert [(r.prompt_len, r.max_tokens, r.arrival_time) for r in trace.requests] == [(591, 140, 0.0), (547, 248, 0.125), (12, 1, 0.5)]
    sim = tmp_path / "example_trace.jsonl"
    sim.write_text("\n".join(json.dumps(o) for o in (
        {"input_toks": 3, "output_toks": 5, "arrival_time_ns": 0, "input_tok_ids": [40000, 2, 3]},
        {"input_toks": 4, "output_toks": 2, "arrival_time_ns": 250_000_000},
    )) + "\n")
    trace, report = import_trace(str(sim))
    assert report.format == "llmservingsim"
    assert trace.requests[0].prompt == (40000, 2, 3) and trace.vocab_size == 40001  # real ids kept for prefix caching
    assert trace.requests[1].arrival_time == 0.25 and trace.requests[1].prompt is None
    out = tmp_path / "out.jsonl"
    write_trace(trace, out)
    assert load_trace(out).requests == trace.requests  # a valid batchspec trace
    (tmp_path / "agentic.jsonl").write_text(json.dumps({"session_id": "s", "arrival_time_ns": 0, "sub_requests": []}) + "\n")
    with pytest.raises(FormatError, match="agentic.jsonl:1: sub_requests: agentic sessions are closed-loop"):
        import_trace(str(tmp_path / "agentic.jsonl"))


@pytest.mark.parametrize("content, message", [
    ("TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:15:46.6805900,374,44\r\n2023-11-16 18:15:47.0,x,5",
     "bad.csv:3: ContextTokens: expected an integer, got 'x'"),
    ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6805900,374\n", None),  # detected as azure, then a missing column
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,5,-1\n", "bad.csv:2: num_decode_tokens: must be >= 0, got -1"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\nnan,5,1\n", "bad.csv:2: arrived_at: expected a finite number"),
])
def test_bad_csv_is_file_line_field_problem(tmp_path, content, message):
    path = tmp_path / "bad.csv"
    path.write_bytes(content.encode())
    with pytest.raises(FormatError) as e:
        import_trace(str(path))
    if message:
        assert str(e.value).startswith(str(tmp_path / message.split(":")[0]) + message[len(message.split(":")[0]):])
    else:
        assert ": GeneratedTokens: missing column" in str(e.value)


def test_bad_mooncake_hash_ids(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 1000, "output_length": 3, "hash_ids": [1]}) + "\n")
    with pytest.raises(FormatError, match=r"m.jsonl:1: hash_ids: 1 ids for 1000 tokens"):
        import_trace(str(path))
    path.write_text('{"timestamp": 0, "input_length": 10,\n')
    with pytest.raises(FormatError, match=r"m.jsonl:1: \(line\): invalid JSON"):
        import_trace(str(path), "mooncake")
