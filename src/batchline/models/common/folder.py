"""What a Hugging Face model folder holds, read from its JSON files alone (no torch, no
transformers): :func:`detect_folder` returns a :class:`FolderModel` that says the task, the
architecture, how an embedder pools and normalizes, its Dense modules, its labels, and which
files run it. ``specs.parse_spec`` calls it for every ``PATH/`` spec, so ``ModelSpec.generates``
is known before anything heavy loads.

The rules, first match wins:

- ``model.onnx`` in the folder: the ONNX path (task from ``config.json`` when it says, else
  read off the graph at load time), with the folder's ``tokenizer.json``;
- a sentence-transformers CrossEncoder (``config_sentence_transformers.json`` says
  ``CrossEncoder``, or ``config.json`` carries a ``sentence_transformers`` block) → ``score``
  (``classify`` when it has several labels);
- ``modules.json`` (sentence-transformers) → ``embed`` with its Pooling, Dense and Normalize;
- ``*ForSequenceClassification`` → ``classify``, or ``score`` with exactly one label;
- ``*ForCausalLM``, ``*LMHeadModel``, ``*ForConditionalGeneration`` → ``generate``;
- an image model (``preprocessor_config.json`` beside the weights): ``*ForImageClassification``
  → ``classify`` (labels from ``id2label``); ``CLIPModel``, ``SiglipModel`` → ``embed`` (the
  image tower, or the text tower for texts) or zero-shot ``classify`` given labels;
  ``Dinov2Model``, ``ViTModel`` → ``embed`` (CLS pooling, or what a sentence-transformers
  ``modules.json`` beside it says, unless told);
- a plain encoder (``BertModel``, ``XLMRobertaModel``, ...) → ``embed``, mean pooling and
  L2 normalization assumed (the log line says so).

Anything else is one :class:`~batchline._errors.InputError` line naming what was found.

Example::

    found = detect_folder(Path("all-MiniLM-L6-v2"))
    found.describe()
    # 'sentence-transformers folder (BertModel, mean pooling, normalized, 256 tokens)'
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from batchline._errors import InputError
from batchline.models.protocol import Task

__all__ = [
    "DenseModule",
    "FolderModel",
    "TokenPooling",
    "detect_folder",
    "gguf_refusal",
    "read_json_object",
]

#: How an embedder pools its token vectors (the token-pooling members of ``specs.Pooling``).
TokenPooling = Literal["mean", "cls", "lasttoken"]
Layout = Literal["sentence-transformers", "cross-encoder", "transformers", "onnx", "image"]
#: An image folder's kind: a classifier head, CLIP/SigLIP's two towers, or an image encoder.
ImageKind = Literal["classifier", "two-tower", "encoder"]

_GENERATE_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
# model_type of decoder families: a sentence-transformers folder over one of them pools its
# last token on torch (helper `torch_embed`), not on the ONNX encoder path
_DECODER_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gemma3_text", "phi3"}
)
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
_ACTIVATIONS = {"Tanh": "tanh", "Identity": "identity", "ReLU": "relu", "Sigmoid": "sigmoid"}
_SUPPORTED = (
    "a sentence-transformers folder (modules.json), a *ForSequenceClassification folder "
    "(classify, or score with one label), a cross-encoder, a plain encoder (BertModel, ...), "
    "a *ForCausalLM folder (generate), an image model with preprocessor_config.json "
    "(*ForImageClassification, CLIPModel, SiglipModel, Dinov2Model, ViTModel) or a folder "
    "with model.onnx"
)
_TWO_TOWERS = {"CLIPModel": "clip", "SiglipModel": "siglip"}
_IMAGE_ENCODERS = {"Dinov2Model": "dinov2", "ViTModel": "vit"}


def gguf_refusal(found: str) -> str:
    """What a GGUF file, or a folder of them, is told: what was found, and what runs."""
    return (
        f"{found}; a GGUF is given as its file (--model FOLDER/NAME.gguf: Llama and Qwen2 "
        "families, run quantized), or give the Hugging Face folder it was made from "
        "(config.json and safetensors weights)"
    )


@dataclass(frozen=True)
class DenseModule:
    """A sentence-transformers ``Dense`` module: ``activation(x @ W.T + b)`` after pooling."""

    path: Path
    in_features: int
    out_features: int
    bias: bool
    activation: Literal["tanh", "identity", "relu", "sigmoid"]


@dataclass(frozen=True)
class FolderModel:
    """What :func:`detect_folder` found; ``task`` may be changed with :meth:`for_task`."""

    folder: Path
    task: Task | None
    layout: Layout
    architecture: str = ""
    model_type: str = ""
    #: the folder holding the transformer's ``config.json`` and weights (a sentence-transformers
    #: folder may keep it in a module subfolder such as ``0_Transformer``)
    model_folder: Path | None = None
    pooling: TokenPooling | None = None
    normalize: bool = False
    #: no modules.json: pooling and normalization were assumed, not read
    assumed: bool = False
    dense: tuple[DenseModule, ...] = ()
    max_seq_length: int | None = None
    labels: tuple[str, ...] = ()
    #: a one-label score model's activation on its logit
    activation: Literal["sigmoid", "identity"] = "sigmoid"
    onnx_file: Path | None = None
    weights: Path | None = None
    tokenizer: Path | None = None
    #: the transformer is a decoder family (last-token embedders run on torch)
    decoder: bool = False
    #: an image model's kind (``layout == "image"``) and its ``preprocessor_config.json``
    image: ImageKind | None = None
    preprocessor: Path | None = None

    @property
    def encoder_folder(self) -> Path:
        return self.model_folder if self.model_folder is not None else self.folder

    def describe(self) -> str:
        """One line for the load log: what the folder is and how it will be read."""
        arch = self.architecture or self.model_type or "no architecture"
        if self.layout == "onnx":
            what = f"{self.task} model" if self.task else "model"
            if self.pooling is not None:
                norm = "normalized" if self.normalize else "not normalized"
                what = f"{what}, {self.pooling} pooling, {norm}"
            where = self.onnx_file.relative_to(self.folder) if self.onnx_file else "model.onnx"
            return f"ONNX folder ({where}, {what})"
        if self.task == "generate":
            return f"causal-LM folder ({arch})"
        if self.image is not None:
            return self._describe_image(arch)
        if self.task == "embed":
            parts = [arch, f"{self.pooling} pooling"]
            parts += [f"dense {d.in_features}->{d.out_features} {d.activation}" for d in self.dense]
            parts.append("normalized" if self.normalize else "not normalized")
            if self.max_seq_length:
                parts.append(f"{self.max_seq_length} tokens")
            if self.assumed:
                return f"encoder folder ({', '.join(parts)}; no modules.json: pooling assumed)"
            return f"sentence-transformers folder ({', '.join(parts)})"
        labels = ", ".join(self.labels)
        if self.task == "score":
            kind = "cross-encoder" if self.layout == "cross-encoder" else "one-label classifier"
            return f"{kind} ({arch}, score = {self.activation}(logit))"
        return f"sequence classifier ({arch}, {len(self.labels)} labels: {labels})"

    def _describe_image(self, arch: str) -> str:
        if self.image == "classifier":
            shown = ", ".join(self.labels[:5]) + (", ..." if len(self.labels) > 5 else "")
            return f"image classifier ({arch}, {len(self.labels)} labels: {shown})"
        if self.image == "two-tower":
            texts = "texts and images" if self.tokenizer is not None else "images only"
            what = "zero-shot classifier" if self.task == "classify" else "embedder"
            return f"image-text {what} ({arch}, {texts})"
        pooling: str = self.pooling or "cls"
        if self.assumed:
            return f"image encoder ({arch}, {pooling} pooling)"
        if pooling == "mean":
            pooling = "mean of every token"
        norm = "normalized" if self.normalize else "not normalized"
        return f"image encoder ({arch}, {pooling} pooling, {norm}, as its modules.json says)"

    def for_task(self, task: Task | None) -> FolderModel:
        """This folder run as ``task`` (``None`` keeps the detected one); an
        :class:`InputError` when the folder cannot do it."""
        if task is None or task == self.task:
            return self
        if self.layout == "onnx":
            if task == "generate":
                raise InputError(
                    f"{self.folder}: an ONNX folder does not generate text; the generate task "
                    "takes a causal-LM folder (config.json with *ForCausalLM and its weights)"
                )
            return replace(self, task=task)
        where = f"{self.folder} is a {self.describe()}"
        if self.image == "two-tower" and task in ("embed", "classify"):
            return replace(self, task=task)  # classify: zero-shot, over the given labels
        if self.task == "classify" and task == "score":
            raise InputError(
                f"{where}: the score task takes a one-label classifier (a cross-encoder), "
                f"this one has {len(self.labels)} labels; use --task classify"
            )
        if self.task == "score" and task == "classify" and len(self.labels) < 2:
            raise InputError(
                f"{where}: it has one label, so it scores pairs; classify needs two or more "
                "labels; use --task score"
            )
        if self.task == "score" and task == "classify":
            return replace(self, task=task)
        raise InputError(f"{where}: it does {self.task}, not {task}")


def read_json_object(path: Path, folder: Path) -> dict[str, object]:
    """``path`` (a JSON file of ``folder``) as a mapping; one ``InputError`` line naming the
    folder when it is unreadable, not JSON, or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"{folder}: cannot read {path.name}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise InputError(f"{folder}: {path.name} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InputError(f"{folder}: {path.name} must hold a JSON object")
    return data


