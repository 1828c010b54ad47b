"""Request and response bodies of the server's own routes (pydantic v2): ``/classify``,
``/generate``, ``/tokenize``, the model list and errors. The OpenAI routes' bodies (and the
rerank and score routes') are :mod:`batchline.models.openai`'s, shared with the batch files.

Requests are validated strictly: a number is not a text. Extra fields are ignored, as the
OpenAI API does, so newer clients keep working. Responses are built by hand in ``routes/``
for speed (a 384-float vector through FastAPI's encoder costs more than the model call); the
response models here document them in the OpenAPI schema and are used by the tests.

(No ``from __future__ import annotations``: FastAPI reads these annotations at run time.)
"""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from batchline.models.openai.embeddings import Usage
from batchline.models.openai.requests import (
    ClassifyRequest,
    RerankDocument,
    SamplingBody,
)

__all__ = [
    "Classification",
    "ClassifyRequest",
    "ClassifyResponse",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ErrorBody",
    "ErrorDetail",
    "GenerateTextRequest",
    "GenerateTextResponse",
    "ModelCard",
    "ModelList",
    "RerankResponse",
    "RerankResult",
    "RerankUsage",
    "ScoreData",
    "ScoreResponse",
    "TokenizeRequest",
    "TokenizeResponse",
]


class LabelScore(BaseModel):
    label: str
    score: float


class Classification(BaseModel):
    label: str
    score: float
    scores: dict[str, float] | None = None
    top_k: list[LabelScore] | None = None


class ClassifyResponse(BaseModel):
    results: list[Classification]


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    """Ranked best first; ``index`` is the document's place in the request."""

    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: Usage


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a text's token ids as the model ``model`` reads it (a generate
    model also takes chat ``messages``, through its chat template)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[dict[str, StrictStr]] | None = None
    add_special_tokens: StrictBool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: the text of token ids (special tokens dropped)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "batchline"
    task: Literal["embed", "classify", "score", "predict", "generate"]
    modality: Literal["text", "image", "tensors"] = "text"
    limits: dict[str, int | list[str]] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: int


class ErrorBody(BaseModel):
    """Every error: ``detail`` (FastAPI's convention) and ``error`` (OpenAI's)."""

    detail: str | list[dict[str, object]]
    error: ErrorDetail


# -- text generation ---------------------------------------------------------------------


class GenerateTextRequest(SamplingBody):
    """``POST /generate``: one generated text per prompt, in order (greedy by default)."""

    prompts: list[StrictStr]
    task_id: StrictStr | StrictInt | None = None
    chat: StrictBool = False
    """Each prompt as one user message through the model's chat template, as ``batchline run``
    sends a text prompt (a model without a template takes it as it is); false: a raw prompt."""


class GenerateTextDetails(BaseModel):
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


class GenerateTextResponse(BaseModel):
    results: list[str]
    #: one per result: why it ended and its token counts
    details: list[GenerateTextDetails]
    task_id: str | int | None = None
    model: str
