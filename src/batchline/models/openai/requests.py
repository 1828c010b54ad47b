"""The request bodies a client sends to the OpenAI routes (and to the rerank and score routes),
validated once, the same way, wherever they arrive: as an HTTP request to ``batchline serve``,
or as the ``body`` of a batch file's line (``batchline run`` on one, and the Batch API).

Validation is strict (pydantic v2): a number is not a text. Unknown fields are ignored, as
OpenAI does, so that newer clients keep working; a generation body keeps them only so that
:meth:`SamplingBody.unapplied` can refuse the sampling fields no engine here applies. A body
that is valid but asks for something this server does not do (``n`` > 1, ``echo``, ``tools``...)
is refused by its :meth:`check`, and a body becomes the engine's ``SamplingParams`` through
:meth:`SamplingBody.sampling`. Every refusal is a ``ValueError`` whose text the routes answer
with a 400 and a batch line's error carries.

(No ``from __future__ import annotations``: pydantic and FastAPI read these annotations at
run time.)
"""

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

from batchline.models.generation import (
    GUIDED_FIELDS,
    MAX_LOGPROBS,
    Constraint,
    SamplingParams,
    constraint_from_openai,
    unapplied_field,
)
from batchline.models.openai.classify import CLASSIFY_URL
from batchline.models.openai.images import InputMessage
from batchline.models.scoring import RERANK_URL, SCORE_URL

__all__ = [
    "BODY_OF_URL",
    "CHAT_URL",
    "CLASSIFY_URL",
    "COMPLETIONS_URL",
    "CONSTRAINT_FIELDS",
    "EMBEDDINGS_URL",
    "MAX_STOPS",
    "ChatCompletionRequest",
    "ChatMessageBody",
    "ClassifyRequest",
    "CompletionRequest",
    "EmbeddingRequest",
    "OpenAISamplingBody",
    "Priority",
    "RerankDocument",
    "RerankRequest",
    "SamplingBody",
    "ScoreRequest",
    "StreamOptions",
    "TextPart",
    "Texts",
    "error_text",
    "read_body",
    "texts_of",
]

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"

#: A request's priority: ``interactive``, ``batch`` or an integer, lower sooner
#: (``batchline._priority``); the server's ``X-Batchline-Priority`` header says the same.
Priority = StrictStr | StrictInt

M = TypeVar("M", bound=BaseModel)


def _one_error(value: object, handler: ValidatorFunctionWrapHandler) -> object:
    try:
        return handler(value)
    except ValidationError:
        # one message, not one per branch of the union ("input.str", "input.list[str].0")
        raise PydanticCustomError(
            "texts_type",
            "Input should be a string or a list of strings (token arrays are not taken: "
            "send the text)",
        ) from None


#: One text or a list of texts.
Texts = Annotated[StrictStr | list[StrictStr], WrapValidator(_one_error)]


def read_body(schema: type[M], body: Mapping[str, object]) -> M:
    """``body`` (parsed JSON) as ``schema``; ``ValueError`` naming the first bad field as the
    server's 422 does (``body.temperature: Input should be...``), never echoing the input."""
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_input=False, include_url=False, include_context=False)
        raise ValueError(error_text([{**e, "loc": ("body", *e["loc"])} for e in errors])) from None


def error_text(errors: Sequence[Mapping[str, Any]]) -> str:
    """The one-line text of pydantic's errors: where the first is, and what it says."""
    if not errors:
        return "invalid request"
    first = errors[0]
    where = ".".join(str(part) for part in first.get("loc", ()))
    message = str(first.get("msg", ""))
    return f"{where}: {message}" if where else message


def texts_of(value: str | Sequence[str], field: str) -> list[str]:
    """A body's one text or list of texts, as a list; ``ValueError`` when there is none or
    one is empty."""
    texts = [value] if isinstance(value, str) else list(value)
    if not texts:
        raise ValueError(f"'{field}' is empty; send at least one of its texts")
    for i, text in enumerate(texts):
        if not text:
            raise ValueError(f"'{field}' text {i} is empty; send non-empty texts")
    return texts


