"""A backend: one kind of model in one place. It says which specs it takes (``claims``),
loads one (``load``), tells its memory before the load (``footprint``), what identifies
its results (``identity``) and which precisions it computes a model in (``precisions``).
:data:`batchline.models.registry.BACKENDS` holds them in order, and the loader, the footprint
estimate and the result cache's identity each ask the first backend that claims a spec; none
of them knows the kinds.

Standard library only: a backend's module imports its runtime where it loads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from batchline._errors import ModelError
from batchline.knobs import CoreKnobs
from batchline.models.protocol import BatchModel, InputKind, Task
from batchline.models.specs import ModelSpec

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "FP32",
    "UNKNOWN",
    "Asked",
    "Backend",
    "Footprint",
    "Identity",
    "Loaded",
    "Registry",
    "precision_refusal",
    "text_input",
]

#: The options a backend reads: its own options class (``SessionOptions``, ...), which the
#: deployment's ``Knobs`` (``models/config.py``) extends, so a backend whose hooks take its
#: own class takes the deployment's knobs. (Contravariant: hooks only take it.)
Opts = TypeVar("Opts", bound=CoreKnobs, contravariant=True)

#: A loaded model, whatever its records and results (each backend's own types).
Loaded = BatchModel[Any, Any]


@dataclass(frozen=True, slots=True)
class Footprint:
    """A model's expected memory: what it holds once loaded, what its load needs at its peak,
    and the runtime it loads (``""``: none known)."""

    steady_bytes: int
    peak_bytes: int
    runtime: str = ""
    #: what else than a larger memory budget makes it fit, where a setting shrinks it
    advice: str = ""


#: What a backend that cannot tell its memory before the load estimates: its first load
#: measures it.
UNKNOWN = Footprint(0, 0)


@dataclass(frozen=True, slots=True)
class Identity:
    """What identifies a backend's model beyond the spec's own options: the files its
    weights and tokenizer are read from, and what else changes its results (a generator's
    dtype and device)."""

    files: tuple[Path, ...]
    options: Mapping[str, object] = field(default_factory=dict)


#: What a model computes in when it computes in nothing else (``Backend.precisions``): the
#: knob's names less ``auto``, which is resolved before the load (``jobs/precision.py``; the
#: loader given ``auto`` loads fp32).
FP32 = frozenset({"fp32"})


class Asked(Protocol):
    """What a refusal reads off the knobs: the precision asked for, and whether it was asked
    for by its older spelling (``--quantize int8``)."""

    @property
    def precision(self) -> str: ...

    @property
    def quantize(self) -> str | None: ...


def precision_refusal(spec: ModelSpec, task: Task, asked: Asked) -> str:
    """The line that refuses a precision a backend does not compute ``spec`` in, where the
    backend has no line of its own: int8 is for embedding models; bf16 for embedding models, and
    for classify and score models from a Hugging Face folder's weights."""
    if asked.precision == "int8":
        if asked.quantize is not None:
            return (
                f"--quantize {asked.quantize} applies to embedding models; {spec.name!r} has "
                f"task {task!r}: leave --quantize out for it"
            )
        return (
            f"precision int8 applies to embedding models; {spec.name!r} has task "
            f"{task!r}: use precision auto, fp32 or bf16 for it"
        )
    if asked.precision == "bf16" and task in ("classify", "score"):
        return (
            f"precision bf16 runs a {task} model from its Hugging Face folder's weights on "
            f"torch; {spec.name!r} ({spec.source}) is no such folder: use precision auto or "
            "fp32 for it"
        )
    return (
        f"precision {asked.precision} applies to embedding, classify and score models; "
        f"{spec.name!r} has task {task!r}: use precision auto or fp32 for it"
    )


def _fp32(spec: ModelSpec, task: Task) -> frozenset[str]:
    return FP32


def _no_task(spec: ModelSpec) -> Task | None:
    return None


def _no_tokenizer(spec: ModelSpec) -> Tokenizer | None:
    return None


def _input_unknown(spec: ModelSpec, task: Task) -> InputKind | None:
    return None


def text_input(spec: ModelSpec, task: Task) -> InputKind:
    """What a text model's ``task`` takes: texts, a pair of texts (``score``: a record), or
    named tensors (``predict``)."""
    return "tensors" if task == "predict" else "record" if task == "score" else "text"


