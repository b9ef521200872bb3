"""The mutant set: every defect this project fixed, and classic ones in the protocol and the arithmetic,
re-seeded one at a time into a scratch copy of the checkout (``tests/compat/run_mutants.py``). The default suite
must kill each one; ``tests/unit/test_mutants.py`` keeps every mutant applicable to today's code.

One TOML file per mutant (``<id>.toml``)::

    name = "what the defect does, in a few words"
    kind = "history"                 # a defect fixed in this project ("history", with its commit) or "classic"
    commit = "ea4163d"               # history only: the commit that fixed it
    file = "ds_odc/comm/nodes.py"    # relative to the checkout
    original = '''...'''             # text found exactly once in that file today
    replacement = '''...'''          # what the mutant puts there instead
    why = "what goes wrong, and who would notice"
    tests = ["tests/...::test_..."]  # where the runner looks first (the killer found last time)
"""
from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import List

import tomllib

HERE = pathlib.Path(__file__).resolve().parent
CHECKOUT = HERE.parent.parent
KINDS = ("history", "classic")
_FIELDS = {"name", "kind", "commit", "file", "original", "replacement", "why", "tests"}


@dataclass(frozen=True)
class Mutant:
    id: str
    name: str
    kind: str
    file: str
    original: str
    replacement: str
    why: str
    tests: List[str] = field(default_factory=list)
    commit: str = ""

    def apply(self, root: pathlib.Path) -> None:
        """Seed this mutant into the checkout at ``root`` (a scratch copy): exactly one occurrence replaced."""
        path = root / self.file
        text = path.read_text()
        count = text.count(self.original)
        if count != 1:
            raise ValueError(f"mutant {self.id}: its original text occurs {count} times in {self.file} (once "
                             "expected): the code moved, update tests/mutants/" + self.id + ".toml")
        path.write_text(text.replace(self.original, self.replacement))


def load(path: pathlib.Path) -> Mutant:
    data = tomllib.loads(path.read_text())
    unknown = set(data) - _FIELDS
    missing = {"name", "kind", "file", "original", "replacement", "why"} - set(data)
    if unknown or missing:
        raise ValueError(f"{path.name}: unknown fields {sorted(unknown)}, missing {sorted(missing)}")
    if data["kind"] not in KINDS:
        raise ValueError(f"{path.name}: kind must be one of {KINDS}, got {data['kind']!r}")
    if data["kind"] == "history" and not data.get("commit"):
        raise ValueError(f"{path.name}: a history mutant names the commit that fixed the defect")
    if data["original"] == data["replacement"]:
        raise ValueError(f"{path.name}: the replacement is the original")
    return Mutant(id=path.stem, **data)


def every() -> List[Mutant]:
    return [load(path) for path in sorted(HERE.glob("*.toml"))]
