"""Losses as ``model.compile`` resolves them, and the shape checks that are right for them.

:func:`resolve_loss` turns a name into Keras' loss function; :func:`mean_loss` evaluates
a loss on one batch as the training loop and the diagnostics do, after checking that
targets and predictions do not broadcast into a comparison of the wrong entries (the
mistake behind many "the loss is finite but training goes nowhere" reports; the book's
chapter *A training loop that survives NaN* shows it).
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf

from companion._checks import is_half

__all__ = ["check_keras_loss_shapes", "mean_loss", "resolve_loss"]


def _is_keras_loss(loss) -> bool:
    """Keras' own losses align the ranks of targets and predictions themselves."""
    if isinstance(loss, keras.losses.Loss):
        return True
    module = getattr(loss, "__module__", "") or ""
    return module.startswith("keras.") or module == "keras"


def resolve_loss(loss: Callable | str) -> Callable:
    """The callable ``loss(y_true, y_pred)`` that ``model.compile(loss=...)`` would use.

    A string goes through :func:`keras.losses.get` (``"mse"``, ``"binary_crossentropy"``);
    a :class:`keras.losses.Loss` or any other callable is returned as it is.

    Args:
        loss: a Keras loss name, a :class:`keras.losses.Loss`, or a callable.

    Returns:
        A callable ``loss(y_true, y_pred)``.

    Raises:
        ValueError: if ``loss`` is a string that names no Keras loss.
        TypeError: if ``loss`` is neither a string nor callable.

    Example:
        >>> resolve_loss("mse").__name__
        'mean_squared_error'
    """
    if isinstance(loss, str):
        try:
            return keras.losses.get(loss)
        except ValueError:
            raise ValueError(f"loss {loss!r} is not a Keras loss name; pass a callable loss(y_true, y_pred)") from None
    if not callable(loss):
        raise TypeError(
            f"loss must be a callable loss(y_true, y_pred) or a Keras loss, got {type(loss).__name__} {loss!r}"
        )
    return loss


def check_keras_loss_shapes(loss, y_true, y_pred) -> None:
    """For one of Keras' own losses: raise if targets and predictions would broadcast wrongly.

    ``y_true`` and ``y_pred`` may be tensors, ``tf.TensorSpec`` s or ``keras.KerasTensor`` s
    (only their static shapes and dtypes are read). A user's callable is not checked: it
    may read extra target columns (a mask, weights), so it is called as ``fit`` calls it.

    Raises:
        ValueError: if an elementwise Keras loss would compare predictions with the wrong
            targets (e.g. targets ``(batch, 2)`` against predictions ``(batch, 1)``).

    Example:
        >>> spec = tf.TensorSpec
        >>> check_keras_loss_shapes("mse", spec([None]), spec([None, 1]))  # aligned by Keras
        >>> check_keras_loss_shapes("mse", spec([None, 2]), spec([None, 1]))
        Traceback (most recent call last):
        ValueError: prediction shape (None, 1) does not match target shape (None, 2)...
    """
    loss = resolve_loss(loss) if isinstance(loss, str) else loss
    if _is_keras_loss(loss):
        _check_loss_shapes(loss, y_true, y_pred)


def _static(value):
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return None, None
    try:
        return tf.TensorShape(shape), tf.as_dtype(dtype)
    except TypeError:
        return None, None


def _check_loss_shapes(loss, y_true, y_pred) -> None:
    """Static checks of targets and predictions that catch silent broadcasting."""
    (true_shape, true_dtype), (pred_shape, pred_dtype) = _static(y_true), _static(y_pred)
    if true_shape is None or pred_shape is None or true_shape.rank is None or pred_shape.rank is None:
        return
    if not (true_dtype.is_floating and pred_dtype.is_floating):
        return  # e.g. integer labels of a sparse cross-entropy
    y_true = tf.TensorSpec(true_shape, true_dtype)
    y_pred = tf.TensorSpec(pred_shape, pred_dtype)
    if _is_keras_loss(loss):
        # Keras' losses align ranks that differ by one (labels of shape (batch,)).
        if true_shape.rank == y_pred.shape.rank - 1:
            true_shape = true_shape.concatenate([1])
        elif true_shape.rank == y_pred.shape.rank + 1 and true_shape[-1] == 1:
            true_shape = true_shape[:-1]
    try:
        broadcast = tf.broadcast_static_shape(true_shape, y_pred.shape)
    except ValueError:
        broadcast = None
    if (
        broadcast is None
        or broadcast.rank != y_pred.shape.rank
        or not all(_same_dim(a, b) for a, b in zip(broadcast, y_pred.shape))
    ):
        if broadcast is None:
            consequence = "they are not broadcast-compatible"
        else:
            consequence = (
                f"an elementwise loss would silently broadcast them to {tuple(broadcast)}, comparing predictions "
                "with the wrong targets"
            )
        raise ValueError(
            f"prediction shape {tuple(y_pred.shape)} does not match target shape {tuple(y_true.shape)}: "
            f"{consequence}. Make the model's output and the targets the same shape "
            "(e.g. targets y[:, None] for a model with one output unit)"
        )


