"""``batchline tune``: search the batching knobs for the most throughput within a p99 budget.

The search runs on the real model and the user's load shape, stage by stage, each stage
keeping the best setting so far (the one with the most records/s at a load point whose p99 is
within budget and where nothing failed; failing that, the lowest p99):

1. the no-batching baseline (one shared session with every core, one record per call);
2. how to split the cores: ``sessions x intra_op_threads`` (one batch in flight per session);
3. ``target_batch_tokens``: 256, 512, 1024, 2048 padded tokens per call;
4. one more batch in flight than sessions (``max_concurrent_batches``);
5. holding records for company: ``min_batch_size`` / ``batch_timeout_s``.

Every model ``batchline run`` takes can be tuned (``default``, ``PATH.onnx`` with a task,
``module:factory``): every trial loads it through ``load_model`` and batches through
``ModelBatcher``, as ``run`` and ``serve`` will with the knobs file written. For a model whose
costs add up (``cost_kind="additive"``: tensors, records), ``target_batch_tokens`` is the
batch's summed cost (records, when each costs 1) and ``max_batch_size`` caps it as well.

Core counts come from the machine (:func:`batchline.knobs.machine_cores`). On a GPU
(``device="cuda[:N]"``) the search differs, because one device runs the batches and the
CPU cores only feed it: the splits are 1 or 2 sessions of one thread each (a second session
lets one batch be assembled and copied while the other computes; more only contend for the
same device, and each holds its own copy of the weights in GPU memory), and the budgets
are larger (:data:`GPU_TOKEN_BUDGETS`, 1,024 to 8,192), since a GPU is far from full at the
256-2,048 padded tokens where a CPU peaks. This branch is untested where there is no GPU.

The winner and the baseline are then measured once more at their best load point (and so is
any setting that a confirmation promotes to winner); the verdict uses the mean throughput and
the worse p99 of the two runs, and the spread between the runs widens the noise margin.
Then :func:`decide` says one of three things: batching pays (write its knobs), batching does
not pay within noise (write the baseline's), or nothing meets the budget at these loads (write
nothing).

    >>> result = await tune(measure, points=parse_load("closed:8,32,64"), p99_budget_ms=100,
    ...                     budget_s=120)        # cores: this machine's
    >>> result.decision.message
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from batchline.bench.loadgen import LoadPoint, PointResult
from batchline.knobs import machine_cores
from batchline.models.config import Knobs

__all__ = [
    "DEFAULT_NOISE",
    "Candidate",
    "Decision",
    "Measure",
    "Trial",
    "TuneResult",
    "best_under_budget",
    "core_splits",
    "decide",
    "plan_duration",
    "tune",
    "within_budget",
]

#: Relative throughput difference treated as noise on a shared machine (FACTS: ±10-20%
#: between runs; within one run less).
DEFAULT_NOISE = 0.10

TOKEN_BUDGETS = (256, 512, 1024, 2048)
#: Budgets tried on a GPU (see the module docstring), the first batching trial at 2,048.
GPU_TOKEN_BUDGETS = (1024, 2048, 4096, 8192)
GPU_FIRST_BUDGET = 2048
#: ``(sessions, intra_op_threads)`` tried on a GPU, the first batching trial first.
GPU_SPLITS = ((2, 1), (1, 1))
# (min_batch_size, batch_timeout_s): hold records briefly while a slot is free
HOLDS = ((8, 0.002), (32, 0.01))

# Per-trial cost beyond its load points (model load, tokenizing, warm-up), and per-point
# cost beyond its duration (drain, bookkeeping), as used to plan the time budget.
_TRIAL_OVERHEAD_S = 1.5
_POINT_OVERHEAD = 1.25
_MIN_DURATION_S = 0.5
# Confirmation rounds at most (each re-measures the current winners once).
_CONFIRM_ROUNDS = 3
_MAX_DURATION_S = 10.0

Verdict = Literal["batching", "baseline", "none"]


class Measure(Protocol):
    """Runs ``knobs`` at each of ``points`` for ``duration_s`` each; one result per point."""

    def __call__(
        self, label: str, knobs: Knobs, points: Sequence[LoadPoint], duration_s: float
    ) -> Awaitable[list[PointResult]]: ...


@dataclass(frozen=True)
class Trial:
    """One setting, measured at every load point."""

    label: str
    knobs: Knobs
    points: tuple[PointResult, ...]

    @property
    def is_baseline(self) -> bool:
        return not self.knobs.batching


@dataclass(frozen=True)
class Candidate:
    """One setting at one load point."""

    label: str
    knobs: Knobs
    point: PointResult


@dataclass(frozen=True)
class Decision:
    """What the tuner concluded, in numbers and in a sentence."""

    verdict: Verdict
    p99_budget_ms: float
    noise: float
    recommended: Candidate | None
    best_batched: Candidate | None
    best_baseline: Candidate | None
    closest: Candidate | None
    message: str


@dataclass
class TuneResult:
    """The verdict, every trial as measured (confirmed points merged), the seconds per point,
    and the settings the time budget made the search skip or leave unconfirmed."""

    decision: Decision
    trials: list[Trial]
    duration_s: float
    elapsed_s: float
    skipped: list[str] = field(default_factory=list)
    unconfirmed: list[str] = field(default_factory=list)


def within_budget(point: PointResult, p99_budget_ms: float, *, margin: float = 0.0) -> bool:
    """The point answered every request and its p99, plus a relative ``margin``, is within
    the budget (``p99 * (1 + margin) <= budget``)."""
    if point.failed or math.isnan(point.p99_ms):
        return False
    return point.p99_ms * (1 + margin) <= p99_budget_ms


def best_under_budget(
    trials: Sequence[Trial],
    p99_budget_ms: float,
    *,
    baseline: bool | None = None,
    margin: float = 0.0,
) -> Candidate | None:
    """The (setting, load point) with the most records/s within budget; ties: lower p99.

    ``baseline=True``/``False`` restricts to baseline/batching trials; ``margin`` is passed to
    :func:`within_budget`.
    """
    pool = [
        Candidate(t.label, t.knobs, p)
        for t in trials
        if baseline is None or t.is_baseline == baseline
        for p in t.points
        if within_budget(p, p99_budget_ms, margin=margin)
    ]
    return max(pool, key=lambda c: (c.point.achieved_rps, -c.point.p99_ms), default=None)


def _closest(trials: Sequence[Trial]) -> Candidate | None:
    """The (setting, load point) with the lowest p99 among those that did not fail."""
    pool = [
        Candidate(t.label, t.knobs, p)
        for t in trials
        for p in t.points
        if not p.failed and not math.isnan(p.p99_ms)
    ]
    return min(pool, key=lambda c: c.point.p99_ms, default=None)


def _describe(c: Candidate) -> str:
    return (
        f"{c.point.achieved_rps:,.0f} rec/s with p99 {c.point.p99_ms:,.0f} ms "
        f"at {c.point.point.label}"
    )


def decide(
    trials: Sequence[Trial], p99_budget_ms: float, *, noise: float = DEFAULT_NOISE
) -> Decision:
    """The verdict on measured trials (pure: no timing, no I/O).

    * ``batching``: the best batching setting within budget beats the baseline's best within
      budget by more than ``noise`` (or the baseline meets the budget nowhere);
    * ``baseline``: the baseline is as good within noise, or only the baseline meets the budget:
      batching does not pay here;
    * ``none``: no setting meets the budget at any load point.

    ``noise`` is also the latency margin: on a machine where throughput moves by that much
    between runs, latency at the same load moves about as much, so a point counts as within
    budget only when ``p99 * (1 + noise)`` is.
    """
    batched = best_under_budget(trials, p99_budget_ms, baseline=False, margin=noise)
    base = best_under_budget(trials, p99_budget_ms, baseline=True, margin=noise)
    closest = _closest(trials)
    budget = f"p99 <= {p99_budget_ms:g} ms"
    margin_note = (
        f" (A point counts as within budget when its p99 plus the {noise:.0%} noise margin is.)"
        if noise > 0
        else ""
    )

    def make(verdict: Verdict, recommended: Candidate | None, message: str) -> Decision:
        return Decision(
            verdict,
            p99_budget_ms,
            noise,
            recommended,
            batched,
            base,
            closest,
            message + margin_note,
        )

    if batched is None and base is None:
        hint = (
            f" The lowest p99 measured was {closest.point.p99_ms:,.0f} ms ({closest.label} at "
            f"{closest.point.point.label})."
            if closest is not None
            else " Every load point had failed or unanswered requests."
        )
        return make(
            "none",
            None,
            f"No setting meets {budget} at these loads.{hint} Raise --p99-ms, or tune at a "
            "lower load (fewer clients, a lower rate).",
        )
    if batched is None:
        assert base is not None
        return make(
            "baseline",
            base,
            f"Batching does not pay here: no batching setting meets {budget}, and the "
            f"no-batching baseline does ({_describe(base)}). Keep batching off.",
        )
    if base is None:
        return make(
            "batching",
            batched,
            f"Recommended: {batched.label}, {_describe(batched)}. The no-batching baseline "
            f"meets {budget} at none of these loads.",
        )
    ratio = (
        batched.point.achieved_rps / base.point.achieved_rps
        if base.point.achieved_rps
        else math.inf
    )
    if ratio <= 1 + noise:
        return make(
            "baseline",
            base,
            f"Batching does not pay here: the no-batching baseline reaches {_describe(base)}; "
            f"the best batching setting ({batched.label}) {_describe(batched)}, "
            f"{ratio:.2f}x, within the {noise:.0%} noise of this machine. Keep batching off.",
        )
    return make(
        "batching",
        batched,
        f"Recommended: {batched.label}, {_describe(batched)}: {ratio:.2f}x the no-batching "
        f"baseline ({_describe(base)}).",
    )


def core_splits(cores: int) -> list[tuple[int, int]]:
    """``(sessions, intra_op_threads)`` pairs using every core: 2 -> [(1, 2), (2, 1)]."""
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    return [(s, cores // s) for s in range(1, min(cores, 8) + 1) if cores % s == 0]


def _is_gpu(device: str) -> bool:
    return device != "cpu"


def _token_budgets(device: str) -> tuple[int, ...]:
    return GPU_TOKEN_BUDGETS if _is_gpu(device) else TOKEN_BUDGETS


def search_space(cores: int, device: str = "cpu") -> tuple[list[tuple[int, int]], Knobs]:
    """The ``(sessions, threads)`` splits to try and the first batching setting (tried first:
    when the time budget allows one batching trial, it is this one)."""
    if _is_gpu(device):
        start = Knobs(
            sessions=GPU_SPLITS[0][0],
            intra_op_threads=GPU_SPLITS[0][1],
            max_concurrent_batches=GPU_SPLITS[0][0],
            target_batch_tokens=GPU_FIRST_BUDGET,
            device=device,
        )
        return list(GPU_SPLITS), start
    start = Knobs(sessions=cores, intra_op_threads=1, max_concurrent_batches=cores)
    splits = core_splits(cores)
    # the shipped defaults (one session per core) first
    ordered = sorted(splits, key=lambda st: (st != (start.sessions, start.intra_op_threads), st))
    return ordered, start


def planned_trials(cores: int, device: str = "cpu") -> int:
    """How many trials a full search runs (the baseline included)."""
    splits, _ = search_space(cores, device)
    return 1 + len(splits) + (len(_token_budgets(device)) - 1) + 1 + len(HOLDS)


def plan_duration(budget_s: float, trials: int, points: int) -> float:
    """Seconds per load point so that ``trials`` trials of ``points`` points, plus two
    confirmation points, fit in ``budget_s``; clamped to [0.5, 10]."""
    usable = 0.9 * budget_s - trials * _TRIAL_OVERHEAD_S
    per_point = usable / ((trials * points + 2) * _POINT_OVERHEAD)
    return min(_MAX_DURATION_S, max(_MIN_DURATION_S, per_point))


def _score(trial: Trial, p99_budget_ms: float, margin: float) -> tuple[float, float]:
    good = [p.achieved_rps for p in trial.points if within_budget(p, p99_budget_ms, margin=margin)]
    p99s = [p.p99_ms for p in trial.points if not p.failed and not math.isnan(p.p99_ms)]
    return (max(good) if good else -1.0, -min(p99s) if p99s else -math.inf)


def _merge(first: PointResult, again: PointResult) -> PointResult:
    """Two runs of one setting at one point: mean throughput, the worse latencies."""
    return dataclasses.replace(
        first,
        duration_s=first.duration_s + again.duration_s,
        sent=first.sent + again.sent,
        completed=first.completed + again.completed,
        errors=first.errors + again.errors,
        unanswered=first.unanswered + again.unanswered,
        achieved_rps=(first.achieved_rps + again.achieved_rps) / 2,
        p50_ms=max(first.p50_ms, again.p50_ms),
        p95_ms=max(first.p95_ms, again.p95_ms),
        p99_ms=max(first.p99_ms, again.p99_ms),
    )


def _label(knobs: Knobs) -> str:
    if not knobs.batching:
        return "baseline"
    label = (
        f"{knobs.sessions}x{knobs.intra_op_threads} tokens={knobs.target_batch_tokens} "
        f"inflight={knobs.max_concurrent_batches}"
    )
    if knobs.min_batch_size > 1:
        label += f" hold={knobs.min_batch_size}/{knobs.batch_timeout_s * 1e3:g}ms"
    return label


async def tune(
    measure: Measure,
    *,
    points: Sequence[LoadPoint],
    p99_budget_ms: float,
    budget_s: float = 120.0,
    cores: int | None = None,
    noise: float = DEFAULT_NOISE,
    duration_s: float | None = None,
    progress: Callable[[str], None] | None = None,
    now: Callable[[], float] = time.monotonic,
    base_knobs: Knobs | None = None,
    device: str = "cpu",
) -> TuneResult:
    """Search the knobs (see the module docstring) within about ``budget_s`` seconds.

    ``measure`` runs one setting; tests pass a synthetic one with a fake ``now``. The baseline
    and one batching setting always run, whatever the budget; later stages are skipped, with a
    progress message, when the time left would not cover them. ``cores`` defaults to this
    machine's (:func:`batchline.knobs.machine_cores`); ``device`` is ``cpu`` or ``cuda[:N]``.
    """
    cores = cores or machine_cores()
    if not p99_budget_ms > 0:
        raise ValueError(f"p99_budget_ms must be > 0, got {p99_budget_ms}")
    if not points:
        raise ValueError("tune needs at least one load point")
    say = progress or (lambda _text: None)
    started = now()
    deadline = started + budget_s
    total = planned_trials(cores, device)
    duration = duration_s or plan_duration(budget_s, total, len(points))
    confirm_reserve = 2 * duration * _POINT_OVERHEAD + _TRIAL_OVERHEAD_S
    trials: list[Trial] = []
    by_knobs: dict[Knobs, Trial] = {}
    skipped: list[str] = []
    spent: list[float] = []

    async def run(knobs: Knobs, *, must: bool = False) -> Trial | None:
        if knobs in by_knobs:
            return by_knobs[knobs]
        label = _label(knobs)
        expected = (sum(spent) / len(spent)) if spent else 0.0
        if not must and now() + expected > deadline - confirm_reserve:
            skipped.append(label)
            say(f"time budget: skipping {label}")
            return None
        t0 = now()
        say(f"[{len(trials) + 1}/{total}] {label} ...")
        results = await measure(label, knobs, points, duration)
        spent.append(now() - t0)
        trial = Trial(label, knobs, tuple(results))
        trials.append(trial)
        by_knobs[knobs] = trial
        rps, neg_p99 = _score(trial, p99_budget_ms, noise)
        verdict = f"best within budget {rps:,.0f} rec/s" if rps >= 0 else "no point within budget"
        p99 = f"lowest p99 {-neg_p99:,.0f} ms" if math.isfinite(neg_p99) else "all points failed"
        say(f"    {verdict}; {p99}; {max(0.0, deadline - now()):.0f} s left")
        return trial

    def best_of(candidates: Sequence[Trial | None]) -> Trial:
        pool = [t for t in candidates if t is not None]
        return max(pool, key=lambda t: _score(t, p99_budget_ms, noise))

    base_knobs = base_knobs or Knobs(device=device).baseline(cores)
    await run(base_knobs, must=True)
    ordered, start = search_space(cores, device)
    stage: list[Trial | None] = []
    for i, (sessions, threads) in enumerate(ordered):
        knobs = start.replace(
            sessions=sessions, intra_op_threads=threads, max_concurrent_batches=sessions
        )
        stage.append(await run(knobs, must=i == 0))
    best = best_of(stage)
    stage = [best]
    stage += [
        await run(best.knobs.replace(target_batch_tokens=tokens))
        for tokens in _token_budgets(device)
        if tokens != best.knobs.target_batch_tokens
    ]
    best = best_of(stage)
    stage = [best, await run(best.knobs.replace(max_concurrent_batches=best.knobs.sessions + 1))]
    best = best_of(stage)
    for min_size, timeout_s in HOLDS:
        await run(best.knobs.replace(min_batch_size=min_size, batch_timeout_s=timeout_s))

    # Confirm: measure the batching winner and the baseline's best once more at their best
    # points. A confirmation can demote the winner and promote a setting measured only once;
    # that one is confirmed in turn, so the recommendation always rests on two runs.
    observed = 0.0
    confirmed: set[tuple[Knobs, LoadPoint]] = set()
    unconfirmed: list[str] = []
    for round_ in range(_CONFIRM_ROUNDS):
        decision = decide(trials, p99_budget_ms, noise=max(noise, observed))
        todo = [
            c
            for c in (decision.best_batched, decision.best_baseline)
            if c is not None and (c.knobs, c.point.point) not in confirmed
        ]
        if not todo:
            break
        for candidate in todo:
            if round_ > 0 and now() + duration * _POINT_OVERHEAD > deadline:
                unconfirmed.append(candidate.label)
                say(f"time budget: {candidate.label} stays measured once")
                continue
            say(f"confirming {candidate.label} at {candidate.point.point.label} ...")
            (again,) = await measure(
                candidate.label, candidate.knobs, [candidate.point.point], duration
            )
            first = candidate.point
            if first.achieved_rps > 0 and again.achieved_rps > 0:
                mean = (first.achieved_rps + again.achieved_rps) / 2
                observed = max(observed, abs(first.achieved_rps - again.achieved_rps) / mean)
            say(
                f"    again: {again.achieved_rps:,.0f} rec/s, p99 {again.p99_ms:,.0f} ms "
                f"(first: {first.achieved_rps:,.0f} rec/s, p99 {first.p99_ms:,.0f} ms)"
            )
            trial = by_knobs[candidate.knobs]
            merged = tuple(_merge(p, again) if p is first else p for p in trial.points)
            updated = Trial(trial.label, trial.knobs, merged)
            trials[trials.index(trial)] = updated
            by_knobs[candidate.knobs] = updated
            confirmed.add((candidate.knobs, candidate.point.point))
        if unconfirmed:
            break
    decision = decide(trials, p99_budget_ms, noise=max(noise, observed))
    last = decision.recommended
    if (
        last is not None
        and (last.knobs, last.point.point) not in confirmed
        and last.label not in unconfirmed
    ):
        unconfirmed.append(last.label)
    return TuneResult(
        decision=decision,
        trials=trials,
        duration_s=duration,
        elapsed_s=now() - started,
        skipped=skipped,
        unconfirmed=unconfirmed,
    )


def measured_notes(
    result: TuneResult, *, points: Sequence[LoadPoint], **extra: object
) -> dict[str, object]:
    """The ``measured`` block written next to the knobs in the config file."""
    d = result.decision
    notes: dict[str, object] = {
        "verdict": d.verdict,
        "p99_budget_ms": d.p99_budget_ms,
        "loads": [str(p) for p in points],
        "seconds_per_point": round(result.duration_s, 2),
        "noise": round(d.noise, 3),
    }
    if d.recommended is not None:
        p = d.recommended.point
        notes.update(
            load=str(p.point),
            records_per_s=round(p.achieved_rps, 1),
            p50_ms=round(p.p50_ms, 1),
            p99_ms=round(p.p99_ms, 1),
            measured_twice=d.recommended.label not in result.unconfirmed,
        )
    if d.best_baseline is not None:
        notes["baseline_records_per_s"] = round(d.best_baseline.point.achieved_rps, 1)
        notes["baseline_p99_ms"] = round(d.best_baseline.point.p99_ms, 1)
        notes["baseline_load"] = str(d.best_baseline.point.point)
    notes.update(extra)
    return notes
