#!/usr/bin/env bash
# Screenshots of the Prefect UI with a short ppoflow run and a cache replay, each checked to show the tab it
# is meant to, and the Task Runs tab's time to rows (scripts/ui_screenshots.py). Needs Chromium from the
# distribution's packages (apt-get install chromium).
# Usage: scripts/ui_screenshots.sh [OUT_DIR]  |  scripts/ui_screenshots.sh --time-to-rows FLOW_RUN_PAGE [--repeat N]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh dev
export PREFECT_SERVER_ANALYTICS_ENABLED=false OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
exec python scripts/ui_screenshots.py "$@"
