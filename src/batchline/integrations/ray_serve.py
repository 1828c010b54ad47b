"""``batchline serve --engine ray``: the same app on Ray Serve replicas, autoscaled.

The layout (with the default ingress; ``--ray-ingress haproxy`` puts HAProxy on HOST:PORT,
and it sends requests to the replicas' own HTTP ports: :mod:`batchline.integrations.ray_ingress`)::

    clients ──HTTP──> Serve's proxy (HOST:PORT)          Ray actors, MIN..MAX replicas
                      ├─ /ready ──> _Readiness ── serve details (running replicas >= 1, or MIN 0)
                      └─ every other path ────────> _Replica: create_app(settings) inside it,
                                                    its lifespan loads the models and starts
                                                    ONE shared batcher per model

Each replica is batchline's own FastAPI app (:func:`batchline.server.create_app`), built in the
replica by ``serve.ingress``'s late-bound ``__serve_build_asgi_app__``: the same routes,
errors, API key and ``/metrics`` as ``batchline serve``, and every request that reaches a
replica feeds that replica's shared batcher. Serve's autoscaler keeps between ``min`` and
``max`` replicas so that each has about ``target_ongoing`` requests in flight; with ``min=0``
the last replica goes away when idle, and the next request waits in the proxy until one has
loaded the model (at most ``request_timeout_s``: beyond, the proxy answers 408).

``max_ongoing_requests`` (how many requests Serve lets into one replica at once) is the
replica's batcher capacity (:func:`replica_capacity`), not Serve's default of 5, which would
cap every batch at 5 requests (ray-project/ray#43288): the replica's own queue bounds the
work, and answers 429 beyond it as a single server does.

A replica that Serve scales down stops getting new requests, finishes those in flight
(streams too, at most ``drain_timeout_s``: Serve's ``graceful_shutdown_timeout_s``), then runs
the app's lifespan shutdown, which drains the batchers and frees the models.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray import serve

from batchline._errors import InputError
from batchline.integrations.ray_ingress import (
    INGRESSES,
    check_ingress,
    default_ingress,
    free_port,
    ingress_env,
    ingress_environment,
    routed,
    wait_routed,
)
from batchline.integrations.ray_serve_state import (
    APP_NAME,
    READY_APP_NAME,
    ReplicaCounts,
    replica_counts,
    start_serve,
    wait_started,
)
from batchline.integrations.session import check_reachable, env_defaults, ray_session
from batchline.server.settings import ServerSettings

if TYPE_CHECKING:
    from fastapi import FastAPI
    from ray.util.metrics import Gauge
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from batchline.server.app import LoadGenerator, LoadModel
    from batchline.server.state import ServerState

__all__ = [
    "APP_NAME",
    "INGRESSES",
    "REPLICA_HEADER",
    "ReplicaCounts",
    "ServeReplicas",
    "default_ingress",
    "deploy",
    "deployment_options",
    "ingress_env",
    "parse_replicas",
    "replica_capacity",
    "replica_counts",
    "serve_on_ray",
]

logger = logging.getLogger("batchline.server")

#: Response header naming the replica that answered (Serve's replica id).
REPLICA_HEADER = "x-batchline-replica"


@dataclass(frozen=True)
class ServeReplicas:
    """How many replicas, and when Serve adds or removes one.

    ``min`` may be 0 (scale to zero): then no replica loads a model until the first request.
    Serve aims at ``target_ongoing`` requests in flight per replica, averaged over the last
    ``look_back_period_s``: it adds replicas once that average has been above the target for
    ``upscale_delay_s``, and removes them once it has been below for ``downscale_delay_s``
    (so an idle replica goes after about ``look_back_period_s + downscale_delay_s``; Ray 2.60
    warns when ``look_back_period_s`` is 10 s or less). ``cpus_per_replica`` is the logical
    CPUs each replica reserves (default: its sessions x intra-op threads).
    """

    min: int = 1
    max: int = 1
    target_ongoing: int = 10
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 60.0
    look_back_period_s: float = 30.0
    cpus_per_replica: float | None = None

    @property
    def fixed(self) -> bool:
        """One count, no autoscaling."""
        return self.min == self.max

    def __post_init__(self) -> None:
        if self.min < 0:
            raise InputError(f"--replicas: the minimum must be >= 0, got {self.min}")
        if self.max < 1 or self.max < self.min:
            raise InputError(
                "--replicas: the maximum must be >= 1 and >= the minimum, "
                f"got {self.min}-{self.max}"
            )
        if self.target_ongoing < 1:
            raise InputError(f"--target-ongoing must be >= 1, got {self.target_ongoing}")
        for name in ("upscale_delay_s", "downscale_delay_s", "look_back_period_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise InputError(f"{name} must be a finite number >= 0, got {value}")
        if self.cpus_per_replica is not None and not self.cpus_per_replica > 0:
            raise InputError(f"cpus_per_replica must be > 0, got {self.cpus_per_replica}")

    @property
    def concurrency(self) -> int:
        """The client concurrency that keeps every replica at its target: ``max x target``
        (``batchline drive --concurrency``, with one request per chunk)."""
        return self.max * self.target_ongoing


def parse_replicas(text: str) -> tuple[int, int]:
    """``"2"`` -> ``(2, 2)``; ``"0-2"`` -> ``(0, 2)``; anything else is an ``InputError``."""
    low, sep, high = text.strip().partition("-")
    try:
        lo = int(low)
        hi = int(high) if sep else lo
    except ValueError:
        raise InputError(f"--replicas {text!r}: expected N or MIN-MAX, e.g. 2 or 0-2") from None
    return lo, hi


def replica_capacity(settings: ServerSettings) -> int:
    """Requests one replica can hold at once: its queue of each batch model (a request holds at
    least one record) plus, for each generate model, its running and waiting sequences. Serve's
    ``max_ongoing_requests``: more would only get 429 from the replica."""
    knobs = settings.knobs
    return sum(
        knobs.max_queue_size + (knobs.max_running_sequences if spec.generates else 0)
        for spec in settings.specs
    )


def _logging(settings: ServerSettings) -> dict[str, bool]:
    # Serve logs every request in the proxy and in the replica by default, and Ray copies the
    # replica's lines to the driver's console: follow the server's access_log (off) instead
    return {"enable_access_log": settings.access_log}


def _scaling(replicas: ServeReplicas) -> dict[str, object]:
    """A fixed count (``--replicas N``) is ``num_replicas``: Serve's replicas then record and
    push no load metrics (they do only with an autoscaling config) and the controller has none
    to fold in; a range is an ``autoscaling_config``."""
    if replicas.fixed:
        return {"num_replicas": replicas.min}
    return {
        "autoscaling_config": {
            "min_replicas": replicas.min,
            "max_replicas": replicas.max,
            "target_ongoing_requests": replicas.target_ongoing,
            "upscale_delay_s": replicas.upscale_delay_s,
            "downscale_delay_s": replicas.downscale_delay_s,
            "look_back_period_s": replicas.look_back_period_s,
        }
    }


def deployment_options(settings: ServerSettings, replicas: ServeReplicas) -> dict[str, Any]:
    """The Serve deployment options of the replicas (``Deployment.options(**...)``)."""
    capacity = replica_capacity(settings)
    if replicas.target_ongoing > capacity:
        raise InputError(
            f"--target-ongoing {replicas.target_ongoing} is more than a replica can hold "
            f"({capacity} requests: max_queue_size per model); lower it or raise --max-queue"
        )
    knobs = settings.knobs
    cpus = replicas.cpus_per_replica or float(knobs.sessions * knobs.intra_op_threads)
    return {
        "name": APP_NAME,
        "max_ongoing_requests": capacity,
        **_scaling(replicas),
        # a replica being removed finishes what it has (streams too), as on SIGTERM
        "graceful_shutdown_timeout_s": settings.drain_timeout_s,
        "graceful_shutdown_wait_loop_s": 0.5,
        "logging_config": _logging(settings),
        "ray_actor_options": {
            "num_cpus": cpus,
            # a replica on a GPU reserves one: Ray places it on a node that has one and never
            # puts two replicas on the same GPU
            "num_gpus": 1 if knobs.is_gpu else 0,
        },
    }


# -- the replica (a Serve deployment) ------------------------------------------------------------


class _ReplicaHeader:
    """ASGI middleware: every response names the replica that sent it."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode("latin-1"), replica.encode("latin-1"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.header]
            await send(message)

        await self.app(scope, receive, send_named)


