"""``run_bench``: every configuration at every load point, on the same inputs, in one run.

    >>> from batchline.bench.runner import BenchOptions, run_bench
    >>> result = run_bench(BenchOptions(loads=parse_load("closed:1,8,32"), duration_s=5))
    >>> write_report(result, Path("report"))      # batchline.bench.report

Any model ``batchline run`` takes (``model``: ``default``, ``PATH.onnx`` with a ``task``,
``module:factory``) is loaded through ``load_model`` and batched through ``Engine`` in every
configuration. All configurations are started (and warmed up, untimed) first; then at each
load point they run back to back, with the same inputs and, for open loops, the same arrival
schedule.
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
from typing import Any, Protocol

from batchline._errors import InputError
from batchline.bench.inputs import InputOptions, Inputs, Lengths, load_model_inputs
from batchline.bench.loadgen import LoadPoint, PointResult, Target, parse_load, run_point
from batchline.bench.targets import (
    Configuration,
    ModelLoader,
    Route,
    describe_knobs,
    embeddings_url,
    model_spec,
    oip_inputs,
    oip_url,
    open_target,
    reference_configurations,
    spec_tokenizer,
)
from batchline.knobs import Knobs, machine_cores
from batchline.models.builtin import BUILTIN_MODELS

__all__ = [
    "DEFAULT_LOAD",
    "BenchOptions",
    "BenchResult",
    "Progress",
    "environment",
    "measure",
    "run_bench",
]

DEFAULT_LOAD = "closed:1,8,32,64"
REFERENCES = ("baseline", "defaults", "classic")


@dataclass
class BenchOptions:
    """What ``batchline bench`` measures.

    ``model`` and its options (``task``, ``tokenizer``, ``labels``, ``pooling``,
    ``normalize``) are ``batchline run``'s. ``target`` is ``"inprocess"`` or a server URL;
    with a URL, ``route`` is ``openai`` (``POST /v1/embeddings``) or ``oip`` (``POST
    /v2/models/{model}/infer``, ``model`` being the served name). ``device`` (``cpu``,
    ``cuda[:N]``) places the reference configurations; ``--config`` files carry their own.
    """

    model: str = "default"
    tokenizer: Path | None = None
    task: str | None = None
    labels: tuple[str, ...] | None = None
    pooling: str | None = None
    normalize: bool | None = None
    target: str = "inprocess"
    route: Route = "openai"
    device: str = "cpu"
    loads: list[LoadPoint] = field(default_factory=lambda: parse_load(DEFAULT_LOAD))
    duration_s: float = 5.0
    inputs: Path | None = None
    text_column: str = "text"
    lengths: Lengths | None = None
    configs: list[Path] = field(default_factory=list)
    compare: Sequence[str] = REFERENCES
    seed: int = 0
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

    def to_dict(self) -> dict[str, Any]:
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


class Progress(Protocol):
    """Hooks a bench calls as it goes; the CLI prints them."""

    def message(self, text: str) -> None: ...

    def point_done(self, result: PointResult, done: int, total: int) -> None: ...


class _Silent:
    def message(self, text: str) -> None:
        pass

    def point_done(self, result: PointResult, done: int, total: int) -> None:
        pass


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
    try:
        from importlib.metadata import version

        env["batchline"] = version("batchline")
    except Exception:  # pragma: no cover - not installed as a distribution
        pass
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
    loader: ModelLoader | None,
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


def run_bench(options: BenchOptions, progress: Progress | None = None) -> BenchResult:
    """Run every configuration at every load point (sync). See the module docstring."""
    return asyncio.run(run_bench_async(options, progress))


async def run_bench_async(options: BenchOptions, progress: Progress | None = None) -> BenchResult:
    """Async :func:`run_bench`."""
    progress = progress or _Silent()
    if not options.loads:
        raise InputError("no load points given")
    if not options.duration_s > 0:
        raise InputError(f"--duration must be > 0 seconds, got {options.duration_s}")
    started = time.perf_counter()
    configs = configurations(options)
    in_process = options.target == "inprocess"
    loader: ModelLoader | None = None
    try:
        if in_process:
            loader = ModelLoader(options_spec(options))
            progress.message(f"loading {loader.name} ...")
            inputs = await asyncio.to_thread(model_inputs, loader, configs[0].knobs, options)
            model_label = f"{options.model} ({loader.info(configs[0].knobs).task})"
        else:
            inputs = await asyncio.to_thread(_http_inputs, options)
            model_label = options.model
        progress.message(f"inputs: {inputs.description}")
        return await _run(options, configs, inputs, loader, model_label, started, progress)
    finally:
        if loader is not None:
            await asyncio.to_thread(loader.close)


async def _run(
    options: BenchOptions,
    configs: list[Configuration],
    inputs: Inputs,
    loader: ModelLoader | None,
    model_label: str,
    started: float,
    progress: Progress,
) -> BenchResult:
    env = environment()
    total = len(configs) * len(options.loads)
    points: list[PointResult] = []

    def on_point(result: PointResult) -> None:
        points.append(result)
        progress.point_done(result, len(points), total)

    # Every configuration stays up for the whole run and the load points are interleaved:
    # at each point all configurations run back to back, so a neighbour's job that slows
    # the shared machine for a while hits them alike instead of one of them.
    async with contextlib.AsyncExitStack() as stack:
        targets: list[Target] = []
        for config in configs:
            progress.message(f"{config.name}: {config.description}")
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


def options_spec(options: Any) -> Any:
    """The model spec of bench or tune options (``model``, ``task``, ``tokenizer``, ...)."""
    return model_spec(
        options.model,
        task=options.task,
        tokenizer=options.tokenizer,
        labels=options.labels,
        pooling=options.pooling,
        normalize=options.normalize,
    )


def input_options(options: Any) -> InputOptions:
    """The input settings of bench or tune options (``inputs``, ``text_column``, ...)."""
    return InputOptions(
        path=options.inputs,
        text_column=options.text_column,
        lengths=options.lengths,
        seed=options.seed,
    )


def model_inputs(loader: ModelLoader, knobs: Knobs, options: Any) -> Inputs:
    """What to send the loader's model, by the input it takes (``info.input_kind``); loads
    the model laid out as ``knobs`` say (the first configuration's: it stays cached). Sync."""
    info = loader.info(knobs)
    specs = info.details.get("inputs")
    return load_model_inputs(
        info.input_kind,
        input_options(options),
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
    from batchline.models.onnx.embedder import load_tokenizer

    tokenizer: Any = None
    if options.tokenizer is not None:
        tokenizer, _ = load_tokenizer(options.tokenizer)
    elif options.model in BUILTIN_MODELS:
        tokenizer = spec_tokenizer(model_spec(options.model))
    if options.route == "oip":
        specs = oip_inputs(options.target, served_name(options.model))
        texts = [s.get("name") for s in specs] == ["text"] and specs[0].get("datatype") == "BYTES"
        return load_model_inputs(
            "text" if texts else "tensors",
            input_options(options),
            tokenizer=tokenizer,
            tensor_specs=specs,
        )
    return load_model_inputs("text", input_options(options), tokenizer=tokenizer)
