"""The CLI's knob flags are built from the settings classes' fields (``batchline._flags``): each
field has exactly one flag, its choices are the field's ``Literal``, and no command writes a knob
flag or a choice list by hand beside them. A round trip: flags -> knobs -> policy -> batcher."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Literal

import pytest

from batchline import BatchPolicy, DynamicBatcher
from batchline.__main__ import build_parser, main
from batchline._flags import (
    add_field_flags,
    built_from,
    field_choices,
    field_flag,
    field_help,
    flag_name,
)
from batchline.knobs import GENERATION_BACKENDS, SHARED_HELP, Knobs

COMMANDS = ("run", "serve", "drive", "bench", "tune")
KNOB_FIELDS = tuple(f.name for f in dataclasses.fields(Knobs))


def _parsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sub.choices[name] for name in COMMANDS}


def _actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings]


@pytest.mark.parametrize("command", ["run", "serve"])
def test_every_knob_has_exactly_one_flag_built_from_its_field(command: str) -> None:
    actions = _actions(_parsers()[command])
    for name in KNOB_FIELDS:
        built = [a for a in actions if built_from(a) == ("Knobs", name)]
        assert len(built) == 1, (command, name, built)
        (action,) = built
        assert action.dest == name
        assert action.option_strings[0] == field_flag(Knobs, name)
        assert str(action.help).startswith(field_help(Knobs, name))
        choices = field_choices(Knobs, name)
        if choices is not None:
            assert tuple(action.choices or ()) == choices, name


def test_no_knob_flag_or_choice_list_is_written_by_hand() -> None:
    """Every flag named after a knob, or storing into one, comes from the builder (a
    deprecated old spelling aside), and no hand-written flag repeats a knob's choices."""
    knob_flags = {o for f in KNOB_FIELDS for o in (flag_name(f), "--no-" + flag_name(f)[2:])}
    knob_choices = {tuple(c) for f in KNOB_FIELDS if (c := field_choices(Knobs, f)) is not None}
    assert tuple(GENERATION_BACKENDS) in knob_choices
    for command, parser in _parsers().items():
        for action in _actions(parser):
            if built_from(action) is not None or action.help == argparse.SUPPRESS:
                continue
            where = (command, action.option_strings)
            assert not set(action.option_strings) & knob_flags, where
            assert action.dest not in KNOB_FIELDS, where
            if action.choices is not None:
                assert tuple(action.choices) not in knob_choices, where


def test_every_knob_flag_s_help_is_its_field_s_and_shared_help_holds_it() -> None:
    for name in KNOB_FIELDS:
        help_text = field_help(Knobs, name)
        assert help_text.endswith(f"(knob: {name})")
        assert SHARED_HELP[field_flag(Knobs, name)] == help_text


def test_flags_round_trip_through_knobs_and_policy_to_the_batcher() -> None:
    from batchline.jobs.cli import _knobs

    args = _parsers()["run"].parse_args(
        [
            "--set",
            "max_batch_size=4",
            "--max-batch-size",
            "8",
            "--target-batch-tokens",
            "300",
            "--min-batch-size",
            "2",
            "--batch-timeout-s",
            "0.25",
            "--max-queue-size",
            "40",
            "--mix-priorities",
            "--priority-yield",
            "1.0",
            "--bulk-slots",
            "1",
            "--bulk-thread-nice",
            "5",
            "--bulk-batch-tokens",
            "600",
            "--sessions",
            "3",
        ]
    )
    knobs = _knobs(args)
    policy = knobs.policy()
    assert policy == BatchPolicy(
        target_batch_cost=300,
        max_batch_size=8,  # the flag wins over --set
        min_batch_size=2,
        batch_timeout_s=0.25,
        max_queue_size=40,
        max_concurrent_batches=3,  # --sessions: one batch in flight per session
        mix_priorities=True,
        priority_yield=1.0,
        bulk_slots=1,
        bulk_thread_nice=5,
        bulk_batch_cost=600,
    )
    batcher: DynamicBatcher[Any, Any] = DynamicBatcher(lambda b: b, policy=policy)
    assert (batcher.max_batch_size, batcher.target_batch_cost) == (8, 300)
    assert (batcher.max_queue_size, batcher.max_concurrent_batches) == (40, 3)
    assert batcher.queue_capacity == 40 + 3 * 8


