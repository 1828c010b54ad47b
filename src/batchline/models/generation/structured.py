"""Structured outputs: a per-request grammar (JSON schema, any JSON object, regex, choice) that
masks each next token of its own sequence inside batched decoding.

A :class:`Constraint` is the request side: frozen and hashable (it rides in
:class:`~batchline.models.generation.engine.SamplingParams`), checked when it is made, so a bad
schema or regex is refused before the request is queued. :class:`TokenGrammars` is the engine
side: built once per engine from the model's Hugging Face tokenizer, it starts one matcher per
constrained sequence and, at each step, fills a bitmask for the constrained rows only and sets
every token outside it to ``-inf`` in that row's logits. An unconstrained row's logits are not
touched, so what it generates does not depend on its neighbours' constraints. EOS is allowed
only where the grammar accepts what was generated so far.

The grammar engine is llguidance (``batchline[generate]``): a Rust wheel with no Python
dependencies (3 MB download, 7.6 MB installed). On SmolLM2's 49k-token vocabulary its token
index takes 0.5-1.0 s to build (once per engine, on the first constrained request), a schema
< 1 ms to check and start a matcher for, and a mask ~0.4 ms per constrained token (5 ms per
16-row step, ``benchmarks/bench_structured.py``; busy 2-core machine, 2026-11). The others on
the index: xgrammar 0.2.8 requires torch, transformers, triton and apache-tvm-ffi;
outlines-core 0.2.14 has no dependencies but builds a regex index per schema ahead of decoding:
7 ms for ``{"answer": integer}``, 1.16 s once the schema has a ``maxLength: 200`` string
(llguidance: 0.8 ms for either).

A constraint is enforced or refused, never dropped. When one is made it is checked against
the grammar engine's limits (:func:`grammar_limits`, the same the engine decodes under) on a
byte-level vocabulary of its own, so the check does not depend on the model: the grammar is
compiled, and a short probe walks its first steps (a cyclic ``$ref`` that can produce nothing,
a regex whose repetition blows up the lexer, more than :data:`MAX_CHOICES` choices are all
refused there, with the engine's reason, before the request is queued; the server answers a
400, ``run`` fails that record). Should the engine still give up on a grammar mid-generation
(a limit reached at a later token), the sequence ends with
:class:`~batchline._errors.ConstraintError`, never as ``stop``, and one log line says which
request and why.

Example::

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    params = SamplingParams(max_tokens=32, constraint=Constraint.json_schema(schema))
"""

from __future__ import annotations

import functools
import json
import logging
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Literal, cast

from batchline._commands import install_command
from batchline._errors import ModelError
from batchline.models.generation.schema_checks import schema_patterns, unproductive_ref

if TYPE_CHECKING:
    import torch
    from llguidance import LLMatcher, LLParserLimits, LLTokenizer
    from transformers import PreTrainedTokenizerBase, TokenizersBackend

__all__ = [
    "GUIDED_FIELDS",
    "MAX_CHOICES",
    "MAX_CONSTRAINT_CHARS",
    "Constraint",
    "ConstraintKind",
    "GrammarState",
    "TokenGrammars",
    "constraint_from_openai",
    "grammar_limits",
]

logger = logging.getLogger(__name__)

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice"]
_KINDS = ("json_schema", "json_object", "regex", "choice")


def _llguidance() -> ModuleType:
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ModelError(
            f"structured outputs need llguidance: {install_command('generate')}"
        ) from exc
    return llguidance


#: At most this many options in a choice constraint. They all sit in one row of the grammar
#: engine's parser, whose limit is 2,000 items (llguidance's ``max_items_in_row``): past it
#: the engine gives up at the first token where the options part.
MAX_CHOICES = 1_000
#: At most this many characters of constraint text (a schema's JSON, a regex, the choices).
MAX_CONSTRAINT_CHARS = 256 * 1024
# llguidance's lexer fuel for building a grammar's regular expressions (its default is
# 1,000,000). A tenth of it still takes a 1,000-option choice, a 10,000-fold repetition or a
# 200-character string field, and gives up on `a{1000000}` within ~0.1 s instead of ~0.9 s of
# one decoding step's CPU (busy 2-core machine, 2026-11).
_LEXER_FUEL = 100_000
# Tokens the submit-time probe walks into a grammar: the lexer builds its states lazily, so a
# regex that is too big only fails once its first bytes are consumed.
_PROBE_STEPS = 16
_PROBE_EOS = 256
_REASON_CHARS = 300
# A schema's regex patterns probed on their own (each a compile of a few milliseconds at most).
_MAX_PATTERNS_PROBED = 32


