"""Prefix affinity (``drive --route generate``): the prefix key, the window's requests, routing
a key to its replica within the imbalance bound, and the drive's guarantees with it on.

The pool's rules run on a manual clock; the drives against fake replicas behind
``httpx.MockTransport``. Assertions are on counts, routes and contents, never on time.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import numpy as np
import pytest

from batchline.__main__ import build_parser
from batchline._clock import ManualClock
from batchline._errors import InputError
from batchline.datasets.sinks import ChunkWriter, Manifest, read_output, read_skipped
from batchline.driver.affinity import plan_requests, prefix_keys, rendezvous_score
from batchline.driver.drive import DriveOptions, drive_job, read_failures
from tests.driver.fake import FakeReplica, fake_vectors
from tests.driver.test_drive import Replicas, options
from tests.driver.test_endpoints import A, B, C, Prober, make_pool, run_for

pytestmark = pytest.mark.anyio

LABELS = ["urgent", "routine", "spam", "question"]


def rubric(k: int) -> str:
    """A few-shot prefix (~900 bytes), its own for every ``k`` from its first line on."""
    shots = [f"Example {k}.{j}: ticket {j * 7 + k} is {LABELS[(k + j) % 4]}." for j in range(24)]
    return f"Rubric {k}. Label each ticket.\n" + "\n".join(shots) + "\n"


def few_shot(n: int, prefixes: int, *, seed: int = 0) -> tuple[list[str], list[int]]:
    """``n`` distinct prompts drawn over ``prefixes`` rubrics, shuffled; and each one's rubric."""
    rng = random.Random(seed)
    drawn = [rng.randrange(prefixes) for _ in range(n)]
    return [f"{rubric(k)}Ticket {i}: my order is late\nLabel:" for i, k in enumerate(drawn)], drawn


def write_prompts(path: Path, prompts: list[str]) -> Path:
    path.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts))
    )
    return path


# -- the key ----------------------------------------------------------------------------------


def test_prompts_of_one_few_shot_prefix_share_a_key_and_other_prefixes_do_not() -> None:
    prompts, drawn = few_shot(200, 12)
    keys = prefix_keys(prompts)
    by_rubric: dict[int, set[bytes]] = {}
    for k, key in zip(drawn, keys, strict=True):
        by_rubric.setdefault(k, set()).add(key)
    assert all(len(ks) == 1 for ks in by_rubric.values())  # one key per prefix
    assert len(set(keys)) == len(by_rubric) == 12  # and a key of its own


def test_a_short_common_start_does_not_collapse_prompts_into_one_key() -> None:
    # the same instruction (~45 bytes) and then each its own text: nothing worth routing for
    texts = [f"Translate to French, keep the tone: sentence {i} " + "word " * 80 for i in range(50)]
    assert len(set(prefix_keys(texts))) == 50


def test_a_prefix_every_prompt_shares_keys_by_what_follows_it() -> None:
    """One system prompt for the whole window, then three few-shot sets: the sets are the keys
    (the system prompt tells the prompts nowhere to go: every replica learns it)."""
    system = "You are a careful assistant. " * 20  # 580 bytes, in every prompt
    prompts, drawn = few_shot(90, 3, seed=1)
    keys = prefix_keys([system + p for p in prompts])
    assert len(set(keys)) == 3
    pairs = list(zip(keys, drawn, strict=True))
    assert all((a == b) == (x == y) for a, x in pairs for b, y in pairs)
    # and when one prefix is all there is, the prompts spread by their own keys
    alone = [system + f"question {i}: " + "why? " * 60 for i in range(20)]
    assert len(set(prefix_keys(alone))) == 20


def test_a_prefix_keys_the_same_in_every_window() -> None:
    prompts, drawn = few_shot(120, 6, seed=2)
    first = dict(zip(drawn[:60], prefix_keys(prompts[:60]), strict=True))
    second = dict(zip(drawn[60:], prefix_keys(prompts[60:]), strict=True))
    assert first == second


def test_any_text_has_a_key() -> None:
    texts = ["", "é" * 300, "\ud800 lone surrogate", "x" * 40_000, "x" * 40_000]
    keys = prefix_keys(texts)
    assert [len(k) for k in keys] == [8] * 5
    assert keys[3] == keys[4]  # the same first 16 KiB: the same key
    assert prefix_keys([]) == []


# -- the window's requests --------------------------------------------------------------------


