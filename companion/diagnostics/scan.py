"""The scanning step: each batch through the loss and its gradients as ``fit`` computes them.

:func:`scan` walks the batches and returns the first whose loss or gradients (or, for a
model's own ``train_step``, whose logs or written variables) are not finite, run a
second time to see whether it reproduces. The step is :func:`compiled_step` (XLA, a
plain graph, or eager) on the loss :func:`loss_function` gives (the given one, or
``model.compute_loss`` as ``fit`` calls it), or
:class:`~companion.diagnostics.step.OwnStepScan` for a model's own ``train_step``;
:func:`run_scan_step` runs it once with every variable it may change restored, so the
scan updates nothing. :mod:`~companion.diagnostics.remedies` runs the same step to
check a remedy.
"""

from __future__ import annotations

import inspect
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from companion import _internal
from companion._gradients import all_finite
from companion.diagnostics.capsule_file import variables_state
from companion.diagnostics.data import batches, nonfinite_data
from companion.diagnostics.gradients import _variable_path
from companion.diagnostics.state import restore, snapshot
from companion.diagnostics.step import OwnStepScan, step_variables, uses_own_step
from companion.losses import mean_loss, resolve_loss

__all__ = [
    "before_step",
    "compiled_step",
    "ensure_built",
    "loss_function",
    "model_state",
    "random_states",
    "run_scan_step",
    "scan",
    "scanned_batches",
]


def loss_function(model, loss) -> Callable:
    """``f(x, y, y_pred, sample_weight) -> scalar``: the given loss, or the compiled one."""
    if loss is not None:
        fn = resolve_loss(loss)

        def given(x, y, y_pred, sample_weight):
            if sample_weight is not None and isinstance(fn, keras.losses.Loss):
                value = fn(y, y_pred, sample_weight=sample_weight)
            else:
                value = mean_loss(fn, y, y_pred)
            if model.losses:
                value = value + tf.cast(tf.add_n(model.losses), value.dtype)
            return value

        return given
    if getattr(model, "compiled", False) and getattr(model, "loss", None) is not None:
        accepts_training = "training" in inspect.signature(model.compute_loss).parameters

        def compiled(x, y, y_pred, sample_weight):
            kwargs = {"training": True} if accepts_training else {}
            return model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, **kwargs)

        return compiled
    raise ValueError(
        "the model is not compiled with a loss: pass loss= (a Keras loss name, a Loss or a callable)"
    )


def model_state(model) -> list:
    """Every local copy of the model's non-trainable variables (see :mod:`.state`)."""
    return snapshot(model.non_trainable_variables)


def ensure_built(model, x) -> None:
    """Build ``model`` by calling it on ``x`` (a model without ``call()`` is built by its ``train_step``)."""
    if not model.built:
        try:
            model(x)
        except Exception:  # a model without call() (keras.io's VAE, GAN): its train_step builds it
            if not uses_own_step(model, None):
                raise


def scanned_batches(model, data, y, sample_weight, batch_size, max_batches, skip):
    """The batches a scan looks at, as ``(index, (x, y_true, weights))``, the model built.

    Batches ``skip`` to ``skip + max_batches - 1`` of ``fit``'s order (``max_batches``
    None: to the end); the model is built on the first one's ``x`` (:func:`ensure_built`).
    Used by :func:`scan` and by the update's scan (``find_update`` in
    ``companion.diagnostics.update``).
    """
    for index, batch in enumerate(batches(data, y, sample_weight, batch_size)):
        if max_batches is not None and index >= skip + max_batches:
            return
        if index < skip:
            continue
        ensure_built(model, batch[0])
        yield index, batch


def before_step(model, own: bool) -> list:
    """What the scanning step may change, saved: everything for an own step, else the state."""
    return snapshot(step_variables(model)) if own else model_state(model)


