"""What a release needs besides the workflow: licences, a valid CITATION.cff, the release
checks of scripts/release.py, the book pinned to the released tag, and the book's URL
derived from repository.url everywhere it is spelled out."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

import book_tools
from book_tools import release

ROOT = book_tools.ROOT
README = (ROOT / "README.md").read_text()
CONTRIBUTING = (ROOT / "CONTRIBUTING.md").read_text()


def _run_release(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "release.py"), *args],
                          capture_output=True, text=True, timeout=60)


# --- licences -------------------------------------------------------------------------------


def test_code_is_mit_and_the_book_cc_by_4_named_in_readme_and_pyproject():
    licence = (ROOT / "LICENSE").read_text()
    assert licence.startswith("MIT License") and "Permission is hereby granted, free of charge" in licence
    book = (ROOT / "LICENSE-BOOK").read_text()
    assert "Creative Commons Attribution 4.0 International" in book
    assert "https://creativecommons.org/licenses/by/4.0/legalcode" in book
    # The whole legal code, not only its name.
    sections = re.findall(r"^Section (\d) – ", book, re.M)
    assert sections == [str(n) for n in range(1, 9)], sections
    assert "[MIT](LICENSE)" in README and "([LICENSE-BOOK](LICENSE-BOOK))" in README and "CC BY 4.0" in README
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]


def test_book_footer_names_both_licences():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    footer = config["html"]["extra_footer"]
    assert "https://creativecommons.org/licenses/by/4.0/" in footer and "CC BY 4.0" in footer
    assert f"{book_tools.repository_url()}/blob/main/LICENSE-BOOK" in footer
    assert f"{book_tools.repository_url()}/blob/main/LICENSE" in footer and "MIT License" in footer


# --- CITATION.cff ---------------------------------------------------------------------------

CITATION = ROOT / "CITATION.cff"


def _validate_cff(path) -> subprocess.CompletedProcess:
    """Against the CFF 1.2.0 schema that check-jsonschema ships (no download)."""
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.citation-file-format", str(path)],
        capture_output=True, text=True, timeout=120,
    )


def test_citation_file_is_valid_cff(tmp_path):
    result = _validate_cff(CITATION)
    assert result.returncode == 0, result.stdout + result.stderr
    # The schema does reject what is not CFF: no authors, or a date that is not ISO 8601.
    text = CITATION.read_text()
    for old, new in (("authors:\n  - name: The NaN Gradients book authors\n", ""),
                     (f'date-released: "{book_tools_releases()[0][1]}"', 'date-released: "30 November 2026"')):
        assert old in text
        broken = tmp_path / "CITATION.cff"
        broken.write_text(text.replace(old, new))
        assert _validate_cff(broken).returncode == 1, f"the schema accepted {new!r} for {old!r}"


def test_citation_names_the_latest_release_and_the_repository():
    """The version a development version leads to is not released yet: the citation stays the last release's."""
    cff = yaml.safe_load(CITATION.read_text())
    assert cff["cff-version"] == "1.2.0"
    latest, date = book_tools_releases()[0]
    assert cff["version"] == latest
    if release.is_release(book_tools.package_version()):
        assert latest == book_tools.package_version()
    assert str(cff["date-released"]) == date, "date-released must be the changelog's date of this version"
    assert cff["repository-code"] == book_tools.repository_url()
    assert cff["url"] == book_tools.pages_url()
    assert cff["license"] == "MIT"


def book_tools_releases() -> list[tuple[str, str]]:
    import re

    return re.findall(r"^## \[(\d+\.\d+\.\d+[^\]]*)\] - (\S+)$", (ROOT / "CHANGELOG.md").read_text(), re.M)


# --- the book's URL -------------------------------------------------------------------------


def test_book_url_is_the_pages_url_of_the_repository_everywhere():
    assert book_tools.pages_url("https://github.com/Some-Owner/some-repo") == "https://some-owner.github.io/some-repo/"
    url = book_tools.pages_url()
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["html"]["baseurl"] == url, "html.baseurl must be where Pages publishes repository.url"
    assert config["sphinx"]["config"]["ogp_site_url"] == url
    import re

    for page in book_tools.linked_pages():
        for found in re.findall(r"https://[\w.-]+\.github\.io/[\w.-]+/?", page.read_text()):
            assert found.rstrip("/") + "/" == url, f"{page.name} links to {found}, not to the book at {url}"


# --- scripts/release.py ---------------------------------------------------------------------