def _read_json_list(path: Path, folder: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"{folder}: {path.name} is not readable JSON ({exc})") from None
    if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
        raise InputError(f"{folder}: {path.name} must be a list of module objects")
    return data


def _labels(config: dict[str, object], folder: Path) -> tuple[str, ...]:
    id2label = config.get("id2label")
    if isinstance(id2label, dict) and id2label:
        try:
            by_id = {int(k): str(v) for k, v in id2label.items()}
        except (TypeError, ValueError):
            raise InputError(
                f"{folder}: config.json id2label keys must be integer ids, got {list(id2label)}"
            ) from None
        if sorted(by_id) != list(range(len(by_id))):
            raise InputError(f"{folder}: config.json id2label ids must be 0..{len(by_id) - 1}")
        return tuple(by_id[i] for i in range(len(by_id)))
    count = config.get("num_labels")
    if isinstance(count, int) and count >= 1:
        return tuple(f"LABEL_{i}" for i in range(count))
    return ("LABEL_0", "LABEL_1")  # transformers' default for a sequence classifier


def _weights(folder: Path) -> Path | None:
    return next((folder / n for n in _WEIGHTS if (folder / n).is_file()), None)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _max_length(folder: Path, config: dict[str, object], st_length: int | None) -> int | None:
    """sentence-transformers' ``max_seq_length``, else the tokenizer config's
    ``model_max_length`` when sane, else the position table's size."""
    if st_length is not None:
        return st_length
    tok_config = folder / "tokenizer_config.json"
    if tok_config.is_file():
        try:
            value = json.loads(tok_config.read_text(encoding="utf-8")).get("model_max_length")
        except (OSError, ValueError, AttributeError):
            value = None
        if _int(value) is not None and value <= 1_000_000:
            return int(value)
    return _int(config.get("max_position_embeddings"))


