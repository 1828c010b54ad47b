"""Request and response bodies of the server's routes (pydantic v2).

Requests are validated strictly: a number is not a text. Extra fields are ignored, as the
OpenAI API does, so newer clients keep working. Responses are built by hand in ``routes/``
for speed (a 384-float vector through FastAPI's encoder costs more than the model call); the
response models here document them in the OpenAPI schema and are used by the tests. The
generation routes' bodies live with them, in ``routes/generation.py``.

(No ``from __future__ import annotations``: FastAPI reads these annotations at run time.)
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

__all__ = [
    "Classification",
    "ClassifyRequest",
    "ClassifyResponse",
    "EmbeddingData",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "ErrorBody",
    "ErrorDetail",
    "ModelCard",
    "ModelList",
    "Usage",
]


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings``, OpenAI-compatible: one text or a list of texts."""

    model_config = ConfigDict(extra="ignore")

    input: StrictStr | list[StrictStr]
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: StrictStr | None = None


class ClassifyRequest(BaseModel):
    """``POST /classify``: one label per text; ``return_all_scores`` adds every label's score."""

    model_config = ConfigDict(extra="ignore")

    input: StrictStr | list[StrictStr]
    model: StrictStr | None = None
    return_all_scores: StrictBool = False


class Classification(BaseModel):
    label: str
    score: float
    scores: dict[str, float] | None = None


class ClassifyResponse(BaseModel):
    results: list[Classification]


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "batchline"
    task: Literal["embed", "classify", "predict", "generate"]


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
