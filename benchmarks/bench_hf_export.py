"""Which exporter turns an encoder folder into ONNX: torch's legacy (TorchScript) exporter, which
``batchline.models.hf.export`` uses, against torch's dynamo exporter (``dynamo=True``, needs
``onnxscript``); optimum-onnx is reported, not run, when it cannot be installed beside
transformers 5.

For each model (random weights, saved with ``save_pretrained``): conversion time (load + export,
seconds), max abs diff of ``last_hidden_state`` against transformers on a padded batch, the file
size, and ONNX Runtime's time for one batch (one intra-op thread, the median of ``--runs``
interleaved calls). Ratios are dynamo / legacy, measured in the same run.

    python benchmarks/bench_hf_export.py                          # tiny and small BERT, ModernBERT
    python benchmarks/bench_hf_export.py --models bert-tiny       # smoke run

Needs ``torch``, ``transformers`` and ``onnxruntime``; the dynamo column ``onnxscript``.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

# name -> (config class, options): "tiny" is the tests' size, "small" is MiniLM-L6's shape
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "bert-tiny": (
        "BertConfig",
        {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 64,
            "vocab_size": 1000,
        },
    ),
    "bert-small": (
        "BertConfig",
        {
            "hidden_size": 384,
            "num_hidden_layers": 6,
            "num_attention_heads": 12,
            "intermediate_size": 1536,
            "vocab_size": 8000,
        },
    ),
    "modernbert-tiny": (
        "ModernBertConfig",
        {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 64,
            "vocab_size": 1000,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "cls_token_id": 1,
            "sep_token_id": 2,
        },
    ),
}


def save(name: str, root: Path) -> Path:
    import torch
    import transformers

    config_class, options = MODELS[name]
    config = getattr(transformers, config_class)(**options)
    torch.manual_seed(0)
    folder = root / name
    transformers.AutoModel.from_config(config).save_pretrained(folder)
    return folder


def batch(vocab: int, rows: int, tokens: int) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(0)
    ids = rng.integers(5, vocab, size=(rows, tokens), dtype=np.int64)
    lengths = np.linspace(tokens, tokens // 4, rows).astype(int)
    mask = (np.arange(tokens)[None, :] < lengths[:, None]).astype(np.int64)
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


def legacy(folder: Path, target: Path) -> None:
    from batchline.models.hf.export import export_encoder

    export_encoder(folder, head="hidden", target=target)


def dynamo(folder: Path, target: Path) -> None:
    import torch
    import transformers

    model = transformers.AutoModel.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    names = ["input_ids", "attention_mask"]
    if getattr(model.config, "type_vocab_size", 0) > 1:
        names.append("token_type_ids")

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any = None) -> Any:
            kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
            if token_type_ids is not None:
                kwargs["token_type_ids"] = token_type_ids
            return self.model(**kwargs).last_hidden_state

    feeds = batch(model.config.vocab_size, 2, 8)
    dim = torch.export.Dim.DYNAMIC
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Encoder().eval(),
            tuple(torch.from_numpy(feeds[n]) for n in names),
            str(target),
            input_names=names,
            output_names=["last_hidden_state"],
            dynamic_shapes={n: {0: dim, 1: dim} for n in names},
            dynamo=True,
            external_data=False,
            verbose=False,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()

    import onnxruntime as ort
    import torch
    import transformers

    torch.set_num_threads(1)
    exporters = {"legacy": legacy}
    if importlib.util.find_spec("onnxscript") is not None:
        exporters["dynamo"] = dynamo
    else:
        print("dynamo: not measured (pip install onnxscript)")
    if importlib.util.find_spec("optimum") is None:
        print(
            "optimum-onnx: not measured (0.1.0, its only release, pins transformers<4.58; "
            f"transformers {transformers.__version__} is installed)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in args.models:
            folder = save(name, root)
            reference = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
            feeds = batch(reference.config.vocab_size, args.rows, args.tokens)
            sessions, rows = {}, {}
            for kind, export in exporters.items():
                target = root / f"{name}-{kind}.onnx"
                started = time.perf_counter()
                export(folder, target)
                seconds = time.perf_counter() - started
                options = ort.SessionOptions()
                options.intra_op_num_threads = 1
                session = ort.InferenceSession(str(target), options)
                inputs = {i.name: feeds[i.name] for i in session.get_inputs()}
                got = session.run(None, inputs)[0]
                with torch.no_grad():
                    want = reference(
                        **{k: torch.from_numpy(v) for k, v in inputs.items()}
                    ).last_hidden_state.numpy()
                real = inputs["attention_mask"].astype(bool)
                diff = float(np.abs(got - want)[real].max())
                size = sum(p.stat().st_size for p in root.glob(f"{target.name}*"))
                sessions[kind] = (session, inputs)
                rows[kind] = {"convert_s": seconds, "diff": diff, "bytes": size, "run": []}
            for _ in range(args.runs):  # interleaved, so that both see the same machine
                for kind, (session, inputs) in sessions.items():
                    started = time.perf_counter()
                    session.run(None, inputs)
                    rows[kind]["run"].append(time.perf_counter() - started)
            for kind, row in rows.items():
                run_ms = statistics.median(row["run"]) * 1e3
                line = (
                    f"{name:16s} {kind:7s} convert {row['convert_s']:6.2f} s  diff "
                    f"{row['diff']:.1e}  {row['bytes'] / 1e6:7.2f} MB  ORT {run_ms:7.2f} ms"
                )
                if kind != "legacy":
                    base = rows["legacy"]
                    line += (
                        f"  | x legacy: convert {row['convert_s'] / base['convert_s']:.1f}, "
                        f"size {row['bytes'] / base['bytes']:.2f}, ORT "
                        f"{statistics.median(row['run']) / statistics.median(base['run']):.2f}"
                    )
                print(line)


if __name__ == "__main__":
    main()
