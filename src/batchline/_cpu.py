"""What this CPU computes natively, read from its ``/proc/cpuinfo`` flags: the one home of the
flags and of the host kinds the number-format choices are made for (an embedding model's
precision, ``models/precision.py``; a generator's dtype, ``generation/torch_dtype.py``).

The kinds, from the most capable down (the first that fits names the host):

- ``amx``: AMX tiles for bf16 and int8 (``amx_bf16``, ``amx_int8``; Intel Xeon since Sapphire
  Rapids), with AVX-512, AVX512-BF16 and VNNI beside them;
- ``avx512-bf16``: AVX-512 with bf16 dot products (``avx512_bf16``; AMD EPYC Genoa, Intel Cooper
  Lake) and usually VNNI;
- ``vnni``: int8 dot products (``avx512_vnni`` or ``avx_vnni``) but no native bf16;
- ``avx2``: neither: bf16 would be emulated and int8 has no dot-product instruction;
- ``other``: no AVX2 either, or no flags to read (not Linux).

Where two CPUs of one kind measured differently (AMD's Zen 4 and Zen 5 are both
``avx512-bf16``), the choice also reads the CPU's vendor and family (:func:`cpu_model`,
:func:`zen`).
Standard library only: the choice is made, and tested on synthetic flag sets, without torch.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "A8_KERNEL_FLAGS",
    "A8_VNNI_FLAGS",
    "BF16_FLAGS",
    "F32_KERNEL_FLAGS",
    "INT8_FLAGS",
    "CpuModel",
    "HostKind",
    "cpu_flags",
    "cpu_model",
    "host_flags",
    "host_kind",
    "host_model",
    "zen",
]

#: Flags (Linux names) of native bf16 arithmetic.
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
#: Flags of int8 dot products (what ONNX Runtime's int8 kernels gain from).
INT8_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni")
#: Flags the own int4 kernel's float32 path needs, all of them (its sums are FMAs in AVX2
#: vectors at least; ``generation/csrc/quant_gemm_f32.cpp``).
F32_KERNEL_FLAGS = ("avx2", "fma")
#: Flags the own int4 kernel's int8-activation path needs, all of them (vpmaddubsw in AVX2
#: vectors at least; ``generation/csrc/quant_gemm_a8.cpp``).
A8_KERNEL_FLAGS = ("avx2", "fma")
#: Flags of its 512-bit path (vpdpbusd), taken where the CPU has all of them.
A8_VNNI_FLAGS = ("avx512f", "avx512bw", "avx512_vnni")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This CPU's feature flags (Linux ``/proc/cpuinfo``); empty where there is none."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@functools.cache
def host_flags() -> frozenset[str]:
    """This CPU's flags (:func:`cpu_flags`), read once a process: asked per chunk of rows
    that a load packs, and they do not change while it runs."""
    return cpu_flags()


@dataclass(frozen=True, slots=True)
class HostKind:
    """A CPU's kind (``name``, one of the module docstring's) and the flags it was read from
    that matter here (``found``)."""

    name: str
    found: tuple[str, ...]

    @property
    def bf16(self) -> bool:
        """Native bf16 arithmetic (AMX or AVX512-BF16)."""
        return any(f in BF16_FLAGS for f in self.found)

    @property
    def int8(self) -> bool:
        """int8 dot products (AMX-INT8 or VNNI)."""
        return any(f in INT8_FLAGS for f in self.found)

    def __str__(self) -> str:
        return f"{self.name} ({', '.join(self.found)})" if self.found else self.name


def host_kind(flags: Collection[str] | None = None) -> HostKind:
    """The kind of this CPU (``flags``: its flags, default :func:`cpu_flags`; tests pass them)."""
    have = set(cpu_flags() if flags is None else flags)
    found = tuple(f for f in (*BF16_FLAGS, *INT8_FLAGS) if f in have)
    if {"amx_bf16", "amx_int8"} <= have:
        name = "amx"
    elif "avx512_bf16" in have:
        name = "avx512-bf16"
    elif any(f in have for f in INT8_FLAGS):
        name = "vnni"
    elif "avx2" in have:
        name = "avx2"
    else:
        name = "other"
    return HostKind(name, found)


@dataclass(frozen=True, slots=True)
class CpuModel:
    """A CPU's vendor (``vendor_id``: ``AuthenticAMD``, ``GenuineIntel``) and family number
    (``cpu family``), as ``/proc/cpuinfo`` gives them."""

    vendor: str
    family: int


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuModel | None:
    """This CPU's vendor and family; None where ``cpuinfo`` does not say them (not Linux, or
    not x86)."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():  # the first processor's block is enough
            break
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    try:
        return CpuModel(fields["vendor_id"], int(fields["cpu family"]))
    except (KeyError, ValueError):
        return None


@functools.cache
def host_model() -> CpuModel | None:
    """This CPU's :func:`cpu_model`, read once a process."""
    return cpu_model()


def zen(model: CpuModel | None, kind: HostKind) -> int | None:
    """The generation of an AMD Zen CPU where its family and kind tell it: 4 for family 25 (0x19)
    with AVX512-BF16 (Zen 3 shares the family, without AVX-512), 5 for family 26 (0x1A); else
    None (another vendor or generation, or unknown)."""
    if model is None or model.vendor != "AuthenticAMD":
        return None
    if model.family == 25 and kind.name == "avx512-bf16":
        return 4
    if model.family == 26:
        return 5
    return None
