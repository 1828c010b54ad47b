"""What a ``batchline run`` job did: the summary its CLI prints as a table."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from batchline._stats import BatchStats, percentile

if TYPE_CHECKING:
    from batchline.datasets.pipeline import PipelineRun

__all__ = ["GenerateSummary", "RunSummary", "summarize"]


@dataclass(frozen=True)
class RunSummary:
    """What a run did; ``records`` counts only this run's records, not resumed ones."""

    output: Path
    batching: bool
    records: int
    skipped: int
    already_done: int
    total_records: int
    wall_s: float
    utilization: float
    avg_batch_size: float
    avg_batch_cost: float
    padding_waste: float
    latency_p50_s: float
    latency_p99_s: float
    #: whether batches were costed in padded tokens (text models); else in the model's units
    padded: bool = True
    #: blank lines of the input, skipped (an OpenAI batch file's; 0 for other inputs)
    blank_lines: int = 0
    #: records of empty or blank text (run as they are, or skipped with --on-bad-record skip)
    empty_texts: int = 0
    #: records answered from an identical input's computation, not computed again
    duplicates: int = 0
    #: records whose result an earlier run computed (``--cache``)
    cached: int = 0
    #: the model's quantization and its measured closeness to float32 (``--quantize``)
    quantized: str = ""
    #: what the model computes in and why (``Knobs.precision``: asked for, or chosen by measuring)
    precision: str = ""
    #: an image job's time: the decode workers', the model's, and the model's idle time
    time_split: str = ""

    @property
    def records_per_s(self) -> float:
        return self.records / self.wall_s if self.wall_s > 0 else 0.0

    def rows(self) -> list[tuple[str, str]]:
        """The summary as (label, value) rows, for a table."""
        mode = "batching" if self.batching else "no batching (one shared session)"
        return [
            *self._head(mode),
            ("records/s", f"{self.records_per_s:,.1f}"),
            ("utilization", f"{self.utilization:.0%}"),
            ("avg batch size", f"{self.avg_batch_size:.1f}"),
            *(
                [
                    ("avg batch cost (padded tokens)", f"{self.avg_batch_cost:.0f}"),
                    ("padding waste", f"{self.padding_waste:.1%}"),
                ]
                if self.padded
                else [("avg batch cost (model's units)", f"{self.avg_batch_cost:.0f}")]
            ),
            ("latency p50 / p99", f"{_ms(self.latency_p50_s)} / {_ms(self.latency_p99_s)}"),
            *([("time split", self.time_split)] if self.time_split else []),
        ]

    def _head(self, mode: str) -> list[tuple[str, str]]:
        """The rows every run's summary starts with."""
        return [
            ("output", str(self.output)),
            ("mode", mode),
            *([("precision", self.precision)] if self.precision else []),
            *([("quantized", self.quantized)] if self.quantized else []),
            ("records (this run)", f"{self.records:,}"),
            ("skipped", f"{self.skipped:,}"),
            *([("empty texts", f"{self.empty_texts:,}")] if self.empty_texts else []),
            ("resumed (already done)", f"{self.already_done:,}"),
            *([("duplicates (computed once)", f"{self.duplicates:,}")] if self.duplicates else []),
            *([("from the cache (earlier runs)", f"{self.cached:,}")] if self.cached else []),
            *([("blank lines (skipped)", f"{self.blank_lines:,}")] if self.blank_lines else []),
            ("wall time", f"{self.wall_s:.1f} s"),
        ]


def _ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1e3:,.1f} ms"


