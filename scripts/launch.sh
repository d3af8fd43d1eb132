#!/usr/bin/env bash
# Start a whole nanopipe pipeline in the foreground; Ctrl-C or SIGTERM stops every process.
#   scripts/launch.sh [--model DIR] [--tp 2] [--device cpu|cuda] [--max-model-len N]
#                     [--stdout] [--port HTTP_PORT] ...   (the flags of `nanopipe serve --help`)
# One TP group over several hosts, as torchrun: run on each host, with its own --node-rank
# (node 0 runs the front and creates the key file; copy that file to the other hosts):
#   scripts/launch.sh --tp 2 --nnodes 2 --node-rank R --master-addr A --master-port P \
#                     --cluster-key FILE
# Data-parallel replicas on a Ray cluster:  scripts/launch.sh --dp 2 --ray-address auto
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${here}${PYTHONPATH:+:${PYTHONPATH}}"
exec "${PYTHON:-python3}" -m frontend.engine.cli "$@"
