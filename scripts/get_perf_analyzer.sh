#!/usr/bin/env bash
# NVIDIA's perf_analyzer, as the tritonclient 2.51.0 x86_64 wheel ships it (data/bin/), with the
# two libraries it loads: libb64.so.0d (Debian package libb64-0d) and libcudart.so.12 (wheel
# nvidia-cuda-runtime-cu12). Installed into $SPECBUILD_PERF_ANALYZER_DIR (default
# ~/.cache/specbuild/perf_analyzer): bin/perf_analyzer and lib/. builder/ops/perf_analyzer.py finds it there.
set -euo pipefail
DEST="${SPECBUILD_PERF_ANALYZER_DIR:-$HOME/.cache/specbuild/perf_analyzer}"
PY="${PYTHON:-$(dirname "$0")/../.venv/bin/python}"
if [ -x "$DEST/bin/perf_analyzer" ] && [ -e "$DEST/lib/libb64.so.0d" ] && [ -e "$DEST/lib/libcudart.so.12" ]; then
  echo "perf_analyzer already in $DEST"; exit 0
fi
WORK="$(mktemp -d)"; trap 'rm -rf "$WORK"' EXIT
mkdir -p "$DEST/bin" "$DEST/lib"
"$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux1_x86_64 --python-version 3.11 \
  tritonclient==2.51.0 -d "$WORK"
"$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 --python-version 3.11 \
  nvidia-cuda-runtime-cu12 -d "$WORK"
(cd "$WORK" && apt-get download libb64-0d >/dev/null 2>&1) || { echo "apt-get download libb64-0d failed" >&2; exit 1; }
"$PY" - "$WORK" "$DEST" <<'PYEOF'
import pathlib, shutil, stat, sys, zipfile
work, dest = map(pathlib.Path, sys.argv[1:])
for wheel in work.glob("*.whl"):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            base = name.rsplit("/", 1)[-1]
            if name.endswith("/bin/perf_analyzer"):
                target = dest / "bin" / "perf_analyzer"
            elif base.startswith("libcudart.so.12"):
                target = dest / "lib" / "libcudart.so.12"
            else:
                continue
            target.write_bytes(z.read(name))
            target.chmod(target.stat().st_mode | stat.S_IXUSR)
PYEOF
DEB="$(ls "$WORK"/libb64-0d_*.deb)"
dpkg-deb -x "$DEB" "$WORK/deb"
cp "$(find "$WORK/deb" -name 'libb64.so.0d*' | head -1)" "$DEST/lib/libb64.so.0d"
LD_LIBRARY_PATH="$DEST/lib" "$DEST/bin/perf_analyzer" --help >/dev/null 2>&1 || true
echo "perf_analyzer installed in $DEST"
