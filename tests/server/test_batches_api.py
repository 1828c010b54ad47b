"""The Batch API in-process (``httpx.ASGITransport``, a tmp data directory, fake models):
files, batches, their statuses and files, keys, limits, cancel, expiry, resume, metrics."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("multipart")

import httpx

from batchline.models.generation.continuous import ContinuousGenerator
from batchline.models.generation.fake import FakeEngine
from batchline.server import create_app

from .conftest import GEN_TOK as TOK
from .conftest import (
    FakeEmbedder,
    FakeGenerateModel,
    client_on,
    fake_generator_loader,
    fake_vector,
    generated_text,
    loader,
    settings,
    wait_for,
)

#: What the openai client sends with every POST, a bodyless cancel included (a POST with a body
#: needs a JSON content type: docs/security.md; one with no body passes without one).
JSON = {"Content-Type": "application/json"}

pytestmark = pytest.mark.anyio

MODELS = {"model": ["emb=default", "gen=smollm2"], "model_name": None}
FINAL = ("completed", "failed", "expired", "cancelled")


@dataclass(eq=False)
class _GenModel(FakeGenerateModel):
    """The conftest's fake generate model with what a job's adapter reads of a
    ``GenerationModel``: its caps and ``encode``."""

    @property
    def max_running(self) -> int:
        return self.knobs.max_running_sequences

    @property
    def max_waiting(self) -> int:
        return self.knobs.max_queue_size

    def encode(self, prompt: Any, *, chat_template: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return self.encode_prompt(prompt)
        return self.encode_chat(prompt)


def _gen_loader() -> Any:
    plain = fake_generator_loader()

    def load(spec: Any, knobs: Any) -> _GenModel:
        m = plain(spec, knobs)
        return _GenModel(m.name, m.generator, m.engine, m.knobs)

    return load


@asynccontextmanager
async def app_on(
    data: Path, fake: FakeEmbedder | None = None, **overrides: Any
) -> AsyncIterator[httpx.AsyncClient]:
    model = fake if fake is not None else FakeEmbedder()
    app = create_app(
        settings(**{**MODELS, "data_dir": data, **overrides}),
        load_model=loader(model),
        load_generator=_gen_loader(),
    )
    async with client_on(app, release=model.gate.set) as client:
        yield client


def embed_line(i: int, text: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": f"emb-{i}",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": "emb", "input": text, **body},
    }


def chat_line(i: int, content: str) -> dict[str, Any]:
    return {
        "custom_id": f"chat-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "gen", "messages": [{"role": "user", "content": content}],
                 "max_tokens": 3},
    }  # fmt: skip


def jsonl(lines: Sequence[object]) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


async def upload(
    client: httpx.AsyncClient, data: bytes, *, key: str | None = None, name: str = "in.jsonl"
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return await client.post(
        "/v1/files", files={"file": (name, data)}, data={"purpose": "batch"}, headers=headers
    )


async def start_batch(
    client: httpx.AsyncClient, data: bytes, endpoint: str = "/v1/embeddings", **more: Any
) -> dict[str, Any]:
    made = await upload(client, data)
    assert made.status_code == 200, made.text
    body = {"input_file_id": made.json()["id"], "endpoint": endpoint, "completion_window": "24h"}
    r = await client.post("/v1/batches", json={**body, **more})
    assert r.status_code == 200, r.text
    batch: dict[str, Any] = r.json()
    return batch


async def until(client: httpx.AsyncClient, batch_id: str, statuses: Sequence[str]) -> Any:
    seen: dict[str, Any] = {}

    async def reached() -> bool:
        seen.update((await client.get(f"/v1/batches/{batch_id}")).json())
        return seen["status"] in statuses

    for _ in range(2000):  # bounded; not a timing assertion
        if await reached():
            return seen
        await asyncio.sleep(0.01)  # let the app run
    raise AssertionError(f"batch never reached {statuses}: {seen}")


async def content(client: httpx.AsyncClient, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    r = await client.get(f"/v1/files/{file_id}/content")
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.text.splitlines()]


async def test_files_are_stored_listed_read_and_deleted(tmp_path: Path) -> None:
    async with app_on(tmp_path / "data") as client:
        data = jsonl([embed_line(0, "one")])
        made = await upload(client, data, name="../../etc/passwd")
        assert made.status_code == 200, made.text
        f = made.json()
        assert f["object"] == "file"
        assert f["purpose"] == "batch"
        assert f["bytes"] == len(data)
        assert f["id"].startswith("file-")
        assert f["filename"] == "../../etc/passwd"
        # the name is metadata only: the bytes live under the id
        assert (tmp_path / "data" / "files" / f"{f['id']}.jsonl").read_bytes() == data
        assert (await client.get(f"/v1/files/{f['id']}")).json() == f
        listed = (await client.get("/v1/files")).json()
        assert [x["id"] for x in listed["data"]] == [f["id"]]
        assert (await client.get(f"/v1/files/{f['id']}/content")).content == data
        for bad in ("file-..", "file-zz", "x" * 300, "..%2Fmeta.sqlite3"):
            assert (await client.get(f"/v1/files/{bad}/content")).status_code == 404
        gone = await client.delete(f"/v1/files/{f['id']}")
        assert gone.json() == {"id": f["id"], "object": "file", "deleted": True}
        assert (await client.get(f"/v1/files/{f['id']}")).status_code == 404
        assert not (tmp_path / "data" / "files" / f"{f['id']}.jsonl").exists()
        wrong = await client.post(
            "/v1/files", files={"file": ("a", b"{}\n")}, data={"purpose": "fine-tune"}
        )
        assert wrong.status_code == 400
        assert "purpose" in wrong.json()["error"]["message"]


async def test_an_embeddings_batch_answers_every_line_once(tmp_path: Path) -> None:
    fake = FakeEmbedder()
    lines: list[object] = [embed_line(i, f"text number {i}") for i in range(7)]
    lines.insert(3, b"{not json")
    lines.append(embed_line(99, "x", model="nope"))
    async with app_on(tmp_path / "data", fake, batch_chunk_size=2) as client:
        batch = await start_batch(client, jsonl(lines), metadata={"job": "nightly"})
        assert batch["status"] == "validating"
        assert batch["metadata"] == {"job": "nightly"}
        done = await until(client, batch["id"], FINAL)
        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": 9, "completed": 7, "failed": 2}
        assert done["completed_at"] >= done["in_progress_at"] >= done["created_at"]
        out = await content(client, done["output_file_id"])
        assert [o["custom_id"] for o in out] == [f"emb-{i}" for i in range(7)]
        for i, o in enumerate(out):
            assert o["error"] is None
            assert o["response"]["status_code"] == 200
            vector = o["response"]["body"]["data"][0]["embedding"]
            assert np.allclose(vector, fake_vector(fake, f"text number {i}"), atol=1e-6)
        errors = await content(client, done["error_file_id"])
        assert [e["custom_id"] for e in errors] == [None, "emb-99"]
        assert all(e["response"] is None and e["error"]["message"] for e in errors)
        assert "nope" in errors[1]["error"]["message"]
        metrics = (await client.get("/metrics")).text
        assert 'batchline_batches{status="completed"} 1.0' in metrics
        assert 'batchline_batch_lines_total{outcome="completed"} 7.0' in metrics
        # the batch's records waited in the model's queue as batch work
        assert 'batchline_queue_wait_seconds_count{model="emb",priority="batch"}' in metrics


async def test_a_batch_file_is_parsed_once_before_its_lines_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Validation learns the kinds of model the lines ask for, so the run does not parse the
    file again (a file of pictures is hundreds of MB); a batch resumed after a restart, which
    was validated by the server before, still reads them from the file."""
    from batchline.server.batches import runner

    def never(path: Path) -> set[str]:
        raise AssertionError("the file was parsed a second time")

    monkeypatch.setattr(runner, "_kinds_asked", never)
    lines: list[object] = [embed_line(i, f"text {i}") for i in range(3)]
    async with app_on(tmp_path / "data", FakeEmbedder()) as client:
        batch = await start_batch(client, jsonl(lines))
        done = await until(client, batch["id"], FINAL)
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}


