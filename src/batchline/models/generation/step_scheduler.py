"""The token planner of a step: which sequences decode and which prompt pieces prefill, as a
:class:`~.plan.StepPlan` an executor runs (vLLM's v1 ``Scheduler.schedule`` is the picture;
which *requests* run at all is decided above, by :class:`~.continuous.ContinuousGenerator`).

Every running sequence decodes one token a step. A waiting prompt is prefilled whole, after
what it holds already (a cached prefix, its earlier chunks), while the step's token budget
(``max_step_tokens``, decodes first) lasts, then at most one chunk of the next: a long prompt
never stalls the running sequences for a whole prefill (chunked prefill, vLLM's
``max_num_batched_tokens``). A prompt identical to one this step prefills to its end is not
computed again: it is that piece's *twin*, and takes its keys, values and first logits (the
``n`` samples of one prompt; duplicate records). A twin of a prompt this step only prefills a
chunk of waits for the last chunk rather than compute the prompt a second time. A prompt whose
tokens' log-probabilities are asked for (``prompt_logprobs``) is computed whole, every time.

Prompts that share a long prefix (a system prompt, few-shot examples) and arrive together would
each compute it in the same step: the cache keeps a prefix only once a prompt that shares it is
prefilled. So the first of them goes alone, and the cache keeps the prefix it shares with the
others, held back one step, which then start from it.

:func:`run_step` is one whole step: plan, execute, take the outputs back, free what ended.
Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from batchline.models.generation.engine import GenerationRequest, StepOutput
from batchline.models.generation.kv_manager import KVManager, Seq
from batchline.models.generation.plan import Decode, Executor, Prefill, StepPlan
from batchline.models.generation.prefix_cache import Prefix, PrefixCache

__all__ = ["Planned", "StepScheduler", "plan_prefill", "run_step"]


@dataclass(slots=True, eq=False)
class _Piece:
    """What a step prefills of one waiting sequence: prompt tokens ``[begin, end)``, after a
    cached ``prefix`` or its own earlier chunks holding ``[0, begin)``."""

    seq: Seq
    begin: int
    end: int
    prefix: Prefix | None  # the cache hit it starts from (None for a twin)
    twin: _Piece | None = None

    @property
    def last(self) -> bool:
        return self.end == len(self.seq.prompt)


class _Leaders:
    """The prompts a step prefills from their start: does one share ``k`` leading tokens
    with a prompt? (Sets of their first ``k`` tokens, built per ``k`` asked: slices compare
    in C, where a token-by-token loop over every pair would cost a step milliseconds.)"""

    def __init__(self) -> None:
        self.prompts: list[tuple[int, ...]] = []
        self._heads: dict[int, set[tuple[int, ...]]] = {}

    def add(self, prompt: tuple[int, ...]) -> None:
        self.prompts.append(prompt)
        for k, heads in self._heads.items():
            if len(prompt) > k:
                heads.add(prompt[:k])

    def share(self, prompt: tuple[int, ...], k: int) -> bool:
        if len(prompt) <= k or not self.prompts:
            return False
        heads = self._heads.get(k)
        if heads is None:
            heads = self._heads[k] = {p[:k] for p in self.prompts if len(p) > k}
        return prompt[:k] in heads


def plan_prefill(
    pending: Iterable[Seq], prefixes: PrefixCache | None, room: int | None
) -> tuple[list[_Piece], list[tuple[int, ...]]]:
    """The pieces of the ``pending`` sequences (in arrival order) one step prefills, within
    ``room`` prompt tokens (None: no limit), see the module docstring, and the prompts held
    back. Looks ``prefixes`` up for a prompt that starts there; holds a prompt back a step
    when one this step prefills from its start shares ``prefixes.min_tokens`` or more tokens
    with it beyond its own hit, so that the cache keeps that prefix for it (once at most: the
    next step its leader has joined)."""
    pieces: list[_Piece] = []
    whole: dict[tuple[int, ...], _Piece] = {}  # prompts this step prefills to their end
    chunked: set[tuple[int, ...]] = set()  # prompts this step prefills a chunk of
    leaders = _Leaders()
    held_back: list[tuple[int, ...]] = []
    for seq in pending:
        prompt = seq.prompt
        if not seq.staged and not seq.scores_prompt:
            twin = whole.get(prompt)
            if twin is not None:  # costs no room: nothing of it is computed
                pieces.append(_Piece(seq, twin.begin, twin.end, None, twin))
                continue
            if prompt in chunked:
                continue  # waits for its twin's last chunk rather than compute it again
        if room is not None and room <= 0:
            break
        prefix = None
        if not seq.staged and prefixes is not None and not seq.scores_prompt:
            prefix = prefixes.lookup(prompt)
            held = 0 if prefix is None else len(prefix.tokens)
            if leaders.share(prompt, held + prefixes.min_tokens):
                held_back.append(prompt)
                continue
        begin = seq.staged if prefix is None else len(prefix.tokens)
        end = len(prompt) if room is None else min(len(prompt), begin + room)
        piece = _Piece(seq, begin, end, prefix)
        pieces.append(piece)
        if piece.last:
            whole.setdefault(prompt, piece)
        elif not seq.staged:
            chunked.add(prompt)
        if room is not None:
            room -= end - begin
        if not seq.staged and prefixes is not None:
            leaders.add(prompt)
    return pieces, held_back


class StepScheduler:
    """The sequences added and not ended, their KV slots (a :class:`~.kv_manager.KVManager`),
    and the plan of each step.

    ``max_step_tokens``: tokens one step computes at most, decodes first, the rest prompt
    chunks; None: every waiting prompt whole. ``prefix_cache_tokens``: positions the prefix
    cache keeps at most; 0 turns prefix caching off.

    :meth:`schedule` changes nothing; :meth:`update` takes a step's outputs back, so a step
    that failed leaves the scheduler as it was.
    """

    def __init__(self, *, max_step_tokens: int | None = None, prefix_cache_tokens: int = 0):
        if max_step_tokens is not None and max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1 or None, got {max_step_tokens}")
        self.max_step_tokens = max_step_tokens
        self.kv = KVManager(prefix_cache_tokens)
        self._pending: dict[str, Seq] = {}  # added, not yet (fully) prefilled
        self._live: dict[str, Seq] = {}  # pending + running, not finished or aborted
        self._trial: PrefixCache | None = None  # the cache index the last plan was made on
        self.prompt_tokens_computed = 0  # prompt tokens prefilled (not a prefix's or a twin's)
        self.prompts_shared = 0  # prompts not prefilled: an identical one joining was

    # -- requests ------------------------------------------------------------------------

    def add(self, request: GenerationRequest) -> None:
        """Register ``request``; it is planned from the next step on."""
        if request.request_id in self._live:
            raise ValueError(f"request {request.request_id!r} is already running")
        seq = Seq(request)
        self._pending[request.request_id] = seq
        self._live[request.request_id] = seq

    def abort(self, request_id: str) -> bool:
        """Drop a request (its row is freed by the next :meth:`~.kv_manager.KVManager.compact`);
        whether it was live."""
        seq = self._live.pop(request_id, None)
        if seq is None:
            return False
        seq.done = True
        self._pending.pop(request_id, None)
        return True

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def num_running(self) -> int:
        return len(self._live)

    def kv_tokens_in_use(self) -> int:
        return self.kv.tokens_in_use(self._pending.values())

    # -- the step ------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step's plan: a token for every running row, then the prompt pieces of
        :func:`plan_prefill` within what ``max_step_tokens`` leaves."""
        rows = self.kv.rows
        room = None if self.max_step_tokens is None else self.max_step_tokens - len(rows)
        # no prompt waits: nothing is looked up or learned, the index itself will do
        trial = self.kv.trial() if self._pending else self.kv.prefixes
        pieces, held_back = plan_prefill(self._pending.values(), trial, room)
        decodes = tuple(
            Decode(s.request.request_id, i, s.last_token, s.held) for i, s in enumerate(rows)
        )
        index = {id(p): i for i, p in enumerate(pieces)}
        prefills: list[Prefill] = []
        learners: list[tuple[Seq, int]] = []
        slot = len(rows)
        for piece in pieces:
            seq = piece.seq
            here = None
            if piece.last:
                here, slot = slot, slot + 1
                if piece.twin is None:
                    learners.append((seq, here))
            prefills.append(
                Prefill(
                    seq.request.request_id,
                    piece.begin,
                    piece.end,
                    len(seq.prompt),
                    here,
                    prefix=None if piece.prefix is None else piece.prefix.tokens,
                    staged=piece.twin is None and seq.staged > 0,
                    twin=None if piece.twin is None else index[id(piece.twin)],
                )
            )
        ops = self.kv.learn(trial, learners, held_back)
        self._trial = trial
        return StepPlan(decodes, tuple(prefills), tuple(ops), tuple(held_back))

    def update(self, plan: StepPlan, outputs: Sequence[StepOutput]) -> None:
        """Take back the outputs of ``plan`` (the latest :meth:`schedule`), which has run:
        the prompts it prefilled to their end join the rows, the others keep their chunks,
        the cache keeps what it learned, and the sequences that finished are done."""
        live = self._live
        joiners: list[Seq] = []
        for p in plan.prefills:
            seq = live.get(p.request_id)
            if seq is None:
                continue  # aborted since it was planned
            if p.last:
                seq.staged = 0
                del self._pending[p.request_id]
                joiners.append(seq)
            else:
                seq.staged = p.end
        self.kv.allocate(joiners)
        self.kv.commit(self._trial, plan.reused)
        self._trial = None
        self.prompt_tokens_computed += plan.prompt_tokens
        self.prompts_shared += sum(p.twin is not None for p in plan.prefills)
        for out in outputs:
            seq = live.get(out.request_id)
            if seq is None:
                continue
            if out.token_ids:
                seq.generated += len(out.token_ids)
                seq.last_token = out.token_ids[-1]
            if out.finished:
                seq.done = True
                del live[out.request_id]


def run_step(scheduler: StepScheduler, executor: Executor) -> tuple[StepPlan, Sequence[StepOutput]]:
    """One step: free the rows of sequences aborted since the last, plan, execute, take the
    outputs back, free the rows of those that finished. If ``executor.execute`` raises, the
    scheduler (and, by its contract, the executor) are left as they were."""
    freed = scheduler.kv.compact()
    if freed is not None:
        executor.release(freed)
    plan = scheduler.schedule()
    outputs = executor.execute(plan) if not plan.empty else []
    scheduler.update(plan, outputs)
    freed = scheduler.kv.compact()
    if freed is not None:
        executor.release(freed)
    return plan, outputs


@runtime_checkable
class Planned(Executor, Protocol):
    """An executor with the scheduler that plans its steps (the torch engine): a generator
    above it steps it with :func:`run_step`, and so knows what each step did."""

    @property
    def scheduler(self) -> StepScheduler: ...
