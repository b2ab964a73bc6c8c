"""Release checks and inputs, used by .github/workflows/release.yml and pages.yml, and the two
commands that move the version (CONTRIBUTING.md, "Releasing"):

    python scripts/release.py cut 0.2.0             # release the development version 0.2.0.devN:
                                                    # the version, CHANGELOG.md, CITATION.cff, every
                                                    # install cell and install line, zh/
    python scripts/release.py dev 0.2.1             # after a release: main becomes 0.2.1.dev0,
                                                    # its install cells install main again
    python scripts/release.py status                # what this tree installs, and any disagreement
    python scripts/release.py check v0.2.0          # the tag names companion.__version__, a release,
                                                    # and CHANGELOG.md has its dated entry
    python scripts/release.py notes v0.2.0 > notes.md   # that entry: the GitHub Release's text
    python scripts/release.py pin-branch v0.2.0     # _config.yml's repository.branch := the tag,
                                                    # so the launch buttons open the release

The rule the version follows: while CHANGELOG.md's *Unreleased* section lists changes, the
version is a development version of the next release (PEP 440, ``0.2.0.dev0``) and every
install cell and install line installs the code the chapters run, the repository's branch
(``main``); a release (``0.2.0``) has an empty *Unreleased* section, its dated section on top,
and installs its own tag. ``version_problems`` checks it (tests/repository/test_versions.py).

Each command exits with status 1 and says why when the tag or the tree disagrees. ``check``
and ``notes`` need nothing but the standard library (the release workflow runs them before
installing anything).
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import pathlib
import re
import subprocess
import sys

from . import settings

# --- versions -------------------------------------------------------------------------------------------------

#: The versions this project uses: a release X.Y.Z, or a development version X.Y.Z.devN of the next one.
VERSION = re.compile(r"(\d+)\.(\d+)\.(\d+)(?:\.dev(\d+))?")


def parse_version(version: str) -> tuple[int, int, int, int | None]:
    """(major, minor, patch, dev number or None) of ``X.Y.Z`` or ``X.Y.Z.devN``."""
    match = VERSION.fullmatch(version)
    if not match:
        raise ValueError(f"{version!r} is not a version X.Y.Z or a development version X.Y.Z.devN (PEP 440)")
    major, minor, patch, dev = match.groups()
    return int(major), int(minor), int(patch), None if dev is None else int(dev)


def is_release(version: str) -> bool:
    """Whether ``version`` is a release (``0.2.0``), not a development version (``0.2.0.dev0``)."""
    return parse_version(version)[3] is None


def release_of(version: str) -> str:
    """The release a version leads to: ``0.2.0`` for ``0.2.0.dev3`` and for ``0.2.0``."""
    return ".".join(str(n) for n in parse_version(version)[:3])


def _set_version(version: str) -> None:
    path = settings.ROOT / "companion" / "_version.py"
    text = path.read_text()
    new, count = re.subn(r'^__version__ = "[^"]+"', f'__version__ = "{version}"', text, count=1, flags=re.M)
    if count != 1:
        raise ValueError("companion/_version.py has no line `__version__ = \"...\"`")
    path.write_text(new)


# --- CHANGELOG.md -----------------------------------------------------------------------------------------------


def _changelog(changelog: str | None) -> str:
    return changelog if changelog is not None else (settings.ROOT / "CHANGELOG.md").read_text()


def changelog_entry(version: str, changelog: str | None = None) -> str:
    """The body of ``CHANGELOG.md``'s section ``## [version] - date`` (without its heading).

    Raises:
        ValueError: if the changelog has no dated section for ``version``.
    """
    text = _changelog(changelog)
    match = re.search(rf"^## \[{re.escape(version)}\] - \d{{4}}-\d{{2}}-\d{{2}}[ \t]*\n(.*?)(?=^## |^\[[^\]]+\]: |\Z)",
                      text, re.M | re.S)
    if not match or not match.group(1).strip():
        raise ValueError(f"CHANGELOG.md has no dated entry `## [{version}] - YYYY-MM-DD` with content")
    return match.group(1).strip() + "\n"


def unreleased_changes(changelog: str | None = None) -> str:
    """The body of ``CHANGELOG.md``'s ``## [Unreleased]`` section, stripped ("" when it is empty)."""
    match = re.search(r"^## \[Unreleased\][ \t]*\n(.*?)(?=^## |^\[[^\]]+\]: |\Z)", _changelog(changelog), re.M | re.S)
    if not match:
        raise ValueError("CHANGELOG.md has no `## [Unreleased]` section")
    return match.group(1).strip()


