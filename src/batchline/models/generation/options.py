"""The generation backends' options: what both backends read (:class:`GenerationOptions`),
the torch engine's (:class:`TorchEngineOptions`) and vLLM's (:class:`VllmOptions`).

Each is the deployment's core (:class:`~batchline.knobs.CoreKnobs`: batching, device) plus its
own concern; the deployment's flat class (``batchline.models.config.Knobs``) composes them with
the other backends' options. A new generation setting is one field on the class of its backend
(``metadata=knob(help, GROUP)``; a ``Literal`` if it takes names; a rule in that class's rules if
it is not a plain number >= 1). Standard library only: every ``--help`` reads these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from batchline._knob_checks import Rules, check_own_fields, integer, is_number
from batchline.knobs import GENERATION, TORCH, VLLM, CoreKnobs, knob

__all__ = [
    "ACTIVATION_FORMATS",
    "GENERATION_BACKENDS",
    "GENERATION_BATCHING",
    "GENERATION_DTYPES",
    "VLLM_SCHEDULING_POLICIES",
    "WEIGHT_FORMATS",
    "ActivationFormat",
    "GenerationBackend",
    "GenerationBackendOptions",
    "GenerationBatching",
    "GenerationDtype",
    "GenerationOptions",
    "TorchEngineOptions",
    "VllmOptions",
    "VllmSchedulingPolicy",
    "WeightFormat",
]

#: The few names some options take, each list written once: the field's annotation, which the
#: check in ``__post_init__`` and the CLI's ``--flag {choices}`` read (``batchline._flags``).
#: How a text generator batches sequences (``generation_batching``).
GenerationBatching = Literal["continuous", "static"]
#: What runs a generative model (``generation_backend``): vLLM runs on CUDA and on CPU.
GenerationBackend = Literal["torch", "vllm"]
#: What a generative model computes in (``dtype``), on either backend; ``auto``: bf16 where the
#: device computes it natively, float32 elsewhere (``generation/torch_dtype.py``).
GenerationDtype = Literal["auto", "float32", "bfloat16"]
#: How the torch backend holds a generative model's linears (``weights``;
#: ``generation/quant_linear.py``).
WeightFormat = Literal["auto", "float", "int8", "int4"]
#: What the own int4 kernel sums a model's rows as (``activations``: every float32 row, a bf16
#: model's few; ``generation/csrc/quant_gemm_a8.cpp``).
ActivationFormat = Literal["auto", "float", "int8"]
#: What computes a bf16 model's dense linears on CPU (``dense_linears``;
#: ``generation/dense_tiles.py``).
DenseLinears = Literal["auto", "onednn", "tiles"]
#: How vLLM's engine orders waiting requests (``vllm_scheduling_policy``).
VllmSchedulingPolicy = Literal["fcfs", "priority"]

GENERATION_BATCHING: tuple[str, ...] = get_args(GenerationBatching)
GENERATION_BACKENDS: tuple[str, ...] = get_args(GenerationBackend)
GENERATION_DTYPES: tuple[str, ...] = get_args(GenerationDtype)
WEIGHT_FORMATS: tuple[str, ...] = get_args(WeightFormat)
ACTIVATION_FORMATS: tuple[str, ...] = get_args(ActivationFormat)
VLLM_SCHEDULING_POLICIES: tuple[str, ...] = get_args(VllmSchedulingPolicy)

_GENERATION_RULES: Rules = {
    "kv_token_budget": (integer(2), "an integer >= 2"),
    "max_running_sequences": (integer(1), "an integer >= 1"),
    "start_running_sequences": (integer(1), "an integer >= 1"),
}
_TORCH_RULES: Rules = {
    "engine_process": (lambda v: isinstance(v, bool), "true or false"),
    "generation_threads": (lambda v: v is None or integer(1)(v), "an integer >= 1 or unset"),
    "huge_pages": (lambda v: isinstance(v, bool), "true or false"),
}
_VLLM_RULES: Rules = {
    "eager": (lambda v: v is None or isinstance(v, bool), "true, false or unset"),
    "gpu_memory_fraction": (lambda v: v is None or (is_number(v) and 0 < v <= 1), "in (0, 1]"),
    "kv_cache_gib": (lambda v: v is None or (is_number(v) and v > 0), "a number > 0"),
    "max_context_tokens": (lambda v: v is None or integer(2)(v), "an integer >= 2"),
}


@dataclass(frozen=True, kw_only=True)
class GenerationOptions(CoreKnobs):
    """Text generation (``--task generate``) on either backend: at most
    ``max_running_sequences`` run at once, and the sum of their prompt + ``max_tokens`` stays
    within ``kv_token_budget`` KV-cache positions; ``max_queue_size`` requests may wait for
    admission; ``batching=False`` runs one sequence at a time (the baseline)."""

    generation_batching: GenerationBatching = field(
        default="continuous",
        metadata=knob(
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
        metadata=knob("sequences generated at once, at most (a static batch's size)", GENERATION),
    )
    start_running_sequences: int = field(
        default=16,
        metadata=knob(
            "continuous batching on the torch backend: the running cap starts at N (16) and, while "
            "prompts wait, rises towards --max-running-sequences as long as one more row's "
            "measured cost in a decode step is at most 0.8 of an average row's; N >= "
            "--max-running-sequences: a fixed cap",
            GENERATION,
        ),
    )
    kv_token_budget: int = field(
        default=16_384,
        metadata=knob(
            "KV-cache positions (prompt + max_tokens of the running sequences), at most",
            GENERATION,
        ),
    )
    generation_backend: GenerationBackend = field(
        default="torch",
        metadata=knob(
            "what runs a text generator: torch (default) or vllm (vLLM's engine, its CPU or CUDA "
            "build as --device says)",
            GENERATION,
        ),
    )
    dtype: GenerationDtype = field(
        default="auto",
        metadata=knob(
            "what a text generator computes in: auto (default: bfloat16 on a CPU with native bf16 "
            "or a CUDA device with it, else float32), float32 (greedy equals transformers' "
            "generate) or bfloat16",
            GENERATION,
        ),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_own_fields(self, GenerationOptions, _GENERATION_RULES)


@dataclass(frozen=True, kw_only=True)
class TorchEngineOptions(GenerationOptions):
    """The torch backend: batchline's own decode loop (``generation/load.py``; the measured
    running cap: ``generation/admission.py``; ``engine_process``:
    ``generation/engine_process.py``)."""

    generation_threads: int | None = field(
        default=None,
        metadata=knob(
            "the torch backend's CPU threads (unset: every core in float32, one in bfloat16)",
            TORCH,
        ),
    )
    weights: WeightFormat = field(
        default="auto",
        metadata=knob(
            "how the torch backend holds the linears: auto (a GGUF file's Q4_0/Q4_1/Q8_0 tensors "
            "kept quantized where the CPU computes bf16 natively, a folder's as they are), float "
            "(in --dtype; a GGUF dequantized), int8 or int4 (weight-only, quantized at load)",
            TORCH,
        ),
    )
    activations: ActivationFormat = field(
        default="auto",
        metadata=knob(
            "what int8/int4/GGUF weights multiply: float (the rows as they are), int8 (each "
            "row's groups of 32 inputs quantized to int8 on the way in and summed in integers, "
            "every row in float32, a step's 1-4 rows in bfloat16: needs AVX2, fast with "
            "AVX512-VNNI) or auto (int8 where the host kind measured it: in float32 where dtype "
            "auto chose it, a named float32 keeping float rows; in bfloat16 on AMX)",
            TORCH,
        ),
    )
    dense_linears: DenseLinears = field(
        default="auto",
        metadata=knob(
            "what computes a bf16 model's dense linears on CPU: onednn (torch's, its weights "
            "packed once), tiles (the own kernel's bf16 tiles: needs AVX512-BF16) or auto (tiles "
            "where the host kind measured them faster: AVX512-BF16 without AMX)",
            TORCH,
        ),
    )
    # Chunked prefill's per-step budget: chunking keeps tokens/s and cuts TTFT p99 (~21 s
    # unchunked, 5-9 s chunked); 512, not 1024: a step of 512 prompt tokens already stalls the
    # running rows ~1 s on a 2-core CPU (benchmarks/engine_levers.md, workload A/B).
    max_step_tokens: int = field(
        default=512,
        metadata=knob(
            "tokens one decode step takes at most, decodes first, longer prompts prefilled in "
            "chunks (512)",
            TORCH,
        ),
    )
    # Off until benchmarks/bench_vs_vllm.py (batchline-torch-proc) says it pays.
    engine_process: bool = field(
        default=False,
        metadata=knob(
            "run the torch backend's continuous batching (engine and scheduler) in a process of "
            "its own, so it never waits for the GIL behind the server's front end; the tokenizer "
            "and streams stay here (not with vllm, static batching or --no-batching)",
            TORCH,
        ),
    )

    # A 1.7B step read from 2 MiB pages took x0.85-0.89 its time in 4 KiB ones (Zen 4 EPYC,
    # 2026-12-06): generation/huge_pages.py.
    huge_pages: bool = field(
        default=True,
        metadata=knob(
            "on CPU, hold the torch backend's weights in 2 MiB pages once loaded (Linux 6.1 and "
            "later; ~2.5 s a GB at load): a decode step reads them with fewer TLB misses; false "
            "keeps the pages the allocator gave",
            TORCH,
            off="keep the torch backend's weights in the pages the allocator gave, not moved "
            "into 2 MiB pages at load (which costs ~2.5 s a GB and makes a decode step read them "
            "with fewer TLB misses)",
        ),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_own_fields(self, TorchEngineOptions, _TORCH_RULES)


@dataclass(frozen=True, kw_only=True)
class VllmOptions(GenerationOptions):
    """vLLM's engine (``generation/vllm_generator.py``)."""

    max_context_tokens: int | None = field(
        default=None,
        metadata=knob(
            "vLLM: prompt + completion of one sequence, at most (unset: 2,048 on CPU, the "
            "model's own on CUDA)",
            VLLM,
        ),
    )
    kv_cache_gib: float | None = field(
        default=None,
        metadata=knob(
            "vLLM: the KV cache's size in GiB (unset: 1 on CPU; on CUDA what "
            "--gpu-memory-fraction leaves)",
            VLLM,
        ),
    )
    gpu_memory_fraction: float | None = field(
        default=None,
        metadata=knob(
            "vLLM: the share of the device's memory it may take, in (0, 1] (unset: 0.3 on CPU, "
            "where vLLM counts it against RAM; vLLM's own on CUDA)",
            VLLM,
        ),
    )
    eager: bool | None = field(
        default=None,
        metadata=knob(
            "vLLM: run the model eagerly, no graph capture or compilation (unset: eager on CPU, "
            "where compiling adds ~60 s to every start; compiled on CUDA)",
            VLLM,
        ),
    )
    vllm_scheduling_policy: VllmSchedulingPolicy = field(
        default="fcfs",
        metadata=knob(
            "vLLM: fcfs (its default: requests join in arrival order, their priority unused) or "
            "priority (joins ordered by each request's aged priority, as the torch backend "
            "always does)",
            VLLM,
        ),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_own_fields(self, VllmOptions, _VLLM_RULES)


@dataclass(frozen=True, kw_only=True)
class GenerationBackendOptions(VllmOptions, TorchEngineOptions):
    """Everything the generation backend reads (``generation/load.py`` picks the engine, so it
    reads both engines' options): the core, generation, the torch engine's, vLLM's. The
    deployment's ``Knobs`` is this plus the other backends' options."""
