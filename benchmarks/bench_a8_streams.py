"""The int8-rows int4 kernel at one row, one tile at a time against several (``streams``), and a
whole batch-1 step through the layers' step path against the path before it.

Per linear (``--shapes``, ``in x out``): one random weight in the 8-bit-steps layout
``--set weights=int4`` packs, held in ``--copies`` copies called in turn so that each call reads
its weight from memory, as a decode step does (copies of ``--least-mib`` at least: a 360M's
layer in 11 copies fits in a Zen 4's 32 MiB L3); the op is called with ``streams`` 1, 2, 4 and 8
in turn, call by call, so that a load on the machine falls on all alike. Printed: the median µs
of each and its time as a fraction of one stream's (below 1: faster), and the GB/s one stream
read.

``--layout int8``: the same for the int8 layout in groups of 32 (``--set weights=int8``), whose
one stream is the 256-bit path it takes at one row without streams.

With ``--step SHAPE`` (a folder ``bench_quant_step.py`` built under ``--folder``): the shape
loads with ``weights=`` the layout in float32 with int8 rows; then one sequence decodes and its
steps alternate between the lean loop as loaded (each layer's ``step_forward``, its chosen
streams), the same loop with every layer at one stream, and one built over the layers'
``forward`` with one stream (what a step ran before 2026-12-05). Printed: the median step of
each and the loaded loop's time over it.

    python benchmarks/bench_a8_streams.py                          # 1.7B and 3B shapes (~1 min)
    python benchmarks/bench_a8_streams.py --shapes 960x1600,960x5120,2560x960   # 360M's
    python benchmarks/bench_a8_streams.py --shapes 64x64 --copies 2 --calls 3  # smoke run
    python benchmarks/bench_a8_streams.py --step 1.7b --folder /tmp/bench-sizes
    python benchmarks/bench_a8_streams.py --layout int8 --step 3b --folder /tmp/bench-sizes
    python benchmarks/bench_a8_streams.py --step 1.7b --streams 8 --folder /tmp/bench-sizes

Needs ``batchline[generate]`` and the kernel library built with AVX512-VNNI (the 512-bit path:
elsewhere ``streams`` is not read). Threads: ``--threads`` (default 2). The lead runs it on a
quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from batchline.models.generation import quant_kernel
from batchline.models.generation.quant_codes import quantize_int4_steps, quantize_int8_groups

# SmolLM2-1.7B's fused gate/up and down, a 3B Llama's fused q/k/v, gate/up and down
DEFAULT_SHAPES = "2048x16384,8192x2048,3072x5120,3072x16384,8192x3072"
STREAMS = (1, 2, 4, 8)


def packed_weight(k: int, n: int, layout: str) -> torch.Tensor:
    """A random ``(n, k)`` weight in the layout ``--set weights=int4`` (8-bit steps) or ``int8``
    (groups of 32) packs for int8 rows."""
    weight = torch.randn(n, k) * 0.05
    if layout == "int8":
        codes, scales = quantize_int8_groups(weight, 32)
        return quant_kernel.pack_int8g(codes, scales)
    steps = quantize_int4_steps(weight)
    return quant_kernel.pack_int4_steps(steps.codes, steps.steps, steps.offsets, steps.units)


def per_linear(
    k: int, n: int, copies: int, calls: int, least_mib: int, layout: str = "int4"
) -> tuple[dict[int, float], int]:
    """Median seconds of a one-row call per streams count (the int8 layout's one stream: the
    256-bit path it takes at one row without streams, ``quant_kernel.int8g_width``), and the
    bytes a call reads."""
    packed = packed_weight(k, n, layout)
    copies = max(copies, -(-least_mib * 2**20 // packed.numel()))  # more than the caches hold
    held = [packed.clone() for _ in range(copies)]
    x = torch.randn(1, k)
    ops = torch.ops.batchline
    op = ops.int8g_linear_a8 if layout == "int8" else ops.int4_linear_a8
    times: dict[int, list[float]] = {s: [] for s in STREAMS}
    call = 0
    for _ in range(calls + 2):  # the first two rounds warm up
        for streams in STREAMS:
            call += 1
            w = held[call % copies]
            width = quant_kernel.int8g_width(1, streams) if layout == "int8" else 512
            start = time.perf_counter()
            op(x, w, n, None, width, streams)
            times[streams].append(time.perf_counter() - start)
    return {s: statistics.median(t[2:]) for s, t in times.items()}, packed.numel()


def step_paths(
    shape: str,
    folder: Path,
    steps: int,
    threads: int,
    layout: str = "int4",
    streams: int | None = None,
) -> dict[str, float]:
    """Median step (seconds) per side, the sides alternated step by step: the step path as
    loaded ("as loaded": each layer's chosen streams, or every layer at ``streams`` where it
    is given), the same path with every layer at one stream ("one stream"), and the loop
    before the step path ("before": each layer's ``forward``, one stream)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_quant_step import _knobs

    from batchline.models.generation.engine import GenerationRequest, SamplingParams
    from batchline.models.generation.lean_llama import LeanForward
    from batchline.models.generation.load import load_text_generator
    from batchline.models.generation.quant_linear import QuantLinear
    from batchline.models.specs import parse_spec

    loaded = load_text_generator(
        parse_spec(f"{folder}/llama-{shape}/"), _knobs(f"{layout}:float32:int8", threads)
    )
    engine = loaded.engine
    assert engine is not None
    layers = [m for m in engine._model.modules() if isinstance(m, QuantLinear)]
    if streams is not None:  # the step path as loaded, rebuilt over every layer at `streams`
        for m in layers:
            m.streams = streams
        engine._lean = LeanForward(engine._model, engine._lean._ops)
    now = engine._lean
    chosen = [m.streams for m in layers]
    step_forwards = [m.step_forward for m in layers]
    for m in layers:
        m.streams = 1
    one = LeanForward(engine._model, now._ops)  # the step path, its products at one stream
    for m in layers:  # the loop before: each layer's forward, one stream
        m.step_forward = (lambda forward: lambda: forward)(m.forward)  # type: ignore[method-assign]
    before = LeanForward(engine._model, now._ops)
    for m, step_forward in zip(layers, step_forwards, strict=True):
        m.step_forward = step_forward  # type: ignore[method-assign]
    sides = {"as loaded": now, "one stream": one, "before": before}
    times: dict[str, list[float]] = {name: [] for name in sides}
    try:
        with torch.inference_mode():
            engine.add_request(
                GenerationRequest("one", tuple(range(10, 70)), SamplingParams(max_tokens=steps))
            )
            engine.step()  # the prefill
            names, turn = list(sides), 0
            while engine.has_unfinished():
                name = names[turn % len(names)]
                engine._lean = sides[name]
                for m, streams in zip(layers, chosen, strict=True):
                    m.streams = streams if name == "as loaded" else 1
                start = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - start)
                turn += 1
    finally:
        loaded.close()
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="in x out, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=40, help="timed calls per streams count")
    parser.add_argument("--copies", type=int, default=11, help="copies of each weight, at least")
    parser.add_argument(
        "--least-mib", type=int, default=256, help="copies enough to hold this many MiB"
    )
    parser.add_argument(
        "--layout",
        choices=("int4", "int8"),
        default="int4",
        help="the weights' layout: int4 in 8-bit steps, or int8 in groups of 32",
    )
    parser.add_argument("--step", help="a bench_quant_step.py shape: 360m, 1.7b or 3b")
    parser.add_argument("--folder", type=Path, help="where bench_quant_step.py built the shape")
    parser.add_argument("--steps", type=int, default=200, help="decode steps (--step)")
    parser.add_argument(
        "--streams",
        type=int,
        choices=STREAMS,
        help="--step: every layer at so many streams on the side as loaded, not the host's "
        "rule (quant_streams.a8_streams): to measure a host whose rule says one",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    here, why = quant_kernel.own_kernels(dtype=torch.float32)
    if not here or not quant_kernel.int8_activations_here()[0]:
        sys.exit(f"the int8-rows kernel does not run here: {why}")
    if args.step:
        if args.folder is None:
            sys.exit("--step needs --folder (bench_quant_step.py --folder DIR builds it)")
        medians = step_paths(
            args.step, args.folder, args.steps, args.threads, args.layout, args.streams
        )
        rule = "the host's rule" if args.streams is None else f"{args.streams} stream(s)"
        print(
            f"{args.step}, {args.layout} with int8 rows, batch 1, {args.threads} thread(s), "
            f"as loaded: {rule}"
        )
        loaded = medians["as loaded"]
        for name, median in medians.items():
            print(f"{name}: {median * 1e3:.2f} ms a step (as loaded x{loaded / median:.3f} it)")
        return
    print(
        f"{args.layout}, one row, {args.threads} thread(s), each weight in copies of "
        f"{args.least_mib} MiB at least"
    )
    print("| shape | " + " | ".join(f"{s} stream(s)" for s in STREAMS) + " | GB/s at 1 |")
    print("|---|" + "---:|" * (len(STREAMS) + 1))
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        medians, read = per_linear(k, n, args.copies, args.calls, args.least_mib, args.layout)
        one = medians[1]
        cells = [f"{medians[s] * 1e6:.0f} µs (x{medians[s] / one:.2f})" for s in STREAMS]
        print(f"| {k} -> {n} | " + " | ".join(cells) + f" | {read / one / 1e9:.1f} |")


if __name__ == "__main__":
    main()
