"""companion.numerics.tilted_mean: accurate to a few ulp, finite gradients, every mode.

The reference is mpmath at 60 significant digits, computed once per session (module-scoped
fixture) on >= 10^4 points per dtype: log-spaced magnitudes of both signs over the whole
normal range, 0, +-tiny, +-max, and a dense grid over the series and closed-form regions.
Errors are in ulps of the reference value in the target dtype. Where the reference itself
is below the smallest normal number (f(x) for x < -1/tiny, f'(x) for |x| > 1/sqrt(tiny)),
TensorFlow's CPU kernels flush to zero, so there the test allows an absolute error of tiny.
"""

from __future__ import annotations

import doctest
import math

import ml_dtypes
import mpmath
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from companion import numerics
from companion.numerics import tilted_mean

# Aims of the issue (its hard limits are 4 and 8): value and gradient, in ulps.
VALUE_ULPS = 2.0
GRADIENT_ULPS = 4.0

SWITCH = numerics._TILTED_MEAN_SWITCH
MODES = ["eager", "function", "xla"]


# --- reference -------------------------------------------------------------------------


def _reference(x: float) -> tuple[mpmath.mpf, mpmath.mpf]:
    """f(x) and f'(x) to ~45 correct digits (60-digit arithmetic, series near 0)."""
    with mpmath.workdps(60):
        x = mpmath.mpf(x)
        if x == 0:
            return mpmath.mpf(1) / 2, mpmath.mpf(1) / 12
        if abs(x) < mpmath.mpf("1e-12"):  # the closed forms would cancel ~24+ digits
            value = mpmath.mpf(1) / 2 + x / 12 - x**3 / 720 + x**5 / 30240
            derivative = mpmath.mpf(1) / 12 - x**2 / 240 + x**4 / 6048
            return value, derivative
        value = 1 + 1 / mpmath.expm1(x) - 1 / x  # 1/(1 - e^-x) = 1 + 1/expm1(x)
        derivative = 1 / x**2 - 1 / (4 * mpmath.sinh(x / 2) ** 2)
        return value, derivative


def _reference_points(dtype: type) -> np.ndarray:
    info = np.finfo(dtype)
    logs = np.linspace(np.log(float(info.tiny)), np.log(float(info.max)), 5000)
    magnitudes = np.append(np.exp(logs[:-1]), info.max).astype(dtype)  # exp(log(max)) may overflow
    specials = np.array([0.0, info.tiny, -info.tiny, info.max, -info.max], dtype)
    grid = np.linspace(-4 * SWITCH, 4 * SWITCH, 4001).astype(dtype)  # both regions, densely
    switch = np.array([SWITCH, -SWITCH], dtype)
    edges = np.concatenate([switch, np.nextafter(switch, 0), np.nextafter(switch, 2 * switch)])
    return np.concatenate([specials, magnitudes, -magnitudes, grid, edges]).astype(dtype)


@pytest.fixture(scope="module", params=[np.float32, np.float64], ids=["float32", "float64"])
def reference(request):
    """(dtype, x, [f_hi, f_lo, f'_hi, f'_lo]): the reference as double-double, once per dtype."""
    dtype = request.param
    x = _reference_points(dtype)
    table = np.empty((4, x.size))
    for i, xi in enumerate(x):
        for j, exact in enumerate(_reference(float(xi))):
            hi = float(exact)
            table[2 * j, i] = hi
            table[2 * j + 1, i] = float(exact - hi)
    return dtype, x, table


def _ulp_errors(got: np.ndarray, hi: np.ndarray, lo: np.ndarray, dtype: type) -> np.ndarray:
    """|got - reference| in ulps of the reference in `dtype`; 0/inf below tiny (see top)."""
    info = np.finfo(dtype)
    error = np.abs((got.astype(np.float64) - hi) - lo)  # got - hi is exact (Sterbenz)
    magnitude = np.abs(hi)
    normal = magnitude >= float(info.tiny)
    exponent = np.floor(np.log2(np.where(normal, magnitude, 1.0)))
    ulps = error / np.ldexp(1.0, (exponent - info.nmant).astype(int))
    flushed_ok = error <= float(info.tiny)
    return np.where(normal, ulps, np.where(flushed_ok, 0.0, np.inf))


