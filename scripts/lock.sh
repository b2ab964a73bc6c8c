#!/usr/bin/env bash
# Write the locks from their inputs with uv (installed by requirements.txt):
#
#     bash scripts/lock.sh              # after editing requirements*.in: keep every other pin
#     bash scripts/lock.sh --upgrade    # move every package to its newest allowed version
#
# requirements.txt      every package of the test and book environment, from requirements.in
# requirements-book.txt the subset `jupyter-book build .` needs, from requirements-book.in,
#                       at the versions requirements.txt pins
#
# Both are universal: one file for Python 3.11-3.13 on Linux, macOS and Windows, with an
# environment marker where a package's version or presence differs.
# After an upgrade, refresh the chapters (python scripts/refresh_notebooks.py) and run the
# test suite: the lock is the stack the committed outputs come from.
set -euo pipefail
cd "$(dirname "$0")/.."

compile=(uv pip compile --quiet --universal --python-version 3.11 --custom-compile-command "bash scripts/lock.sh" --annotation-style line)

"${compile[@]}" "$@" requirements.in -o requirements.txt

# The book's subset: constrained to the full lock's pins (without its editable line).
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
grep -v '^-e ' requirements.txt > "$constraints"
"${compile[@]}" requirements-book.in -c "$constraints" -o requirements-book.txt
