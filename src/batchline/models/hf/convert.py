"""A detected encoder folder to an ONNX file, converted once and cached.

:func:`convert` writes the graph with our own builder where it covers the architecture (BERT:
:func:`batchline.models.onnx.bert.build_bert`, no torch), else with the torch exporter
(``batchline.models.hf.export.export_encoder``, torch and transformers at conversion time
only). The file lands in ``batchline._cache.cache_dir() / "hf"``, named by a key over the
content of the weights and ``config.json``, the builder version and what the graph returns:
a second load reuses it, changed weights get a new file. Writes are whole or nothing
(``_cache.write_whole``).

Example::

    converted = convert(found, top="embedding")   # found = detect_folder(folder)
    converted.path, converted.how                 # (PosixPath('.../hf/bert-3f2a...onnx'), 'built')
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from batchline._cache import cache_dir, make_cache_folder, write_whole
from batchline._errors import ModelError
from batchline.models.common.folder import FolderModel

__all__ = ["Converted", "Top", "builder_covers", "convert", "convert_with"]

#: What the graph returns: pooled (and, for ``embedding``, normalized) vectors baked in,
#: the token vectors (``hidden``: pooling runs in numpy) or classifier ``logits``.
Top = Literal["embedding", "hidden", "logits"]


@dataclass(frozen=True)
class Converted:
    """An ONNX file for a folder: where it is and how it came to be (``built`` by our
    builder, ``exported`` with torch, or ``cached`` from an earlier load)."""

    path: Path
    how: Literal["built", "exported", "cached"]

    def describe(self) -> str:
        if self.how == "cached":
            return f"ONNX (converted before, cached at {self.path})"
        return f"ONNX ({self.how}, cached at {self.path})"


def builder_covers(found: FolderModel) -> bool:
    """Whether our own BERT builder writes this folder's graph (else torch exports it)."""
    from batchline.models.onnx import bert_covers

    if found.weights is None or found.weights.name != "model.safetensors":
        return False
    config = json.loads((found.encoder_folder / "config.json").read_text(encoding="utf-8"))
    return bert_covers(config)


def convert(
    found: FolderModel, *, top: Top, pooling: str = "mean", normalize: bool = True
) -> Converted:
    """The cached ONNX file of ``found`` returning ``top`` (see :data:`Top`); ``pooling``
    (``mean`` or ``cls``) and ``normalize`` shape an ``embedding`` top. Builds or exports it
    on the first call."""
    builder = builder_covers(found)
    if not builder and top == "embedding":
        raise ValueError("only the builder bakes pooling in: ask the exporter for 'hidden'")
    pairs = found.task == "score"
    options = {"top": top, "pooling": pooling, "normalize": normalize, "pairs": pairs}
    if builder:
        return convert_with(
            found,
            "builder",
            options,
            lambda target: write_whole(
                target, _build(found, top, pooling, normalize, pairs), "cache.hf"
            ),
        )
    return convert_with(found, "exporter", options, lambda target: _export(found, top, target))


def convert_with(
    found: FolderModel,
    route: str,
    options: Mapping[str, object],
    write: Callable[[Path], None],
) -> Converted:
    """The cached ONNX file of ``found`` that ``write(target)`` makes, keyed by ``route``,
    ``options`` and the folder's content: ``write`` runs only when no such file is cached,
    and must write ``target`` whole (``_cache.write_whole``) or not at all. Any failure but a
    ``ModelError`` becomes one ``ModelError`` line naming the folder. Every conversion here
    (the text encoders, ``batchline.models.image``'s image models) goes through it."""
    target = _target(found, route, options)
    if target.is_file():
        return Converted(target, "cached")
    make_cache_folder(target.parent)
    try:
        write(target)
    except ModelError:
        raise
    except Exception as exc:  # a broken weights file or config: one line, not a traceback
        raise ModelError(
            f"{found.folder}: cannot convert it to ONNX ({type(exc).__name__}: {exc})"
        ) from exc
    if not target.is_file():
        raise ModelError(f"{found.folder}: the conversion wrote no ONNX file")
    return Converted(target, "built" if route == "builder" else "exported")


def _target(found: FolderModel, route: str, options: Mapping[str, object]) -> Path:
    from batchline.models.onnx import BUILDER_VERSION

    digest = hashlib.sha256()
    digest.update(json.dumps({"route": route, "v": BUILDER_VERSION, **options}).encode())
    digest.update((found.encoder_folder / "config.json").read_bytes())
    for weights in _weight_files(found):
        digest.update(weights.name.encode())
        with weights.open("rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", found.folder.resolve().name or "model")
    kind = found.model_type or "model"
    return cache_dir() / "hf" / f"{stem}-{kind}-{digest.hexdigest()[:16]}.onnx"


def _weight_files(found: FolderModel) -> list[Path]:
    weights = found.weights
    if weights is None:
        raise ModelError(f"{found.folder}: no weights to convert")
    if weights.name.endswith(".index.json"):
        try:
            index = json.loads(weights.read_text(encoding="utf-8"))
            shards = sorted(set(index["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelError(f"{weights}: not a readable safetensors index ({exc})") from None
        return [weights.parent / s for s in shards]
    return [weights]


def _build(found: FolderModel, top: Top, pooling: str, normalize: bool, pairs: bool) -> bytes:
    from batchline.models.onnx import build_bert

    if top == "logits":
        model = build_bert(found.encoder_folder, head="classifier", token_types=pairs)
    elif top == "hidden":
        model = build_bert(found.encoder_folder, pooling="none", normalize=False)
    else:
        model = build_bert(
            found.encoder_folder,
            pooling="cls" if pooling == "cls" else "mean",
            normalize=normalize,
            graph_name=found.folder.resolve().name,
        )
    data: bytes = model.SerializeToString()
    return data


def _export(found: FolderModel, top: Top, target: Path) -> None:
    from batchline.models.hf.export import Head, export_encoder

    # export_encoder says what the folder needs (torch, or a type transformers knows); the
    # exporter writes the cache file itself, whole (and, past 2 GB, its weights beside it
    # as TARGET.data, moved into place first), so no copy is made of a large graph here
    head: Head = "logits" if top == "logits" else "hidden"
    export_encoder(found.encoder_folder, head=head, target=target)