def mean_loss(loss: Callable, y_true: Any, y_pred: Any) -> tf.Tensor:
    """``mean(loss(y_true, y_pred))`` as a float32 scalar, after checks that catch silent broadcasting.

    Half-precision predictions (mixed precision) are cast to float32 first, as Keras
    does for its own losses. The loss may return a scalar or one value per example (its
    first axis must then be the batch axis); it is averaged over all entries. This is
    the loss :func:`companion.training.train` and
    :func:`companion.diagnostics.nonfinite_gradients` compute for a batch.

    Args:
        loss: a callable ``loss(y_true, y_pred)`` (see :func:`resolve_loss`).
        y_true: the targets.
        y_pred: the predictions.

    Returns:
        A float32 scalar tensor.

    Raises:
        ValueError: if targets and predictions have shapes an elementwise loss would
            broadcast into a wrong comparison (e.g. ``(batch,)`` against ``(batch, 1)``
            for a callable that is not one of Keras' losses), or the loss returns values
            that are neither a scalar nor one per example.
        TypeError: if the loss returns something that is not a floating-point tensor.

    Example:
        >>> y_true, y_pred = tf.constant([[1.0], [3.0]]), tf.constant([[0.0], [0.0]])
        >>> float(mean_loss(resolve_loss("mse"), y_true, y_pred))
        5.0
    """
    y_pred = tf.nest.map_structure(
        lambda t: tf.cast(t, tf.float32) if tf.is_tensor(t) and is_half(t.dtype) else t, y_pred
    )
    _check_loss_shapes(loss, y_true, y_pred)
    value = loss(y_true, y_pred)
    try:
        value = tf.convert_to_tensor(value)
    except (TypeError, ValueError):
        raise TypeError(f"loss must return a tensor, got {type(value).__name__}") from None
    if not value.dtype.is_floating:
        raise TypeError(f"loss must return a floating-point tensor, got dtype {value.dtype.name}")
    _check_loss_output(value, y_pred)
    return tf.cast(tf.reduce_mean(value), tf.float32)


def _same_dim(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and int(a) == int(b))


def _check_loss_output(value: tf.Tensor, y_pred) -> None:
    """The loss must be a scalar, or per-example values laid out like the predictions.

    Per-example values have the leading axes of the predictions: ``(batch,)`` for a loss
    that reduces the last axis, ``(batch, d)`` for an elementwise one. Anything else (an
    axis the predictions do not have, or a batch axis that went missing) means the loss
    broadcast or reduced the wrong axes.
    """
    if value.shape.rank is None or value.shape.rank == 0:
        return
    if tf.is_tensor(y_pred) and y_pred.shape.rank is not None:
        expected = y_pred.shape
        if value.shape.rank <= expected.rank and all(
            _same_dim(value.shape[i], expected[i]) for i in range(value.shape.rank)
        ):
            return
        detail = f"the predictions have shape {tuple(expected)}"
    else:
        batch = _batch_dim(y_pred)
        if _same_dim(value.shape[0], batch):
            return
        detail = f"the batch axis has size {batch}"
    raise ValueError(
        f"loss returned a tensor of shape {tuple(value.shape)}, but {detail}; expected a scalar or one value per "
        "example laid out like the predictions (batch axis first). Typical causes: targets of shape (batch,) "
        "against predictions of shape (batch, 1), which broadcast to (batch, batch), or a reduction over axis 0"
    )


def _batch_dim(structure):
    for t in tf.nest.flatten(structure):
        if tf.is_tensor(t) and t.shape.rank:
            return t.shape[0]
    return None
