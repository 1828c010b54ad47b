"""What ``batchline bench --task generate`` measures and reports: the configurations it compares,
each run's raw figures, the medians over repeats, and the ratios (against the goals, and every
throughput against the sequential baseline at the same load point).

Only the standard library: the report reads these without the models.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

from batchline.bench.loadgen import LoadKind, LoadPoint
from batchline.bench.stats import summarize

__all__ = [
    "ALL_GENERATORS",
    "BASELINE_GENERATOR",
    "DESCRIPTIONS",
    "GENERATORS",
    "GOALS",
    "GenPoint",
    "GenerateBenchResult",
    "Ratio",
    "RunFigures",
    "medians",
]

GeneratorName = Literal["sequential", "static", "continuous", "vllm"]
#: The default configurations: batchline's own, on the loaded torch engine.
GENERATORS: tuple[GeneratorName, ...] = ("sequential", "static", "continuous")
#: Every configuration ``--generators`` takes, in report order: ``vllm`` needs vLLM installed.
ALL_GENERATORS: tuple[GeneratorName, ...] = (*GENERATORS, "vllm")
#: What every throughput is divided by in the report (at the same closed-loop point).
BASELINE_GENERATOR: GeneratorName = "sequential"

#: The goals the ratios are held to: (name, numerator, denominator, metric, op, goal).
GOALS: tuple[tuple[str, str, str, str, str, float], ...] = (
    ("continuous/static throughput", "continuous", "static", "tokens_per_s", ">=", 1.3),
    ("continuous/static p99 latency", "continuous", "static", "latency_p99_s", "<=", 0.8),
    ("continuous/sequential throughput", "continuous", "sequential", "tokens_per_s", ">=",
     2.5),
    ("continuous/static TTFT p99", "continuous", "static", "ttft_p99_s", "<=", 0.5),
)  # fmt: skip

DESCRIPTIONS: dict[str, str] = {
    "sequential": "one sequence at a time (the baseline)",
    "static": "static batching: a batch runs until its last sequence ends",
    "continuous": "continuous batching: sequences join and leave between steps",
    "vllm": "vLLM's engine on the same model (its own continuous batching and paged KV cache), "
    "through batchline's VllmGenerator; started for each of its turns",
}


def _none_if_nan(value: float) -> float | None:
    return None if math.isnan(value) else value


@dataclass(frozen=True)
class RunFigures:
    """One generator, one load point, one repeat: the raw figures."""

    generator: str
    kind: LoadKind
    offered: float
    repeat: int
    requests: int
    tokens: int
    wall_s: float
    latencies_s: list[float]
    ttfts_s: list[float]
    itl_p50_s: float
    rejected: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(frozen=True)
class GenPoint:
    """One generator at one load point: medians over the repeats (seconds; ``nan`` = none)."""

    generator: str
    kind: LoadKind
    offered: float
    requests: int
    repeats: int
    tokens_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    rejected: int = 0

    @property
    def point(self) -> LoadPoint:
        return LoadPoint(self.kind, self.offered)

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in data.items()}


@dataclass(frozen=True)
class Ratio:
    """One goal's ratio at one load point."""

    name: str
    point: LoadPoint
    value: float
    op: str
    goal: float

    @property
    def ok(self) -> bool:
        if math.isnan(self.value):
            return False
        return self.value >= self.goal if self.op == ">=" else self.value <= self.goal

    def line(self) -> str:
        mark = "ok" if self.ok else "MISSED"
        return (
            f"{self.point.label:<18} {self.name:<38} {self.value:6.2f}   "
            f"goal {self.op} {self.goal:g}   {mark}"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "load": str(self.point),
            "value": None if math.isnan(self.value) else self.value,
            "goal": f"{self.op} {self.goal:g}",
            "ok": self.ok,
        }