def released_versions(changelog: str | None = None) -> list[tuple[str, str]]:
    """(version, date) of every dated section of ``CHANGELOG.md``, in the changelog's order (newest first)."""
    return re.findall(r"^## \[(\d+\.\d+\.\d+[^\]]*)\] - (\d{4}-\d{2}-\d{2})[ \t]*$", _changelog(changelog), re.M)


def with_release_section(changelog: str, version: str, date: str, url: str) -> str:
    """``changelog`` with its *Unreleased* items moved under ``## [version] - date``, an empty
    *Unreleased* section above it, and the links at the end updated (compare from ``v<version>``,
    the release's tag)."""
    if not unreleased_changes(changelog):
        raise ValueError("CHANGELOG.md's Unreleased section is empty: there is nothing to release")
    if version in dict(released_versions(changelog)):
        raise ValueError(f"CHANGELOG.md already has a section for {version}")
    text, count = re.subn(r"^## \[Unreleased\][ \t]*\n\n?", f"## [Unreleased]\n\n## [{version}] - {date}\n\n",
                          changelog, count=1, flags=re.M)
    assert count == 1
    link = f"[{version}]: {url}/releases/tag/v{version}"
    unreleased_link = re.compile(r"^\[Unreleased\]: .*$", re.M)
    if unreleased_link.search(text):
        text = unreleased_link.sub(lambda m: f"[Unreleased]: {url}/compare/v{version}...HEAD\n{link}", text, count=1)
    else:
        text = text.rstrip("\n") + f"\n\n[Unreleased]: {url}/compare/v{version}...HEAD\n{link}\n"
    return text


# --- the release workflow's checks ------------------------------------------------------------------------------


def check_tag(tag: str) -> str:
    """The version a release tag names; ValueError unless it is ``v`` + companion.__version__,
    that version is a release (not ``.devN``) and CHANGELOG.md has a dated entry for it."""
    version = settings.package_version()
    if tag != f"v{version}":
        raise ValueError(f"tag {tag!r} does not name the package version: expected 'v{version}' "
                         "(companion/_version.py)")
    if not is_release(version):
        raise ValueError(f"{version} is a development version, not a release: cut the release first "
                         f"(`python scripts/release.py cut {release_of(version)}`)")
    changelog_entry(version)
    return version


def with_repository_branch(config_text: str, branch: str) -> str:
    """``_config.yml``'s text with ``repository.branch`` set to ``branch`` (comments kept).

    The release workflow builds the book from a tag with ``branch`` = the tag, so that the
    launch buttons open the notebooks of the release whose version the install cells name.
    """
    if not re.fullmatch(r"[\w./-]+", branch):
        raise ValueError(f"branch must be a git ref name, got {branch!r}")
    pattern = re.compile(r"^(repository:\n(?:[ \t]+.*\n|[ \t]*\n)*?[ \t]+branch:[ \t]*)\S+", re.M)
    new, count = pattern.subn(lambda m: m.group(1) + branch, config_text, count=1)
    if count != 1:
        raise ValueError("_config.yml has no repository.branch setting")
    return new


# --- what the install cells install ------------------------------------------------------------------------------


def version_problems() -> list[str]:
    """Every way in which this tree breaks the version rule (module docstring); [] when it keeps it.

    The version and the changelog agree (a release has no unreleased changes and its dated section
    on top; unreleased changes make a development version of a release newer than the last one), and
    every install cell and install line installs :func:`cells.install_ref` of that version: the
    code the chapters run.
    """
    from . import cells  # needs PyYAML (_config.yml), which check and notes do without

    problems = []
    version = settings.package_version()
    try:
        parse_version(version)
    except ValueError as err:
        return [f"companion/_version.py: {err}"]
    changelog = _changelog(None)
    unreleased = unreleased_changes(changelog)
    releases = [v for v, _ in released_versions(changelog)]
    if is_release(version):
        if unreleased:
            problems.append(
                f"CHANGELOG.md lists unreleased changes, but the version {version} is a release: the install cells "
                f"would install v{version}, which has none of them. Set the development version of the next "
                "release (`python scripts/release.py dev X.Y.Z`), or cut the release (`... cut X.Y.Z`)")
        if not releases or releases[0] != version:
            problems.append(f"the version {version} is a release, but CHANGELOG.md's top dated section is "
                            f"{releases[0] if releases else 'missing'}")
    else:
        base = release_of(version)
        if releases and parse_version(base)[:3] <= parse_version(releases[0])[:3]:
            problems.append(f"the development version {version} leads to {base}, which is not newer than the "
                            f"last release, {releases[0]} (CHANGELOG.md)")
    ref = cells.install_ref(version)
    for path in settings.notebooks():
        cell = cells.first_code_cell(json.loads(path.read_text()))
        installed = cells.installed_ref("".join(cell["source"])) if cells.is_colab_cell(cell) else None
        if installed != ref:
            problems.append(f"{settings.rel(path)}: the install cell installs @{installed}, not @{ref} (the code "
                            f"of {version}); run `python scripts/refresh_notebooks.py --no-execute`")
    for page, found in cells.install_refs_in_pages():
        for kind, other in found:
            if other != ref:
                problems.append(f"{settings.rel(page)}: {kind} names @{other}, not @{ref} (the code of {version}); "
                                "run `python scripts/refresh_notebooks.py --no-execute`")
    return problems


