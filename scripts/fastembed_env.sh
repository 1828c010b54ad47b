#!/usr/bin/env bash
# Make (once) the virtual environment the embedding benchmark runs fastembed in, apart from the
# main .venv: fastembed 0.9.1 pins huggingface-hub<2, below the one transformers uses there.
#   bash scripts/fastembed_env.sh       -> .venv-fastembed/ (or $BATCHLINE_FASTEMBED_VENV)
# benchmarks/bench_embeddings.py --peers runs fastembed with this venv's python, in a process of
# its own that reads the texts and writes the vectors back (no batchline import there).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${BATCHLINE_FASTEMBED_VENV:-$ROOT/.venv-fastembed}"
export HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet "fastembed==0.9.1"
"$VENV/bin/python" -c "import fastembed" \
  || { echo "fastembed_env.sh: 'import fastembed' fails in $VENV" >&2; exit 1; }
echo "$VENV"
