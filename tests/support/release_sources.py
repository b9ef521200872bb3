"""The source of every release of the declared ranges, for ``tests/unit/test_release_surfaces.py``: which releases
(PyPI's JSON API, filtered by ``ds_odc/integration/versions.py``), their sdists (downloaded once, kept in a cache),
and their files, unpacked from the sdist as the check asks for them. Nothing is installed, built or imported.

The cache is ``$DS_ODC_SDIST_CACHE``, else ``~/.cache/ds_odc/sdists``: the sdists as PyPI names them, each
release list (``<package>.releases.json``, refreshed after a day), under ``src/`` the files unpacked so far with a
manifest of every file of each sdist (so a file a release lacks is known without reopening it), and under
``verdicts/`` each release's verdict per entry: an sdist never changes, so an entry is read from it again only when
the entry or the checker (``surface.py``, ``surface_rules.py``, ``surface_source.py``, ``versions.py``) changed. A
fresh machine downloads what it lacks; an offline one with a warm cache works from it, and without a cached list
from :data:`PINNED` (the releases as they were listed when it was written).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request

from packaging.version import InvalidVersion, Version

from ds_odc.integration import surface, surface_rules, surface_source, versions
from ds_odc.integration.surface import SURFACE, PrivateName, check_source
from ds_odc.integration.versions import DEEPSPEED_RANGE, TESTED_HF, release

CACHE_VARIABLE = "DS_ODC_SDIST_CACHE"
INDEX = "https://pypi.org/pypi/{package}/json"
LIST_MAX_AGE_S = 24 * 3600
TIMEOUT_S = 30  # one download
LIST_TIMEOUT_S = 10  # the release list, fetched while pytest collects
PACKAGES = ("deepspeed", "transformers", "accelerate")

#: The releases checked, as PyPI listed them when this was written (used only when no list can be fetched and none
#: is cached): ``{package: {version: sdist file name, or None when yanked}}``.
PINNED: dict[str, dict[str, str | None]] = {
    "deepspeed": {f"0.18.{n}": f"deepspeed-0.18.{n}.tar.gz" for n in range(10)} |
                 {f"0.19.{n}": f"deepspeed-0.19.{n}.tar.gz" for n in range(9)},
    "transformers": {v: (None if v in ("4.57.0", "5.10.0") else f"transformers-{v}.tar.gz") for v in (
        "4.57.0", "4.57.1", "4.57.6", "5.0.0", "5.1.0", "5.2.0", "5.3.0", "5.4.0", "5.5.0", "5.5.4", "5.6.0",
        "5.6.2", "5.7.0", "5.8.0", "5.8.1", "5.9.0", "5.10.0", "5.10.1", "5.10.4", "5.11.0", "5.12.0", "5.12.1",
        "5.13.0", "5.13.1", "5.14.0", "5.14.1", "5.15.0", "5.15.1", "5.16.0", "5.16.1", "5.17.0", "5.18.0",
        "5.19.0", "5.20.0", "5.20.2", "5.21.0", "5.21.1", "5.22.0", "5.22.2", "5.23.0")},
    "accelerate": {f"1.{n}.0": f"accelerate-1.{n}.0.tar.gz" for n in range(11, 16)},
}


@dataclasses.dataclass(frozen=True)
class Release:
    """One release to check: its sdist (``url`` and ``sha256`` None when listed from :data:`PINNED`), or why not."""
    package: str
    version: str
    filename: str | None = None
    url: str | None = None
    sha256: str | None = None
    yanked: str | None = None  # PyPI's reason ("" when it gave none) when the release is yanked: skipped

    @property
    def label(self) -> str:
        return f"{self.package} {self.version}"


def cache_dir() -> str:
    return os.environ.get(CACHE_VARIABLE) or os.path.join(os.path.expanduser("~"), ".cache", "ds_odc", "sdists")


def _write_atomically(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".part-")
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.replace(temporary, path)


# -- which releases --------------------------------------------------------------------------------------------
def _listing(package: str) -> tuple[dict, str]:
    """``({version: {filename, url, sha256, yanked}}, where it came from)``, final releases with an sdist only."""
    path = os.path.join(cache_dir(), f"{package}.releases.json")
    cached = None
    if os.path.exists(path):
        with open(path) as handle:
            cached = json.load(handle)
        if time.time() - cached["fetched"] < LIST_MAX_AGE_S:
            return cached["releases"], f"PyPI, cached {time.strftime('%Y-%m-%d %H:%M', time.gmtime(cached['fetched']))}"
    index = INDEX.format(package=package)
    try:
        with urllib.request.urlopen(index, timeout=LIST_TIMEOUT_S) as response:
            listed = json.load(response)["releases"]
    except OSError as err:
        if cached is not None:
            return cached["releases"], f"a cached PyPI list (refresh failed: {err})"
        return {v: {"filename": f, "url": None, "sha256": None, "yanked": None if f else ""}
                for v, f in PINNED[package].items()}, f"the pinned list in tests/support (PyPI unreachable: {err})"
    releases = {}
    for version, files in listed.items():
        sdists = [f for f in files if f["packagetype"] == "sdist"]
        if sdists:
            sdist = sdists[0]
            releases[version] = {"filename": sdist["filename"], "url": urllib.parse.urljoin(index, sdist["url"]),
                                 "sha256": sdist["digests"]["sha256"],
                                 "yanked": (sdist.get("yanked_reason") or "") if sdist.get("yanked") else None}
        elif files:
            releases[version] = {"filename": None, "url": None, "sha256": None, "yanked": None}
    _write_atomically(path, json.dumps({"fetched": time.time(), "releases": releases}).encode())
    return releases, "PyPI"


def select(package: str, listed: dict) -> list[Release]:
    """The releases of ``package`` to check, oldest first: DeepSpeed's every final release in
    :data:`~ds_odc.integration.versions.DEEPSPEED_RANGE`; transformers' and accelerate's first and last final release
    of each minor in :data:`~ds_odc.integration.versions.TESTED_HF`. A yanked release is kept (the test skips it and
    says so) and, where it was a minor's first or last, the next one inward is checked in its place."""
    finals = {}
    for version, sdist in listed.items():
        try:
            parsed = Version(version)
        except InvalidVersion:
            continue
        if not (parsed.is_prerelease or parsed.is_devrelease or parsed.local):
            finals[parsed] = Release(package, version, sdist["filename"], sdist["url"], sdist["sha256"],
                                     sdist["yanked"])
    if package == "deepspeed":
        low, high = (Version(v) for v in DEEPSPEED_RANGE)
        return [finals[v] for v in sorted(finals) if low <= v <= high]
    low, high = (release(v).release[:2] for v in TESTED_HF[package])
    chosen = []
    for minor in sorted({v.release[:2] for v in finals if low <= v.release[:2] <= high}):
        versions = sorted(v for v in finals if v.release[:2] == minor)
        kept = [v for v in versions if finals[v].yanked is None]
        ends = {kept[0], kept[-1]} if kept else set()
        chosen += [finals[v] for v in versions if v in ends or (finals[v].yanked is not None and
                                                              (not kept or v < kept[0] or v > kept[-1]))]
    return chosen


