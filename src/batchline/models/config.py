"""A deployment's settings, composed from its layers' options classes as vLLM's
``VllmConfig`` composes its parts.

:class:`Knobs` is one flat, frozen class: the core's :class:`~batchline.knobs.CoreKnobs`
(batching, device), the ONNX backend's :class:`~batchline.models.onnx.options.SessionOptions`,
and the generation backends' :class:`~batchline.models.generation.options.GenerationOptions`,
:class:`~batchline.models.generation.options.TorchEngineOptions` and
:class:`~batchline.models.generation.options.VllmOptions`. Its fields are theirs, written once
where each backend keeps them, and read flat (``knobs.max_running_sequences``,
``Knobs(sessions=2)``, a config file's keys, ``--set``); each part checks its own fields. A
backend's code types what it reads with its own options class, which :class:`Knobs` is.

The CLI builds a flag from each field (:func:`add_knob_arguments`,
:func:`add_generation_knob_arguments`; ``batchline._flags``), so no flag, help or choice list is
written twice. Standard library only: every ``--help`` imports this module.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchline._flags import add_field_flags, field_flag
from batchline.knobs import BATCHING, GENERATION, SESSIONS, TORCH, VLLM, machine_cores
from batchline.models.generation.options import GenerationBackendOptions
from batchline.models.onnx.options import SessionOptions

__all__ = [
    "BASELINE",
    "SERVE_DEFAULTS",
    "SHARED_HELP",
    "Knobs",
    "add_device_argument",
    "add_generation_knob_arguments",
    "add_knob_arguments",
    "generation_knobs_typed",
    "knob_names",
]


@dataclass(frozen=True, kw_only=True)
class Knobs(GenerationBackendOptions, SessionOptions):
    """How one model replica batches and runs: every layer's options, flat. The generation
    backend's options (both engines') before the sessions', so that the fields run core,
    sessions, generation, torch, vllm (a dataclass takes its bases' fields from the last base
    on). The concerns (``metadata["group"]``):

    - batching, and ``device``: :class:`~batchline.knobs.CoreKnobs`;
    - sessions: an embedding model's (:class:`~batchline.models.onnx.options.SessionOptions`);
    - generation (``--task generate``), both backends, then the torch engine's and vLLM's:
      ``models/generation/options.py``.

    Checking: each part's ``__post_init__`` checks the fields it declares, in that order.
    """

    @classmethod
    def serving(cls, **changes: Any) -> Knobs:
        """``batchline serve``'s preset: :data:`SERVE_DEFAULTS` (measured for request latency,
        where Knobs' own defaults were measured on datasets) updated with ``changes``. A slot
        per session unless ``max_concurrent_batches`` is given, and as many bulk slots unless
        ``bulk_slots`` is (``None``: bulk shares the slots)."""
        values = {**SERVE_DEFAULTS, **changes}
        sessions = values.get("sessions", machine_cores())
        # a bad session count is left for __post_init__ to name
        per_session = max(1, sessions) if type(sessions) is int else 1
        if values.get("max_concurrent_batches") is None:
            values["max_concurrent_batches"] = per_session
        if "bulk_slots" not in changes:
            values["bulk_slots"] = per_session
        return cls(**values)

    def for_loading(self) -> Knobs:
        """The knobs a model is loaded with: these, or :meth:`baseline` when batching is off."""
        return self if self.batching else self.baseline()

    def baseline(self, cores: int | None = None) -> Knobs:
        """The no-batching baseline of this deployment (what every published ratio is measured
        against): batching off, ONE session every caller shares, with ``cores`` intra-op
        threads (default: this machine's cores), and as many callers at once as ``cores``. The
        device, queue and generation fields are kept."""
        n = machine_cores() if cores is None else cores
        return self.replace(
            batching=False,
            sessions=1,
            intra_op_threads=n,
            max_concurrent_batches=n,
            solo_intra_op_threads=None,
        )


#: Where ``batchline serve``'s defaults differ from Knobs' (:meth:`Knobs.serving`), measured
#: with ``benchmarks/bench_serve.py`` on a 2-core CPU (c = concurrent clients; ratios to the
#: baseline's req/s and p99):
#:
#: - ``target_batch_tokens`` 256 (Knobs: 512, measured on datasets, where latency does not
#:   count). At c=32, 256: short x1.44 / x0.89, mixed x1.08 / x1.18; 512: x1.34 / x0.92,
#:   x1.04 / x1.32; 1024: x1.25 / x1.34, x1.07 / x1.35: on this CPU a sentence costs about
#:   the same at any batch size past a few, so bigger batches of long texts only add latency.
#: - ``max_batch_size`` 64 (Knobs: 256): with 256 padded tokens per call, 64 rows is already
#:   4 tokens each; more rows would only be reached by texts the budget does not bound.
#: - ``solo_intra_op_threads`` 2 (Knobs: none): a batch that starts while no other runs uses
#:   one extra two-thread session, so low traffic is as fast as the baseline's two-thread
#:   session, and concurrent batches still get a core each.
#: - ``max_queue_size`` 2,048 (Knobs: 5,000): as large as one request may be
#:   (``max_inputs_per_request``): a few seconds of short texts on 2 cores (~300/s on the
#:   shared machine); more would only delay the 429.
#: - bulk work (the Batch API's lines, at ``batch`` priority) in a lane of its own:
#:   ``bulk_slots`` one per session (set by :meth:`Knobs.serving`), so that a live request
#:   never waits for a slot that bulk holds; ``bulk_thread_nice`` 19, so that bulk takes only
#:   the CPU live requests leave; ``bulk_batch_tokens`` 512, Knobs' dataset budget. With a
#:   2,000-line embeddings batch beside 2 live clients (``benchmarks/bench_batch_api.py``):
#:   live p99 x2.09 its idle p99 in the shared slots, x1.6-1.7 in the lane (x1.31-1.46 with
#:   the batch output written as the route writes vectors); the batch alone x0.72 of ``run``'s
#:   lines/s before, x0.92-0.93 after.
SERVE_DEFAULTS: dict[str, int] = {
    "target_batch_tokens": 256,
    "max_batch_size": 64,
    "solo_intra_op_threads": 2,
    "max_queue_size": 2048,
    "bulk_thread_nice": 19,
    "bulk_batch_tokens": 512,
}

#: The no-batching baseline of the default knobs on this machine (``Knobs().baseline()``).
BASELINE = Knobs().baseline()


def knob_names(*groups: str) -> tuple[str, ...]:
    """The Knobs fields of these concerns (``batchline.knobs.BATCHING``, ``SESSIONS``, ...),
    in order."""
    return tuple(f.name for f in dataclasses.fields(Knobs) if f.metadata["group"] in groups)


#: The one help text of each option that several commands take (``run``, ``serve``, ``bench``,
#: ``tune``): a command may add a sentence after it, never change it (``tests/test_cli_flags.py``).
#: A knob's flag is its field's help (``batchline._flags``), so it is not written here.
SHARED_HELP: dict[str, str] = {
    "--config": "a settings file, TOML or JSON with flat keys, e.g. the knobs 'batchline tune' "
    "writes; a name it does not know is refused with the closest valid one",
    "--set": "one setting, as a --config file names it (repeatable; values are JSON, e.g. "
    "--set max_batch_size=8 --set mix_priorities=true); wins over --config, flags win over it",
    "--quiet": "print nothing on success: no progress, no summary (errors still print)",
    "--no-dedupe": "compute every record, even one whose input repeats one of the last 16,384 "
    "distinct inputs (default: such a record takes that input's result, and the summary "
    "counts it)",
    **{
        option: str(action.help)
        for action in add_field_flags(argparse.ArgumentParser(add_help=False), Knobs)
        for option in action.option_strings
    },
}


def generation_knobs_typed(args: argparse.Namespace, settings: Iterable[str]) -> list[str]:
    """The generation knobs (both backends', the torch engine's, vLLM's) a command line typed,
    as it typed them: the flag of each given as its flag (argparse's ``None``: not given), then
    ``--set NAME`` for each of ``settings`` (the names its ``--set``s gave) that is one. A
    command where nothing generates refuses them: they would change nothing."""
    names = knob_names(GENERATION, TORCH, VLLM)
    flags = [field_flag(Knobs, name) for name in names if getattr(args, name, None) is not None]
    return flags + [f"--set {name}" for name in settings if name in names]


def add_device_argument(p: argparse._ActionsContainer, *, default: str | None = None) -> None:
    """``--device`` (``run``, ``serve``, ``bench``, ``tune``); ``default``: the command's."""
    add_field_flags(p, Knobs, ["device"], defaults={"device": default})


def add_knob_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that set :class:`Knobs` (``run`` and ``serve``): a settings file, ``--set``,
    and a flag for each batching and session knob, built from its field (``sessions`` also
    sets one batch in flight per session, as ``Knobs.serving`` does). The generation knobs'
    flags: :func:`add_generation_knob_arguments`."""
    p.add_argument("--config", type=Path, metavar="FILE", help=SHARED_HELP["--config"])
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help=SHARED_HELP["--set"]
    )
    add_field_flags(p, Knobs, knob_names(BATCHING, SESSIONS))


def add_generation_knob_arguments(
    g: argparse._ActionsContainer,
    names: Iterable[str] | None = None,
    *,
    more: Mapping[str, str] | None = None,
) -> None:
    """A flag for each text-generation knob (both backends, the torch engine's, vLLM's), or
    for ``names`` of them; ``more``: a sentence a command adds after a flag's help."""
    add_field_flags(g, Knobs, names or knob_names(GENERATION, TORCH, VLLM), more=more)
