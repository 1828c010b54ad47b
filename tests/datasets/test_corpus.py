"""The demo corpus: extraction rules on small inputs, then the real corpus once per session."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchline._errors import InputError
from batchline.datasets import corpus
from batchline.datasets.corpus import demo_corpus_path, iter_corpus_records
from batchline.datasets.sources import Record, open_source


def test_paragraphs_are_split_cleaned_and_filtered() -> None:
    doc = """Summary line of the function.

        A longer paragraph that
        wraps over   two lines.

        >>> example()
        42

        Too short.

        Arguments:
          x -- the first value
          y -- the second value
        - a bullet item here
        1. a numbered item here

        Section heading
        ---------------
        """

    assert list(corpus._paragraphs(doc)) == [
        "Summary line of the function.",
        "A longer paragraph that wraps over two lines.",
        "x -- the first value",
        "y -- the second value",
        "- a bullet item here",
        "1. a numbered item here",
    ]


def test_docstrings_are_named_by_module_and_qualname(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "mod.py").write_text(
        '"""Module doc."""\n'
        "class A:\n"
        '    """Class doc."""\n'
        "    def f(self):\n"
        '        """Method doc."""\n'
        "async def g():\n"
        '    """Coroutine doc."""\n'
        'x = "\\d"  # an invalid escape: its warning must not escape\n',
        encoding="utf-8",
    )
    (pkg / "py2.py").write_text('print "python 2"\n', encoding="utf-8")

    assert list(corpus._docstrings(pkg / "mod.py", tmp_path)) == [
        ("pkg.mod:", "Module doc."),
        ("pkg.mod:A", "Class doc."),
        ("pkg.mod:A.f", "Method doc."),
        ("pkg.mod:g", "Coroutine doc."),
    ]
    assert list(corpus._docstrings(pkg / "py2.py", tmp_path)) == []


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path))
    assert corpus.cache_dir() == tmp_path
    monkeypatch.delenv("BATCHLINE_CACHE_DIR")
    assert corpus.cache_dir().name == "batchline"


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHLINE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield demo_corpus_path()


def test_demo_corpus_has_enough_distinct_prose(corpus_file: Path) -> None:
    rows = [json.loads(line) for line in corpus_file.read_text(encoding="utf-8").splitlines()]

    # 20,854 on CPython 3.11.7 with its test suite, 14,604 on Debian's python3 without it
    assert len(rows) >= 10_000
    assert len({r["id"] for r in rows}) == len(rows)
    assert len({r["text"] for r in rows}) == len(rows)
    assert all(len(r["text"].split()) >= 3 for r in rows)
    assert not any(r["text"].startswith(">>>") for r in rows)  # prose may mention the prompt
    assert not any("  " in r["text"] or "\n" in r["text"] for r in rows)
    lengths = sorted(len(r["text"].split()) for r in rows)
    assert lengths[len(lengths) // 2] < 30 < 100 < lengths[-1]  # varied: short to long
    assert rows[0]["id"].startswith(("__future__:", "__hello__:", "_"))  # sorted path order


def test_demo_corpus_is_cached_and_deterministic(
    corpus_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(corpus_file.parent))

    def must_not_run() -> Iterator[dict[str, str]]:
        raise AssertionError("the corpus was generated again")

    monkeypatch.setattr(corpus, "iter_corpus_records", must_not_run)
    assert demo_corpus_path() == corpus_file
    assert not [p for p in corpus_file.parent.iterdir() if p.suffix == ".tmp"]
    monkeypatch.undo()

    with open(corpus_file, encoding="utf-8") as f:
        head = [json.loads(line) for line in itertools.islice(f, 2_000)]
    assert list(itertools.islice(iter_corpus_records(), 2_000)) == head


def test_demo_corpus_refuses_an_impossible_size(
    corpus_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(corpus_file.parent))
    with pytest.raises(ValueError, match="fewer than 10000000"):
        demo_corpus_path(min_records=10_000_000)


def test_a_python_without_its_test_suite_still_has_a_demo_corpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Debian's python3 ships the standard library's tests apart (libpython3.11-testsuite): its
    # corpus is ~14,600 records, and `batchline run` with no input must still take it.
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path))
    few = [{"id": f"m:{n}#0", "text": f"paragraph number {n} of a small library"} for n in range(7)]
    monkeypatch.setattr(corpus, "iter_corpus_records", lambda: iter(few))
    path = demo_corpus_path()
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == few
    with pytest.raises(ValueError, match="7 records, fewer than 8") as refused:
        demo_corpus_path(min_records=8)
    assert isinstance(refused.value, InputError)  # the CLI's one line, not a traceback


def test_demo_corpus_is_a_valid_source(corpus_file: Path) -> None:
    source = open_source(corpus_file)
    first = next(iter(source))
    assert isinstance(first, Record)
    assert first.index == 0
    assert first.id == json.loads(corpus_file.read_text(encoding="utf-8").split("\n", 1)[0])["id"]
