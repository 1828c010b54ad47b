"""How requests reach the Ray Serve replicas of ``batchline serve --engine ray``.

- ``proxy`` (Serve's default): Serve's Python proxy on HOST:PORT takes each HTTP request, and
  forwards it to a replica as a Ray call; the replica hands it to the app as ASGI.
- ``haproxy``: HAProxy on HOST:PORT (Serve starts it and rewrites its config as replicas come
  and go); each replica runs an HTTP server of its own on a port of 30000-31000, and HAProxy
  sends requests there (least connections first). While no replica runs (scale to zero),
  HAProxy sends requests to Serve's proxy, which holds them until one does.

Serve reads the choice from environment variables when its processes start
(:func:`ingress_env`); figures in docs/ray.md.
"""

from __future__ import annotations

import contextlib
import csv
import os
import socket
import time

import ray

from batchline._errors import InputError, ModelError

__all__ = [
    "INGRESSES",
    "check_ingress",
    "free_port",
    "ingress_env",
    "routed",
    "wait_routed",
]

#: How requests reach the replicas (``serve --engine ray --ray-ingress``): ``proxy``, Serve's
#: Python proxy, which forwards each request to a replica over Ray; ``haproxy``, HAProxy on
#: HOST:PORT, which sends each request over HTTP to the port the replica listens on itself.
INGRESSES = ("proxy", "haproxy")


def check_ingress(ingress: str) -> None:
    if ingress not in INGRESSES:
        raise InputError(f"--ray-ingress {ingress!r}: expected one of {', '.join(INGRESSES)}")


def ingress_env(ingress: str) -> dict[str, str]:
    """Ray's environment variables that choose ``ingress`` (:data:`INGRESSES`). Serve reads
    them when its processes start: set them before ``ray.init`` (or ``ray start`` on every
    node of a cluster). ``haproxy`` also picks free ports for what Serve would put on fixed
    ones (its fallback proxy, which holds requests while no replica runs, HAProxy's
    Prometheus endpoint and stats page), so that two can run on one machine, and shortens the
    30 s that a removed replica keeps its port open for an outside load balancer to notice
    (HAProxy is told at once)."""
    check_ingress(ingress)
    if ingress == "proxy":
        return {}
    return {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port("127.0.0.1")),
        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_port("127.0.0.1")),
        # HAProxy binds these two on every interface, whatever --host says
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port("0.0.0.0")),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port("0.0.0.0")),
    }


def routed(app: str, *, replicas: int = 1) -> bool:
    """Whether HAProxy sends the requests of application ``app`` to ``replicas`` replicas or
    more, or (0) at least to Serve's proxy, which holds them while no replica runs (MIN 0).
    Waiting for every starting replica keeps a reload (each added replica is one) from cutting
    off the clients that came once the first was routed. Serve calls a
    replica running before HAProxy has reloaded with its port, and the HAProxy process that a
    reload replaces closes the connections it holds: a client that connected to it would be
    cut off. So: once HAProxy's stats list such a server UP and the replaced process has
    exited (HAProxy of the node this runs on: on the private Ray, the only one)."""
    from ray.serve._private.constants import RAY_SERVE_HAPROXY_SOCKET_PATH

    # Serve's HAProxy keeps its files in a folder per node
    folder, name = os.path.split(RAY_SERVE_HAPROXY_SOCKET_PATH)
    folder = os.path.join(folder, ray.get_runtime_context().get_node_id())
    servers = _haproxy_servers_up(os.path.join(folder, name), f"http-{app}")
    if replicas:
        servers = [s for s in servers if s.startswith("SERVE_REPLICA")]
    return len(servers) >= max(replicas, 1) and _haproxy_processes(folder) == 1


def wait_routed(app: str, timeout_s: float, *, replicas: int = 1) -> None:
    """Wait until :func:`routed`; ``ModelError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not routed(app, replicas=replicas):
        if time.monotonic() > deadline:
            what = f"{replicas} replica(s)" if replicas else "Serve"
            raise ModelError(
                f"HAProxy did not route to {what} within "
                f"{timeout_s:.0f} s; check the proxy's log (serve/proxy_*.log under Ray's "
                "session folder)"
            )
        time.sleep(0.2)


def _haproxy_servers_up(socket_path: str, backend: str) -> list[str]:
    """The servers of ``backend`` that HAProxy's stats (``show stat``, CSV) list UP."""
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(2.0)
            s.connect(socket_path)
            s.sendall(b"show stat\n")
            data = b"".join(iter(lambda: s.recv(65536), b""))
    except OSError:  # not started yet, or between two of its processes
        return []
    return [
        # pxname, svname, ..., status (the 18th field)
        row[1]
        for row in csv.reader(data.decode(errors="replace").splitlines())
        if len(row) > 17
        and row[0] == backend
        and row[1] not in ("FRONTEND", "BACKEND")
        and row[17].startswith("UP")
    ]


def _haproxy_processes(folder: str) -> int:
    """HAProxy processes running on a config under ``folder`` (the live one, and those that
    a reload replaced and that still finish their connections), from /proc."""
    needle = os.path.join(folder, "haproxy.cfg").encode()
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            count += needle in argv and os.path.basename(argv[0]) == b"haproxy"
    return count


def free_port(host: str) -> int:
    """A port free on ``host`` now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
