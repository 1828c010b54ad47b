"""The seed's whole flow: two real ``batchline serve --model gen=PATH/`` replicas, ``batchline
drive --route generate`` fanning a prompts file out to them, every prompt's text written
exactly once, in order, and equal to what ``batchline run --model PATH/`` generates offline.

The model is the tiny random Llama saved as a Hugging Face folder (it has a chat template).
``drive --max-tokens N`` sends ``max_tokens`` with each chunk (greedy); by default both
``drive`` and ``run`` send each prompt through the chat template (``"chat": true`` in the
``/generate`` body), and with ``--no-chat-template`` both send it raw. Either way the two write
the same columns and texts. Assertions are on counts, order and contents, never on time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchline.__main__ import main
from batchline._cache import cache_dir
from batchline.datasets.sinks import read_output
from tests.driver.procs import Procs, processes

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CONTEXT = 64  # small and fast; prompts + max_tokens fit
N_PROMPTS = 14


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from tests.models.generation.test_load import save_tiny_generator

    torch.set_num_threads(1)
    return save_tiny_generator(tmp_path_factory.mktemp("gen") / "tiny", context_tokens=CONTEXT)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    with processes(tmp_path) as p:
        yield p


def prompts() -> list[str]:
    # ASCII, one byte per token (byte-level tokenizer, no merges): equal token counts
    topics = ["batching", "the sea", "queues", "a lazy dog", "resumes", "tea"]
    return [f"Prompt {i:02d} is about {topics[i % len(topics)]:<10}." for i in range(N_PROMPTS)]


def test_drive_over_two_replicas_writes_each_prompts_text_once_in_order_as_run_does(
    tiny: Path, tmp_path: Path, procs: Procs, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cache of the test's own, but the session's kernel library in it: from an empty one the
    # first replica would build the library (44 s on 2 cores) while the other waited for it,
    # most of wait_ready's 120 s beside the suite's other worker (before the build lock, each
    # built it at once with the other and ran past that in a CI run, 2026-12-06).
    kernels = cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to(kernels, target_is_directory=True)
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path / "cache"))
    texts = prompts()
    src = tmp_path / "prompts.jsonl"
    src.write_text(
        "".join(json.dumps({"id": f"p{i}", "text": t}) + "\n" for i, t in enumerate(texts)),
        encoding="utf-8",
    )
    max_tokens = 12

    a = procs.serve("--model", f"gen={tiny}/", name="a")
    b = procs.serve("--model", f"gen={tiny}/", name="b")
    a.wait_ready()
    b.wait_ready()
    out = tmp_path / "driven"
    argv = ["drive", str(src), "--route", "generate", "--endpoint", a.url, "--endpoint", b.url]
    argv += ["-o", str(out), "--records-per-request", "4", "--concurrency", "4", "--quiet"]
    argv += ["--max-tokens", str(max_tokens), "--no-chat-template"]
    assert main(argv) == 0, a.output()[-2000:] + b.output()[-2000:]

    offline = tmp_path / "offline"
    argv = ["run", str(src), "--model", f"{tiny}/", "-o", str(offline), "--quiet"]
    argv += ["--no-chat-template", "--max-tokens", str(max_tokens)]
    assert main(argv) == 0

    driven = read_output(out).to_pylist()
    expected = read_output(offline).to_pylist()
    # exactly once, in order: one row per prompt, indices 0..n-1
    assert [r["index"] for r in driven] == list(range(N_PROMPTS))
    assert [r["id"] for r in driven] == [f"p{i}" for i in range(N_PROMPTS)]
    assert [r["index"] for r in expected] == list(range(N_PROMPTS))
    # the same greedy text through two replicas as offline
    assert [r["text"] for r in driven] == [r["text"] for r in expected]
    assert any(r["text"] for r in expected)  # the comparison is not of empty strings
    # both replicas generated, and the prompts were generated once between them
    served = [finished(server.url) for server in (a, b)]
    assert all(n > 0 for n in served)
    assert sum(served) == N_PROMPTS

    # the defaults: both through the chat template, the same columns and the same texts
    chat_driven = tmp_path / "chat-driven"
    argv = ["drive", str(src), "--route", "generate", "--endpoint", a.url, "--endpoint", b.url]
    argv += ["-o", str(chat_driven), "--records-per-request", "4", "--quiet"]
    argv += ["--max-tokens", str(max_tokens)]
    assert main(argv) == 0, a.output()[-2000:] + b.output()[-2000:]
    chat_offline = tmp_path / "chat-offline"
    argv = ["run", str(src), "--model", f"{tiny}/", "-o", str(chat_offline), "--quiet"]
    argv += ["--max-tokens", str(max_tokens)]
    assert main(argv) == 0
    got, want = read_output(chat_driven), read_output(chat_offline)
    assert got.column_names == want.column_names
    assert {"text", "finish_reason", "prompt_tokens", "completion_tokens"} <= set(got.column_names)
    assert got.to_pylist() == want.to_pylist()  # ids, texts, finish reasons, token counts
    # the template was applied: the prompts are longer than the raw ones
    raw_tokens = [r["prompt_tokens"] for r in expected]
    assert all(
        c > r for c, r in zip(got.column("prompt_tokens").to_pylist(), raw_tokens, strict=True)
    )


def finished(url: str) -> int:
    """Requests a replica's generation routes finished (its Prometheus counter)."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=10.0).text
    return round(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("batchline_generation_finished_total{")
        )
    )
