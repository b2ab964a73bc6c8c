"""Private TensorFlow/Keras APIs, one family: writes to variables while tracing, and a variable's initial value from a checkpoint.

Each hook says what it relies on and what happens when it is gone, and is registered
(:func:`companion._internal.registry.hook`) with its canary tests.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import tensorflow as tf

from companion._internal.registry import hook, warn_once


# --------------------------------------------------------------------------------------
# Variable writes while tracing (the masked update of companion.training)
# --------------------------------------------------------------------------------------
# Relies on: every resource-variable write (``Variable.assign``, ``assign_add``,
# ``assign_sub``, so every write of a Keras optimizer's ``apply``) calling
# ``tensorflow.python.ops.gen_resource_variable_ops.assign_variable_op`` (and the _add /
# _sub variants) through the module attribute, at trace time.
# If gone: ``variable_writes_interceptable()`` is False (or the traced update holds
# writes that did not come through the interceptor), and the training loop puts the
# update under a ``tf.cond`` instead: the same results, slower under XLA.
# The patch is installed while at least one thread traces under it (reference count,
# under a lock) and only rewrites writes of the threads that asked for it, so two
# threads tracing at once can neither leave it installed nor see each other's rewrite.

_WRITERS = {
    "assign_variable_op": lambda old, value: value,
    "assign_add_variable_op": lambda old, value: old + value,
    "assign_sub_variable_op": lambda old, value: old - value,
}
_patch_lock = threading.Lock()
_patch_users = 0
_patch_originals: dict[str, Callable] = {}
_thread_rewriters = threading.local()


def _resource_variable_ops():
    try:
        from tensorflow.python.ops import gen_resource_variable_ops as module
    except ImportError:  # pragma: no cover - depends on the TensorFlow version
        return None
    if not all(callable(getattr(module, name, None)) for name in (*_WRITERS, "read_variable_op")):
        return None  # pragma: no cover
    return module


@hook('test_every_write_of_a_keras_optimizer_update_goes_through_the_interceptor')
def variable_writes_interceptable() -> bool:
    """Whether :func:`intercept_variable_writes` can work with this TensorFlow."""
    if _resource_variable_ops() is None:  # pragma: no cover - depends on the TensorFlow version
        warn_once(
            "gen_resource_variable_ops",
            "tensorflow.python.ops.gen_resource_variable_ops has no assign_variable_op: the masked update is "
            "unavailable, so companion.training puts the update under a tf.cond (same results, slower with XLA)",
        )
        return False
    return True


def _patched(name: str, original: Callable, assign: Callable, read: Callable) -> Callable:
    combine = _WRITERS[name]

    def write(resource, value, *args, **kwargs):
        rewriters = getattr(_thread_rewriters, "stack", None)
        if not rewriters:
            return original(resource, value, *args, **kwargs)
        old = read(resource, value.dtype)
        return assign(resource, rewriters[-1](old, combine(old, value)), *args, **kwargs)

    write.__wrapped__ = original
    return write


@hook('test_every_write_of_a_keras_optimizer_update_goes_through_the_interceptor', 'test_the_write_interceptor_is_removed_when_two_threads_trace_at_once', 'test_writes_of_a_thread_that_did_not_ask_are_not_rewritten')
@contextlib.contextmanager
def intercept_variable_writes(rewrite: Callable[[tf.Tensor, tf.Tensor], tf.Tensor]) -> Iterator[None]:
    """While active in this thread, every traced variable write assigns ``rewrite(old, new)``.

    ``old`` is the variable's value read right before the write and ``new`` the value the
    original write would store (``old + delta`` for ``assign_add``). Writes of other
    threads are not touched. Call :func:`variable_writes_interceptable` first.
    """
    global _patch_users
    module = _resource_variable_ops()
    if module is None:  # pragma: no cover - depends on the TensorFlow version
        raise RuntimeError("variable writes cannot be intercepted with this TensorFlow")
    with _patch_lock:
        if _patch_users == 0:
            _patch_originals.update({name: getattr(module, name) for name in _WRITERS})
            assign, read = _patch_originals["assign_variable_op"], module.read_variable_op
            for name, original in _patch_originals.items():
                setattr(module, name, _patched(name, original, assign, read))
        _patch_users += 1
    stack = _thread_rewriters.__dict__.setdefault("stack", [])
    stack.append(rewrite)
    try:
        yield
    finally:
        stack.pop()
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                for name, original in _patch_originals.items():
                    setattr(module, name, original)
                _patch_originals.clear()


@hook('test_the_write_interceptor_is_removed_when_two_threads_trace_at_once')
def variable_writes_patched() -> bool:
    """Whether the write interceptor is installed right now (for tests)."""
    module = _resource_variable_ops()
    return module is not None and any(hasattr(getattr(module, name), "__wrapped__") for name in _WRITERS)


# --------------------------------------------------------------------------------------
# A variable's initial value that restores a checkpoint (the ulp perturbation)
# --------------------------------------------------------------------------------------
# Relies on: ``tf.train.Checkpoint`` restoring a variable that is created after
# ``restore()`` was called ("restore on create") by passing a
# ``tensorflow.python.trackable.base.CheckpointInitialValueCallable`` as the
# ``initial_value`` of the new variable, through every variable creator.
# Why: ``companion.book.notebook.setup(perturb_ulp=True)`` moves every new variable's initial
# value by one ulp; a value read from a checkpoint must come back bit for bit, as it would
# through an ``assign``.
# If gone: ``is_checkpoint_restore`` recognises the value by its ``checkpoint_position``
# attribute (public on that class); if that is gone too, a restored-on-create variable is
# perturbed like any other (a resumed run then differs by one ulp under the switch only).


@hook('test_restore_on_create_passes_a_checkpoint_value_that_is_recognised')
def is_checkpoint_restore(initial_value: Any) -> bool:
    """Whether a variable creator's ``initial_value`` is a value restored from a checkpoint."""
    try:
        from tensorflow.python.trackable.base import CheckpointInitialValue, CheckpointInitialValueCallable
    except ImportError:  # pragma: no cover - depends on the TensorFlow version
        warn_once("CheckpointInitialValueCallable", "tensorflow's restore-on-create value class is gone: "
                  "recognising restored values by their checkpoint_position attribute")
        return getattr(initial_value, "checkpoint_position", None) is not None
    return isinstance(initial_value, (CheckpointInitialValue, CheckpointInitialValueCallable))