def random_states(model) -> list:
    """The random states a training step advances: the model's ``SeedGenerator`` states and the global ones.

    ``fit`` draws batch k's dropout masks, noise and timesteps (``keras.random.*`` with a
    ``SeedGenerator``, or unseeded from Keras' global one, or TensorFlow's global
    ``tf.random.Generator``) from the states k steps have advanced; the scan keeps them
    advancing from batch to batch (:func:`run_scan_step` with ``advance=True``), so
    batch k draws what ``fit`` drew at step k.
    """
    found = [v for v in model.variables if str(getattr(v, "name", "")).rpartition("/")[2].startswith(
        "seed_generator_state")]
    found += _internal.global_random_states()
    unique, seen = [], set()
    for variable in found:
        if id(variable) not in seen:
            seen.add(id(variable))
            unique.append(variable)
    return unique


def run_scan_step(model, step, own: bool, x, y_true, weights,
                  advance: bool = False) -> tuple[bool, list[str], list[str]]:
    """One scanning step with every variable restored: ``(loss ok, bad variables, bad logs)``.

    ``advance``: the random states (:func:`random_states`) keep the values the step left
    them at, as after a step of ``fit``; everything else is put back.
    """
    saved = before_step(model, own)
    moved = None
    try:
        first, second = step(x, y_true, weights)
        if advance:
            moved = snapshot(random_states(model))
    finally:
        restore(saved)
        if moved is not None:
            restore(moved)
    first, second = np.asarray(first), np.asarray(second)
    if own:
        bad_logs = [name for name, ok in zip(step.log_names, first) if not ok]
        bad = [_variable_path(v) for v, ok in zip(step.written, second) if not ok]
        return not bad_logs, bad, bad_logs
    names = [_variable_path(v) for v, ok in zip(model.trainable_variables, second) if not ok]
    return bool(first), names, []


def scan(model, data, loss_fn, y, sample_weight, batch_size, max_batches, skip, jit):
    """The first non-finite batch: ``(index, batch, {"loss": bool, "variables": [...], ...})``.

    Batch k is run with the random states ``fit`` had at step k (each batch's step
    advances them, as ``fit``'s does), and the scan stops with them as they were before
    the failing batch, so that its re-runs draw the same numbers; the caller puts them
    back afterwards (``diagnose`` does).
    """
    step = None
    own = loss_fn is None
    for index, batch in scanned_batches(model, data, y, sample_weight, batch_size, max_batches, skip):
        x, y_true, weights = batch
        if step is None:
            step = OwnStepScan(model, jit) if own else compiled_step(model, loss_fn, jit)
        bad_data = bool(nonfinite_data(batch))
        before = snapshot(random_states(model))
        try:
            loss_ok, names, bad_logs = run_scan_step(model, step, own, x, y_true, weights, advance=True)
        except Exception:
            if not bad_data:
                raise
            loss_ok, names, bad_logs = False, [], []
        if bad_data or not (loss_ok and not names):
            restore(before)  # the failing batch's random states, for its re-runs
        if bad_data:
            return index, batch, {"loss": not loss_ok, "variables": names, "data": True, "logs": bad_logs,
                                  "state": variables_state(model), "own": own}
        if loss_ok and not names:
            continue
        # The same step once more, on the same batch, weights and seeds: does it reproduce?
        again_ok, again, _ = run_scan_step(model, step, own, x, y_true, weights)
        return index, batch, {"loss": not loss_ok, "variables": names, "logs": bad_logs,
                              "state": variables_state(model), "own": own, "reproduced": not (again_ok and not again)}
    return None


def compiled_step(model, loss_fn, jit: bool | None) -> Callable:
    """The scanning step: XLA (``jit=True``), a plain graph (``False``) or eager (``None``)."""
    variables = list(model.trainable_variables)

    def step(x, y_true, weights):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            value = loss_fn(x, y_true, y_pred, weights)
        grads = tape.gradient(value, variables)
        flags = [tf.constant(True) if g is None else all_finite([g]) for g in grads]
        finite = tf.reduce_all(tf.math.is_finite(tf.cast(value, tf.float32)))
        return finite, tf.stack(flags) if flags else tf.ones([0], tf.bool)

    if jit is None:
        return step
    return tf.function(step, jit_compile=jit, reduce_retracing=True)

