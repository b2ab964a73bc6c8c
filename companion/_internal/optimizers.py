"""Private TensorFlow/Keras APIs, one family: keras optimizers: the all-reduce inside ``apply`` that the guarded step makes once, the learning rate as given, the variables an optimizer was built on.

Each hook says what it relies on and what happens when it is gone, and is registered
(:func:`companion._internal.registry.hook`) with its canary tests.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator


from companion._internal.registry import hook, warn_once


# --------------------------------------------------------------------------------------
# Gradients already summed over replicas
# --------------------------------------------------------------------------------------
# Relies on: Keras 3's TensorFlow optimizer all-reducing the gradients inside ``apply``
# through its method ``_all_reduce_sum_gradients(grads_and_vars)``. The training loop
# has summed them for the finiteness test already; overriding the method on the
# instance with the identity avoids a second all-reduce.
# If gone: each replica hands the optimizer its own share (scaled by 1/global batch)
# and the optimizer's all-reduce sums them: the same numbers, twice the traffic.


@hook('test_keras_optimizers_all_reduce_through_the_method_the_loop_overrides')
def can_skip_optimizer_all_reduce(optimizer) -> bool:
    """Whether :func:`optimizer_all_reduce_skipped` works for ``optimizer``."""
    if callable(getattr(type(optimizer), "_all_reduce_sum_gradients", None)):
        return True
    warn_once(
        "_all_reduce_sum_gradients",
        f"{type(optimizer).__name__} has no _all_reduce_sum_gradients: with several replicas the gradients are "
        "all-reduced twice per step (once for the finiteness test, once by the optimizer)",
    )
    return False


_skip_lock = threading.Lock()
_skip_users: dict[int, int] = {}


@hook('test_keras_optimizers_all_reduce_through_the_method_the_loop_overrides')
@contextlib.contextmanager
def optimizer_all_reduce_skipped(optimizer) -> Iterator[None]:
    """While tracing ``optimizer.apply``: tell it its gradients are summed already.

    Reference-counted per optimizer: under ``MirroredStrategy`` every replica's thread
    enters it around the same ``merge_call``.
    """
    with _skip_lock:
        count = _skip_users.get(id(optimizer), 0)
        if count == 0:
            optimizer._all_reduce_sum_gradients = list  # the (gradient, variable) pairs, unchanged
        _skip_users[id(optimizer)] = count + 1
    try:
        yield
    finally:
        with _skip_lock:
            _skip_users[id(optimizer)] -= 1
            if _skip_users[id(optimizer)] == 0:
                del _skip_users[id(optimizer)]
                del optimizer._all_reduce_sum_gradients


# --------------------------------------------------------------------------------------
# The learning rate as given: a variable or a schedule
# --------------------------------------------------------------------------------------
# Relies on: Keras 3's optimizer keeping what its ``learning_rate`` argument became in
# ``_learning_rate``: a ``keras.Variable`` for a float, else the
# ``LearningRateSchedule`` (or callable) itself. The public ``learning_rate`` property
# only gives the current value, so a rollback could not tell a schedule from a rate.
# If gone: the rate is found from ``get_config()["learning_rate"]`` (a float, or a
# serialised schedule that is deserialised again): slower, and a schedule is a copy.


@hook('test_keras_optimizers_keep_the_learning_rate_as_given')
def learning_rate_as_given(optimizer):
    """What ``optimizer``'s ``learning_rate`` argument became: a variable, a
    ``LearningRateSchedule``, or a callable."""
    found = getattr(optimizer, "_learning_rate", None)
    if found is not None:
        return found
    warn_once(
        "_learning_rate",
        f"{type(optimizer).__name__} has no _learning_rate: its learning rate is read from get_config()",
    )
    import keras

    rate = optimizer.get_config()["learning_rate"]
    return keras.optimizers.schedules.deserialize(rate) if isinstance(rate, dict) else rate


# --------------------------------------------------------------------------------------
# The variables an optimizer was built on
# --------------------------------------------------------------------------------------
# Relies on: Keras 3's optimizer keeping, after ``build(var_list)``, the variables it was
# built on in ``_trainable_variables``, in ``var_list``'s order. The NaN doctor builds
# its copy of an optimizer on copies of the same variables, so that the copy's state
# maps one to one onto the optimizer's when a step applies it to part of them (a second
# optimizer for the rest, or a weight that gets no gradient).
# If gone: ``None``: the copy is built on the variables the step applies it to, and the
# diagnosis of such a step gives up ("the optimizer's state cannot be copied").


@hook('test_keras_optimizers_keep_the_variables_they_were_built_on')
def variables_built_on(optimizer) -> list | None:
    """The variables ``optimizer`` was built on, in its order (``None`` if not known)."""
    found = getattr(optimizer, "_trainable_variables", None)
    if found is not None:
        return list(found)
    warn_once(
        "_trainable_variables",
        f"{type(optimizer).__name__} has no _trainable_variables: the NaN doctor cannot copy its state when a "
        "step applies it to part of the variables it was built on",
    )
    return None
