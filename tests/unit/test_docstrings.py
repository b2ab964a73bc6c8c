"""Every example in a public docstring of companion runs and prints what it shows.

One doctest per public object (the names in each submodule's ``__all__``, with their
methods), run with the module's namespace plus ``keras``, ``np`` and ``tf``, which the
examples use without importing.
"""

from __future__ import annotations

import doctest
import importlib
import sys

import keras
import matplotlib
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework.config import disable_op_determinism, is_op_determinism_enabled

import companion


def _public_examples():
    finder = doctest.DocTestFinder(exclude_empty=True)
    for module_name in companion._SUBMODULES:
        module = importlib.import_module(f"companion.{module_name}")
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            # The names of the module that defines it (a private one, for re-exported objects) and of the public one.
            home = sys.modules.get(getattr(obj, "__module__", None) or module.__name__, module)
            globs = {**vars(home), **vars(module), "keras": keras, "np": np, "tf": tf}
            for test in finder.find(obj, f"companion.{module_name}.{name}", module=module, globs=globs):
                if test.examples:
                    yield pytest.param(test, id=test.name)


EXAMPLES = list(_public_examples())


@pytest.fixture(autouse=True)
def _restore_global_state():
    """An example may call companion.book.notebook.setup(): later tests get TF's and matplotlib's defaults back."""
    determinism = is_op_determinism_enabled()
    params = dict(matplotlib.rcParams)
    yield
    if not determinism and is_op_determinism_enabled():
        disable_op_determinism()
    matplotlib.rcParams.update(params)


@pytest.mark.parametrize("test", EXAMPLES)
def test_docstring_example_runs(test):
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    result = runner.run(test, out=report.append)
    assert result.failed == 0, "".join(report)


def test_the_examples_of_the_training_and_diagnostics_api_are_collected():
    names = {param.values[0].name for param in EXAMPLES}
    expected = {
        "companion.training.train",
        "companion.training.SkipNonFinite",
        "companion.optimizers.SkipNonFinite",
        "companion.diagnostics.nonfinite_gradients",
        "companion.diagnostics.locate_nonfinite",
        "companion.diagnostics.GradientReport",
        "companion.diagnostics.diagnose",
        "companion.diagnostics.diagnose_function",
        "companion.diagnostics.NaNDoctor",
        "companion.numerics.double_where",
        "companion.losses.resolve_loss",
        "companion.losses.mean_loss",
    }
    assert expected <= names, sorted(expected - names)


def test_train_docstring_is_a_reference_of_at_most_seventy_lines():
    """``train``'s docstring is its reference (arguments, returns, raises, one example);
    the design and its reasons live in the chapter it names (issue 41)."""
    import inspect

    from companion.training import train

    lines = inspect.getdoc(train).splitlines()
    assert len(lines) <= 70, len(lines)
    assert "A training loop that survives NaN" in " ".join(" ".join(lines).split())
