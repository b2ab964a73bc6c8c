"""Keras' own tests of ``fit``, run with ``fit`` routed to :func:`companion.training.train`.

The test files are those of the installed keras wheel (``keras/src/**/_test.py``, found
through ``import keras``; nothing is copied into this repository). The selection is
pinned in tests/contracts/keras_suite/selection.txt: Keras test node ids (relative to
``keras/src``) that call ``fit``, chosen from trainers/, callbacks/, models/,
optimizers/, saving/, metrics/ and the TensorFlow distribute test; a line marked
``# exception:`` is a test of behaviour ``train`` changes on purpose, with the reason
(the book's page *Differences from fit* says what happens instead).

The selection runs in a fresh process (Keras' tests change global state: dtype
policies, logical devices) under tests/contracts/keras_suite/keras_suite_plugin.py, which replaces
``keras.Model.fit`` by an adapter that hands each argument of ``fit`` to the argument of
``train`` with the same name. ``KERAS_SUITE=ci`` runs the lines marked ``ci`` (38 tests:
the pinned subset .ci/run's stage "Keras' tests of fit through train" runs),
``KERAS_SUITE=quick`` the lines marked ``quick`` (52), ``KERAS_SUITE=full`` every line
(about half an hour idle; not in CI). Without
``KERAS_SUITE`` (the README's ``python -m pytest``) only the selection is checked and the
run is skipped, so the default collection never runs Keras' suite.

Another stack (.ci/keras_suite.sh: the Colab stack's Keras 3.13, whose wheel ships no test
files): ``KERAS_SUITE_TESTS_FROM`` names where the test files come from (a keras wheel, or
a folder holding ``keras/src``, e.g. the lock's site-packages). The selected files are
copied into a temporary folder with no ``__init__.py`` and imported with
``--import-mode=importlib``, so they run against the installed keras and TensorFlow; the
run records the keras, TensorFlow and companion it imported, and the test asserts they are
the ones this process imports. A line marked ``not-3.13: <reason>`` is a test that fails
with Keras 3.13's own ``fit`` (a test of a later Keras): it is not run on a Keras 3.13.x.

Measured on this 2-core machine under a load average of 7-9 (2026-12-01): the full
selection (203 tests) took 30 min 16 s; the quick part is 52 tests. On the Colab stack
(Keras 3.13.2, TensorFlow 2.20, Python 3.13; test files of Keras 3.15.1), load average
2-3: the 38 ``ci`` tests pass with Keras' own fit and with train, .ci/keras_suite.sh took
113 s; of the quick part, 3 fail with Keras 3.13.2's fit (marked ``not-3.13``) and the 49
others pass with fit, and with train but for the 6 of them that are exceptions.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

HERE = pathlib.Path(__file__).parent / "keras_suite"
SELECTION = HERE / "selection.txt"
#: Where the test files come from on a stack whose keras wheel ships none.
TESTS_FROM = "KERAS_SUITE_TESTS_FROM"
#: A marker in a selection line's comment, after its tags: ``exception: <reason>`` or
#: ``not-3.13: <reason>``.
MARKER = re.compile(r"\b(exception|not-\d+\.\d+):")


def parse_line(line: str) -> tuple[str, set[str], dict[str, str]]:
    """A selection line's node id, its tags (``ci``, ``quick``) and markers (-> reason)."""
    node, _, comment = line.partition("#")
    parts = MARKER.split(comment)
    tags = {word.strip(" ,;") for word in parts[0].split()} - {""}
    markers = {parts[i]: parts[i + 1].strip() for i in range(1, len(parts), 2)}
    return node.strip(), tags, markers


def entries() -> list[tuple[str, set[str], dict[str, str]]]:
    lines = [line.strip() for line in SELECTION.read_text().splitlines()]
    return [parse_line(line) for line in lines if line and not line.startswith("#")]


def read_selection() -> tuple[list[str], dict[str, str], set[str]]:
    """The pinned node ids, the exceptions (id -> reason) and the quick part."""
    tests, exceptions, quick = [], {}, set()
    for node, tags, markers in entries():
        tests.append(node)
        if "exception" in markers:
            exceptions[node] = markers["exception"]
        if "quick" in tags:
            quick.add(node)
    return tests, exceptions, quick


