"""The layout rules the house keeps: no import circle among batchline's modules nor among
any package's children (its modules and subpackages, each taken whole), no module over 650
lines (the core batcher may reach 1,100), layers that point down (:data:`LAYERS`), and code
outside ``models/`` that reaches a backend only through its package's face.

The import graph is read from the source with ``ast``, so nothing is imported. Every ``import``
and ``from ... import`` counts, at module level and inside functions alike: a function-local
import still ties the two modules together, it only hides the knot until run time. Imports
under ``if TYPE_CHECKING:`` count too: they never run, but a module that names another's types
depends on its design, and a cycle there is the same knot for the reader.
An edge goes to the module named (``from batchline.models import loader`` is an edge to
``batchline.models.loader``; ``from batchline.models import BatchModel`` to the package
``batchline.models``); a package's ``__init__`` that an import runs on the way is not counted.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "batchline"
MAX_LINES = 650
ALLOWED = {"batchline._batcher": 1_100}


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import in ``tree``, at any depth (``if TYPE_CHECKING:`` blocks included)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def _targets(
    module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]
) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name in known:
                yield alias.name
        return
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        if submodule in known:
            yield submodule
        elif base in known:
            yield base


def import_graph() -> dict[str, set[str]]:
    """batchline's modules, each with the batchline modules it imports."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        edges = {t for node in _imports(tree) for t in _targets(name, is_package, node, known)}
        edges.discard(name)
        graph[name] = edges
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the components with more than one module (each one a knot of
    cycles), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, for the failure message."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt_frontier: list[str] = []
        for node in frontier:
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    return component  # pragma: no cover - a component always holds a cycle through start


def test_the_graph_is_read_from_the_source() -> None:
    graph = import_graph()
    # a module-level and a function-local import both make an edge
    assert "batchline._errors" in graph["batchline._batcher"]
    assert "batchline.models.loader" in graph
    assert any(graph.values())


def test_the_cycle_finder_finds_a_knot_and_its_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert _one_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_type_checking_and_function_local_imports_count() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import x\nelse:\n    import y\n"
        "def f():\n    import z\n"
    )
    names = [a.name for node in _imports(tree) if isinstance(node, ast.Import) for a in node.names]
    assert names == ["x", "y", "z"]


def test_no_import_circle() -> None:
    graph = import_graph()
    knots = strongly_connected(graph)
    report = "\n".join(
        f"- {' -> '.join(_one_cycle(graph, knot))}  (knot of {len(knot)}: {', '.join(knot)})"
        for knot in knots
    )
    assert not knots, f"{len(knots)} import circle(s) among batchline's modules:\n{report}"


def package_graphs(graph: dict[str, set[str]]) -> dict[str, dict[str, set[str]]]:
    """For every package, the import graph of its children (its modules and subpackages,
    each with everything under it): child A imports child B when a module under A imports
    one under B. A module's import of a package above it (its face) is no edge between
    children."""
    found: dict[str, dict[str, set[str]]] = {}
    for module, targets in graph.items():
        for target in targets:
            a, b = module.split("."), target.split(".")
            common = 0
            while common < min(len(a), len(b)) and a[common] == b[common]:
                common += 1
            if common in (len(a), len(b)):
                continue  # one contains the other
            parent = ".".join(a[:common])
            child_a, child_b = ".".join(a[: common + 1]), ".".join(b[: common + 1])
            found.setdefault(parent, {}).setdefault(child_a, set()).add(child_b)
    return found


def package_knots(graph: dict[str, set[str]]) -> list[list[str]]:
    """The knots among the children of any package (``models.onnx`` <-> ``models.specs``)."""
    return sorted(
        knot for children in package_graphs(graph).values() for knot in strongly_connected(children)
    )


#: Package knots tolerated while a change removes them (none now); an entry must go when its
#: knot does (the test below fails on a stale one).
TOLERATED_KNOTS: list[list[str]] = []