@dataclass(frozen=True)
class GenerateSummary(RunSummary):
    """What a generation job did (this run's records only); latencies are per request, from
    ``submit`` (time in the waiting queue included)."""

    generation_batching: str = "continuous"
    dtype: str = ""
    #: how the linears are held (``gguf, int8 activations``; ``float, dense linears in the own
    #: bf16 tiles``): the load log says why
    weights: str = ""
    generated_tokens: int = 0
    prompt_tokens: int = 0
    ttft_p50_s: float = math.nan
    ttft_p99_s: float = math.nan
    itl_p50_s: float = math.nan
    itl_p99_s: float = math.nan
    max_running: int = 0
    #: the continuous scheduler's cap at the end, where the measured cost of a row moved it
    running_cap: int = 0
    running_peak: int = 0
    waiting_peak: int = 0
    in_flight_limit: int = 0
    avg_running_per_step: float = 0.0
    kv_token_budget: int = 0
    kv_reserved_peak: int = 0
    aborted: int = 0
    preempted: int = 0
    failed: int = 0
    #: whether prompts were submitted grouped by shared prefix (``--no-prefix-ordering``: not)
    prefix_ordering: bool = False
    #: the engine's prompt-prefix cache: capacity in positions (0: none), prompts that hit it,
    #: prompt tokens it saved from prefill
    prefix_cache_tokens: int = 0
    prefix_cache_hits: int = 0
    prefix_tokens_reused: int = 0
    #: prompt tokens the engine prefilled, and prompts it did not because an identical one
    #: joined the same step (a line's n samples)
    prompt_tokens_computed: int = 0
    prompts_shared: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def rows(self) -> list[tuple[str, str]]:
        budget = (
            f"{self.kv_reserved_peak:,} / {self.kv_token_budget:,} "
            f"({self.kv_reserved_peak / self.kv_token_budget:.0%})"
            if self.kv_token_budget
            else "n/a"
        )
        return [
            *self._head(_MODES.get(self.generation_batching, self.generation_batching)),
            *([("dtype", self.dtype)] if self.dtype else []),
            *([("weights", self.weights)] if self.weights else []),
            ("tokens generated", f"{self.generated_tokens:,}"),
            ("tokens/s", f"{self.tokens_per_s:,.1f}"),
            ("records/s", f"{self.records_per_s:,.2f}"),
            ("TTFT p50 / p99", f"{_ms(self.ttft_p50_s)} / {_ms(self.ttft_p99_s)}"),
            ("inter-token p50 / p99", f"{_ms(self.itl_p50_s)} / {_ms(self.itl_p99_s)}"),
            ("end-to-end p50 / p99", f"{_ms(self.latency_p50_s)} / {_ms(self.latency_p99_s)}"),
            ("running peak (sampled) / cap", self._running()),
            ("avg running per step", f"{self.avg_running_per_step:.1f}"),
            ("waiting peak (in-flight cap)", f"{self.waiting_peak} ({self.in_flight_limit})"),
            ("KV reserved peak / budget", budget),
            (
                "aborted / preempted / failed",
                f"{self.aborted} / {self.preempted} / {self.failed}",
            ),
            *self._prefix_rows(),
        ]

    def _running(self) -> str:
        shown = f"{self.running_peak} / {self.max_running}"
        if self.running_cap and self.running_cap != self.max_running:
            shown += f" (measured cap at the end: {self.running_cap})"
        return shown

    def _prefix_rows(self) -> list[tuple[str, str]]:
        if not self.prefix_cache_tokens:
            return []
        share = self.prefix_tokens_reused / self.prompt_tokens if self.prompt_tokens else 0.0
        ordered = "grouped by shared prefix" if self.prefix_ordering else "in input order"
        return [
            ("prompts submitted", ordered),
            (
                "prefix cache: hits / reused tokens",
                f"{self.prefix_cache_hits:,} prompts / {self.prefix_tokens_reused:,} "
                f"({share:.0%} of prompt tokens; holds {self.prefix_cache_tokens:,} positions)",
            ),
            (
                "prompt tokens computed",
                f"{self.prompt_tokens_computed:,} of {self.prompt_tokens:,}"
                + (
                    f" ({self.prompts_shared:,} identical prompts shared a prefill)"
                    if self.prompts_shared
                    else ""
                ),
            ),
        ]


_MODES = {
    "continuous": "continuous batching",
    "static": "static batching",
    "sequential": "no batching (one sequence at a time)",
    "vllm": "vLLM",
}


def summarize(
    output: Path,
    batching: bool,
    done: PipelineRun,
    stats: BatchStats | None,
    *,
    padded: bool = True,
) -> RunSummary:
    """A :class:`RunSummary` of one run of the pipeline and the batcher's stats."""
    return RunSummary(
        padded=padded,
        output=output,
        batching=batching,
        **done.counts(),
        utilization=stats.utilization if stats is not None else 0.0,
        avg_batch_size=stats.avg_batch_size if stats is not None else 0.0,
        avg_batch_cost=stats.avg_batch_cost if stats is not None else 0.0,
        padding_waste=stats.padding_waste if stats is not None else 0.0,
        latency_p50_s=percentile(done.latencies_s, 50),
        latency_p99_s=percentile(done.latencies_s, 99),
    )
