#!/usr/bin/env bash
# NVIDIA's genai-perf (0.0.16) against a real specbuild server: the README's profile command.
#
# genai-perf and its dependencies (~940 MB, 77 packages) go into their own virtual environment
# (default ~/.cache/specbuild/genai-perf-venv), not the project's, which is why CI does not run
# this. It drives perf_analyzer, which scripts/get_perf_analyzer.sh installs. The script starts
# `specbuild serve` (the default deployment, docs/serving.md) on free loopback ports, runs the profile
# against the `ensemble` model over gRPC streaming (the server's admin APIs open: perf_analyzer
# reads Triton's statistics API), prints genai-perf's table, and stops the server.
# With --endpoint-type chat or completions it starts the OpenAI-compatible API too
# (`serve --openai-port`, docs/openai.md) and profiles that endpoint over HTTP streaming instead.
#
#   bash scripts/genai_perf.sh [--concurrency N] [--request-count N] [--artifact-dir DIR]
#                              [--endpoint-type chat|completions]
set -euo pipefail
cd "$(dirname "$0")/.."

CONCURRENCY=1
REQUESTS=8
ARTIFACTS="${TMPDIR:-/tmp}/specbuild-genai-perf"
ENDPOINT_TYPE=""  # empty: Triton gRPC (ensemble); chat or completions: the OpenAI API
while [ $# -gt 0 ]; do
    case "$1" in
        --concurrency) CONCURRENCY="$2"; shift 2 ;;
        --request-count) REQUESTS="$2"; shift 2 ;;
        --artifact-dir) ARTIFACTS="$2"; shift 2 ;;
        --endpoint-type) ENDPOINT_TYPE="$2"; shift 2 ;;
        *) echo "genai_perf.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

CACHE="${SPECBUILD_CACHE_DIR:-$HOME/.cache/specbuild}"
VENV="${GENAI_PERF_VENV:-$CACHE/genai-perf-venv}"
PA="$CACHE/perf_analyzer"
[ -x .venv/bin/specbuild ] || { echo "genai_perf.sh: run scripts/setup.sh first" >&2; exit 1; }
[ -x "$PA/bin/perf_analyzer" ] || bash scripts/get_perf_analyzer.sh
if [ ! -x "$VENV/bin/genai-perf" ]; then
    echo "genai_perf.sh: installing genai-perf 0.0.16 into $VENV"
    "${PYTHON:-python3}" -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check "genai-perf==0.0.16" "numpy<2"
fi

ports=$(.venv/bin/python -c "
import socket
socks = [socket.socket() for _ in range(4)]
for s in socks: s.bind(('127.0.0.1', 0))
print(' '.join(str(s.getsockname()[1]) for s in socks))")
read -r HTTP GRPC METRICS OPENAI <<<"$ports"
case "$ENDPOINT_TYPE" in
    # perf_analyzer reads Triton's statistics API, which `serve` closes by default (docs/security.md):
    # open on this loopback-only server; without it perf_analyzer exits 99 ("This protocol is restricted")
    "") SERVE_FLAGS=(--open-admin-apis) ;;
    chat|completions) SERVE_FLAGS=(--openai-port "$OPENAI") ;;
    *) echo "genai_perf.sh: --endpoint-type must be chat or completions" >&2; exit 2 ;;
esac
LOG="$(mktemp /tmp/specbuild-genai-perf-server.XXXXXX.log)"
.venv/bin/specbuild serve --decoupled-mode true --http-port "$HTTP" --grpc-port "$GRPC" --metrics-port "$METRICS" \
    "${SERVE_FLAGS[@]}" >"$LOG" 2>&1 &
SERVER=$!
stop_server() { kill "$SERVER" 2>/dev/null && wait "$SERVER" 2>/dev/null; echo "genai_perf.sh: server stopped (log $LOG)"; }
trap stop_server EXIT
for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$HTTP/v2/health/ready" >/dev/null 2>&1 && break
    kill -0 "$SERVER" 2>/dev/null || { echo "genai_perf.sh: the server exited; its log:" >&2; tail -n 20 "$LOG" >&2; exit 1; }
    sleep 1
done
curl -sf "http://127.0.0.1:$HTTP/v2/health/ready" >/dev/null || { echo "genai_perf.sh: server not ready" >&2; exit 1; }
if [ -n "$ENDPOINT_TYPE" ]; then  # the front starts once Triton is ready
    for _ in $(seq 1 120); do curl -sf "http://127.0.0.1:$OPENAI/health" >/dev/null 2>&1 && break; sleep 1; done
    PATH="$PA/bin:$PATH" LD_LIBRARY_PATH="$PA/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$VENV/bin/genai-perf" profile -m smollm2-135m-instruct --endpoint-type "$ENDPOINT_TYPE" --streaming \
        -u "http://127.0.0.1:$OPENAI" --tokenizer "$CACHE/models/smollm2-135m-instruct" \
        --synthetic-input-tokens-mean 128 --output-tokens-mean 64 --extra-inputs ignore_eos:true \
        --extra-inputs max_tokens:64 --concurrency "$CONCURRENCY" --request-count "$REQUESTS" \
        --artifact-dir "$ARTIFACTS"
    echo "genai_perf.sh: artifacts in $ARTIFACTS"
    exit 0
fi

# the README's command, with this server's gRPC port
PATH="$PA/bin:$PATH" LD_LIBRARY_PATH="$PA/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
"$VENV/bin/genai-perf" profile -m ensemble --backend tensorrtllm --streaming -u "127.0.0.1:$GRPC" \
    --tokenizer "$CACHE/models/smollm2-135m-instruct" --synthetic-input-tokens-mean 128 \
    --output-tokens-mean 64 --extra-inputs ignore_eos:true --concurrency "$CONCURRENCY" \
    --request-count "$REQUESTS" --artifact-dir "$ARTIFACTS"
echo "genai_perf.sh: artifacts in $ARTIFACTS"
