#!/usr/bin/env bash
# Set up, then run the main job: embeddings of the built-in demo corpus with the default model.
# Extra arguments go to `batchline run` (e.g. bash scripts/run.sh --help). Relative paths
# resolve against the current directory, where the output lands too (default:
# ./demo-corpus.embeddings, or ./INPUT-STEM.embeddings for an input file).
source "$(dirname "$0")/_env.sh" jobs
exec "$VENV/bin/batchline" run "$@"
