"""A re-run with ``--cache``: ``batchline run`` of the default embedder over N demo-corpus
records into a fresh result cache, then again after editing 1% of the records (spread over
the file), on the same cache: the second run computes only the edited records.

The ratio is the first run's wall time over the re-run's, as each summary gives it: from
reading the input to the committed output. Loading the model (a re-run loads it too) is
outside both; the times around each whole ``run()`` call are printed too. Also printed: a
re-run without ``--cache`` (what ``--resume`` cannot save: the file changed).

Goal (issue "Work done once"): re-run with --cache >= x20 faster than the first run.

    python benchmarks/bench_cache.py               # 4,000 records, about a minute
    python benchmarks/bench_cache.py --records 10000
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from batchline.datasets.corpus import demo_corpus_path
from batchline.jobs.run import RunOptions, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=4_000)
    parser.add_argument("--edited", type=float, default=0.01, help="share of records edited")
    args = parser.parse_args()
    with open(demo_corpus_path()) as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(args.records), f, strict=False)]
    step = max(1, round(1 / args.edited))
    edited = [f"{t} (edited)" if i % step == 0 else t for i, t in enumerate(texts)]
    changed = sum(a != b for a, b in zip(texts, edited, strict=True))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = root / "records.jsonl"
        cache = root / "cache"
        warm = root / "warm.jsonl"
        warm.write_text("".join(json.dumps({"text": f"warm-up {i}"}) + "\n" for i in range(64)))
        run(RunOptions(input=warm, output=root / "warm"))  # load and compile the model once
        src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        t0 = time.perf_counter()
        first = run(RunOptions(input=src, output=root / "first", cache=cache))
        t1 = time.perf_counter()
        src.write_text("".join(json.dumps({"text": t}) + "\n" for t in edited))
        again = run(RunOptions(input=src, output=root / "again", cache=cache))
        t2 = time.perf_counter()
        plain = run(RunOptions(input=src, output=root / "plain"))
        size = (cache / "results.sqlite").stat().st_size
    print(
        f"{len(texts):,} demo-corpus records, {changed:,} edited before the re-run; default "
        f"model, 2 cores; cache file {size / 2**20:.1f} MiB"
    )
    rows = (
        ("first run, --cache", first, t1 - t0),
        ("re-run, --cache", again, t2 - t1),
        ("re-run, no cache", plain, None),
    )
    for name, summary, whole in rows:
        line = f"  {name:20s} {summary.wall_s:7.2f} s  ({summary.records_per_s:8,.0f} records/s"
        line += f", {summary.cached:,} from the cache)" if summary.cached else ")"
        if whole is not None:
            line += f"; with the model's load {whole:.2f} s"
        print(line)
    print(f"first run / re-run with --cache = x{first.wall_s / again.wall_s:.1f}   (goal >= x20)")
    print(f"  the same, with the model's load: x{(t1 - t0) / (t2 - t1):.1f}")


if __name__ == "__main__":
    main()