@serve.ingress()
class _Replica:
    """One replica: batchline's app, built here; Serve runs its lifespan (models loaded, one
    batcher each) before the replica takes requests, and its shutdown when it is removed."""

    def __init__(
        self,
        settings: ServerSettings,
        load_model: LoadModel | None = None,
        load_generator: LoadGenerator | None = None,
    ) -> None:
        self._settings = settings
        self._load_model = load_model
        self._load_generator = load_generator
        self.replica_id: str = serve.get_replica_context().replica_id.unique_id
        self._exporter: asyncio.Task[None] | None = None

    async def __serve_build_asgi_app__(self) -> FastAPI:
        from batchline.server.app import create_app

        app = create_app(
            self._settings, load_model=self._load_model, load_generator=self._load_generator
        )
        app.add_middleware(_ReplicaHeader, replica=self.replica_id)
        self._exporter = asyncio.create_task(_export_stats(app.state.server, STATS_INTERVAL_S))
        return app


#: How often each replica copies its batchers' stats into Ray's metrics.
STATS_INTERVAL_S = 2.0


async def _export_stats(state: ServerState, interval_s: float) -> None:
    """Copy each batch model's stats into Ray's metrics, tagged with this replica (Serve adds
    the ``deployment``, ``replica`` and ``application`` tags): one Prometheus endpoint per Ray
    node then shows every replica's batching, where ``/metrics`` through the proxy shows the
    one replica that answered."""
    from ray.serve.metrics import Gauge

    records = Gauge(
        "batchline_replica_records",
        description="Records by outcome since the replica started (submitted, completed, "
        "failed, cancelled, expired).",
        tag_keys=("model", "outcome"),  # type: ignore[arg-type]  # Ray types it tuple[str]
    )
    batches = Gauge(
        "batchline_replica_batches", description="Model calls so far.", tag_keys=("model",)
    )
    size = Gauge(
        "batchline_replica_avg_batch_size",
        description="Mean records per model call.",
        tag_keys=("model",),
    )
    queued = Gauge(
        "batchline_replica_queue_depth", description="Records queued now.", tag_keys=("model",)
    )
    while True:
        try:
            _set_stats(state, records, batches, size, queued)
        except Exception:  # a metric must never take the replica down
            logger.exception("exporting the batch stats to Ray's metrics failed")
        await asyncio.sleep(interval_s)


