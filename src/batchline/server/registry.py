"""``ModelRegistry``: the one place a server's models are found, loaded and let go.

A route asks it for a model by name and task (:meth:`ModelRegistry.acquire`) and gets a
:data:`~batchline.server.served.Served`: a :class:`~batchline.server.served.ServedModel` or a
:class:`~batchline.server.served.ServedGenerator`, whichever way the model came to be loaded.
Eager models (loaded at start) and on-demand ones (``memory_budget``: loaded on their first
request, evicted when idle, :mod:`batchline.server.residency`) are the same objects, asked for
the same way; an on-demand model is held for the request (the gate releases it when the
response is done), an eager one is simply looked up.

What ``acquire`` answers besides the model: 404 listing the served models for an unknown name,
400 naming a model's task and its route when it does another, 400 when no model does the task
(or, for ``generate``, when several do and none is named), and for an on-demand model the
residency's 504 / 503 / 507 / 429 (:func:`batchline.server.residency.use_served`).

Everything else that needs the set of models reads it here: the model list (``/v1/models``,
``/ready``), the metrics, the drain (:meth:`generators`), the Batch API (:meth:`claim`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.types import Scope

from batchline._device import Device
from batchline._errors import BatchlineError
from batchline._residency import ModelLoadError, Residency
from batchline._tracing import Tracing
from batchline.models.config import Knobs
from batchline.models.protocol import BatchModel
from batchline.models.specs import ModelSpec
from batchline.server.errors import ApiError, bad_request, safe_text, shutting_down
from batchline.server.metrics import ServerMetrics
from batchline.server.residency import RELEASES, build_residency, use_served
from batchline.server.served import Served, ServedGenerator, ServedModel
from batchline.server.settings import ServerSettings

if TYPE_CHECKING:
    from batchline._batcher import DynamicBatcher
    from batchline.models.generation import GenerationModel
    from batchline.server.batcher import Job

__all__ = ["ROUTE_OF_TASK", "LoadGenerator", "LoadModel", "ModelRegistry"]

logger = logging.getLogger("batchline.server")

#: ``load_model(spec, knobs) -> BatchModel``: how the app loads each served batch model.
LoadModel = Callable[[ModelSpec, Knobs], BatchModel[object, object]]
#: ``load_generator(spec, knobs) -> GenerationModel``: how it loads each generate model.
LoadGenerator = Callable[[ModelSpec, Knobs], "GenerationModel"]

#: The route that serves each task, for the wrong-task message.
ROUTE_OF_TASK = {
    "embed": "POST /v1/embeddings",
    "classify": "POST /classify",
    "score": "POST /v1/rerank or POST /v1/score",
    "predict": "POST /v2/models/{name}/infer",
    "generate": "POST /v1/completions, POST /v1/chat/completions or POST /generate",
}


class ModelRegistry:
    """The served models of one server (see the module docstring). Empty until
    :meth:`open` loads the settings' models (or a test :meth:`add` s its own)."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self._order: list[str] = []
        """Every served name, batch and generate models alike, in the order they were given."""
        self._tasks: dict[str, str] = {}
        """Each model's task, loaded or not."""
        self._resident: dict[str, Served] = {}
        self.residency: Residency[Served] | None = None
        """Every model's load and unload (:class:`batchline._residency.Residency`; each model
        pinned without a memory budget; ``None`` before :meth:`open`)."""
        self._on_demand = False
        self._inputs: dict[str, str | None] = {}
        """What each model takes, told before it loads (``None``: its load tells)."""
        self.opened_at = int(time.time())
        """When the models were given to the registry: an unloaded model's ``created``."""

    # -- filling -------------------------------------------------------------------------------

    def add(self, served: Served) -> None:
        """Serve ``served``, loaded and started: what each load ends with (a test that builds
        its own served model adds it here)."""
        name = served.name
        if name not in self._tasks:
            self._order.append(name)
        self._tasks[name] = served.task
        self._resident[name] = served

    async def open(
        self,
        *,
        metrics: ServerMetrics,
        tracing: Tracing | None,
        load_model: LoadModel,
        load_generator: LoadGenerator,
        device: Device | None,
    ) -> None:
        """Load the settings' models: every one now, in order, without a memory budget (a
        failed load stops the start with its own error); with one, the pinned and preloaded
        ones now and the rest on their first request."""
        settings = self.settings
        specs = settings.specs
        knobs = settings.knobs if settings.knobs.batching else settings.baseline_knobs
        loading = _Loading(self, knobs, metrics, tracing, device, load_model, load_generator)
        self._on_demand = on_demand = settings.memory_budget is not None
        self._order[:] = [s.name for s in specs]
        self._tasks.update({s.name: _task_of(s) for s in specs})
        self.opened_at = int(time.time())
        self._inputs = {s.name: _input_of(s, self._tasks[s.name]) for s in specs}
        residency = self.residency = build_residency(
            settings,
            list(specs),
            loading.load,
            loading.unload,
            metrics.residency_event if on_demand else None,
            tasks=dict(self._tasks),
        )
        if on_demand:
            metrics.watch_residency(residency)
        first = [*settings.pin, *settings.preload] if on_demand else [s.name for s in specs]
        try:
            for name in dict.fromkeys(first):
                await residency.preload(name)
        except BaseException as exc:
            await residency.close()
            if not on_demand and isinstance(exc, ModelLoadError) and exc.__cause__ is not None:
                raise exc.__cause__ from None
            raise

    async def close(self) -> None:
        """Unload (drain) every model."""
        if self.residency is not None:
            await self.residency.close()

    # -- a request -----------------------------------------------------------------------------

    async def acquire(self, name: str | None, task: str, scope: Scope) -> Served:
        """The served model ``name`` of ``task`` (``None``: the first model of ``task``; for
        ``generate``, the only one), loaded first when it is an on-demand model and held until
        the request ends (its release is left in ``scope`` for the gate); the name picked is
        left in ``scope["batchline.model"]``. The errors are in the module docstring."""
        if name is None:
            name = self._first(task)
        else:
            other = self._tasks.get(name)
            if other is None:
                raise ApiError(
                    404,
                    f"model {safe_text(name[:100])!r} is not served here; models: "
                    f"{self.describe()}",
                    "model_not_found",
                )
            if other != task:
                where = ROUTE_OF_TASK.get(other)
                hint = f"; send it to {where}" if where else ""
                raise bad_request(
                    f"model {name!r} does {other}, and this route serves {task} models{hint}"
                )
        scope["batchline.model"] = name
        if self._on_demand and self.residency is not None:
            settings = self.settings
            return await use_served(
                self.residency,
                name,
                scope,
                settings.request_timeout_s,
                max_waiting=settings.knobs.max_queue_size,
                retry_after_s=settings.retry_after_s,
            )
        served = self._resident.get(name)
        if served is None:  # unloaded by a shutdown that the request raced
            raise shutting_down(self.settings.retry_after_s)
        return served

    def _first(self, task: str) -> str:
        names = [n for n in self._order if self._tasks[n] == task]
        if not names:
            raise bad_request(f"no model served here does {task}; models: {self.describe()}")
        if len(names) > 1 and task == "generate":
            # generated texts differ too much to pick one silently
            raise bad_request(
                f"{len(names)} {task} models are served ({', '.join(names)}); name one in 'model'"
            )
        return names[0]

    def release(self, scope: Scope) -> None:
        """Give back every model a request acquired (the gate, when the response is done)."""
        for release in scope.pop(RELEASES, ()):
            release()

    def loads_on_demand(self, name: str) -> bool:
        """Whether ``name`` is a model that loads on its first request (``memory_budget``)."""
        return self._on_demand and name in self._tasks

    async def claim(self, name: str) -> Served | None:
        """The model ``name`` for a claim that lasts (a Batch API run: it does not take turns
        with requests), loaded as needed; ``None`` when it is not served. Give it back with
        :meth:`unclaim`."""
        if name not in self._tasks:
            return None
        if self._on_demand and self.residency is not None:
            return await self.residency.acquire(name)
        return self._resident.get(name)

    def unclaim(self, name: str) -> None:
        """A :meth:`claim` is over."""
        if self._on_demand and self.residency is not None:
            self.residency.release(name)

    # -- what the rest of the server reads -----------------------------------------------------

    def names(self) -> list[str]:
        """Every served name, loaded or not, in the order they were given."""
        return list(self._order)

    def task_of(self, name: str) -> str | None:
        """The task of the served model ``name`` (``None``: not served here)."""
        return self._tasks.get(name)

    def input_kind_of(self, name: str) -> str | None:
        """What the model ``name`` takes, told before it loads (``None``: unknown until it
        loads, or not served)."""
        return self._inputs.get(name)

    def input_kinds(self) -> dict[str, str | None]:
        """What each served model takes: a loaded one's own ``input_kind``, else what
        :meth:`input_kind_of` tells (``None``: unknown until it loads)."""
        kinds = {n: self._inputs.get(n) for n in self._order}
        kinds.update({s.name: s.info.input_kind for s in self.served()})
        return kinds

    def get(self, name: str) -> Served | None:
        """The model ``name`` if it is loaded now (no claim: for metrics and logs)."""
        return self._resident.get(name)

    def served(self) -> list[Served]:
        """Every loaded model, in the order they were given."""
        return [self._resident[n] for n in self._order if n in self._resident]

    def models(self) -> list[ServedModel[object, object]]:
        """Every loaded batch model, in order."""
        return [m for m in self.served() if isinstance(m, ServedModel)]

    def generators(self) -> list[ServedGenerator]:
        """Every loaded generate model, in order."""
        return [m for m in self.served() if isinstance(m, ServedGenerator)]

    def batchers(self) -> dict[str, DynamicBatcher[Job[object], object]]:
        """Each loaded batch model's batcher, by name (none for the baseline)."""
        return {m.name: m.batcher for m in self.models() if m.batcher is not None}

    def describe(self) -> str:
        """``"a (embed), b (predict)"``: the served models and their tasks."""
        return ", ".join(f"{n} ({self._tasks[n]})" for n in self._order) or "none"

    def _drop(self, name: str) -> None:
        self._resident.pop(name, None)


