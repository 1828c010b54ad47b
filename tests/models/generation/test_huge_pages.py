"""A loaded model's weights moved into 2 MiB pages (``huge_pages.py``): which tensors are a
model's, which 2 MiB spans they touch, what the kernel is asked and what the load log says of
it; the bytes never change."""

from __future__ import annotations

import ctypes
import errno
import logging
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from batchline.models.generation import huge_pages  # noqa: E402
from batchline.models.generation.huge_pages import (  # noqa: E402
    HUGE,
    HugePages,
    into_huge_pages,
    model_tensors,
    span_chunks,
)

MIB = 1 << 20


def test_each_span_touches_the_2_mib_chunks_it_reaches_each_counted_once() -> None:
    spans = [
        (HUGE + 10, 100),  # inside one chunk
        (HUGE + 200, HUGE),  # from that chunk into the next
        (5 * HUGE - 1, 2),  # across a boundary by a byte on each side
        (9 * HUGE, 0),  # empty: nothing
    ]
    assert span_chunks(spans) == [HUGE, 2 * HUGE, 4 * HUGE, 5 * HUGE]
    assert span_chunks([]) == []


class _Packed(torch.nn.Module):
    """A module as the engine's are: a parameter, a buffer, packed tensors in a list (some in
    tuples) and a view of its own parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4, 4))
        self.register_buffer("scale", torch.ones(4))
        self.packed = [torch.zeros(8, dtype=torch.uint8), (torch.zeros(3), torch.zeros(2))]
        self.view = self.weight.detach()[1:]  # the parameter's storage again
        self.on_meta = torch.empty(4, device="meta")
        self.count = 3


def test_a_models_tensors_are_its_parameters_buffers_and_packed_lists_each_storage_once() -> None:
    outer = torch.nn.Sequential(_Packed(), torch.nn.Linear(2, 3))
    found = list(model_tensors(outer))
    first, linear = outer[0], outer[1]
    expected = [
        first.weight,
        first.scale,
        first.packed[0],
        first.packed[1][0],
        first.packed[1][1],
        linear.weight,
        linear.bias,
    ]
    pointer = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    assert sorted(map(pointer, found)) == sorted(map(pointer, expected))
    assert len(found) == len(expected)  # the view of the weight is not its storage again


def _anon_huge_kib(address: int, size: int) -> int:
    """AnonHugePages of the mappings that hold [address, address + size), from smaps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low < address + size and high > address
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are asked on Linux")
def test_a_tensor_moved_into_huge_pages_keeps_its_bytes_and_the_kernel_holds_it_so() -> None:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randint(0, 256, (24 * MIB,), dtype=torch.uint8, generator=generator)
    before = weight.clone()
    done = into_huge_pages([weight])
    assert torch.equal(weight, before)
    storage = weight.untyped_storage()
    chunks = span_chunks([(storage.data_ptr(), storage.nbytes())])
    if done.moved:
        assert done.asked == len(chunks) * HUGE
        # a 24 MiB tensor mapped on its own: all but its first and last chunks can be huge
        assert done.moved >= done.asked - 2 * HUGE
        assert _anon_huge_kib(storage.data_ptr(), storage.nbytes()) * 1024 >= done.moved
        assert "weights in 2 MiB pages" in str(done)
    else:  # a kernel without MADV_COLLAPSE, or THP off: said, not raised
        assert done.reason
        assert str(done).startswith("weights in 4 KiB pages (")


def _fake_madvise(monkeypatch: pytest.MonkeyPatch, fails: Any) -> list[tuple[int, int]]:
    """``madvise`` replaced: MADV_COLLAPSE of chunk ``i`` fails with ``fails(i)`` (an errno, or
    0: done); every call recorded as (address, advice)."""
    calls: list[tuple[int, int]] = []
    collapses = iter(range(1 << 30))

    def madvise(address: int, size: int, advice: int) -> int:
        assert size == HUGE
        assert address % HUGE == 0
        calls.append((address, advice))
        if advice != huge_pages._MADV_COLLAPSE:
            return 0
        code = fails(next(collapses))
        if code:
            ctypes.set_errno(code)
            return -1
        return 0

    monkeypatch.setattr(huge_pages, "_madvise", lambda: madvise)
    monkeypatch.setattr(huge_pages, "_refused", lambda: "")
    return calls