def chapter_imports() -> dict[pathlib.Path, set[tuple[str, str | None]]]:
    """For every chapter, the (module, name) pairs it imports from ``companion`` (name None for
    ``import companion.x``), read from its code cells."""
    found = {}
    for path in settings.notebooks():
        pairs = set()
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            # IPython's magics and shell escapes are not Python; nothing is imported on those lines.
            source = "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                               for line in "".join(cell["source"]).splitlines())
            try:
                tree = ast.parse(source)
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and (
                        node.module == "companion" or node.module.startswith("companion.")):
                    pairs.update((node.module, alias.name) for alias in node.names)
                elif isinstance(node, ast.Import):
                    pairs.update((alias.name, None) for alias in node.names
                                 if alias.name == "companion" or alias.name.startswith("companion."))
        found[path] = pairs
    return found


def _module_source(read, module: str) -> str | None:
    base = module.replace(".", "/")
    for candidate in (f"{base}.py", f"{base}/__init__.py"):
        text = read(candidate)
        if text is not None:
            return text
    return None


def _defined_names(source: str) -> set[str] | None:
    """The names a module's top level defines or imports, or None if it answers any name (``__getattr__``)."""
    names: set[str] = set()

    def bind(statements) -> bool:
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name == "__getattr__":
                    return False
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):  # names bound under a guard count too
                blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
                blocks += [handler.body for handler in getattr(node, "handlers", [])]
                if not all(bind(block) for block in blocks):
                    return False
        return True

    return names if bind(ast.parse(source).body) else None


def missing_imports(read) -> list[str]:
    """What the chapters import from ``companion`` that the tree ``read`` gives does not provide.

    ``read(path)`` returns the text of a file of the tree (``companion/x.py``), or None if it has
    none: :func:`tree_at` reads a commit or a tag, :func:`working_tree` this checkout.
    """
    missing = []
    for path, pairs in chapter_imports().items():
        for module, name in sorted(pairs, key=lambda p: (p[0], p[1] or "")):
            source = _module_source(read, module)
            if source is None:
                missing.append(f"{settings.rel(path)}: `{module}` does not exist")
                continue
            if name is None or name == "*":
                continue
            defined = _defined_names(source)
            if defined is not None and name not in defined and _module_source(read, f"{module}.{name}") is None:
                missing.append(f"{settings.rel(path)}: `{module}` has no `{name}`")
    return list(dict.fromkeys(missing))


def working_tree(relative: str) -> str | None:
    path = settings.ROOT / relative
    return path.read_text() if path.is_file() else None


