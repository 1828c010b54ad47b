"""One linear at a decode step's row counts: dense bf16, torch's int4 kernel, batchline's own.

Per shape (``in -> out``), thread count and row count, three products of the same weight are
timed in one process, alternated call by call so that a load on the machine falls on all three
alike: dense bf16 packed for oneDNN (``PackedLinear``, the engine's dense path), torch's CPU int4
kernel (``_weight_int4pack_mm_for_cpu``, what ``QuantLinear`` calls) and batchline's
(``quant_kernel.int4_linear``) through each of its two paths, vdpbf16ps and AMX tiles (it takes
AMX from ``quant_kernel.AMX_ROWS`` rows on), all int4 from the same codes, groups of 32. Printed:
the median µs per call of each, and each int4 kernel's time as a fraction of dense's (below 1:
faster). On a CPU without AMX the "amx" column is the vdpbf16ps path again.

The default shapes are SmolLM2-360M's fused gate/up (960 -> 5,120) and down (2,560 -> 960),
and a Qwen2.5-1.5B-sized MLP (1,536 -> 8,960 and 8,960 -> 1,536).

    python benchmarks/bench_quant_kernel.py                          # 1 and 2 threads (~2 min)
    python benchmarks/bench_quant_kernel.py --shapes 960x5120 --rows 16 --calls 20
    python benchmarks/bench_quant_kernel.py --shapes 64x128 --calls 3   # smoke run

Needs torch 2.6 or later and a C++ compiler (the kernel library is built on first use). On a
CPU without AVX512-BF16 the own kernel runs its plain C++ sums and says so.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from batchline.models.generation.packed_linear import PackedLinear
from batchline.models.generation.quant_kernel import (
    AMX_ROWS,
    int4_linear,
    own_kernels,
    pack_int4,
)
from batchline.models.generation.quant_linear import QuantLinear, quantize_int4

DEFAULT_SHAPES = "960x5120,2560x960,1536x8960,8960x1536"
NEVER = 1 << 30  # an amx_rows no call reaches: the vdpbf16ps path only


def products(k: int, n: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The three products of one random ``(n, k)`` weight."""
    weight = torch.randn(n, k) * 0.05
    with torch.no_grad():
        dense = PackedLinear(_linear(weight.to(torch.bfloat16)))
    codes = quantize_int4(weight, 32)
    torch_int4 = QuantLinear.int4([codes], dtype=torch.bfloat16, own_kernel=False)
    packed = pack_int4(codes.codes, codes.scales, codes.zeros)

    def own_dp(x: torch.Tensor) -> torch.Tensor:
        return int4_linear(x, packed, n, amx_rows=NEVER)

    def own_amx(x: torch.Tensor) -> torch.Tensor:
        return int4_linear(x, packed, n, amx_rows=1)

    def theirs(x: torch.Tensor) -> torch.Tensor:
        # QuantLinear's forward below its dense-rows threshold: torch's kernel alone
        return torch_int4(x)

    return {"dense": dense, "torch int4": theirs, "own vdpbf16": own_dp, "own amx": own_amx}


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    n, k = weight.shape
    layer = torch.nn.Linear(k, n, bias=False, dtype=weight.dtype)
    layer.weight.copy_(weight)
    return layer


def timed(
    fns: dict[str, Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor, calls: int
) -> dict[str, float]:
    """Median µs per call of each, alternated call by call (after one warm-up call each)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    with torch.inference_mode():
        for fn in fns.values():
            fn(x)
        for _ in range(calls):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn(x)
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="in x out, comma-separated")
    parser.add_argument("--rows", default="1,4,8,16", help="row counts, comma-separated")
    parser.add_argument("--threads", default="1,2", help="intra-op thread counts")
    parser.add_argument("--calls", type=int, default=50, help="timed calls per product")
    args = parser.parse_args()
    fast, where = own_kernels()
    print(
        f"own kernel: {'AVX512-BF16' if fast else 'plain C++ (' + where + ')'}, AMX from"
        f" {AMX_ROWS} rows where the CPU has it"
    )
    print(f"torch {torch.__version__}; µs per call (median of {args.calls}), ratios to dense")
    print(
        f"{'shape':>12} {'thr':>3} {'rows':>4} {'dense':>7} {'torch4':>7} {'own dp':>7}"
        f" {'own amx':>7} {'torch/d':>7} {'dp/d':>5} {'amx/d':>5}"
    )
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        fns = products(k, n)
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k).to(torch.bfloat16)
                us = timed(fns, x, args.calls)
                d, t4 = us["dense"], us["torch int4"]
                dp, amx = us["own vdpbf16"], us["own amx"]
                print(
                    f"{shape:>12} {threads:>3} {rows:>4} {d:7.0f} {t4:7.0f} {dp:7.0f}"
                    f" {amx:7.0f} {t4 / d:7.2f} {dp / d:5.2f} {amx / d:5.2f}"
                )


if __name__ == "__main__":
    main()
