"""companion.reproductions, case B: the seed's f fails exactly as the book says it does.

These tests pin the failures the chapters show (measured with TF 2.21, float32): if a
TensorFlow upgrade changes one of them, the chapter text has to change too.
"""

from __future__ import annotations

import mpmath
import numpy as np
import pytest
import tensorflow as tf

from companion.numerics import tilted_mean
from companion.reproductions import naive_tilted_mean, seed_blended_f, seed_taylor

MODES = ["eager", "xla"]


def _value_and_gradient(fn, x, mode="eager"):
    def run(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
        return y, tape.gradient(y, x)

    if mode == "xla":
        run = tf.function(run, jit_compile=True)
    y, g = run(tf.constant(x, tf.float32))
    return y.numpy(), g.numpy()


def _true_f(x: float) -> float:
    with mpmath.workdps(50):
        x = mpmath.mpf(x)
        return 0.5 if x == 0 else float(1 / (1 - mpmath.exp(-x)) - 1 / x)


# --- the seed's sigmoid blend --------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_seed_blend_returns_minus_44_9_at_one_millionth(mode):
    value, _ = _value_and_gradient(seed_blended_f, [1e-6], mode)
    assert value[0] == pytest.approx(-44.9, abs=0.05)
    assert _true_f(1e-6) == pytest.approx(0.5, abs=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_seed_blend_is_nan_at_zero(mode):
    value, _ = _value_and_gradient(seed_blended_f, [0.0], mode)
    assert np.isnan(value[0])


@pytest.mark.parametrize("mode", MODES)
def test_seed_blend_gradient_is_nan_at_zero_minus_100_and_minus_1000(mode):
    x = [0.0, -100.0, -1000.0, -50.0, 50.0]
    value, gradient = _value_and_gradient(seed_blended_f, x, mode)
    assert np.all(np.isnan(gradient[:3]))
    # The values at -100 and -1000 are fine: only the gradient is NaN there.
    np.testing.assert_allclose(value[1:3], [0.01, 0.001], rtol=1e-5)
    # Away from 0 and from exp overflow the gradient is finite.
    assert np.all(np.isfinite(gradient[3:]))


def test_seed_blend_masks_are_inverted_between_minus_10_and_10():
    # mask_neg = sigmoid((x + 10)/0.5) is ~1 for x > -10: the blend is -1/x there.
    value, _ = _value_and_gradient(seed_blended_f, [1.0, 5.0])
    np.testing.assert_allclose(value, [-1.0, -0.2], rtol=1e-3)
    assert _true_f(1.0) == pytest.approx(0.582, abs=1e-3)


def test_seed_taylor_cubic_term_has_the_wrong_sign():
    x = 0.5
    truth = _true_f(x)
    seed = float(seed_taylor(tf.constant(x, tf.float64)).numpy())
    correct = 0.5 + x / 12 - x**3 / 720
    # The seed's polynomial is off by ~x^3/360; the correct one by ~x^5/30240.
    assert seed - truth == pytest.approx(x**3 / 360, rel=0.01)
    assert abs(correct - truth) == pytest.approx(x**5 / 30240, rel=0.01)


# --- the naive formula -----------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_naive_formula_is_nan_at_zero_and_inaccurate_near_it(mode):
    value, gradient = _value_and_gradient(naive_tilted_mean, [0.0, 1e-6, -1e-6], mode)
    assert np.isnan(value[0]) and np.isnan(gradient[0])
    # Cancellation of two ~1e6 terms: thousands instead of 0.5.
    assert np.all(np.abs(value[1:] - 0.5) > 1e3)


@pytest.mark.parametrize("mode", MODES)
def test_naive_formula_gradient_is_nan_once_exp_overflows(mode):
    # float32 exp overflows for arguments above log(max) = 88.72.
    x = [-1000.0, -100.0, -89.0, -88.0, -50.0]
    value, gradient = _value_and_gradient(naive_tilted_mean, x, mode)
    np.testing.assert_allclose(value, [_true_f(v) for v in x], rtol=1e-5)  # the value survives
    assert np.all(np.isnan(gradient[:3]))
    assert np.all(np.isfinite(gradient[3:]))


def test_custom_loss_term_of_the_seed_is_nan_at_minus_50_and_fixed_by_tilted_mean():
    # The seed's loss used f(x) + f(x + 50); x = -50 puts the second term at f(0).
    def loss(f):
        return lambda x: f(x) + f(x + 50.0)

    value, gradient = _value_and_gradient(loss(naive_tilted_mean), [-50.0])
    assert np.isnan(value[0]) and np.isnan(gradient[0])
    value, gradient = _value_and_gradient(loss(tilted_mean), [-50.0])
    assert value[0] == pytest.approx(0.02 + 0.5, rel=1e-6)
    assert np.isfinite(gradient[0])


def test_tilted_mean_fixes_every_point_where_the_seed_fails():
    x = [0.0, 1e-6, -100.0, -1000.0, 1.0, 5.0]
    value, gradient = _value_and_gradient(tilted_mean, x)
    np.testing.assert_allclose(value, [_true_f(v) for v in x], rtol=1e-6)
    assert np.all(np.isfinite(gradient))
