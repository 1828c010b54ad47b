"""batchline on vLLM against vLLM itself, in one run, on the built-in SmolLM2.

Online: one OpenAI-client workload against each server of ``--servers``, started here one at a
time on 127.0.0.1 (a fresh start per run, so no server idles beside the measured one):

- ``vllm``: vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``) with
  the engine arguments batchline's CPU defaults give (eager, 2,048-token context, 1 GiB KV
  cache, 16 running sequences);
- ``batchline-vllm``: ``batchline serve --generation-backend vllm`` (the same engine);
- ``batchline-torch``: ``batchline serve`` on batchline's own torch engine;
- ``batchline-torch-proc``: the same with ``--set engine_process=true``: the engine and its
  scheduler in a process of their own, off the front end's GIL;
- ``torch-engine``: no server: the same requests submitted in a process of its own to the
  generator ``batchline serve`` builds (``load_text_generator``, the same knobs), by
  ``--concurrency`` tasks, with TTFT at the first delta. ``batchline-torch`` against it is what
  the HTTP front end costs (issue "engines at the limit": server >= 0.85x the engine), and
  ``batchline-torch-proc`` against it what is left of that cost with the engine in its own
  process.

A server may carry settings, ``NAME:KEY=VALUE[:KEY=VALUE...]``, to compare variants in one
run: a batchline server passes each as ``--set KEY=VALUE`` (a knob), vLLM's sets each as an
environment variable, e.g. ``--servers vllm,vllm:VLLM_CPU_OMP_THREADS_BIND=0-1,batchline-torch,
batchline-torch:generation_threads=1``.

The workload: ``--concurrency`` chat clients (16) sending ``--requests`` demo math prompts
(96) through the chat template, greedy, streaming with ``stream_options={"include_usage":
True}``, ``max_tokens`` drawn between ``--min-new`` and ``--max-new`` (8-128, seeded) and
``ignore_eos`` (both servers take it), so every server generates the same tokens. Each dtype
of ``--dtypes`` runs ``--repeats`` interleaved repeats (the server order rotates). Printed per
dtype and server: tokens/s, request latency and TTFT p50/p99 (medians over the repeats), and
the ratios to vLLM's server. The issue's goals: batchline-vllm >= 0.95x vLLM's tokens/s and
TTFT p99 <= 1.2x vLLM's.

Offline (``--offline``, on by default): ``batchline run --generation-backend vllm`` (its job
API, on the demo prompts) against vLLM's ``LLM.generate`` on the same token ids, greedy, at
most ``--offline-new`` tokens each (both end at EOS: greedy on one engine, they generate the
same tokens; the token counts are printed to show it). Each runs in a process of its own;
tokens/s counts generation only, not the engine's start (batchline's includes reading the
prompts and writing the output). Goal: >= 0.95x.

Run it from the vLLM venv (bash scripts/vllm_env.sh makes it), on a quiet machine:

    .venv-vllm/bin/python benchmarks/bench_vs_vllm.py                    # the figures (~25 min)
    .venv-vllm/bin/python benchmarks/bench_vs_vllm.py --requests 8 --repeats 1 \\
        --dtypes float32 --offline-prompts 8                             # smoke run (~5 min)

Its clients are its own, not ``batchline.bench``'s load generator: streamed OpenAI chat timed
per token (TTFT) against servers that batchline does not run, which its targets do not cover.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _servers import free_port, stop, wait_ready

SERVERS = ("vllm", "batchline-vllm", "batchline-torch", "batchline-torch-proc", "torch-engine")
MODEL_NAME = "gen"
# What batchline's CPU defaults give vLLM's engine (batchline.models.generation.load), passed
# to vLLM's own server and LLM as flags so both run the same engine.
KV_CACHE_BYTES = 2**30
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default=",".join(SERVERS), help="comma-separated")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--min-new", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--online", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--offline", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--offline-prompts", type=int, default=96)
    parser.add_argument("--offline-new", type=int, default=64)
    parser.add_argument("--start-timeout-s", type=float, default=300.0)
    # internal: one offline run in a process of its own
    parser.add_argument("--_offline-one", dest="offline_one", help=argparse.SUPPRESS)
    parser.add_argument("--_engine-one", dest="engine_one", help=argparse.SUPPRESS)
    parser.add_argument("--_result", dest="result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_LOOPBACK_IP", "127.0.0.1")
    if args.offline_one:  # vLLM logs to stdout: the result goes to a file
        Path(args.result).write_text(json.dumps(_offline_one(args.offline_one, args)))
        return
    if args.engine_one:
        result = asyncio.run(_engine_one(args.engine_one, _workload(args), args.concurrency))
        Path(args.result).write_text(json.dumps(result.__dict__))
        return

    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = sorted({_variant(s)[0] for s in servers} - set(SERVERS))
    if unknown:
        parser.error(f"unknown server(s) {unknown}; known: {', '.join(SERVERS)}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    from batchline.models.generation.smollm2 import smollm2_folder

    folder = str(smollm2_folder())
    workload = _workload(args)
    if args.online:
        print(
            f"workload: {len(workload)} requests, {args.concurrency} concurrent chat clients, "
            f"greedy, streaming, max_tokens {args.min_new}-{args.max_new} (seed {args.seed}, "
            f"{sum(m for _, m in workload):,} tokens asked for), ignore_eos; "
            f"{args.repeats} interleaved repeat(s)",
            flush=True,
        )
    for dtype in dtypes:
        if args.online:
            _print_online(dtype, _online(servers, dtype, folder, workload, args))
        if args.offline:
            _print_offline(dtype, args)


def _online(
    servers: list[str],
    dtype: str,
    folder: str,
    workload: list[tuple[str, int]],
    args: argparse.Namespace,
) -> dict[str, list[RunResult]]:
    results: dict[str, list[RunResult]] = {s: [] for s in servers}
    for repeat in range(args.repeats):
        # interleaved: the order rotates, and reverses every other repeat
        order = servers[repeat % len(servers) :] + servers[: repeat % len(servers)]
        if repeat % 2:
            order.reverse()
        for server in order:
            result = _measure_server(server, dtype, folder, workload, args)
            results[server].append(result)
            print(f"  [{dtype}, repeat {repeat + 1}] {server}: {result.line()}", flush=True)
    return results


# -- the online workload -----------------------------------------------------------------------


def _workload(args: argparse.Namespace) -> list[tuple[str, int]]:
    from batchline.models.generation.demo import demo_prompts

    draw = random.Random(args.seed)
    return [
        (p["prompt"], draw.randint(args.min_new, args.max_new))
        for p in demo_prompts(args.requests, seed=args.seed)
    ]


@dataclass
class RunResult:
    tokens: int
    wall_s: float
    latencies_s: list[float]
    ttfts_s: list[float]
    failed: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    def p(self, values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    def line(self) -> str:
        return (
            f"{self.tokens_per_s:6.1f} tok/s, latency p50/p99 {self.p(self.latencies_s, 0.5):.2f}"
            f"/{self.p(self.latencies_s, 0.99):.2f} s, TTFT p50/p99 "
            f"{self.p(self.ttfts_s, 0.5):.2f}/{self.p(self.ttfts_s, 0.99):.2f} s, "
            f"{self.tokens:,} tokens" + (f", {self.failed} FAILED" if self.failed else "")
        )


async def _drive(port: int, workload: list[tuple[str, int]], concurrency: int) -> RunResult:
    import httpx
    import openai

    queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
    for item in workload:
        queue.put_nowait(item)
    latencies: list[float] = []
    ttfts: list[float] = []
    tokens = 0
    failed = 0

    # each request on a connection of its own: llama-server closes a kept-alive connection after
    # a few requests, and a request sent on it as it closes failed with a connection error (one
    # of six at one client, 2026-12-04/05); no retries, so a server's own failure still counts
    http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_keepalive_connections=0))
    async with openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1",
        api_key="unused",
        max_retries=0,
        timeout=900,
        http_client=http,
    ) as client:

        async def one(prompt: str, max_tokens: int) -> None:
            nonlocal tokens, failed
            started = time.perf_counter()
            first: float | None = None
            used = None
            try:
                stream = await client.chat.completions.create(
                    model=MODEL_NAME,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=max_tokens,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                async for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.perf_counter()
                    if chunk.usage is not None:
                        used = chunk.usage.completion_tokens
            except openai.OpenAIError as exc:
                failed += 1
                print(f"    request failed: {exc!r}", flush=True)
                return
            ended = time.perf_counter()
            latencies.append(ended - started)
            ttfts.append((first or ended) - started)
            tokens += used or 0

        async def client_loop() -> None:
            while not queue.empty():
                await one(*queue.get_nowait())

        started = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return RunResult(tokens, wall, latencies, ttfts, failed)


def _variant(server: str) -> tuple[str, list[str]]:
    """A server's name and its ``KEY=VALUE`` settings (``NAME:KEY=VALUE:...``)."""
    name, *settings = server.split(":")
    return name, settings


