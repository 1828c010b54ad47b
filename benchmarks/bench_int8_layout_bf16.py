"""A bf16 model's int8 weights three ways: in groups of 32 as two int4 planes or in the int8
layout, and per channel.

A bf16 model holds int8 in groups (``weights=int8``'s lm_head, a GGUF's Q8_0 and Q6_K tensors) as
the two int4 planes of ``quant_codes.int8_group_planes``: each plane a product of the int4 kernel,
a step's few rows summed as int8 where the load takes int8 rows (``activations=int8``, ``auto`` on
an AMX host: below ``quant_kernel.A8_BF16_ROWS`` rows), bf16 rows through AMX tiles from there.
The int8 layout (``quant_kernel.pack_int8g``, 8.5 bits a weight where the planes read 10) is one
product of int8 rows at any row count. Per channel (``quantize.quantize_int8``: what
``weights=int8`` is in bf16, the own int8 kernel: ``vdpbf16ps`` on bf16 rows, AMX tiles from
``quant_kernel.INT8_AMX_ROWS`` rows) it reads 8 bits a weight. Per shape (``in x out``) and row
count the three are timed in one process, alternated call by call, each call on the next of
``--copies`` copies of the weight (so that it is read from memory, as a step reads it). Printed:
the median ms a call of each and the layout's time over the others' (below 1: the layout is
faster).

    python benchmarks/bench_int8_layout_bf16.py                       # heads and MLPs, ~3 min
    python benchmarks/bench_int8_layout_bf16.py --shapes 960x49152 --rows 1,4,256
    python benchmarks/bench_int8_layout_bf16.py --shapes 64x128 --rows 1 --calls 3  # smoke run

Needs torch, a C++ compiler (the kernel library is built on first use) and a CPU with
AVX512-BF16 and AVX512-VNNI (elsewhere it says why not and stops). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from batchline.models.generation import quant_kernel
from batchline.models.generation.quant_codes import (
    int8_group_planes,
    quantize_int8,
    quantize_int8_groups,
)
from batchline.models.generation.quant_linear import QuantLinear

#: SmolLM2-360M's and -1.7B's lm_head, 1.7B's fused gate/up and its down.
DEFAULT_SHAPES = "960x49152,2048x49152,2048x16384,8192x2048"


def copies_of(k: int, n: int, copies: int) -> dict[str, list[QuantLinear]]:
    """``copies`` layers of one weight as two planes (int8 rows on), as the int8 layout and per
    channel."""
    weight = torch.randn(n, k) * 0.02
    codes, scales = quantize_int8_groups(weight, 32)
    planes = int8_group_planes(codes, scales, 32)
    two = [QuantLinear.int4(planes, dtype=torch.bfloat16) for _ in range(copies)]
    for layer in two:
        layer.int8_rows = True
    one = [
        QuantLinear.own_int4([quant_kernel.pack_int8g(codes, scales)], n, k, kind="int8g")
        for _ in range(copies)
    ]
    for layer in one:
        layer.int8_rows = True
    channel = [
        QuantLinear.int8(*quantize_int8(weight), dtype=torch.bfloat16) for _ in range(copies)
    ]
    return {"planes": two, "layout": one, "channel": channel}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="in x out, comma-separated")
    parser.add_argument("--rows", default="1,2,4,8,16,64,256,512", help="comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=12, help="timed calls per product")
    parser.add_argument("--copies", type=int, default=4, help="weights taken in turn")
    args = parser.parse_args()
    for here, why in (quant_kernel.own_kernels(), quant_kernel.int8_activations_here()):
        if not here:
            sys.exit(f"the own bf16 kernels with int8 rows do not run here: {why}")
    torch.set_num_threads(args.threads)
    print(f"{args.threads} thread(s), {args.copies} copies of each weight, median ms a call")
    print("| shape | rows | two planes | int8 layout | per channel | layout / planes | / channel |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        made = copies_of(k, n, args.copies)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k).to(torch.bfloat16)
            times: dict[str, list[float]] = {name: [] for name in made}
            with torch.inference_mode():
                for mine in made.values():  # warm: the kernels' buffers, the library
                    mine[0](x)
                for i in range(args.calls):
                    for name, mine in made.items():
                        layer = mine[i % len(mine)]
                        start = time.perf_counter()
                        layer(x)
                        times[name].append(time.perf_counter() - start)
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            cells = " | ".join(f"{ms[name]:.2f}" for name in ("planes", "layout", "channel"))
            ratios = f"{ms['layout'] / ms['planes']:.2f} | {ms['layout'] / ms['channel']:.2f}"
            print(f"| {k} -> {n} | {rows} | {cells} | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
