"""The batching knobs of a model deployment, and the config file that carries them.

``batchline tune`` writes this file; ``batchline run --config F`` and
``batchline serve --config F`` read it. JSON (``.json``) or TOML (``.toml``), flat keys::

    {"batching": true, "target_batch_tokens": 512, "max_concurrent_batches": 2,
     "sessions": 2, "intra_op_threads": 1}

Text generation (``--task generate``) reads its own fields besides ``device``,
``intra_op_threads`` and ``max_queue_size``: see :class:`Knobs`.

Defaults come from measurements on a 2-core CPU with all-MiniLM-L6-v2 (docs/CONTRACTS.md,
FACTS): two sessions of one intra-op thread each, one batch in flight per session, about
512 padded tokens per call. ``batching=false`` is the single-shared-session baseline: one
session using every core, each record run on its own, two callers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from batchline._config_file import (
    NOTE_KEYS,
    check_setting_names,
    parse_set_options,
    read_config_file,
    to_toml,
)
from batchline._errors import InputError
from batchline._flags import (
    add_deprecated_flag,
    add_field_flags,
    field_choices,
)
from batchline._fsio import replacing
from batchline._knob_checks import check_knob, check_policy_knobs
from batchline._policy import POLICY_FIELDS, BatchPolicy

__all__ = [
    "BASELINE",
    "DEFAULT_BUCKET_WIDTH",
    "DEFAULT_PADDING_SLACK",
    "DEFAULT_TARGET_BATCH_TOKENS",
    "GENERATION_BACKENDS",
    "GENERATION_BATCHING",
    "GENERATION_DTYPES",
    "NOTE_KEYS",
    "PRECISIONS",
    "SERVE_DEFAULTS",
    "SHARED_HELP",
    "WEIGHT_FORMATS",
    "Knobs",
    "add_deprecated_flag",
    "add_device_argument",
    "add_generation_knob_arguments",
    "add_knob_arguments",
    "check_setting_names",
    "knob_names",
    "machine_cores",
    "parse_set_options",
    "read_config_file",
    "to_toml",
]

# Padded tokens per model call. MiniLM-L6 on ONNX Runtime (2 sessions x 1 thread) peaks at
# about 256-1,024 padded tokens per call and falls beyond ~2k; benchmarks/bench_embeddings.py
# measures 256/512/1024 and this is the best of them on a mixed-length corpus.
DEFAULT_TARGET_BATCH_TOKENS = 512

# Length grouping for the TokenBatcher. A batch may take a text that adds at most this many
# padded tokens (about what one more model call costs on MiniLM); the core's default (16)
# let short-text batches carry ~18% padding and cost ~15% throughput in
# benchmarks/bench_embeddings.py, 4 brought padding under 5%.
DEFAULT_PADDING_SLACK = 4
DEFAULT_BUCKET_WIDTH = 2


#: The few names some knobs take, each list written once: the field's annotation, which the
#: check in ``Knobs.__post_init__`` and the CLI's ``--flag {choices}`` read (``batchline._flags``).
#: How a text generator batches sequences (``Knobs.generation_batching``).
GenerationBatching = Literal["continuous", "static"]
#: What runs a generative model (``Knobs.generation_backend``): vLLM runs on CUDA and on CPU.
GenerationBackend = Literal["torch", "vllm"]
#: What a generative model computes in (``Knobs.dtype``), on either backend; ``auto``: bf16
#: where the device computes it natively, float32 elsewhere (``generation/torch_dtype.py``).
GenerationDtype = Literal["auto", "float32", "bfloat16"]
#: What an embedding model computes in (``Knobs.precision``; ``models/precision.py``).
Precision = Literal["auto", "fp32", "bf16", "int8"]
#: How the torch backend holds a generative model's linears (``Knobs.weights``;
#: ``generation/quant_linear.py``).
WeightFormat = Literal["auto", "float", "int8", "int4"]
#: How vLLM's engine orders waiting requests (``Knobs.vllm_scheduling_policy``).
VllmSchedulingPolicy = Literal["fcfs", "priority"]

GENERATION_BATCHING: tuple[str, ...] = get_args(GenerationBatching)
GENERATION_BACKENDS: tuple[str, ...] = get_args(GenerationBackend)
GENERATION_DTYPES: tuple[str, ...] = get_args(GenerationDtype)
PRECISIONS: tuple[str, ...] = get_args(Precision)
WEIGHT_FORMATS: tuple[str, ...] = get_args(WeightFormat)
VLLM_SCHEDULING_POLICIES: tuple[str, ...] = get_args(VllmSchedulingPolicy)


#: The batcher's own defaults, which the knobs of the same names take (``batchline._policy``).
_POLICY = BatchPolicy()

#: The concerns the knobs fall in (``metadata["group"]``): the CLI adds each group's flags
#: where its command wants them (:func:`knob_names`).
BATCHING, SESSIONS, GENERATION, TORCH, VLLM = "batching", "sessions", "generation", "torch", "vllm"


def _knob(help: str, group: str, **more: str) -> dict[str, str]:
    """A Knobs field's metadata: its help and its concern, written once beside its default;
    the CLI builds the field's flag from them (``batchline._flags``)."""
    return {"help": help, "group": group, **more}