def test_validation_keeps_the_custom_ids_and_the_kinds_asked(tmp_path: Path) -> None:
    from batchline.server.batches.runner import _check_file, _kinds_asked
    from batchline.server.settings import ServerSettings

    path = tmp_path / "in.jsonl"
    chat = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {}}
    rows = [json.dumps(embed_line(1, "a")), json.dumps(chat), "{not json"]
    path.write_text("\n".join(rows) + "\n")
    kinds: set[str] = set()
    total, errors = _check_file(path, ServerSettings(), kinds)
    assert (total, errors) == (3, [])
    assert kinds == _kinds_asked(path) == {"embed", "generate"}
    dupes = tmp_path / "dupes.jsonl"
    dupes.write_text(json.dumps(chat) + "\n" + json.dumps(chat) + "\n")
    _, (error,) = _check_file(dupes, ServerSettings())
    assert error["code"] == "duplicate_custom_id"
    assert "lines 1 and 2" in str(error["message"])


async def test_a_chat_batch_runs_on_the_served_generator(tmp_path: Path) -> None:
    async with app_on(tmp_path / "data") as client:
        lines = [chat_line(i, f"hello {i}") for i in range(4)]
        batch = await start_batch(client, jsonl(lines), endpoint="/v1/chat/completions")
        done = await until(client, batch["id"], FINAL)
        assert done["status"] == "completed", done
        out = await content(client, done["output_file_id"])
        for i, o in enumerate(out):
            body = o["response"]["body"]
            assert body["object"] == "chat.completion"
            assert body["model"] == "gen"
            ids = TOK.encode(f"<user>hello {i}\n<assistant>")
            assert body["choices"][0]["message"]["content"] == generated_text(ids, 3)
        assert done["error_file_id"] is None


