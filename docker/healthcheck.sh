#!/bin/sh
# Exit 0 when Triton reports ready on its HTTP port: /v2/health/ready answers 200 once every
# model has loaded. The images' HEALTHCHECK and compose.yaml's healthcheck run this.
set -eu
PORT="${SPECBUILD_HTTP_PORT:-8000}"
exec "${SPECBUILD_PYTHON:-python3}" -c '
import sys, urllib.request
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/v2/health/ready", timeout=5) as reply:
        sys.exit(0 if reply.status == 200 else 1)
except OSError as exc:
    print(f"not ready: {exc}", file=sys.stderr)
    sys.exit(1)
' "$PORT"
