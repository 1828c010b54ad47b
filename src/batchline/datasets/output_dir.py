"""A job's output folder, apart from the chunks written into it: the name it gets when the job
names none, which of its files are the chunk writer's own, its one writer (a lock held while a
job writes into it), opening it (new, overwritten or resumed, dropping what a crashed run wrote
after its last manifest), and how a failure of its disk is said to the user.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from batchline._dir_lock import DirBusyError, DirLock, lock_dir
from batchline._errors import DiskError, InputError
from batchline._fsio import disk_errno, disk_phrase
from batchline.datasets.flushed import FLUSHED
from batchline.datasets.manifest import (
    MANIFEST_NAME,
    SKIPPED_NAME,
    TMP,
    Manifest,
    check_settings,
    exists_message,
    write_manifest,
)

__all__ = [
    "FAILURES_NAME",
    "default_output",
    "disk_error",
    "lock_output",
    "open_output",
    "own_file",
    "refuse_if_busy",
]

_PART = re.compile(r"part-\d{6,}\.(?:parquet|jsonl)(?:\.tmp)?")
_OWN_NAMES = {MANIFEST_NAME, SKIPPED_NAME, MANIFEST_NAME + TMP, SKIPPED_NAME + TMP}
#: ``drive``'s log of failed records beside the chunks: its lines count only for chunks a
#: manifest lists (``driver.drive``), so without a manifest it holds nothing to resume.
FAILURES_NAME = "_failures.jsonl"
_DISK_FIX = {
    errno.ENOSPC: "free some space",
    errno.EDQUOT: "free some space or raise the quota",
    errno.EROFS: "choose a writable output folder (--output)",
    errno.EACCES: "choose a writable output folder (--output)",
    errno.EPERM: "choose a writable output folder (--output)",
}


def default_output(input_path: Path | None, task: str) -> Path:
    """The output folder of a job that names none, in the current directory: ``STEM.embeddings``
    for the embed task, ``STEM.results`` for the others (``run``'s and ``drive``'s alike).
    ``STEM`` is the input's name without its extension (:func:`_stem`)."""
    stem = "demo-corpus" if input_path is None else _stem(input_path)
    return Path(f"{stem}.{'embeddings' if task == 'embed' else 'results'}")


def _stem(path: Path) -> str:
    """``path``'s name without its extension; for ``.`` or ``..``, the name of the folder it
    resolves to; for a brace pattern of shards, the name without the range
    (``shards/train-{000..009}.tar``: ``train``), or the shards' folder's when nothing else is
    left (``shards/{000..009}.tar``: ``shards``)."""
    if path.name in ("", ".", ".."):
        return path.resolve().stem or "root"
    if "{" in path.name:
        from batchline.datasets.formats.images import without_range

        rest = without_range(path.stem).strip("-_. ")
        if rest != path.stem:
            return rest or _stem(path.parent)
    return path.stem


def own_file(name: str) -> bool:
    """Whether ``name``, in an output folder, is one of the chunk writer's own files."""
    return name in _OWN_NAMES or bool(_PART.fullmatch(name) or FLUSHED.fullmatch(name))


def lock_output(out: Path) -> DirLock:
    """Hold ``out`` (made if missing) for this job's writer until it is released (a lock on the
    folder itself: nothing is added to it): a second job on the same folder (a ``--resume``
    while the first still runs would drop the files the first is about to commit) is refused in
    one line. ``OSError`` where the disk refuses the folder (full, read-only: the caller says
    so), ``InputError`` where the path cannot be a folder (a file on its way)."""
    if out.exists() and not out.is_dir():
        raise InputError(f"{out} exists and is not a directory; choose another output path")
    try:
        return lock_dir(out)
    except DirBusyError:
        raise InputError(
            f"{out} is being written by another batchline job; wait for it to end (then "
            "--resume goes on from its last chunk), or choose another output folder"
        ) from None
    except OSError as exc:
        if disk_errno(exc) is not None:
            raise
        raise InputError(
            f"cannot make the output folder {out}: {exc.strerror or exc}; choose another "
            "output path"
        ) from None


