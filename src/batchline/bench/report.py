"""The report of a bench: a Markdown file with the table, PNG plots, the raw figures as JSON,
and the same table printed in the terminal.

    >>> files = write_report(result, Path("report"))
    >>> files["report"]                 # report/report.md
    PosixPath('report/report.md')

Plots (one per load kind present, closed and/or open): achieved throughput against offered
load, and p99 latency against offered load (log scale), one line per configuration.
Plots are drawn on bare matplotlib ``Figure`` objects (Agg), never through pyplot: no display
needed, and the caller's matplotlib backend is left alone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchline.bench.loadgen import LoadKind, PointResult
from batchline.bench.runner import BenchResult

__all__ = ["TABLE_HEADER", "format_row", "print_table", "render_markdown", "write_report"]

TABLE_HEADER = (
    "configuration",
    "load",
    "offered",
    "achieved rec/s",
    "p50 ms",
    "p95 ms",
    "p99 ms",
    "avg batch",
    "utilization",
    "errors",
)

_CONSOLE_HEADER = (
    "configuration",
    "load",
    "rec/s",
    "p50 ms",
    "p95 ms",
    "p99 ms",
    "batch",
    "util",
    "errors",
)

# One color and marker per configuration, the same in every plot; the baseline is black.
_STYLES = [
    ("#1f77b4", "o"),
    ("#2ca02c", "^"),
    ("#9467bd", "D"),
    ("#8c564b", "v"),
    ("#17becf", "X"),
    ("#e377c2", "P"),
    ("#d62728", "s"),
]
_BASELINE_STYLE = ("#222222", "o")
_CLASSIC_STYLE = ("#ff7f0e", "s")


def _ms(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _errors(p: PointResult) -> str:
    parts = [f"{p.errors:,}"]
    if p.unanswered:
        parts.append(f"+{p.unanswered:,} unanswered")
    return " ".join(parts)


def format_row(p: PointResult) -> tuple[str, ...]:
    """One table row, as strings in the order of :data:`TABLE_HEADER`."""
    return (
        p.config,
        p.kind,
        p.point.offered,
        f"{p.achieved_rps:,.1f}",
        _ms(p.p50_ms),
        _ms(p.p95_ms),
        _ms(p.p99_ms),
        "n/a" if p.avg_batch_size is None else f"{p.avg_batch_size:.1f}",
        "n/a" if p.utilization is None else f"{p.utilization:.0%}",
        _errors(p),
    )


def _ordered(points: Sequence[PointResult]) -> list[PointResult]:
    """Grouped by load point (kind, then offered), configurations in run order within each."""
    order = {name: i for i, name in enumerate(dict.fromkeys(p.config for p in points))}
    return sorted(points, key=lambda p: (p.kind, p.offered, order[p.config]))


def _md_table(points: Sequence[PointResult]) -> list[str]:
    lines = [
        "| " + " | ".join(TABLE_HEADER) + " |",
        "|" + "|".join(["---"] * 2 + ["---:"] * (len(TABLE_HEADER) - 2)) + "|",
    ]
    for p in _ordered(points):
        cells = [c.replace("|", "\\|") for c in format_row(p)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _comparisons(result: BenchResult) -> list[str]:
    """One line per load point: each configuration against the baseline."""
    base_name = next((c.name for c in result.configurations if c.is_baseline), None)
    if base_name is None:
        return []
    base = {(p.kind, p.offered): p for p in result.for_config(base_name)}
    lines: list[str] = []
    for p in _ordered(result.points):
        b = base.get((p.kind, p.offered))
        if p.config == base_name or b is None or b.achieved_rps <= 0:
            continue
        ratio = p.achieved_rps / b.achieved_rps
        p99 = (
            f", p99 {p.p99_ms / b.p99_ms:.2f}x"
            if b.p99_ms > 0 and not math.isnan(p.p99_ms) and not math.isnan(b.p99_ms)
            else ""
        )
        lines.append(
            f"- {p.point.label}: **{p.config}** {ratio:.2f}x the baseline's throughput{p99}"
        )
    return lines


def render_markdown(result: BenchResult, plots: Sequence[str] = ()) -> str:
    """The report as Markdown; ``plots`` are image file names relative to the report."""
    lines = [
        "# batchline bench",
        "",
        f"Model **{result.model}**, target **{result.target}**; "
        f"{result.duration_s:g} s per load point, configurations interleaved at each point "
        "(after a warm-up of each); "
        f"the whole run took {result.elapsed_s:.0f} s.",
        "",
    ]
    if result.command:
        lines += ["```", result.command, "```", ""]
    lines += [
        f"Inputs: {result.inputs}.",
        "",
        "Environment: " + ", ".join(f"{k} {v}" for k, v in result.environment.items()) + ".",
        "",
    ]
    lines += ["## Configurations", ""]
    lines += [f"- **{c.name}**: {c.description}" for c in result.configurations]
    lines += ["", "## Results", ""]
    lines += _md_table(result.points)
    lines += [
        "",
        "*load*: closed = N concurrent clients, each sending its next request when answered; "
        "open = Poisson arrivals at the offered rate, latency measured from each request's "
        "intended send time (no coordinated omission). *achieved*: records answered within the "
        "measurement window, per second. *utilization*: fraction of the processing slots busy. "
        "*errors*: failed requests; *unanswered*: still waiting when the run gave up on them "
        "(counted in the latency percentiles with the time they had waited).",
        "",
    ]
    comparisons = _comparisons(result)
    if comparisons:
        lines += ["## Against the no-batching baseline", "", *comparisons, ""]
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{Path(name).stem}]({name})" for name in plots]
        lines.append("")
    return "\n".join(lines)


def _nice_steps(value: float) -> list[float]:
    decade = 10 ** math.floor(math.log10(value))
    return [m * decade * f for f in (0.1, 1, 10) for m in (1, 2, 5)]


def _nice_below(value: float) -> float:
    """The largest of ..., 1, 2, 5, 10, 20, ... at most ``value`` (> 0)."""
    return max(v for v in _nice_steps(value) if v <= value * (1 + 1e-9))


def _nice_above(value: float) -> float:
    """The smallest of ..., 1, 2, 5, 10, 20, ... at least ``value`` (> 0)."""
    return min(v for v in _nice_steps(value) if v >= value * (1 - 1e-9))


def _plot(result: BenchResult, kind: LoadKind, metric: str, path: Path) -> None:
    # a bare Figure renders through Agg without pyplot: no display, no global backend change
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    points = [p for p in result.points if p.kind == kind]
    names = list(dict.fromkeys(p.config for p in points))
    offered = sorted({p.offered for p in points})
    fig = Figure(figsize=(8, 5), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    others = 0
    for name in names:
        config = next(c for c in result.configurations if c.name == name)
        if config.is_baseline:
            color, marker = _BASELINE_STYLE
        elif config.kind == "classic":
            color, marker = _CLASSIC_STYLE
        else:
            color, marker = _STYLES[others % len(_STYLES)]
            others += 1
        series = sorted((p for p in points if p.config == name), key=lambda p: p.offered)
        xs = [p.offered for p in series]
        ys = [p.achieved_rps if metric == "throughput" else p.p99_ms for p in series]
        ax.plot(xs, ys, marker=marker, color=color, label=name, linewidth=2, markersize=7)
        # a point where requests failed or went unanswered is circled in red
        bad = [(x, y) for p, x, y in zip(series, xs, ys, strict=True) if p.failed]
        if bad:
            ax.scatter(
                [x for x, _ in bad],
                [y for _, y in bad],
                s=220,
                facecolors="none",
                edgecolors="red",
                linewidths=1.5,
                zorder=3,
            )
    if kind == "closed":
        ax.set_xlabel("offered load: concurrent clients (closed loop)")
    else:
        ax.set_xlabel("offered load: records/s (open loop, Poisson arrivals)")
    spread = offered[-1] / offered[0] if offered and offered[0] > 0 else 1.0
    if spread >= 8:
        ax.set_xscale("log", base=2 if kind == "closed" else 10)
        ax.set_xticks(offered)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
    elif offered:
        ax.set_xticks(offered)
    if metric == "throughput":
        if kind == "open" and offered:
            ax.plot(
                offered,
                offered,
                linestyle=":",
                color="#888888",
                linewidth=1.2,
                label="achieved = offered",
            )
        ax.set_ylabel("achieved throughput (records/s)")
        ax.set_ylim(bottom=0)
        fig.suptitle(f"Throughput vs offered load ({kind} loop)", fontsize=13)
    else:
        ax.set_ylabel("p99 latency (ms, log scale)")
        ax.set_yscale("log")
        # 1-2-5 ticks in plain numbers: latencies often span less than one decade
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        values = [p.p99_ms for p in points if p.p99_ms > 0 and math.isfinite(p.p99_ms)]
        if values:
            # end the axis on labelled ticks, so the lowest and highest lines can be read
            ax.set_ylim(_nice_below(min(values)), _nice_above(max(values)))
        fig.suptitle(f"p99 latency vs offered load ({kind} loop)", fontsize=13)
    ax.grid(True, which="major", alpha=0.35)
    handles, labels = ax.get_legend_handles_labels()
    if any(p.failed for p in points):
        from matplotlib.lines import Line2D

        handles.append(
            Line2D(
                [],
                [],
                marker="o",
                linestyle="none",
                markerfacecolor="none",
                markeredgecolor="red",
                markersize=12,
            )
        )
        labels.append("errors or unanswered requests")
    ax.legend(handles, labels, loc="best", fontsize=9, framealpha=0.9)
    ax.set_title(f"{result.model} model; {result.inputs}", fontsize=8, color="#555555")
    fig.savefig(path)


def write_report(result: BenchResult, out_dir: Path) -> dict[str, Path]:
    """Write ``report.md``, ``results.json`` and the PNG plots into ``out_dir``.

    Returns the written files by role (``report``, ``results``, ``throughput-closed``, ...).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    plots: list[str] = []
    kinds: tuple[LoadKind, ...] = ("closed", "open")
    for kind in kinds:
        if not any(p.kind == kind for p in result.points):
            continue
        for metric in ("throughput", "p99"):
            name = f"{metric}-{kind}.png"
            _plot(result, kind, metric, out_dir / name)
            plots.append(name)
            files[f"{metric}-{kind}"] = out_dir / name
    report = out_dir / "report.md"
    report.write_text(render_markdown(result, plots))
    files["report"] = report
    results = out_dir / "results.json"
    results.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    files["results"] = results
    return files


def print_table(points: Sequence[PointResult], console: Any = None, title: str = "") -> None:
    """Print the results table with rich."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        # a pipe gets 80 columns by default: too narrow for ten columns of figures
        console = Console()
        if not console.is_terminal:
            console = Console(width=130)
    table = Table(title=title or "batchline bench")
    for i, header in enumerate(_CONSOLE_HEADER):
        table.add_column(header, justify="left" if i < 2 else "right", no_wrap=i < 2)
    previous: tuple[str, float] | None = None
    for p in _ordered(points):
        key = (p.kind, p.offered)
        if previous is not None and key != previous:
            table.add_section()
        previous = key
        row = format_row(p)
        row = (row[0], f"{p.kind} {p.point.offered}", *row[3:])
        style = "red" if p.failed else None
        table.add_row(*row, style=style)
    console.print(table)
