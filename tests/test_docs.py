"""The front door stays short and its links lead somewhere: the README at most 300 lines, every
docs page linked from it, and every relative link in the README and docs/ naming a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = sorted((REPO / "docs").glob("*.md"))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(page: Path) -> list[str]:
    """The link targets in `page` that are paths in this repository (no scheme, no bare anchor)."""
    return [target.split("#", 1)[0] for target in LINK.findall(page.read_text(encoding="utf-8"))
            if not re.match(r"[a-z]+:", target) and not target.startswith("#")]


def test_the_readme_is_at_most_300_lines() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= 300, f"README.md has {lines} lines; move detail to docs/"


def test_the_readme_links_every_docs_page() -> None:
    linked = {Path(target).name for target in relative_links(README) if target.startswith("docs/")}
    assert [page.name for page in PAGES if page.name not in linked] == []


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.name)
def test_every_relative_link_names_a_file_that_exists(page: Path) -> None:
    missing = [target for target in relative_links(page) if not (page.parent / target).exists()]
    assert missing == [], f"{page.relative_to(REPO)} links to files that are not there: {missing}"
