"""scripts/ holds what set-up, CI and users run; scripts/analysis/ the one-off analysis tools.
Every script compiles and every script path the docs, tests, CI and images name exists."""

from __future__ import annotations

import py_compile
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_BY_SETUP_CI_OR_USERS = {"setup.sh", "get_perf_analyzer.sh", "genai_perf.sh", "check_layers.py", "load_test.py",
                            "abrupt_clients.py", "reliability.py", "prefix_cache_bench.py",
                            "cpu_peer_bench.py", "cpu_peer_row.py", "agent_bench.py"}


def test_scripts_top_level_is_setup_and_ci_only() -> None:
    top = {p.name for p in (ROOT / "scripts").iterdir() if p.is_file()}
    assert top == RUN_BY_SETUP_CI_OR_USERS, "a one-off analysis tool belongs in scripts/analysis/"


def test_every_script_compiles(tmp_path: Path) -> None:
    scripts = sorted((ROOT / "scripts").rglob("*.py"))
    assert len(scripts) >= len([n for n in RUN_BY_SETUP_CI_OR_USERS if n.endswith(".py")]) + 1
    for i, path in enumerate(scripts):
        py_compile.compile(str(path), cfile=str(tmp_path / f"{i}.pyc"), doraise=True)


def test_every_named_script_exists() -> None:
    texts = [ROOT / "README.md", ROOT / ".ci" / "run", *(ROOT / "docs").glob("*.md"), *(ROOT / "tests").glob("*.py"),
             *(ROOT / "docker").rglob("*"), *(ROOT / "scripts").rglob("*"), *(ROOT / "builder").rglob("*.py"),
             *(ROOT / "triton_backend").rglob("*.py"), ROOT / "pyproject.toml"]
    named = {(p, m) for p in texts if p.is_file() and p.suffix not in (".pyc", ".whl", ".gguf")
             for m in re.findall(r"scripts/[\w/.-]+\.(?:py|sh)", p.read_text(errors="ignore"))}
    assert named
    missing = sorted(f"{p.relative_to(ROOT)}: {m}" for p, m in named if not (ROOT / m).is_file())
    assert not missing, missing
