"""One sampled token's draw: ``sampling.sample_top_p`` against the full sort it replaced.

Per vocabulary size, ``top_p`` and kind of logits (``flat``: random normal ones, the nucleus a
large part of the vocabulary; ``peaked``: a real model's shape, a few tokens far ahead), the draw
as it is (a top-k that grows until it holds the nucleus, or with ``top_p`` 1 the cumulative sum
in id order) and as it was before 2026-12-05 (softmax, a full descending sort, the cumulative
sum, one inverse-CDF draw) are timed in one process, alternated call by call. Printed: the median
µs of each and the ratio (below 1: the draw now is faster).

    python benchmarks/bench_sampler.py                 # SmolLM2's 49,152 and a 151,936 vocabulary
    python benchmarks/bench_sampler.py --vocab 1000 --calls 20   # smoke run

Needs ``batchline[generate]`` (torch). Threads: ``--threads`` (default 2). The lead runs it on
a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from batchline.models.generation.sampling import sample_top_p


def sorted_draw(logits: torch.Tensor, temperature: float, top_p: float, g: torch.Generator) -> int:
    """The draw before: every probability sorted, most likely first."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    ranked, order = torch.sort(probs, descending=True)
    cumulative = torch.cumsum(ranked, dim=-1)
    if top_p < 1.0:
        keep = (cumulative - ranked) < top_p
        keep[0] = True
        ranked = ranked * keep
        cumulative = torch.cumsum(ranked, dim=-1)
    u = float(torch.rand((), generator=g))
    threshold = torch.tensor([u * float(cumulative[-1])])
    index = int(torch.searchsorted(cumulative, threshold, right=True)[0])
    return int(order[min(index, int(torch.count_nonzero(ranked)) - 1)])


def logits_of(kind: str, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(vocab)
    if kind == "flat":
        return torch.randn(vocab, generator=g)
    logits = torch.randn(vocab, generator=g) * 2
    logits[torch.randperm(vocab, generator=g)[:20]] += 12  # a few tokens far ahead
    return logits.bfloat16().float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", default="49152,151936", help="sizes, comma-separated")
    parser.add_argument("--top-p", default="1.0,0.95,0.8", help="comma-separated")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"one row, temperature 1, {args.threads} thread(s), median of {args.calls} calls each")
    print("| vocabulary | logits | top_p | sorted (before) | now | now / before |")
    print("|---:|---|---:|---:|---:|---:|")
    for vocab in (int(v) for v in args.vocab.split(",")):
        for kind in ("peaked", "flat"):
            logits = logits_of(kind, vocab)
            for top_p in (float(p) for p in args.top_p.split(",")):
                g = torch.Generator().manual_seed(0)
                before: list[float] = []
                now: list[float] = []
                for _ in range(args.calls + 3):
                    start = time.perf_counter()
                    sorted_draw(logits, 1.0, top_p, g)
                    before.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    sample_top_p(logits, temperature=1.0, top_p=top_p, generator=g)
                    now.append(time.perf_counter() - start)
                b, n = statistics.median(before[3:]), statistics.median(now[3:])
                print(
                    f"| {vocab:,} | {kind} | {top_p} | {b * 1e6:.0f} µs | {n * 1e6:.0f} µs "
                    f"| x{n / b:.3f} |"
                )


if __name__ == "__main__":
    main()
