"""The campaign table of docs/findings/README.md, one row per campaign corpus (issue #21).

    python scripts/campaign-table.py CORPUS...            # a Markdown table, one row per corpus
    python scripts/campaign-table.py --json CORPUS...     # the same figures as JSON

Each CORPUS is the ``--corpus`` directory of a ``batchspec fuzz`` campaign.  The row is read from
what the campaign left there, nothing is re-run:

* the campaign state (``.campaign-ENGINE-LEVEL-seedS-shardIofN.json``, one per shard: shards are
  summed): ``seconds`` — the campaign time in all, which ``--resume`` carries on from (a resumed
  campaign's ``--seconds`` is the total budget, not more time), traces, steps, traces outside the
  envelope (configurations the engine's own validation refuses: not run), harness failures, the
  rule ids the spec fired;
* the rule ids the campaign *could* fire: the envelope the state describes, read back into
  :mod:`fuzz.capabilities` and counted by :func:`fuzz.capabilities.reachable_rules` of this
  checkout (a rule that fired is reachable whatever its declared needs, as in ``batchspec fuzz``);
* the findings' group files (``NAME.group.json``): each finding's triage class (``batchspec triage``),
  ``untriaged`` when it has none.

``--rules-of SRC``: count only the rule ids the campaign's own code had (a checkout or snapshot of
the repository the campaign ran from), when this checkout has added rules since.

Only the standard library and this repository's own (stdlib-only) ``spec`` and ``fuzz.capabilities``
are imported: the script runs in any of the engines' venvs.  Bad input: one line
``CORPUS: FIELD: problem`` and exit 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLASSES = ("engine-bug", "deliberate-difference", "spec-wrong", "untriaged")
HEADER = ("corpus", "engine", "mode", "ran", "traces", "steps", "outside", "harness failures",
          "rule ids hit", "findings", *CLASSES)


class TableInputError(ValueError):
    """A corpus the table cannot be read from: ``CORPUS: FIELD: problem`` (exit 2)."""


def read_states(corpus: Path) -> list[dict]:
    """The corpus's campaign states (one per shard)."""
    if not corpus.is_dir():
        raise TableInputError(f"{corpus}: corpus: not a directory")
    states = []
    for path in sorted(corpus.glob(".campaign-*.json")):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise TableInputError(f"{path}: file: not a readable campaign state ({e})") from None
        if not isinstance(state, dict) or state.get("format") not in (None, "batchspec-campaign"):
            raise TableInputError(f"{path}: format: not a campaign state")
        for name in ("engine", "traces", "steps", "seconds", "covered"):
            if name not in state:
                raise TableInputError(f"{path}: {name}: missing (not a campaign state)")
        states.append(state)
    if not states:
        raise TableInputError(f"{corpus}: corpus: no campaign state (.campaign-*.json) in this directory")
    return states


def _value(text: str):
    """One value of an envelope description: a JSON literal (true, 3, 0.05) or a bare name (fcfs)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def envelope_declaration(description: str) -> dict:
    """The capability declaration (:mod:`fuzz.capabilities` JSON) a campaign state's ``envelope``
    line describes: the inverse of ``Envelope.describe`` (``profile P; knob a|b; knob lo..hi; knob
    any; request features``)."""
    if description.startswith("every profile and knob value"):
        return {"everything": True, "request_features": description.endswith("; request features")}
    parts = [p.strip() for p in description.split(";") if p.strip()]
    if not parts or not parts[0].startswith("profile "):
        raise ValueError(f"not an envelope description: {description!r}")
    out: dict = {"profile": parts[0].removeprefix("profile "), "knobs": {}}
    for part in parts[1:]:
        if part == "request features":
            out["request_features"] = True
            continue
        knob, _, values = part.partition(" ")
        if values == "any":
            out["knobs"][knob] = "any"
        elif ".." in values and "|" not in values:
            lo, _, hi = values.partition("..")
            out["knobs"][knob] = {k: _value(v) for k, v in (("min", lo), ("max", hi)) if v}
        else:
            out["knobs"][knob] = [_value(v) for v in values.split("|")]
    return out


def rules_of(src: str) -> set[str]:
    """The rule ids (those that fire) of the spec in checkout ``src``, read in a separate interpreter."""
    import subprocess

    if not (Path(src) / "spec" / "rules.py").is_file():
        raise TableInputError(f"{src}: --rules-of: not a batchspec checkout (no spec/rules.py)")
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from spec.rules import all_rules; "
            "print(json.dumps(sorted(r.id for r in all_rules().values() if r.fires)))")
    out = subprocess.run([sys.executable, "-c", code, str(Path(src).resolve())], capture_output=True, text=True, cwd=src)
    if out.returncode != 0:
        raise TableInputError(f"{src}: --rules-of: cannot read its spec's rules ({out.stderr.strip().splitlines()[-1:]})")
    return set(json.loads(out.stdout))


def reachable(state: dict, only: set[str] | None = None) -> set[str]:
    """The rule ids the state's envelope can fire (this checkout's reachability; of ``only`` when
    given), plus those it fired."""
    from fuzz.capabilities import parse, reachable_rules
    from spec.rules import all_rules

    fired = {r.id for r in all_rules().values() if r.fires}
    if only is not None:
        fired &= only
    envelope = parse(envelope_declaration(state.get("envelope") or "every profile and knob value"))
    return set(reachable_rules(envelope, fired, state.get("profile"), state.get("knobs") or {})) | set(state["covered"])


def mode_of(envelope: str) -> str:
    """sync / async, plus speculative, from the envelope line ("every mode" for the whole map)."""
    declaration = envelope_declaration(envelope) if envelope else {"everything": True}
    if declaration.get("everything"):
        return "every mode"
    knobs = declaration.get("knobs", {})
    asyn = knobs.get("async_scheduling") == [True]
    drafts = any(v not in (0, "0") for v in knobs.get("num_speculative_tokens", [0])) if isinstance(
        knobs.get("num_speculative_tokens", [0]), list) else True
    return ("async" if asyn else "sync") + (" + speculative" if drafts else "")


def findings(corpus: Path) -> dict[str, str]:
    """Each finding's triage class, from its group file."""
    out = {}
    for group in sorted(corpus.glob("*.group.json")):
        try:
            triage = (json.loads(group.read_text()) or {}).get("triage") or {}
        except (OSError, ValueError) as e:
            raise TableInputError(f"{group}: file: not a readable group file ({e})") from None
        cls = triage.get("class", "untriaged")
        out[group.name.removesuffix(".group.json")] = cls if cls in CLASSES else "untriaged"
    return out


