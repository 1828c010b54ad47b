"""OpenAI's ``Completion`` and ``ChatCompletion`` (not streamed), for ``/v1/completions`` and
``/v1/chat/completions`` and the batch files' completions and chat lines alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["completion_response", "usage"]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_response(
    *,
    id: str,
    created: int,
    model: str,
    chat: bool,
    choices: Sequence[tuple[str, str | None]],
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """A ``chat.completion`` (``chat``: each choice an assistant message) or a
    ``text_completion``; ``choices`` are ``(text, finish_reason)`` in order."""
    listed = []
    for index, (text, finish_reason) in enumerate(choices):
        choice: dict[str, Any] = {"index": index}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        listed.append(choice)
    return {
        "id": id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": listed,
        "usage": usage(prompt_tokens, completion_tokens),
    }
