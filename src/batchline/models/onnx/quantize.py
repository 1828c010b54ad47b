"""An int8 text encoder (``Knobs.quantize = "int8"``, ``--quantize int8``), and the gate that
decides whether it may be called one.

:func:`quantized_graph` turns an encoder's ONNX graph into ONNX Runtime's dynamic int8 one:
weights int8 per output channel, activations quantized on the fly per batch, the rest of the
graph in float32. It is cached beside the float32 graph's own cache, keyed by the source file's
digest, so the second load costs what loading costs.

Per channel, not per tensor: on all-MiniLM-L6-v2 and the first 2,000 demo-corpus texts, per
tensor gave a mean cosine of 0.961 to the float32 vectors and a top-10 neighbour overlap of
0.81; per channel 0.992 and 0.90 (2026-11-28, this machine).

:func:`measure_quality` compares the int8 encoder's vectors with the float32 one's on texts the
caller gives (the job uses the demo corpus): the mean cosine between the two vectors of each
text, and the mean overlap of each text's 10 nearest neighbours among the texts. :data:`GATE`
is what a model must reach to be used quantized; a model that misses it is refused with the
figures (``batchline.jobs.quantized``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from batchline._cache import cache_dir, make_cache_folder, write_whole
from batchline._errors import InputError, ModelError
from batchline._fsio import checkpoint

__all__ = [
    "GATE",
    "QUANTIZE_VERSION",
    "Quality",
    "cached_quality",
    "compare_vectors",
    "embed_all",
    "measure_quality",
    "quantized_graph",
    "store_quality",
]

logger = logging.getLogger("batchline.models")

#: Bump when the quantization settings change, so stale graphs are not reused.
QUANTIZE_VERSION = 1
#: Neighbours compared per text (top-k overlap).
NEIGHBOURS = 10


@dataclass(frozen=True)
class Quality:
    """How close the int8 encoder's vectors are to the float32 one's, on ``texts`` texts."""

    mean_cosine: float
    top10_overlap: float
    texts: int

    def shortfalls(self, gate: Quality) -> list[str]:
        """What misses ``gate``, by how much (empty: it passes)."""
        out = []
        if self.mean_cosine < gate.mean_cosine:
            out.append(
                f"mean cosine {self.mean_cosine:.4f} < {gate.mean_cosine} "
                f"(short by {gate.mean_cosine - self.mean_cosine:.4f})"
            )
        if self.top10_overlap < gate.top10_overlap:
            out.append(
                f"top-10 neighbour overlap {self.top10_overlap:.3f} < {gate.top10_overlap} "
                f"(short by {gate.top10_overlap - self.top10_overlap:.3f})"
            )
        return out


#: What an int8 encoder must reach against its float32 graph (issue 32's bar), on 2,000 texts.
GATE = Quality(mean_cosine=0.99, top10_overlap=0.9, texts=2_000)


def quantized_graph(source: Path, *, cache: Path | None = None) -> Path:
    """The int8 graph of the float32 encoder ``source`` (built once, then cached)."""
    digest = _file_digest(source)
    folder = (cache if cache is not None else cache_dir()) / "quantized"
    target = folder / f"{source.stem[:40]}-{digest[:16]}-int8-v{QUANTIZE_VERSION}.onnx"
    if target.is_file():
        return target
    try:
        from onnxruntime.quantization import QuantType, quantize_dynamic
    except ImportError as exc:  # a trimmed onnxruntime build
        raise ModelError(
            f"--quantize int8 needs onnxruntime.quantization, which this onnxruntime lacks: {exc}"
        ) from None
    make_cache_folder(folder)
    logger.info("quantizing %s to int8 (once; cached as %s)", source.name, target.name)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".quantize-") as tmp:
        out = Path(tmp) / target.name
        try:
            with _without_preprocessing_advice():
                quantize_dynamic(source, out, per_channel=True, weight_type=QuantType.QInt8)
        except Exception as exc:  # onnxruntime raises plain exceptions for graphs it cannot take
            raise ModelError(f"cannot quantize {source.name} to int8: {exc}") from None
        checkpoint("cache.quantized", "rename", target)
        out.replace(target)  # whole or not at all: a reader never sees half a graph
    return target


def measure_quality(
    reference: Any, quantized: Any, texts: Sequence[str], *, batch: int = 32
) -> Quality:
    """``quantized``'s vectors against ``reference``'s on ``texts`` (two
    :class:`~batchline.models.onnx.embed.TextEmbedder`, or anything with their ``prepare``
    and ``embed_tokens``). Raises ``InputError`` with fewer than 11 texts."""
    if len(texts) <= NEIGHBOURS:
        raise InputError(f"the quality gate needs more than {NEIGHBOURS} texts, got {len(texts)}")
    return compare_vectors(embed_all(reference, texts, batch), embed_all(quantized, texts, batch))


def compare_vectors(a: npt.NDArray[np.float32], b: npt.NDArray[np.float32]) -> Quality:
    """How close ``b``'s rows are to ``a``'s (the same texts' vectors from two models): the
    mean cosine of each pair, and the mean overlap of each row's 10 nearest neighbours."""
    if len(a) <= NEIGHBOURS or a.shape != b.shape:
        raise InputError(
            f"comparing vectors needs two sets of the same shape with more than {NEIGHBOURS} "
            f"rows, got {a.shape} and {b.shape}"
        )
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    cosine = np.sum(a * b, axis=1) / np.maximum(norms, 1e-12)
    near_a, near_b = _neighbours(a), _neighbours(b)
    shared = [len(set(x) & set(y)) for x, y in zip(near_a, near_b, strict=True)]
    overlap = np.mean(shared) / NEIGHBOURS
    return Quality(float(np.mean(cosine)), float(overlap), len(a))


def cached_quality(graph: Path) -> Quality | None:
    """The quality measured for ``graph`` before (:func:`store_quality`), if any."""
    path = graph.with_suffix(".quality.json")
    try:
        data = json.loads(path.read_text())
        return Quality(**{k: data[k] for k in ("mean_cosine", "top10_overlap", "texts")})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_quality(graph: Path, quality: Quality) -> None:
    """Keep ``quality`` beside ``graph`` for :func:`cached_quality`."""
    path = graph.with_suffix(".quality.json")
    try:
        write_whole(path, json.dumps(asdict(quality)).encode(), "cache.quantized")
    except OSError as exc:  # the cache is read-only or full: measured again next time
        logger.warning("cannot keep the quality of %s: %s", graph.name, exc)


def embed_all(model: Any, texts: Sequence[str], batch: int = 32) -> npt.NDArray[np.float32]:
    """Every text's vector from ``model`` (its ``prepare`` and ``embed_tokens``), in batches
    of ``batch`` texts of similar length (as the batcher forms them), in the texts' order."""
    items = model.prepare(list(texts))
    bad = next((x for x in items if isinstance(x, BaseException)), None)
    if bad is not None:
        raise InputError(f"a quality-gate text cannot be embedded: {bad}")
    order = sorted(range(len(items)), key=lambda i: len(items[i]))
    out: npt.NDArray[np.float32] | None = None
    for start in range(0, len(order), batch):
        idx = order[start : start + batch]
        vectors = np.asarray(model.embed_tokens([items[i] for i in idx]), dtype=np.float32)
        if out is None:
            out = np.zeros((len(items), vectors.shape[1]), dtype=np.float32)
        out[idx] = vectors
    assert out is not None
    return out


def _neighbours(vectors: npt.NDArray[np.float32]) -> npt.NDArray[np.int64]:
    """Each row's :data:`NEIGHBOURS` nearest other rows by cosine."""
    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    similarity = unit @ unit.T
    np.fill_diagonal(similarity, -np.inf)
    return np.argsort(-similarity, axis=1)[:, :NEIGHBOURS]


@contextlib.contextmanager
def _without_preprocessing_advice() -> Iterator[None]:
    """Drop the warning ONNX Runtime's quantizer logs on the root logger for every graph (to
    run its shape-inference pre-processing, which it does not need for a dynamic int8 MatMul
    graph): a user would read it as something to act on."""

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Please consider to run pre-processing")

    root = logging.getLogger()
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)


def _file_digest(path: Path) -> str:
    try:
        with path.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:
        raise ModelError(f"cannot read {path}: {exc.strerror or exc}") from None
