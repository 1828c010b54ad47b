"""Torch helpers the backends that load weights with torch share (the generators, the
Hugging Face torch embedder and exporters): transformers kept quiet while a model loads, a
folder's model read quietly for an export, linears packed once for oneDNN, and the memory of
weights read from a mapped file given back once they are replaced. Only the standard library
at import: torch and transformers are imported where used."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys
import threading
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    import torch

__all__ = [
    "file_mappings",
    "from_pretrained_quietly",
    "pack_linear_weights",
    "quiet_transformers",
    "release_file_pages",
    "release_file_ranges",
    "trim_heap",
]

_quiet_lock = threading.Lock()
_quiet_depth = 0
_saved: tuple[bool, int] = (True, 0)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No progress bars ("Loading weights: 100%") and only errors from transformers while a
    model loads: run, serve and bench print their own progress. The first of overlapping
    loads (threads) saves the settings, the last one restores them."""
    global _quiet_depth, _saved
    from transformers.utils import logging as hf_logging

    with _quiet_lock:
        if _quiet_depth == 0:
            _saved = (hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity())
            hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
            hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
        _quiet_depth += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_depth -= 1
            if _quiet_depth == 0:
                bars, verbosity = _saved
                hf_logging.set_verbosity(verbosity)
                if bars:
                    hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


def from_pretrained_quietly(auto: Any, folder: Path, **options: Any) -> tuple[Any, dict[str, Any]]:
    """``auto.from_pretrained`` on ``folder``'s own files (``options`` passed on: its dtype...)
    and its loading info (``missing_keys``...: what the caller checks), with transformers quiet
    and Python's warnings ignored: an exporter checks the model it gets, not what transformers
    says about it. Raises what ``from_pretrained`` raises."""
    with warnings.catch_warnings(), quiet_transformers():
        warnings.simplefilter("ignore")
        model, info = auto.from_pretrained(
            folder, local_files_only=True, output_loading_info=True, **options
        )
    return model, info


def pack_linear_weights(model: torch.nn.Module) -> int:
    """Replace ``model``'s fp32 and bf16 ``nn.Linear`` layers on CPU by ones whose weights are
    packed once for oneDNN (the blocked layout its kernels want), and return how many. Nothing
    changes on other devices, or without oneDNN (bf16: without its bf16 support).

    bf16 outputs are the same bit for bit; fp32 ones differ in the last bits (another summation
    order), and SmolLM2's greedy tokens still equal transformers' ``generate`` on the 22-prompt
    test (tests/models/generation/test_smollm2.py). Measured on SmolLM2-135M, one core with
    avx512_bf16, a 16-row decode step, in-process A/B on a busy machine: fp32 750 -> 520 ms,
    bf16 198 -> 139 ms; the 49k-wide lm_head alone: fp32 116 -> 48 ms, bf16 10 -> 5.8 ms.
    The model stays on CPU afterwards (packed weights do not move).
    """
    import torch

    from batchline.models.common.packed_linear import PackedLinear

    dtypes = set()
    if torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        dtypes.add(torch.float32)
        if torch.ops.mkldnn._is_mkldnn_bf16_supported():
            dtypes.add(torch.bfloat16)
    swaps: list[tuple[torch.nn.Module, str, torch.nn.Linear]] = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if (
                type(child) is torch.nn.Linear
                and child.weight.dtype in dtypes
                and child.weight.device.type == "cpu"
            ):
                swaps.append((parent, name, child))
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    # the packed copies are what the model computes with now: the file's pages go back (a tied
    # lm_head's are the embedding's, read again row by row where a lookup touches them)
    release_file_pages(child.weight for _, _, child in swaps)
    return len(swaps)


#: madvise's advice to drop pages from the process (Linux): a file's pages are read again from
#: the file if touched later.
_MADV_DONTNEED = 4


def release_file_pages(
    tensors: Iterable[torch.Tensor], files: list[tuple[int, int]] | None = None
) -> int:
    """Give back the memory pages that ``tensors`` occupy in a mapped file, and return how many
    bytes: the whole pages inside each tensor's bytes, where those lie in a file mapping
    (transformers maps a safetensors file and hands out views of it when no dtype conversion is
    needed). Touched pages of a mapping count in the process's RSS until it is unmapped, and the
    mapping lives while any weight still views it (the embedding does), so a loader that
    replaces a layer's weights by its own copies (fused, quantized) calls this on the replaced
    ones: a 3B model's file is not held whole on top of its int4 copy. Memory that maps no file
    (a tensor's own allocation) is never touched. A page given back is read from the file again
    if touched later, so only a write into the mapping is lost: pass tensors the model no longer
    holds, or whose mapped bytes were never written (weights read from a file are not: a
    tied lm_head's weight is its embedding's). ``files``: :func:`file_mappings`, read by the
    caller once for many calls (reading them took ~4 ms with torch and transformers loaded:
    ~3 s of a 1.7B int8 load that released every 1,024 rows). Elsewhere than on Linux it does
    nothing."""
    return release_file_ranges(
        ((t.data_ptr(), t.numel() * t.element_size()) for t in tensors), files
    )


def release_file_ranges(
    ranges: Iterable[tuple[int, int]], files: list[tuple[int, int]] | None = None
) -> int:
    """:func:`release_file_pages` for memory given as ``(address, bytes)`` ranges (a numpy view
    of a mapped file's bytes: a GGUF file's tensors); the same rules."""
    if sys.platform != "linux":
        return 0
    if files is None:
        files = file_mappings()
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    released = 0
    for start, nbytes in ranges:
        end = start + nbytes
        if not any(low <= start and end <= high for low, high in files):
            continue
        first, last = -(-start // page) * page, end // page * page
        if (
            last > first
            and libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)
            == 0
        ):
            released += last - first
    return released


def trim_heap() -> None:
    """Hand the C heap's free memory back to the system (glibc's ``malloc_trim``), after a load
    that freed many large temporaries (a quantized load: ~230 MB of a 3B model's stayed
    resident without it). Nothing where the C library has no such call."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform == "linux" else None
    if trim is not None:
        trim(0)


def file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of regular files (/proc/self/maps)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            # address perms offset dev inode path: a file has an inode and an absolute path
            if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
                low, high = fields[0].split("-")
                ranges.append((int(low, 16), int(high, 16)))
    return ranges
