"""Every link in the docs resolves, and every citation of a doc section names one that exists.

Links: each relative link or image in README.md, docs/**/*.md, examples/README.md and
slurm/README.md must name a file or directory of the repository, and its #anchor (or a bare
#anchor) a heading of the target page, slugged as GitHub slugs headings. Web links are not
followed (no network). Citations: anywhere in the code, recipes, scripts or docs, a
`docs/<page>.md` must exist, and `docs/<page>.md#anchor`, `docs/<page>.md, section N` and
`docs/<page>.md, "Heading"` must name a heading of that page (a citation is checked wherever
it stands, code spans included). A link inside a fenced block or inline code is text, not a
link, and is not checked.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC_GLOBS = ["README.md", "docs/**/*.md", "examples/README.md", "slurm/README.md"]
CITING_DIRS = ["megatron_fr", "tests", "tools", "examples", "slurm", "docs", ".ci"]
CITING_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ""}

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.DOTALL)
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", re.MULTILINE)
HTML_ANCHOR = re.compile(r"<a\s[^>]*?(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:[ \t]*<?(\S+?)>?(?:[ \t]+\"[^\"]*\")?[ \t]*$", re.M)
PAGE = r"docs/[\w./-]+?\.md"
CITATIONS = [
    re.compile(rf"(?P<page>{PAGE})#(?P<anchor>[\w-]+)"),
    re.compile(rf"(?P<page>{PAGE}),\s+section\s+(?P<number>\d+(?:\.\d+)*)"),
    re.compile(rf"(?P<page>{PAGE}),\s+(?:section\s+)?\"(?P<title>[^\"\n]+)\""),
]
BARE_PAGE = re.compile(rf"(?<![\w/.-])(?P<page>{PAGE})(?![\w/-])")


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: the rendered text lower-cased, every character that
    is not a letter, digit, mark, space, '-' or '_' dropped, each space made a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    kept = (c for c in text if c in " -_" or unicodedata.category(c)[0] in "LMN")
    return "".join(kept).replace(" ", "-")


def strip_code(markdown: str) -> str:
    """The text with fenced blocks and inline code blanked (line structure kept)."""
    return CODE_SPAN.sub(_blank, FENCE.sub(_blank, markdown))


def _blank(match: re.Match[str]) -> str:
    return re.sub(r"[^\n]", " ", match.group(0))


def headings(markdown: str) -> list[str]:
    """The page's headings in order (outside code blocks), as written."""
    return HEADING.findall(FENCE.sub("", markdown))


def anchors(markdown: str) -> set[str]:
    """Every anchor a page has: its headings' slugs (a repeated slug gets -1, -2, ... as on
    GitHub) and explicit <a name/id> anchors."""
    seen: Counter[str] = Counter()
    result = set(HTML_ANCHOR.findall(markdown))
    for heading in headings(markdown):
        slug = github_slug(heading)
        result.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return result


def link_targets(markdown: str) -> list[str]:
    """The targets of inline links, images and reference definitions, outside code."""
    text = strip_code(markdown)
    return INLINE_LINK.findall(text) + REFERENCE_DEF.findall(text)


def broken_links(page: Path, root: Path) -> list[str]:
    """'page: target (why)' for each relative link of the page that does not resolve."""
    problems, name = [], page.relative_to(root)
    for target in link_targets(page.read_text()):
        if not target or re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # a web or mail address: not followed
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            problems.append(f"{name}: {target} (no such file)")
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved.read_text())):
            problems.append(f"{name}: {target} (no heading with anchor #{anchor})")
    return problems


def section_matches(title: str, heading: str) -> bool:
    """A cited title names a heading that starts with it, its section number aside."""
    bare = re.sub(r"^\d+(?:\.\d+)*\.?\s+", "", heading)
    return any(h.lower().startswith(title.lower()) for h in (heading, bare))


def broken_citations(source: Path, root: Path) -> list[str]:
    """'source: citation (why)' for each docs/<page>.md reference in the file that does not
    resolve against the pages under root."""
    text, problems, name = source.read_text(errors="replace"), [], source.relative_to(root)
    for match in BARE_PAGE.finditer(text):
        if not (root / match["page"]).is_file():
            problems.append(f"{name}: {match['page']} (no such page)")
    for pattern in CITATIONS:
        for match in pattern.finditer(text):
            page = root / match["page"]
            if not page.is_file():
                continue  # reported above
            found = citation_resolves(match.groupdict(), page.read_text())
            if not found:
                problems.append(f"{name}: {match[0]!r} (no such section)")
    return problems


