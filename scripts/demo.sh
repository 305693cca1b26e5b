#!/usr/bin/env bash
# The README's first command: set up .venv and run the demo (GRPO on a tiny model, on the CPU).
# Extra arguments are passed on, e.g. scripts/demo.sh trainer.total_training_steps=50
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh ""  # no extras (a bare `source` would hand it this script's arguments)
export PREFECT_SERVER_ANALYTICS_ENABLED=false OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
exec ppoflow train "$@"
