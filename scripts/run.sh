#!/usr/bin/env bash
# Set up, then run the main job: embeddings of the built-in demo corpus with the default model.
# Extra arguments go to `batchline run` (e.g. bash scripts/run.sh --help).
source "$(dirname "$0")/_env.sh" jobs
exec .venv/bin/batchline run "$@"