@pytest.mark.parametrize(
    ("code", "said", "asked_again"),
    [
        (errno.EINVAL, "this kernel has no MADV_COLLAPSE: Linux 6.1 and later", False),
        (errno.EAGAIN, "the kernel could not collapse a 2 MiB probe now (EAGAIN: ", True),
        (errno.ENOMEM, "the kernel could not collapse a 2 MiB probe now (ENOMEM: ", True),
    ],
)
def test_a_probe_the_kernel_refuses_leaves_the_pages_and_says_why(
    code: int, said: str, asked_again: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EINVAL is a kernel without MADV_COLLAPSE, for good; EAGAIN or ENOMEM is a kernel with
    no free 2 MiB page at that moment (seen on Linux 6.18, said as "no MADV_COLLAPSE" before),
    and the next load asks again."""
    probes: list[int] = []

    def probe() -> int:
        probes.append(code)
        return code

    probe.cache_clear = lambda: probes.append(-1)  # type: ignore[attr-defined]
    monkeypatch.setattr(huge_pages, "_probe_errno", probe)
    monkeypatch.setattr(huge_pages, "_madvise", lambda: pytest.fail("madvise asked"))
    done = into_huge_pages([torch.zeros(3 * MIB, dtype=torch.uint8)])
    assert (done.asked, done.moved) == (0, 0)
    if (
        sys.platform.startswith("linux")
        and "[never]" not in Path(huge_pages._THP_SETTING).read_text()
    ):
        assert done.reason.startswith(said)
        assert (probes == [code, -1]) is asked_again  # the remembered answer forgotten
        assert (probes == [code]) is not asked_again
    assert str(done) == f"weights in 4 KiB pages ({done.reason})"


def test_each_chunk_is_marked_for_huge_pages_before_its_collapse_is_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _fake_madvise(monkeypatch, lambda i: 0)
    tensor = torch.zeros(5 * MIB, dtype=torch.uint8)
    done = into_huge_pages([tensor])
    storage = tensor.untyped_storage()
    chunks = span_chunks([(storage.data_ptr(), storage.nbytes())])
    advice = (huge_pages._MADV_HUGEPAGE, huge_pages._MADV_COLLAPSE)
    assert calls == [(chunk, each) for chunk in chunks for each in advice]
    assert (done.asked, done.moved, done.reason) == (len(chunks) * HUGE, len(chunks) * HUGE, "")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are asked on Linux")
def test_the_probe_of_madv_collapse_answers_as_a_span_of_the_processs_own_does() -> None:
    huge_pages._probe_errno.cache_clear()
    probed = huge_pages._probe_errno()
    # the probe's answer is the kernel's: a fresh private mapping of 4 MiB, written, collapsed
    import mmap

    with mmap.mmap(-1, 2 * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as region:
        region.write(b"\2" * len(region))
        start = -ctypes.addressof(ctypes.c_char.from_buffer(region)) % HUGE
        try:
            region.madvise(huge_pages._MADV_COLLAPSE, start, HUGE)
            code = 0
        except OSError as exc:
            code = exc.errno or errno.EINVAL
        assert region[start : start + 4] == b"\2" * 4
    # the same answer, unless the kernel's free 2 MiB pages ran out at one of the two asks
    transient = (errno.EAGAIN, errno.ENOMEM)
    assert probed == code or probed in transient or code in transient


def test_the_spans_that_stay_in_small_pages_are_counted_by_their_errno(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_madvise(monkeypatch, lambda i: errno.EINVAL if i == 0 else errno.EAGAIN if i == 1 else 0)
    tensor = torch.zeros(9 * MIB, dtype=torch.uint8)
    done = into_huge_pages([tensor])
    storage = tensor.untyped_storage()
    chunks = len(span_chunks([(storage.data_ptr(), storage.nbytes())]))
    assert done.asked == chunks * HUGE
    assert done.moved == (chunks - 2) * HUGE
    assert done.reason == "2 spans of 2 MiB stayed in 4 KiB pages (1 of them EINVAL)"
    moved, asked = (chunks - 2) * 2, chunks * 2
    assert str(done).startswith(f"weights in 2 MiB pages: {moved:,} of {asked:,} MiB in ")


def test_where_the_system_never_grants_huge_pages_none_is_asked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "_THP_SETTING", str(setting))
    monkeypatch.setattr(huge_pages, "_madvise", lambda: pytest.fail("madvise asked"))
    done = into_huge_pages([torch.zeros(3 * MIB, dtype=torch.uint8)])
    if sys.platform.startswith("linux"):
        assert done.reason == f"{setting} is never"
    assert str(done).startswith("weights in 4 KiB pages (")
    assert HugePages(0, 0, 0.0).__str__() == "no weights"


def test_the_load_log_says_where_the_weights_are_and_the_knob_turns_it_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, torch_threads: None
) -> None:
    pytest.importorskip("transformers")
    from batchline.models.config import Knobs
    from batchline.models.generation.load import load_text_generator
    from batchline.models.specs import parse_spec

    from .test_load import save_tiny_generator

    folder = save_tiny_generator(tmp_path / "tiny")
    said = {}
    for huge in (True, False):
        with caplog.at_level(logging.INFO, logger="batchline.generation"):
            loaded = load_text_generator(parse_spec(f"{folder}/"), Knobs(huge_pages=huge))
        lines = [r.getMessage() for r in caplog.records if "read per decode step" in r.getMessage()]
        caplog.clear()
        assert len(lines) == 1, lines
        said[huge] = lines[0]
        loaded.close()
    assert "weights in 2 MiB pages: " in said[True] or "weights in 4 KiB pages (" in said[True]
    assert "MiB pages" not in said[False]
    assert "KiB pages" not in said[False]
