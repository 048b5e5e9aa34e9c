"""gpu_engine against the decision logs recorded from nano-vllm's real scheduler (issue #16,
item 5): the recorded corpus (``tests/corpus/nano-vllm/``, see tests/test_nanovllm_corpus.py)
run through gpu_engine, each record compared with nano-vllm's at the exact level (batch,
tokens, admissions and hits, preemptions, finishes, free-block counts, block tables,
evictions), and the state fields nano-vllm's objects hold (its waiting queue, computed
tokens, the blocks ``hash_blocks`` caches, hit blocks, reference counts, the hash map's
blocks).  gpu_engine implements the ``nano-vllm`` profile's knobs on its own, so this
checks it against the real engine directly, not only through the spec.
"""
from __future__ import annotations

from functools import lru_cache

from fuzz.diff import first_divergence
from gpu_engine import GpuEngine
from spec.config import resolve
from spec.io import load_log, load_trace
from spec.protocol import drive
from spec.scheduler import run
from test_nanovllm_corpus import CORPUS, FINDINGS, entries


def gpu_records(trace, use_numpy=None):
    engine = GpuEngine.from_trace(trace, use_numpy=use_numpy, log_state=True)
    return drive(engine, trace, resolve(trace.config).max_steps)


@lru_cache(maxsize=None)
def corpus():
    return entries("corpus.jsonl")


def test_gpu_engine_reproduces_every_recorded_nano_vllm_log():
    disagree = []
    for trace, records, _ in corpus():
        d = first_divergence(gpu_records(trace), records, "exact", engine="nano-vllm")
        if d is not None:
            disagree.append(f"{trace.name}: {d.describe()}")
    assert len(corpus()) >= 300
    assert not disagree, f"{len(disagree)} of {len(corpus())} recorded traces diverge; first:\n{disagree[0]}"


def test_the_comparison_can_fail():
    """A recorded log with one field changed is caught (the check above is not vacuous)."""
    for trace, records, _ in corpus():
        if any(r.preempted for r in records):
            break
    step = next(i for i, r in enumerate(records) if r.preempted)
    changed = list(records)
    changed[step] = type(records[step]).from_json({**records[step].to_json(), "preempted": []})
    d = first_divergence(gpu_records(trace), changed, "exact", engine="nano-vllm")
    assert d is not None and d.step == records[step].step and d.field == "preempted"


def test_torch_code_path_on_recorded_logs():
    """The CUDA code path (array code as torch ops), on CPU, on a slice of the corpus."""
    for trace, records, _ in corpus()[::10]:
        d = first_divergence(gpu_records(trace, use_numpy=False), records, "exact", engine="nano-vllm")
        assert d is None, f"{trace.name}: {d.describe()}"


def test_never_fits_and_findings_gpu_engine_sides_with_the_spec():
    """Where nano-vllm does what no engine should (a crash on a request that can never fit,
    the recorded findings), gpu_engine makes the spec's decisions, not nano-vllm's."""
    for trace, _, _ in entries("never-fits.jsonl"):
        assert first_divergence(run(trace), gpu_records(trace), "exact", engine="gpu") is None, trace.name
    for name in FINDINGS:
        trace = load_trace(CORPUS / "findings" / f"{name}.jsonl")
        log = load_log(CORPUS / "findings" / f"{name}.log.jsonl")
        mine = gpu_records(trace)
        assert first_divergence(run(trace), mine, "exact", engine="gpu") is None, name
        d = first_divergence(mine, log.records, "exact", engine="nano-vllm")
        assert d is not None and (d.step, d.field) == FINDINGS[name], (name, d and d.describe())
