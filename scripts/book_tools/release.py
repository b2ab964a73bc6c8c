"""Release checks and inputs, used by .github/workflows/release.yml and pages.yml (and runnable by hand):

    python scripts/release.py check v0.2.0          # the tag names companion.__version__,
                                                    # and CHANGELOG.md has its dated entry
    python scripts/release.py notes v0.2.0 > notes.md   # that entry: the GitHub Release's text
    python scripts/release.py pin-branch v0.2.0     # _config.yml's repository.branch := the tag,
                                                    # so the launch buttons open the release

Each exits with status 1 and says why when the tag and the repository disagree.
"""

from __future__ import annotations

import argparse
import re
import sys

from . import settings


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


def changelog_entry(version: str, changelog: str | None = None) -> str:
    """The body of ``CHANGELOG.md``'s section ``## [version] - date`` (without its heading).

    Raises:
        ValueError: if the changelog has no dated section for ``version``.
    """
    text = changelog if changelog is not None else (settings.ROOT / "CHANGELOG.md").read_text()
    match = re.search(rf"^## \[{re.escape(version)}\] - \d{{4}}-\d{{2}}-\d{{2}}[ \t]*\n(.*?)(?=^## |^\[[^\]]+\]: |\Z)",
                      text, re.M | re.S)
    if not match or not match.group(1).strip():
        raise ValueError(f"CHANGELOG.md has no dated entry `## [{version}] - YYYY-MM-DD` with content")
    return match.group(1).strip() + "\n"


def check_tag(tag: str) -> str:
    """The version a release tag names; ValueError unless it is ``v`` + companion.__version__
    and CHANGELOG.md has a dated entry for it."""
    version = settings.package_version()
    if tag != f"v{version}":
        raise ValueError(f"tag {tag!r} does not name the package version: expected 'v{version}' "
                         "(companion/_version.py)")
    changelog_entry(version)
    return version


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["check", "notes", "pin-branch"])
    parser.add_argument("tag", help="the release tag, v<version>")
    args = parser.parse_args(argv)
    try:
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