def test_release_check_accepts_the_tag_of_the_package_version_only_and_only_a_release():
    version = book_tools.package_version()
    for tag in (version, f"v{version}.1", "v0.0.0", f"release-{version}"):
        with pytest.raises(ValueError, match="does not name the package version"):
            release.check_tag(tag)
    result = _run_release("check", "v0.0.0")
    assert result.returncode == 1 and f"expected 'v{version}'" in result.stderr
    if release.is_release(version):
        assert release.check_tag(f"v{version}") == version
        assert _run_release("check", f"v{version}").returncode == 0
    else:  # a development version is never released: `cut` makes the release first
        with pytest.raises(ValueError, match="development version"):
            release.check_tag(f"v{version}")
        result = _run_release("check", f"v{version}")
        assert result.returncode == 1 and f"release.py cut {release.release_of(version)}" in result.stderr


def test_changelog_entry_is_the_body_of_the_version_section():
    changelog = (
        "# Changelog\n\n## [Unreleased]\n\n- next\n\n## [1.1.0] - 2026-12-01\n\n### Fixed\n\n- a bug\n\n"
        "## [1.0.0] - 2026-11-30\n\n- first\n\n[1.1.0]: https://x/releases/tag/v1.1.0\n"
    )
    assert release.changelog_entry("1.1.0", changelog) == "### Fixed\n\n- a bug\n"
    assert release.changelog_entry("1.0.0", changelog) == "- first\n"
    for missing in ("1.2.0", "Unreleased", "1.1"):
        with pytest.raises(ValueError, match="no dated entry"):
            release.changelog_entry(missing, changelog)
    with pytest.raises(ValueError, match="no dated entry"):  # a heading without content
        release.changelog_entry("2.0.0", "## [2.0.0] - 2026-12-02\n\n## [1.0.0] - 2026-11-30\n- x\n")
    latest = book_tools_releases()[0][0]
    assert release.changelog_entry(latest).strip() and "## [" not in release.changelog_entry(latest)
    if release.is_release(book_tools.package_version()):
        notes = _run_release("notes", f"v{book_tools.package_version()}")
        assert notes.returncode == 0 and notes.stdout == release.changelog_entry(book_tools.package_version())


def test_pinning_the_branch_changes_only_repository_branch():
    text = (ROOT / "_config.yml").read_text()
    pinned = release.with_repository_branch(text, "v9.8.7")
    assert yaml.safe_load(pinned)["repository"]["branch"] == "v9.8.7"
    changed = [(a, b) for a, b in zip(text.splitlines(), pinned.splitlines()) if a != b]
    assert len(changed) == 1 and len(text.splitlines()) == len(pinned.splitlines())
    # The launch URL of a chapter then names the tag.
    assert yaml.safe_load(text)["repository"]["branch"] == book_tools.repository_branch()
    with pytest.raises(ValueError, match="git ref name"):
        release.with_repository_branch(text, "v1; rm -rf /")
    with pytest.raises(ValueError, match="no repository.branch"):
        release.with_repository_branch("title: x\n", "v1.0.0")


def test_release_pin_branch_refuses_a_tag_that_is_not_the_version(tmp_path):
    result = _run_release("pin-branch", "v0.0.0")
    assert result.returncode == 1
    assert yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["branch"] != "v0.0.0"


# --- the release, dry run -------------------------------------------------------------------


def _copy_of_the_tree(target):
    """The checkout's tracked files as they are in the working tree (no .git): a tree to release."""
    import shutil

    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True, timeout=60)
    for name in listed.stdout.decode().split("\0"):
        source = ROOT / name
        if name and source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


