"""``batchline run --quantize int8`` against ``batchline run`` (float32), on the same records.

The first N records of the demo corpus (stdlib docstrings), the default model, run's default
knobs. A first int8 run, untimed, builds the int8 graph and measures the quality gate (mean
cosine and top-10 neighbour overlap against float32 on 2,000 demo-corpus texts); then the two
are timed in alternating order (``fp32 int8``, then ``int8 fp32``, ...: drift hits both) and
the median of each is kept. Goal (issue 32): int8 >= x1.7 records/s, at the quality gate.

    python benchmarks/bench_quantize.py                 # 4,000 records, 2 rounds
    python benchmarks/bench_quantize.py --records 1000 --rounds 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from batchline.datasets.corpus import demo_corpus_path
from batchline.jobs.run import RunOptions, run
from batchline.models.config import Knobs

GOAL = 1.7


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=4_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with open(demo_corpus_path()) as f:
        rows = [json.loads(line) for _, line in zip(range(args.records), f, strict=False)]
    kinds = {"fp32": Knobs(), "int8": Knobs(quantize="int8")}
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    quality = ""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "sample.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        # the first int8 run builds the int8 graph and measures the gate: untimed
        options = RunOptions(input=src, output=Path(tmp) / "warm", knobs=kinds["int8"])
        quality = run(options).quantized
        for r in range(args.rounds):
            for kind in ("fp32", "int8") if r % 2 == 0 else ("int8", "fp32"):
                options = RunOptions(
                    input=src, output=Path(tmp) / kind, knobs=kinds[kind], overwrite=True
                )
                rates[kind].append(run(options).records_per_s)
                print(f"  round {r + 1} {kind}: {rates[kind][-1]:8.1f} records/s", flush=True)
    fp32, int8 = statistics.median(rates["fp32"]), statistics.median(rates["int8"])
    print(f"{len(rows):,} demo-corpus records, default model, {os.cpu_count()} cores")
    print(f"  fp32  {fp32:8.1f} records/s")
    print(f"  int8  {int8:8.1f} records/s   ({quality})")
    verdict = "met" if int8 / fp32 >= GOAL else "NOT met"
    print(f"int8 / fp32 = x{int8 / fp32:.2f} (goal >= x{GOAL}): {verdict}")


if __name__ == "__main__":
    main()