def citation_resolves(parts: dict[str, str | None], markdown: str) -> bool:
    if parts.get("anchor"):
        return parts["anchor"] in anchors(markdown)
    if parts.get("number"):
        return any(re.match(rf"{re.escape(parts['number'])}\.?\s", h) for h in headings(markdown))
    return any(section_matches(parts["title"] or "", h) for h in headings(markdown))


def doc_pages(root: Path) -> list[Path]:
    return sorted({path for pattern in DOC_GLOBS for path in root.glob(pattern)})


def citing_files(root: Path) -> list[Path]:
    """The repository's text sources that may cite a doc page (README.md included)."""
    files = [root / "README.md"]
    for directory in CITING_DIRS:
        found = (root / directory).rglob("*")
        files += [p for p in found if p.is_file() and p.suffix in CITING_SUFFIXES]
    return [p for p in files if p.resolve() != Path(__file__).resolve()]


def test_every_doc_link_resolves():
    pages = doc_pages(REPO)
    assert REPO / "README.md" in pages and len(pages) >= 4, pages
    problems = [problem for page in pages for problem in broken_links(page, REPO)]
    assert not problems, "broken doc links:\n" + "\n".join(problems)


def test_every_citation_of_a_doc_section_resolves():
    problems = [p for source in citing_files(REPO) for p in broken_citations(source, REPO)]
    assert not problems, "citations of missing doc pages or sections:\n" + "\n".join(problems)


def test_github_slugs():
    """Anchors as GitHub makes them (the rule github-slugger reproduces): punctuation and
    symbols dropped, not collapsed, so '&' between spaces leaves '--'; repeats get -1, -2."""
    assert github_slug("5. Under parallelism: why the layout does not change the result") == (
        "5-under-parallelism-why-the-layout-does-not-change-the-result"
    )
    assert github_slug("`megatron_fr/config/` and [links](x.md)") == "megatron_frconfig-and-links"
    assert github_slug("Weight sync & conversion") == "weight-sync--conversion"
    assert github_slug("Lag 8, no gate (δ = ∞)") == "lag-8-no-gate-δ--"
    page = "# Tests\n## Tests\n```\n# not a heading\n```\n## Tests\n"
    assert anchors(page) == {"tests", "tests-1", "tests-2"}


def test_a_broken_link_or_anchor_is_reported(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n## Weight sync & conversion\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "[ok](docs/page.md) [ok anchor](docs/page.md#weight-sync--conversion) [self](#top)\n"
        "[gone](docs/missing.md) ![gone image](docs/fig.png)\n"
        "[bad anchor](docs/page.md#weight-sync)\n"
        "[web](https://example.com/x.md) `[in code](nowhere.md)`\n"
        "```\n[in a fence](nowhere.md)\n```\n"
        "[ref]: docs/also_missing.md\n\n# Top\n"
    )
    assert broken_links(readme, tmp_path) == [
        "README.md: docs/missing.md (no such file)",
        "README.md: docs/fig.png (no such file)",
        "README.md: docs/page.md#weight-sync (no heading with anchor #weight-sync)",
        "README.md: docs/also_missing.md (no such file)",
    ]


def test_a_citation_of_a_missing_section_is_reported(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "algo.md").write_text("# Algo\n\n## 5. Under parallelism: why\n")
    source = tmp_path / "code.py"
    source.write_text(
        '"""See docs/algo.md, "Under parallelism", docs/algo.md, section 5 and\n'
        "docs/algo.md#5-under-parallelism-why; but not docs/algo.md, section 6,\n"
        'docs/algo.md, "Over parallelism", docs/algo.md#under or docs/gone.md."""\n'
    )
    assert broken_citations(source, tmp_path) == [
        "code.py: docs/gone.md (no such page)",
        "code.py: 'docs/algo.md#under' (no such section)",
        "code.py: 'docs/algo.md, section 6' (no such section)",
        "code.py: 'docs/algo.md, \"Over parallelism\"' (no such section)",
    ]
