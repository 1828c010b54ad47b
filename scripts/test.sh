#!/usr/bin/env bash
# Set up, then lint, type-check and run the whole test suite. Extra arguments go to pytest.
source "$(dirname "$0")/_env.sh" dev
cd "$ROOT"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/pytest "$@"
