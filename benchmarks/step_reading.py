"""How much code does a reader follow for one profile's step? (issue #16, item 4)

Runs a fixed, seeded set of traces through :class:`spec.scheduler.SpecEngine`
under one profile's knobs and traces, with :func:`sys.settrace`, which
functions of ``spec/`` are entered from ``SpecEngine.step`` and which of their
lines execute.  It prints, per file and in total:

* ``body lines``  — the source lines of every function body entered, without
  its docstring, blank lines and comment-only lines: what a reader following
  the step has to read;
* ``executed``    — the distinct lines among them that ran;
* ``foreign``     — body lines that mention a knob value of another engine
  family (estimate, swap, vtc, static, prefill-first, full reservation,
  new_token_ratio): branches a reader of this profile meets but never takes.

Usage: ``python benchmarks/step_reading.py [--profile vllm-v1] [--traces 200]``.
Deterministic: same arguments, same figures.
"""
from __future__ import annotations

import argparse
import ast
import random
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spec.config import PROFILES  # noqa: E402
from spec.formats import Trace, TraceRequest  # noqa: E402
from spec.protocol import StepLimitError, drive  # noqa: E402
from spec.scheduler import SpecEngine  # noqa: E402

SPEC_DIR = str(ROOT / "spec")
FOREIGN = re.compile(r"estimate|swap|vtc|static|prefill.first|prefill_first|kv_reservation|reservation|"
                     r"new_token_ratio|ratio|retract|cpu_")


def traces(profile: str, n: int, seed: int) -> list[Trace]:
    """Small seeded traces that reach every path of a vLLM-style step: tight memory
    (preemption), shared prefixes (cache hits and evictions), chunked prefills,
    max_num_seqs, EOS and aborts."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        cfg = {"profile": profile, "num_blocks": rng.randint(6, 24), "block_size": rng.choice([2, 4]),
               "max_num_batched_tokens": rng.choice([8, 16, 32]), "max_num_seqs": rng.choice([2, 4, 8]),
               "max_model_len": 64, "max_steps": 2000}
        if not PROFILES[profile].config.enable_chunked_prefill:  # the whole prompt must fit one step
            cfg["max_num_batched_tokens"] = cfg["max_model_len"]
        reqs = []
        for i in range(rng.randint(2, 8)):
            group = rng.choice([None, "g0", "g1"])
            reqs.append(TraceRequest(
                id=f"r{i}", prompt_len=rng.randint(1, 30), max_tokens=rng.randint(1, 12),
                arrival_step=rng.randint(0, 6), prefix_group=group, prefix_len=rng.randint(0, 16) if group else 0,
                abort_at=rng.choice([None] * 6 + [rng.randint(0, 10)]), ignore_eos=rng.random() < 0.5))
        out.append(Trace(config=cfg, requests=reqs))
    return out


def body_lines(path: str, first_line: int) -> set[int]:
    """The body lines of the function starting at ``first_line`` (docstring, blanks, comments excluded)."""
    src = Path(path).read_text().splitlines()
    tree = _tree(path)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                (node.lineno == first_line or (node.decorator_list and node.decorator_list[0].lineno == first_line)):
            body = node.body
            skip = set()
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                skip = set(range(body[0].lineno, body[0].end_lineno + 1))
            lines = set()
            for ln in range(node.lineno, node.end_lineno + 1):
                text = src[ln - 1].strip()
                if ln in skip or not text or text.startswith("#") or text.startswith("@"):
                    continue
                lines.add(ln)
            return lines
    return set()


_TREES: dict[str, ast.AST] = {}


def _tree(path: str) -> ast.AST:
    if path not in _TREES:
        _TREES[path] = ast.parse(Path(path).read_text())
    return _TREES[path]


def measure(profile: str, n: int, seed: int) -> tuple[dict, dict]:
    entered: set[tuple[str, int]] = set()
    executed: dict[str, set[int]] = defaultdict(set)
    depth = [0]

    def local(frame, event, arg):
        if event == "line":
            executed[frame.f_code.co_filename].add(frame.f_lineno)
        return local

    def tracer(frame, event, arg):
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(SPEC_DIR):
            return None
        if code.co_name in ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>", "<lambda>"):
            return local
        entered.add((code.co_filename, code.co_firstlineno))
        return local

    original = SpecEngine.step

    def traced_step(self):
        depth[0] += 1
        sys.settrace(tracer)
        try:
            return original(self)
        finally:
            sys.settrace(None)
            depth[0] -= 1

    SpecEngine.step = traced_step
    try:
        for tr in traces(profile, n, seed):
            eng = SpecEngine.from_trace(tr)
            try:
                drive(eng, tr, 2000)
            except StepLimitError:
                pass
    finally:
        SpecEngine.step = original
    bodies: dict[str, set[int]] = defaultdict(set)
    for path, first in entered:
        bodies[path] |= body_lines(path, first)
    return bodies, executed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="vllm-v1")
    ap.add_argument("--traces", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show-foreign", action="store_true", help="list the foreign lines")
    args = ap.parse_args()
    bodies, executed = measure(args.profile, args.traces, args.seed)
    print(f"profile {args.profile}: {args.traces} traces, seed {args.seed}; spec functions entered from step()")
    print(f"  {'file':<22}{'body lines':>12}{'executed':>10}{'foreign':>9}")
    totals = [0, 0, 0]
    for path in sorted(bodies):
        lines = bodies[path]
        src = Path(path).read_text().splitlines()
        ran = len(lines & executed[path])
        foreign = sum(1 for ln in lines if FOREIGN.search(src[ln - 1]))
        for i, v in enumerate((len(lines), ran, foreign)):
            totals[i] += v
        print(f"  {Path(path).relative_to(ROOT).as_posix():<22}{len(lines):>12}{ran:>10}{foreign:>9}")
        if args.show_foreign:
            for ln in sorted(ln for ln in lines if FOREIGN.search(src[ln - 1])):
                print(f"      {ln:>5}: {src[ln - 1].strip()}")
    print(f"  {'total':<22}{totals[0]:>12}{totals[1]:>10}{totals[2]:>9}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
