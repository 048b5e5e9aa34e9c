"""Pictures of simulations (matplotlib, imported only when a plot is drawn).

* :func:`batch_timeline` — which request runs in which step: prefill chunks
  and decodes, admissions, preemptions and finishes (the "step 1: A B C" view);
* :func:`kv_occupancy` — KV blocks held, and requests running / waiting, over time;
* :func:`latency_cdfs` — TTFT, TPOT, ITL and end-to-end latency CDFs, one line per run;
* :func:`capacity_plot` — p50/p95/p99 TTFT against arrival rate per profile,
  with the SLO and each profile's capacity boundary.

Every function writes the file named by ``path`` (PNG or SVG by its
extension) and returns the path.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from spec.costmodel import NS_PER_S

if TYPE_CHECKING:
    from fuzz.sweep import Capacity, SweepPoint
    from spec.simulate import SimResult

PREFILL, DECODE = "#f28e2b", "#4e79a7"
PALETTE = ("#4e79a7", "#e15759", "#59a14f", "#f28e2b", "#b07aa1", "#76b7b2", "#edc948", "#9c755f", "#ff9da7", "#bab0ac")
#: At most this many points per line on time-series plots (max per bucket keeps spikes).
MAX_POINTS = 4000


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # SVG text stays text: searchable, and smaller files

    return plt


def _save(fig, path: str | Path) -> str:
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise ValueError(f"{path}: plots are written as .png or .svg")
    path.parent.mkdir(parents=True, exist_ok=True)
    import os
    import tempfile

    import matplotlib.pyplot as plt

    # a temporary file renamed into place: an interrupted plot never leaves half an image
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=130, bbox_inches="tight")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    finally:
        plt.close(fig)
    return str(path)


def batch_timeline(result: "SimResult", path: str | Path, max_steps: int = 60, max_requests: int = 40,
                   title: str | None = None, first_step: int = 0) -> str:
    """One row per request, one column per step: orange = prefill chunk (tokens written in it),
    blue = decode; ▶ admitted, ✕ preempted, ● finished, ■ aborted (before the step).
    Needs ``simulate(..., keep_records=N)``; ``first_step`` skips the steps before it."""
    plt = _pyplot()
    samples = result.samples[first_step : first_step + max_steps]
    if not samples:
        raise ValueError("no step records kept: simulate with keep_records > 0")
    rows: dict[str, int] = {}
    for s in samples:
        for rid, _ in s.record.scheduled:
            if rid not in rows and len(rows) < max_requests:
                rows[rid] = len(rows)
    fig, ax = plt.subplots(figsize=(min(4 + 0.28 * len(samples), 22), 1.2 + 0.32 * len(rows)))
    annotate = len(samples) <= 40
    for x, s in enumerate(samples):
        rec = s.record
        for rid, n, is_decode in s.parts:
            if rid not in rows:
                continue
            ax.barh(rows[rid], 0.9, left=x + 0.05, height=0.7, color=DECODE if is_decode else PREFILL)
            if annotate and not is_decode:
                ax.text(x + 0.5, rows[rid], str(n), ha="center", va="center", fontsize=7, color="white")
        for rid in rec.preempted:
            if rid in rows:
                ax.plot(x + 0.5, rows[rid], marker="x", color="#d62728", markersize=9, mew=2.2)
        for rid in rec.new + rec.resumed:
            if rid in rows:
                ax.plot(x + 0.08, rows[rid], marker=">", color="#2ca02c", markersize=6)
        for rid, _ in rec.finished:
            if rid in rows:
                ax.plot(x + 0.95, rows[rid], marker="o", color="black", markersize=5)
        for rid in rec.aborted:
            if rid in rows:
                ax.plot(x + 0.05, rows[rid], marker="s", color="#b07aa1", markersize=6)
    ax.set_yticks(range(len(rows)), list(rows))
    ax.invert_yaxis()
    ax.set_xlim(0, len(samples))
    ax.set_xlabel("step  (bottom: simulated time at the step's start, s)" if annotate else "step")
    if annotate:
        ax.set_xticks([x + 0.5 for x in range(len(samples))], [str(s.record.step) for s in samples], fontsize=7)
        sec = ax.secondary_xaxis("bottom")
        sec.spines["bottom"].set_position(("outward", 28))
        sec.set_xticks([x + 0.5 for x in range(0, len(samples), max(1, len(samples) // 10))],
                       [f"{samples[x].start_ns / NS_PER_S:.6g}" for x in range(0, len(samples), max(1, len(samples) // 10))],
                       fontsize=7)
    ax.set_ylabel("request")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=PREFILL, label="prefill chunk (tokens)"), Patch(color=DECODE, label="decode"),
                       Line2D([], [], marker=">", color="#2ca02c", ls="", label="admitted / resumed"),
                       Line2D([], [], marker="x", color="#d62728", ls="", mew=2, label="preempted"),
                       Line2D([], [], marker="o", color="black", ls="", label="finished"),
                       Line2D([], [], marker="s", color="#b07aa1", ls="", label="aborted")],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    ax.set_title(title or "batch timeline", fontsize=10)
    ax.grid(axis="x", alpha=0.2)
    return _save(fig, path)


def _downsample(xs: Sequence[float], ys: Sequence[float], n: int = MAX_POINTS) -> tuple[list, list]:
    """At most ``n`` points: each bucket of consecutive samples keeps its largest value."""
    if len(xs) <= n:
        return list(xs), list(ys)
    size = math.ceil(len(xs) / n)
    ox, oy = [], []
    for i in range(0, len(xs), size):
        chunk = ys[i : i + size]
        j = max(range(len(chunk)), key=chunk.__getitem__)
        ox.append(xs[i + j])
        oy.append(chunk[j])
    return ox, oy


def kv_occupancy(result: "SimResult", path: str | Path, title: str | None = None) -> str:
    """KV blocks held (share of the usable pool) and requests running / waiting, against time."""
    plt = _pyplot()
    t = [e / NS_PER_S for e in result.step_end_ns]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    if result.usable_blocks and result.used_blocks and min(result.used_blocks) >= 0:
        x, y = _downsample(t, [100 * u / result.usable_blocks for u in result.used_blocks])
        ax.fill_between(x, y, step="post", color=DECODE, alpha=0.35, lw=0)
        ax.plot(x, y, drawstyle="steps-post", color=DECODE, lw=0.8)
        ax.set_ylim(0, 105)
        ax.set_ylabel(f"KV blocks held, % of {result.usable_blocks:,}")
    else:
        ax.text(0.5, 0.5, "the engine does not report free blocks", transform=ax.transAxes, ha="center")
    waiting = [a - b for a, b in zip(result.in_system, result.running)]
    for series, label, color in ((list(result.running), "running", "#59a14f"), (waiting, "waiting", "#e15759")):
        x, y = _downsample(t, series)
        ax2.plot(x, y, drawstyle="steps-post", lw=0.9, color=color, label=label)
    ax2.set_ylabel("requests")
    ax2.set_xlabel("simulated time (s)")
    ax2.legend(loc="upper left", fontsize=8, frameon=False)
    ax.set_title(title or "KV occupancy", fontsize=10)
    for a in (ax, ax2):
        a.grid(alpha=0.25)
    return _save(fig, path)


def latency_cdfs(results: dict[str, "SimResult"], path: str | Path, title: str | None = None) -> str:
    """Empirical CDFs of TTFT, TPOT, ITL (every gap) and end-to-end latency, one line per run
    (a color and a dash pattern each, so runs that coincide stay visible)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.4))
    dashes = ("-", "--", ":", "-.")
    s = 1 / NS_PER_S
    for k, (label, result) in enumerate(results.items()):
        done = [t for t in result.requests.values() if t.completed]
        series = {
            "TTFT (s)": [(t.first_token_ns - t.arrival_ns) * s for t in done],
            "TPOT (s)": [(t.finish_ns - t.first_token_ns) * s / (t.outputs - 1) for t in done if t.outputs > 1],
            "ITL, every token gap (s)": [g * s for g in result.itl_ns],
            "end-to-end latency (s)": [(t.finish_ns - t.arrival_ns) * s for t in done],
        }
        for ax, (name, values) in zip(axes, series.items()):
            ax.set_xlabel(name)
            xs = sorted(values)
            if not xs:
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            xs, ys = _downsample(xs, ys)
            ax.plot(xs, ys, drawstyle="steps-post", color=PALETTE[k % len(PALETTE)], ls=dashes[k % len(dashes)],
                    label=label, lw=1.5)
    from matplotlib.ticker import NullFormatter

    for ax in axes:
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels collide on short log ranges
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.25, which="both")
        for q in (0.5, 0.95, 0.99):
            ax.axhline(q, color="gray", lw=0.5, ls=":")
    axes[0].set_ylabel("fraction (completed requests; ITL: token gaps)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, -0.02), ncol=min(len(labels), 3), fontsize=8,
               frameon=False)
    fig.subplots_adjust(bottom=0.22, wspace=0.25)
    fig.suptitle(title or "latency CDFs", fontsize=10)
    return _save(fig, path)


