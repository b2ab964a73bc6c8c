"""companion.numerics powers: safe_pow, signed_pow, log_exp_pow, bounded, bounded_inverse.

The guarantees tested here (each over the whole float range with hypothesis):

- safe_pow / signed_pow values are tf.pow's: relative error <= 2e-6 in float32 against a
  float64 reference wherever the exact value is a normal float32 number;
- their gradients with respect to x and p are finite for every finite x (0, subnormal,
  negative, huge) and p in [0.05, 4], also through the chain x -> a x -> (a x)^p, and
  accurate where the true derivative is representable;
- the conventions at 0 (derivative 0; 1 for signed_pow at p = 1) hold exactly;
- log_exp_pow is the seed's formula, with its documented costs;
- bounded stays inside [low, high] with finite gradients, bounded_inverse inverts it.
"""

from __future__ import annotations

import doctest

import mpmath
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from companion import numerics
from companion.numerics import bounded, bounded_inverse, log_exp_pow, safe_pow, signed_pow

F32 = np.finfo(np.float32)
P_MIN, P_MAX = 0.05, 4.0
POWERS = [safe_pow, signed_pow]

finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
normal_positive32 = st.floats(min_value=float(F32.tiny), max_value=float(F32.max), width=32)
exponents = st.floats(min_value=float(np.float32(P_MIN)), max_value=P_MAX, width=32)


def _arrays(elements, size=st.integers(1, 64)):
    return hnp.arrays(np.float32, size, elements=elements)


def _value_and_gradients(fn, x, p):
    """fn(x, p) and its gradients with respect to x and p (upstream gradient 1)."""
    x = tf.convert_to_tensor(x)
    p = tf.convert_to_tensor(p)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([x, p])
        y = fn(x, p)
    return y.numpy(), tape.gradient(y, x).numpy(), tape.gradient(y, p).numpy()


def _reference(x: np.ndarray, p: np.ndarray, signed: bool):
    """Value, d/dx and d/dp in float64 (exact to ~1e-16, far below float32's 6e-8)."""
    x64, p64 = x.astype(np.float64), p.astype(np.float64)
    magnitude = np.abs(x64) if signed else x64
    inside = magnitude >= F32.tiny
    base = np.where(inside, magnitude, 1.0)
    with np.errstate(over="ignore"):
        value = np.where(inside, base**p64, 0.0)
        slope = np.where(inside, p64 * base ** (p64 - 1), 0.0)
        dp = np.where(inside, base**p64 * np.log(base), 0.0)
    sign = np.sign(x64) if signed else 1.0
    return sign * value, slope, sign * dp


def _relative_error(actual, expected):
    return np.abs(actual.astype(np.float64) - expected) / np.abs(expected)


def _representable(values: np.ndarray) -> np.ndarray:
    magnitude = np.abs(values)
    return (magnitude >= F32.tiny) & (magnitude <= F32.max)


# --- the problem is real in this TensorFlow -------------------------------------------


def test_tf_pow_gradient_through_a_times_x_is_nan_at_zero_for_p_below_one():
    a = tf.Variable(1.5)
    x = tf.constant([0.0, 2.0])
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(tf.pow(a * x, 0.5))
    assert np.isfinite(y.numpy())
    assert np.isnan(tape.gradient(y, a).numpy())


# --- safe_pow and signed_pow: values ------------------------------------------------------


@given(x=_arrays(normal_positive32), p=exponents, fn=st.sampled_from(POWERS))
def test_power_value_is_as_accurate_as_tf_pow_for_positive_x(x, p, fn):
    p = np.full_like(x, p)
    value, _, _ = _value_and_gradients(fn, x, p)
    expected, _, _ = _reference(x, p, signed=fn is signed_pow)
    normal = _representable(expected)
    assert np.all(_relative_error(value[normal], expected[normal]) <= 2e-6)
    np.testing.assert_array_equal(value, tf.pow(x, p).numpy())  # it *is* tf.pow there


