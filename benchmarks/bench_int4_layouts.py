"""The own int4 kernel on its two layouts of a weight quantized here: bf16 scales and zeros (320
bytes a block of 16 columns by 32 inputs, 5 bits a weight) against 8-bit steps (290, 4.53 bits;
what ``--set weights=int4`` packs since 2026-12-04), at a decode step's row counts.

Per shape (``in -> out``), row count and kind of row (bf16; float32; float32 summed as int8),
the product of the same random weight in each layout is timed in one process, alternated call by
call so that a load on the machine falls on both alike. Each layout is held in ``--copies``
copies, called in turn, so that a call reads its weight from memory, not from a cache (a decode
step reads each weight once). Printed: the median µs per call of each, and the steps layout's
time as a fraction of the bf16 one's (its bytes are 0.906 of them).

    python benchmarks/bench_int4_layouts.py                 # 1.7B and 3B MLP shapes (~2 min)
    python benchmarks/bench_int4_layouts.py --shapes 64x128 --copies 2 --calls 3   # smoke run

Needs ``batchline[generate]`` and the kernel library (built on first use); bf16 rows need
AVX512-BF16 and are left out where the CPU has none; int8 rows need AVX2 at least. Threads:
``--threads`` (default 2). The lead runs it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from batchline.models.generation import quant_kernel
from batchline.models.generation.quant_codes import quantize_int4, quantize_int4_steps

# SmolLM2-1.7B's fused gate/up and down, a 3B Llama's (hidden 3,072, MLP 8,192)
DEFAULT_SHAPES = "2048x16384,8192x2048,3072x16384,8192x3072"


def layouts(k: int, n: int, copies: int) -> dict[str, list[torch.Tensor]]:
    """One random ``(n, k)`` weight in both layouts, ``copies`` copies of each."""
    weight = torch.randn(n, k) * 0.05
    plain = quantize_int4(weight, 32)
    steps = quantize_int4_steps(weight)
    bf16 = quant_kernel.pack_int4(plain.codes, plain.scales, plain.zeros)
    compact = quant_kernel.pack_int4_steps(steps.codes, steps.steps, steps.offsets, steps.units)
    return {"bf16 scales": [bf16.clone() for _ in range(copies)],
            "8-bit steps": [compact.clone() for _ in range(copies)]}  # fmt: skip


def row_kinds() -> dict[str, Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]]:
    """The kinds of rows the kernel takes here: name -> product(x, packed, n)."""
    kinds: dict[str, Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]] = {}
    if quant_kernel.own_kernels()[0]:
        kinds["bf16"] = lambda x, p, n: quant_kernel.int4_linear(x.bfloat16(), p, n)
    if quant_kernel.own_kernels(dtype=torch.float32)[0]:
        kinds["float32"] = lambda x, p, n: quant_kernel.int4_linear(x, p, n)
    if quant_kernel.int8_activations_here()[0]:
        kinds["int8 rows"] = lambda x, p, n: quant_kernel.int4_linear(x, p, n, int8_rows=True)
    return kinds


def timed(
    product: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    packed: dict[str, list[torch.Tensor]],
    x: torch.Tensor,
    n: int,
    calls: int,
) -> dict[str, float]:
    """Median µs per call of ``product`` on each layout, alternated call by call, each call on
    the next copy."""
    times: dict[str, list[float]] = {name: [] for name in packed}
    with torch.inference_mode():
        for copies in packed.values():
            product(x, copies[0], n)
        for call in range(calls):
            for name, copies in packed.items():
                weight = copies[call % len(copies)]
                start = time.perf_counter()
                product(x, weight, n)
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="in x out, comma-separated")
    parser.add_argument("--rows", default="1,16", help="row counts, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=60, help="timed calls per layout")
    parser.add_argument("--copies", type=int, default=6, help="copies of each packed weight")
    args = parser.parse_args()
    kinds = row_kinds()
    if not kinds:
        raise SystemExit(f"the own int4 kernels do not run here: {quant_kernel.own_kernels()[1]}")
    torch.set_num_threads(args.threads)
    print(f"{args.threads} thread(s); µs per call (median of {args.calls}), {args.copies} copies")
    print("| shape | rows | rows as | bf16 scales | 8-bit steps | steps / bf16 |")
    print("|---|---:|---|---:|---:|---:|")
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        packed = layouts(k, n, args.copies)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            for kind, product in kinds.items():
                us = timed(product, packed, x, n, args.calls)
                a, b = us["bf16 scales"], us["8-bit steps"]
                print(f"| {shape} | {rows} | {kind} | {a:.0f} | {b:.0f} | {b / a:.3f} |")


if __name__ == "__main__":
    main()