def vllm_server_command(python: str, folder: str, port: int, dtype: str) -> list[str]:
    """vLLM's own OpenAI server on ``folder`` with the engine arguments batchline's CPU
    defaults give it (also ``bench_sizes.py``'s)."""
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        folder,
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes",
        str(KV_CACHE_BYTES),
        "--gpu-memory-utilization",
        "0.3",
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--enforce-eager",
        "--uvicorn-log-level",
        "warning",
    ]


def _server_command(server: str, dtype: str, folder: str, port: int) -> list[str]:
    server, settings = _variant(server)
    if server == "vllm":
        return vllm_server_command(sys.executable, folder, port, dtype)
    backend = "vllm" if server == "batchline-vllm" else "torch"
    # batchline-torch-proc: batchline-torch with the engine in a process of its own
    engine_process = ["--set", "engine_process=true"] if server == "batchline-torch-proc" else []
    return [
        sys.executable,
        "-m",
        "batchline",
        "serve",
        "--model",
        f"{MODEL_NAME}=smollm2",
        "--port",
        str(port),
        "--generation-backend",
        backend,
        # the dtype knob: vLLM's engine reads it; the torch engine as far as it does
        "--set",
        f"dtype={dtype}",
        "--set",
        f"max_running_sequences={MAX_NUM_SEQS}",
        *engine_process,
        *[flag for setting in settings for flag in ("--set", setting)],
        # a slow machine's long requests must not meet serve's 30 s default (vLLM has none)
        "--request-timeout-s",
        "900",
        "--log-level",
        "warning",
    ]