def test_a_window_s_requests_hold_one_prefix_each_replica_s_in_turn() -> None:
    # interleaved as a shuffled file holds them: p, q, s, r, p, q, s, r, ... (47 in all)
    counts = {b"p": 25, b"q": 7, b"s": 12, b"r": 3}
    keys = [k for turn in range(25) for k, n in counts.items() if turn < n]
    homes = {b"p": "A", b"q": "B", b"r": "A", b"s": "B"}
    planned = plan_requests(keys, homes.__getitem__, 10)
    sent = [i for p in planned for i in p.indices]
    assert sorted(sent) == list(range(len(keys)))  # every record once
    assert all(1 <= len(p.indices) <= 10 for p in planned)
    # a replica's prefixes packed together, requests of 10 but for each replica's last
    assert [len(p.indices) for p in planned] == [10, 10, 10, 9, 8]
    assert [homes[p.key] for p in planned] == ["A", "B", "A", "B", "A"]  # in turn
    for p in planned:  # a request routes to where all its records belong
        assert {homes[keys[i]] for i in p.indices} == {homes[p.key]}
    # a prefix's records are consecutive in its replica's requests, in input order
    lane = [i for p in planned if homes[p.key] == "A" for i in p.indices]
    assert [keys[i] for i in lane] == [b"p"] * 25 + [b"r"] * 3
    assert lane[:25] == sorted(lane[:25])
    with pytest.raises(ValueError, match="size must be >= 1"):
        plan_requests(keys, homes.__getitem__, 0)


def test_records_that_share_nothing_are_packed_not_sent_alone() -> None:
    keys = [bytes([i]) for i in range(95)]
    planned = plan_requests(keys, lambda key: key[0] % 2, 20)
    assert sorted(len(p.indices) for p in planned) == [7, 8, 20, 20, 20, 20]


# -- routing (conftest's clock and prober fixtures) --------------------------------------------


KEYS = [f"prefix {i}".encode() for i in range(30)]


async def test_a_key_goes_to_one_endpoint_and_keys_spread(
    clock: ManualClock, prober: Prober
) -> None:
    async with make_pool(clock, prober, [A, B, C]) as pool:
        where: dict[bytes, set[str]] = {}
        for _ in range(4):
            for key in KEYS:
                ep = await pool.acquire(key=key)
                where.setdefault(key, set()).add(ep.url)
                assert ep is pool.home(key)
                pool.succeeded(ep)
        assert all(len(urls) == 1 for urls in where.values())
        assert {url for urls in where.values() for url in urls} == {A, B, C}
        assert (pool.affine, pool.fallbacks) == (4 * len(KEYS), 0)


async def test_a_key_s_endpoint_takes_its_chunks_within_the_bound_else_the_least_loaded(
    clock: ManualClock, prober: Prober
) -> None:
    async with make_pool(clock, prober, [A, B]) as pool:  # affinity_slack=1, the default
        key = KEYS[0]
        home = pool.home(key)
        assert home is not None
        got = [(await pool.acquire(key=key)) is home for _ in range(7)]
        # 1st: both idle; 2nd: the other is idle, so it takes it; 3rd: level again; 4th: one
        # ahead is within the bound; 5th: two ahead is not; 6th: one ahead; 7th: two
        assert got == [True, False, True, True, False, True, False]
        assert (pool.affine, pool.fallbacks) == (4, 3)
        assert [ep.in_flight for ep in pool.endpoints] == [4, 3] if home.url == A else [3, 4]
    async with make_pool(clock, prober, [A, B], affinity_slack=0) as strict:
        key = KEYS[0]
        home = strict.home(key)
        got = [(await strict.acquire(key=key)) is home for _ in range(6)]
        assert got == [True, False, True, False, True, False]  # only when level


async def test_a_set_aside_endpoint_s_keys_move_and_come_back_and_no_other_key_moves(
    clock: ManualClock, prober: Prober
) -> None:
    async with make_pool(clock, prober, [A, B, C]) as pool:
        before = {key: pool.home(key) for key in KEYS}
        a = pool.endpoints[0]
        for _ in range(3):  # three failures in a row set A aside
            a.in_flight += 1
            pool.failed(a, "connect")
        assert pool.states()[A] == "set aside"
        for key in KEYS:
            ep = await pool.acquire(key=key)
            pool.succeeded(ep)
            if before[key] is a:  # moved, to its next endpoint in rendezvous order
                assert ep is max(pool.endpoints[1:], key=lambda e: rendezvous_score(key, e.url))
            else:
                assert ep is before[key]  # never moved
        assert any(before[key] is a for key in KEYS)
        prober.ready[A] = True
        await run_for(clock, 0.5)
        assert pool.states()[A] == "up"
        assert {key: pool.home(key) for key in KEYS} == before  # back where they were


