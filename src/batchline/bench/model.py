"""The model a bench or a tune measures: ``--model`` and its options as one spec
(:func:`model_spec`), loaded through :func:`batchline.models.loader.load_model` once per
session layout (:class:`LoadedModels`, so a tuner that tries many batch budgets does not reload
the weights each time) in the precision ``run`` would load it in (``auto`` chosen as
:mod:`batchline.jobs.precision` chooses), its tokenizer
(:func:`~batchline.models.loader.text_tokenizer`) and its inputs prepared once
(:func:`prepare_items`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from batchline._errors import InputError
from batchline.models.config import Knobs
from batchline.models.protocol import BatchModel, ModelInfo
from batchline.models.specs import ModelSpec

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from batchline.jobs.precision import Choice

__all__ = ["LoadedModels", "layout_of", "model_spec", "prepare_items"]

AnyModel = BatchModel[object, object]


def model_spec(
    model: str | ModelSpec = "default",
    *,
    task: str | None = None,
    tokenizer: Path | None = None,
    labels: tuple[str, ...] | None = None,
    pooling: str | None = None,
    normalize: bool | None = None,
    top_k: int | None = None,
) -> ModelSpec:
    """``--model`` and its options as one spec, as ``batchline run`` reads them; a text
    generator is refused here (``batchline bench --task generate`` measures generation)."""
    from batchline.models.specs import parse_specs

    if isinstance(model, ModelSpec):
        spec = model.with_options(
            task=task,
            tokenizer=tokenizer,
            labels=labels,
            pooling=pooling,
            normalize=normalize,
            top_k=top_k,
        )
    else:
        (spec,) = parse_specs(
            [model],
            tasks=[task] if task else [],
            tokenizer=tokenizer,
            labels=labels,
            pooling=pooling,
            normalize=normalize,
            top_k=top_k,
        )
    if spec.generates:
        raise InputError(
            f"model {spec.name!r} generates text: bench and tune measure batch models "
            "(embed, classify, predict); batchline bench --task generate measures generation"
        )
    return spec


Layout = tuple[object, ...]


def layout_of(spec: ModelSpec, knobs: Knobs) -> Layout:
    """What of ``knobs`` a loaded model depends on: its sessions, threads, device and
    precision (a ``module:factory`` model is laid out by its own code: one layout)."""
    if spec.kind == "python":
        return ()
    precision = (knobs.precision, knobs.quantize)
    if not knobs.batching:
        return (False, 1, knobs.intra_op_threads, None, knobs.device, *precision)
    return (
        True,
        knobs.sessions,
        knobs.intra_op_threads,
        knobs.solo_intra_op_threads,
        knobs.device,
        *precision,
    )


class LoadedModels:
    """Loads a model spec through ``load_model`` (what ``run`` and ``serve`` load) and keeps
    each layout loaded: models are cached by (spec, layout), so only the first configuration
    with a given layout pays for loading the weights. :meth:`close` closes them all.

    ``precision = "auto"`` is resolved as ``run`` resolves it, once, on the first layout
    loaded (measured there, or read from the cache of earlier answers), and every later layout
    loads the same precision: a tuner's trials compare layouts, not precisions. The answer is
    :attr:`choice`.

    >>> loader = LoadedModels(model_spec("model.onnx", task="predict"))
    >>> model = loader.load(Knobs(sessions=2))
    """

    def __init__(self, spec: ModelSpec | str = "default", tokenizer: Path | None = None) -> None:
        self.spec = spec if isinstance(spec, ModelSpec) else model_spec(spec, tokenizer=tokenizer)
        self._models: dict[tuple[ModelSpec, Layout], AnyModel] = {}
        self._tokenizer: list[Tokenizer | None] = []
        #: what ``precision = "auto"`` chose, and why (``None``: not resolved yet, or the knob
        #: does not apply to the model)
        self.choice: Choice | None = None
        self._chosen: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    def load(self, knobs: Knobs) -> AnyModel:
        """The model laid out as ``knobs`` say (cached)."""
        from batchline.models.loader import load_model

        knobs = self._in_precision(knobs)
        key = (self.spec, layout_of(self.spec, knobs))
        if key not in self._models:
            self._models[key] = load_model(self.spec, knobs)
        return self._models[key]

    def _in_precision(self, knobs: Knobs) -> Knobs:
        """``knobs`` with ``auto`` resolved (once per loader)."""
        if knobs.precision != "auto" or self.spec.kind == "python":
            return knobs
        if self._chosen is None:
            from batchline.jobs.precision import announce, resolve_knobs

            resolved, self.choice = resolve_knobs(self.spec, knobs)
            self._chosen = resolved.precision
            announce(self.spec, self.choice)
        return knobs.replace(precision=self._chosen)

    def info(self, knobs: Knobs) -> ModelInfo:
        """The model's info (loading it laid out as ``knobs`` say, if not loaded yet)."""
        return self.load(knobs).info

    def tokenizer(self) -> Tokenizer | None:
        """The Hugging Face tokenizer of a text model (built-in or ``.onnx`` embed/classify),
        loaded once, to cut texts to lengths and count tokens; ``None`` for other models."""
        if not self._tokenizer:
            from batchline.models.loader import text_tokenizer

            self._tokenizer.append(text_tokenizer(self.spec))
        return self._tokenizer[0]

    def release(self, keep: Sequence[Knobs] = ()) -> None:
        """Close and drop loaded models except those laid out as one of ``keep``."""
        kept = {(self.spec, layout_of(self.spec, k)) for k in keep}
        for key in [k for k in self._models if k not in kept]:
            self._models.pop(key).close()

    def close(self) -> None:
        """Close every loaded model."""
        self.release()


def prepare_items(model: AnyModel, inputs: Sequence[object]) -> list[object]:
    """``model.prepare(inputs)``, all of them usable, or an ``InputError`` saying which not."""
    prepared = model.prepare(inputs)
    bad = [(i, p) for i, p in enumerate(prepared) if isinstance(p, BaseException)]
    if bad:
        index, exc = bad[0]
        raise InputError(
            f"the model {model.info.name!r} cannot take {len(bad):,} of the {len(inputs):,} "
            f"inputs; input {index + 1}: {exc}"
        )
    return list(prepared)
