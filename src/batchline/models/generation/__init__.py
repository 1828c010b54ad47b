"""Text generation behind the model seam (``pip install 'batchline[generate]'``).

- :mod:`~batchline.models.generation.engine`: the step-level interface (``StepEngine``) and
  the requests, sampling parameters and step outputs that flow through it (standard library).
- :func:`load_text_generator` (``load.py``): a generate spec and the knobs to a
  :class:`GenerationModel` (its :class:`TextGenerator`, prompt encoding, model info), what
  ``run``, ``serve`` and ``bench`` call.
- backends (torch / vLLM) and the schedulers over them (static and continuous batching) load
  only when used, so importing this package needs no torch; ``FakeEngine`` is a model-free
  engine of set step costs, for benchmarks and tests; ``ProcessGenerator`` runs the continuous
  one in a process of its own (``Knobs.engine_process``).

Example::

    from batchline.models.generation import SamplingParams, load_text_generator
    from batchline.models.specs import parse_spec
    from batchline.models.config import Knobs

    model = load_text_generator(parse_spec("smollm2"), Knobs())
    async with model.generator as gen:
        completion = await gen.submit(model.encode("Say hi."), SamplingParams()).result()
    model.close()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchline._lazy import lazy_exports
from batchline.models.generation.engine import (
    MAX_LOGPROBS,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StepEngine,
    StepOutput,
    TokenLogprob,
    unapplied_field,
)
from batchline.models.generation.options import (
    GENERATION_BACKENDS,
    GenerationDtype,
    GenerationOptions,
    TorchEngineOptions,
    VllmOptions,
)

if TYPE_CHECKING:
    from batchline.models.generation.continuous import ContinuousGenerator
    from batchline.models.generation.demo import demo_prompts, write_demo_prompts
    from batchline.models.generation.engine_process import ProcessGenerator
    from batchline.models.generation.fake import FakeEngine, FakeTokenizer, StepCost
    from batchline.models.generation.generators import (
        GENERATOR_KINDS,
        GeneratorKind,
        build_generator,
    )
    from batchline.models.generation.load import GenerationModel, PromptInput, load_text_generator
    from batchline.models.generation.static import SequentialGenerator, StaticGenerator
    from batchline.models.generation.stats import GenerationStats
    from batchline.models.generation.stream import (
        Completion,
        Detokenizer,
        GenerationDelta,
        GenerationStream,
        TextGenerator,
        check_fits,
        completions_of,
    )
    from batchline.models.generation.structured import (
        GUIDED_FIELDS,
        Constraint,
        constraint_from_openai,
    )
    from batchline.models.generation.torch_dtype import choose_dtype
    from batchline.models.generation.vllm_generator import VllmGenerator

__all__ = [
    "GENERATION_BACKENDS",
    "GENERATOR_KINDS",
    "GUIDED_FIELDS",
    "MAX_LOGPROBS",
    "Completion",
    "Constraint",
    "ContinuousGenerator",
    "Detokenizer",
    "FakeEngine",
    "FakeTokenizer",
    "FinishReason",
    "GenerationDelta",
    "GenerationDtype",
    "GenerationModel",
    "GenerationOptions",
    "GenerationRequest",
    "GenerationStats",
    "GenerationStream",
    "GeneratorKind",
    "ProcessGenerator",
    "PromptInput",
    "SamplingParams",
    "SequentialGenerator",
    "StaticGenerator",
    "StepCost",
    "StepEngine",
    "StepOutput",
    "TextGenerator",
    "TokenLogprob",
    "TorchEngineOptions",
    "VllmGenerator",
    "VllmOptions",
    "build_generator",
    "check_fits",
    "choose_dtype",
    "completions_of",
    "constraint_from_openai",
    "demo_prompts",
    "load_text_generator",
    "unapplied_field",
    "write_demo_prompts",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "GENERATOR_KINDS": "generators",
        "GUIDED_FIELDS": "structured",
        "Completion": "stream",
        "completions_of": "stream",
        "Constraint": "structured",
        "ContinuousGenerator": "continuous",
        "Detokenizer": "stream",
        "FakeEngine": "fake",
        "FakeTokenizer": "fake",
        "GenerationDelta": "stream",
        "GenerationModel": "load",
        "GenerationStats": "stats",
        "GenerationStream": "stream",
        "GeneratorKind": "generators",
        "ProcessGenerator": "engine_process",
        "PromptInput": "load",
        "SequentialGenerator": "static",
        "StaticGenerator": "static",
        "StepCost": "fake",
        "TextGenerator": "stream",
        "VllmGenerator": "vllm_generator",
        "build_generator": "generators",
        "check_fits": "stream",
        "choose_dtype": "torch_dtype",
        "constraint_from_openai": "structured",
        "demo_prompts": "demo",
        "load_text_generator": "load",
        "write_demo_prompts": "demo",
    },
)
