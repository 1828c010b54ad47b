"""``batchline bench`` and ``batchline tune`` end to end: the CLI, HTTP mode against a small
fake server, and short in-process runs on the real default model (no timing assertions)."""

from __future__ import annotations

import asyncio
import json
import shlex
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from batchline.__main__ import main
from batchline._errors import InputError
from batchline.bench.loadgen import LoadPoint, run_point
from batchline.bench.runner import BenchOptions, configurations
from batchline.bench.targets import HttpTarget, embeddings_url
from batchline.models.config import Knobs

TEXTS = [
    "A short one.",
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "Batching fills the device; waiting for company costs latency.",
    "Embeddings map text to vectors; similar meanings land close together in that space.",
] * 5


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    path = tmp_path / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return path


def test_help_lists_both_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "bench" in out
    assert "tune" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--load", "burst:3"], "--load"),
        (["bench", "--compare", "fastest"], "unknown reference"),
        (["bench", "--model", "nope.bin"], "model spec"),
        (["bench", "--device", "tpu"], "device must be"),
        (["tune", "--p99-ms", "9", "--model", "smollm2"], "bench --task generate"),
        (["bench", "--target", "ftp://x"], "--target"),
        (["tune", "--p99-ms", "0"], "--p99-ms"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main([*argv, "--inputs", str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_configs_apply_only_in_process(tmp_path: Path) -> None:
    cfg = tmp_path / "k.json"
    Knobs().dump(cfg)
    with pytest.raises(InputError, match="in-process"):
        configurations(BenchOptions(target="http://127.0.0.1:1", configs=[cfg]))
    names = [c.name for c in configurations(BenchOptions(configs=[cfg, cfg]))]
    assert names == ["baseline", "batchline defaults", "classic timeout", "k", "k'"]


def test_embeddings_url() -> None:
    assert embeddings_url("http://h:8000") == "http://h:8000/v1/embeddings"
    assert embeddings_url("http://h:8000/") == "http://h:8000/v1/embeddings"
    assert embeddings_url("http://h/api/v1/embeddings") == "http://h/api/v1/embeddings"


# -- HTTP mode against a fake server --------------------------------------------------------


class FakeServer:
    """Speaks just enough HTTP/1.1: keep-alive, sometimes chunked, sometimes 503, sometimes
    closing the connection after answering."""

    def __init__(self) -> None:
        self.requests: list[dict[str, object]] = []
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                assert line.startswith(b"POST /v1/embeddings HTTP/1.1")
                length = 0
                while (header := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = header.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                self.requests.append(json.loads(await reader.readexactly(length)))
                n = len(self.requests)
                body = json.dumps({"object": "list", "data": [{"embedding": [0.5] * 8}]}).encode()
                status = b"503 Service Unavailable" if n % 7 == 0 else b"200 OK"
                if n % 5 == 0:
                    writer.write(
                        b"HTTP/1.1 "
                        + status
                        + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
                        + b"%x\r\n" % len(body)
                        + body
                        + b"\r\n0\r\n\r\n"
                    )
                else:
                    close = n % 3 == 0
                    writer.write(
                        b"HTTP/1.1 "
                        + status
                        + b"\r\nContent-Type: application/json\r\n"
                        + b"Content-Length: %d\r\n" % len(body)
                        + (b"Connection: close\r\n" if close else b"")
                        + b"\r\n"
                        + body
                    )
                    if close:
                        await writer.drain()
                        return
                await writer.drain()
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


@pytest.fixture
async def fake_server() -> AsyncIterator[tuple[FakeServer, str]]:
    server = FakeServer()
    async with server as url:
        yield server, url


@pytest.mark.anyio
async def test_http_target_against_a_fake_server(fake_server: tuple[FakeServer, str]) -> None:
    server, url = fake_server
    async with HttpTarget(url, TEXTS) as target:
        result = await run_point(target, LoadPoint("closed", 4), duration_s=0.3, config=url)
        assert target.counters() is None
        open_result = await run_point(target, LoadPoint("open", 200), duration_s=0.3)
    total = result.sent + open_result.sent
    assert len(server.requests) == total
    assert {r["input"] for r in server.requests} <= set(TEXTS)
    errors = result.errors + open_result.errors
    assert errors == total // 7  # every seventh answer was a 503
    assert result.unanswered == open_result.unanswered == 0
    assert result.avg_batch_size is None
    assert result.utilization is None


@pytest.mark.anyio
async def test_bench_http_mode(
    fake_server: tuple[FakeServer, str], inputs: Path, tmp_path: Path
) -> None:
    from batchline.bench.report import write_report
    from batchline.bench.runner import run_bench_async

    _, url = fake_server
    options = BenchOptions(
        target=url,
        loads=[LoadPoint("closed", 2)],
        duration_s=0.3,
        warmup_s=0.1,
        inputs=inputs,
    )
    result = await run_bench_async(options)
    assert [c.kind for c in result.configurations] == ["http"]
    assert result.points[0].completed > 0
    files = write_report(result, tmp_path / "report")
    assert "/v1/embeddings" in files["report"].read_text()


# -- in-process, on the real model -----------------------------------------------------------


@pytest.mark.slow
def test_bench_end_to_end_on_the_real_model(
    inputs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("onnxruntime")
    config = tmp_path / "mine.json"
    Knobs(target_batch_tokens=256).dump(config)
    out = tmp_path / "report"
    code = main(
        [
            "bench",
            "--inputs", str(inputs),
            "--load", "closed:4",
            "--duration", "1",
            "--warmup", "0.2",
            "--config", str(config),
            "-o", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    md = (out / "report.md").read_text()
    for name in ("baseline", "batchline defaults", "classic timeout", "mine"):
        assert f"| {name} | closed | 4 clients |" in md
    assert (out / "throughput-closed.png").stat().st_size > 1000
    assert (out / "p99-closed.png").stat().st_size > 1000
    data = json.loads((out / "results.json").read_text())
    assert len(data["points"]) == 4
    assert all(p["completed"] > 0 for p in data["points"])
    printed = capsys.readouterr().out
    assert "batchline defaults" in printed


@pytest.mark.slow
def test_tune_end_to_end_on_the_real_model(
    inputs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("onnxruntime")
    out = tmp_path / "tuned.json"
    code = main(
        [
            "tune",
            "--p99-ms", "60000",
            "--inputs", str(inputs),
            "--load", "closed:2",
            "--budget-s", "4",
            "--duration", "0.3",
            "-o", str(out),
        ]
    )  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err
    knobs = Knobs.load(out)  # what batchline run/serve --config read
    measured = json.loads(out.read_text())["measured"]
    assert measured["verdict"] in ("batching", "baseline")
    assert measured["p99_ms"] <= 60000
    assert knobs.batching == (measured["verdict"] == "batching")
    assert "skipping" in printed.err  # a 4 s budget cannot cover the whole search
    assert f"Wrote {out}" in printed.out.replace("\n", "")


@pytest.mark.slow
def test_a_tuned_toml_file_works_where_tune_says_it_does(
    inputs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Follow tune's printed instructions for a .toml output: every command it names reads it."""
    pytest.importorskip("onnxruntime")
    out = tmp_path / "tuned.toml"
    code = main(
        [
            "tune",
            "--p99-ms", "60000",
            "--inputs", str(inputs),
            "--load", "closed:2",
            "--budget-s", "3",
            "--duration", "0.3",
            "-o", str(out),
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    assert out.read_text().startswith("batching = ")  # TOML, not JSON in a .toml file
    commands = [
        shlex.split(line.strip())
        for line in printed.splitlines()
        if line.startswith("  batchline ")
    ]
    verbs = [argv[1] for argv in commands]
    assert verbs == ["run", "serve", "bench"], printed
    for argv in commands:
        assert str(out) in argv
    run_argv, serve_argv, bench_argv = (argv[1:] for argv in commands)
    # run: on a few records of the same inputs
    run_out = tmp_path / "run-out"
    assert main([*run_argv, str(inputs), "--limit", "5", "-o", str(run_out), "--quiet"]) == 0
    assert (run_out / "_manifest.json").is_file()
    capsys.readouterr()
    # serve: the settings it would start with
    assert main([*serve_argv, "--print-config"]) == 0
    served = json.loads(capsys.readouterr().out)
    assert served["target_batch_tokens"] == Knobs.load(out).target_batch_tokens
    # the check command, shortened
    assert (
        main([*bench_argv, "--duration", "0.3", "--warmup", "0.1", "-o", str(tmp_path / "r")]) == 0
    )


@pytest.mark.slow
def test_bench_quiet_prints_nothing_on_success(
    inputs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("onnxruntime")
    out = tmp_path / "report"
    argv = ["bench", "--inputs", str(inputs), "--load", "closed:1", "--compare", "baseline"]
    argv += ["--duration", "0.3", "--warmup", "0.1", "-o", str(out), "--quiet"]
    assert main(argv) == 0
    assert capsys.readouterr() == ("", "")
    assert "| baseline | closed | 1 client |" in (out / "report.md").read_text()  # written
