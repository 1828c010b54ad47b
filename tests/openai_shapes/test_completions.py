"""OpenAI's Completion and ChatCompletion (``batchline.models.openai.completions``): what the routes
and the batch files both write."""

from __future__ import annotations

from batchline.models.generation import TokenLogprob
from batchline.models.openai.completions import (
    Choice,
    chat_logprobs,
    completion_logprobs,
    completion_response,
)

TEXT = {10: "Hi", 11: " there", 12: "é", 13: "!"}


def test_a_chat_completion_has_openais_shape() -> None:
    body = completion_response(
        id="chatcmpl-1",
        created=5,
        model="m",
        chat=True,
        choices=[Choice("hi", "stop")],
        prompt_tokens=3,
        completion_tokens=1,
    )
    assert body == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 5,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }


def test_a_completion_has_a_text_choice_per_prompt() -> None:
    body = completion_response(
        id="cmpl-1",
        created=5,
        model="m",
        chat=False,
        choices=[Choice("a", "length"), Choice("b", "stop")],
        prompt_tokens=6,
        completion_tokens=2,
    )
    assert body["object"] == "text_completion"
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "a", "length"),
        (1, "b", "stop"),
    ]
    assert body["usage"]["total_tokens"] == 8


def test_chat_logprobs_have_openais_shape() -> None:
    tokens = [TokenLogprob(10, -0.5, ((10, -0.5), (13, -1.5))), TokenLogprob(12, -0.25)]
    assert chat_logprobs(tokens, TEXT.__getitem__) == {
        "content": [
            {
                "token": "Hi",
                "logprob": -0.5,
                "bytes": [72, 105],
                "top_logprobs": [
                    {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
                    {"token": "!", "logprob": -1.5, "bytes": [33]},
                ],
            },
            {"token": "é", "logprob": -0.25, "bytes": [195, 169], "top_logprobs": []},
        ],
        "refusal": None,
    }


def test_completion_logprobs_are_parallel_lists_with_text_offsets() -> None:
    tokens = [
        TokenLogprob(10, -0.5, ((13, -0.1), (10, -0.5))),  # picked, not the most likely
        TokenLogprob(11, -0.25),
    ]
    got = completion_logprobs(tokens, TEXT.__getitem__, offset=4)
    assert got == {
        "tokens": ["Hi", " there"],
        "token_logprobs": [-0.5, -0.25],
        # each place's most likely tokens, and the picked one (logprobs=0: that one alone)
        "top_logprobs": [{"!": -0.1, "Hi": -0.5}, {" there": -0.25}],
        "text_offset": [4, 6],
    }