def tagged(tag: str) -> set[str]:
    """The node ids of the selection whose line carries ``tag`` (``quick``, ``ci``)."""
    return {node for node, tags, _ in entries() if tag in tags}


def excluded_on(version: str) -> dict[str, str]:
    """The tests not run on Keras ``version`` (marked ``not-X.Y``: they fail with its fit)."""
    marker = "not-" + ".".join(version.split(".")[:2])
    return {node: markers[marker] for node, _, markers in entries() if marker in markers}


def keras_source() -> pathlib.Path:
    """The installed keras's ``keras/src``."""
    import keras

    return pathlib.Path(keras.__file__).parent / "src"


def suite_source() -> pathlib.Path | None:
    """The keras wheel or ``keras/src`` folder ``KERAS_SUITE_TESTS_FROM`` names, or None."""
    value = os.environ.get(TESTS_FROM)
    if not value:
        return None
    path = pathlib.Path(value).expanduser().resolve()
    if path.is_file() and path.name.startswith("keras-") and path.suffix == ".whl":
        return path
    for candidate in (path / "keras" / "src", path / "src", path):
        if (candidate / "version.py").is_file() and (candidate / "trainers").is_dir():
            return candidate
    raise AssertionError(f"{TESTS_FROM}={value} is neither a keras wheel nor a folder holding keras/src")


def files_of(source: pathlib.Path) -> tuple[set[str], str]:
    """The test files of ``source`` (a keras wheel or ``keras/src``), relative to keras/src,
    and the Keras version they are of."""
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as wheel:
            names = wheel.namelist()
            version_py = wheel.read("keras/src/version.py").decode()
        files = {n[len("keras/src/"):] for n in names if n.startswith("keras/src/") and n.endswith("_test.py")}
    else:
        files = {p.relative_to(source).as_posix() for p in source.rglob("*_test.py")}
        version_py = (source / "version.py").read_text()
    return files, re.search(r"__version__ = \"([^\"]+)\"", version_py).group(1)


def copy_tests(tests: list[str], source: pathlib.Path, tree: pathlib.Path) -> None:
    """Copy the files of ``tests`` from ``source`` (a keras wheel or ``keras/src``) into
    ``tree``, in their folders and without any ``__init__.py``."""
    for name in sorted({t.split("::")[0] for t in tests}):
        target = tree / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.suffix == ".whl":
            with zipfile.ZipFile(source) as wheel:
                target.write_bytes(wheel.read(f"keras/src/{name}"))
        else:
            shutil.copyfile(source / name, target)


def imported_here() -> dict[str, str]:
    """The keras (version and file), TensorFlow and companion this process imports."""
    import importlib.util

    import keras
    import tensorflow

    origin = importlib.util.find_spec("companion").origin
    return {"keras": keras.__version__, "keras_file": str(pathlib.Path(keras.__file__).resolve()),
            "tensorflow": str(pathlib.Path(tensorflow.__file__).resolve()),
            "companion": str(pathlib.Path(origin).resolve())}


