"""A GGUF file's config and tokenizer, as transformers reads them from the file's metadata, kept
once in the cache as a folder of their own.

transformers parses the whole metadata for each (the vocabulary's tokens, scores and merges):
on the 2-core AVX2-only EPYC, for a 1.7B Q8_0 file with SmolLM2's 49,152-token vocabulary
(2026-12-04), 5.3 s for the config and 5.1 s for the tokenizer, half of the file's 19.6 s load.
From the kept folder both take 0.14 s. The folder is named by a hash of the file's bytes up to
its tensor data (the header, every metadata value and the tensor table) and of transformers'
version, so a file that changes, or a transformers that reads it otherwise, gets a folder of
its own, made whole or not at all (:func:`~batchline._cache.build_folder_whole`). Where it
cannot be written (a read-only or full cache) the load goes on from the file, and the log says
why; a kept folder that cannot be read is said, removed and written again.

The tokenizer is read from the file alone: given the file's own folder, transformers also read
the ``tokenizer_config.json`` a Hugging Face folder beside it holds, and a GGUF made from such
a folder (llama.cpp's converter writes it there) lost its chat template to that file's, which
had none (transformers 5.25: the template sat in ``chat_template.jinja``).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from batchline._cache import build_folder_whole, cache_dir
from batchline._errors import ModelError
from batchline.models.generation.gguf_file import read_gguf

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

__all__ = ["END_TEXTS", "end_ids", "gguf_config_and_tokenizer", "gguf_meta_folder"]

logger = logging.getLogger("batchline.generation")

#: The bytes hashed at a time for the folder's name.
_CHUNK = 1 << 20
#: Hashed into the folder's name: a new one where what is kept changes (2: the tokenizer read
#: from the file alone; folders kept before could hold another file's chat template, or none;
#: 3: the config's EOS ids are every end-of-generation token of the file, :func:`end_ids`).
_KEPT_VERSION = b"3"
#: The texts of the tokens that end a turn or a message in the chat formats of the families a
#: GGUF holds here (Llama 3's end of turn, of message and of text, ChatML's, Phi's, Gemma's),
#: which llama.cpp also ends a generation at when the vocabulary has them as special tokens.
END_TEXTS = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
)


def gguf_meta_folder(path: Path, header_bytes: int) -> Path:
    """Where the config and tokenizer of the GGUF file at ``path``, whose tensor data starts at
    ``header_bytes``, are kept."""
    import transformers

    digest = hashlib.sha256(transformers.__version__.encode() + b"\0" + _KEPT_VERSION + b"\0")
    with path.open("rb") as f:
        left = header_bytes
        while left > 0:
            chunk = f.read(min(left, _CHUNK))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
    return cache_dir() / "gguf" / digest.hexdigest()[:24]


def gguf_config_and_tokenizer(
    path: Path, header_bytes: int, metadata: Mapping[str, object] | None = None
) -> tuple[PretrainedConfig, PreTrainedTokenizerBase]:
    """The config and tokenizer transformers reads from the GGUF file at ``path`` (its tensor
    data starting at ``header_bytes``): from the kept folder where an earlier load left it,
    else from the file, then kept. ``metadata``: the file's scalars where the caller has read
    them already (else read here, when the file is read)."""
    from transformers import AutoConfig, AutoTokenizer

    from batchline.models.common.torch_weights import quiet_transformers

    folder = gguf_meta_folder(path, header_bytes)
    with quiet_transformers():
        if (folder / "config.json").is_file():
            try:
                kept: tuple[PretrainedConfig, PreTrainedTokenizerBase] = (
                    AutoConfig.from_pretrained(folder, local_files_only=True),
                    AutoTokenizer.from_pretrained(folder, local_files_only=True),
                )
            except (OSError, ValueError) as exc:  # damaged: read the file, keep it again
                logger.warning("%s: its kept config and tokenizer in %s: %s", path, folder, exc)
                shutil.rmtree(folder, ignore_errors=True)
            else:
                return kept
        config, tokenizer = _from_file(path, metadata)
    _keep(folder, config, tokenizer, path)
    return config, tokenizer


def _from_file(
    path: Path, metadata: Mapping[str, object] | None
) -> tuple[PretrainedConfig, PreTrainedTokenizerBase]:
    from transformers import AutoConfig, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    read = load_gguf_checkpoint(str(path), return_tensors=False)["config"]  # type: ignore[no-untyped-call]
    config = AutoConfig.for_model(**read)
    # from an empty folder, the file named by its whole path: the file's folder may hold another
    # tokenizer's files, which transformers would read too (the module docstring)
    with tempfile.TemporaryDirectory(prefix="batchline-gguf-") as alone:
        tokenizer = AutoTokenizer.from_pretrained(
            alone, gguf_file=str(path.resolve()), local_files_only=True
        )
    if metadata is None:
        metadata = read_gguf(path).metadata
    ends = end_ids(metadata, tokenizer, int(config.vocab_size))
    declared = config.eos_token_id
    declared = [declared] if isinstance(declared, int) else list(declared or [])
    if ends - set(declared):
        config.eos_token_id = sorted(ends | set(declared))
    return config, tokenizer


def end_ids(
    metadata: Mapping[str, object], tokenizer: PreTrainedTokenizerBase, vocab_size: int
) -> set[int]:
    """The token ids that end a generation of a GGUF's model, as llama.cpp ends one: the file's
    EOS, its end-of-turn and end-of-message tokens where its metadata names them, and its
    special tokens of :data:`END_TEXTS`. transformers reads the EOS alone, so a file whose EOS
    is ``<|eot_id|>`` would not stop at the ``<|eom_id|>`` that ends a Llama 3.1 tool call."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    named = {metadata.get(f"tokenizer.ggml.{key}") for key in keys}
    added = tokenizer.added_tokens_encoder
    found = named | {added.get(text) for text in END_TEXTS}
    return {i for i in found if isinstance(i, int) and 0 <= i < vocab_size}


def _keep(
    folder: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, path: Path
) -> None:
    """Write ``config`` and ``tokenizer`` to ``folder`` whole, or say in the log why not."""

    def save(scratch: Path) -> None:
        config.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)

    try:
        build_folder_whole(folder, save, "cache.gguf")
    except (OSError, ModelError) as exc:
        logger.info("%s: its config and tokenizer not kept in %s (%s)", path.name, folder, exc)
