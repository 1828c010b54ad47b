"""Peak memory of ``batchline run`` on a large input: it must stream, never load the input.

Generates a JSONL file of N rows (default 1,000,000), then runs the real job pipeline (reader,
tokenizer, batcher, chunk writer) in a child process and reads the child's peak RSS (VmHWM).

The real model embeds ~300-1,100 texts/s on 2 cores, so 1,000,000 rows would take close to an
hour; by default the model call is replaced by a stand-in that returns 384 random floats per
text (tokenizer, batcher, queue and writer are the real ones), which is what the memory bound is
about. ``--real-model`` uses the real model instead (use it with a smaller ``--rows``).

    python benchmarks/bench_run_memory.py                      # 1M rows, stand-in model
    python benchmarks/bench_run_memory.py --rows 20000 --real-model
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import sys, numpy as np
from pathlib import Path
from batchline.jobs import run as job

if sys.argv[3] == "stand-in":
    real_load = job.load_job_model

    def fast_model(options, knobs):
        model = real_load(options, knobs)
        rng = np.random.default_rng(0)
        # the model call alone is replaced: tokenizer, batcher, queue and writer are real
        model.run_batch = lambda batch: list(
            rng.standard_normal((len(batch), 384), dtype=np.float32)
        )
        return model

    job.load_job_model = fast_model

summary = job.run(job.RunOptions(input=Path(sys.argv[1]), output=Path(sys.argv[2])))
peak_kb = next(
    int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")
)
print(summary.records, summary.wall_s, peak_kb)
"""

_SENTENCE = (
    "the model batches records of varied length so that every call keeps the device busy "
    "while nothing waits longer than it must and no record is ever lost or written twice"
)
WORDS = _SENTENCE.split(" ")


def make_input(path: Path, rows: int) -> None:
    rng = random.Random(7)
    with open(path, "w") as f:
        for i in range(rows):
            n = rng.randint(4, 40)
            text = " ".join(rng.choice(WORDS) for _ in range(n))
            f.write(json.dumps({"id": f"r{i}", "text": text}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--real-model", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "input.jsonl"
        t0 = time.perf_counter()
        make_input(src, args.rows)
        size_mb = src.stat().st_size / 1e6
        print(f"input: {args.rows:,} rows, {size_mb:,.0f} MB ({time.perf_counter() - t0:.0f} s)")
        mode = "real" if args.real_model else "stand-in"
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(src), str(Path(tmp) / "out"), mode],
            capture_output=True,
            text=True,
            check=True,
        )
        records, wall, peak_kb = out.stdout.split()
        peak_mb = int(peak_kb) / 1024
        print(
            f"model: {mode}; records: {int(records):,}; wall: {float(wall):.0f} s; "
            f"{int(records) / float(wall):,.0f} records/s"
        )
        print(f"peak RSS: {peak_mb:,.0f} MB (target <= 1,536 MB; input file {size_mb:,.0f} MB)")


if __name__ == "__main__":
    main()