async def _engine_one(dtype: str, workload: list[tuple[str, int]], concurrency: int) -> RunResult:
    """The workload on the generator ``batchline serve`` builds, without the server."""
    from batchline.models.config import Knobs
    from batchline.models.generation import load_text_generator
    from batchline.models.generation.engine import SamplingParams
    from batchline.models.specs import parse_spec

    knobs = Knobs.serving(dtype=dtype, max_running_sequences=MAX_NUM_SEQS)  # as serve has them
    model = await asyncio.to_thread(load_text_generator, parse_spec(f"{MODEL_NAME}=smollm2"), knobs)
    queue = list(reversed(workload))
    latencies: list[float] = []
    ttfts: list[float] = []
    tokens = 0

    async def one(prompt: str, max_tokens: int) -> None:
        nonlocal tokens
        started = time.perf_counter()
        first: float | None = None
        ids = model.encode_chat([{"role": "user", "content": prompt}])
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        stream = model.generator.submit(ids, params)
        async for delta in stream:
            if first is None and delta.text:
                first = time.perf_counter()
        done = await stream.result()
        ended = time.perf_counter()
        latencies.append(ended - started)
        ttfts.append((first or ended) - started)
        tokens += len(done.token_ids)

    async def client_loop(work: list[tuple[str, int]]) -> None:
        while work:
            await one(*work.pop())

    async with model.generator:
        warm = [(p, 8) for p, _ in workload[:4]]  # the servers' warm-up, not measured
        await asyncio.gather(*(client_loop(warm) for _ in range(4)))
        latencies.clear()
        ttfts.clear()
        tokens = 0
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(queue) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    model.close()
    return RunResult(tokens, wall, latencies, ttfts, 0)


def _measure_engine(dtype: str, args: argparse.Namespace) -> RunResult:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--_engine-one", dtype, "--_result", str(out)]
        for flag in ("requests", "concurrency", "min_new", "max_new", "seed"):
            command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        subprocess.run(command, check=True)
        return RunResult(**json.loads(out.read_text()))


def _measure_server(
    server: str, dtype: str, folder: str, workload: list[tuple[str, int]], args: argparse.Namespace
) -> RunResult:
    name, settings = _variant(server)
    if name == "torch-engine":
        if settings:
            raise SystemExit("torch-engine takes no settings; compare servers instead")
        return _measure_engine(dtype, args)
    environment = dict(os.environ)
    if name == "vllm":
        environment.update(setting.split("=", 1) for setting in settings)
    port = free_port()
    log = Path(tempfile.gettempdir()) / f"bench-vs-vllm-{server}-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            _server_command(server, dtype, folder, port),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environment,
        )
    try:
        wait_ready(proc, port, log, args.start_timeout_s)
        # warm-up: a few short requests, not measured
        asyncio.run(_drive(port, [(p, 8) for p, _ in workload[:4]], 4))
        return asyncio.run(_drive(port, workload, args.concurrency))
    finally:
        stop(proc)
        log.unlink(missing_ok=True)


