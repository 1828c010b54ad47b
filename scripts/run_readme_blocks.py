"""Run the README's bash blocks in order, as a new user would, in the current directory.

Usage: python3 scripts/run_readme_blocks.py CLONE   (standard library only)

Each command line of each ```bash block runs in order, with the environment it is given
(check_fresh_install.sh: a fresh clone, a venv of one's own on PATH and nothing else). What a
line may do:

- ``bash scripts/run.sh`` and ``bash scripts/test.sh``: skipped, said so (the check runs
  run.sh itself, CI runs test.sh before it);
- ``pip install ...``: run in the clone, where ``.`` is;
- ``batchline serve ...``: started, stopped by SIGTERM once ``/ready`` answers; it must exit 0,
  or refuse in one line (exit 2) when it needs what a fresh clone lacks;
- a line whose comment starts ``# needs the server above`` (a ``curl``): run while the
  ``batchline serve`` line before it in its block is up (ready, before its SIGTERM); it must
  exit 0 (``curl -f``: an HTTP error fails it). When that server refused, the line is reported
  as not run, with the server's refusal; a marked line with no server line above it in its
  block fails the check;
- any other line: it must exit 0, or refuse in one line (exit 2, no traceback) naming what to
  do, when it needs what a fresh clone lacks (an extra not installed, a file of your own such
  as ``./my-classifier/``). A line that exits otherwise fails the check.

At the end it prints what ran, what refused and why, and what was skipped.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

LINE_TIMEOUT_S = 900
SERVE_READY_S = 300


#: The comment that marks a line to run against the server started above it in its block.
NEEDS_SERVER = "needs the server above"


def blocks(readme: str) -> list[list[tuple[str, bool]]]:
    """Each of the README's bash blocks: its command lines (continuations joined, in order),
    each with whether it is marked ``# needs the server above``."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S):
        lines = []
        for raw in block.replace("\\\n", " ").splitlines():
            line = _strip_comment(raw).strip()
            if line:
                comment = raw[len(_strip_comment(raw)) :].strip()
                lines.append((line, comment.startswith(f"# {NEEDS_SERVER}")))
        found.append(lines)
    return found


def commands(readme: str) -> list[str]:
    """Each command line of the README's bash blocks, continuations joined, in order."""
    return [line for block in blocks(readme) for line, _ in block]


def _strip_comment(line: str) -> str:
    """``line`` without its trailing ``# comment`` (a ``#`` inside quotes stays)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _refused(done: subprocess.CompletedProcess[str]) -> str | None:
    """The one line of a clean refusal (exit 2, one stderr line, no traceback), else None."""
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    if done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr:
        return lines[0]
    return None


def _is_serve(line: str) -> bool:
    return re.search(r"(^|\s)batchline\s+serve\b", line) is not None


def _serve(
    line: str, log: Path, while_up: list[str]
) -> tuple[tuple[str, str], list[tuple[str, str]]]:
    """Start a ``batchline serve`` line, wait for /ready, run ``while_up`` (the lines that need
    it), stop it: its (outcome, detail), and each of those lines'."""
    argv = shlex.split(line)
    port = argv[argv.index("--port") + 1] if "--port" in argv else "8000"
    with log.open("wb") as out:
        proc = subprocess.Popen(["bash", "-c", line], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + SERVE_READY_S
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                text = log.read_text(errors="replace")
                lines = [x for x in text.splitlines() if x.strip()]
                if proc.returncode == 2 and len(lines) == 1:
                    why = ("refused", f"not run: the server above refused ({lines[0]})")
                    return ("refused", lines[0]), [why] * len(while_up)
                why = ("FAILED", "not run: the server above failed")
                return ("FAILED", f"exit {proc.returncode}:\n{text[-3000:]}"), [why] * len(while_up)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            why = ("FAILED", "not run: the server above never got ready")
            return ("FAILED", f"not ready after {SERVE_READY_S} s"), [why] * len(while_up)
        outcomes = [_run(needing, log.parent) for needing in while_up]
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        served = ("ran", "ready, then SIGTERM: exit 0") if code == 0 else ("FAILED", f"exit {code}")
        return served, outcomes
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _run(line: str, cwd: Path) -> tuple[str, str]:
    """Run one line: (outcome, detail)."""
    done = subprocess.run(
        ["bash", "-c", line],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=LINE_TIMEOUT_S,
        check=False,
    )
    sys.stdout.write(done.stdout[-2000:])
    if done.returncode == 0:
        return "ran", "exit 0"
    if (refusal := _refused(done)) is not None:
        return "refused", refusal
    return "FAILED", f"exit {done.returncode}:\n{done.stderr[-3000:]}"


def main() -> int:
    clone = Path(sys.argv[1]).resolve()
    here = Path.cwd()
    report: list[tuple[str, str, str]] = []
    n = 0
    for block in blocks((clone / "README.md").read_text(encoding="utf-8")):
        for at, (line, needs_server) in enumerate(block):
            n += 1
            if needs_server:  # run with the server line above it (below), or a mistake
                if not any(_is_serve(above) for above, _ in block[:at]):
                    report.append(("FAILED", line, f"marked '# {NEEDS_SERVER}', but no "
                                   "`batchline serve` line is above it in its block"))  # fmt: skip
                continue
            print(f"== README line {n}: {line}", flush=True)
            if re.match(r"bash scripts/(run|test)\.sh\b", line):
                report.append(("skipped", line, "run.sh: stage 1 of the check; test.sh: CI"))
                continue
            if _is_serve(line):
                # the marked lines after it, up to the next server line of the block
                needing = []
                for later, marked in block[at + 1 :]:
                    if _is_serve(later):
                        break
                    if marked:
                        needing.append(later)
                served, outcomes = _serve(line, here / f"serve-{n}.log", needing)
                report.append((served[0], line, served[1]))
                report += [(o, x, d) for x, (o, d) in zip(needing, outcomes, strict=True)]
                continue
            outcome, detail = _run(line, clone if line.startswith("pip ") else here)
            report.append((outcome, line, detail))
    print("\n== the README's blocks, in order")
    for outcome, line, detail in report:
        print(f"{outcome:8} {line}\n         {detail}")
    failed = [r for r in report if r[0] == "FAILED"]
    ran = [r for r in report if r[0] == "ran"]
    print(
        f"{len(ran)} ran, {len(report) - len(ran) - len(failed)} refused or skipped, "
        f"{len(failed)} failed"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    sys.exit(main())