def run_selection(tests: list[str], tmp_path: pathlib.Path, route: str = "train") -> tuple[dict[str, str], str]:
    """Run ``tests`` in a fresh pytest process with ``fit`` routed to ``route``; their outcomes.

    The test files are the installed keras's, or with ``KERAS_SUITE_TESTS_FROM`` copies of
    those of the wheel or folder it names; either way they import the installed keras, and
    the keras, TensorFlow and companion of the run are checked to be this process's."""
    source = suite_source()
    if source is None:
        root, import_mode = keras_source(), []
    else:
        # Not an importable name: the run's current folder (tmp_path) is on its sys.path.
        root, import_mode = tmp_path / "keras-tests", ["--import-mode=importlib"]
        copy_tests(tests, source, root)
    record = tmp_path / "record.json"
    expected = imported_here()
    # The run imports companion from where this process does: the folder holding it,
    # unless that is the environment's site-packages (a stack's installed wheel).
    home = pathlib.Path(expected["companion"]).parents[1]
    site = {pathlib.Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    paths = [str(HERE)] + ([] if home in site else [str(home)])
    env = dict(os.environ)
    if not sys.flags.isolated:  # python -I (.ci/stacks.sh) ignored PYTHONPATH here: so does the run
        paths.append(env.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    command = [
        sys.executable, "-m", "pytest", "-c", str(HERE / "pytest.ini"), "--rootdir", str(root),
        "--confcutdir", str(root), *import_mode, "-q", "--fit-route", route, "--fit-record", str(record),
        *[str(root / t) for t in tests],
    ]
    # Run from a directory with no Python modules of its own (keras/src holds a
    # package named ``random``, the repository a ``conftest.py``).
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=3600)
    if not record.exists():
        raise AssertionError(f"the Keras suite did not run:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    recorded = json.loads(record.read_text())
    assert recorded["imported"] == expected, (
        f"the Keras suite ran against {recorded['imported']}, not this process's {expected}")
    # The plugin names tests relative to keras/src or the copy (the --rootdir).
    return recorded["outcomes"], result.stdout


def check(tests, exceptions, outcomes, output, route="train") -> None:
    missing = [t for t in tests if t not in outcomes]
    failed = [t for t in tests if t not in exceptions and outcomes.get(t) not in ("passed",)]
    # An exception is a test train fails on purpose: one that passes is not an exception.
    passing = [t for t in tests if t in exceptions and outcomes.get(t) == "passed"]
    assert not missing, f"not run: {missing[:10]}"
    assert not passing, f"these exceptions pass with {route}: take them off the exceptions: {passing}"
    assert not failed, f"{len(failed)} of {len(tests)} Keras tests fail with {route}: {failed}\n{output[-5000:]}"


def test_selection_is_pinned_and_every_exception_has_a_reason():
    tests, exceptions, quick = read_selection()
    assert len(tests) == len(set(tests)), "a node id is listed twice"
    assert 100 <= len(tests) <= 250
    assert quick and quick <= set(tests)
    ci = tagged("ci")
    assert 30 <= len(ci) <= 45 and ci <= set(tests) and not ci & set(exceptions)
    assert all(reason for reason in exceptions.values())
    for node, tags, markers in entries():
        assert tags <= {"ci", "quick"}, f"{node}: unknown tags {tags - {'ci', 'quick'}}"
        assert all(markers.values()), f"{node}: a marker without a reason"


def test_every_selected_file_is_in_the_test_files():
    source = suite_source() or keras_source()
    files, version = files_of(source)
    if not files and source == keras_source():
        pytest.skip(f"the installed keras ({version}) ships no test files; name some with {TESTS_FROM}")
    tests, _, _ = read_selection()
    missing = sorted({t.split("::")[0] for t in tests} - files)
    assert not missing, f"selected files not in Keras {version}'s test files ({source}): {missing}"


@pytest.mark.slow
def test_keras_tests_of_fit_pass_with_train(tmp_path):
    """With ``KERAS_SUITE_ROUTE=fit`` (default ``train``), the same tests with Keras' own
    fit: how the ``not-X.Y`` lines are checked on another Keras."""
    import keras

    part = os.environ.get("KERAS_SUITE")
    if part not in ("ci", "quick", "full"):
        pytest.skip("Keras' suite runs with KERAS_SUITE=ci (.ci/run's stage), quick or full")
    route = os.environ.get("KERAS_SUITE_ROUTE", "train")
    assert route in ("train", "fit"), f"KERAS_SUITE_ROUTE={route}: train or fit"
    tests, exceptions, quick = read_selection()
    if part != "full":
        tests = [t for t in tests if t in tagged(part)]
    excluded = excluded_on(keras.__version__)
    tests = [t for t in tests if t not in excluded]
    outcomes, output = run_selection(tests, tmp_path, route)
    check(tests, exceptions if route == "train" else {}, outcomes, output, route)
