"""A batch model's lines of an OpenAI batch file (``/v1/embeddings``, ``/v1/classify``,
``/v1/rerank``, ``/v1/score``): every item of a line queued as its own record on the model's
engine, and the line's outcome made of their results, in the body the route would answer
(:class:`~batchline.jobs.openai_batch.LinesAdapter` sends each line here; the output file's
lines are written by :mod:`batchline.jobs.openai_output`)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np

from batchline._errors import InputError
from batchline.datasets.outcomes import Failed, Outcome, Result
from batchline.jobs.batch import collect, prepare_block, queue_block
from batchline.jobs.requests import ClassifyLine, EmbeddingLine
from batchline.models.openai.classify import classification
from batchline.models.scoring import ScoreAsk
from batchline.models.vectors import shorten

if TYPE_CHECKING:
    from batchline._stats import BatchStats
    from batchline.models.batching import ModelBatcher
    from batchline.models.protocol import BatchModel

__all__ = ["BatchLines", "Line", "LineEngine"]


class LineEngine(Protocol):
    """What answers a batch model's lines: a started :class:`ModelBatcher` (``run``), or the
    server's queue of a served model at ``batch`` priority (``batchline.server.batches``).
    ``model`` prepares, costs and encodes; ``submit`` queues one prepared item, waiting for
    room, and gives its result's future."""

    @property
    def model(self) -> BatchModel[object, object]: ...

    @property
    def stats(self) -> BatchStats: ...

    async def submit(self, item: object) -> asyncio.Future[object]: ...


#: A line a batch model answers: an embeddings or classify line (its texts or pictures) or a
#: rerank or score line (its pairs).
Line = EmbeddingLine | ClassifyLine | ScoreAsk


class BatchLines:
    """A batch model's started batcher, for the lines it answers: every item of a line (an
    embeddings line's texts, a rerank line's pairs) is queued as its own record, so items of
    many lines share batches, and the line's outcome is made of all their results (or is the
    first failure among them)."""

    def __init__(self, engine: LineEngine) -> None:
        self.engine = engine
        # the block helpers use only the engine's model and submit: any LineEngine does
        self._helpers = cast("ModelBatcher[object, object]", engine)
        dim = engine.model.info.details.get("dim")
        self.dim = dim if isinstance(dim, int) else None
        #: the model reads pictures: a line's are decoded here as ``run`` decodes them
        self._pictures = engine.model.info.input_kind == "image"

    def _prepare_mixed(self, items: Sequence[object]) -> list[object]:
        """``prepare_block`` where pictures (bytes) are among the items or the model reads
        them: each picture decoded and preprocessed for an image model, and an item of the
        other kind that item's error (sync: in a worker thread)."""
        model = self.engine.model
        takes = "images" if self._pictures else "texts"
        out: list[object] = []
        for item in items:
            if isinstance(item, bytes) != self._pictures:
                out.append(InputError(f"model {model.info.name!r} takes {takes}"))
            elif isinstance(item, bytes):
                out.append(_picture(model, item))
            else:
                out.extend(prepare_block(self._helpers, [item]))
        return out

    async def submit(self, lines: Sequence[Line]) -> asyncio.Future[list[Outcome]]:
        items = [item for line in lines for item in _items(line)]
        if any(isinstance(item, bytes) for item in items) or self._pictures:
            prepared = await asyncio.to_thread(self._prepare_mixed, items)
        else:
            prepared = await asyncio.to_thread(prepare_block, self._helpers, items)
        cost = self.engine.model.cost
        tokens = [0 if isinstance(p, BaseException) else cost(p) for p in prepared]
        pending = await queue_block(self._helpers, prepared)
        return asyncio.ensure_future(self._outcomes(lines, tokens, pending))

    async def _outcomes(
        self,
        lines: Sequence[Line],
        tokens: Sequence[int],
        pending: Sequence[asyncio.Future[object] | Failed],
    ) -> list[Outcome]:
        got = await collect(self._helpers, pending)
        outcomes: list[Outcome] = []
        at = 0
        for line in lines:
            n = len(_items(line))
            mine, used = got[at : at + n], sum(tokens[at : at + n])
            at += n
            failed = next(((i, g) for i, g in enumerate(mine) if isinstance(g, Failed)), None)
            if failed is not None:
                i, first = failed
                where = f"input {i}: " if n > 1 else ""
                outcomes.append(Failed(f"{where}{first.message}"))
            elif isinstance(line, EmbeddingLine):
                outcomes.append(_embedded(line, mine, used))
            elif isinstance(line, ClassifyLine):
                outcomes.append(_classified(self.engine.model, line, mine, used))
            else:
                outcomes.append(_scored(mine, used))
        return outcomes


def _items(line: Line) -> Sequence[object]:
    return line.pairs if isinstance(line, ScoreAsk) else line.items


def _picture(model: BatchModel[object, object], data: bytes) -> object:
    """One picture's model input, decoded and preprocessed as a ``run`` job's decode workers
    do (draft on, the default pixel limit), or its ``InputError``."""
    from batchline.models.image import DEFAULT_MAX_PIXELS, decode_image

    preprocess = getattr(model, "preprocess")  # noqa: B009 (an image model's attribute)
    try:
        image = decode_image(data, draft=preprocess.draft_size(), max_pixels=DEFAULT_MAX_PIXELS)
        pixels = preprocess(image)
    except InputError as exc:
        return exc
    (item,) = model.prepare([pixels])
    return item


def _embedded(line: EmbeddingLine, results: Sequence[object], tokens: int) -> Outcome:
    vectors = [np.asarray(v, dtype=np.float32) for v in results]
    if not all(v.ndim == 1 and np.isfinite(v).all() for v in vectors):
        return Failed("model error: an embedding is not a vector of finite values")
    if line.dimensions is not None:
        vectors = [shorten(v, line.dimensions) for v in vectors]
    # float32 values held exactly as doubles; formatted when the file is written
    return Result(None, {"embeddings": [v.tolist() for v in vectors], "prompt_tokens": tokens})


def _classified(
    model: BatchModel[object, object], line: ClassifyLine, results: Sequence[object], tokens: int
) -> Outcome:
    """A classify line's answers, as ``POST /v1/classify`` gives them (JSON text of its
    ``results``: :mod:`batchline.models.openai.classify`), or the model's error."""
    try:
        items = [classification(model.encode(r), all_scores=line.all_scores) for r in results]
        text = json.dumps(items, separators=(",", ":"), allow_nan=False)
    except ValueError as exc:
        return Failed(f"model error: {exc}")
    return Result(None, {"classifications": text, "prompt_tokens": tokens})


def _scored(results: Sequence[object], tokens: int) -> Outcome:
    scores = [r for r in results if isinstance(r, int | float) and not isinstance(r, bool)]
    if len(scores) != len(results) or not all(math.isfinite(x) for x in scores):
        return Failed("model error: a score is not a finite number")
    columns = {"scores": [float(x) for x in scores], "prompt_tokens": tokens}
    return Result(None, {**columns, "created": int(time.time())})
