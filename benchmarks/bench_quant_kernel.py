"""One linear at a decode step's row counts: dense bf16, torch's int4/int8 kernel, batchline's own.

Per shape (``in -> out``), thread count and row count, four products of the same weight are
timed in one process, alternated call by call so that a load on the machine falls on all alike:
dense bf16 packed for oneDNN (``PackedLinear``, the engine's dense path), torch's CPU kernel
(``_weight_int4pack_mm_for_cpu``, or ``_weight_int8pack_mm`` with ``--kind int8``) and
batchline's (``quant_kernel.int4_linear`` / ``int8_linear``) through each of its two paths,
vdpbf16ps and AMX tiles (``QuantLinear`` takes AMX for int4 from ``quant_kernel.AMX_ROWS`` rows
on, for int8 always), from the same codes (int4: groups of 32; int8: a scale per output).
Printed: the median µs per call of each, and each quantized kernel's time as a fraction of
dense's (below 1: faster); then, per shape and row count, each product's time at 2 threads (or
each further ``--threads`` count) as a fraction of its time at the first (0.5: it halved). The
thread counts are alternated call by call too. On a CPU without AMX the "amx" column is the
vdpbf16ps path again.

The default shapes are SmolLM2-360M's fused gate/up (960 -> 5,120) and down (2,560 -> 960),
and a Qwen2.5-1.5B-sized MLP (1,536 -> 8,960 and 8,960 -> 1,536).

    python benchmarks/bench_quant_kernel.py                 # int4, 1 and 2 threads (~1 min)
    python benchmarks/bench_quant_kernel.py --threads 1,2 --calls 200 --kind int8
    python benchmarks/bench_quant_kernel.py --kind int8
    python benchmarks/bench_quant_kernel.py --shapes 960x5120 --rows 16 --calls 20
    python benchmarks/bench_quant_kernel.py --shapes 64x128 --calls 3   # smoke run

Needs torch 2.6 or later, a C++ compiler (the kernel library is built on first use) and a CPU
with AVX512-BF16 (elsewhere it says why not and stops).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from batchline.models.common.packed_linear import PackedLinear
from batchline.models.generation.quant_codes import quantize_int4, quantize_int8
from batchline.models.generation.quant_kernel import (
    AMX_ROWS,
    INT8_AMX_ROWS,
    int4_linear,
    int8_linear,
    own_kernels,
    pack_int4,
    pack_int8,
)
from batchline.models.generation.quant_linear import QuantLinear

DEFAULT_SHAPES = "960x5120,2560x960,1536x8960,8960x1536"
NEVER = 1 << 30  # an amx_rows no call reaches: the vdpbf16ps path only


def products(kind: str, k: int, n: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The four products of one random ``(n, k)`` weight, the quantized ones as ``kind``."""
    weight = torch.randn(n, k) * 0.05
    with torch.no_grad():
        dense = PackedLinear(_linear(weight.to(torch.bfloat16)))
    own: Callable[..., torch.Tensor]
    if kind == "int4":
        codes = quantize_int4(weight, 32)
        # QuantLinear's forward below its dense-rows threshold: torch's kernel alone
        theirs = QuantLinear.int4([codes], dtype=torch.bfloat16, own_kernel=False)
        packed: Any = pack_int4(codes.codes, codes.scales, codes.zeros)
        own = int4_linear
    else:
        codes8, scales = quantize_int8(weight)
        theirs = QuantLinear.int8(codes8, scales, dtype=torch.bfloat16, own_kernel=False)
        packed = pack_int8(codes8, scales)
        own = int8_linear

    def own_dp(x: torch.Tensor) -> torch.Tensor:
        return own(x, packed, n, amx_rows=NEVER)

    def own_amx(x: torch.Tensor) -> torch.Tensor:
        return own(x, packed, n, amx_rows=1)

    return {"dense": dense, "torch": theirs, "own vdpbf16": own_dp, "own amx": own_amx}


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    n, k = weight.shape
    layer = torch.nn.Linear(k, n, bias=False, dtype=weight.dtype)
    layer.weight.copy_(weight)
    return layer


def timed(
    fns: dict[str, Callable[[torch.Tensor], torch.Tensor]],
    x: torch.Tensor,
    calls: int,
    threads: list[int],
) -> dict[tuple[int, str], float]:
    """Median µs per call of each product at each thread count, alternated call by call and
    thread count by thread count (after one warm-up call each), so that a load on the machine
    falls on all alike."""
    times: dict[tuple[int, str], list[float]] = {(t, n): [] for t in threads for n in fns}
    with torch.inference_mode():
        for t in threads:
            torch.set_num_threads(t)
            for fn in fns.values():
                fn(x)
        for _ in range(calls):
            for t in threads:
                torch.set_num_threads(t)
                for name, fn in fns.items():
                    start = time.perf_counter()
                    fn(x)
                    times[t, name].append(time.perf_counter() - start)
    return {key: statistics.median(t) * 1e6 for key, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="in x out, comma-separated")
    parser.add_argument("--rows", default="1,4,8,16", help="row counts, comma-separated")
    parser.add_argument("--threads", default="1,2", help="intra-op thread counts")
    parser.add_argument("--calls", type=int, default=50, help="timed calls per product")
    parser.add_argument("--kind", choices=("int4", "int8"), default="int4", help="the format")
    args = parser.parse_args()
    fast, where = own_kernels()
    if not fast:
        raise SystemExit(f"batchline's int kernels do not run here: {where}")
    print(f"{args.kind}, groups of 32" if args.kind == "int4" else "int8, a scale per output")
    print(
        f"own kernel: {where}, AMX from"
        f" {AMX_ROWS if args.kind == 'int4' else INT8_AMX_ROWS} row(s) where the CPU has it"
    )
    print(f"torch {torch.__version__}; µs per call (median of {args.calls}), ratios to dense")
    print(
        f"{'shape':>12} {'thr':>3} {'rows':>4} {'dense':>7} {'torch':>7} {'own dp':>7}"
        f" {'own amx':>7} {'torch/d':>7} {'dp/d':>5} {'amx/d':>5}"
    )
    threads = [int(t) for t in args.threads.split(",")]
    scaling: list[str] = []
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        fns = products(args.kind, k, n)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k).to(torch.bfloat16)
            us = timed(fns, x, args.calls, threads)
            for t in threads:
                d, t4 = us[t, "dense"], us[t, "torch"]
                dp, amx = us[t, "own vdpbf16"], us[t, "own amx"]
                print(
                    f"{shape:>12} {t:>3} {rows:>4} {d:7.0f} {t4:7.0f} {dp:7.0f}"
                    f" {amx:7.0f} {t4 / d:7.2f} {dp / d:5.2f} {amx / d:5.2f}"
                )
            for t in threads[1:]:
                ratios = "  ".join(
                    f"{name} x{us[t, name] / us[threads[0], name]:.2f}" for name in fns
                )
                scaling.append(f"{shape:>12} {rows:>4} rows, {t} thr / {threads[0]}: {ratios}")
    if scaling:
        print("each product's time at more threads as a fraction of its time at the first count:")
        print("\n".join(scaling))


if __name__ == "__main__":
    main()
