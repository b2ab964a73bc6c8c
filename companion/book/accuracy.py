"""Measuring accuracy in ulps against a high-precision reference.

The book states the accuracy of its numerics in *ulps* (units in the last place): the
error of a result divided by the spacing of the floating-point numbers at the exact value.
This module holds the two pieces every such measurement needs:

- `tilted_mean_reference`: f(x) = 1/(1 - e^-x) - 1/x (or its derivative) computed with
  mpmath to many more digits than float64 has, the yardstick for
  :func:`companion.numerics.tilted_mean`;
- `ulp_error`: the error of computed values in ulps of that reference in a given dtype.

mpmath is not a dependency of the package (the numerics do not need it); it is imported
when a reference is computed, with a clear error if it is missing (``pip install mpmath``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["tilted_mean_reference", "ulp_error"]


def _import_mpmath():
    try:
        import mpmath
    except ImportError:  # pragma: no cover - exercised by a test that hides mpmath
        raise ImportError(
            "companion.book.accuracy needs mpmath for its high-precision reference: pip install mpmath"
        ) from None
    return mpmath


def _as_float_array(values, name: str) -> np.ndarray:
    """Real numbers (array, tensor, list, scalar) as a float64 NumPy array, exactly for floats."""
    if hasattr(values, "numpy") and not isinstance(values, np.ndarray):
        values = values.numpy()  # a tf.Tensor
    array = np.asarray(values)
    if array.dtype.kind not in "fiub":
        raise TypeError(f"{name} must be real numbers (array, tensor, list or scalar), got dtype {array.dtype}")
    return array.astype(np.float64)


def _finfo(dtype) -> np.finfo:
    """``np.finfo`` of a NumPy, string or TensorFlow floating dtype, with a clear error."""
    dtype = getattr(dtype, "as_numpy_dtype", dtype)  # tf.float32 -> np.float32
    try:
        return np.finfo(np.dtype(dtype))
    except (TypeError, ValueError):
        raise TypeError(f"dtype must be a floating dtype such as np.float32 or 'float64', got {dtype!r}") from None


def tilted_mean_reference(x, derivative: bool = False, *, dps: int = 50) -> np.ndarray:
    r"""f(x) = 1/(1 - e^-x) - 1/x, or f'(x), to ``dps`` significant digits with mpmath.

    .. code-block:: none

        f(x)  = 1 + 1/expm1(x) - 1/x,         f(0)  = 1/2
        f'(x) = 1/x^2 - 1 / (4 sinh^2(x/2)),   f'(0) = 1/12

    Each input is taken as the exact binary number it is (a float32 input is widened to
    float64 first, which is exact). The closed forms are evaluated with ``dps + 20``
    significant digits, enough to absorb their cancellation (about ``log10(1/|x|)``
    digits near 0) down to ``|x| = 1e-12``; below that the Taylor series
    ``1/2 + x/12 - x^3/720 + x^5/30240`` (and its derivative) is used, whose truncation
    error there is below 1e-90. ``f(+-inf)`` is 1 and 0, ``f'(+-inf)`` is 0, NaN gives NaN.

    This is a reference for tests and figures, not a fast function: about 20
    microseconds per point.

    Args:
        x: real numbers: a NumPy array, a tensor, a list or a scalar.
        derivative: if True, return f'(x) instead of f(x).
        dps: number of correct significant decimal digits wanted (at least 20).

    Returns:
        A NumPy array of dtype ``object`` and the shape of ``x``, holding ``mpmath.mpf``
        numbers; pass it to `ulp_error`, or convert it with ``.astype(float)``.

    Raises:
        ImportError: if mpmath is not installed.
        TypeError: if ``x`` is not real numbers.
        ValueError: if ``dps`` is smaller than 20.

    Example:
        >>> reference = tilted_mean_reference([0.0, 1.0])
        >>> [round(float(v), 12) for v in reference]
        [0.5, 0.581976706869]
        >>> float(tilted_mean_reference(0.0, derivative=True)[()]) == 1 / 12
        True
    """
    if isinstance(dps, bool) or not isinstance(dps, int) or dps < 20:
        raise ValueError(f"dps must be an integer >= 20, got {dps!r}")
    mpmath = _import_mpmath()
    points = _as_float_array(x, "x")
    result = np.empty(points.shape, dtype=object)
    with mpmath.workdps(dps + 20):
        small = mpmath.mpf("1e-12")
        for index, value in np.ndenumerate(points):
            value = float(value)
            if np.isnan(value):
                result[index] = mpmath.mpf("nan")
            elif np.isinf(value):
                result[index] = mpmath.mpf(0) if derivative or value < 0 else mpmath.mpf(1)
            else:
                t = mpmath.mpf(value)
                if abs(t) < small:  # the closed forms would cancel 12+ digits
                    if derivative:
                        exact = mpmath.mpf(1) / 12 - t**2 / 240 + t**4 / 6048
                    else:
                        exact = mpmath.mpf(1) / 2 + t / 12 - t**3 / 720 + t**5 / 30240
                elif derivative:
                    exact = 1 / t**2 - 1 / (4 * mpmath.sinh(t / 2) ** 2)
                else:
                    exact = 1 + 1 / mpmath.expm1(t) - 1 / t
                result[index] = +exact  # unary plus rounds to the working precision
    return result


def ulp_error(computed, reference, dtype) -> np.ndarray:
    r"""``|computed - reference|`` in ulps of ``reference`` in ``dtype``.

    .. code-block:: none

        ulp_error = |computed - reference| / ulp(reference),
        ulp(r)    = 2^(max(e, emin) - p + 1)   where 2^e <= |r| < 2^(e+1)

    with ``p`` the precision of ``dtype`` in bits (24 for float32, 53 for float64) and
    ``emin`` its smallest normal exponent: ``ulp(r)`` is the spacing of the ``dtype``
    numbers at ``r``. A result correctly rounded to ``dtype`` is within 0.5 ulp; a
    result that is off by one number, within 1.5. Below the smallest normal number the
    spacing is the constant subnormal one, so a result that a CPU flushed to zero counts
    as an error of up to ``2^(p-1)`` ulps there (exclude those points if that is what
    the device does).

    The difference is taken in float64 for a float64 ``reference``; for an mpmath
    reference (the output of `tilted_mean_reference`) it is taken exactly, so a float64
    result can be measured to a small fraction of its ulp.

    Args:
        computed: the values to measure (array, tensor, list or scalar).
        reference: the exact values, broadcastable against ``computed``: floats, or an
            ``object`` array of ``mpmath.mpf``.
        dtype: the floating dtype whose ulp is the unit: ``np.float32``, ``"float64"``,
            ``tf.float32``, ... (float16 too).

    Returns:
        The error in ulps, as a float64 NumPy array; ``inf`` where ``computed`` is
        not finite but ``reference`` is, 0 where both are the same infinity or both NaN,
        NaN where only the reference is NaN.

    Raises:
        TypeError: if ``dtype`` is not a floating dtype or an input is not numbers.

    Example:
        >>> import numpy as np
        >>> third = np.float32(1) / np.float32(3)
        >>> round(float(ulp_error(third, 1 / 3, np.float32)), 3)
        0.333
        >>> float(ulp_error(np.nextafter(third, np.float32(1)), 1 / 3, np.float32)) > 1
        True
    """
    info = _finfo(dtype)
    got = _as_float_array(computed, "computed").astype(np.float64)
    ref_array = np.asarray(reference)
    if ref_array.dtype == object:
        mpmath = _import_mpmath()
        ref_array, got = np.broadcast_arrays(ref_array, got)
        hi = np.empty(ref_array.shape)
        lo = np.empty(ref_array.shape)
        with mpmath.workdps(40):
            for index, exact in np.ndenumerate(ref_array):
                exact = mpmath.mpf(exact)
                hi[index] = float(exact)
                lo[index] = float(exact - hi[index]) if mpmath.isfinite(exact) else 0.0
    else:
        hi = _as_float_array(ref_array, "reference").astype(np.float64)
        lo = np.zeros_like(hi)
        hi, got = np.broadcast_arrays(hi, got)
        lo = np.broadcast_to(lo, hi.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        error = np.abs((got - hi) - lo)  # got - hi is exact whenever they are within a factor 2
        magnitude = np.abs(hi)
        finite = np.isfinite(magnitude)
        exponent = np.floor(np.log2(np.where(finite & (magnitude > 0), magnitude, 1.0)))
        exponent = np.maximum(exponent, info.minexp)
        ulps = error / np.ldexp(1.0, (exponent - info.nmant).astype(int))
        ulps = np.where(np.isfinite(got) | ~finite, ulps, np.inf)
        same_special = (np.isnan(got) & np.isnan(hi)) | (np.isinf(hi) & (got == hi))
        return np.where(same_special, 0.0, ulps)