def _set_stats(
    state: ServerState, records: Gauge, batches: Gauge, size: Gauge, queued: Gauge
) -> None:
    from batchline.server.metrics import record_outcomes

    for model in state.registry.models():
        name = model.name
        stats = model.stats()
        if stats is None:  # the baseline has no batcher
            continue
        for outcome, value in record_outcomes(stats):
            records.set(value, tags={"model": name, "outcome": outcome})
        batches.set(stats.total_batches, tags={"model": name})
        size.set(stats.avg_batch_size, tags={"model": name})
        queued.set(stats.queue_depth, tags={"model": name})


class _Readiness:
    """``GET /ready`` of the whole deployment, answered without reaching (or waking) a replica:
    200 once at least one replica is running, or at once when the minimum is 0 (a request then
    waits for a replica); 503 otherwise. The body tells the replicas' target and running. With
    HAProxy, only once HAProxy routes to MIN replicas (a replica added later reloads HAProxy,
    which cuts off the clients it holds), or with MIN 0 to Serve's proxy (:func:`routed`)."""

    def __init__(self, minimum: int, retry_after_s: int, ingress: str = "proxy") -> None:
        self._minimum = minimum
        self._retry_after_s = retry_after_s
        self._routed = ingress == "proxy"

    async def __call__(self, request: Request) -> JSONResponse:
        from starlette.responses import JSONResponse

        counts = await asyncio.to_thread(replica_counts)
        if not self._routed and (counts.running >= 1 or self._minimum == 0):
            # with MIN 0, routed once HAProxy sends requests on to Serve's proxy, which holds
            # them until a replica runs
            self._routed = await asyncio.to_thread(routed, APP_NAME, replicas=self._minimum)
            if not self._routed:
                counts = dataclasses.replace(counts, running=0, deployed=False)
        body: dict[str, object] = {
            "replicas": {
                "min": self._minimum,
                "target": counts.target,
                "running": counts.running,
            }
        }
        if counts.running >= 1 or (self._minimum == 0 and counts.deployed):
            return JSONResponse({"status": "ready", **body})
        return JSONResponse(
            {"status": "loading", **body},
            status_code=503,
            headers={"Retry-After": str(self._retry_after_s)},
        )


