"""An encoder folder (BERT, RoBERTa, XLM-RoBERTa, DistilBERT, MPNet, ModernBERT, ...) to one
self-contained ONNX file that ONNX Runtime runs; torch and transformers are needed for the
conversion only, never to run the result.

:func:`export_encoder` loads the folder with transformers (fp32, eager attention: one plain
graph of matmuls and softmax that the exporter traces the same way for every architecture),
traces it with torch's TorchScript-based exporter (``torch.onnx.export(..., dynamo=False)``,
opset 17: fused ``LayerNormalization``), checks the graph against the model on a padded probe
batch of another shape than the traced one (a shape baked into the graph, or a mask that does not
reach it, shows there), and writes the file whole or not at all.

Which exporter (benchmarks/hf_export.md has the figures and the command to reproduce them):

- torch's legacy exporter: every architecture above exports, max abs diff vs transformers
  ≤ 2e-6; BERT tiny converts in 1.3 s, a MiniLM-L6-shaped BERT in 5.2 s (load and check included);
- torch's dynamo exporter (``dynamo=True``, needs ``onnxscript``): the same diffs, but ×6.5-20
  the conversion time, a larger file for tiny models, and ONNX Runtime no faster (×0.75-1.15,
  within the noise of a shared machine);
- optimum-onnx (0.1.0, its only release): it pins ``transformers<4.58`` and would downgrade the
  ``transformers`` 5 that generation needs, so it was not installed.

Example::

    export_encoder(Path("bge-small/"), head="hidden", target=Path("cache/bge-small.onnx"))
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import numpy as np

from batchline._cache import write_whole
from batchline._commands import install_command
from batchline._errors import ModelError
from batchline._fsio import checkpoint

__all__ = [
    "MAX_INLINE_BYTES",
    "OPSET",
    "Head",
    "export_encoder",
    "require_torch",
]

#: The ONNX opset written: ONNX Runtime 1.18 and later run it; 17 brings LayerNormalization.
OPSET = 17
#: Weights above this many bytes go to ``<target>.data`` beside the graph (protobuf's 2 GiB
#: limit on one message, less room for the graph itself).
MAX_INLINE_BYTES = 2**31 - 2**26
#: How far the exported graph may stray from transformers on the probe batch, relative to the
#: largest output (fp32 differences are ~1e-6; a wrong mask or a baked shape gives ~1).
_TOLERANCE = 1e-3

Head = Literal["hidden", "logits"]
_OUTPUTS: dict[str, str] = {"hidden": "last_hidden_state", "logits": "logits"}


def require_torch(what: str) -> tuple[ModuleType, ModuleType]:
    """``(torch, transformers)``, or a ``ModelError`` saying that ``what`` needs them and the
    exact install."""
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise ModelError(
            f"{what} needs torch and transformers ({exc.name} is missing): "
            f"{install_command('generate')} "
            "(the pin is torch's CPU wheel; on a GPU, your CUDA build)"
        ) from exc
    return torch, transformers


def export_encoder(folder: Path, *, head: Literal["hidden", "logits"], target: Path) -> None:
    """Convert the Hugging Face encoder in ``folder`` to one ONNX file at ``target``.

    Inputs ``input_ids`` and ``attention_mask`` (int64, ``(batch, sequence)``), plus
    ``token_type_ids`` where the model takes them and has more than one type (BERT: sentence
    pairs); output ``last_hidden_state`` ``(batch, sequence, hidden)`` for ``head="hidden"``
    (``AutoModel``) or ``logits`` ``(batch, num_labels)`` for ``head="logits"``
    (``AutoModelForSequenceClassification``), float32, both axes dynamic. The weights are inside
    the file; only above ~2 GB do they go to one file ``<target name>.data`` beside it, which is
    moved into place before the graph, so a ``target`` that exists is whole.

    Raises ``ModelError`` when torch or transformers is missing (with the install), when the
    folder cannot be loaded as that head (a ``logits`` export of a folder without a trained
    classifier), or when the export does not reproduce the model (naming the architecture).

    Example::

        export_encoder(Path("ms-marco-MiniLM/"), head="logits", target=Path("reranker.onnx"))
    """
    if head not in _OUTPUTS:
        raise ValueError(f"head must be hidden or logits, got {head!r}")
    folder, target = Path(folder), Path(target)
    arch = _architecture(folder)
    if arch not in TORCH_EXPORTED and not _importable("torch", "transformers"):
        raise ModelError(
            f"{folder}: model_type {arch!r} is none batchline converts without torch (bert) or "
            f"has converted with it ({', '.join(sorted(TORCH_EXPORTED - {'bert'}))}); "
            f"transformers may know it, with torch: {install_command('generate')}"
        )
    torch, transformers = require_torch(f"converting {folder} ({arch}) to ONNX")
    _check_known(folder, arch, transformers)
    model = _load(folder, head, arch, torch, transformers)
    names = ["input_ids", "attention_mask"]
    if _takes_token_types(model):
        names.append("token_type_ids")
    output = _OUTPUTS[head]
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{target.name}.", dir=target.parent) as tmp:
            traced = Path(tmp) / "traced" / "model.onnx"
            traced.parent.mkdir()
            _trace(torch, model, names, output, traced, arch)
            _finish(torch, model, names, output, traced, target, arch=arch, head=head)
    except OSError as exc:
        raise ModelError(f"cannot write the converted model {target}: {exc}") from exc


#: The model types converted and checked against transformers (``benchmarks/hf_export.md``).
TORCH_EXPORTED = frozenset({"bert", "roberta", "xlm-roberta", "distilbert", "mpnet", "modernbert"})


def _importable(*modules: str) -> bool:
    import importlib.util

    try:
        return all(importlib.util.find_spec(m) is not None for m in modules)
    except (ImportError, ValueError):  # blocked, or half-installed
        return False


def _check_known(folder: Path, model_type: str, transformers: ModuleType) -> None:
    """Refuse, in one line, a model type this transformers does not know (its own error is a
    paragraph of advice to upgrade it)."""
    known = transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES
    if model_type not in known:
        raise ModelError(
            f"{folder}: transformers {transformers.__version__} does not know model_type "
            f"{model_type!r}, so batchline cannot convert it; a folder of a known type, or the "
            "model exported to ONNX (--model PATH.onnx), runs"
        )


def _architecture(folder: Path) -> str:
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {path}: {exc}") from exc
    archs = config.get("architectures") or []
    return str(config.get("model_type") or (archs[0] if archs else "unknown architecture"))


def _load(folder: Path, head: Head, arch: str, torch: ModuleType, transformers: ModuleType) -> Any:
    auto = (
        transformers.AutoModel
        if head == "hidden"
        else transformers.AutoModelForSequenceClassification
    )
    from batchline.models.common.torch_weights import from_pretrained_quietly

    try:
        model, info = from_pretrained_quietly(
            auto, folder, dtype=torch.float32, attn_implementation="eager"
        )
    except (OSError, ValueError, KeyError, RuntimeError) as exc:  # RuntimeError: shapes
        kind = "an encoder" if head == "hidden" else "a sequence classifier"
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise ModelError(f"cannot load {folder} ({arch}) as {kind}: {first.strip()}") from exc
    # An unused pooler is harmless (last_hidden_state does not go through it); any other weight
    # left at its random initialisation (a classifier the folder does not hold) is not.
    missing = [k for k in info.get("missing_keys", ()) if not k.startswith("pooler.")]
    if missing:
        shown = ", ".join(sorted(missing)[:4]) + (", ..." if len(missing) > 4 else "")
        what = "a trained sequence classifier" if head == "logits" else "all encoder weights"
        raise ModelError(
            f"{folder} ({arch}) does not hold {what}: {len(missing)} weight(s) missing "
            f"({shown}); converting it would run random weights"
        )
    return model.eval()


def _takes_token_types(model: Any) -> bool:
    """BERT-like models with more than one token type (a cross-encoder's pairs need them);
    RoBERTa's single type, DistilBERT, MPNet and ModernBERT have none to feed."""
    takes = "token_type_ids" in inspect.signature(model.forward).parameters
    return takes and int(getattr(model.config, "type_vocab_size", 0) or 0) > 1


def _wrap(torch: Any, model: Any, output: str) -> Any:
    class Encoder(torch.nn.Module):  # type: ignore[misc]
        """The model with positional inputs and its one output, as the exporter traces it."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any = None) -> Any:
            kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
            if token_type_ids is not None:
                kwargs["token_type_ids"] = token_type_ids
            return getattr(self.model(**kwargs), output)

    return Encoder().eval()


def _probe(model: Any, names: list[str], lengths: list[int], seed: int) -> dict[str, Any]:
    """A right-padded batch with one row per length: ids away from the special ones, the pad id
    in the padding, token types 1 in a row's second half (a pair)."""
    config = model.config
    vocab = int(config.vocab_size)
    rng = np.random.default_rng(seed)
    width = max(lengths)
    ids = rng.integers(min(5, vocab - 1), vocab, size=(len(lengths), width), dtype=np.int64)
    mask = (np.arange(width)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    pad = getattr(config, "pad_token_id", None)
    ids[mask == 0] = pad if isinstance(pad, int) and 0 <= pad < vocab else 0
    feeds = {"input_ids": ids, "attention_mask": mask}
    if "token_type_ids" in names:
        types = (np.arange(width)[None, :] >= np.array(lengths)[:, None] // 2).astype(np.int64)
        feeds["token_type_ids"] = types * mask
    return feeds


def _trace(
    torch: ModuleType, model: Any, names: list[str], output: str, path: Path, arch: str
) -> None:
    feeds = _probe(model, names, [8, 5], seed=0)
    args = tuple(torch.from_numpy(feeds[n]) for n in names)
    axes = {n: {0: "batch", 1: "sequence"} for n in names}
    axes[output] = {0: "batch", 1: "sequence"} if output == "last_hidden_state" else {0: "batch"}
    try:
        with warnings.catch_warnings(), torch.no_grad():
            # tracer warnings (a Python branch on a shape...): the probe check below decides
            warnings.simplefilter("ignore")
            torch.onnx.export(
                _wrap(torch, model, output),
                args,
                str(path),
                input_names=names,
                output_names=[output],
                dynamic_axes=axes,
                opset_version=OPSET,
                dynamo=False,
            )
    except Exception as exc:  # the exporter raises many kinds; all mean "cannot convert"
        raise ModelError(
            f"{arch} cannot be exported to ONNX by torch {torch.__version__}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from exc


def _finish(
    torch: ModuleType,
    model: Any,
    names: list[str],
    output: str,
    traced: Path,
    target: Path,
    *,
    arch: str,
    head: str,
) -> None:
    import onnx

    proto = onnx.load(str(traced))  # with any external data the exporter wrote beside it
    for key, value in (("batchline.architecture", arch), ("batchline.head", head)):
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    weights = sum(len(t.raw_data) for t in proto.graph.initializer)
    if weights <= MAX_INLINE_BYTES:
        data = proto.SerializeToString()
        _check(torch, model, names, output, data, arch)
        write_whole(target, data, "cache.hf")
        return
    staged = traced.parent.parent / target.name
    data_name = f"{target.name}.data"
    onnx.save_model(
        proto,
        str(staged),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data_name,
        size_threshold=1024,
    )
    _check(torch, model, names, output, str(staged), arch)
    for path in (staged.parent / data_name, staged):
        with path.open("rb") as f:
            checkpoint("cache.hf", "fsync", path)
            os.fsync(f.fileno())
    # the weights first: a graph in place always finds its weights
    checkpoint("cache.hf", "rename", target)
    os.replace(staged.parent / data_name, target.parent / data_name)
    os.replace(staged, target)


def _check(
    torch: ModuleType, model: Any, names: list[str], output: str, graph: bytes | str, arch: str
) -> None:
    """Run the graph and the model on a padded batch of another shape than the traced one."""
    import onnxruntime as ort

    feeds = _probe(model, names, [13, 7, 2], seed=1)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
    got = session.run([output], feeds)[0]
    with torch.no_grad():
        tensors = {n: torch.from_numpy(feeds[n]) for n in names}
        want = getattr(model(**tensors), output).numpy()
    if got.shape != want.shape:
        raise ModelError(
            f"the ONNX export of {arch} gives {output} of shape {list(got.shape)} where "
            f"transformers gives {list(want.shape)}: this architecture cannot be converted"
        )
    real = feeds["attention_mask"].astype(bool) if output == "last_hidden_state" else ...
    diff = float(np.abs(got - want)[real].max())
    scale = max(1.0, float(np.abs(want[real]).max()))
    if not diff <= _TOLERANCE * scale:
        raise ModelError(
            f"the ONNX export of {arch} differs from transformers by {diff:.3g} (largest output "
            f"{scale:.3g}) on a padded probe batch: this architecture cannot be converted "
            "correctly; export it yourself to model.onnx in the folder"
        )
