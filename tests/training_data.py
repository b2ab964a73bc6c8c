"""Data, models and assertions shared by the tests of companion.training, companion.optimizers
and companion.diagnostics (imported by those test modules, not collected itself).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

FEATURES = 3
BATCH = 8
N_BATCHES = 8
_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(BATCH * N_BATCHES, FEATURES)).astype("float32")
Y = X @ np.array([[1.0], [2.0], [-1.0]], "float32")


def make_dataset(poisoned=(), n_batches=N_BATCHES):
    """Batches of (x, y); in each poisoned batch one input row is NaN."""
    x = X[: n_batches * BATCH].copy()
    for batch in poisoned:
        x[batch * BATCH + 3, 0] = np.nan
    return tf.data.Dataset.from_tensor_slices((x, Y[: n_batches * BATCH])).batch(BATCH)


def make_model(batch_norm: bool = False, seed: int = 0, width: int = 8) -> keras.Model:
    """A small MLP (``width`` hidden units) on FEATURES inputs, optionally with batch normalisation."""
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((FEATURES,)), keras.layers.Dense(width, activation="tanh")]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization())
    layers.append(keras.layers.Dense(1))
    return keras.Sequential(layers)


def state_of(model, optimizer) -> list[np.ndarray]:
    """Every model variable (batch-norm statistics included) and every optimizer variable."""
    return [np.array(v.numpy()) for v in model.variables] + [np.array(v.numpy()) for v in optimizer.variables]


def assert_bit_identical(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for left, right in zip(a, b):
        assert left.dtype == right.dtype and left.shape == right.shape
        assert left.tobytes() == right.tobytes()


class SqrtOfProduct(keras.layers.Layer):
    """y = sqrt(w * x): finite at x = 0, but d y / d w = x / (2 sqrt(w x)) = 0 * inf = NaN there."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(), initializer=keras.initializers.Constant(0.5), name="w")

    def call(self, x):
        return tf.sqrt(self.w * x)
