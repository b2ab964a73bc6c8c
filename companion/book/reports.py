"""NaN failures that people reported publicly, rebuilt small enough to run in seconds.

The chapter *Finding your own NaN* (``book/closing/finding_your_own_nan.ipynb``) runs
the NaN doctor (:func:`companion.diagnostics.diagnose`) on each of these, and
``tests/unit/test_finding_your_own_nan.py`` asserts what it finds. Each rebuild keeps what the
report describes (the layers, the loss, the data that triggers it, the way the reporter
trained: ``model.fit``, an eager loop, a ``tf.function`` loop, XLA) and drops the rest;
sizes and data are made up, and made deterministic. ``rebuild(key, fixed=True)`` applies
the fix the thread arrived at (or the book's, where the thread did not).

:data:`REPORTS` lists them: ``key -> ReportInfo(title, url, mode, cause)``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from companion.numerics import double_where

__all__ = ["REPORTS", "CustomStep", "Rebuild", "ReportInfo", "rebuild", "reporter_step", "run_as_reported"]


@dataclasses.dataclass(frozen=True)
class ReportInfo:
    """A public report the chapter rebuilds.

    Attributes:
        title: what the reporter saw, in a few words.
        url: the report.
        mode: how the reporter trained: ``"fit"``, ``"fit, XLA"`` (``jit_compile=True``),
            ``"eager loop"`` or ``"tf.function loop"``.
        cause: the cause the doctor names (a key of
            ``companion.diagnostics.CAUSES``).
    """

    title: str
    url: str
    mode: str
    cause: str


@dataclasses.dataclass(frozen=True)
class Rebuild:
    """A rebuilt failure: the model, the data and the loss, ready to train or diagnose.

    Attributes:
        key: its key in :data:`REPORTS`.
        model: the Keras model (compiled for the ``fit`` modes).
        data: what ``fit`` takes: a ``tf.data.Dataset`` or an ``(x, y)`` tuple.
        loss: the loss function, for the loop modes (None for the compiled ones).
        optimizer: the optimizer, for the loop modes (None for the compiled ones).
        epochs: how many epochs the reporter's run needs to show the failure.
    """

    key: str
    model: keras.Model
    data: Any
    loss: Callable | None
    optimizer: keras.optimizers.Optimizer | None
    epochs: int


#: The rebuilt reports by key, in the order the chapter shows them.
REPORTS: dict[str, ReportInfo] = {
    "angular_distance": ReportInfo(
        "BinaryCrossentropy NaN for an angular distance",
        "https://whosebug.com/question/4715380/Keras-BinaryCrossentropy-loss-gives-NaN-for-angular-distance-between-two-vectors",
        "fit",
        "singular_derivative",
    ),
    "triplet_loss": ReportInfo(
        "triplet loss NaN when the positive equals the anchor",
        "https://github.com/tensorflow/tensorflow/issues/30199",
        "eager loop",
        "singular_derivative",
    ),
    "complex_angle": ReportInfo(
        "tf.math.angle loss: NaN gradients on a zero sample",
        "https://github.com/tensorflow/tensorflow/issues/50854",
        "tf.function loop",
        "singular_derivative",
    ),
    "where_activation": ReportInfo(
        "tf.where activation: NaN gradient at x = 1",
        "https://github.com/tensorflow/tensorflow/issues/20355",
        "tf.function loop",
        "where_trap",
    ),
    "std_of_zero_vector": ReportInfo(
        "K.std of a zero activation vector",
        "https://github.com/keras-team/keras/issues/2960",
        "fit",
        "singular_derivative",
    ),
    "probabilities_crossentropy": ReportInfo(
        "y * log(softmax) goes NaN during training",
        "https://github.com/aymericdamien/TensorFlow-Examples/issues/383",
        "fit, XLA",
        "log_of_zero",
    ),
    "learning_rate": ReportInfo(
        "loss grows to a trillion, then NaN",
        "https://datascience.stackexchange.com/questions/15962/why-is-learning-rate-causing-my-neural-networks-weights-to-skyrocket",
        "fit",
        "divergence",
    ),
    "multi_output_kl": ReportInfo(
        "two-output model: the KL loss takes log of negative features",
        "https://github.com/vicwer/C3AE_Age_Estimation/issues/10",
        "fit",
        "domain_edge",
    ),
    "std_batch_of_one": ReportInfo(
        "reduce_std over a batch of one example",
        "https://github.com/tensorflow/tensorflow/issues/56830",
        "fit",
        "singular_derivative",
    ),
    "nan_in_data": ReportInfo(
        "every loss NaN: missing values in the dataset",
        "https://github.com/circleAhn/TESLA-tf/issues/1",
        "fit",
        "nonfinite_input",
    ),
}


# --- the models ---------------------------------------------------------------------------


def _open_interval(c):
    bound = 1.0 - float(np.finfo(np.float32).eps)
    return tf.clip_by_value(c, -bound, bound)


def _angular_distance(fixed: bool):
    # Two strings through one shared encoder; the angular distance of their codes. With
    # identical inputs the cosine is exactly 1 and acos'(1) = -inf.
    left, right = keras.Input((3,), name="left"), keras.Input((3,), name="right")
    encoder = keras.layers.Dense(4, kernel_initializer="ones", name="encoder")
    cosine = keras.layers.Dot(axes=1, normalize=True, name="cosine")([encoder(left), encoder(right)])
    clip = _open_interval if fixed else tf.identity
    distance = keras.layers.Lambda(lambda c: tf.math.acos(clip(c)) / math.pi, name="angular_distance")(cosine)
    model = keras.Model([left, right], distance, name="siamese")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="binary_crossentropy", jit_compile=False)
    x = np.eye(3, dtype=np.float32)
    same = np.zeros((3, 1), np.float32)  # label 0: distance 0 for identical strings
    # two epochs: a finite loss with NaN gradients shows as a NaN loss one step later
    return Rebuild("angular_distance", model, ((x, x.copy()), same), None, None, 2)


def _triplet_loss(fixed: bool):
    anchor, positive, negative = (keras.Input((4,), name=n) for n in ("anchor", "positive", "negative"))
    encoder = keras.layers.Dense(3, name="encoder")
    codes = keras.layers.Concatenate(name="codes")([encoder(anchor), encoder(positive), encoder(negative)])
    model = keras.Model([anchor, positive, negative], codes, name="triplet")

    def distance(u, v):
        squared = tf.reduce_sum(tf.square(u - v), axis=1)
        return double_where(squared > 0, tf.sqrt, squared, 0.0) if fixed else tf.norm(u - v, axis=1)

    def triplet_loss(y_true, y_pred):
        a, p, n = tf.split(y_pred, 3, axis=1)
        return tf.reduce_mean(tf.maximum(distance(a, p) - distance(a, n) + 1.0, 0.0))

    rng = np.random.default_rng(0)
    a = rng.normal(size=(8, 4)).astype(np.float32)
    p = a + 0.1 * rng.normal(size=(8, 4)).astype(np.float32)
    p[0] = a[0]  # a generated positive identical to its anchor
    n = a + 0.3 * rng.normal(size=(8, 4)).astype(np.float32)  # hard negatives: every hinge active
    return Rebuild("triplet_loss", model, ((a, p, n), np.zeros((8, 1), np.float32)), triplet_loss,
                   keras.optimizers.SGD(0.01), 1)


def _angle(z, fixed: bool):
    if not fixed:
        return tf.math.angle(z)
    nonzero = tf.abs(z) > 0
    safe = tf.where(nonzero, z, tf.ones_like(z))
    return tf.where(nonzero, tf.math.angle(safe), tf.zeros_like(tf.math.real(z)))


def _complex_angle(fixed: bool):
    x = keras.Input((2,))
    out = keras.layers.Dense(1, use_bias=False, name="dense")(x)
    model = keras.Model(x, out, name="phase_net")

    def angle_loss(y_true, y_pred):
        zero = tf.zeros_like(y_pred)
        difference = _angle(tf.complex(y_true, zero), fixed) - _angle(tf.complex(y_pred, zero), fixed)
        return tf.reduce_mean(tf.square(difference))

    x = np.array([[0.0, 0.0], [1.0, 2.0]], np.float32)  # a single "zero" sample, and one more
    y = np.array([[1.0], [-1.0]], np.float32)
    return Rebuild("complex_angle", model, (x, y), angle_loss, keras.optimizers.SGD(0.01), 1)


def _transfer(z, fixed: bool):
    negative = z < 0
    if not fixed:
        return tf.where(negative, 1.0 / (1.0 - z), tf.math.log(z + 1.0))
    z_negative = tf.where(negative, z, 0.0)
    z_other = tf.where(negative, 0.0, z)
    return tf.where(negative, 1.0 / (1.0 - z_negative), tf.math.log(z_other + 1.0))


def _where_activation(fixed: bool):
    x = keras.Input((1,))
    z = keras.layers.Dense(1, kernel_initializer="ones", name="dense")(x)
    out = keras.layers.Lambda(lambda t: _transfer(t, fixed), name="transfer")(z)
    model = keras.Model(x, out, name="transfer_net")
    x = np.array([[1.0], [0.5], [-2.0]], np.float32)
    y = np.array([[0.5], [0.4], [0.3]], np.float32)
    return Rebuild("where_activation", model, (x, y), keras.losses.MeanSquaredError(), keras.optimizers.SGD(0.1), 1)


def _std(h, fixed: bool):
    if fixed:  # what the report proposes: sqrt(var + eps) instead of std
        return tf.sqrt(keras.ops.var(h, axis=-1, keepdims=True) + 1e-6)
    return keras.ops.std(h, axis=-1, keepdims=True)


def _std_of_zero_vector(fixed: bool):
    x = keras.Input((4,))
    h = keras.layers.Dense(8, activation="relu", name="hidden")(x)
    # statistics pooling: the mean and the std of the activations, as two features
    h = keras.layers.Lambda(
        lambda t: keras.ops.concatenate([keras.ops.mean(t, axis=-1, keepdims=True), _std(t, fixed)], axis=-1),
        name="stats_pool",
    )(h)
    out = keras.layers.Dense(1, name="out")(h)
    model = keras.Model(x, out, name="normed")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    x[5] = 0.0  # an example whose activations are all 0 (relu of 0 with zero biases)
    return Rebuild("std_of_zero_vector", model, (x, rng.normal(size=(16, 1)).astype(np.float32)), None, None, 2)


def _probabilities_crossentropy(fixed: bool):
    x = keras.Input((2,))
    out = keras.layers.Dense(3, activation=None if fixed else "softmax", name="classifier")(x)
    model = keras.Model(x, out, name="classifier_net")

    def cross_entropy(y_true, y_pred):  # the tutorial's -sum(y * log(pred))
        return tf.reduce_mean(-tf.reduce_sum(y_true * tf.math.log(y_pred), axis=1))

    loss = keras.losses.CategoricalCrossentropy(from_logits=True) if fixed else cross_entropy
    from companion.book.debugging import xla_allowed  # noqa: PLC0415 - debugging imports this module

    with xla_allowed():  # Keras drops jit_compile=True under op determinism, which setup() enables
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss, jit_compile=True)
    rng = np.random.default_rng(0)
    x = (300.0 * rng.normal(size=(32, 2))).astype(np.float32)  # unscaled features
    y = keras.utils.to_categorical(rng.integers(0, 3, size=32), 3).astype(np.float32)
    return Rebuild("probabilities_crossentropy", model, (x, y), None, None, 1)


def _learning_rate(fixed: bool):
    rng = np.random.default_rng(0)
    x = (3.0 * rng.normal(size=(64, 4))).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, kernel_initializer="zeros", name="dense")],
                             name="regression")
    model.compile(optimizer=keras.optimizers.SGD(0.05 if fixed else 0.15), loss="mse", jit_compile=False)
    # one full batch a step, 60 steps in one epoch
    return Rebuild("learning_rate", model, tf.data.Dataset.from_tensors((x, y)).repeat(60), None, None, 1)


def _multi_output_kl(fixed: bool):
    x = keras.Input((4,))
    trunk = keras.layers.Dense(8, activation="relu", name="trunk")(x)
    age = keras.layers.Dense(1, name="age")(trunk)
    feats = keras.layers.Dense(3, activation="softmax" if fixed else None, name="feats")(trunk)
    model = keras.Model(x, {"age": age, "feats": feats}, name="c3ae")

    def kl_loss(y_true, y_pred):
        return tf.reduce_sum(y_true * tf.math.log(y_true / y_pred), axis=-1)

    model.compile(optimizer=keras.optimizers.SGD(0.01), loss={"age": "mae", "feats": kl_loss}, jit_compile=False)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    targets = {"age": rng.uniform(10, 60, size=(16, 1)).astype(np.float32),
               "feats": np.full((16, 3), 1 / 3, np.float32)}
    return Rebuild("multi_output_kl", model, (x, targets), None, None, 1)


def _batch_std(t, fixed: bool):
    if fixed:
        return tf.sqrt(tf.math.reduce_variance(t, axis=0) + 1e-6)
    return tf.math.reduce_std(t, axis=0)


def _std_batch_of_one(fixed: bool):
    x = keras.Input((3,))
    h = keras.layers.Dense(4, name="dense")(x)
    h = keras.layers.Lambda(lambda t: t / (_batch_std(t, fixed) + 1e-3), name="batch_scale")(h)
    out = keras.layers.Dense(1, name="out")(h)
    model = keras.Model(x, out, name="batch_scaled")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
    rng = np.random.default_rng(0)
    data = tf.data.Dataset.from_tensor_slices(
        (rng.normal(size=(33, 3)).astype(np.float32), rng.normal(size=(33, 1)).astype(np.float32))
    ).batch(32)  # 33 examples: the second batch has one
    return Rebuild("std_batch_of_one", model, data, None, None, 2)


def _nan_in_data(fixed: bool):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 3)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)
    x[70, 1] = np.nan  # a missing value in the third batch of 32
    if fixed:
        keep = np.isfinite(x).all(axis=1)
        x, y = x[keep], y[keep]
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="dense")], name="sensor_net")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
    return Rebuild("nan_in_data", model, (x, y), None, None, 1)


_BUILDERS = {
    "angular_distance": _angular_distance,
    "triplet_loss": _triplet_loss,
    "complex_angle": _complex_angle,
    "where_activation": _where_activation,
    "std_of_zero_vector": _std_of_zero_vector,
    "probabilities_crossentropy": _probabilities_crossentropy,
    "learning_rate": _learning_rate,
    "multi_output_kl": _multi_output_kl,
    "std_batch_of_one": _std_batch_of_one,
    "nan_in_data": _nan_in_data,
}


def rebuild(key: str, fixed: bool = False, seed: int = 0) -> Rebuild:
    """Build the model, data and loss of a report in :data:`REPORTS`.

    Args:
        key: a key of :data:`REPORTS`.
        fixed: apply the fix (the thread's, or the book's where the thread has none).
        seed: the seed for the model's initial weights.

    Returns:
        A :class:`Rebuild`.

    Raises:
        KeyError: if ``key`` is not in :data:`REPORTS`.

    Example:
        >>> r = rebuild("where_activation")
        >>> r.model.name, REPORTS[r.key].mode
        ('transfer_net', 'tf.function loop')
    """
    if key not in _BUILDERS:
        raise KeyError(f"unknown report {key!r}; expected one of {sorted(REPORTS)}")
    keras.utils.set_random_seed(seed)
    return _BUILDERS[key](fixed)


def reporter_step(r: Rebuild) -> Callable:
    """The training step of a loop-mode rebuild, as its reporter's loop calls it.

    ``step(x, y)`` computes ``r.loss`` on ``r.model(x)`` under a ``tf.GradientTape``,
    applies the gradients with ``r.optimizer`` and returns the loss; for the
    ``"tf.function loop"`` mode it is wrapped in ``tf.function``. Hand it to
    :func:`companion.diagnostics.diagnose_function` with a batch to diagnose the
    reporter's own step.

    Args:
        r: a :class:`Rebuild` of a loop mode (``r.loss`` and ``r.optimizer`` set).

    Returns:
        The step function.

    Raises:
        ValueError: if ``r`` is trained with ``fit``.

    Example:
        >>> r = rebuild("where_activation")
        >>> step = reporter_step(r)
        >>> bool(np.isfinite(float(step(*r.data))))
        True
    """
    if r.loss is None or r.optimizer is None:
        raise ValueError(f"{r.key!r} is trained with fit, not a loop of its own: use NaNDoctor or diagnose")
    variables = r.model.trainable_variables

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = r.loss(y, r.model(x))
        r.optimizer.apply(tape.gradient(loss, variables), variables)
        return loss

    return tf.function(step) if REPORTS[r.key].mode == "tf.function loop" else step


def run_as_reported(r: Rebuild, callbacks=()) -> dict[str, Any]:
    """Train a rebuild the way its reporter did, for ``r.epochs`` epochs.

    ``fit`` modes call ``model.fit`` (full batches for arrays, as the reports did where
    they said, else batches of 32); the loop modes run ``r.optimizer`` on ``r.loss`` one
    batch a step, eagerly or inside one ``tf.function``.

    Args:
        r: a :class:`Rebuild`.
        callbacks: Keras callbacks for the ``fit`` modes (e.g. a
            :class:`~companion.diagnostics.NaNDoctor`).

    Returns:
        A dict with ``"losses"`` (the loss of each epoch, floats) and
        ``"weights_finite"`` (whether every weight is finite afterwards).

    Example:
        >>> run = run_as_reported(rebuild("where_activation"))
        >>> run["weights_finite"]
        False
    """
    mode = REPORTS[r.key].mode
    if mode.startswith("fit"):
        if isinstance(r.data, tf.data.Dataset):
            history = r.model.fit(r.data, epochs=r.epochs, verbose=0, callbacks=list(callbacks))
        else:
            x, y = r.data
            history = r.model.fit(
                x, y, batch_size=32, epochs=r.epochs, verbose=0, shuffle=False, callbacks=list(callbacks)
            )
        losses = [float(v) for v in history.history["loss"]]
    else:
        x, y = r.data
        step = reporter_step(r)
        losses = [float(step(x, y)) for _ in range(r.epochs)]
    weights_finite = all(bool(np.isfinite(v.numpy()).all()) for v in r.model.weights)
    return {"losses": losses, "weights_finite": weights_finite}


class CustomStep(keras.Model):
    """A model with its own ``train_step`` and its own optimizer (issue 27's example).

    Its loss is ``mean(sqrt((p - y)**2))``: the derivative ``(p - y) / |p - y|`` is
    ``0 / 0`` wherever a prediction equals its target, so the loss stays finite and the
    step writes ``NaN`` into the kernel. ``fixed=True`` uses ``mean(|p - y|)`` instead,
    whose subgradient at 0 is 0. The update goes through ``self.d_opt``, not
    ``model.optimizer`` (as keras.io's GANs do with ``d_optimizer``/``g_optimizer``).

    Args:
        fixed: use ``|p - y|`` (default ``False``).

    Example:
        >>> model = CustomStep()
        >>> model.compile(optimizer="sgd")
        >>> x, y = np.zeros((4, 2), "float32"), np.zeros((4, 1), "float32")
        >>> _ = model.fit(x, y, verbose=0)
        >>> bool(np.isnan(model.dense.kernel.numpy()).any())
        True
    """

    def __init__(self, fixed: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fixed = bool(fixed)
        self.dense = keras.layers.Dense(1, use_bias=False)
        self.d_opt = keras.optimizers.SGD(0.1)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            if self.fixed:
                loss = tf.reduce_mean(tf.abs(self(x) - y))
            else:
                loss = tf.reduce_mean(tf.sqrt(tf.square(self(x) - y)))
        grads = tape.gradient(loss, self.trainable_variables)
        self.d_opt.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "fixed": self.fixed}
