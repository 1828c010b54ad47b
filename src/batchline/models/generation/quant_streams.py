"""How many weight tiles a one-row product of the int8-rows kernel reads at once, per host kind.

A batch-1 decode step reads every weight once from memory. The 512-bit int8-rows paths
(``csrc/quant_gemm_a8.cpp``: int4 in 8-bit steps, and the int8 layout) can read one tile at a
time, reading ahead in software, or ``streams`` tiles side by side (1, 2, 4 or 8), which gives
the hardware's prefetchers that many streams to follow. Which pays depends on the CPU's
prefetchers and memory, not on the kernel, so :func:`a8_streams` holds the rule host kind by
host kind, each number where it was measured (``benchmarks/bench_a8_streams.py``). The kernel's
own layout and width choices stay in :mod:`~batchline.models.generation.quant_kernel`; a
``QuantLinear`` asks this module once, at load, and hands its number to the op and to the
one-row region (``csrc/decode_layers.cpp``).
"""

from __future__ import annotations

from collections.abc import Collection

from batchline._cpu import CpuModel, host_flags, host_kind, host_model, zen

__all__ = [
    "A8_STREAMS",
    "A8_STREAMS_AMX",
    "A8_STREAMS_VNNI",
    "A8_STREAMS_ZEN5",
    "A8_STREAM_INPUTS",
    "A8_STREAM_INPUTS_ZEN5",
    "INT8G_STREAMS",
    "a8_streams",
]

#: The tiles the 512-bit int8-rows path reads at once in a one-row int4 product on Zen 4 (1, 2, 4 or
#: 8): so many streams from memory for the hardware's prefetchers instead of one read ahead in
#: software (see ``csrc/quant_gemm_a8.cpp``'s ``row_by_tiles_a8``). Zen 5 takes
#: :data:`A8_STREAMS_ZEN5` on its longest inputs only.
A8_STREAMS = 8
#: The tiles a one-row int4 product reads at once on an AMX host (Intel, int8 rows: a bf16 model's
#: one-row steps there, :data:`~.quant_kernel.A8_BF16_ROWS`): every linear of a 1.7B shape's 24
#: layers (2,048 -> 3,072, 2,048 -> 2,048, 2,048 -> 16,384, 8,192 -> 2,048) took x0.84-0.85 the time
#: of one tile at a time with 8 (x0.90-0.92 with 4, x1.00 with 2), a 360M's 32 (960 and 2,560
#: inputs) x0.88 (x0.94-0.99 with 4), in two or three runs (2-core AMX Xeon, bf16 rows, 2026-12-06).
A8_STREAMS_AMX = 8
#: The tiles a one-row int4 product of :data:`A8_STREAM_INPUTS_ZEN5` inputs or more reads at once on
#: Zen 5 (family 26): a 1.7B's and a 3B's down projection (8,192 inputs) at 4 streams, the other
#: layers at one, alternated step by step with every layer at one: 1.7B x0.95-0.99 (five runs), 3B
#: x0.96-1.00 (five); those layers at 8: x0.97 and x1.01. Every layer at 4 (the 3B's 3,072 inputs
#: too) took x1.09, and on 2026-12-05 every layer at 2 x1.12, at 4 x1.06-1.11, 8 from 3,072 inputs
#: x1.04 (Zen 5 EPYC, 2 threads, ``benchmarks/bench_a8_streams.py --step``).
A8_STREAMS_ZEN5 = 4
#: The fewest inputs at which a one-row int4 product reads :data:`A8_STREAMS_ZEN5` tiles at once on
#: Zen 5: measured at 8,192 (against 2,048 and 3,072, where more than one was slower); a Qwen2.5's
#: 8,960 and 11,008 fall above it, unmeasured.
A8_STREAM_INPUTS_ZEN5 = 8192
#: The fewest inputs at which a one-row int4 product reads :data:`A8_STREAMS` tiles at once on Zen
#: 4: a long tile (3,072 inputs: 28 KB) read alone took x1.12-1.39 the time of 8 at once; at a
#: 1.7B's 2,048 inputs 8 were even to x0.83, at a 360M's 960 and 2,560 x0.95-0.98 alone but a 360M
#: step with every layer at 8 took x1.05 the time of its layers at 1 (Zen 4 EPYC, 2026-12-05:
#: ``benchmarks/bench_a8_streams.py``).
A8_STREAM_INPUTS = 3072
#: The tiles a one-row product of the int8 layout (:func:`~.quant_kernel.int8g_linear`) reads at
#: once on Zen 5, through the 512-bit path, every layer: a step alternating with one tile at a time
#: on the 256-bit path (the path below :data:`~.quant_kernel.INT8G_WIDE_ROWS` rows) took, in four
#: runs a shape, x0.86-1.00 at 360M, x0.84-0.96 at 1.7B and x0.85-0.97 at 3B with 4; with 2 x0.86 at
#: 3B, with 8 x1.13 at 1.7B (one run each; Zen 5 EPYC, family 26, 2 threads, 2026-12-05,
#: ``bench_a8_streams.py --layout int8 --step S``). One row of 2,048 -> 16,384 alone: 512-bit one
#: tile x0.90, two x0.86, four x0.76. Not measured on Zen 4, whose one row stays on the 256-bit path
#: (:data:`~.quant_kernel.INT8G_WIDE_ROWS`). On the AMX Xeon (float32 rows, a Q8_0 file's, the 1.7B
#: shape's 24 layers, 2026-12-06): 512-bit 4 tiles x0.85 the time of one tile on the 256-bit path, 8
#: x0.86, 512-bit one tile x0.88.
INT8G_STREAMS = 4
#: The tiles a one-row product of either layout (int4 in 8-bit steps, the int8 layout) reads at once
#: on the ``vnni`` kind (AVX512-VNNI without AVX512-BF16: Intel's Ice Lake and Cascade Lake),
#: through the 512-bit path, every layer. Measured on the 2-core Ice Lake Xeon (model 106,
#: 2026-12-07, ``benchmarks/bench_a8_streams.py --step S --streams N``): a batch-1 step alternating
#: with every layer at one stream took, in int4, x0.83-0.87 at 360M (three runs; 4 streams
#: x0.85-0.87), x0.79 at 1.7B (4: x0.83) and x0.78 at 3B; in the int8 layout x0.78-0.82 at 360M and
#: 1.7B (4: x0.82-0.85) and x0.79 at 3B. Alone from memory, one row, 8 tiles took x0.64-0.84 (int4)
#: and x0.69-0.76 (int8) the time of one.
A8_STREAMS_VNNI = 8