@pytest.mark.slow
def test_release_dry_run_cuts_the_next_release_and_starts_the_one_after_on_a_copy_of_the_tree(tmp_path):
    """What a maintainer runs (CONTRIBUTING.md, "Releasing"), on a copy: `release.py cut` makes a tree that
    the release workflow's check accepts and that keeps the version rule, and `dev` then makes main again."""
    tree = _copy_of_the_tree(tmp_path / "tree")

    def run(*args, stdin=None):
        result = subprocess.run([sys.executable, str(tree / "scripts" / "release.py"), *args], cwd=tree,
                                capture_output=True, text=True, timeout=300, input=stdin)
        return result

    version = book_tools.package_version()
    major, minor, patch, _ = release.parse_version(version)
    if release.is_release(version):  # just released: start the next one, with a change to release
        following = f"{major}.{minor}.{patch + 1}"
        assert run("dev", following).returncode == 0
        changelog = tree / "CHANGELOG.md"
        changelog.write_text(changelog.read_text().replace("## [Unreleased]\n", "## [Unreleased]\n\n- a change\n", 1))
        version = f"{following}.dev0"
    assert run("status").returncode == 0
    next_release = release.release_of(version)
    unreleased = release.unreleased_changes((tree / "CHANGELOG.md").read_text())
    assert run("check", f"v{next_release}").returncode == 1  # a development version is not released

    today = __import__("datetime").date.today().isoformat()
    cut = run("cut", next_release)
    assert cut.returncode == 0, cut.stdout + cut.stderr
    assert f"git tag -a v{next_release}" in cut.stdout
    # the release workflow's own steps, on the tag that would be pushed
    assert run("check", f"v{next_release}").returncode == 0
    notes = run("notes", f"v{next_release}")
    assert notes.returncode == 0 and notes.stdout.strip() == unreleased
    status = run("status")
    assert status.returncode == 0, status.stdout
    changelog = (tree / "CHANGELOG.md").read_text()
    assert release.unreleased_changes(changelog) == ""
    assert release.released_versions(changelog)[0] == (next_release, today)
    url = book_tools.repository_url()
    links = f"[Unreleased]: {url}/compare/v{next_release}...HEAD\n[{next_release}]: {url}/releases/tag/v{next_release}\n"
    assert links in changelog
    cff = yaml.safe_load((tree / "CITATION.cff").read_text())
    assert cff["version"] == next_release and str(cff["date-released"]) == today
    assert f'__version__ = "{next_release}"' in (tree / "companion" / "_version.py").read_text()
    spec = f"nan-gradients-companion @ git+{url}@v{next_release}"
    for notebook in (tree / "book").rglob("*.ipynb"):
        assert f'code = "{spec.split(" @ ")[1]}"' in notebook.read_text().replace('\\"', '"'), notebook.name
    readme = (tree / "README.md").read_text()
    assert f'pip install "{spec}"' in readme and f"/blob/v{next_release}/book/" in readme
    assert f'pip install "{spec}"' in (tree / "companion" / "README.md").read_text()
    # the Chinese edition needs no new translation, and zh/ was rewritten with the English
    zh = subprocess.run([sys.executable, str(tree / "scripts" / "translate_book.py"), "--check"], cwd=tree,
                        capture_output=True, text=True, timeout=300)
    assert zh.returncode == 0, zh.stdout + zh.stderr
    assert f"@v{next_release}" in (tree / "zh" / "book" / "intro.md").read_text()
    assert run("cut", next_release).returncode == 1  # nothing left to release

    after = f"{major}.{minor}.{patch + 1}" if release.is_release(book_tools.package_version()) else next_release
    following = ".".join(map(str, (*release.parse_version(after)[:2], release.parse_version(after)[2] + 1)))
    dev = run("dev", following)
    assert dev.returncode == 0, dev.stdout + dev.stderr
    assert run("status").returncode == 0
    assert f'pip install "nan-gradients-companion @ git+{url}@{book_tools.repository_branch()}"' in (
        tree / "README.md").read_text()


# --- contributor documents ------------------------------------------------------------------


def test_contributing_documents_the_lock_refresh_and_the_release_steps():
    assert "[CONTRIBUTING.md](CONTRIBUTING.md)" in README
    assert "## Contributing" in README and "scripts/refresh_notebooks.py" not in README.split("## Contributing")[1]
    assert "bash scripts/lock.sh" in CONTRIBUTING
    for step in ("companion/_version.py", "CHANGELOG.md", "CITATION.cff", "git tag -a v<version>",
                 "python scripts/release.py check v<version>", "github-pages", "trusted publisher"):
        assert step in CONTRIBUTING, f"CONTRIBUTING.md's release steps do not mention {step!r}"
    lock_script = (ROOT / "scripts" / "lock.sh").read_text()
    assert "uv pip compile" in lock_script and "--universal" in lock_script


def test_changing_the_repository_rewrites_the_book_url_too(tmp_path, monkeypatch):
    from book_tools import refresh

    old = book_tools.repository_url()
    page = tmp_path / "CITATION.cff"
    page.write_text(f"repository-code: {old}\nurl: {book_tools.pages_url(old)}\n")
    monkeypatch.setattr(book_tools.settings, "linked_pages", lambda: [page])
    refresh.sync_links(old, "https://github.com/Fork-Owner/fork-book")
    assert page.read_text() == (
        "repository-code: https://github.com/Fork-Owner/fork-book\nurl: https://fork-owner.github.io/fork-book/\n"
    )
