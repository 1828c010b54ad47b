from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchline.models.generation.stream import (
    GenerationDelta,
    GenerationStream,
    IncrementalDetokenizer,
    StopStringScanner,
)

from .gen_helpers import TOK

pytestmark = pytest.mark.anyio


# -- incremental detokenization -------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40), data=st.data())
def test_pieces_rebuild_the_text_and_never_carry_a_partial_character(
    text: str, data: st.DataObject
) -> None:
    ids = TOK.encode(text)
    detok = IncrementalDetokenizer(TOK, TOK.encode(data.draw(st.text(max_size=8))))
    pieces = []
    i = 0
    while i < len(ids):
        n = data.draw(st.integers(1, 4))
        pieces.append(detok.push(ids[i : i + n]))
        i += n
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    # a U+FFFD in a piece can only be one that is in the text itself
    assert sum(p.count("\ufffd") for p in pieces) == text.count("\ufffd")


def test_a_multibyte_character_is_emitted_when_its_last_byte_arrives() -> None:
    detok = IncrementalDetokenizer(TOK)
    ids = TOK.encode("😀")
    assert [detok.push([t]) for t in ids] == ["", "", "", "😀"]


def test_flush_emits_an_unfinished_character_as_a_replacement() -> None:
    detok = IncrementalDetokenizer(TOK)
    assert detok.push(TOK.encode("a")) == "a"
    assert detok.push(TOK.encode("😀")[:2]) == ""
    assert detok.flush() == "\ufffd"


class SpaceEatingTokenizer:
    """Like SentencePiece: a decode drops the leading space of its first token."""

    def decode(self, ids: Sequence[int]) -> str:
        return TOK.decode(ids).removeprefix(" ")


def test_prompt_context_keeps_the_first_generated_space() -> None:
    prompt = TOK.encode("Q: 2+2 =")
    with_context = IncrementalDetokenizer(SpaceEatingTokenizer(), prompt)
    assert with_context.push(TOK.encode(" 4")) == " 4"
    without = IncrementalDetokenizer(SpaceEatingTokenizer())
    assert without.push(TOK.encode(" 4")) == "4"


# -- stop strings ---------------------------------------------------------------------------


def scan(pieces: Sequence[str], stops: Sequence[str]) -> tuple[list[str], bool]:
    scanner = StopStringScanner(stops)
    out = []
    for piece in pieces:
        emitted, stopped = scanner.feed(piece)
        out.append(emitted)
        if stopped:
            return out, True
    out.append(scanner.flush())
    return out, False


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc\n", max_size=30),
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=3),
    data=st.data(),
)
def test_the_text_is_cut_before_the_first_stop_string_however_it_is_split(
    text: str, stops: list[str], data: st.DataObject
) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    out, stopped = scan(pieces, stops)
    # the rule: after each piece, cut before the earliest stop string in the text so far
    expected, found = text, False
    received = ""
    for piece in pieces:
        received += piece
        at = [i for i in (received.find(s) for s in stops) if i != -1]
        if at:
            expected, found = received[: min(at)], True
            break
    assert "".join(out) == expected
    assert stopped == found
    # nothing emitted is ever taken back: each prefix of the output is a prefix of the result
    assert all(expected.startswith("".join(out[:k])) for k in range(len(out) + 1))


def test_a_possible_stop_prefix_is_held_back_then_released() -> None:
    scanner = StopStringScanner(["STOP"])
    assert scanner.feed("go ST") == ("go ", False)
    assert scanner.feed("ay") == ("STay", False)
    assert scanner.feed("S") == ("", False)
    assert scanner.feed("TOP!") == ("", True)


# -- the stream object ----------------------------------------------------------------------


async def test_stream_delivers_deltas_then_the_result() -> None:
    aborted: list[str] = []
    stream = GenerationStream("r", 3, on_abort=aborted.append)
    stream._push(GenerationDelta("a", (1,)))
    stream._push(GenerationDelta("b", (2,), True, "length"))
    from batchline.models.generation.stream import Completion

    stream._complete(Completion("ab", (1, 2), 3, 2, "length", 0.1, 0.2))
    assert [d.text async for d in stream] == ["a", "b"]
    assert (await stream.result()).text == "ab"
    stream.abort()  # finished: nothing to abort
    assert aborted == []
    assert stream.done


async def test_abort_is_requested_once() -> None:
    aborted: list[str] = []
    stream = GenerationStream("r", 3, on_abort=aborted.append)
    stream.abort()
    stream.abort()
    assert aborted == ["r"]


async def test_a_waiting_iterator_wakes_on_a_delta() -> None:
    stream = GenerationStream("r", 1, on_abort=lambda _: None)
    task = asyncio.create_task(stream.__anext__())
    await asyncio.sleep(0)
    assert not task.done()
    stream._push(GenerationDelta("x", (1,)))
    assert (await task).text == "x"


async def test_completions_wait_for_progress_not_for_the_whole_answer() -> None:
    """On a manual clock: tokens 6 units apart go on past a 10-unit timeout in all, and the
    answers come back in order once every stream ends; 10 units without a token from any
    stream is a TimeoutError that aborts the streams still running."""
    from batchline import ManualClock
    from batchline.models.generation.stream import Completion, completions_of

    clock = ManualClock()
    aborted: list[str] = []
    streams = [
        GenerationStream(f"r{i}", 3, on_abort=aborted.append, clock=clock.now) for i in range(2)
    ]
    for k in range(5):  # 30 units in all: three timeouts, none of them without progress
        clock.advance(6.0)
        streams[k % 2]._push(GenerationDelta(f"t{k}", (k,)))
    waiting = asyncio.ensure_future(completions_of(streams, 10.0, now=clock.now))
    await asyncio.sleep(0)
    assert not waiting.done()  # 6 units since the last token: it waits on
    for i in (1, 0):
        streams[i]._complete(Completion(f"a{i}", (i,), 3, 1, "length", 0.1, 0.2))
    assert [c.text for c in await waiting] == ["a0", "a1"]
    assert aborted == []

    stuck = [GenerationStream(f"s{i}", 3, on_abort=aborted.append, clock=clock.now) for i in (0, 1)]
    stuck[0]._complete(Completion("done", (1,), 3, 1, "length", 0.1, 0.2))
    clock.advance(10.0)  # no progress from either since: that is the timeout
    with pytest.raises(TimeoutError):
        await completions_of(stuck, 10.0, now=clock.now)
    assert aborted == ["s1"]


async def test_completions_end_at_the_first_error() -> None:
    from batchline.models.generation.stream import completions_of

    aborted: list[str] = []
    streams = [GenerationStream(f"r{i}", 3, on_abort=aborted.append) for i in range(2)]
    waiting = asyncio.ensure_future(completions_of(streams, 60.0))
    await asyncio.sleep(0)
    streams[1]._fail(RuntimeError("the step failed"))
    with pytest.raises(RuntimeError, match="the step failed"):
        await waiting
    assert aborted == ["r0"]


def test_the_request_level_layer_imports_without_torch_or_vllm() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import batchline.models.generation.continuous, batchline.models.generation.static\n"
        "import batchline.models.generation.stream, batchline.models.generation.stats\n"
        "import batchline.models.generation.fake, batchline.models.generation.demo\n"
        "import batchline.models.generation.vllm_generator\n"
        "heavy = [m for m in ('torch', 'transformers', 'vllm', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
