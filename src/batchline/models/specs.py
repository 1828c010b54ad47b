"""Model specs: the one string that names a model everywhere (``run``, ``serve``, ``bench``,
``tune``, ``drive``'s reference checks, Ray, knobs files), and the one resolver that loads it.

Spec kinds:

- ``default`` — the built-in all-MiniLM-L6-v2 embedder; ``smollm2`` — the built-in generator
  (``batchline models list`` shows the built-in models);
- ``PATH.onnx`` — any ONNX model, with a task: ``embed`` (a text encoder; the tokenizer from
  ``tokenizer=`` or ``tokenizer.json`` beside it), ``classify`` (a sequence classifier; labels
  from ``config.json``'s ``id2label`` beside it or ``labels=``) or ``predict`` (tensors in,
  tensors out). Without a task, a model with an ``input_ids`` input embeds, any other predicts;
- ``PATH/`` — a local Hugging Face model folder, read for what it is
  (``batchline.models.common.folder``): a sentence-transformers embedder, a sequence
  classifier, a cross-encoder (task ``score``), a plain encoder (``embed``), a folder with
  ``model.onnx`` (the ``PATH.onnx`` path with the folder's tokenizer and config), a causal LM (task
  ``generate``, loaded by ``batchline.models.generation.load``), or an image model (an image
  classifier, CLIP/SigLIP, DINOv2: ``batchline.models.image``);
- ``module:factory`` — the user's own Python: ``factory()`` returns a :class:`BatchModel`, or
  simply a batch function ``list[record] -> list[result]`` (sync or async), optionally with a
  ``cost(record) -> int`` attribute;
- ``NAME=SPEC`` — any of the above under a name of one's own (several models at once).

Standard library only at import time; loading imports what the model needs.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, cast, get_args

from batchline._errors import InputError
from batchline.models.builtin import BUILTIN_MODELS
from batchline.models.common.folder import FolderModel, detect_folder
from batchline.models.common.image_options import ImageOptions
from batchline.models.protocol import TASKS, Task

__all__ = [
    "MODALITIES",
    "ModelSpec",
    "Pooling",
    "SpecKind",
    "parse_spec",
    "parse_specs",
    "with_modality",
]

SpecKind = Literal["builtin", "onnx", "python", "hf", "gguf"]
#: How an embedder's token outputs become one vector per text: ``mean`` over the attention
#: mask, ``cls`` (the first token's), ``lasttoken`` (the last real token's: decoder
#: embedders), or ``none`` (the model already returns ``(batch, dim)``).
Pooling = Literal["mean", "cls", "lasttoken", "none"]
#: What a model that takes several kinds of input is loaded for (a CLIP folder: its text or
#: its image tower); the dataset's kind decides, ``None`` is the model's own default.
SpecInput = Literal["text", "image"]

_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]*)=(.+)$")
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True)
class ModelSpec:
    """A parsed model spec and the options that go with it.

    ``name`` is what clients and outputs call it: the ``NAME=`` prefix, else the built-in
    name, the file's stem, or the factory's name.
    """

    name: str
    source: str
    kind: SpecKind
    task: Task | None = None
    tokenizer: Path | None = None
    labels: tuple[str, ...] | None = None
    pooling: Pooling | None = None
    normalize: bool | None = None
    #: classify: keep the ``top_k`` likeliest labels per result (``None``: every label)
    top_k: int | None = None
    #: the input kind to load a two-tower folder for (``None``: text for embed, image for
    #: zero-shot classify)
    input_kind: SpecInput | None = None
    #: what a ``PATH/`` spec's folder holds (read once, at parse time)
    folder: FolderModel | None = field(default=None, compare=False, repr=False)
    #: a plain ``.onnx`` that reads pictures, and how (``--image-size``, ``--mean``, ``--std``)
    image: ImageOptions | None = None

    @property
    def path(self) -> Path:
        return Path(self.source)

    def with_options(
        self,
        *,
        task: str | None = None,
        tokenizer: Path | None = None,
        labels: tuple[str, ...] | None = None,
        pooling: str | None = None,
        normalize: bool | None = None,
        image: ImageOptions | None = None,
        top_k: int | None = None,
        input_kind: str | None = None,
    ) -> ModelSpec:
        """This spec with the given options set (``None`` keeps what it has), validated.
        Labels given to a two-tower image folder (CLIP, SigLIP) without a task make it a
        zero-shot classifier."""
        if task is not None and task not in TASKS:
            raise InputError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
        if pooling is not None and pooling not in get_args(Pooling):
            raise InputError(f"pooling must be mean, cls, lasttoken or none, got {pooling!r}")
        if top_k is not None and top_k < 1:
            raise InputError(f"--top-k must be >= 1, got {top_k}")
        if input_kind is not None and input_kind not in get_args(SpecInput):
            raise InputError(f"input kind must be text or image, got {input_kind!r}")
        two_towers = self.folder is not None and self.folder.image == "two-tower"
        if task is None and labels is not None and two_towers:
            task = "classify"
        spec = replace(
            self,
            task=task if task is not None else self.task,  # type: ignore[arg-type]
            tokenizer=tokenizer if tokenizer is not None else self.tokenizer,
            labels=labels if labels is not None else self.labels,
            pooling=pooling if pooling is not None else self.pooling,  # type: ignore[arg-type]
            normalize=normalize if normalize is not None else self.normalize,
            image=image if image is not None else self.image,
            top_k=top_k if top_k is not None else self.top_k,
            input_kind=input_kind if input_kind is not None else self.input_kind,  # type: ignore[arg-type]
        )
        spec._check()
        return spec

    def _check(self) -> None:
        if self.kind == "builtin":
            builtin_task = BUILTIN_MODELS[self.source].task
            if self.task is not None and self.task != builtin_task:
                raise InputError(
                    f"model {self.name!r} ({self.source}) does {builtin_task}, not {self.task}"
                )
        if self.kind == "gguf" and self.task != "generate":
            raise InputError(f"model {self.name!r} ({self.source}) is a GGUF: it generates text")
        if self.kind in ("onnx", "python") and self.task == "generate":
            raise InputError(
                f"model {self.name!r} ({self.source}) cannot generate text: the generate task "
                "takes smollm2 or a Hugging Face causal-LM folder (PATH/ with config.json)"
            )
        if self.folder is not None:
            self.folder.for_task(self.task)  # raises when the folder cannot do the task
        if self.kind in ("builtin", "hf", "gguf") and self.tokenizer is not None:
            raise InputError(f"a tokenizer goes with an .onnx model, not {self.source!r}")
        if self.labels is not None and self.task not in (None, "classify"):
            raise InputError(f"labels go with the classify task, not {self.task}")
        if self.top_k is not None and self.task not in (None, "classify"):
            raise InputError(f"--top-k goes with the classify task, not {self.task}")
        image = self.folder.image if self.folder is not None else None
        if image == "two-tower" and self.task == "classify" and not self.labels:
            raise InputError(
                f"model {self.name!r} ({self.source}) classifies zero-shot over labels you "
                'give: --labels "a cat,a dog" or --labels FILE (one label a line)'
            )
        if image == "two-tower" and self.task == "classify" and self.input_kind == "text":
            raise InputError(
                f"model {self.name!r}: zero-shot classification takes images; texts go to "
                "its text tower with --task embed"
            )
        if self.input_kind == "text" and image in ("classifier", "encoder"):
            raise InputError(f"model {self.name!r} ({self.source}) takes images, not texts")
        pools = self.pooling is not None or self.normalize is not None
        if pools and self.task not in (None, "embed"):
            raise InputError(f"pooling and normalize go with the embed task, not {self.task}")

    @property
    def generates(self) -> bool:
        """Whether this spec names a text generator (task ``generate``, known without loading)."""
        return self.task == "generate" or self.builtin_task == "generate"

    @property
    def builtin_task(self) -> Task | None:
        return BUILTIN_MODELS[self.source].task if self.kind == "builtin" else None


def _lone_gguf(folder: Path) -> Path | None:
    """The one ``.gguf`` file of a folder without ``config.json``, else None (a folder of
    several is refused by :func:`detect_folder`, which names them)."""
    if not folder.is_dir() or (folder / "config.json").exists():
        return None
    found = sorted(folder.glob("*.gguf"))
    return found[0] if len(found) == 1 else None


def parse_spec(text: str) -> ModelSpec:
    """``default``, ``smollm2``, ``PATH.onnx``, ``PATH.gguf`` (a causal LM in one GGUF file),
    ``PATH/`` (a Hugging Face model folder),
    ``module:factory``, or ``NAME=`` any of them."""
    text = text.strip()
    if not text:
        raise InputError("a model spec must not be empty")
    name: str | None = None
    match = _NAME.match(text)
    if match and not Path(text).exists():
        name, text = match.group(1), match.group(2).strip()
    if text in BUILTIN_MODELS:
        served = BUILTIN_MODELS[text].served_name
        return ModelSpec(name=name or served, source=text, kind="builtin")
    if text.lower().endswith(".onnx"):
        path = Path(text)
        if not path.is_file():
            raise InputError(no_such(text))
        return ModelSpec(name=name or path.stem, source=str(path), kind="onnx")
    if text.lower().endswith(".gguf"):
        path = Path(text)
        if not path.is_file():
            raise InputError(no_such(text))
        return ModelSpec(name=name or path.stem, source=str(path), kind="gguf", task="generate")
    if _FACTORY.match(text) and not Path(text).is_dir():
        return ModelSpec(name=name or text.rsplit(":", 1)[1], source=text, kind="python")
    folder = Path(text)
    if not folder.exists() and (text.endswith(("/", "\\")) or _looks_like_a_path(text)):
        raise InputError(no_such(text))
    if text.endswith(("/", "\\")) or folder.is_dir():
        gguf = _lone_gguf(folder)
        if gguf is not None:  # a folder holding one GGUF file and no config.json: that file
            name = name or folder.resolve().name
            return ModelSpec(name=name, source=str(gguf), kind="gguf", task="generate")
        found = detect_folder(folder)
        # the folder's own name; resolve() so that "." and "out/" name it too
        name = name or folder.resolve().name
        if found.onnx_file is not None:
            # the folder's tokenizer, also where the graph sits in a subfolder (onnx/)
            return ModelSpec(
                name=name,
                source=str(found.onnx_file),
                kind="onnx",
                task=found.task,
                tokenizer=found.tokenizer if found.onnx_file.parent != folder else None,
                folder=found,
            )
        return ModelSpec(name=name, source=str(folder), kind="hf", task=found.task, folder=found)
    raise InputError(
        f"model spec {text!r} is none of: a built-in model ({', '.join(BUILTIN_MODELS)}), "
        "a path to an .onnx or .gguf file, a Hugging Face model folder (PATH/ with config.json), "
        "or module:factory (your own Python); prefix NAME= to name it"
    )


def no_such(text: str) -> str:
    """The one wording of a model path that is not there."""
    return f"{text}: no such model file or folder"


def _looks_like_a_path(text: str) -> bool:
    return "/" in text or "\\" in text or text.startswith((".", "~"))


def parse_specs(
    models: list[str],
    *,
    tasks: Sequence[str] = (),
    tokenizer: Path | None = None,
    labels: tuple[str, ...] | None = None,
    pooling: str | None = None,
    normalize: bool | None = None,
    image: ImageOptions | None = None,
    top_k: int | None = None,
    modalities: Sequence[str] = (),
) -> list[ModelSpec]:
    """Several ``--model`` values and their ``--task`` and ``--modality`` values (``TASK``
    alone when there is one model, else ``NAME=TASK``; see :func:`with_modality`). The other
    options apply to a single model only."""
    specs = [parse_spec(m) for m in models or ["default"]]
    names = [s.name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InputError(f"two models are named {dupes[0]!r}: name them with NAME=SPEC")
    task_of = _per_model("--task", tasks, names)
    modality_of = _per_model("--modality", modalities, names)
    single = len(specs) == 1
    specs = [with_modality(s, modality_of[s.name]) if s.name in modality_of else s for s in specs]
    if not single and any(x is not None for x in (tokenizer, labels, pooling, normalize, top_k)):
        raise InputError(
            "--tokenizer, --labels, --pooling, --normalize and --top-k go with a single --model"
        )
    return [
        s.with_options(
            task=task_of.get(s.name),
            tokenizer=tokenizer if single else None,
            labels=labels if single else None,
            pooling=pooling if single else None,
            normalize=normalize if single else None,
            # pictures are read by an .onnx only (a folder says what it reads)
            image=image if single and s.kind == "onnx" else None,
            top_k=top_k if single else None,
        )
        for s in specs
    ]


def _per_model(flag: str, values: Sequence[str], names: Sequence[str]) -> dict[str, str]:
    """``{name: value}`` of a per-model flag's ``[NAME=]VALUE`` values: ``VALUE`` alone goes
    with the one model there is; with several, each names its model."""
    of: dict[str, str] = {}
    for given in values:
        match = _NAME.match(given)
        if match:
            target, value = match.group(1), match.group(2)
            if target not in names:
                raise InputError(
                    f"{flag} {given}: no model named {target!r}; models: {', '.join(names)}"
                )
        elif len(names) == 1:
            target, value = names[0], given
        else:
            raise InputError(f"{flag} {given}: with several models, say which: {flag} NAME={given}")
        of[target] = value
    return of


#: What ``--modality`` takes.
MODALITIES = ("text", "image")


def with_modality(spec: ModelSpec, modality: str) -> ModelSpec:
    """``spec`` reading ``modality``: a two-tower folder's tower (CLIP, SigLIP: ``text`` or
    ``image``), or, for a plain ONNX model, pictures (``image``: its one NCHW input, its
    preprocessing from a ``preprocessor_config.json`` beside it, as ``run`` reads pictures);
    ``InputError`` for a model that takes one kind of input."""
    if modality not in MODALITIES:
        raise InputError(
            f"--modality {spec.name}={modality}: a modality is one of {', '.join(MODALITIES)}"
        )
    if spec.folder is not None and spec.folder.image == "two-tower":
        return spec.with_options(input_kind=cast(SpecInput, modality))
    if spec.kind == "onnx":
        if modality == "image":
            return spec.with_options(image=spec.image or ImageOptions())
        return spec
    raise InputError(
        f"modality goes with a two-tower image folder (CLIP, SigLIP) or a plain .onnx; "
        f"{spec.name!r} takes one kind of input"
    )


def import_factory(source: str) -> object:
    """Import ``module:factory`` (the current directory is importable, as for ``python -m``)
    and return what ``factory()`` returns."""
    module_name, _, attr = source.partition(":")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InputError(f"model {source!r}: cannot import {module_name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if factory is None:
        raise InputError(f"model {source!r}: module {module_name!r} has no {attr!r}")
    if not callable(factory):
        raise InputError(f"model {source!r}: {attr!r} is not callable")
    try:
        return factory()
    except Exception as exc:
        raise InputError(f"model {source!r}: {attr}() raised {type(exc).__name__}: {exc}") from exc
