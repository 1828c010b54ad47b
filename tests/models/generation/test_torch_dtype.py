"""The torch backend's dtype: ``auto`` decided on given CPU flags (never the real CPU's), the
flags read from a cpuinfo file, and bf16 linear layers packed for oneDNN with the same outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from batchline._cpu import CpuModel, cpu_model, host_kind, zen
from batchline.models.generation.torch_dtype import DtypeChoice, choose_dtype, cpu_flags

X86_NO_BF16 = {"fpu", "sse2", "avx2", "avx512f", "avx512_vnni"}


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (X86_NO_BF16 | {"avx512_bf16"}, "bfloat16"),
        (X86_NO_BF16 | {"amx_bf16", "amx_tile"}, "bfloat16"),
        (X86_NO_BF16, "float32"),
        (set(), "float32"),
    ],
)
def test_auto_takes_bf16_on_a_cpu_with_native_bf16_only(flags: set[str], expected: str) -> None:
    choice = choose_dtype("auto", "cpu", flags=flags)
    assert choice.dtype == expected
    assert choice.reason.startswith("auto: ")
    if expected == "bfloat16":
        assert "native bf16" in str(choice)
        assert sorted(flags & {"avx512_bf16", "amx_bf16"})[0] in choice.reason
    else:
        assert "no native bf16" in choice.reason


def test_auto_on_cuda_follows_the_device_and_an_explicit_dtype_wins() -> None:
    assert choose_dtype("auto", "cuda:1", cuda_bf16=True).dtype == "bfloat16"
    assert choose_dtype("auto", "cuda", cuda_bf16=False).dtype == "float32"
    # asked for: taken as it is, whatever the hardware
    assert choose_dtype("float32", "cpu", flags={"avx512_bf16"}) == DtypeChoice(
        "float32", "asked for"
    )
    assert choose_dtype("bfloat16", "cpu", flags=set()).dtype == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16"):
        choose_dtype("float16", "cpu", flags=set())


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(x86) == {"fpu", "avx512f", "avx512_bf16"}
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert cpu_flags(arm) == {"fp", "asimd", "bf16"}
    assert choose_dtype("auto", "cpu", flags=cpu_flags(arm)).dtype == "float32"
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_the_cpu_s_vendor_and_family_are_read_from_its_first_block(tmp_path: Path) -> None:
    zen5 = tmp_path / "zen5"
    zen5.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n\n"
        "processor\t: 1\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n"
    )
    assert cpu_model(zen5) == CpuModel("AuthenticAMD", 26)
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\n")
    assert cpu_model(arm) is None
    garbled = tmp_path / "garbled"
    garbled.write_text("vendor_id\t: AuthenticAMD\ncpu family\t: x\n")
    assert cpu_model(garbled) is None
    assert cpu_model(tmp_path / "missing") is None


def test_a_zen_generation_is_told_by_family_and_kind() -> None:
    avx512_bf16 = host_kind({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"})
    avx2 = host_kind({"avx2", "fma"})
    assert zen(CpuModel("AuthenticAMD", 25), avx512_bf16) == 4
    assert zen(CpuModel("AuthenticAMD", 25), avx2) is None  # Zen 3: the family without AVX-512
    assert zen(CpuModel("AuthenticAMD", 26), avx512_bf16) == 5
    assert zen(CpuModel("AuthenticAMD", 23), avx2) is None
    assert zen(CpuModel("GenuineIntel", 6), avx512_bf16) is None
    assert zen(None, avx512_bf16) is None


def test_packed_bf16_linears_give_the_same_outputs(torch_threads: None) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU's oneDNN has no bf16")  # fp32 packs anywhere oneDNN runs
    from batchline.models.common.packed_linear import PackedLinear
    from batchline.models.generation.torch_dtype import pack_linear_weights

    from .conftest import build_tiny_llama

    ids = torch.tensor([[5, 17, 3, 90, 41, 7]])
    for dtype in (torch.bfloat16, torch.float32):
        model: Any = build_tiny_llama().to(dtype)
        with torch.inference_mode():
            before = model(input_ids=ids).logits
            # 2 layers x (q, k, v, o, gate, up, down) + lm_head
            assert pack_linear_weights(model) == 15
            after = model(input_ids=ids).logits
            assert pack_linear_weights(model) == 0  # packed already
        assert isinstance(model.lm_head, PackedLinear)
        assert "packed" in repr(model.lm_head)
        if dtype == torch.bfloat16:
            assert torch.equal(before, after)  # oneDNN computed both
        else:  # another summation order than MKL's: the last bits differ
            torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
            assert torch.equal(before.argmax(-1), after.argmax(-1))
