"""A GGUF's quantized tensors are never expanded to float32 while it loads: in a process of
its own, the resident memory a load of a Q4_0 file adds at its peak (``VmHWM`` less the
resident memory before it, once a first load has imported what loads need) stays within the
file's size, its KV budget and a margin; the same file dequantized (``weights=float``) goes
well past that bound, so the measure sees a float copy where one is made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")
pytest.importorskip("transformers")

from batchline.models.generation.torch_dtype import choose_weights

from .conftest import build_tiny_llama
from .gguf_helpers import tiny_vocab, write_tiny_gguf

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

MIB = 1 << 20
#: what a load holds beside the weights and the KV cache (the engine's buffers, its tables),
#: and its passing temporaries (a linear being packed): 46 MiB measured for the file below
#: (Zen 5, 2026-12-06), where its values in float32 are 480 MB
MARGIN = 96 * MIB
KV_POSITIONS = 256

# Loads the first file (what a load imports, the kernels, are then in the process), reads its
# resident memory, loads the second and prints what the second load added at its peak.
_CHILD = """
import json, sys
import torch
torch.set_num_threads(1)
from batchline.models.config import Knobs
from batchline.models.generation.load import load_text_generator
from batchline.models.specs import parse_spec

def status(key):
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

warm, path, weights, positions = sys.argv[1:5]
knobs = Knobs(dtype="float32", weights=weights, kv_token_budget=int(positions))
load_text_generator(parse_spec(warm), knobs).close()
before = status("VmRSS:")
loaded = load_text_generator(parse_spec(path), knobs)
print(json.dumps({"added": status("VmHWM:") - before, "weights": loaded.info.details["weights"]}))
"""


def _added_at_peak(warm: Path, path: Path, weights: str) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    args = [warm, path, weights, KV_POSITIONS]
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_gguf_load_adds_no_more_than_its_file_its_kv_budget_and_a_margin(
    tmp_path: Path,
) -> None:
    if choose_weights("auto", gguf=True, dtype="float32").weights != "gguf":
        pytest.skip("a GGUF's linears are not kept quantized in float32 on this host")
    # 8 layers of 15.2 M weights (68 MiB of Q4_0 blocks): a layer is an eighth of the file
    layers, hidden, intermediate = 8, 1024, 4096
    model = build_tiny_llama(
        hidden_size=hidden, intermediate_size=intermediate, layers=layers, heads=hidden // 128
    )
    path = write_tiny_gguf(tmp_path / "big.gguf", model, "Q4_0", vocab=tiny_vocab())
    warm = write_tiny_gguf(tmp_path / "warm.gguf", build_tiny_llama(), "Q4_0", vocab=tiny_vocab())
    kv = 2 * layers * 2 * 128 * 4 * KV_POSITIONS  # keys and values, 2 KV heads of 128, float32
    bound = path.stat().st_size + kv + MARGIN

    kept = _added_at_peak(warm, path, "auto")
    assert kept["weights"] == "gguf"
    added = int(kept["added"])
    assert added <= bound, f"the load added {added / MIB:.0f} MiB, over {bound / MIB:.0f} MiB"

    dense = _added_at_peak(warm, path, "float")  # dequantized: its float32 values held
    assert dense["weights"] == "float"
    assert int(dense["added"]) > bound + 200 * MIB, dense
