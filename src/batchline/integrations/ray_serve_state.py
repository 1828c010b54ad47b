"""Serve's side of ``batchline serve --engine ray``: starting Serve, and what its controller
says of the deployment (:mod:`batchline.integrations.ray_serve` deploys onto it)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve

from batchline._errors import ModelError
from batchline.integrations.session import last_line
from batchline.server.settings import ServerSettings

__all__ = [
    "APP_NAME",
    "READY_APP_NAME",
    "ReplicaCounts",
    "replica_counts",
    "start_serve",
    "wait_started",
]

logger = logging.getLogger("batchline.server")

#: The Serve application (and its deployment) that holds the replicas.
APP_NAME = "batchline"
#: The small application that answers ``/ready`` without waking a replica.
READY_APP_NAME = "batchline-ready"


@dataclass(frozen=True)
class ReplicaCounts:
    """The replicas of the deployment now: ``target`` (what the autoscaler wants), ``running``
    (serving), ``starting`` (placed or loading the model), ``deployed`` (the application is
    running, even with zero replicas), and each running replica's id -> actor name."""

    target: int
    running: int
    starting: int
    deployed: bool
    actors: dict[str, str]


def replica_counts() -> ReplicaCounts:
    """Ask Serve's controller about the replicas (works in the driver and in a replica)."""
    # The controller's details are what `serve status` and the dashboard show; Ray 2.60 has no
    # public call that returns the target replica count.
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:  # Serve is not running
        return ReplicaCounts(0, 0, 0, False, {})
    app = client.get_serve_details().get("applications", {}).get(APP_NAME)
    if not app:
        return ReplicaCounts(0, 0, 0, False, {})
    dep = app.get("deployments", {}).get(APP_NAME, {})
    replicas = dep.get("replicas", [])
    running = {r["replica_id"]: r["actor_name"] for r in replicas if r["state"] == "RUNNING"}
    starting = sum(1 for r in replicas if r["state"] in ("STARTING", "PENDING_MIGRATION"))
    return ReplicaCounts(
        target=int(dep.get("target_num_replicas", 0)),
        running=len(running),
        starting=starting,
        deployed=app.get("status") == "RUNNING",
        actors=running,
    )


def start_serve(settings: ServerSettings, logging_config: dict[str, bool], deadline: float) -> None:
    """Start Serve (its controller and ingress) on ``settings``' host and port; return once
    its proxies are healthy, or raise ``ModelError`` at ``deadline`` (``time.monotonic()``).

    Serve's controller gives a starting proxy a few seconds to say it is ready (5 s, then 10,
    15...: RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S), kills one that has not and starts another,
    while ``serve.start`` waits on the first and raises ``ActorDiedError``: on a loaded machine
    (2 cores, a test suite on both), HAProxy's manager took longer. Serve is then running, and
    the new proxy is waited for here.
    """
    options: dict[str, Any] = {
        "http_options": {
            "host": settings.host,
            "port": settings.port,
            # bounds a request's wait for a replica (scale from zero) and its whole life
            "request_timeout_s": settings.request_timeout_s,
        },
        "logging_config": logging_config,
    }
    try:
        serve.start(**options)
    except ray.exceptions.ActorDiedError as e:
        logger.warning(
            "Serve's controller restarted its proxy, which did not start in time (%s): "
            "waiting for the new one",
            last_line(str(e)),
        )
        serve.start(**options)  # joins the running controller (or starts one if it died too)
        _wait_proxies(deadline)


def _wait_proxies(deadline: float) -> None:
    while True:
        proxies = serve.status().proxies
        if proxies and all(status == "HEALTHY" for status in proxies.values()):
            return
        if time.monotonic() > deadline:
            states = ", ".join(sorted({getattr(p, "value", str(p)) for p in proxies.values()}))
            states = states or "none"
            raise ModelError(f"Serve's proxy did not start (proxies: {states}): see Ray's logs")
        time.sleep(0.25)


def wait_started(timeout_s: float) -> None:
    """Wait until the replicas' application and ``/ready``'s run (the new version's min
    replicas up); raise ``ModelError`` when they fail to deploy or at ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications
        app, probe = status.get(APP_NAME), status.get(READY_APP_NAME)
        if app is not None and app.status == "DEPLOY_FAILED":
            messages = [d.message for d in app.deployments.values() if d.message]
            why = last_line(messages[0] if messages else app.message)
            raise ModelError(
                f"the replicas could not start: {why} (a replica's own error, such as a model "
                "that does not load, is in the log above)"
            )
        # RUNNING: the new version's min replicas are up (none for min 0)
        if app is not None and probe is not None and probe.status == app.status == "RUNNING":
            return
        if time.monotonic() > deadline:
            resources = ray.cluster_resources()  # type: ignore[no-untyped-call]
            raise ModelError(
                f"no replica started within {timeout_s:.0f} s; the Ray cluster has "
                f"{resources.get('CPU', 0):g} CPU(s) and {resources.get('GPU', 0):g} GPU(s): "
                "lower --replicas, or check the replicas' logs"
            )
        time.sleep(0.25)
