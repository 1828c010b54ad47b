"""A deterministic fake :class:`StepEngine` and a byte-level fake tokenizer, for tests and docs.

>>> tok = FakeTokenizer()
>>> engine = FakeEngine()
>>> engine.add_request(GenerationRequest("a", tuple(tok.encode("2 + 2 ="))))
>>> out = engine.step()          # prefills "a" and yields its first token

The next token is a pure function of the prompt and the tokens generated so far (by default
printable ASCII, never EOS unless ``eos_after`` says so), so greedy outputs never depend on
what shares the batch: static and continuous batching must give identical texts. Each step is
recorded (:attr:`FakeEngine.steps`) so tests can check caps and when a slot freed.
``step_time_s`` makes steps take real time (``fixed + per_sequence * n + per_prefill_token *
prompt tokens``) for the benchmark's ``--fake`` smoke; tests leave it at zero.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from batchline.models.generation.engine import (
    FinishReason,
    GenerationRequest,
    StepOutput,
    TokenLogprob,
)

__all__ = ["FakeEngine", "FakeStep", "FakeTokenizer", "StepCost", "fake_logprob"]

EOS_ID = 2  # of the specials 0-2, the only one the engine reads
_BYTE_BASE = 3  # token id 3 + b is byte b


class FakeTokenizer:
    """Byte-level: ids 0-2 are specials (decoded as nothing), id ``3 + b`` is byte ``b``.

    ``decode`` replaces an incomplete UTF-8 sequence with U+FFFD, as real byte-level
    tokenizers do, so partial characters can be tested.
    """

    eos_token_id = EOS_ID
    vocab_size = _BYTE_BASE + 256

    def encode(self, text: str) -> list[int]:
        return [_BYTE_BASE + b for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(i - _BYTE_BASE for i in ids if _BYTE_BASE <= i < _BYTE_BASE + 256)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The byte a token stands for (none for a special one), part of a character or not."""
        return bytes([token_id - _BYTE_BASE]) if _BYTE_BASE <= token_id < _BYTE_BASE + 256 else b""


def default_next_token(prompt: Sequence[int], generated: Sequence[int]) -> int:
    """A printable ASCII byte that depends on the prompt and the position only."""
    n = len(generated)
    mixed = (sum(prompt) * 31 + len(prompt) * 7 + n * 13 + (generated[-1] if generated else 0)) % 95
    return _BYTE_BASE + 32 + mixed


def fake_logprob(token: int, top: int) -> TokenLogprob:
    """The fake engine's log-probabilities: the token it picks holds half the mass, the
    printable bytes after it a quarter, an eighth..."""
    half = -math.log(2)
    alternatives = [(token, half)]
    for k in range(1, top):
        alternatives.append((_BYTE_BASE + 32 + (token - _BYTE_BASE - 32 + k) % 95, half * (k + 1)))
    return TokenLogprob(token, half, tuple(alternatives[:top]))


@dataclass(frozen=True, slots=True)
class StepCost:
    """Real seconds a fake step sleeps: ``fixed_s + per_sequence_s * running +
    per_prefill_token_s * prompt tokens prefilled in the step``."""

    fixed_s: float = 0.0
    per_sequence_s: float = 0.0
    per_prefill_token_s: float = 0.0

    def seconds(self, running: int, prefill_tokens: int) -> float:
        return (
            self.fixed_s + self.per_sequence_s * running + self.per_prefill_token_s * prefill_tokens
        )


@dataclass(frozen=True, slots=True)
class FakeStep:
    """One recorded step: which sequences ran, which were prefilled."""

    index: int
    running: tuple[str, ...]
    prefilled: tuple[str, ...]


class _Seq:
    __slots__ = ("generated", "prefilled", "request")

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.generated: list[int] = []
        self.prefilled = False


