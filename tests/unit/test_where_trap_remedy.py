"""The double where the doctor writes for a ``where_trap``: its safe value is a point where f is finite.

The remedy ``tf.where(c, f(tf.where(c, x, s)), y)`` only works if ``f`` and its gradient
are finite at ``s`` (``companion.numerics.double_where``'s own rule); ``1.0`` is the pole
of ``1 / (1 - x)``, the activation of TensorFlow issue 20355 that the book's chapter
*Finding your own NaN* diagnoses.
"""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from companion.book.reports import rebuild
from companion.diagnostics import diagnose
from companion.diagnostics.rewrites import SAFE_CANDIDATES, _safe_value
from companion.numerics import double_where

# Activations z -> tf.where(z < -2, f(z), z), each with one unselected branch f that is not
# finite at the input z = bad (each tf.where on one line, as the doctor reads the user's line).


def pole_at_one(z):
    return tf.where(z < -2.0, 1.0 / (1.0 - z), z)


def log_at_zero(z):
    return tf.where(z < -2.0, tf.math.log(z), z)


def log_shifted(z):
    return tf.where(z < -2.0, tf.math.log(z - 1.0), z)


def log_at_one(z):
    return tf.where(z < -2.0, tf.math.log(1.0 - z) * 2.0, z)


def pole_and_log(z):
    return tf.where(z < -2.0, 1.0 / tf.square(z - 1.0) + tf.math.log(z), z)


#: Each activation, its unselected branch f, and an input where f is not finite.
BRANCHES = {
    "pole_at_one": (pole_at_one, lambda z: 1.0 / (1.0 - z), 1.0),
    "log_at_zero": (log_at_zero, tf.math.log, 0.0),
    "log_shifted": (log_shifted, lambda z: tf.math.log(z - 1.0), 1.0),
    "log_at_one": (log_at_one, lambda z: tf.math.log(1.0 - z) * 2.0, 1.0),  # not 1.0: log(0)
    "pole_and_log": (pole_and_log, lambda z: 1.0 / tf.square(z - 1.0) + tf.math.log(z), 1.0),
}


class Activation(keras.layers.Layer):
    """``activation(w * x)`` with one scalar weight ``w`` (1 at the start)."""

    def __init__(self, activation, **kwargs):
        super().__init__(**kwargs)
        self.activation = activation

    def build(self, shape):
        self.w = self.add_weight(shape=(), initializer="ones", name="w")

    def call(self, x):
        return self.activation(self.w * x)


def _written_safe_value(remedy: str) -> float:
    found = re.search(r"tf\.where\(c, f\(tf\.where\(c, x, (-?[\d.]+)\)\), y\)", remedy)
    assert found is not None, remedy
    return float(found.group(1))


def _value_and_gradient(f, at: float):
    point = tf.constant(at, tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(point)
        value = f(point)
    return value, tape.gradient(value, point)


@pytest.mark.parametrize("name", list(BRANCHES))
def test_the_written_safe_value_gives_a_finite_f_and_a_finite_gradient(name):
    activation, f, bad = BRANCHES[name]
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), Activation(activation, name="activation")])
    x, y = np.full((2, 1), bad, np.float32), np.ones((2, 1), np.float32)
    d = diagnose(model, (x, y), loss="mse")
    assert d is not None and d.cause == "where_trap", str(d)
    safe = _written_safe_value(d.remedy)
    value, gradient = _value_and_gradient(f, safe)
    assert bool(tf.math.is_finite(value)) and bool(tf.math.is_finite(gradient)), (name, safe)
    # and the double where written with it makes the gradient finite at the trap
    w = tf.Variable(1.0)
    with tf.GradientTape() as tape:
        z = w * x
        loss = tf.reduce_sum(tf.where(z < -2.0, f(tf.where(z < -2.0, z, safe)), z))
    assert bool(tf.math.is_finite(tape.gradient(loss, w))), (name, safe)


def test_the_book_s_activation_gets_a_safe_value_off_its_pole():
    # tf.where(x < 0, 1/(1 - x), log(x + 1)) of TensorFlow issue 20355: 1.0 is 1/(1 - x)'s pole.
    r = rebuild("where_activation")
    d = diagnose(r.model, r.data, loss=r.loss)
    safe = _written_safe_value(d.remedy)
    assert safe != 1.0
    value, gradient = _value_and_gradient(lambda z: 1.0 / (1.0 - z), safe)
    assert bool(tf.math.is_finite(value)) and bool(tf.math.is_finite(gradient))
    z = tf.Variable([1.0])  # the input of the report, where the branch 1 / (1 - z) is not taken
    with tf.GradientTape() as tape:
        fixed = double_where(z < 0, lambda t: 1.0 / (1.0 - t), z, tf.math.log(z + 1.0), safe_x=safe)
    assert bool(tf.reduce_all(tf.math.is_finite(tape.gradient(fixed, z))))


def test_only_the_branch_that_holds_the_op_constrains_the_safe_value():
    code = "return tf.where(z < 0, 1.0 / (1.0 - z), tf.math.log(z + 1.0))"
    assert _safe_value("Log", None, code, "float32") == 1.0  # log(1 + 1) is finite
    assert _safe_value("RealDiv", None, code, "float32") == 0.0  # 1 / (1 - 1) is not


def test_a_branch_the_doctor_cannot_evaluate_gets_no_value():
    # a call the doctor will not make for the user (the model), or no expression at all
    assert _safe_value("Log", None, "return tf.where(c, model(x), y)", "float32") is None
    assert _safe_value("Log", None, "for x in y:", "float32") is None
    assert _safe_value("Log", None, "return tf.where(c, tf.math.log(x) - 1e40 * x, x)", "float32") in (
        None, *SAFE_CANDIDATES)


def test_a_remedy_without_a_safe_value_says_what_the_value_must_be():
    from companion.diagnostics.rewrites import _where_trap

    remedy = _where_trap("", "Log", None, "y = model(x)", "float32")
    assert "tf.where(c, x, s)" in remedy and "s, a value where f and its gradient are finite" in remedy


def test_a_numpy_array_of_the_notebook_is_not_taken_for_the_branch_s_input(monkeypatch):
    import __main__

    monkeypatch.setattr(__main__, "z", np.array([1.0, 1.0], np.float32), raising=False)
    code = "return tf.where(z < 0, 1.0 / (1.0 - z), tf.math.log(z + 1.0))"
    assert _safe_value("RealDiv", "<cell>:1", code, "float32") == 0.0


def test_a_float16_branch_is_tried_in_float16():
    # exp(2 * 11.2) overflows float16 (max 65504) but not float32
    code = "return tf.where(c, x, tf.exp(11.2 * (x + 1.0)))"
    assert _safe_value("Exp", None, code, "float32") == 1.0
    assert _safe_value("Exp", None, code, "float16") == -1.0
    assert keras.backend.floatx() == "float32"
