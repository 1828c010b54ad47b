#!/usr/bin/env bash
# Set up, then lint, type-check and run the whole test suite: on BATCHLINE_TEST_WORKERS workers
# (default 2, a file to a worker: most tests wait on subprocesses and servers), then the tests
# marked `serial` (timing under load) alone. Extra arguments go to both pytest runs; with a -m or
# -n of your own, or BATCHLINE_TEST_WORKERS=1, the suite runs in one process as given.
source "$(dirname "$0")/_env.sh" dev
cd "$ROOT"
# Models built or converted by the tests (the ONNX MiniLM graph, the smollm2 safetensors folder,
# ~30 s to convert) are cached once per clone, apart from the user's own cache; tests that need a
# fresh cache make their own.
export BATCHLINE_CACHE_DIR="${BATCHLINE_CACHE_DIR:-$ROOT/.cache/batchline}"
export BATCHLINE_TEST_CACHE_DIR="${BATCHLINE_TEST_CACHE_DIR:-$BATCHLINE_CACHE_DIR}"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
workers="${BATCHLINE_TEST_WORKERS:-2}"
for arg in "$@"; do
  case "$arg" in -m* | -n* | --numprocesses*) workers=1 ;; esac
done
if [ "$workers" -le 1 ]; then
  exec .venv/bin/pytest "$@"
fi
# both passes run, so one run reports every failure; exit status 5 is "no test selected", which
# a pass may be when given a file or a -k
first=0
.venv/bin/pytest -n "$workers" --dist loadfile -m "not serial" "$@" || first=$?
second=0
.venv/bin/pytest -m serial "$@" || second=$?
for status in "$first" "$second"; do
  [ "$status" = 0 ] || [ "$status" = 5 ] || exit "$status"
done
if [ "$first" = 5 ] && [ "$second" = 5 ]; then
  exit 5
fi
