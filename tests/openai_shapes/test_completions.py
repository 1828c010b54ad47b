"""OpenAI's Completion and ChatCompletion (``batchline.models.openai.completions``): what the routes
and the batch files both write."""

from __future__ import annotations

from batchline.models.openai.completions import completion_response


def test_a_chat_completion_has_openais_shape() -> None:
    body = completion_response(
        id="chatcmpl-1",
        created=5,
        model="m",
        chat=True,
        choices=[("hi", "stop")],
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
        choices=[("a", "length"), ("b", "stop")],
        prompt_tokens=6,
        completion_tokens=2,
    )
    assert body["object"] == "text_completion"
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "a", "length"),
        (1, "b", "stop"),
    ]
    assert body["usage"]["total_tokens"] == 8
