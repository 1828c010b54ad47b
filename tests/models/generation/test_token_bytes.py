"""A token's own bytes for OpenAI's ``logprobs[].bytes``: a token that holds part of a
character gives that part, so that a client joining the tokens' bytes gets the text back (its
text alone reads U+FFFD, whose bytes had been sent)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

pytest.importorskip("tokenizers")

from tokenizers import decoders, pre_tokenizers

from batchline.models.generation.engine import TokenLogprob
from batchline.models.generation.fake import FakeTokenizer
from batchline.models.generation.token_bytes import (
    byte_level_bytes,
    byte_level_map,
    token_bytes_of,
)
from batchline.models.openai.completions import chat_logprobs


def _byte_level_pieces(data: bytes) -> list[str]:
    """``data`` as a byte-level BPE vocabulary writes it, one token a byte (the
    pre-tokenizer's own alphabet and mapping, not this module's)."""
    level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    pieces = level.pre_tokenize_str(data.decode("utf-8"))
    written = "".join(p for p, _ in pieces)
    assert len(written) == len(data)
    return list(written)


class _Stub:
    """A transformers tokenizer's face: ids to token strings, decode, its backend's decoder."""

    def __init__(self, pieces: Sequence[str], decoder: Any) -> None:
        self.pieces = list(pieces)
        self.backend_tokenizer = type("Backend", (), {"decoder": decoder})()

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.pieces[token_id]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids).replace("\u2581", " ")


def test_every_byte_reads_back_through_the_byte_level_alphabet() -> None:
    """Every byte UTF-8 text can hold (all but 0xC0, 0xC1 and 0xF5-0xFF), written by the
    tokenizers library's own pre-tokenizer, reads back; the alphabet is the library's."""
    text = "".join(map(chr, range(0x800)))  # 1- and 2-byte characters: 0x00-0xDF
    text += "".join(chr(lead << 12) for lead in range(1, 16))  # leads 0xE1-0xEF
    text += "\u0800\U00010000\U00040000\U00080000\U000c0000\U00100000"  # 0xE0, 0xF0-0xF4
    data = text.encode("utf-8")
    assert set(data) == set(range(256)) - {0xC0, 0xC1, *range(0xF5, 0x100)}
    assert byte_level_bytes("".join(_byte_level_pieces(data))) == data
    assert set(byte_level_map()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(byte_level_map().values()) == list(range(256))
    assert byte_level_bytes("<|im_end|>\u2581") is None  # not of the alphabet


def test_a_split_character_gives_its_own_bytes_and_they_join_into_the_text() -> None:
    text = "🍨 café"
    pieces = _byte_level_pieces(text.encode("utf-8"))
    of = token_bytes_of(_Stub(pieces, decoders.ByteLevel()))
    got = [of(i) for i in range(len(pieces))]
    assert got[0] == "🍨".encode()[:1]  # part of the emoji, not U+FFFD's bytes
    assert b"".join(got).decode("utf-8") == text


def test_sentencepiece_byte_fallback_and_plain_pieces() -> None:
    pieces = ["<0xF0>", "<0x9F>", "\u2581caf", "é", "<unk>"]
    of = token_bytes_of(_Stub(pieces, decoders.Sequence([decoders.ByteFallback()])))
    assert [of(0), of(1)] == [b"\xf0", b"\x9f"]
    assert of(2) == b" caf"  # decoded: the word mark is a space
    assert of(3) == "é".encode()


def test_chat_logprobs_take_the_tokens_bytes() -> None:
    tok = FakeTokenizer()
    ids = tok.encode("ñ!")  # two tokens for the ñ, one for the !
    scored = [TokenLogprob(i, -0.5, ((i, -0.5),)) for i in ids]
    shaped = chat_logprobs(scored, lambda i: tok.decode([i]), tok.token_bytes)
    entries = shaped["content"]
    assert isinstance(entries, list)
    assert [e["token"] for e in entries] == ["\ufffd", "\ufffd", "!"]
    assert bytes(b for e in entries for b in e["bytes"]).decode("utf-8") == "ñ!"
    assert entries[0]["top_logprobs"][0]["bytes"] == [0xC3]
    # without the tokens' own bytes, the text's: what had been sent
    plain = chat_logprobs(scored, lambda i: tok.decode([i]))["content"]
    assert isinstance(plain, list)
    assert plain[0]["bytes"] == [239, 191, 189]