@given(x=_arrays(finite32), p=exponents)
def test_safe_pow_is_zero_with_zero_gradients_for_x_at_most_zero(x, p):
    p = np.full_like(x, p)
    value, dx, dp = _value_and_gradients(safe_pow, x, p)
    off = x < F32.tiny  # <= 0, and subnormals, which TensorFlow treats as 0
    np.testing.assert_array_equal(value[off], 0.0)
    np.testing.assert_array_equal(dx[off], 0.0)
    np.testing.assert_array_equal(dp[off], 0.0)


@given(x=_arrays(finite32), p=exponents)
def test_signed_pow_is_odd_and_agrees_with_safe_pow_for_positive_x(x, p):
    p = np.full_like(x, p)
    value, dx, dp = _value_and_gradients(signed_pow, x, p)
    neg_value, neg_dx, neg_dp = _value_and_gradients(signed_pow, -x, p)
    np.testing.assert_array_equal(neg_value, -value)
    np.testing.assert_array_equal(neg_dx, dx)  # the derivative of an odd function is even
    np.testing.assert_array_equal(neg_dp, -dp)
    positive = x > 0
    safe_value, safe_dx, safe_dp = _value_and_gradients(safe_pow, x, p)
    np.testing.assert_array_equal(value[positive], safe_value[positive])
    np.testing.assert_array_equal(dx[positive], safe_dx[positive])
    np.testing.assert_array_equal(dp[positive], safe_dp[positive])


# --- safe_pow and signed_pow: gradients ---------------------------------------------------


@given(x=_arrays(finite32), p=_arrays(exponents, size=st.just(1)), fn=st.sampled_from(POWERS))
def test_power_gradients_are_finite_for_every_finite_x(x, p, fn):
    # 0, -0, subnormals, negative numbers, and huge x where x^p overflows to inf.
    p = np.full_like(x, p[0])
    _, dx, dp = _value_and_gradients(fn, x, p)
    assert np.all(np.isfinite(dx)), (x[~np.isfinite(dx)], p[0])
    assert np.all(np.isfinite(dp)), (x[~np.isfinite(dp)], p[0])


@given(x=_arrays(finite32), p=exponents, fn=st.sampled_from(POWERS))
def test_power_gradients_match_the_float64_derivatives_where_representable(x, p, fn):
    p = np.full_like(x, p)
    _, dx, dp = _value_and_gradients(fn, x, p)
    _, expected_dx, expected_dp = _reference(x, p, signed=fn is signed_pow)
    # From the value: tf.pow's error (<= 2e-6) and two roundings; where x^p over- or
    # underflows, from exp(log p + (p - 1) log x) in float64, rounded once.
    for actual, expected in [(dx, expected_dx), (dp, expected_dp)]:
        ok = _representable(expected)
        assert np.all(_relative_error(actual[ok], expected[ok]) <= 1e-5)
        # Where the true derivative overflows, the convention is the largest float.
        too_large = np.abs(expected) > F32.max
        np.testing.assert_array_equal(np.abs(actual[too_large]), F32.max)


