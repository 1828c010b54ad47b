"""The deployment's knobs by layer: the core's ``CoreKnobs``, each backend's options class
beside its backend, and ``models/config.py``'s ``Knobs`` composing them, flat."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from batchline._errors import InputError
from batchline.knobs import CoreKnobs, machine_cores
from batchline.models.config import Knobs, knob_names
from batchline.models.generation.options import (
    GenerationBackendOptions,
    GenerationOptions,
    TorchEngineOptions,
    VllmOptions,
)
from batchline.models.onnx.options import SessionOptions

#: Every knob, in order, with its default (``machine_cores``: this machine's cores): the flat
#: list the composed class must keep (config files, ``--set`` and ``serve`` read these names).
FLAT: list[tuple[str, Any]] = [
    ("batching", True),
    ("target_batch_tokens", 512),
    ("max_batch_size", 256),
    ("max_concurrent_batches", machine_cores),
    ("min_batch_size", 1),
    ("batch_timeout_s", 0.05),
    ("max_queue_size", 5000),
    ("mix_priorities", False),
    ("priority_yield", 0.5),
    ("bulk_slots", None),
    ("bulk_thread_nice", 0),
    ("bulk_batch_tokens", None),
    ("device", "cpu"),
    ("sessions", machine_cores),
    ("intra_op_threads", 1),
    ("solo_intra_op_threads", None),
    ("quantize", None),
    ("precision", "auto"),
    ("generation_batching", "continuous"),
    ("max_running_sequences", 64),
    ("start_running_sequences", 16),
    ("kv_token_budget", 16_384),
    ("generation_backend", "torch"),
    ("dtype", "auto"),
    ("generation_threads", None),
    ("weights", "auto"),
    ("activations", "auto"),
    ("dense_linears", "auto"),
    ("max_step_tokens", 512),
    ("engine_process", False),
    ("huge_pages", True),
    ("max_context_tokens", None),
    ("kv_cache_gib", None),
    ("gpu_memory_fraction", None),
    ("eager", None),
    ("vllm_scheduling_policy", "fcfs"),
]


def _names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def test_the_composed_class_keeps_every_knob_flat_with_its_default() -> None:
    knobs = Knobs()
    assert _names(Knobs) == [name for name, _ in FLAT]
    for name, default in FLAT:
        want = default() if callable(default) else default
        assert getattr(knobs, name) == want, name


def test_each_part_holds_its_own_concern_on_top_of_the_core() -> None:
    core = _names(CoreKnobs)
    # the device is core (every backend reads it); its flag comes with the sessions' group
    assert core == [*knob_names("batching"), "device"]
    sessions = [name for name in knob_names("sessions") if name != "device"]
    assert _names(SessionOptions) == core + sessions
    assert _names(GenerationOptions) == core + list(knob_names("generation"))
    assert _names(TorchEngineOptions) == _names(GenerationOptions) + list(knob_names("torch"))
    assert _names(VllmOptions) == _names(GenerationOptions) + list(knob_names("vllm"))
    for part in (SessionOptions, GenerationBackendOptions, TorchEngineOptions, VllmOptions):
        assert issubclass(Knobs, part)
    # a part is frozen and keyword-only, as the whole is
    with pytest.raises(dataclasses.FrozenInstanceError):
        SessionOptions().sessions = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        CoreKnobs(True)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("cls", "changes", "message"),
    [
        (CoreKnobs, {"device": "tpu"}, "device must be cpu, cuda or cuda:N"),
        (CoreKnobs, {"batching": "yes"}, "batching must be true or false"),
        (CoreKnobs, {"bulk_batch_tokens": 0}, "bulk_batch_tokens must be an integer >= 1"),
        (CoreKnobs, {"max_batch_size": 0}, "max_batch_size"),
        (SessionOptions, {"sessions": 0}, "sessions must be >= 1"),
        (SessionOptions, {"solo_intra_op_threads": 0}, "solo_intra_op_threads must be >= 1"),
        (SessionOptions, {"precision": "fp16"}, "precision must be one of auto, fp32"),
        (SessionOptions, {"quantize": "int4"}, "quantize must be int8 or unset"),
        (SessionOptions, {"quantize": "int8", "precision": "bf16"}, "disagree"),
        (GenerationOptions, {"kv_token_budget": 1}, "kv_token_budget must be an integer >= 2"),
        (GenerationOptions, {"generation_backend": "tgi"}, "generation_backend must be torch or"),
        (TorchEngineOptions, {"generation_threads": 0}, "generation_threads must be an integer"),
        (TorchEngineOptions, {"weights": "int2"}, "weights must be one of auto"),
        (TorchEngineOptions, {"activations": "int4"}, "activations must be one of auto, float"),
        (TorchEngineOptions, {"dense_linears": "mkl"}, "dense_linears must be one of auto, onednn"),
        (TorchEngineOptions, {"engine_process": 1}, "engine_process must be true or false"),
        (TorchEngineOptions, {"huge_pages": "yes"}, "huge_pages must be true or false"),
        (VllmOptions, {"gpu_memory_fraction": 1.5}, r"gpu_memory_fraction must be in \(0, 1\]"),
        (VllmOptions, {"max_context_tokens": 1}, "max_context_tokens must be an integer >= 2"),
        (VllmOptions, {"vllm_scheduling_policy": "lifo"}, "fcfs or priority"),
    ],
)
def test_each_part_checks_its_own_fields(cls: type, changes: dict[str, Any], message: str) -> None:
    with pytest.raises(InputError, match=message):
        cls(**changes)
    with pytest.raises(InputError, match=message):  # and so does the whole
        Knobs(**changes)


def test_a_part_normalises_its_own_fields_alone_and_in_the_whole() -> None:
    assert SessionOptions(quantize="int8").precision == "int8"
    assert Knobs(quantize="int8").precision == "int8"
    assert SessionOptions(device="cuda:1").providers == [
        ("CUDAExecutionProvider", {"device_id": "1"})
    ]
    assert GenerationOptions(device="cuda").is_gpu
    # each part's replace keeps its own class
    assert type(TorchEngineOptions().replace(max_step_tokens=8)) is TorchEngineOptions
    assert type(Knobs().replace(sessions=1)) is Knobs


#: One key of every concern, set away from its default.
_FILE = {
    "max_batch_size": 8,
    "device": "cpu",
    "sessions": 2,
    "precision": "fp32",
    "max_running_sequences": 5,
    "dtype": "float32",
    "max_step_tokens": 64,
    "weights": "int8",
    "kv_cache_gib": 0.5,
    "eager": True,
    "vllm_scheduling_policy": "priority",
}


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_a_config_file_with_every_concern_round_trips(tmp_path: Path, suffix: str) -> None:
    knobs = Knobs(**_FILE)
    path = knobs.dump(tmp_path / f"knobs{suffix}")
    assert Knobs.load(path) == knobs
    written = path.read_text(encoding="utf-8")
    data = json.loads(written) if suffix == ".json" else None
    for name in ("weights", "vllm_scheduling_policy", "precision", "max_batch_size"):
        assert (data is not None and name in data) or f"{name} =" in written


def test_a_part_loads_only_its_own_keys(tmp_path: Path) -> None:
    path = Knobs(**_FILE).dump(tmp_path / "knobs.json")
    with pytest.raises(InputError, match="kv_cache_gib"):
        SessionOptions.load(path)  # vLLM's keys are not the sessions'
    only = tmp_path / "sessions.json"
    only.write_text(json.dumps({"sessions": 2, "max_batch_size": 8}), encoding="utf-8")
    assert SessionOptions.load(only) == SessionOptions(sessions=2, max_batch_size=8)


def test_the_generation_knobs_a_command_line_typed_are_named_as_typed() -> None:
    import argparse

    from batchline.models.config import add_generation_knob_arguments, generation_knobs_typed

    parser = argparse.ArgumentParser()
    parser.add_argument("--set", action="append", default=[])
    add_generation_knob_arguments(parser)
    # nothing typed: nothing named, whatever the knobs' defaults are
    assert generation_knobs_typed(parser.parse_args([]), []) == []
    args = parser.parse_args(["--weights", "int4"])
    # a --set of a batching knob is not a generation one
    named = generation_knobs_typed(args, ["max_running_sequences", "max_batch_size"])
    assert named == ["--weights", "--set max_running_sequences"]
