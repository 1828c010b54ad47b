"""A loaded model's weights moved into 2 MiB pages, once, at load (Linux 6.1 and later).

A decode step of a 0.5-3B model reads every weight from memory, and in 4 KiB pages the reads
miss the TLB at every page: on this project's Zen 4 EPYC (2 threads), a 1.7B step in 2 MiB pages
took x0.90 (int4) and x0.97 (bf16) the time of the same weights in 4 KiB ones, the two loads'
steps taken in turn (2026-12-06; docs/generation.md, "On Zen 4, weights in 2 MiB pages"). The
engine's tensors are allocated by torch and glibc where the system's transparent huge pages are
``madvise`` (the usual setting) only where asked, which no allocator here does, so this asks
after the fact: ``madvise(MADV_COLLAPSE)`` copies each 2 MiB span that holds a weight into one
huge page, the bytes and addresses unchanged (the kernel does it synchronously, ~2.5 s a GB
here, part of it compacting free memory). Where the kernel predates it (a 2 MiB probe mapping of
its own is refused), the system's setting is ``never``, or the platform is not Linux, the
weights stay as they are and the load log says so. The spans are a weight's own storage rounded
out to 2 MiB: at most 2 MiB of a neighbour's memory on each side of a run of weights is made
resident with them. A span that reaches past its mapping (the first and last of a large tensor
that glibc mapped on its own, mostly) cannot be one huge page and stays as it is (``EINVAL``),
which the load log counts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import mmap
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["HugePages", "into_huge_pages", "model_tensors", "span_chunks"]

#: The huge page size this asks for (x86-64's, and arm64's over 4 KiB pages).
HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


@dataclass(frozen=True)
class HugePages:
    """What :func:`into_huge_pages` did: ``asked`` bytes of spans (2 MiB each), ``moved`` of
    them now in huge pages, in ``seconds``; ``reason`` says why none were tried, or how many
    failed (and the ``errno`` most of them gave, by name)."""

    asked: int
    moved: int
    seconds: float
    reason: str = ""

    def __str__(self) -> str:
        if not self.asked:
            return f"weights in 4 KiB pages ({self.reason})" if self.reason else "no weights"
        mib = 1 << 20
        text = f"weights in 2 MiB pages: {self.moved // mib:,} of {self.asked // mib:,} MiB"
        text += f" in {self.seconds:.1f} s"
        return f"{text} ({self.reason})" if self.reason else text


def model_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The CPU tensors a model's modules hold: their parameters and buffers, and tensors kept
    as attributes, alone or in lists, tuples and dicts (the own kernels' packed weights), each
    storage once."""
    seen: set[int] = set()

    def walk(value: Any, depth: int) -> Iterator[torch.Tensor]:
        if isinstance(value, torch.Tensor):
            if value.device.type == "cpu" and value.layout == torch.strided:
                storage = value.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    yield value
        elif depth and isinstance(value, list | tuple):
            for item in value:
                yield from walk(item, depth - 1)
        elif depth and isinstance(value, dict):
            for item in value.values():
                yield from walk(item, depth - 1)

    for module in model.modules():
        yield from walk(vars(module), 3)


def span_chunks(spans: Iterable[tuple[int, int]]) -> list[int]:
    """The 2 MiB-aligned addresses of the chunks that the ``(address, bytes)`` spans touch, in
    order, each once."""
    chunks: set[int] = set()
    for address, size in spans:
        if size > 0:
            chunks.update(range(address // HUGE * HUGE, address + size, HUGE))
    return sorted(chunks)


def into_huge_pages(tensors: Iterable[torch.Tensor]) -> HugePages:
    """Ask the kernel to hold the storages of ``tensors`` in 2 MiB pages (see the module's
    docstring); what it did, never an error."""
    started = time.perf_counter()
    refused = _refused()
    if refused:
        return HugePages(0, 0, 0.0, refused)
    spans = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors]
    chunks = span_chunks(spans)
    madvise = _madvise()
    moved = 0
    failures: dict[int, int] = {}
    for chunk in chunks:
        madvise(chunk, HUGE, _MADV_HUGEPAGE)
        if madvise(chunk, HUGE, _MADV_COLLAPSE) == 0:
            moved += HUGE
        else:
            code = ctypes.get_errno()
            failures[code] = failures.get(code, 0) + 1
    seconds = time.perf_counter() - started
    reason = ""
    if failures:
        code, count = max(failures.items(), key=lambda item: item[1])
        stayed = sum(failures.values())
        name = errno.errorcode.get(code, str(code))
        reason = f"{stayed} span{'s' if stayed > 1 else ''} of 2 MiB stayed in 4 KiB pages"
        reason += f" ({name})" if count == stayed else f" ({count} of them {name})"
    return HugePages(len(chunks) * HUGE, moved, seconds, reason)


def _refused() -> str:
    """Why no span is tried here, or ''."""
    if not sys.platform.startswith("linux"):
        return "huge pages are asked for on Linux only"
    try:
        with open(_THP_SETTING) as setting:
            if "[never]" in setting.read():
                return f"{_THP_SETTING} is never"
    except OSError:
        return "this kernel has no transparent huge pages"
    return _collapse_refused()


def _collapse_refused() -> str:
    """Why the kernel does not collapse a 2 MiB span of an anonymous mapping of this process's
    own (made here, written, collapsed and unmapped), or '': a span of the model's may fail for
    reasons of its own (it reaches past its mapping), this one where ``MADV_COLLAPSE`` is
    missing (``EINVAL``, remembered) or the kernel has no free 2 MiB page to give now
    (``EAGAIN``, ``ENOMEM``: asked again at the next load)."""
    code = _probe_errno()
    if code == 0:
        return ""
    if code == errno.EINVAL:
        return "this kernel has no MADV_COLLAPSE: Linux 6.1 and later"
    _probe_errno.cache_clear()
    name = errno.errorcode.get(code, str(code))
    return f"the kernel could not collapse a 2 MiB probe now ({name}: {os.strerror(code)})"


@functools.cache
def _probe_errno() -> int:
    """0 where the kernel collapsed the probe of :func:`_collapse_refused`, else the errno."""
    with mmap.mmap(-1, 2 * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as probe:
        probe.write(b"\1" * len(probe))
        address = ctypes.addressof(ctypes.c_char.from_buffer(probe))  # the view dropped at once
        start = -address % HUGE
        try:
            probe.madvise(_MADV_HUGEPAGE, start, HUGE)
            probe.madvise(_MADV_COLLAPSE, start, HUGE)
        except OSError as exc:
            return exc.errno or errno.EINVAL
        return 0


def _madvise() -> Any:
    """libc's ``madvise``, errno kept."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
