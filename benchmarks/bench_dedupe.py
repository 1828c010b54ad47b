"""Duplicate records computed once: ``batchline run`` on an embedding job whose records repeat
30% of the time, with its default (each distinct text computed once) against ``--no-dedupe``
(every record computed), on the same file, in one run.

The file: N records of the demo corpus (stdlib docstrings) where a record is, with probability
0.3, a copy of an earlier record's text (drawn uniformly from those before it; seeded), so the
copies lie near and far, as scraped pages and templated rows do. The two modes alternate
(``--repeats`` rounds, the median rate of each is reported), so that the machine's drift falls
on both.

Goal (issue "Work done once"): dedupe / no-dedupe >= x1.35 records/s.

    python benchmarks/bench_dedupe.py               # 4,000 records, 2 rounds, a few minutes
    python benchmarks/bench_dedupe.py --records 1000 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

from batchline.datasets.corpus import demo_corpus_path
from batchline.jobs.run import RunOptions, run


def with_duplicates(texts: list[str], share: float, seed: int) -> list[str]:
    """``texts`` where each record after the first is, with probability ``share``, a copy of
    an earlier record's text."""
    rng = random.Random(seed)
    out: list[str] = []
    fresh = iter(texts)
    while len(out) < len(texts):
        if out and rng.random() < share:
            out.append(rng.choice(out))
        else:
            out.append(next(fresh))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=4_000)
    parser.add_argument("--share", type=float, default=0.3, help="records that are copies")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with open(demo_corpus_path()) as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(args.records), f, strict=False)]
    records = with_duplicates(texts, args.share, seed=0)
    copies = len(records) - len(set(records))
    rates: dict[str, list[float]] = {"dedupe": [], "no-dedupe": []}
    counted = 0
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "sample.jsonl"
        src.write_text("".join(json.dumps({"text": t}) + "\n" for t in records))
        run(RunOptions(input=src, output=Path(tmp) / "warm", limit=200))  # load, compile, cache
        for r in range(args.repeats):
            for name in ("no-dedupe", "dedupe") if r % 2 == 0 else ("dedupe", "no-dedupe"):
                out = Path(tmp) / f"{name}-{r}"
                summary = run(RunOptions(input=src, output=out, dedupe=name == "dedupe"))
                rates[name].append(summary.records_per_s)
                if name == "dedupe":
                    counted = summary.duplicates
    on, off = statistics.median(rates["dedupe"]), statistics.median(rates["no-dedupe"])
    print(
        f"{len(records):,} demo-corpus records, {copies:,} of them copies of an earlier one "
        f"({copies / len(records):.0%}); default model, 2 cores; median of {args.repeats}"
    )
    print(f"  dedupe (default)  {on:8.1f} records/s   (the summary counts {counted:,} duplicates)")
    print(f"  --no-dedupe       {off:8.1f} records/s")
    print(f"dedupe / no-dedupe = x{on / off:.2f}   (goal >= x1.35)")


if __name__ == "__main__":
    main()
