#!/usr/bin/env bash
# Every GPU check of ppoflow in one go, for one CUDA machine (sized for an H200: under 10 minutes):
#   1. a virtual environment with ppoflow[vllm,dev] installed (vLLM brings its own CUDA build of torch),
#   2. pytest -m gpu (tests/test_vllm_rollout_gpu.py: vLLM vs transformers parity, log-probs, seeds,
#      sampling options, weight updates, the Ray rollout actor),
#   3. the real-models check (benchmarks/real_models_gpu.py: gradient checkpointing, remove padding, LoRA and
#      bf16 against the plain path on Qwen2.5-0.5B's shapes, with peak memory and tokens/s; about 2 minutes),
#   4. a summary: PASS only if every GPU test ran and passed (a skipped GPU test means a prerequisite
#      is missing, so it counts as a failure here) and the real-models check passed.
# Usage: scripts/gpu_check.sh [--bench] [extra pytest arguments]
#   --bench             also run benchmarks/vllm_vs_hf.py (small settings) after the checks
# Environment:
#   PPOFLOW_GPU_VENV    the environment to install into (default ~/.cache/ppoflow/gpu-venv, reused);
#                       set it empty to install into the current interpreter's environment instead
#   PPOFLOW_WHEELHOUSE  a folder of wheels for an offline install (pip --no-index --find-links)
#   PPOFLOW_GPU_BUDGET  seconds for the whole script (default 480); pytest gets what the install left
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
budget=${PPOFLOW_GPU_BUDGET:-480}
bench=0
if [ "${1:-}" = "--bench" ]; then bench=1; shift; fi
say() { echo "[gpu_check $((SECONDS - start))s] $*"; }

if ! nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; then
    say "FAIL: no NVIDIA GPU is visible (nvidia-smi failed)"; exit 2
fi

venv=${PPOFLOW_GPU_VENV-${XDG_CACHE_HOME:-$HOME/.cache}/ppoflow/gpu-venv}
if [ -n "$venv" ]; then
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv" || { say "FAIL: could not create $venv"; exit 3; }
    # shellcheck disable=SC1091
    . "$venv/bin/activate"
fi
installer=(python -m pip install -q --disable-pip-version-check)
command -v uv >/dev/null && installer=(uv pip install -q --python "$(command -v python)")  # much faster
[ -n "${PPOFLOW_WHEELHOUSE:-}" ] && installer+=(--no-index --find-links "$PPOFLOW_WHEELHOUSE")
say "installing ppoflow[vllm,dev] into ${venv:-the current environment} with ${installer[0]}"
if ! "${installer[@]}" -e ".[vllm,dev]"; then
    say "FAIL: could not install ppoflow[vllm,dev] (no network? set PPOFLOW_WHEELHOUSE to a folder of wheels)"
    exit 3
fi
python - <<'EOF' || { say "FAIL: the installed vllm/torch do not see a GPU"; exit 3; }
import importlib.metadata as md, torch
print(f"[gpu_check] python ok; torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {md.version('vllm')}, "
      f"transformers {md.version('transformers')}; GPU: {torch.cuda.get_device_name(0)}")
EOF

export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1 \
       PREFECT_SERVER_ANALYTICS_ENABLED=false VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_LOGGING_LEVEL=WARNING \
       OMP_NUM_THREADS=1
left=$((budget - (SECONDS - start)))
[ "$left" -lt 120 ] && left=120
report=$(mktemp -d)/gpu.xml
say "running pytest -m gpu (at most ${left}s)"
timeout --signal=INT --kill-after=20 "$left" python -m pytest -m gpu -q -rA -p no:cacheprovider \
    --junitxml="$report" tests "$@"
rc=$?

summary=$(python - "$report" <<'EOF'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("no report (pytest was stopped)"); sys.exit(1)
cases = root.iter("testcase")
passed, failed, skipped = [], [], []
for case in cases:
    name = case.get("name")
    if case.find("failure") is not None or case.find("error") is not None:
        failed.append(name)
    elif case.find("skipped") is not None:
        skipped.append(f"{name} ({case.find('skipped').get('message', '')[:80]})")
    else:
        passed.append(name)
print(f"{len(passed)} passed, {len(failed)} failed, {len(skipped)} skipped")
for label, names in (("FAILED", failed), ("SKIPPED", skipped)):
    for name in names:
        print(f"  {label}: {name}")
sys.exit(0 if passed and not failed and not skipped else 1)
EOF
)
ok=$?
echo "$summary" | sed 's/^/[gpu_check] /'
[ "$rc" -eq 124 ] || [ "$rc" -eq 130 ] && say "pytest ran out of its ${left}s"
say "the real-models check: benchmarks/real_models_gpu.py (at most 300s)"
timeout --signal=INT --kill-after=20 300 python benchmarks/real_models_gpu.py
real_models=$?
[ "$real_models" -eq 0 ] || summary="$summary; the real-models check FAILED"
if [ "$rc" -eq 0 ] && [ "$ok" -eq 0 ] && [ "$real_models" -eq 0 ]; then verdict=PASS; else verdict=FAIL; fi

if [ "$bench" -eq 1 ]; then
    say "benchmark: benchmarks/vllm_vs_hf.py (small settings)"
    python benchmarks/vllm_vs_hf.py --prompts 64 --n 4 --max-new-tokens 128 --repeats 2 || say "benchmark failed"
fi
say "GPU CHECK: $verdict ($(echo "$summary" | head -1)) in $((SECONDS - start))s"
[ "$verdict" = PASS ]