@dataclass
class GenerateBenchResult:
    """Everything the report needs."""

    model: str
    generators: list[str]
    points: list[GenPoint]
    runs: list[RunFigures]
    loads: list[LoadPoint]
    workload: str
    environment: dict[str, str]
    command: str = ""
    elapsed_s: float = 0.0
    #: generator -> the dtype it computed in, and why
    dtypes: dict[str, str] = field(default_factory=dict)

    def baseline_ratio(self, point: GenPoint) -> float:
        """``point``'s tokens/s over the baseline's (:data:`BASELINE_GENERATOR`) at the same
        closed-loop load point; ``nan`` where the baseline did not run or the loop is open
        (throughput is the arrival rate there)."""
        if point.kind == "open":
            return math.nan
        base = [
            p for p in self.points if p.generator == BASELINE_GENERATOR and p.point == point.point
        ]
        if not base or base[0].tokens_per_s <= 0:
            return math.nan
        return point.tokens_per_s / base[0].tokens_per_s

    def ratios(self) -> list[Ratio]:
        """Every goal's ratio at every load point where both its configurations ran
        (throughput ratios at closed-loop points only: open-loop throughput is the rate)."""
        out: list[Ratio] = []
        for load in self.loads:
            here = {p.generator: p for p in self.points if p.point == load}
            for name, num, den, metric, op, goal in GOALS:
                if metric == "tokens_per_s" and load.kind == "open":
                    continue  # capped by the arrival rate: not what the goal measures
                if num in here and den in here:
                    a, b = getattr(here[num], metric), getattr(here[den], metric)
                    value = a / b if b > 0 else math.nan
                    out.append(Ratio(name, load, value, op, goal))
        return out

    def to_dict(self) -> dict[str, object]:
        return {
            "model": self.model,
            "generators": {g: DESCRIPTIONS[g] for g in self.generators},
            "dtypes": self.dtypes,
            "loads": [str(p) for p in self.loads],
            "workload": self.workload,
            "points": [
                {**p.to_dict(), "tokens_per_s_x_baseline": _none_if_nan(self.baseline_ratio(p))}
                for p in self.points
            ],
            "ratios": [r.to_dict() for r in self.ratios()],
            "runs": [
                {
                    "generator": r.generator,
                    "load": str(LoadPoint(r.kind, r.offered)),
                    "repeat": r.repeat,
                    "requests": r.requests,
                    "tokens": r.tokens,
                    "wall_s": r.wall_s,
                    "tokens_per_s": r.tokens_per_s,
                    "rejected": r.rejected,
                }
                for r in self.runs
            ],
            "environment": self.environment,
            "command": self.command,
            "elapsed_s": self.elapsed_s,
        }


# -- the whole bench: medians over repeats ----------------------------------------------------


def _median(values: Sequence[float]) -> float:
    clean = [v for v in values if not math.isnan(v)]
    return statistics.median(clean) if clean else math.nan


def medians(runs: Sequence[RunFigures]) -> list[GenPoint]:
    """Medians over repeats, per load point and generator (in run order)."""
    keys = list(dict.fromkeys((r.kind, r.offered, r.generator) for r in runs))
    points: list[GenPoint] = []
    for kind, offered, generator in keys:
        rs = [r for r in runs if (r.kind, r.offered, r.generator) == (kind, offered, generator)]
        latency = [summarize(r.latencies_s) for r in rs]
        ttft = [summarize(r.ttfts_s) for r in rs]
        points.append(
            GenPoint(
                generator=generator,
                kind=kind,
                offered=offered,
                requests=rs[0].requests,
                repeats=len(rs),
                tokens_per_s=_median([r.tokens_per_s for r in rs]),
                latency_p50_s=_median([x.p50_s for x in latency]),
                latency_p99_s=_median([x.p99_s for x in latency]),
                ttft_p50_s=_median([x.p50_s for x in ttft]),
                ttft_p99_s=_median([x.p99_s for x in ttft]),
                itl_p50_s=_median([r.itl_p50_s for r in rs]),
                rejected=sum(r.rejected for r in rs),
            )
        )
    return points
