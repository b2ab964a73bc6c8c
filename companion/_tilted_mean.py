"""tilted_mean, the f(x) = 1/(1 - e^(-x)) - 1/x of case B, evaluated without NaN.

Public through :mod:`companion.numerics`; the derivation (Bernoulli series, the closed
form, the switch point) is in the chapters *Taylor and asymptotics* and *Blending done
right*.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import numpy as np
import tensorflow as tf

from companion._checks import as_float_tensor as _as_float_tensor


#: |x| above which `tilted_mean` uses its closed form (see the docstring for why 4).
_TILTED_MEAN_SWITCH = 4.0

#: Series truncation budgets, as fractions of the dtype's eps (the ulp of 1). See
#: `_economized`: each keeps the truncation error of the polynomial below 1/16 ulp of the
#: smallest value (or derivative) `tilted_mean` returns from it.
_SERIES_VALUE_BUDGET = 1.0 / 64.0
_SERIES_DERIVATIVE_BUDGET = 1.0 / 128.0

#: Taylor terms economized into the polynomials (their remainder at |z| <= 2 is below
#: 2 zeta(4) (2 / 2 pi)^(2 N) ~ 3e-24, negligible against either budget).
_ECONOMIZED_TAYLOR_TERMS = 24


def _bernoulli_numbers(count: int) -> list[Fraction]:
    """The exact Bernoulli numbers B_0, ..., B_{count-1} (Akiyama–Tanigawa algorithm).

    This algorithm gives B_1 = +1/2; only the even-index numbers are used here, and
    those do not depend on the convention.
    """
    row: list[Fraction] = []
    numbers: list[Fraction] = []
    for m in range(count):
        row.append(Fraction(1, m + 1))
        for j in range(m, 0, -1):
            row[j - 1] = j * (row[j - 1] - row[j])
        numbers.append(row[0])
    return numbers


def _tilted_mean_series_length(eps: float, z_max: float) -> tuple[int, int]:
    """Number of Taylor terms for the value and the derivative of the series at |z| <= z_max.

    The coefficients of f(z) - 1/2 = sum_{k>=1} c_k z^(2k-1) are c_k = B_2k / (2k)!
    = (-1)^(k+1) 2 zeta(2k) / (2 pi)^(2k), so |c_k| <= 2 zeta(4) / (2 pi)^(2k) for k >= 2.
    With rho = (z / 2 pi)^2 < 1 the remainders after K terms are bounded by geometric
    series:

        |R_K(z)|  <= 2 zeta(4) |z|^(2K+1) / (2 pi)^(2K+2) / (1 - rho)
        |R'_K(z)| <= 2 zeta(4) |z|^(2K)   / (2 pi)^(2K+2) * ((2K+1)/(1-rho) + 2 rho/(1-rho)^2)

    K is the smallest count with |R_K| <= eps/64 (value) and |R'_K| <= eps/128
    (derivative): (8, 10) in float32, (17, 19) in float64. `tilted_mean` no longer sums
    the truncated series; this is the count its economized polynomials
    (`_tilted_mean_coefficients`) are compared with, in the book and the tests.
    """
    zeta4 = math.pi**4 / 90.0
    two_pi = 2.0 * math.pi
    rho = (z_max / two_pi) ** 2

    def value_bound(k: int) -> float:
        return 2.0 * zeta4 * z_max ** (2 * k + 1) / two_pi ** (2 * k + 2) / (1.0 - rho)

    def derivative_bound(k: int) -> float:
        factor = (2 * k + 1) / (1.0 - rho) + 2.0 * rho / (1.0 - rho) ** 2
        return 2.0 * zeta4 * z_max ** (2 * k) / two_pi ** (2 * k + 2) * factor

    k_value = next(k for k in range(1, 200) if value_bound(k) <= _SERIES_VALUE_BUDGET * eps)
    k_derivative = next(k for k in range(1, 200) if derivative_bound(k) <= _SERIES_DERIVATIVE_BUDGET * eps)
    return k_value, k_derivative


def _economized(taylor: list[Fraction], w_max: Fraction, budget: float) -> tuple[list[Fraction], Fraction]:
    """Chebyshev economization of the power series sum_k taylor[k] w^k on [0, w_max].

    Exact rational arithmetic: with w = (w_max / 2)(1 + s), s in [-1, 1], the polynomial is
    rewritten in Chebyshev polynomials T_j(s) (s^k = 2^(1-k) sum_j binom(k, j) T_(k-2j)(s),
    T_0 counted once), and the terms from the first whose dropped coefficients sum to at
    most `budget` onwards are dropped: |T_j| <= 1 on [-1, 1], so that sum bounds the
    error. The kept terms go back to powers of w. Returns the coefficients (lowest power
    first) and the bound.

    On [0, 4] the Chebyshev coefficients of these functions fall by a factor of about 41
    per term (the poles at w = -4 pi^2, Bernstein's ellipse), the Taylor coefficients by
    about 10: the economized polynomial needs 5 or 6 terms where the truncated Taylor
    series needs 8 or 10 (float32), 11 or 12 where it needs 17 or 19 (float64).
    """
    n = len(taylor)
    half = w_max / 2
    in_s = [Fraction(0)] * n  # the series in s: sum_k taylor[k] half^k (1 + s)^k
    for k, a in enumerate(taylor):
        for j in range(k + 1):
            in_s[j] += a * half**k * math.comb(k, j)
    chebyshev = [Fraction(0)] * n
    for k, a in enumerate(in_s):
        for j in range(k // 2 + 1):
            weight = Fraction(math.comb(k, j), 2 ** (k - 1)) if k else Fraction(1)
            if k and k == 2 * j:
                weight /= 2
            chebyshev[k - 2 * j] += a * weight
    terms = next(m for m in range(1, n + 1) if float(sum(map(abs, chebyshev[m:]))) <= budget)
    bound = sum(map(abs, chebyshev[terms:]))
    # Back to powers of s (T_0 = 1, T_1 = s, T_(j+1) = 2 s T_j - T_(j-1)), then of w.
    in_s = [Fraction(0)] * terms
    previous, current = [Fraction(1)], [Fraction(0), Fraction(1)]
    for j, a in enumerate(chebyshev[:terms]):
        polynomial = previous if j == 0 else current
        for i, b in enumerate(polynomial):
            in_s[i] += a * b
        if j >= 1:
            shifted = [Fraction(0)] + [2 * b for b in current]
            previous, current = current, [b - (previous[i] if i < len(previous) else 0)
                                          for i, b in enumerate(shifted)]
    in_w = [Fraction(0)] * terms  # s = w / half - 1
    for k, a in enumerate(in_s):
        for j in range(k + 1):
            in_w[j] += a * math.comb(k, j) * (-1) ** (k - j) / half**j
    return in_w, bound


@functools.lru_cache(maxsize=None)
def _tilted_mean_polynomials(dtype_name: str) -> tuple[tuple[Fraction, ...], tuple[Fraction, ...], float, float]:
    """The exact polynomials P and Q for a float32/float64 dtype, and their error bounds.

    f(z) = 1/2 + z P(z^2) and f'(z) = Q(z^2) for |z| <= 2 (the halved argument of the
    series branch), P and Q economized (`_economized`) from the Taylor series
    P(w) = sum_k c_k w^(k-1), Q(w) = sum_k (2k-1) c_k w^(k-1), c_k = B_2k / (2k)!, with the
    fewest terms whose error stays within the budgets: |z| |P - P_exact| <= eps/64 (so P
    within eps/128) and |Q - Q_exact| <= eps/128, eps from the dtype.
    """
    eps = float(np.finfo(dtype_name).eps)
    count = _ECONOMIZED_TAYLOR_TERMS
    bernoulli = _bernoulli_numbers(2 * count + 3)
    c = [bernoulli[2 * k] / math.factorial(2 * k) for k in range(1, count + 1)]
    w_max = Fraction(_TILTED_MEAN_SWITCH / 2) ** 2
    z_max = _TILTED_MEAN_SWITCH / 2
    p, p_bound = _economized(c, w_max, _SERIES_VALUE_BUDGET * eps / z_max)
    q, q_bound = _economized([(2 * k + 1) * c[k] for k in range(count)], w_max, _SERIES_DERIVATIVE_BUDGET * eps)
    return tuple(p), tuple(q), float(p_bound * Fraction(z_max)), float(q_bound)


@functools.lru_cache(maxsize=None)
def _tilted_mean_coefficients(dtype_name: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Horner coefficients (highest power first) of P and Q, for a float32/float64 dtype.

    The exact economized polynomials of `_tilted_mean_polynomials`, rounded to float64
    (and to the dtype where they are used). Their leading coefficients are the Taylor
    coefficients 1/12, -1/720, 1/30240, ... (P) and 1/12, -3/720, 5/30240, ... (Q), each
    moved a little to spread the error of the dropped terms over [0, 4]: by relative
    amounts of 1e-8, 7e-6, 6e-4 for P in float32 (where fewer terms are kept), 2e-18, 7e-15,
    3e-12 in float64.
    """
    p, q, _, _ = _tilted_mean_polynomials(dtype_name)
    return tuple(float(a) for a in reversed(p)), tuple(float(a) for a in reversed(q))


