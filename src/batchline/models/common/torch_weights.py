"""Torch helpers the backends that load weights with torch share (the generators, the
Hugging Face torch embedder and exporters): transformers kept quiet while a model loads, a
folder's model read quietly for an export, and linears packed once for oneDNN. Only the
standard library at import: torch and transformers are imported where used."""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    import torch

__all__ = ["from_pretrained_quietly", "pack_linear_weights", "quiet_transformers"]

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
    return len(swaps)
