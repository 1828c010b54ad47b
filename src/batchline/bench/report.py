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
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from batchline.bench.loadgen import LoadKind, PointResult
from batchline.bench.runner import BenchResult

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from rich.console import Console
    from rich.table import Table

    from batchline.bench.generate_results import GenerateBenchResult, GenPoint

__all__ = [
    "GENERATE_HEADER",
    "TABLE_HEADER",
    "format_generate_row",
    "format_row",
    "generate_dtypes_line",
    "print_generate_table",
    "print_table",
    "render_generate_markdown",
    "render_markdown",
    "write_generate_report",
    "write_report",
]

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
    return f"{p.errors:,}" + (f" +{p.unanswered:,} unanswered" if p.unanswered else "")


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


def _md_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A Markdown table: the first two columns left-aligned, the figures right-aligned."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|",
        *("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows),
    ]


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


def _head(
    title: str, summary: str, command: str, inputs: str, environment: Mapping[str, str]
) -> list[str]:
    """A report's first lines: title, what ran, the command (when known), inputs, machine."""
    lines = [title, "", summary, ""]
    if command:
        lines += ["```", command, "```", ""]
    env = ", ".join(f"{k} {v}" for k, v in environment.items())
    return [*lines, inputs, "", f"Environment: {env}.", ""]


def render_markdown(result: BenchResult, plots: Sequence[str] = ()) -> str:
    """The report as Markdown; ``plots`` are image file names relative to the report."""
    lines = _head(
        "# batchline bench",
        f"Model **{result.model}**, target **{result.target}**; "
        f"{result.duration_s:g} s per load point, configurations interleaved at each point "
        "(after a warm-up of each); "
        f"the whole run took {result.elapsed_s:.0f} s.",
        result.command,
        f"Inputs: {result.inputs}.",
        result.environment,
    )
    lines += ["## Configurations", ""]
    lines += [f"- **{c.name}**: {c.description}" for c in result.configurations]
    lines += ["", "## Results", ""]
    lines += _md_table(TABLE_HEADER, map(format_row, _ordered(result.points)))
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
        lines += ["## Plots", "", *[f"![{Path(name).stem}]({name})" for name in plots], ""]
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


def _offered_axis(
    ax: Axes, kind: LoadKind, offered: Sequence[float], unit: str = "records"
) -> None:
    """The x axis of every plot: offered load, log-scaled when it spans 8x or more."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    if kind == "closed":
        ax.set_xlabel("offered load: concurrent clients (closed loop)")
    else:
        ax.set_xlabel(f"offered load: {unit}/s (open loop, Poisson arrivals)")
    spread = offered[-1] / offered[0] if offered and offered[0] > 0 else 1.0
    if spread >= 8:
        ax.set_xscale("log", base=2 if kind == "closed" else 10)
        ax.set_xticks(offered)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
    elif offered:
        ax.set_xticks(offered)


def _latency_axis(ax: Axes, label: str, values: Sequence[float]) -> None:
    """A log-scaled latency y axis with 1-2-5 ticks in plain numbers (latencies often span
    less than one decade), ending on labelled ticks around the positive finite ``values``, so
    the lowest and highest lines can be read."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_ylabel(label)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    shown = [v for v in values if v > 0 and math.isfinite(v)]
    if shown:
        ax.set_ylim(_nice_below(min(shown)), _nice_above(max(shown)))


def _plot(result: BenchResult, kind: LoadKind, metric: str, path: Path) -> None:
    # a bare Figure renders through Agg without pyplot: no display, no global backend change
    from matplotlib.figure import Figure

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
    _offered_axis(ax, kind, offered)
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
        _latency_axis(ax, "p99 latency (ms, log scale)", [p.p99_ms for p in points])
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
    return _write_files(
        out_dir,
        {p.kind for p in result.points},
        ("throughput", "p99"),
        lambda kind, metric, path: _plot(result, kind, metric, path),
        lambda plots: render_markdown(result, plots),
        result.to_dict(),
    )


