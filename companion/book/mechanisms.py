"""Small examples of the mechanisms the survey found recurring, each with its fix.

The checklist chapter (``book/closing/checklist.ipynb``) gives each recurring mechanism
of the survey (:mod:`companion.book.survey`) a section; the code of its example and of
its fix is here, so the chapter shows the computation and imports the rest:

* weights that start non-finite: :class:`LogPriorDense` (an output bias set to the
  log-odds of label frequencies, one of which is 0) and :class:`DataInitScale` (a scale set from the
  first batch's spread, which is 0 for a constant feature);
* a learning-rate schedule that goes below 0: :class:`LinearDecay` and
  :func:`scheduled_fit`;
* targets bootstrapped from the model itself: :func:`td_run`;
* weights computed from class counts: :func:`positive_weight` and :func:`weighted_loss`;
* special functions that overflow: :func:`log_bessel_i0` and :func:`log_beta`;
* a Cholesky factor of a matrix that float32 cannot keep positive definite:
  :func:`rbf_kernel` and :func:`cholesky`;
* samplers that return the end of their interval: :func:`beta_draws`;
* a NaN written by the optimizer's update (Adam's ``epsilon`` is 0 in ``float16``):
  :func:`half_precision_regression`, :func:`update_steps` and
  :func:`half_precision_diagnosis`.

Part of the book's support code (:mod:`companion.book`): no stability promise.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

__all__ = [
    "DataInitScale",
    "LinearDecay",
    "LogPriorDense",
    "beta_draws",
    "cholesky",
    "half_precision_diagnosis",
    "half_precision_regression",
    "label_tagger",
    "log_bessel_i0",
    "log_beta",
    "positive_weight",
    "rbf_kernel",
    "scheduled_fit",
    "standardized_dataset",
    "td_run",
    "update_steps",
    "weighted_loss",
]


# --------------------------------------------------------------------------------------
# Weights that start non-finite
# --------------------------------------------------------------------------------------


class LogPriorDense(keras.layers.Dense):
    """A multi-label output layer whose bias starts at the log-odds of each label's frequency.

    The bias ``log(p / (1 - p))``, with ``p`` the fraction of training examples that have
    the label, makes the untrained model predict each label's prior (a common
    initialisation for rare labels). A label that no training example has gets
    ``log(0) = -inf``, and the sigmoid cross-entropy from logits of a label 0 at a logit of
    ``-inf`` is ``-inf * 0 = NaN`` from the first step. With ``floor``, each frequency is
    first kept in ``[floor, 1 - floor]``.

    Args:
        positives: how many training examples have each label.
        total: how many training examples there are.
        floor: the smallest frequency the log is taken of (None: none).
        **kwargs: passed to ``keras.layers.Dense`` (``units`` is ``len(positives)``).

    Example:
        >>> layer = LogPriorDense([3.0, 0.0], total=8, floor=1e-7)
        >>> bool(np.isfinite(layer.log_odds).all())
        True
    """

    def __init__(self, positives, total: float, floor: float | None = None, **kwargs):
        prior = np.asarray(positives, dtype="float64") / total
        if floor is not None:
            prior = np.clip(prior, floor, 1.0 - floor)
        with np.errstate(divide="ignore"):
            self.log_odds = np.log(prior / (1.0 - prior))
        init = keras.initializers.Constant(self.log_odds)
        super().__init__(len(prior), bias_initializer=init, **kwargs)  # prior


def label_tagger(floor: float | None = None, seed: int = 0):
    """A multi-label classifier whose output layer is a :class:`LogPriorDense`, and its data.

    Three labels: the first on about half of 64 examples, the second on about a fifth, the
    third on none, so that its log-odds prior is ``log 0 = -inf`` unless ``floor`` is set.

    Returns:
        ``(model, x, y)``: the compiled model (sigmoid cross-entropy from logits, Adam),
        its inputs and its labels.

    Example:
        >>> model, x, y = label_tagger(floor=1e-7)
        >>> bool(np.isfinite(model.get_layer("labels").bias.numpy()).all())
        True
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = np.stack([rng.random(64) < 0.5, rng.random(64) < 0.2, np.zeros(64, bool)], 1).astype("float32")
    keras.utils.set_random_seed(seed)
    out = LogPriorDense(y.sum(0), len(y), floor=floor, name="labels")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), out], name="tagger")
    model.compile(optimizer="adam", loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model, x, y


class DataInitScale(keras.layers.Layer):
    """A per-feature scale and shift set from the first batch (ActNorm's initialisation).

    :meth:`initialize` sets ``scale = 1 / std`` and ``shift = -mean / std`` over a batch,
    so that the layer's output starts with mean 0 and standard deviation 1 per feature.
    A feature that is constant in that batch has ``std = 0``: the scale is ``1/0 = inf``
    and the shift ``0/0`` or ``±inf``. ``safe=True`` divides with ``tf.math.divide_no_nan``
    (0 where the spread is 0: the constant feature is dropped rather than made infinite).

    Example:
        >>> layer = DataInitScale()
        >>> layer.build((None, 2))
        >>> layer.initialize(np.array([[1.0, 5.0], [3.0, 5.0]], "float32"), safe=True)
        >>> layer.scale.numpy().tolist()
        [1.0, 0.0]
    """

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="scale")
        self.shift = self.add_weight(shape=(input_shape[-1],), initializer="zeros", name="shift")

    def initialize(self, x, safe: bool = False) -> None:
        """Set the scale and shift from the batch ``x`` (``safe``: divide with divide_no_nan)."""
        x = tf.convert_to_tensor(x, tf.float32)
        mean, std = tf.reduce_mean(x, 0), tf.math.reduce_std(x, 0)
        if safe:
            scale, shift = tf.math.divide_no_nan(1.0, std), tf.math.divide_no_nan(-mean, std)
        else:
            scale, shift = 1.0 / std, -mean / std
        self.scale.assign(scale)  # data-init
        self.shift.assign(shift)

    def call(self, x):
        return x * self.scale + self.shift


