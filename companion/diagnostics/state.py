"""Snapshot and restore of variables, one copy per replica, so the doctor changes nothing.

The doctor runs the model with ``training=True``: batch normalisation updates its moving
statistics and a dropout layer advances its seed generator. Restoring the variables'
values afterwards is not enough under a distribution strategy. There a variable has one
copy per replica, and the copies of non-trainable variables need not agree (each
replica's batch normalisation updates its own statistics from its own shard); reading
such a variable in cross-replica context gives one copy (the first replica's), and
assigning it writes that value to every copy. :func:`snapshot` therefore keeps every
copy, and :func:`restore` writes each copy back to itself, without any collective.

"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import tensorflow as tf

__all__ = ["components", "preserved", "restore", "snapshot"]


def components(variable: Any) -> list:
    """The per-replica copies of ``variable`` (a Keras or TensorFlow variable).

    Args:
        variable: a :class:`keras.Variable` or a ``tf.Variable``, distributed or not.

    Returns:
        The list of its ``tf.Variable`` copies on this worker: one per local replica
        for a distributed variable, else the variable itself.
    """
    inner = getattr(variable, "value", variable) if not isinstance(variable, tf.Variable) else variable
    values = getattr(inner, "values", None)
    if isinstance(inner, tf.distribute.DistributedValues) and values:
        return list(values)
    return [inner]


def snapshot(variables: Iterable[Any]) -> list[tuple[Any, tf.Tensor]]:
    """Every local copy of every variable, with its current value.

    Args:
        variables: Keras or TensorFlow variables (duplicates are kept once).

    Returns:
        A list of ``(copy, value)`` pairs for :func:`restore`.
    """
    saved, seen = [], set()
    for variable in variables:
        for copy in components(variable):
            if id(copy) in seen:
                continue
            seen.add(id(copy))
            with tf.device(copy.device):
                saved.append((copy, tf.identity(copy.read_value())))
    return saved


def restore(saved: list[tuple[Any, tf.Tensor]]) -> None:
    """Write each saved value back to its own copy (no collective, no cross-replica write).

    Args:
        saved: what :func:`snapshot` returned.
    """
    for copy, value in saved:
        with tf.device(copy.device):
            copy.assign(value)


@contextlib.contextmanager
def preserved(variables: Iterable[Any]) -> Iterator[None]:
    """Restore every local copy of ``variables`` when the block ends, even on an error.

    Args:
        variables: Keras or TensorFlow variables.
    """
    saved = snapshot(variables)
    try:
        yield
    finally:
        restore(saved)
