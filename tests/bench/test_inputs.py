"""Inputs of a bench: texts read from files and cut to token lengths with the real tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from batchline._errors import InputError
from batchline.bench.inputs import LENGTHS, load_inputs, read_texts, shape_lengths

WORDS = (
    "Batching trades latency for throughput, and it pays only when the service is "
    "throughput-bound; measure it on your own model and hardware before you trust it."
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    pytest.importorskip("tokenizers")
    from batchline.bench.model import LoadedModels

    return LoadedModels().tokenizer()


@pytest.mark.parametrize("lengths", ["short", "mixed"])
def test_shape_lengths_draws_token_counts_in_range(tokenizer: Any, lengths: str) -> None:
    low, high = LENGTHS[lengths]
    texts = shape_lengths([WORDS, "tiny", WORDS.upper()], tokenizer, lengths, count=200, seed=1)  # type: ignore[arg-type]
    assert len(texts) == 200
    counts = [len(e.ids) for e in tokenizer.encode_batch(texts)]
    # a cut inside a word can re-tokenize one token longer or shorter
    assert all(low - 1 <= c <= high + 1 for c in counts), (min(counts), max(counts))
    assert max(counts) - min(counts) > (high - low) // 2  # spread over the range
    assert texts == shape_lengths(
        [WORDS, "tiny", WORDS.upper()],
        tokenizer,
        lengths,
        count=200,
        seed=1,  # type: ignore[arg-type]
    )


def test_shape_lengths_needs_texts(tokenizer: Any) -> None:
    with pytest.raises(InputError, match="no texts"):
        shape_lengths([], tokenizer, "short", count=3, seed=0)


def test_read_texts_from_csv_skips_blank_and_bad_rows(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text('id,body\n1,first text\n2,"  "\n3,second text\n')
    assert read_texts(path, text_column="body") == ["first text", "second text"]
    assert read_texts(path, text_column="body", limit=1) == ["first text"]


def test_load_inputs_from_a_file(tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("one text\nanother text here\n\n")
    inputs = load_inputs(path, lengths=None, tokenizer=tokenizer)
    assert inputs.texts == ["one text", "another text here"]
    assert "2 texts from" in inputs.description
    assert "tokens per text" in inputs.description
    cut = load_inputs(path, lengths="short", tokenizer=tokenizer, count=50)
    assert len(cut.texts) == 50
    assert "short lengths 8-24" in cut.description
    empty = tmp_path / "e.txt"
    empty.write_text("\n\n")
    with pytest.raises(InputError, match="no non-empty texts"):
        load_inputs(empty, lengths=None, tokenizer=tokenizer)