def _horner(w: tf.Tensor, coefficients: tuple[float, ...]) -> tf.Tensor:
    """The polynomial with `coefficients` (highest power first) at `w`, by Horner's rule."""
    result = tf.fill(tf.shape(w), tf.constant(coefficients[0], w.dtype))
    for coefficient in coefficients[1:]:
        result = result * w + coefficient
    return result


def _estrin(w: tf.Tensor, coefficients: tuple[float, ...]) -> tf.Tensor:
    """The polynomial with `coefficients` (highest power first) at `w`, by Estrin's scheme.

    The same terms as `_horner`, summed as a tree: P = P_low + w^k P_high with k the
    largest power of two below the number of terms, each half the same way, down to pairs
    a + b w. Horner's rule is one chain of 2(n-1) dependent operations; Estrin's is about
    2 log2(n) deep, so the CPU overlaps the work of neighbouring elements instead of waiting
    on each product (the polynomials are most of tilted_mean's arithmetic: in float64 11
    and 12 terms). Either rounds about 2n operations once each; on these polynomials, whose
    terms fall by a factor of about 10 each, the error is that of the first terms either
    way.

    Each join is written P_low - w^k (-P_high), with -P_high summed from the negated
    coefficients (bit for bit the negation, rounding being symmetric): a chain of adds
    would be regrouped by tf.function's arithmetic optimizer (into AddN, in its own
    order), and the results in a graph would differ from eager ones in the last bit.
    """
    lowest_first = tuple(reversed(coefficients))
    powers = {1: w}

    def power(k: int) -> tf.Tensor:
        if k not in powers:
            half_power = power(k // 2)
            powers[k] = half_power * half_power
        return powers[k]

    def tree(terms: tuple[float, ...]):
        if len(terms) == 1:
            return tf.constant(terms[0], w.dtype)
        if len(terms) == 2:
            return terms[0] + terms[1] * w
        k = 1 << ((len(terms) - 1).bit_length() - 1)  # largest power of two < len(terms)
        return tree(terms[:k]) - power(k) * tree(tuple(-t for t in terms[k:]))

    if len(lowest_first) == 1:
        return tf.fill(tf.shape(w), tf.constant(lowest_first[0], w.dtype))
    return tree(lowest_first)


def _series(w: tf.Tensor, coefficients: tuple[float, ...]) -> tf.Tensor:
    """The series polynomial at `w`: by Estrin's scheme in float64, by Horner's rule in float32.

    The polynomials are much of tilted_mean's arithmetic, evaluated for every element
    (both branches are). In float64 (11 and 12 terms) Estrin's shorter chains make
    tilted_mean's forward and backward pass a little faster under XLA (0.95 and 0.98 times
    the time with Horner's rule in two runs of 41 side-by-side rounds on an AMD EPYC with
    AVX-512); in float32 (5 and 6 terms) Horner's rule is as fast, and rounds fewer
    operations.
    """
    return _estrin(w, coefficients) if w.dtype == tf.float64 else _horner(w, coefficients)


def _half_exponential(x: tf.Tensor) -> tf.Tensor:
    """c = e^(-|x|/2), in [0, 1] (never overflows), 0 at abs(x) = inf, NaN at NaN.

    The value and the derivative both start from c, and under XLA it is the only op they
    share: the exponential gets a loop of its own, whose result both read, and each of
    them does its own divisions in its own loop. (A division that both used would get a
    loop of its own too, with the exponential: that loop, an exp and a division per
    element, was the slowest of the three. Divisions are cheap next to XLA's float64 exp,
    which is about a third of the float64 forward and backward pass.)
    """
    return tf.exp(-0.5 * tf.abs(x))


def _far_region(x: tf.Tensor, c: tf.Tensor):
    """What both closed forms use: the mask of the series region, t = max(|x|, 4), e, 1 - e.

    e = e^(-|x|) = c^2 in the closed-form region and 0 in the series region, so that
    1 - e >= 1 - e^(-4) > 0 wherever the closed form is evaluated, even where it is then
    discarded (the double-where of `double_where`: the autodiff of the derivative, i.e. the
    second derivative, sees only finite values). The select before the square also keeps
    XLA from rewriting c * c as exp(-|x|), a second exponential.
    """
    switch = tf.constant(_TILTED_MEAN_SWITCH, x.dtype)
    near = tf.abs(x) <= switch  # False for NaN: NaN takes the closed form and propagates.
    e = tf.square(tf.where(near, tf.zeros_like(c), c))
    return near, tf.maximum(tf.abs(x), switch), e, 1.0 - e


def _series_argument(x: tf.Tensor, near: tf.Tensor) -> tf.Tensor:
    """z = x/2 in the series region and 0 beyond (the series only sees its own region).

    With z = 0, z P(z^2) is exactly 0 where the closed form is used, so the value adds it
    unselected (one fused multiply-add under XLA, as z P + sigmoid written directly).
    """
    return tf.where(near, 0.5 * x, tf.zeros_like(x))


def _tilted_mean_value(x: tf.Tensor) -> tf.Tensor:
    """f(x) = (+-(q_1 - q_2) + z P(z^2)) m + k: two quotients, each used once; m, k selected.

    |x| <= 4 (halving identity): f(x) = (sigmoid(x/2) + f(x/2)) / 2 with
    sigmoid(x/2) = q_1 = (1 or c) / (1 + c) (x >= 0 or x < 0, c = e^(-|x|/2)), q_2 = 0,
    f(x/2) = z P(z^2) + 1/2, m = 1/2 and k = 1/4: (sigmoid + z P) / 2 + 1/4 rounds once,
    exactly as ((sigmoid + z P) + 1/2) / 2 does. Both halves are positive (no
    cancellation), and sigmoid(x/2) for x >= 0 is one division, not 1 - sigmoid(-x/2).

    |x| > 4, t = |x|: f(-t) = 1/t - r with q_2 = 1/t and q_1 = r = e / (1 - e) =
    1/expm1(t), and f(t) = 1 - f(-t): -(q_1 - q_2) + 0 for x < 0, (q_1 - q_2) + 1 for
    x > 0 (z = 0, m = 1, k = 0 or 1; the negation is exact). r is at most 7.5% of 1/t, so
    the subtraction amplifies the rounding of its two terms by at most
    (1 + 0.075) / (1 - 0.075) = 1.16. One quotient ((1 - e) - t e) / (t (1 - e)) would save
    a division but round once more (1.66 ulp at worst on the test points in float64,
    instead of 1.31).

    Each quotient is used once: under XLA a division with two users gets a loop of its
    own, its result a round trip through memory.
    """
    c = _half_exponential(x)
    near, t, e, one_minus_e = _far_region(x, c)
    z = _series_argument(x, near)
    p, _ = _tilted_mean_coefficients(x.dtype.name)
    ones, zeros = tf.ones_like(x), tf.zeros_like(x)
    q_1 = tf.where(near, tf.where(x >= 0, ones, c), e) / tf.where(near, 1.0 + c, one_minus_e)
    # 1 where the closed form is used, 0 elsewhere, as the numerator of 1/t: a literal 1
    # would let tf.function's constant folding turn 1/t into Reciprocal(t), which TF's CPU
    # kernel computes approximately in float32 (1 ulp off even at powers of two).
    q_2 = tf.where(near, zeros, ones) / t
    m = tf.where(near, 0.5 * ones, ones)
    k = tf.where(near, 0.25 * ones, tf.where(x > 0, ones, zeros))
    difference = q_1 - q_2
    # Single adds, not chains that tf.function's arithmetic optimizer would regroup into an
    # AddN: graph and eager results are the same bits.
    return (tf.where(near | (x > 0), difference, -difference) + z * _series(z * z, p)) * m + k


def _tilted_mean_derivative(x: tf.Tensor) -> tf.Tensor:
    """f'(x) = (+-v + q_2 + b) m: two quotients v and q_2, each used once; b, m selected.

    |x| <= 4: f'(x) = (sigmoid'(x/2) + f'(x/2)) / 4 with sigmoid'(x/2) = v =
    c / (1 + c (2 + c)) = c / (1 + c)^2, f'(x/2) = b = Q(z^2) = z^2 Q_1(z^2) + q_0,
    q_2 = 0 and m = 1/4 (exact). Both terms are positive. (1 + c)^2 is summed as
    1 + c (2 + c), so the rounding of 1 + c is not doubled by a square (on 3e6 random
    float32 points: 0.43 ulp on average against 0.44 for r (1 - r), r = c / (1 + c), the
    form that needs r twice), and Q is summed first, where its last rounding is at its own
    scale, not at the sum's.

    |x| > 4, t = |x|: f'(x) = 1/t^2 - e/(1 - e)^2 = q_2 - v with q_2 = 1/(t t) and
    v = e / (1 - e)^2 = r (1 + r), b = 0, m = 1. The subtraction amplifies the rounding of
    its terms by at most (1 + t^2 r (1 + r)) / (1 - t^2 r (1 + r)) = 1.87 at t = 4, falling
    to 1.20 at t = 6. At t = inf, t is replaced by the dtype's max (same f' = 0) so that the
    second derivative is 0, not 0 * inf. 1/(t t) rounds twice, as (1/t)^2 would three times.
    """
    c = _half_exponential(x)
    near, t, e, one_minus_e = _far_region(x, c)
    z = _series_argument(x, near)
    _, q = _tilted_mean_coefficients(x.dtype.name)
    ones, zeros = tf.ones_like(x), tf.zeros_like(x)
    v = tf.where(near, c, e) / tf.where(near, 1.0 + c * (2.0 + c), one_minus_e * one_minus_e)
    t = tf.minimum(t, x.dtype.max)
    # 1 wherever the closed form is used, as the numerator of 1/(t t): a literal 1 would
    # let tf.function's constant folding turn it into Reciprocal, approximate in float32.
    q_2 = tf.where(near, zeros, ones) / (t * t)
    w = z * z
    b = tf.where(near, w * _series(w, q[:-1]) + q[-1], zeros)
    # v times +-1 (exact): v used once (a select of v and -v would use it twice).
    return ((tf.where(near, ones, -ones) * v + q_2) + b) * tf.where(near, 0.25 * ones, ones)


@tf.custom_gradient
def _tilted_mean_float(x: tf.Tensor):
    def grad(upstream: tf.Tensor) -> tf.Tensor:
        # Built from TF ops on x, so an outer tape differentiates it: nested tapes work.
        return upstream * _tilted_mean_derivative(x)

    return _tilted_mean_value(x), grad


def tilted_mean_series_terms(dtype) -> tuple[int, int]:
    """How many polynomial terms :func:`tilted_mean` sums for the value and for the derivative.

    For abs(x) <= 4, ``tilted_mean`` evaluates f(x/2) = 1/2 + z P(z^2) and
    f'(x/2) = Q(z^2) at z = x/2, with P and Q polynomials in w = z^2 on [0, 4]. They come
    from the series f(z) = 1/2 + sum_k c_k z^(2k-1), c_k = B_2k / (2k)!, *economized*:
    rewritten exactly in Chebyshev polynomials on [0, 4] and cut after the fewest terms
    whose dropped coefficients sum to at most 1/16 ulp of the smallest value
    (f(-4) = 0.231) and derivative (f'(4) = 0.0435) taken from the series, the ulp coming
    from the dtype's ``eps``. The truncated Taylor series would need 8 and 10 terms in
    float32, 17 and 19 in float64. The derivation is in the book's chapter
    ``case_b/taylor_and_asymptotics``.

    Args:
        dtype: a floating-point dtype (``tf.float32``, ``"float64"``, ``np.float32``, ...).
            float16 and bfloat16 are computed in float32, so they count as float32.

    Returns:
        ``(value_terms, derivative_terms)``: (5, 6) for float32, (11, 12) for float64.

    Raises:
        TypeError: if ``dtype`` is not a floating-point dtype.

    Example:
        >>> tilted_mean_series_terms(tf.float32), tilted_mean_series_terms("float64")
        ((5, 6), (11, 12))
    """
    try:
        dtype = tf.as_dtype(dtype)
    except TypeError as error:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype!r}") from error
    if not dtype.is_floating:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype.name}")
    name = "float64" if dtype == tf.float64 else "float32"
    value, derivative = _tilted_mean_coefficients(name)
    return len(value), len(derivative)


