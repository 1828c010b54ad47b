"""One float32 int-weight linear three ways (int8 four): the float32 int4 kernel, int8 rows, dense
float32, and for int8 its own layout.

Per shape (``in -> out``), weight format (``int4``, or ``int8g``: int8 in groups of 32 as two int4
planes, what ``weights=int8`` is in float32) and row count, three products of the same
``QuantLinear`` are timed in one process, alternated call by call so that a load on the machine
falls on all alike: the float32 kernel (``csrc/quant_gemm_f32.cpp``), int8 rows
(``csrc/quant_gemm_a8.cpp``, ``activations=int8``) and the dense product of the weight
dequantized a chunk of columns at a time (what a layer does from ``DENSE_ROWS`` rows on); for
``int8g`` also the int8 layout int8 rows take since 2026-12-03 (``quant_kernel.pack_int8g``, one
product over 8.5 bits a weight where the planes read 10 in two). With ``--copies N`` each call
takes the next of N copies of the weight, so that a step's streaming from memory is timed rather
than a weight the cache holds. Printed: the median ms per call of
each, and int8 rows' time as a fraction of each other's (below 1: faster), and the int8
layout's as a fraction of the planes' with int8 rows.

    python benchmarks/bench_a8_kernel.py                              # 1.7B's MLP, ~2 min
    python benchmarks/bench_a8_kernel.py --copies 12 --rows 1,4,16    # from memory
    python benchmarks/bench_a8_kernel.py --formats int8g --rows 64,256,512
    python benchmarks/bench_a8_kernel.py --shapes 64x128 --rows 1 --calls 3  # smoke run

Needs torch, a C++ compiler (the kernel library is built on first use) and a CPU with AVX2 and
FMA (elsewhere it says why not and stops); int8 rows take vpdpbusd where the CPU has
AVX512-VNNI, vpmaddubsw elsewhere. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from batchline.models.generation import quant_kernel, quant_linear
from batchline.models.generation.quant_codes import (
    int8_group_planes,
    quantize_int4,
    quantize_int8_groups,
)
from batchline.models.generation.quant_linear import QuantLinear

DEFAULT_SHAPES = "2048x16384,8192x2048"  # SmolLM2-1.7B's fused gate/up and its down
PATHS = ("float32 kernel", "int8 rows", "int8 layout", "dense float32")


def layers(fmt: str, k: int, n: int, copies: int) -> dict[str, list[QuantLinear]]:
    """Each path's copies of one weight: the planes (float32 scales) for all but the int8
    layout (int8g only: bf16 scales, as int8 rows pack it)."""
    weight = torch.randn(n, k) * 0.02
    if fmt == "int4":
        planes = [quantize_int4(weight, 32)]
    else:
        planes = int8_group_planes(*quantize_int8_groups(weight, 32), 32)
    shared = [QuantLinear.int4(planes, dtype=torch.float32) for _ in range(copies)]
    made = {name: shared for name in PATHS if name != "int8 layout"}
    if fmt == "int8g":
        made["int8 layout"] = [
            QuantLinear.int4(planes, dtype=torch.float32, scale_dtype=torch.bfloat16)
            for _ in range(copies)
        ]
    return made


def path(name: str, fmt: str) -> Callable[[QuantLinear, torch.Tensor], torch.Tensor]:
    """A call of ``layer(x)`` through ``name``: the layer's flag and its format's dense row
    count set so that the layer takes that path at any row count."""
    plain = "own32" if fmt == "int4" else "own32g"
    rows8 = "own32a8" if fmt == "int4" else "own32a8g"

    def call(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
        layer.int8_rows = name in ("int8 rows", "int8 layout")
        dense = 1 if name == "dense float32" else 1 << 30
        quant_linear.DENSE_ROWS[plain] = quant_linear.DENSE_ROWS[rows8] = dense
        out: torch.Tensor = layer(x)
        return out

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="in x out, comma-separated")
    parser.add_argument("--formats", default="int4,int8g", help="int4, int8g; comma-separated")
    parser.add_argument("--rows", default="1,16,128,512", help="row counts, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=12, help="timed calls per product")
    parser.add_argument("--copies", type=int, default=1, help="weights taken in turn")
    args = parser.parse_args()
    here, why = quant_kernel.int8_activations_here()
    if not here:
        sys.exit(f"int8 rows do not run here: {why}")
    torch.set_num_threads(args.threads)
    saved = dict(quant_linear.DENSE_ROWS)
    print(f"{args.threads} thread(s), {args.copies} cop(ies) of each weight, median ms a call")
    ratios = "int8 rows / float32 kernel | int8 rows / dense | int8 layout / int8 rows"
    print(f"| shape | format | rows | {' | '.join(PATHS)} | {ratios} |")
    print("|---|---|---:|" + "---:|" * (len(PATHS) + 3))
    try:
        for shape in args.shapes.split(","):
            k, n = (int(v) for v in shape.split("x"))
            for fmt in args.formats.split(","):
                copies = layers(fmt, k, n, args.copies)
                names = [name for name in PATHS if name in copies]
                for rows in (int(r) for r in args.rows.split(",")):
                    x = torch.randn(rows, k)
                    times: dict[str, list[float]] = {name: [] for name in names}
                    calls = {name: path(name, fmt) for name in names}
                    with torch.inference_mode():
                        for name in names:  # warm: the kernels' buffers, the library
                            calls[name](copies[name][0], x)
                        for i in range(args.calls):
                            for j, name in enumerate(names):  # each call a weight of its own
                                mine = copies[name]
                                layer = mine[(i * len(names) + j) % len(mine)]
                                start = time.perf_counter()
                                calls[name](layer, x)
                                times[name].append(time.perf_counter() - start)
                    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
                    cells = " | ".join(f"{ms[name]:.2f}" if name in ms else "-" for name in PATHS)
                    a8 = ms["int8 rows"]
                    layout = f"{ms['int8 layout'] / a8:.2f}" if "int8 layout" in ms else "-"
                    print(
                        f"| {k} -> {n} | {fmt} | {rows} | {cells} | "
                        f"{a8 / ms['float32 kernel']:.2f} | {a8 / ms['dense float32']:.2f} | "
                        f"{layout} |",
                        flush=True,
                    )
    finally:
        quant_linear.DENSE_ROWS.update(saved)


if __name__ == "__main__":
    main()
