"""Record vLLM's decision logs on the known-bug traces (tests/corpus/vllm-known/) and say what each shows.

Run with the vLLM venv (0.32.0; prefix PYTHONPATH=/path/to/vllm-0.33 for 0.33.0):

    python scripts/record_known_bugs.py            # writes tests/corpus/vllm-known/vllm-<release>/NAME.log.jsonl

The installed release runs as it is (engine ``vllm-release``): the traces are fcfs, where the releases'
one scheduling difference (priority_self_preempt) does not arise.  For each trace it prints whether
vLLM finished, raised or ran to the step limit, whether the spec agrees with its log, the invariants
its log breaks on its own, and the evidence that the trace reaches the bug's code path: preemptions
of a request whose output was in flight (async), chunked prefills beside decodes, the largest number
of preemptions in one step."""
from __future__ import annotations

import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fuzz.replay import replay_records  # noqa: E402
from fuzz.vllm_adapter import VllmEngine, installed_release  # noqa: E402
from invariants.log_checker import check_log  # noqa: E402
from spec.config import resolve  # noqa: E402
from spec.formats import DecisionLog  # noqa: E402
from spec.io import load_trace, write_log  # noqa: E402
from spec.protocol import StepLimitError, drive  # noqa: E402

KNOWN = ROOT / "tests" / "corpus" / "vllm-known"


def evidence(records) -> str:
    """How often the trace reaches the code paths of the async bugs."""
    in_flight = 0
    for prev, rec in zip(records, records[1:]):
        running_before = {r for r, _ in prev.scheduled}
        in_flight += sum(1 for r in rec.preempted if r in running_before)
    chunked = sum(1 for rec in records if any(n > 1 for _, n in rec.scheduled) and any(n == 1 for _, n in rec.scheduled))
    most = max((len(rec.preempted) for rec in records), default=0)
    return (f"preemptions with output in flight: {in_flight}; steps with a prefill beside a decode: {chunked}; "
            f"most preemptions in one step: {most}; preemptions: {sum(len(r.preempted) for r in records)}")


def main() -> int:
    release = installed_release()
    out_dir = KNOWN / f"vllm-{release}"
    out_dir.mkdir(exist_ok=True)
    for path in sorted(KNOWN.glob("*.jsonl")):
        trace = load_trace(path, steps=True)
        engine = VllmEngine(trace, release_as_is=True)
        crash = None
        try:
            records = drive(engine, trace, resolve(trace.config).max_steps)
        except StepLimitError as e:
            records = e.records
        except Exception as e:  # noqa: BLE001  (an engine-core assertion is what a known bug looks like)
            records, crash = [], "".join(traceback.format_exception(type(e), e, e.__traceback__))
        if crash:
            print(f"{path.stem}: vLLM {release} RAISED\n{crash}")
            continue
        log = DecisionLog(f"vllm-{release}", "exact", records, trace=f"../{path.name}", config=trace.config)
        write_log(log, out_dir / f"{path.stem}.log.jsonl")
        result = replay_records(trace, records, "exact", engine=f"vllm-{release}", after=0)
        broken = check_log(log, resolve(trace.config), trace).violations
        print(f"{path.stem}: vLLM {release}: {len(records)} steps; spec "
              f"{'agrees' if result.agreed else 'DIVERGES: ' + result.divergence.describe()}; "
              f"invariants broken: {sorted({v.invariant for v in broken}) or 'none'}; {evidence(records)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