def tree_at(ref: str):
    """A ``read`` for :func:`missing_imports` of the commit ``ref`` names in this repository's git, or None
    if git does not know ``ref`` (a shallow clone, a tag not fetched)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(settings.ROOT), *args], capture_output=True, text=True, timeout=60)

    if git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}").returncode != 0:
        return None

    def read(relative: str) -> str | None:
        shown = git("show", f"{ref}:{relative}")
        return shown.stdout if shown.returncode == 0 else None

    return read


# --- moving the version -----------------------------------------------------------------------------------------


def _sync_install_refs() -> list[str]:
    """Every install cell and install line, and zh/, rewritten for the current version."""
    from . import refresh
    from .zh import render

    written = refresh.sync_install_refs()
    import nbformat

    for path in settings.notebooks():
        nb = nbformat.read(path, as_version=4)
        if refresh.sync_colab_cell(nb):
            nbformat.write(nb, path)
            written.append(settings.rel(path))
    written += [settings.rel(p) for p in render.write_tree(False)]
    return written


def cut(version: str, date: str | None = None) -> list[str]:
    """Release ``version`` from its development version: set it, move CHANGELOG.md's *Unreleased*
    items under it, date CITATION.cff, and point every install cell and line at its tag. Returns
    the files written; ValueError (nothing written) unless the tree is a development version of
    ``version`` with unreleased changes."""
    date = date or datetime.date.today().isoformat()
    datetime.date.fromisoformat(date)
    if not is_release(version):
        raise ValueError(f"cut a release X.Y.Z, not {version}")
    current = settings.package_version()
    if is_release(current) or release_of(current) != version:
        raise ValueError(f"this tree is at {current}, not a development version of {version} "
                         f"(`python scripts/release.py dev {version}` first)")
    changelog_path = settings.ROOT / "CHANGELOG.md"
    changelog = with_release_section(changelog_path.read_text(), version, date, settings.repository_url())
    citation_path = settings.ROOT / "CITATION.cff"
    citation, count = re.subn(r"^version: .*$", f"version: {version}", citation_path.read_text(), count=1, flags=re.M)
    citation, dated = re.subn(r"^date-released: .*$", f'date-released: "{date}"', citation, count=1, flags=re.M)
    if count != 1 or dated != 1:
        raise ValueError("CITATION.cff has no `version:` or no `date-released:` line")
    changelog_path.write_text(changelog)
    citation_path.write_text(citation)
    _set_version(version)
    return ["companion/_version.py", "CHANGELOG.md", "CITATION.cff", *_sync_install_refs()]


def start_development(version: str) -> list[str]:
    """Make this tree the development version ``version``.dev0 of the next release: the install cells
    and lines then install the repository's branch. Returns the files written."""
    if not is_release(version):
        raise ValueError(f"name the next release X.Y.Z, not {version}")
    current = settings.package_version()
    releases = [v for v, _ in released_versions()]
    last = releases[0] if releases else "0.0.0"
    if parse_version(version)[:3] <= parse_version(last)[:3]:
        raise ValueError(f"{version} is not newer than the last release, {last}")
    if not is_release(current) and parse_version(release_of(current))[:3] > parse_version(version)[:3]:
        raise ValueError(f"this tree is already at {current}, a development version of a later release")
    _set_version(f"{version}.dev0")
    return ["companion/_version.py", *_sync_install_refs()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (("check", "the tag names this tree's release and CHANGELOG.md has its entry"),
                       ("notes", "print the tag's CHANGELOG.md entry"),
                       ("pin-branch", "set _config.yml's repository.branch to the tag")):
        commands.add_parser(name, help=text).add_argument("tag", help="the release tag, v<version>")
    cut_parser = commands.add_parser("cut", help="release the development version of VERSION")
    cut_parser.add_argument("version", help="the release, X.Y.Z")
    cut_parser.add_argument("--date", help="the release date, YYYY-MM-DD (default: today)")
    commands.add_parser("dev", help="start the development version VERSION.dev0 of the next release").add_argument(
        "version", help="the next release, X.Y.Z")
    commands.add_parser("status", help="the version, what the install cells install, and any disagreement")
    args = parser.parse_args(argv)
    try:
        if args.command in ("cut", "dev"):
            written = cut(args.version, args.date) if args.command == "cut" else start_development(args.version)
            for path in written:
                print(f"wrote {path}")
            problems = version_problems()
            if problems:
                raise ValueError("the tree still disagrees with itself:\n" + "\n".join(problems))
            version = settings.package_version()
            from . import cells

            print(f"companion {version}: install cells and lines install @{cells.install_ref(version)}")
            if args.command == "cut":
                print(f"next: run the tests, commit, push, wait for CI on main; then\n"
                      f"  git tag -a v{version} -m \"v{version}\" && git push origin v{version}")
            return 0
        if args.command == "status":
            from . import cells

            version = settings.package_version()
            print(f"companion {version} ({'release' if is_release(version) else 'development version'}); "
                  f"install cells install @{cells.install_ref(version)}")
            problems = version_problems()
            print("\n".join(problems) or "the version, CHANGELOG.md and every install cell and line agree")
            return 1 if problems else 0
        version = check_tag(args.tag)
        if args.command == "check":
            print(f"{args.tag}: companion {version}, CHANGELOG.md entry found")
        elif args.command == "notes":
            sys.stdout.write(changelog_entry(version))
        else:
            config = settings.ROOT / "_config.yml"
            config.write_text(with_repository_branch(config.read_text(), args.tag))
            print(f"_config.yml: repository.branch = {args.tag}")
    except ValueError as err:
        print(f"release: {err}", file=sys.stderr)
        return 1
    return 0