def test_the_package_graph_lifts_module_imports_to_the_packages_children() -> None:
    graph = {
        "batchline.models.onnx.embed": {"batchline.models.specs", "batchline.models"},
        "batchline.models.specs": {"batchline.models.hf.detect"},
        "batchline.models.hf.load": {"batchline.models.onnx", "batchline.models.hf.detect"},
        "batchline.models.loader": {"batchline.models.onnx.embed"},
        "batchline.server.app": {"batchline.models.loader"},
    }
    assert package_graphs(graph) == {
        "batchline.models": {
            "batchline.models.onnx": {"batchline.models.specs"},
            "batchline.models.specs": {"batchline.models.hf"},
            "batchline.models.hf": {"batchline.models.onnx"},
            "batchline.models.loader": {"batchline.models.onnx"},
        },
        "batchline.models.hf": {"batchline.models.hf.load": {"batchline.models.hf.detect"}},
        "batchline": {"batchline.server": {"batchline.models"}},
    }
    assert package_knots(graph) == [
        ["batchline.models.hf", "batchline.models.onnx", "batchline.models.specs"]
    ]
    del graph["batchline.models.specs"]
    assert package_knots(graph) == []


def test_no_package_level_import_circle() -> None:
    knots = package_knots(import_graph())
    untolerated = [knot for knot in knots if knot not in TOLERATED_KNOTS]
    report = "\n".join(f"- {' <-> '.join(knot)}" for knot in untolerated)
    assert not untolerated, f"import circles between packages' children:\n{report}"
    stale = [knot for knot in TOLERATED_KNOTS if knot not in knots]
    assert not stale, f"these knots are gone: delete them from TOLERATED_KNOTS: {stale}"


def test_no_module_over_the_line_limit() -> None:
    over = {}
    for name, path in _modules().items():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > ALLOWED.get(name, MAX_LINES):
            over[name] = lines
    report = "\n".join(f"- {name}: {lines} lines" for name, lines in sorted(over.items()))
    assert not over, f"modules over {MAX_LINES} lines ({ALLOWED} allowed):\n{report}"


#: The layers, lowest first: a module imports its own layer's package or lower ones, never a
#: higher one, and no command package (driver, server, bench) imports a sibling. The core is
#: the private top-level modules (``batchline._*``), ``knobs`` and ``sync``.
LAYERS = {
    "oip": 1,
    "models": 2,
    "datasets": 3,
    "jobs": 4,
    "driver": 5,
    "server": 5,
    "bench": 5,
    "integrations": 6,
    "__main__": 7,  # the CLI: ``batchline`` and ``python -m batchline``
}
#: Backend packages whose inner modules stay behind the package's face (its ``__init__``).
BACKENDS = ("batchline.models.generation", "batchline.models.onnx")


def layer_of(module: str) -> tuple[str, int]:
    """A module's layer: its first package under batchline, or the core (0)."""
    top = module.split(".")[1] if "." in module else ""
    return (top, LAYERS[top]) if top in LAYERS else ("core", 0)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        if module == PACKAGE:
            continue  # the package's face re-exports the core
        (own, low) = layer_of(module)
        for target in sorted(targets):
            (other, high) = layer_of(target)
            if own != other and (high > low or (high == low and low > 0)):
                found.append(f"{module} -> {target}")
    return found


def past_the_seam(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{module} -> {target}"
        for module, targets in sorted(graph.items())
        if not module.startswith("batchline.models")
        for target in sorted(targets)
        if any(target.startswith(f"{backend}.") for backend in BACKENDS)
    ]


def test_the_layer_rule_and_the_seam_rule_catch_what_they_name() -> None:
    graph = {
        "batchline.jobs.run": {"batchline.server.app", "batchline.models.loader"},
        "batchline.server.app": {"batchline.bench.loadgen", "batchline.models.onnx.embedder"},
        "batchline.models.loader": {"batchline.models.onnx.embedder", "batchline._errors"},
        "batchline.__main__": {"batchline.integrations.ray", "batchline._errors"},
        "batchline.integrations.ray": {"batchline.__main__"},
    }
    assert upward_imports(graph) == [
        "batchline.integrations.ray -> batchline.__main__",
        "batchline.jobs.run -> batchline.server.app",
        "batchline.server.app -> batchline.bench.loadgen",
    ]
    assert past_the_seam(graph) == ["batchline.server.app -> batchline.models.onnx.embedder"]


