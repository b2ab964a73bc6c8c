"""The model's own ``train_step`` as the doctor runs it: every variable it may write, restored.

A model with its own ``train_step`` (keras.io's GANs with a ``d_optimizer`` and a
``g_optimizer``, its VAE, Keras' guide *Customizing what happens in fit()*) or without a
compiled loss has no loss the doctor could differentiate on its own. The doctor then
runs the step itself, as ``fit`` does, on a copy of everything it may write:

* :func:`optimizers_of` finds the model's optimizers (``model.optimizer`` and any
  optimizer kept as an attribute, e.g. ``self.d_optimizer``);
* :func:`step_variables` lists what the step may change: the model's variables (seed
  generators included), its metrics' variables, every optimizer's variables, and the
  global random generators; :mod:`~companion.diagnostics.state` saves and restores them;
* :class:`OwnStepScan` is the scanning step (a ``tf.function``, or eager): the step's
  logs are finite, and which variables the step wrote as non-finite;
* :func:`culprit` picks, among the op-by-op re-run's non-finite ops, the one that made
  the first harmful value: the backward op of the user's loss rather than the
  optimizer's ``Sub`` that consumed its NaN gradient afterwards.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from companion import _internal

__all__ = ["OwnStepScan", "culprit", "optimizers_of", "step_variables", "uses_own_step"]


def uses_own_step(model: Any, loss: Any) -> bool:
    """Whether the doctor runs ``model.train_step`` (no ``loss`` given, and an own step or no compiled loss)."""
    if loss is not None or not isinstance(model, keras.Model):
        return False
    overridden = type(model).train_step is not _keras_train_step(model)
    compiled_loss = getattr(model, "compiled", False) and getattr(model, "loss", None) is not None
    return overridden or (not compiled_loss and bool(getattr(model, "compiled", False)))


def _keras_train_step(model) -> Callable:
    """The ``train_step`` Keras' backend trainer defines (the one a plain model inherits)."""
    for klass in type(model).__mro__:
        if klass.__module__.startswith("keras.") and "train_step" in vars(klass):
            return vars(klass)["train_step"]
    return keras.Model.train_step  # pragma: no cover


def optimizers_of(model: Any) -> list:
    """``model.optimizer`` and every optimizer kept as an attribute of the model, once each."""
    found, seen = [], set()
    candidates = [getattr(model, "optimizer", None)] + list(vars(model).values())
    for value in candidates:
        if isinstance(value, keras.optimizers.Optimizer) and id(value) not in seen:
            seen.add(id(value))
            found.append(value)
            inner = getattr(value, "inner_optimizer", None)  # a LossScaleOptimizer
            if isinstance(inner, keras.optimizers.Optimizer) and id(inner) not in seen:
                seen.add(id(inner))
                found.append(inner)
    return found


def step_variables(model: Any) -> list:
    """Everything a training step may write: model, metrics, optimizers, global RNGs."""
    variables = list(model.variables)
    variables += list(getattr(model, "metrics_variables", []) or [])
    for optimizer in optimizers_of(model):
        variables += list(getattr(optimizer, "variables", ()))
    variables += _internal.global_random_states()
    unique, seen = [], set()
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            unique.append(variable)
    return unique


def written_variables(model: Any) -> list:
    """The floating-point variables whose non-finite value the doctor reports after a step."""
    variables = list(model.trainable_variables) + [v for v in model.non_trainable_variables]
    for optimizer in optimizers_of(model):
        variables += list(getattr(optimizer, "variables", ()))
    unique, seen = [], set()
    for variable in variables:
        if id(variable) not in seen and tf.as_dtype(variable.dtype).is_floating:
            seen.add(id(variable))
            unique.append(variable)
    return unique


def pack(x, y, sample_weight):
    """The batch as ``fit`` hands it to ``train_step``."""
    return keras.utils.pack_x_y_sample_weight(x, y, sample_weight)


def logs_values(logs) -> list[tuple[str, tf.Tensor]]:
    """``(name, tensor)`` of each floating-point value the step returned."""
    if isinstance(logs, dict):
        items = [(str(k), v) for k, v in logs.items()]
    else:
        items = [(str(i), v) for i, v in enumerate(tf.nest.flatten(logs))]
    out = []
    for name, value in items:
        for leaf in tf.nest.flatten(value):
            if isinstance(leaf, (tf.Tensor, tf.Variable, np.ndarray, float)) or hasattr(leaf, "dtype"):
                tensor = tf.convert_to_tensor(leaf)
                if tensor.dtype.is_floating:
                    out.append((name, tensor))
    return out


class OwnStepScan:
    """``scan(x, y, w) -> (finite flag per logged value, finite flag per written variable)``.

    Runs ``model.train_step`` as ``fit`` does (a ``tf.function``, with XLA if ``jit``;
    eagerly if ``jit`` is ``None``). :attr:`log_names` names the logged values (known
    after the first call), :attr:`written` the variables checked. The caller saves and
    restores :func:`step_variables` around each call.
    """

    def __init__(self, model: Any, jit: bool | None) -> None:
        self.model = model
        self.written = written_variables(model)
        self.log_names: list[str] = []
        self._fn = self._step if jit is None else tf.function(self._step, jit_compile=bool(jit), reduce_retracing=True)

    def _step(self, x, y, weights):
        logs = self.model.train_step(pack(x, y, weights))
        values = logs_values(logs)
        self.log_names = [name for name, _ in values]
        logs_ok = [tf.reduce_all(tf.math.is_finite(tf.cast(v, tf.float32))) for _, v in values]
        flags = [tf.reduce_all(tf.math.is_finite(v.value if hasattr(v, "value") else v)) for v in self.written]
        return (
            tf.stack(logs_ok) if logs_ok else tf.ones([0], tf.bool),
            tf.stack(flags) if flags else tf.ones([0], tf.bool),
        )

    def __call__(self, x, y, weights):
        return self._fn(x, y, weights)


def culprit(tracer) -> Any:
    """The event that made the first harmful non-finite value of an op-by-op re-run.

    The forward pass's first non-finite op, unless every non-finite forward value was
    dropped by a ``tf.where`` (then the backward op it turns into a NaN) or there was
    none before the backward pass (then the first backward op: the NaN gradient, not
    the optimizer's ops that consume it afterwards); ``None`` without events.
    """
    events = list(tracer.events)
    if not events:
        return None
    backward = tracer.first(backward=True)
    forward = [e for e in events if not e.backward]
    before = [e for e in forward if backward is None or e.index < backward.index]
    if backward is not None and (not before or tracer.masked_selects):
        return backward
    if before:
        return before[0]
    return forward[0] if forward else events[0]