async def test_a_file_that_is_not_jsonl_fails_the_batch(tmp_path: Path) -> None:
    async with app_on(tmp_path / "data") as client:
        batch = await start_batch(client, b"name,text\n1,hello\n")
        done = await until(client, batch["id"], FINAL)
        assert done["status"] == "failed"
        assert done["failed_at"] is not None
        codes = [(e["code"], e["line"]) for e in done["errors"]["data"]]
        assert codes == [("invalid_file", None), ("invalid_json_line", 1), ("invalid_json_line", 2)]
        assert done["output_file_id"] is None
        assert done["error_file_id"] is None


async def test_duplicate_custom_ids_fail_the_batch_naming_the_lines(tmp_path: Path) -> None:
    lines = [embed_line(0, "a"), embed_line(1, "b"), b"", embed_line(0, "c")]
    async with app_on(tmp_path / "data") as client:
        batch = await start_batch(client, jsonl(lines))
        done = await until(client, batch["id"], FINAL)
        assert done["status"] == "failed"
        (error,) = done["errors"]["data"]
        assert error["code"] == "duplicate_custom_id"
        assert error["line"] == 4
        assert "'emb-0'" in error["message"]
        assert "lines 1 and 4" in error["message"]


async def test_keys_own_their_files_and_batches(tmp_path: Path) -> None:
    async with app_on(tmp_path / "data", api_key="key-a, key-b") as client:
        a = {"Authorization": "Bearer key-a"}
        b = {"Authorization": "Bearer key-b"}
        assert (await upload(client, b"{}\n")).status_code == 401
        f = (await upload(client, jsonl([embed_line(0, "x")]), key="key-a")).json()
        body = {"input_file_id": f["id"], "endpoint": "/v1/embeddings"}
        assert (await client.post("/v1/batches", json=body, headers=b)).status_code == 404
        made = await client.post("/v1/batches", json=body, headers=a)
        assert made.status_code == 200, made.text
        batch_id = made.json()["id"]
        for path in (f"/v1/files/{f['id']}", f"/v1/files/{f['id']}/content",
                     f"/v1/batches/{batch_id}"):  # fmt: skip
            assert (await client.get(path, headers=a)).status_code == 200
            assert (await client.get(path, headers=b)).status_code == 404
        assert (await client.get("/v1/files", headers=b)).json()["data"] == []
        assert (await client.get("/v1/batches", headers=b)).json()["data"] == []
        cancel = await client.post(f"/v1/batches/{batch_id}/cancel", headers={**b, **JSON})
        assert cancel.status_code == 404
        assert (await client.delete(f"/v1/files/{f['id']}", headers=b)).status_code == 404


