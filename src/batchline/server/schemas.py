"""Request and response bodies of the server's routes (pydantic v2).

Requests are validated strictly: a number is not a text. Extra fields are ignored, as the
OpenAI API does, so newer clients keep working. Responses are built by hand in ``routes/``
for speed (a 384-float vector through FastAPI's encoder costs more than the model call); the
response models here document them in the OpenAPI schema and are used by the tests.

(No ``from __future__ import annotations``: FastAPI reads these annotations at run time.)
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from batchline.models.generation import (
    GUIDED_FIELDS,
    Constraint,
    constraint_from_openai,
    unapplied_field,
)

#: A request's priority: ``interactive``, ``batch`` or an integer, lower sooner
#: (``batchline._priority``); the ``X-Batchline-Priority`` header says the same.
Priority = StrictStr | StrictInt

__all__ = [
    "ChatCompletionRequest",
    "ChatMessageBody",
    "Classification",
    "ClassifyRequest",
    "ClassifyResponse",
    "CompletionRequest",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "EmbeddingData",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "ErrorBody",
    "ErrorDetail",
    "GenerateTextRequest",
    "GenerateTextResponse",
    "ModelCard",
    "ModelList",
    "OpenAISamplingBody",
    "RerankDocument",
    "RerankRequest",
    "RerankResponse",
    "RerankResult",
    "RerankUsage",
    "SamplingBody",
    "ScoreData",
    "ScoreRequest",
    "ScoreResponse",
    "StreamOptions",
    "TextPart",
    "TokenizeRequest",
    "TokenizeResponse",
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
    priority: Priority | None = None


class ClassifyRequest(BaseModel):
    """``POST /classify``: one label per text; ``return_all_scores`` adds every label's score."""

    model_config = ConfigDict(extra="ignore")

    input: StrictStr | list[StrictStr]
    model: StrictStr | None = None
    return_all_scores: StrictBool = False
    priority: Priority | None = None


class Classification(BaseModel):
    label: str
    score: float
    scores: dict[str, float] | None = None


class ClassifyResponse(BaseModel):
    results: list[Classification]


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankDocument(BaseModel):
    """A document as Cohere's and Jina's clients may send it: ``{"text": ...}``."""

    model_config = ConfigDict(extra="ignore")

    text: StrictStr


class RerankRequest(BaseModel):
    """``POST /v1/rerank`` (also ``/rerank``), as Cohere's and Jina's clients send it: one
    query, the documents to rank against it; ``top_n`` keeps the best n."""

    model_config = ConfigDict(extra="ignore")

    query: StrictStr
    documents: list[StrictStr | RerankDocument]
    model: StrictStr | None = None
    top_n: Annotated[StrictInt, Field(ge=1)] | None = None
    return_documents: StrictBool = True
    priority: Priority | None = None


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


class ScoreRequest(BaseModel):
    """``POST /v1/score`` (also ``/score``), in vLLM's shape: ``text_1`` against ``text_2``.
    One ``text_1`` is scored against every ``text_2``; two lists of one length pair up."""

    model_config = ConfigDict(extra="ignore")

    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    model: StrictStr | None = None
    priority: Priority | None = None


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


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


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
    task: Literal["embed", "classify", "score", "predict", "generate"]


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

#: At most this many stop strings per request.
MAX_STOPS = 16

Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False, strict=True)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False, strict=True)]
MaxTokens = Annotated[int, Field(ge=1, strict=True)]
# int64, as OpenAI's API takes; torch's generators refuse seeds outside 64 bits
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1, strict=True)]
Stop = StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOPS)]


class SamplingBody(BaseModel):
    """What every generation request may say about sampling (and which model).

    Unknown fields are kept (``model_extra``) only so that :meth:`unapplied` can refuse the
    sampling fields no engine here applies; other unknown fields are ignored, as OpenAI does.
    """

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    # validated like the other routes' (a bad value is a 400); it orders who joins the next
    # decode step (SamplingParams.priority, models/generation/scheduler.py)
    priority: Priority | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    # vLLM's extension (its server takes it too): generate max_tokens even past the EOS token
    ignore_eos: StrictBool = False
    # structured outputs, read by batchline.models.generation.structured.constraint_from_openai
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    # OpenAI's; their ranges are checked by SamplingParams (a 400 that names the range)
    presence_penalty: StrictFloat | StrictInt | None = None
    frequency_penalty: StrictFloat | StrictInt | None = None
    logit_bias: dict[StrictStr, StrictFloat | StrictInt] | None = None

    def unapplied(self) -> str | None:
        """The first field the body sets that no engine applies (``UNAPPLIED_FIELDS``), or
        None."""
        return unapplied_field(self.model_extra or {})

    def constrains(self) -> bool:
        """Whether the body names a structured-output constraint (cheap: nothing compiled)."""
        return any(getattr(self, name) is not None for name in ("response_format", *GUIDED_FIELDS))

    def constraint(self) -> Constraint | None:
        """The structured-output constraint asked for (``ValueError`` when it is bad)."""
        return constraint_from_openai(
            self.model_dump(include={"response_format", *GUIDED_FIELDS}, exclude_none=True)
        )


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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


class OpenAISamplingBody(SamplingBody):
    """The OpenAI routes' common fields (``n``, ``stream``...)."""

    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logprobs: StrictBool | StrictInt | None = None
    user: StrictStr | None = None


class CompletionRequest(OpenAISamplingBody):
    """``POST /v1/completions``, OpenAI-compatible: one text prompt or a list of them."""

    prompt: StrictStr | list[StrictStr]
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: StrictStr


class ChatMessageBody(BaseModel):
    """One message of a chat request (``content`` text or text parts); the model layer's
    ``ChatMessage`` is the plain ``{"role", "content"}`` mapping it becomes."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(OpenAISamplingBody):
    """``POST /v1/chat/completions``, OpenAI-compatible: messages through the model's chat
    template. ``max_completion_tokens`` (the newer name) wins over ``max_tokens``."""

    messages: list[ChatMessageBody]
    max_completion_tokens: MaxTokens | None = None
    tools: list[Any] | None = None
