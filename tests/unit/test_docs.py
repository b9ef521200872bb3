"""The README and the user guide: every relative link resolves (to a file, and to a heading where it names
one), the README stays a front page, and no page rests on a machine path or a tool outside the repository:
no absolute path but the system's own (``/dev/shm``, ``/proc``, ...), and every script a command runs
(``python X.py``, ``bash X.sh``) is the repository's. The rule is general: this file names no outside path or tool
either. That every option is documented is tests/unit/test_config_docs.py's."""
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
#: An absolute path, by its first component (a URL's path and ``~/``, ``$VAR/`` paths are not absolute here).
ABSOLUTE = re.compile(r"(?<![\w.~$}/:-])/([A-Za-z0-9_.-]+)/")
#: The system's own directories, the same on every reader's machine.
SYSTEM = {"dev", "proc", "sys", "usr", "etc", "tmp", "bin", "lib", "var", "opt"}
#: A script a command runs: what a reader must find in the repository.
RUN = re.compile(r"(?:python3?|bash|sh)(?:\s+-[\w-]+)*\s+([\w./-]+\.(?:py|sh))\b")
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


def foreign(text: str) -> list[str]:
    """What ``text`` names that a reader outside the machine it was written on cannot follow: absolute paths
    outside the system's directories, and scripts run by a command that the repository does not hold."""
    found = [f"/{m.group(1)}/..." for m in ABSOLUTE.finditer(text) if m.group(1) not in SYSTEM]
    found += [f"runs {m.group(1)}" for m in RUN.finditer(text) if not os.path.exists(os.path.join(ROOT, m.group(1)))]
    return found


@pytest.mark.parametrize("page", [p for p in PAGES if p not in HYGIENE_LATER])
def test_no_machine_paths_or_tools_from_outside_the_repository(page):
    assert not foreign(_text(page)), f"{page}: {foreign(_text(page))}"


def test_the_rule_sees_a_machine_path_and_an_outside_tool_and_lets_the_systems_and_the_repositorys_pass():
    assert foreign("results under /scratch/me/run1 and /home/x/y") == ["/scratch/...", "/home/..."]
    assert foreign("    python tools/measure_it.py --n 3") == ["runs tools/measure_it.py"]
    assert foreign("/dev/shm, /proc/self/status, https://pypi.org/pypi/x, ~/.cache/ds_odc, $OUT/results, "
                   "python benchmarks/paired.py -n 3, bash scripts/bootstrap.sh") == []


def test_the_readme_is_a_front_page():
    text = _text("README.md")
    assert len(text.splitlines()) <= 250, "move reference material into docs/"
    assert "make test" in text and "make venv" in text, "the set-up and test commands CI and newcomers use"
    for page in glob.glob(os.path.join(ROOT, "docs", "*.md")):
        name = os.path.relpath(page, ROOT)
        assert f"({name})" in text, f"the README's map of the docs has no link to {name}"
