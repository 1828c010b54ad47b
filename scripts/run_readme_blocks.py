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


def commands(readme: str) -> list[str]:
    """Each command line of the README's bash blocks, continuations joined, in order."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = _strip_comment(line).strip()
            if line:
                found.append(line)
    return found


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


def _serve(line: str, log: Path) -> tuple[str, str]:
    """Start a ``batchline serve`` line, wait for /ready, stop it: (outcome, detail)."""
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
                    return "refused", lines[0]
                return "FAILED", f"exit {proc.returncode}:\n{text[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            return "FAILED", f"not ready after {SERVE_READY_S} s"
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        return ("ran", "ready, then SIGTERM: exit 0") if code == 0 else ("FAILED", f"exit {code}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> int:
    clone = Path(sys.argv[1]).resolve()
    here = Path.cwd()
    report: list[tuple[str, str, str]] = []
    for n, line in enumerate(commands((clone / "README.md").read_text(encoding="utf-8")), 1):
        print(f"== README line {n}: {line}", flush=True)
        if re.match(r"bash scripts/(run|test)\.sh\b", line):
            report.append(("skipped", line, "run.sh: stage 1 of the check; test.sh: CI, before it"))
            continue
        if re.search(r"(^|\s)batchline\s+serve\b", line):
            outcome, detail = _serve(line, here / f"serve-{n}.log")
            report.append((outcome, line, detail))
            continue
        cwd = clone if line.startswith("pip ") else here
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
            report.append(("ran", line, "exit 0"))
        elif (refusal := _refused(done)) is not None:
            report.append(("refused", line, refusal))
        else:
            report.append(("FAILED", line, f"exit {done.returncode}:\n{done.stderr[-3000:]}"))
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
