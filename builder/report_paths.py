"""Paths as committed reports name them: relative to the repository, never a machine's own.

Every writer of a report that may be committed (bench results, training reports, load-test
results) passes its data through :func:`portable`, so the next run stays free of absolute
paths such as a home or scratch folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUTSIDE = "<outside the repository>"


def repo_path(path: str | os.PathLike[str], root: Path = REPO) -> str:
    """``path`` relative to the repository ``root`` when it lies inside it; a relative path as
    given; a path elsewhere as ``<outside the repository>/NAME`` (its last component only)."""
    p = Path(path)
    if not p.is_absolute():
        return p.as_posix()
    try:
        return p.resolve().relative_to(root.resolve()).as_posix() or "."
    except ValueError:
        return f"{OUTSIDE}/{p.name}"


def _looks_like_path(text: str) -> bool:
    return os.path.isabs(text) and not any(c.isspace() for c in text)


def portable(value: Any, root: Path = REPO) -> Any:
    """``value`` with every :class:`~pathlib.Path` and every string holding one absolute path
    (no whitespace) replaced by :func:`repo_path`, through nested dicts, lists and tuples."""
    if isinstance(value, Path) or (isinstance(value, str) and _looks_like_path(value)):
        return repo_path(value, root)
    if isinstance(value, dict):
        return {k: portable(v, root) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v, root) for v in value]
    return value


__all__ = ["OUTSIDE", "REPO", "portable", "repo_path"]
