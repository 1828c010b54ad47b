"""Issue 55's search for a faster embedding path than the bf16 one, kept as ratios.

Every path embeds the same length-sorted batches (<= 512 padded tokens, one thread, one
batch at a time) of the first ``--texts`` demo-corpus texts with the built-in MiniLM; the
paths take turns batch by batch for ``--rounds`` rounds (so that another process's load
hits each alike) and each keeps its best round. Printed per path: records/s of the model
calls, the ratio to the bf16 path as ``batchline run`` loads it today, and its vectors
against ONNX Runtime fp32 (mean cosine, top-10 neighbour overlap: the ``auto`` gate is
0.999 / 0.95). Read a ratio as a gain only past ``bf16-twin``'s (the control): on a shared
machine two copies of one path read up to ×1.2 apart (docs/precision.md has the figures).

Paths:

- ``ort-fp32``: ONNX Runtime fp32 (the reference vectors);
- ``bf16``: torch bf16 as ``batchline run`` loads it: the lean BERT forward
  (``models/hf/lean_encoder.py``);
- ``bf16-twin``: a second copy of ``bf16``, loaded the same way: the control (how far two
  equal paths differ in this run is the noise);
- ``bf16-hf``: transformers' ``BertModel`` forward in bf16, linear weights packed for oneDNN
  (the bf16 path before the lean forward);
- ``bf16-pack512``: ``bf16-hf`` with the weights packed for 512-row products (it packs for 16:
  a decode step's);
- ``bf16-eager-attn``: ``bf16-hf`` with transformers' plain attention instead of SDPA;
- ``bf16-compiled``: transformers' model in bf16 through ``torch.compile`` (inductor, CPU,
  frozen weights, dynamic shapes); its compile time is printed;
- ``int8-<variant>``: ONNX Runtime dynamic int8 with some MatMuls left in fp32
  (``all``: none left; ``ffn``: only the FFN's two MatMuls quantized; ``ffn-up``: only the
  up-projection; ``no-last``: all but the last layer's; ``no-attn-out``: all but the attention
  output projections).

A path may name its batch budget in padded tokens: ``bf16@1024`` (default 512, the job's).

Run::

    PYTHONPATH=src python benchmarks/bench_precision_paths.py            # 512 texts, 3 rounds
    PYTHONPATH=src python benchmarks/bench_precision_paths.py --texts 2000 --rounds 5  # full
    PYTHONPATH=src python benchmarks/bench_precision_paths.py --texts 64 --rounds 1 \
        --paths ort-fp32,bf16                                            # smoke
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

INT8_VARIANTS = ("all", "ffn", "ffn-up", "no-last", "no-attn-out")


def _batches(lengths: Sequence[int], budget: int = 512) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = [[]]
    for i in order:
        if groups[-1] and (len(groups[-1]) + 1) * lengths[i] > budget:
            groups.append([])
        groups[-1].append(i)
    return groups


def _matmul_names(graph: Path) -> dict[str, str]:
    """Each MatMul node's name and its weight's (an initializer; "" for activation products)."""
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    weights = {t.name for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type == "MatMul":
            out[node.name] = next((i for i in node.input if i in weights), "")
    return out


def _excluded(names: dict[str, str], variant: str) -> list[str]:
    """The MatMul nodes a variant leaves in fp32 (the built-in graph names its weights
    ``encoder.layer.N.{q,k,v,attn_out,ffn_in,ffn_out}.weight_t``)."""
    layers = [_layer(w) for w in names.values() if _layer(w) >= 0]
    last = max(layers, default=-1)

    def keep_fp32(weight: str) -> bool:
        if variant == "all":
            return False
        if not weight:  # an activation product (attention scores): never quantized here
            return True
        if variant == "ffn":
            return ".ffn_" not in weight
        if variant == "ffn-up":
            return ".ffn_in." not in weight
        if variant == "no-last":
            return _layer(weight) == last
        if variant == "no-attn-out":
            return ".attn_out." in weight
        raise ValueError(variant)

    return [n for n, w in names.items() if keep_fp32(w)]


def _layer(name: str) -> int:
    parts = name.split(".")
    for a, b in itertools.pairwise(parts):
        if a == "layer" and b.isdigit():
            return int(b)
    return -1


def _int8_session(source: Path, variant: str, folder: Path) -> Any:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out = folder / f"int8-{variant}.onnx"
    names = _matmul_names(source)
    excluded = _excluded(names, variant)
    quantize_dynamic(
        source,
        out,
        per_channel=True,
        weight_type=QuantType.QInt8,
        op_types_to_quantize=["MatMul"],
        nodes_to_exclude=excluded,
    )
    print(f"  int8-{variant}: {len(names) - len(excluded)} of {len(names)} MatMuls quantized")
    return _session(out)


def _session(graph: Path) -> Any:
    """One ONNX Runtime session of one thread that does not spin when idle: a spinning thread
    would take the core from the path that runs next (the paths take turns batch by batch)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--paths",
        default="ort-fp32,bf16,bf16-twin,bf16-hf,bf16-pack512,bf16-eager-attn,bf16@1024,"
        "bf16-compiled," + ",".join(f"int8-{v}" for v in INT8_VARIANTS),
    )
    args = parser.parse_args()
    paths = args.paths.split(",")

    import torch

    torch.set_num_threads(1)
    from batchline.jobs.quantized import gate_texts
    from batchline.models.config import Knobs
    from batchline.models.hf.torch_embed import load_torch_embedder
    from batchline.models.loader import load_model
    from batchline.models.onnx import compare_vectors, minilm
    from batchline.models.specs import parse_spec

    texts = gate_texts(args.texts)
    knobs = Knobs(sessions=1, intra_op_threads=1, batching=False)
    spec = parse_spec("default")
    tokens = load_model(spec, knobs.replace(precision="fp32")).prepare(texts)
    runners: dict[str, Callable[[list[Any]], np.ndarray]] = {}
    runners["ort-fp32"] = _ort_runner(_session(minilm.default_model_path()))

    def torch_model(**options: Any) -> Any:
        return load_torch_embedder(
            minilm.weights_dir(),
            name="bench",
            pooling="mean",
            normalize=True,
            max_length=minilm.MAX_LENGTH,
            knobs=knobs,
            **options,
        )

    names = {p.split("@")[0] for p in paths}
    if "bf16" in names:
        runners["bf16"] = torch_model(bf16=True).embed_tokens
    if "bf16-twin" in names:  # the control: a second copy of the bf16 path
        runners["bf16-twin"] = torch_model(bf16=True).embed_tokens
    if "bf16-hf" in names:
        runners["bf16-hf"] = torch_model(bf16=True, lean=False).embed_tokens
    if "bf16-pack512" in names:
        import batchline.models.common.packed_linear as packed_linear

        rows = packed_linear._PACK_ROWS
        packed_linear._PACK_ROWS = 512
        runners["bf16-pack512"] = torch_model(bf16=True, lean=False).embed_tokens
        packed_linear._PACK_ROWS = rows
    if "bf16-eager-attn" in names:
        eager = torch_model(bf16=True, lean=False)
        eager.model.set_attn_implementation("eager")
        runners["bf16-eager-attn"] = eager.embed_tokens
    if "bf16-compiled" in names:
        start = time.perf_counter()
        runners["bf16-compiled"] = _compiled(torch_model(bf16=False, lean=False), tokens)
        took = time.perf_counter() - start
        print(f"  bf16-compiled: load, compile, first calls {took:.1f} s")
    tmp = Path(tempfile.mkdtemp(prefix="bench-precision-"))
    source = minilm.default_model_path()
    for name in names:
        if name.startswith("int8-"):
            runners[name] = _ort_runner(_int8_session(source, name[5:], tmp))
    shutil.rmtree(tmp, ignore_errors=True)  # the sessions hold the int8 graphs now
    for path in paths:
        if path.split("@")[0] not in runners:
            raise SystemExit(f"unknown path {path!r}")

    speed: dict[str, float] = {}
    vectors: dict[str, np.ndarray] = {}
    reference = np.zeros((len(tokens), 384), dtype=np.float32)
    for group in _batches([len(t) for t in tokens]):
        reference[group] = runners["ort-fp32"]([tokens[i] for i in group])
    plans = {p: _batches([len(t) for t in tokens], int(p.partition("@")[2] or 512)) for p in paths}
    steps = max(len(g) for g in plans.values())
    for round_ in range(args.rounds):
        took = dict.fromkeys(paths, 0.0)
        outs = {p: np.zeros((len(tokens), 384), dtype=np.float32) for p in paths}
        # the paths take turns batch by batch (in a rotating order), so that a change in the
        # machine's load hits each of them alike
        for step in range(steps):
            turn = (step + round_) % len(paths)
            for path in paths[turn:] + paths[:turn]:
                if step >= len(plans[path]):
                    continue
                group = plans[path][step]
                batch = [tokens[i] for i in group]
                start = time.perf_counter()
                outs[path][group] = runners[path.partition("@")[0]](batch)
                took[path] += time.perf_counter() - start
        for path in paths:
            speed[path] = max(speed.get(path, 0.0), len(tokens) / took[path])
            vectors.setdefault(path, outs[path])
    host = os.getloadavg()[0]
    print(f"{len(tokens)} texts, {args.rounds} rounds, load average {host:.1f} at the end")
    base = speed.get("bf16", speed[paths[0]])
    print(f"{'path':<18}{'records/s':>10}{'x bf16':>8}{'cosine':>10}{'top-10':>8}")
    for path in paths:
        q = compare_vectors(reference, vectors[path])
        print(
            f"{path:<18}{speed[path]:>10.0f}{speed[path] / base:>8.2f}"
            f"{q.mean_cosine:>10.5f}{q.top10_overlap:>8.3f}"
        )