def _print_online(dtype: str, results: dict[str, list[RunResult]]) -> None:
    def median(server: str, f: Any) -> float:
        return statistics.median(f(r) for r in results[server])

    rows = {
        s: (
            median(s, lambda r: r.tokens_per_s),
            median(s, lambda r: r.p(r.latencies_s, 0.5)),
            median(s, lambda r: r.p(r.latencies_s, 0.99)),
            median(s, lambda r: r.p(r.ttfts_s, 0.5)),
            median(s, lambda r: r.p(r.ttfts_s, 0.99)),
        )
        for s in results
    }
    print(f"\nonline, {dtype} (medians over repeats; ratios to vLLM's own server)")
    width = max(20, *(len(s) for s in rows))
    header = f"{'server':<{width}} {'tok/s':>7} {'lat p50':>8} {'lat p99':>8} {'TTFT p50':>9}"
    print(header + f" {'TTFT p99':>9}   {'x tok/s':>7} {'x lat p99':>9} {'x TTFT p99':>10}")
    base = rows.get("vllm")
    for server, (tps, l50, l99, t50, t99) in rows.items():
        line = f"{server:<{width}} {tps:7.1f} {l50:7.2f}s {l99:7.2f}s {t50:8.2f}s {t99:8.2f}s"
        if base is not None:
            line += f"   {tps / base[0]:7.2f} {l99 / base[2]:9.2f} {t99 / base[4]:10.2f}"
        print(line)
    for server in ("batchline-torch", "batchline-torch-proc"):
        if server in rows and "torch-engine" in rows:
            ratio = rows[server][0] / rows["torch-engine"][0]
            goal = "met" if ratio >= 0.85 else "NOT met"
            print(f"{server} / torch-engine tok/s = {ratio:.2f} (goal >= 0.85: {goal})")
    if base is not None and "batchline-vllm" in rows:
        tps, _, _, _, t99 = rows["batchline-vllm"]
        ok = tps >= 0.95 * base[0] and t99 <= 1.2 * base[4]
        print(
            f"goal (batchline-vllm >= 0.95x tok/s, TTFT p99 <= 1.2x): "
            f"{'met' if ok else 'NOT met'}\n",
            flush=True,
        )


# -- offline: batchline run against LLM.generate ---------------------------------------------


def _print_offline(dtype: str, args: argparse.Namespace) -> None:
    got = {}
    for which in ("batchline-run", "vllm-llm"):
        result = Path(tempfile.gettempdir()) / f"bench-vs-vllm-{which}-{os.getpid()}.json"
        done = subprocess.run(
            [
                sys.executable,
                __file__,
                "--_offline-one",
                which,
                "--dtypes",
                dtype,
                "--offline-prompts",
                str(args.offline_prompts),
                "--offline-new",
                str(args.offline_new),
                "--_result",
                str(result),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise SystemExit(f"offline {which} failed:\n{done.stderr[-4000:]}")
        got[which] = json.loads(result.read_text())
        result.unlink()
    ours, theirs = got["batchline-run"], got["vllm-llm"]
    print(
        f"offline, {dtype}: {args.offline_prompts} prompts x {args.offline_new} new tokens: "
        f"batchline run {ours['tokens_per_s']:.1f} tok/s ({ours['tokens']:,} tokens), "
        f"vLLM LLM.generate {theirs['tokens_per_s']:.1f} tok/s ({theirs['tokens']:,} tokens): "
        f"x{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f} (goal >= 0.95)\n",
        flush=True,
    )


def _offline_one(which: str, args: argparse.Namespace) -> dict[str, float]:
    dtype = args.dtypes.split(",")[0]
    if which == "batchline-run":
        from batchline.jobs.generate import GenerateOptions, run_generate_job
        from batchline.models.config import Knobs

        with tempfile.TemporaryDirectory() as tmp:
            summary = asyncio.run(
                run_generate_job(
                    GenerateOptions(
                        input=None,
                        output=Path(tmp) / "out",
                        model="smollm2",
                        limit=args.offline_prompts,
                        max_tokens=args.offline_new,
                        knobs=Knobs(generation_backend="vllm", dtype=dtype),
                    )
                )
            )
        return {"tokens": summary.generated_tokens, "tokens_per_s": summary.tokens_per_s}

    import vllm

    from batchline.models.generation.demo import demo_prompts
    from batchline.models.generation.smollm2 import smollm2_folder

    llm = vllm.LLM(
        model=str(smollm2_folder()),
        dtype=dtype,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        gpu_memory_utilization=0.3,
        max_num_seqs=MAX_NUM_SEQS,
        enforce_eager=True,
    )
    # the token ids batchline's run submits: the chat template rendered, then encoded as is
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_folder()), local_files_only=True)
    prompts: list[Any] = []
    for p in demo_prompts(args.offline_prompts):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": p["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer.encode(str(text), add_special_tokens=False)
        prompts.append(vllm.inputs.TokensPrompt(prompt_token_ids=ids))
    params = vllm.SamplingParams(max_tokens=args.offline_new, temperature=0.0)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tokens": tokens, "tokens_per_s": tokens / wall}


if __name__ == "__main__":
    main()
