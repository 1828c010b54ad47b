"""The demo corpus: real English text of varied length, built offline from the running Python.

Its records are paragraphs of the standard library's docstrings (module, class and function),
then of ``pydoc_data.topics`` (the language reference text behind ``help()``), then of IDLE's
bundled text files (``idlelib/*.txt``: news, history, read-me), then of the docstrings of the
standard library's own test modules. (The library's docstrings alone give about 15,000
paragraphs; the other sources bring CPython 3.11-3.13 to 20,300-20,900.)

Each text is cleaned with ``inspect.cleandoc`` and split into paragraphs at blank lines; list
items ("- x", "1. x", ":param x:", "x -- y") become paragraphs of their own. A paragraph is kept
when it has no ``>>>`` prompt and at least 3 words once heading underlines ("-----") are dropped;
its whitespace is collapsed, and repeats are dropped. The order is deterministic: library files
in sorted path order, then topics by name, then IDLE's files, then test files.

The text is CPython's, so it is generated on first use rather than shipped, and cached as JSONL
(``{"id": ..., "text": ...}``) under ``$BATCHLINE_CACHE_DIR`` or the user cache directory.

    >>> from batchline.datasets.corpus import demo_corpus_path
    >>> path = demo_corpus_path()          # about 20 s the first time, then instant
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import sys
import sysconfig
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

from batchline._cache import cache_dir, write_whole
from batchline._errors import InputError

__all__ = [
    "CORPUS_VERSION",
    "DemoCorpusTooSmallError",
    "cache_dir",
    "demo_corpus_path",
    "iter_corpus_records",
]

#: Bump when the extraction rules change, so stale caches are not reused.
CORPUS_VERSION = 1

_TEST_DIRS = {"test", "tests", "idle_test"}
_NEVER_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_BLANK_LINE = re.compile(r"\n[ \t]*\n")
# A line that opens a list item starts a paragraph of its own.
_ITEM = re.compile(r"\s*(?:[-*+•]\s|\d+[.)]\s|:\w[^:]*:|\w+\s+--\s)")
_MIN_WORDS = 3
# Heading underlines ("-----", "*****"): markup, not words.
_RULE = re.compile(r"([-=*~^#_+])\1{2,}")


class DemoCorpusTooSmallError(InputError, ValueError):
    """This Python's standard library yields fewer records than asked for: an input error (the
    CLI's one line, for ``run``, ``bench`` and the quantization gate alike) and a ValueError."""


def demo_corpus_path(min_records: int = 1) -> Path:
    """Path of the demo corpus JSONL, generating and caching it on first use.

    Its size depends on the Python: CPython 3.11.7 with its test suite (python.org's builds,
    pyenv, the official images) yields 20,854 records; Debian's python3 3.11.2, whose ``test``
    package is a separate apt package, 14,604. Raises :class:`DemoCorpusTooSmallError` if this
    Python's standard library yields fewer than ``min_records`` paragraphs.

        >>> from batchline.datasets.sources import open_source
        >>> source = open_source(demo_corpus_path())
    """
    if min_records < 0:
        raise ValueError(f"min_records must be >= 0, got {min_records}")
    version = ".".join(map(str, sys.version_info[:3]))
    path = cache_dir() / f"stdlib-docstrings-py{version}-v{CORPUS_VERSION}.jsonl"
    if not path.exists():
        lines = (json.dumps(r, ensure_ascii=False) + "\n" for r in iter_corpus_records())
        write_whole(path, "".join(lines).encode("utf-8"), "cache.corpus")
    with open(path, "rb") as f:
        count = sum(1 for _ in f)
    if count < min_records:
        raise DemoCorpusTooSmallError(
            f"the demo corpus of this Python has {count} records, fewer than {min_records}; "
            "ask for fewer, or use your own dataset"
        )
    return path


def iter_corpus_records() -> Iterator[dict[str, str]]:
    """Generate the corpus records (``{"id", "text"}``) afresh, in their deterministic order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    library, tests = _python_files(stdlib)
    seen: set[str] = set()
    ids: set[str] = set()

    def keep(id_: str, paragraphs: Iterable[str]) -> Iterator[dict[str, str]]:
        for n, text in enumerate(paragraphs):
            if text in seen:
                continue
            seen.add(text)
            record_id = f"{id_}#{n}"
            while record_id in ids:  # a name defined twice in one module (if/else branches)
                record_id += "'"
            ids.add(record_id)
            yield {"id": record_id, "text": text}

    for path in library:
        for id_, doc in _docstrings(path, stdlib):
            yield from keep(id_, _paragraphs(doc))
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        pass
    else:
        for name in sorted(topics):
            yield from keep(f"pydoc_data.topics:{name}", _paragraphs(topics[name]))
    for path in sorted((stdlib / "idlelib").glob("*.txt")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        yield from keep(f"idlelib/{path.name}", _paragraphs(text))
    for path in tests:
        for id_, doc in _docstrings(path, stdlib):
            yield from keep(id_, _paragraphs(doc))


def _python_files(stdlib: Path) -> tuple[list[Path], list[Path]]:
    library: list[Path] = []
    tests: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in _NEVER_DIRS)
        rel = Path(dirpath).relative_to(stdlib)
        is_test = any(part in _TEST_DIRS for part in rel.parts)
        for name in sorted(filenames):
            if name.endswith(".py"):
                (tests if is_test else library).append(Path(dirpath) / name)
    return library, tests


def _docstrings(path: Path, stdlib: Path) -> Iterator[tuple[str, str]]:
    """(``module:qualname``, cleaned docstring) for the module and each class and function."""
    try:
        source = path.read_bytes()
        with warnings.catch_warnings():
            # Old modules hold invalid escape sequences; their warnings say nothing about the text.
            warnings.simplefilter("ignore")
            tree = ast.parse(source)
    except (SyntaxError, ValueError, UnicodeDecodeError, OSError):
        return  # test data written in Python 2, or a file that is not source
    module = ".".join(path.relative_to(stdlib).with_suffix("").parts)

    def visit(node: ast.AST, qualname: str) -> Iterator[tuple[str, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{qualname}.{child.name}" if qualname else child.name
                doc = ast.get_docstring(child, clean=True)
                if doc:
                    yield f"{module}:{name}", doc
                yield from visit(child, name)
            else:
                yield from visit(child, qualname)

    doc = ast.get_docstring(tree, clean=True) if isinstance(tree, ast.Module) else None
    if doc:
        yield f"{module}:", doc
    yield from visit(tree, "")


def _paragraphs(doc: str) -> Iterator[str]:
    for block in _BLANK_LINE.split(inspect.cleandoc(doc)):
        lines = block.splitlines()
        if any(line.lstrip().startswith(">>>") for line in lines):
            continue  # a doctest: code, not prose
        current: list[str] = []
        for line in lines:
            if current and _ITEM.match(line):
                yield from _clean(current)
                current = []
            current.append(line)
        yield from _clean(current)


def _clean(lines: list[str]) -> Iterator[str]:
    words = [w for w in " ".join(lines).split() if not _RULE.fullmatch(w)]
    if len(words) >= _MIN_WORDS:
        yield " ".join(words)
