"""An OpenAI batch file's lines with ``n`` > 1, log-probabilities and ``echo``: each line's
completions in one response body, as the route answers (read back with the ``openai``
package's own types), on the tiny random Llama of test_generate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from batchline.models.config import Knobs

from .test_openai_batch import MODEL, chat, read_lines, run_batch, tiny, write_lines

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

__all__ = ["tiny"]  # the module fixture, imported for the tests below


def completion(custom_id: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": MODEL, "prompt": "2 + 2 =", "max_tokens": 4, **body},
    }


def test_n_logprobs_and_echo_lines(tiny: Path, tmp_path: Path) -> None:
    lines = [
        # req-0's prompt and settings with n=1, first: req-0's three are not answered from
        # its one (though greedy duplicates are otherwise computed once)
        chat(6, messages=[{"role": "user", "content": "question 0"}]),
        chat(0, n=3),  # greedy: three times one text
        chat(1, n=2, temperature=0.9, seed=5, logprobs=True, top_logprobs=2),
        completion("echo", echo=True, n=2, temperature=0),
        completion("lp", logprobs=1, temperature=0),
        completion("scored", echo=True, logprobs=0, temperature=0),
        chat(4),  # one plain choice, beside the others
        chat(
            5,
            messages=[{"role": "user", "content": "question 1"}],  # req-1's prompt
            n=3,
            temperature=0.9,
            seed=5,
            logprobs=True,
            top_logprobs=2,
        ),
    ]
    src = write_lines(tmp_path / "requests.jsonl", lines)
    out = tmp_path / "results.jsonl"
    run_batch(tiny, src, out)
    got = {g["custom_id"]: g for g in read_lines(out)}
    assert all(g["error"] is None for g in got.values()), got
    bodies = {k: g["response"]["body"] for k, g in got.items()}

    greedy = openai.types.chat.ChatCompletion.model_validate(bodies["req-0"])
    texts = [c.message.content for c in greedy.choices]
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len(set(texts)) == 1
    single = openai.types.chat.ChatCompletion.model_validate(bodies["req-6"])
    assert [c.message.content for c in single.choices] == texts[:1]
    plain = openai.types.chat.ChatCompletion.model_validate(bodies["req-4"])
    assert len(plain.choices) == 1
    assert plain.choices[0].logprobs is None
    assert greedy.usage is not None
    assert plain.usage is not None
    # the prompt counted once, every choice's tokens
    assert greedy.usage.completion_tokens == 3 * 5

    sampled = openai.types.chat.ChatCompletion.model_validate(bodies["req-1"])
    for c in sampled.choices:
        assert c.logprobs is not None
        assert c.logprobs.content is not None
        # a token per generated token (the random model's may end inside a character)
        assert 1 <= len(c.logprobs.content) <= 5
        assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
        assert all(t.logprob <= 0 for t in c.logprobs.content)
    # seed + i: the first two of n=3 with the same seed are the two of n=2
    three = openai.types.chat.ChatCompletion.model_validate(bodies["req-5"])
    assert [c.message.content for c in three.choices[:2]] == [
        c.message.content for c in sampled.choices
    ]

    echo = openai.types.Completion.model_validate(bodies["echo"])
    assert [c.text[: len("2 + 2 =")] for c in echo.choices] == ["2 + 2 ="] * 2
    lp = openai.types.Completion.model_validate(bodies["lp"])
    (choice,) = lp.choices
    assert choice.logprobs is not None
    tokens = choice.logprobs.tokens or []
    assert 1 <= len(tokens) == len(choice.logprobs.token_logprobs or []) <= 4
    assert choice.logprobs.text_offset == sorted(choice.logprobs.text_offset or [])
    # greedy: the picked token is the most likely one, so it heads its place's list
    top = choice.logprobs.top_logprobs or []
    assert [max(t, key=t.__getitem__) for t in top] == tokens
    # greedy, the same prompt: the echoed choices continue as the plain one
    assert echo.choices[0].text == "2 + 2 =" + choice.text
    # echo with logprobs: the prompt's tokens scored first, its first with nulls (as OpenAI
    # and vLLM answer; the openai package's strict validation wants numbers there, its
    # client reads responses leniently)
    (scored,) = bodies["scored"]["choices"]
    assert scored["text"] == echo.choices[0].text
    values = scored["logprobs"]["token_logprobs"]
    assert values[0] is None
    assert scored["logprobs"]["top_logprobs"][0] is None
    assert values[-len(tokens) :] == pytest.approx(choice.logprobs.token_logprobs)
    assert all(v <= 0 for v in values[1:])
    assert len(values) == len(scored["logprobs"]["tokens"]) > len(tokens)  # the prompt's too


def test_a_line_asking_more_than_the_job_keeps_in_flight_fails_alone(
    tiny: Path, tmp_path: Path
) -> None:
    src = write_lines(tmp_path / "requests.jsonl", [chat(0, n=128), chat(1)])
    out = tmp_path / "results.jsonl"
    run_batch(tiny, src, out, knobs=Knobs(dtype="float32", max_running_sequences=16))
    first, second = read_lines(out)
    # 16 running sequences at most, 4 x that in flight
    assert "n=128 is more than this job keeps in flight (64)" in first["error"]["message"]
    assert second["error"] is None
