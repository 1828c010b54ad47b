"""Duplicate records are computed once (``batchline.jobs.batch.Seen``): a record whose input
repeats a recent one takes that input's result, bit for bit, and the summary counts it; a
user's Python model and ``--no-dedupe`` compute every record."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from batchline.datasets.outcomes import Failed
from batchline.datasets.readers import read_output
from batchline.datasets.sources import Record
from batchline.jobs.batch import BatchAdapter, Seen, input_key
from batchline.jobs.run import RunOptions, run
from batchline.models.batching import ModelBatcher
from batchline.models.config import Knobs
from batchline.models.protocol import ModelInfo


def test_the_key_of_an_input() -> None:
    key = input_key("a text")
    assert isinstance(key, bytes)
    assert len(key) == 16  # a digest: the window's memory does not grow with the texts
    assert input_key("a text") == key
    assert input_key("a text.") != key
    assert input_key({"query": "q", "document": "d"}) == input_key({"document": "d", "query": "q"})
    assert input_key({"query": "q", "document": "d"}) != input_key({"query": "d", "document": "q"})
    assert input_key({"text": "a text"}) != key  # a pair never meets a text
    assert input_key({"query": "q", "document": None}) is None
    assert input_key([1.0, 2.0]) is None


def test_the_window_keeps_the_most_recently_used() -> None:
    seen = Seen(2)
    a, b, c = Failed("a"), Failed("b"), Failed("c")
    seen.put(b"a", a)
    seen.put(b"b", b)
    assert seen.get(b"a") is a  # now the most recent
    seen.put(b"c", c)  # evicts b
    assert seen.get(b"b") is None
    assert seen.get(b"a") is a
    assert seen.get(b"c") is c
    assert seen.duplicates == 3
    with pytest.raises(ValueError, match="window must be >= 1"):
        Seen(0)


class CountingModel:
    """Embeds a text as [its length, its first code point]; counts the texts it is given."""

    def __init__(self) -> None:
        self.info = ModelInfo(name="counting", task="embed")
        self.computed: list[str] = []

    def prepare(self, inputs: list[object]) -> list[object]:
        return [ValueError("empty") if x == "" else x for x in inputs]

    def cost(self, item: object) -> int:
        return 1

    def run_batch(self, batch: list[str]) -> list[list[float]]:
        self.computed.extend(batch)
        return [[float(len(t)), float(ord(t[0]))] for t in batch]

    def encode(self, result: object) -> object:
        return result

    def close(self) -> None:
        pass


def records(texts: list[str]) -> list[Record]:
    return [Record(i, str(i), t, value=t) for i, t in enumerate(texts)]


@pytest.mark.anyio
async def test_a_repeated_input_is_computed_once_in_a_block_and_across_blocks() -> None:
    model = CountingModel()
    async with ModelBatcher(model, Knobs(max_batch_size=4)) as engine:  # type: ignore[arg-type]
        adapter = BatchAdapter(engine, dedupe_window=8)
        first = await (await adapter.submit(records(["ab", "c", "ab", "", "", "ab"])))
        second = await (await adapter.submit(records(["c", "xyz", "ab"])))
    assert sorted(model.computed) == ["ab", "c", "xyz"]
    values = [*first, *second]
    assert values[0] is values[2] is values[5] is values[8]  # the same result object
    assert values[1] is values[6]
    assert isinstance(first[3], Failed)
    assert first[4] is first[3]  # a bad input fails alike
    assert adapter.duplicates == 5  # ab twice and "" once in the block; c and ab after it


@pytest.mark.anyio
async def test_without_a_window_every_record_is_computed() -> None:
    model = CountingModel()
    async with ModelBatcher(model, Knobs(max_batch_size=4)) as engine:  # type: ignore[arg-type]
        adapter = BatchAdapter(engine)
        await (await adapter.submit(records(["ab", "ab", "ab"])))
    assert model.computed == ["ab", "ab", "ab"]
    assert adapter.duplicates == 0


TEXTS = ["the cat sat", "a dog ran", "the cat sat", "é ü ß", "a dog ran", "the cat sat", "new"]


def test_a_job_computes_each_repeated_text_once_and_writes_every_record(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS * 3))
    once = run(RunOptions(input=src, output=tmp_path / "once", chunk_size=5))
    every = run(RunOptions(input=src, output=tmp_path / "every", chunk_size=5, dedupe=False))
    assert once.records == every.records == len(TEXTS) * 3
    assert once.duplicates == len(TEXTS) * 3 - len(set(TEXTS))
    assert every.duplicates == 0
    assert ("duplicates (computed once)", f"{once.duplicates:,}") in once.rows()
    got = np.stack([np.asarray(v, np.float32) for v in read_output(tmp_path / "once")["embedding"]])
    want = np.stack(
        [np.asarray(v, np.float32) for v in read_output(tmp_path / "every")["embedding"]]
    )
    np.testing.assert_allclose(got, want, atol=1e-5)  # batches differ: padding, not the text
    texts = TEXTS * 3
    for i, text in enumerate(texts):
        first = texts.index(text)
        assert np.array_equal(got[i], got[first])  # a duplicate is its first's result, bit for bit


def test_a_job_dedupes_as_the_backend_that_claims_its_model_says() -> None:
    import dataclasses

    from batchline.jobs.batch import DEDUPE_WINDOW
    from batchline.jobs.run import dedupe_window
    from batchline.models.registry import BACKENDS
    from batchline.models.specs import parse_spec
    from tests.toy_backend import TOY

    toy = parse_spec("toy:hello")  # a module:factory spec, which the toy backend claims first
    assert dedupe_window(RunOptions(spec=toy)) == 0  # the python backend's: not deterministic
    assert dedupe_window(RunOptions(spec=parse_spec("default"))) == DEDUPE_WINDOW
    assert dedupe_window(RunOptions(spec=parse_spec("default"), dedupe=False)) == 0
    with BACKENDS.registered(TOY):
        assert dedupe_window(RunOptions(spec=toy)) == DEDUPE_WINDOW
    with BACKENDS.registered(dataclasses.replace(TOY, deterministic=False)):
        assert dedupe_window(RunOptions(spec=toy)) == 0
