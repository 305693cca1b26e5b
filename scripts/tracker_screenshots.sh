#!/usr/bin/env bash
# Screenshots of a short ppoflow run in MLflow's UI, each checked to show what it is meant to, and the dump
# viewer's output (scripts/tracker_screenshots.py). Needs Chromium from the distribution's packages
# (apt-get install chromium).
# Usage: scripts/tracker_screenshots.sh [OUT_DIR]   (default: docs/images/trackers)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh dev
export PREFECT_SERVER_ANALYTICS_ENABLED=false OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
exec python scripts/tracker_screenshots.py "$@"