def tilted_mean(x, name: str | None = None) -> tf.Tensor:
    r"""Mean of the uniform distribution on [0, 1] tilted by e^(x u), with exact gradients.

    .. code-block:: none

        tilted_mean(x) = 1 / (1 - exp(-x)) - 1/x,    tilted_mean(0) = 1/2
                       = 1/2 + L(x/2) / 2,           L(y) = coth(y) - 1/y (Langevin)

    f increases from f(-inf) = 0 to f(inf) = 1, f(-x) = 1 - f(x), and its derivative
    f'(x) = 1/x^2 - 1 / (4 sinh^2(x/2)) is even, with f'(0) = 1/12. It is the f of case B
    in the book, where a loss used f(x) + f(x + 50).

    **Why the naive form fails.** Near 0 both terms are about 1/x and their difference
    is about 1/2: the rounding errors of exp and of the two reciprocals, relative to
    terms of size 1/x, are left standing against a result of 1/2, and measured the error
    grows like eps/x^2. In float32 the naive form returns
    -1.3e4 at x = 1e-6, and at x = 0 it is inf - inf = NaN. Below x = -88.7 (float32)
    exp(-x) overflows: the value 1/(1 - exp(-x)) - 1/x is still right (-0 - 1/x), but the
    backward pass multiplies -(1/(1 - exp(-x)))^2 = -0 by exp(-x) = inf: 0 * inf = NaN.
    The Taylor series f = 1/2 + x/12 - x^3/720 + x^5/30240 - ... (coefficients
    B_2k / (2k)!) converges only for abs(x) < 2 pi, and slowly near it.

    **What is computed instead.** The halving identity

    .. code-block:: none

        f(x) = (sigmoid(x/2) + f(x/2)) / 2,    f'(x) = (sigmoid'(x/2) + f'(x/2)) / 4

    (from 1/(1-a) + 1/(1+a) = 2/(1-a^2) with a = e^(-x/2)) adds terms that are all
    positive, so it has no cancellation for either sign of x. For abs(x) <= 4, f(x/2) and
    f'(x/2) come from polynomials in (x/2)^2 economized from the Taylor series at
    abs(x/2) <= 2 (Chebyshev economization: 5 and 6 terms in float32, 11 and 12 in float64,
    where the truncated series, converging like (2 / 2 pi)^2 ~ 0.1 per term, needs 8 and
    10, 17 and 19). For abs(x) > 4, with t = abs(x),

    .. code-block:: none

        f(-t) = 1/t - 1/expm1(t),    f(t) = 1 - f(-t),
        f'(x) = 1/x^2 - r (1 + r),   r = 1/expm1(t)

    where r = 1/expm1(t) is at most 7.5% of 1/t: with both terms rounded (relative error
    u each), cancellation amplifies the rounding error of the value by at most
    (1 + t r) / (1 - t r) <= 1.16, and that of the derivative by
    (1 + t^2 r (1 + r)) / (1 - t^2 r (1 + r)) <= 1.87 (at t = 4, falling to 1.03 and 1.20
    at t = 6). These factors do not depend on the precision, hence a fixed switch at
    abs(x) = T = 4: a lower one shortens the series but amplifies the derivative's error
    more (2.97 at T = 3), a higher one
    needs many more terms (the series at abs(x/2) <= T/2 converges like (T / 4 pi)^2 per
    term). Every branch uses e^(-abs(x)/2) (or its square), which cannot overflow, so there
    is no overflow threshold either.

    **Thresholds from the dtype.** The number of polynomial terms is the smallest whose
    error (the sum of the dropped Chebyshev coefficients, computed exactly from the
    Bernoulli numbers) stays under 1/16 ulp of the smallest value (f(-4) = 0.231) and
    derivative (f'(4) = 0.0435) taken from the series, with the ulp from
    ``np.finfo(dtype).eps``: 5 terms for the value and 6 for the derivative in float32,
    11 and 12 in float64 (:func:`tilted_mean_series_terms`).

    **Cost.** Under XLA every element evaluates both branches. One exponential,
    e^(-abs(x)/2), is shared by the value and the gradient (a loop of its own); each of them
    is one more loop with its polynomial and two divisions (the value: sigmoid(x/2) or
    1/expm1(t), and 1/t; the derivative: sigmoid'(x/2) or e/(1 - e)^2, and 1/t^2), each
    quotient used once, so that no quotient makes a loop and a pass through memory of its
    own. In float64 XLA's CPU exp is the largest single cost, about a third of the pass.
    ``benchmarks/tilted_mean.py`` measures forward + backward against the naive formula
    (the book's chapter ``tools/performance``).

    **Gradient.** A ``tf.custom_gradient`` returns upstream * f'(x) with f' evaluated as
    above: autodiff of the value would differentiate through abs(x), which gives
    f'(0) = 1/48 instead of 1/12, and the derivative needs its own number of series terms.
    The derivative is built from TF ops whose branches only see their own region, so
    nested gradient tapes give a finite second derivative everywhere.

    **Accuracy**, measured against mpmath on 10^4 log-spaced points of both signs over
    the normal range plus dense grids on [-16, 16] (and on 3e6 random float32 points
    against the float64 result): value within 1.7 ulp and derivative within 3.0 ulp in
    float32 and float64 (the tests assert 2 and 4), eagerly, under ``tf.function``
    (bit-identical to eager) and under XLA (which may differ from eager by an ulp).
    Results below the smallest normal number (f(x) for x < -1/tiny, f'(x) for
    abs(x) > 1/sqrt(tiny)) are flushed to 0 by TensorFlow's CPU kernels. float16 and
    bfloat16 results are the float32 ones rounded once more.

    Args:
        x: floating-point tensor (float16, bfloat16, float32 or float64). float16 and
            bfloat16 are computed in float32 and the result cast back.
        name: name scope of the ops; defaults to "tilted_mean".

    Returns:
        A tensor of the shape and dtype of ``x``: f(x) in [0, 1], 1 at +inf, 0 at -inf,
        NaN at NaN.

    Raises:
        TypeError: if ``x`` is not a floating-point tensor.

    Example:
        >>> x = tf.constant([-1000.0, -50.0, 0.0, 50.0])
        >>> with tf.GradientTape() as tape:
        ...     tape.watch(x)
        ...     y = tilted_mean(x)
        >>> y.numpy().round(6)
        array([0.001, 0.02 , 0.5  , 0.98 ], dtype=float32)
        >>> (tape.gradient(y, x).numpy() * 12).round(6)  # f'(0) = 1/12
        array([1.2e-05, 4.8e-03, 1.0e+00, 4.8e-03], dtype=float32)
    """
    with tf.name_scope(name or "tilted_mean"):
        x = _as_float_tensor(x, "x")
        if x.dtype in (tf.float16, tf.bfloat16):
            return tf.cast(_tilted_mean_float(tf.cast(x, tf.float32)), x.dtype)
        return _tilted_mean_float(x)
