"""A GGUF file's metadata scalars and tensors, read without parsing its vocabulary.

gguf-py's ``GGUFReader`` builds a numpy view of every metadata value, the tokenizer's tens of
thousands of tokens and merges included: 5-10 s for SmolLM2's 98 MB file on this 2-core host,
most of a load. The weights need only the scalars (the architecture) and the tensor table, so
this reads the container itself (GGUF v2/v3, little-endian: a header, the key/value pairs, the
tensor infos, the aligned data) and skips the arrays by their lengths; the tensors are views of
one ``numpy.memmap`` of the file, shaped as gguf-py shapes them (rows of block bytes for a
quantized type). The tokenizer, where the file gives it, is read by transformers.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    import numpy as np

__all__ = ["GgufFile", "GgufTensor", "read_gguf"]

_MAGIC = b"GGUF"
# value type -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_ALIGNMENT = 32


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """One tensor: its name, GGML type (``gguf.GGMLQuantizationType``'s value) and bytes, a
    read-only view of the file, ``(..., rows, row bytes)`` uint8 whatever the type
    (``gguf.quants.dequantize`` takes them so)."""

    name: str
    tensor_type: int
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class GgufFile:
    """The metadata scalars (arrays left out: ``None``) and the tensors of a GGUF file, and
    where its tensor data starts (the bytes of its header, metadata and tensor table, padded
    to the alignment)."""

    metadata: dict[str, Any]
    tensors: list[GgufTensor]
    header_bytes: int


def read_gguf(path: Path) -> GgufFile:
    """Read ``path``'s header, metadata scalars and tensor table; ``ValueError`` where it is
    not a GGUF file this reads (a bad magic, another version, truncated)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with path.open("rb") as f:
        if f.read(4) != _MAGIC:
            raise ValueError(f"{path.name} is not a GGUF file (no GGUF magic)")
        version, tensors, pairs = struct.unpack("<IQQ", _exact(f, 20))
        if version not in (2, 3):
            raise ValueError(f"{path.name} is GGUF version {version}; this reads 2 and 3")
        metadata = {}
        for _ in range(pairs):
            key = _string(f)
            (kind,) = struct.unpack("<I", _exact(f, 4))
            metadata[key] = _value(f, kind)
        infos = []
        for _ in range(tensors):
            name = _string(f)
            (dims,) = struct.unpack("<I", _exact(f, 4))
            shape = struct.unpack(f"<{dims}Q", _exact(f, 8 * dims))
            kind, offset = struct.unpack("<IQ", _exact(f, 12))
            infos.append((name, shape, kind, offset))
        alignment = int(metadata.get("general.alignment") or _ALIGNMENT)
        start = -(-f.tell() // alignment) * alignment
    data = np.memmap(path, mode="r", dtype=np.uint8)
    out = []
    for name, shape, kind, offset in infos:
        qtype = GGMLQuantizationType(kind)
        block, size = GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(shape[1:], dtype=np.int64))
        row_bytes = shape[0] // block * size
        first = start + offset
        raw = data[first : first + rows * row_bytes]
        if raw.size != rows * row_bytes:
            raise ValueError(f"{path.name} is truncated (tensor {name})")
        out.append(GgufTensor(name, kind, raw.reshape(*reversed(shape[1:]), row_bytes)))
    return GgufFile(metadata, out, start)


def _exact(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError("the GGUF file is truncated")
    return data


def _string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", _exact(f, 8))
    return _exact(f, n).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int) -> Any:
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, _exact(f, struct.calcsize(fmt)))[0]
    if kind == _STRING:
        return _string(f)
    if kind != _ARRAY:
        raise ValueError(f"the GGUF file holds a value of unknown type {kind}")
    item, count = struct.unpack("<IQ", _exact(f, 12))
    if item in _SCALARS:
        f.seek(count * struct.calcsize(_SCALARS[item]), 1)
    else:
        for _ in range(count):
            _value(f, item)  # strings (the vocabulary), nested arrays
    return None
