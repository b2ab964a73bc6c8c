"""companion.numerics.double_where: right values, finite gradients, clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from companion.numerics import double_where

FLOAT_DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64]


def _value_and_gradient(fn, x):
    x = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fn(x)
    return y, tape.gradient(y, x)


def test_single_where_has_nan_gradient_that_double_where_removes():
    x = tf.constant([0.0, 1.0, 4.0])
    _, naive = _value_and_gradient(lambda t: tf.where(t > 0, tf.math.log(t), 0.0), x)
    value, fixed = _value_and_gradient(lambda t: double_where(t > 0, tf.math.log, t, 0.0), x)
    assert np.isnan(naive.numpy()[0])  # the trap the chapter shows is real in this TF
    np.testing.assert_array_equal(value.numpy(), [0.0, 0.0, np.log(4.0).astype(np.float32)])
    np.testing.assert_array_equal(fixed.numpy(), [0.0, 1.0, 0.25])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.name)
def test_double_where_keeps_dtype_and_gradient_is_zero_outside_condition(dtype):
    x = tf.constant([-2.0, 0.0, 0.25, 9.0], dtype=dtype)
    value, grad = _value_and_gradient(lambda t: double_where(t > 0, tf.sqrt, t, -1.0), x)
    assert value.dtype == dtype and grad.dtype == dtype
    np.testing.assert_allclose(tf.cast(value, tf.float64).numpy(), [-1.0, -1.0, 0.5, 3.0], rtol=1e-2)
    np.testing.assert_allclose(tf.cast(grad, tf.float64).numpy(), [0.0, 0.0, 1.0, 1.0 / 6.0], rtol=1e-2)


@given(
    hnp.arrays(
        np.float32,
        st.integers(1, 16),
        elements=st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=False),
    )
)
def test_double_where_of_log_is_exact_inside_and_finite_everywhere(values):
    # Normal-range inputs: 1/x overflows for subnormal x, and TF flushes subnormals on CPU.
    x = tf.constant(values)
    value, grad = _value_and_gradient(lambda t: double_where(t > 0, tf.math.log, t, 0.0), x)
    positive = values > 0
    assert np.all(np.isfinite(grad.numpy()))
    # Where the condition holds, value and gradient are bit-identical to the plain function's.
    np.testing.assert_array_equal(value.numpy()[positive], tf.math.log(x).numpy()[positive])
    _, plain_grad = _value_and_gradient(tf.math.log, x)
    np.testing.assert_array_equal(grad.numpy()[positive], plain_grad.numpy()[positive])
    np.testing.assert_array_equal(value.numpy()[~positive], 0.0)
    np.testing.assert_array_equal(grad.numpy()[~positive], 0.0)


def test_double_where_broadcasts_otherwise_tensor():
    x = tf.constant([[0.0, 4.0], [1.0, -1.0]])
    otherwise = tf.constant([10.0, 20.0])
    out = double_where(x > 0, tf.sqrt, x, otherwise)
    np.testing.assert_array_equal(out.numpy(), [[10.0, 2.0], [1.0, 20.0]])


def test_double_where_works_under_xla():
    fn = tf.function(lambda t: double_where(t > 0, tf.math.log, t, 0.0), jit_compile=True)
    np.testing.assert_array_equal(fn(tf.constant([0.0, 1.0])).numpy(), [0.0, 0.0])


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"x": tf.constant([1, 2])}, TypeError, "floating dtype.*int32"),
        ({"x": "abc"}, TypeError, "string"),
        ({"condition": tf.constant([1.0, 0.0])}, TypeError, "boolean.*float32"),
        ({"fn": "log"}, TypeError, "callable.*str"),
    ],
)
def test_double_where_rejects_bad_input_with_clear_message(kwargs, error, message):
    args = {"condition": tf.constant([True, False]), "fn": tf.math.log, "x": tf.constant([1.0, 0.0])}
    args.update(kwargs)
    with pytest.raises(error, match=message):
        double_where(args["condition"], args["fn"], args["x"])


def test_double_where_keeps_float64_numpy_input_in_float64():
    x = np.array([1e300, 0.0])  # 1e300 overflows float32
    out = double_where(x > 0, tf.math.log, x, 0.0)
    assert out.dtype == tf.float64
    np.testing.assert_allclose(out.numpy(), [np.log(1e300), 0.0], rtol=1e-15)
