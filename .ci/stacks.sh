#!/usr/bin/env bash
# CI, after the locked suite: the package on the other stacks readers run it on.
#
#     bash .ci/stacks.sh [colab] [oldest]        # default: both
#
# For each stack (.ci/stacks/NAME.txt: the pins, and a line '# python: 3.X'), in a
# fresh virtual environment:
#   1. install the package from a wheel built from this checkout (never the checkout itself)
#      with the stack's pins and the test tools;
#   2. the unit tests: tests/unit, tests/contracts and tests/distributed (UNIT_TEST_FOLDERS
#      below), without nbval and without the slow multi-process tests,
#      importing the installed package; on the Colab stack, Keras' own tests of fit through
#      train as well (.ci/keras_suite.sh);
#   3. every chapter (book/**/*.ipynb), copied to a temporary folder outside the repository
#      and executed there, as in Colab: no output comparison (that stays on the lock), but
#      no cell may raise unless it is tagged raises-exception. Not on a stack whose pins
#      say '# chapters: no' (the oldest: the package's floor for users' own training
#      code, where its unit tests run; readers run the chapters on Colab's stack).
# Each stage prints its time; a failed stage does not stop the others (the exit code says).
# STACKS_PHASE=install only makes the environments (steps 1; .ci/run starts that in the
# background while the locked suite runs), STACKS_PHASE=test only runs steps 2-3 in them;
# the default, all, does both. STACKS_PARTS=unit or STACKS_PARTS=chapters runs only that part of
# step 2-3 (.ci/run spreads the parts over two lanes); the default, both, runs both.
# The Pythons: python3.X on PATH (setup-python on GitHub), else pyenv's newest 3.X; override
# with STACK_PYTHON_<NAME>=/path/to/python.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
STACKS_DIR=${STACKS_DIR:-$ROOT/.venv-stacks}

# The tests of the package, by folder: tests/unit, tests/contracts (Keras' and TensorFlow's
# behaviour the package relies on) and tests/distributed. tests/book and tests/repository check
# the chapters, the built book, the lock and the repository (README, changelog, workflows,
# packaging from git): they run on the lock only.
UNIT_TEST_FOLDERS=(tests/unit tests/contracts tests/distributed)
# The tests marked slow (fresh processes: MirroredStrategy, multi-worker jobs) run on the lock
# only, to keep CI within its time; UNIT_TESTS_MARK="" runs them here too.
UNIT_TESTS_MARK=${UNIT_TESTS_MARK-not slow and not lock and not killmatrix}

stage_start=0
stage() { stage_start=$(date +%s); echo "== $1"; }
stage_done() { echo "== $1: $(( $(date +%s) - stage_start )) s"; }

find_python() {  # find_python NAME VERSION
    local override="STACK_PYTHON_${1^^}"
    if [ -n "${!override:-}" ]; then echo "${!override}"; return; fi
    if command -v "python$2" >/dev/null && "python$2" -c '' 2>/dev/null; then command -v "python$2"; return; fi
    local root
    root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
    local found
    found=$(ls -d "$root"/versions/"$2".*/bin/python 2>/dev/null | sort -V | tail -n 1)
    if [ -z "$found" ]; then echo "no Python $2 found (set $override)" >&2; return 1; fi
    echo "$found"
}

# pip, without the lines about index locations this machine's pip configuration lists but
# does not have.
pip_in() {  # pip_in PYTHON ARGS...
    local python=$1; shift
    "$python" -m pip "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }
    return "${PIPESTATUS[0]}"
}

failed=()
stacks=("$@")
[ ${#stacks[@]} -gt 0 ] || stacks=(colab oldest)

phase=${STACKS_PHASE:-all}
case "$phase" in all|install|test) ;; *) echo "STACKS_PHASE must be all, install or test, not '$phase'" >&2; exit 2;; esac
parts=${STACKS_PARTS:-both}
case "$parts" in both|unit|chapters) ;; *) echo "STACKS_PARTS must be both, unit or chapters, not '$parts'" >&2; exit 2;; esac

