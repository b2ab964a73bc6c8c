"""TensorFlow's and Keras' own NaN tools on one rebuilt report (companion.book.debugging)."""

from __future__ import annotations

import pytest
import tensorflow as tf

from companion.book import debugging
from companion.book.reports import rebuild


@pytest.fixture(scope="module")
def runs():
    return {(run.tool, run.xla): run for run in debugging.compare_tools("probabilities_crossentropy")}


def test_every_tool_runs_with_and_without_xla(runs):
    assert set(runs) == {(tool, xla) for tool in debugging.TOOLS for xla in (False, True)}


def test_check_numerics_op_raises_without_xla_and_checks_nothing_with_it(runs):
    assert runs["check_numerics op", False].stopped and runs["check_numerics op", False].weights_finite
    assert not runs["check_numerics op", True].stopped  # compiled to the identity (tensorflow#117319)
    assert not runs["check_numerics op", True].weights_finite


def test_enable_check_numerics_names_the_op_and_line_and_does_not_compile_under_xla(runs):
    plain, xla = runs["enable_check_numerics", False], runs["enable_check_numerics", True]
    # (The line is the rebuild's in companion/book/reports.py; where companion is an installed
    # package, as on the other stacks, the first frame outside site-packages is this file's.)
    assert plain.op == "Log" and plain.line is not None
    assert xla.xla and xla.failed is not None and "no XLA kernel" in xla.failed


def test_debugger_v2_finds_the_op_in_its_dump_without_stopping(runs):
    plain = runs["Debugger V2", False]
    assert not plain.stopped and plain.op == "Log" and plain.line is not None
    assert runs["Debugger V2", True].failed is not None


def test_terminate_on_nan_names_only_the_batch_after_the_update(runs):
    for xla in (False, True):
        run = runs["TerminateOnNaN", xla]
        assert run.stopped and run.batch == "epoch 0, batch 0" and run.op is None and not run.weights_finite


def test_the_doctor_names_op_line_and_batch_and_keeps_the_weights_in_both_modes(runs):
    for xla in (False, True):
        run = runs["NaNDoctor", xla]
        assert run.xla == xla and (run.op, run.line) == ("Log", "reports.py:252") and run.weights_finite


def test_xla_allowed_puts_op_determinism_back():
    from tensorflow.python.framework import config

    before = config.is_op_determinism_enabled()
    with debugging.xla_allowed():
        assert not config.is_op_determinism_enabled()
    assert config.is_op_determinism_enabled() == before


def test_the_xla_rebuild_is_compiled_with_xla_under_op_determinism():
    from tensorflow.python.framework import config

    before = config.is_op_determinism_enabled()
    tf.config.experimental.enable_op_determinism()
    try:
        assert rebuild("probabilities_crossentropy").model.jit_compile is True
    finally:
        if not before:  # as it was: a later test's jit_compile=True would be dropped
            config.disable_op_determinism()
