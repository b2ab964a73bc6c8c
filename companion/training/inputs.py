"""Input checks of :func:`companion.training.train`'s own arguments (``fit``'s and
``compile``'s are checked by ``fit`` and ``compile``, except where their messages do not
say what is wrong: :func:`check_targets`), raised before any step runs with a message
that says what was given and what is expected (a model whose weights are not finite
before the first step: :func:`check_finite_weights`); a list of batches as a dataset; and
an epoch's batches read again for the NaN doctor.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import keras
import numpy as np
import tensorflow as tf

from companion._internal import own_step_unbuilt
from companion.diagnostics.state import components
from companion.losses import check_keras_loss_shapes, resolve_loss

#: What ``on_nonfinite`` may be: skip the step, raise at once, apply every step
#: unchecked, as ``fit`` does (no guard; for measuring what the guard costs), or skip
#: and roll back with a smaller learning rate (:mod:`companion.training.recovery`).
ON_NONFINITE = ("skip", "raise", "ignore", "rollback")


def check_finite_weights(model: keras.Model) -> None:
    """Refuse a model whose weights hold a NaN or an Inf before training starts.

    No training step cures such a weight: a guarded step skips every step (each one is
    non-finite), and ``fit`` writes ``NaN`` into every weight the first update touches.
    The usual sources are an initial value computed from the data: a bias set to the
    log of a class prior that is 0, a data-dependent initialisation that divides by a
    spread of 0. Each variable's first local copy is read, without any collective.

    Args:
        model: a Keras model (its variables are read; an unbuilt model has none).

    Raises:
        ValueError: naming each non-finite variable, how many of its entries are not
            finite, and what to do.
    """
    bad = []
    for variable in model.variables:
        value = np.asarray(components(variable)[0].numpy())
        if value.dtype.kind not in "fc":
            continue
        count = int(np.count_nonzero(~np.isfinite(value)))
        if count:
            path = getattr(variable, "path", None) or variable.name
            bad.append(f"{path} ({count} of {value.size} entries)")
    if bad:
        raise ValueError(
            f"model {model.name!r} has weights that are not finite before the first step: {', '.join(bad)}; "
            "no training step can make them finite. Set them finite where they are set (an initializer, an "
            "assign or set_weights before training: e.g. np.log(np.maximum(prior, eps)) for a log prior, "
            "tf.math.divide_no_nan for a spread that can be 0); companion.diagnostics.diagnose names the "
            "layer and the line"
        )


def built_by_its_first_step(model: keras.Model) -> bool:
    """Whether ``model`` is left unbuilt until its first ``train_step``, as ``fit`` leaves it.

    A model with its own ``train_step`` and a layer not built yet: its ``call()`` may take
    other inputs than the data (a GAN's generator takes noise, a denoiser ``(noisy, t)``),
    so calling it on the data's inputs would build its layers for the wrong shapes. ``fit``
    (without a strategy) calls no model before the first step; the step builds what it
    uses. ``train`` builds nothing for such a model either.

    Args:
        model: a Keras model.

    Returns:
        True for a model with its own ``train_step`` and an unbuilt layer.
    """
    return own_step_unbuilt(model)


def _describe_spec(spec) -> str:
    if isinstance(spec, tf.TensorSpec):
        return f"a single tensor of shape {tuple(spec.shape)} and dtype {spec.dtype.name}"
    if isinstance(spec, dict):
        return f"a dict with keys {sorted(spec)}"
    if isinstance(spec, (tuple, list)):
        return f"a {type(spec).__name__} of {len(spec)} elements"
    return f"{type(spec).__name__}"


def as_dataset(dataset, name: str = "dataset") -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of ``(inputs, targets[, sample_weights])`` with a known, finite cardinality."""
    if isinstance(dataset, tf.data.Dataset):
        spec = dataset.element_spec
        if not (isinstance(spec, (tuple, list)) and len(spec) in (2, 3)):
            raise TypeError(
                f"{name} must yield (inputs, targets) or (inputs, targets, sample_weights) tuples, but its "
                f"elements are {_describe_spec(spec)}; e.g. tf.data.Dataset.from_tensor_slices((x, y)).batch(32)"
            )
        cardinality = int(dataset.cardinality())
        if cardinality == 0:
            raise ValueError(f"{name} is empty: it yields no batch")
        if cardinality == tf.data.INFINITE_CARDINALITY:
            raise ValueError(
                f"{name} is infinite (e.g. .repeat() without a count), so an epoch would never end; "
                "use .take(steps_per_epoch) or .repeat(n)"
            )
        return dataset
    if isinstance(dataset, (str, bytes, dict)) or not isinstance(dataset, Iterable):
        raise TypeError(
            f"{name} must be a tf.data.Dataset or an iterable of (inputs, targets) batches, "
            f"got {type(dataset).__name__}"
        )
    batches = []
    for index, element in enumerate(dataset):
        if not (isinstance(element, (tuple, list)) and len(element) in (2, 3)):
            described = type(element).__name__
            if isinstance(element, (tuple, list)):
                described += f" of length {len(element)}"
            raise TypeError(
                f"{name} must yield (inputs, targets) pairs or (inputs, targets, sample_weights) triples, "
                f"but element {index} is a {described}"
            )
        try:
            batches.append(tf.nest.map_structure(tf.convert_to_tensor, tuple(element)))
        except (TypeError, ValueError) as err:
            raise TypeError(f"element {index} of {name} cannot be converted to tensors: {err}") from None
    if not batches:
        raise ValueError(f"{name} is empty: it yields no batch")
    spec = tf.nest.map_structure(tf.type_spec_from_value, batches[0])
    for index, batch in enumerate(batches[1:], start=1):
        try:
            tf.nest.assert_same_structure(batches[0], batch)
            spec = tf.nest.map_structure(
                lambda s, t: s.most_specific_common_supertype([tf.type_spec_from_value(t)]), spec, batch
            )
        except (TypeError, ValueError) as err:
            raise TypeError(f"element {index} of {name} does not have the structure of element 0: {err}") from None
        if any(s is None for s in tf.nest.flatten(spec)):
            raise TypeError(f"element {index} of {name} has a different dtype from element 0")
    result = tf.data.Dataset.from_generator(lambda: iter(batches), output_signature=spec)
    return result.apply(tf.data.experimental.assert_cardinality(len(batches)))


def _unpack_spec(spec):
    """(inputs, targets) of a dataset's element spec, as Keras' ``fit`` unpacks an element."""
    if isinstance(spec, list):
        spec = tuple(spec)
    if not isinstance(spec, tuple):
        return spec, None
    if len(spec) == 1:
        return spec[0], None
    return spec[0], spec[1]


def _compiled_loss(model, loss):
    """The loss ``train`` will train with: ``loss`` if given, else the one the model was compiled with."""
    if loss is not None:
        return loss
    if getattr(model, "compiled", False):
        return getattr(model, "loss", None)
    return None


def _uses_keras_loss_step(model) -> bool:
    """Whether ``fit`` computes the compiled loss from (y, predictions): Keras' own step and loss."""
    cls = type(model)
    return cls.train_step is keras.Model.train_step and cls.compute_loss is keras.Model.compute_loss


def _loss_name(loss) -> str:
    if isinstance(loss, str):
        return repr(loss)
    return repr(getattr(loss, "name", None) or getattr(loss, "__name__", None) or type(loss).__name__)


_SPARSE = ("sparse_categorical_crossentropy",)
_CATEGORICAL = ("categorical_crossentropy", "categorical_focal_crossentropy")


def _loss_kind(loss) -> str | None:
    """'sparse' or 'categorical' for Keras' cross-entropies over classes, else None."""
    try:
        resolved = resolve_loss(loss) if isinstance(loss, str) else loss
    except (TypeError, ValueError):
        return None
    if isinstance(resolved, keras.losses.Loss):
        fn = getattr(resolved, "fn", None)
        name = getattr(fn, "__name__", "") or ""
    else:
        name = getattr(resolved, "__name__", "") or ""
    module = getattr(resolved, "__module__", "") or ""
    if not (module.startswith("keras") or isinstance(resolved, keras.losses.Loss)):
        return None
    if name in _SPARSE:
        return "sparse"
    if name in _CATEGORICAL:
        return "categorical"
    return None


def _prediction_spec(model, inputs):
    """The model's output spec for inputs of these specs (None if it cannot tell without running)."""
    if not model.built:
        return None
    try:
        symbolic = tf.nest.map_structure(lambda s: keras.KerasTensor(s.shape, dtype=s.dtype.name), inputs)
        predictions = model.compute_output_spec(symbolic)
    except Exception:  # noqa: BLE001 - a model that cannot say: nothing to check
        return None
    return predictions if isinstance(predictions, keras.KerasTensor) else None


def _check_label_rank(loss, targets, predictions, where: str) -> None:
    """Cross-entropies over classes: one-hot targets for the sparse loss, labels for the other."""
    kind = _loss_kind(loss)
    true_shape, pred_shape = tf.TensorShape(targets.shape), tf.TensorShape(predictions.shape)
    if kind is None or true_shape.rank is None or pred_shape.rank is None or pred_shape.rank < 1:
        return
    classes = pred_shape[-1]
    if kind == "sparse" and true_shape.rank == pred_shape.rank and true_shape[-1] not in (1, None):
        raise ValueError(
            f"{where} have shape {tuple(true_shape)}, but loss {_loss_name(loss)} expects integer class labels "
            f"of shape {tuple(pred_shape[:-1])} for predictions of shape {tuple(pred_shape)} (one rank less): "
            "these look like one-hot targets, which go with loss 'categorical_crossentropy' "
            "(or pass the labels, y.argmax(axis=-1))"
        )
    if kind == "categorical" and true_shape.rank == pred_shape.rank - 1 and classes not in (1, None):
        raise ValueError(
            f"{where} have shape {tuple(true_shape)}, but loss {_loss_name(loss)} expects one-hot targets of the "
            f"predictions' shape {tuple(pred_shape)}: these look like integer class labels, which go with loss "
            f"'sparse_categorical_crossentropy' (or pass keras.utils.to_categorical(y, {classes}))"
        )


def check_targets(model: keras.Model, x: Any, y: Any = None, loss: Any = None) -> None:
    """Raise before the first step where ``fit`` would fail without saying what is wrong.

    Checks, for a model trained by Keras' own ``train_step`` and ``compute_loss`` with a
    compiled loss (``loss``, or the model's own if ``loss`` is None):

    - that there are targets: a ``tf.data.Dataset`` ``x`` that yields inputs alone (a
      single tensor, a dict, a 1-tuple), or arrays ``x`` with ``y=None``, would reach
      Keras' loss with ``y_true=None`` (``fit`` says ``None values not supported.``);
    - that the targets' rank suits the loss, where the model's output shape is known
      without running it: one-hot targets for ``sparse_categorical_crossentropy``, integer
      labels for ``categorical_crossentropy`` (Keras blames the predictions' rank), and
      targets that an elementwise Keras loss would silently broadcast against the
      predictions (see :func:`companion.losses.check_keras_loss_shapes`).

    A model whose ``train_step`` or ``compute_loss`` is its own, or that has no compiled
    loss (e.g. only ``add_loss``), may take inputs without targets: nothing is checked.
    Inputs that cannot be inspected without consuming them (a generator, a
    ``keras.utils.PyDataset``) are left to ``fit``.

    Args:
        model: the Keras model to train.
        x: ``train``'s ``x``: a dataset, arrays or tensors (nested in tuples, lists or
            dicts), or anything else ``fit`` accepts.
        y: ``train``'s ``y``.
        loss: the loss ``train`` compiles with, or None.

    Raises:
        ValueError: if the inputs have no targets while a loss needs them (the type of
            error ``fit`` raises there, with a message that says what is missing), or the
            targets' shape does not suit the loss.

    Example:
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> check_targets(model, tf.data.Dataset.from_tensor_slices(np.ones((8, 4))), loss="mse")
        Traceback (most recent call last):
        ValueError: x is a tf.data.Dataset that yields inputs without targets...
    """
    loss = _compiled_loss(model, loss)
    if loss is None or not _uses_keras_loss_step(model):
        return
    if isinstance(x, tf.data.Dataset):
        inputs, targets = _unpack_spec(x.element_spec)
        if targets is None:
            raise ValueError(
                f"x is a tf.data.Dataset that yields inputs without targets (its elements are "
                f"{_describe_spec(x.element_spec)}), but loss {_loss_name(loss)} compares predictions with targets: "
                "make it yield (inputs, targets) or (inputs, targets, sample_weights) tuples, e.g. "
                "tf.data.Dataset.from_tensor_slices((x, y)).batch(32); a model whose train_step or compute_loss "
                "needs no targets may be trained on inputs alone"
            )
        where = "the targets of x (a tf.data.Dataset)"
    else:
        leaves = tf.nest.flatten(x) if x is not None else []
        if not leaves or not all(isinstance(v, (np.ndarray, tf.Tensor)) and len(v.shape) >= 1 for v in leaves):
            return  # a generator, a PyDataset, ...: fit reads it
        if y is None:
            raise ValueError(
                f"y is None, but x ({type(x).__name__}) holds inputs only and loss {_loss_name(loss)} compares "
                "predictions with targets: pass the targets as y (train(model, x, y, ...)), or a "
                "tf.data.Dataset of (inputs, targets) as x"
            )
        if isinstance(y, (dict, list, tuple)) or not isinstance(y, (np.ndarray, tf.Tensor)) or len(y.shape) < 1:
            return
        inputs = tf.nest.map_structure(lambda v: tf.TensorSpec((None, *v.shape[1:]), tf.as_dtype(v.dtype)), x)
        targets = tf.TensorSpec((None, *y.shape[1:]), tf.as_dtype(y.dtype))
        where = "the targets y"
    if isinstance(loss, (dict, list, tuple)) or not isinstance(targets, tf.TensorSpec):
        return  # several outputs: Keras matches losses to outputs
    predictions = _prediction_spec(model, inputs)
    if predictions is None:
        return
    _check_label_rank(loss, targets, predictions, where)
    try:
        check_keras_loss_shapes(loss, targets, predictions)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def check_callbacks(callbacks) -> list:
    """``callbacks`` as a list of :class:`keras.callbacks.Callback`."""
    if callbacks is None:
        return []
    if isinstance(callbacks, keras.callbacks.Callback) or not isinstance(callbacks, (list, tuple)):
        raise TypeError(f"callbacks must be a list of keras.callbacks.Callback, got {type(callbacks).__name__}")
    for callback in callbacks:
        if not isinstance(callback, keras.callbacks.Callback):
            raise TypeError(
                f"callbacks must be keras.callbacks.Callback instances, got {type(callback).__name__} {callback!r}"
            )
    return list(callbacks)


def replay_batches(x, y=None, sample_weight=None, batch_size=None, validation_split=0.0):
    """The training batches of an epoch as ``fit`` cuts them, unshuffled, for the NaN doctor.

    Args:
        x, y, sample_weight, batch_size, validation_split: as given to ``fit``.

    Returns:
        ``x`` itself if it is a ``tf.data.Dataset``; for arrays or tensors (nested in
        tuples, lists or dicts), a dataset of their first ``1 - validation_split`` rows
        (the rows ``fit`` trains on) in batches of ``batch_size`` (``fit``'s default 32);
        ``None`` for inputs that cannot be read twice (a generator, a ``PyDataset``).
    """
    if isinstance(x, tf.data.Dataset):
        return x
    parts = tuple(tuple(v) if isinstance(v, list) else v for v in (x, y, sample_weight) if v is not None)
    leaves = tf.nest.flatten(parts)
    if not leaves or not all(isinstance(v, (np.ndarray, tf.Tensor)) and len(v.shape) >= 1 for v in leaves):
        return None
    rows = int(leaves[0].shape[0])
    keep = int(math.floor(rows * (1.0 - (validation_split or 0.0))))
    parts = tf.nest.map_structure(lambda v: v[:keep], parts)
    return tf.data.Dataset.from_tensor_slices(parts).batch(int(batch_size or 32))