def grammar_limits() -> LLParserLimits:
    """The grammar engine's limits (``llguidance.LLParserLimits``), the same for the
    submit-time check and for decoding. Errors stay short: no grammar or parser state in
    them (llguidance's verbose errors run to ~180 KB for a large grammar)."""
    limits: LLParserLimits = _llguidance().LLParserLimits(
        initial_lexer_fuel=_LEXER_FUEL, verbose_errors=False
    )
    return limits


def grammar_reason(error: str) -> str:
    """The grammar engine's error as one short line."""
    text = " ".join(error.replace("<non-verbose/>", " ").split())
    if text.startswith("NoExtensionBias"):
        return (
            "the grammar can produce no output at all (a schema whose $ref cycle never "
            "reaches a value, or that nothing satisfies)"
        )
    return text[:_REASON_CHARS]


class _ByteVocabulary:
    """One token per byte and an EOS: what llguidance's ``TokenizerWrapper`` reads."""

    def __init__(self) -> None:
        self.eos_token_id = _PROBE_EOS
        self.bos_token_id = None
        self.tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
        self.special_token_ids = [_PROBE_EOS]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)


@functools.cache
def _byte_tokenizer() -> LLTokenizer:
    llg = _llguidance()
    tokenizer: LLTokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_ByteVocabulary()))
    return tokenizer


_WHITESPACE = frozenset(b" \t\n\r")


def _lowest(allowed: list[int], _: random.Random) -> int:
    return allowed[0]


def _highest(allowed: list[int], _: random.Random) -> int:
    return allowed[-1]


def _lowest_word(allowed: list[int], _: random.Random) -> int:
    return next((b for b in allowed if b not in _WHITESPACE), allowed[0])


def _any_word(allowed: list[int], rng: random.Random) -> int:
    words = [b for b in allowed if b not in _WHITESPACE]
    return rng.choice(words or allowed)


#: The paths the probe walks, one byte chosen of those allowed at each step: the lowest
#: (``\t`` in JSON: it stays in whitespace), the highest (``(a|b)*c{99999}`` fails at its
#: first ``c``), the lowest that is not whitespace, and a seeded random one.
_WALKS = (_lowest, _highest, _lowest_word, _any_word)


def _probe(grammar: str, what: str) -> None:
    """Raise ``ValueError`` saying why the engine cannot enforce ``grammar``: compiled under
    :func:`grammar_limits` on a byte vocabulary (a bad grammar fails here), then walked a few
    steps along each of :data:`_WALKS` (a grammar the engine would give up on early: its
    lexer builds a repetition's states only when the bytes reach it)."""
    compiled = _llguidance().LLMatcher(
        _byte_tokenizer(), grammar, log_level=0, limits=grammar_limits()
    )
    if compiled.is_error():
        raise ValueError(f"invalid {what}: {grammar_reason(compiled.get_error())}")
    rng = random.Random(0)
    for pick in _WALKS:
        matcher = compiled.deep_copy()
        for _ in range(_PROBE_STEPS):
            bits = int.from_bytes(matcher.compute_bitmask(), "little") & ((1 << _PROBE_EOS) - 1)
            if matcher.is_error() or not bits:
                break  # an error, or only EOS is left: a complete output
            allowed = [b for b in range(_PROBE_EOS) if bits >> b & 1]
            if not matcher.consume_token(pick(allowed, rng)):
                break
        if matcher.is_error():
            reason = grammar_reason(matcher.get_error())
            raise ValueError(f"the grammar engine cannot enforce this {what}: {reason}")