class _Loading:
    """How the registry loads, starts, stops and forgets one model (the residency's load and
    unload): ``knobs`` are a batch model's (the baseline's without batching), ``device`` the
    slots the batch models share (``None``: each batcher its own)."""

    def __init__(
        self,
        registry: ModelRegistry,
        knobs: Knobs,
        metrics: ServerMetrics,
        tracing: Tracing | None,
        device: Device | None,
        load_model: LoadModel,
        load_generator: LoadGenerator,
    ) -> None:
        self.registry = registry
        self.settings = registry.settings
        self.knobs = knobs
        self.metrics = metrics
        self.tracing = tracing
        self.device = device
        self.load_model = load_model
        self.load_generator = load_generator

    async def load(self, spec: ModelSpec) -> Served:
        served = await (self._generator(spec) if spec.generates else self._model(spec))
        self.registry.add(served)
        return served

    async def unload(self, served: Served) -> None:
        self.registry._drop(served.name)
        if isinstance(served, ServedGenerator):
            self.metrics.generation.forget(served.name)  # holds no reference to it
        else:
            self.metrics.watch(served.name, lambda: None)  # holds no reference to it
        await served.stop(timeout_s=self.settings.drain_timeout_s)

    async def _model(self, spec: ModelSpec) -> ServedModel[object, object]:
        settings, metrics = self.settings, self.metrics
        model = await asyncio.to_thread(self.load_model, spec, self.knobs)
        served: ServedModel[object, object] = ServedModel(
            spec.name,
            model,
            settings,
            self.knobs,
            metrics.for_model(spec.name),
            device=self.device,
            weight=settings.model_weights.get(spec.name, 1.0),
            tracing=self.tracing,
        )
        metrics.watch(spec.name, served.stats)
        try:
            await served.start()
        except BaseException:
            model.close()
            raise
        batching = "batching" if settings.knobs.batching else "no batching"
        logger.info("model %s ready (%s, %s)", spec.name, served.task, batching)
        return served

    async def _generator(self, spec: ModelSpec) -> ServedGenerator:
        # settings.knobs, not the baseline's: batching=False is one sequence at a time, on
        # the same threads (a second torch thread only slows a 2-core CPU)
        model = await asyncio.to_thread(self.load_generator, spec, self.settings.knobs)
        generator = ServedGenerator(spec.name, model, self.metrics.generation, tracing=self.tracing)
        try:
            await generator.start()
        except BaseException:
            model.close()
            raise
        logger.info(
            "model %s ready (generate, %s, %s)",
            spec.name,
            generator.info.details.get("batching", "batching"),
            getattr(model, "dtype", "") or "dtype not reported",
        )
        return generator


def _input_of(spec: ModelSpec, task: str) -> str | None:
    """What a model takes, known before it loads (its backend tells); ``None`` where no
    backend can tell (the load then says what is wrong with the spec)."""
    from batchline.models.loader import input_kind

    try:
        return input_kind(dataclasses.replace(spec, task=task))  # type: ignore[arg-type]
    except (BatchlineError, OSError):
        return None


def _task_of(spec: ModelSpec) -> str:
    """A model's task, known before it loads (``resolve_task`` reads an ``.onnx`` file's
    inputs, not its weights)."""
    from batchline.models.loader import resolve_task

    return resolve_task(spec)