@pytest.mark.parametrize("fn", POWERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("p", [0.05, 0.25, 0.5, 0.99, 1.0, 1.01, 2.0, 4.0])
def test_power_gradient_is_finite_at_zero_through_a_times_x(fn, p):
    a = tf.Variable(1.5)
    exponent = tf.Variable(p)
    x = tf.constant([0.0, -0.0, 0.5, 2.0])
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(fn(a * x, exponent))
    da, dp = tape.gradient(y, [a, exponent])
    # The true gradients: d/da = sum x p (a x)^(p-1) (its x = 0 terms tend to 0), d/dp.
    xs = np.array([0.5, 2.0])
    np.testing.assert_allclose(da.numpy(), np.sum(xs * p * (1.5 * xs) ** (p - 1)), rtol=1e-5)
    np.testing.assert_allclose(dp.numpy(), np.sum((1.5 * xs) ** p * np.log(1.5 * xs)), rtol=1e-5, atol=1e-6)


@given(
    x=_arrays(finite32),
    a=st.floats(min_value=1 / 16, max_value=16, width=32),
    p=exponents,
    fn=st.sampled_from(POWERS),
)
def test_power_gradient_through_a_times_x_is_finite_wherever_representable(x, a, p, fn):
    # d/da sum (a x)^p = sum p |a x|^(p-1) x. Each term is finite where the derivative
    # p |a x|^(p-1) is (for p <= 1 always; at x = 0 it is 0); what must be representable
    # is the sum, the gradient itself: 5 terms of 6.8e37 add up to more than the
    # largest float32, and then inf is the right answer (see the regression test below).
    a_var = tf.Variable(a)
    a64, p64 = np.float64(a), np.float64(p)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        base = np.abs(a64 * x.astype(np.float64))
        assume(np.all(base <= F32.max))
        inside = base >= F32.tiny
        terms = np.where(inside, p64 * np.where(inside, base, 1.0) ** (p64 - 1) * x, 0.0)
    if fn is safe_pow:
        terms = np.where(x > 0, terms, 0.0)
    representable = np.abs(terms) <= F32.max / 2  # the product p |a x|^(p-1) * x
    x, terms = x[representable], terms[representable]
    assume(x.size > 0 and np.sum(np.abs(terms)) <= F32.max / 2)  # the gradient, summed
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(fn(a_var * x, tf.constant(p)))
    gradient = tape.gradient(y, a_var).numpy()
    assert np.isfinite(gradient)
    # Accurate relative to the size of the terms (they can cancel for signed_pow).
    assert abs(gradient - np.sum(terms)) <= 2e-5 * np.sum(np.abs(terms)) + F32.tiny


def _exact_gradient_through_a_times_x(x: float, a: float, p: float, copies: int = 1):
    """d/da of copies * (a x)^p, p (a x)^(p-1) x times copies, from mpmath at 40 digits."""
    with mpmath.workdps(40):
        x_, a_, p_ = (mpmath.mpf(float(np.float32(v))) for v in (x, a, p))
        return copies * p_ * (a_ * x_) ** (p_ - 1) * x_


@pytest.mark.parametrize("fn", POWERS, ids=lambda f: f.__name__)
def test_power_gradient_through_a_times_x_near_the_top_of_float32(fn):
    # The example of issue 11: x = 4.2989354e16, a = 3, p = 2.21875. (a x)^p = 9.2e37 and
    # the gradient 6.8e37 are both below the largest float32, 3.4e38.
    x, a, p = np.float32(4.2989354e16), np.float32(3.0), np.float32(2.21875)
    for copies in [1, 4]:
        a_var = tf.Variable(a)
        with tf.GradientTape() as tape:
            y = tf.reduce_sum(fn(a_var * np.full(copies, x), tf.constant(p)))
        gradient = tape.gradient(y, a_var).numpy()
        exact = _exact_gradient_through_a_times_x(x, a, p, copies)
        assert np.isfinite(gradient)
        assert abs((mpmath.mpf(float(gradient)) - exact) / exact) <= 1e-6, (copies, gradient, exact)
    # Five copies sum to 3.40282368e38, above the largest float32 plus half an ulp
    # (3.40282357e38): the correctly rounded gradient is inf, and that is what comes out.
    exact = _exact_gradient_through_a_times_x(x, a, p, 5)
    assert exact > mpmath.mpf(float(F32.max)) + mpmath.mpf(2) ** 103
    a_var = tf.Variable(a)
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(fn(a_var * np.full(5, x), tf.constant(p)))
    assert np.isinf(tape.gradient(y, a_var).numpy())


@given(
    x=_arrays(finite32),
    p=exponents,
    log2_scale=st.integers(-125, 127),  # upstream gradients from 2^-126 to 2^127: normal
    fn=st.sampled_from(POWERS),
    data=st.data(),
)
def test_power_gradients_times_any_upstream_gradient_are_accurate_where_representable(x, p, log2_scale, fn, data):
    # What the custom gradient returns is upstream * d/dx and upstream * d/dp. Where the
    # derivative alone over- or underflows (p |x|^(p-1) = 3e40 at x = 1e20, p = 3), the
    # product with a small (or large) upstream gradient can still be representable, and
    # then it must be accurate; beyond the float range it is clamped to +-max.
    mantissas = data.draw(_arrays(st.floats(0.5, 1.0, width=32), st.just(x.size)))
    signs = np.where(data.draw(hnp.arrays(np.bool_, x.size)), -1.0, 1.0)
    upstream = (signs * mantissas * 2.0**log2_scale).astype(np.float32)
    p = np.full_like(x, p)
    x_t, p_t = tf.constant(x), tf.constant(p)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([x_t, p_t])
        y = fn(x_t, p_t)
    dx = tape.gradient(y, x_t, output_gradients=tf.constant(upstream)).numpy()
    dp = tape.gradient(y, p_t, output_gradients=tf.constant(upstream)).numpy()
    _, slope, slope_p = _reference(x, p, signed=fn is signed_pow)
    for actual, derivative in [(dx, slope), (dp, slope_p)]:
        expected = upstream.astype(np.float64) * derivative  # float64: no overflow up to 1e308
        assert np.all(np.isfinite(actual))
        ok = _representable(expected)
        # From the value: tf.pow's error (<= 2e-6) and a few roundings; in log space one
        # rounding (the path runs in float64).
        assert np.all(_relative_error(actual[ok], expected[ok]) <= 1e-5), (x[ok], actual[ok], expected[ok])
        too_large = np.abs(expected) > F32.max
        np.testing.assert_array_equal(actual[too_large], np.sign(expected[too_large]) * F32.max)
        # Flushed to 0, or a subnormal. (At |x| < tiny the conventions hold instead, e.g.
        # signed_pow's derivative 1 at p = 1: test_gradient_convention_at_zero.)
        too_small = (np.abs(expected) < F32.tiny) & (np.abs(x) >= F32.tiny)
        assert np.all(np.abs(actual[too_small]) <= F32.tiny)


@pytest.mark.parametrize("fn", POWERS, ids=lambda f: f.__name__)
def test_power_gradient_with_a_small_upstream_gradient_where_the_derivative_overflows(fn):
    # y = 1e-10 * x^3 at x = 1e20: dy/dx = 3e30, although 3 x^2 = 3e40 overflows.
    # And y = 1e30 * x^3 at x = 1e-30: dy/dx = 3e-30, although 3 x^2 = 3e-60 underflows.
    # Before the products were formed in log space, these were 3.4e28 and 0.
    x = tf.constant([1e20, 1e-30, 1e20])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(tf.constant([1e-10, 1e30, 1e-10]) * fn(x, tf.constant([3.0, 3.0, 2.0])))
    dx = tape.gradient(y, x).numpy()
    x64, upstream64 = (np.float32([1e20, 1e-30, 1e20]).astype(np.float64), np.float32([1e-10, 1e30, 1e-10]))
    expected = upstream64 * np.array([3.0, 3.0, 2.0]) * x64 ** np.array([2.0, 2.0, 1.0])
    np.testing.assert_allclose(dx, expected, rtol=2e-5)


@pytest.mark.parametrize("fn", POWERS, ids=lambda f: f.__name__)
def test_power_gradient_propagates_a_non_finite_upstream_gradient(fn):
    x = tf.constant([2.0, 1e20, 0.0])
    p = tf.constant([2.0, 3.0, 2.0])
    for upstream in [np.inf, -np.inf, np.nan]:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x, p)
        dx = tape.gradient(y, x, output_gradients=tf.fill([3], np.float32(upstream))).numpy()
        if np.isnan(upstream):
            assert np.all(np.isnan(dx))
        else:
            np.testing.assert_array_equal(dx[:2], [upstream, upstream])  # not clamped
            assert np.isnan(dx[2])  # upstream * 0 at x = 0, as for any op