def _value_and_gradient(x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tilted_mean(x)
    return y, tape.gradient(y, x)


def _compiled(fn, mode: str):
    if mode == "eager":
        return fn
    return tf.function(fn, jit_compile=(mode == "xla"))


@pytest.fixture(scope="module")
def results(reference):
    """Value and gradient on the reference points in each mode."""
    dtype, x, _ = reference
    out = {}
    for mode in MODES:
        y, g = _compiled(_value_and_gradient, mode)(tf.constant(x))
        out[mode] = (y.numpy(), g.numpy())
    return out


# --- accuracy against mpmath --------------------------------------------------------------


def test_reference_covers_at_least_ten_thousand_points_per_dtype(reference):
    _, x, _ = reference
    assert x.size >= 10_000
    assert np.all(np.isfinite(x))


@pytest.mark.parametrize("mode", MODES)
def test_tilted_mean_value_is_within_two_ulp_of_mpmath(reference, results, mode):
    dtype, x, table = reference
    value, _ = results[mode]
    assert value.dtype == dtype
    errors = _ulp_errors(value, table[0], table[1], dtype)
    worst = int(np.argmax(errors))
    assert errors[worst] <= VALUE_ULPS, f"{errors[worst]:.2f} ulp at x = {x[worst]!r}"


@pytest.mark.parametrize("mode", MODES)
def test_tilted_mean_gradient_is_finite_and_within_four_ulp_of_mpmath(reference, results, mode):
    dtype, x, table = reference
    _, gradient = results[mode]
    assert gradient.dtype == dtype
    assert np.all(np.isfinite(gradient))
    errors = _ulp_errors(gradient, table[2], table[3], dtype)
    worst = int(np.argmax(errors))
    assert errors[worst] <= GRADIENT_ULPS, f"{errors[worst]:.2f} ulp at x = {x[worst]!r}"


def test_tilted_mean_is_bit_identical_eager_and_in_tf_function(results):
    # The sums are written in the order grappler's arithmetic optimizer would give them,
    # and 1/y never has a literal 1 that constant folding could turn into Reciprocal(y).
    np.testing.assert_array_equal(results["function"][0], results["eager"][0])
    np.testing.assert_array_equal(results["function"][1], results["eager"][1])


def test_tilted_mean_under_xla_agrees_with_eager_to_the_ulp_budget(reference, results):
    # XLA's exp differs from Eigen's by an ulp now and then; both are checked against mpmath
    # above, and here against each other (in ulps of the eager result).
    dtype, _, _ = reference
    for index, budget in ((0, VALUE_ULPS), (1, GRADIENT_ULPS)):
        eager, xla = results["eager"][index], results["xla"][index]
        scale = np.spacing(np.maximum(np.abs(eager), np.finfo(dtype).tiny).astype(dtype))
        assert np.all(np.abs(xla.astype(np.float64) - eager) <= budget * scale)


# --- what the switch at |x| = 4 buys ---------------------------------------------------------

#: Mean error of the derivative on |x| in [3, 4], in ulps. The series branch adds
#: positive terms: 0.43-0.46 ulp on average there (both dtypes, every mode, an AMD EPYC
#: with oneDNN on and off). With the switch moved to 3 the closed form, whose cancellation
#: amplifies its rounding by 1.87 (t = 4) to 2.97 (t = 3), gives 0.88-0.91 ulp (and a
#: worst point of 4.7 ulp). The bound sits between them with a factor of about 1.4 of room
#: on each side: a last-bit difference between CPUs moves a few of the 4001 points, not
#: the mean.
SWITCH_BAND_MEAN_GRADIENT_ULPS = 0.65


@pytest.fixture(scope="module", params=[np.float32, np.float64], ids=["float32", "float64"])
def switch_band(request):
    """(dtype, x, f'_hi, f'_lo): 4001 points of [3, 4] and f' there as double-double."""
    dtype = request.param
    x = np.linspace(3.0, 4.0, 4001).astype(dtype)
    exact = [_reference(float(v))[1] for v in x]
    hi = np.array([float(d) for d in exact])
    lo = np.array([float(d - float(d)) for d in exact])
    return dtype, x, hi, lo


@pytest.mark.parametrize("mode", MODES)
def test_gradient_on_three_to_four_has_the_series_accuracy_not_the_closed_forms(switch_band, mode):
    # A switch at 3 would need fewer series terms, but would hand [3, 4] to the closed
    # form, f' = 1/t^2 - r (1 + r), whose subtraction doubles to triples its rounding
    # error there (the docstring's 2.97 at T = 3): this is what the switch at 4 buys.
    dtype, x, hi, lo = switch_band
    _, gradient = _compiled(_value_and_gradient, mode)(tf.constant(x))
    errors = _ulp_errors(gradient.numpy(), hi, lo, dtype)
    assert errors.mean() <= SWITCH_BAND_MEAN_GRADIENT_ULPS, (
        f"mean {errors.mean():.3f} ulp, max {errors.max():.2f} ulp on [3, 4]"
    )


# --- special values, limits, dtypes ----------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32, tf.float64], ids=lambda d: d.name)
def test_tilted_mean_limits_zero_and_nan(dtype, mode):
    x = tf.constant([-np.inf, 0.0, np.inf, np.nan], dtype)
    y, g = _compiled(_value_and_gradient, mode)(x)
    assert y.dtype == dtype and g.dtype == dtype
    y, g = tf.cast(y, tf.float64).numpy(), tf.cast(g, tf.float64).numpy()
    assert y[0] == 0.0 and y[1] == 0.5 and y[2] == 1.0 and np.isnan(y[3])
    assert g[0] == 0.0 and g[2] == 0.0
    assert g[1] == pytest.approx(1 / 12, rel=float(ml_dtypes.finfo(dtype.as_numpy_dtype).eps))
    assert np.isnan(g[3])


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16], ids=lambda d: d.name)
def test_half_precision_is_computed_in_float32_for_every_finite_input(dtype):
    # Every finite float16 / bfloat16 value, exhaustively (2^16 bit patterns).
    bits = np.arange(2**16, dtype=np.uint16)
    all_values = tf.bitcast(tf.constant(bits), dtype)
    x = tf.boolean_mask(all_values, tf.math.is_finite(all_values))
    y, g = _value_and_gradient(x)
    y32, g32 = _value_and_gradient(tf.cast(x, tf.float32))
    assert y.dtype == dtype and g.dtype == dtype
    np.testing.assert_array_equal(y.numpy(), tf.cast(y32, dtype).numpy())
    np.testing.assert_array_equal(g.numpy(), tf.cast(g32, dtype).numpy())
    assert np.all(np.isfinite(tf.cast(g, tf.float32).numpy()))
    assert np.all((y.numpy() >= 0) & (y.numpy() <= 1))


