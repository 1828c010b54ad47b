#!/usr/bin/env bash
# The full fault-injection matrix (tests/faults/): every write step of run, the Batch API, the
# caches and drive failed in turn with ENOSPC, EIO and EROFS. The normal test run tries a few
# steps of each; this tries all of them (a few minutes). Extra arguments go to pytest.
# Uses the repository's .venv when there is one (scripts/test.sh makes it), else python3.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY=python3
cd "$ROOT"
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 BATCHLINE_FAULT_MATRIX=full
export BATCHLINE_CACHE_DIR="${BATCHLINE_CACHE_DIR:-$ROOT/.cache/batchline}"
export BATCHLINE_TEST_CACHE_DIR="${BATCHLINE_TEST_CACHE_DIR:-$BATCHLINE_CACHE_DIR}"
exec "$PY" -m pytest tests/faults -q --timeout=900 "$@"