@pytest.mark.parametrize("p", [0.05, 0.5, 0.99, 1.0, 1.5, 4.0])
def test_gradient_convention_at_zero(p):
    x = tf.constant([0.0, -0.0])
    _, safe_dx, safe_dp = _value_and_gradients(safe_pow, x, tf.fill([2], p))
    _, signed_dx, signed_dp = _value_and_gradients(signed_pow, x, tf.fill([2], p))
    np.testing.assert_array_equal(safe_dx, 0.0)  # the left derivative, as relu
    np.testing.assert_array_equal(signed_dx, 1.0 if p == 1.0 else 0.0)  # identity at p = 1
    np.testing.assert_array_equal(safe_dp, 0.0)
    np.testing.assert_array_equal(signed_dp, 0.0)


def test_power_derivatives_match_mpmath_on_a_grid():
    xs = np.geomspace(1e-30, 1e30, 61).astype(np.float32)
    for p in [0.05, 0.5, 1.0, 2.5]:
        _, dx, dp = _value_and_gradients(safe_pow, xs, np.full_like(xs, p))
        with mpmath.workdps(40):
            p_exact = mpmath.mpf(float(np.float32(p)))
            for x, gx, gp in zip(xs, dx, dp):
                x_exact = mpmath.mpf(float(x))
                want_dx = p_exact * x_exact ** (p_exact - 1)
                want_dp = x_exact**p_exact * mpmath.log(x_exact)
                for got, want in [(gx, want_dx), (gp, want_dp)]:
                    if F32.tiny <= abs(want) <= F32.max:
                        assert abs((mpmath.mpf(float(got)) - want) / want) <= 1e-5, (x, p)