def machine_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class Knobs:
    """How one model replica batches and runs. See the module docstring for the file format.

    Each field's meaning is its ``help`` (``metadata``), which is also its flag's help:
    ``batchline run --help`` lists them by concern. The concerns (``metadata["group"]``):

    - batching: how records become batches, i.e. the :class:`~batchline.BatchPolicy` a batcher
      gets (:meth:`policy`); ``mix_priorities`` and ``priority_yield`` are the batcher's (see
      ``batchline._queue``): on a GPU, where a fuller batch costs little more,
      ``mix_priorities=True`` and ``priority_yield=1.0`` keep batches full;
    - sessions: an embedding model's sessions (``sessions`` of ``intra_op_threads`` threads
      each, defaulting to one per core of this machine), on ``device`` (``cuda[:N]``: ONNX
      Runtime's CUDA execution provider, which needs the ``onnxruntime-gpu`` build), in
      ``precision`` (``auto`` is resolved by ``run``, ``serve``, ``bench`` and ``tune`` by
      measuring once per model and CPU kind past a quality gate, ``jobs/precision.py``; the
      loader itself, given ``auto``, loads fp32). ``quantize = "int8"`` is the older spelling
      of ``precision = "int8"``;
    - generation (``--task generate``), both backends: at most ``max_running_sequences`` run
      at once, and the sum of their prompt + ``max_tokens`` stays within ``kv_token_budget``
      KV-cache positions; ``max_queue_size`` requests may wait for admission;
      ``batching=False`` runs one sequence at a time (the baseline);
    - torch: batchline's own decode loop (``generation/load.py``; the measured running cap:
      ``generation/admission.py``; ``engine_process``: ``generation/engine_process.py``);
    - vllm: vLLM's engine (``generation/vllm_generator.py``).
    """

    # -- batching: how records become batches (the BatchPolicy a batcher gets: policy()) ----
    batching: bool = field(
        default=True,
        metadata=_knob(
            "batch records; false: the no-batching baseline",
            BATCHING,
            off="the baseline to compare against: one shared session, one record per call (a text "
            "generator: one sequence at a time)",
        ),
    )
    target_batch_tokens: int = field(
        default=DEFAULT_TARGET_BATCH_TOKENS,
        metadata=_knob("padded tokens per model call", BATCHING),
    )
    max_batch_size: int = field(
        default=_POLICY.max_batch_size, metadata=_knob("records per model call, at most", BATCHING)
    )
    max_concurrent_batches: int = field(
        default_factory=machine_cores,
        metadata=_knob("batches in flight at once (default: one per session)", BATCHING),
    )
    min_batch_size: int = field(
        default=_POLICY.min_batch_size,
        metadata=_knob(
            "while a slot is free, hold records until this many are queued (1: never hold)",
            BATCHING,
        ),
    )
    batch_timeout_s: float = field(
        default=_POLICY.batch_timeout_s,
        metadata=_knob(
            "hold records for --min-batch-size at most this many seconds",
            BATCHING,
        ),
    )
    max_queue_size: int = field(
        default=_POLICY.max_queue_size,
        metadata=_knob(
            "records queued per model, at most; beyond, run waits and serve answers 429",
            BATCHING,
        ),
    )
    mix_priorities: bool = field(
        default=_POLICY.mix_priorities,
        metadata=_knob(
            "let a batch take records of lower priority than its first (on a GPU, where a fuller "
            "batch costs little more)",
            BATCHING,
        ),
    )
    priority_yield: float = field(
        default=_POLICY.priority_yield,
        metadata=_knob(
            "while higher priorities arrive, a batch takes at most this fraction of its budget, "
            "in (0, 1] (1: off)",
            BATCHING,
        ),
    )
    bulk_slots: int | None = field(
        default=_POLICY.bulk_slots,
        metadata=_knob(
            "slots of their own for bulk work, the Batch API's lines (unset: bulk shares them)",
            BATCHING,
        ),
    )
    bulk_thread_nice: int = field(
        default=_POLICY.bulk_thread_nice,
        metadata=_knob("bulk batches' worker threads run at nice +N (0-19)", BATCHING),
    )
    bulk_batch_tokens: int | None = field(
        default=None,
        metadata=_knob(
            "bulk batches' own padded-token budget (unset: --target-batch-tokens)", BATCHING
        ),
    )
    # -- an embedding model's sessions (ONNX Runtime, or torch for bf16) -------------------
    sessions: int = field(
        default_factory=machine_cores,
        metadata=_knob("model sessions, each running one batch at a time", SESSIONS),
    )
    # One thread per session or torch generation engine: on a busy core a second thread only
    # waits (benchmarks/engine_levers.md, step-level A/B).
    intra_op_threads: int = field(default=1, metadata=_knob("threads per session", SESSIONS))
    solo_intra_op_threads: int | None = field(
        default=None,
        metadata=_knob(
            "threads of one extra, wider session a batch may use while no other runs, so low "
            "traffic gets the baseline's single-call latency (unset: none)",
            SESSIONS,
        ),
    )
    device: str = field(
        default="cpu",
        metadata=_knob(
            "cpu (default) or cuda[:N]: where the model runs",
            SESSIONS,
            metavar="DEVICE",
        ),
    )
    # An embedding model's graph in int8 (ONNX Runtime's dynamic quantization), used only when
    # it passes the quality gate against its float32 graph (models/onnx/quantize.py).
    quantize: Literal["int8"] | None = field(
        default=None,
        metadata=_knob(
            "int8: an embedding model's graph in int8 (ONNX Runtime's dynamic quantization), "
            "refused unless its vectors pass the quality gate against float32 on the demo corpus",
            SESSIONS,
        ),
    )
    precision: Precision = field(
        default="auto",
        metadata=_knob(
            "what an embedding model computes in: auto (measured once per model and CPU kind, past "
            "a quality gate), fp32 or int8 (ONNX Runtime), bf16 (torch, oneDNN); classifiers and "
            "rerankers stay fp32",
            SESSIONS,
        ),
    )
    # -- text generation (--task generate): both backends ---------------------------------
    generation_batching: GenerationBatching = field(
        default="continuous",
        metadata=_knob(
            "continuous (default): sequences join and leave between steps; static: a batch runs "
            "until its last sequence ends (--no-batching: one at a time)",
            GENERATION,
        ),
    )
    # Rows beyond 16 pay on this project's CPU (SmolLM2, bf16: 690, 901, 1,037 tokens/s at
    # 16, 32, 64 rows) until a row costs nearly an average one; the continuous scheduler's
    # measured cap finds where, starting at 16 (generation/admission.py).
    max_running_sequences: int = field(
        default=64,
        metadata=_knob("sequences generated at once, at most (a static batch's size)", GENERATION),
    )
    start_running_sequences: int = field(
        default=16,
        metadata=_knob(
            "continuous batching on the torch backend: the running cap starts at N (16) and, while "
            "prompts wait, rises towards --max-running-sequences as long as one more row's "
            "measured cost in a decode step is at most 0.8 of an average row's; N >= "
            "--max-running-sequences: a fixed cap",
            GENERATION,
        ),
    )
    kv_token_budget: int = field(
        default=16_384,
        metadata=_knob(
            "KV-cache positions (prompt + max_tokens of the running sequences), at most",
            GENERATION,
        ),
    )
    generation_backend: GenerationBackend = field(
        default="torch",
        metadata=_knob(
            "what runs a text generator: torch (default) or vllm (vLLM's engine, its CPU or CUDA "
            "build as --device says)",
            GENERATION,
        ),
    )
    dtype: GenerationDtype = field(
        default="auto",
        metadata=_knob(
            "what a text generator computes in: auto (default: bfloat16 on a CPU with native bf16 "
            "or a CUDA device with it, else float32), float32 (greedy equals transformers' "
            "generate) or bfloat16",
            GENERATION,
        ),
    )
    # -- the torch backend's engine ---------------------------------------------------------
    generation_threads: int | None = field(
        default=None,
        metadata=_knob(
            "the torch backend's CPU threads (unset: every core in float32, one in bfloat16)",
            TORCH,
        ),
    )
    weights: WeightFormat = field(
        default="auto",
        metadata=_knob(
            "how the torch backend holds the linears: auto (a GGUF file's Q4_0/Q4_1/Q8_0 tensors "
            "kept quantized where the CPU computes bf16 natively, a folder's as they are), float "
            "(in --dtype; a GGUF dequantized), int8 or int4 (weight-only, quantized at load)",
            TORCH,
        ),
    )
    # Chunked prefill's per-step budget: chunking keeps tokens/s and cuts TTFT p99 (~21 s
    # unchunked, 5-9 s chunked); 512, not 1024: a step of 512 prompt tokens already stalls the
    # running rows ~1 s on a 2-core CPU (benchmarks/engine_levers.md, workload A/B).
    max_step_tokens: int = field(
        default=512,
        metadata=_knob(
            "tokens one decode step takes at most, decodes first, longer prompts prefilled in "
            "chunks (512)",
            TORCH,
        ),
    )
    # Off until benchmarks/bench_vs_vllm.py (batchline-torch-proc) says it pays.
    engine_process: bool = field(
        default=False,
        metadata=_knob(
            "run the torch backend's continuous batching (engine and scheduler) in a process of "
            "its own, so it never waits for the GIL behind the server's front end; the tokenizer "
            "and streams stay here (not with vllm, static batching or --no-batching)",
            TORCH,
        ),
    )
    # -- vLLM's engine ----------------------------------------------------------------------
    max_context_tokens: int | None = field(
        default=None,
        metadata=_knob(
            "vLLM: prompt + completion of one sequence, at most (unset: 2,048 on CPU, the "
            "model's own on CUDA)",
            VLLM,
        ),
    )
    kv_cache_gib: float | None = field(
        default=None,
        metadata=_knob(
            "vLLM: the KV cache's size in GiB (unset: 1 on CPU; on CUDA what "
            "--gpu-memory-fraction leaves)",
            VLLM,
        ),
    )
    gpu_memory_fraction: float | None = field(
        default=None,
        metadata=_knob(
            "vLLM: the share of the device's memory it may take, in (0, 1] (unset: 0.3 on CPU, "
            "where vLLM counts it against RAM; vLLM's own on CUDA)",
            VLLM,
        ),
    )
    eager: bool | None = field(
        default=None,
        metadata=_knob(
            "vLLM: run the model eagerly, no graph capture or compilation (unset: eager on CPU, "
            "where compiling adds ~60 s to every start; compiled on CUDA)",
            VLLM,
        ),
    )
    vllm_scheduling_policy: VllmSchedulingPolicy = field(
        default="fcfs",
        metadata=_knob(
            "vLLM: fcfs (its default: requests join in arrival order, their priority unused) or "
            "priority (joins ordered by each request's aged priority, as the torch backend "
            "always does)",
            VLLM,
        ),
    )

    def __post_init__(self) -> None:
        if self.quantize == "int8" and self.precision != "int8":
            if self.precision != "auto":
                raise InputError(
                    f"quantize=int8 and precision={self.precision} disagree; "
                    "set precision alone (fp32, bf16 or int8)"
                )
            object.__setattr__(self, "precision", "int8")  # one name from here on
        for f in dataclasses.fields(self):
            if f.name not in _POLICY_KNOBS:
                check_knob(f.name, getattr(self, f.name), _CHOICES.get(f.name))
        check_policy_knobs({name: getattr(self, name) for name in _POLICY_KNOBS})

    @property
    def providers(self) -> list[str | tuple[str, dict[str, str]]]:
        """ONNX Runtime execution providers for :attr:`device` (never a silent CPU fall-back:
        ``OnnxModel.load`` refuses a provider that is missing or fails to start)."""
        if self.device == "cpu":
            return ["CPUExecutionProvider"]
        _, _, index = self.device.partition(":")
        return [("CUDAExecutionProvider", {"device_id": index or "0"})]

    @property
    def is_gpu(self) -> bool:
        return self.device != "cpu"

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Knobs:
        """Read a JSON or TOML config file; unknown keys are an error (a typo must not pass)."""
        p = Path(path)
        data = read_config_file(p)
        check_setting_names(data, (f.name for f in dataclasses.fields(cls)), where=str(p))
        return cls(**data)

    def dump(self, path: str | os.PathLike[str], **notes: object) -> Path:
        """Write the knobs, plus free-form ``notes`` (e.g. what was measured), as TOML for a
        ``.toml`` path and JSON otherwise; :meth:`load` and ``serve --config`` read either."""
        p = Path(path)
        data: dict[str, object] = {
            k: v for k, v in dataclasses.asdict(self).items() if v is not None
        }
        data.update(notes)
        text = to_toml(data) if p.suffix.lower() == ".toml" else json.dumps(data, indent=2) + "\n"
        with replacing(p, "config.knobs") as f:  # whole or not at all
            f.write(text.encode("utf-8"))
        return p

    def replace(self, **changes: Any) -> Knobs:
        return dataclasses.replace(self, **changes)

    def policy(self, **changes: Any) -> BatchPolicy:
        """The :class:`~batchline.BatchPolicy` these knobs give a batcher: every field the two
        share by name, ``target_batch_tokens`` and ``bulk_batch_tokens`` as the budgets
        (``target_batch_cost``, ``bulk_batch_cost``), then ``changes`` (a model's own units,
        the length grouping). ``min_batch_size`` is capped at ``max_batch_size``."""
        values: dict[str, Any] = {name: getattr(self, name) for name in _POLICY_KNOBS}
        values.update(
            target_batch_cost=self.target_batch_tokens,
            bulk_batch_cost=self.bulk_batch_tokens,
            min_batch_size=min(self.min_batch_size, self.max_batch_size),
        )
        values.update(changes)
        return BatchPolicy(**values)

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


#: Knobs fields that take one of a few names: their Literal annotation's.
_CHOICES: dict[str, tuple[Any, ...]] = {
    f.name: choices
    for f in dataclasses.fields(Knobs)
    if (choices := field_choices(Knobs, f.name)) is not None
}

#: The Knobs fields that are BatchPolicy fields of the same name and meaning.
_POLICY_KNOBS = tuple(f.name for f in dataclasses.fields(Knobs) if f.name in POLICY_FIELDS)

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
    """The Knobs fields of these concerns (:data:`BATCHING`, :data:`SESSIONS`, ...), in order."""
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