# -- embeddings ------------------------------------------------------------------------------


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings``: one text or a list of texts (token arrays are not taken); or
    pictures, for an image model: vLLM's ``messages`` (one conversation, one vector) or
    infinity's ``input`` of data URIs with ``"modality": "image"`` (:mod:`.images`)."""

    model_config = ConfigDict(extra="ignore")

    input: Texts | None = None
    messages: list[InputMessage] | None = None
    modality: Literal["text", "image"] = "text"
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: StrictStr | None = None
    priority: Priority | None = None

    def cut(self, dim: object, model: str) -> int | None:
        """How many leading dimensions of ``model``'s vectors (``dim`` each, as its card says)
        to keep, renormalized; None for all. ``ValueError`` for a count out of range, or any
        count when the model does not say its ``dim``."""
        asked = self.dimensions
        if asked is None or asked == dim:
            return None
        if not isinstance(dim, int):
            raise ValueError(
                f"{model} does not say how many dimensions it returns; omit 'dimensions'"
            )
        if not 1 <= asked <= dim:
            raise ValueError(
                f"'dimensions' must be between 1 and {dim} ({model} returns {dim}), got {asked}"
            )
        return asked


class ClassifyRequest(BaseModel):
    """``POST /classify`` (``/v1/classify``): one label per text; ``return_all_scores`` adds
    every label's score. Pictures as for ``/v1/embeddings``: vLLM's ``messages``, or
    infinity's ``input`` of data URIs with ``"modality": "image"``. A zero-shot CLIP or
    SigLIP model classifies among the labels it is served with."""

    model_config = ConfigDict(extra="ignore")

    input: Texts | None = None
    messages: list[InputMessage] | None = None
    modality: Literal["text", "image"] = "text"
    model: StrictStr | None = None
    return_all_scores: StrictBool = False
    priority: Priority | None = None


# -- rerank and score (Cohere's and Jina's rerank, vLLM's score) ------------------------------


class RerankDocument(BaseModel):
    """A document as Cohere's and Jina's clients may send it: ``{"text": ...}``."""

    model_config = ConfigDict(extra="ignore")

    text: StrictStr


class RerankRequest(BaseModel):
    """``POST /v1/rerank``: one query, the documents to rank against it; ``top_n`` keeps the
    best n."""

    model_config = ConfigDict(extra="ignore")

    query: StrictStr
    documents: list[StrictStr | RerankDocument]
    model: StrictStr | None = None
    top_n: Annotated[StrictInt, Field(ge=1)] | None = None
    return_documents: StrictBool = True
    priority: Priority | None = None


class ScoreRequest(BaseModel):
    """``POST /v1/score``, in vLLM's shape: ``text_1`` against ``text_2``. One ``text_1`` is
    scored against every ``text_2``; two lists of one length pair up."""

    model_config = ConfigDict(extra="ignore")

    text_1: Texts
    text_2: Texts
    model: StrictStr | None = None
    priority: Priority | None = None


# -- text generation ----------------------------------------------------------------------

#: At most this many stop strings per request.
MAX_STOPS = 16
#: At most this many completions per prompt (``n``).
MAX_N = 128
#: The fields that constrain a completion (structured outputs).
CONSTRAINT_FIELDS = ("response_format", *GUIDED_FIELDS)

Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False, strict=True)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False, strict=True)]
MaxTokens = Annotated[int, Field(ge=1, strict=True)]
# int64, as OpenAI's API takes; torch's generators refuse seeds outside 64 bits
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1, strict=True)]
Stop = StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOPS)]
# an integer or a float, one error when neither (a union would name both branches)
Number = Annotated[float, Field(allow_inf_nan=False, strict=True)]