class FakeEngine:
    """A :class:`~batchline.models.generation.engine.StepEngine` with no model.

    Args:
        next_token: ``f(prompt_ids, generated_ids) -> token id`` (default: printable ASCII).
        eos_after: when set, a sequence not ignoring EOS emits EOS as its ``eos_after``-th
            token (``int``) or at ``eos_after(prompt_ids)`` (callable; ``None`` = never).
        max_context_tokens: the model's context length.
        step_cost: real time each step takes (see :class:`StepCost`).
        fail_steps: step indexes (0-based) whose ``step()`` raises ``RuntimeError``.
    """

    def __init__(
        self,
        *,
        next_token: Callable[[Sequence[int], Sequence[int]], int] | None = None,
        eos_after: int | Callable[[Sequence[int]], int | None] | None = None,
        eos_token_id: int = EOS_ID,
        max_context_tokens: int = 2048,
        step_cost: StepCost | None = None,
        fail_steps: Sequence[int] = (),
    ) -> None:
        self._next = next_token if next_token is not None else default_next_token
        self._eos_after = eos_after
        self._eos = eos_token_id
        self._max_context = max_context_tokens
        self._cost = step_cost if step_cost is not None else StepCost()
        self._fail_steps = set(fail_steps)
        self._seqs: dict[str, _Seq] = {}
        self._busy = threading.Lock()
        self.steps: list[FakeStep] = []
        self.added: list[str] = []
        self.aborted: list[str] = []

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({self._eos})

    @property
    def max_context_tokens(self) -> int:
        return self._max_context

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        # the engine is not thread-safe: two calls at once is a scheduler bug
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("FakeEngine called from two threads at once")
        try:
            yield
        finally:
            self._busy.release()

    def add_request(self, request: GenerationRequest) -> None:
        with self._exclusive():
            if request.request_id in self._seqs:
                raise ValueError(f"request id {request.request_id!r} is already running")
            if request.params.constraint is not None:
                raise ValueError("the fake engine does not apply constraints (structured outputs)")
            self._seqs[request.request_id] = _Seq(request)
            self.added.append(request.request_id)

    def abort(self, request_id: str) -> None:
        with self._exclusive():
            if self._seqs.pop(request_id, None) is not None:
                self.aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def num_running(self) -> int:
        return len(self._seqs)

    def kv_tokens_in_use(self) -> int:
        return sum(len(s.request.prompt_ids) + len(s.generated) for s in self._seqs.values())

    def _eos_at(self, prompt: Sequence[int]) -> int | None:
        if self._eos_after is None:
            return None
        if isinstance(self._eos_after, int):
            return self._eos_after
        return self._eos_after(prompt)

    def step(self) -> Sequence[StepOutput]:
        with self._exclusive():
            index = len(self.steps)
            if index in self._fail_steps:
                self.steps.append(FakeStep(index, (), ()))
                raise RuntimeError(f"fake engine: step {index} failed")
            running = tuple(self._seqs)
            prefilled = tuple(rid for rid, s in self._seqs.items() if not s.prefilled)
            prefill_tokens = sum(len(self._seqs[rid].request.prompt_ids) for rid in prefilled)
            cost = self._cost.seconds(len(running), prefill_tokens)
            outputs: list[StepOutput] = []
            for rid in running:
                seq = self._seqs[rid]
                seq.prefilled = True
                params = seq.request.params
                prompt = seq.request.prompt_ids
                eos_at = None if params.ignore_eos else self._eos_at(prompt)
                if eos_at is not None and len(seq.generated) + 1 >= eos_at:
                    token = self._eos
                else:
                    token = self._next(prompt, seq.generated)
                seq.generated.append(token)
                top, k = params.logprobs, params.prompt_logprobs
                lp = None if top is None else (fake_logprob(token, top),)
                scored = None
                if k is not None and len(seq.generated) == 1:
                    scored = tuple(fake_logprob(t, k) for t in prompt[1:])
                reason: FinishReason | None = None
                if token == self._eos and not params.ignore_eos:
                    reason = "stop"
                elif len(seq.generated) >= params.max_tokens:
                    reason = "length"
                outputs.append(
                    StepOutput(
                        rid,
                        (token,),
                        finished=reason is not None,
                        finish_reason=reason,
                        logprobs=lp,
                        prompt_logprobs=scored,
                    )
                )
            for out in outputs:
                if out.finished:
                    del self._seqs[out.request_id]
            self.steps.append(FakeStep(index, running, prefilled))
            if cost > 0:
                time.sleep(cost)
            return outputs