# -- the deployment ------------------------------------------------------------------------------


def deploy(
    settings: ServerSettings,
    replicas: ServeReplicas,
    *,
    load_model: LoadModel | None = None,
    load_generator: LoadGenerator | None = None,
    ingress: str = "proxy",
    start_timeout_s: float = 300.0,
) -> str:
    """Start Serve's ingress on ``settings.host:port`` and deploy the replicas on the Ray this
    process is connected to; return the URL once ``/ready`` would be true.

    ``load_model`` / ``load_generator`` are :func:`batchline.server.create_app`'s (they are
    pickled to the replicas). ``ingress`` is the one that Ray was started with
    (:data:`INGRESSES`; :func:`ingress_env`): with ``haproxy``, the URL is returned once
    HAProxy routes to a replica (to Serve's proxy with MIN 0). Raises ``ModelError`` when the
    replicas cannot start (a model that does not load, resources the cluster lacks) within
    ``start_timeout_s``.
    """
    check_ingress(ingress)
    options = deployment_options(settings, replicas)
    deadline = time.monotonic() + start_timeout_s
    start_serve(settings, _logging(settings), deadline)
    # /ready first: until it is routed, the app at "/" would answer it, waking a replica
    readiness = serve.deployment(
        name=READY_APP_NAME,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        logging_config=_logging(settings),
    )(_Readiness)
    serve.run(
        readiness.bind(replicas.min, settings.retry_after_s, ingress),
        name=READY_APP_NAME,
        route_prefix="/ready",
        blocking=False,
    )
    replica = serve.deployment()(_Replica)
    app = replica.options(**options).bind(settings, load_model, load_generator)
    # serve.run would wait for the replicas with no time limit, and say only "failed to
    # update the deployments" when a model does not load: wait here instead
    serve.run_many(
        [serve.RunTarget(app, name=APP_NAME, route_prefix="/")],
        wait_for_applications_running=False,
    )
    wait_started(max(deadline - time.monotonic(), 5.0))
    if ingress == "haproxy":
        wait_routed(APP_NAME, max(deadline - time.monotonic(), 5.0), replicas=replicas.min)
    return f"http://{_url_host(settings.host)}:{settings.port}"


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


# -- the command ---------------------------------------------------------------------------------


def serve_from_args(args: argparse.Namespace, settings: ServerSettings) -> int:
    """``batchline serve --engine ray``: :func:`serve_on_ray` with the command's flags."""
    low, high = parse_replicas(args.replicas or "1")
    target = 10 if args.target_ongoing is None else args.target_ongoing
    replicas = ServeReplicas(min=low, max=high, target_ongoing=target)
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s: %(message)s")
    ingress = args.ray_ingress or default_ingress(args.address)
    return serve_on_ray(settings, replicas, address=args.address, ingress=ingress)


