"""The documentation holds together: docs/CONFIG.md is what the schema renders today, every relative link of the README
and of docs/*.md reaches a file (and a heading, where it names one), and the README begins with its two commands."""

import re
from pathlib import Path

from islands import config_reference

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_configuration_reference_is_what_the_schema_renders():
    written = config_reference.DOC.read_text() if config_reference.DOC.exists() else ""
    assert written == config_reference.render(), (
        "docs/CONFIG.md is stale against islands/config.py: run `python -m islands.config_reference` and commit it")


def _prose(text: str) -> str:
    """The page without its fenced code blocks, where a `](` is code, not a link."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen, found = {}, set()
    for line in _prose(page.read_text()).splitlines():
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(page.read_text())) if not re.match(r"[a-z]+:", t)]


def test_every_relative_link_reaches_a_file_and_its_heading():
    broken = []
    for page in PAGES:
        for target in links(page):
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
    assert sum(len(links(p)) for p in PAGES) > 20  # the links were found at all


def test_the_readme_starts_with_its_two_commands():
    block = re.search(r"```\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1).splitlines()
    assert [line.split()[:2] for line in block[:2]] == [["make", "demo"], ["make", "test"]]
