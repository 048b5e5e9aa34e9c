"""nano-vllm's real scheduler behind the engine protocol (optional extra ``nanovllm``).

:class:`NanoVllmEngine` drives ``nanovllm.engine.scheduler.Scheduler`` and its
``BlockManager`` from a nano-vllm checkout the user points to
(GeeeekExplorer/nano-vllm, MIT; the ``nano-vllm`` profile is checked against commit
:data:`NANOVLLM_COMMIT`; it is not on PyPI).  The checkout is found from the
``path`` argument or the ``BATCHSPEC_NANOVLLM`` environment variable, e.g.::

    git clone https://github.com/GeeeekExplorer/nano-vllm /tmp/nano-vllm
    git -C /tmp/nano-vllm checkout bb823b3e06983d71485a8e1f23715ebd87d98ef8
    pip install -e '.[nanovllm]'      # xxhash and numpy, which its block manager imports
    BATCHSPEC_NANOVLLM=/tmp/nano-vllm python -m fuzz.nanovllm_adapter record --out tests/corpus/nano-vllm

Only the engine modules are imported (``sampling_params``, ``engine.sequence``,
``engine.block_manager``, ``engine.scheduler``), without running the package's
``__init__`` (which loads the model runner, torch and flash-attention).  The one
module stubbed is ``nanovllm.config``: the scheduler imports its ``Config`` only as a
type annotation, and the real one imports ``transformers`` and asserts a model folder
and ``kvcache_block_size % 256 == 0``.  The adapter passes the scheduler a plain
namespace with the fields it reads instead, so a trace may use small blocks; the
scheduler and block manager are block-size generic for ``block_size >= 2``.

The fake model: ``schedule()`` returns the batch; each sequence whose prefill is
complete after the step (every decode, and a prefill that reaches its last token)
samples the token the trace prescribes (``TraceRequest.output_token``); a cut
prefill samples nothing; then nano-vllm's own ``postprocess`` appends tokens,
applies EOS (unless ``ignore_eos``) and ``max_tokens``, hashes computed blocks and
frees finished sequences.  The adapter decides nothing itself: it does not reject
requests at arrival (nano-vllm has no such rule), so a request that can never fit
reaches nano-vllm, which then raises ``AssertionError`` in ``schedule()`` (a finding:
docs/conformance.md).

What it reads to write a decision log at the ``exact`` level: the batch and its
token counts; admissions (a sequence that gained a block table in ``schedule()``:
``new``, or ``resumed`` after a preemption) with their prefix hits
(``num_cached_tokens`` right after allocation); preemptions in order (observing
``Scheduler.preempt`` on the instance); finishes in batch order with their reason;
the free-block count and every block table at the end of the step; and evictions,
observed on ``BlockManager._allocate_block``: a popped block whose hash still maps
to it in ``hash_to_block_id`` (the one place a cached block leaves the cache).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import random
import sys
import types
from dataclasses import fields
from itertools import chain
from pathlib import Path
from typing import Any

from fuzz.replay import EngineConfigError, EngineUnavailable
from spec.config import PROFILES, SchedulerConfig, resolve
from spec.formats import FINISH_EOS, FINISH_MAX_TOKENS, StepRecord, Trace, TraceRequest

#: The nano-vllm commit the ``nano-vllm`` profile is checked against.
NANOVLLM_COMMIT = "bb823b3e06983d71485a8e1f23715ebd87d98ef8"
ENGINE_NAME = f"nano-vllm-{NANOVLLM_COMMIT[:7]}"

#: Knobs the adapter maps onto nano-vllm's configuration; ``max_model_len`` and
#: ``reject_unservable`` only bound the spec's side (nano-vllm's scheduler has neither),
#: ``max_steps`` is the driver's.
MAPPED_KNOBS = frozenset({"num_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len",
                          "reject_unservable", "max_steps"})

_MODULES: dict[str, Any] = {}


def checkout_path(path: str | os.PathLike | None = None) -> Path:
    """The nano-vllm checkout: ``path``, else ``$BATCHSPEC_NANOVLLM``."""
    raw = path or os.environ.get("BATCHSPEC_NANOVLLM")
    if not raw:
        raise EngineUnavailable("no nano-vllm checkout: pass its path or set BATCHSPEC_NANOVLLM "
                                f"(git clone https://github.com/GeeeekExplorer/nano-vllm; checkout {NANOVLLM_COMMIT})")
    root = Path(raw).expanduser().resolve()
    if not (root / "nanovllm" / "engine" / "scheduler.py").is_file():
        raise EngineUnavailable(f"{root}: not a nano-vllm checkout (no nanovllm/engine/scheduler.py)")
    return root


def nanovllm_modules(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Import nano-vllm's engine modules from the checkout once per process."""
    if _MODULES:
        return _MODULES
    root = checkout_path(path)
    loaded = sys.modules.get("nanovllm")
    if loaded is not None and Path(getattr(loaded, "__path__", [""])[0]).resolve() != root / "nanovllm":
        raise EngineUnavailable(f"another nanovllm package is already imported ({loaded.__path__})")
    missing = [m for m in ("xxhash", "numpy") if importlib.util.find_spec(m) is None]  # block_manager's imports
    if missing:
        raise EngineUnavailable(f"{', '.join(missing)} not installed: install the `nanovllm` extra "
                                "(pip install -e '.[nanovllm]')")
    # Packages without their __init__ (the model runner pulls torch and flash-attention),
    # and a stand-in for nanovllm.config, whose Config the scheduler uses only as an annotation.
    for name, sub in (("nanovllm", "nanovllm"), ("nanovllm.engine", "nanovllm/engine")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(root / sub)]
        sys.modules[name] = pkg
    config = types.ModuleType("nanovllm.config")
    config.Config = types.SimpleNamespace
    sys.modules["nanovllm.config"] = config
    try:
        _MODULES.update(
            SamplingParams=importlib.import_module("nanovllm.sampling_params").SamplingParams,
            Sequence=importlib.import_module("nanovllm.engine.sequence").Sequence,
            Scheduler=importlib.import_module("nanovllm.engine.scheduler").Scheduler,
            root=root,
        )
    except Exception as e:  # pragma: no cover - depends on the checkout
        for name in ("nanovllm", "nanovllm.engine", "nanovllm.config"):
            sys.modules.pop(name, None)
        raise EngineUnavailable(f"nano-vllm's engine modules do not import from {root}: {e!r}") from e
    return _MODULES


