"""``manifest.json``: what a build made, from what, with which tools.

Written last, so a build folder without a manifest is an unfinished build. Holds the spec,
the plan, the precisions, every file's sha256 and size, the engines' status (never
"compiled" unless the engine files exist), the torch runtime's weights and the versions of
the tools involved.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from triton_backend.core.reference_model import sha256_of

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "specbuild-manifest/1"
_TOOLS = ("specbuild", "torch", "transformers", "nvidia-modelopt", "safetensors", "tensorrt_llm", "tensorrt")


def file_hashes(root: Path, folders: list[str]) -> dict[str, dict[str, Any]]:
    """``{relative path: {sha256, bytes}}`` for every file under ``folders`` of ``root``."""
    out: dict[str, dict[str, Any]] = {}
    for folder in folders:
        base = root / folder
        paths = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for path in paths:
            if path.exists():
                out[path.relative_to(root).as_posix()] = {"sha256": sha256_of(path), "bytes": path.stat().st_size}
    return out


def tool_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in _TOOLS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def write_manifest(out_dir: Path, content: dict[str, Any], hashed: list[str]) -> Path:
    manifest = {"format": MANIFEST_FORMAT, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                **content, "versions": tool_versions(), "files": file_hashes(out_dir, hashed)}
    path = out_dir / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return path


def refresh_manifest(out_dir: Path, folders: list[str]) -> None:
    """Hash again the files under ``folders`` (derived files rendered again, e.g. a serving
    switch that is no part of the build's key); every other entry is kept."""
    path = out_dir / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    stale = [rel for rel in manifest["files"] if any(rel == f or rel.startswith(f + "/") for f in folders)]
    for rel in stale:
        del manifest["files"][rel]
    manifest["files"].update(file_hashes(out_dir, folders))
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")


def verify_manifest(out_dir: Path) -> list[str]:
    """Files whose content no longer matches the manifest (empty: all match)."""
    manifest = json.loads((out_dir / MANIFEST_NAME).read_text())
    bad = []
    for rel, info in manifest["files"].items():
        path = out_dir / rel
        if not path.is_file() or sha256_of(path) != info["sha256"]:
            bad.append(rel)
    return bad
