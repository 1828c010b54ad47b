"""Grammars the engine would give up on only mid-generation are refused when the constraint is
made: a ``$ref`` that can never produce a value, wherever it sits (``schema_checks``), and a
bounded repetition the lexer builds only when the bytes reach it (the probe's walks)."""

from __future__ import annotations

from typing import Any

import pytest

from batchline.models.generation.schema_checks import schema_patterns, unproductive_ref

NODE_CYCLE = {
    "type": "object",
    "properties": {"x": {"$ref": "#/$defs/node"}},
    "required": ["x"],
    "$defs": {
        "node": {
            "type": "object",
            "properties": {"next": {"$ref": "#/$defs/node"}},
            "required": ["next"],
        }
    },
}


@pytest.mark.parametrize(
    ("schema", "ref"),
    [
        (NODE_CYCLE, "#/$defs/node"),  # the issue's case: a cycle nested under a property
        ({"$ref": "#"}, "#"),
        (  # the root, reached from a nested property
            {
                "type": "object",
                "properties": {
                    "x": {"type": "object", "properties": {"y": {"$ref": "#"}}, "required": ["y"]}
                },
                "required": ["x"],
            },
            "#",
        ),
        (  # an optional property whose schema can never end is refused too
            {**NODE_CYCLE, "required": []},
            "#/$defs/node",
        ),
        (  # an array that must hold at least one of itself
            {
                "$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1}},
                "$ref": "#/$defs/a",
            },
            "#/$defs/a",
        ),
        (  # every anyOf branch recurses
            {
                "$defs": {
                    "a": {"anyOf": [{"$ref": "#/$defs/a"}, {"allOf": [{"$ref": "#/$defs/a"}]}]}
                },
                "type": "object",
                "properties": {"p": {"$ref": "#/$defs/a"}},
            },
            "#/$defs/a",
        ),
        (  # a required property the schema forbids
            {
                "$defs": {"f": {"type": "object", "properties": {"p": False}, "required": ["p"]}},
                "$ref": "#/$defs/f",
            },
            "#/$defs/f",
        ),
    ],
)
def test_a_ref_that_can_never_produce_a_value_is_found(schema: Any, ref: str) -> None:
    assert unproductive_ref(schema) == ref


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"type": "integer"}}},
        {  # a tree: the recursion is an array that may be empty
            "type": "object",
            "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["kids"],
        },
        {  # a list: the recursion may end in null
            "type": "object",
            "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
            "required": ["next"],
        },
        {"type": ["object", "null"], "properties": {"n": {"$ref": "#"}}, "required": ["n"]},
        {"properties": {"n": {"$ref": "#"}}, "required": ["n"]},  # no type: a number will do
        {"$defs": {"unused": NODE_CYCLE["$defs"]}, "type": "string"},  # never reached
        {"$ref": "https://example.com/schema.json"},  # not followed: the engine decides
        {"$ref": "#/$defs/missing"},
        {"type": "nonsense"},  # the engine's own error says what is wrong
        True,
    ],
)
def test_schemas_that_can_end_pass(schema: Any) -> None:
    assert unproductive_ref(schema) is None


def test_every_pattern_is_found_once() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "pattern": "[a-z]+"},
            "b": {"$ref": "#/$defs/b"},
            "c": {"type": "array", "items": {"type": "string", "pattern": "[a-z]+"}},
        },
        "$defs": {"b": {"type": "string", "pattern": "(a|b)*c{99999}"}, "z": {"pattern": "z"}},
    }
    assert sorted(schema_patterns(schema)) == ["(a|b)*c{99999}", "[a-z]+"]


# -- the constraints themselves (llguidance) ---------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        # the issue's regex: `a` forever never reached `c{99999}`; the highest byte walks there
        (lambda c: c.regex("(a|b)*c{99999}"), "cannot enforce this regex constraint: lexer"),
        (lambda c: c.json_schema(NODE_CYCLE), "'#/$defs/node' can produce no output at all"),
        (
            lambda c: c.json_schema(
                {"type": "object", "properties": {"s": {"type": "string", "pattern": "x*y{99999}"}}}
            ),
            "cannot enforce this pattern 'x*y{99999}' of the json schema constraint",
        ),
    ],
)
def test_what_the_engine_gives_up_on_mid_generation_is_refused_when_made(
    make: Any, message: str
) -> None:
    structured = pytest.importorskip("batchline.models.generation.structured")
    pytest.importorskip("llguidance")
    with pytest.raises(ValueError, match="cannot enforce") as refused:
        make(structured.Constraint)
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_ordinary_grammars_still_pass() -> None:
    structured = pytest.importorskip("batchline.models.generation.structured")
    pytest.importorskip("llguidance")
    constraint = structured.Constraint
    constraint.regex("(a|b)*c{3}")
    constraint.regex(r"\d{3}-\d{4}")
    constraint.json_schema({"type": "string", "pattern": "[a-z]{2,40}"})
    constraint.json_schema(
        {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    )
