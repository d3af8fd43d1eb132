#!/usr/bin/env bash
# Start a whole nanopipe pipeline in the foreground; Ctrl-C or SIGTERM stops every process.
#   scripts/launch.sh [--model DIR] [--tp 2] [--device cpu|cuda] [--max-model-len N]
#                     [--stdout] [--port HTTP_PORT] ...   (the flags of `nanopipe serve --help`)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${here}${PYTHONPATH:+:${PYTHONPATH}}"
exec "${PYTHON:-python3}" -m frontend.engine.cli "$@"
