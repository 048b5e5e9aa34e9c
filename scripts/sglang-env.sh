#!/usr/bin/env bash
# A virtual environment in which SGLang's scheduler runs in-process on a CPU (fuzz/sglang_adapter.py).
#
# SGLang's wheel pins CUDA-only packages (flashinfer, sglang-kernel, cuda-python, a CUDA torch ...),
# so it is installed with --no-deps, and so is everything else: below is the smallest set of
# packages with which `import sglang.srt.managers.scheduler` succeeds on a CPU, found by importing
# until nothing was missing. The GPU-only modules it still names (sgl_kernel, flashinfer, tvm_ffi,
# torchvision) are stubbed by the adapter, never installed. Nothing here is a CUDA build of torch.
#
# Usage: bash scripts/sglang-env.sh [VENV]        (default .venv-sglang, or $BATCHSPEC_SGLANG_VENV)
#        then VENV/bin/batchspec conform --engine sglang --traces 200
#        or   VENV/bin/python -m pytest -m sglang tests/test_sglang_conformance.py
set -euo pipefail
cd "$(dirname "$0")/.."
V=${1:-${BATCHSPEC_SGLANG_VENV:-.venv-sglang}}
PIP=("$V/bin/pip" install -q --no-deps)

python3 -m venv "$V"

# torch: the CPU build, and the packages it imports (no nvidia-* runtime wheels)
"${PIP[@]}" torch==2.13.0 filelock==4.3.1 fsspec==2026.9.0 Jinja2==3.1.6 MarkupSafe==3.0.4 mpmath==1.3.0 \
    networkx==3.6.1 sympy==1.14.0 typing_extensions==4.16.0 setuptools==84.2.1
if ! "$V/bin/python" -c "import torch, sys; sys.exit(torch.version.cuda is not None)"; then
    echo "sglang-env.sh: pip chose a CUDA build of torch; install the CPU build of torch 2.13.0 first" >&2
    exit 2
fi

# SGLang itself, and what its scheduling modules import (pure Python or CPU wheels)
"${PIP[@]}" sglang==0.5.23 \
    aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 annotated-types==0.8.0 \
    anyio==4.16.0 attrs==26.1.0 certifi==2026.10.19.post1 click==8.5.1 compressed-tensors==0.20.1 dill==0.4.1 \
    einops==0.8.2 fastapi==0.165.0 frozenlist==1.8.0 gguf==0.19.0 h11==0.16.0 httpcore2==2.16.2 httpx2==2.16.2 \
    huggingface_hub==2.4.0 idna==3.20 ipython==9.18.1 loguru==0.7.3 msgspec==0.23.0 multidict==7.2.1 \
    numpy==2.4.6 openai==3.57.0 opentelemetry-api==1.45.2 orjson==3.13.0 packaging==26.4 \
    partial-json-parser==0.2.1.1.post7 pillow==13.0.0 propcache==0.5.4 psutil==7.2.2 pybase64==1.5.1 \
    pydantic==2.14.4 pydantic_core==2.50.5 PyYAML==6.0.4 pyzmq==27.3.0 regex==2026.11.19 requests==2.34.2 \
    sentencepiece==0.2.3 setproctitle==1.3.8 sniffio==1.3.1 starlette==1.10.0 tokenizers==0.23.2 tqdm==4.70.1 \
    traitlets==5.16.1 transformers==5.19.0 triton==3.9.0 truststore==0.10.5 typing-inspection==0.4.5 \
    urllib3==2.8.0 uvicorn==0.54.0 yarl==1.25.1

# batchspec (editable) and its light dependencies, and pytest for the `sglang` marker's tests
"${PIP[@]}" -e . jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
    rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 Pygments==2.21.0 safetensors==0.8.0
"$V/bin/pip" install -q pytest pytest-xdist  # (pyproject's addopts run pytest -n auto)

"$V/bin/python" -c "import fuzz.sglang_adapter as a; a.sglang_modules(); print('SGLang', a.SGLANG_VERSION, 'imports: ok')"