def serve_on_ray(
    settings: ServerSettings,
    replicas: ServeReplicas,
    *,
    address: str | None = None,
    ingress: str = "proxy",
    start_timeout_s: float = 300.0,
    status_interval_s: float = 2.0,
) -> int:
    """Serve ``settings`` on Ray Serve until SIGTERM/SIGINT; return 0 after a clean shutdown.

    ``address=None`` starts a private local Ray instance (``num_cpus``: this machine's cores,
    or what ``max`` replicas reserve if more) and stops it at the end; ``"auto"`` or
    ``"HOST:PORT"`` deploys onto a running cluster and deletes the deployment at the end.
    The replicas (target, running) are logged when they change. ``ingress`` (:data:`INGRESSES`)
    applies to the private instance; a cluster's is chosen by its owner (:func:`ingress_env`).

    Example::

        settings = ServerSettings(model="default", port=8000)
        serve_on_ray(settings, ServeReplicas(min=0, max=2, target_ongoing=10))
    """
    check_ingress(ingress)
    if address is not None and ingress != "proxy":
        raise InputError(
            f"--ray-ingress {ingress} sets up the Ray that serve starts; on a cluster, set "
            "RAY_SERVE_ENABLE_HA_PROXY=1 on every node before `ray start` (docs/ray.md), "
            "and drop --ray-ingress"
        )
    options = deployment_options(settings, replicas)  # bad knobs fail before Ray starts
    cpus = float(options["ray_actor_options"]["num_cpus"])
    if address is not None and not ray.is_initialized():
        check_reachable(address)
    if settings.port == 0:
        settings = settings.model_copy(update={"port": free_port(settings.host)})
    local_cpus = max(os.cpu_count() or 1, math.ceil(replicas.max * cpus))
    stop = threading.Event()
    quick = {} if replicas.fixed else _QUICK_AUTOSCALING_ENV
    private = ingress if address is None else "proxy"
    # signals after ray.init: Ray's core installs a SIGTERM handler that aborts the process
    with (
        ingress_environment(private, avoid=[settings.port]) as ingress_vars,
        env_defaults(
            {**quick, **_LEAN_LOGS_ENV, **_LEAN_CONTROL_ENV, **ingress_vars}
            if address is None
            else {}
        ),
        ray_session(address, local_cpus),
        _signals_set(stop),
    ):
        try:
            url = deploy(settings, replicas, ingress=ingress, start_timeout_s=start_timeout_s)
            logger.info(
                "serving on %s (%s): %d-%d replica(s), target %d ongoing requests each "
                "(drive with --concurrency %d)",
                url,
                ingress,
                replicas.min,
                replicas.max,
                replicas.target_ongoing,
                replicas.concurrency,
            )
            last: tuple[int, int] | None = None
            while not stop.wait(status_interval_s if last is not None else 0.5):
                counts = replica_counts()
                now = (counts.target, counts.running)
                if now != last:
                    logger.info("replicas: target %d, running %d", *now)
                    last = now
            logger.info("stopping: replicas finish their requests in flight")
        finally:
            with contextlib.suppress(Exception):
                if address is None:
                    serve.shutdown()  # type: ignore[no-untyped-call]
                else:
                    serve.delete(APP_NAME)
                    serve.delete(READY_APP_NAME)
    return 0


# Serve's own request-path logs: to its log files only (not echoed through the driver's
# stderr), flushed every 1,000 lines or at the first error: the values of Ray's own
# RAY_SERVE_THROUGHPUT_OPTIMIZED preset. batchline's log lines are not Serve's and still show.
# One replica behind HAProxy, c=1 p50 added: +2.47 and +2.73 ms with them, +3.32 and +4.22
# without (bench_ray_serve.py --overhead-only, 2 runs each, 2026-11-28); c=32 within noise.
_LEAN_LOGS_ENV = {"RAY_SERVE_LOG_TO_STDERR": "0", "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000"}

# Serve's controller runs its control loop every 0.1 s, and each pass asks the GCS for every
# node's resources: under load, at one replica behind HAProxy (c=32), the controller took 0.030
# cores and the GCS 0.016 of the two this machine has, taken from the replica's model threads.
# Every 0.5 s: 0.013 and 0.007 (/proc, 12 s points, 2026-11-28). A change of replicas is seen
# up to 0.4 s later, against ~10 s for a replica to start. On a cluster, its owner's to set.
_LEAN_CONTROL_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}

# Serve's autoscaler learns about requests through metrics that the proxy and the replicas
# record every look_back_period_s x 0.2 (6 s by default) and push every 10 s: a request that
# arrives with zero replicas waited 5-9 s before Serve even decided to start one (measured,
# Ray 2.60, 2-core machine). A private instance records every ~0.3-0.6 s and pushes every
# 0.5 s. These are Ray's environment variables, read by the processes Ray starts; on a
# cluster they are its owner's to set.
_QUICK_AUTOSCALING_ENV = {
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_AUTOSCALING_METRIC_RECORD_INTERVAL_FACTOR": "0.02",
}


@contextlib.contextmanager
def _signals_set(stop: threading.Event) -> Iterator[None]:
    """SIGTERM and SIGINT set ``stop`` (the main thread's wait ends) instead of raising."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in previous:
        signal.signal(s, lambda *_: stop.set())
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
