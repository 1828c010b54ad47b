#!/usr/bin/env bash
# Set up, then lint, type-check and run the whole test suite. Extra arguments go to pytest.
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
.venv/bin/pytest "$@"
