"""``batchline run`` end to end on the demo corpus, against the model's limit and no batching.

All in one run, on the same records (the first N of the demo corpus: stdlib docstrings):

  limit        ONNX Runtime alone on pre-tokenized, length-sorted batches at the best padded-token
               budget (256/512/1024), 2 sessions x 1 thread on 2 threads (bench_embeddings' (a)).
  run          ``batchline run`` with its defaults: reading, tokenizing, batching, inference and
               writing Parquet chunks, from the input file to the committed output.
  no-batching  ``batchline run --no-batching``: one shared session (2 threads), one record per call.

Goals (issue "batchline run"): run >= 0.85 x limit, and run > no-batching.

    python benchmarks/bench_run.py              # 6,000 records, a few minutes
    python benchmarks/bench_run.py --records 2000
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench_embeddings import mode_limit  # the same limit as the embedding benchmark

from batchline.datasets.corpus import demo_corpus_path
from batchline.jobs.run import RunOptions, run
from batchline.models import Embedder
from batchline.models.config import Knobs


def limit_rate(texts: list[str]) -> tuple[float, int]:
    emb = Embedder.default(sessions=2, intra_op_threads=1)
    toks = emb.tokenize(texts)
    mode_limit(emb, toks[:200], 512)  # warm-up
    best = (0.0, 0)
    for budget in (256, 512, 1024):
        t0 = time.perf_counter()
        mode_limit(emb, toks, budget)
        rate = len(toks) / (time.perf_counter() - t0)
        best = max(best, (rate, budget))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=6_000)
    args = parser.parse_args()
    corpus = demo_corpus_path()
    with open(corpus) as f:
        rows = [json.loads(line) for _, line in zip(range(args.records), f, strict=False)]
    texts = [r["text"] for r in rows]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "sample.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        results: dict[str, float] = {}
        limit, budget = limit_rate(texts)
        results["limit"] = limit
        for name, knobs in (("run", Knobs()), ("no-batching", Knobs(batching=False))):
            summary = run(RunOptions(input=src, output=Path(tmp) / name, knobs=knobs))
            results[name] = summary.records_per_s
            if name == "run":
                util, batch = summary.utilization, summary.avg_batch_size
                waste = summary.padding_waste
    print(f"{len(texts):,} demo-corpus records (stdlib docstrings), default model, 2 cores")
    print(f"  limit        {results['limit']:8.1f} records/s  (best budget {budget} padded tokens)")
    print(
        f"  run          {results['run']:8.1f} records/s  (utilization {util:.0%}, "
        f"avg batch {batch:.1f}, padding waste {waste:.1%})"
    )
    print(f"  no-batching  {results['no-batching']:8.1f} records/s")
    print(f"run / limit        = {results['run'] / results['limit']:.2f}   (goal >= 0.85)")
    print(f"run / no-batching  = x{results['run'] / results['no-batching']:.2f} (goal > 1)")


if __name__ == "__main__":
    main()