def releases(package: str) -> tuple[list[Release], str]:
    """:func:`select` over the list of PyPI (cached for a day), with where the list came from."""
    listed, origin = _listing(package)
    return select(package, listed), origin


# -- their source ---------------------------------------------------------------------------------------------
def sdist(found: Release) -> str:
    """The path of ``found``'s sdist in the cache, downloaded (and its sha256 checked) if it is not there yet."""
    if found.filename is None:
        raise FileNotFoundError(f"{found.label} has no sdist on PyPI: its source cannot be checked")
    path = os.path.join(cache_dir(), found.filename)
    if os.path.exists(path):
        return path
    if found.url is None:
        raise FileNotFoundError(f"{found.label}: {found.filename} is not in {cache_dir()} and PyPI could not be "
                                f"reached to list it (set {CACHE_VARIABLE} to a warm cache, or deselect the check "
                                "with -m 'not release_surfaces')")
    with urllib.request.urlopen(found.url, timeout=TIMEOUT_S) as response:
        data = response.read()
    if found.sha256 and hashlib.sha256(data).hexdigest() != found.sha256:
        raise OSError(f"{found.label}: {found.url} does not match the sha256 PyPI lists for it")
    _write_atomically(path, data)
    return path


class SourceTree:
    """The files of one sdist, from the directory that holds the package (``deepspeed/runtime/engine.py``,
    ``transformers/trainer.py`` although transformers keeps its package under ``src/``). A file is unpacked into
    the cache the first time it is read; the first look at an sdist lists it and unpacks ``likely`` in one pass."""

    def __init__(self, found: Release, likely=()):
        self.release, self.archive = found, sdist(found)
        self.root = os.path.join(cache_dir(), "src", found.filename.removesuffix(".tar.gz"))
        manifest = os.path.join(self.root, "manifest.json")
        if not os.path.exists(manifest):
            self._list(manifest, set(likely))
        with open(manifest) as handle:
            listed = json.load(handle)
        self.prefix, self.files = listed["prefix"], set(listed["files"])

    def _list(self, manifest: str, likely: set) -> None:
        """One pass over the archive: every file's name into the manifest, and the ``likely`` ones unpacked."""
        names, held = [], {}
        with tarfile.open(self.archive) as archive:
            for member in archive:
                if member.isfile():
                    names.append(member.name)
                    if member.name.split("/", 1)[-1].removeprefix("src/") in likely:
                        held[member.name] = archive.extractfile(member).read()
        package = self.release.package
        inits = sorted((n for n in names if n.endswith(f"/{package}/__init__.py")), key=len)
        if not inits:
            raise FileNotFoundError(f"{self.release.label}: {self.release.filename} holds no {package}/__init__.py")
        prefix = inits[0][:-len(f"{package}/__init__.py")]
        for name, data in held.items():
            if name.startswith(prefix):
                _write_atomically(os.path.join(self.root, name[len(prefix):]), data)
        files = [n[len(prefix):] for n in names if n.startswith(prefix)]
        _write_atomically(manifest, json.dumps({"prefix": prefix, "files": files}).encode())

    def read(self, path: str) -> str | None:
        """The text of ``path``, or None if the release has no such file."""
        if path not in self.files:
            return None
        local = os.path.join(self.root, path)
        if not os.path.exists(local):
            with tarfile.open(self.archive) as archive:
                _write_atomically(local, archive.extractfile(self.prefix + path).read())
        with open(local, encoding="utf-8", errors="replace") as handle:
            return handle.read()


