"""A BERT encoder built to ONNX from its safetensors checkpoint, without torch.

:func:`build_bert` writes the graph with ``onnx.helper``: embeddings, post-LayerNorm
self-attention layers with erf GELU, then one of three tops:

- ``pooling="mean"`` or ``"cls"``: one vector per text, output ``sentence_embedding``
  ``(batch, hidden)``, L2-normalised when ``normalize`` (sentence-transformers' clamps);
- ``pooling="none"``: the token vectors, output ``last_hidden_state`` ``(batch, seq, hidden)``;
- ``head="classifier"``: BERT's pooler (dense + tanh on the first token) and the classifier
  linear, output ``logits`` ``(batch, num_labels)``.

Inputs are ``input_ids`` and ``attention_mask`` (int64, ``(batch, seq)``), plus
``token_type_ids`` when ``token_types`` (text pairs); without it every token has type 0, and
that row is folded into the word table. Batch and sequence axes are dynamic.
:func:`bert_covers` says whether a folder's ``config.json`` is one this builder writes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from batchline._errors import ModelError
from batchline._types import Array

__all__ = ["BUILDER_VERSION", "OPSET", "bert_covers", "build_bert"]

# Bump when a graph changes: it is part of every built model's cache key.
BUILDER_VERSION = 2
OPSET = 17  # LayerNormalization is an ONNX op from 17; ONNX Runtime 1.31 runs it natively.


def bert_covers(config: Mapping[str, object]) -> bool:
    """Whether :func:`build_bert` writes this ``config.json``'s model: BERT with erf GELU and
    absolute positions."""
    return (
        config.get("model_type") == "bert"
        and config.get("hidden_act", "gelu") == "gelu"
        and config.get("position_embedding_type", "absolute") == "absolute"
    )


class _Graph:
    """A small helper that names nodes and collects nodes and initializers; ``w`` holds the
    checkpoint's tensors by key, ``eps`` is the LayerNorm epsilon."""

    def __init__(self, w: dict[str, Array], eps: float) -> None:
        self.w = w
        self.eps = eps
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def const(self, name: str, value: Array) -> str:
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


def build_bert(
    folder: Path,
    *,
    weights: Path | None = None,
    pooling: Literal["mean", "cls", "none"] = "mean",
    normalize: bool = True,
    head: Literal["none", "classifier"] = "none",
    token_types: bool = False,
    graph_name: str = "bert",
) -> onnx.ModelProto:
    """Build the graph of the BERT checkpoint in ``folder`` (``config.json`` and
    ``model.safetensors``, or ``weights``); see the module docstring for the options.
    ``ModelError`` when the checkpoint is not one this builder covers."""
    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    path = weights if weights is not None else folder / "model.safetensors"
    w = load_file(str(path))
    # Checkpoints of a model with a head prefix the encoder's keys with "bert."; accept both.
    if any(k.startswith("bert.") for k in w):
        w = {k.removeprefix("bert."): v for k, v in w.items()}
    needed = "embeddings.word_embeddings.weight"
    if needed not in w:
        raise ModelError(f"{path} does not look like a BERT checkpoint (no '{needed}')")
    if config.get("hidden_act", "gelu") != "gelu":
        raise ModelError(f"unsupported activation {config['hidden_act']!r}; expected 'gelu'")
    if head == "classifier" and not {"pooler.dense.weight", "classifier.weight"} <= set(w):
        raise ModelError(
            f"{path} has no BERT pooler and classifier weights (pooler.dense, classifier): "
            "not a BertForSequenceClassification checkpoint"
        )

    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    layers = int(config["num_hidden_layers"])
    eps = float(config.get("layer_norm_eps", 1e-12))
    head_dim = hidden // heads

    g = _Graph(w, eps)
    f32 = np.float32
    one_f = g.const("one_f", np.array(1.0, dtype=f32))
    half_f = g.const("half_f", np.array(0.5, dtype=f32))
    axes_1 = g.const("axes_1", np.array([1], dtype=np.int64))

    # Tables first, then ops: the initializer and node order of the graph this builder has
    # always written for all-MiniLM-L6-v2 (its cache file stays byte-identical).
    types = w["embeddings.token_type_embeddings.weight"]
    if token_types:  # (word + type) + position, the order BERT adds them in
        word_t = g.const("word_embeddings", w["embeddings.word_embeddings.weight"])
        type_t = g.const("token_type_embeddings", types)
    else:  # every token has type 0: that row is folded into the word table
        word = w["embeddings.word_embeddings.weight"] + types[0]
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
    words = g.op("Gather", [word_t, "input_ids"])
    if token_types:
        words = g.op("Add", [words, g.op("Gather", [type_t, "token_type_ids"])])
    x = g.op("Add", [words, g.op("Gather", [pos_t, positions])])
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

    if head == "classifier":
        first = g.op("Gather", [x, g.const("idx_0", np.array(0, dtype=np.int64))], axis=1)
        pooled = g.op("Tanh", [g.linear(first, "pooler.dense", "pooler")])
        top, name = g.linear(pooled, "classifier", "classifier"), "logits"
        shape: list[str | int] = ["batch", int(w["classifier.weight"].shape[0])]
    elif pooling == "none":
        top, name, shape = x, "last_hidden_state", ["batch", "sequence", hidden]
    else:
        if pooling == "cls":
            top = g.op("Gather", [x, g.const("idx_0", np.array(0, dtype=np.int64))], axis=1)
        else:  # mean over real tokens
            m = g.op("Unsqueeze", [mask_f, g.const("axes_m1", np.array([-1], dtype=np.int64))])
            summed = g.op("ReduceSum", [g.op("Mul", [x, m]), axes_1], keepdims=0)
            count = g.op(
                "Max",
                [
                    g.op("ReduceSum", [m, axes_1], keepdims=0),
                    g.const("min_count", np.array(1e-9, dtype=f32)),
                ],
            )
            top = g.op("Div", [summed, count])
        if normalize:
            norm = g.op("ReduceL2", [top], axes=[1], keepdims=1)
            norm = g.op("Max", [norm, g.const("min_norm", np.array(1e-12, dtype=f32))])
            top = g.op("Div", [top, norm])
        name, shape = "sentence_embedding", ["batch", hidden]
    g.nodes.append(helper.make_node("Identity", [top], [name], name="output"))

    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"]),
    ]
    if token_types:
        inputs.append(
            helper.make_tensor_value_info(
                "token_type_ids", TensorProto.INT64, ["batch", "sequence"]
            )
        )
    graph = helper.make_graph(
        g.nodes,
        graph_name,
        inputs=inputs,
        outputs=[helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)],
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
