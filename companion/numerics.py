"""Numerically safe tensor functions.

Each function states the formula it computes, why the naive form fails, and the
guarantee it gives, in the spirit of ``tensorflow_probability.math``.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

__all__ = ["double_where"]

_FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def _as_float_tensor(value, name: str, dtype: tf.DType | None = None) -> tf.Tensor:
    """``tf.convert_to_tensor`` that accepts floating tensors only, with a clear error."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be a floating-point tensor, got a string {value!r}")
    try:
        tensor = tf.convert_to_tensor(value, dtype_hint=dtype or tf.float32)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name} must be a floating-point tensor, got {type(value).__name__}: {err}") from None
    if tensor.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{name} must have a floating dtype (float16, bfloat16, float32 or float64), "
            f"got {tensor.dtype.name}; cast it first, e.g. tf.cast({name}, tf.float32)"
        )
    if dtype is not None and tensor.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype.name} like x, got {tensor.dtype.name}")
    return tensor


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