def _st_modules(folder: Path) -> list[tuple[str, Path]]:
    """``modules.json`` as (module kind, its folder), the kind being the class name."""
    modules = _read_json_list(folder / "modules.json", folder)
    out = []
    for m in sorted(modules, key=lambda m: int(m.get("idx", 0))):
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        out.append((kind, folder / str(m.get("path", ""))))
    return out


def _pooling(path: Path, folder: Path) -> TokenPooling:
    config = (
        read_json_object(path / "config.json", folder) if (path / "config.json").is_file() else {}
    )
    mode = config.get("pooling_mode")
    if mode is None:  # the older layout: one boolean per mode
        on = [k for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
        names = {
            "pooling_mode_mean_tokens": "mean",
            "pooling_mode_cls_token": "cls",
            "pooling_mode_lasttoken": "lasttoken",
        }
        mode = [names.get(k, k.removeprefix("pooling_mode_")) for k in on] or "mean"
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if mode in ("mean", "cls", "lasttoken"):
        return mode
    raise InputError(
        f"{folder}: the sentence-transformers Pooling module uses {mode!r} pooling; "
        "supported: mean, cls, lasttoken"
    )


def _dense(path: Path, folder: Path) -> DenseModule:
    config = read_json_object(path / "config.json", folder)
    name = str(config.get("activation_function", "torch.nn.modules.activation.Tanh"))
    activation = _ACTIVATIONS.get(name.rsplit(".", 1)[-1])
    ins, outs = _int(config.get("in_features")), _int(config.get("out_features"))
    if activation is None or ins is None or outs is None:
        raise InputError(
            f"{folder}: Dense module {path.name} has activation {name!r}, in_features "
            f"{config.get('in_features')!r}, out_features {config.get('out_features')!r}; "
            f"supported activations: {', '.join(_ACTIVATIONS)}"
        )
    if _weights(path) is None:
        raise InputError(f"{folder}: Dense module {path.name} has no weights file")
    return DenseModule(path, ins, outs, bool(config.get("bias", True)), activation)  # type: ignore[arg-type]


def _is_cross_encoder(folder: Path, config: dict[str, object]) -> bool:
    st_config = folder / "config_sentence_transformers.json"
    if (
        st_config.is_file()
        and read_json_object(st_config, folder).get("model_type") == "CrossEncoder"
    ):
        return True
    return isinstance(config.get("sentence_transformers"), dict)


def _score_activation(folder: Path, config: dict[str, object]) -> Literal["sigmoid", "identity"]:
    name: object = None
    st_config = folder / "config_sentence_transformers.json"
    if st_config.is_file():
        name = read_json_object(st_config, folder).get("activation_fn")
    block = config.get("sentence_transformers")
    if name is None and isinstance(block, dict):
        name = block.get("activation_fn")
    short = str(name or "Sigmoid").rsplit(".", 1)[-1]
    if short in ("Sigmoid", "Identity"):
        return "sigmoid" if short == "Sigmoid" else "identity"
    raise InputError(
        f"{folder}: the cross-encoder's activation {name!r} is not supported; "
        "supported: Sigmoid, Identity"
    )


def detect_folder(folder: Path) -> FolderModel:
    """Read ``folder`` (JSON files only) and say what it is; see the module docstring."""
    if not folder.is_dir():
        raise InputError(f"{folder}: no such model file or folder")
    tokenizer = folder / "tokenizer.json"
    tok = tokenizer if tokenizer.is_file() else None
    # a model.onnx of its own, or one exported beside the weights (the hub's onnx/ folder)
    onnx_file = next(
        (p for p in (folder / "model.onnx", folder / "onnx" / "model.onnx") if p.is_file()), None
    )
    config_path = folder / "config.json"
    config = read_json_object(config_path, folder) if config_path.is_file() else None
    if (
        onnx_file is not None
        and config is not None
        and _architecture(config).endswith(_GENERATE_SUFFIXES)
    ):
        if _weights(folder) is None:
            raise InputError(
                f"{folder}: a causal LM as ONNX ({onnx_file.name}, {_architecture(config)}) is "
                "not supported; the generate task takes the model's safetensors folder"
            )
        onnx_file = None  # the weights beside it generate, as any causal-LM folder
    if onnx_file is not None:
        return _onnx_folder(folder, onnx_file, config, tok)

    model_folder = folder
    st_length: int | None = None
    modules: list[tuple[str, Path]] = []
    if (folder / "modules.json").is_file():
        modules = _st_modules(folder)
        transformer = next((p for kind, p in modules if kind == "Transformer"), None)
        if transformer is None:
            kinds = ", ".join(k for k, _ in modules) or "none"
            raise InputError(
                f"{folder}: a sentence-transformers folder without a Transformer module "
                f"(modules: {kinds}); supported: Transformer, Pooling, Dense, Normalize"
            )
        model_folder = transformer
        if tok is None and (model_folder / "tokenizer.json").is_file():
            tok = model_folder / "tokenizer.json"  # the older layout keeps it with the weights
        bert_config = model_folder / "sentence_bert_config.json"
        if bert_config.is_file():
            st_length = _int(read_json_object(bert_config, folder).get("max_seq_length"))
        config_path = model_folder / "config.json"
        config = read_json_object(config_path, folder) if config_path.is_file() else None
    if config is None:
        ggufs = sorted(p.name for p in folder.glob("*.gguf"))
        if ggufs:
            found = f"{folder}: GGUF model(s) ({', '.join(ggufs[:3])}) without config.json"
            raise InputError(gguf_refusal(found))
        raise InputError(
            f"{folder}: not a Hugging Face model folder (no config.json); supported: {_SUPPORTED}"
        )
    arch = _architecture(config)
    model_type = str(config.get("model_type", ""))
    if not arch and not model_type:
        raise InputError(
            f"{folder}: config.json names no architecture and no model_type; "
            f"supported: {_SUPPORTED}"
        )
    decoder = model_type in _DECODER_TYPES or arch.endswith(_GENERATE_SUFFIXES)
    if (model_folder / "preprocessor_config.json").is_file():
        image = _image_folder(folder, config, arch, model_type, tok)
        if image is not None:
            return image
    base = FolderModel(
        folder,
        None,
        "transformers",
        architecture=arch,
        model_type=model_type,
        model_folder=model_folder if model_folder != folder else None,
        max_seq_length=_max_length(model_folder, config, st_length),
        weights=_weights(model_folder),
        tokenizer=tok,
        decoder=decoder,
    )
    if arch.endswith(_GENERATE_SUFFIXES) and not modules:
        return replace(base, task="generate")
    if base.weights is None:
        raise InputError(
            f"{folder}: {arch or model_type} folder without weights (looked for "
            f"{', '.join(_WEIGHTS)} in {model_folder})"
        )
    if tok is None:
        raise InputError(
            f"{folder}: no tokenizer.json; save the fast tokenizer beside the model "
            "(AutoTokenizer.from_pretrained(...).save_pretrained(folder))"
        )
    if _is_cross_encoder(folder, config) or arch.endswith("ForSequenceClassification"):
        if not arch.endswith("ForSequenceClassification"):
            raise InputError(
                f"{folder}: a cross-encoder needs a *ForSequenceClassification config, "
                f"found {arch or model_type!r}"
            )
        labels = _labels(config, folder)
        layout: Layout = "cross-encoder" if _is_cross_encoder(folder, config) else "transformers"
        if len(labels) == 1:
            return replace(
                base,
                task="score",
                layout=layout,
                labels=labels,
                activation=_score_activation(folder, config),
            )
        return replace(base, task="classify", layout=layout, labels=labels)
    if modules:
        return _sentence_transformers(base, modules)
    if arch.endswith("Model") or (not arch and model_type):
        return replace(base, task="embed", pooling="mean", normalize=True, assumed=True)
    raise InputError(f"{folder}: architecture {arch!r} is not supported; supported: {_SUPPORTED}")


def _image_folder(
    folder: Path, config: dict[str, object], arch: str, model_type: str, tok: Path | None
) -> FolderModel | None:
    """An image model folder (weights and ``preprocessor_config.json``), or ``None`` when the
    architecture is none of the image families (a text model that ships one too)."""
    kind: ImageKind
    if arch.endswith("ForImageClassification"):
        kind = "classifier"
    elif arch in _TWO_TOWERS or (not arch and model_type in _TWO_TOWERS.values()):
        kind = "two-tower"
    elif arch in _IMAGE_ENCODERS or (not arch and model_type in _IMAGE_ENCODERS.values()):
        kind = "encoder"
    else:
        return None
    weights = _weights(folder)
    if weights is None:
        raise InputError(
            f"{folder}: {arch or model_type} folder without weights (looked for "
            f"{', '.join(_WEIGHTS)})"
        )
    found = FolderModel(
        folder,
        None,
        "image",
        architecture=arch,
        model_type=model_type,
        weights=weights,
        tokenizer=tok if kind == "two-tower" else None,
        image=kind,
        preprocessor=folder / "preprocessor_config.json",
    )
    if kind == "classifier":
        return replace(found, task="classify", labels=_labels(config, folder))
    if kind == "two-tower":
        return replace(found, task="embed", normalize=True)
    if (folder / "modules.json").is_file():  # a sentence-transformers layout says how it pools
        modules = _st_modules(folder)
        if any(kind == "Dense" for kind, _ in modules):
            raise InputError(
                f"{folder}: a Dense module after an image encoder's pooling is not supported; "
                "supported: Transformer, Pooling, Normalize"
            )
        st = _sentence_transformers(found, modules)
        return replace(found, task="embed", pooling=st.pooling, normalize=st.normalize)
    return replace(found, task="embed", pooling="cls", normalize=True, assumed=True)


def _onnx_folder(
    folder: Path, onnx_file: Path, config: dict[str, object] | None, tok: Path | None
) -> FolderModel:
    """A folder with its own ONNX graph: the task from ``config.json`` when it names a
    sequence classifier (else the graph decides at load time); a sentence-transformers
    layout beside it gives its pooling and normalization."""
    found = FolderModel(folder, None, "onnx", onnx_file=onnx_file, tokenizer=tok)
    if config is not None and _architecture(config).endswith("ForSequenceClassification"):
        labels = _labels(config, folder)
        return replace(found, task="score" if len(labels) == 1 else "classify", labels=labels)
    if (folder / "modules.json").is_file():
        st = _sentence_transformers(found, _st_modules(folder))
        length = folder / "sentence_bert_config.json"
        max_length = (
            _int(read_json_object(length, folder).get("max_seq_length"))
            if length.is_file()
            else None
        )
        return replace(st, layout="onnx", max_seq_length=max_length)
    return found


def _architecture(config: dict[str, object]) -> str:
    archs = config.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    return ""


def _sentence_transformers(base: FolderModel, modules: list[tuple[str, Path]]) -> FolderModel:
    folder = base.folder
    pooling: TokenPooling | None = None
    dense: list[DenseModule] = []
    normalize = False
    for kind, path in modules:
        if kind == "Transformer":
            continue
        if kind == "Pooling" and pooling is None and not dense:
            pooling = _pooling(path, folder)
        elif kind == "Dense" and pooling is not None:
            dense.append(_dense(path, folder))
        elif kind == "Normalize" and pooling is not None:
            normalize = True
        else:
            raise InputError(
                f"{folder}: sentence-transformers module {kind!r} ({path.name or 'root'}) is "
                "not supported here; supported: Transformer, Pooling, Dense, Normalize in "
                "that order"
            )
    if pooling is None:
        raise InputError(f"{folder}: a sentence-transformers folder without a Pooling module")
    return replace(
        base,
        task="embed",
        layout="sentence-transformers",
        pooling=pooling,
        normalize=normalize,
        dense=tuple(dense),
    )