def standardize_features(x, y):
    """A ``tf.data`` map: each feature of a batch to mean 0 and standard deviation 1."""
    mean, std = tf.reduce_mean(x, axis=0), tf.math.reduce_std(x, axis=0)
    return (x - mean) / std, y  # standardize


def standardize_features_safe(x, y):
    """The same map with ``tf.math.divide_no_nan``: a constant feature becomes 0."""
    mean, std = tf.reduce_mean(x, axis=0), tf.math.reduce_std(x, axis=0)
    return tf.math.divide_no_nan(x - mean, std), y


def standardized_dataset(safe: bool = False, seed: int = 0):
    """A regression whose ``tf.data`` pipeline standardises each batch; feature 1 is constant.

    Returns:
        ``(model, dataset)``: a compiled ``Dense(1)`` and the batched, mapped dataset
        (``standardize_features``, or ``standardize_features_safe`` with ``safe``).

    Example:
        >>> model, data = standardized_dataset(safe=True)
        >>> x, _ = next(iter(data))
        >>> bool(np.isfinite(x.numpy()).all())
        True
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(32, 3)).astype("float32")
    x[:, 1] = 5.0  # a column that never changes
    y = x[:, :1] * 2.0
    mapping = standardize_features_safe if safe else standardize_features
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).map(mapping)
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)], name="regression")
    model.compile(optimizer="sgd", loss="mse")
    return model, dataset


# --------------------------------------------------------------------------------------
# A learning-rate schedule below 0
# --------------------------------------------------------------------------------------


@keras.saving.register_keras_serializable(package="companion.book")
class LinearDecay(keras.optimizers.schedules.LearningRateSchedule):
    """``rate * (1 - step / decay_steps)``, written by hand; ``floor`` keeps it at or above it.

    Without a floor the rate keeps falling after ``decay_steps`` and turns negative: the
    optimizer then climbs the loss instead of descending it. Keras'
    ``PolynomialDecay(rate, decay_steps, end_learning_rate=0.0)`` is the same line held at
    its end value.

    Example:
        >>> float(LinearDecay(0.1, 10)(20)) < 0
        True
        >>> float(LinearDecay(0.1, 10, floor=0.0)(20))
        0.0
    """

    def __init__(self, rate: float, decay_steps: int, floor: float | None = None):
        self.rate, self.decay_steps, self.floor = rate, decay_steps, floor

    def __call__(self, step):
        value = self.rate * (1.0 - tf.cast(step, tf.float32) / self.decay_steps)
        return value if self.floor is None else tf.maximum(value, self.floor)

    def get_config(self) -> dict[str, Any]:
        return {"rate": self.rate, "decay_steps": self.decay_steps, "floor": self.floor}


def _regression(n: int = 64, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(n, 4)) * 3.0).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [1.5]], "float32")).astype("float32")
    return x, y


def scheduled_fit(learning_rate, steps: int = 150) -> tuple[list[float], list[float]]:
    """Plain SGD on a linear regression (inputs of std 3), one full batch a step.

    Args:
        learning_rate: a float or a ``LearningRateSchedule`` for ``keras.optimizers.SGD``.
        steps: how many steps to run.

    Returns:
        ``(losses, rates)``: the loss after each step and the rate each step used.

    Example:
        >>> losses, rates = scheduled_fit(0.01, steps=3)
        >>> losses[-1] < losses[0]
        True
    """
    x, y = _regression()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, kernel_initializer="zeros")])
    optimizer = keras.optimizers.SGD(learning_rate)
    losses, rates = [], []
    for step in range(steps):
        rates.append(float(learning_rate(step)) if callable(learning_rate) else float(learning_rate))
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        losses.append(float(tf.reduce_mean(tf.square(model(x) - y))))
    return losses, rates


# --------------------------------------------------------------------------------------
# Bootstrapped targets
# --------------------------------------------------------------------------------------


def td_run(steps: int = 200, both_states: bool = False, gamma: float = 0.99,
           learning_rate: float = 0.5) -> list[float]:
    """Semi-gradient TD(0) on two states whose values share one weight, ``v(s) = w * phi(s)``.

    State 1 (``phi = 1``) moves to state 2 (``phi = 2``) with reward 0; state 2 ends the
    episode with reward 0. Every true value is 0. Trained on the first transition only
    (off-policy: a replay buffer that never holds the second), the target
    ``gamma * v(s2) = 2 * gamma * w`` is computed from the weight itself and held fixed
    (``tf.stop_gradient``, as a target network does): each step moves ``w`` towards
    ``1.98 w``, so ``w`` grows geometrically until it overflows. With ``both_states``
    (the episode's transitions in proportion) the same update shrinks ``w`` towards 0.
    This is the two-state example of Tsitsiklis and Van Roy (1997).

    Args:
        steps: how many SGD steps.
        both_states: train on both transitions (else on the first only).
        gamma: the discount.
        learning_rate: the SGD rate.

    Returns:
        The weight ``w`` after each step (floats, possibly ``inf`` or ``nan``).

    Example:
        >>> abs(td_run(20, both_states=True)[-1]) < 1e-3
        True
    """
    w = tf.Variable(1.0)
    phi = tf.constant([1.0, 2.0])  # features of states 1 and 2
    next_value = tf.constant([1.0, 0.0])  # state 1 -> state 2; state 2 -> the end
    rows = 2 if both_states else 1
    optimizer = keras.optimizers.SGD(learning_rate)
    history = []
    for _ in range(steps):
        with tf.GradientTape() as tape:
            value = w * phi[:rows]
            target = tf.stop_gradient(gamma * next_value[:rows] * w * phi[1])  # bootstrap
            loss = tf.reduce_mean(tf.square(target - value))
        optimizer.apply([tape.gradient(loss, w)], [w])
        history.append(float(w.numpy()))
    return history


# --------------------------------------------------------------------------------------
# Weights from class counts
# --------------------------------------------------------------------------------------


def positive_weight(labels, safe: bool = False) -> tf.Tensor:
    """The positive-class weight ``n_negative / n_positive`` of each label column.

    ``tf.nn.weighted_cross_entropy_with_logits`` takes it as ``pos_weight`` to balance a
    rare positive class. A column without a positive example gives ``n / 0 = inf``;
    ``safe`` divides with ``tf.math.divide_no_nan`` (a weight of 0 for a class that has
    no positive example to weight).

    Example:
        >>> positive_weight(np.array([[1.0, 0.0], [0.0, 0.0]])).numpy().tolist()
        [1.0, inf]
    """
    labels = tf.convert_to_tensor(labels, tf.float32)
    positives = tf.reduce_sum(labels, axis=0)
    negatives = tf.cast(tf.shape(labels)[0], tf.float32) - positives
    if safe:
        return tf.math.divide_no_nan(negatives, positives)
    return negatives / positives  # n / 0


def weighted_loss(labels, logits, pos_weight) -> tf.Tensor:
    """The mean of ``tf.nn.weighted_cross_entropy_with_logits`` over all entries."""
    labels = tf.convert_to_tensor(labels, tf.float32)
    return tf.reduce_mean(tf.nn.weighted_cross_entropy_with_logits(labels, logits, pos_weight))


# --------------------------------------------------------------------------------------
# Special functions that overflow
# --------------------------------------------------------------------------------------


def log_bessel_i0(kappa, stable: bool = False) -> tf.Tensor:
    """``log I0(kappa)``, the von Mises distribution's log normaliser.

    ``I0`` grows like ``exp(kappa) / sqrt(2 pi kappa)`` and is ``inf`` in float32 from
    ``kappa`` of about 91 on, so ``log(bessel_i0(kappa))`` is ``inf`` there and its
    gradient ``I1 / I0 = inf / inf = NaN``. The exponentially scaled
    ``bessel_i0e(kappa) = exp(-|kappa|) I0(kappa)`` stays in range:
    ``log I0 = log(bessel_i0e(kappa)) + |kappa|`` (``stable=True``).

    Example:
        >>> bool(np.isfinite(log_bessel_i0(tf.constant(100.0), stable=True)))
        True
    """
    kappa = tf.convert_to_tensor(kappa, tf.float32)
    if stable:
        return tf.math.log(tf.math.bessel_i0e(kappa)) + tf.abs(kappa)
    return tf.math.log(tf.math.bessel_i0(kappa))


def log_beta(a, b, stable: bool = False) -> tf.Tensor:
    """``log B(a, b)``: from Gamma functions (``inf / inf`` for a and b near 40), or ``tf.math.lbeta``.

    ``Gamma(40) = 2.0e46`` is beyond float32's ``3.4e38``: ``Gamma(a) Gamma(b) / Gamma(a + b)``
    is ``inf / inf = NaN``; ``lbeta`` sums ``lgamma`` values, which stay small.

    Example:
        >>> bool(np.isnan(log_beta(40.0, 40.0)))
        True
    """
    a, b = tf.convert_to_tensor(a, tf.float32), tf.convert_to_tensor(b, tf.float32)
    if stable:
        return tf.math.lbeta(tf.stack([a, b], axis=-1))
    gamma = lambda z: tf.exp(tf.math.lgamma(z))  # noqa: E731
    return tf.math.log(gamma(a) * gamma(b) / gamma(a + b))


# --------------------------------------------------------------------------------------
# Cholesky in float32
# --------------------------------------------------------------------------------------


def rbf_kernel(n: int = 40, lengthscale: float = 0.5, dtype=tf.float32) -> tf.Tensor:
    """The squared-exponential kernel matrix of ``n`` points evenly spaced on [0, 1].

    It is positive definite, but its eigenvalues fall off so fast (below ``1e-15`` of the
    largest for 40 points) that rounding to float32 makes it indefinite.

    Example:
        >>> rbf_kernel(3).shape
        TensorShape([3, 3])
    """
    x = tf.cast(tf.linspace(0.0, 1.0, n), dtype)[:, None]
    return tf.exp(-0.5 * tf.square(x - tf.transpose(x)) / lengthscale**2)


def cholesky(matrix, jitter: float = 0.0) -> tf.Tensor:
    """``tf.linalg.cholesky(matrix + jitter * mean(diag) * I)``.

    On a matrix that is not positive definite in its dtype, TensorFlow's Cholesky
    returns ``NaN`` (it does not raise). A jitter much larger than the rounding error of
    the largest eigenvalue (``n * eps * lambda_max``) makes it positive definite again, at
    the price of changing the matrix by that much.

    Example:
        >>> bool(np.isfinite(cholesky(rbf_kernel(), jitter=1e-4)).all())
        True
    """
    matrix = tf.convert_to_tensor(matrix)
    n = matrix.shape[-1]
    scale = jitter * tf.reduce_mean(tf.linalg.diag_part(matrix))
    return tf.linalg.cholesky(matrix + scale * tf.eye(n, dtype=matrix.dtype))


# --------------------------------------------------------------------------------------
# Samplers at the end of their interval
# --------------------------------------------------------------------------------------


def beta_draws(n: int = 1000, concentration: float = 0.1, seed: int = 0) -> dict[str, tf.Tensor]:
    """Beta(c, c) draws made as ``g1 / (g1 + g2)`` from two Gamma(c) draws, and their logs.

    For a small concentration most Gamma draws are tiny, and in float32 ``g1 / (g1 + g2)``
    rounds to exactly 1 (or 0) for many of them: ``log(1 - x)`` is then ``-inf``. The logs
    taken from the Gamma draws themselves, ``log(g2) - log(g1 + g2)``, are finite
    (TensorFlow's Gamma sampler returns at least the smallest normal number).

    Returns:
        A dict with ``"x"`` (the draws), ``"log1m_naive"`` (``log(1 - x)``) and
        ``"log1m_safe"`` (``log(g2) - log(g1 + g2)``).

    Example:
        >>> draws = beta_draws(100)
        >>> bool(np.isfinite(draws["log1m_safe"]).all())
        True
    """
    g = tf.random.stateless_gamma([2, n], seed=[seed, 1], alpha=concentration)
    x = g[0] / (g[0] + g[1])
    return {
        "x": x,
        "log1m_naive": tf.math.log(1.0 - x),
        "log1m_safe": tf.math.log(g[1]) - tf.math.log(g[0] + g[1]),
    }


# --------------------------------------------------------------------------------------
# A NaN written by the optimizer's update
# --------------------------------------------------------------------------------------


def half_precision_regression(optimizer=None, dtype: str = "float16", seed: int = 0):
    """A linear regression whose ``Dense(1)`` has ``dtype`` weights, trained by Adam.

    Feature 3 of the inputs is 0 in every example, so the kernel's row 3 gets a gradient of
    exactly 0 and Adam's first and second moments of it stay 0. Adam's step is
    ``m / (sqrt(v) + epsilon)``, computed in the variable's dtype: ``epsilon=1e-8`` (the
    default of PyTorch's and Optax's Adam; Keras' is ``1e-7``) is below half of ``float16``'s
    smallest subnormal ``2**-24`` and rounds to 0, so that entry's step is ``0 / 0 = NaN``
    while the loss and the gradients are finite. An epsilon ``float16`` holds (``1e-4``), or
    ``dtype="mixed_float16"`` (the variables in ``float32``, the computation in
    ``float16``), keeps the update finite.

    Args:
        optimizer: the optimizer to compile with; by default Adam with a learning rate of
            ``1e-3`` and ``epsilon=1e-8``, made on the line that compiles the model.
        dtype: the ``Dense`` layer's dtype policy (``"float16"``, ``"mixed_float16"``, ...).
        seed: seeds the data and the initial weights.

    Returns:
        ``(model, x, y)``: the compiled model (named ``half``, its layer ``head``), 32 examples
        of 4 features and their targets. :func:`update_steps` trains it.

    Example:
        >>> model, x, y = half_precision_regression(keras.optimizers.Adam(1e-3, epsilon=1e-4))
        >>> all(step["weights finite"] for step in update_steps(model, x, y, steps=2))
        True
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(32, 4)).astype("float32")
    x[:, 3] = 0.0  # a feature that is always 0: a zero gradient, zero moments
    y = x @ np.array([[1.0], [-2.0], [0.5], [0.0]], "float32")
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, dtype=dtype, name="head")],
                             name="half")
    model.compile(optimizer or keras.optimizers.Adam(1e-3, epsilon=1e-8), "mse")
    return model, x, y


