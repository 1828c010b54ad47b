"""The texts a bench sends: a sample of a file or of the demo corpus, optionally cut to lengths.

``--lengths short`` makes texts of about 8-24 tokens, ``mixed`` of about 8-128 (special tokens
included, uniformly drawn), by cutting real text at a token boundary; texts shorter than their
drawn length are joined with the next ones first. Seeded: one seed, one sample.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from batchline._errors import InputError
from batchline._stats import percentile

__all__ = ["LENGTHS", "Inputs", "Lengths", "load_inputs", "read_texts", "shape_lengths"]

Lengths = Literal["short", "mixed"]

#: Token-length ranges (special tokens included) of ``--lengths``.
LENGTHS: dict[str, tuple[int, int]] = {"short": (8, 24), "mixed": (8, 128)}

# Texts in a sample; requests cycle through them.
DEFAULT_SAMPLE = 2_000
# At most this many records are read from an --inputs file.
_MAX_READ = 20_000


@dataclass(frozen=True)
class Inputs:
    """The texts of a run and a one-line description of them for the report."""

    texts: list[str]
    description: str


def read_texts(path: Path, *, text_column: str = "text", limit: int = _MAX_READ) -> list[str]:
    """Up to ``limit`` non-empty texts of ``path`` (any format ``open_source`` reads)."""
    from batchline.jobs.sources import Record, open_source

    source = open_source(path, text_column=text_column, extra_columns=(), on_bad_record="skip")
    texts: list[str] = []
    for block in source.iter_blocks(1024):
        for item in block:
            if isinstance(item, Record) and item.text.strip():
                texts.append(item.text)
                if len(texts) >= limit:
                    return texts
    return texts


def shape_lengths(
    texts: list[str], tokenizer: Any, lengths: Lengths, *, count: int, seed: int
) -> list[str]:
    """``count`` texts whose token counts are drawn uniformly from ``LENGTHS[lengths]``."""
    if not texts:
        raise InputError("no texts to build inputs from")
    low, high = LENGTHS[lengths]
    rng = random.Random(seed)
    pool = list(texts)
    rng.shuffle(pool)
    cursor = 0
    out: list[str] = []
    for _ in range(count):
        want = rng.randint(low, high) - 2  # [CLS] and [SEP] are added by the model's tokenizer
        pieces: list[str] = []
        encoding: Any = None
        for _attempt in range(64):
            pieces.append(pool[cursor % len(pool)])
            cursor += 1
            encoding = tokenizer.encode(" ".join(pieces), add_special_tokens=False)
            if len(encoding.ids) >= want:
                break
        joined = " ".join(pieces)
        ends = [end for _, end in encoding.offsets]
        out.append(joined[: ends[min(want, len(ends)) - 1]] if ends else joined)
    return out


def load_inputs(
    inputs: Path | None,
    *,
    lengths: Lengths | None,
    tokenizer: Any,
    text_column: str = "text",
    count: int = DEFAULT_SAMPLE,
    seed: int = 0,
) -> Inputs:
    """The texts of a run: from ``inputs`` (as they are, unless ``lengths`` is given) or a
    seeded sample of the demo corpus (cut to ``lengths``, ``mixed`` by default)."""
    if inputs is None:
        from batchline.jobs.corpus import demo_corpus_path

        all_texts = read_texts(demo_corpus_path(), limit=10**9)
        source = "the demo corpus"
        lengths = lengths or "mixed"
    else:
        all_texts = read_texts(inputs, text_column=text_column)
        source = str(inputs)
        if not all_texts:
            raise InputError(f"{inputs}: no non-empty texts in column {text_column!r}")
    if lengths is not None:
        texts = shape_lengths(all_texts, tokenizer, lengths, count=count, seed=seed)
    else:
        rng = random.Random(seed)
        texts = all_texts if len(all_texts) <= count else rng.sample(all_texts, count)
    token_counts = [float(len(e.ids)) for e in tokenizer.encode_batch(texts)]
    shape = f", {lengths} lengths {LENGTHS[lengths][0]}-{LENGTHS[lengths][1]}" if lengths else ""
    description = (
        f"{len(texts):,} texts from {source}{shape}; tokens per text: median "
        f"{percentile(token_counts, 50):.0f}, p90 {percentile(token_counts, 90):.0f}, "
        f"max {max(token_counts):.0f}"
    )
    return Inputs(texts, description)