def refuse_if_busy(out: Path) -> None:
    """Refuse at once, in :func:`lock_output`'s one line, a job whose output folder another
    job is writing: called before the model loads, which can take minutes. A folder that does
    not exist yet is left alone (the writer makes it, and removes it if it wrote nothing). The
    writer takes the lock for itself when it opens: this check only answers sooner."""
    if out.is_dir():
        lock_output(out).release()


def open_output(
    out: Path, settings: dict[str, object], *, overwrite: bool, resume: bool
) -> tuple[Manifest, bool]:
    """The manifest a writer into ``out`` starts from, and whether it began the output: a
    resumed folder's (recovered), else a new one written in an empty (or overwritten) folder
    (the writer holds the folder: :func:`lock_output`)."""
    if out.exists() and not out.is_dir():
        raise InputError(f"{out} exists and is not a directory; choose another output path")
    entries = sorted(p.name for p in out.iterdir()) if out.exists() else []
    if resume and MANIFEST_NAME in entries:
        manifest = Manifest.load(out)
        check_settings(out, manifest.settings, settings)
        _recover(out, manifest, entries)
        return manifest, False
    # A run that failed before its first chunk removes its folder or its own files; what a
    # task of it still wrote meanwhile (a failed record's line in drive's log) holds nothing
    # committed: a resume then starts afresh, as on a new folder, instead of refusing it.
    bare = all(own_file(name) or name == FAILURES_NAME for name in entries)
    if resume and entries and not bare:
        raise InputError(
            f"{out} has no {MANIFEST_NAME}, so there is no batchline job to resume; "
            "choose another output path, or pass --overwrite to write into it"
        )
    if entries and not resume and not overwrite:
        raise InputError(exists_message(out, entries, settings))
    for name in entries:  # overwritten, or a bare folder resumed: the writer's own files go
        if own_file(name):
            (out / name).unlink()
    out.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(settings=settings, chunks={})
    write_manifest(out, manifest)
    return manifest, True


def _recover(out: Path, manifest: Manifest, entries: list[str]) -> None:
    """Drop what a crashed run wrote after its last manifest."""
    listed = {c.file for c in manifest.chunks.values() if c.file is not None}
    for name in entries:
        # Temp files, and part or flushed files renamed before their manifest was: both
        # uncommitted.
        stray = name.startswith(("part-", "_flushed-")) and name not in {
            *listed,
            manifest.flushed,
        }
        if own_file(name) and (name.endswith(TMP) or stray):
            (out / name).unlink()
    missing = sorted(listed - set(entries))
    if missing:
        raise InputError(
            f"{out}: {missing[0]} is listed in {MANIFEST_NAME} but missing; "
            "pass --overwrite to start the job again"
        )
    skipped = out / SKIPPED_NAME
    size = skipped.stat().st_size if skipped.exists() else 0
    if size < manifest.skipped_bytes:
        raise InputError(
            f"{skipped} is shorter than {MANIFEST_NAME} records; pass --overwrite to start again"
        )
    if size > manifest.skipped_bytes:
        # Lines appended by a commit whose manifest was never written: that chunk is redone.
        with open(skipped, "r+b") as f:
            f.truncate(manifest.skipped_bytes)
            os.fsync(f.fileno())


def disk_error(out: Path, exc: BaseException, *, committed: bool = True) -> DiskError | None:
    """``exc`` as a one-line ``DiskError`` naming the folder and the fix when it is the disk's
    failure (full, read-only, I/O error), else None."""
    code = disk_errno(exc)
    if code is None:
        return None
    fix = _DISK_FIX.get(code, "check the disk")
    again = (
        "then rerun with --resume to continue from the last committed chunk"
        if committed
        else "then run the job again"
    )
    return DiskError(
        f"cannot write to {out}: the file system {disk_phrase(code)}; {fix}, {again}", code
    )
