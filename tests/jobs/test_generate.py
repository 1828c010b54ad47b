"""``batchline run --task generate``: every prompt's completion exactly once, in order, whatever
the batching; bad prompts are per-record failures; a SIGKILLed job resumes to the same output.

The model is the tiny random Llama saved as a Hugging Face folder (``--model PATH/``); one slow
test runs the real SmolLM2 through the CLI.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from batchline._errors import InputError
from batchline.datasets.sinks import Manifest, read_output, read_skipped
from batchline.models.config import Knobs

pytest.importorskip("transformers")

# prompts of many lengths, so sequences join and leave a continuous batch at different steps
PROMPTS = [f"{i} + {i * 7 % 13} = ?" + " and then" * (i % 5) for i in range(14)]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from tests.models.generation.test_load import save_tiny_generator

    torch.set_num_threads(1)
    return save_tiny_generator(tmp_path_factory.mktemp("gen") / "tiny")


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path / "cache"))


def write_prompts(path: Path, prompts: list[str], column: str = "prompt") -> Path:
    with path.open("w", encoding="utf-8") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": f"p{i}", column: p}) + "\n")
    return path


def run_job(tiny: Path, input: Path | None, out: Path, **options: Any) -> Any:
    from batchline.jobs.generate import GenerateOptions
    from batchline.jobs.run import run

    # float32: greedy tokens equal transformers' generate (dtype auto may take bf16 here)
    knobs = options.pop("knobs", Knobs(dtype="float32"))
    opts = GenerateOptions(
        input=input,
        output=out,
        model=f"{tiny}/",
        max_tokens=options.pop("max_tokens", MAX_TOKENS),
        knobs=knobs,
        **options,
    )
    return run(opts)


def rows(out: Path) -> list[dict[str, Any]]:
    return read_output(out).to_pylist()  # type: ignore[no-any-return]


def reference(tiny: Path, prompts: list[str], max_tokens: int) -> list[tuple[str, int]]:
    """transformers' own greedy ``generate``, one prompt at a time: (text, tokens generated)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny)
    out = []
    for prompt in prompts:
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
        with torch.no_grad():
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=2,
            )[0, ids.shape[1] :].tolist()
        out.append((str(tok.decode(generated, skip_special_tokens=True)), len(generated)))
    return out


def test_every_prompt_once_in_order_and_greedy_equal_in_every_mode(
    tiny: Path, tmp_path: Path
) -> None:
    src = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    outputs = {}
    modes = {
        "continuous": Knobs(max_running_sequences=3, dtype="float32"),
        "static": Knobs(generation_batching="static", max_running_sequences=4, dtype="float32"),
        "one at a time": Knobs(batching=False, dtype="float32"),
    }
    for name, knobs in modes.items():
        out = tmp_path / name.replace(" ", "-")
        summary = run_job(tiny, src, out, knobs=knobs, chunk_size=5)
        got = rows(out)
        assert [r["index"] for r in got] == list(range(len(PROMPTS)))
        assert [r["id"] for r in got] == [f"p{i}" for i in range(len(PROMPTS))]
        assert summary.records == len(PROMPTS)
        assert summary.generated_tokens == sum(r["completion_tokens"] for r in got)
        assert summary.failed == summary.aborted == summary.preempted == 0
        assert ("dtype", "float32 (asked for)") in summary.rows()
        assert ("weights", "float") in summary.rows()  # a float folder's, as it was
        assert Manifest.load(out).complete
        outputs[name] = [(r["text"], r["completion_tokens"], r["finish_reason"]) for r in got]
    assert outputs["continuous"] == outputs["static"] == outputs["one at a time"]
    expected = reference(tiny, PROMPTS, MAX_TOKENS)
    assert [(t, n) for t, n, _ in outputs["continuous"]] == expected


def test_too_long_prompts_and_bad_values_are_that_records_failure(
    tiny: Path, tmp_path: Path
) -> None:
    long = "x" * 200  # over the tiny model's 128-token context
    src = tmp_path / "prompts.jsonl"
    with src.open("w") as f:
        for value in ["short", long, 42, "also short"]:
            f.write(json.dumps({"prompt": value}) + "\n")
        f.write("{not json\n")
    out = tmp_path / "out"
    summary = run_job(tiny, src, out, on_bad_record="skip")
    assert [r["index"] for r in rows(out)] == [0, 3]
    skipped = read_skipped(out)
    assert [s["index"] for s in skipped] == [1, 2, 4]
    assert str(skipped[0]["reason"]).startswith("bad input: prompt of")
    assert "context of 128 tokens" in str(skipped[0]["reason"])
    assert "not text" in str(skipped[1]["reason"])
    assert (summary.records, summary.skipped) == (2, 3)
    strict = write_prompts(tmp_path / "strict.jsonl", ["short", long, "short"])
    with pytest.raises(InputError, match=r"record 1 .* failed: bad input: prompt of"):
        run_job(tiny, strict, tmp_path / "strict")


