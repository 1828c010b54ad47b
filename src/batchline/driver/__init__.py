"""Client fan-out: ``batchline drive`` sends a dataset to serving replicas, exactly once.

- ``batchline.driver.drive``: ``drive_job(DriveOptions) -> DriveSummary``, the job itself.
- ``batchline.driver.options``: ``DriveOptions``, what to drive where, checked once.
- ``batchline.driver.endpoints``: ``EndpointPool``, routing to the least-loaded replica (or a
  prefix's own), setting failing ones aside and re-probing them.
- ``batchline.driver.affinity``: prefix keys and the requests of a window, for prefix affinity.
- ``batchline.driver.client``: ``ReplicaClient``, one HTTP attempt and its verdict.
- ``batchline.driver.retry``: ``Backoff`` (full jitter) and ``parse_retry_after``.

    >>> from batchline.driver import DriveOptions, drive_job
    >>> summary = await drive_job(DriveOptions(input=Path("docs.jsonl"),
    ...                                        endpoints=["http://127.0.0.1:8000"]))

(The sync ``drive(options)`` lives in ``batchline.driver.drive``: the package's attribute
``drive`` is that submodule.)

The names below are imported on first use, so ``batchline --help`` (which imports
``batchline.driver.cli``) needs neither httpx nor pyarrow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchline._lazy import lazy_exports

if TYPE_CHECKING:
    from batchline.driver.client import ReplicaClient, Reply
    from batchline.driver.drive import DriveSummary, drive_job, read_failures
    from batchline.driver.endpoints import EndpointPool, EndpointReport
    from batchline.driver.options import DriveOptions
    from batchline.driver.retry import Backoff, parse_retry_after

__all__ = [
    "Backoff",
    "DriveOptions",
    "DriveSummary",
    "EndpointPool",
    "EndpointReport",
    "ReplicaClient",
    "Reply",
    "drive_job",
    "parse_retry_after",
    "read_failures",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "Backoff": "retry",
        "parse_retry_after": "retry",
        "EndpointPool": "endpoints",
        "EndpointReport": "endpoints",
        "ReplicaClient": "client",
        "Reply": "client",
        "DriveOptions": "options",
        "DriveSummary": "drive",
        "drive_job": "drive",
        "read_failures": "drive",
    },
)
