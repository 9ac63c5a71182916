"""Every relative link and image in README.md, BENCHMARKS.md and docs/**/*.md points at a file of the repository
(and, for a link into a Markdown file with ``#anchor``, at one of its headings), so moving a section or a figure
cannot leave a dead link behind."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target) and ![alt](target)
IMG = re.compile(r"<img\s[^>]*src=\"([^\"]+)\"")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # https:, mailto:, ...


def unfenced(text: str) -> str:
    """``text`` without its fenced code blocks."""
    return re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.MULTILINE | re.DOTALL)


def prose(text: str) -> str:
    """``text`` without code blocks and inline code spans (a link there is an example, not a link)."""
    return re.sub(r"`[^`\n]*`", "", unfenced(text))


def anchors(page: Path) -> set[str]:
    """The ids GitHub gives ``page``'s headings: lower case, punctuation other than - and _ dropped, spaces as -."""
    ids = set()
    for line in unfenced(page.read_text()).splitlines():  # a heading's code span keeps its text in the id
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            ids.add(re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-"))
    return ids


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(page: Path) -> list[str]:
    text = prose(page.read_text())
    broken = []
    for target in [*LINK.findall(text), *IMG.findall(text)]:
        if EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file: {shown(dest)})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {shown(dest)})")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_and_images_resolve(page):
    assert not broken_links(page), f"{page.relative_to(ROOT)} links to what is not there: {broken_links(page)}"


def test_the_checker_sees_a_broken_link_an_image_and_an_anchor(tmp_path):
    (tmp_path / "there.md").write_text("# A heading, with (punctuation) `x=y`\n")
    (tmp_path / "fig.png").write_bytes(b"")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) ![ok](fig.png) [ok](there.md#a-heading-with-punctuation-xy) [web](https://x.org/y)\n"
                    "`[code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n"
                    "[gone](gone.md) ![gone](gone.png) [bad anchor](there.md#nope) <img src=\"missing.png\">\n")
    found = broken_links(page)
    assert [f.split(" ")[0] for f in found] == ["gone.md", "gone.png", "there.md#nope", "missing.png"]