def capacity_plot(points: list["SweepPoint"], capacities: dict[str, "Capacity"], slo_s: float, path: str | Path,
                  title: str | None = None) -> str:
    """p50 / p95 / p99 TTFT against arrival rate, one color per profile.

    Hollow markers: the queue grew without bound at that rate.  The dashed
    horizontal line is the SLO; each profile's dotted vertical line (labelled at
    the bottom) is the rate at which its p99 TTFT crosses it, when it crosses
    between two swept rates.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 6))
    profiles = list(dict.fromkeys(p.profile for p in points if p.metrics is not None))
    styles = (("p50", ":", 0.8), ("p95", "--", 1.1), ("p99", "-", 1.8))
    markers = ("o", "s", "^", "D", "v", "P")
    for k, profile in enumerate(profiles):
        color, marker = PALETTE[k % len(PALETTE)], markers[k % len(markers)]
        pts = sorted((p for p in points if p.profile == profile and p.metrics is not None), key=lambda p: p.rate)
        for name, ls, lw in styles:
            xs = [p.rate for p in pts]
            ys = [max(getattr(p.metrics.ttft, name), 1e-4) for p in pts]
            ax.plot(xs, ys, ls=ls, lw=lw, color=color, alpha=0.9)
            if name == "p99":
                for p, y in zip(pts, ys):
                    hollow = p.metrics.unbounded_queue
                    ax.plot(p.rate, y, marker=marker, ms=6, color=color, mfc="white" if hollow else color, mew=1.5, ls="")
                ax.plot([], [], ls="-", lw=lw, color=color, marker=marker, label=f"{profile} p99")
        cap = capacities.get(profile)
        if cap and cap.slo_rate and cap.slo_bracket[0] is not None:  # a crossing inside the swept range
            ax.axvline(cap.slo_rate, color=color, ls=":", lw=1.2, alpha=0.9)
            ax.annotate(f"{cap.slo_rate:.3g}/s", (cap.slo_rate, 0), xycoords=("data", "axes fraction"),
                        xytext=(3, 4 + 12 * k), textcoords="offset points", color=color, fontsize=8)
    ax.axhline(slo_s, color="black", ls="--", lw=1)
    ax.annotate(f"SLO: p99 TTFT {slo_s:g} s", (0, slo_s), xycoords=("axes fraction", "data"), xytext=(4, -12),
                textcoords="offset points", fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arrival rate (requests/s)")
    ax.set_ylabel("time to first token (s)")
    ax.grid(alpha=0.25, which="both")
    from matplotlib.lines import Line2D

    handles, labels = ax.get_legend_handles_labels()
    handles += [Line2D([], [], color="gray", ls=ls, lw=lw, label=name) for name, ls, lw in styles]
    handles += [Line2D([], [], color="gray", marker="o", mfc="white", ls="", label="queue grows without bound")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    ax.set_title(title or "TTFT against arrival rate", fontsize=10)
    return _save(fig, path)


def slo_plot(points: list["SweepPoint"], path: str | Path, title: str | None = None) -> str:
    """Issue 19: what each policy trades, against arrival rate, one color per profile.

    Left: SLO goodput (requests per second meeting both their TTFT and TPOT targets, solid)
    next to request throughput (dotted).  Right: SLO attainment per class (one line style per
    class; the share of the class's requests meeting both targets).  Hollow markers: the
    queue grew without bound at that rate.
    """
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    done = [p for p in points if p.metrics is not None and p.metrics.slo_attainment is not None]
    profiles = list(dict.fromkeys(p.profile for p in done))
    classes = sorted({c for p in done for c in p.metrics.slo_classes})
    styles = ("-", "--", "-.", ":")
    markers = ("o", "s", "^", "D", "v", "P")
    for k, profile in enumerate(profiles):
        color, marker = PALETTE[k % len(PALETTE)], markers[k % len(markers)]
        pts = sorted((p for p in done if p.profile == profile), key=lambda p: p.rate)
        xs = [p.rate for p in pts]
        left.plot(xs, [p.metrics.slo_goodput for p in pts], color=color, lw=1.8, label=profile)
        left.plot(xs, [p.metrics.request_throughput for p in pts], color=color, lw=0.9, ls=":")
        for p in pts:
            left.plot(p.rate, p.metrics.slo_goodput, marker=marker, color=color, ls="",
                      mfc="white" if p.metrics.unbounded_queue else color, mew=1.5)
        for j, name in enumerate(classes):
            ys = [p.metrics.slo_classes[name].attained * 100 if name in p.metrics.slo_classes else float("nan") for p in pts]
            right.plot(xs, ys, color=color, ls=styles[j % len(styles)], lw=1.5, marker=marker, ms=4)
    from matplotlib.lines import Line2D

    left.set_xscale("log")
    left.set_xlabel("arrival rate (requests/s)")
    left.set_ylabel("requests/s")
    left.set_title("SLO goodput (solid) and throughput (dotted)", fontsize=9)
    left.grid(alpha=0.25, which="both")
    left.legend(fontsize=8, frameon=False, loc="upper left")
    right.set_xscale("log")
    right.set_xlabel("arrival rate (requests/s)")
    right.set_ylabel("requests meeting both targets (%)")
    right.set_ylim(0, 102)
    right.set_title("SLO attainment per class", fontsize=9)
    right.grid(alpha=0.25, which="both")
    right.legend(handles=[Line2D([], [], color="gray", ls=styles[j % len(styles)], label=name) for j, name in enumerate(classes)],
                 fontsize=8, frameon=False, loc="lower left")
    fig.suptitle(title or "goodput and SLO attainment against arrival rate", fontsize=10)
    return _save(fig, path)
