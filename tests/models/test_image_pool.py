"""The decode pool: pictures decoded in worker processes as inline, a bad picture's error
carried back, the byte budget's backpressure, and the choice of how many decode at once."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("PIL")

from batchline._errors import InputError
from batchline.models.image import (
    DecodeOptions,
    DecodePool,
    ImagePreprocess,
    ImageRef,
    choose_workers,
    decode_image,
)
from tests.image_helpers import jpeg_bytes

PRE = ImagePreprocess(shortest_edge=16, crop_to=(16, 16), mean=(0.5,) * 3, std=(0.5,) * 3)


@pytest.mark.parametrize(
    ("decode_s", "model_s", "cores", "want"),
    [
        (0.020, 0.010, 4, 3),  # decode twice as slow: 2.4 -> 3 at once
        (0.010, 0.010, 4, 2),  # as fast: one, and a fifth more for the spread -> 2
        (0.001, 0.100, 4, 1),  # decode far faster: one is enough
        (1.000, 0.001, 2, 2),  # decode far slower: every core
        (math.nan, 0.01, 3, 3),  # nothing measured yet: every core
        (0.01, 0.0, 3, 3),
    ],
)
def test_choose_workers_matches_decode_to_the_model(
    decode_s: float, model_s: float, cores: int, want: int
) -> None:
    assert choose_workers(decode_s, model_s, cores) == want


def test_choose_workers_refuses_no_cores() -> None:
    with pytest.raises(ValueError, match="cores must be >= 1"):
        choose_workers(0.1, 0.1, 0)


@pytest.mark.parametrize("kwargs", [{"workers": 0}, {"max_pixels": 0}, {"max_bytes_in_flight": 0}])
def test_decode_options_are_checked(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        DecodeOptions(**kwargs)


def test_workers_decode_as_inline_and_carry_a_bad_picture_back(tmp_path: Path) -> None:
    good = tmp_path / "a.jpg"
    good.write_bytes(jpeg_bytes(1, size=(64, 48)))
    (tmp_path / "b.jpg").write_text("not a picture")

    async def main() -> tuple[object, ...]:
        async with DecodePool(PRE, DecodeOptions(workers=2, draft=False)) as pool:
            first = await pool.decode(ImageRef(path=str(good)))
            again = await pool.decode(ImageRef(data=good.read_bytes()))
            with pytest.raises(InputError, match="not a picture"):
                await pool.decode(ImageRef(path=str(tmp_path / "b.jpg")))
            return first, again, pool.stats()

    first, again, stats = asyncio.run(main())
    want = PRE(decode_image(good.read_bytes()))
    np.testing.assert_array_equal(first.pixels, want)  # type: ignore[attr-defined]
    assert first.pixels.shape == (3, 16, 16)  # type: ignore[attr-defined]
    assert first.key == again.key  # type: ignore[attr-defined]  # the same bytes, the same key
    assert (stats.decoded, stats.failed, stats.workers) == (2, 1, 2)  # type: ignore[attr-defined]


def test_the_byte_budget_holds_the_reader_until_pictures_are_released() -> None:
    pool = DecodePool(PRE, DecodeOptions(workers=1, max_bytes_in_flight=100))

    async def main() -> list[str]:
        events: list[str] = []
        await pool.reserve(60)
        events.append("first in")

        async def second() -> None:
            await pool.reserve(60)  # 120 > 100: waits for the first
            events.append("second in")

        task = asyncio.create_task(second())
        for _ in range(5):
            await asyncio.sleep(0)
        events.append("releasing")
        await pool.release(60)
        await task
        await pool.release(60)
        await pool.reserve(500)  # larger than the budget: goes alone, as nothing is held
        assert pool.bytes_in_flight == 500
        return events

    async def bounded() -> list[str]:
        return await asyncio.wait_for(main(), timeout=10)

    assert asyncio.run(bounded())[:3] == ["first in", "releasing", "second in"]
    other = DecodePool(PRE, DecodeOptions(workers=1, max_bytes_in_flight=100))
    with pytest.raises(TimeoutError):
        asyncio.run(asyncio.wait_for(_huge_waits(other), timeout=0.5))


async def _huge_waits(pool: DecodePool) -> None:
    await pool.reserve(1)
    await pool.reserve(500)  # never alone while the first is held


def test_output_bytes_are_the_model_input_size() -> None:
    pool = DecodePool(PRE)
    assert pool.output_bytes == 3 * 16 * 16 * 4
    assert pool.budget_of(ImageRef(data=b"x" * 10)) == 10 + 3 * 16 * 16 * 4


def test_set_active_moves_to_a_smaller_pool_that_decodes_the_same(tmp_path: Path) -> None:
    good = tmp_path / "a.jpg"
    good.write_bytes(jpeg_bytes(2, size=(40, 30)))

    async def main() -> tuple[object, object, int]:
        async with DecodePool(PRE, DecodeOptions(workers=2)) as pool:
            before = await pool.decode(ImageRef(path=str(good)))
            await pool.set_active(1)
            after = await pool.decode(ImageRef(path=str(good)))
            await pool.set_active(9)  # clamped to the processes it may have
            return before, after, pool.stats().active

    before, after, active = asyncio.run(main())
    np.testing.assert_array_equal(before.pixels, after.pixels)  # type: ignore[attr-defined]
    assert active == 2


def test_a_worker_that_dies_stops_the_job_with_one_clear_error(tmp_path: Path) -> None:
    import os
    import signal

    from batchline._errors import ModelError

    good = tmp_path / "a.jpg"
    good.write_bytes(jpeg_bytes(3))

    async def main() -> None:
        async with DecodePool(PRE, DecodeOptions(workers=1)) as pool:
            await pool.decode(ImageRef(path=str(good)))
            pid = await asyncio.wrap_future(
                pool._executor.submit(os.getpid)  # type: ignore[union-attr]
            )
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(ModelError, match=r"decode worker process died.*--resume"):
                await _decode_until_it_fails(pool, ImageRef(path=str(good)))

    asyncio.run(main())


async def _decode_until_it_fails(pool: DecodePool, ref: ImageRef) -> None:
    for _ in range(50):  # bounded: the executor notices the death on its next call
        await pool.decode(ref)
        await asyncio.sleep(0.05)


def test_a_pool_is_sized_once_from_measured_decode_and_model_costs() -> None:
    from batchline._stats import BatchStats

    pictures = [ImageRef(data=jpeg_bytes(i, size=(24, 20))) for i in range(32)]

    async def main() -> list[tuple[bool, int]]:
        async with DecodePool(PRE, DecodeOptions(), cores=2) as pool:
            seen = [(await pool.size_from(BatchStats(total_batches=5), 1), pool.active)]
            await asyncio.gather(*(pool.decode(p) for p in pictures[:8]))
            slow = BatchStats(total_batches=4, total_completed=32, busy_time_s=100.0)
            seen.append((await pool.size_from(slow, 1), pool.active))  # 8 decoded: too few
            await asyncio.gather(*(pool.decode(p) for p in pictures[8:]))
            few = BatchStats(total_batches=1, total_completed=32, busy_time_s=100.0)
            seen.append((await pool.size_from(few, 1), pool.active))  # one batch: too few
            seen.append((await pool.size_from(slow, 1), pool.active))  # a slow model: one
            fast = BatchStats(total_batches=4, total_completed=32, busy_time_s=1e-6)
            seen.append((await pool.size_from(fast, 1), pool.active))  # sized once, for good
            return seen

    assert asyncio.run(main()) == [(False, 2), (False, 2), (False, 2), (True, 1), (True, 1)]
