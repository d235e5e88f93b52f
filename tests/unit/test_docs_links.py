"""Every relative link in README.md and docs/*.md resolves, and README.md stays a front page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300
# [text](target) and ![alt](target); the target ends at the first space or closing paren.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks (a `# comment` in a shell block is no
    heading, and a link-like string in code is no link)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to
    hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file; repeats get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    result = set()
    for line in prose_lines(path.read_text()):
        match = HEADING.match(line)
        if match:
            base = slug(match[2])
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
    return result


def relative_links(path: Path) -> list[str]:
    links = []
    for line in prose_lines(path.read_text()):
        line = re.sub(r"`[^`]*`", "", line)  # inline code holds no links
        links += [target for target in LINK.findall(line) if not re.match(r"[a-z]+:", target)]
    return links


def test_the_pages_have_links() -> None:
    """The link check below looks at something: the README points at every docs page."""
    readme_links = {link.split("#")[0] for link in relative_links(ROOT / "README.md")}
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme_links, f"README.md does not link docs/{page.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda path: path.name)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for link in relative_links(page):
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{link}: no heading with that anchor in {path.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_is_a_front_page() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail into docs/"
    )


def test_slugs_follow_github() -> None:
    assert slug("The cost of a token (run 2026-12-01)") == "the-cost-of-a-token-run-2026-12-01"
    assert slug("What `make up` runs") == "what-make-up-runs"
    assert (
        slug("What stands in the way of #15's targets") == "what-stands-in-the-way-of-15s-targets"
    )


def test_a_broken_link_is_seen(tmp_path: Path) -> None:
    """The link check can fail: a missing file and a missing heading are both caught."""
    (tmp_path / "a.md").write_text("# Title\n\n## Real heading\n\n```\n# not a heading\n```\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#real-heading) [gone](c.md) [bad](a.md#not-a-heading)\n")
    assert relative_links(page) == ["a.md#real-heading", "c.md", "a.md#not-a-heading"]
    assert anchors(tmp_path / "a.md") == {"title", "real-heading"}
