"""Pictures as records: a folder of image files, or WebDataset ``.tar`` shards.

- A **folder** (``images``): every picture under it (by extension, :data:`IMAGE_SUFFIXES`),
  recursive, sorted by relative path; the id is that path (``/``-separated). Folders reached
  through symlinks are followed once each, so a symlink loop ends the descent instead of the
  job; a file that cannot be read (a dangling link, a link loop, no permission) is that
  record's error when its bytes are read.
- **WebDataset shards** (``webdataset``), the layout img2dataset and clip-retrieval write: a
  ``.tar`` file, a folder of them, or a brace pattern (``shards/{00000..00099}.tar``). A sample
  is the run of consecutive members sharing a key (the member's path up to the first dot of
  its name): ``KEY.jpg`` is its picture, ``KEY.txt`` and ``KEY.json`` its fields. The id is the
  key; ``--copy-column txt`` copies the text, ``--copy-column NAME`` a field of the JSON. A
  shard that cannot be read, or is damaged past some sample, is one bad record after the
  samples read before the damage (``SHARD#damaged``): under ``--on-bad-record skip`` the
  other shards go on.

Each record's input is an :class:`~batchline.models.image.ImageRef` (the file, or the span of
the shard holding the member): the bytes are read by a decode worker, never here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from batchline._errors import InputError
from batchline.datasets.formats.base import Item, Record, Skipper, Source
from batchline.models.image import IMAGE_SUFFIXES, ImageRef

__all__ = ["ImageFolderSource", "ShardSource", "expand_shards", "is_shard_input", "without_range"]

_BRACES = re.compile(r"\{(\d+)\.\.(\d+)\}")


def is_shard_input(path: Path) -> bool:
    """Whether ``path`` names WebDataset shards: a ``.tar``, a brace pattern, or a folder
    whose top level holds ``.tar`` files."""
    if _BRACES.search(path.name) or path.suffix.lower() == ".tar":
        return True
    if path.is_dir():
        try:
            with os.scandir(path) as entries:
                return any(e.name.lower().endswith(".tar") and e.is_file() for e in entries)
        except OSError:
            return False
    return False


def without_range(name: str) -> str:
    """``name`` without its brace range: ``train-{000..009}`` is ``train-``."""
    return _BRACES.sub("", name)


def expand_shards(path: Path) -> list[Path]:
    """The shard files ``path`` names, in order; ``InputError`` when one is missing."""
    match = _BRACES.search(path.name)
    if match:
        first, last = match.group(1), match.group(2)
        if int(last) < int(first):
            raise InputError(f"{path}: the range {{{first}..{last}}} runs backwards")
        width = len(first) if first.startswith("0") else 0
        names = [
            path.name[: match.start()] + str(n).zfill(width) + path.name[match.end() :]
            for n in range(int(first), int(last) + 1)
        ]
        shards = [path.with_name(name) for name in names]
    elif path.is_dir():
        shards = sorted(p for p in path.iterdir() if p.suffix.lower() == ".tar" and p.is_file())
    else:
        shards = [path]
    missing = [s for s in shards if not s.is_file()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InputError(f"{missing[0]}: no such shard{more}")
    if not shards:
        raise InputError(f"{path}: no .tar shards in it")
    return shards


def _listing_fingerprint(entries: Iterator[tuple[str, os.stat_result | None]]) -> str:
    """A digest of names, sizes and modification times (not of the bytes: a folder of
    photos is gigabytes), for a resumed job to check it reads the same input."""
    h = hashlib.blake2b(digest_size=16)
    count = 0
    for name, st in entries:
        count += 1
        stamp = f"{st.st_size}:{st.st_mtime_ns}" if st is not None else "unreadable"
        h.update(f"{name}\0{stamp}\n".encode("utf-8", "surrogateescape"))
    return f"{count} files:{h.hexdigest()}"


class ImageFolderSource(Source):
    """Every picture under a folder (see the module docstring)."""

    def _read_columns(self) -> bool:
        self._refuse_columns("a folder of pictures", "the pictures' paths under it")
        self.extra_columns = ()
        self._files = self._walk()
        self.total_records = len(self._files)
        return False

    def _walk(self) -> list[tuple[str, Path, os.stat_result | None]]:
        found: list[tuple[str, Path, os.stat_result | None]] = []
        seen: set[tuple[int, int]] = set()

        def visit(folder: Path, prefix: str) -> None:
            try:
                st = folder.stat()
            except OSError:
                return  # a link to nowhere, or a loop of links: nothing below it
            if (st.st_dev, st.st_ino) in seen:
                return  # reached again through a symlink: a loop, or a second way in
            seen.add((st.st_dev, st.st_ino))
            try:
                with os.scandir(folder) as listing:
                    entries = sorted(listing, key=lambda e: e.name)
            except OSError as exc:
                raise InputError(f"{folder}: cannot list the folder: {exc.strerror}") from None
            for entry in entries:
                rel = f"{prefix}{entry.name}"
                try:
                    is_dir = entry.is_dir()  # follows symlinks; a loop of links is no folder
                except OSError:
                    is_dir = False
                if is_dir:
                    visit(Path(entry.path), rel + "/")
                elif Path(entry.name).suffix.lower() in IMAGE_SUFFIXES:
                    try:
                        info: os.stat_result | None = entry.stat()
                    except OSError:
                        info = None  # read (and reported) as that record's error
                    found.append((rel, Path(entry.path), info))

        visit(self.path, "")
        return found

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = _listing_fingerprint((rel, st) for rel, _, st in self._files)
        return self._fingerprint

    def _items(self, skipper: Skipper, block_size: int) -> Iterator[Item]:
        for index, (rel, path, st) in enumerate(self._files):
            if skipper.skipped(index):
                continue
            size = st.st_size if st is not None else None
            yield Record(index, rel, "", {}, ImageRef(path=str(path), size=size))
        self.total_records = len(self._files)


class ShardSource(Source):
    """The samples of WebDataset ``.tar`` shards (see the module docstring)."""

    def _read_columns(self) -> bool:
        if self._id_requested is not None:
            raise InputError(
                f"{self.path}: a shard's ids are its sample keys; leave --id-column out"
            )
        self.shards = expand_shards(self.path)
        self.extra_columns = tuple(self._extra_requested or ())
        self.total_records = sum(1 for _ in self._samples(count_only=True))
        return False

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = _listing_fingerprint((str(s), s.stat()) for s in self.shards)
        return self._fingerprint

    def _samples(
        self, *, count_only: bool = False
    ) -> Iterator[tuple[Path, str, list[tarfile.TarInfo], tarfile.TarFile] | _Damage]:
        """(shard, key, its members, the open shard) for every sample, in order; a shard that
        cannot be opened, or is damaged past some sample, gives the samples read before the
        damage, then one :class:`_Damage` (a bad record of its own: the other shards go on)."""
        for shard in self.shards:
            try:
                tar = tarfile.open(shard, mode="r:")  # noqa: SIM115 (closed by the with below)
            except (tarfile.TarError, OSError) as exc:
                yield _Damage(shard, f"not a readable .tar shard: {exc}")
                continue
            with tar:
                key: str | None = None
                members: list[tarfile.TarInfo] = []
                try:
                    for member in tar:
                        if not member.isfile():
                            continue
                        head, _, name = member.name.rpartition("/")
                        stem = name.split(".", 1)[0]
                        this = f"{head}/{stem}" if head else stem
                        if this != key and members:
                            assert key is not None
                            yield shard, key, members, tar
                            members = []
                        key = this
                        if not count_only or not members:  # counting keeps one per sample
                            members.append(member)
                except (tarfile.TarError, OSError) as exc:
                    # the sample being read when the damage came is lost with what follows
                    after = f" after sample {key!r}" if key is not None else ""
                    yield _Damage(shard, f"the shard is damaged{after}: {exc}")
                    continue
                if members and key is not None:
                    yield shard, key, members, tar

    def _items(self, skipper: Skipper, block_size: int) -> Iterator[Item]:
        index = -1
        for index, sample in enumerate(self._samples()):
            if skipper.skipped(index):
                continue
            if isinstance(sample, _Damage):
                where = sample.shard.name
                yield self._bad(index, f"{where}#damaged", where, sample.reason, str(sample.shard))
                continue
            shard, key, members, tar = sample
            picture = next((m for m in members if _suffix(m.name) in IMAGE_SUFFIXES), None)
            if picture is None:
                names = ", ".join(m.name for m in members)
                yield self._bad(
                    index, key, f"{shard.name}: sample {key!r}", "holds no picture", names
                )
                continue
            extra: dict[str, object] = {}
            if self.extra_columns:
                extra = self._fields(tar, members, shard, key)
            ref = ImageRef(path=str(shard), offset=picture.offset_data, size=picture.size)
            yield Record(index, key, "", extra, ref)
        self.total_records = index + 1

    def _fields(
        self, tar: tarfile.TarFile, members: list[tarfile.TarInfo], shard: Path, key: str
    ) -> dict[str, object]:
        """The copied columns of a sample: ``txt`` from ``KEY.txt``, others from ``KEY.json``."""
        text: str | None = None
        fields: dict[str, object] = {}
        for member in members:
            suffix = _suffix(member.name)
            if suffix not in (".txt", ".json"):
                continue
            handle = tar.extractfile(member)
            raw = handle.read() if handle is not None else b""
            if suffix == ".txt":
                text = raw.decode("utf-8", errors="replace")
                continue
            try:
                loaded = json.loads(raw)
            except ValueError:
                loaded = None
            if isinstance(loaded, dict):
                fields = loaded
        return {
            column: text if column == "txt" else fields.get(column)
            for column in self.extra_columns or ()
        }


@dataclass(frozen=True, slots=True)
class _Damage:
    """A shard that cannot be read (on), in the place of its samples from there: one bad
    record, so that the other shards' are not lost with it."""

    shard: Path
    reason: str


def _suffix(name: str) -> str:
    """A member's extension after the key: ``.jpg`` of ``000123.jpg``."""
    base = name.rpartition("/")[2]
    return "." + base.split(".", 1)[1].lower() if "." in base else ""
