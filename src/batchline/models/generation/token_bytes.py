"""The UTF-8 bytes one token stands for, for the ``bytes`` of OpenAI's log-probabilities.

A token can hold part of a character (an emoji is often three or four tokens): decoded alone
it reads U+FFFD, whose bytes say nothing of the token. ``bytes`` exist so that a client can
join such tokens back into text, so they come from the token itself:

- a byte-level BPE vocabulary (GPT-2's, SmolLM2's, Llama 3's, Qwen2's: the tokenizer's decoder
  is ``tokenizers``' ``ByteLevel``) writes each byte as one printable character, the printable
  Latin-1 bytes as themselves and the other 68 as U+0100 onward, in byte order;
- a SentencePiece vocabulary with byte fallback writes a byte it has no piece for as
  ``<0xNN>``;
- anything else is the token's decoded text (whole characters there).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

__all__ = ["byte_level_bytes", "byte_level_map", "token_bytes_of"]

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def byte_level_map() -> dict[str, int]:
    """The byte-level alphabet read back: each of its 256 characters to the byte it writes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def byte_level_bytes(piece: str) -> bytes | None:
    """The bytes a byte-level BPE token's string stands for; None where a character of it is
    not of the alphabet (an added token written as text)."""
    table = byte_level_map()
    try:
        return bytes(table[ch] for ch in piece)
    except KeyError:
        return None


def token_bytes_of(tokenizer: Any) -> Callable[[int], bytes]:
    """``token_id -> bytes`` for a transformers tokenizer (see the module)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    byte_level = type(decoder).__name__ == "ByteLevel"

    def of(token_id: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if byte_level:
                found = byte_level_bytes(piece)
                if found is not None:
                    return found
            fallback = _BYTE_PIECE.fullmatch(piece)
            if fallback is not None:
                return bytes([int(fallback.group(1), 16)])
        text = tokenizer.decode([token_id], skip_special_tokens=True)
        return str(text).encode("utf-8")

    return of
