"""A batch-1 decode step per weight format against its memory floor, on a model shape built here.

The shape is SmolLM2-360M's (``LlamaConfig``: hidden 960, 32 layers, 15 heads / 5 KV heads,
MLP 2,560, vocabulary 49,152, tied embeddings) with random weights, saved in bf16 with
``save_pretrained`` in a temp folder, or once under ``--folder`` and kept there (a step's time
does not depend on the weights' values).
Each format loads it as ``batchline run`` and ``serve`` do (``load_text_generator``, ``--dtype``,
``--set weights=...``); one sequence of a ``--prompt-tokens`` prompt then decodes, and the
median of its decode steps is the step time. The floor is the bytes a step reads (every
linear's weight, the lm_head's too: ``quant_linear.step_weight_bytes``) divided by the host's
copy bandwidth, measured here first and after each format, the best of them (``torch``
copying a ``--copy-mib`` buffer, counted as the bytes read plus the bytes written per second,
STREAM's convention). Printed: per format its
weight bytes, the floor, the step's median and its ratio to the floor (issue 52's bar: 1.3),
and each format's step against the first one's (bf16's by default).

    python benchmarks/bench_quant_step.py           # 360M: bf16, int8 and int4 as `auto` takes them
    python benchmarks/bench_quant_step.py --shape 1.7b --formats bfloat16,int4
    python benchmarks/bench_quant_step.py --shape tiny --steps 4 # smoke run (seconds)
    python benchmarks/bench_quant_step.py --formats float32,bfloat16,int4:float32  # no AVX512-BF16
    python benchmarks/bench_quant_step.py --formats float32,int4:float32:float,int4:float32:int8
    python benchmarks/bench_quant_step.py --formats bfloat16:onednn,bfloat16:tiles
    python benchmarks/bench_quant_step.py --shape 3b --rss --folder DIR  # peak RSS per format
    python benchmarks/bench_quant_step.py --one-call --threads 2  # layers in one call or a loop
    python benchmarks/bench_quant_step.py --one-region --threads 2 --formats int4:auto  # batch 1

``--split`` also runs one row through the step's linears alone (each layer's q/k/v, o, gate/up
and down and the lm_head, as the lean loop calls them) after each step, and prints their median
and what the rest of the step costs a layer: the norms, the attention, the Python between.

``--one-call`` alternates, in one process per format, decode runs of the step's layers in one
call of the kernel library (``csrc/decode_layers.cpp``, the default where the model's products
are the library's) and of the Python loop over them (the same bits), ``--repeats`` times, and
prints each side's median steps and the loop's time over the one call's, pair by pair.
``--one-region`` does the same within the one call: a batch-1 step of float32 rows on int8-row
products in one parallel region (``DecodeLayers.use_one_row``, the default where it is taken)
against the same layers op by op (the same bits).

``--alternate`` loads every format at once and takes their decode steps in turn, one step of
each a round (every other round in the reverse order), so that the formats' steps meet the host
at the same moments: timed one after another, a ratio between formats is partly the host's,
whose copy bandwidth moved between 43 and 80 GB/s within a minute (Zen 5 EPYC, 2026-12-05).
Alternated, a 1.7B int4 step was x0.43 bf16's in a run whose copy bandwidth reached 80 GB/s and
x0.36 in one near 45: the ratio itself moves with the host's speed, int4's step lying further
above its floor (x1.66 where bf16's was x1.16, the fast run).

A format ending in ``@4k`` keeps its weights in the pages the allocator gave
(``--set huge_pages=false``); without it the load moves them into 2 MiB pages, as ``run`` and
``serve`` do. ``--alternate --formats int4:auto,int4:auto@4k`` times what that buys.

``--busy 0,0.25,0.5`` times the step while another process keeps one core busy that share of
each 2 ms (0: none), as a server's HTTP thread and its clients do beside the step on a small
host; each format's median step per share and its ratio to the first share's.

``--rss`` times nothing: each format loads the shape in a process of its own (the folder built
once, under ``--folder`` if given, and kept there), and its peak resident memory after loading
and one short answer is printed against bf16's (issue 52's bar for int4 at 3B: 0.35x).

Needs ``batchline[generate]``. One intra-op thread unless ``--threads``. The lead runs it on a
quiet machine: on a loaded one the floor and the steps both move.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# name -> LlamaConfig fields (hidden, intermediate, layers, heads, kv heads)
SHAPES = {
    "tiny": (128, 256, 2, 4, 2),
    "360m": (960, 2560, 32, 15, 5),
    "1.7b": (2048, 8192, 24, 32, 32),
    "3b": (3072, 8192, 28, 24, 8),  # Llama-3.2-3B's layers (SmolLM2's vocabulary, as all here)
}
VOCAB = 49_152


def copy_bandwidth(mib: int, repeats: int = 5) -> float:
    """Bytes per second of a large tensor copy (read + write), the best of ``repeats``, both
    buffers in 2 MiB pages where the kernel grants them, as the engine holds its weights (in
    4 KiB pages a 512 MiB copy made x0.94 of this rate, the two taken in turn: Zen 4 EPYC,
    2026-12-06), so that the floor is not lowered by pages the step does not read from."""
    src, dst = _copy_buffers(mib)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


@functools.cache
def _copy_buffers(mib: int) -> tuple[Any, Any]:
    """:func:`copy_bandwidth`'s two float32 buffers of ``mib`` MiB, made and moved into 2 MiB
    pages once a process (~1.3 s a pair here), not at each of a run's measurements."""
    import torch

    from batchline.models.generation.huge_pages import into_huge_pages

    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.zeros_like(src)
    into_huge_pages([src, dst])
    return src, dst


