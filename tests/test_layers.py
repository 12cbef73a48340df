"""The package layering holds: no module imports a later layer, no import cycle (scripts/check_layers.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _checker():
    spec = importlib.util.spec_from_file_location("check_layers", ROOT / "scripts" / "check_layers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_upward_import_and_no_cycle() -> None:
    assert _checker().problems(ROOT) == []


def test_the_checker_sees_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    core, serving = tmp_path / "triton_backend" / "core", tmp_path / "triton_backend" / "serving"
    for d in (core, serving, tmp_path / "builder"):
        d.mkdir(parents=True)
    (core / "a.py").write_text("from triton_backend.serving.b import x\n")
    (serving / "b.py").write_text("def f():\n    from triton_backend.core import a\n")
    found = _checker().problems(tmp_path)
    assert any(line.startswith("upward import: triton_backend.core.a -> triton_backend.serving.b") for line in found)
    assert any(line.startswith("import cycle:") for line in found)
