"""Every ```python and ```sh block of README.md and docs/*.md runs here, against a real
`model-router serve` of the default fleet on free loopback ports, or is marked as not run with
the reason, by an HTML comment on the line before it:

    <!-- not run: needs a CUDA GPU -->

A block runs in the repository's root, its addresses (127.0.0.1:8000 or localhost:8000 for
HTTP, 127.0.0.1:8001 for gRPC) turned into the test server's and `.venv/bin/` into this
environment's; an sh block under `bash -e -o pipefail`, a python block after the page's earlier
python blocks (a page's python blocks read as one session). It passes when it exits 0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, RouterProcess, serve

pytestmark = pytest.mark.e2e

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LANGUAGES = {"python": "python", "sh": "sh", "bash": "sh", "shell": "sh"}
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.DOTALL | re.MULTILINE)
NOT_RUN = re.compile(r"^<!-- not run: (.*?) -->$")
BLOCK_TIMEOUT_S = 180  # a hang bound: the slowest block loads the default fleet in its own process


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence
    language: str  # "python" or "sh"
    code: str
    not_run: str | None  # the reason, for a marked block

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def page_blocks(path: Path) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        language = LANGUAGES.get(match.group(1))
        if language is None:
            continue
        before = [line for line in text[: match.start()].splitlines() if line.strip()]
        marker = NOT_RUN.match(before[-1].strip()) if before else None
        found.append(Block(str(path.relative_to(REPO)), text[: match.start()].count("\n") + 1, language, match.group(2),
                           marker.group(1).strip() if marker else None))
    return found


BLOCKS = [block for page in PAGES for block in page_blocks(page)]
RUN = [block for block in BLOCKS if block.not_run is None]


def test_the_docs_have_blocks_to_run_and_every_mark_names_a_reason() -> None:
    assert len(RUN) >= 15, [block.id for block in RUN]
    assert all(block.not_run for block in BLOCKS if block.not_run is not None), "a `not run:` mark with no reason"


def test_every_not_run_mark_stands_before_a_block() -> None:
    """A mark left behind when its block moved would mark nothing (and the next block would run)."""
    marked = {(block.page, block.line) for block in BLOCKS if block.not_run is not None}
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, start=1):
            if NOT_RUN.match(line.strip()):
                following = next((n for n in range(number + 1, len(lines) + 1) if lines[n - 1].strip()), None)
                assert (str(page.relative_to(REPO)), following) in marked, \
                    f"{page.relative_to(REPO)}:{number}: a `not run:` mark with no python or sh block after it"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    """The default fleet (config/fleet.yaml, as `make serve` serves it), on free ports."""
    fleet = (REPO / "config" / "fleet.yaml").read_text(encoding="utf-8")
    fleet = re.sub(r"^model_store: \S+", f"model_store: {REPO / 'model_store'}", fleet, count=1, flags=re.MULTILINE)
    with serve(tmp_path_factory.mktemp("doc_snippets"), fleet, timeout=180) as process:
        yield process


def addressed(code: str, server: RouterProcess) -> str:
    http = server.url.removeprefix("http://")
    code = re.sub(r"\b(127\.0\.0\.1|localhost):8000\b", http, code)
    code = re.sub(r"\b127\.0\.0\.1:8001\b", server.grpc_address, code)
    return code.replace(".venv/bin/", f"{Path(sys.executable).parent}/")


def earlier_python(block: Block) -> list[Block]:
    return [b for b in RUN if b.page == block.page and b.language == "python" and b.line < block.line]


@pytest.mark.parametrize("block", RUN, ids=[block.id for block in RUN])
def test_the_block_runs(block: Block, server: RouterProcess) -> None:
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    if block.language == "sh":
        command = ["bash", "-e", "-o", "pipefail", "-c", addressed(block.code, server)]
    else:
        session = "\n".join(b.code for b in [*earlier_python(block), block])
        command = [sys.executable, "-c", addressed(session, server)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S, check=False)
    assert done.returncode == 0, (f"{block.id} ({block.language}) exited {done.returncode}:\n"
                                  f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
