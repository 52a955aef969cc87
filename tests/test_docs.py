"""The README stays a five-minute read, and the docs' relative links lead to files that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 130
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def relative_links(text: str) -> list[str]:
    """Targets of markdown links that point into the repository (no URL scheme, not an anchor)."""
    return [
        t
        for t in LINK.findall(text)
        if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.I) and not t.startswith("#")
    ]


def test_relative_links_are_found():
    text = "[a](docs/x.md) [b](https://e.org) [c](#top) [d](../y/z.md#part) [e](mailto:q@e.org)"
    assert relative_links(text) == ["docs/x.md", "../y/z.md#part"]


def test_readme_is_short():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail into docs/"
    )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_to_existing_files(doc: Path):
    missing = [
        target
        for target in relative_links(doc.read_text())
        if not (doc.parent / target.split("#", 1)[0]).exists()
    ]
    assert not missing, f"{doc.relative_to(REPO)} links to missing files: {missing}"
