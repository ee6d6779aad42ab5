#!/usr/bin/env bash
# Prepare .devkit/ for a GPU machine that has torch, transformers, numba and numba-cuda but neither
# this project's .venv nor a network (the device tool's image): the wheels it lacks (`datasets` and
# two of its needs), SmolLM2-135M-Instruct's tokenizer and the wiki corpus as JSONL. Then, there:
#   bash scripts/device_calibrate.sh            (with .devkit carried along)
# Needs `make setup` here first. DEVICE_PYTHON: the device's Python version (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
KIT=.devkit
rm -rf "$KIT"
mkdir -p "$KIT/whl" "$KIT/tokenizer"
ver() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${DEVICE_PYTHON:-3.12}" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$KIT/whl" \
  "datasets==$(ver datasets)" "dill==$(ver dill)" "multiprocess==$(ver multiprocess)"
MODEL=$("$PY" -m sglang_tasq.models)
cp "$MODEL"/tokenizer.json "$MODEL"/tokenizer_config.json "$KIT/tokenizer/"
"$PY" -m calibrate.corpora --corpus wiki >/dev/null   # the JSONL splits, built once in the cache
CORPUS=$("$PY" -c "from calibrate.corpora import _corpus_dir; print(_corpus_dir('wiki'))")
mkdir -p "$KIT/cache/corpora/$(basename "$CORPUS")"
cp "$CORPUS"/*.jsonl "$KIT/cache/corpora/$(basename "$CORPUS")/"
du -sh "$KIT"