def _wide_console() -> Console:
    """A stdout console; 130 columns on a pipe, whose default 80 are too narrow for the table."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=130)


def _rich_table(
    title: str,
    header: Sequence[str],
    rows: Iterable[tuple[object, Sequence[str], str | None]],
    caption: str | None = None,
) -> Table:
    """A rich table: the first two columns left-aligned, the figures right-aligned, a section
    per load point; ``rows`` are ``(load point, cells, style)``."""
    from rich.table import Table

    table = Table(title=title, caption=caption)
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i < 2 else "right", no_wrap=i < 2)
    previous: object = None
    for point, cells, style in rows:
        if previous is not None and point != previous:
            table.add_section()
        previous = point
        table.add_row(*cells, style=style)
    return table


def print_table(
    points: Sequence[PointResult], console: Console | None = None, title: str = ""
) -> None:
    """Print the results table with rich."""
    rows = (
        (
            (p.kind, p.offered),
            (p.config, f"{p.kind} {p.point.offered}", *format_row(p)[3:]),
            "red" if p.failed else None,
        )
        for p in _ordered(points)
    )
    (console or _wide_console()).print(
        _rich_table(title or "batchline bench", _CONSOLE_HEADER, rows)
    )


# -- batchline bench --task generate ------------------------------------------------------------

GENERATE_HEADER = (
    "configuration",
    "load",
    "requests",
    "tokens/s",
    "x baseline",
    "latency p50 s",
    "latency p99 s",
    "TTFT p50 s",
    "TTFT p99 s",
    "ITL p50 ms",
)

# sequential is the baseline (black), static the classic batcher (orange)
_GENERATOR_STYLES = {
    "sequential": _BASELINE_STYLE,
    "static": _CLASSIC_STYLE,
    "continuous": _STYLES[0],
    "vllm": _STYLES[6],
}


def _s(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.3f}" if value < 1 else f"{value:.2f}"


def format_generate_row(p: GenPoint, x_baseline: float = math.nan) -> tuple[str, ...]:
    """One row of the generation table, in the order of :data:`GENERATE_HEADER`; ``x_baseline``:
    its tokens/s over sequential's at the same point (``nan``: none)."""
    rejected = f" ({p.rejected} rejected)" if p.rejected else ""
    return (
        p.generator,
        p.point.label,
        f"{p.requests}{rejected}",
        f"{p.tokens_per_s:,.1f}",
        "n/a" if math.isnan(x_baseline) else f"x{x_baseline:.2f}",
        _s(p.latency_p50_s),
        _s(p.latency_p99_s),
        _s(p.ttft_p50_s),
        _s(p.ttft_p99_s),
        "n/a" if math.isnan(p.itl_p50_s) else f"{p.itl_p50_s * 1e3:.1f}",
    )


def _generate_ordered(points: Sequence[GenPoint]) -> list[GenPoint]:
    from batchline.bench.generate_results import ALL_GENERATORS

    order: dict[str, int] = {name: i for i, name in enumerate(ALL_GENERATORS)}
    return sorted(points, key=lambda p: (p.kind, p.offered, order.get(p.generator, 9)))


def _generate_rows(result: GenerateBenchResult) -> list[tuple[str, ...]]:
    return [
        format_generate_row(p, result.baseline_ratio(p)) for p in _generate_ordered(result.points)
    ]


def generate_dtypes_line(result: GenerateBenchResult) -> str:
    """Which dtype each configuration computed in, those computing alike named together."""
    by_dtype: dict[str, list[str]] = {}
    for name in result.generators:
        by_dtype.setdefault(result.dtypes.get(name, "n/a"), []).append(name)
    return "; ".join(f"{', '.join(names)}: {dtype}" for dtype, names in by_dtype.items())


def render_generate_markdown(result: GenerateBenchResult, plots: Sequence[str] = ()) -> str:
    """The generation bench's report as Markdown; ``plots`` relative to the report."""
    from batchline.bench.generate_results import DESCRIPTIONS

    vllm = "; and vLLM's engine on the same model" * ("vllm" in result.generators)
    lines = _head(
        "# batchline bench: text generation",
        f"Model **{result.model}**; sequential, static and continuous batching on the same "
        f"loaded weights, each run on a fresh generator{vllm}; the whole run took "
        f"{result.elapsed_s:.0f} s.",
        result.command,
        f"Workload: {result.workload}.",
        result.environment,
    )
    lines += [
        "## Configurations",
        "",
        *[
            f"- **{g}**: {DESCRIPTIONS[g]}; computes in {result.dtypes.get(g, 'n/a')}"
            for g in result.generators
        ],
        "",
        "## Results",
        "",
        "Medians over the repeats.",
        "",
        *_md_table(GENERATE_HEADER, _generate_rows(result)),
        "",
        "",
        "*closed*: N clients, each submitting its next request when the previous completes; "
        "tokens/s = generated tokens / wall time until the last completes; *x baseline*: "
        "tokens/s over sequential's at the same point. *open*: Poisson "
        "arrivals at the offered rate, latency and TTFT from each request's intended send "
        "time; throughput there is capped by the arrival rate. *TTFT*: time to the first "
        "generated token; *ITL*: time between a sequence's tokens.",
        "",
    ]
    ratios = result.ratios()
    if ratios:
        lines += ["## Ratios against the goals", "", "| load | ratio | value | goal | |"]
        lines.append("|---|---|---:|---|---|")
        for r in ratios:
            mark = "ok" if r.ok else "**missed**"
            lines.append(
                f"| {r.point.label} | {r.name} | {r.value:.2f} | {r.op} {r.goal:g} | {mark} |"
            )
        lines.append("")
    if plots:
        lines += ["## Plots", "", *[f"![{Path(name).stem}]({name})" for name in plots], ""]
    return "\n".join(lines)


