"""Rich renderings shared by the commands: the step table and request stories."""
from __future__ import annotations

from rich import box
from rich.table import Table

from spec.formats import StepRecord, Trace


def readable(table: Table, compact: bool = False, width: int | None = None) -> Table:
    """Nothing is cut off in a narrow terminal (80 columns): every cell folds onto more
    lines instead of ending in "…".  ``compact`` drops the outer padding and heavy box
    of wide tables, leaving more room for their numbers; with ``width`` the columns are
    laid out to wrap between words (:func:`keep_words_whole`)."""
    for column in table.columns:
        column.overflow = "fold"
    if compact:
        table.box = box.SIMPLE_HEAVY
        table.pad_edge = False
        table.collapse_padding = True
        table.show_edge = False
    return keep_words_whole(table, width)


def keep_words_whole(table: Table, width: int | None) -> Table:
    """Lay the columns out for a ``width``-column terminal so that cells wrap between words
    (``A(max_tokens)`` stays whole) rather than inside them.

    Starting from each column's natural width, the column with the most room above its
    longest word (header included) gives up one character at a time until the table fits;
    only when every column is down to its longest word does the widest one fold a word.
    """
    if not width:
        return table
    budget = width - table._extra_width - sum(table._get_padding_width(i) for i in range(len(table.columns)))
    from rich.text import Text

    lows, widths = [], []
    for i, column in enumerate(table.columns):
        cells = [Text.from_markup(str(cell)).plain for cell in column._cells] + [str(column.header)]
        lows.append(max((len(w) for c in cells for w in c.split()), default=1))
        widths.append(max((len(c) for c in cells), default=1))
    if sum(widths) <= budget or len(widths) > budget:
        return table
    while sum(widths) > budget:
        slack = [w - lo for w, lo in zip(widths, lows)]
        i = slack.index(max(slack)) if max(slack) > 0 else widths.index(max(widths))
        widths[i] -= 1
    for column, w in zip(table.columns, widths):
        column.width = w
    return table


def batch_cell(record: StepRecord, prompt_lens: dict[str, int] | None = None) -> str:
    """``A:16p B:1d`` — each scheduled request with its tokens, p(refill) or d(ecode)."""
    parts = []
    for rid, n in record.scheduled:
        kind = "d" if rid in record.sampled and n == 1 else "p"
        parts.append(f"{rid}:{n}{kind}")
    return " ".join(parts) or "-"


def _ids(items) -> str:
    return " ".join(i if isinstance(i, str) else f"{i[0]}({i[1]})" for i in items) or ""


def step_table(records: list[StepRecord], title: str | None = None, max_rows: int | None = None,
               width: int | None = None) -> Table:
    """One row per executed step: batch, admissions, preemptions, finishes, free blocks."""
    table = Table(title=title, box=box.SIMPLE_HEAVY, show_lines=False, pad_edge=False, collapse_padding=True, show_edge=False)
    for name, style in (("step", "bold"), ("batch", ""), ("admitted", "green"),
                        ("preempted", "red"), ("finished", "cyan"), ("aborted/ rejected", "magenta"), ("free", "")):
        table.add_column(name, style=style, justify="right" if name in ("step", "free") else "left", overflow="fold")
    shown = records if max_rows is None else records[:max_rows]
    for r in shown:
        admitted = " ".join(r.new + [f"{x}(resumed)" for x in r.resumed])
        gone = " ".join(r.aborted + [f"{x}({why})" for x, why in r.rejected])
        free = "" if r.num_free_blocks is None else str(r.num_free_blocks)
        table.add_row(str(r.step), batch_cell(r), admitted, _ids(r.preempted), _ids(r.finished), gone, free)
    keep_words_whole(table, width)
    table.caption = "batch: id:tokens, p = prefill chunk, d = decode; free: free blocks after the step"
    table.caption_justify = "left"
    if max_rows is not None and len(records) > max_rows:
        table.caption += f"; {len(records) - max_rows} more steps not shown (--max-rows)"
    return table


def outcome_table(trace: Trace, records: list[StepRecord]) -> Table:
    """Per request: arrival, admission, preemptions, finish step and reason, output tokens."""
    info: dict[str, dict] = {r.id: {"arrival": r.arrival_step, "outputs": 0, "preempted": 0} for r in trace.requests}
    for rec in records:
        for rid in rec.new:
            info[rid].setdefault("admitted", rec.step)
        for rid in rec.preempted:
            info[rid]["preempted"] += 1
        for rid in rec.sampled:
            info[rid]["outputs"] += 1
            info[rid].setdefault("first_token", rec.step)
        for rid, why in rec.finished:
            info[rid]["end"] = f"{rec.step} {why}"
        for rid in rec.aborted:
            info[rid]["end"] = f"{rec.step} aborted"
        for rid, why in rec.rejected:
            info[rid]["end"] = f"{rec.step} rejected: {why}"
    table = Table(box=box.SIMPLE_HEAVY, title="requests")
    for col in ("request", "arrival", "admitted", "first token", "preemptions", "outputs", "end"):
        table.add_column(col, justify="left" if col in ("request", "end") else "right", overflow="fold")
    for rid, i in info.items():
        table.add_row(rid, str(i["arrival"]), str(i.get("admitted", "-")), str(i.get("first_token", "-")),
                      str(i["preempted"]), str(i["outputs"]), i.get("end", "-"))
    return table


def proof_table(rows: list[ProofRow], title: str | None = None, show_counterexamples: bool = True):
    """The ``batchspec prove`` table: property, profile, bound, result, time (rows of :func:`invariants.proofs.run_proofs`)."""
    from invariants.proofs.common import COUNTEREXAMPLE, PROVED
    from rich import box
    from rich.table import Table

    from rich.markup import escape

    table = Table(title=title or "batchspec prove", box=box.SIMPLE_HEAVY, show_lines=False)
    table.add_column("property", ratio=2)
    table.add_column("profile", no_wrap=True)
    table.add_column("bound", ratio=1, overflow="fold")
    table.add_column("result", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    for r in rows:
        if r.result == PROVED:
            res = "[green]proved[/]" + (" (witness)" if r.details.get("exists") else "")
        elif r.result == COUNTEREXAMPLE:
            res = "[red]counterexample[/]"
        else:
            res = f"[red]{escape(r.result)}[/]"
        prop = f"[bold]{escape(r.name)}[/] {escape(r.property)}"
        if r.counterexample and show_counterexamples and (not r.ok or r.kind == "bmc"):
            prop += "\n[dim]" + escape(r.counterexample) + "[/]"
        table.add_row(prop, escape(r.profile), escape(r.bound), res, f"{r.seconds:.1f}s")
    bad = [r.name for r in rows if not r.ok]
    total = sum(r.seconds for r in rows)
    table.caption = (f"{len(rows) - len(bad)}/{len(rows)} proved, {total:.0f}s of solving"
                     + (f"; NOT proved: {', '.join(bad)}" if bad else ""))
    return table
