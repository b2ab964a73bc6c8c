"""Keras' own tests of ``fit``, run with ``fit`` routed to :func:`companion.training.train`.

The test files are those of the installed keras wheel (``keras/src/**/_test.py``, found
through ``import keras``; nothing is copied into this repository). The selection is
pinned in tests/keras_suite/selection.txt: Keras test node ids (relative to
``keras/src``) that call ``fit``, chosen from trainers/, callbacks/, models/,
optimizers/, saving/, metrics/ and the TensorFlow distribute test; a line marked
``# exception:`` is a test of behaviour ``train`` changes on purpose, with the reason
(the book's page *Differences from fit* says what happens instead).

The selection runs in a fresh process (Keras' tests change global state: dtype
policies, logical devices) under tests/keras_suite/keras_suite_plugin.py, which replaces
``keras.Model.fit`` by an adapter that hands each argument of ``fit`` to the argument of
``train`` with the same name. ``KERAS_SUITE=ci`` runs the lines marked ``ci`` (38 tests:
the pinned subset .ci/run's stage "Keras' tests of fit through train" runs),
``KERAS_SUITE=quick`` the lines marked ``quick`` (52), ``KERAS_SUITE=full`` every line
(about half an hour idle; not in CI). Without
``KERAS_SUITE`` (the README's ``python -m pytest``) only the selection is checked and the
run is skipped, so the default collection never runs Keras' suite.

Measured on this 2-core machine under a load average of 7-9 (2026-12-01): the full
selection (203 tests) took 30 min 16 s; the quick part is 52 tests.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent / "keras_suite"
SELECTION = HERE / "selection.txt"


def read_selection() -> tuple[list[str], dict[str, str], set[str]]:
    """The pinned node ids, the exceptions (id -> reason) and the quick part."""
    tests, exceptions, quick = [], {}, set()
    for line in SELECTION.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        node, _, comment = line.partition("#")
        node = node.strip()
        tests.append(node)
        comment = comment.strip()
        if "exception:" in comment:
            exceptions[node] = comment.split("exception:", 1)[1].strip()
        if "quick" in node_tags(line):
            quick.add(node)
    return tests, exceptions, quick


def tagged(tag: str) -> set[str]:
    """The node ids of the selection whose line carries ``tag`` (``quick``, ``ci``)."""
    lines = [line.strip() for line in SELECTION.read_text().splitlines()]
    return {line.partition("#")[0].strip() for line in lines if line and not line.startswith("#")
            and tag in node_tags(line)}


def node_tags(line: str) -> set[str]:
    _, _, comment = line.partition("#")
    return {word.strip(" ,;") for word in comment.split("exception:")[0].split()}


def keras_source() -> pathlib.Path:
    import keras

    return pathlib.Path(keras.__file__).parent / "src"


def run_selection(tests: list[str], tmp_path: pathlib.Path, route: str = "train") -> tuple[dict[str, str], str]:
    """Run ``tests`` in a fresh pytest process with ``fit`` routed to ``route``; their outcomes."""
    source = keras_source()
    record = tmp_path / "record.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parents[1]), env.get("PYTHONPATH", "")])
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    command = [
        sys.executable, "-m", "pytest", "-c", str(HERE / "pytest.ini"), "--rootdir", str(source),
        "--confcutdir", str(source), "-q", "--fit-route", route, "--fit-record", str(record),
        *[str(source / t) for t in tests],
    ]
    # Run from a directory with no Python modules of its own (keras/src holds a
    # package named ``random``, the repository a ``conftest.py``).
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=3600)
    if not record.exists():
        raise AssertionError(f"the Keras suite did not run:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    # The plugin names tests relative to keras/src (the --rootdir).
    return json.loads(record.read_text())["outcomes"], result.stdout


def check(tests, exceptions, outcomes, output) -> None:
    missing = [t for t in tests if t not in outcomes]
    failed = [t for t in tests if t not in exceptions and outcomes.get(t) not in ("passed",)]
    assert not missing, f"not run: {missing[:10]}"
    assert not failed, f"{len(failed)} of {len(tests)} Keras tests fail with train: {failed}\n{output[-5000:]}"


def test_selection_is_pinned_and_every_exception_has_a_reason():
    tests, exceptions, quick = read_selection()
    assert len(tests) == len(set(tests)), "a node id is listed twice"
    assert 100 <= len(tests) <= 250
    assert quick and quick <= set(tests)
    ci = tagged("ci")
    assert 30 <= len(ci) <= 45 and ci <= set(tests) and not ci & set(exceptions)
    assert all(reason for reason in exceptions.values())
    source = keras_source()
    assert all((source / t.split("::")[0]).exists() for t in tests), "a selected file is not in the keras wheel"


@pytest.mark.slow
def test_keras_tests_of_fit_pass_with_train(tmp_path):
    part = os.environ.get("KERAS_SUITE")
    if part not in ("ci", "quick", "full"):
        pytest.skip("Keras' suite runs with KERAS_SUITE=ci (.ci/run's stage), quick or full")
    tests, exceptions, quick = read_selection()
    if part != "full":
        tests = [t for t in tests if t in tagged(part)]
    outcomes, output = run_selection(tests, tmp_path)
    check(tests, exceptions, outcomes, output)