async def test_uploads_past_the_limits_get_413(tmp_path: Path) -> None:
    async with app_on(
        tmp_path / "data", max_batch_file_bytes=2000, max_batch_file_lines=3
    ) as client:
        big = await upload(client, b"x" * 200_000)  # Content-Length past the cap
        assert big.status_code == 413
        assert "max_batch_file_bytes" in big.text

        async def trickle() -> AsyncIterator[bytes]:  # no Content-Length: the bytes count
            yield b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n'
            for _ in range(100):
                yield b"y" * 1000
            yield b"\r\n--b--\r\n"

        streamed = await client.post(
            "/v1/files",
            content=trickle(),
            headers={"Content-Type": "multipart/form-data; boundary=b"},
        )
        assert streamed.status_code == 413, streamed.text
        over = await upload(client, b"x" * 2100)  # within the framing slack, past the cap
        assert over.status_code == 413
        assert "max_batch_file_bytes" in over.text
        lines = await upload(client, b"{}\n" * 4)
        assert lines.status_code == 413
        assert "max_batch_file_lines" in lines.text
        assert list((tmp_path / "data" / "files").iterdir()) == []  # nothing kept
        ok = await upload(client, b"{}\n" * 3)
        assert ok.status_code == 200, ok.text


async def test_cancel_mid_batch_keeps_what_was_answered(tmp_path: Path) -> None:
    fake = FakeEmbedder(gated=True)
    lines = [embed_line(i, f"t {i}") for i in range(6)]
    async with app_on(tmp_path / "data", fake, batch_chunk_size=2) as client:
        batch = await start_batch(client, jsonl(lines))
        await until(client, batch["id"], ("in_progress",))
        await wait_for(lambda: fake.gate.is_set() is False and len(fake.batches) == 0)
        r = await client.post(f"/v1/batches/{batch['id']}/cancel", headers=JSON)
        assert r.status_code == 200
        assert r.json()["status"] in ("cancelling", "cancelled")
        fake.gate.set()  # the batch in the model's hands may finish; the rest is withdrawn
        done = await until(client, batch["id"], FINAL)
        assert done["status"] == "cancelled"
        assert done["cancelled_at"] is not None
        answered = await content(client, done["output_file_id"]) if done["output_file_id"] else []
        errors = await content(client, done["error_file_id"])
        assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
        ids = sorted(x["custom_id"] for x in [*answered, *errors])
        assert ids == sorted(f"emb-{i}" for i in range(6))  # every line once
        counts = done["request_counts"]
        assert counts == {"total": 6, "completed": len(answered), "failed": len(errors)}
        again = await client.post(f"/v1/batches/{batch['id']}/cancel", headers=JSON)
        assert again.json()["status"] == "cancelled"


class _HoldsAfter(FakeEngine):
    """The fake step engine, whose steps wait (in the generator's thread) once ``answers``
    sequences have finished, until ``gate`` is set: a batch's later lines stay in flight."""

    def __init__(self, answers: int) -> None:
        super().__init__()
        self.answers = answers
        self.finished = 0
        self.gate = threading.Event()

    def step(self) -> Any:
        if self.finished >= self.answers and not self.gate.wait(timeout=30):
            raise RuntimeError("test gate never opened")
        outputs = super().step()
        self.finished += sum(o.finished for o in outputs)
        return outputs


async def test_a_cancelled_generation_batch_keeps_every_line_answered(tmp_path: Path) -> None:
    """Lines answered before the cancel are in the output file (they had been in no chunk, a
    chunk being 256 lines, and a block of 16 lines waited for its slowest: every answer of
    the block was said "cancelled before this request ran"); the others are batch_cancelled."""
    engines: list[_HoldsAfter] = []

    def load(spec: Any, knobs: Any) -> _GenModel:
        engine = _HoldsAfter(answers=3)
        engines.append(engine)
        generator = ContinuousGenerator(
            engine, TOK, max_running=1, max_waiting=knobs.max_queue_size, name=spec.name
        )
        return _GenModel(spec.name, generator, engine, knobs)

    fake = FakeEmbedder()
    app = create_app(
        settings(**{**MODELS, "data_dir": tmp_path / "data"}),
        load_model=loader(fake),
        load_generator=load,
    )
    lines = [chat_line(i, f"question {i}") for i in range(8)]
    async with client_on(app, release=lambda: [e.gate.set() for e in engines]) as client:
        batch = await start_batch(client, jsonl(lines), endpoint="/v1/chat/completions")
        await wait_for(lambda: bool(engines) and engines[0].finished >= 3)
        seen = await until(client, batch["id"], ("in_progress",))
        for _ in range(2000):  # the counts move as lines are answered (bounded)
            if seen["request_counts"]["completed"] == 3:
                break
            await asyncio.sleep(0.01)
            seen = (await client.get(f"/v1/batches/{batch['id']}")).json()
        assert seen["request_counts"]["completed"] == 3
        r = await client.post(f"/v1/batches/{batch['id']}/cancel", headers=JSON)
        assert r.status_code == 200
        done = await until(client, batch["id"], FINAL)
        engines[0].gate.set()
        assert done["status"] == "cancelled"
        answered = await content(client, done["output_file_id"])
        errors = await content(client, done["error_file_id"])
        assert sorted(a["custom_id"] for a in answered) == ["chat-0", "chat-1", "chat-2"]
        for a in answered:
            body = a["response"]["body"]
            assert body["choices"][0]["message"]["content"]
            assert body["usage"]["completion_tokens"] == 3
        assert sorted(e["custom_id"] for e in errors) == [f"chat-{i}" for i in range(3, 8)]
        assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
        assert done["request_counts"] == {"total": 8, "completed": 3, "failed": 5}


