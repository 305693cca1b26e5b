#!/usr/bin/env bash
# The reliability suite alone, the slow kill/resume sweep included (about 15 minutes on 2 cores):
# damaged caches and checkpoints, malicious cache records, storage outages on the moto server, bad
# inputs, killed workers, and ppoflow train SIGKILLed at many moments then resumed. Ends with the line
# "reliability suite: N cases tried, M handled well". Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh dev
export PREFECT_SERVER_ANALYTICS_ENABLED=false OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
exec python -m pytest -q -m reliability "$@"
