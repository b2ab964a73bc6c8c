"""companion.book.reproductions, case A: what the answer's check_numerics does and does not check."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from companion.book.reproductions import seed_checked_power

X = tf.constant([0.0, 0.5, 2.0])


def test_seed_checked_power_passes_its_checks_while_the_gradient_is_nan():
    a = tf.Variable(1.5)
    with tf.GradientTape() as tape:
        value = tf.reduce_sum(seed_checked_power(X, a, 0.998))  # raises if a check fires
    assert np.isfinite(float(value))
    assert np.isnan(float(tape.gradient(value, a)))


def _gradient_through_returned_check(x, a):
    with tf.GradientTape() as tape:
        u = tf.debugging.check_numerics(a * x, "after a*x")
        value = tf.reduce_sum(tf.pow(u, 0.998))
    return tape.gradient(value, a)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_check_numerics_on_the_returned_tensor_catches_the_backward_inf(mode):
    function = _gradient_through_returned_check
    if mode == "graph":
        function = tf.function(function, jit_compile=False)
    with pytest.raises(tf.errors.InvalidArgumentError, match="detected in gradient"):
        function(X, tf.Variable(1.5))


def test_check_numerics_is_the_identity_under_xla():
    # A canary for the book's claim (TensorFlow issues #117319, #118075): if XLA starts
    # checking, this fails and case_a/clipping_and_guards must be updated.
    gradient = tf.function(_gradient_through_returned_check, jit_compile=True)(X, tf.Variable(1.5))
    assert np.isnan(float(gradient))
