"""``benchmarks/bench_quant_quality.py``'s llama.cpp agreement: its pure pieces (the request, the
reading of the answer, the count), not llama-server itself (the script runs that)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from ..benchmark_scripts import BENCHMARKS, load_benchmark

SCRIPT = BENCHMARKS / "bench_quant_quality.py"


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark("bench_quant_quality.py", monkeypatch)


def test_matches_counts_equal_tokens_position_by_position(script: ModuleType) -> None:
    ours = [[5, 6, 7], [8, 9]]
    theirs = [[5, 0, 7], [9, 8]]  # the same tokens at other positions do not count
    assert script.matches(ours, theirs) == 2
    assert script.matches(ours, ours) == 5
    assert script.matches([[]], [[]]) == 0


def test_matches_refuses_runs_of_other_shapes(script: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"\[3, 2\] and \[2, 3\]"):
        script.matches([[1, 2, 3], [4, 5]], [[1, 2], [3, 4, 5]])


def test_the_request_sends_the_ids_alone_greedy_for_one_token(script: ModuleType) -> None:
    ids = [1, 9690, 198, 2683]
    body = script.completion_body(ids)
    sent = json.loads(json.dumps(body))
    assert sent["prompt"] == ids  # ids only, nothing before them: llama-server adds no BOS
    assert sent["n_predict"] == 1
    assert sent["samplers"] == ["top_k"]
    assert sent["top_k"] == 1
    assert sent["cache_prompt"] is True
    assert sent["return_tokens"] is True
    assert not {"ignore_eos", "logit_bias", "grammar"} & set(sent)  # nothing moves the pick


def test_predicted_reads_the_token_and_the_tokens_computed(script: ModuleType) -> None:
    response = {"tokens": [253], "tokens_evaluated": 5, "timings": {"cache_n": 4, "prompt_n": 1}}
    assert script.predicted(response, 5) == (253, 1)


@pytest.mark.parametrize(
    ("response", "said"),
    [
        ({"tokens": [253], "tokens_evaluated": 6}, "evaluated 6 prompt tokens where 5"),
        ({"tokens": [], "tokens_evaluated": 5}, "returned tokens"),
        ({"content": " a", "tokens_evaluated": 5}, "returned tokens None"),
    ],
)
def test_predicted_refuses_an_answer_at_another_position(
    script: ModuleType, response: dict[str, object], said: str
) -> None:
    with pytest.raises(SystemExit, match=said):
        script.predicted(response, 5)


def test_llama_server_runs_as_the_gate_does(script: ModuleType) -> None:
    command = script.llama_command(Path("/bin/llama-server"), Path("/m/x.gguf"), 8123, 200)
    flags = dict(zip(command[1::2], command[2::2], strict=True))
    assert command[0] == "/bin/llama-server"
    assert flags["-m"] == "/m/x.gguf"
    assert flags["--host"] == "127.0.0.1"
    assert flags["--port"] == "8123"
    assert flags["-np"] == "1"
    assert flags["-t"] == flags["-tb"] == "1"
    assert flags["-c"] == "200"


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--llama-server", "/no/such/llama-server"], "no such executable file"),
        (["--formats", "q4_1,fp8"], "unknown format(s) ['fp8']"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(flags: list[str], said: str) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert said in done.stderr.strip().splitlines()[-1]
    assert "Traceback" not in done.stderr
