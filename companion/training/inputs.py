"""Input checks of :func:`companion.training.train`'s own arguments (``fit``'s and
``compile``'s are checked by ``fit`` and ``compile``), raised before any step runs with a
message that says what was given and what is expected; a list of batches as a
dataset; and an epoch's batches read again for the NaN doctor.
"""

from __future__ import annotations

import math
from typing import Iterable

import keras
import numpy as np
import tensorflow as tf

#: What ``on_nonfinite`` may be: skip the step, raise at once, or apply every step
#: unchecked, as ``fit`` does (no guard; for measuring what the guard costs).
ON_NONFINITE = ("skip", "raise", "ignore")


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
