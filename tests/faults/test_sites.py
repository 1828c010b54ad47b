"""Every write site in ``src/`` has its line in the harness's table (``harness.SITES``): a new
site fails here until a scenario covers it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import batchline

from .harness import SITES

_SITE = re.compile(r"(run|batch|drive|cache|config)\.[a-z0-9]+")
_CALLS = {"checkpoint", "replacing", "write_whole", "append_synced", "fsync_dir"}


def _sites_in_src() -> dict[str, str]:
    """Each site name passed to ``batchline._fsio``'s functions (a literal argument, or a
    ``_SITE`` constant) -> where."""
    found: dict[str, str] = {}
    root = Path(batchline.__file__).parent
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            values: list[ast.expr] = []
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in _CALLS:
                    values = [*node.args, *(k.value for k in node.keywords)]
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "_SITE" for t in node.targets
            ):
                values = [node.value]
            for value in values:
                if not (isinstance(value, ast.Constant) and isinstance(value.value, str)):
                    continue
                if _SITE.fullmatch(value.value):
                    found.setdefault(value.value, f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_every_write_site_has_a_line_in_the_harness() -> None:
    found = _sites_in_src()
    assert {"run.part", "run.manifest", "batch.meta", "cache.result", "config.knobs"} <= set(found)
    missing = {site: where for site, where in found.items() if site not in SITES}
    assert not missing, f"add a line to tests/faults/harness.py SITES for: {missing}"


def test_every_write_through_fsio_names_its_site() -> None:
    """A call of ``write_whole``/``replacing``/``append_synced`` without a site name would
    slip past the table: each one in ``src/`` passes one (a literal or a name)."""
    root = Path(batchline.__file__).parent
    bare = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "_fsio.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name in _CALLS - {"fsync_dir"} and len(node.args) < (
                2 if name != "append_synced" else 3
            ):
                bare.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not bare, f"name the write site: {bare}"