async def test_a_retry_avoids_the_key_s_endpoint(clock: ManualClock, prober: Prober) -> None:
    async with make_pool(clock, prober, [A, B]) as pool:
        key = KEYS[0]
        home = await pool.acquire(key=key)
        pool.failed(home, "http_5xx")
        retry = await pool.acquire(avoid=home, key=key)
        assert retry is not home
        pool.succeeded(retry)
        assert (await pool.acquire(key=key)) is home  # a fresh chunk goes home again


# -- drives -----------------------------------------------------------------------------------


class Recorder:
    """The fake replicas, and what each request held: (host, its prompts), in arrival order."""

    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas
        self.sent: list[tuple[str, list[str]]] = []

    async def handler(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            self.sent.append((request.url.host, json.loads(request.content)["prompts"]))
        return await self.replicas.handler(request)

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handler)


def written_texts(out: Path) -> tuple[list[int], np.ndarray]:
    table = read_output(out)
    return table.column("index").to_pylist(), np.array(table.column("text").to_pylist())


def generate(src: Path, out: Path, **kwargs: Any) -> DriveOptions:
    return options(src, out, route="generate", **kwargs)


@pytest.fixture
def small_windows() -> Iterator[None]:
    """Windows of 30 records, so that a small file spans several."""
    with mock.patch("batchline.jobs.generate.PREFIX_ORDER_WINDOW", 30):
        yield


async def test_each_prefix_goes_to_one_replica_in_one_run_and_every_record_once_in_order(
    tmp_path: Path,
) -> None:
    prompts, drawn = few_shot(240, 12)
    src = write_prompts(tmp_path / "in.jsonl", prompts)
    rec = Recorder(Replicas(a=FakeReplica(), b=FakeReplica()))
    # one request at a time: no endpoint is ever busier than another, so none falls back
    summary = await drive_job(
        generate(src, tmp_path / "out", concurrency=1), transport=rec.transport
    )
    indices, texts = written_texts(tmp_path / "out")
    assert indices == list(range(240))
    np.testing.assert_allclose(texts, fake_vectors(prompts), rtol=1e-6)
    rubric_of = dict(zip(prompts, drawn, strict=True))
    hosts: dict[int, set[str]] = {}
    runs: dict[str, list[int]] = {}
    for host, sent in rec.sent:
        for prompt in sent:
            k = rubric_of[prompt]
            hosts.setdefault(k, set()).add(host)
            if not runs.get(host) or runs[host][-1] != k:
                runs.setdefault(host, []).append(k)
    assert all(len(h) == 1 for h in hosts.values())  # a prefix, one replica
    assert set(runs) == {"a", "b"}  # both replicas worked
    for seen in runs.values():  # each replica saw each of its prefixes in one run
        assert len(seen) == len(set(seen))
    assert summary.prefix_affinity
    assert (summary.affine_requests, summary.fallback_requests) == (summary.requests, 0)
    assert summary.requests <= 240 // 10 + 2  # packed: full requests but for each replica's last
    assert dict(summary.rows())["prefix affinity"] == (
        f"{summary.requests} requests to their prefix's replica, 0 fell back to the least busy"
    )


async def test_no_prefix_affinity_sends_in_input_order_to_the_least_loaded(tmp_path: Path) -> None:
    prompts, _ = few_shot(60, 6)
    src = write_prompts(tmp_path / "in.jsonl", prompts)
    rec = Recorder(Replicas(a=FakeReplica(), b=FakeReplica()))
    opts = generate(src, tmp_path / "out", prefix_affinity=False)
    summary = await drive_job(opts, transport=rec.transport)
    assert sorted(sent for _, sent in rec.sent) == sorted(
        prompts[i : i + 10] for i in range(0, 60, 10)
    )  # blocks of --records-per-request, as read
    assert not summary.prefix_affinity
    assert (summary.affine_requests, summary.fallback_requests) == (0, 0)
    assert "prefix affinity" not in dict(summary.rows())
    with pytest.raises(InputError, match="--no-prefix-affinity goes with --route generate"):
        options(src, tmp_path / "x", prefix_affinity=False)
    with pytest.raises(InputError, match="affinity_slack must be >= 0"):
        generate(src, tmp_path / "x", affinity_slack=-1)


