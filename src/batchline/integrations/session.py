"""What the Ray job engine (``ray.py``) and Ray Serve (``ray_serve.py``) share: the Ray
session a command opens (or the one already open), the fast check of a cluster address, and
the short reason a Ray error ends with."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator

import ray

from batchline._errors import InputError

__all__ = ["check_reachable", "env_defaults", "last_line", "ray_session"]

#: A private Ray instance's object store: the job's blocks and results pass through it.
_LOCAL_OBJECT_STORE_BYTES = 256 * 1024 * 1024


@contextlib.contextmanager
def env_defaults(values: dict[str, str]) -> Iterator[None]:
    """Set the variables not already set, and remove them again afterwards."""
    added = [k for k in values if k not in os.environ]
    os.environ.update({k: values[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


@contextlib.contextmanager
def ray_session(address: str | None, local_cpus: int) -> Iterator[None]:
    """Use the running Ray connection, or open one for the run and close it at the end."""
    if ray.is_initialized():
        yield
        return
    defaults = {"RAY_USAGE_STATS_ENABLED": "0"}
    if address is None:
        # A private instance needs no token; a cluster's own auth mode is left to its owner.
        defaults["RAY_AUTH_MODE"] = "disabled"
    with env_defaults(defaults):
        try:
            if address is None:
                # "local": never attach to another user's `ray start` instance on this machine.
                ray.init(
                    address="local",
                    num_cpus=local_cpus,
                    object_store_memory=_LOCAL_OBJECT_STORE_BYTES,
                    include_dashboard=False,
                    logging_level=logging.WARNING,
                )
            else:
                ray.init(address=address, logging_level=logging.WARNING)
        except ConnectionError as exc:
            raise InputError(
                f"cannot connect to a Ray cluster at {address!r}: {exc}; start one with "
                "'ray start --head', or leave out --address to run on this machine"
            ) from None
        try:
            yield
        finally:
            ray.shutdown()


def check_reachable(address: str) -> None:
    """Fail fast on a HOST:PORT nobody listens on: Ray itself retries for minutes."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # "auto", a URL: left to Ray
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except OSError as exc:
        raise InputError(
            f"cannot connect to a Ray cluster at {address}: {exc.strerror or exc}; start its "
            "head node with 'ray start --head --port=PORT', or check the address"
        ) from None


def last_line(error: BaseException | str) -> str:
    """The last non-blank line of an error (a Ray error wraps the cause's whole traceback)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if lines:
        return lines[-1]
    return type(error).__name__ if isinstance(error, BaseException) else "unknown error"