@dataclass(frozen=True, slots=True)
class Backend(Generic[Opts]):
    """One kind of model, reading its own options class ``Opts`` (the knobs it is given are the
    deployment's, a subclass).

    - ``claims(spec, knobs)``: whether this backend takes ``spec`` (its task resolved when it
      loads; as given when its footprint or identity is asked);
    - ``load(spec, knobs)``: the loaded model, laid out as ``knobs`` say;
    - ``footprint(spec, knobs, task)``: its memory, read off its files before the load;
    - ``identity(spec, knobs)``: its files and options for a result cache, ``None`` when its
      results cannot be identified (they are then never cached);
    - ``task(spec)``: the task read off a spec that names none, where this backend can tell
      (an ``.onnx`` file's graph); ``None`` leaves it to the next backend;
    - ``tokenizer(spec)``: the ``tokenizers`` tokenizer a text model reads its texts with, what
      a benchmark cuts and counts its texts with (``None``: it takes no text, or says none);
    - ``deterministic``: whether its results are a function of its input alone, so that a job
      answers a repeated input from the first one's result (a user's Python model may not be);
    - ``precisions(spec, task)``: the precisions it computes ``spec`` in for ``task`` (of
      ``fp32``, ``bf16``, ``int8``; default fp32 alone), which the loader asks before it loads
      and refuses any other with ``refusal(spec, task, knobs)``'s one line (default
      :func:`precision_refusal`);
    - ``input_kind(spec, task)``: what the model takes (``ModelInfo.input_kind``), told before
      the load, so that a server lists a model it has not loaded yet as it will be (``None``:
      only its load tells, as a user's Python model).
    """

    name: str
    claims: Callable[[ModelSpec, Opts], bool]
    load: Callable[[ModelSpec, Opts], Loaded]
    footprint: Callable[[ModelSpec, Opts, Task | None], Footprint]
    identity: Callable[[ModelSpec, Opts | None], Identity | None]
    task: Callable[[ModelSpec], Task | None] = _no_task
    tokenizer: Callable[[ModelSpec], Tokenizer | None] = _no_tokenizer
    deterministic: bool = True
    precisions: Callable[[ModelSpec, Task], frozenset[str]] = _fp32
    refusal: Callable[[ModelSpec, Task, Asked], str] = precision_refusal
    input_kind: Callable[[ModelSpec, Task], InputKind | None] = _input_unknown


class Registry:
    """The backends in the order they are asked: the first that claims a spec takes it."""

    def __init__(self) -> None:
        self._backends: list[Backend[Any]] = []

    def register(self, backend: Backend[Any], *, first: bool = False) -> None:
        """Add ``backend`` last (``first``: ahead of every other, to take specs they would)."""
        if any(b.name == backend.name for b in self._backends):
            raise ValueError(f"a backend named {backend.name!r} is registered already")
        self._backends.insert(0 if first else len(self._backends), backend)

    def unregister(self, name: str) -> None:
        """Remove the backend named ``name``."""
        self._backends = [b for b in self._backends if b.name != name]

    @contextmanager
    def registered(self, backend: Backend[Any], *, first: bool = True) -> Iterator[Backend[Any]]:
        """``backend`` registered for the ``with`` block only (ahead of the others by default)."""
        self.register(backend, first=first)
        try:
            yield backend
        finally:
            self.unregister(backend.name)

    def __iter__(self) -> Iterator[Backend[Any]]:
        return iter(tuple(self._backends))

    def names(self) -> list[str]:
        return [b.name for b in self._backends]

    def claiming(self, spec: ModelSpec, knobs: CoreKnobs) -> Backend[Any]:
        """The first backend that claims ``spec``."""
        for backend in self._backends:
            if backend.claims(spec, knobs):
                return backend
        raise ModelError(
            f"model {spec.name!r} ({spec.source}): no backend takes it "
            f"(registered: {', '.join(self.names())})"
        )

    def task(self, spec: ModelSpec) -> Task | None:
        """The task the first backend that can tell reads off ``spec``."""
        for backend in self._backends:
            task = backend.task(spec)
            if task is not None:
                return task
        return None
