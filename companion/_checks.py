"""Small argument checks and dtype sets shared by every module of :mod:`companion`.

Each check raises the error a user can act on: ``TypeError`` when the kind of value is
wrong (a bool or a float where an int is expected), ``ValueError`` when it is the right
kind but out of range, and the message says what was given and what is expected.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import tensorflow as tf

#: Names of the half-precision float dtypes: computed in, but never reduced in (losses,
#: softmax and statistics are taken in float32).
HALF_DTYPE_NAMES = frozenset({"float16", "bfloat16"})


def is_half(dtype: Any) -> bool:
    """Whether ``dtype`` (a ``tf.DType``, NumPy dtype or name) is float16 or bfloat16."""
    name = getattr(dtype, "name", dtype)
    return str(name) in HALF_DTYPE_NAMES


def check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a Python int, if it is an integer (not a bool) within the bounds.

    Raises:
        TypeError: if ``value`` is not a Python or NumPy integer, or is a bool.
        ValueError: if it is below ``minimum`` or above ``maximum``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return int(value)


def check_positive_number(name: str, value: Any, *, allow_none: bool = False) -> float | None:
    """``value`` as a float, if it is a finite real number > 0 (or ``None`` when allowed).

    Raises:
        TypeError: if ``value`` is not a real number (bools and strings included).
        ValueError: if it is not finite or not > 0.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        expected = "a positive number or None" if allow_none else "a positive number"
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {number}")
    return number


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False`` (NumPy bools included).

    Raises:
        TypeError: for anything else, e.g. ``1`` or ``"yes"``.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


#: The floating dtypes the numerics accept.
FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def as_float_tensor(value, name: str, dtype: tf.DType | None = None) -> tf.Tensor:
    """``tf.convert_to_tensor`` that accepts floating tensors only, with a clear error."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be a floating-point tensor, got a string {value!r}")
    try:
        if isinstance(value, (tf.Tensor, tf.Variable, np.ndarray)) or (
            dtype is None and isinstance(value, np.generic)
        ):
            # Tensors, arrays and (for x itself) NumPy scalars keep their own dtype:
            # a float64 array must not silently become float32.
            tensor = tf.convert_to_tensor(value)
        else:
            # Python numbers and lists, and NumPy scalars given for p, take x's dtype
            # (or float32).
            tensor = tf.convert_to_tensor(value, dtype_hint=dtype or tf.float32)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name} must be a floating-point tensor, got {type(value).__name__}: {err}") from None
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must have a floating dtype (float16, bfloat16, float32 or float64), "
            f"got {tensor.dtype.name}; cast it first, e.g. tf.cast({name}, tf.float32)"
        )
    if dtype is not None and tensor.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype.name} like x, got {tensor.dtype.name}")
    return tensor
