"""ServerSettings, config files and the ``serve`` command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchline.__main__ import main
from batchline._errors import InputError
from batchline.server import ServerSettings, load_config


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHLINE_API_KEY", raising=False)


def test_defaults_are_safe() -> None:
    s = ServerSettings()
    assert s.host == "127.0.0.1"
    assert s.api_key is None
    assert s.knobs.batching is True
    assert s.truncate is True
    assert [spec.name for spec in s.specs] == ["all-MiniLM-L6-v2"]
    assert ServerSettings(model_name="mini").specs[0].name == "mini"


def test_model_specs_single_and_several(tmp_path: Path) -> None:
    onnx_file = tmp_path / "e5-small.onnx"
    onnx_file.write_bytes(b"x")
    assert [s.name for s in ServerSettings(model=str(onnx_file)).specs] == ["e5-small"]
    specs = ServerSettings(model=["emb=default", f"clf={onnx_file}"], task=["clf=predict"]).specs
    assert [(s.name, s.task) for s in specs] == [("emb", None), ("clf", "predict")]
    with pytest.raises(InputError, match="no such model file"):
        ServerSettings(model=str(tmp_path / "missing.onnx")).specs  # noqa: B018
    with pytest.raises(InputError, match="two models are named"):
        ServerSettings(model=["a=default", "a=default"]).specs  # noqa: B018
    with pytest.raises(InputError, match="single model"):
        ServerSettings(model=["a=default", "b=default"], model_name="x").specs  # noqa: B018
    with pytest.raises(InputError, match="model_weights names c"):
        ServerSettings(model=["a=default"], model_weights={"c": 2}).specs  # noqa: B018


def test_knob_fields_are_knobs_fields_with_knobs_validation() -> None:
    import dataclasses

    from batchline.models.config import Knobs
    from batchline.server.settings import KNOB_FIELDS, SETTING_NAMES

    assert set(KNOB_FIELDS) == {f.name for f in dataclasses.fields(Knobs)}
    assert set(KNOB_FIELDS) <= SETTING_NAMES
    s = ServerSettings(sessions=3, target_batch_tokens=128, device="cuda:1")
    knobs = s.knobs
    assert isinstance(knobs, Knobs)
    assert (knobs.sessions, knobs.max_concurrent_batches) == (3, 3)  # one slot per session
    assert (knobs.target_batch_tokens, knobs.device) == (128, "cuda:1")
    # serve's measured defaults, where they differ from Knobs'
    assert (knobs.target_batch_tokens, knobs.max_batch_size) == (128, 64)
    assert ServerSettings().knobs.solo_intra_op_threads == 2
    assert ServerSettings().knobs.max_queue_size == 2048
    # the same checks as Knobs, with Knobs' words
    for bad, match in (({"device": "tpu"}, "device must be cpu"), ({"min_batch_size": 0}, ">= 1")):
        with pytest.raises(InputError, match=match):
            ServerSettings.build(bad)
    # every other default is Knobs' own
    serve_own = {
        "target_batch_tokens",
        "max_batch_size",
        "max_concurrent_batches",
        "max_queue_size",
        "solo_intra_op_threads",
        "bulk_slots",
        "bulk_thread_nice",
        "bulk_batch_tokens",
    }
    defaults, served = Knobs(), ServerSettings().knobs
    # bulk (the Batch API's lines) in a lane of its own: a slot per session, lowered threads
    assert (served.bulk_slots, served.bulk_thread_nice) == (served.sessions, 19)
    assert served.bulk_batch_tokens == 512
    assert ServerSettings.build({"sessions": 3}).knobs.bulk_slots == 3
    assert ServerSettings.build({"bulk_slots": None}).knobs.bulk_slots is None
    for name in set(KNOB_FIELDS) - serve_own:
        assert getattr(served, name) == getattr(defaults, name), name
    base = ServerSettings(batching=False, baseline_intra_op_threads=4).baseline_knobs
    assert (base.batching, base.sessions, base.intra_op_threads) == (False, 1, 4)


def test_toml_and_json_files_and_overrides(tmp_path: Path) -> None:
    toml = tmp_path / "serve.toml"
    toml.write_text("port = 9001\nmax_queue_size = 4096\n[server]\nsessions = 1\n")
    s = ServerSettings.from_file(toml, port=9002, host=None)
    assert (s.port, s.knobs.max_queue_size, s.knobs.sessions) == (9002, 4096, 1)
    js = tmp_path / "serve.json"
    js.write_text(json.dumps({"batching": False, "request_timeout_s": 2.5}))
    s = ServerSettings.from_file(js)
    assert s.knobs.batching is False
    assert s.request_timeout_s == 2.5
    noext = tmp_path / "serve.conf"
    noext.write_text('{"port": 1234}')
    assert load_config(noext) == {"port": 1234}


def test_write_round_trips_without_the_key(tmp_path: Path) -> None:
    s = ServerSettings.build(
        {"target_batch_tokens": 1024, "api_key": "hush"}, max_batch_size=32, truncate=False
    )
    for name in ("tuned.toml", "tuned.json"):
        path = s.write(tmp_path / name)
        text = path.read_text()
        assert "hush" not in text
        assert "api_key" not in text
        again = ServerSettings.from_file(path)
        assert again.knobs.target_batch_tokens == 1024
        assert again.knobs.max_batch_size == 32
        assert again.truncate is False
        assert again.api_key is None


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"max_queue_szie": 10}, "max_queue_szie"),
        ({"port": 70000}, "port"),
        ({"sessions": 0}, "sessions"),
        ({"max_queue_size": 10, "max_inputs_per_request": 20}, "max_inputs_per_request"),
        ({"request_timeout_s": "soon"}, "request_timeout_s"),
        ({"api_key": ""}, "api_key"),
    ],
)
def test_bad_settings_are_one_clear_input_error(data: dict[str, object], match: str) -> None:
    with pytest.raises(InputError, match=match):
        ServerSettings.build(data)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("port = = 3")
    with pytest.raises(InputError, match="not a valid TOML config file"):
        load_config(bad)
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    with pytest.raises(InputError, match="table of settings"):
        load_config(arr)


def test_cli_print_config_merges_file_and_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("max_queue_size = 3000\nport = 9100\n")
    code = main(
        [
            "serve",
            "--config",
            str(cfg),
            "--port",
            "9200",
            "--no-batching",
            "--request-timeout-s",
            "7",
            "--api-key",
            "topsecret",
            "--print-config",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    data = json.loads(out)
    assert data["port"] == 9200
    assert data["max_queue_size"] == 3000
    assert data["batching"] is False
    assert data["request_timeout_s"] == 7.0
    assert "topsecret" not in out


def test_cli_errors_are_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", str(tmp_path / "nope.onnx")]) == 2
    assert "no such model file" in capsys.readouterr().err
    from tests.models.onnx_builders import token_encoder

    model = token_encoder(tmp_path, pooled=True)  # a text model with no tokenizer beside it
    assert main(["serve", "--model", str(model)]) == 2
    assert "--tokenizer" in capsys.readouterr().err
    assert main(["serve", "--model", "a=default", "--model", "b=default", "--task", "x"]) == 2
    assert "--task NAME=x" in capsys.readouterr().err
    assert main(["serve", "--max-queue", "0"]) == 2
    assert "max_queue_size" in capsys.readouterr().err
    # a generation knob where no model generates changed nothing: refused, flag or --set
    assert main(["serve", "--model", "default", "--weights", "int4"]) == 2
    assert "--weights goes with a generate model" in capsys.readouterr().err
    assert main(["serve", "--model", "default", "--set", "weights=int4"]) == 2
    assert "--set weights goes with a generate model" in capsys.readouterr().err


def test_a_tuned_knobs_file_is_a_server_config(tmp_path: Path) -> None:
    from batchline.models.config import Knobs

    path = tmp_path / "tuned.json"
    Knobs(target_batch_tokens=1024, max_concurrent_batches=3, sessions=2).dump(
        path, comment="from batchline tune", measured={"rps": 1000}
    )
    s = ServerSettings.from_file(path)
    assert s.knobs.target_batch_tokens == 1024
    assert s.knobs.max_concurrent_batches == 3
    assert s.knobs.sessions == 2
    assert s.knobs.max_queue_size == 5000


def test_cli_several_models_and_their_tasks(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "serve",
            "--model",
            "emb=default",
            "--model",
            "clf=mymod:factory",
            "--task",
            "clf=predict",
            "--set",
            'model_weights={"clf": 2}',
            "--print-config",
        ]
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == ["emb=default", "clf=mymod:factory"]
    assert data["task"] == ["clf=predict"]
    assert data["model_weights"] == {"clf": 2.0}
    assert main(["serve", "--model", "a=default", "--task", "b=embed"]) == 2
    assert "no model named 'b'" in capsys.readouterr().err
    assert main(["serve", "--model", "a=default", "--model", "b=default", "--pooling", "cls"]) == 2
    assert "single --model" in capsys.readouterr().err
    assert main(["serve", "--model", "gen=smollm2", "--task", "gen=embed"]) == 2
    assert "generate" in capsys.readouterr().err
    assert main(["serve", "--model", "gen=smollm2", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == ["gen=smollm2"]


def test_the_body_limit_makes_room_for_a_picture_unless_it_is_set() -> None:
    from batchline.server.settings import BODY_JSON_ROOM, DEFAULT_MAX_BODY_BYTES

    s = ServerSettings()
    assert s.body_limit(pictures=False) == DEFAULT_MAX_BODY_BYTES
    # the default 10 MiB picture in base64 is 13.3 MiB: more than the 8 MiB of a text server
    ten = 10 * 1024 * 1024
    assert s.body_limit(pictures=True) == -(-ten * 4 // 3) + BODY_JSON_ROOM
    small = ServerSettings(max_image_bytes=1000)
    assert small.body_limit(pictures=True) == DEFAULT_MAX_BODY_BYTES
    # set by the user: what they set, pictures or not
    assert ServerSettings(max_body_bytes=4096).body_limit(pictures=True) == 4096


def test_byte_sizes_take_units(capsys: pytest.CaptureFixture[str]) -> None:
    s = ServerSettings.build({"max_body_bytes": "1MiB"}, max_image_bytes="500KB")
    assert (s.max_body_bytes, s.max_image_bytes) == (1 << 20, 500_000)
    assert main(["serve", "--max-image-bytes", "20MiB", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["max_image_bytes"] == 20 << 20
    assert main(["serve", "--set", "max_decode_bytes=1GiB", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["max_decode_bytes"] == 1 << 30
    with pytest.raises(SystemExit) as exited:  # argparse's own one line
        main(["serve", "--max-image-bytes", "lots"])
    assert exited.value.code == 2
    assert "--max-image-bytes" in capsys.readouterr().err


def test_help_says_what_the_queue_takes_and_that_long_texts_are_cut(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse's line breaks aside
    assert "max_queue_size + (prefetch_batches + 1) x max_batch_size" in text
    assert "--set truncate=false answers it with 413" in text
    docs = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    assert "max_queue_size + (prefetch_batches + 1) × max_batch_size" in docs
    assert "--set truncate=false" in docs
