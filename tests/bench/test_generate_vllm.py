"""``batchline bench --task generate --generators ...,vllm``: vLLM's engine beside batchline's own
generators in one run, here on a stand-in with vLLM's async engine shape (the real one runs in
tests/models/generation/test_vllm_cli.py, in the vLLM venv). No timing assertions."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from batchline.__main__ import main
from batchline._clock import Clock
from batchline._errors import InputError
from batchline.bench import generate as generate_module
from batchline.bench import generate_vllm
from batchline.bench.generate import (
    ALL_GENERATORS,
    GENERATORS,
    GenerateBenchOptions,
    GenerateBenchResult,
    ModelParts,
    bench_knobs,
    build_work,
    fake_parts,
    run_generate_bench,
)
from batchline.bench.generate_vllm import EngineTurn
from batchline.bench.loadgen import parse_loads
from batchline.bench.report import generate_dtypes_line, write_generate_report
from batchline.models.config import Knobs
from batchline.models.generation.stream import TextGenerator
from batchline.models.generation.vllm_generator import VllmGenerator
from tests.models.generation.test_vllm import StandInAsyncLLM

STAND_IN_DTYPE = "bfloat16 (auto: the stand-in's)"


class StandInVllm:
    """Starts a stand-in vLLM engine for each turn and counts the turns and their closing."""

    def __init__(self, *, context_tokens: int = 4096) -> None:
        self.context_tokens = context_tokens
        self.events: list[str] = []
        self.generators: list[VllmGenerator] = []
        self.calls: list[tuple[str, Knobs]] = []

    async def __call__(self, model: str, knobs: Knobs) -> EngineTurn:
        self.calls.append((model, knobs))
        self.events.append("start")
        engine = StandInAsyncLLM(delta=True)  # as vLLM streams to the adapter

        def new_generator(clock: Clock) -> TextGenerator:
            gen = VllmGenerator(
                engine,
                max_context_tokens=self.context_tokens,
                sampling_params_factory=lambda p: p,
                prompt_factory=lambda ids: {"prompt_token_ids": ids},
                clock=clock,
            )
            self.generators.append(gen)
            return gen

        async def close() -> None:
            self.events.append("close")

        return EngineTurn(new_generator, self.context_tokens, STAND_IN_DTYPE, close)


def small(**overrides: object) -> GenerateBenchOptions:
    values: dict[str, object] = {
        "loads": parse_loads(["closed:3", "open:500"]),
        "requests": 6,
        "sequential_requests": 3,
        "repeats": 2,
        "min_new": 2,
        "max_new": 5,
        "max_running_sequences": 3,
        "generators": ALL_GENERATORS,
    }
    values.update(overrides)
    return GenerateBenchOptions(**values)  # type: ignore[arg-type]


@pytest.fixture
def parts() -> ModelParts:
    return fake_parts(fixed_s=0.0, per_sequence_s=0.0)


def test_vllm_runs_beside_the_others_on_the_same_work_one_engine_per_turn(
    parts: ModelParts,
) -> None:
    options = small()
    vllm = StandInVllm()
    result = run_generate_bench(options, parts=parts, start_vllm=vllm)
    work = build_work(parts, options)
    assert result.generators == list(ALL_GENERATORS)
    # one engine per turn (a turn: every load point of one repeat), warmed, always closed
    assert vllm.events == ["start", "close"] * options.repeats
    # the same model and knobs as the torch configurations (the backend is set when loading)
    assert all(call == (options.model, bench_knobs(options)) for call in vllm.calls)
    assert vllm.calls[0][1].dtype == options.dtype
    assert vllm.calls[0][1].max_running_sequences == options.max_running_sequences
    # a fresh generator per run (its own stats): the warm-up's and one per load point
    assert len(vllm.generators) == options.repeats * (1 + len(options.loads))
    runs = [r for r in result.runs if r.generator == "vllm"]
    assert len(runs) == options.repeats * len(options.loads)
    for run in runs:
        assert (run.requests, run.rejected) == (options.requests, 0)
        assert run.tokens == sum(w.max_tokens for w in work[: options.requests])
    # repeats interleave: the turn order rotates, vllm's position with it
    per_repeat = len(ALL_GENERATORS) * len(options.loads)
    orders = [
        list(dict.fromkeys(r.generator for r in result.runs[i : i + per_repeat]))
        for i in range(0, len(result.runs), per_repeat)
    ]
    assert orders == [list(ALL_GENERATORS), [*ALL_GENERATORS[1:], ALL_GENERATORS[0]]]
    assert {(p.generator, str(p.point)) for p in result.points} == {
        (g, load) for g in ALL_GENERATORS for load in ("closed:3", "open:500")
    }
    assert result.dtypes == {**dict.fromkeys(GENERATORS, parts.dtype), "vllm": STAND_IN_DTYPE}


def test_every_row_has_its_throughput_over_the_same_baseline(parts: ModelParts) -> None:
    result = run_generate_bench(small(repeats=1), parts=parts, start_vllm=StandInVllm())
    by = {(p.generator, str(p.point)): p for p in result.points}
    base = by["sequential", "closed:3"].tokens_per_s
    for name in ALL_GENERATORS:
        point = by[name, "closed:3"]
        assert result.baseline_ratio(point) == pytest.approx(point.tokens_per_s / base)
        # open loop: throughput is the arrival rate, no ratio
        assert math.isnan(result.baseline_ratio(by[name, "open:500"]))
    assert result.baseline_ratio(by["sequential", "closed:3"]) == pytest.approx(1.0)
    # without the baseline in the run, no ratio at all
    alone = run_generate_bench(
        small(repeats=1, generators=["continuous", "vllm"]), parts=parts, start_vllm=StandInVllm()
    )
    assert all(math.isnan(alone.baseline_ratio(p)) for p in alone.points)


def test_the_report_shows_the_vllm_row_its_ratio_and_every_dtype(
    parts: ModelParts, tmp_path: Path
) -> None:
    result = run_generate_bench(small(repeats=1), parts=parts, start_vllm=StandInVllm())
    files = write_generate_report(result, tmp_path / "report")
    text = files["report"].read_text()
    (row,) = [line for line in text.splitlines() if line.startswith("| vllm | closed 3 clients")]
    vllm_point = next(p for p in result.points if p.generator == "vllm" and p.kind == "closed")
    assert f"x{result.baseline_ratio(vllm_point):.2f}" in row
    assert "| x baseline |" in text
    assert "*x baseline*: tokens/s over sequential's at the same point" in text
    assert "- **vllm**: vLLM's engine on the same model" in text
    assert f"computes in {STAND_IN_DTYPE}" in text
    assert f"computes in {parts.dtype}" in text
    assert "started for each of its turns" in text
    data = json.loads(files["results"].read_text())
    assert data["dtypes"]["vllm"] == STAND_IN_DTYPE
    assert {p["generator"] for p in data["points"]} == set(ALL_GENERATORS)
    ratios = {
        p["generator"]: p["tokens_per_s_x_baseline"]
        for p in data["points"]
        if p["kind"] == "closed"
    }
    assert ratios["sequential"] == pytest.approx(1.0)
    assert ratios["vllm"] == pytest.approx(result.baseline_ratio(vllm_point))
    assert all(p["tokens_per_s_x_baseline"] is None for p in data["points"] if p["kind"] == "open")
    assert generate_dtypes_line(result) == (
        f"sequential, static, continuous: {parts.dtype}; vllm: {STAND_IN_DTYPE}"
    )


def test_vllms_engine_is_shut_down_when_the_work_does_not_fit_its_context(
    parts: ModelParts,
) -> None:
    vllm = StandInVllm(context_tokens=8)
    with pytest.raises(InputError, match="over vLLM's context of 8 tokens"):
        run_generate_bench(small(generators=["vllm"]), parts=parts, start_vllm=vllm)
    assert vllm.events == ["start", "close"]


def test_a_failed_vllm_run_still_shuts_its_engine_down(
    parts: ModelParts, monkeypatch: pytest.MonkeyPatch
) -> None:
    vllm = StandInVllm()
    real = generate_module.run_one

    async def failing(name: str, gen: TextGenerator, *args: object, **kwargs: object) -> object:
        if name == "vllm":
            raise RuntimeError("engine died")
        return await real(name, gen, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(generate_module, "run_one", failing)
    with pytest.raises(RuntimeError, match="engine died"):
        run_generate_bench(small(), parts=parts, start_vllm=vllm)
    assert vllm.events == ["start", "close"]


# -- the CLI ---------------------------------------------------------------------------------


def _no_loading(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    loaded: list[str] = []

    def load_parts(options: GenerateBenchOptions) -> ModelParts:
        loaded.append(options.model)
        raise AssertionError("no model may load")

    monkeypatch.setattr(generate_module, "load_parts", load_parts)
    return loaded


def test_vllm_missing_is_one_line_before_any_model_loads(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(generate_vllm, "vllm_installed", lambda: False)
    loaded = _no_loading(monkeypatch)
    argv = ["bench", "--task", "generate", "--generators", "continuous,vllm", "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--generators vllm needs vLLM" in err
    assert "bash scripts/vllm_env.sh" in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert loaded == []
    with pytest.raises(InputError, match=r"bash scripts/vllm_env\.sh"):
        run_generate_bench(small(generators=["vllm"]))  # the API says the same


def test_an_unknown_generator_names_vllm_among_the_choices(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    loaded = _no_loading(monkeypatch)
    assert main(["bench", "--task", "generate", "--generators", "continuous,vlm"]) == 2
    err = capsys.readouterr().err
    assert "--generators takes sequential, static, continuous, vllm; got continuous, vlm" in err
    assert loaded == []


def test_the_cli_parses_the_vllm_generator_and_prints_its_row(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    seen: list[GenerateBenchOptions] = []
    real: Callable[..., GenerateBenchResult] = run_generate_bench

    def on_stand_ins(options: GenerateBenchOptions, progress: object) -> GenerateBenchResult:
        seen.append(options)
        parts = fake_parts(fixed_s=0.0, per_sequence_s=0.0)
        return real(options, None, parts=parts, start_vllm=StandInVllm())

    monkeypatch.setattr(generate_module, "run_generate_bench", on_stand_ins)
    out = tmp_path / "report"
    argv = ["bench", "--task", "generate", "--generators", " continuous , vllm,sequential"]
    argv += ["--load", "closed:3", "--requests", "4", "--sequential-requests", "2"]
    argv += ["--repeats", "1", "--min-new", "2", "--max-new", "4", "--dtype", "bfloat16"]
    argv += ["--max-running-sequences", "3", "-o", str(out)]  # the table: not --quiet
    assert main(argv) == 0
    (options,) = seen
    assert list(options.generators) == ["continuous", "vllm", "sequential"]
    assert (options.dtype, options.max_running_sequences, options.model) == (
        "bfloat16",
        3,
        "smollm2",
    )
    out_text = capsys.readouterr().out
    (row,) = [line for line in out_text.splitlines() if line.startswith("│ vllm ")]
    cells = [cell.strip() for cell in row.strip("│").split("│")]
    assert cells[:3] == ["vllm", "closed 3 clients", "4"]
    assert float(cells[4].removeprefix("x")) > 0  # its tokens/s over sequential's
    printed = " ".join(out_text.split())
    assert "x baseline: tokens/s over sequential's" in printed
    assert f"vllm: {STAND_IN_DTYPE}" in printed
    data = json.loads((out / "results.json").read_text())
    assert [g for g in data["generators"]] == ["sequential", "continuous", "vllm"]


def test_bench_help_names_the_vllm_generator_without_importing_vllm(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import sys

    before = "vllm" in sys.modules
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "and vllm: the same model, dtype and --max-running-sequences" in help_text
    assert "bash scripts/vllm_env.sh" in help_text
    assert ("vllm" in sys.modules) == before
