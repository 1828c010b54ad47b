"""Several API keys (comma-separated, or a keys file) and the Batch API's settings."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pydantic")

from batchline._errors import InputError
from batchline.server.settings import ServerSettings


def test_keys_come_comma_separated_and_from_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("k1\n# a comment\n\n  k2  \nk1\n", encoding="utf-8")
    monkeypatch.setenv("BATCHLINE_API_KEY", " sk-a , sk-b,")
    settings = ServerSettings.build(api_key_file=keys)
    assert settings.api_keys == ("sk-a", "sk-b", "k1", "k2")
    assert "sk-a" not in repr(settings.to_dict())  # the keys are never written out
    monkeypatch.delenv("BATCHLINE_API_KEY")
    assert ServerSettings.build().api_keys == ()


def test_a_bad_keys_setting_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"api_key_file .*missing"):
        ServerSettings.build(api_key_file=tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n", encoding="utf-8")
    with pytest.raises(InputError, match="holds no key"):
        ServerSettings.build(api_key_file=empty)
    with pytest.raises(InputError, match="holds no key"):
        ServerSettings.build(api_key=" , ")


def test_the_data_dir_defaults_under_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path / "cache"))
    assert ServerSettings.build().batch_data_dir == tmp_path / "cache" / "batch-api"
    assert ServerSettings.build(data_dir=tmp_path / "d").batch_data_dir == tmp_path / "d"