def row(corpus: Path, only: set[str] | None = None) -> dict:
    """The table's figures for one corpus (rule ids of ``only``, when given, as ``--rules-of``)."""
    states = read_states(corpus)
    first = states[0]
    covered = set().union(*(s["covered"] for s in states))
    try:
        can = set().union(*(reachable(s, only) for s in states))
    except ValueError as e:
        raise TableInputError(f"{corpus}: envelope: {e}") from None
    classes = findings(corpus)
    # a finding the state counts but whose group file is missing is counted as untriaged
    names = set(classes) | {n for s in states for n in s.get("findings", {})}
    return {"corpus": corpus.name, "engine": first["engine"], "mode": mode_of(first.get("envelope", "")),
            "envelope": first.get("envelope", ""),
            "seconds": round(max(s["seconds"] for s in states), 1),  # shards run side by side
            "traces": sum(s["traces"] for s in states), "steps": sum(s["steps"] for s in states),
            "outside": sum(s.get("outside_envelope", 0) for s in states),
            "harness_failures": sum(s.get("errors", 0) for s in states),
            "rules_hit": len(covered), "rules_reachable": len(can), "not_hit": sorted(can - covered),
            "findings": len(names),
            "classes": {c: sum(1 for n in names if classes.get(n, "untriaged") == c) for c in CLASSES},
            "finding_classes": {n: classes.get(n, "untriaged") for n in sorted(names)}}


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min"


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * 3 + "---:|" * (len(HEADER) - 3)]
    for r in rows:
        cells = [r["corpus"], r["engine"], r["mode"], minutes(r["seconds"]), f"{r['traces']:,}",
                 f"{r['steps']:,}", f"{r['outside']:,}", str(r["harness_failures"]),
                 f"{r['rules_hit']}/{r['rules_reachable']}", str(r["findings"]), *(str(r["classes"][c]) for c in CLASSES)]
        lines.append("| " + " | ".join(cells) + " |")
    total = {k: sum(r[k] for r in rows) for k in ("seconds", "traces", "steps", "outside", "harness_failures", "findings")}
    lines.append(f"\n{len(rows)} campaign(s): {minutes(total['seconds'])} in all, {total['traces']:,} traces, "
                 f"{total['steps']:,} steps, {total['findings']} finding(s) "
                 + "(" + ", ".join(f"{sum(r['classes'][c] for r in rows)} {c}" for c in CLASSES) + ")")
    for r in rows:
        lines.append(f"{r['corpus']}: envelope {r['envelope']}")
        if r["not_hit"]:
            lines.append(f"{r['corpus']}: reachable rule ids not hit: {', '.join(r['not_hit'])}")
        for name, cls in r["finding_classes"].items():
            lines.append(f"{r['corpus']}: finding {name}: {cls}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("corpora", nargs="+", metavar="CORPUS", help="a campaign's --corpus directory")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--rules-of", metavar="SRC", help="count the rule ids of the spec in checkout SRC "
                                                       "(the code the campaigns ran), not this one's")
    args = ap.parse_args(argv)
    try:
        only = rules_of(args.rules_of) if args.rules_of else None
        rows = [row(Path(c), only) for c in args.corpora]
        names = [r["corpus"] for r in rows]
        for r, c in zip(rows, args.corpora):  # two corpora of one name (old/MODE beside MODE): name the parent
            if names.count(r["corpus"]) > 1:
                r["corpus"] = f"{Path(c).resolve().parent.name}/{r['corpus']}"
    except TableInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