class SamplingBody(BaseModel):
    """What every generation request may say about sampling (and which model)."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    # it orders who joins the next decode step (SamplingParams.priority)
    priority: Priority | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    # vLLM's extension (its server takes it too): generate max_tokens even past the EOS token
    ignore_eos: StrictBool = False
    # structured outputs, read by batchline.models.generation.structured.constraint_from_openai
    response_format: dict[str, object] | None = None
    guided_json: dict[str, object] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    # OpenAI's; their ranges are checked by SamplingParams (the error names the range)
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[StrictStr, Number] | None = None

    def unapplied(self) -> str | None:
        """The first field the body sets that no engine applies (``UNAPPLIED_FIELDS``), or
        None."""
        return unapplied_field(self.model_extra or {})

    def asked_max_tokens(self) -> int | None:
        """The completion's token cap the body asks for (None: the route's or job's default)."""
        return self.max_tokens

    def logprob_count(self) -> int | None:
        """Alternatives per token to return with each token's log-probability (None: no
        log-probabilities; ``SamplingParams.logprobs``)."""
        return None

    def prompt_logprob_count(self) -> int | None:
        """The same for the prompt's tokens (``SamplingParams.prompt_logprobs``): asked by
        ``echo`` with ``logprobs``."""
        return None

    def constraint_fields(self) -> dict[str, object]:
        """The structured-output fields the body sets (empty: it asks for no constraint)."""
        return self.model_dump(include=set(CONSTRAINT_FIELDS), exclude_none=True)

    def constrains(self) -> bool:
        """Whether the body names a structured-output constraint (cheap: nothing compiled)."""
        return any(getattr(self, name) is not None for name in CONSTRAINT_FIELDS)

    def constraint(self) -> Constraint | None:
        """The structured-output constraint asked for (``ValueError`` when it is bad)."""
        return constraint_from_openai(self.constraint_fields())

    def sampling(
        self,
        *,
        max_tokens: int,
        constraint: Constraint | None,
        priority: int = 0,
        greedy: bool = False,
    ) -> SamplingParams:
        """The engine's sampling parameters for this body: ``max_tokens`` the cap to use when
        the body asks for none (:meth:`asked_max_tokens` first), ``constraint`` the body's
        (compiled by the caller, who may cache it), greedy by default when ``greedy`` (else
        OpenAI's temperature 1). ``ValueError`` for a field no engine applies, a penalty out
        of OpenAI's range or a ``logit_bias`` key that is no token id."""
        unapplied = self.unapplied()
        if unapplied is not None:
            raise ValueError(f"'{unapplied}' is not applied by batchline's engines; omit it")
        stop = self.stop
        asked = self.asked_max_tokens()
        temperature = self.temperature
        return SamplingParams(
            max_tokens=max_tokens if asked is None else asked,
            temperature=temperature if temperature is not None else (0.0 if greedy else 1.0),
            top_p=self.top_p if self.top_p is not None else 1.0,
            seed=self.seed,
            stop=() if stop is None else (stop,) if isinstance(stop, str) else tuple(stop),
            ignore_eos=self.ignore_eos,
            constraint=constraint,
            priority=priority,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=SamplingParams.bias_of(self.logit_bias),
            logprobs=self.logprob_count(),
            prompt_logprobs=self.prompt_logprob_count(),
        )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


class OpenAISamplingBody(SamplingBody):
    """The OpenAI generation routes' common fields (``n``, ``stream``...).

    ``n`` completions of each prompt share its prefill (the engine computes an identical
    prompt once); sampled with a ``seed``, completion ``i`` draws from ``seed + i``, so the
    ``n`` differ and the same request gives the same ``n`` again.
    """

    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None

    def check(self) -> None:
        """``ValueError`` for what is valid OpenAI but not done here."""

    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(OpenAISamplingBody):
    """``POST /v1/completions``: one text prompt or a list of them."""

    prompt: Texts
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None
    # legacy completions: the k most likely tokens at each place, with the token's own
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    def check(self) -> None:
        super().check()
        if self.best_of not in (None, 1, self.n):
            raise ValueError("'best_of' is not supported; omit it (or send it equal to n)")
        if self.suffix:
            raise ValueError("'suffix' is not supported; omit it")

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompt_logprob_count(self) -> int | None:
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str]:
        """The prompts, in order (``ValueError`` when there is none or one is empty)."""
        return texts_of(self.prompt, "prompt")


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
    """``POST /v1/chat/completions``: messages through the model's chat template.
    ``max_completion_tokens`` (the newer name) wins over ``max_tokens``."""

    messages: list[ChatMessageBody]
    max_completion_tokens: MaxTokens | None = None
    tools: list[object] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    def check(self) -> None:
        super().check()
        if self.tools:
            raise ValueError("'tools' are not supported by this server; omit them")
        if not self.messages:
            raise ValueError("'messages' is empty; send at least one message")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("'top_logprobs' needs 'logprobs': true")

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def asked_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def chat(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them: ``{"role", "content"}`` texts."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]


#: The body each url of a batch file's line (and each route) takes.
BODY_OF_URL: dict[str, type[BaseModel]] = {
    CHAT_URL: ChatCompletionRequest,
    CLASSIFY_URL: ClassifyRequest,
    COMPLETIONS_URL: CompletionRequest,
    EMBEDDINGS_URL: EmbeddingRequest,
    RERANK_URL: RerankRequest,
    SCORE_URL: ScoreRequest,
}
