"""Every entry of the surface table, against the source of every release of the declared ranges: each DeepSpeed
release from 0.18.0 to 0.19.8, the first and the last release of each transformers and accelerate minor. Read from
each release's sdist, unpacked and never installed, built or imported (``tests/support/release_sources.py``; the
rules are ``ds_odc.integration.surface.check_source``'s). A name missing from a release fails here, naming the
release and the name, unless its entry holds only on other releases (``since=`` / ``before=`` a ``Change``) or its
feature is refused on that release (a ``Feature``'s ``since``).

Downloads: ~19 DeepSpeed sdists (1.6-2 MB each), ~38 transformers ones (8-11 MB), 5 accelerate ones, kept in a cache
(``$DS_ODC_SDIST_CACHE``, else ``~/.cache/ds_odc/sdists``); tests/README.md gives the cost cold and warm.
Deselect with ``-m "not release_surfaces"``.
"""
import pytest

from ds_odc.integration.surface import SURFACE
from ds_odc.integration.versions import DEEPSPEED_RANGE, TESTED_HF
from tests.support import release_sources
from tests.support.release_sources import PACKAGES, Release, select

_LISTED = {package: release_sources.releases(package) for package in PACKAGES}  # at collection: cached for a day


def _cases():
    for package in PACKAGES:
        releases, origin = _LISTED[package]
        for found in releases:
            yield pytest.param(found, origin, id=f"{package}-{found.version}")


@pytest.mark.release_surfaces
@pytest.mark.parametrize("found, origin", list(_cases()))
def test_every_surface_entry_is_in_the_source_of_the_release(found: Release, origin: str):
    if found.yanked is not None:
        pytest.skip(f"{found.label} is yanked on PyPI{f' ({found.yanked})' if found.yanked else ''}: not checked "
                    f"(release list from {origin})")
    missing = release_sources.check_release(found)
    assert not missing, f"{found.label} ({found.filename}, release list from {origin}) lacks:\n" + "\n".join(
        f"  - {entry.describe()}: needed by {entry.used_by} ({entry.why})"
        + (f" [feature: {entry.feature.name}]" if entry.feature else "") for entry in missing) + \
        "\nGive the entry the releases it holds on (a Change in ds_odc/integration/surface_releases.py, since= / " \
        "before=), or refuse the feature that needs it on that release (its Feature's since=)."


@pytest.mark.release_surfaces
def test_the_releases_checked_span_the_declared_ranges():
    deepspeed = [found.version for found in _LISTED["deepspeed"][0]]
    assert deepspeed[0] == DEEPSPEED_RANGE[0] and deepspeed[-1] == DEEPSPEED_RANGE[1], deepspeed
    assert len(deepspeed) >= 19, deepspeed  # every patch release: 0.18.0-0.18.9, 0.19.0-0.19.8 when written
    for package, (low, high) in TESTED_HF.items():
        minors = {tuple(int(p) for p in found.version.split(".")[:2]) for found in _LISTED[package][0]}
        assert min(minors) == tuple(int(p) for p in low.split(".")) and \
            max(minors) == tuple(int(p) for p in high.split(".")), (package, sorted(minors))


def test_every_package_with_entries_is_checked():
    assert {entry.package for entry in SURFACE} - {"torch"} <= set(PACKAGES)  # torch: no source to read (C++)


# -- which releases, from a listing as PyPI's JSON API gives it (no network) ---------------------------------------
def _listing(*versions: str, yanked=()) -> dict:
    return {v: {"filename": f"x-{v}.tar.gz", "url": f"https://example.invalid/x-{v}.tar.gz", "sha256": None,
                "yanked": "broken" if v in yanked else None} for v in versions}


def test_every_deepspeed_release_in_the_range_is_selected_and_nothing_else():
    listed = _listing("0.17.6", "0.18.0", "0.18.1", "0.19.0rc1", "0.19.8", "0.19.9", "0.20.0", "0.18.5.dev0",
                      yanked=("0.18.1",))
    assert [(r.version, r.yanked) for r in select("deepspeed", listed)] == \
        [("0.18.0", None), ("0.18.1", "broken"), ("0.19.8", None)]


def test_each_minor_gives_its_first_and_last_release_and_a_yanked_end_gives_way_inward():
    listed = _listing("4.56.2", "4.57.0", "4.57.1", "4.57.3", "4.57.6", "5.0.0rc3", "5.0.0", "5.10.0", "5.10.1",
                      "5.10.2", "5.10.4", "5.23.0", "5.24.0", yanked=("4.57.0", "5.10.0", "5.10.2"))
    chosen = [(r.version, r.yanked is not None) for r in select("transformers", listed)]
    assert chosen == [("4.57.0", True), ("4.57.1", False), ("4.57.6", False), ("5.0.0", False),
                      ("5.10.0", True), ("5.10.1", False), ("5.10.4", False), ("5.23.0", False)]


@pytest.mark.release_surfaces
@pytest.mark.parametrize("package", PACKAGES)
def test_the_pinned_fallback_list_names_releases_pypi_lists(package):
    """The list an offline machine falls back on (``release_sources.PINNED``) holds only releases still selected,
    with the same yanked state; a release PyPI adds later is checked from the live list, not from this one."""
    listed = {found.version: found.yanked is not None for found in _LISTED[package][0]}
    pinned = {version: filename is None for version, filename in release_sources.PINNED[package].items()}
    assert {v: y for v, y in pinned.items() if listed.get(v) != y} == {}, listed
