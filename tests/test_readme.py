"""The newcomer's page: README.md is one page with the two commands, its figure tables (and
docs/benchmarks.md's) are exactly what the benchmark result files render to, and every link
of README.md and docs/ resolves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from builder.bench.docs_render import (DOC_FILES, HEADLINE_ROWS, HeadlineRow, blocks_in, render_docs, render_headline,
                                       render_text)
from triton_backend.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
DEMO = "bash scripts/setup.sh && .venv/bin/specbuild demo"
TESTS = "bash scripts/setup.sh && .venv/bin/python -m pytest"
# pages other branches of this session add; remove a name here once its page is merged
PENDING_PAGES: set[str] = set()


def test_every_rendered_table_matches_its_result_file() -> None:
    stale = render_docs(ROOT, check=True)
    assert stale == [], f"stale figure tables in {stale}: run `specbuild bench render-readme`"
    assert "headline" in blocks_in(README.read_text())
    assert set(blocks_in((ROOT / "docs" / "benchmarks.md").read_text())) == {"headline", "methods", "pass-cost",
                                                                            "concurrency"}


def test_a_changed_figure_makes_the_readme_stale(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    for name in ("headline.json", "bench-cpu.json", "pass-cost-cpu.json", "concurrency-cpu.json"):
        (results / name).write_text((RESULTS / name).read_text())
    text = README.read_text()
    assert render_text(text, results) == text
    figures = json.loads((results / "headline.json").read_text())
    figures["best_copy_x_plain"] = round(figures["best_copy_x_plain"] + 0.31, 4)
    (results / "headline.json").write_text(json.dumps(figures))
    assert render_text(text, results) != text
    del figures["eagle_chat_x_plain"]  # a key the README cites must stay in the file
    (results / "headline.json").write_text(json.dumps(figures))
    with pytest.raises(ConfigError, match="eagle_chat_x_plain"):
        render_text(text, results)
    with pytest.raises(ConfigError, match="unknown rendered block"):
        render_text("<!-- BEGIN rendered:nope x -->\n<!-- END rendered:nope -->\n", results)


def test_a_pending_row_renders_not_measured_until_its_key_is_written() -> None:
    rows = (HeadlineRow("a", "measured", 1.0), HeadlineRow("b", "bench not run yet", 1.5, pending=True))
    assert "| bench not run yet (`b`) | not measured yet | >= 1.50 | - |" in render_headline({"a": 2.0}, rows)
    assert "| bench not run yet (`b`) | 1.60 | >= 1.50 | yes |" in render_headline({"a": 2.0, "b": 1.6}, rows)
    with pytest.raises(ConfigError, match=r"\['a'\]"):  # a row that is not pending must be in the file
        render_headline({"b": 1.6}, rows)


def test_readme_cites_every_headline_key_and_the_file_holds_them() -> None:
    text = README.read_text()
    figures = json.loads((RESULTS / "headline.json").read_text())
    for row in HEADLINE_ROWS:
        for key in row.keys:
            assert f"`{key}`" in text and (key in figures or row.pending)
    # a figure a benchmark writes gets a row (label and goal in builder/bench/docs_render.py)
    keys = {key for row in HEADLINE_ROWS for key in row.keys}
    assert set(figures) <= keys, set(figures) - keys


def test_readme_is_one_page_with_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 80
    assert f"```bash\n{DEMO}\n```" in text and f"```bash\n{TESTS}\n```" in text
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == TESTS  # CI runs the README's test command, exactly


def _links(path: Path) -> list[str]:
    return [m for m in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()) if "://" not in m]


def test_every_relative_link_resolves() -> None:
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    assert {ROOT / name for name in DOC_FILES} <= set(pages)
    for page in pages:
        for link in _links(page):
            target = (page.parent / link).resolve()
            rel = target.relative_to(ROOT).as_posix()
            assert target.exists() or rel in PENDING_PAGES, f"{page.relative_to(ROOT)} links to missing {link}"
    assert "docs/index.md" in _links(README)
    in_index = {"docs/" + link for link in _links(ROOT / "docs" / "index.md")}
    on_disk = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")} - {"docs/index.md"}
    assert on_disk | PENDING_PAGES <= in_index, f"pages missing from docs/index.md: {on_disk | PENDING_PAGES - in_index}"


def test_render_command_checks_and_refuses_a_missing_results_folder(tmp_path: Path, capsys) -> None:
    from builder.cli.main import main as cli_main

    assert cli_main(["bench", "render-readme", "--check"]) == 0
    assert cli_main(["bench", "render-readme", "--check", "--out", str(tmp_path / "none")]) == 2
    assert "no headline file" in capsys.readouterr().err


def test_docs_index_commands_table_lists_every_command_once_with_one_page() -> None:
    """docs/index.md's commands table: every row is `command(s) | page`, its page link resolves,
    and together the rows name each `specbuild` sub-command (``k8s`` by its own sub-commands) once."""
    from builder.cli.main import build_parser

    text = (ROOT / "docs" / "index.md").read_text()
    table = text.split("## Commands", 1)[1].split("\n\n")[1].splitlines()
    assert table[:2] == ["| command | page |", "|---|---|"]
    named: list[str] = []
    for row in table[2:]:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        assert len(cells) == 2 and row.startswith("| `specbuild ") and row.endswith("|"), row
        page = re.match(r"\[([\w.-]+\.md)\]\(([\w.-]+\.md)\)", cells[1])
        assert page and page.group(1) == page.group(2) and (ROOT / "docs" / page.group(2)).exists(), row
        named += [c.split()[0] for c in re.findall(r"`(?:specbuild )?([^`]+)`", cells[0])]
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert sorted(named) == sorted([*commands, "k8s"]), sorted(set(named) ^ set(commands))
