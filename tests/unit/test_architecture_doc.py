"""docs/architecture.md names every module under ds_odc/, each under its package, and nothing that is gone: a module
added, moved or removed without its line fails here. The tree is the page's first code block: a line that starts at
the margin with ``ds_odc/...`` names modules of the package ``ds_odc/`` (or opens the package it ends with: ``/``),
an indented line names modules of the package opened last, and a line whose first column is empty continues a
description."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"


def named_in_the_tree(text: str) -> list:
    block = text.split("```")[1]
    named, package = [], None
    for line in block.splitlines():
        first = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0] if line.strip() else ""
        if not first or (line.startswith(" ") and package is None):
            continue
        if not line.startswith(" "):  # at the margin: a package heading, or modules of ds_odc/ itself
            if not first.startswith("ds_odc/"):
                package = None  # ops/ and the like: not Python modules of the package
                continue
            if first.endswith("/"):
                package = first
                continue
            package = None
            head, *rest = [name.strip() for name in first.split(",")]
            named += [head] + [f"ds_odc/{name}" for name in rest]
            continue
        if line.startswith(" " * 4):
            continue  # a description's continuation
        named += [package + name.strip() for name in first.split(",")]
    return named


def test_the_architecture_page_names_every_module_once_under_its_package():
    named = named_in_the_tree(PAGE.read_text())
    actual = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "ds_odc").rglob("*.py"))
    duplicates = sorted({name for name in named if named.count(name) > 1})
    assert not duplicates, f"named twice in docs/architecture.md: {duplicates}"
    assert sorted(set(actual) - set(named)) == [], "modules docs/architecture.md does not name (add a line each)"
    assert sorted(set(named) - set(actual)) == [], "docs/architecture.md names modules that do not exist"


def test_the_reader_of_the_tree_sees_headings_modules_and_continuations():
    text = "intro\n```\nds_odc/a.py, b.py    x\nds_odc/pkg/          y\n  c.py, d.py         z\n" \
           "                     more of z\nops/                 w\n```\n"
    assert named_in_the_tree(text) == ["ds_odc/a.py", "ds_odc/b.py", "ds_odc/pkg/c.py", "ds_odc/pkg/d.py"]