def check_supported(cfg: SchedulerConfig, trace: Trace) -> None:
    """Raise :class:`EngineConfigError` for what nano-vllm cannot express: any knob
    other than :data:`MAPPED_KNOBS` away from the ``nano-vllm`` profile, block size 1,
    stop tokens, aborts."""
    base = PROFILES["nano-vllm"].config
    for f in fields(cfg):
        if f.name != "profile" and f.name not in MAPPED_KNOBS and getattr(cfg, f.name) != getattr(base, f.name):
            raise EngineConfigError(f"{f.name}={getattr(cfg, f.name)!r} cannot be run on nano-vllm "
                                    f"(only {getattr(base, f.name)!r})")
    if cfg.block_size < 2:
        raise EngineConfigError("block_size=1: nano-vllm's can_append (len % block_size == 1) never allocates")
    for r in trace.requests:
        if r.stop_token_ids:
            raise EngineConfigError(f"request {r.id}: stop_token_ids: nano-vllm stops on EOS and max_tokens only")
        if r.abort_at is not None:
            raise EngineConfigError(f"request {r.id}: abort_at: nano-vllm's scheduler has no abort")


class NanoVllmEngine:
    """nano-vllm's ``Scheduler`` as an engine of the protocol (see the module docstring)."""

    name = "nano-vllm"
    #: Its envelope for campaigns (fuzz.capabilities): the nano-vllm profile, blocks of 2 to 256
    #: tokens.  Traces with aborts or stop tokens are still refused (EngineConfigError).
    capabilities = {"profile": "nano-vllm", "knobs": {"block_size": [2, 4, 8, 16, 256]}}

    def __init__(self, trace: Trace, path: str | os.PathLike | None = None):
        m = nanovllm_modules(path)
        self.config = cfg = resolve(trace.config)
        check_supported(cfg, trace)
        self.vocab_size = trace.vocab_size
        self.eos_token_id = trace.eos_token_id
        self._Sequence, self._SamplingParams = m["Sequence"], m["SamplingParams"]
        self._Sequence.block_size = cfg.block_size  # a class attribute, as nano-vllm's LLMEngine sets it
        self.scheduler = m["Scheduler"](types.SimpleNamespace(
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            eos=trace.eos_token_id, kvcache_block_size=cfg.block_size, num_kvcache_blocks=cfg.num_blocks))
        self.bm = self.scheduler.block_manager
        self.ids: dict[int, str] = {}  # seq_id -> request id
        self.sources: dict[str, TraceRequest] = {}
        self.seqs: list[Any] = []
        self.ever_preempted: set[str] = set()
        self._preempted: list[str] = []
        self._evicted: list[int] = []
        self._registered: dict[str, list[int]] = {}  # request -> block ordinals hash_blocks cached in this step
        self._observe()

    def _observe(self) -> None:
        """Record preemptions and evictions as nano-vllm makes them (instance attributes only)."""
        scheduler, bm = self.scheduler, self.bm
        preempt, allocate_block, hash_blocks = scheduler.preempt, bm._allocate_block, bm.hash_blocks

        def on_preempt(seq):
            self._preempted.append(self.ids[seq.seq_id])
            return preempt(seq)

        def on_allocate_block():
            block = bm.blocks[bm.free_block_ids[0]]
            if block.hash != -1 and bm.hash_to_block_id.get(block.hash) == block.block_id:
                self._evicted.append(block.block_id)
            return allocate_block()

        def on_hash_blocks(seq):
            start = seq.num_cached_tokens // bm.block_size  # (hash_blocks' own range)
            end = (seq.num_cached_tokens + seq.num_scheduled_tokens) // bm.block_size
            if end > start:
                self._registered.setdefault(self.ids[seq.seq_id], []).extend(range(start, end))
            return hash_blocks(seq)

        scheduler.preempt = on_preempt
        bm._allocate_block = on_allocate_block
        bm.hash_blocks = on_hash_blocks

    # -- protocol --------------------------------------------------------

    def add_request(self, tr: TraceRequest) -> None:
        if tr.id in self.sources:
            raise ValueError(f"duplicate request id {tr.id!r}")
        self.sources[tr.id] = tr
        params = self._SamplingParams(max_tokens=tr.max_tokens, ignore_eos=tr.ignore_eos)
        seq = self._Sequence(tr.prompt_token_ids(self.vocab_size), params)
        self.ids[seq.seq_id] = tr.id
        self.seqs.append(seq)
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        raise EngineConfigError("nano-vllm's scheduler has no abort")

    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.is_finished()

    def step(self) -> StepRecord:
        self._Sequence.block_size = self.config.block_size
        had_blocks = {seq.seq_id for seq in self.seqs if seq.block_table}
        seqs, is_prefill = self.scheduler.schedule()
        scheduled = [(self.ids[s.seq_id], s.num_scheduled_tokens) for s in seqs]
        admitted = [s for s in seqs if s.seq_id not in had_blocks]
        new = [self.ids[s.seq_id] for s in admitted if self.ids[s.seq_id] not in self.ever_preempted]
        resumed = [self.ids[s.seq_id] for s in admitted if self.ids[s.seq_id] in self.ever_preempted]
        hits = {self.ids[s.seq_id]: s.num_cached_tokens for s in admitted}
        hit_blocks = {self.ids[s.seq_id]: s.block_table[:s.num_cached_tokens // self.config.block_size]
                      for s in admitted if s.num_cached_tokens}  # (read now: postprocess may free them)
        sampled: dict[str, int] = {}
        tokens = []
        for s in seqs:
            rid = self.ids[s.seq_id]
            samples = not is_prefill or s.num_cached_tokens + s.num_scheduled_tokens >= s.num_tokens
            token = self.sources[rid].output_token(s.num_completion_tokens, self.vocab_size) if samples else 0
            if samples:
                sampled[rid] = token
            tokens.append(token)  # a cut prefill's entry is never read (postprocess skips it)
        self.scheduler.postprocess(seqs, tokens, is_prefill)
        finished = [(self.ids[s.seq_id], self._finish_reason(s)) for s in seqs if s.is_finished]
        self.ever_preempted.update(self._preempted)
        tables = {self.ids[s.seq_id]: list(s.block_table) for s in self.seqs if s.block_table}
        record = StepRecord(
            step=-1, scheduled=scheduled, new=new, resumed=resumed, preempted=self._preempted, finished=finished,
            aborted=[], rejected=[], sampled=sampled, num_free_blocks=len(self.bm.free_block_ids),
            blocks={rid: len(t) for rid, t in tables.items()}, cache_hits=hits, num_evicted=len(self._evicted),
            block_ids=tables, evicted=self._evicted,
        )
        self._state(record, hit_blocks)
        self._preempted, self._evicted, self._registered = [], [], {}
        return record

    def _state(self, record: StepRecord, hit_blocks: dict[str, list[int]]) -> None:
        """The optional state fields, read from nano-vllm's objects at the end of the step: its
        waiting queue, each running sequence's ``num_cached_tokens`` (its computed tokens; 0 for a
        preempted one, which ``deallocate`` resets), the block ordinals each ``hash_blocks`` call
        of the step hashed into ``hash_to_block_id``, the admitted sequences' hit blocks, each held
        block's ``ref_count`` and the block id of every ``hash_to_block_id`` entry."""
        sched, bm = self.scheduler, self.bm
        # a sequence whose prefill was cut stays at the head of nano-vllm's waiting queue holding its
        # blocks: running in the protocol's terms (admitted, as step() reads it), as in the spec
        record.waiting = sorted(self.ids[s.seq_id] for s in sched.waiting if not s.block_table)
        record.computed = {self.ids[s.seq_id]: s.num_cached_tokens for s in chain(sched.running, sched.waiting)
                           if s.block_table or self.ids[s.seq_id] in self.ever_preempted}
        record.cache_registered = {rid: list(m) for rid, m in self._registered.items()}
        record.hit_blocks = hit_blocks
        record.ref_counts = {str(b): bm.blocks[b].ref_count for table in record.block_ids.values() for b in table}
        record.cached_blocks = sorted(bm.hash_to_block_id.values())

    def _finish_reason(self, seq) -> str:
        """nano-vllm stops on EOS first, then on max_tokens (postprocess)."""
        eos = not seq.ignore_eos and seq.last_token == self.eos_token_id
        return FINISH_EOS if eos else FINISH_MAX_TOKENS


# --------------------------------------------------------------------------
# Traces for the recorded corpus, and recording.
# --------------------------------------------------------------------------

#: What each kind of corpus trace stresses (the kind is in the trace's name).
KINDS = ("tight", "prefix", "long", "seqs", "eos", "mixed")


def corpus_trace(seed: int, kind: str | None = None, never_fits: bool = False) -> Trace:
    """One fuzzed trace for the ``nano-vllm`` profile, drawn from ``seed``.

    Kinds: ``tight`` (few blocks: preemption and self-preemption), ``prefix`` (shared
    prefixes: hits, duplicates computed in one step, evictions), ``long`` (prompts
    longer than the token budget: cut prefills), ``seqs`` (max_num_seqs from 1 up),
    ``eos`` (early EOS), ``mixed``.  Every request fits the pool on its own
    (``prompt + max_tokens - 1`` slots at most) unless ``never_fits`` adds one that
    cannot, and ``max_num_seqs <= max_num_batched_tokens`` (nano-vllm's decode
    ignores the budget: a separate finding).
    """
    rng = random.Random(f"nano-vllm corpus {seed}")
    kind = kind or KINDS[seed % len(KINDS)]
    bs = rng.choice([2, 4, 4, 8, 16]) if rng.random() < 0.9 else 256
    unit = max(1, bs // 4) if bs >= 64 else 1  # scale lengths with big blocks
    budget = rng.choice([8, 16, 32, 64]) * unit
    if kind == "long":
        budget = rng.choice([4, 8, 12]) * unit
    seqs = rng.choice([1, 2, 3, 4, 8, 16]) if kind == "seqs" else rng.choice([2, 4, 8, 32])
    seqs = min(seqs, budget)
    n = rng.randint(2, 10)
    max_prompt = {"long": 60, "tight": 24}.get(kind, 40) * unit
    groups = [(f"g{g}", rng.randint(1, 24) * unit) for g in range(rng.randint(1, 3))]
    reqs = []
    for i in range(n):
        prompt = rng.randint(1, max_prompt)
        r: dict[str, Any] = {"id": f"r{i}", "arrival_step": rng.randint(0, 8) if rng.random() < 0.7 else 0,
                             "max_tokens": rng.randint(1, 16 if kind != "tight" else 24)}
        if kind in ("prefix", "mixed") and rng.random() < 0.7 or rng.random() < 0.2:
            g, plen = rng.choice(groups)
            roll = rng.random()
            prompt = plen if roll < 0.3 else plen + rng.randint(0, 12 * unit)
            r.update(prefix_group=g, prefix_len=min(plen, prompt))
        r["prompt_len"] = prompt
        if kind in ("eos", "mixed") and rng.random() < 0.5:
            at = rng.randint(0, r["max_tokens"] - 1)
            r["output_tokens"] = tuple(3 + rng.randrange(1000) for _ in range(at)) + (2,)
        if rng.random() < 0.15:
            r["ignore_eos"] = True
            r.pop("output_tokens", None)
        reqs.append(r)
    peak = max(r["prompt_len"] + r["max_tokens"] - 1 for r in reqs)
    need = -(-peak // bs)
    blocks = need + (rng.randint(0, 2) if kind == "tight" else rng.randint(0, 3 * need + 4))
    if never_fits:
        big = {"id": "huge", "arrival_step": rng.randint(0, 3), "prompt_len": rng.randint(1, 2 * bs),
               "max_tokens": 1}
        big["max_tokens"] = blocks * bs - big["prompt_len"] + 2 + rng.randint(0, bs)  # peak > the whole pool
        if rng.random() < 0.5:  # or a prompt that alone needs more blocks than the pool
            big["prompt_len"], big["max_tokens"] = blocks * bs + 1 + rng.randint(0, bs), 1 + rng.randint(0, 3)
        reqs.insert(rng.randint(0, len(reqs)), big)
    reqs.sort(key=lambda r: r["arrival_step"])  # a trace file lists requests in arrival order
    max_len = max(4096, max(r["prompt_len"] + r["max_tokens"] for r in reqs))
    config = {"profile": "nano-vllm", "block_size": bs, "num_blocks": blocks, "max_num_batched_tokens": budget,
              "max_num_seqs": seqs, "max_model_len": max_len, "max_steps": 2000}
    name = f"nano-{kind}-{seed}" + ("-never-fits" if never_fits else "")
    return Trace(config=config, requests=[TraceRequest(**r) for r in reqs], name=name)


def record(trace: Trace, path: str | os.PathLike | None = None) -> tuple[list[StepRecord], str | None]:
    """Run ``trace`` on nano-vllm: its records, and the error it raised (``None`` if none)."""
    from fuzz.replay import SideError, Stepper

    stepper = Stepper(NanoVllmEngine(trace, path), trace)
    max_steps = resolve(trace.config).max_steps
    records: list[StepRecord] = []
    try:
        while (k := stepper.next_step()) is not None and k < max_steps:
            records.append(stepper.run_step())
    except SideError as e:  # nano-vllm raised: the text names its file relative to the checkout
        return records, e.text.replace(f"{nanovllm_modules(path)['root']}{os.sep}", "")
    return records, None


def _trace_lines(trace: Trace) -> list[dict]:
    return [trace.header_json()] + [r.to_json() for r in trace.requests]


def _log_lines(trace: Trace, records: list[StepRecord]) -> list[dict]:
    from spec.formats import DecisionLog

    log = DecisionLog(ENGINE_NAME, "exact", records, trace=trace.name, config=trace.config)
    return [log.header_json()] + [r.to_json("exact") for r in records]


def record_corpus(out: str | os.PathLike, n: int = 300, seed: int = 0, path: str | os.PathLike | None = None,
                  never_fits: int = 12) -> dict[str, int]:
    """Record ``n`` corpus traces (and ``never_fits`` traces with a request that can never
    fit) into ``out/corpus.jsonl`` and ``out/never-fits.jsonl``: one line per trace,
    ``{"trace": [trace lines], "log": [log lines], "error": text or null}``."""
    import json

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    counts = {"traces": 0, "errors": 0}
    for fname, count, bad in (("corpus.jsonl", n, False), ("never-fits.jsonl", never_fits, True)):
        lines = []
        for k in range(seed, seed + count):
            trace = corpus_trace(k, never_fits=bad)
            records, error = record(trace, path)
            counts["traces"] += 1
            counts["errors"] += error is not None
            lines.append(json.dumps({"trace": _trace_lines(trace), "log": _log_lines(trace, records), "error": error},
                                    separators=(",", ":")))
        tmp = out / f".{fname}.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, out / fname)
    return counts


def record_log(trace_path: str | os.PathLike, log_path: str | os.PathLike,
               path: str | os.PathLike | None = None) -> str | None:
    """Record one trace file's nano-vllm decision log (the standard log format) at
    ``log_path``; return the error nano-vllm raised, if any (a log cannot hold it:
    a finding's trace states it in its description)."""
    from spec.formats import DecisionLog
    from spec.io import load_trace, write_log

    trace = load_trace(trace_path)
    records, error = record(trace, path)
    write_log(DecisionLog(ENGINE_NAME, "exact", records, trace=Path(trace_path).as_posix(), config=trace.config),
              log_path)
    return error


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fuzz.nanovllm_adapter",
                                 description="Record nano-vllm decision logs for the corpus (tests/corpus/nano-vllm).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="record the corpus")
    rec.add_argument("--out", default="tests/corpus/nano-vllm")
    rec.add_argument("--traces", type=int, default=300)
    rec.add_argument("--never-fits", type=int, default=12)
    rec.add_argument("--seed", type=int, default=0)
    rec.add_argument("--nanovllm", default=None, help="the nano-vllm checkout (default: $BATCHSPEC_NANOVLLM)")
    one = sub.add_parser("log", help="record one trace file's decision log")
    one.add_argument("trace")
    one.add_argument("--out", required=True, help="the decision log to write")
    one.add_argument("--nanovllm", default=None, help="the nano-vllm checkout (default: $BATCHSPEC_NANOVLLM)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "log":
            error = record_log(args.trace, args.out, args.nanovllm)
            print(f"wrote {args.out}" + (f"; nano-vllm raised {error}" if error else ""))
            return 0
        counts = record_corpus(args.out, args.traces, args.seed, args.nanovllm, args.never_fits)
    except (EngineUnavailable, EngineConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"recorded {counts['traces']} traces into {args.out} ({counts['errors']} raised in nano-vllm)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
