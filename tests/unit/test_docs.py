"""The documentation stays navigable and true: links resolve, the README's code-layout list
names every package, the configuration reference is the generator's output, pages keep their
size, and no page points at the issue tracker (which is not in the repository).

Plain file reads; no torch, no processes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megazero.config.reference import reference
from tests.support.paths import REPO

ROOT = REPO
README = ROOT / "README.md"
PAGES = [README] + sorted((ROOT / "docs").glob("*.md"))
LAYOUT_HEADING = "## Where things are"

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`([^`\n]+)`")


def prose(path: Path) -> str:
    """The page without its fenced code blocks (a link inside a code block is not a link)."""
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", prose(path), re.M)}


def section(text: str, heading: str) -> str:
    """The lines under ``heading`` up to the next heading of the same or a higher level."""
    level = heading.split()[0]
    start = text.index(heading + "\n")
    rest = text[start + len(heading) + 1 :]
    end = re.search(rf"^#{{1,{len(level)}}}\s", rest, re.M)
    return rest[: end.start()] if end else rest


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def layout_paths() -> set[str]:
    """The paths the README's code-layout section names (code spans with a '/' or a suffix)."""
    text = section(README.read_text(encoding="utf-8"), LAYOUT_HEADING)
    return {
        span.strip()
        for span in CODE_SPAN.findall(text)
        if "/" in span or re.search(r"\.(py|sh|toml|md)$", span.strip())
    }


def packages() -> set[str]:
    """Every top-level package and every package below megazero/, as 'path/'."""
    top = {
        f"{d.name}/"
        for d in ROOT.iterdir()
        if d.is_dir() and not d.name.startswith(".") and (d / "__init__.py").exists()
    }
    below = {
        f"{d.relative_to(ROOT).as_posix()}/"
        for d in (ROOT / "megazero").rglob("*")
        if d.is_dir() and (d / "__init__.py").exists()
    }
    return top | below


def test_code_layout_names_every_package_and_only_real_paths():
    named = layout_paths()
    missing_on_disk = sorted(p for p in named if not (ROOT / p.rstrip("/")).exists())
    assert not missing_on_disk, f"README '{LAYOUT_HEADING}' names paths that do not exist: {missing_on_disk}"
    unnamed = sorted(packages() - {p if p.endswith("/") else p + "/" for p in named})
    assert not unnamed, f"packages missing from README '{LAYOUT_HEADING}' (add a line each): {unnamed}"


def test_configuration_reference_is_generated():
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert page == reference(), (
        "docs/configuration.md is stale: python -m megazero.config.reference > docs/configuration.md"
    )


@pytest.mark.parametrize("name, limit", [("README.md", 300), ("docs/design.md", 350)])
def test_page_length(name, limit):
    lines = (ROOT / name).read_text(encoding="utf-8").count("\n")
    assert lines <= limit, f"{name} has {lines} lines; keep it at most {limit} (move detail to a docs/ page)"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_issue_tracker_references(page):
    hits = [m.group(0) for m in re.finditer(r"\bissues?\s*#?\d+", page.read_text(encoding="utf-8"), re.I)]
    assert not hits, f"{page.relative_to(ROOT)} cites the tracker ({hits}); say what the thing is instead"


def test_no_issue_tracker_references_in_code():
    """Docstrings and comments say what a thing is, not which tracker item asked for it."""
    files = [f for pkg in ("megazero", "model", "data", "scripts", "tests") for f in (ROOT / pkg).rglob("*.py")]
    hits = [
        f"{f.relative_to(ROOT)}:{n}"
        for f in files + [ROOT / "train.py"]
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"\bissues?\s*#?\d+", line, re.I) and f.name != "test_docs.py"
    ]
    assert hits == []
