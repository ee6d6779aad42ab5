#!/usr/bin/env bash
# On a GPU machine without this project's .venv (prepared here by scripts/device_kit.sh, .devkit
# carried along): calibration of a Llama-3.1-8B-shaped random-weight model, end to end on the GPU,
# timed by bench.calibrate_device, for each preset named (default: fast, then default).
#   bash scripts/device_calibrate.sh [fast] [default]
# Results: $OUT/calibrate_device/<shape>_<preset>_<device>/{metrics.json,summary.md} (OUT: bench/results).
# PYTHON, DEVICE (cuda), SHAPE (llama-3.1-8b) and CALIB_FLAGS (passed to calibrate) change the run,
# e.g. PYTHON=.venv/bin/python DEVICE=cpu SHAPE=tiny CALIB_FLAGS="--tokens 4096" for a CPU smoke run.
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${KIT:-.devkit}
PY=${PYTHON:-python3}
[ -d "$KIT/whl" ] || { echo "no $KIT: run scripts/device_kit.sh where the venv is, and carry $KIT" >&2; exit 2; }
if ! "$PY" -c "import datasets" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tasq-site "$KIT"/whl/*.whl
  export PYTHONPATH="/tmp/tasq-site"
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" TASQ_CACHE="$PWD/$KIT/cache" PYTHONUNBUFFERED=1 \
  HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
RESULTS=${OUT:-bench/results}/calibrate_device
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch, transformers, numba; print('torch', torch.__version__, 'transformers', transformers.__version__, 'numba', numba.__version__)"
for p in ${@:-fast default}; do
  # shellcheck disable=SC2086  # CALIB_FLAGS is a list of flags
  "$PY" -m bench.calibrate_device --shape "${SHAPE:-llama-3.1-8b}" --device "${DEVICE:-cuda}" --preset "$p" \
    --tokenizer "$KIT/tokenizer" --results "$RESULTS" --work /tmp/tasq-calib-device ${CALIB_FLAGS:-}
done
