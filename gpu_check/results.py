"""The results table of the GPU check: one row per check (pass, FAIL, warn, skipped, info) with its
figure or its reason. Parts write their rows as a markdown table; the pytest part as a JUnit report,
whose `figure` properties (pytest's `record_property`) become the detail."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["HEADER", "Row", "junit_rows", "parse_table", "part_table", "render", "summary"]

HEADER = ("| part | check | result | detail |", "| --- | --- | --- | --- |")
RESULTS = ("pass", "FAIL", "warn", "skipped", "info")
DETAIL_LIMIT = 300


@dataclass(frozen=True)
class Row:
    part: str
    check: str
    result: str  # one of RESULTS
    detail: str

    def line(self) -> str:
        detail = " ".join(self.detail.replace("|", "/").split())[:DETAIL_LIMIT]
        return f"| {self.part} | {self.check} | {self.result} | {detail} |"


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def parse_table(text: str, part: str) -> list[Row]:
    """The rows of a part's table (`| check | result | detail |`, header and rule skipped)."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("|") or set(line) <= set("|- "):
            continue
        cells = _cells(line)
        if len(cells) < 3 or cells[1] == "result":
            continue
        result = cells[1] if cells[1] in RESULTS else "FAIL"
        rows.append(Row(part, cells[0], result, " | ".join(cells[2:])))
    return rows


def junit_rows(xml_text: str, part: str) -> list[Row]:
    """One row per test case of a JUnit report; a case's `figure` properties are its detail."""
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as exc:
        return [Row(part, "junit report", "FAIL", f"unreadable: {exc}")]
    rows = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}".lstrip(":")
        figures = [p.get("value", "") for p in case.iter("property") if p.get("name") == "figure"]
        result, detail = "pass", "; ".join(figures) or f"{float(case.get('time', 0)):.1f} s"
        for tag, outcome in (("failure", "FAIL"), ("error", "FAIL"), ("skipped", "skipped")):
            found = case.find(tag)
            if found is not None:
                result, detail = outcome, (found.get("message") or found.text or tag).strip()
                break
        rows.append(Row(part, name, result, detail))
    return rows or [Row(part, "tests", "FAIL", "the report holds no test case")]


def render(rows: Iterable[Row]) -> str:
    """The results table: every part's rows."""
    return "\n".join([*HEADER, *(row.line() for row in rows)]) + "\n"


def part_table(rows: Iterable[tuple[str, str, str]]) -> str:
    """A part's own table, as parse_table reads it: check, result, detail."""
    lines = ["| check | result | detail |", "| --- | --- | --- |"]
    lines += [f"| {check} | {result} | {detail.replace('|', '/')} |" for check, result, detail in rows]
    return "\n".join(lines) + "\n"


def summary(rows: Sequence[Row]) -> str:
    """`N checks: a pass, b FAIL, ...`, in the order of RESULTS."""
    counts = {result: sum(row.result == result for row in rows) for result in RESULTS}
    return f"{len(rows)} checks: " + ", ".join(f"{n} {result}" for result, n in counts.items() if n)
