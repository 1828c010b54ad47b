"""Completions kept across runs (``run --task generate --cache DIR``): a re-run takes what an
earlier run generated for the same generator, settings and prompt, written bit for bit as the
computed record; it generates only what changed; sampling without a seed is never kept; the key
changes with the model's files, a setting and the prompt; a resumed job writes each record
once."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from batchline._errors import InputError
from batchline.datasets.sinks import ChunkWriter, Manifest
from batchline.jobs.generate_cache import request_key
from batchline.models.config import Knobs
from batchline.models.generation import Constraint, SamplingParams
from batchline.models.identity import model_identity
from batchline.models.specs import ModelSpec

from .test_generate import rows, run_job, tiny, write_prompts  # noqa: F401  (tiny: a fixture)

pytest.importorskip("transformers")

PROMPTS = [f"question {i}: what is {i} + {i * 3 % 7}?" for i in range(8)]


def outputs(out: Path) -> list[tuple[Any, ...]]:
    """What a record's row holds of its completion, in input order."""
    return [
        (r["index"], r["id"], r["text"], r["finish_reason"], r["prompt_tokens"],
         r["completion_tokens"])
        for r in rows(out)
    ]  # fmt: skip


def kept(cache: Path) -> int:
    """Completions the cache folder holds."""
    with sqlite3.connect(cache / "results.sqlite") as db:
        (n,) = db.execute("SELECT COUNT(*) FROM results").fetchone()
    return int(n)


# -- the key ------------------------------------------------------------------------------


#: A value other than the default for each SamplingParams field.
_OTHER: dict[str, object] = {
    "max_tokens": 9,
    "temperature": 0.5,
    "top_p": 0.5,
    "seed": 4,
    "stop": ("x",),
    "ignore_eos": True,
    "constraint": None,  # built in the test: it needs the grammar engine
    "priority": 3,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "logit_bias": ((5, 1.0),),
    "logprobs": 2,
    "prompt_logprobs": 2,
}


def test_every_setting_that_changes_the_tokens_is_in_the_key() -> None:
    # sampled with a seed, so that seed and top_p count too
    base = SamplingParams(max_tokens=8, temperature=0.7, seed=1)
    key = request_key([1, 2, 3], base)
    fields = [f.name for f in dataclasses.fields(SamplingParams)]
    unknown = [name for name in fields if name not in _OTHER]
    assert not unknown, f"say whether these SamplingParams fields change the tokens: {unknown}"
    grammar = importlib.util.find_spec("llguidance") is not None
    for name in fields:
        if name == "constraint" and not grammar:
            continue  # building a constraint needs the grammar engine
        other = Constraint.regex("[0-9]+") if name == "constraint" else _OTHER[name]
        changed = dataclasses.replace(base, **{name: other})
        if name == "priority":  # it orders admission, never the tokens
            assert request_key([1, 2, 3], changed) == key
        else:
            assert request_key([1, 2, 3], changed) != key, name
    assert request_key([1, 2, 4], base) != key  # the prompt
    # greedy ignores the seed, top_p and priority: a job's --seed gives each record its own
    greedy = SamplingParams(max_tokens=8)
    assert request_key([1], greedy) == request_key(
        [1], SamplingParams(max_tokens=8, seed=3, top_p=0.5, priority=2)
    )
    assert request_key([1], SamplingParams(temperature=0.7)) is None  # a draw each time


def generator_spec(folder: Path) -> ModelSpec:
    return ModelSpec(name="g", source=str(folder), kind="hf", task="generate")


def test_a_generators_identity_changes_with_its_files_backend_dtype_and_device(
    tmp_path: Path,
) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 64)
    spec = generator_spec(tmp_path)
    exact = Knobs(dtype="float32")
    identity = model_identity(spec, exact)
    assert identity == model_identity(spec, exact)
    others = [
        exact.replace(dtype="bfloat16"),  # rounds differently
        exact.replace(generation_backend="vllm"),  # another engine
        exact.replace(device="cuda"),  # other kernels
    ]
    assert len({identity, *(model_identity(spec, k) for k in others)}) == 4
    # how requests are batched and capped changes no greedy or seeded token
    batching = [
        exact.replace(generation_batching="static"),
        exact.replace(batching=False),
        exact.replace(max_running_sequences=3, kv_token_budget=1024),
    ]
    assert {model_identity(spec, k) for k in batching} == {identity}
    (tmp_path / "model.safetensors").write_bytes(b"\1" * 64)  # new weights
    assert model_identity(spec, exact) != identity


def test_a_batch_models_identity_ignores_the_generation_knobs(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"onnx")
    spec = ModelSpec(name="e", source=str(tmp_path), kind="hf", task="embed")
    assert model_identity(spec) == model_identity(spec, Knobs(dtype="bfloat16", device="cuda"))


# -- jobs ---------------------------------------------------------------------------------