def _ort_runner(session: Any) -> Callable[[list[Any]], np.ndarray]:
    """A runner of ``session`` (an int8 graph of the built-in encoder, whose output is the
    pooled, normalized vector) on padded token batches."""
    from batchline.models.onnx.runtime import pad_sequences

    names = [i.name for i in session.get_inputs()]

    def run(batch: list[Any]) -> np.ndarray:
        ids, mask = pad_sequences([t.ids for t in batch], pad_value=0)
        feed = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        out = session.run(None, {k: v for k, v in feed.items() if k in names})[0]
        return np.asarray(out, dtype=np.float32)

    return run


def _compiled(embedder: Any, tokens: Sequence[Any]) -> Callable[[list[Any]], np.ndarray]:
    """``embedder`` (loaded in fp32, unpacked) in bf16 through inductor: frozen weights (it
    packs them for oneDNN itself), dynamic shapes; compiled on two batches first."""
    import torch

    model = embedder.model.to(torch.bfloat16)
    compiled = torch.compile(model.forward, dynamic=True, options={"freezing": True})

    class Compiled(torch.nn.Module):
        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return compiled(input_ids=input_ids, attention_mask=attention_mask)

    embedder.model = Compiled()
    embedder.embed_tokens(list(tokens[:4]))
    embedder.embed_tokens(list(tokens[-2:]))
    return embedder.embed_tokens  # type: ignore[no-any-return]


if __name__ == "__main__":
    main()
