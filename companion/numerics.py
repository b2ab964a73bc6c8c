"""Numerically safe tensor functions.

Each function states the formula it computes, why the naive form fails, and the
guarantee it gives, in the spirit of ``tensorflow_probability.math``.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import tensorflow as tf

__all__ = ["bounded", "bounded_inverse", "double_where", "log_exp_pow", "safe_pow", "signed_pow", "tilted_mean",
           "tilted_mean_series_terms"]

# Input conversion shared with companion._tilted_mean (numerics' names kept for the tests).
from companion._checks import FLOAT_DTYPES as _FLOAT_DTYPES  # noqa: E402
from companion._checks import as_float_tensor as _as_float_tensor  # noqa: E402


def double_where(
    condition,
    fn: Callable[[tf.Tensor], tf.Tensor],
    x,
    otherwise=0.0,
    *,
    safe_x: float = 1.0,
) -> tf.Tensor:
    """``fn(x)`` where ``condition`` holds and ``otherwise`` elsewhere, with finite gradients.

    The one-where form ``tf.where(condition, fn(x), otherwise)`` has the right value but
    can have a NaN gradient. Its backward pass sends the upstream gradient ``g`` to the
    branch that was *not* taken as ``0``, and the chain rule then multiplies that ``0`` by
    ``fn'(x)``. Wherever ``fn'(x)`` is ``inf`` or NaN (``log`` at 0, ``sqrt`` at 0, ``pow``
    of a negative base, ...) the product ``0 * inf`` is NaN, and it lands in ``dx``
    although ``fn(x)`` was never used.

    The fix is a second ``where`` on the input, so ``fn`` only ever sees values in its
    domain::

        x_safe = tf.where(condition, x, safe_x)
        result = tf.where(condition, fn(x_safe), otherwise)

    Where ``condition`` is false the gradient with respect to ``x`` is then exactly 0.

    Args:
        condition: boolean tensor, broadcastable against ``x``.
        fn: elementwise function of one tensor, finite with a finite derivative at
            ``safe_x`` and wherever ``condition`` holds.
        x: floating-point tensor.
        otherwise: value (or tensor, broadcastable against ``x``) used where
            ``condition`` is false. Converted to ``x.dtype``.
        safe_x: a point inside the domain of ``fn`` that replaces ``x`` where
            ``condition`` is false. Its value never reaches the result.

    Returns:
        A tensor of the broadcast shape of ``condition`` and ``x``, dtype of ``x``.

    Raises:
        TypeError: if ``x`` is not floating point, ``condition`` is not boolean, or
            ``fn`` is not callable.

    Example:
        >>> x = tf.constant([0.0, 1.0])
        >>> with tf.GradientTape() as tape:
        ...     tape.watch(x)
        ...     y = double_where(x > 0, tf.math.log, x, 0.0)
        >>> tape.gradient(y, x).numpy()
        array([0., 1.], dtype=float32)
    """
    if not callable(fn):
        raise TypeError(f"fn must be a callable like tf.math.log, got {type(fn).__name__}")
    x = _as_float_tensor(x, "x")
    condition = tf.convert_to_tensor(condition)
    if condition.dtype != tf.bool:
        raise TypeError(f"condition must be a boolean tensor, got dtype {condition.dtype.name}")
    otherwise = tf.cast(tf.convert_to_tensor(otherwise, dtype_hint=x.dtype), x.dtype)
    safe = tf.cast(safe_x, x.dtype)
    x_safe = tf.where(condition, x, safe)
    return tf.where(condition, fn(x_safe), otherwise)


# --- powers: the x^b and f^c of case A ---------------------------------------------------

_HALF_DTYPES = (tf.float16, tf.bfloat16)


def _float_limits(dtype: tf.DType) -> tuple[float, float]:
    """(smallest normal number, largest finite number) of a TensorFlow float dtype."""
    if dtype == tf.bfloat16:  # NumPy's finfo does not know bfloat16
        return 2.0**-126, float(dtype.max)
    info = np.finfo(dtype.as_numpy_dtype)
    return float(info.tiny), float(info.max)


def _sum_to_shape(gradient: tf.Tensor, shape: tf.Tensor, other_shape: tf.Tensor) -> tf.Tensor:
    """Undo broadcasting in a gradient: sum over the broadcast axes, reshape to ``shape``."""
    axes, _ = tf.raw_ops.BroadcastGradientArgs(s0=shape, s1=other_shape)
    return tf.reshape(tf.reduce_sum(gradient, axis=axes), shape)


# safe_pow and signed_pow, in detail (safe_pow's docstring is the summary).
#
# **Why the naive form fails.** `tf.pow(x, p)` has the right value at 0, but its
# gradient with respect to the base, ``p * 0^(p-1)``, is ``+inf`` for ``0 < p < 1``.
# The chain rule multiplies it by the derivative of whatever produced the base: in
# ``(a * x) ** p`` that is ``x`` for ``a``, which is 0 at ``x = 0``, and ``0 * inf``
# is NaN, while the loss stays finite. (TensorFlow 2.21 masks the exponent side,
# ``x^p log x = 0 * -inf``, but not the base side.) For ``x < 0`` and a non-integer
# ``p``, `tf.pow` returns NaN value and gradients, and ``tf.where(x > 0, tf.pow(x, p), 0)``
# does not help: the unused branch still sends its NaN into the gradient (the
# ``tf.where`` trap, see `double_where`).
#
# **What is computed instead.** A double where (the base is replaced by 1 wherever it
# is not a positive normal number, so `tf.pow` never sees 0 or a negative number) and a
# `tf.custom_gradient` that returns the derivatives above, clamped to the finite range.
#
# **The gradient at 0.** For ``x < 0`` the function is the constant 0, so both
# derivatives are 0. At ``x = 0`` itself ``d/dx`` is taken to be 0, the derivative from
# the left, as `tf.nn.relu` does at 0 (``safe_pow(x, 1)`` is relu). For ``p > 1`` that
# is the true derivative; for ``p = 1`` it is one of the two one-sided ones; for
# ``p < 1`` the derivative from the right is ``+inf`` and any finite value is a
# convention. 0 is chosen over the largest finite number because:
#
# - a gradient of about 3.4e38 (float32) is not usable: multiplied by any weight
#   larger than 1 it overflows to inf, and Adam squares it into its second moment,
#   which becomes inf: the step leaves the weight unchanged and the next one makes it
#   NaN (``inf - inf`` in the moment update), so the NaN only moves one op on;
# - in the chain ``x -> a x -> (a x)^p`` the gradient with respect to ``a`` at
#   ``x = 0`` is ``x * f'(0) = 0`` for any finite ``f'(0)``, and 0 is also its true
#   limit, ``lim x * p (a x)^(p-1) = p a^(p-1) x^p -> 0``. The convention only shows
#   where the base is shifted, ``(x + s)^p``, whose true gradient is infinite anyway;
# - just right of 0 the derivative keeps its large true value (``p x^(p-1) <= 1/x``
#   for ``p <= 1, x <= 1``, finite for every normal ``x``): the steepness is not
#   hidden, only the single point where it is infinite.
#
# **Thresholds from the dtype.** "``x > 0``" is ``x >= finfo.tiny``, the smallest
# normal number of the dtype the power is computed in (float32 for float16 and
# bfloat16 inputs): TensorFlow's CPU kernels flush subnormal numbers to zero, and this
# makes a subnormal ``x`` count as 0 on every device.
#
# **The gradient's products.** What the custom gradient returns is the upstream
# gradient ``g`` times a derivative, ``g p x^(p-1)`` and ``g x^p log(x)``, and that
# product is what must not overflow where it is representable. Neither derivative
# formula is safe alone: ``p * (x^p / x)`` overflows with ``x^p`` (``x > 1.8e19`` for
# ``p = 2`` in float32) although ``p x^(p-1)`` is still finite, and
# ``p * exp((p - 1) log x)`` is exact to only ``|(p - 1) log x| * eps``. And a
# derivative beyond the float range (``3 x^2 = 3e40`` at ``x = 1e20``) can meet a small
# ``g`` (``1e-10``: product ``3e30``). So each product is formed from the value,
# ``g * (p * (x^p / x))`` and ``g * (x^p * log x)``, where the derivative is a finite
# normal number, and otherwise in log space,
# ``exp(log|g| + log p + (p - 1) log x)`` and ``exp(log|g| + p log x + log|log x|)``
# (with signs), whose exponent cannot overflow. A product beyond the float range is
# clamped to ``[-finfo.max, finfo.max]`` (for a finite ``g``; an infinite or NaN ``g``
# passes through), so the gradients are finite for every finite ``x`` and ``g``. What
# happens after the custom gradient is TensorFlow's: in ``d/da (a x)^p`` the product
# with ``x`` (``p (a x)^(p-1) * x``) and the sum over the elements of ``x`` overflow
# where their true value does (five terms of 6.8e37 sum to inf in float32), and where
# ``p (a x)^(p-1)`` itself is beyond the float range but ``x < 1`` brings the product
# back into it, the clamped derivative makes that product too small (no value the
# power could return would be right there).
#
# **Accuracy.** The value is `tf.pow`'s own for ``x >= tiny`` (in float32 within
# 2e-6 relative error of the exact value wherever that is a normal number). The
# gradients are within a few ulp where they are formed from the value. In log space
# the rounding of the exponent, about ``(|log g| + |(p - 1) log x|) * eps`` relative
# (1e-5 in float32), is avoided by doing that path in float64, rounded once to the
# dtype (tested within 1e-5 against a float64 reference for upstream gradients from
# 2^-126 to 2^127; the float64 path of float64 inputs keeps about 2e-14). float16 and
# bfloat16 inputs are computed in float32 and cast back.


def _power_float(x: tf.Tensor, p: tf.Tensor, *, signed: bool, limit: float) -> tf.Tensor:
    """`safe_pow` (``signed=False``) or `signed_pow` (``signed=True``) in float32/float64.

    ``limit`` is the largest finite number of the caller's dtype: the derivatives are
    clamped to it, so they stay finite after a cast back to float16 or bfloat16.
    """
    dtype = x.dtype
    tiny = tf.constant(_float_limits(dtype)[0], dtype)
    limit = tf.constant(limit, dtype)
    nan = tf.constant(np.nan, dtype)

    @tf.custom_gradient
    def power(x, p):
        magnitude = tf.abs(x) if signed else x
        # The double where: pow and log only ever see a normal positive base; 1 replaces
        # every other base, and what it gives is discarded.
        inside = magnitude >= tiny
        base = tf.where(inside, magnitude, tf.ones_like(magnitude))
        powered = tf.pow(base, p)
        is_nan = tf.math.is_nan(x) | tf.math.is_nan(p)  # NaN in, NaN out: the where would hide it
        value = tf.where(inside, powered, tf.zeros_like(powered))
        if signed:
            value = tf.where(x < 0, -value, value)
        value = tf.where(is_nan, nan, value)

        def grad(upstream: tf.Tensor):
            # The chain rule needs upstream * d/dx and upstream * d/dp, with
            # d/dx |x|^p = p |x|^(p-1) and d/dp |x|^p = |x|^p log|x|. Each product is
            # formed here, in one of two ways, so that no intermediate over- or underflows
            # where the product itself is representable:
            # - where the derivative is a finite normal number, from the value:
            #   upstream * (p * (|x|^p / |x|)) and upstream * (|x|^p * log|x|), a few ulp;
            # - elsewhere (|x|^p or the derivative over- or underflows, e.g. x^p = inf at
            #   x = 1e20, p = 3, where upstream * 3e40 can still be finite), in log space:
            #   exp(log|upstream| + log|p| + (p - 1) log|x|) and
            #   exp(log|upstream| + p log|x| + log|log|x||), with signs. The sum of logs
            #   is at most a few hundred and cannot overflow. Its rounding error, about
            #   (|log upstream| + |exponent|) * eps relative, would be ~1e-5 in float32
            #   (exp turns an absolute error of the exponent into a relative one), so
            #   float32 does this path in float64: one rounding, at the cast back.
            # A product beyond the finite range is clamped to +-limit (finite upstream).
            log_base = tf.math.log(base)
            finite_upstream = tf.math.is_finite(upstream)
            wide = tf.float64
            log_base_w = tf.math.log(tf.cast(base, wide))
            p_w = tf.cast(p, wide)
            log_upstream_w = tf.math.log(tf.abs(tf.cast(upstream, wide)))
            sign_upstream = tf.sign(upstream)

            def times_upstream(plain, log_magnitude_w, sign):
                usable = tf.math.is_finite(plain) & ((tf.abs(plain) >= tiny) | tf.equal(plain, 0))
                magnitude = tf.cast(tf.exp(log_upstream_w + log_magnitude_w), dtype)  # inf if too large
                via_log = sign_upstream * sign * magnitude
                product = tf.where(usable, upstream * plain, via_log)
                clamped = tf.minimum(tf.maximum(product, -limit), limit)
                return tf.where(finite_upstream, clamped, product)

            normal = tf.math.is_finite(powered) & (powered >= tiny)
            zero = upstream * tf.zeros_like(powered)  # NaN where upstream is, as upstream * 0
            # d/dx. The where keeps p * (inf / x) out of the product: that path is unused.
            from_value = tf.where(normal, p * (powered / base), tf.fill(tf.shape(powered), nan))
            log_slope = tf.math.log(tf.abs(p_w)) + tf.math.multiply_no_nan(log_base_w, p_w - 1)
            dx = times_upstream(from_value, log_slope, tf.sign(p))
            # The boundary |x| < tiny: derivative 0 (see the docstrings), except
            # signed_pow(x, 1) = x, whose derivative 1 is kept.
            boundary = zero
            if signed:
                boundary = tf.where(tf.equal(p, 1), upstream + zero, boundary)
            dx = tf.where(inside, dx, boundary)
            # d/dp: 0 where the value is the constant 0.
            from_value_p = tf.where(normal, powered * log_base, tf.fill(tf.shape(powered), nan))
            log_dp = p_w * log_base_w + tf.math.log(tf.abs(log_base_w))
            dp = times_upstream(from_value_p, log_dp, tf.sign(log_base))
            dp = tf.where(inside, dp, zero)
            if signed:
                dp = tf.where(x < 0, -dp, dp)
            dx = tf.where(is_nan, nan, dx)
            dp = tf.where(is_nan, nan, dp)
            shape_x, shape_p = tf.shape(x), tf.shape(p)
            return _sum_to_shape(dx, shape_x, shape_p), _sum_to_shape(dp, shape_p, shape_x)

        return value, grad

    return power(x, p)


def _power(x, p, *, signed: bool, name: str) -> tf.Tensor:
    with tf.name_scope(name):
        x = _as_float_tensor(x, "x")
        p = _as_float_tensor(p, "p", dtype=x.dtype)
        limit = _float_limits(x.dtype)[1]
        if x.dtype in _HALF_DTYPES:
            result = _power_float(tf.cast(x, tf.float32), tf.cast(p, tf.float32), signed=signed, limit=limit)
            return tf.cast(result, x.dtype)
        return _power_float(x, p, signed=signed, limit=limit)


def safe_pow(x, p, name: str | None = None) -> tf.Tensor:
    r"""``x**p`` for ``x > 0`` and ``0`` for ``x <= 0``, with finite gradients everywhere.

    .. code-block:: none

        safe_pow(x, p) = x^p    for x > 0,         0 for x <= 0          (p > 0)
        d/dx           = p x^(p-1) for x > 0,      0 for x <= 0
        d/dp           = x^p log(x) for x > 0,     0 for x <= 0

    `tf.pow(x, p)` has an infinite gradient with respect to the base at 0 for
    ``0 < p < 1`` (NaN once the chain rule multiplies it by 0) and NaN values and
    gradients for a negative base; `safe_pow` computes the power through a double where
    and a custom gradient, takes ``d/dx = 0`` at ``x = 0`` (as `tf.nn.relu` does), counts
    subnormal bases as 0, and keeps both gradients finite for every finite ``x`` and
    upstream gradient. The chapter *The log-exp power* (``book/case_a/log_exp_power``) derives
    it; the comments above ``_power_float`` give the conventions and the accuracy.

    Args:
        x: floating-point tensor (float16, bfloat16, float32 or float64).
        p: the exponent, broadcastable against ``x``, same dtype (a Python number is
            converted). Meant for ``p > 0`` (the guarantees are tested for
            ``0.05 <= p <= 4``); for ``p <= 0`` the result is still ``x^p`` for
            ``x > 0`` and 0 for ``x <= 0`` (not the limit 1 or inf), with clamped
            derivatives.
        name: name scope of the ops; defaults to "safe_pow".

    Returns:
        A tensor of the broadcast shape of ``x`` and ``p``, dtype of ``x``; NaN where
        ``x`` or ``p`` is NaN.

    Raises:
        TypeError: if ``x`` is not floating point or ``p`` has another dtype.

    Example:
        >>> a = tf.Variable(1.5)
        >>> x = tf.constant([0.0, 4.0])
        >>> with tf.GradientTape() as tape:
        ...     y = tf.reduce_sum(safe_pow(a * x, 0.5))  # tf.pow: the gradient is NaN
        >>> round(float(y), 4), round(float(tape.gradient(y, a)), 4)
        (2.4495, 0.8165)
    """
    return _power(x, p, signed=False, name=name or "safe_pow")


def signed_pow(x, p, name: str | None = None) -> tf.Tensor:
    r"""``sign(x) * |x|**p``, the odd extension of the power, with finite gradients.

    .. code-block:: none

        signed_pow(x, p) = sign(x) |x|^p,          signed_pow(0, p) = 0       (p > 0)
        d/dx             = p |x|^(p-1)  for x != 0
        d/dp             = sign(x) |x|^p log|x| for x != 0,   0 at x = 0

    For inputs that can be negative: a learned power of a signed quantity, or a target
    like ``sign(x) |x|^b`` on [-1, 1]. It is odd and increasing in ``x`` for ``p > 0``,
    so unlike `safe_pow` it does not map a whole half-line to a constant (whose zero
    gradient can leave a term dead).

    **Why the naive form fails.** ``tf.sign(x) * tf.pow(tf.abs(x), p)`` has the right
    value, but at ``x = 0`` the derivative of ``|x|^p`` is ``+inf`` for ``p < 1`` and the
    chain rule multiplies it by ``sign(0) = 0`` or by the 0 of an ``a * x`` upstream:
    NaN. `tf.pow(x, p)` itself is NaN for negative ``x`` and non-integer ``p``.

    **The gradient at 0.** ``d/dx`` at ``x = 0`` is the true derivative where it is
    finite, 0 for ``p > 1`` and 1 for ``p = 1`` (``signed_pow(x, 1)`` is the identity),
    and 0 for ``p < 1``, where the true derivative is ``+inf`` from both sides. 0 rather
    than the largest finite number, for the reasons given in `safe_pow`: a gradient of
    ~1e38 overflows one multiplication later and poisons Adam's second moment, and in
    ``(a x)^p`` the gradient with respect to ``a`` at ``x = 0`` is 0 for any finite
    convention, its true limit. ``d/dp`` at 0 is 0: the value is 0 for every ``p``.

    Everything else (the double where, the custom gradient, ``x`` below the smallest
    normal number counting as 0, derivatives clamped to the dtype's finite range, value
    accuracy equal to `tf.pow`'s, float16/bfloat16 computed in float32) is as in
    `safe_pow`, applied to ``|x|``.

    Args:
        x: floating-point tensor (float16, bfloat16, float32 or float64), any sign.
        p: the exponent, broadcastable against ``x``, same dtype (a Python number is
            converted); meant for ``p > 0`` (tested for ``0.05 <= p <= 4``).
        name: name scope of the ops; defaults to "signed_pow".

    Returns:
        A tensor of the broadcast shape of ``x`` and ``p``, dtype of ``x``; NaN where
        ``x`` or ``p`` is NaN.

    Raises:
        TypeError: if ``x`` is not floating point or ``p`` has another dtype.

    Example:
        >>> x = tf.constant([-8.0, 0.0, 8.0])
        >>> with tf.GradientTape() as tape:
        ...     tape.watch(x)
        ...     y = signed_pow(x, 1.0 / 3.0)
        >>> y.numpy().round(4)
        array([-2.,  0.,  2.], dtype=float32)
        >>> tape.gradient(y, x).numpy().round(4)
        array([0.0833, 0.    , 0.0833], dtype=float32)
    """
    return _power(x, p, signed=True, name=name or "signed_pow")


def log_exp_pow(x, p, eps: float = 1e-6, name: str | None = None) -> tf.Tensor:
    r"""The power that case A's answer proposes, exactly as written: ``exp(p * log(max(x, eps)))``.

    .. code-block:: none

        log_exp_pow(x, p) = exp(p log(max(x, eps)))
                          = x^p for x >= eps,   eps^p for x < eps

    Kept so that the book can measure what it costs; use `safe_pow` or `signed_pow`
    instead. Its gradients are finite at 0 (``max`` sends the gradient to ``eps``, so
    ``d/dx = 0`` for ``x < eps``), but:

    - **the value at 0 is eps^p, not 0**: ``1e-3`` for ``p = 0.5``, ``0.25`` for
      ``p = 0.1``; a model that needs ``g(0) = 0`` has to fight it with other terms;
    - **negative inputs are silently mapped to eps^p**: no NaN that would say that
      ``x^p`` is not defined there, and a zero gradient that says nothing either;
    - **``d/dx`` is 0 for all ``x < eps``**: no learning signal there;
    - **the relative error grows with ``|p log x|``**: the rounding error of
      ``p * log(x)`` (about ``|p log x|`` ulps of 1) is turned by ``exp`` into a
      relative error of about ``|p log x| * eps_machine``, e.g. ~1e-5 in float32 for
      ``x = 1e38, p = 1`` (``|p log x| = 87.5``), where `tf.pow` is within an ulp or two.
    - ``eps = 1e-6`` is a float32 choice: it is subnormal in float16 (smallest normal
      6.1e-5), where TensorFlow may flush it to 0 and ``log`` returns ``-inf``.

    Args:
        x: floating-point tensor.
        p: the exponent, broadcastable against ``x``, same dtype (a Python number is
            converted).
        eps: the positive floor of ``x``, converted to ``x``'s dtype. Default 1e-6, the
            answer's value.
        name: name scope of the ops; defaults to "log_exp_pow".

    Returns:
        A tensor of the broadcast shape of ``x`` and ``p``, dtype of ``x``.

    Raises:
        TypeError: if ``x`` is not floating point or ``p`` has another dtype.
        ValueError: if ``eps`` is not a positive finite number.

    Example:
        >>> x = tf.constant([-1.0, 0.0, 4.0])
        >>> log_exp_pow(x, 0.1).numpy().round(4)  # x^0.1 is 0 at 0
        array([0.2512, 0.2512, 1.1487], dtype=float32)
    """
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating, np.integer)):
        raise TypeError(f"eps must be a positive number like 1e-6, got {type(eps).__name__} {eps!r}")
    if not (math.isfinite(float(eps)) and float(eps) > 0):
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")
    with tf.name_scope(name or "log_exp_pow"):
        x = _as_float_tensor(x, "x")
        p = _as_float_tensor(p, "p", dtype=x.dtype)
        return tf.exp(p * tf.math.log(tf.maximum(x, tf.constant(eps, x.dtype))))


def _check_interval(low, high) -> tuple[float, float]:
    for label, bound in (("low", low), ("high", high)):
        if isinstance(bound, bool) or not isinstance(bound, (int, float, np.floating, np.integer)):
            raise TypeError(f"{label} must be a real number, got {type(bound).__name__} {bound!r}")
        if not math.isfinite(float(bound)):
            raise ValueError(f"{label} must be finite, got {bound!r}")
    if not float(low) < float(high):
        raise ValueError(f"low must be smaller than high, got low={low!r} and high={high!r}")
    return float(low), float(high)


def bounded(raw, low: float, high: float, name: str | None = None) -> tf.Tensor:
    r"""Map an unconstrained value into the interval (low, high) with a sigmoid.

    .. code-block:: none

        bounded(raw, low, high) = low + (high - low) * sigmoid(raw)
        d/draw                  = (high - low) * sigmoid(raw) * (1 - sigmoid(raw))

    Used for the exponents ``b`` and ``c`` of case A, which a network predicts as
    unconstrained numbers: the answer proposes ``b = 0.1 + 1.9 * sigmoid(b_raw)``, i.e.
    ``bounded(b_raw, 0.1, 2.0)``. The value and the gradient are finite for every
    ``raw``, including ``+-inf`` (sigmoid is computed stably by TensorFlow).

    What it does not do: it keeps an exponent *finite*, not *safe*. An interval that
    contains exponents below 1, like the answer's [0.1, 2], still allows
    ``tf.pow(0, b)`` with its infinite base-side derivative; that needs `safe_pow`.
    Near the bounds the sigmoid saturates and the gradient vanishes (it is below
    ``(high - low) * 4.5e-5`` for ``|raw| > 10``), and in floating point the result
    reaches ``high`` exactly once ``sigmoid(raw)`` rounds to 1 (``raw > 16.6`` in
    float32, where the gradient is exactly 0) and ``low`` once ``(high - low) *
    sigmoid(raw)`` is below half an ulp of ``low`` (``raw < -20`` for [0.1, 2], although
    the gradient stays nonzero down to ``raw = -87``), so the interval is closed in
    practice; the result is
    clipped to ``[low, high]`` (rounded to the dtype) so that rounding never steps past
    a bound. (A bound smaller in magnitude than the dtype's smallest normal number, such
    as 1e-39 in float32, acts as 0 on CPU, where TensorFlow flushes subnormals to zero.)

    Args:
        raw: floating-point tensor of unconstrained values.
        low: lower bound, a finite Python number.
        high: upper bound, a finite Python number larger than ``low``.
        name: name scope of the ops; defaults to "bounded".

    Returns:
        A tensor of the shape and dtype of ``raw`` with values in [low, high].

    Raises:
        TypeError: if ``raw`` is not floating point or a bound is not a number.
        ValueError: if a bound is not finite or ``low >= high``.

    Example:
        >>> bounded(tf.constant([-100.0, 0.0, 100.0]), 0.1, 2.0).numpy()
        array([0.1 , 1.05, 2.  ], dtype=float32)
    """
    low, high = _check_interval(low, high)
    with tf.name_scope(name or "bounded"):
        raw = _as_float_tensor(raw, "raw")
        # tf.constant, not tf.cast: a cast would round the Python float to float32 first.
        low_t, high_t = tf.constant(low, raw.dtype), tf.constant(high, raw.dtype)
        value = low_t + tf.constant(high - low, raw.dtype) * tf.sigmoid(raw)
        # The rounding of the product and the sum can step one ulp past a bound.
        return tf.minimum(tf.maximum(value, low_t), high_t)


def bounded_inverse(value, low: float, high: float, name: str | None = None) -> tf.Tensor:
    r"""The ``raw`` for which `bounded` returns ``value``: the inverse of ``low + (high - low) sigmoid(raw)``.

    .. code-block:: none

        bounded_inverse(v, low, high) = logit((v - low) / (high - low))
                                      = log(v - low) - log(high - v)

    Use it to make a bounded parameter start at a chosen value, e.g. an exponent at
    ``b = 1``: initialise ``b_raw`` to ``bounded_inverse(1.0, 0.1, 2.0)`` (= -0.1054).
    The right-hand form has no cancellation near either bound (``1 - t`` for
    ``t = (v - low) / (high - low)`` near 1 would lose digits); it is evaluated in
    float64 and rounded to the dtype of ``value``, so
    ``bounded(bounded_inverse(v, low, high), low, high)`` is ``v`` up to the rounding of
    `bounded` itself (a few ulp).

    Args:
        value: floating-point tensor or number, strictly between ``low`` and ``high``.
        low: lower bound, a finite Python number.
        high: upper bound, a finite Python number larger than ``low``.
        name: name scope of the ops; defaults to "bounded_inverse".

    Returns:
        A tensor of the shape of ``value``, dtype of ``value`` (float32 for a Python
        number).

    Raises:
        TypeError: if ``value`` is not floating point or a bound is not a number.
        ValueError: if a bound is not finite, ``low >= high``, or (for a value known
            when the function is called) some ``value`` is not strictly inside
            ``(low, high)``. Inside a ``tf.function`` the last check is a
            ``tf.debugging`` assertion, raising ``InvalidArgumentError`` when it runs.

    Example:
        >>> raw = bounded_inverse(1.0, 0.1, 2.0)
        >>> round(float(raw), 4), float(bounded(raw, 0.1, 2.0))
        (-0.1054, 1.0)
    """
    low, high = _check_interval(low, high)
    with tf.name_scope(name or "bounded_inverse"):
        value = _as_float_tensor(value, "value")
        wide = tf.cast(value, tf.float64)
        static = wide.numpy() if tf.executing_eagerly() else tf.get_static_value(wide)
        if static is not None:
            concrete = np.asarray(static)
            outside = ~((concrete > low) & (concrete < high))  # NaN counts as outside
            if np.any(outside):
                first = concrete[outside].flat[0] if concrete.ndim else concrete
                raise ValueError(
                    f"value must lie strictly between low={low} and high={high}, got {first!r}"
                    + (f" ({int(outside.sum())} of {concrete.size} values outside)" if concrete.ndim else "")
                )
            checks = []
        else:
            checks = [
                tf.debugging.assert_greater(wide, tf.constant(low, tf.float64), message="value must be > low"),
                tf.debugging.assert_less(wide, tf.constant(high, tf.float64), message="value must be < high"),
            ]
        with tf.control_dependencies(checks):
            raw = tf.math.log(wide - low) - tf.math.log(high - wide)
        return tf.cast(raw, value.dtype)


# tilted_mean, the f of case B, lives in companion._tilted_mean (its series and its
# closed form); it is part of this module's API. The private names are re-exported for
# the tests that check the series' coefficients and budgets.
from companion._tilted_mean import (  # noqa: E402
    _SERIES_DERIVATIVE_BUDGET,
    _SERIES_VALUE_BUDGET,
    _TILTED_MEAN_SWITCH,
    _ECONOMIZED_TAYLOR_TERMS,
    _bernoulli_numbers,
    _economized,
    _tilted_mean_coefficients,
    _tilted_mean_derivative,
    _tilted_mean_polynomials,
    _tilted_mean_series_length,
    _tilted_mean_value,
    tilted_mean,
    tilted_mean_series_terms,
)