def test_case_b_loss_term_has_finite_gradient_where_the_naive_one_is_nan():
    # The seed's loss used f(x) + f(x + 50): x = -50 puts the second term at 0, and
    # x < -88.7 overflows exp(-x) in float32.
    x = tf.constant([-1000.0, -100.0, -50.0, 0.0, 3.0])
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(tilted_mean(x) + tilted_mean(x + 50.0))
    gradient = tape.gradient(loss, x).numpy()
    assert np.isfinite(loss.numpy())
    assert np.all(np.isfinite(gradient)) and np.all(gradient > 0)


# --- second derivative ----------------------------------------------------------------------


def _second_derivative(x):
    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            y = tilted_mean(x)
        g = inner.gradient(y, x)
    return g, outer.gradient(g, x)


def _reference_second_derivative(x: float) -> float:
    with mpmath.workdps(60):
        x = mpmath.mpf(x)
        if abs(x) < mpmath.mpf("1e-12"):
            return float(-x / 120 + x**3 / 1512)
        s = mpmath.sinh(x / 2)
        return float(-2 / x**3 + mpmath.cosh(x / 2) / (4 * s**3))


@pytest.mark.parametrize("mode", MODES)
def test_second_derivative_is_finite_everywhere_and_close_to_mpmath(reference, mode):
    dtype, x, table = reference
    info = np.finfo(dtype)
    points = np.concatenate([x, [np.inf, -np.inf]]).astype(dtype)
    g, h = _compiled(_second_derivative, mode)(tf.constant(points))
    g, h = g.numpy(), h.numpy()
    assert np.all(np.isfinite(h))
    assert h[-1] == 0.0 and h[-2] == 0.0
    # The first derivative seen by the outer tape is the custom gradient itself.
    assert np.all(_ulp_errors(g[:-2], table[2], table[3], dtype) <= GRADIENT_ULPS)
    # f'' is autodiff of the derivative's formula, not a tuned kernel: check it to an
    # absolute tolerance relative to max |f''| = 0.0116 (float32 loses digits near 0).
    sample = points[:-2][:: max(1, points.size // 2000)]
    expected = np.array([_reference_second_derivative(float(v)) for v in sample])
    got = h[:-2][:: max(1, points.size // 2000)]
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=float(2**12 * info.eps) * 0.0116)


# --- the series and its length -----------------------------------------------------------


def test_bernoulli_numbers_match_mpmath():
    numbers = numerics._bernoulli_numbers(41)
    for n in range(0, 41, 2):
        assert float(numbers[n]) == float(mpmath.bernoulli(n))


def test_series_has_the_right_signs_and_length_from_eps():
    value, derivative = numerics._tilted_mean_coefficients("float32")
    # Horner order, highest power first: ..., +1/30240, -1/720, +1/12 (the seed had +1/720),
    # each moved a little by the economization (most in float32, where fewer terms are kept).
    assert value[-3:] == pytest.approx((1 / 30240, -1 / 720, 1 / 12), rel=2e-3)
    assert derivative[-3:] == pytest.approx((5 / 30240, -3 / 720, 1 / 12), rel=2e-3)
    value64, derivative64 = numerics._tilted_mean_coefficients("float64")
    assert value64[-3:] == pytest.approx((1 / 30240, -1 / 720, 1 / 12), rel=1e-9)
    assert derivative64[-3:] == pytest.approx((5 / 30240, -3 / 720, 1 / 12), rel=1e-9)
    assert (len(value), len(derivative)) == (5, 6)
    assert (len(value64), len(derivative64)) == (11, 12)
    # Fewer terms than the truncated Taylor series needs for the same budgets.
    assert numerics._tilted_mean_series_length(float(np.finfo(np.float32).eps), SWITCH / 2) == (8, 10)
    assert numerics._tilted_mean_series_length(float(np.finfo(np.float64).eps), SWITCH / 2) == (17, 19)


def test_economized_polynomials_match_mpmath_chebyshev_fits():
    # The exact economization (rational arithmetic, no mpmath in the package) against an
    # independent near-minimax fit: mpmath's Chebyshev interpolation with as many terms.
    def p_exact(w):
        if w == 0:
            return mpmath.mpf(1) / 12
        z = mpmath.sqrt(w)
        return (1 / mpmath.expm1(z) + 1 - 1 / z - mpmath.mpf(1) / 2) / z

    with mpmath.workdps(40):
        for dtype in ("float32", "float64"):
            p, _, bound, _ = numerics._tilted_mean_polynomials(dtype)
            fit, fit_error = mpmath.chebyfit(p_exact, [0, SWITCH**2 / 4], len(p), error=True)
            # Both are within a small factor of the minimax error, and so of each other.
            ours = max(abs(mpmath.polyval([mpmath.mpf(a.numerator) / a.denominator for a in p], w, asc=True)
                           - p_exact(w)) for w in mpmath.linspace(0, SWITCH**2 / 4, 400))
            assert ours <= bound / (SWITCH / 2) * (1 + 1e-9)
            assert ours <= 4 * fit_error and fit_error <= 4 * ours


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_series_truncation_stays_within_its_budget_on_the_whole_series_branch(dtype):
    eps = float(np.finfo(dtype).eps)
    value, derivative = numerics._tilted_mean_coefficients(np.dtype(dtype).name)
    value_error = derivative_error = mpmath.mpf(0)
    with mpmath.workdps(50):
        for z in mpmath.linspace(0, SWITCH / 2, 401)[1:]:  # economized: the error oscillates
            exact_value, exact_derivative = _reference(z)
            w = z * z
            value_series = 1 / mpmath.mpf(2) + z * mpmath.polyval([mpmath.mpf(c) for c in value[::-1]], w, asc=True)
            derivative_series = mpmath.polyval([mpmath.mpf(c) for c in derivative[::-1]], w, asc=True)
            value_error = max(value_error, abs(value_series - exact_value))
            derivative_error = max(derivative_error, abs(derivative_series - exact_derivative))
    # Budgets of _tilted_mean_polynomials, plus the rounding of coefficients to float64.
    assert value_error <= numerics._SERIES_VALUE_BUDGET * eps + 1e-16
    assert derivative_error <= numerics._SERIES_DERIVATIVE_BUDGET * eps + 1e-16


# --- properties over the whole float range -----------------------------------------------------


def _finite_arrays(dtype):
    width = 32 if dtype == np.float32 else 64
    return hnp.arrays(
        dtype, st.integers(1, 64), elements=st.floats(width=width, allow_nan=False, allow_infinity=False)
    )


def _spacing(values: np.ndarray, dtype) -> np.ndarray:
    return np.spacing(np.maximum(np.abs(values), np.finfo(dtype).tiny).astype(dtype)).astype(np.float64)


@given(data=st.data(), dtype=st.sampled_from([np.float32, np.float64]))
def test_tilted_mean_is_finite_bounded_and_symmetric(data, dtype):
    values = data.draw(_finite_arrays(dtype))
    y, g = _value_and_gradient(tf.constant(values))
    y_neg, g_neg = _value_and_gradient(tf.constant(-values))
    y, g, y_neg, g_neg = (t.numpy().astype(np.float64) for t in (y, g, y_neg, g_neg))
    assert np.all(np.isfinite(g)) and np.all((g >= 0) & (g <= 1 / 12 + 1e-7))
    assert np.all((y >= 0) & (y <= 1))
    # f(-x) = 1 - f(x), to the error of both evaluations.
    tolerance = VALUE_ULPS * (_spacing(y, dtype) + _spacing(y_neg, dtype))
    assert np.all(np.abs(y_neg - (1 - y)) <= tolerance)
    # f' is even, and computed from |x| and x^2 only: bit-identical.
    np.testing.assert_array_equal(g_neg, g)


@given(data=st.data(), dtype=st.sampled_from([np.float32, np.float64]))
def test_tilted_mean_is_non_decreasing(data, dtype):
    values = np.sort(data.draw(_finite_arrays(dtype)))
    # Also each value's next float up: neighbours are where rounding could break order.
    values = np.sort(np.concatenate([values, np.nextafter(values, np.finfo(dtype).max).astype(dtype)]))
    y = tilted_mean(tf.constant(values)).numpy().astype(np.float64)
    # Allowed: a step down by no more than the rounding error of two evaluations.
    step_down = y[:-1] - y[1:]
    assert np.all(step_down <= 2 * VALUE_ULPS * _spacing(y[1:], dtype))


@given(st.floats(min_value=1.0, max_value=3e38, allow_nan=False))
def test_tilted_mean_approaches_its_asymptotes(t):
    # f(t) = 1 - 1/t + 1/expm1(t) and f(-t) = 1/t - 1/expm1(t): within 1e-6 relative for t >= 20.
    x = tf.constant([t, -t], tf.float64)
    y = tilted_mean(x).numpy()
    correction = 1 / math.expm1(t) if t < 700 else 0.0
    np.testing.assert_allclose(y, [1 - 1 / t + correction, 1 / t - correction], rtol=1e-14, atol=1e-300)


# --- API -------------------------------------------------------------------------------------


def test_tilted_mean_docstring_example_runs():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(tilted_mean, "tilted_mean", globs={"tf": tf, "tilted_mean": tilted_mean}):
        runner.run(test)
    assert runner.failures == 0 and runner.tries > 0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (tf.constant([1, 2]), "floating dtype.*int32"),
        ("0.5", "string"),
        (tf.constant([True]), "floating dtype.*bool"),
        (np.array([1, 2]), "floating dtype.*int64"),
    ],
)
def test_tilted_mean_rejects_non_float_input_with_a_clear_type_error(value, message):
    with pytest.raises(TypeError, match=message):
        tilted_mean(value)


def test_tilted_mean_keeps_the_precision_of_numpy_input():
    assert tilted_mean([0.0]).dtype == tf.float32  # Python numbers: float32, like TF
    assert tilted_mean(np.array([1e300])).dtype == tf.float64
    assert tilted_mean(np.array([-1e300])).numpy()[0] == pytest.approx(1e-300, rel=1e-15)
    assert tilted_mean(np.float16(1.0)).dtype == tf.float16
    assert "tilted_mean" in numerics.__all__