def a8_streams(
    in_features: int,
    flags: Collection[str] | None = None,
    model: CpuModel | None = None,
    *,
    int8_layout: bool = False,
) -> int:
    """The tiles a one-row int8-rows product of ``in_features`` inputs reads at once (the op's
    ``streams``), where it was measured to pay: int4 on Zen 4 :data:`A8_STREAMS` from
    :data:`A8_STREAM_INPUTS` inputs on, on Zen 5 :data:`A8_STREAMS_ZEN5` from
    :data:`A8_STREAM_INPUTS_ZEN5` on, on an AMX host :data:`A8_STREAMS_AMX`; the int8 layout
    (``int8_layout``) on Zen 5 and AMX hosts :data:`INT8G_STREAMS`; both layouts on the ``vnni``
    kind (Ice Lake) :data:`A8_STREAMS_VNNI`; else 1. ``flags`` and ``model`` default to this
    CPU's, ``model`` only where ``flags`` do too (a flag set alone, as tests give, names no
    model)."""
    have = host_flags() if flags is None else flags
    kind = host_kind(have)
    generation = zen(host_model() if model is None and flags is None else model, kind)
    if kind.name == "vnni" and "avx512_vnni" in have:  # the 512-bit path, either layout
        return A8_STREAMS_VNNI
    if int8_layout:
        return INT8G_STREAMS if generation == 5 or kind.name == "amx" else 1
    if kind.name == "amx":
        return A8_STREAMS_AMX
    if generation == 4 and in_features >= A8_STREAM_INPUTS:
        return A8_STREAMS
    if generation == 5 and in_features >= A8_STREAM_INPUTS_ZEN5:
        return A8_STREAMS_ZEN5
    return 1
