"""CHANGELOG.md describes the version the package and the install cells install (tests/repository/test_versions.py:
unreleased changes make a development version)."""

from __future__ import annotations

import datetime
import pkgutil
import re

import book_tools
import companion

CHANGELOG = (book_tools.ROOT / "CHANGELOG.md").read_text()
RELEASES = re.findall(r"^## \[(\d+\.\d+\.\d+[^\]]*)\] - (\S+)$", CHANGELOG, re.M)


def test_top_released_version_is_the_package_version_or_the_release_before_it():
    """A release is the top dated section; a development version (unreleased changes) comes after it."""
    from book_tools import release

    assert RELEASES, "CHANGELOG.md has no released version (`## [x.y.z] - YYYY-MM-DD`)"
    version = companion.__version__
    assert version == book_tools.package_version()
    if release.is_release(version):
        assert RELEASES[0][0] == version and not release.unreleased_changes(CHANGELOG)
    else:
        assert release.parse_version(version)[:3] > release.parse_version(RELEASES[0][0])[:3]


def test_releases_are_dated_and_newest_first():
    dates = [datetime.date.fromisoformat(date) for _, date in RELEASES]
    assert dates == sorted(dates, reverse=True)
    headings = re.findall(r"^## \[([^\]]+)\]", CHANGELOG, re.M)
    assert headings[0] == "Unreleased" and headings[1:] == [version for version, _ in RELEASES]


def test_every_release_links_to_its_tag_in_the_configured_repository():
    url = book_tools.repository_url()
    for version, _ in RELEASES:
        assert f"[{version}]: {url}/releases/tag/v{version}" in CHANGELOG


def test_every_public_submodule_is_in_the_changelog():
    for module in pkgutil.iter_modules(companion.__path__):
        if not module.name.startswith("_"):
            assert f"`companion.{module.name}`" in CHANGELOG, f"CHANGELOG.md never mentions companion.{module.name}"
