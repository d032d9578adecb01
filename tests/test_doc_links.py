"""Every link between the project's Markdown pages leads somewhere: the file exists and, for a
``#section`` link into a Markdown page, that page has a heading with that anchor (as GitHub
makes anchors from headings). A section moved or renamed without its links fails here."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Folders that hold no page of ours (environments, run outputs, version control).
SKIPPED = {".git", ".venv", ".venv-dev", "venv", "runs", "outputs", "node_modules"}
#: ``[text](target)`` and ``![alt](target)``; the target up to its first space or ``)``.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)[^)]*\)")
HEADING = re.compile(r"#{1,6}\s+(.*?)\s*#*\s*$")


def markdown_pages(root: Path) -> list[Path]:
    """The ``.md`` files under ``root``, outside :data:`SKIPPED` and hidden folders (which are
    not walked)."""
    pages: list[Path] = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in SKIPPED and not d.startswith(".")]
        pages.extend(Path(folder) / name for name in files if name.endswith(".md"))
    return sorted(pages)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of ``text`` outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of ``text``: lower case, characters other than
    letters, digits, ``_``, ``-`` and spaces dropped, spaces as ``-``; a repeated one gets
    ``-1``, ``-2``, ..."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(text):
        match = HEADING.match(line)
        if match is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(root: Path) -> list[str]:
    """``"page:line: target (why)"`` for every relative link of :func:`markdown_pages` whose file
    does not exist, or whose ``#anchor`` is not a heading of the Markdown page it names."""
    broken = []
    headings: dict[Path, set[str]] = {}  # each linked page's anchors, read once
    for page in markdown_pages(root):
        for number, line in prose_lines(page.read_text(encoding="utf-8")):
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                    continue
                path, _, anchor = target.partition("#")
                linked = (page.parent / path) if path else page
                where = f"{page.relative_to(root)}:{number}: {target}"
                if not linked.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and linked.suffix == ".md":
                    known = linked.resolve()
                    if known not in headings:
                        headings[known] = anchors(known.read_text(encoding="utf-8"))
                    if anchor not in headings[known]:
                        broken.append(f"{where} (no heading with that anchor)")
    return broken


def test_every_link_between_the_pages_leads_to_a_file_and_a_heading() -> None:
    assert markdown_pages(ROOT), "no Markdown page found"
    assert broken_links(ROOT) == []


def test_a_missing_file_or_heading_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text(
        "# Guide\n\n## Speed and memory\n\n## Speed and memory\n\nSee [the top](#guide).\n"
    )
    (tmp_path / "README.md").write_text(
        "# Project\n\n"
        "[ok](docs/guide.md#speed-and-memory) [second](docs/guide.md#speed-and-memory-1)\n"
        "[site](https://example.com/x#y) ![picture](docs/guide.md)\n"
        "[gone](docs/missing.md) [renamed](docs/guide.md#speed)\n\n"
        "```\n[in code](nowhere.md)\n```\n"
    )
    (tmp_path / ".venv" / "lib").mkdir(parents=True)
    (tmp_path / ".venv" / "lib" / "x.md").write_text("[vendored](nowhere.md)\n")

    assert broken_links(tmp_path) == [
        "README.md:5: docs/missing.md (no such file)",
        "README.md:5: docs/guide.md#speed (no heading with that anchor)",
    ]
