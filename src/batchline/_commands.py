"""The commands a hint names, spelled so that they work where this batchline runs.

Standard library only. A hint that says ``batchline run ... --resume`` or ``pip install
'batchline[generate]'`` leads nowhere after ``bash scripts/run.sh``: its ``batchline`` and its
``pip`` live in the clone's ``.venv/bin``, not on ``PATH``, and batchline is not on PyPI. So a
hint asks here for the program and the install command: the bare names where ``PATH`` finds
this environment's own, else absolute paths; batchline's extras from the folder it was
installed from.

>>> program()                    # 'batchline', or '/home/me/batchline/.venv/bin/batchline'
>>> install_command("generate")  # "pip install torch==2.13.0 -e '/home/me/batchline[generate]'"
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from importlib import metadata
from pathlib import Path

__all__ = ["TORCH_REQUIREMENT", "install_command", "pip_command", "program"]

#: torch's CPU wheel. Installed with (or before) the ``generate`` extra it satisfies the extra's
#: range; without the pin pip resolves a multi-GB CUDA build.
TORCH_REQUIREMENT = "torch==2.13.0"

#: The extras that need torch (installed with the pin above).
_TORCH_EXTRAS = frozenset({"generate", "dev"})


def _own(name: str) -> str | None:
    """``name`` as this environment holds it beside the interpreter: the bare name when ``PATH``
    finds that very file, else its absolute path; ``None`` when it has none."""
    here = Path(os.path.abspath(sys.executable)).parent / name
    if not here.is_file():
        return None
    found = shutil.which(name)
    if found is not None and os.path.abspath(found) == str(here):
        return name
    return str(here)


def program() -> str:
    """The command that runs this batchline: ``batchline`` when ``PATH`` finds this
    environment's script, its absolute path when not (a ``run.sh`` setup), else
    ``PYTHON -m batchline``."""
    own = _own("batchline")
    if own is not None:
        return own
    return shlex.join([os.path.abspath(sys.executable), "-m", "batchline"])


def pip_command() -> str:
    """``pip install`` for this environment (``/abs/.venv/bin/python -m pip install`` when this
    environment's pip is not the one on ``PATH``)."""
    if _own("pip") == "pip":
        return "pip install"
    return shlex.join([os.path.abspath(sys.executable), "-m", "pip", "install"])


def install_command(*extras: str) -> str:
    """The one command that installs batchline's ``extras`` here (torch pinned to its CPU wheel
    where an extra needs torch), from the folder batchline came from."""
    names = ",".join(extras)
    parts = [pip_command()]
    if _TORCH_EXTRAS & set(extras):
        parts.append(TORCH_REQUIREMENT)
    source, editable = _source()
    if source is None:
        parts.append(shlex.quote(f"batchline[{names}]"))
    else:
        parts += ["-e"] if editable else []
        parts.append(shlex.quote(f"{source}[{names}]"))
    return " ".join(parts)


def _source() -> tuple[str | None, bool]:
    """The folder batchline is installed from, and whether it runs from there (editable);
    ``(None, False)`` when neither the package nor its metadata says."""
    tree = Path(__file__).resolve().parents[2]
    if (tree / "pyproject.toml").is_file() and (tree / "src" / "batchline").is_dir():
        return str(tree), True
    try:
        text = metadata.distribution("batchline").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None, False
    try:
        url = json.loads(text or "{}").get("url", "")
    except ValueError:
        return None, False
    if isinstance(url, str) and url.startswith("file://"):
        return url.removeprefix("file://"), False
    return None, False
