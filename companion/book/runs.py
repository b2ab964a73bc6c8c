"""Short, instrumented training runs: the experiments the case A chapters measure.

The chapters of case A ask the same few questions of a model many times: at which step
do its gradients first stop being finite, what did its exponents do until then, and how
does that change with the learning rate? And, for a single reparametrised variable:
how many optimizer steps does it take to reach a target? This module answers them, so
that a chapter's cell shows the question and the answer, not the loop.

- `run_until_nonfinite`: plain optimizer steps on a sequence of batches, stopping at the
  first step whose gradients are not all finite (that step is not applied);
- `learning_rate_sweep`: the same run, from the same seeded start, for several
  learning rates of Adam;
- `steps_to_reach`: gradient steps on ``(value(w) - target)^2`` until each entry of
  ``value(w)`` is within a tolerance of the target.

These are book tools, deliberately plain (the loss is the mean squared error, there is
no guard and no clipping): the training loop for real use is
:func:`companion.training.train`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Sequence  # typing: the API page resolves these

import keras
import numpy as np
import tensorflow as tf

__all__ = ["NonFiniteRun", "learning_rate_sweep", "run_until_nonfinite", "steps_to_reach"]


@dataclasses.dataclass(frozen=True)
class NonFiniteRun:
    """What `run_until_nonfinite` saw.

    Attributes:
        step: the first step (counted from 0) whose gradients are not all finite, or
            ``None`` if every step of the run had finite gradients.
        losses: the loss of every step computed, the failing one included.
        smallest_exponent: per step, the smallest of the exponents ``b`` and ``c`` the
            model predicted for that step's batch (before the step's update); empty for
            a model without ``predict_parameters``.
        largest_exponent: the same, the largest.
        nonfinite_variables: at the failing step, how many trainable variables have a
            non-finite gradient (0 without a failing step).
    """

    step: int | None
    losses: tuple[float, ...]
    smallest_exponent: tuple[float, ...]
    largest_exponent: tuple[float, ...]
    nonfinite_variables: int

    @property
    def steps(self) -> int:
        """Number of steps computed (applied steps plus the failing one)."""
        return len(self.losses)


def _as_batch(batch):
    """``((xs, ys), targets)`` as `targets.dataset` yields, or a bare ``(xs, ys)``."""
    first, second = batch
    if isinstance(first, (tuple, list)):
        return tuple(first), second
    return (first, second), second


def run_until_nonfinite(
    model: keras.Model,
    batches: Sequence,
    optimizer: keras.optimizers.Optimizer,
    *,
    max_steps: int,
) -> NonFiniteRun:
    """Train with plain optimizer steps until a gradient is not finite.

    Step ``k`` uses ``batches[k % len(batches)]``, computes the mean squared error and
    its gradients and, if every gradient is finite, applies them; the first step with a
    non-finite gradient is recorded and not applied, and the run stops there, so the
    model keeps the weights of the step before. For a model with ``predict_parameters``
    and ``evaluate_terms`` (:class:`companion.book.models.ParameterNet`) the prediction is
    computed through them, and the range of the exponents ``b`` and ``c`` of each step
    is recorded. The step is compiled with ``tf.function`` (no XLA), once per call.

    Args:
        model: a Keras model called as ``model(inputs)``.
        batches: a non-empty sequence of ``((xs, ys), targets)`` pairs (the elements of
            :func:`companion.book.targets.dataset`) or of ``(xs, ys)`` pairs, whose targets
            are then ``ys``.
        optimizer: a fresh Keras optimizer.
        max_steps: the largest number of steps to compute, >= 1.

    Returns:
        A :class:`NonFiniteRun`.

    Raises:
        ValueError: if ``batches`` is empty or ``max_steps`` is not a positive int.

    Example:
        >>> from companion.book import models, targets
        >>> keras.utils.set_random_seed(0)
        >>> net = models.ParameterNet(num_terms=1, d_model=4, num_heads=1, fixes=())
        >>> batches = list(targets.dataset("sqrt", batches=2, batch_size=4, seed=0))
        >>> adam = keras.optimizers.Adam(1e-2)
        >>> run = run_until_nonfinite(net, batches, adam, max_steps=5)
        >>> run.step, run.steps, run.smallest_exponent[0]  # fails once b is below 1
        (1, 2, 1.0)
    """
    batches = [_as_batch(batch) for batch in batches]
    if not batches:
        raise ValueError("batches must hold at least one batch, got none")
    if isinstance(max_steps, bool) or not isinstance(max_steps, (int, np.integer)) or max_steps < 1:
        raise ValueError(f"max_steps must be a positive int, got {max_steps!r}")
    has_parameters = hasattr(model, "predict_parameters") and hasattr(model, "evaluate_terms")
    model(batches[0][0])  # builds the model and (below) the optimizer, so that the step is traced once
    if not optimizer.built:  # as fit does: a first call that created its slots would be traced twice
        optimizer.build(model.trainable_variables)

    @tf.function
    def step(inputs, targets):
        with tf.GradientTape() as tape:
            if has_parameters:
                parameters = model.predict_parameters(inputs)
                prediction = model.evaluate_terms(parameters, inputs[0])
                exponents = tf.concat([parameters["b"], parameters["c"]], axis=-1)
                extremes = tf.stack([tf.reduce_min(exponents), tf.reduce_max(exponents)])
            else:
                prediction = model(inputs)
                extremes = tf.zeros([0])
            error = tf.cast(prediction, tf.float32) - tf.cast(targets, tf.float32)
            loss = tf.reduce_mean(tf.square(error))
        variables = model.trainable_variables
        grads = tape.gradient(loss, variables)
        finite = tf.stack([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
        if tf.reduce_all(finite):
            optimizer.apply_gradients(zip(grads, variables))
        return loss, extremes, tf.reduce_sum(tf.cast(tf.logical_not(finite), tf.int32))

    losses, smallest, largest = [], [], []
    for k in range(int(max_steps)):
        inputs, targets = batches[k % len(batches)]
        loss, extremes, bad = step(inputs, targets)
        losses.append(float(loss))
        if has_parameters:
            smallest.append(float(extremes[0]))
            largest.append(float(extremes[1]))
        if int(bad):
            return NonFiniteRun(k, tuple(losses), tuple(smallest), tuple(largest), int(bad))
    return NonFiniteRun(None, tuple(losses), tuple(smallest), tuple(largest), 0)


def learning_rate_sweep(
    build: Callable[[], keras.Model],
    batches: Sequence,
    learning_rates: Iterable[float],
    *,
    max_steps: int,
    seed: int = 0,
) -> dict[float, NonFiniteRun]:
    """`run_until_nonfinite` with Adam, from the same seeded start, for each learning rate.

    Before each run ``keras.utils.set_random_seed(seed)`` is called and a fresh model is
    built with ``build()``, so the runs differ in the learning rate only.

    Args:
        build: a function of no argument that returns a fresh model.
        batches: as for `run_until_nonfinite`.
        learning_rates: the learning rates of ``keras.optimizers.Adam``, each > 0.
        max_steps: the largest number of steps of each run.
        seed: the seed set before each model is built.

    Returns:
        A dict from each learning rate to its :class:`NonFiniteRun`, in the given order.

    Raises:
        ValueError: if a learning rate is not a positive number, or as
            `run_until_nonfinite`.

    Example:
        >>> from companion.book import models, targets
        >>> batches = list(targets.dataset("sqrt", batches=2, batch_size=4, seed=0))
        >>> def build():
        ...     return models.ParameterNet(num_terms=1, d_model=4, num_heads=1, fixes=())
        >>> runs = learning_rate_sweep(build, batches, [1e-2, 1e-3], max_steps=5)
        >>> {lr: run.step for lr, run in runs.items()}
        {0.01: 1, 0.001: 1}
    """
    rates = [float(lr) for lr in learning_rates]
    for lr in rates:
        if not np.isfinite(lr) or lr <= 0:
            raise ValueError(f"every learning rate must be a positive number, got {lr!r}")
    runs = {}
    for lr in rates:
        keras.utils.set_random_seed(seed)
        model = build()
        runs[lr] = run_until_nonfinite(model, batches, keras.optimizers.Adam(learning_rate=lr), max_steps=max_steps)
    return runs


def steps_to_reach(
    value: Callable[[tf.Tensor], tf.Tensor],
    start,
    optimizer: keras.optimizers.Optimizer,
    *,
    target: float,
    tolerance: float,
    max_steps: int,
) -> np.ndarray:
    """Steps of ``optimizer`` on ``sum((value(w) - target)^2)`` until each entry arrives.

    ``w`` is a float32 variable that starts at ``start``; each step applies the gradient
    of the loss to it. An entry has arrived at the first step after which
    ``|value(w) - target| < tolerance``; the entries keep moving together after that
    (the loss is a sum), and the count stops when all have arrived or after
    ``max_steps``. The steps are compiled with ``tf.function``.

    Args:
        value: maps the variable to the quantity that should reach ``target``, e.g.
            ``lambda r: bounded(r, 0.1, 2.0)`` for a reparametrised exponent, or
            ``lambda w: w`` for the quantity itself.
        start: the initial value of the variable: a number or a 1-D array.
        optimizer: a fresh Keras optimizer.
        target: the value to reach.
        tolerance: the distance counted as arrived, > 0.
        max_steps: the largest number of steps, >= 1.

    Returns:
        An int array of the shape of ``start``: the step count of each entry, counted
        from 1, or 0 for an entry that had not arrived after ``max_steps``.

    Raises:
        ValueError: if ``tolerance`` is not positive or ``max_steps`` not a positive int.

    Example:
        >>> steps_to_reach(lambda w: w, [0.0, 0.5], keras.optimizers.SGD(0.25),
        ...                target=1.0, tolerance=0.1, max_steps=10)
        array([4, 3])
    """
    if not tolerance > 0:
        raise ValueError(f"tolerance must be positive, got {tolerance!r}")
    if isinstance(max_steps, bool) or not isinstance(max_steps, (int, np.integer)) or max_steps < 1:
        raise ValueError(f"max_steps must be a positive int, got {max_steps!r}")
    w = tf.Variable(np.atleast_1d(np.asarray(start, np.float32)))
    if not optimizer.built:  # so that the step is traced once (a first call creating the slots is traced twice)
        optimizer.build([w])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(value(w) - target))
        optimizer.apply_gradients([(tape.gradient(loss, w), w)])
        return tf.abs(value(w) - target) < tolerance

    arrived = np.zeros(w.shape, int)
    for k in range(1, int(max_steps) + 1):
        close = step().numpy()
        arrived[close & (arrived == 0)] = k
        if arrived.all():
            break
    return arrived.reshape(np.shape(start))