if [ "$phase" != test ]; then
    wheels=$(mktemp -d)
    trap 'rm -rf "$wheels"' EXIT
    stage "build the wheel"
    pip_in python3 wheel --quiet --no-deps --wheel-dir "$wheels" "$ROOT"
    wheel=$(ls "$wheels"/*.whl)
    stage_done "build the wheel ($(basename "$wheel"))"
fi

for name in "${stacks[@]}"; do
    pins="$ROOT/.ci/stacks/$name.txt"
    version=$(sed -n 's/^# *python: *\([0-9.]*\).*/\1/p' "$pins" | head -n 1)
    [ -n "$version" ] || { echo "$pins names no Python (a line '# python: 3.X')" >&2; exit 1; }
    python=$(find_python "$name" "$version")
    env="$STACKS_DIR/$name"

    if [ "$phase" != test ]; then
        stage "$name: install (Python $version: $python)"
        rm -rf "$env"
        "$python" -m venv "$env"
        pip_in "$env/bin/python" install --quiet --upgrade pip
        # The test tools are not part of the stack and float; the stack's pins win.
        pip_in "$env/bin/python" install --quiet -r "$pins" "$wheel" \
            pytest hypothesis mpmath ipykernel nbclient nbformat
        pip_in "$env/bin/python" check
        TF_CPP_MIN_LOG_LEVEL=3 "$env/bin/python" -c 'import sys, numpy, tensorflow, keras; print("  Python", sys.version.split()[0],
              "TensorFlow", tensorflow.__version__, "Keras", keras.__version__, "NumPy", numpy.__version__)'
        stage_done "$name: install"
    fi
    [ "$phase" != install ] || continue
    [ -x "$env/bin/python" ] || { echo "$env is missing: run with STACKS_PHASE=install first" >&2; exit 1; }

    if [ "$parts" != chapters ]; then
        stage "$name: unit tests"
        # -I: neither the current folder nor PYTHONPATH on sys.path; importlib mode: pytest adds no
        # folder of the checkout either, so `companion` is the installed one (checked after the run).
        # InternalAPIWarning (a hook on a private API falling back) is an error on the lock
        # (pyproject.toml); an older Keras lacks some of what the hooks use (Keras 3.5 has no
        # _is_default mark), so here a fall-back is a warning, and its canary says so.
        "$env/bin/python" -I "$ROOT/.ci/pytest_installed.py" "${UNIT_TEST_FOLDERS[@]}" -p no:nbval -p no:cacheprovider -o addopts= --import-mode=importlib -q \
            -W "default::companion._internal.registry.InternalAPIWarning" \
            ${UNIT_TESTS_MARK:+-m "$UNIT_TESTS_MARK"} || failed+=("$name: unit tests")
        stage_done "$name: unit tests"
        if [ "$name" = colab ]; then
            # Keras' own tests of fit through train (issue 21), Keras 3.15.1's test files against
            # this stack's Keras (.ci/keras_suite.sh: the 38 `ci` tests, measured 113 s).
            stage "$name: Keras' tests of fit through train"
            STACKS_DIR="$STACKS_DIR" bash "$ROOT/.ci/keras_suite.sh" "$name" || failed+=("$name: Keras' suite")
            stage_done "$name: Keras' tests of fit through train"
        fi
    fi

    if [ "$parts" != unit ] && grep -q '^# *chapters: *no' "$pins"; then
        echo "== $name: the chapters do not run on this stack ($pins: '# chapters: no')"
    elif [ "$parts" != unit ]; then
        stage "$name: every chapter, outside the repository"
        "$env/bin/python" -I "$ROOT/.ci/execute_chapters.py" "$ROOT/book" || failed+=("$name: chapters")
        stage_done "$name: chapters"
    fi
done

if [ ${#failed[@]} -gt 0 ]; then
    printf '== FAILED: %s\n' "${failed[@]}"
    exit 1
fi
if [ "$phase" = install ]; then echo "== every stack installed: ${stacks[*]}"; else echo "== every stack passed ($parts): ${stacks[*]}"; fi