# --- dtypes, broadcasting, compilation, NaN, errors ---------------------------------------


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float64], ids=lambda d: d.name)
@pytest.mark.parametrize("fn", POWERS, ids=lambda f: f.__name__)
def test_power_gradients_are_finite_over_the_whole_range_of_other_dtypes(dtype, fn):
    low, high = numerics._float_limits(dtype)
    with np.errstate(over="ignore"):
        magnitudes = np.minimum(np.exp(np.linspace(np.log(low), np.log(high), 400)), high)
    x = tf.cast(np.concatenate([[0.0, low / 4], magnitudes, -magnitudes]), dtype)
    for p in [0.05, 0.5, 1.0, 2.0, 4.0]:
        value, dx, dp = _value_and_gradients(fn, x, tf.fill(tf.shape(x), tf.constant(p, dtype)))
        assert value.dtype == dtype.as_numpy_dtype and dx.dtype == value.dtype
        assert np.all(np.isfinite(dx.astype(np.float64))) and np.all(np.isfinite(dp.astype(np.float64)))
        x64 = x.numpy().astype(np.float64)
        inside = (np.abs(x64) if fn is signed_pow else x64) >= low
        with np.errstate(over="ignore"):
            expected = np.where(inside, np.abs(x64), 0.0) ** p
        finite = inside & (expected >= low) & (expected <= high / 2)  # a normal result
        rtol = 1e-14 if dtype == tf.float64 else 1e-2
        np.testing.assert_allclose(np.abs(value.astype(np.float64))[finite], expected[finite], rtol=rtol)


def test_power_broadcasts_and_sums_gradients_back_to_each_shape():
    x = tf.constant([[0.0], [1.0], [4.0]])  # (3, 1)
    p = tf.constant([[0.5, 1.0, 2.0, 3.0]])  # (1, 4)
    value, dx, dp = _value_and_gradients(safe_pow, x, p)
    assert value.shape == (3, 4) and dx.shape == (3, 1) and dp.shape == (1, 4)
    xs = np.array([[0.0], [1.0], [4.0]])
    ps = np.array([[0.5, 1.0, 2.0, 3.0]])
    expected_dx = np.where(xs > 0, ps * np.where(xs > 0, xs, 1) ** (ps - 1), 0).sum(axis=1, keepdims=True)
    expected_dp = np.where(xs > 0, xs**ps * np.log(np.where(xs > 0, xs, 1)), 0).sum(axis=0, keepdims=True)
    np.testing.assert_allclose(dx, expected_dx, rtol=1e-6)
    np.testing.assert_allclose(dp, expected_dp, rtol=1e-6)