def _generate_plot(
    result: GenerateBenchResult, kind: LoadKind, metrics: Sequence[str], path: Path
) -> None:
    from matplotlib.figure import Figure

    points = [p for p in result.points if p.kind == kind]
    offered = sorted({p.offered for p in points})
    fig = Figure(figsize=(8, 5), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    labels = {
        "tokens_per_s": "",
        "ttft_p50_s": " TTFT p50",
        "ttft_p99_s": " TTFT p99",
        "latency_p99_s": " p99",
    }
    values: list[float] = []
    for name in result.generators:
        color, marker = _GENERATOR_STYLES.get(name, _STYLES[1])
        series = sorted((p for p in points if p.generator == name), key=lambda p: p.offered)
        for metric in metrics:
            ys = [float(getattr(p, metric)) for p in series]
            values += ys
            ax.plot(
                [p.offered for p in series],
                ys,
                marker=marker,
                color=color,
                label=name + labels[metric],
                linewidth=2,
                markersize=7,
                linestyle="--" if metric == "ttft_p50_s" else "-",
                # p50 hollow: with one load point there is no line to tell them apart
                markerfacecolor="none" if metric == "ttft_p50_s" else color,
            )
    _offered_axis(ax, kind, offered, unit="requests")
    if metrics == ["tokens_per_s"]:
        ax.set_ylabel("generated tokens/s")
        ax.set_ylim(bottom=0)
        fig.suptitle(f"Generation throughput vs offered load ({kind} loop)", fontsize=13)
    else:
        what = "TTFT" if metrics[0].startswith("ttft") else "request latency"
        _latency_axis(ax, f"{what} (s, log scale)", values)
        title = "TTFT p50 (dashed, hollow) and p99" if what == "TTFT" else "p99 request latency"
        fig.suptitle(f"{title} vs offered load ({kind} loop)", fontsize=13)
    ax.grid(True, which="major", alpha=0.35)
    ax.legend(loc="best", fontsize=9, framealpha=0.9)
    ax.set_title(f"{result.model}; {result.workload}", fontsize=7, color="#555555", wrap=True)
    fig.savefig(path)


def write_generate_report(result: GenerateBenchResult, out_dir: Path) -> dict[str, Path]:
    """Write ``report.md``, ``results.json`` and, per load kind present, the PNG plots
    ``throughput-KIND.png``, ``ttft-KIND.png`` (p50 and p99) and ``latency-p99-KIND.png``."""
    charts = {
        "throughput": ["tokens_per_s"],
        "ttft": ["ttft_p50_s", "ttft_p99_s"],
        "latency-p99": ["latency_p99_s"],
    }
    return _write_files(
        out_dir,
        {p.kind for p in result.points},
        tuple(charts),
        lambda kind, stem, path: _generate_plot(result, kind, charts[stem], path),
        lambda plots: render_generate_markdown(result, plots),
        result.to_dict(),
    )


def print_generate_table(result: GenerateBenchResult, console: Console | None = None) -> None:
    """Print the generation table and the ratios with rich."""
    console = console or _wide_console()
    rows = (
        (p.point, row, None)
        for p, row in zip(_generate_ordered(result.points), _generate_rows(result), strict=True)
    )
    table = _rich_table(
        "batchline bench --task generate (medians over repeats)",
        GENERATE_HEADER,
        rows,
        caption="x baseline: tokens/s over sequential's at the same closed-loop point"
        if "sequential" in result.generators
        else "x baseline: n/a, the baseline did not run",
    )
    console.print(table)
    console.print(f"dtype: {generate_dtypes_line(result)}", highlight=False)
    ratios = result.ratios()
    if ratios:
        console.print("ratios:", highlight=False)
        for r in ratios:
            console.print("  " + r.line(), highlight=False, style=None if r.ok else "red")


def _write_files(
    out_dir: Path,
    kinds: set[LoadKind],
    stems: Sequence[str],
    draw: Callable[[LoadKind, str, Path], None],
    render: Callable[[list[str]], str],
    data: object,
) -> dict[str, Path]:
    """Draw ``STEM-KIND.png`` for each stem and each load kind present (closed first), then
    write ``report.md`` (``render(plot file names)``) and ``results.json``; every file written,
    by key (``STEM-KIND``, ``report``, ``results``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    for kind in ("closed", "open"):
        for stem in stems if kind in kinds else ():
            files[f"{stem}-{kind}"] = out_dir / f"{stem}-{kind}.png"
            draw(kind, stem, files[f"{stem}-{kind}"])
    markdown = render([f.name for f in files.values()])
    files["report"] = out_dir / "report.md"
    files["report"].write_text(markdown)
    files["results"] = out_dir / "results.json"
    files["results"].write_text(json.dumps(data, indent=2) + "\n")
    return files
