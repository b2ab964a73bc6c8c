"""Every chapter's install cell installs code that provides what the chapter imports (issue 44).

A chapter run where `companion` is missing (Colab, Kaggle, Binder, a downloaded notebook) gets the
package from its first cell, which names a git ref: a release's tag, or on a development version
the repository's branch. That code must be the code the chapter was run with. Checked without the
network: the version says what it is (unreleased changes make a development version of a newer
release; a release has no unreleased changes and its dated section on top), every install cell and
install line names the ref of that version, and where git knows the ref, the chapters' imports
resolve in its tree.
"""

from __future__ import annotations

import json

import pytest

import book_tools
from book_tools import cells, release

VERSION = book_tools.package_version()


def test_the_version_the_changelog_and_every_install_cell_and_line_agree():
    problems = release.version_problems()
    assert not problems, "\n".join(problems)


def test_unreleased_changes_make_a_development_version_of_a_newer_release():
    releases = [version for version, _ in release.released_versions()]
    if release.unreleased_changes():
        assert not release.is_release(VERSION), (
            f"CHANGELOG.md lists unreleased changes, but {VERSION} is a release: "
            f"its install cells would install v{VERSION}, which has none of them")
        assert release.parse_version(release.release_of(VERSION))[:3] > release.parse_version(releases[0])[:3]
    elif release.is_release(VERSION):
        assert releases[0] == VERSION, f"{VERSION} is a release, but CHANGELOG.md's top section is {releases[0]}"


def test_every_install_cell_installs_the_code_of_this_version():
    ref = cells.install_ref(VERSION)
    assert ref == (f"v{VERSION}" if release.is_release(VERSION) else book_tools.repository_branch())
    for path in book_tools.notebooks():
        source = "".join(book_tools.first_code_cell(json.loads(path.read_text()))["source"])
        assert cells.installed_ref(source) == ref, f"{path.name} installs @{cells.installed_ref(source)}, not @{ref}"


def test_the_chapters_imports_resolve_in_the_tree_the_install_cells_name():
    """Where git knows the ref (a full clone with the tags; CI's shallow checkout does not), what the
    chapters import is in its tree; this checkout's tree always provides it (nbval runs the chapters)."""
    assert not release.missing_imports(release.working_tree)
    imports = release.chapter_imports()
    assert all(imports.values()) and any(("companion.book.notebook", "setup") in pairs for pairs in imports.values())
    ref = cells.install_ref(VERSION)
    read = release.tree_at(ref) if release.is_release(VERSION) else None
    if read is None:
        pytest.skip(f"{ref} is this checkout's own code, or git does not know it")
    missing = release.missing_imports(read)
    assert not missing, f"the install cells install @{ref}, whose code lacks:\n" + "\n".join(missing)


def test_missing_imports_finds_what_an_older_tree_lacks():
    """The v0.1.0 tree (commit d680d17) had no `companion.book.notebook`, which every chapter imports now."""
    read = release.tree_at("d680d17")
    if read is None:
        pytest.skip("git does not know v0.1.0's commit (a shallow clone)")
    missing = release.missing_imports(read)
    assert any("`companion.book.notebook` does not exist" in line for line in missing), missing


def test_versions_are_parsed_as_pep_440_releases_and_development_versions():
    assert release.parse_version("0.2.0") == (0, 2, 0, None) and release.is_release("0.2.0")
    assert release.parse_version("0.2.0.dev3") == (0, 2, 0, 3) and not release.is_release("0.2.0.dev3")
    assert release.release_of("0.2.0.dev3") == "0.2.0"
    for bad in ("0.2", "v0.2.0", "0.2.0-dev", "0.2.0rc1", "0.2.0.dev"):
        with pytest.raises(ValueError, match="not a version"):
            release.parse_version(bad)
