"""Tests of companion.diagnostics: per-variable gradient reports and locating the first NaN."""

from __future__ import annotations

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

from companion.diagnostics import (
    GradientRecord,
    GradientReport,
    NonFiniteLocation,
    locate_nonfinite,
    nonfinite_gradients,
)
from training_data import SqrtOfProduct


class LogLayer(keras.layers.Layer):
    def call(self, x):
        return tf.math.log(x)  # the line locate_nonfinite must point at


def sqrt_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((1,)), SqrtOfProduct(name="sqrt_wx"), keras.layers.Dense(1, name="head")], name="net"
    )


def line_of(obj, text: str) -> int:
    lines, start = inspect.getsourcelines(obj)
    return start + next(i for i, line in enumerate(lines) if text in line)


# --------------------------------------------------------------------------------------
# nonfinite_gradients
# --------------------------------------------------------------------------------------


def test_nonfinite_gradients_names_only_the_variable_with_the_nan_gradient():
    model = sqrt_model()
    # Target 1 at x = 0 makes the upstream gradient there non-zero (TF's SqrtGrad maps 0/0 to 0).
    batch = (tf.constant([[0.0], [4.0]]), tf.constant([[1.0], [2.0]]))
    report = nonfinite_gradients(model, "mse", batch)

    assert isinstance(report, GradientReport) and len(report) == 3
    assert [r.path for r in report] == [v.path for v in model.trainable_variables]
    assert [r.path for r in report.nonfinite] == ["net/sqrt_wx/w"]
    (bad,) = report.nonfinite
    assert (bad.nan_count, bad.inf_count, bad.shape) == (1, 0, ())
    assert np.isnan(bad.max_abs)  # no finite entry at all
    assert not report.all_finite


def test_nonfinite_gradients_matches_the_tape_on_a_finite_batch():
    model = sqrt_model()
    x, y = tf.constant([[1.0], [4.0]]), tf.constant([[1.0], [1.0]])
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(y - model(x, training=True)))
    expected = tape.gradient(loss, model.trainable_variables)

    report = nonfinite_gradients(model, keras.losses.MeanSquaredError(), (x, y))
    assert report.all_finite and report.nonfinite == ()
    for record, gradient in zip(report, expected):
        assert record.max_abs == pytest.approx(float(np.max(np.abs(gradient.numpy()))), rel=1e-6)
        assert record.nan_count == record.inf_count == 0


def test_nonfinite_gradients_updates_nothing():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3), keras.layers.BatchNormalization()])
    before = [v.numpy().copy() for v in model.variables]
    nonfinite_gradients(model, "mse", (np.full((4, 2), np.nan, "float32"), np.zeros((4, 3), "float32")))
    # Batch-norm statistics would be NaN had the forward pass's update been kept.
    assert all(np.array_equal(v.numpy(), b) for v, b in zip(model.variables, before))


def test_nonfinite_gradients_counts_infinities_and_missing_gradients():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((1,))
    used = keras.layers.Dense(1, name="used")(inputs)
    keras.layers.Dense(1, name="unused")(inputs)
    model = keras.Model(inputs, used)
    report = nonfinite_gradients(model, "mse", (np.array([[np.inf]], "float32"), np.array([[0.0]], "float32")))
    assert report[0].path.endswith("used/kernel") and report[0].inf_count + report[0].nan_count == 1


def test_gradient_report_prints_an_aligned_table():
    report = GradientReport(
        [
            GradientRecord("net/dense/kernel", (4, 8), nan_count=3, inf_count=1, max_abs=1.5),
            GradientRecord("net/dense/bias", (8,), nan_count=0, inf_count=0, max_abs=0.25),
            GradientRecord("net/unused", (2,), 0, 0, 0.0, has_gradient=False),
            GradientRecord("net/poisoned", (2,), nan_count=2, inf_count=0, max_abs=float("nan")),
        ]
    )
    lines = str(report).splitlines()
    assert lines[0].split() == ["variable", "shape", "NaN", "Inf", "max", "|finite|"]
    assert lines[1].split() == ["net/dense/kernel", "(4,", "8)", "3", "1", "1.50e+00"]
    assert lines[3].split()[-2:] == ["no", "gradient"]
    assert lines[4].split()[-2:] == ["none", "finite"]  # not "nan": there is no finite entry to measure
    assert len({len(line) for line in lines[:3]}) == 1  # aligned columns
    assert [r.path for r in report.nonfinite] == ["net/dense/kernel", "net/poisoned"]
    assert str(report[3]).endswith("2 NaN, 0 Inf, max |finite| none finite")
    assert "3 NaN, 1 Inf" in str(report[0])


def test_gradient_report_renders_as_the_books_html_table():
    report = GradientReport(
        [
            GradientRecord("net/dense/kernel", (4, 8), nan_count=3, inf_count=1, max_abs=1.5),
            GradientRecord("net/unused", (2,), 0, 0, 0.0, has_gradient=False),
        ]
    )
    page = report._repr_html_()
    assert page.count("<tr>") == 3 and page.count("<th ") == 5  # a header and one row per record
    for cell in ("net/dense/kernel", "(4, 8)", ">3<", ">1<", "1.50e+00", "no gradient"):
        assert cell in page


