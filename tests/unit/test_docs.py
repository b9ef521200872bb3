"""The README and the user guide: every relative link resolves (to a file, and to a heading where it names
one), the README stays a front page, and no page rests on a machine path or a tool outside the repository.
That every option is documented is tests/unit/test_config_docs.py's."""
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = sorted(["README.md", "CONTRIBUTING.md", "CHANGELOG.md", "tests/README.md",
                *(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))),
                *(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.md")))])
#: Pages another change is rewriting as this test lands; they join the hygiene check once it has.
HYGIENE_LATER: set = set()
#: What a reader outside the machine it was written on cannot follow.
FOREIGN = re.compile(r"/work/|/root/|farm-bench|farm-studio|device tool")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _text(page: str) -> str:
    with open(os.path.join(ROOT, page)) as source:
        return source.read()


def _outside_code(text: str) -> str:
    """The text with fenced code blocks and inline code removed (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings."""
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S), flags=re.M):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(_outside_code(_text(page))):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else \
            os.path.join(ROOT, page)
        if not os.path.exists(resolved):
            broken.append(f"{target}: no such file")
        elif anchor and resolved.endswith(".md") and anchor not in _anchors(_text(os.path.relpath(resolved, ROOT))):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page}: " + "; ".join(broken)


@pytest.mark.parametrize("page", [p for p in PAGES if p not in HYGIENE_LATER])
def test_no_machine_paths_or_tools_from_outside_the_repository(page):
    found = [line.strip() for line in _text(page).splitlines() if FOREIGN.search(line)]
    assert not found, f"{page}: {found}"


def test_the_readme_is_a_front_page():
    text = _text("README.md")
    assert len(text.splitlines()) <= 250, "move reference material into docs/"
    assert "make test" in text and "make venv" in text, "the set-up and test commands CI and newcomers use"
    for page in glob.glob(os.path.join(ROOT, "docs", "*.md")):
        name = os.path.relpath(page, ROOT)
        assert f"({name})" in text, f"the README's map of the docs has no link to {name}"
