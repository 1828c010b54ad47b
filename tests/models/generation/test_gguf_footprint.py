"""What a memory budget counts for a GGUF file's generator before its first load
(``generation/backend.py``'s footprint): the file's bytes as kept quantized, or its values in
the dtype laid out as float, and the KV cache of the shape its header gives."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from batchline.models.config import Knobs  # noqa: E402
from batchline.models.footprint import estimate_footprint  # noqa: E402
from batchline.models.generation.backend import GGUF_EXTRA, GGUF_HELD  # noqa: E402
from batchline.models.generation.torch_dtype import choose_weights  # noqa: E402
from batchline.models.specs import parse_spec  # noqa: E402

from .conftest import build_tiny_llama  # noqa: E402
from .gguf_helpers import write_tiny_gguf  # noqa: E402

# the tiny Llama: 2 layers, 2 KV heads of 64 / 4 heads = 16 values
KV_A_POSITION = 2 * 2 * 2 * 16  # keys and values, layers, KV heads, head dim


def test_a_kept_ggufs_footprint_is_its_file_and_its_kv_cache(tmp_path: Path) -> None:
    if choose_weights("auto", gguf=True, dtype="float32").weights != "gguf":
        pytest.skip("a GGUF's linears are not kept quantized in float32 on this host")
    path = write_tiny_gguf(tmp_path / "m.gguf", build_tiny_llama(), "Q8_0")
    spec = parse_spec(str(path))
    held = int(GGUF_HELD * path.stat().st_size) + GGUF_EXTRA
    got = estimate_footprint(spec, Knobs.serving(kv_token_budget=1024, dtype="float32"))
    assert got.runtime == "torch"
    assert got.steady_bytes == held + KV_A_POSITION * 4 * 1024
    assert got.peak_bytes == held + held // 4  # the load's, before any KV is taken
    assert "--kv-token-budget" in got.advice
    more = estimate_footprint(spec, Knobs.serving(kv_token_budget=4096, dtype="float32"))
    assert more.steady_bytes - got.steady_bytes == KV_A_POSITION * 4 * 3072


def test_a_gguf_laid_out_as_float_counts_its_values_in_the_dtype(tmp_path: Path) -> None:
    model = build_tiny_llama()
    path = write_tiny_gguf(tmp_path / "m.gguf", model, "Q8_0")
    values = sum(p.numel() for p in model.parameters())  # every one is in the file
    knobs = Knobs.serving(kv_token_budget=1024, dtype="float32", weights="float")
    got = estimate_footprint(parse_spec(str(path)), knobs)
    assert got.steady_bytes == 2 * values * 4 + KV_A_POSITION * 4 * 1024


def test_a_file_that_is_no_gguf_estimates_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    got = estimate_footprint(parse_spec(str(bad)), Knobs.serving(dtype="float32"))
    assert (got.steady_bytes, got.peak_bytes) == (0, 0)  # its load says what is wrong