def build_folder(shape: str, root: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, mlp, layers, heads, kv_heads = SHAPES[shape]
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: a 3B shape never holds fp32 copies
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    folder = root / f"llama-{shape}"
    model.save_pretrained(folder)
    _save_tokenizer(folder)
    return folder


def _save_tokenizer(folder: Path) -> None:
    """SmolLM2's tokenizer (its GGUF converted first, ~30 s once, where it is not yet), else,
    where the smollm2 weights are not pulled, a byte-level one, saying so: its prompts are ~4x
    the tokens, and llama.cpp's converter refuses it."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from batchline._errors import ModelError
    from batchline.models.generation.smollm2 import smollm2_folder

    try:
        found = smollm2_folder()
    except ModelError as exc:
        print(
            f"SmolLM2's tokenizer is not here ({exc}); {folder} gets a byte-level one: "
            "its prompts are ~4x the tokens, and llama.cpp's converter refuses it",
            flush=True,
        )
    else:
        AutoTokenizer.from_pretrained(found).save_pretrained(folder)
        return
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)


def decode_steps(
    engine: Any, prompt_tokens: int, steps: int, between: list[float] | None = None
) -> list[float]:
    """Seconds of each decode step of one sequence (the prefill step left out); with
    ``between``, the seconds of one pass over the step's linears alone (:func:`linears_pass`)
    after each step are appended to it."""
    prefilled(engine, prompt_tokens, steps)
    alone = None if between is None else linears_pass(engine)
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        if alone is not None and between is not None:
            start = time.perf_counter()
            alone()
            between.append(time.perf_counter() - start)
    return times


def prefilled(engine: Any, prompt_tokens: int, steps: int) -> None:
    """One sequence of a ``prompt_tokens`` prompt added to ``engine`` and prefilled, ``steps``
    decode steps left to it (greedy, past any EOS)."""
    from batchline.models.generation.engine import GenerationRequest, SamplingParams

    prompt = tuple(range(10, 10 + prompt_tokens))
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    engine.add_request(GenerationRequest("one", prompt, params))
    engine.step()  # the prefill


def linears_pass(engine: Any) -> Any:
    """A callable that runs one row through every linear a decode step runs, in the step's
    order and as its lean loop calls them (q/k/v, o, gate/up, down of each layer, then the
    lm_head), and nothing else: the weights' share of a step."""
    import torch

    lean = engine._lean
    if lean is None:
        raise SystemExit("--split needs the lean forward (a Llama-family folder)")
    config = engine._model.config
    hidden = torch.randn(1, int(config.hidden_size))
    attended = torch.randn(1, lean._heads * lean._head_dim)
    act = torch.randn(1, int(config.intermediate_size))
    dtype = next(engine._model.parameters()).dtype
    hidden, attended, act = (t.to(dtype) for t in (hidden, attended, act))
    calls = []
    for layer in lean._layers:
        qkv = layer.qkv_step or layer.qkv
        up = layer.gate_up_joined or layer.gate_up
        calls += [(qkv, hidden), (layer.o, attended), (up, hidden), (layer.down, act)]
    calls.append((lean._lm_head, hidden))

    def run() -> None:
        with torch.inference_mode():
            for linear, x in calls:
                linear(x)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="360m")
    # the int formats as `serve --set weights=...` runs them (the dtype auto takes on this CPU)
    parser.add_argument("--formats", default="bfloat16,int8:auto,int4:auto")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--copy-mib", type=int, default=512)
    parser.add_argument("--rss", action="store_true", help="peak RSS per format, no timing")
    parser.add_argument(
        "--split",
        action="store_true",
        help="also time the step's linears alone after each step: what the rest costs a layer",
    )
    parser.add_argument(
        "--one-call",
        action="store_true",
        help="alternate the layers in one call with the Python loop over them, per format",
    )
    parser.add_argument(
        "--one-region",
        action="store_true",
        help="alternate a batch-1 step in one parallel region with the same layers op by op",
    )
    parser.add_argument(
        "--repeats", type=int, default=8, help="--one-call's and --one-region's pairs of runs"
    )
    parser.add_argument(
        "--alternate",
        action="store_true",
        help="load every format at once and take their decode steps in turn",
    )
    parser.add_argument(
        "--busy", help="comma-separated shares of one core another process keeps busy (0-1)"
    )
    parser.add_argument(
        "--folder", type=Path, help="where the shape's folder is kept (built there once)"
    )
    parser.add_argument("--_load-one", dest="load_one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.load_one:
        print(f"peak-rss {_load_one(args.folder, args.load_one)}")
        return
    if args.rss:
        _rss(args)
        return
    if args.one_call:
        _one_call(args)
        return
    if args.one_region:
        _one_region(args)
        return
    if args.busy:
        _busy(args)
        return
    if args.alternate:
        if args.split:
            parser.error("--split times each format's steps alone: not with --alternate")
        _alternate(args)
        return

    import torch

    from batchline.models.generation.load import load_text_generator
    from batchline.models.generation.quant_linear import step_weight_bytes
    from batchline.models.specs import parse_spec

    torch.set_num_threads(args.threads)
    # measured again after each format, the best taken: on a shared host the memory's bandwidth
    # moves by x1.7 within minutes, and a floor from a slow moment flatters every step
    bandwidths = [copy_bandwidth(args.copy_mib)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = _folder(args.folder or Path(tmp), args.shape)
        for fmt in args.formats.split(","):
            loaded = load_text_generator(parse_spec(f"{folder}/"), _knobs(fmt, args.threads))
            engine = loaded.engine
            assert engine is not None
            read = step_weight_bytes(engine._model)
            alone: list[float] | None = [] if args.split else None
            with torch.inference_mode():
                times = decode_steps(engine, args.prompt_tokens, args.steps, alone)
            layers = len(engine._lean._layers) if engine._lean is not None else 0
            loaded.close()
            bandwidths.append(copy_bandwidth(args.copy_mib))
            linears = statistics.median(alone) if alone else None
            rows.append((fmt, read, statistics.median(times), linears, layers))
    _report(args, rows, bandwidths, "before the first format and after each")


Row = tuple[str, int, float, float | None, int]  # format, bytes read, step, linears alone, layers


def _report(args: argparse.Namespace, rows: list[Row], bandwidths: list[float], when: str) -> None:
    """The table: each format's bytes, floor (at the best of ``bandwidths``), median step, and
    its ratios to the floor and to the first format's step."""
    bandwidth = max(bandwidths)
    print(
        f"copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write, the best of "
        f"{len(bandwidths)} measurements: {when}; the least "
        f"{min(bandwidths) / 1e9:.1f}), {args.threads} thread(s)"
    )
    base_fmt, base = rows[0][0], rows[0][2]  # the first format listed
    prompt = f"a {args.prompt_tokens}-token prompt"
    alternated = ", the formats' steps alternated" if args.alternate else ""
    print(f"{args.shape}, batch 1, {args.steps} decode steps after {prompt}{alternated}")
    split = " linears alone | beside them, a layer |" if args.split else ""
    print(
        f"| format | weights read per step | memory floor | step (median) | x floor "
        f"| x {base_fmt} |{split}"
    )
    print("|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if args.split else ""))
    for fmt, read, step, linears, layers in rows:
        floor = read / bandwidth
        cells = ""
        if linears is not None:
            cells = f" {linears * 1e3:.2f} ms | {(step - linears) / layers * 1e6:.0f} µs |"
        print(
            f"| {fmt} | {read / 2**20:.0f} MiB | {floor * 1e3:.2f} ms | {step * 1e3:.2f} ms | "
            f"{step / floor:.2f} | {step / base:.2f} |{cells}"
        )


def _alternate(args: argparse.Namespace) -> None:
    """Every format loaded at once, one sequence each, their decode steps taken in turn (every
    other round in the reverse order), so that each format's median step meets the host at the
    same moments as the others' (timed one after another, on a host whose bandwidth moves within
    seconds, a ratio between formats is partly the host's); the copy bandwidth measured before,
    every 16 rounds and after, the best taken for the floor."""
    import torch

    from batchline.models.generation.load import load_text_generator
    from batchline.models.generation.quant_linear import step_weight_bytes
    from batchline.models.specs import parse_spec

    torch.set_num_threads(args.threads)
    formats = args.formats.split(",")
    bandwidths = [copy_bandwidth(args.copy_mib)]
    times: dict[str, list[float]] = {fmt: [] for fmt in formats}
    reads: dict[str, int] = {}
    loaded = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = _folder(args.folder or Path(tmp), args.shape)
        try:
            for fmt in formats:
                loaded[fmt] = load_text_generator(
                    parse_spec(f"{folder}/"), _knobs(fmt, args.threads)
                )
            engines = {fmt: m.engine for fmt, m in loaded.items()}
            with torch.inference_mode():
                for engine in engines.values():
                    prefilled(engine, args.prompt_tokens, args.steps)
                for turn in range(args.steps):
                    for fmt in formats if turn % 2 == 0 else formats[::-1]:
                        start = time.perf_counter()
                        engines[fmt].step()
                        times[fmt].append(time.perf_counter() - start)
                    if turn % 16 == 15:
                        bandwidths.append(copy_bandwidth(args.copy_mib))
            reads = {fmt: step_weight_bytes(engine._model) for fmt, engine in engines.items()}
        finally:
            for model in loaded.values():
                model.close()
    bandwidths.append(copy_bandwidth(args.copy_mib))
    rows = [(fmt, reads[fmt], statistics.median(times[fmt]), None, 0) for fmt in formats]
    _report(args, rows, bandwidths, "before the steps, every 16 rounds of them and after")


def _one_call(args: argparse.Namespace) -> None:
    """Per format, decode runs with the layers in one call and through the Python loop,
    alternated in one process: each side's median step per run, and loop / one call per pair."""

    def switch(lean: Any, on: bool) -> None:
        lean._one_call_on = on

    def taken(lean: Any) -> bool:
        return any(stack is not None for stack in lean._one_calls.values())

    _two_ways(args, ("layers in one call", "one call", "loop"), switch, taken)


def _one_region(args: argparse.Namespace) -> None:
    """Per format, batch-1 decode runs with the one call's layers in one parallel region and op
    by op, alternated in one process, as :func:`_one_call` prints them."""

    def stacks(lean: Any) -> list[Any]:
        return [found[0] for found in lean._one_calls.values() if found is not None]

    def switch(lean: Any, on: bool) -> None:
        for stack in stacks(lean):
            stack.use_one_row(on)

    def taken(lean: Any) -> bool:
        return any(stack.one_row() for stack in stacks(lean))

    _two_ways(args, ("a batch-1 step in one region", "one region", "op by op"), switch, taken)


def _two_ways(
    args: argparse.Namespace,
    names: tuple[str, str, str],
    switch: Callable[[Any, bool], None],
    taken: Callable[[Any], bool],
) -> None:
    """Per format, decode runs with ``switch(lean, True)`` and ``switch(lean, False)``
    alternated in one process: each side's median step per run, and the second's time over the
    first's per pair. ``names``: what is compared, then the two sides; ``taken(lean)``: whether
    the model has the first side (asked with it on)."""
    import torch

    what, first, second = names
    title = "median step (ms) of each run"
    for fmt, engine in _each_format(args, title):
        lean = engine._lean
        if lean is None:
            raise SystemExit(f"comparing {what} needs the lean forward (a Llama-family folder)")
        runs: dict[bool, list[float]] = {True: [], False: []}
        with torch.inference_mode():
            decode_steps(engine, args.prompt_tokens, 4)  # the one call made, warm
            for _ in range(args.repeats):
                for on in (True, False):
                    switch(lean, on)
                    times = decode_steps(engine, args.prompt_tokens, args.steps)
                    runs[on].append(statistics.median(times) * 1e3)
            switch(lean, True)
        ratios = sorted(b / a for a, b in zip(runs[True], runs[False], strict=True))
        print(f"{fmt}: {what} {'taken' if taken(lean) else 'NOT taken (no such model)'}")
        width = max(len(first), len(second)) + 1
        print(f"  {first + ':':<{width}} " + " ".join(f"{v:.2f}" for v in runs[True]))
        print(f"  {second + ':':<{width}} " + " ".join(f"{v:.2f}" for v in runs[False]))
        print(
            f"  {second} / {first}: median x{statistics.median(ratios):.3f}, "
            f"pairs x{ratios[0]:.3f}-x{ratios[-1]:.3f}"
        )


def _each_format(args: argparse.Namespace, title: str) -> Any:
    """Each ``--formats`` entry's engine on the shape's folder, loaded in turn (and closed
    after), ``title`` printed first."""
    import torch

    from batchline.models.generation.load import load_text_generator
    from batchline.models.specs import parse_spec

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = _folder(args.folder or Path(tmp), args.shape)
        print(f"{args.shape}, batch 1, {args.threads} thread(s), {title}")
        for fmt in args.formats.split(","):
            loaded = load_text_generator(parse_spec(f"{folder}/"), _knobs(fmt, args.threads))
            try:
                yield fmt, loaded.engine
            finally:
                loaded.close()


def _burn(share: float, stop: Any) -> None:
    """Keep this process busy ``share`` of each 2 ms until ``stop`` is set."""
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < 0.002 * share:
            pass
        time.sleep(0.002 * (1 - share))


def _busy(args: argparse.Namespace) -> None:
    """Per format, the median step while another process keeps one core busy each share."""
    import multiprocessing

    import torch

    shares = [float(share) for share in args.busy.split(",")]
    if any(not 0 <= share <= 1 for share in shares):
        raise SystemExit("--busy: shares of one core, each from 0 to 1")
    context = multiprocessing.get_context("spawn")
    for fmt, engine in _each_format(args, "median step beside a busy core"):
        medians = []
        with torch.inference_mode():
            decode_steps(engine, args.prompt_tokens, 4)  # warm
            for share in shares:
                stop = context.Event()
                burner = context.Process(target=_burn, args=(share, stop)) if share else None
                if burner is not None:
                    burner.start()
                    time.sleep(0.5)  # started
                try:
                    times = decode_steps(engine, args.prompt_tokens, args.steps)
                    medians.append(statistics.median(times))
                finally:
                    stop.set()
                    if burner is not None:
                        burner.join()
        cells = ", ".join(
            f"{share:.0%} busy {m * 1e3:.2f} ms (x{m / medians[0]:.2f})"
            for share, m in zip(shares, medians, strict=True)
        )
        print(f"{fmt}: {cells}")


def _load_one(folder: Path, fmt: str) -> int:
    """Load ``folder`` in ``fmt``, answer one short request, and return the peak RSS (bytes)."""
    import resource

    from batchline.models.generation.load import load_text_generator
    from batchline.models.specs import parse_spec

    loaded = load_text_generator(parse_spec(f"{folder}/"), _knobs(fmt))
    engine = loaded.engine
    assert engine is not None
    decode_steps(engine, 16, 2)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _knobs(fmt: str, threads: int | None = None) -> Any:
    """The ``Knobs`` of a ``--formats`` entry: ``bfloat16`` or ``float32`` (dense; ``bfloat16:
    onednn`` or ``bfloat16:tiles`` names what computes its linears, ``auto`` where left out), or
    ``int8`` / ``int4`` computing in bf16, or ``int4:float32`` (a weight format, a dtype:
    ``int4:auto`` the one ``auto`` takes, what ``serve --set weights=int4`` runs), and
    ``int4:float32:int8`` (and the activations: ``float``, ``int8``; ``auto`` where left out);
    any of them ``@4k``: the weights left in the allocator's pages (``huge_pages=false``)."""
    from batchline.models.config import Knobs

    fmt, _, pages = fmt.partition("@")
    huge = pages != "4k"
    dense, _, kernel = fmt.partition(":")
    if dense in ("bfloat16", "float32"):
        return Knobs(
            dtype=dense,
            weights="float",
            dense_linears=kernel or "auto",
            generation_threads=threads,
            huge_pages=huge,
        )
    weights, _, rest = fmt.partition(":")
    dtype, _, activations = rest.partition(":")
    return Knobs(
        dtype=dtype or "bfloat16",
        weights=weights,
        activations=activations or "auto",
        generation_threads=threads,
        huge_pages=huge,
    )


def _folder(root: Path, shape: str) -> Path:
    """``shape``'s folder under ``root``, built there unless an earlier run left it."""
    folder = root / f"llama-{shape}"
    if not (folder / "config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        build_folder(shape, root)
    return folder


def _rss(args: argparse.Namespace) -> None:
    import subprocess
    import sys

    folder = _folder(args.folder or Path(tempfile.mkdtemp(prefix="bench-rss-")), args.shape)
    peaks = {}
    for fmt in args.formats.split(","):
        done = subprocess.run(
            [sys.executable, __file__, "--_load-one", fmt, "--folder", str(folder)],
            capture_output=True,
            text=True,
            check=True,
        )
        line = next(x for x in done.stdout.splitlines() if x.startswith("peak-rss "))
        peaks[fmt] = int(line.split()[1])
    base = peaks.get("bfloat16", next(iter(peaks.values())))
    print(f"{args.shape}: peak RSS after loading and one short answer, a process each")
    print("| format | peak RSS | x bf16 |")
    print("|---|---:|---:|")
    for fmt, peak in peaks.items():
        print(f"| {fmt} | {peak / 2**30:.2f} GiB | {peak / base:.2f} |")


if __name__ == "__main__":
    main()
