"""The model seam: what every model is, to every layer above ``batchline.models``.

``run``, ``serve``, ``bench``, ``tune`` and the Ray engine talk to a :class:`BatchModel` and
never to a concrete model class; a new kind of model is one new module under ``models/``.
Standard library only, so that every layer can import it for typing without an extra.

A model says:

- its **task** (:data:`Task`): ``embed`` (text → vector), ``classify`` (text → label and
  scores), ``score`` (a ``{"query", "document"}`` pair → one relevance score: a reranker),
  ``predict`` (tensors or whole records in, tensors or values out) or ``generate``
  (prompt → text, served by a :class:`~batchline.models.generation.stream.TextGenerator`
  rather than a batch function: see ``models/generation``);
- how one input is **prepared** outside the batcher (tokenize, decode, check shapes), in a
  worker thread or inline, so the batcher only queues ready items;
- each prepared item's **cost** and how costs add up (:data:`CostKind`): ``padded`` makes a
  batch cost ``len(batch) × its costliest item`` (a ``TokenBatcher``: padding-aware groups),
  ``additive`` sums them (a ``DynamicBatcher``; 1 per item is a batch-size budget);
- how a batch **runs**: ``run_batch(list) -> results``, sync (called in a worker thread) or a
  coroutine function (awaited on the loop);
- how one result is **encoded** for a dataset output (:attr:`ModelInfo.result_kind`).

Example, a model written by hand (``batchline run data.jsonl --model mymod:factory``)::

    class Upper:
        info = ModelInfo(name="upper", task="predict", input_kind="record")

        def prepare(self, inputs):
            return [str(r["text"]) for r in inputs]

        def cost(self, item):
            return 1

        def run_batch(self, batch):
            return [s.upper() for s in batch]

        def encode(self, result):
            return result
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar, get_args, runtime_checkable

from batchline._errors import InputError

__all__ = [
    "TASKS",
    "BatchModel",
    "CostKind",
    "InputKind",
    "ModelInfo",
    "ResultKind",
    "Task",
    "Tokenizing",
    "check_token_ids",
]

Task = Literal["embed", "classify", "score", "predict", "generate"]
TASKS: tuple[Task, ...] = get_args(Task)

#: ``padded``: a batch costs ``len(batch) × max(cost)``; ``additive``: the sum of its costs.
CostKind = Literal["padded", "additive"]

#: What ``prepare`` takes per record: ``text`` (a string), ``tensors`` (a mapping of input
#: name to one row's array), ``record`` (the whole input row as a dict), ``image`` (a
#: picture: its bytes, or where they are; an image model also has ``preprocess``, an
#: ``ImagePreprocess``, and its prepared items are float32 ``(3, H, W)`` arrays; see
#: ``batchline.models.image``).
InputKind = Literal["text", "tensors", "record", "image"]

#: How a dataset output stores one result (``batchline.datasets.columns``): ``vector`` (a
#: fixed-length float32 list), ``tensors`` (named arrays: native nested lists of numbers),
#: ``value`` (a string or a mapping of scalars, such as a label and scores: the Arrow type it
#: has, a struct for a mapping) or ``json`` (anything JSON can say: JSON text, for a user's
#: function that returns arbitrary objects).
ResultKind = Literal["vector", "tensors", "value", "json"]

P = TypeVar("P")  # a prepared item
R = TypeVar("R")  # one record's result


@dataclass(frozen=True)
class ModelInfo:
    """What a model is, for routing, outputs and listings (``GET /v1/models``, OIP metadata).

    ``details`` is JSON-able and task-specific: ``dim`` (embed), ``labels`` (classify),
    ``inputs``/``outputs`` as ``{"name", "datatype", "shape"}`` lists (predict).
    """

    name: str
    task: Task
    input_kind: InputKind = "text"
    cost_kind: CostKind = "additive"
    result_kind: ResultKind = "json"
    #: the dataset output's column for the result
    result_column: str = "result"
    #: the longest input in tokens, when the model has such a limit
    max_tokens: int | None = None
    details: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.input_kind not in get_args(InputKind):
            kinds = ", ".join(get_args(InputKind))
            raise ValueError(f"input_kind must be one of {kinds}, got {self.input_kind!r}")
        if self.cost_kind not in get_args(CostKind):
            raise ValueError(f"cost_kind must be padded or additive, got {self.cost_kind!r}")
        if self.result_kind not in get_args(ResultKind):
            kinds = ", ".join(get_args(ResultKind))
            raise ValueError(f"result_kind must be one of {kinds}, got {self.result_kind!r}")


@runtime_checkable
class BatchModel(Protocol[P, R]):
    """A model that runs batches of prepared items; see the module docstring.

    Contract:

    - ``prepare(inputs)`` returns one entry per input, in order: the prepared item, or the
      exception that makes that input unusable (it is reported for that record alone, and
      the others go on). It may run in any thread.
    - ``cost(item) >= 1``.
    - ``run_batch(batch)`` returns one result per item, in order; it is thread-safe for as
      many concurrent calls as the layout it was loaded with has sessions. It raising fails
      the batch, which the batcher bisects until only the failing items fail.
    - ``encode(result)`` is a numpy float32 vector for ``result_kind == "vector"``, a
      mapping of name to array (or nested lists) for ``tensors``, else a JSON-able value.
    - ``close()`` frees what the model holds; it is called once, after the last batch.
    """

    @property
    def info(self) -> ModelInfo: ...

    def prepare(self, inputs: Sequence[object]) -> list[P | BaseException]: ...

    def cost(self, item: P) -> int: ...

    def run_batch(self, batch: list[P]) -> Sequence[R] | Awaitable[Sequence[R]]: ...

    def encode(self, result: R) -> object: ...

    def close(self) -> None: ...


@runtime_checkable
class Tokenizing(Protocol):
    """A model whose tokenizer clients may use directly (``POST /tokenize`` and
    ``/detokenize``): the ids it feeds the model for a text, and the text of some ids.

    ``token_ids(text, special_tokens=True)`` adds the special tokens the model is fed with
    (``[CLS] ... [SEP]``, a BOS); ``special_tokens=False`` gives the text's own tokens.
    ``token_text(ids)`` drops special tokens.
    """

    def token_ids(self, text: str, *, special_tokens: bool = True) -> list[int]: ...

    def token_text(self, ids: Sequence[int]) -> str: ...


def check_token_ids(ids: Sequence[int], vocab_size: int) -> None:
    """``InputError`` (what ``Tokenizing.token_text`` raises) for an id outside ``[0,
    vocab_size)``: a tokenizer's decode would skip it silently."""
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise InputError(f"token id {bad} is outside the vocabulary (ids 0 to {vocab_size - 1})")
