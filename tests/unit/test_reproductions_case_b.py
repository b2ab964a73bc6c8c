"""companion.book.reproductions, case B: the seed's f fails exactly as the book says it does.

These tests pin the failures the chapters show (measured with TF 2.21, float32): if a
TensorFlow upgrade changes one of them, the chapter text has to change too.
"""

from __future__ import annotations

import mpmath
import numpy as np
import pytest
import tensorflow as tf

from companion import numerics
from companion.book import reproductions
from companion.numerics import tilted_mean, tilted_mean_series_terms
from companion.book.reproductions import (
    naive_tilted_mean,
    seed_blended_f,
    seed_gradient_formula,
    seed_question_f,
    seed_taylor,
)

MODES = ["eager", "xla"]


def _value_and_gradient(fn, x, mode="eager", dtype=tf.float32):
    def run(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
        return y, tape.gradient(y, x)

    if mode == "xla":
        run = tf.function(run, jit_compile=True)
    y, g = run(tf.constant(x, dtype))
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
def test_seed_blend_gradient_is_nan_at_zero_and_below_the_overflow_threshold(mode):
    x = [0.0, -100.0, -1000.0, -50.0, 50.0]
    value, gradient = _value_and_gradient(seed_blended_f, x, mode)
    assert np.all(np.isnan(gradient[:3]))
    # The values at -100 and -1000 are fine: only the gradient is NaN there.
    np.testing.assert_allclose(value[1:3], [0.01, 0.001], rtol=1e-5)
    # Away from 0 and from exp overflow the gradient is finite.
    assert np.all(np.isfinite(gradient[3:]))


def test_seed_blend_gradient_is_nan_for_every_x_below_minus_88_72_and_finite_above():
    # The unused `original` branch overflows there, and no weight removes 0 * inf.
    below = -np.geomspace(88.73, 3e38, 400)
    above = np.linspace(-88.7, -0.5, 400)
    _, gradient = _value_and_gradient(seed_blended_f, np.concatenate([below, above]))
    assert np.all(np.isnan(gradient[:400]))
    assert np.all(np.isfinite(gradient[400:]))


def test_seed_blend_value_is_nan_next_to_zero_and_beyond_7e12():
    x = [1e-8, -1e-8, 2.9e-8, 1e-7, 6e12, 7e12, 1e20]
    value, _ = _value_and_gradient(seed_blended_f, x)
    assert np.all(np.isnan(value[[0, 1, 2, 5, 6]]))
    assert np.all(np.isfinite(value[[3, 4]]))


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


# --- the question's own code and the answer's gradient formula ----------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_question_f_has_right_values_and_nan_gradients_at_zero_and_below_overflow(mode):
    x = [-1000.0, -760.0, -709.7, -50.0, -0.1, 0.0, 0.05, 1.0]
    value, gradient = _value_and_gradient(seed_question_f, x, mode, tf.float64)
    np.testing.assert_allclose(value, [_true_f(v) for v in x], rtol=0, atol=1.5e-6)
    assert value[5] == 0.5
    assert np.all(np.isnan(gradient[[0, 1, 5]]))
    assert np.all(np.isfinite(gradient[[2, 3, 4, 6, 7]]))


def test_question_f_jump_at_the_switch_is_the_missing_cubic_term():
    edge = [-0.1, float(np.nextafter(-0.1, 0.0)), float(np.nextafter(0.1, 0.0)), 0.1]
    value, gradient = _value_and_gradient(seed_question_f, edge, dtype=tf.float64)
    np.testing.assert_allclose(np.abs(value[[1, 3]] - value[[0, 2]]), 0.1**3 / 720, rtol=1e-3)
    np.testing.assert_allclose(np.abs(gradient[[1, 3]] - gradient[[0, 2]]), 0.1**2 / 240, rtol=1e-2)


def test_question_f_loss_term_gradient_is_nan_at_minus_50():
    _, gradient = _value_and_gradient(lambda x: seed_question_f(x) + seed_question_f(x + 50.0),
                                      [-50.0, -50.0 + 1e-9], dtype=tf.float64)
    assert np.isnan(gradient[0]) and np.isfinite(gradient[1])


def test_answers_gradient_formula_is_one_over_x_squared_minus_the_derivative():
    points = [-30.0, -3.0, -0.5, 0.2, 1.0, 7.0]
    with mpmath.workdps(60):
        f = lambda z: 1 / (1 - mpmath.exp(-z)) - 1 / z
        for v in points:
            formula = mpmath.exp(-mpmath.mpf(v)) / (1 - mpmath.exp(-mpmath.mpf(v))) ** 2
            derivative = mpmath.diff(f, mpmath.mpf(v))
            assert abs(formula - (1 / mpmath.mpf(v) ** 2 - derivative)) < mpmath.mpf("1e-40") / v**2
    computed = seed_gradient_formula(tf.constant(points, tf.float64)).numpy()
    with mpmath.workdps(30):
        expected = [float(mpmath.exp(-v) / (1 - mpmath.exp(-v)) ** 2) for v in map(mpmath.mpf, points)]
    np.testing.assert_allclose(computed, expected, rtol=1e-12)


def test_answers_gradient_formula_is_inf_over_inf_once_exp_overflows():
    assert np.all(np.isnan(seed_gradient_formula(tf.constant([-88.8, -100.0])).numpy()))


def test_naive_f_near_minus_50_is_exactly_zero_with_derivative_one_over_t():
    # float32 x near -50 is a multiple of 2^-18, so t = x + 50 is exact; 1 - exp(-t) == t.
    x = np.float32(-50.0) + np.arange(-90, 65, dtype=np.float32) * np.float32(2.0**-18)
    x = x[x != -50.0]
    value, gradient = _value_and_gradient(lambda z: naive_tilted_mean(z + 50.0), x)
    t = x.astype(np.float64) + 50.0
    assert np.all(value == 0.0)
    np.testing.assert_allclose(gradient * t, 1.0, rtol=0, atol=2e-3)
    # Just outside the band the value is no longer exactly 0.
    value, _ = _value_and_gradient(lambda z: naive_tilted_mean(z + 50.0),
                                   np.float32(-50.0) + np.float32([-91, 65]) * np.float32(2.0**-18))
    assert np.all(value != 0.0)


def test_reproductions_docstring_examples_run():
    import doctest

    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    globs = {"tf": tf, "np": np, **vars(reproductions)}
    for fn in (seed_question_f, seed_gradient_formula):
        for test in finder.find(fn, fn.__name__, globs=globs):
            runner.run(test)
    assert runner.failures == 0 and runner.tries >= 2


# --- the number of series terms of tilted_mean ---------------------------------------------------


def test_tilted_mean_series_terms_are_fewer_than_the_taylor_remainder_bound_needs():
    import math

    zeta4, rho = math.pi**4 / 90, (2 / (2 * math.pi)) ** 2
    for dtype, expected, taylor in ((tf.float32, (5, 6), 8), (tf.float64, (11, 12), 17)):
        assert tilted_mean_series_terms(dtype) == expected
        eps = float(np.finfo(dtype.as_numpy_dtype).eps)
        k = next(k for k in range(1, 100)
                 if 2 * zeta4 * 2 ** (2 * k + 1) / (2 * math.pi) ** (2 * k + 2) / (1 - rho) <= eps / 64)
        assert k == taylor  # the truncated Taylor series would need these
        assert tilted_mean_series_terms(dtype)[0] < k
    assert tilted_mean_series_terms("float16") == tilted_mean_series_terms(np.float32) == (5, 6)
    globs = {"tf": tf, "tilted_mean_series_terms": tilted_mean_series_terms}
    import doctest

    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(tilted_mean_series_terms, globs=globs):
        runner.run(test)
    assert runner.failures == 0 and runner.tries == 1


@pytest.mark.parametrize("bad", [tf.int32, "int64", "not a dtype", tf.bool])
def test_tilted_mean_series_terms_rejects_non_float_dtypes(bad):
    with pytest.raises(TypeError, match="floating-point dtype"):
        tilted_mean_series_terms(bad)


def test_tilted_mean_series_terms_is_what_tilted_mean_uses():
    # Summing exactly that many terms at |x| <= 4 is what keeps the value within 2 ulp.
    for dtype in ("float32", "float64"):
        value_terms, derivative_terms = tilted_mean_series_terms(dtype)
        p, q = numerics._tilted_mean_coefficients(dtype)
        assert (len(p), len(q)) == (value_terms, derivative_terms)
