"""Lazy re-exports for package ``__init__`` files.

A subpackage whose modules need an extra (numpy, FastAPI, matplotlib, ...) must still import
with none installed, so that ``batchline --help`` and every ``batchline CMD --help`` work on a
bare install. Its ``__init__`` names what it exports and where each name lives; the module is
imported on first attribute access, and type checkers see the real names through an
``if TYPE_CHECKING:`` block beside it.

Example (in ``batchline/server/__init__.py``)::

    __getattr__ = lazy_exports(__name__, {"create_app": "app", "ServerSettings": "settings"})
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(package: str, homes: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` that imports ``package.<homes[name]>`` when ``name`` is used."""

    def __getattr__(name: str) -> object:
        module = homes.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return __getattr__
