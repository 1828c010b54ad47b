"""Text generation behind the model seam (``pip install 'batchline[generate]'``).

- :mod:`~batchline.models.generation.engine`: the step-level interface (``StepEngine``) and
  the requests, sampling parameters and step outputs that flow through it (standard library).
- backends (torch / vLLM) and the schedulers over them (static and continuous batching) load
  only when used, so importing this package needs no torch.
"""

from __future__ import annotations

from batchline.models.generation.engine import (
    FinishReason,
    GenerationRequest,
    SamplingParams,
    StepEngine,
    StepOutput,
)

__all__ = [
    "FinishReason",
    "GenerationRequest",
    "SamplingParams",
    "StepEngine",
    "StepOutput",
]
