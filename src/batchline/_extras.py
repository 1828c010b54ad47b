"""The optional extras (pyproject.toml's optional-dependencies) and the modules each brings.

Standard library only: the CLI reads it to name the ``pip install`` a missing module calls for,
and ``batchline models pull`` to tell whether a model's extra is already installed.
"""

from __future__ import annotations

import importlib.util

__all__ = ["EXTRA_OF_MODULE", "INCLUDES", "extra_installed"]

#: extra -> the extras it includes
INCLUDES = {
    "onnx": {"onnx"},
    "jobs": {"jobs", "onnx"},
    "server": {"server", "jobs", "onnx"},
    "driver": {"driver", "jobs", "onnx"},
    "bench": {"bench", "jobs", "onnx"},
    "ray": {"ray", "jobs", "onnx"},
    "generate": {"generate"},
    "trace": {"trace"},
}

#: a third-party module -> the extra that brings it
EXTRA_OF_MODULE = {
    "onnxruntime": "onnx",
    "onnx": "onnx",
    "tokenizers": "onnx",
    "safetensors": "onnx",
    "numpy": "onnx",
    "platformdirs": "onnx",
    "pyarrow": "jobs",
    "PIL": "jobs",
    "rich": "jobs",
    "fastapi": "server",
    "uvicorn": "server",
    "pydantic": "jobs",
    "prometheus_client": "server",
    "httpx": "driver",
    "matplotlib": "bench",
    "ray": "ray",
    "torch": "generate",
    "transformers": "generate",
    "gguf": "generate",
    # FastAPI >= 0.165 brings OpenTelemetry's API; the SDK and the exporter are the extra's
    "opentelemetry": "trace",
}


def extra_installed(extra: str) -> bool:
    """Whether every module ``extra`` brings can be imported here (found, not imported)."""
    modules = [m for m, e in EXTRA_OF_MODULE.items() if e == extra]
    try:
        return all(importlib.util.find_spec(m) is not None for m in modules)
    except (ImportError, ValueError):  # a module blocked or half-installed
        return False