async def test_the_concurrency_cap_holds_with_prefix_affinity(tmp_path: Path) -> None:
    prompts, _ = few_shot(150, 10)
    src = write_prompts(tmp_path / "in.jsonl", prompts)
    replicas = Replicas(a=FakeReplica(), b=FakeReplica())
    full = asyncio.Event()
    load = {"now": 0, "most": 0}

    async def handler(request: httpx.Request) -> httpx.Response:
        # the first requests wait until 3 are in flight at once: the cap is reached, and a 4th
        # (a broken cap) would be counted before any of them answers
        load["now"] += 1
        load["most"] = max(load["most"], load["now"])
        try:
            if load["now"] >= 3:
                full.set()
            await asyncio.wait_for(full.wait(), timeout=10)
            return await replicas.handler(request)
        finally:
            load["now"] -= 1

    opts = generate(src, tmp_path / "out", chunk_size=5, concurrency=3)
    summary = await drive_job(opts, transport=httpx.MockTransport(handler))
    assert summary.records == 150
    assert load["most"] == 3


async def test_several_windows_duplicates_and_a_refused_request_each_record_once_in_order(
    tmp_path: Path, small_windows: None
) -> None:
    prompts, _ = few_shot(200, 8, seed=4)
    prompts[150] = prompts[20]  # a duplicate in a later window
    prompts[151] = prompts[152]  # ... and in the same one
    prompts[77] = "POISON " + prompts[77]
    src = write_prompts(tmp_path / "in.jsonl", prompts)
    replicas = Replicas(a=FakeReplica(poison="POISON"), b=FakeReplica(poison="POISON"))
    summary = await drive_job(
        generate(src, tmp_path / "out", chunk_size=4, concurrency=3), transport=replicas.transport
    )
    failed = [int(str(f["index"])) for f in read_failures(tmp_path / "out")]
    assert 77 in failed  # the refused request, and only it
    assert len(failed) <= 4
    assert [s["index"] for s in read_skipped(tmp_path / "out")] == failed
    indices, texts = written_texts(tmp_path / "out")
    assert indices == [i for i in range(200) if i not in failed]
    np.testing.assert_allclose(texts, fake_vectors([prompts[i] for i in indices]), rtol=1e-6)
    assert summary.duplicates == 2
    assert summary.records + summary.failed == 200
    assert sum(h.n for r in replicas.by_host.values() for h in r.hits) == 198


async def test_resume_after_a_crash_with_prefix_affinity_gives_every_record_once(
    tmp_path: Path, small_windows: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts, _ = few_shot(230, 9, seed=5)
    src = write_prompts(tmp_path / "in.jsonl", prompts)
    out = tmp_path / "out"
    real_write = ChunkWriter.write_batch
    writes = {"n": 0}

    def crashing(self: ChunkWriter, records: Any, results: Any) -> None:
        writes["n"] += 1
        if writes["n"] == 4:
            raise OSError("disk on fire")
        real_write(self, records, results)

    monkeypatch.setattr(ChunkWriter, "write_batch", crashing)
    replicas = Replicas(a=FakeReplica(), b=FakeReplica())
    with pytest.raises(OSError, match="disk on fire"):
        await drive_job(generate(src, out), transport=replicas.transport)
    monkeypatch.setattr(ChunkWriter, "write_batch", real_write)
    assert 0 < len(Manifest.load(out).chunks) < 6
    summary = await drive_job(generate(src, out, resume=True), transport=replicas.transport)
    assert summary.already_done > 0
    assert summary.records == 230 - summary.already_done
    indices, texts = written_texts(out)
    assert indices == list(range(230))
    np.testing.assert_allclose(texts, fake_vectors(prompts), rtol=1e-6)


async def test_a_dead_replica_s_prefixes_go_to_the_other(tmp_path: Path) -> None:
    prompts, _ = few_shot(200, 10, seed=6)
    src = write_prompts(tmp_path / "in.jsonl", prompts)
    replicas = Replicas(a=FakeReplica(), b=FakeReplica())
    replicas.down.add("a")
    summary = await drive_job(generate(src, tmp_path / "out"), transport=replicas.transport)
    a, b = summary.endpoints
    assert (a.times_set_aside, a.successes) == (1, 0)
    assert b.successes == summary.requests - a.requests
    indices, texts = written_texts(tmp_path / "out")
    assert indices == list(range(200))
    np.testing.assert_allclose(texts, fake_vectors(prompts), rtol=1e-6)
    assert summary.affine_requests + summary.fallback_requests == summary.requests


def test_the_flag_turns_it_off() -> None:
    argv = ["drive", "in.jsonl", "--endpoint", "http://h:1", "--route", "generate"]
    assert build_parser().parse_args(argv).prefix_affinity is True
    assert build_parser().parse_args([*argv, "--no-prefix-affinity"]).prefix_affinity is False
