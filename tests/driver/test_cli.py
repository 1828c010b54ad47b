"""``batchline drive``'s parser, its imports, and the summary it prints."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from batchline.__main__ import build_parser, main
from batchline.driver.cli import options_from
from batchline.driver.drive import DriveSummary
from batchline.driver.endpoints import EndpointReport


def test_the_cli_module_imports_only_the_standard_library() -> None:
    code = (
        "import sys, batchline.driver, batchline.driver.cli\n"
        "heavy = {'httpx', 'pyarrow', 'numpy', 'rich'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_parser_s_defaults() -> None:
    args = build_parser().parse_args(["drive", "in.jsonl", "--endpoint", "http://h:1"])
    assert args.input == Path("in.jsonl")
    assert args.endpoints == ["http://h:1"]
    options = options_from(args)
    assert (options.chunk_size, options.concurrency, options.max_attempts) == (50, 10, 8)
    assert (args.connect_timeout_s, args.read_timeout_s) == (10.0, 120.0)
    assert (args.route, args.on_bad_record, args.encoding) == ("embeddings", "fail", "base64")
    args = build_parser().parse_args(
        ["drive", "x.csv", "--endpoint", "http://a", "--endpoint", "http://b", "--resume"]
    )
    assert args.endpoints == ["http://a", "http://b"]
    # a generation request of 50 prompts would outlast a CPU server's request timeout
    generate = ["drive", "p.jsonl", "--endpoint", "http://a", "--route", "generate"]
    assert options_from(build_parser().parse_args(generate)).chunk_size == 8
    given = build_parser().parse_args([*generate, "--records-per-request", "3"])
    assert options_from(given).chunk_size == 3


@pytest.mark.parametrize(
    "argv",
    [
        ["drive", "in.jsonl"],  # no endpoint
        ["drive", "in.jsonl", "--endpoint", "http://h", "--resume", "--overwrite"],
        ["drive", "in.jsonl", "--endpoint", "http://h", "--route", "chat"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    capsys.readouterr()


def test_an_unknown_package_attribute_is_an_attribute_error() -> None:
    import batchline.driver

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = batchline.driver.nope


def test_the_summary_rows_name_each_endpoint_and_the_failures() -> None:
    summary = DriveSummary(
        output=Path("out"),
        route="embeddings",
        records=90,
        failed=10,
        skipped=0,
        already_done=0,
        total_records=100,
        failed_total=10,
        wall_s=2.0,
        requests=12,
        retries=2,
        endpoints=(
            EndpointReport("http://a", 7, 5, {"connect": 2}, 1, 1, 3),
            EndpointReport("http://b", 5, 5, {}, 0, 0, 0),
        ),
    )
    rows = dict(summary.rows())
    assert rows["records/s"] == "45.0"
    assert rows["http://a"] == "7 requests; connect 2; set aside 1x, back 1x"
    assert rows["http://b"] == "5 requests; no errors"
    assert rows["FAILED records (all runs)"] == "10: see _failures.jsonl"
    assert summary.exit_code == 1


def test_with_nothing_listening_the_drive_says_so_and_stops_resumably(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as s:  # a port nobody listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(5)))
    argv = ["drive", str(src), "--endpoint", f"http://127.0.0.1:{port}", "--quiet"]
    argv += ["-o", str(tmp_path / "out"), "--give-up-after-s", "0.5"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"http://127.0.0.1:{port}: set aside after 3 failures in a row (last: connect)" in err
    assert "every endpoint is set aside: waiting up to 0.5 s" in err
    assert "no endpoint has been ready for 0.5 s" in err
    assert "--resume" in err
    # nothing was committed, so nothing is left behind: the hinted rerun is not refused
    assert not (tmp_path / "out").exists()
