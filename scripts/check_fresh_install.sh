#!/usr/bin/env bash
# The README's commands as a new user runs them, each in a fresh virtual environment:
#  1. `bash scripts/run.sh` in a fresh clone (it makes its own .venv), called from another
#     directory, on a few records of the demo corpus and on a relative input path; stopped by
#     SIGTERM in the background, then finished by the command its message names;
#  2. then each of the README's bash blocks in order (scripts/run_readme_blocks.py), in a venv
#     of one's own with nothing else on PATH: `pip install '.[jobs]'`, `batchline models pull`,
#     `batchline run`, the generation journey (torch's CPU wheel, smollm2), `batchline serve`
#     (started, ready, SIGTERM). A line that needs what this setup lacks (an extra, a file of
#     your own) must refuse in one line with the fix; any other outcome fails the check.
# Both reuse pip's download cache; batchline's model/corpus cache starts empty.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export BATCHLINE_CACHE_DIR="$WORK/cache" HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

fail() { echo "check_fresh_install: FAILED: $*" >&2; exit 1; }

git clone --quiet "$ROOT" "$WORK/clone"
mkdir "$WORK/caller"
cd "$WORK/caller"

echo "== 1. bash scripts/run.sh in a fresh clone (its own fresh .venv)"
bash "$WORK/clone/scripts/run.sh" --limit 300 | tee run1.txt
grep -q "records (this run)" run1.txt || fail "run.sh printed no summary"
[ -f demo-corpus.embeddings/_manifest.json ] || fail "no ./demo-corpus.embeddings in the caller's directory"
printf 'a first line\na second line\n' > mine.txt
bash "$WORK/clone/scripts/run.sh" mine.txt --quiet > run2.txt
[ ! -s run2.txt ] || fail "--quiet printed something on success"
[ -f mine.embeddings/_manifest.json ] || fail "relative input did not resolve against the caller's directory"
# stopped by SIGTERM while in the background of this script (so with SIGINT ignored): it stops,
# keeps what is done, and its hint, run as printed with nothing else on PATH, finishes the job
# (10,000 records: 3,000 took under 12 s on the AMX hosts, so the job had ended before the kill)
bash "$WORK/clone/scripts/run.sh" --limit 10000 -o stopped --quiet 2> stop.txt &
sleep 12  # the model loads, then some records are done (either way the hint must work)
kill -TERM $! 2>/dev/null || true  # one that ended already is caught just below
code=0; wait $! || code=$?
[ "$code" = 143 ] || fail "SIGTERM: exit $code, not 143 (did it end before the kill?): $(cat stop.txt)"
hint="$(sed -n 's/.*; to go on, run: //p' stop.txt)"
[ -n "$hint" ] || fail "a stopped run named no command: $(cat stop.txt)"
env PATH=/usr/bin:/bin bash -c "$hint" || fail "the hinted command failed: $hint"
grep -q '"complete": true' stopped/_manifest.json || fail "the hinted command did not finish"
[ -z "$(git -C "$WORK/clone" status --porcelain)" ] || fail "run.sh left files in the repository"

echo "== 2. the README's blocks in order, in an environment of one's own, nothing else on PATH"
python3 -m venv "$WORK/venv"
mkdir "$WORK/journey"
(cd "$WORK/journey" && env PATH="$WORK/venv/bin:/usr/bin:/bin" VIRTUAL_ENV="$WORK/venv" \
    python3 "$WORK/clone/scripts/run_readme_blocks.py" "$WORK/clone") | tee run3.txt
grep -q "records (this run)" run3.txt || fail "batchline run printed no summary"
[ -f "$WORK/journey/my-texts.embeddings/_manifest.json" ] || fail "batchline run wrote no output"
echo "check_fresh_install: OK"
