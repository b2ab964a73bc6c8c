"""Data as ``fit`` takes it, batch by batch, and the check of a batch's own values.

:func:`batches` turns what ``model.fit`` accepts (a ``tf.data.Dataset``, a
:class:`keras.utils.PyDataset`, arrays with ``y=``, an ``(x, y[, sample_weight])``
tuple, one batch, any iterable of batches) into ``(x, y, sample_weight)`` batches in
``fit``'s order, unshuffled; :func:`nonfinite_data` lists the parts of a batch that
hold NaN or Inf.
"""

from __future__ import annotations

from typing import Any, Iterator

import keras
import numpy as np
import tensorflow as tf

from companion.diagnostics.trace import nonfinite_mask

__all__ = ["Replay", "batches", "nonfinite_data"]


def _unpack(batch) -> tuple[Any, Any, Any]:
    if isinstance(batch, list):
        batch = tuple(batch)
    return keras.utils.unpack_x_y_sample_weight(batch)


def _is_array_like(value) -> bool:
    if isinstance(value, (np.ndarray, tf.Tensor)) or hasattr(value, "__array__"):
        return True
    if isinstance(value, dict):
        return all(_is_array_like(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_is_array_like(v) for v in value)
    return False


def batches(data, y=None, sample_weight=None, batch_size=None) -> Iterator[tuple[Any, Any, Any]]:
    """``(x, y, sample_weight)`` batches of ``data`` in ``fit``'s order, unshuffled."""
    if isinstance(data, tf.data.Dataset):
        for batch in data:
            yield _unpack(batch)
        return
    if isinstance(data, keras.utils.PyDataset):
        for index in range(len(data)):
            yield _unpack(data[index])
        return
    as_tuple = isinstance(data, tuple) and 1 <= len(data) <= 3
    if y is None and sample_weight is None and as_tuple and _is_array_like(data):
        data, y, sample_weight = (tuple(data) + (None, None))[:3]
    elif not _is_array_like(data):
        if not hasattr(data, "__iter__"):
            raise TypeError(
                "data must be a tf.data.Dataset, a keras PyDataset, arrays (x, y[, sample_weight]) or an "
                f"iterable of batches, got {type(data).__name__}"
            )
        for batch in data:
            yield _unpack(batch)
        return
    arrays = (data, y, sample_weight)
    sizes = {int(np.shape(a)[0]) for a in tf.nest.flatten([a for a in arrays if a is not None])}
    if len(sizes) != 1:
        raise ValueError(f"x, y and sample_weight must have the same number of samples, got {sorted(sizes)}")
    (count,) = sizes
    size = 32 if batch_size is None else int(batch_size)
    if size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for start in range(0, count, size):
        yield tuple(
            None if a is None else tf.nest.map_structure(lambda v: tf.convert_to_tensor(np.asarray(v)[start:start + size]), a)
            for a in arrays
        )


class Replay:
    """An iterator that can be iterated again: it keeps the batches it has yielded."""

    def __init__(self, source) -> None:
        self._source = source
        self._seen: list = []

    def __iter__(self):
        yield from self._seen
        for batch in self._source:
            self._seen.append(batch)
            yield batch


def _leaves(structure, path: str = ""):
    """``(path, leaf)`` pairs of a nest of dicts, lists and tuples."""
    if isinstance(structure, dict):
        for key in sorted(structure):
            yield from _leaves(structure[key], f"{path}/{key}" if path else str(key))
    elif isinstance(structure, (list, tuple)):
        for index, item in enumerate(structure):
            yield from _leaves(item, f"{path}/{index}" if path else str(index))
    else:
        yield path, structure


def nonfinite_data(batch) -> list[tuple[str, np.ndarray]]:
    """The non-finite parts of a batch: ``[("x", array), ...]``."""
    found = []
    for label, part in zip(("x", "y", "sample_weight"), batch):
        if part is None:
            continue
        for path, value in _leaves(part):
            array = np.asarray(value)
            if array.dtype.kind in "fc" or array.dtype.kind == "V":
                if nonfinite_mask(array).any():
                    found.append((label + (f"[{path}]" if path else ""), array))
    return found
