"""The one place a kind of text generator is chosen and built over a step engine, for
``load_text_generator`` (run, serve) and ``bench --task generate`` alike, with one name per
kind: ``sequential`` (one sequence at a time: the no-batching baseline), ``static`` (a batch
runs to its end before the next starts) and ``continuous`` (sequences join and leave the
running batch between steps)."""

from __future__ import annotations

from typing import Literal

from batchline._clock import Clock
from batchline.models.generation.continuous import ContinuousGenerator
from batchline.models.generation.engine import StepEngine
from batchline.models.generation.static import SequentialGenerator, StaticGenerator
from batchline.models.generation.stream import Detokenizer, TextGenerator

__all__ = ["GENERATOR_KINDS", "GeneratorKind", "build_generator"]

GeneratorKind = Literal["sequential", "static", "continuous"]
#: Every kind, the baseline first.
GENERATOR_KINDS: tuple[GeneratorKind, ...] = ("sequential", "static", "continuous")


def build_generator(
    kind: GeneratorKind,
    engine: StepEngine,
    detokenizer: Detokenizer,
    *,
    max_running: int,
    kv_token_budget: int,
    start_running: int | None = None,
    max_waiting: int = 1_024,
    clock: Clock | None = None,
) -> TextGenerator:
    """A generator of ``kind`` over ``engine`` (not started). ``sequential`` ignores
    ``max_running`` and ``kv_token_budget``: one sequence runs, with the whole context;
    ``start_running`` is the continuous one's (where its measured cap starts)."""
    if kind == "sequential":
        return SequentialGenerator(engine, detokenizer, max_waiting=max_waiting, clock=clock)
    if kind == "static":
        return StaticGenerator(
            engine,
            detokenizer,
            max_batch_size=max_running,
            kv_token_budget=kv_token_budget,
            max_waiting=max_waiting,
            clock=clock,
        )
    if kind == "continuous":
        return ContinuousGenerator(
            engine,
            detokenizer,
            max_running=max_running,
            start_running=start_running,
            kv_token_budget=kv_token_budget,
            max_waiting=max_waiting,
            clock=clock,
        )
    raise ValueError(f"no generator kind {kind!r}; one of {', '.join(GENERATOR_KINDS)}")