def test_chat_messages_column_and_raw_text(tiny: Path, tmp_path: Path) -> None:
    src = tmp_path / "chats.jsonl"
    with src.open("w") as f:
        for p in PROMPTS[:3]:
            f.write(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n")
    chat = tmp_path / "chat"
    run_job(tiny, src, chat)
    as_text = tmp_path / "as-text"
    run_job(tiny, write_prompts(tmp_path / "p.jsonl", PROMPTS[:3], "text"), as_text)
    assert [r["text"] for r in rows(chat)] == [r["text"] for r in rows(as_text)]
    raw = tmp_path / "raw"
    run_job(tiny, write_prompts(tmp_path / "q.jsonl", PROMPTS[:3]), raw, chat_template=False)
    assert [r["prompt_tokens"] for r in rows(raw)] == [len(p.encode()) for p in PROMPTS[:3]]


def test_a_small_waiting_queue_is_never_overrun(tiny: Path, tmp_path: Path) -> None:
    src = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    knobs = Knobs(max_running_sequences=2, max_queue_size=2)
    summary = run_job(tiny, src, tmp_path / "out", knobs=knobs)
    assert summary.in_flight_limit == 2
    assert summary.records == len(PROMPTS)
    assert summary.waiting_peak <= 2
    assert summary.running_peak <= 2


def test_seeded_sampling_is_the_same_in_every_mode(tiny: Path, tmp_path: Path) -> None:
    src = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[:6])
    texts = []
    exact = Knobs(dtype="float32")  # bf16 rounds a batch's sums differently
    for i, knobs in enumerate(
        [exact.replace(max_running_sequences=4), exact.replace(batching=False)]
    ):
        out = tmp_path / f"out{i}"
        run_job(tiny, src, out, knobs=knobs, temperature=1.0, top_p=0.9, seed=11)
        texts.append([r["text"] for r in rows(out)])
    assert texts[0] == texts[1]


def test_without_an_input_the_demo_math_prompts(tmp_path: Path) -> None:
    from tests.models.generation.test_load import save_tiny_generator

    # the demo prompts are ~150 bytes, over the tiny model's usual context of 128
    roomy = save_tiny_generator(tmp_path / "roomy", context_tokens=512)
    out = tmp_path / "demo"
    summary = run_job(roomy, None, out, limit=3, max_tokens=2)
    got = rows(out)
    assert [r["id"] for r in got] == ["gsm-0000", "gsm-0001", "gsm-0002"]
    assert all(isinstance(r["answer"], int) for r in got)  # copied for checking answers
    assert summary.total_records == 3


def test_resume_needs_the_same_sampling(tiny: Path, tmp_path: Path) -> None:
    src = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[:2])
    out = tmp_path / "out"
    run_job(tiny, src, out)
    again = run_job(tiny, src, out, resume=True)
    assert (again.records, again.already_done) == (0, 2)
    with pytest.raises(InputError, match="max_tokens"):
        run_job(tiny, src, out, resume=True, max_tokens=MAX_TOKENS + 1)


def test_cli_refuses_ray_and_generation_flags_elsewhere(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from batchline.__main__ import main

    src = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[:1])
    assert main(["run", str(src), "--model", f"{tiny}/", "--replicas", "2"]) == 2
    assert "--replicas and --cpus-per-replica go with --engine ray" in capsys.readouterr().err
    assert main(["run", str(src), "--max-tokens", "4", "--text-column", "prompt"]) == 2
    assert "--max-tokens goes with text generation" in capsys.readouterr().err
    assert main(["run", str(src), "--model", f"{tiny}/", "--prompt-column", "nope"]) == 2
    assert "no prompt column 'nope'" in capsys.readouterr().err


