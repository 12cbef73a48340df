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


def test_the_checker_sees_a_module_in_no_layer(tmp_path: Path) -> None:
    """Every package is in the order: a package the layers do not name (builder/eval/ was one) is a problem."""
    for d in (tmp_path / "triton_backend" / "core", tmp_path / "builder" / "newpkg"):
        d.mkdir(parents=True)
        (d / "m.py").write_text("X = 1\n")
    assert _checker().problems(tmp_path) == ["module in no layer: builder.newpkg.m"]


def test_every_module_imports(monkeypatch) -> None:
    """Every module imports (a name moved between modules fails here, not in a Triton stub). The
    Triton models import ``triton_python_backend_utils``, which only Triton's stub provides: an
    empty module stands in for it, so the imports after it are checked too (nothing of it is
    used at import time; tests/test_triton_server.py runs the models in a real Triton)."""
    import importlib
    import sys
    import types

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    before = set(sys.modules)
    failed = {}
    for top in ("triton_backend", "builder"):
        for path in sorted((ROOT / top).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - any import error is the finding
                failed[name] = repr(exc)
    for name in set(sys.modules) - before:  # the Triton models hold the stand-in: not for later tests
        if name.startswith("triton_backend.serving.triton."):
            del sys.modules[name]
    assert failed == {}


def test_no_two_runtime_modules_share_a_name() -> None:
    """Every module under triton_backend/ has a name of its own (``__init__.py`` aside): a name
    says which module it is without its folder (docs and logs name modules by file)."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "triton_backend").rglob("*.py")):
        if path.name != "__init__.py" and "__pycache__" not in path.parts:
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
