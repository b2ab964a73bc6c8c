"""Write the Chinese edition (简体中文版) of the book from the English sources and the stored translations.

    python scripts/translate_book.py             # write zh/ (fails, naming each cell, on a missing or stale translation)
    python scripts/translate_book.py --check     # write nothing; fail if zh/ is out of date
    python scripts/translate_book.py --stale     # list every missing or stale translation, with the English it needs
    python scripts/translate_book.py --rewrapped # keep the translations whose English was only re-wrapped
    python scripts/translate_book.py --export book/case_a/reproduce.ipynb > units.txt      # the English units, to translate
    python scripts/translate_book.py --import book/case_a/reproduce.ipynb < units.zh.txt   # store translations

How the edition is made: :mod:`book_tools.zh`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from .. import settings
from . import render, store, units


def _page_arg(name: str) -> pathlib.Path | None:
    if name in ("site", store.SITE_STORE.name):
        return None
    path = (settings.ROOT / name).resolve() if not pathlib.Path(name).is_absolute() else pathlib.Path(name)
    if path not in [p.resolve() for p in units.english_pages()]:
        raise SystemExit(f"{name}: not a page of _toc.yml (or 'site')")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help="write nothing; fail if zh/ is out of date")
    group.add_argument("--stale", action="store_true", help="list missing and stale translations, with diffs")
    group.add_argument("--export", metavar="PAGE", help="print the English units of PAGE (or 'site')")
    group.add_argument("--import", dest="import_", metavar="PAGE", help="store the translations read from stdin")
    group.add_argument("--prune", action="store_true", help="drop stored translations of units that are gone")
    group.add_argument("--rewrapped", action="store_true",
                       help="keep the translations of units whose English was only re-wrapped")
    parser.add_argument("--draft", action="store_true",
                        help="write zh/ even with stale (old translation kept) or missing (English) units")
    parser.add_argument("--todo", action="store_true", help="with --export: only the missing and stale units")
    args = parser.parse_args(argv)
    if args.export:
        sys.stdout.write(store.export_units(_page_arg(args.export), args.todo))
        return 0
    if args.import_:
        count = store.import_units(_page_arg(args.import_), sys.stdin.read())
        print(f"stored {count} translations for {args.import_}")
        return 0
    if args.prune:
        store.prune_stores()
        return 0
    if args.rewrapped:
        for line in store.refresh_rewrapped():
            print("kept (only re-wrapped):", line)
        return 0
    if args.stale:
        report = store.stale_report()
        print(report or "every unit of English text has a current translation")
        return 1 if report else 0
    try:
        if args.check:
            diffs = render.differences()
            print("\n".join(diffs) or "zh/ is up to date")
            return 1 if diffs else 0
        written = render.write_tree(args.draft)
    except render.Untranslated as error:
        print(f"{len(error.problems)} units of English text have no current translation "
              "(see `python scripts/translate_book.py --stale`):", file=sys.stderr)
        print(str(error), file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {settings.rel(path)}" if path.exists() else f"removed {settings.rel(path)}")
    if args.draft:
        problems = store.all_problems()
        if problems:
            print(f"a DRAFT: {len(problems)} units are stale (old translation kept) or missing (English kept); "
                  "see --stale", file=sys.stderr)
            return 1
    return 0
