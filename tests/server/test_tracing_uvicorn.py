"""The real thing with traces: ``batchline serve`` in a subprocess on 127.0.0.1 with
``OTEL_TRACES_EXPORTER=console``, a request carrying ``traceparent``, and SIGTERM, after which
the spans it printed continue that trace (the provider is flushed on the way out)."""

from __future__ import annotations

import os
import re
import signal

import pytest

pytest.importorskip("opentelemetry.sdk")

from .test_uvicorn import TEXTS, run_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


def test_serve_traces_a_request_into_the_callers_trace() -> None:
    env = {k: "" for k in os.environ if k.startswith("OTEL_")}
    env.update({"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "emb-test"})
    with run_server(env=env) as server:
        status, _, _ = server.post(
            "/v1/embeddings",
            {"input": TEXTS[:2]},
            headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
        )
        assert status == 200
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
        printed = server.log.read_text()
    names = re.findall(r'"name": "([^"]+)"', printed)
    assert "POST /v1/embeddings" in names
    assert "batch" in names
    assert f'"trace_id": "0x{TRACE_ID}"' in printed
    assert f'"parent_id": "0x{PARENT_ID}"' in printed
    assert '"service.name": "emb-test"' in printed
