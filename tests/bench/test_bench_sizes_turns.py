"""``benchmarks/bench_sizes.py``'s interleaved turns: a server's turns pooled into one result,
and issue 52's ratios taken per turn (pure pieces: no server is started)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ..benchmark_scripts import BENCHMARKS, load_benchmark


def test_turns_pool_per_server_and_ratios_pair_the_right_servers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sizes = load_benchmark("bench_sizes.py", monkeypatch)
    result = sizes.RunResult
    turns = [
        {
            "own-bf16": result(64, 4.0, [4.0], [0.3], 0),
            "own-int4": result(64, 2.0, [2.0], [0.2], 0),
        },
        {
            "own-int4": result(64, 1.0, [1.0], [0.1], 1),
            "own-bf16": result(64, 2.0, [2.0], [0.2], 0),
        },
    ]
    pooled = sizes._pooled(turns)
    assert pooled["own-int4"].tokens == 128
    assert pooled["own-int4"].wall_s == pytest.approx(3.0)
    assert pooled["own-int4"].latencies_s == [2.0, 1.0]
    assert pooled["own-int4"].failed == 1
    assert pooled["own-bf16"].tokens_per_s == pytest.approx(128 / 6.0)
    assert [sizes._ratios(t) for t in turns] == [
        {"own-int4 / own-bf16": pytest.approx(2.0)},
        {"own-int4 / own-bf16": pytest.approx(2.0)},
    ]
    # a server's settings stay in its label; its kind picks the pair
    got = sizes._ratios(
        {
            "own-int4:generation_threads=2": result(30, 1.0, [], [], 0),
            "llama-q4km": result(20, 1.0, [], [], 0),
        }
    )
    assert got == {"own-int4:generation_threads=2 / llama-q4km": pytest.approx(1.5)}


def test_interleave_refuses_rounds() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_sizes.py"), "--interleave", "--rounds", "2"],
        capture_output=True,
        text=True,
        cwd=BENCHMARKS,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--interleave takes turns within one run" in done.stderr