def likely_paths(package: str, entries) -> list[str]:
    """The files the entries of ``package`` name: each module's file (or package ``__init__``) and its parents'."""
    paths = set()
    for entry in entries:
        if entry.package != package:
            continue
        parts = entry.module.split(".")
        for n in range(1, len(parts) + 1):
            paths |= {"/".join(parts[:n]) + "/__init__.py", "/".join(parts[:n]) + ".py"}
        if entry.found_in and "/" in entry.found_in:
            paths |= {f"{'/'.join(parts)}/{entry.found_in}", f"{'/'.join(parts[:-1])}/{entry.found_in}"}
    return sorted(paths)


def _fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_release(found: Release, entries: tuple[PrivateName, ...] = SURFACE) -> list[PrivateName]:
    """:func:`~ds_odc.integration.surface.check_source` of ``found``'s sdist: the entries of its package that hold
    there and are missing. Verdicts already reached for the same entry by the same checker are reused."""
    checker = _fingerprint("".join(open(module.__file__, encoding="utf-8").read()
                                   for module in (surface, surface_rules, surface_source, versions)))
    path = os.path.join(cache_dir(), "verdicts", f"{found.filename}.json")
    memo = {}
    if os.path.exists(path):
        with open(path) as handle:
            memo = json.load(handle)
    verdicts = memo.get("verdicts", {}) if memo.get("checker") == checker else {}
    mine = [(entry, _fingerprint(repr(entry))) for entry in entries if entry.package == found.package]
    todo = tuple(entry for entry, key in mine if key not in verdicts)
    if todo:
        tree = SourceTree(found, likely_paths(found.package, todo))
        missing = check_source(tree.read, found.package, found.version, todo)
        verdicts.update({_fingerprint(repr(entry)): entry not in missing for entry in todo})
        _write_atomically(path, json.dumps({"checker": checker, "verdicts": verdicts}).encode())
    return [entry for entry, key in mine if not verdicts[key]]