@pytest.mark.parametrize("fn", POWERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("jit", [False, True], ids=["function", "xla"])
def test_power_is_the_same_compiled(fn, jit):
    x = tf.constant([-3.0, 0.0, 1e-20, 0.7, 5.0, 3e30])
    p = tf.constant([0.05, 0.5, 0.5, 1.0, 2.0, 1.2])

    def value_and_grads(x, p):
        with tf.GradientTape() as tape:
            tape.watch([x, p])
            y = fn(x, p)
        return (y, *tape.gradient(y, [x, p]))

    eager = value_and_grads(x, p)
    compiled = tf.function(value_and_grads, jit_compile=jit)(x, p)
    for e, c in zip(eager, compiled):
        np.testing.assert_allclose(c.numpy(), e.numpy(), rtol=2e-6)
        assert np.all(np.isfinite(c.numpy()[1:])) or c is compiled[0]


@pytest.mark.parametrize("fn", POWERS, ids=lambda f: f.__name__)
def test_power_propagates_nan(fn):
    value, _, _ = _value_and_gradients(fn, tf.constant([np.nan, 0.0, 2.0]), tf.constant([0.5, np.nan, 1.0]))
    assert np.isnan(value[0]) and np.isnan(value[1]) and value[2] == 2.0


@pytest.mark.parametrize("fn", [*POWERS, log_exp_pow], ids=lambda f: f.__name__)
def test_power_rejects_wrong_dtypes(fn):
    with pytest.raises(TypeError, match="floating dtype.*int32"):
        fn(tf.constant([1, 2]), 0.5)
    with pytest.raises(TypeError, match="p must have dtype float32"):
        fn(tf.constant([1.0]), tf.constant(0.5, tf.float64))


# --- log_exp_pow: the seed's formula and its costs --------------------------------------


@given(x=_arrays(finite32), p=exponents)
def test_log_exp_pow_is_exactly_the_seeds_formula_with_finite_gradients(x, p):
    p = np.full_like(x, p)
    value, dx, dp = _value_and_gradients(log_exp_pow, x, p)
    seed = tf.exp(p * tf.math.log(tf.maximum(x, 1e-6))).numpy()
    np.testing.assert_array_equal(value, seed)
    small = x < 1e-6
    assert np.all(np.isfinite(dx[small])) and np.all(dx[small] == 0.0)  # no signal below eps
    assert np.all(np.isfinite(dp[small]))


def test_log_exp_pow_costs_value_at_zero_and_negative_inputs():
    x = tf.constant([-5.0, 0.0])
    for p in [0.1, 0.5, 2.0]:
        value = log_exp_pow(x, p).numpy()
        np.testing.assert_allclose(value, [1e-6**p] * 2, rtol=1e-5)  # x^p would be NaN and 0
    assert log_exp_pow(tf.constant(0.0), 0.1).numpy() > 0.25  # a quarter at x = 0


def test_log_exp_pow_relative_error_grows_with_p_log_x():
    # Worst relative error over 2000 points, for |p log x| about 10, 40 and 80.
    rng = np.random.default_rng(0)

    def worst(fn, low, high, p):
        x = np.exp(rng.uniform(low, high, 2000)).astype(np.float32)
        got = fn(tf.constant(x), p).numpy().astype(np.float64)
        return np.max(_relative_error(got, x.astype(np.float64) ** np.float64(np.float32(p))))

    errors = [worst(log_exp_pow, np.log(a), np.log(a) + 1, 1.0) for a in [1e4, 1e17, 1e34]]
    assert errors[0] < errors[1] < errors[2]
    assert errors[2] > 10 * worst(safe_pow, np.log(1e34), np.log(1e34) + 1, 1.0)


def test_log_exp_pow_rejects_bad_eps():
    with pytest.raises(ValueError, match="positive finite"):
        log_exp_pow(tf.constant([1.0]), 0.5, eps=0.0)
    with pytest.raises(TypeError, match="eps must be a positive number"):
        log_exp_pow(tf.constant([1.0]), 0.5, eps="1e-6")


# --- bounded and bounded_inverse ----------------------------------------------------------

intervals = st.tuples(st.floats(-10, 10), st.floats(1e-3, 10)).map(lambda t: (t[0], t[0] + t[1]))


@given(raw=_arrays(st.floats(width=32, allow_nan=False)), interval=intervals)
def test_bounded_stays_in_the_interval_with_finite_gradients(raw, interval):
    low, high = interval
    # TensorFlow flushes float32 subnormals to zero on CPU, so a bound like 3.2e-39 acts
    # as 0 there (documented in bounded's docstring); NumPy, which checks, does not flush.
    assume(all(bound == 0 or abs(bound) >= np.finfo(np.float32).tiny for bound in interval))
    raw = tf.constant(raw)
    with tf.GradientTape() as tape:
        tape.watch(raw)
        value = bounded(raw, low, high)
    gradient = tape.gradient(value, raw).numpy()
    value = value.numpy()
    assert np.all(value >= np.float32(low)) and np.all(value <= np.float32(high))
    assert np.all(np.isfinite(gradient)) and np.all(gradient >= 0)


@given(interval=intervals, t=st.floats(1e-4, 1 - 1e-4))
def test_bounded_inverse_inverts_bounded(interval, t):
    low, high = interval
    target = low + (high - low) * t
    assume(low < np.float32(target) < high)
    raw = bounded_inverse(np.float32(target), low, high)
    assert raw.dtype == tf.float32
    recovered = bounded(raw, low, high).numpy()
    # A few ulp of the interval's scale: rounding of raw, sigmoid, the product and the sum.
    scale = max(abs(low), abs(high))
    assert abs(float(recovered) - float(np.float32(target))) <= 8 * np.spacing(np.float32(scale))


def test_bounded_inverse_starts_an_exponent_at_one():
    raw = bounded_inverse(1.0, 0.1, 2.0)
    assert abs(float(bounded(raw, 0.1, 2.0)) - 1.0) <= 2 * F32.eps
    assert float(bounded_inverse(tf.constant(1.0, tf.float64), 0.1, 2.0)) == pytest.approx(np.log(0.9 / 1.0))


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: bounded(tf.constant(0.0), 2.0, 0.1), ValueError, "low must be smaller than high"),
        (lambda: bounded(tf.constant(0.0), 1.0, 1.0), ValueError, "low must be smaller than high"),
        (lambda: bounded(tf.constant(0.0), 0.0, float("inf")), ValueError, "high must be finite"),
        (lambda: bounded(tf.constant(0.0), "0", 1.0), TypeError, "low must be a real number"),
        (lambda: bounded(tf.constant([1, 2]), 0.0, 1.0), TypeError, "floating dtype"),
        (lambda: bounded_inverse(2.0, 0.1, 2.0), ValueError, "strictly between"),
        (lambda: bounded_inverse([0.5, 0.05], 0.1, 2.0), ValueError, r"strictly between.*1 of 2"),
        (lambda: bounded_inverse(float("nan"), 0.1, 2.0), ValueError, "strictly between"),
        (lambda: bounded_inverse(1.0, 2.0, 0.1), ValueError, "low must be smaller than high"),
    ],
)
def test_bounded_errors_say_what_was_given(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_bounded_inverse_checks_values_inside_tf_function():
    fn = tf.function(lambda v: bounded_inverse(v, 0.1, 2.0))
    assert np.isfinite(fn(tf.constant(1.0)).numpy())
    with pytest.raises(tf.errors.InvalidArgumentError, match="value must be < high"):
        fn(tf.constant(3.0))


@pytest.mark.parametrize("name", ["safe_pow", "signed_pow", "log_exp_pow", "bounded", "bounded_inverse"])
def test_docstring_examples_run(name):
    fn = getattr(numerics, name)
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(fn, name, globs={**vars(numerics), "tf": tf, "np": np}):
        runner.run(test)
    assert runner.failures == 0


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: safe_pow(x, 0.5),
        lambda x: signed_pow(x, 0.5),
        lambda x: log_exp_pow(x, 0.5),
        lambda x: bounded(x, 0.1, 2.0),
        lambda x: bounded_inverse(x, 0.1, 2.0),
        numerics.tilted_mean,
    ],
    ids=["safe_pow", "signed_pow", "log_exp_pow", "bounded", "bounded_inverse", "tilted_mean"],
)
def test_numpy_inputs_keep_their_dtype_and_python_floats_are_float32(fn):
    # As with NumPy arrays and tensors, a NumPy scalar is computed in its own precision.
    assert fn(np.float64(0.5)).dtype == tf.float64
    assert fn(np.array([0.5, 1.5])).dtype == tf.float64
    assert fn(np.float32(0.5)).dtype == tf.float32
    assert fn(0.5).dtype == tf.float32  # like tf.constant(0.5)