def test_nonfinite_gradients_rejects_bad_arguments():
    model = sqrt_model()
    batch = (np.ones((2, 1), "float32"), np.ones((2, 1), "float32"))
    with pytest.raises(TypeError, match=r"batch must be an \(inputs, targets\) pair, got a tuple of length 3"):
        nonfinite_gradients(model, "mse", batch + batch[:1])
    with pytest.raises(TypeError, match=r"model must be a Keras model"):
        nonfinite_gradients(lambda x: x, "mse", batch)
    with pytest.raises(TypeError, match=r"loss must be a callable"):
        nonfinite_gradients(model, None, batch)
    with pytest.raises(ValueError, match=r"prediction shape \(2, 1\) does not match target shape \(2,\)"):
        nonfinite_gradients(model, lambda y, p: tf.square(y - p), (batch[0], np.ones(2, "float32")))


# --------------------------------------------------------------------------------------
# locate_nonfinite
# --------------------------------------------------------------------------------------


def test_locate_finds_a_forward_nan_in_a_layer():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), LogLayer(name="log")], name="fwd")
    where = locate_nonfinite(model, tf.constant([[1.0, -1.0]]))

    assert isinstance(where, NonFiniteLocation)
    assert (where.op_type, where.phase, where.gradient_of) == ("Log", "forward", None)
    assert where.op_name == "fwd/log/Log" and where.layer == "fwd/log"
    assert where.filename == __file__ and where.lineno == line_of(LogLayer, "tf.math.log(x)")
    assert where.source == "return tf.math.log(x)  # the line locate_nonfinite must point at"
    assert (where.nan_count, where.inf_count, where.dtype, where.shape) == (1, 0, "float32", (1, 2))
    assert "Log" in str(where) and "test_diagnostics.py" in str(where)


def test_locate_finds_a_gradient_nan_under_a_finite_forward_pass():
    model = sqrt_model()

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(y - model(x)))
        return tape.gradient(loss, model.trainable_variables)

    where = locate_nonfinite(step, tf.constant([[0.0]]), tf.constant([[1.0]]))
    # The first non-finite value is the Inf of d sqrt(u) / du at u = 0 (the NaN comes after).
    assert (where.op_type, where.phase, where.gradient_of) == ("SqrtGrad", "gradient", "Sqrt")
    assert where.op_name.startswith("gradient_tape") and where.inf_count == 1
    # The layer and line of the forward op (as PyTorch's anomaly mode), then where the tape ran.
    assert where.layer == "net/sqrt_wx" and where.filename.endswith("training_data.py")
    assert where.lineno == line_of(SqrtOfProduct.call, "tf.sqrt") and "tf.sqrt" in where.source
    assert where.gradient_lineno == line_of(step, "tape.gradient")
    page = where._repr_html_()  # the same fields, as a table in a notebook
    assert "SqrtGrad" in page and "gradient of Sqrt" in page and "net/sqrt_wx" in page
    assert f"training_data.py:{where.lineno}" in page and f":{where.gradient_lineno}<" in page


def test_locate_sees_through_xla_compiled_functions():
    @tf.function(jit_compile=True)
    def compiled(x):
        return tf.math.log(x) * 2.0

    where = locate_nonfinite(compiled, tf.constant([0.0, 1.0]))
    assert where is not None and where.op_type == "Log" and where.inf_count == 1
    assert where.lineno == line_of(compiled.python_function, "tf.math.log(x)")


def test_locate_returns_none_when_everything_is_finite_and_restores_tf_state():
    assert not tf.config.functions_run_eagerly()
    assert locate_nonfinite(lambda x: tf.exp(x), tf.constant(1.0)) is None
    assert locate_nonfinite(lambda: tf.math.log(-1.0)).op_type == "Log"
    assert not tf.config.functions_run_eagerly()
    assert tf.debugging.is_traceback_filtering_enabled() and keras.config.is_traceback_filtering_enabled()
    assert np.isnan(tf.math.log(-1.0).numpy())  # numerics checks are off again


def test_locate_restores_state_when_fn_raises_and_propagates_the_error():
    def broken():
        raise KeyError("not a numerics problem")

    with pytest.raises(KeyError, match="not a numerics problem"):
        locate_nonfinite(broken)
    assert not tf.config.functions_run_eagerly()
    assert np.isinf(tf.math.log(0.0).numpy())


def test_locate_keeps_check_numerics_on_if_the_user_had_it_on():
    tf.debugging.enable_check_numerics()
    try:
        assert locate_nonfinite(lambda: tf.sqrt(-1.0)).op_type == "Sqrt"
        with pytest.raises(tf.errors.InvalidArgumentError):
            tf.math.log(0.0)
    finally:
        tf.debugging.disable_check_numerics()


def test_locate_rejects_a_non_callable():
    with pytest.raises(TypeError, match="fn must be callable, got int"):
        locate_nonfinite(3)