async def test_an_expired_window_keeps_the_partial_results(tmp_path: Path) -> None:
    fake = FakeEmbedder(gated=True)
    lines = [embed_line(i, f"t {i}") for i in range(4)]
    async with app_on(tmp_path / "data", fake) as client:
        batch = await start_batch(client, jsonl(lines), completion_window="1s")
        assert batch["expires_at"] == batch["created_at"] + 1
        done = await until(client, batch["id"], FINAL)
        assert done["status"] == "expired"
        assert done["expired_at"] is not None
        errors = await content(client, done["error_file_id"])
        assert [e["error"]["code"] for e in errors] == ["batch_expired"] * 4
        bad = await client.post(
            "/v1/batches",
            json={"input_file_id": batch["input_file_id"], "endpoint": "/v1/embeddings",
                  "completion_window": "forever"},
        )  # fmt: skip
        assert bad.status_code == 400
        assert "completion_window" in bad.text


class _StopsAfter(FakeEmbedder):
    """The fake embedder, whose gate closes after ``calls`` model calls: a batch stops there."""

    def __init__(self, calls: int) -> None:
        super().__init__()
        self.calls = calls

    def embed_tokens(self, texts: Any) -> Any:
        out = super().embed_tokens(texts)
        if len(self.batches) >= self.calls:
            self.gate.clear()
        return out


def committed_chunks(parts: Path) -> int:
    manifest = parts / "_manifest.json"
    return len(json.loads(manifest.read_text())["chunks"]) if manifest.is_file() else 0


async def test_a_stopped_server_resumes_its_batch_to_the_same_output(tmp_path: Path) -> None:
    # 150 lines: more than a block of the pipeline (64 lines), which is written whole
    lines = jsonl([embed_line(i, f"words {i} " * (i % 3 + 1)) for i in range(150)])
    fake = _StopsAfter(calls=70)
    one_a_call = {"batch_chunk_size": 2, "max_batch_size": 1}
    async with app_on(tmp_path / "a", fake, **one_a_call) as client:
        batch = await start_batch(client, lines)
        parts = tmp_path / "a" / "batches" / batch["id"] / "all.jsonl.parts"
        await wait_for(lambda: committed_chunks(parts) >= 2)
    # the server stopped mid-batch: two chunks committed, the batch unfinished
    again = FakeEmbedder()
    async with app_on(tmp_path / "a", again, **one_a_call) as client:
        done = await until(client, batch["id"], FINAL)
        assert done["status"] == "completed"
        assert done["request_counts"]["completed"] == 150
        resumed = (await client.get(f"/v1/files/{done['output_file_id']}/content")).content
    async with app_on(tmp_path / "b", **one_a_call) as client:
        whole = await until(client, (await start_batch(client, lines))["id"], FINAL)
        uninterrupted = (await client.get(f"/v1/files/{whole['output_file_id']}/content")).content
    # the same answers; the ids are the batch's own (another batch's differ)
    assert _without_ids(resumed) == _without_ids(uninterrupted)
    assert _ids(resumed).isdisjoint(_ids(uninterrupted))
    # the restarted server answered only what was not committed (one line per call)
    assert len(again.batches) <= 150 - 64


def _ids(output: bytes) -> set[str]:
    lines = [json.loads(x) for x in output.splitlines()]
    return {x["id"] for x in lines} | {x["response"]["request_id"] for x in lines}


def _without_ids(output: bytes) -> list[Any]:
    lines = [json.loads(x) for x in output.splitlines()]
    for x in lines:
        del x["id"], x["response"]["request_id"]
    return lines


