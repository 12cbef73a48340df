#!/usr/bin/env bash
# Sets up a fresh machine: a virtual environment in .venv with everything specbuild needs,
# and the reference model fetched, verified and converted into the cache.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
# torch first and pinned: this version is the local CPU wheel; anything else pulls GBs of CUDA packages
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
.venv/bin/specbuild fetch-model
# NVIDIA's perf_analyzer (tests/test_perf_analyzer.py, specbuild bench perf-analyzer); optional:
# without apt or the package index its tests skip with a reason
bash scripts/get_perf_analyzer.sh || echo "perf_analyzer not installed (scripts/get_perf_analyzer.sh failed); its tests will skip" >&2
