"""What a bench sends, by what the model takes (``ModelInfo.input_kind``):

- **texts** (embed, classify): a sample of ``--inputs`` or of the demo corpus, optionally cut
  to lengths. ``--lengths short`` makes texts of about 8-24 tokens, ``mixed`` of about 8-128
  (special tokens included, uniformly drawn), by cutting real text at a token boundary; texts
  shorter than their drawn length are joined with the next ones first;
- **tensor rows** (predict): the rows of ``--inputs`` (a ``.npy`` file, or JSONL/Parquet list
  columns named as the model's inputs), or, without ``--inputs``, random rows shaped from the
  model's inputs (``info.details["inputs"]``; a dynamic non-batch dimension gets
  :data:`DYNAMIC_DIM`);
- **records** (``module:factory``): the rows of ``--inputs`` (JSONL, CSV, Parquet) as dicts,
  or the demo corpus's rows (``{"id", "text"}``) without it.

Seeded: one seed, one sample.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from batchline._errors import InputError
from batchline._stats import percentile
from batchline.models.protocol import InputKind

if TYPE_CHECKING:
    from tokenizers import Encoding, Tokenizer

    from batchline._types import Array
    from batchline.datasets.sources import Record

__all__ = [
    "DYNAMIC_DIM",
    "LENGTHS",
    "InputOptions",
    "Inputs",
    "Lengths",
    "load_inputs",
    "load_model_inputs",
    "load_records",
    "load_tensor_rows",
    "random_tensor_rows",
    "read_texts",
    "shape_lengths",
]

Lengths = Literal["short", "mixed"]

#: Token-length ranges (special tokens included) of ``--lengths``.
LENGTHS: dict[str, tuple[int, int]] = {"short": (8, 24), "mixed": (8, 128)}

# Inputs in a sample; requests cycle through them.
DEFAULT_SAMPLE = 2_000
# At most this many records are read from an --inputs file.
_MAX_READ = 20_000
#: The size given to a dynamic non-batch dimension of a random tensor row.
DYNAMIC_DIM = 16
# Random tensor rows take at most about this many bytes in all (a 3x224x224 float32 image is
# 600 kB: 2,000 of them would be 1.2 GB), and at least this many rows.
_RANDOM_BYTES = 64 << 20
_MIN_RANDOM_ROWS = 16


@dataclass(frozen=True)
class Inputs:
    """The inputs of a run (what ``model.prepare`` takes: texts, tensor rows or records) and a
    one-line description of them for the report."""

    items: list[object]
    description: str

    @property
    def texts(self) -> list[str]:
        """The inputs as texts (what ``POST /v1/embeddings`` sends); ``InputError`` otherwise."""
        if not all(isinstance(x, str) for x in self.items):
            raise InputError("these inputs are not texts: an embeddings route sends texts only")
        return [x for x in self.items if isinstance(x, str)]


@dataclass(frozen=True)
class InputOptions:
    """Where a bench's inputs come from (``--inputs``, ``--text-column``, ``--lengths``,
    ``--seed``)."""

    path: Path | None = None
    text_column: str = "text"
    lengths: Lengths | None = None
    seed: int = 0
    count: int = DEFAULT_SAMPLE


def read_texts(path: Path, *, text_column: str = "text", limit: int = _MAX_READ) -> list[str]:
    """Up to ``limit`` non-empty texts of ``path`` (any format ``open_source`` reads)."""
    records = _read(
        path, limit, lambda r: bool(r.text.strip()), text_column=text_column, extra_columns=()
    )
    return [r.text for r in records[:limit]]


def _read(
    path: Path, limit: int, keep: Callable[[Record], bool] = bool, block: int = 1024, **options: Any
) -> list[Record]:
    """The records of ``path`` that ``keep`` accepts (all by default), read block by block until
    at least ``limit`` are in (bad records skipped); ``options`` go to ``open_source``."""
    from batchline.datasets.sources import Record, open_source

    source = open_source(path, on_bad_record="skip", **options)
    records: list[Record] = []
    for items in source.iter_blocks(block):
        records += [r for r in items if isinstance(r, Record) and keep(r)]
        if len(records) >= limit:
            break
    return records


def shape_lengths(
    texts: list[str], tokenizer: Tokenizer, lengths: Lengths, *, count: int, seed: int
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
        encoding: Encoding
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
    tokenizer: Tokenizer | None,
    text_column: str = "text",
    count: int = DEFAULT_SAMPLE,
    seed: int = 0,
) -> Inputs:
    """The texts of a run: from ``inputs`` (as they are, unless ``lengths`` is given) or a
    seeded sample of the demo corpus (cut to ``lengths``, ``mixed`` by default).

    ``tokenizer`` (a Hugging Face ``Tokenizer``) cuts texts to lengths and counts their tokens;
    without one (a ``module:factory`` text model), texts are sent as they are and counted in
    characters."""
    if tokenizer is None and lengths is not None:
        raise InputError(
            f"--lengths {lengths} cuts texts at token boundaries and needs the model's tokenizer; "
            "this model has none that batchline can read: pass --inputs with texts as they are"
        )
    if inputs is None:
        from batchline.datasets.corpus import demo_corpus_path

        all_texts = read_texts(demo_corpus_path(), limit=10**9)
        source = "the demo corpus"
        lengths = lengths or ("mixed" if tokenizer is not None else None)
    else:
        all_texts = read_texts(inputs, text_column=text_column)
        source = str(inputs)
        if not all_texts:
            raise InputError(f"{inputs}: no non-empty texts in column {text_column!r}")
    if lengths is not None and tokenizer is not None:
        texts = shape_lengths(all_texts, tokenizer, lengths, count=count, seed=seed)
    else:
        rng = random.Random(seed)
        texts = all_texts if len(all_texts) <= count else rng.sample(all_texts, count)
    if tokenizer is not None:
        counts = [float(len(e.ids)) for e in tokenizer.encode_batch(texts)]
        unit = "tokens"
    else:
        counts = [float(len(t)) for t in texts]
        unit = "characters"
    shape = f", {lengths} lengths {LENGTHS[lengths][0]}-{LENGTHS[lengths][1]}" if lengths else ""
    description = (
        f"{len(texts):,} texts from {source}{shape}; {unit} per text: median "
        f"{percentile(counts, 50):.0f}, p90 {percentile(counts, 90):.0f}, "
        f"max {max(counts):.0f}"
    )
    return Inputs(list(texts), description)


def load_records(path: Path | None, *, count: int = DEFAULT_SAMPLE, seed: int = 0) -> Inputs:
    """Whole rows as dicts (what a ``module:factory`` model takes): a seeded sample of ``path``
    (JSONL, CSV, Parquet) or of the demo corpus."""
    if path is None:
        from batchline.datasets.corpus import demo_corpus_path

        source_path, name = demo_corpus_path(), "the demo corpus"
    else:
        source_path, name = path, str(path)
    rows = [r.input for r in _read(source_path, _MAX_READ, input_kind="record")]
    if not rows:
        raise InputError(f"{name}: no readable records")
    rng = random.Random(seed)
    sample = rows if len(rows) <= count else rng.sample(rows, count)
    return Inputs(sample, f"{len(sample):,} records from {name}")


def load_tensor_rows(
    path: Path, specs: Sequence[Mapping[str, object]], *, count: int = DEFAULT_SAMPLE
) -> Inputs:
    """The first ``count`` rows of ``path`` as ``{input name: array}``: a ``.npy`` file feeds a
    one-input model; JSONL or Parquet list columns named as the model's inputs feed any."""
    names = [str(s["name"]) for s in specs]
    records = _read(path, count, block=256, input_kind="tensors", input_columns=names)
    rows = [r.input for r in records[:count]]
    if not rows:
        raise InputError(f"{path}: no readable rows for the model's inputs {names}")
    return Inputs(rows, f"{len(rows):,} rows from {path}; {_describe_row(rows[0])}")


