"""``run_bench``: every configuration at every load point, on the same inputs, in one run.

    >>> from batchline.bench.runner import BenchOptions, run_bench
    >>> result = run_bench(BenchOptions(loads=parse_load("closed:1,8,32"), duration_s=5))
    >>> write_report(result, Path("report"))      # batchline.bench.report

Every model ``batchline run`` takes (``model``: ``default``, ``PATH.onnx`` with a ``task``,
``module:factory``) is loaded through ``load_model`` and batched through ``ModelBatcher`` in
every configuration. All configurations are started (and warmed up, untimed) first; then at
each load point they run back to back, with the same inputs and, for open loops, the same
arrival schedule.

``run_tune`` is ``batchline tune`` on the real model: the search of
:func:`batchline.bench.tune.tune`, each trial measured here as a bench measures a configuration.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import platform
import sys
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchline._errors import InputError
from batchline.bench.inputs import InputOptions, Inputs, Lengths, load_model_inputs
from batchline.bench.loadgen import LoadPoint, PointResult, Target, parse_load, run_point
from batchline.bench.model import LoadedModels, model_spec
from batchline.bench.targets import (
    Configuration,
    Route,
    describe_knobs,
    embeddings_url,
    oip_inputs,
    oip_url,
    open_target,
    reference_configurations,
)
from batchline.bench.tune import DEFAULT_NOISE, TuneResult, tune
from batchline.knobs import machine_cores
from batchline.models.builtin import BUILTIN_MODELS
from batchline.models.config import Knobs
from batchline.models.selection import ModelSelection
from batchline.models.specs import ModelSpec

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "DEFAULT_LOAD",
    "DEFAULT_TUNE_LOAD",
    "BenchOptions",
    "BenchResult",
    "MeasuredModel",
    "Say",
    "TuneOptions",
    "environment",
    "measure",
    "run_bench",
    "run_tune",
]

DEFAULT_LOAD = "closed:1,8,32,64"
REFERENCES = ("baseline", "defaults", "classic")


@dataclass(kw_only=True)
class MeasuredModel(ModelSelection):
    """What bench and tune share: the model (``batchline run``'s :class:`ModelSelection`),
    where it runs (``device``: ``cpu``, ``cuda[:N]``) and what it is sent (``inputs``,
    ``text_column``, ``lengths``, ``seed``: see ``batchline.bench.inputs``)."""

    device: str = "cpu"
    inputs: Path | None = None
    text_column: str = "text"
    lengths: Lengths | None = None
    seed: int = 0

    def measured_spec(self) -> ModelSpec:
        """The model spec (``batchline.bench.model.model_spec``: a generator is refused)."""
        return model_spec(self.model, task=self.task, **self.spec_options())

    def input_options(self) -> InputOptions:
        """Where the inputs come from, as ``batchline.bench.inputs`` takes it."""
        return InputOptions(
            path=self.inputs, text_column=self.text_column, lengths=self.lengths, seed=self.seed
        )


@dataclass
class BenchOptions(MeasuredModel):
    """What ``batchline bench`` measures: a :class:`MeasuredModel` at each load point.

    ``target`` is ``"inprocess"`` or a server URL; with a URL, ``route`` is ``openai``
    (``POST /v1/embeddings``) or ``oip`` (``POST /v2/models/{model}/infer``, ``model`` being
    the served name). ``device`` places the reference configurations; ``--config`` files carry
    their own.
    """

    target: str = "inprocess"
    route: Route = "openai"
    loads: list[LoadPoint] = field(default_factory=lambda: parse_load(DEFAULT_LOAD))
    duration_s: float = 5.0
    configs: list[Path] = field(default_factory=list)
    compare: Sequence[str] = REFERENCES
    warmup_s: float = 1.0
    command: str = ""


@dataclass
class BenchResult:
    """Everything a report needs: what was run, on what, and each point's figures."""

    configurations: list[Configuration]
    points: list[PointResult]
    loads: list[LoadPoint]
    duration_s: float
    inputs: str
    model: str
    target: str
    environment: dict[str, str]
    command: str = ""
    elapsed_s: float = 0.0

    def for_config(self, name: str) -> list[PointResult]:
        return [p for p in self.points if p.config == name]

    def to_dict(self) -> dict[str, object]:
        return {
            "configurations": [
                {
                    "name": c.name,
                    "kind": c.kind,
                    "description": c.description,
                    "knobs": dataclasses.asdict(c.knobs) if c.kind != "http" else None,
                    "url": c.url or None,
                    "route": c.route if c.kind == "http" else None,
                }
                for c in self.configurations
            ],
            "points": [p.to_dict() for p in self.points],
            "loads": [str(p) for p in self.loads],
            "duration_s": self.duration_s,
            "inputs": self.inputs,
            "model": self.model,
            "target": self.target,
            "environment": self.environment,
            "command": self.command,
            "elapsed_s": self.elapsed_s,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        """The inverse of :meth:`to_dict` (re-render a report from ``results.json``)."""
        configs = [
            Configuration(
                c["name"],
                c["kind"],
                Knobs(**c["knobs"]) if c.get("knobs") else Knobs(),
                url=c.get("url") or "",
                description=c.get("description", ""),
                route=c.get("route") or "openai",
            )
            for c in data["configurations"]
        ]
        return cls(
            configurations=configs,
            points=[PointResult.from_dict(p) for p in data["points"]],
            loads=[q for spec in data["loads"] for q in parse_load(spec)],
            duration_s=data["duration_s"],
            inputs=data["inputs"],
            model=data["model"],
            target=data["target"],
            environment=data["environment"],
            command=data.get("command", ""),
            elapsed_s=data.get("elapsed_s", 0.0),
        )


#: How every bench and tune tells how it goes: one line of text at a time (the CLI prints
#: them; ``None`` where a bench takes one means silent).
Say = Callable[[str], None]


def point_line(result: PointResult, done: int, total: int) -> str:
    """The progress line of one measured point."""
    failed = f", {result.errors + result.unanswered} failed/unanswered" if result.failed else ""
    return (
        f"  [{done}/{total}] {result.config} at {result.point.label}: "
        f"{result.achieved_rps:,.0f} rec/s, p99 {result.p99_ms:,.0f} ms{failed}"
    )


def environment() -> dict[str, str]:
    """Where the numbers come from: CPU count, load, versions."""
    env = {
        "cpus": str(
            len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        ),
        "platform": platform.platform(terse=True),
        "python": platform.python_version(),
    }
    if hasattr(os, "getloadavg"):
        env["load average (1 min) at start"] = f"{os.getloadavg()[0]:.2f}"
    for module in ("onnxruntime", "numpy"):
        mod = sys.modules.get(module)
        if mod is not None:
            env[module] = str(getattr(mod, "__version__", "?"))
    with contextlib.suppress(Exception):  # not installed as a distribution
        from importlib.metadata import version

        env["batchline"] = version("batchline")
    return env


async def warm_up(target: Target, points: Sequence[LoadPoint], seconds: float) -> None:
    """Untimed load, so the first point does not pay for first calls (allocations, caches)."""
    clients = max([int(p.value) for p in points if p.kind == "closed"] + [8])
    await run_point(target, LoadPoint("closed", min(clients, 32)), duration_s=seconds)


async def measure(
    config: Configuration,
    inputs: Sequence[object],
    points: Sequence[LoadPoint],
    *,
    duration_s: float,
    loader: LoadedModels | None,
    seed: int = 0,
    warmup_s: float = 1.0,
    on_point: Callable[[PointResult], None] | None = None,
) -> list[PointResult]:
    """Start ``config``, warm it up, and run it at each of ``points``."""
    results: list[PointResult] = []
    async with open_target(config, inputs, loader) as target:
        if warmup_s > 0:
            await warm_up(target, points, warmup_s)
        for point in points:
            result = await run_point(
                target, point, duration_s=duration_s, config=config.name, seed=seed
            )
            results.append(result)
            if on_point is not None:
                on_point(result)
    return results


def configurations(options: BenchOptions) -> list[Configuration]:
    """The configurations a bench compares, from its options."""
    if options.target != "inprocess":
        if options.configs:
            raise InputError(
                "--config applies to in-process runs; to bench a server with other settings, "
                "start it with 'batchline serve --config F' and pass its URL to --target"
            )
        if options.route == "oip":
            url = oip_url(options.target, served_name(options.model))
            what = "one row each"
        else:
            url, what = embeddings_url(options.target), "one text each"
        name = f"server {urllib.parse.urlsplit(url).netloc}"
        return [
            Configuration(
                name, "http", url=url, description=f"POST {url}, {what}", route=options.route
            )
        ]
    Knobs(device=options.device)  # validates --device before anything loads
    configs = reference_configurations(
        options.compare, cores=machine_cores(), device=options.device
    )
    seen = {c.name for c in configs}
    for path in options.configs:
        knobs = Knobs.load(path)
        name = path.stem
        while name in seen:
            name += "'"
        seen.add(name)
        configs.append(Configuration.from_knobs(name, knobs, f"{path}: {describe_knobs(knobs)}"))
    if not configs:
        raise InputError("nothing to measure: pass --config F or keep a reference in --compare")
    return configs


def run_bench(options: BenchOptions, progress: Say | None = None) -> BenchResult:
    """Run every configuration at every load point (sync). See the module docstring."""
    return asyncio.run(run_bench_async(options, progress))


async def run_bench_async(options: BenchOptions, progress: Say | None = None) -> BenchResult:
    """Async :func:`run_bench`; ``progress`` is told how it goes, one line at a time."""
    say = progress or (lambda _text: None)
    if not options.loads:
        raise InputError("no load points given")
    if not options.duration_s > 0:
        raise InputError(f"--duration must be > 0 seconds, got {options.duration_s}")
    started = time.perf_counter()
    configs = configurations(options)
    in_process = options.target == "inprocess"
    loader: LoadedModels | None = None
    try:
        if in_process:
            loader = LoadedModels(options.measured_spec())
            say(f"loading {loader.name} ...")
            inputs = await asyncio.to_thread(model_inputs, loader, configs[0].knobs, options)
            model_label = f"{options.model} ({loader.info(configs[0].knobs).task})"
            if loader.choice is not None:
                say(f"precision: {loader.choice.describe()}")
        else:
            inputs = await asyncio.to_thread(_http_inputs, options)
            model_label = options.model
        say(f"inputs: {inputs.description}")
        return await _run(options, configs, inputs, loader, model_label, started, say)
    finally:
        if loader is not None:
            await asyncio.to_thread(loader.close)


async def _run(
    options: BenchOptions,
    configs: list[Configuration],
    inputs: Inputs,
    loader: LoadedModels | None,
    model_label: str,
    started: float,
    say: Say,
) -> BenchResult:
    env = environment()
    total = len(configs) * len(options.loads)
    points: list[PointResult] = []

    def on_point(result: PointResult) -> None:
        points.append(result)
        say(point_line(result, len(points), total))

    # Every configuration stays up for the whole run and the load points are interleaved:
    # at each point all configurations run back to back, so a neighbour's job that slows
    # the shared machine for a while hits them alike instead of one of them.
    async with contextlib.AsyncExitStack() as stack:
        targets: list[Target] = []
        for config in configs:
            say(f"{config.name}: {config.description}")
            targets.append(
                await stack.enter_async_context(
                    open_target(config, inputs.items, loader, model=_served(options))
                )
            )
            if options.warmup_s > 0:
                await warm_up(targets[-1], options.loads, options.warmup_s)
        for point in options.loads:
            for config, target in zip(configs, targets, strict=True):
                on_point(
                    await run_point(
                        target,
                        point,
                        duration_s=options.duration_s,
                        config=config.name,
                        seed=options.seed,
                    )
                )
    if hasattr(os, "getloadavg"):
        # the neighbours' load while it ran says how far to trust the figures
        env["load average (1 min) at end"] = f"{os.getloadavg()[0]:.2f}"
    return BenchResult(
        configurations=configs,
        points=points,
        loads=list(options.loads),
        duration_s=options.duration_s,
        inputs=inputs.description,
        model=model_label,
        target=options.target,
        environment=env,
        command=options.command,
        elapsed_s=time.perf_counter() - started,
    )


# -- tune on the real model (the search is batchline.bench.tune) ----------------------------


@dataclass
class TuneOptions(MeasuredModel):
    """What ``batchline tune`` searches on: a :class:`MeasuredModel` within a p99 budget."""

    p99_budget_ms: float
    loads: list[LoadPoint] = field(default_factory=lambda: parse_load(DEFAULT_TUNE_LOAD))
    budget_s: float = 120.0
    duration_s: float | None = None
    noise: float = DEFAULT_NOISE
    cores: int | None = None


DEFAULT_TUNE_LOAD = "closed:8,32,64"


async def run_tune(options: TuneOptions, progress: Say | None = None) -> tuple[TuneResult, str]:
    """Tune on the real model: :func:`batchline.bench.tune.tune` (the search) with each trial
    measured here, as a bench measures a configuration. Returns the result and a description
    of the inputs."""
    say = progress or (lambda _text: None)
    if not options.p99_budget_ms > 0:
        raise InputError(f"--p99-ms must be > 0, got {options.p99_budget_ms}")
    if not options.budget_s > 0:
        raise InputError(f"--budget-s must be > 0, got {options.budget_s}")
    if options.duration_s is not None and not options.duration_s > 0:
        raise InputError(f"--duration must be > 0 seconds, got {options.duration_s}")
    if not options.noise >= 0:
        raise InputError(f"--noise must be >= 0, got {options.noise}")
    cores = options.cores or machine_cores()
    base = Knobs(device=options.device).baseline(cores)  # validates --device
    spec = options.measured_spec()
    loader = LoadedModels(spec)
    try:
        say(f"loading {spec.name} ...")
        inputs = await asyncio.to_thread(model_inputs, loader, base, options)
        if loader.choice is not None:
            say(f"precision: {loader.choice.describe()}")
        say(f"inputs: {inputs.description}")

        async def trial(
            label: str, knobs: Knobs, points: Sequence[LoadPoint], duration_s: float
        ) -> list[PointResult]:
            config = Configuration.from_knobs(label, knobs)

            def on_point(p: PointResult) -> None:
                say(
                    f"    {p.point.label}: {p.achieved_rps:,.0f} rec/s, p99 {p.p99_ms:,.0f} ms"
                    + (f", {p.errors + p.unanswered} failed/unanswered" if p.failed else "")
                )

            # one layout loaded besides the baseline's: a search over many layouts must not
            # hold them all in memory at once
            await asyncio.to_thread(loader.release, [base, knobs])
            return await measure(
                config,
                inputs.items,
                points,
                duration_s=duration_s,
                loader=loader,
                seed=options.seed,
                warmup_s=min(1.0, duration_s / 2),
                on_point=on_point,
            )

        result = await tune(
            trial,
            points=options.loads,
            p99_budget_ms=options.p99_budget_ms,
            budget_s=options.budget_s,
            cores=cores,
            noise=options.noise,
            duration_s=options.duration_s,
            progress=say,
            base_knobs=base,
            device=options.device,
        )
    finally:
        await asyncio.to_thread(loader.close)
    return result, inputs.description


def model_inputs(loader: LoadedModels, knobs: Knobs, options: MeasuredModel) -> Inputs:
    """What to send the loader's model, by the input it takes (``info.input_kind``); loads
    the model laid out as ``knobs`` say (the first configuration's: it stays cached). Sync."""
    info = loader.info(knobs)
    specs = info.details.get("inputs")
    return load_model_inputs(
        info.input_kind,
        options.input_options(),
        tokenizer=loader.tokenizer() if info.input_kind == "text" else None,
        tensor_specs=specs if isinstance(specs, list) else (),
    )


def served_name(model: str) -> str:
    """The name a server knows ``--model`` by: a built-in's served name, or as given."""
    builtin = BUILTIN_MODELS.get(model)
    return builtin.served_name if builtin is not None else model


def _served(options: BenchOptions) -> str:
    """The ``model`` an HTTP request names: always for OIP; for OpenAI only a name other than
    ``default`` and not an ``.onnx`` path (a server with one model needs none)."""
    model = options.model
    if options.route == "oip" or not (model == "default" or model.lower().endswith(".onnx")):
        return served_name(model)
    return ""


def _http_inputs(options: BenchOptions) -> Inputs:
    """Inputs for a server: texts for ``/v1/embeddings``; for OIP, what the served model's
    metadata lists (texts for a ``text`` BYTES input, else tensor rows). Texts are cut and
    counted with the tokenizer of ``--tokenizer``, else of the built-in model when it is the
    one named."""
    from batchline.models.onnx import load_tokenizer

    tokenizer: Tokenizer | None = None
    if options.tokenizer is not None:
        tokenizer, _ = load_tokenizer(options.tokenizer)
    elif options.model in BUILTIN_MODELS:
        from batchline.models.loader import text_tokenizer

        tokenizer = text_tokenizer(model_spec(options.model))
    if options.route == "oip":
        specs = oip_inputs(options.target, served_name(options.model))
        texts = [s.get("name") for s in specs] == ["text"] and specs[0].get("datatype") == "BYTES"
        return load_model_inputs(
            "text" if texts else "tensors",
            options.input_options(),
            tokenizer=tokenizer,
            tensor_specs=specs,
        )
    return load_model_inputs("text", options.input_options(), tokenizer=tokenizer)
