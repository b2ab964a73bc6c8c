#!/usr/bin/env bash
# CI, after .ci/stacks.sh: Keras' own tests of fit with fit routed to train (issue 21) on
# another stack, in the environment .ci/stacks.sh made for it:
#
#     bash .ci/keras_suite.sh [NAME]        # default: colab
#
# That stack's keras wheel ships no test files (Keras 3.13's wheel and sdist have none), so
# the test files are those of the lock's Keras (requirements.txt's keras==): from the lock's
# virtual environment (.venv) when it holds them, else from that keras wheel, downloaded.
# tests/contracts/test_keras_suite.py copies the selected files into a temporary folder with no
# __init__.py and imports them with --import-mode=importlib, so they run against the stack's
# keras and TensorFlow; the run records the keras, TensorFlow and companion it imported and
# the test asserts they are the stack's. Lines of tests/contracts/keras_suite/selection.txt marked
# 'not-X.Y: <reason>' (tests that fail with Keras X.Y's own fit) are not run on Keras X.Y.
# As .ci/stacks.sh's unit tests: python -I and importlib mode, so that `companion` is the
# installed wheel (checked after the run).
# Overrides: KERAS_SUITE (default ci), KERAS_SUITE_TESTS_FROM (a keras wheel, or a folder
# holding keras/src), KERAS_SUITE_ROUTE=fit (the same tests with Keras' own fit).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
STACKS_DIR=${STACKS_DIR:-$ROOT/.venv-stacks}
name=${1:-colab}
env="$STACKS_DIR/$name"
[ -x "$env/bin/python" ] || { echo "$env is missing: run STACKS_PHASE=install bash .ci/stacks.sh $name" >&2; exit 1; }
start=$(date +%s)

if [ -z "${KERAS_SUITE_TESTS_FROM:-}" ]; then
    keras=$(sed -n 's/^keras==\([0-9][0-9.]*\).*/\1/p' requirements.txt)
    [ -n "$keras" ] || { echo "requirements.txt pins no keras" >&2; exit 1; }
    site=$(ls -d "$ROOT"/.venv/lib/python3.*/site-packages 2>/dev/null | head -n 1 || true)
    if [ -n "$site" ] && [ -f "$site/keras/src/trainers/trainer_test.py" ] \
        && grep -q "__version__ = \"$keras\"" "$site/keras/src/version.py"; then
        KERAS_SUITE_TESTS_FROM=$site
    else
        wheels=$(mktemp -d)
        trap 'rm -rf "$wheels"' EXIT
        "$env/bin/python" -m pip download --quiet --no-deps --only-binary=:all: --dest "$wheels" \
            "keras==$keras" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }
        KERAS_SUITE_TESTS_FROM=$(ls "$wheels"/keras-"$keras"-*.whl)
    fi
fi
export KERAS_SUITE_TESTS_FROM
export KERAS_SUITE=${KERAS_SUITE:-ci}
echo "== $name: Keras' tests of fit through train (KERAS_SUITE=$KERAS_SUITE; test files: $KERAS_SUITE_TESTS_FROM)"

"$env/bin/python" -I "$ROOT/.ci/pytest_installed.py" tests/contracts/test_keras_suite.py -p no:nbval -p no:cacheprovider -o addopts= --import-mode=importlib -q
echo "== $name: Keras' tests of fit through train: $(( $(date +%s) - start )) s"
