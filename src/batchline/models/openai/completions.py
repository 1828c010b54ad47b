"""OpenAI's ``Completion`` and ``ChatCompletion`` (not streamed), for ``/v1/completions`` and
``/v1/chat/completions`` and the batch files' completions and chat lines alike, with their
``logprobs`` objects (:func:`chat_logprobs`, :func:`completion_logprobs`; streamed chunks
carry the same objects over their own tokens).

A token's text is what decoding that token alone gives; one that ends inside a character
reads U+FFFD, and its ``bytes`` are that text's UTF-8.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from batchline.models.generation import TokenLogprob

__all__ = ["Choice", "chat_logprobs", "completion_logprobs", "completion_response", "usage"]

#: A token id's text (the model's detokenizer on that token alone).
TokenText = Callable[[int], str]
TokenBytes = Callable[[int], bytes]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass(frozen=True, slots=True)
class Choice:
    """One choice of a response: its text, why it ended, and its ``logprobs`` object (None
    when not asked)."""

    text: str
    finish_reason: str | None
    logprobs: dict[str, object] | None = None


def completion_response(
    *,
    id: str,
    created: int,
    model: str,
    chat: bool,
    choices: Sequence[Choice],
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, object]:
    """A ``chat.completion`` (``chat``: each choice an assistant message) or a
    ``text_completion``; ``choices`` in order (their ``index``)."""
    listed = []
    for index, c in enumerate(choices):
        choice: dict[str, object] = {"index": index}
        if chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        choice["logprobs"] = c.logprobs
        choice["finish_reason"] = c.finish_reason
        listed.append(choice)
    return {
        "id": id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": listed,
        "usage": usage(prompt_tokens, completion_tokens),
    }


def _entry(
    token_id: int, logprob: float, text_of: TokenText, bytes_of: TokenBytes | None
) -> dict[str, object]:
    text = text_of(token_id)
    raw = bytes_of(token_id) if bytes_of is not None else text.encode("utf-8")
    return {"token": text, "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(
    logprobs: Sequence[TokenLogprob], text_of: TokenText, bytes_of: TokenBytes | None = None
) -> dict[str, object]:
    """A chat choice's ``logprobs``: ``{"content": [{"token", "logprob", "bytes",
    "top_logprobs": [...]}], "refusal": null}``; ``bytes`` from ``bytes_of`` (the token's own:
    ``models.generation.token_bytes``, whole for a token that holds part of a character),
    else the UTF-8 of its text."""
    content = [
        {
            **_entry(lp.token_id, lp.logprob, text_of, bytes_of),
            "top_logprobs": [_entry(t, v, text_of, bytes_of) for t, v in lp.top],
        }
        for lp in logprobs
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    logprobs: Sequence[TokenLogprob],
    text_of: TokenText,
    *,
    offset: int = 0,
    prompt: tuple[int, Sequence[TokenLogprob]] | None = None,
) -> dict[str, object]:
    """A text completion's ``logprobs``: parallel ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (each place's most likely tokens and the chosen one, text to
    log-probability) and ``text_offset`` (where each token starts in the choice's text,
    counting from ``offset``). With ``prompt`` (``echo``: its first token's id, and the log-
    probabilities of the others), the prompt's tokens come first, its first with nulls."""
    tokens: list[str] = []
    offsets: list[int] = []
    values: list[float | None] = []
    top: list[dict[str, float] | None] = []
    at = offset
    scored: list[TokenLogprob] = list(logprobs)
    if prompt is not None:
        first, rest = prompt
        text = text_of(first)
        tokens.append(text)
        offsets.append(at)
        values.append(None)
        top.append(None)
        at += len(text)
        scored = [*rest, *logprobs]
    for lp in scored:
        text = text_of(lp.token_id)
        tokens.append(text)
        offsets.append(at)
        at += len(text)
        values.append(lp.logprob)
        best = {text_of(t): v for t, v in lp.top}
        best.setdefault(text, lp.logprob)
        top.append(best)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": top,
        "text_offset": offsets,
    }
