"""A GGUF file's config and tokenizer kept once in the cache (``gguf_meta``): read from the file
the first time, from the kept folder afterwards, the same config and tokens either way; a folder
per file content; a cache that cannot be written leaves the load to the file, and a damaged
folder is read from the file and kept again; and a user's GGUF loads through it."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")
pytest.importorskip("transformers")

from batchline.models.generation import gguf_meta  # noqa: E402
from batchline.models.generation.gguf_header import read_gguf_file  # noqa: E402
from batchline.models.generation.gguf_meta import (  # noqa: E402
    gguf_config_and_tokenizer,
    gguf_meta_folder,
)
from batchline.models.generation.gguf_weights import load_gguf  # noqa: E402

from .conftest import build_tiny_llama  # noqa: E402
from .gguf_helpers import tiny_vocab, write_tiny_gguf  # noqa: E402

CONFIG_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "rms_norm_eps")


def _gguf(tmp_path: Path, name: str = "mine.gguf") -> tuple[Path, int]:
    path = write_tiny_gguf(tmp_path / name, build_tiny_llama(), "Q8_0", vocab=tiny_vocab())
    return path, read_gguf_file(path).header_bytes


def _same(first: tuple[Any, Any], second: tuple[Any, Any]) -> None:
    (config, tokenizer), (config2, tokenizer2) = first, second
    for field in CONFIG_FIELDS:
        assert getattr(config2, field) == getattr(config, field)
    text = "hi  there, 123"
    assert tokenizer2(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert tokenizer2.chat_template == tokenizer.chat_template
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer2.apply_chat_template(chat) == tokenizer.apply_chat_template(chat)


def _refuse_the_file(*_: Any) -> Any:
    raise AssertionError("read the GGUF file's metadata again")


def test_the_first_load_reads_the_file_and_keeps_them_the_next_reads_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path / "cache"))
    path, header = _gguf(tmp_path)
    first = gguf_config_and_tokenizer(path, header)
    folder = gguf_meta_folder(path, header)
    assert (folder / "config.json").is_file()
    assert folder.parent == tmp_path / "cache" / "gguf"
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no scratch left
    monkeypatch.setattr(gguf_meta, "_from_file", _refuse_the_file)
    _same(first, gguf_config_and_tokenizer(path, header))


def test_the_folder_is_the_files_content_s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path / "cache"))
    path, header = _gguf(tmp_path)
    copy = shutil.copy(path, tmp_path / "elsewhere.gguf")
    assert gguf_meta_folder(Path(copy), header) == gguf_meta_folder(path, header)
    other = write_tiny_gguf(
        tmp_path / "other.gguf", build_tiny_llama(), "Q8_0", vocab=tiny_vocab()[:-1]
    )
    other_header = read_gguf_file(other).header_bytes
    assert gguf_meta_folder(other, other_header) != gguf_meta_folder(path, header)


def test_a_cache_that_cannot_be_written_leaves_the_load_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(blocked))
    path, header = _gguf(tmp_path)
    with caplog.at_level(logging.INFO, logger="batchline.generation"):
        config, tokenizer = gguf_config_and_tokenizer(path, header)
    assert config.model_type == "llama"
    assert tokenizer("hi")["input_ids"]
    assert "config and tokenizer not kept" in caplog.text
    assert blocked.read_text() == "not a folder"


def test_a_damaged_folder_is_said_read_from_the_file_and_kept_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path / "cache"))
    path, header = _gguf(tmp_path)
    first = gguf_config_and_tokenizer(path, header)
    folder = gguf_meta_folder(path, header)
    (folder / "config.json").write_text("{ not json")
    with caplog.at_level(logging.WARNING, logger="batchline.generation"):
        again = gguf_config_and_tokenizer(path, header)
    assert "its kept config and tokenizer" in caplog.text
    _same(first, again)
    # kept again whole: the next load reads the folder
    monkeypatch.setattr(gguf_meta, "_from_file", _refuse_the_file)
    _same(first, gguf_config_and_tokenizer(path, header))


def test_a_users_gguf_loads_its_config_and_tokenizer_through_the_kept_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path / "cache"))
    path, header = _gguf(tmp_path)
    model, tokenizer, _ = load_gguf(path, dtype=torch.float32)
    assert (gguf_meta_folder(path, header) / "config.json").is_file()
    monkeypatch.setattr(gguf_meta, "_from_file", _refuse_the_file)
    again, tokenizer2, _ = load_gguf(path, dtype=torch.float32)
    _same((model.config, tokenizer), (again.config, tokenizer2))


def test_a_gguf_beside_another_tokenizer_s_files_keeps_its_own_chat_template(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GGUF made from a Hugging Face folder sits in it (llama.cpp's converter writes it
    there): that folder's tokenizer files, without a template, are not the file's."""
    from .gguf_helpers import CHAT_TEMPLATE
    from .test_load import save_tiny_generator

    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path / "cache"))
    folder = save_tiny_generator(tmp_path / "folder", chat_template=False)
    assert (folder / "tokenizer_config.json").is_file()
    path, header = _gguf(folder)
    (tmp_path / "alone").mkdir()
    alone, _ = _gguf(tmp_path / "alone")
    _, tokenizer = gguf_config_and_tokenizer(path, header)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    _same(gguf_config_and_tokenizer(alone, header), gguf_config_and_tokenizer(path, header))


def test_a_gguf_ends_a_generation_at_each_of_its_end_tokens_as_llama_cpp_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torch_threads: None
) -> None:
    """Not only its EOS: an end-of-message id its metadata names, and its special tokens that
    end a turn (here ``<|im_end|>``, a control token); a normal token of such a text, or an id
    past the model's vocabulary, is no end. The engine stops at each, from the kept folder too."""
    from batchline.models.config import Knobs
    from batchline.models.generation.load import load_text_generator
    from batchline.models.specs import parse_spec

    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path / "cache"))
    vocab = tiny_vocab()
    vocab[-3:] = ["<|im_end|>", "<|eot_id|>", "<x-msg>"]  # the last a plain token, named below
    eom, vocab_size = len(vocab) - 1, len(vocab)
    path = write_tiny_gguf(
        tmp_path / "ends.gguf",
        build_tiny_llama(),
        "Q8_0",
        vocab=vocab,
        control=("<|im_end|>",),  # <|eot_id|> stays a normal token here
        metadata={"tokenizer.ggml.eom_token_id": eom},
    )
    header = read_gguf_file(path).header_bytes
    expected = [2, vocab_size - 3, eom]  # </s>, <|im_end|>, the named end of message
    for _ in range(2):  # from the file, then from the kept folder
        config, _ = gguf_config_and_tokenizer(path, header)
        assert config.eos_token_id == expected
    loaded = load_text_generator(parse_spec(str(path)), Knobs(generation_threads=1))
    try:
        assert loaded.engine is not None
        assert set(loaded.engine.eos_token_ids) == set(expected)
    finally:
        loaded.close()
