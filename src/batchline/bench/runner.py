"""``run_bench``: every configuration at every load point, on the same inputs, in one run.

    >>> from batchline.bench.runner import BenchOptions, run_bench
    >>> result = run_bench(BenchOptions(loads=parse_load("closed:1,8,32"), duration_s=5))
    >>> write_report(result, Path("report"))      # batchline.bench.report

All configurations are started (and warmed up, untimed) first; then at each load point they
run back to back, with the same texts and, for open loops, the same arrival schedule.
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
from batchline.bench.inputs import Inputs, Lengths, load_inputs
from batchline.bench.loadgen import LoadPoint, PointResult, Target, parse_load, run_point
from batchline.bench.targets import (
    Configuration,
    ModelLoader,
    describe_knobs,
    embeddings_url,
    open_target,
    reference_configurations,
)
from batchline.knobs import Knobs

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
    """What ``batchline bench`` measures. ``target`` is ``"inprocess"`` or a server URL."""

    model: str = "default"
    tokenizer: Path | None = None
    target: str = "inprocess"
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
    texts: Sequence[str],
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
    async with open_target(config, texts, loader) as target:
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
        url = embeddings_url(options.target)
        name = f"server {urllib.parse.urlsplit(url).netloc}"
        return [Configuration(name, "http", url=url, description=f"POST {url}, one text each")]
    configs = reference_configurations(options.compare)
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
    loader = ModelLoader(options.model, options.tokenizer) if in_process else None
    inputs = await asyncio.to_thread(_inputs, options, loader)
    progress.message(f"inputs: {inputs.description}")
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
                await stack.enter_async_context(open_target(config, inputs.texts, loader))
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
        model=options.model,
        target=options.target,
        environment=env,
        command=options.command,
        elapsed_s=time.perf_counter() - started,
    )


def _inputs(options: BenchOptions, loader: ModelLoader | None) -> Inputs:
    tok_loader = loader or ModelLoader(options.model, options.tokenizer)
    tokenizer, _ = tok_loader.tokenizer()
    return load_inputs(
        options.inputs,
        lengths=options.lengths,
        tokenizer=tokenizer,
        text_column=options.text_column,
        seed=options.seed,
    )
