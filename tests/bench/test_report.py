"""The report files: Markdown table rows, valid PNG plots, results.json, the printed table."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from PIL import Image

from batchline.bench.loadgen import PointResult
from batchline.bench.report import TABLE_HEADER, format_row, print_table, write_report
from batchline.bench.runner import BenchResult
from batchline.bench.targets import Configuration, reference_configurations
from batchline.models.config import Knobs


def point(
    config: str, kind: str, offered: float, rps: float, p99: float, **kw: object
) -> PointResult:
    values: dict[str, object] = {
        "config": config,
        "kind": kind,
        "offered": offered,
        "duration_s": 2.0,
        "sent": int(rps * 2),
        "completed": int(rps * 2),
        "errors": 0,
        "achieved_rps": rps,
        "p50_ms": p99 / 3,
        "p95_ms": p99 / 1.5,
        "p99_ms": p99,
        "avg_batch_size": 1.0,
        "utilization": 0.5,
    }
    values.update(kw)
    return PointResult(**values)  # type: ignore[arg-type]


def result(kinds: tuple[str, ...] = ("closed", "open")) -> BenchResult:
    configs = reference_configurations(["baseline", "defaults", "classic"])
    configs.append(Configuration.from_knobs("mine", Knobs(target_batch_tokens=1024)))
    points = []
    for kind in kinds:
        loads = [1, 8, 32, 64] if kind == "closed" else [50, 100, 200, 400]
        for i, c in enumerate(configs):
            for j, load in enumerate(loads):
                rps = min(load * 40.0 if kind == "closed" else load, 120.0 * (1 + i))
                p99 = 5.0 * (j + 1) ** 2 * (i + 1)
                extra: dict[str, object] = {}
                if kind == "open" and load == 400 and c.is_baseline:
                    extra = {"unanswered": 37, "p99_ms": 2_500.0}
                points.append(point(c.name, kind, load, rps, p99, **extra))
    return BenchResult(
        configurations=configs,
        points=points,
        loads=[],
        duration_s=2.0,
        inputs="100 texts from a test",
        model="default",
        target="inprocess",
        environment={"cpus": "2"},
        command="batchline bench --duration 2",
        elapsed_s=42.0,
    )


def test_report_files(tmp_path: Path) -> None:
    r = result()
    files = write_report(r, tmp_path / "report")
    assert set(files) == {
        "report",
        "results",
        "throughput-closed",
        "p99-closed",
        "throughput-open",
        "p99-open",
    }
    for role, path in files.items():
        assert path.exists(), role
        if path.suffix == ".png":
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            with Image.open(path) as image:
                image.verify()
            with Image.open(path) as image:
                width, height = image.size
                assert width >= 600
                assert height >= 400
                # a real plot, not a blank canvas
                assert len(image.convert("RGB").getcolors(maxcolors=1 << 16) or []) > 10


def test_markdown_has_one_row_per_point_and_links_the_plots(tmp_path: Path) -> None:
    r = result()
    files = write_report(r, tmp_path)
    md = files["report"].read_text()
    header = "| " + " | ".join(TABLE_HEADER) + " |"
    assert header in md
    rows = [line for line in md.splitlines() if line.startswith("| ") and line != header]
    assert len(rows) == len(r.points)
    for p in r.points:
        assert "| " + " | ".join(format_row(p)) + " |" in rows
    # grouped by load point: the baseline, then the others, at each point
    assert rows[0].startswith("| baseline | closed | 1 client |")
    assert rows[1].startswith("| batchline defaults | closed | 1 client |")
    assert "| baseline | open | 400 rec/s | 120.0 |" in md
    assert "0 +37 unanswered" in md
    for name in ("throughput-closed.png", "p99-closed.png", "throughput-open.png"):
        assert f"]({name})" in md
    assert "## Against the no-batching baseline" in md
    assert "batchline bench --duration 2" in md
    assert "**mine**: 1024 padded tokens per batch" in md


def test_format_row() -> None:
    p = point("x", "closed", 8, 1234.56, 87.25, avg_batch_size=None, utilization=None)
    assert format_row(p) == (
        "x",
        "closed",
        "8 clients",
        "1,234.6",
        "29.1",
        "58.2",
        "87.2",
        "n/a",
        "n/a",
        "0",
    )
    nan = point("x", "open", 10, 0.0, math.nan, errors=3)
    assert format_row(nan)[4:7] == ("n/a", "n/a", "n/a")
    assert format_row(nan)[-1] == "3"


def test_only_the_load_kinds_run_are_plotted(tmp_path: Path) -> None:
    files = write_report(result(("closed",)), tmp_path)
    assert "throughput-open" not in files
    assert (tmp_path / "p99-closed.png").exists()
    assert not (tmp_path / "p99-open.png").exists()


def test_results_json_round_trips(tmp_path: Path) -> None:
    r = result()
    files = write_report(r, tmp_path)
    data = json.loads(files["results"].read_text())
    again = BenchResult.from_dict(data)
    assert again.points == r.points
    assert [c.name for c in again.configurations] == [c.name for c in r.configurations]
    assert again.configurations[0].is_baseline


def test_printed_table() -> None:
    from rich.console import Console

    console = Console(record=True, width=140)
    print_table(result().points, console)
    text = console.export_text()
    assert "batchline defaults" in text
    assert "closed 32 clients" in text
    assert "open 400 rec/s" in text
    assert "+37 unanswered" in text


def test_unknown_reference_configuration() -> None:
    from batchline._errors import InputError

    with pytest.raises(InputError, match="unknown reference"):
        reference_configurations(["fastest"])
