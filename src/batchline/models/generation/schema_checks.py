"""What a JSON schema must pass before the grammar engine compiles it: every ``$ref`` it can
reach must be able to produce a value.

The grammar engine (llguidance) builds its parser lazily, so a ``$ref`` cycle that can never
end (``{"properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}`` inside
``node``) compiles, starts, and only grows: ``{"next":{"next":...`` until the tokens run
out, or the engine gives up mid-generation. Whether a subschema can produce a value is a
least fixed point, found here by iteration over the subschemas the root reaches: a subschema
is productive when one of its types is (an object whose required properties all are, an
array whose first ``minItems`` items are, any scalar type), its ``$ref`` target, every
``allOf`` branch and one ``anyOf``/``oneOf`` branch are. A ``false`` schema never is; a
keyword this does not model (``not``, ``if``, a remote ``$ref``) counts as productive,
leaving it to the engine. Standard library only.

    >>> node = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
    >>> unproductive_ref(node)
    '#'
    >>> unproductive_ref({**node, "required": []}) is None       # the cycle may end
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from urllib.parse import unquote

__all__ = ["schema_patterns", "unproductive_ref"]

_SCALARS = frozenset({"string", "number", "integer", "boolean", "null"})
_ALL_TYPES = _SCALARS | {"object", "array"}
# keywords whose value is one subschema, or a list or a map of them
_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
# (not ``$defs``: a definition is reached through a ``$ref``, or is not used at all)
_MAP = ("properties", "patternProperties", "dependentSchemas")


def unproductive_ref(schema: object) -> str | None:
    """The first ``$ref`` reachable from ``schema`` whose target can produce no value (as it
    is written, ``"#/$defs/node"``), or ``"#"`` when the root itself cannot; ``None`` when
    every reachable ``$ref`` can."""
    nodes = _reachable(schema, schema)
    good: set[int] = set()
    changed = True
    while changed:
        changed = False
        for node in nodes:
            if id(node) not in good and _productive(node, schema, good):
                good.add(id(node))
                changed = True
    for node in nodes:
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = _resolve(schema, ref)
            if target is not _UNKNOWN and not _holds(target, good):
                return ref
    if not _holds(schema, good):
        return "#"
    return None


def schema_patterns(schema: object) -> Iterator[str]:
    """Every ``pattern`` (a regex) of the subschemas ``schema`` reaches, once each."""
    seen: set[str] = set()
    for node in _reachable(schema, schema):
        pattern = node.get("pattern")
        if isinstance(pattern, str) and pattern not in seen:
            seen.add(pattern)
            yield pattern


_UNKNOWN = object()  # a $ref this does not follow (remote, or pointing nowhere)


def _resolve(root: object, ref: str) -> object:
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return _UNKNOWN
    node = root
    for part in ref[2:].split("/"):
        key = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return _UNKNOWN
    return node


def _children(node: Mapping[str, object], root: object) -> Iterator[object]:
    for key in _ONE:
        if key in node:
            yield node[key]
    for key in _LIST:
        value = node.get(key)
        if isinstance(value, list):
            yield from value
    for key in _MAP:
        value = node.get(key)
        if isinstance(value, Mapping):
            yield from value.values()
    ref = node.get("$ref")
    if isinstance(ref, str):
        yield _resolve(root, ref)


def _reachable(start: object, root: object) -> list[Mapping[str, object]]:
    """The subschemas (objects) reachable from ``start``, each once, in the order found."""
    found: list[Mapping[str, object]] = []
    seen: set[int] = set()
    stack = [start]
    while stack:
        node = stack.pop()
        if not isinstance(node, Mapping) or id(node) in seen:
            continue
        seen.add(id(node))
        found.append(node)
        stack.extend(reversed(list(_children(node, root))))
    return found


def _holds(node: object, good: set[int]) -> bool:
    """Whether ``node`` can produce a value, as far as ``good`` (the productive ones) says."""
    if isinstance(node, bool):
        return node
    if not isinstance(node, Mapping):
        return True  # not a schema this models (or _UNKNOWN): the engine decides
    return id(node) in good


def _productive(node: Mapping[str, object], root: object, good: set[int]) -> bool:
    ref = node.get("$ref")
    if isinstance(ref, str) and not _holds(_resolve(root, ref), good):
        return False
    all_of = node.get("allOf")
    if isinstance(all_of, list) and not all(_holds(s, good) for s in all_of):
        return False
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and not any(_holds(s, good) for s in branches):
            return False
    if "enum" in node or "const" in node:
        return True  # a listed value (the engine checks it against the rest)
    kind = node.get("type")
    types = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else None
    if types is None or not types <= _ALL_TYPES:
        types = set(_ALL_TYPES)  # none given: any; an unknown one: the engine says
    if types & _SCALARS:
        return True
    if "object" in types and _object_productive(node, good):
        return True
    return "array" in types and _array_productive(node, good)


def _object_productive(node: Mapping[str, object], good: set[int]) -> bool:
    properties = node.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    extra = node.get("additionalProperties", True)
    required = node.get("required")
    for name in required if isinstance(required, list) else ():
        schema = properties.get(name, extra) if isinstance(name, str) else True
        if not _holds(schema, good):
            return False
    return True


def _array_productive(node: Mapping[str, object], good: set[int]) -> bool:
    least = node.get("minItems", 0)
    least = least if isinstance(least, int) and not isinstance(least, bool) else 0
    prefix = node.get("prefixItems")
    prefix = prefix if isinstance(prefix, list) else []
    if not all(_holds(s, good) for s in prefix[:least]):
        return False
    return least <= len(prefix) or _holds(node.get("items", True), good)
