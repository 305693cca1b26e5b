#!/usr/bin/env bash
# The tests left out of the default run (scripts/test.sh) to keep it under 10 minutes on 2 cores: the
# longer end-to-end runs (serving deployments, S3 across processes, kill-and-resume, outages during a
# replay, the kill/resume sweep, a run for each policy loss, ...). Over 20 minutes on 2 cores. Extra
# arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh dev
export PREFECT_SERVER_ANALYTICS_ENABLED=false OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
exec python -m pytest -q -m slow "$@"