def test_a_rerun_after_editing_one_record_generates_only_that_one(
    tiny: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    src = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    first = run_job(tiny, src, tmp_path / "first", cache=cache)
    assert first.cached == 0
    assert kept(cache) == len(PROMPTS)
    edited = list(PROMPTS)
    edited[3] = "an edited question"
    write_prompts(src, edited)
    again = run_job(tiny, src, tmp_path / "again", cache=cache)
    assert again.records == len(PROMPTS)
    assert again.cached == len(PROMPTS) - 1  # all but the edited one
    assert ("from the cache (earlier runs)", f"{len(PROMPTS) - 1:,}") in again.rows()
    # bit-identical to generating every record
    plain = run_job(tiny, src, tmp_path / "plain")
    assert plain.cached == 0
    got = outputs(tmp_path / "again")
    assert got == outputs(tmp_path / "plain")
    assert again.generated_tokens == got[3][5]  # the tokens generated: the edited record's
    was = outputs(tmp_path / "first")
    assert [g == w for g, w in zip(got, was, strict=True)] == [i != 3 for i in range(8)]
    assert Manifest.load(tmp_path / "again").complete


def test_another_setting_or_changed_model_files_take_nothing_from_the_cache(
    tiny: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    model = shutil.copytree(tiny, tmp_path / "model")
    cache = tmp_path / "cache"
    src = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[:4])
    run_job(model, src, tmp_path / "first", cache=cache)
    assert run_job(model, src, tmp_path / "same", cache=cache).cached == 4
    # a setting: another max_tokens, a stop string
    assert run_job(model, src, tmp_path / "longer", cache=cache, max_tokens=7).cached == 0
    assert run_job(model, src, tmp_path / "stop", cache=cache, stop=("zz",)).cached == 0
    # another dtype (bf16 rounds otherwise)
    bf16 = Knobs(dtype="bfloat16")
    assert run_job(model, src, tmp_path / "bf16", cache=cache, knobs=bf16).cached == 0
    # the model's files: one byte more in its config (the same model, but not the same file)
    config = model / "config.json"
    config.write_text(config.read_text() + " ")
    assert run_job(model, src, tmp_path / "touched", cache=cache).cached == 0


def test_sampling_without_a_seed_is_never_kept_and_with_one_it_is(
    tiny: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    src = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[:4])
    unseeded = tmp_path / "unseeded"
    run_job(tiny, src, tmp_path / "u1", cache=unseeded, temperature=0.8)
    assert kept(unseeded) == 0
    assert run_job(tiny, src, tmp_path / "u2", cache=unseeded, temperature=0.8).cached == 0
    seeded = tmp_path / "seeded"
    first = run_job(tiny, src, tmp_path / "s1", cache=seeded, temperature=0.8, seed=5)
    assert first.cached == 0
    again = run_job(tiny, src, tmp_path / "s2", cache=seeded, temperature=0.8, seed=5)
    assert again.cached == 4
    assert again.generated_tokens == 0
    assert outputs(tmp_path / "s2") == outputs(tmp_path / "s1")
    assert run_job(tiny, src, tmp_path / "s3", cache=seeded, temperature=0.8, seed=6).cached == 0


def test_duplicates_and_cached_records_are_counted_once_each(
    tiny: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[1]]
    src = write_prompts(tmp_path / "prompts.jsonl", prompts)
    first = run_job(tiny, src, tmp_path / "first", cache=cache)
    assert (first.duplicates, first.cached) == (2, 0)
    assert kept(cache) == 3
    again = run_job(tiny, src, tmp_path / "again", cache=cache)
    assert (again.duplicates, again.cached, again.generated_tokens) == (2, 3, 0)
    without = run_job(tiny, src, tmp_path / "without", cache=cache, dedupe=False)
    assert (without.duplicates, without.cached, without.generated_tokens) == (0, 5, 0)
    assert outputs(tmp_path / "again") == outputs(tmp_path / "first")
    assert outputs(tmp_path / "without") == outputs(tmp_path / "first")


def test_a_resumed_job_with_the_cache_writes_each_record_once(
    tiny: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    whole = tmp_path / "whole"
    run_job(tiny, src, whole, chunk_size=3)
    real_write = ChunkWriter.write_batch
    writes = {"n": 0}

    def crashing(self: ChunkWriter, records: Any, results: Any) -> None:
        writes["n"] += 1
        if writes["n"] >= 2:
            raise OSError("disk on fire")
        real_write(self, records, results)

    monkeypatch.setattr("batchline.jobs.generate._BLOCK", 4)  # two blocks, written apart
    monkeypatch.setattr(ChunkWriter, "write_batch", crashing)
    cache = tmp_path / "cache"
    out = tmp_path / "out"
    options: dict[str, Any] = {"chunk_size": 3, "cache": cache, "prefix_ordering": False}
    with pytest.raises(OSError, match="disk on fire"):
        run_job(tiny, src, out, **options)
    monkeypatch.setattr(ChunkWriter, "write_batch", real_write)
    resumed = run_job(tiny, src, out, resume=True, **options)
    assert resumed.already_done == 3  # the first block's whole chunk
    assert resumed.records == len(PROMPTS) - 3
    assert resumed.cached >= 1  # generated before the crash, not written: not generated again
    assert [r["index"] for r in rows(out)] == list(range(len(PROMPTS)))  # each once, in order
    assert outputs(out) == outputs(whole)


def test_an_openai_batch_file_refuses_the_cache_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from batchline.__main__ import main

    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]},
    }
    src = tmp_path / "batch.jsonl"
    src.write_text(json.dumps(line) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["run", str(src), "-o", str(out), "--cache", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "an OpenAI batch file runs without it" in err
    assert not out.exists()


def test_a_cache_folder_that_cannot_be_one_stops_the_job_before_any_output(
    tiny: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    src = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[:1])
    with pytest.raises(InputError, match="cannot keep results there"):
        run_job(tiny, src, tmp_path / "out", cache=tmp_path / "a-file")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.usefixtures("smollm2_cli")
def test_smollm2_greedy_reruns_from_the_cache_bit_for_bit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from batchline.__main__ import main

    args = ["run", "--model", "smollm2", "--limit", "4", "--max-tokens", "8", "--dtype",
            "float32", "--intra-op-threads", "1", "--cache", str(tmp_path / "c")]  # fmt: skip
    assert main([*args, "-o", str(tmp_path / "first")]) == 0
    capsys.readouterr()
    assert main([*args, "-o", str(tmp_path / "again")]) == 0
    assert "from the cache (earlier runs)" in capsys.readouterr().out
    assert outputs(tmp_path / "again") == outputs(tmp_path / "first")