def half_precision_diagnosis(**kwargs):
    """The NaN doctor on the first batch of :func:`half_precision_regression` (its ``kwargs``).

    The doctor names the line that made the optimizer by searching the files of the code
    that calls it; called from here, that is this module's line that compiles the model.

    Returns:
        The :class:`~companion.diagnostics.Diagnosis`, or None when the step is finite.

    Example:
        >>> d = half_precision_diagnosis()
        >>> d.cause, d.phase, d.variables[0]
        ('nonfinite_update', 'update', 'half/head/kernel')
    """
    from companion.diagnostics import diagnose

    model, x, y = half_precision_regression(**kwargs)
    return diagnose(model, (x, y))


def update_steps(model, x, y, steps: int = 2) -> list[dict[str, Any]]:
    """Full-batch steps of ``model``'s compiled optimizer on the mean squared error.

    Returns:
        A list with a dict for each step, of ``"loss"`` (before its update, a float),
        ``"gradients finite"`` and ``"weights finite"`` (after its update).

    Example:
        >>> model, x, y = half_precision_regression()
        >>> step = update_steps(model, x, y, steps=1)[0]
        >>> step["gradients finite"], step["weights finite"]
        (True, False)
    """
    records = []
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(model(x), tf.float32) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply(grads, model.trainable_variables)
        records.append({
            "loss": float(loss),
            "gradients finite": all(bool(np.isfinite(g.numpy()).all()) for g in grads),
            "weights finite": all(bool(np.isfinite(v.numpy()).all())
                                  for v in model.trainable_variables),
        })
    return records
