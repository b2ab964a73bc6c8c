"""companion.book.accuracy: the mpmath reference of f(x) = 1/(1 - e^-x) - 1/x and errors in ulps."""

from __future__ import annotations

import sys

import mpmath
import numpy as np
import pytest
import tensorflow as tf

from companion.book import accuracy
from companion.book.accuracy import tilted_mean_reference, ulp_error

# --- the reference -----------------------------------------------------------------------


def test_reference_has_the_known_values_at_zero_one_and_the_infinities():
    values = tilted_mean_reference([0.0, 1.0, np.inf, -np.inf, np.nan])
    derivatives = tilted_mean_reference([0.0, 1.0, np.inf, -np.inf], derivative=True)
    e = mpmath.e
    with mpmath.workdps(50):
        assert values[0] == mpmath.mpf(1) / 2
        assert abs(values[1] - (1 / (1 - 1 / e) - 1)) < mpmath.mpf("1e-45")
        assert abs(derivatives[0] - mpmath.mpf(1) / 12) < mpmath.mpf("1e-45")
        # f'(1) = 1 - e / (e - 1)^2
        assert abs(derivatives[1] - (1 - e / (e - 1) ** 2)) < mpmath.mpf("1e-45")
    assert (values[2], values[3]) == (1, 0) and mpmath.isnan(values[4])
    assert derivatives[2] == 0 and derivatives[3] == 0


def test_reference_keeps_fifty_digits_across_the_series_switch_and_symmetry():
    # f(-x) = 1 - f(x) and f' even hold exactly, so they test the digits the reference keeps.
    x = np.array([1e-300, 1e-13, 1e-12, 1.0000001e-12, 1e-6, 0.5, 3.0, 40.0, 800.0, 1e300])
    with mpmath.workdps(60):
        symmetry = tilted_mean_reference(x) + tilted_mean_reference(-x) - 1
        evenness = tilted_mean_reference(x, derivative=True) - tilted_mean_reference(-x, derivative=True)
        assert max(abs(v) for v in symmetry) < mpmath.mpf("1e-50")
        assert max(abs(v) for v in evenness) < mpmath.mpf("1e-50")


def test_reference_keeps_the_shape_and_widens_float32_exactly():
    x = np.float32([[0.1, -2.0], [3.5, 7.25]])
    reference = tilted_mean_reference(x)
    assert reference.shape == (2, 2) and reference.dtype == object
    # float32(0.1) is not 0.1: the reference is f of the float32 number itself.
    with mpmath.workdps(50):
        exact = 1 + 1 / mpmath.expm1(mpmath.mpf(float(x[0, 0]))) - 1 / mpmath.mpf(float(x[0, 0]))
        assert abs(reference[0, 0] - exact) < mpmath.mpf("1e-45")
    assert tilted_mean_reference(tf.constant(x)).shape == (2, 2)


def test_reference_rejects_too_few_digits_and_non_numbers():
    with pytest.raises(ValueError, match="dps"):
        tilted_mean_reference([1.0], dps=10)
    with pytest.raises(TypeError, match="real numbers"):
        tilted_mean_reference(["a"])


def test_missing_mpmath_gives_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpmath", None)  # makes `import mpmath` fail
    with pytest.raises(ImportError, match="pip install mpmath"):
        tilted_mean_reference([1.0])


# --- ulp errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_correctly_rounded_values_are_within_half_an_ulp_and_neighbours_within_one_and_a_half(dtype):
    x = np.linspace(-30.0, 30.0, 201).astype(dtype)
    reference = tilted_mean_reference(x)
    rounded = reference.astype(float).astype(dtype)  # float64 first: double rounding is within 0.5 + tiny
    errors = ulp_error(rounded, reference, dtype)
    assert np.all(errors <= 0.5 + 1e-6)
    up = np.nextafter(rounded, np.inf).astype(dtype)
    errors_up = ulp_error(up, reference, dtype)
    assert np.all((errors_up >= 0.5 - 1e-6) & (errors_up <= 1.5 + 1e-6))


def test_ulp_is_the_spacing_of_the_dtype_at_the_reference():
    assert ulp_error(1.0 + 2.0**-23, 1.0, np.float32) == 1.0
    assert ulp_error(1.0 + 2.0**-52, 1.0, "float64") == 1.0
    assert ulp_error(0.75 + 2.0**-24, 0.75, tf.float32) == 1.0  # ulp halves below 1
    tiny = float(np.finfo(np.float32).tiny)
    assert ulp_error(0.0, tiny / 4, np.float32) == 2.0**21  # subnormal spacing is 2^-149


def test_non_finite_results_and_references():
    errors = ulp_error([np.nan, np.inf, 1.0, np.inf, np.nan], [1.0, 1.0, np.nan, np.inf, np.nan], np.float32)
    assert errors[0] == np.inf and errors[1] == np.inf
    assert np.isnan(errors[2])
    assert errors[3] == 0 and errors[4] == 0


def test_an_mpmath_reference_measures_float64_below_its_ulp():
    third = mpmath.mpf(1) / 3
    with mpmath.workdps(50):
        reference = np.array([mpmath.mpf(1) / 3], dtype=object)
    # float64(1/3) is 1/3 - 1/(3 * 2^54): 1/3 of an ulp of 2^-2 ... 2^-1 (ulp 2^-54).
    assert ulp_error(1 / 3, reference, np.float64)[0] == pytest.approx(1 / 3, abs=1e-9)
    assert float(third) == 1 / 3


def test_ulp_error_rejects_integer_dtypes():
    with pytest.raises(TypeError, match="floating dtype"):
        ulp_error([1.0], [1.0], np.int32)