async def test_two_batches_of_one_file_answer_with_ids_of_their_own(tmp_path: Path) -> None:
    lines = jsonl([chat_line(0, "hi"), embed_line(1, "words")])
    async with app_on(tmp_path / "a") as client:
        outputs = []
        for _ in range(2):
            done = await until(client, (await start_batch(client, lines))["id"], FINAL)
            outputs.append(await content(client, done["output_file_id"]))
    first, second = outputs
    assert [x["custom_id"] for x in first] == [x["custom_id"] for x in second]
    for a, b in zip(first, second, strict=True):
        assert a["id"] != b["id"]
        assert a["response"]["request_id"] != b["response"]["request_id"]
    assert first[0]["response"]["body"]["id"] != second[0]["response"]["body"]["id"]


async def test_batches_list_in_pages(tmp_path: Path) -> None:
    async with app_on(tmp_path / "data") as client:
        made = [await start_batch(client, jsonl([embed_line(0, "a")])) for _ in range(3)]
        first = (await client.get("/v1/batches", params={"limit": 2})).json()
        assert [b["id"] for b in first["data"]] == [made[2]["id"], made[1]["id"]]
        assert first["has_more"] is True
        assert first["last_id"] == made[1]["id"]
        rest = (await client.get("/v1/batches", params={"after": first["last_id"]})).json()
        assert [b["id"] for b in rest["data"]] == [made[0]["id"]]
        assert rest["has_more"] is False
        assert (await client.get("/v1/batches", params={"limit": 0})).status_code == 400
        wrong = await client.post(
            "/v1/batches",
            json={"input_file_id": made[0]["input_file_id"], "endpoint": "/v1/moderations"},
        )
        assert wrong.status_code == 400
        assert "endpoint" in wrong.text
        for b in made:
            await until(client, b["id"], FINAL)


async def test_a_batch_stopped_before_its_first_chunk_writes_every_line_as_not_run(
    tmp_path: Path,
) -> None:
    from batchline.jobs.openai_batch import BatchFiles

    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl([embed_line(0, "a"), embed_line(1, "b")]))
    files = BatchFiles(src, tmp_path / "all.jsonl", tmp_path / "all.jsonl.parts")
    files.parts.mkdir()  # the writer's folder, made before any manifest
    assert not files.started
    files.write_output(not_run=("batch_cancelled", "cancelled"))
    out = [json.loads(x) for x in files.output.read_text().splitlines()]
    assert [(o["custom_id"], o["error"]["code"]) for o in out] == [
        ("emb-0", "batch_cancelled"),
        ("emb-1", "batch_cancelled"),
    ]


@pytest.mark.usefixtures("fixed_footprints")
async def test_a_batch_loads_its_on_demand_model_and_holds_it_while_it_runs(
    tmp_path: Path,
) -> None:
    fake = FakeEmbedder(gated=True)
    lines = jsonl([embed_line(i, f"t {i}") for i in range(5)])
    overrides = {"model": ["emb=default", "other=default"], "memory_budget": "1000"}
    async with app_on(tmp_path / "data", fake, **overrides) as client:
        models = {m["id"]: m["state"] for m in (await client.get("/v1/models")).json()["data"]}
        assert models == {"emb": "unloaded", "other": "unloaded"}
        batch = await start_batch(client, lines)
        await until(client, batch["id"], ("in_progress",))
        await wait_for(lambda: len(fake.batches) == 0)
        models = {m["id"]: m["state"] for m in (await client.get("/v1/models")).json()["data"]}
        assert models["emb"] in ("loading", "resident")
        fake.gate.set()
        done = await until(client, batch["id"], FINAL)
        assert done["status"] == "completed", done
        assert done["request_counts"]["completed"] == 5


async def test_batches_past_the_running_cap_wait_their_turn(tmp_path: Path) -> None:
    fake = FakeEmbedder(gated=True)
    lines = jsonl([embed_line(i, f"t {i}") for i in range(3)])
    async with app_on(tmp_path / "data", fake, max_running_batches=1) as client:
        first = await start_batch(client, lines)
        second = await start_batch(client, lines)
        await until(client, first["id"], ("in_progress",))
        waiting = (await client.get(f"/v1/batches/{second['id']}")).json()
        assert waiting["status"] == "validating"  # the one slot is the first batch's
        fake.gate.set()
        done = [await until(client, b["id"], FINAL) for b in (first, second)]
        assert [d["status"] for d in done] == ["completed", "completed"]
        assert done[1]["in_progress_at"] >= done[0]["completed_at"]
