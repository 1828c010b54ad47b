"""Generation at the sizes people run: the own engine's weight formats against vLLM and llama.cpp.

One model shape at a time (``--shapes``: SmolLM2-360M's, SmolLM2-1.7B's, or a 3B Llama shape:
hidden 3,072, MLP 8,192, 28 layers, 24 heads / 8 KV heads), random weights saved in bf16 with
SmolLM2's tokenizer (``bench_quant_step.build_folder``; a step's time does not depend on the
weights' values). llama.cpp's files are made from that folder by its own tools: a bf16 GGUF
(``convert_hf_to_gguf.py``), then Q8_0 and Q4_K_M (``llama-quantize``). Each server of
``--servers`` is started here on 127.0.0.1, alone, and answers the same streamed chat requests
(the demo math prompts through the chat template, greedy, ``ignore_eos``, ``--new`` tokens
each) from ``--clients`` clients at once (16, then 1):

- ``own-bf16``, ``own-int8``, ``own-int4``: ``batchline serve`` on its torch engine in the
  dtype ``auto`` takes (``--own-dtype``): bf16, or float32 where the CPU has no native bf16,
  own-bf16 then its dense float32,
  ``--set weights=float|int8|int4`` (settings after a colon are more ``--set``s:
  ``own-int4:generation_threads=2``);
- ``vllm``: vLLM's CPU server in bf16 (``--vllm-dtype``; from ``--vllm-python``, the venv
  ``scripts/vllm_env.sh`` makes), the engine arguments ``bench_vs_vllm.py`` gives it;
- ``llama-q8``, ``llama-q4km``: ``llama-server`` on the Q8_0 and Q4_K_M files, with its
  defaults (``-np 16 -t CORES``); where it exits at load (its AMX weight repacking crashed on
  one host), it is started again with ``--no-repack``, and the table says so;
- ``own-q8``, ``own-q4km``: ``batchline serve`` on those same files (``--model FILE.gguf``,
  weights ``auto``: the file's blocks kept quantized), what a user who holds the GGUF runs.

Each server first answers two other prompts (not timed, none of the timed ones: llama.cpp
keeps a slot's whole prompt and would answer a repeated one from it).

Printed per shape and client count: tokens/s, TTFT p50 and request latency p50 of each server,
and the ratios issue 52 asks for (own bf16 / vLLM; own int4 / llama.cpp Q4_K_M; own int8 /
llama.cpp Q8_0; own int4 / own bf16), and the two engines on the same file. The built files
are kept under ``--work`` (a 1.7B shape is ~3.4 GB bf16 + 1.8 GB Q8_0 + 1.1 GB Q4_K_M) so that
a second run starts at once.

    python benchmarks/bench_sizes.py --shapes 1.7b          # ~30 min on 2 cores
    python benchmarks/bench_sizes.py --shapes tiny --clients 2 --requests 2 --new 4  # smoke
    python benchmarks/bench_sizes.py --shapes 1.7b --own-dtype float32   # float rows throughout
    python benchmarks/bench_sizes.py --shapes 3b --servers own-bf16,own-int4 --clients 1 --rounds 3

``--rounds N`` runs every server N times per client count, each other round in the reverse
order, and prints each ratio per round and its median: on a host whose memory bandwidth moves
within minutes, one round's ratio is one draw. ``--interleave`` goes further: every server is
started at once (their memory together: the 1.7B's own bf16, int4 and llama.cpp's Q4_K_M ~6 GB),
and they take turns, each turn one request per client to each server while the others idle, so
that the servers a ratio compares are measured seconds apart (one 1.7B bf16 request's decode
went from 76 to 48 ms a token between two rounds 5 s apart, Zen 5, 2026-12-05):

    python benchmarks/bench_sizes.py --shapes 1.7b --servers own-bf16,own-int4,llama-q4km \\
        --clients 1 --requests 8 --interleave

Needs ``batchline[generate]``; llama.cpp's ``llama-server``, ``llama-quantize`` and
``convert_hf_to_gguf.py`` (``--llama-dir``: the build of ../shared/FACTS.md's recipe), and
vLLM's CPU venv for ``vllm``; a server whose tools are missing is left out, saying so. Run it
on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _servers import LLAMA_DIR, LLAMA_FALLBACK, free_port, start, stop
from bench_quant_step import SHAPES, build_folder
from bench_vs_vllm import MODEL_NAME, RunResult, _drive, vllm_server_command

SERVERS = (
    "own-bf16",
    "own-int8",
    "own-int4",
    "vllm",
    "llama-q8",
    "llama-q4km",
    "own-q8",
    "own-q4km",
)
LLAMA_FILES = {"llama-q8": "Q8_0", "llama-q4km": "Q4_K_M"}
#: the own servers on llama.cpp's files
OWN_FILES = {"own-q8": "Q8_0", "own-q4km": "Q4_K_M"}
#: The ratios issue 52 asks for: (own server, the one it is measured against)
RATIOS = (
    ("own-bf16", "vllm"),
    ("own-int4", "llama-q4km"),
    ("own-int8", "llama-q8"),
    ("own-int4", "own-bf16"),
    ("own-int8", "own-bf16"),
    ("own-q4km", "llama-q4km"),
    ("own-q8", "llama-q8"),
)
ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1.7b", help=f"comma-separated: {sorted(SHAPES)}")
    parser.add_argument("--servers", default=",".join(SERVERS), help="comma-separated")
    parser.add_argument("--clients", default="16,1", help="concurrent clients, comma-separated")
    parser.add_argument("--requests", type=int, default=2, help="requests per client")
    parser.add_argument("--new", type=int, default=64, help="tokens each answer")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench-sizes")
    parser.add_argument(
        "--llama-dir",
        type=Path,
        default=LLAMA_DIR,
        help="llama.cpp's source folder, built (build/bin/llama-server)",
    )
    parser.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm/bin/python")
    parser.add_argument(
        "--convert-python",
        type=Path,
        default=ROOT / ".venv-vllm/bin/python",
        help="runs llama.cpp's converter: it needs sentencepiece, which vLLM's venv has",
    )
    parser.add_argument(
        "--own-dtype",
        default="auto",
        help="the own servers' dtype (auto: bf16 where the CPU computes it natively, else "
        "float32, own-bf16 then being the own engine's dense weights in float32; a named "
        "float32 keeps the int formats' rows in float, as activations=auto does there)",
    )
    parser.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's --dtype")
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="run every server this many times per client count (each other round in the "
        "reverse order) and print each ratio per round and its median",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="start every server at once and let them take turns, each turn one request per "
        "client to each (--requests turns); print each ratio per turn and its median",
    )
    args = parser.parse_args()
    if args.interleave and args.rounds > 1:
        parser.error("--interleave takes turns within one run: give --requests, not --rounds")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_LOOPBACK_IP", "127.0.0.1")
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = sorted({s.split(":")[0] for s in servers} - set(SERVERS))
    if unknown:
        parser.error(f"unknown server(s) {unknown}; known: {', '.join(SERVERS)}")
    clients = [int(c) for c in args.clients.split(",")]
    for shape in args.shapes.split(","):
        folder = _folder(shape.strip(), args.work)
        ggufs = _ggufs(folder, servers, args)
        title = f"{shape} (own {args.own_dtype}, vLLM {args.vllm_dtype})"
        for n in clients:
            if args.interleave:
                notes: dict[str, str] = {}
                turns = _interleaved(servers, folder, ggufs, n, args, notes)
                _print(title + ", interleaved", n, _pooled(turns), notes)
                _print_rounds(title + ", interleaved", n, [_ratios(t) for t in turns], "turn")
                continue
            rounds: list[dict[str, float]] = []
            for index in range(args.rounds):
                results: dict[str, RunResult] = {}
                notes = {}
                # every other round in the reverse order: a host drifting during a round
                # (its memory bandwidth does, here) then favours no server across rounds
                for server in servers if index % 2 == 0 else servers[::-1]:
                    got = _measure(server, folder, ggufs, n, args, notes)
                    if got is not None:
                        results[server] = got
                        print(f"  [{shape}, {n} client(s)] {server}: {got.line()}", flush=True)
                suffix = f", round {index + 1} of {args.rounds}" if args.rounds > 1 else ""
                rounds.append(_print(title + suffix, n, results, notes))
            if args.rounds > 1:
                _print_rounds(title, n, rounds)


def _folder(shape: str, work: Path) -> Path:
    folder = work / f"llama-{shape}"
    if not (folder / "config.json").is_file():
        work.mkdir(parents=True, exist_ok=True)
        print(f"building the {shape} shape's folder (random weights) under {work}", flush=True)
        built = build_folder(shape, work)
        assert built == folder
    return folder


def _ggufs(folder: Path, servers: list[str], args: argparse.Namespace) -> dict[str, Path]:
    """The GGUF file each server on one (llama.cpp's, and the own ones on its files) runs, made
    once from ``folder``."""
    kinds = {**LLAMA_FILES, **OWN_FILES}
    wanted = {s.split(":")[0] for s in servers} & set(kinds)
    bin_dir = args.llama_dir / "build" / "bin"
    convert = args.llama_dir / "convert_hf_to_gguf.py"
    if not wanted or not (bin_dir / "llama-server").is_file() or not convert.is_file():
        if wanted:
            print(f"llama.cpp: left out (no {bin_dir / 'llama-server'} or {convert})")
        return {}
    bf16 = folder / "model-bf16.gguf"
    if not bf16.is_file():
        print("converting to a bf16 GGUF (llama.cpp's convert_hf_to_gguf.py)", flush=True)
        subprocess.run(
            [
                str(args.convert_python),
                str(convert),
                str(folder),
                "--outtype",
                "bf16",
                "--outfile",
                str(bf16),
            ],
            check=True,
            capture_output=True,
        )
    files = {}
    for server in sorted(wanted):
        kind = kinds[server]
        path = folder / f"model-{kind}.gguf"
        if not path.is_file():
            print(f"quantizing to {kind} (llama-quantize)", flush=True)
            subprocess.run(
                [str(bin_dir / "llama-quantize"), str(bf16), str(path), kind],
                check=True,
                capture_output=True,
            )
        files[server] = path
    return files


def _command(
    server: str, folder: Path, ggufs: dict[str, Path], port: int, args: argparse.Namespace
) -> list[str] | None:
    name, *settings = server.split(":")
    cores = str(len(os.sched_getaffinity(0)))
    if name == "vllm":
        if not args.vllm_python.is_file():
            return None
        return vllm_server_command(str(args.vllm_python), str(folder), port, args.vllm_dtype)
    if name in LLAMA_FILES:
        if name not in ggufs:
            return None
        return [
            str(args.llama_dir / "build" / "bin" / "llama-server"),
            "-m",
            str(ggufs[name]),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-np",
            "16",
            "-c",
            str(16 * 256),
            "-t",
            cores,
            "--jinja",
            "--alias",
            MODEL_NAME,
            *settings,
        ]
    if name in OWN_FILES:
        if name not in ggufs:
            return None
        model, weights = str(ggufs[name]), "auto"  # a GGUF's blocks kept quantized
    else:
        model, weights = f"{folder}/", name.removeprefix("own-").replace("bf16", "float")
    return [
        sys.executable,
        "-m",
        "batchline",
        "serve",
        "--model",
        f"{MODEL_NAME}={model}",
        "--port",
        str(port),
        "--set",
        f"dtype={args.own_dtype}",
        "--set",
        f"weights={weights}",
        "--set",
        "max_running_sequences=16",
        *[flag for setting in settings for flag in ("--set", setting)],
        "--request-timeout-s",
        "1800",
        "--log-level",
        "warning",
    ]


def _launch(
    server: str,
    folder: Path,
    ggufs: dict[str, Path],
    args: argparse.Namespace,
    notes: dict[str, str],
) -> tuple[subprocess.Popen[bytes], int, Path] | None:
    """Start ``server`` and warm it up: its process, port and log; ``None`` (the reason in
    ``notes``) where its tools are missing or it does not start."""
    port = free_port()
    command = _command(server, folder, ggufs, port, args)
    if command is None:
        notes[server] = "left out: its tools are missing"
        print(f"  {server}: {notes[server]}", flush=True)
        return None
    log = Path(tempfile.gettempdir()) / f"bench-sizes-{port}.log"
    fallback = LLAMA_FALLBACK if server.split(":")[0] in LLAMA_FILES else ()
    try:
        proc, note = start(command, port, log, args.start_timeout_s, fallback=fallback)
    except SystemExit as exc:
        notes[server] = f"did not start: {str(exc).splitlines()[-1][:120]}"
        print(f"  {server}: {notes[server]}", flush=True)
        log.unlink(missing_ok=True)
        return None
    if note:
        notes[server] = note
    try:
        # warmed up on prompts of their own: a server that keeps whole prompts (llama.cpp's
        # slots do) would otherwise answer the timed ones from the warm-up's cache
        asyncio.run(_drive(port, [(p, 4) for p, _ in _prompts(2, 4, seed=1)], 2))
    except BaseException:
        _shut(proc, log)
        raise
    return proc, port, log


def _shut(proc: subprocess.Popen[bytes], log: Path) -> None:
    stop(proc)
    log.unlink(missing_ok=True)


def _measure(
    server: str,
    folder: Path,
    ggufs: dict[str, Path],
    clients: int,
    args: argparse.Namespace,
    notes: dict[str, str],
) -> RunResult | None:
    launched = _launch(server, folder, ggufs, args, notes)
    if launched is None:
        return None
    proc, port, log = launched
    try:
        return asyncio.run(_drive(port, _prompts(clients * args.requests, args.new), clients))
    finally:
        _shut(proc, log)


def _interleaved(
    servers: list[str],
    folder: Path,
    ggufs: dict[str, Path],
    clients: int,
    args: argparse.Namespace,
    notes: dict[str, str],
) -> list[dict[str, RunResult]]:
    """Every server up at once, taking turns: in turn t each answers the same ``clients``
    prompts from ``clients`` clients while the others idle (every other turn in the reverse
    order); ``--requests`` turns. One result per server and turn."""
    up: dict[str, tuple[subprocess.Popen[bytes], int, Path]] = {}
    try:
        for server in servers:
            launched = _launch(server, folder, ggufs, args, notes)
            if launched is not None:
                up[server] = launched
        # a server that spins while idle would slow the one whose turn it is: say so
        print(f"  the host with every server idle: {_busy_cores(3.0):.2f} cores busy", flush=True)
        prompts = _prompts(clients * args.requests, args.new)
        turns: list[dict[str, RunResult]] = []
        names = list(up)
        for t in range(args.requests):
            mine = prompts[t * clients : (t + 1) * clients]
            turn = {}
            for server in names if t % 2 == 0 else names[::-1]:
                turn[server] = asyncio.run(_drive(up[server][1], mine, clients))
            turns.append(turn)
            print(
                f"  [turn {t + 1} of {args.requests}] "
                + ", ".join(f"{s} {r.tokens_per_s:.1f}" for s, r in turn.items()),
                flush=True,
            )
        return turns
    finally:
        for proc, _, log in up.values():
            _shut(proc, log)


def _busy_cores(seconds: float) -> float:
    """The cores this host kept busy over ``seconds`` (``/proc/stat``: all but idle and iowait),
    NaN where it cannot be read."""

    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return float("nan")
    cores = len(os.sched_getaffinity(0))
    return cores * (1 - (idle1 - idle0) / max(1, total1 - total0))


def _prompts(n: int, new: int, *, seed: int = 0) -> list[tuple[str, int]]:
    from batchline.models.generation.demo import demo_prompts

    return [(p["prompt"], new) for p in demo_prompts(n, seed=seed)]


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _print(
    shape: str, clients: int, results: dict[str, RunResult], notes: dict[str, str]
) -> dict[str, float]:
    """Print one run's table and issue 52's ratios; return the ratios by their label."""
    print(f"\n{shape}, {clients} client(s): tokens/s, TTFT p50, latency p50")
    print("| server | tok/s | TTFT p50 | latency p50 | note |")
    print("|---|---:|---:|---:|---|")
    for server, r in results.items():
        # the progress line's p50 (the nearest rank), not statistics.median: at 16 clients the
        # TTFTs fall in two waves, and a median averaged across the gap matched neither line
        ttft, latency = r.p(r.ttfts_s, 0.5), r.p(r.latencies_s, 0.5)
        note = notes.get(server, "") + (f"; {r.failed} FAILED" if r.failed else "")
        print(f"| {server} | {r.tokens_per_s:.1f} | {ttft:.2f} s | {latency:.2f} s | {note} |")
    ratios = _ratios(results)
    for label, ratio in ratios.items():
        print(f"{label}: x{ratio:.2f}")
    print(flush=True)
    return ratios


def _ratios(results: dict[str, RunResult]) -> dict[str, float]:
    """Issue 52's ratios (``RATIOS``) among ``results``' servers, by label."""
    ratios = {}
    for mine, theirs in RATIOS:
        for a, ra in results.items():
            for b, rb in results.items():
                if a.split(":")[0] == mine and b.split(":")[0] == theirs and rb.tokens_per_s:
                    ratios[f"{a} / {b}"] = ra.tokens_per_s / rb.tokens_per_s
    return ratios


def _pooled(turns: list[dict[str, RunResult]]) -> dict[str, RunResult]:
    """Each server's turns as one result: its tokens over its own time, its requests' latencies
    and TTFTs together."""
    pooled: dict[str, RunResult] = {}
    for turn in turns:
        for server, r in turn.items():
            was = pooled.get(server)
            pooled[server] = (
                r
                if was is None
                else RunResult(
                    was.tokens + r.tokens,
                    was.wall_s + r.wall_s,
                    was.latencies_s + r.latencies_s,
                    was.ttfts_s + r.ttfts_s,
                    was.failed + r.failed,
                )
            )
    return pooled


def _print_rounds(
    shape: str, clients: int, rounds: list[dict[str, float]], unit: str = "round"
) -> None:
    """Each ratio of every round (or turn), and its median over the ones that had it."""
    print(f"{shape}, {clients} client(s), {len(rounds)} {unit}s: each ratio per {unit}, median")
    for label in dict.fromkeys(label for ratios in rounds for label in ratios):
        got = [ratios[label] for ratios in rounds if label in ratios]
        cells = " ".join(f"x{r:.2f}" for r in got)
        print(f"{label}: {cells}, median x{statistics.median(got):.2f}")
    print(flush=True)


if __name__ == "__main__":
    main()
