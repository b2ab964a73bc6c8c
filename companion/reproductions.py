"""The seeds' failing code, faithfully, so chapters and tests can show the failure.

Everything here is *wrong on purpose*: each function is the code of one of the book's two
seed questions (``shared/seeds/``), copied as its author wrote it, bugs included, so that a
chapter can run it and show where it breaks, and a test can pin that the failure is real
in the TensorFlow the book is tested with. Do not use these functions in a model; the
fixed versions live in :mod:`companion.numerics` (and the other modules), and each
docstring below says which one.

The only changes to the seeds' code are the ones needed to make it importable: a name,
a docstring, and ``tf.convert_to_tensor`` on the input (the seeds passed tensors).

Sections:
    Case B (seed ``003``): f(x) = 1/(1 - e^-x) - 1/x in a custom loss.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["naive_tilted_mean", "seed_blended_f", "seed_taylor"]


# --- Case B: f(x) = 1/(1 - e^-x) - 1/x (seed 003) --------------------------------------


def naive_tilted_mean(x) -> tf.Tensor:
    """The question's f, typed straight from its formula: ``1/(1 - exp(-x)) - 1/x``.

    How it fails:

    - at ``x = 0`` it is ``inf - inf = NaN`` (the question defines f(0) = 1/2 separately);
    - near 0 both terms are about ``1/x`` and their difference keeps few correct bits:
      in float32 it returns about -1.3e4 at ``x = 1e-6`` and -4.9e4 at ``x = -1e-6``
      (true value 0.5), with gradients of order 1e10;
    - once ``exp(-x)`` overflows (``x < -88.7`` in float32, ``x < -709.8`` in float64)
      the value is still right but the gradient ``exp(-x) / (1 - exp(-x))^2`` is
      ``inf / inf = NaN``.

    The fix is :func:`companion.numerics.tilted_mean`.
    """
    x = tf.convert_to_tensor(x)
    return 1 / (1 - tf.exp(-x)) - 1 / x


def seed_blended_f(x) -> tf.Tensor:
    """The answer's "smooth piecewise approximation" of f, verbatim (its ``def f(x)``).

    It blends a Taylor polynomial, two asymptotes and the original formula with sigmoid
    masks. How it fails, measured with TF 2.21 in float32:

    - ``mask_neg`` is inverted: it is ~1 for every ``x > -10``, so between -10 and 10 the
      blend is the *negative-x* asymptote -1/x, not the original formula:
      ``seed_blended_f(1.0)`` is -1 (true value 0.582), ``seed_blended_f(5.0)`` is -0.2;
    - ``seed_blended_f(1e-6)`` is about -44.9 (true value 0.5): ``mask_zero`` is
      sigmoid(10), which leaves ~4.5e-5 of that -1/x = -1e6 in the result;
    - ``seed_blended_f(0)`` is NaN: every branch is evaluated everywhere, and
      ``0 * (1/0)`` is NaN however small the mask;
    - the gradient is NaN at 0 (same reason) and at -100 and -1000 (the unused
      ``original`` branch overflows, and ``0 * NaN`` is NaN);
    - its Taylor term ``+x^3/720`` has the wrong sign: f = 1/2 + x/12 - x^3/720 + ...

    The fix is :func:`companion.numerics.tilted_mean`.
    """
    x = tf.convert_to_tensor(x)
    # --- from here on, the seed's code as written (comments translated) ---
    # Near x = 0: a third-order Taylor expansion (closer to the gradient of the original)
    taylor = 0.5 + x/12 + tf.pow(x, 3)/720
    # x > 10: approximately 1 - 1/x (the limit of the original)
    large_pos = 1 - 1/x
    # x < -10: approximately -1/x (the limit of the original)
    large_neg = -1/x
    # the middle region uses the original formula
    original = 1/(1 - tf.exp(-x)) - 1/x

    # smooth switching masks: a sigmoid soft transition avoids the gradient jump of a hard switch
    # transition between x < -10 and the middle region
    mask_neg = tf.sigmoid((x + 10)/0.5)
    # transition between x > 10 and the middle region
    mask_pos = tf.sigmoid((10 - x)/0.5)
    # transition between |x| < 0.1 and the middle region
    mask_zero = tf.sigmoid((0.1 - tf.abs(x))/0.01)

    # combine the regions
    res = mask_neg * large_neg + (1 - mask_neg) * original
    res = mask_pos * res + (1 - mask_pos) * large_pos
    res = mask_zero * taylor + (1 - mask_zero) * res

    return res


def seed_taylor(x) -> tf.Tensor:
    """The ``taylor`` line of :func:`seed_blended_f` on its own: ``0.5 + x/12 + x^3/720``.

    The sign of its cubic term is wrong: with f = 1/2 + sum_k B_2k x^(2k-1) / (2k)! and
    B_4 = -1/30, the series is f = 1/2 + x/12 - x^3/720 + x^5/30240 - ..., so this
    polynomial is off by about x^3/360 where the correct one is off by x^5/30240.
    """
    x = tf.convert_to_tensor(x)
    return 0.5 + x/12 + tf.pow(x, 3)/720
