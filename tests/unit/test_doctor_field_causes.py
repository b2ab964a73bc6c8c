"""The doctor's causes read from what the values did, on public reports (issue 42, item 7).

An infinite output from finite inputs is an overflow when the same op computes a finite
value beyond the dtype's range in float64 (a Bessel function of a large argument), and a
pole or domain edge when it is infinite or NaN at any precision; a log at 0 inside
TensorFlow's own gradient formula is named from that op's inputs, traced to the argument
of the user's call that it reads, and that argument is kept off 0 on the user's line.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from companion.diagnostics import diagnose

HERE = __file__
EPS = 1.19e-07  # float32's eps as the remedy prints it


def line_of(marker: str) -> int:
    """The line of this file that ends with ``# <marker>``."""
    lines = open(HERE).read().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if line.rstrip().endswith(f"# {marker}"))


class ExponentialCdf(keras.layers.Layer):
    """The CDF of an exponential waiting time, P(1, rate * t): a Gamma CDF of shape 1."""

    def __init__(self, fixed=False, **kwargs):
        super().__init__(**kwargs)
        self.fixed = fixed

    def call(self, inputs):
        rate = tf.nn.softplus(inputs[:, :1])
        elapsed = tf.nn.relu(inputs[:, 1:2]) * rate
        if self.fixed:  # the remedy, as printed
            return tf.math.igamma(tf.ones_like(rate), tf.maximum(elapsed, EPS))
        return tf.math.igamma(tf.ones_like(rate), elapsed)  # gamma-cdf


def _survival(fixed=False):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="hazard"),
                              ExponentialCdf(fixed, name="cdf")], name="survival")
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(32, 2)).astype("float32")
    return model, x, np.full((32, 1), 0.5, "float32")


def test_zero_log_zero_inside_tensorflow_s_igamma_gradient_is_a_log_of_zero_at_the_user_s_argument():
    """tensorflow/tensorflow#123578 (https://github.com/tensorflow/tensorflow/issues/123578).

    The gradient of ``tf.math.igamma(a, x)`` with respect to ``x`` is NaN at ``a = 1,
    x = 0``: TensorFlow's gradient computes ``(a - 1) * log(x) = 0 * -inf`` although
    ``igamma(1, x) = 1 - exp(-x)`` has the derivative 1 there. The doctor called the
    ``-inf`` of that ``Log`` an overflow.
    """
    model, x, y = _survival()
    d = diagnose(model, (x, y), batch_size=8)
    assert (d.phase, d.op, d.forward_op, d.cause, d.layer) == ("backward", "Log", "Igamma", "log_of_zero",
                                                               "survival/cdf"), str(d)
    assert d.source == f"{HERE}:{line_of('gamma-cdf')}"
    assert "inputs of Log are exactly 0, inside TensorFlow's gradient of Igamma: argument 2 (x)" in d.inputs_summary
    assert d.remedy == (f"at test_doctor_field_causes.py:{line_of('gamma-cdf')}: the Log at 0 is in TensorFlow's "
                        "gradient of tf.math.igamma, which you cannot edit: tf.math.igamma(a, x) -> "
                        "tf.math.igamma(a, tf.maximum(x, 1.19e-07)) (x kept off 0, where that gradient is 0 * log 0 "
                        "or 1/0)"), d.remedy
    assert d.verified.startswith("verified: the step is finite with igamma's x clamped at 1.19e-07"), d.verified
    model, x, y = _survival(fixed=True)
    history = model.fit(x, y, epochs=2, batch_size=8, verbose=0, shuffle=False)
    assert np.isfinite(history.history["loss"]).all()


def von_mises_nll(y_true, y_pred):
    mu, kappa = y_pred[:, :1], tf.exp(y_pred[:, 1:2])
    log_norm = tf.math.log(2.0 * np.pi * tf.math.bessel_i0(kappa))  # log-i0
    return tf.reduce_mean(log_norm - kappa * tf.cos(y_true - mu))


def test_a_bessel_function_beyond_float32_is_an_overflow_not_a_domain_edge():
    """pymc-devs/pymc#2832 (https://github.com/pymc-devs/pymc/pull/2832).

    The von Mises log-likelihood's ``log(I0(kappa))`` overflows for a large
    concentration ("before, both overflow"): ``I0(100)`` is about 1e42, finite in
    float64 and beyond float32's range. The doctor called it a domain edge.
    """
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_initializer="ones", name="head")],
                             name="direction")
    model.compile(optimizer="sgd", loss=von_mises_nll)
    x = np.full((8, 3), 1.6, "float32")  # log-concentration 4.8: kappa about 120
    d = diagnose(model, (x, np.zeros((8, 1), "float32")))
    assert (d.phase, d.op, d.cause) == ("loss", "BesselI0", "overflow"), str(d)
    assert d.source == f"{HERE}:{line_of('log-i0')}"
    assert "outputs of BesselI0 are beyond float32's max 3.4028e+38: up to" in d.inputs_summary, d.inputs_summary
    assert "in float64" in d.inputs_summary


def test_a_pole_stays_a_domain_edge():
    """``ndtri(1)`` is infinite at any precision: the edge of its domain, not an overflow."""
    model = keras.Sequential([keras.Input((1,)), keras.layers.Lambda(lambda p: tf.math.ndtri(p))])
    model.compile(optimizer="sgd", loss="mse")
    d = diagnose(model, (np.array([[0.5], [1.0]], "float32"), np.zeros((2, 1), "float32")))
    assert (d.op, d.cause) == ("Ndtri", "domain_edge"), str(d)
    assert "in float64 as well" in d.inputs_summary
