"""The doctor's remedy for the standard deviation of a constant: sqrt(var + eps), verified.

``keras.ops.std`` and ``tf.math.reduce_std`` have no epsilon argument, and clamping their
input leaves the variance 0 (a constant, a batch of one); the remedy the doctor writes
for a ``Sqrt`` inside them is ``tf.sqrt(tf.math.reduce_variance(x, axis=a) + eps)``, and it
re-runs the failing step with it (the rebuilds of Keras issue 2960 and TensorFlow issue
56830 in the chapter *Finding your own NaN*).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from companion.book.reports import rebuild, run_as_reported
from companion.diagnostics import NaNDoctor
from companion.diagnostics.rewrites import _std_with_eps


@pytest.mark.parametrize("key, name", [("std_of_zero_vector", "keras.ops.std"),
                                       ("std_batch_of_one", "tf.math.reduce_std")])
def test_the_std_of_a_constant_gets_sqrt_of_var_plus_eps_verified_on_the_failing_step(key, name):
    doctor = NaNDoctor(verbose=False)
    run_as_reported(rebuild(key), callbacks=[doctor])
    d = doctor.diagnosis
    assert d.cause == "singular_derivative" and d.forward_op == "Sqrt", str(d)
    assert f"{name}(x, axis=a) -> tf.sqrt(tf.math.reduce_variance(x, axis=a) + 1.19e-07)" in d.remedy
    assert "epsilon argument" not in d.remedy and "tf.maximum" not in d.remedy
    assert d.verified.startswith(f"verified: the step is finite with {name} as sqrt(var + 1.19e-07)"), d.verified


def test_sqrt_of_var_plus_eps_has_a_finite_gradient_on_a_batch_of_one():
    x = tf.Variable([[3.0, -1.0]])  # one row: its variance over the batch is 0
    std = _std_with_eps(float(np.finfo(np.float32).eps))
    with tf.GradientTape() as tape:
        value = tf.reduce_sum(std(tf.math.reduce_std, x, 0))
    assert bool(tf.reduce_all(tf.math.is_finite(tape.gradient(value, x))))
    with tf.GradientTape() as tape:  # the clamp of the input the remedy no longer writes
        clamped = tf.reduce_sum(tf.math.reduce_std(tf.maximum(x, 1.19e-07), 0))
    assert not bool(tf.reduce_all(tf.math.is_finite(tape.gradient(clamped, x))))


def test_keepdims_is_kept():
    std = _std_with_eps(1e-7)
    x = tf.constant([[1.0, 2.0], [3.0, 5.0]])
    assert std(tf.math.reduce_std, x, -1, True).shape == (2, 1)
    assert std(tf.math.reduce_std, x, axis=0).shape == (2,)
    np.testing.assert_allclose(std(tf.math.reduce_std, x, 0).numpy(), np.std(x.numpy(), 0), rtol=1e-3)
