"""Release checks and inputs, used by .github/workflows/release.yml (and runnable by hand):

    python scripts/release.py check v0.2.0          # the tag names companion.__version__,
                                                    # and CHANGELOG.md has its dated entry
    python scripts/release.py notes v0.2.0 > notes.md   # that entry: the GitHub Release's text
    python scripts/release.py pin-branch v0.2.0     # _config.yml's repository.branch := the tag,
                                                    # so the launch buttons open the release

Each exits with status 1 and says why when the tag and the repository disagree.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import book_tools  # noqa: E402


def check_tag(tag: str) -> str:
    """The version a release tag names; ValueError unless it is ``v`` + companion.__version__
    and CHANGELOG.md has a dated entry for it."""
    version = book_tools.package_version()
    if tag != f"v{version}":
        raise ValueError(f"tag {tag!r} does not name the package version: expected 'v{version}' "
                         "(companion/_version.py)")
    book_tools.changelog_entry(version)
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
            sys.stdout.write(book_tools.changelog_entry(version))
        else:
            config = book_tools.ROOT / "_config.yml"
            config.write_text(book_tools.with_repository_branch(config.read_text(), args.tag))
            print(f"_config.yml: repository.branch = {args.tag}")
    except ValueError as err:
        print(f"release: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