def _check_schema(schema: object, what: str) -> None:
    """What the engine would find only mid-generation in a JSON schema: a ``$ref`` that can
    never produce a value, a ``pattern`` whose repetition the lexer cannot build."""
    ref = unproductive_ref(schema)
    if ref is not None:
        where = "the schema itself" if ref == "#" else f"$ref {ref!r}"
        raise ValueError(
            f"the grammar engine cannot enforce this {what}: {where} can produce no output at all "
            "(every way through it leads back into a $ref cycle, or into false); let the "
            "cycle end: make the property that recurses optional, or give it an anyOf "
            "branch that does not"
        )
    for i, pattern in enumerate(schema_patterns(schema)):
        if i >= _MAX_PATTERNS_PROBED:
            break
        regex = str(_llguidance().LLMatcher.grammar_from_regex(pattern))
        _probe(regex, f"pattern {pattern!r} of the {what}")


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a constrained sequence may generate. Make one with the class methods; each checks
    the grammar and raises ``ValueError`` with the grammar engine's reason when it is bad.

    ``spec`` is the canonical text: the schema as sorted JSON, the regex, or the choices as a
    JSON list; empty for ``json_object``.
    """

    kind: ConstraintKind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            kinds = ", ".join(_KINDS)
            raise ValueError(f"constraint kind must be one of {kinds}, got {self.kind!r}")
        what = f"{self.kind.replace('_', ' ')} constraint"
        if len(self.spec) > MAX_CONSTRAINT_CHARS:
            raise ValueError(
                f"the {what} is {len(self.spec):,} characters; the most batchline enforces "
                f"is {MAX_CONSTRAINT_CHARS:,}"
            )
        _probe(self.grammar(), what)  # first: the engine's own reason for a bad grammar
        if self.kind == "json_schema":
            _check_schema(json.loads(self.spec), what)

    @classmethod
    def json_schema(cls, schema: object) -> Constraint:
        """Output is JSON that validates against ``schema`` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, Mapping):
            raise ValueError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> Constraint:
        """Output is one JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: object) -> Constraint:
        """Output matches ``pattern`` (Rust ``regex`` syntax), whole."""
        if not isinstance(pattern, str) or not pattern:
            raise ValueError("a regex constraint needs a non-empty pattern string")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Iterable[str]) -> Constraint:
        """Output is exactly one of ``options``."""
        items = list(options)
        if not items or not all(isinstance(o, str) and o for o in items):
            raise ValueError("a choice constraint needs a non-empty list of non-empty strings")
        if len(items) > MAX_CHOICES:
            raise ValueError(
                f"a choice constraint takes at most {MAX_CHOICES:,} options, got {len(items):,} "
                "(the grammar engine cannot enforce more); use a regex or a JSON schema enum "
                "over fewer values"
            )
        return cls("choice", json.dumps(items))

    def grammar(self) -> str:
        """The llguidance grammar text for this constraint."""
        matcher = _llguidance().LLMatcher
        if self.kind == "json_schema":
            return str(matcher.grammar_from_json_schema(self.spec))
        if self.kind == "json_object":
            return str(matcher.grammar_from_json_schema('{"type": "object"}'))
        if self.kind == "regex":
            return str(matcher.grammar_from_regex(self.spec))
        # JSON string literals are valid Lark string literals.
        alternatives = " | ".join(json.dumps(o) for o in json.loads(self.spec))
        return str(matcher.grammar_from_lark(f"start: {alternatives}"))

    def vllm_options(self) -> dict[str, object]:
        """Keyword arguments for ``vllm.sampling_params.StructuredOutputsParams``."""
        if self.kind == "json_schema":
            return {"json": self.spec}
        if self.kind == "json_object":
            return {"json_object": True}
        if self.kind == "regex":
            return {"regex": self.spec}
        return {"choice": json.loads(self.spec)}


#: The request-body extras vLLM's OpenAI server takes for structured outputs.
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice")


def constraint_from_openai(body: Mapping[str, object]) -> Constraint | None:
    """The constraint an OpenAI-style request body asks for, or None.

    Reads ``response_format`` (``{"type": "json_schema", "json_schema": {"schema": {...}}}``,
    ``{"type": "json_object"}`` or ``{"type": "text"}``) and vLLM's extras ``guided_json``,
    ``guided_regex``, ``guided_choice``; at most one of them. A schema is always enforced, so
    ``json_schema.strict`` (true or false) changes nothing: ``strict: false`` still constrains.
    Raises ``ValueError`` saying what is wrong (the server answers it with a 400, a batch job
    with the line's error).
    """
    asked: list[Constraint] = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, Mapping) or not isinstance(fmt.get("type"), str):
            raise ValueError(
                'response_format must be an object with a "type": "text", "json_object" '
                'or "json_schema"'
            )
        kind = fmt["type"]
        if kind == "json_object":
            asked.append(Constraint.json_object())
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
                raise ValueError(
                    'response_format of type "json_schema" needs "json_schema": '
                    '{"name": ..., "schema": {...}}'
                )
            strict = spec.get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise ValueError(
                    f'response_format json_schema "strict" must be true or false, got {strict!r}'
                )
            asked.append(Constraint.json_schema(spec["schema"]))
        elif kind != "text":
            raise ValueError(
                f'response_format type must be "text", "json_object" or "json_schema", got {kind!r}'
            )
    if body.get("guided_json") is not None:
        asked.append(Constraint.json_schema(body["guided_json"]))
    if body.get("guided_regex") is not None:
        asked.append(Constraint.regex(body["guided_regex"]))
    if body.get("guided_choice") is not None:
        choices = body["guided_choice"]
        if not isinstance(choices, list):
            raise ValueError("guided_choice must be a list of strings")
        asked.append(Constraint.choice(choices))
    if len(asked) > 1:
        raise ValueError(
            "give one of response_format (json_object or json_schema), guided_json, "
            "guided_regex or guided_choice, not several"
        )
    return asked[0] if asked else None


class GrammarState:
    """One constrained sequence's place in its grammar."""

    __slots__ = ("_matcher", "_reported", "kind", "request_id")

    def __init__(self, matcher: LLMatcher, *, request_id: str = "", kind: str = "") -> None:
        self._matcher = matcher
        self.request_id = request_id
        self.kind = kind
        self._reported = False

    def take(self, token: int) -> str | None:
        """Move past ``token``, the sequence's chosen next token, unless the engine has given
        up already (while masking); return :meth:`failure` after it: None while the grammar is
        enforced (a refusal of ``token`` shows there too)."""
        if self.failure() is None:
            self._matcher.consume_token(token)
        return self.failure()

    def failure(self) -> str | None:
        """Why the grammar engine gave up on this sequence, or None while it enforces it. The
        first time it has, one line is logged with the request id and the reason."""
        if not self._matcher.is_error():
            return None
        reason = grammar_reason(self._matcher.get_error())
        if not self._reported:
            self._reported = True
            logger.warning(
                "request %s: the grammar engine gave up on its %s constraint: %s; the "
                "sequence ends with an error",
                self.request_id,
                self.kind,
                reason,
            )
        return f"the grammar engine gave up on this request's {self.kind} constraint: {reason}"


class TokenGrammars:
    """Grammar matchers over one model's vocabulary (``tokenizer``: a fast Hugging Face
    tokenizer; ``vocab_size``: the logits' width; ``eos_token_ids``: what ends a sequence).

    The token index is built on the first constrained request (~1 s for a 49k vocabulary).
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, *, vocab_size: int, eos_token_ids: Iterable[int]
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._index: LLTokenizer | None = None
        self._bits: torch.Tensor | None = None

    def start(self, constraint: Constraint, request_id: str = "") -> GrammarState:
        """A fresh matcher for one sequence (under :func:`grammar_limits`)."""
        llg = _llguidance()
        if self._index is None:
            import llguidance.hf

            fast = cast("TokenizersBackend", self._tokenizer)  # AutoTokenizer's default kind
            self._index = llguidance.hf.from_tokenizer(
                fast, n_vocab=self._vocab_size, eos_token=self._eos
            )
        matcher = llg.LLMatcher(
            self._index, constraint.grammar(), log_level=0, limits=grammar_limits()
        )
        if matcher.is_error():
            reason = grammar_reason(matcher.get_error())
            raise ValueError(f"invalid {constraint.kind} constraint: {reason}")
        return GrammarState(matcher, request_id=request_id, kind=constraint.kind)

    def mask(self, logits: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
        """Set to ``-inf``, in place, every token a row's grammar does not allow next; rows whose
        state is None are left as they are."""
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows:
            return
        import torch

        # One bit per token, 32 to an int32 word, filled by the matcher in place (llguidance's
        # own torch helpers are not used: importing them compiles a kernel with torch.compile).
        words = (self._vocab_size + 31) // 32
        bitmask = torch.zeros((len(rows), words), dtype=torch.int32)
        for k, i in enumerate(rows):
            state = states[i]
            assert state is not None
            state._matcher.unsafe_compute_mask_ptr(bitmask[k].data_ptr(), words * 4)
        if self._bits is None:
            self._bits = torch.arange(32, dtype=torch.int32)
        # (rows, words) int32 -> (rows, words * 32) bool, one bit per token, low bit first.
        allowed = ((bitmask.unsqueeze(-1) >> self._bits) & 1).bool().flatten(1)
        allowed = allowed[:, : logits.shape[1]]
        # A matcher in an error state allows nothing: let that row pick EOS rather than sample
        # NaN; the engine ends it with the matcher's failure() (an error, never "stop").
        stuck = ~allowed.any(dim=1)
        if bool(stuck.any()):
            allowed[stuck.nonzero().flatten()[:, None], torch.tensor(self._eos)] = True
        allowed = allowed.to(logits.device)
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
