"""Hugging Face model folders (issue 29): a folder runs as fast as the built-in model, and a
reranker batches. Ratios against baselines measured in the same run.

  run default      ``batchline run`` with the built-in all-MiniLM-L6-v2 (the baseline)
  run FOLDER/      ``batchline run --model MINILM_FOLDER/``: the weights package's own
                   sentence-transformers folder, detected and converted (the same graph)
  rerank batched   a random-weight cross-encoder folder (MiniLM-L6 sized, BERT, one label,
                   built from numpy: no torch) behind its model batcher, as ``run`` and
                   ``serve`` batch it: 2 sessions x 1 thread
  rerank single    the same model, one pair per call, 2 callers on one shared session of
                   2 threads (what a naive server does)

Pairs are short (a 2-5 word query, a 5-12 word document from the demo corpus). The two
``run`` modes alternate twice, best kept, to even out a noisy shared machine.
Goals: FOLDER/ / default >= 0.95; rerank batched / single >= x2.

    python benchmarks/bench_hf_folders.py                # 3,000 records, 2,000 pairs
    python benchmarks/bench_hf_folders.py --records 300 --pairs 200    # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from batchline.datasets.corpus import demo_corpus_path
from batchline.jobs.run import RunOptions, run
from batchline.knobs import Knobs
from batchline.models.batching import ModelBatcher
from batchline.models.loader import load_model
from batchline.models.onnx import minilm
from batchline.models.specs import parse_spec


def reranker_folder(where: Path) -> Path:
    """A MiniLM-L6-sized BertForSequenceClassification with one label and random weights,
    written as safetensors from numpy, with the MiniLM tokenizer."""
    from safetensors.numpy import load_file, save_file

    src = minilm.weights_dir()
    folder = where / "reranker"
    folder.mkdir()
    config = json.loads((src / "config.json").read_text())
    config.update(architectures=["BertForSequenceClassification"], id2label={"0": "LABEL_0"})
    (folder / "config.json").write_text(json.dumps(config))
    shutil.copy(src / "tokenizer.json", folder / "tokenizer.json")
    rng = np.random.default_rng(0)
    weights = {
        f"bert.{k}": rng.normal(0, 0.05, v.shape).astype(np.float32)
        for k, v in load_file(str(src / "model.safetensors")).items()
    }
    hidden = int(config["hidden_size"])
    weights["bert.pooler.dense.weight"] = rng.normal(0, 0.05, (hidden, hidden)).astype(np.float32)
    weights["bert.pooler.dense.bias"] = np.zeros(hidden, np.float32)
    weights["classifier.weight"] = rng.normal(0, 0.05, (1, hidden)).astype(np.float32)
    weights["classifier.bias"] = np.zeros(1, np.float32)
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def short_pairs(texts: list[str], n: int) -> list[dict[str, str]]:
    rng = np.random.default_rng(1)
    words = [t.split() for t in texts if len(t.split()) >= 24]
    pairs = []
    for i in range(n):
        w = words[i % len(words)]
        q, d = int(rng.integers(2, 6)), int(rng.integers(5, 13))
        pairs.append({"query": " ".join(w[:q]), "document": " ".join(w[q : q + d])})
    return pairs


async def batched(model: Any, items: list[Any]) -> None:
    async with ModelBatcher(model, Knobs()) as batcher:
        futures = [await batcher.submit(i) for i in items]
        await asyncio.gather(*futures)


def single(model: Any, items: list[Any]) -> None:
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda item: model.run_batch([item]), items))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=3_000)
    parser.add_argument("--pairs", type=int, default=2_000)
    args = parser.parse_args()
    with open(demo_corpus_path()) as f:
        rows = [json.loads(line) for _, line in zip(range(args.records), f, strict=False)]
    folder = f"{minilm.weights_dir()}/"
    for spec in ("default", folder):  # build and cache both graphs before any timing
        load_model(parse_spec(spec), Knobs(batching=False)).close()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "sample.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        rates: dict[str, float] = {"default": 0.0, "folder": 0.0}
        for turn in range(2):
            for name, model in (("default", "default"), ("folder", folder)):
                out = Path(tmp) / f"{name}-{turn}"
                summary = run(RunOptions(input=src, output=out, model=model, knobs=Knobs()))
                rates[name] = max(rates[name], summary.records_per_s)

        pairs = short_pairs([r["text"] for r in rows], args.pairs)
        scorer = load_model(parse_spec(f"{reranker_folder(Path(tmp))}/"), Knobs())
        alone = load_model(parse_spec(f"{Path(tmp) / 'reranker'}/"), Knobs(batching=False))
        items = scorer.prepare(pairs)
        t0 = time.perf_counter()
        asyncio.run(batched(scorer, items))
        rerank_batched = len(items) / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        single(alone, alone.prepare(pairs))
        rerank_single = len(items) / (time.perf_counter() - t0)
    tokens = sum(len(i) for i in items) / len(items)
    print(f"{len(rows):,} demo-corpus records, 2 cores")
    print(f"  run default      {rates['default']:8.1f} records/s")
    print(f"  run FOLDER/      {rates['folder']:8.1f} records/s  ({folder})")
    print(f"{len(items):,} short pairs (mean {tokens:.0f} tokens), MiniLM-L6-sized cross-encoder")
    print(f"  rerank batched   {rerank_batched:8.1f} pairs/s")
    print(f"  rerank single    {rerank_single:8.1f} pairs/s")
    print(f"FOLDER/ / default  = {rates['folder'] / rates['default']:.2f}   (goal >= 0.95)")
    print(f"batched / single   = x{rerank_batched / rerank_single:.2f} (goal >= x2)")


if __name__ == "__main__":
    main()