#: The backend packages under ``models/``: none imports another's inner modules (only its
#: face), and what they share sits below them, in ``models/common/``.
BACKEND_PACKAGES = (
    "batchline.models.generation",
    "batchline.models.hf",
    "batchline.models.image",
    "batchline.models.onnx",
)


def between_backends(graph: dict[str, set[str]]) -> list[str]:
    def package(module: str) -> str | None:
        return next((p for p in BACKEND_PACKAGES if module.startswith(f"{p}.")), None)

    return [
        f"{module} -> {target}"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if package(module) is not None and package(target) not in (None, package(module))
    ]


def test_the_backend_rule_catches_an_inner_import() -> None:
    graph = {
        "batchline.models.hf.load": {"batchline.models.onnx.embed", "batchline.models.onnx"},
        "batchline.models.hf.convert": {"batchline.models.hf.detect"},
        "batchline.models.loader": {"batchline.models.onnx.embed"},
    }
    assert between_backends(graph) == ["batchline.models.hf.load -> batchline.models.onnx.embed"]


def test_backends_use_each_other_s_faces_only() -> None:
    found = between_backends(import_graph())
    report = "\n".join(f"- {edge}" for edge in found)
    assert not found, f"a backend imports another's inner modules (use its face):\n{report}"


def test_layers_point_down() -> None:
    found = upward_imports(import_graph())
    report = "\n".join(f"- {edge}" for edge in found)
    assert not found, f"imports of a higher layer or a sibling command package:\n{report}"


def test_code_outside_models_uses_the_backends_faces() -> None:
    found = past_the_seam(import_graph())
    report = "\n".join(f"- {edge}" for edge in found)
    assert not found, f"imports past a backend's face (use its package):\n{report}"


#: Modules longer than this must be named in docs/ARCHITECTURE.md, by their path under
#: ``src/batchline/``; every package must be named too (``server/routes/``).
NAMED_OVER = 300
ARCHITECTURE = SRC.parent / "docs" / "ARCHITECTURE.md"


def unnamed(text: str, package: Path) -> list[str]:
    """The modules over :data:`NAMED_OVER` lines and the subpackages under ``package`` that
    ``text`` does not name by their path (``server/app.py``, ``server/routes/``)."""
    missing = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if path.name == "__init__.py":
            name = relative.removesuffix("__init__.py")
            if name and name not in text:
                missing.append(name)
        elif (
            relative not in text and len(path.read_text(encoding="utf-8").splitlines()) > NAMED_OVER
        ):
            missing.append(relative)
    return missing


def test_the_naming_rule_catches_a_long_module_and_a_package(tmp_path: Path) -> None:
    (tmp_path / "server" / "routes").mkdir(parents=True)
    for init in ("__init__.py", "server/__init__.py", "server/routes/__init__.py"):
        (tmp_path / init).write_text("")
    (tmp_path / "server" / "app.py").write_text("x = 1\n" * (NAMED_OVER + 1))
    (tmp_path / "server" / "small.py").write_text("x = 1\n")
    assert unnamed("", tmp_path) == ["server/", "server/app.py", "server/routes/"]
    assert unnamed("`server/` holds `server/app.py`; `server/routes/`", tmp_path) == []


def test_architecture_names_every_package_and_every_long_module() -> None:
    missing = unnamed(ARCHITECTURE.read_text(encoding="utf-8"), SRC / PACKAGE)
    assert not missing, (
        f"docs/ARCHITECTURE.md does not name these (modules over {NAMED_OVER} lines, by their "
        f"path under src/batchline/, and packages): {', '.join(missing)}"
    )
