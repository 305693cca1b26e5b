#!/usr/bin/env bash
# The README's second command: set up .venv with the test tools and run the test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k cache
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh dev
export PREFECT_SERVER_ANALYTICS_ENABLED=false OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
exec python -m pytest -q "$@"
