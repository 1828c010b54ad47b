"""``batchline bench --task generate``: sequential, static and continuous on one loaded model,
closed and open loops, the report files and the goal ratios (no timing assertions: the figures
are whatever this machine gave; only their presence and their bookkeeping are checked)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from batchline.__main__ import main
from batchline._errors import InputError
from batchline.bench.generate import (
    GENERATORS,
    GOALS,
    GenerateBenchOptions,
    GenerateBenchResult,
    ModelParts,
    build_work,
    fake_parts,
    run_generate_bench,
)
from batchline.bench.loadgen import LoadPoint, parse_loads
from batchline.bench.report import render_generate_markdown, write_generate_report

RATIO_NAMES = [g[0] for g in GOALS]


def small(**overrides: object) -> GenerateBenchOptions:
    values: dict[str, object] = {
        "loads": parse_loads(["closed:3", "open:500"]),
        "requests": 6,
        "sequential_requests": 3,
        "repeats": 2,
        "min_new": 2,
        "max_new": 5,
        "max_running_sequences": 3,
    }
    values.update(overrides)
    return GenerateBenchOptions(**values)  # type: ignore[arg-type]


@pytest.fixture
def parts() -> ModelParts:
    return fake_parts(fixed_s=0.0, per_sequence_s=0.0)


def test_every_configuration_at_every_point_generates_exactly_what_was_asked(
    parts: ModelParts,
) -> None:
    options = small()
    result = run_generate_bench(options, parts=parts)
    work = build_work(parts, options)
    assert result.generators == list(GENERATORS)
    # every repeat of every generator at every point: the work's requests, each generating
    # exactly its max_tokens (ignore_eos), the same work for every configuration
    assert len(result.runs) == options.repeats * len(options.loads) * len(GENERATORS)
    for run in result.runs:
        n = options.sequential_requests if run.generator == "sequential" else options.requests
        assert (run.requests, run.rejected) == (n, 0)
        assert run.tokens == sum(w.max_tokens for w in work[:n])
        assert len(run.latencies_s) == len(run.ttfts_s) == n
        assert all(t <= lat for t, lat in zip(run.ttfts_s, run.latencies_s, strict=True))
    # repeats interleave: the order rotates, so the first generator differs per repeat
    firsts = [r.generator for r in result.runs if r.offered == 3][:: len(GENERATORS)]
    assert firsts == ["sequential", "static"]
    assert {(p.generator, str(p.point)) for p in result.points} == {
        (g, load) for g in GENERATORS for load in ("closed:3", "open:500")
    }
    assert all(p.repeats == 2 and p.tokens_per_s > 0 for p in result.points)


def test_the_ratios_are_the_goals_at_each_point(parts: ModelParts) -> None:
    result = run_generate_bench(small(), parts=parts)
    ratios = result.ratios()
    closed = [r for r in ratios if r.point == LoadPoint("closed", 3)]
    opened = [r for r in ratios if r.point == LoadPoint("open", 500)]
    assert [r.name for r in closed] == RATIO_NAMES
    # open-loop throughput is the arrival rate: only latency and TTFT are compared there
    assert [r.name for r in opened] == [
        "continuous/static p99 latency",
        "continuous/static TTFT p99",
    ]
    by = {(p.generator, str(p.point)): p for p in result.points}
    (tput,) = [r for r in closed if r.name == "continuous/static throughput"]
    assert tput.value == pytest.approx(
        by["continuous", "closed:3"].tokens_per_s / by["static", "closed:3"].tokens_per_s
    )
    assert tput.ok == (tput.value >= 1.3)
    assert "goal >= 1.3" in tput.line()
    # without sequential, its ratio is left out
    two = run_generate_bench(small(generators=["static", "continuous"], repeats=1), parts=parts)
    assert "continuous/sequential throughput" not in [r.name for r in two.ratios()]


def test_report_files_hold_all_three_configurations_and_the_ratios(
    parts: ModelParts, tmp_path: Path
) -> None:
    result = run_generate_bench(small(repeats=1), parts=parts)
    files = write_generate_report(result, tmp_path / "report")
    names = {p.name for p in (tmp_path / "report").iterdir()}
    charts = ("throughput", "ttft", "latency-p99")
    pngs = {f"{chart}-{kind}.png" for chart in charts for kind in ("closed", "open")}
    assert names == {"report.md", "results.json", *pngs}
    assert all(path.stat().st_size > 0 for path in files.values())
    text = files["report"].read_text()
    for name in (*GENERATORS, *RATIO_NAMES, "TTFT p99", "tokens/s", "ttft-closed.png"):
        assert name in text
    data = json.loads(files["results"].read_text())
    assert set(data["generators"]) == set(GENERATORS)
    assert {p["generator"] for p in data["points"]} == set(GENERATORS)
    assert {r["name"] for r in data["ratios"]} == set(RATIO_NAMES)
    assert all(r["value"] is None or math.isfinite(r["value"]) for r in data["ratios"])


def test_a_report_without_ratios_or_plots_still_renders() -> None:
    empty = GenerateBenchResult("fake", ["continuous"], [], [], [], "none", {})
    text = render_generate_markdown(empty)
    assert "## Ratios" not in text
    assert "## Plots" not in text


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"loads": []}, "no load points"),
        ({"generators": ["dynamic"]}, "--generators takes"),
        ({"requests": 0}, "--requests must be >= 1"),
        ({"min_new": 9, "max_new": 8}, "--max-new"),
        ({"max_new": 5000}, "over the model's context"),
        ({"kv_token_budget": 10}, "cannot hold the longest request"),
    ],
)
def test_bad_options_are_input_errors(
    parts: ModelParts, overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(InputError, match=message):
        run_generate_bench(small(**overrides), parts=parts)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--requests", "3"], "--requests goes with text generation"),
        (["bench", "--task", "generate", "--target", "http://127.0.0.1:9"], "--target does not"),
        (["bench", "--task", "generate", "--inputs", "x.jsonl"], "--inputs does not"),
    ],
)
def test_cli_refusals_are_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


# -- the CLI on the tiny random Llama saved as a Hugging Face folder ------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    import torch

    from tests.models.generation.test_load import save_tiny_generator

    torch.set_num_threads(1)
    # the demo prompts through the chat template are ~200 tokens: over the usual 128
    return save_tiny_generator(tmp_path_factory.mktemp("gen") / "tiny", context_tokens=512)


def test_cli_on_a_folder_model_compares_the_three_on_one_load(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchline.models.generation import load as load_module

    loads: list[str] = []
    real = load_module.load_text_generator

    def counting(spec: object, knobs: object) -> object:
        loads.append(str(getattr(spec, "name", "")))
        return real(spec, knobs)  # type: ignore[arg-type]

    monkeypatch.setattr(load_module, "load_text_generator", counting)
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "report"
    argv = ["bench", "--model", f"{tiny}/", "--load", "closed:2", "--load", "open:200"]
    argv += ["--requests", "3", "--sequential-requests", "2", "--repeats", "1"]
    argv += ["--min-new", "2", "--max-new", "4", "--max-running-sequences", "2"]
    argv += ["--threads", "1", "-o", str(out)]  # the table: not --quiet
    assert main(argv) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "Loading weights" not in captured.err  # transformers' progress bars are silenced
    assert loads == ["tiny"]  # the weights loaded once for all three
    for name in (*GENERATORS, *RATIO_NAMES, "TTFT p99", "tokens/s"):
        assert name in printed
    assert "closed 2 clients" in printed
    assert "open 200/s" in printed
    data = json.loads((out / "results.json").read_text())
    assert {p["generator"] for p in data["points"]} == set(GENERATORS)
    assert data["model"] == "tiny"
    assert {"report.md", "throughput-closed.png", "ttft-open.png", "latency-p99-open.png"} <= {
        p.name for p in out.iterdir()
    }
    # every batched run generated exactly what its requests asked for
    runs = [r for r in data["runs"] if r["generator"] != "sequential"]
    assert all(r["requests"] == 3 and 6 <= r["tokens"] <= 12 for r in runs)


def test_the_benchmark_script_is_a_wrapper_with_its_own_flags(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ..benchmark_scripts import load_benchmark

    script = load_benchmark("bench_generate.py", monkeypatch)
    argv = ["--fake", "--clients", "3", "--requests", "4", "--sequential-requests", "2"]
    argv += ["--repeats", "1", "--min-new", "2", "--max-new", "4"]
    options = script.options_from(script.parse(argv))
    assert options.loads == [LoadPoint("closed", 3)]
    assert options.max_running_sequences == 3
    assert list(options.generators) == list(GENERATORS)
    assert script.options_from(script.parse([*argv, "--mode", "open", "--rate", "7"])).loads == [
        LoadPoint("open", 7)
    ]
    script.main([*argv, "--configs", "static,continuous"])
    printed = capsys.readouterr().out
    assert "continuous/static throughput" in printed
    assert "sequential" not in printed


# -- the generation target on the shared load generator ------------------------------------------


class _Result:
    def __init__(self, completion: object) -> None:
        self.completion = completion

    async def result(self) -> object:
        if isinstance(self.completion, Exception):
            raise self.completion
        return self.completion


class _Refusing:
    """Refuses prompt 1 (a full queue), fails prompt 2 (a broken model), answers the rest."""

    def submit(self, prompt_ids: tuple[int, ...], params: object) -> _Result:
        from batchline._errors import ModelError, QueueFullError
        from batchline.models.generation.stream import Completion

        if prompt_ids == (1,):
            raise QueueFullError("waiting queue full")
        if prompt_ids == (2,):
            return _Result(ModelError("the step failed"))
        return _Result(Completion("xyz", (5, 6, 7), 1, 3, "length", ttft_s=0.0, latency_s=0.0))


def test_the_target_counts_refusals_as_failed_requests_and_keeps_a_model_error() -> None:
    import asyncio

    from batchline._errors import ModelError
    from batchline.bench.generate import GenerationTarget, Work
    from batchline.bench.loadgen import run_closed

    work = [Work((0,), 3), Work((1,), 3), Work((0,), 3)]
    target = GenerationTarget(_Refusing(), work)  # type: ignore[arg-type]
    samples, _ = asyncio.run(run_closed(target, 1, None, requests=3))
    assert sorted(s.index for s in samples) == [0, 1, 2]
    assert [s.ok for s in sorted(samples, key=lambda s: s.index)] == [True, False, True]
    assert target.rejected == 1
    assert sorted(target.completions) == [0, 2]
    target.check()  # a refusal is the server saying no, not a broken model
    broken = GenerationTarget(_Refusing(), [Work((2,), 3)])  # type: ignore[arg-type]
    asyncio.run(run_closed(broken, 1, None, requests=1))
    with pytest.raises(ModelError, match="the step failed"):
        broken.check()
