"""A pytest plugin that runs Keras' own tests of ``fit`` with ``fit`` routed to ``train``.

Loaded with ``-p keras_suite_plugin`` (``tests/keras_suite`` on ``sys.path``; see
tests/contracts/test_keras_suite.py, which runs the pinned selection this way). Options:

* ``--fit-route=fit`` (default) leaves ``keras.Model.fit`` alone: the baseline;
* ``--fit-route=train`` replaces ``fit`` on every Keras model by :func:`train_as_fit`,
  which calls :func:`companion.training.train` with each of ``fit``'s arguments passed
  to the argument of ``train`` with the same name: one to one, nothing emulated. A call
  of ``fit`` made by ``train`` itself goes to Keras' ``fit``.
* ``--fit-record=PATH`` writes, per test, how many times it called ``fit`` and its
  outcome (JSON), which is how the selection was chosen (tests that call ``fit``), and
  the keras, TensorFlow and companion the run imported.
"""

from __future__ import annotations

import json
import threading

import pytest

_ORIGINAL = {}
_STATE = threading.local()
_CALLS: dict[str, int] = {}
_OUTCOMES: dict[str, str] = {}
_CURRENT = {"nodeid": None}

#: fit's parameters, in fit's order: each goes to train's argument of the same name.
FIT_ARGUMENTS = (
    "x", "y", "batch_size", "epochs", "verbose", "callbacks", "validation_split", "validation_data", "shuffle",
    "class_weight", "sample_weight", "initial_epoch", "steps_per_epoch", "validation_steps",
    "validation_batch_size", "validation_freq",
)


def pytest_addoption(parser):
    group = parser.getgroup("keras_suite")
    group.addoption("--fit-route", choices=("fit", "train"), default="fit", help="what keras.Model.fit runs")
    group.addoption("--fit-record", default=None, help="write the fit calls and outcome of every test here (JSON)")


def train_as_fit(self, *args, **kwargs):
    """``fit``'s signature; every argument is handed to ``train`` under its own name."""
    if getattr(_STATE, "inside_train", False):
        return _ORIGINAL["fit"](self, *args, **kwargs)
    from companion.training import train

    named = dict(zip(FIT_ARGUMENTS, args))
    overlap = set(named) & set(kwargs)
    if overlap:
        raise TypeError(f"fit() got multiple values for {sorted(overlap)}")
    named.update(kwargs)
    unknown = set(named) - set(FIT_ARGUMENTS)
    if unknown:
        raise TypeError(f"fit() got unexpected keyword arguments {sorted(unknown)}")
    x = named.pop("x", None)
    _STATE.inside_train = True
    try:
        return train(self, x, **named)
    finally:
        _STATE.inside_train = False


def _counting(fit):
    def counted_fit(self, *args, **kwargs):
        if not getattr(_STATE, "counting", False):
            nodeid = _CURRENT["nodeid"]
            if nodeid is not None:
                _CALLS[nodeid] = _CALLS.get(nodeid, 0) + 1
        _STATE.counting = True
        try:
            return fit(self, *args, **kwargs)
        finally:
            _STATE.counting = False

    return counted_fit


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """trainer_test.py imports jax at module level and uses it only in jax-backend
    tests (not selected): without jax installed, an empty module stands in for it while
    that file is imported (and only then: Keras itself checks whether jax exists)."""
    import importlib.util
    import sys
    import types

    stub = (
        isinstance(collector, pytest.Module)
        and collector.path.name == "trainer_test.py"
        and "jax" not in sys.modules
        and importlib.util.find_spec("jax") is None
    )
    if stub:
        sys.modules["jax"] = types.ModuleType("jax")
    try:
        yield
    finally:
        if stub:
            sys.modules.pop("jax", None)


def pytest_configure(config):
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    _ORIGINAL["fit"] = TensorFlowTrainer.fit
    route = config.getoption("--fit-route")
    fit = train_as_fit if route == "train" else _ORIGINAL["fit"]
    TensorFlowTrainer.fit = _counting(fit)
    config.stash_route = route


def pytest_runtest_setup(item):
    _CURRENT["nodeid"] = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _OUTCOMES[item.nodeid] = report.outcome
        path = item.config.getoption("--fit-record")
        if path:  # one line per test as it ends, so that an interrupted run still tells
            with open(path + ".jsonl", "a") as f:
                line = {"test": item.nodeid, "outcome": report.outcome, "fit_calls": _CALLS.get(item.nodeid, 0),
                        "seconds": round(report.duration, 2)}
                f.write(json.dumps(line) + "\n")


def pytest_runtest_teardown(item):
    _CURRENT["nodeid"] = None


def imported() -> dict[str, str]:
    """The keras (version and file), TensorFlow and companion this run imported (companion
    from where it would be imported, if the run did not: route ``fit``)."""
    import importlib.util
    import pathlib
    import sys

    import keras
    import tensorflow

    companion = sys.modules.get("companion")
    origin = companion.__file__ if companion is not None else importlib.util.find_spec("companion").origin
    return {"keras": keras.__version__, "keras_file": str(pathlib.Path(keras.__file__).resolve()),
            "tensorflow": str(pathlib.Path(tensorflow.__file__).resolve()),
            "companion": str(pathlib.Path(origin).resolve())}


def pytest_unconfigure(config):
    path = config.getoption("--fit-record")
    if path:
        record = {"calls": _CALLS, "outcomes": _OUTCOMES, "imported": imported()}
        with open(path, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
    if "fit" in _ORIGINAL:
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

        TensorFlowTrainer.fit = _ORIGINAL["fit"]