_KILL_AFTER_CHUNK = """
import os, signal, sys
from batchline.datasets import sinks

commit = sinks.ChunkWriter._commit

def commit_then_die(self, k, pending):
    commit(self, k, pending)
    if len(self.manifest.chunks) == 2:  # two chunks are on disk: die mid-job, no clean-up
        os.kill(os.getpid(), signal.SIGKILL)

sinks.ChunkWriter._commit = commit_then_die
from batchline.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_kill_9_then_resume_gives_every_output_once(tiny: Path, tmp_path: Path) -> None:
    src = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    out = tmp_path / "out"
    args = ["run", str(src), "--model", f"{tiny}/", "-o", str(out), "--chunk-size", "3",
            "--max-tokens", str(MAX_TOKENS), "--max-running-sequences", "2", "--quiet",
            "--dtype", "float32"]  # fmt: skip
    env = {**os.environ, "BATCHLINE_CACHE_DIR": str(tmp_path / "cache")}
    killed = subprocess.run(
        [sys.executable, "-c", _KILL_AFTER_CHUNK, *args], env=env, capture_output=True, timeout=300
    )
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    manifest = Manifest.load(out)
    assert len(manifest.chunks) == 2
    assert not manifest.complete
    done_before = sum(c.rows for c in manifest.chunks.values())

    from batchline.__main__ import main

    assert main([*args, "--resume"]) == 0
    resumed = rows(out)
    assert [r["index"] for r in resumed] == list(range(len(PROMPTS)))  # each once, in order
    whole = tmp_path / "whole"
    run_job(tiny, src, whole, chunk_size=3)
    assert resumed == rows(whole)
    assert done_before == 6


@pytest.mark.slow
@pytest.mark.usefixtures("smollm2_cli")
def test_smollm2_demo_prompts_through_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from batchline.__main__ import main

    out = tmp_path / "demo"
    args = ["run", "--model", "smollm2", "--limit", "10", "--max-tokens", "8", "-o", str(out)]
    assert main([*args, "--intra-op-threads", "1"]) == 0
    assert "tokens/s" in capsys.readouterr().out
    got = rows(out)
    assert [r["id"] for r in got] == [f"gsm-{i:04d}" for i in range(10)]
    assert all(r["text"] and r["completion_tokens"] <= 8 for r in got)
    assert Manifest.load(out).complete


def test_the_progress_bar_counts_prompts_and_tokens(tiny: Path, tmp_path: Path) -> None:
    import io

    from rich.console import Console

    from batchline.jobs.cli import _generation_bar
    from batchline.jobs.generate import GenerateOptions, TokenRate
    from batchline.jobs.run import run

    console = Console(file=io.StringIO(), force_terminal=True, width=200)
    bar = _generation_bar(console)
    assert isinstance(bar, TokenRate)
    src = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[:4])
    opts = GenerateOptions(input=src, output=tmp_path / "out", model=f"{tiny}/", max_tokens=3)
    try:
        run(opts, bar)
    finally:
        bar.close()
    shown = console.file.getvalue()  # type: ignore[attr-defined]
    assert "4/" in shown  # prompts done (a JSONL's total is known only once read through)
    assert re.search(r"[1-9]\d* tok, [\d.,]+ tok/s", shown), shown


def test_a_model_that_cannot_load_leaves_no_output(tiny: Path, tmp_path: Path) -> None:
    import torch

    from batchline._errors import ModelError

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    src = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[:1])
    out = tmp_path / "out"
    with pytest.raises(ModelError, match="no CUDA device"):
        run_job(tiny, src, out, knobs=Knobs(device="cuda"))
    assert not out.exists()


def test_response_format_for_the_job_and_per_record(tiny: Path, tmp_path: Path) -> None:
    pytest.importorskip("llguidance")
    src = tmp_path / "constrained.jsonl"
    lines: list[dict[str, Any]] = [
        {"prompt": "a"},
        {"prompt": "b", "guided_choice": ["yes", "no"]},
        {"prompt": "c", "guided_regex": "[0-9]{1,3}"},
        {"prompt": "d", "guided_regex": "(("},
        {"prompt": "e", "response_format": {"type": "text"}},
    ]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    schema = json.dumps({"enum": ["ab", "cd"]})
    run_job(tiny, src, out, max_tokens=8, response_format=schema, on_bad_record="skip")
    got = {r["index"]: r for r in rows(out)}
    assert sorted(got) == [0, 1, 2, 4]
    assert json.loads(got[0]["text"]) in ("ab", "cd")
    assert got[1]["text"] in ("yes", "no")
    assert re.fullmatch("[0-9]{1,3}", got[2]["text"])
    assert all(got[i]["finish_reason"] == "stop" for i in (0, 1, 2))
    (skipped,) = read_skipped(out)
    assert skipped["index"] == 3
    assert "invalid regex constraint" in str(skipped["reason"])
    # the record that asked for plain text got what an unconstrained job gives it
    plain = write_prompts(tmp_path / "plain.jsonl", ["e"])
    run_job(tiny, plain, tmp_path / "plain", max_tokens=8)
    assert rows(tmp_path / "plain")[0]["text"] == got[4]["text"]


def test_a_bad_response_format_stops_the_job_before_it_starts(tiny: Path, tmp_path: Path) -> None:
    pytest.importorskip("llguidance")
    src = write_prompts(tmp_path / "p.jsonl", ["a"])
    with pytest.raises(InputError, match="sampling settings: invalid json schema constraint"):
        run_job(tiny, src, tmp_path / "out", response_format='{"type": "integer", "minimum": "x"}')
    with pytest.raises(InputError, match="not valid JSON"):
        run_job(tiny, src, tmp_path / "out2", response_format="{oops")


def test_a_constraint_that_cannot_be_enforced_fails_its_record_and_the_job_goes_on(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("llguidance")
    from tests.models.generation.gen_helpers import grammars_give_up

    cyclic = {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
        "$ref": "#/$defs/a",
    }
    src = tmp_path / "constrained.jsonl"
    lines: list[dict[str, Any]] = [
        {"prompt": "a"},
        {"prompt": "b", "guided_choice": [f"choice{i}" for i in range(10_000)]},
        {"prompt": "c", "guided_regex": "a{1000000}"},
        {"prompt": "d", "guided_json": cyclic},
        {
            "prompt": "e",
            "response_format": {"type": "json_schema", "json_schema": {"schema": cyclic}},
        },
        {"prompt": "f", "guided_regex": "[0-9]{1,3}"},
    ]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    summary = run_job(tiny, src, out, max_tokens=8, on_bad_record="skip")
    assert [r["index"] for r in rows(out)] == [0, 5]
    reasons = {s["index"]: str(s["reason"]) for s in read_skipped(out)}
    assert "at most 1,000 options" in reasons[1]
    assert "cannot enforce this regex constraint" in reasons[2]
    assert "can produce no output at all" in reasons[3]
    assert "no output at all" in reasons[4]
    assert (summary.records, summary.skipped) == (2, 4)
    # a grammar the engine gives up on mid-generation: that record fails, never "stop"
    grammars_give_up(monkeypatch, after=1)
    again = tmp_path / "again"
    run_job(tiny, src, again, max_tokens=8, on_bad_record="skip")
    assert [r["index"] for r in rows(again)] == [0]
    reasons = {s["index"]: str(s["reason"]) for s in read_skipped(again)}
    assert reasons[5].startswith("bad input: ")
    assert "ConstraintError" not in reasons[5]  # the check's own words, not a Python class
    assert "gave up on this request's regex" in reasons[5]


def test_a_records_own_max_tokens_is_its_answers_limit_and_a_bad_one_fails_it_alone(
    tiny: Path, tmp_path: Path
) -> None:
    src = tmp_path / "limits.jsonl"
    lines: list[dict[str, Any]] = [
        {"prompt": "a", "max_tokens": 2},
        {"prompt": "b"},
        {"prompt": "c", "max_tokens": 9.0},  # a Parquet column with gaps reads as floats
        {"prompt": "d", "max_tokens": 0},
        {"prompt": "e", "max_tokens": "many"},
        {"prompt": "f", "max_tokens": True},
        {"prompt": "g", "max_tokens": 2.5},
        {"prompt": "h", "max_tokens": 10**9},  # past the context: its failure, as a long prompt
    ]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    summary = run_job(tiny, src, out, on_bad_record="skip")
    got = {r["index"]: r for r in rows(out)}
    assert sorted(got) == [0, 1, 2]
    reasons = {s["index"]: str(s["reason"]) for s in read_skipped(out)}
    assert sorted(reasons) == [3, 4, 5, 6, 7]
    assert all("max_tokens must be a whole number >= 1" in reasons[i] for i in (3, 4, 5, 6))
    assert "got 'many'" in reasons[4]
    assert "1000000000" in reasons[7].replace(",", "")
    assert (summary.records, summary.skipped) == (3, 5)
    # each answer is the one the job's --max-tokens of that value gives (greedy, float32)
    for index, prompt, limit in ((0, "a", 2), (1, "b", MAX_TOKENS), (2, "c", 9)):
        alone = tmp_path / f"alone-{index}"
        run_job(tiny, write_prompts(tmp_path / f"{index}.jsonl", [prompt]), alone, max_tokens=limit)
        (want,) = rows(alone)
        assert got[index]["completion_tokens"] <= limit
        assert (got[index]["text"], got[index]["completion_tokens"]) == (
            want["text"],
            want["completion_tokens"],
        )
    assert got[2]["completion_tokens"] > MAX_TOKENS or got[2]["finish_reason"] == "stop"


def test_run_says_the_generators_load_line_and_quiet_does_not(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from batchline.__main__ import main

    src = write_prompts(tmp_path / "p.jsonl", ["a"])
    args = ["run", str(src), "--model", f"{tiny}/", "--max-tokens", "2", "--set", "dtype=float32"]
    assert main([*args, "-o", str(tmp_path / "said")]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "read per decode step" in line]
    assert len(said) == 1  # the dtype, weights, kernels and bytes: as serve logs it
    assert said[0].startswith("batchline run: tiny: torch on cpu, float32 (asked for)")
    assert main([*args, "-o", str(tmp_path / "quiet"), "--quiet"]) == 0
    assert "read per decode step" not in capsys.readouterr().err
