"""The front door stays short and its links lead somewhere: the README at most 300 lines, every
docs page linked from it, and every relative link in the README and docs/ naming a file that exists.
What users read speaks to them: no word of a test machine, its tools, internal issue numbers or bare
commit hashes in the README, docs/, config/, the Makefile, pyproject.toml, scripts/, gpu_check/ or router/."""

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


# Words of a machine the project was tested on and its tools, internal issue numbers and bare commit
# hashes: none means anything to a user.
NOT_FOR_USERS = {
    "a device tool": re.compile(r"device tool", re.IGNORECASE),
    "a lent or borrowed machine": re.compile(r"\b(lent|borrowed)\b", re.IGNORECASE),
    "give_back": re.compile(r"\bgive_back\b"),
    "a local wheel store": re.compile(r"local wheel store", re.IGNORECASE),
    "STYLE.md (not in the repository)": re.compile(r"STYLE\.md"),
    "an internal issue number": re.compile(r"\bissues? #?\d+|(?<![\w&/])#\d{2,}\b|\bround \d+\b", re.IGNORECASE),
    "a bare commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}\b"),
}
FOR_USERS = [README, REPO / "CHANGELOG.md", REPO / "Makefile", REPO / "pyproject.toml",
             *sorted(path for folder in ("docs", "config", "scripts", "gpu_check", "router")
                     for path in (REPO / folder).rglob("*")
                     if path.is_file() and path.suffix in {".md", ".yaml", ".yml", ".py", ".sh", ".txt", ".toml"}
                     and "_pb2" not in path.name)]


def prose(path: Path) -> list[tuple[int, str]]:
    """The lines of `path` a reader reads as text: in Markdown, those outside code blocks (where
    request ids and trace ids are hex by nature)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix != ".md":
        return list(enumerate(lines, 1))
    kept, fenced = [], False
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            kept.append((number, line))
    return kept


def test_no_word_of_a_test_machine_an_issue_number_or_a_commit_hash_reaches_users() -> None:
    found = [f"{path.relative_to(REPO)}:{number}: {what}: {match.group(0)!r}"
             for path in FOR_USERS for number, line in prose(path)
             for what, pattern in NOT_FOR_USERS.items() if (match := pattern.search(line))]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize(("line", "what"), [
    ("through the device tool's run", "a device tool"),
    ("a lent GPU machine", "a lent or borrowed machine"),
    ("then give_back", "give_back"),
    ("the engine process (issue 21)", "an internal issue number"),
    ("as #24 asked", "an internal issue number"),
    ("the router of `d9dac20`", "a bare commit hash"),
    ("(STYLE.md)", "STYLE.md (not in the repository)"),
])
def test_the_words_check_finds_each_kind(line: str, what: str) -> None:
    assert NOT_FOR_USERS[what].search(line)


@pytest.mark.parametrize("line", ["give_back_memory(device)", "request_id=9f2c41d7a7ed05d9de9d4ae58751737741d2c5cc",
                                  "1,686 s", "carry out what it returns", "a batch of 32", "&#10003;"])
def test_the_words_check_leaves_ordinary_text(line: str) -> None:
    assert not [what for what, pattern in NOT_FOR_USERS.items() if pattern.search(line)]