def test_unset_flags_leave_the_knobs_alone_and_bools_take_both_forms() -> None:
    from batchline.jobs.cli import _knobs

    parser = _parsers()["run"]
    assert _knobs(parser.parse_args([])) == Knobs()
    knobs = _knobs(parser.parse_args(["--no-batching", "--engine-process", "--no-eager"]))
    assert (knobs.batching, knobs.engine_process, knobs.eager) == (False, True, False)
    knobs = _knobs(parser.parse_args(["--eager", "--generation-backend", "vllm"]))
    assert (knobs.eager, knobs.generation_backend) == (True, "vllm")


def test_serve_takes_the_same_flags_into_its_settings(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("pydantic")
    argv = ["serve", "--max-batch-size", "16", "--kv-cache-gib", "2.5", "--print-config"]
    assert main([*argv, "--vllm-scheduling-policy", "priority"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["max_batch_size"], printed["kv_cache_gib"]) == (16, 2.5)
    assert printed["vllm_scheduling_policy"] == "priority"


def test_serve_s_old_max_queue_spelling_still_sets_the_knob(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = _parsers()["serve"].parse_args(["--max-queue", "7"])
    assert args.max_queue_size == 7
    assert "use --max-queue-size" in capsys.readouterr().err


# -- the builder itself, on a class of its own ----------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Toy:
    mode: Literal["fast", "exact"] = dataclasses.field(
        default="fast", metadata={"help": "how to run"}
    )
    level: int | None = dataclasses.field(default=None, metadata={"help": "how hard"})
    ratio: float = dataclasses.field(default=0.5, metadata={"help": "a share"})
    color: str = dataclasses.field(
        default="red", metadata={"help": "a colour", "choices": ("red", "blue")}
    )
    on: bool = dataclasses.field(default=True, metadata={"help": "on", "off": "turn it off"})
    loud: bool = dataclasses.field(default=False, metadata={"help": "be loud"})
    maybe: bool | None = dataclasses.field(default=None, metadata={"help": "perhaps"})


def test_the_builder_reads_type_choices_help_and_bool_forms_from_the_fields() -> None:
    p = argparse.ArgumentParser()
    actions = add_field_flags(p, _Toy, more={"ratio": "this command's own words"})
    assert [a.option_strings[0] for a in actions] == [
        "--mode", "--level", "--ratio", "--color", "--no-on", "--loud", "--maybe",
    ]  # fmt: skip
    assert all(built_from(a) == ("_Toy", a.dest) for a in actions)
    assert actions[2].help == "a share (knob: ratio); this command's own words"
    assert actions[4].help == "turn it off (knob: on)"
    args = p.parse_args([])
    assert all(getattr(args, f.name) is None for f in dataclasses.fields(_Toy))  # not given
    args = p.parse_args(
        ["--mode", "exact", "--level", "3", "--ratio", "0.25", "--color", "blue", "--no-on"]
    )
    assert (args.mode, args.level, args.ratio, args.color, args.on) == (
        "exact",
        3,
        0.25,
        "blue",
        False,
    )
    args = p.parse_args(["--loud", "--no-maybe"])
    assert (args.loud, args.maybe) == (True, False)
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "slow"])


def test_a_field_without_help_is_refused_by_the_builder() -> None:
    @dataclasses.dataclass
    class Bare:
        size: int = 1

    with pytest.raises(ValueError, match=r"Bare.size has no metadata help: write it on the field"):
        add_field_flags(argparse.ArgumentParser(), Bare)
