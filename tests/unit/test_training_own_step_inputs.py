"""``train`` trains a model whose own ``train_step`` calls sub-models and whose ``call()`` takes
other inputs than the data, as ``fit`` does (issue 42, item 5).

``fit`` (without a distribution strategy) calls no model before the first ``train_step``: the
step builds what it uses. ``train`` used to build the model by calling it on the data (the
symbolic build of the compiled state), which built a generator's layers for the images' shape.
Each test trains the same model from the same seed with ``fit`` and with ``train`` on the same
batches (``shuffle=False``) and compares the weights.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from companion.training import train


class WGAN(keras.Model):
    """keras-team/keras-io#15: a WGAN fitted on the image arrays; ``call(latent)`` is the generator."""

    def __init__(self, latent=3, features=6):
        super().__init__()
        self.latent = latent
        self.generator = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(features)])
        self.critic = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    def call(self, latent):
        return self.generator(latent)

    def train_step(self, real):
        if isinstance(real, tuple):
            real = real[0]
        z = tf.random.stateless_normal((tf.shape(real)[0], self.latent), seed=[1, 2])
        with tf.GradientTape() as tape:
            d_loss = tf.reduce_mean(self.critic(self(z))) - tf.reduce_mean(self.critic(real))
        grads = tape.gradient(d_loss, self.critic.trainable_variables)
        self.d_optimizer.apply_gradients(zip(grads, self.critic.trainable_variables))
        with tf.GradientTape() as tape:
            g_loss = -tf.reduce_mean(self.critic(self(z)))
        grads = tape.gradient(g_loss, self.generator.trainable_variables)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_variables))
        return {"d_loss": d_loss, "g_loss": g_loss}


class Denoiser(keras.Model):
    """keras-team/keras-core#318: an own ``train_step`` on images; ``call((noisy, t))`` takes two inputs."""

    def __init__(self):
        super().__init__()
        self.net = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(4)])

    def call(self, inputs):
        noisy, t = inputs
        return self.net(tf.concat([noisy, t], axis=-1))

    def train_step(self, images):
        if isinstance(images, tuple):
            images = images[0]
        t = tf.random.stateless_uniform((tf.shape(images)[0], 1), seed=[3, 4])
        noise = tf.random.stateless_normal(tf.shape(images), seed=[5, 6])
        with tf.GradientTape() as tape:
            predicted = self((images + t * noise, t), training=True)
            loss = tf.reduce_mean(tf.square(predicted - noise))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def _wgan():
    keras.utils.set_random_seed(0)
    model = WGAN()
    model.compile(keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3))
    return model, np.random.default_rng(0).normal(size=(64, 6)).astype("float32")


def _denoiser():
    keras.utils.set_random_seed(1)
    model = Denoiser()
    model.compile(optimizer=keras.optimizers.Adam(1e-3))
    return model, np.random.default_rng(1).normal(size=(64, 4)).astype("float32")


REPORTS = {"keras-team/keras-io#15": _wgan, "keras-team/keras-core#318": _denoiser}


def _weights(model):
    return [np.asarray(v.numpy()) for v in model.trainable_variables]


@pytest.mark.parametrize("report", sorted(REPORTS))
def test_train_trains_an_own_step_model_whose_call_takes_other_inputs_as_fit_does(report):
    model, x = REPORTS[report]()
    expected = model.fit(x, batch_size=16, epochs=2, shuffle=False, verbose=0)
    fitted = _weights(model)
    model, x = REPORTS[report]()
    history = train(model, x, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert history.skipped == []
    trained = _weights(model)
    assert len(trained) == len(fitted) and all(a.shape == b.shape for a, b in zip(trained, fitted))
    assert all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(trained, fitted))
    for key, values in expected.history.items():
        assert np.allclose(history.history[key], values, rtol=1e-5), key


def test_train_trains_it_on_a_dataset_as_fit_does():
    model, x = _wgan()
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(16)
    expected = model.fit(dataset, epochs=1, verbose=0)
    fitted = _weights(model)
    model, _ = _wgan()
    history = train(model, dataset, epochs=1, verbose=0)
    assert all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(_weights(model), fitted))
    assert np.allclose(history.history["d_loss"], expected.history["d_loss"], rtol=1e-5)


def test_only_an_unbuilt_model_with_its_own_step_is_left_to_its_first_step():
    from companion.training.inputs import built_by_its_first_step

    model, x = _wgan()
    assert built_by_its_first_step(model)
    model.fit(x, batch_size=16, epochs=1, verbose=0)
    assert not built_by_its_first_step(model)  # built by that step
    assert not built_by_its_first_step(keras.Sequential([keras.layers.Dense(1)]))  # Keras' own train_step