def random_tensor_rows(
    specs: Sequence[Mapping[str, object]], *, count: int = DEFAULT_SAMPLE, seed: int = 0
) -> Inputs:
    """Seeded random rows shaped from a model's inputs (``{"name", "datatype", "shape"}``,
    ``-1`` for a dynamic dimension; the first is the batch axis, left out of a row)."""
    import numpy as np

    from batchline.oip import DATATYPES

    if not specs:
        raise InputError("the model declares no inputs to shape random rows from; pass --inputs")
    shapes: dict[str, tuple[tuple[int, ...], np.dtype[np.generic]]] = {}
    for spec in specs:
        name, datatype = str(spec["name"]), str(spec.get("datatype", ""))
        dims = spec.get("shape")
        numeric = datatype in DATATYPES and datatype != "BYTES"
        if not numeric or not isinstance(dims, list | tuple) or not dims:
            raise InputError(
                f"cannot make random rows for input {name!r} ({datatype or 'no type'}, shape "
                f"{dims}): pass --inputs with real rows (a .npy file, or JSONL list columns)"
            )
        dims_of_row = [int(d) if isinstance(d, int) and d >= 0 else DYNAMIC_DIM for d in dims[1:]]
        shapes[name] = (tuple(dims_of_row), DATATYPES[datatype])
    row_bytes = sum(max(1, int(np.prod(s))) * dt.itemsize for s, dt in shapes.values())
    count = max(1, min(count, max(_MIN_RANDOM_ROWS, _RANDOM_BYTES // max(1, row_bytes))))
    rng = np.random.default_rng(seed)
    rows: list[object] = []
    for _ in range(count):
        row: dict[str, Array] = {}
        for name, (shape, dtype) in shapes.items():
            if dtype.kind == "f":
                row[name] = rng.standard_normal(shape).astype(dtype)
            elif dtype.kind == "b":
                row[name] = rng.integers(0, 2, shape).astype(bool)
            else:  # small non-negative ints: valid ids or indices for most models
                row[name] = rng.integers(0, 8, shape).astype(dtype)
        rows.append(row)
    return Inputs(rows, f"{count:,} random rows (seed {seed}); {_describe_row(rows[0])}")


def _describe_row(row: object) -> str:
    if isinstance(row, Mapping):
        parts = []
        for name, a in row.items():
            dtype = getattr(getattr(a, "dtype", None), "name", "?")
            parts.append(f"{name} {list(getattr(a, 'shape', ()))} {dtype}")
        return "per row: " + ", ".join(parts)
    return f"per row: {type(row).__name__}"


def load_model_inputs(
    input_kind: InputKind,
    options: InputOptions,
    *,
    tokenizer: Tokenizer | None = None,
    tensor_specs: Sequence[Mapping[str, object]] = (),
) -> Inputs:
    """The inputs of a run for a model that takes ``input_kind`` (see the module docstring).

    ``tokenizer`` goes with texts; ``tensor_specs`` (``info.details["inputs"]``) with tensors.
    """
    if input_kind == "text":
        return load_inputs(
            options.path,
            lengths=options.lengths,
            tokenizer=tokenizer,
            text_column=options.text_column,
            count=options.count,
            seed=options.seed,
        )
    if options.lengths is not None:
        raise InputError(
            f"--lengths shapes texts; this model takes "
            f"{'tensor rows' if input_kind == 'tensors' else 'records'}, not texts: leave it out"
        )
    if input_kind == "record":
        return load_records(options.path, count=options.count, seed=options.seed)
    if options.path is not None:
        return load_tensor_rows(options.path, tensor_specs, count=options.count)
    return random_tensor_rows(tensor_specs, count=options.count, seed=options.seed)
