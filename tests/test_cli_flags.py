"""One flag, one meaning: the options run, serve, drive, bench and tune share are defined once,
and a wrong setting name is answered with the closest valid one, in one line, exit code 2."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from batchline.__main__ import build_parser, main
from batchline.models.config import SHARED_HELP
from batchline.models.selection import MODEL_HELP, TASK_HELP

COMMANDS = ("run", "serve", "drive", "bench", "tune")

#: Options that two commands spell alike yet that are not (yet) one definition, and why.
#: A new shared spelling must join SHARED_HELP or this list, with its reason.
NOT_SHARED = {
    "--address": "run's and serve's are the same text (the Ray cluster to join)",
    "--allow-empty": "the dataset flags: one definition (datasets.selection)",
    "--copy-column": "the dataset flags: one definition (datasets.selection)",
    "--format": "the dataset flags: one definition (datasets.selection)",
    "--id-column": "the dataset flags: one definition (datasets.selection)",
    "--limit": "the dataset flags: one definition (datasets.selection)",
    "--on-bad-record": "the dataset flags: one definition (datasets.selection)",
    "--output-format": "the dataset flags: one definition (datasets.selection)",
    "--overwrite": "the dataset flags: one definition (datasets.selection)",
    "--resume": "the dataset flags: one definition (datasets.selection)",
    "--text-column": "one definition (datasets.selection.add_text_column_argument)",
    "--inputs": "bench's and tune's: one definition (bench.cli._model_and_inputs)",
    "--lengths": "bench's and tune's: one definition (bench.cli._model_and_inputs)",
    "--help": "argparse's",
    # same meaning, each command's default or direction stated after it
    "--api-key": "serve requires the key, drive sends it",
    "--duration": "seconds per load point; tune plans it from --budget-s by default",
    "--load": "the load shape; bench and tune default to different points",
    "--engine": "local or ray: what 'ray' starts differs (replicas of a job, Ray Serve)",
    "--replicas": "run takes N, serve N or MIN-MAX (autoscaling)",
    "--max-image-pixels": "the same limit; run and serve have different defaults",
    "--max-tokens": "per prompt; drive's default is the server's",
    "--no-chat-template": "drive sends prompts as they are, run encodes them so",
    "--task": "one text (TASK_HELP); serve's metavar names the model it applies to, [NAME=]TASK",
    "--tokenizer": "serve's applies to a single model",
    "--labels": "serve's applies to a single model",
    "--pooling": "serve's applies to a single model",
    "--normalize": "serve's applies to a single model",
    "--no-normalize": "serve's applies to a single model",
    "--top-k": "the model flags: one definition (models.selection.add_model_arguments)",
    # known to differ, left for a later rename
    "--output": "each command's result: a folder (run, drive, bench) or tune's config file",
    "--seed": "run's seeds sampling, bench's and tune's the sample and arrivals",
}


def _parsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sub.choices[name] for name in COMMANDS}


def _visible(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        option: action
        for action in parser._actions
        if action.help != argparse.SUPPRESS
        for option in action.option_strings
        if option.startswith("--")
    }


def test_every_shared_option_has_one_name_metavar_and_meaning() -> None:
    options = {name: _visible(p) for name, p in _parsers().items()}
    shared_by: dict[str, list[str]] = {}
    for name, actions in options.items():
        for option in actions:
            shared_by.setdefault(option, []).append(name)
    common = {option for option, names in shared_by.items() if len(names) > 1}
    defined_once = {*SHARED_HELP, "--model", "--config"}
    assert common - defined_once - set(NOT_SHARED) == set()
    for option, help_text in {**SHARED_HELP, "--model": MODEL_HELP, "--task": TASK_HELP}.items():
        takers = shared_by.get(option, [])
        assert len(takers) > 1, f"{option} is not shared"
        metavars = {options[name][option].metavar for name in takers}
        assert len(metavars) == 1 or option == "--task", f"{option}: metavars {metavars}"
        for name in takers:
            assert (options[name][option].help or "").startswith(help_text), (option, name)
    # the knob flags: run and serve take each of them, from one place
    for flag in ("--config", "--set", "--sessions", "--intra-op-threads", "--max-batch-size"):
        assert {"run", "serve"} <= set(shared_by[flag]), flag
    assert {"run", "serve", "bench", "tune"} <= set(shared_by["--device"])


def test_a_word_means_one_thing_drive_renamed_its_two() -> None:
    options = {name: _visible(p) for name, p in _parsers().items()}
    assert shared_help_of(options, "--chunk-size") == {"run": "records per output chunk"}
    assert "--model" not in options["drive"]
    assert "--records-per-request" in options["drive"]
    assert "--request-model" in options["drive"]


def shared_help_of(options: dict[str, dict[str, argparse.Action]], flag: str) -> dict[str, str]:
    return {name: str(actions[flag].help) for name, actions in options.items() if flag in actions}


def test_drive_s_old_spellings_still_work_with_a_one_line_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = _parsers()["drive"]
    args = parser.parse_args(["--endpoint", "http://x", "--chunk-size", "7", "--model", "m"])
    assert (args.chunk_size, args.model) == (7, "m")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2
    assert "--chunk-size is deprecated" in err[0]
    assert "use --records-per-request" in err[0]
    assert "--model is deprecated" in err[1]
    assert "use --request-model" in err[1]
    args = parser.parse_args(["--endpoint", "http://x", "--records-per-request", "7"])
    assert args.chunk_size == 7
    assert capsys.readouterr().err == ""


def test_bench_s_route_is_now_protocol_and_the_old_spelling_warns(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--route`` is drive's server route; bench's protocol flag is ``--protocol``."""
    parser = _parsers()["bench"]
    assert "--protocol" in _visible(parser)
    assert "--route" not in _visible(parser)
    args = parser.parse_args(["--target", "http://x", "--route", "oip"])
    assert args.route == "oip"
    (line,) = capsys.readouterr().err.splitlines()
    assert "--route is deprecated" in line
    assert "use --protocol" in line
    args = parser.parse_args(["--target", "http://x", "--protocol", "oip"])
    assert args.route == "oip"
    assert capsys.readouterr().err == ""


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("command", ["run", "serve"])
def test_a_set_typo_names_the_closest_setting(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("pydantic")
    extra = ["--print-config"] if command == "serve" else []
    assert main([command, "--set", "max_batch_sise=8", *extra]) == 2
    line = _one_error_line(capsys)
    assert "unknown setting 'max_batch_sise'" in line
    assert "did you mean 'max_batch_size'?" in line
    assert "intra_op_threads" in line  # the valid names are listed


@pytest.mark.parametrize("command", ["run", "serve"])
def test_a_config_file_typo_names_the_closest_setting(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("pydantic")
    config = tmp_path / "knobs.json"
    config.write_text(json.dumps({"sesions": 2}))
    extra = ["--print-config"] if command == "serve" else []
    assert main([command, "--config", str(config), *extra]) == 2
    line = _one_error_line(capsys)
    assert f"{config}: unknown setting 'sesions' (did you mean 'sessions'?)" in line


def test_run_s_set_sets_its_knobs(tmp_path: Path) -> None:
    from batchline.jobs.cli import _knobs

    parser = _parsers()["run"]
    config = tmp_path / "knobs.toml"
    config.write_text("max_batch_size = 4\nsessions = 3\n")
    args = parser.parse_args(["--config", str(config), "--set", "max_batch_size=8"])
    knobs = _knobs(args)
    assert (knobs.max_batch_size, knobs.sessions) == (8, 3)  # --set wins over the file
    args = parser.parse_args(["--set", "sessions=2", "--set", "mix_priorities=true"])
    knobs = _knobs(args)
    assert (knobs.sessions, knobs.max_concurrent_batches, knobs.mix_priorities) == (2, 2, True)
    # a flag wins over --set
    args = parser.parse_args(["--set", "max_batch_size=8", "--max-batch-size", "16"])
    assert _knobs(args).max_batch_size == 16


def test_a_bad_set_item_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--set", "max_batch_size"]) == 2
    assert "expected KEY=VALUE" in _one_error_line(capsys)
    assert main(["run", "--set", "max_batch_size=lots"]) == 2
    assert "max_batch_size must be a number, got 'lots'" in _one_error_line(capsys)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["run", "--input", "data.jsonl"], "--input could be --input-column"),
        (["run", "in.jsonl", "--out", "o"], "--out could be --output, --output-format"),
        (["serve", "--mod", "x"], "--mod could be --model, --modality"),
        (
            ["drive", "in.jsonl", "--endpoint", "http://h:1", "--conc", "3"],
            "--conc could be --concurrency",
        ),
    ],
)
def test_a_cut_short_flag_is_refused_by_its_command_naming_what_it_could_be(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # argparse would read a unique prefix as the flag: `run --input FILE` ran the built-in data
    # with FILE as the --input-column, and nothing said so
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"batchline {argv[0]}: error: unrecognized arguments: " in err
    assert said in err
    assert err.startswith(f"usage: batchline {argv[0]} ")


def test_an_unknown_argument_no_flag_begins_is_said_plainly(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["models", "pull", "smollm2", "--zz"])
    err = capsys.readouterr().err
    assert "batchline models pull: error: unrecognized arguments: --zz\n" in err
    assert "could be" not in err
