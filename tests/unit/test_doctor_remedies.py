"""Rebuilt public NaN reports whose first remedy, applied as printed, cures the failing step (issue 27).

Each case rebuilds, for Keras 3 and on small synthetic data of the right shapes, a NaN
that someone reported publicly (the URL is in the case): models with their own
``train_step`` (keras.io's WGAN-GP, VAE, GAN, siamese and contrastive models, Keras'
*customizing fit* guide), mixed precision (``mixed_float16`` layers, a
``LossScaleOptimizer``) and runs that diverge over steps (too large a learning rate).
The test runs the case the way its reporter did (``fit`` with a :class:`NaNDoctor`, or
:func:`diagnose`), asserts the op, the line (the one marked ``# <- case`` in this
file), the cause, and then applies the first remedy the doctor prints, as printed
(the case's ``fixed`` build does what the remedy's text says, and the test checks
that the text says it), and runs the failing step again: it is finite.

The cases of ``test_doctor_reports.py`` are checked the same way at the end of this
file (their first remedy, applied, makes their step finite).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

import keras
import numpy as np
import pytest
import tensorflow as tf

import test_doctor_reports as reports  # the cases of the other file, and their runner
from companion.diagnostics import CAUSES, NaNDoctor, diagnose
from companion.numerics import safe_pow, signed_pow
from keras_io_models import GuideModel

HERE = inspect.getsourcefile(lambda: None)
with open(HERE) as _source:
    _LINES = _source.read().splitlines()

EPS = float(np.finfo(np.float32).eps)


def marked(case_id: str) -> int:
    """The line of this file that carries the marker of ``case_id``."""
    (found,) = [i + 1 for i, line in enumerate(_LINES) if line.rstrip().endswith(f"# <- {case_id}")]
    return found


@dataclasses.dataclass
class Case:
    id: str
    url: str
    kinds: tuple[str, ...]  # "custom" (own train_step), "mixed", "diverge", "library" (an op it cannot edit)
    build: Callable  # (fixed: bool) -> (model, x, y, fit kwargs)
    cause: str
    op: str | None
    remedy: str  # what the remedy must say (what ``build(fixed=True)`` applies)
    run: str = "fit"  # "fit" (with a NaNDoctor) or "diagnose"
    line: bool = True


@pytest.fixture(autouse=True)
def float32_policy():
    yield
    keras.mixed_precision.set_global_policy("float32")


def log(x, fixed):
    return tf.math.log(tf.maximum(x, EPS)) if fixed else tf.math.log(x)


def seeded():
    keras.utils.set_random_seed(0)


# --------------------------------------------------------------------------------------
# Models with their own train_step
# --------------------------------------------------------------------------------------


class WGANGP(keras.Model):
    """keras.io examples/generative/wgan_gp.py, shrunk: the gradient penalty's norm at 0."""

    def __init__(self, critic, generator, latent_dim, fixed=False):
        super().__init__()
        self.critic, self.generator, self.latent_dim, self.fixed = critic, generator, latent_dim, fixed
        self.seed_generator = keras.random.SeedGenerator(7)

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    def gradient_penalty(self, real, fake):
        alpha = keras.random.uniform((tf.shape(real)[0], 1, 1, 1), seed=self.seed_generator)
        interpolated = real + alpha * (fake - real)
        with tf.GradientTape() as gp_tape:
            gp_tape.watch(interpolated)
            pred = self.critic(interpolated, training=True)
        grads = gp_tape.gradient(pred, [interpolated])[0]
        squares = tf.reduce_sum(tf.square(grads), axis=[1, 2, 3])
        norm = tf.sqrt(tf.maximum(squares, EPS) if self.fixed else squares)  # <- wgan_gp_norm
        return tf.reduce_mean((norm - 1.0) ** 2)

    def train_step(self, real):
        batch = tf.shape(real)[0]
        latent = keras.random.normal((batch, self.latent_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            fake = self.generator(latent, training=True)
            d_cost = tf.reduce_mean(self.critic(fake)) - tf.reduce_mean(self.critic(real))
            d_loss = d_cost + 10.0 * self.gradient_penalty(real, fake)
        grads = tape.gradient(d_loss, self.critic.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.critic.trainable_weights))
        with tf.GradientTape() as tape:
            g_loss = -tf.reduce_mean(self.critic(self.generator(latent, training=True)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        return {"d_loss": d_loss, "g_loss": g_loss}


def wgan_gp_norm(fixed=False):
    # A critic whose ReLU is off everywhere (a dead critic): its gradient with respect to
    # the images is 0, and the penalty's sqrt(sum(grads**2)) has an infinite derivative.
    seeded()
    critic = keras.Sequential(
        [keras.Input((4, 4, 1)), keras.layers.Flatten(),
         keras.layers.Dense(4, activation="relu", kernel_initializer="zeros", bias_initializer="zeros"),
         keras.layers.Dense(1)], name="critic")
    generator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(16), keras.layers.Reshape((4, 4, 1))],
                                 name="generator")
    model = WGANGP(critic, generator, latent_dim=2, fixed=fixed)
    model.compile(keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3))
    images = np.random.default_rng(0).uniform(size=(16, 4, 4, 1)).astype("float32")
    return model, images, None, {"batch_size": 8}


class VAE(keras.Model):
    """keras.io examples/generative/vae.py, shrunk: encoder, decoder, KL term with exp(z_log_var)."""

    def __init__(self, encoder, decoder, fixed=False):
        super().__init__()
        self.encoder, self.decoder, self.fixed = encoder, decoder, fixed
        self.seed_generator = keras.random.SeedGenerator(1337)

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var = self.encoder(data)
            if self.fixed:
                variance = tf.exp(tf.minimum(z_log_var, 44.0))
            else:
                variance = tf.exp(z_log_var)  # <- vae_kl_exp
            eps = keras.random.normal(tf.shape(z_mean), seed=self.seed_generator)
            z = z_mean + tf.sqrt(variance) * eps
            reconstruction = self.decoder(z)
            r_loss = tf.reduce_mean(tf.square(data - reconstruction))
            kl = -0.5 * (1 + z_log_var - tf.square(z_mean) - variance)
            total = r_loss + tf.reduce_mean(tf.reduce_sum(kl, axis=1))
        grads = tape.gradient(total, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        return {"loss": total, "kl_loss": tf.reduce_mean(kl)}


def vae_kl_exp(fixed=False):
    # The encoder's log-variance of an unscaled input (pixels in 0..255) is about 150:
    # exp(150) overflows float32 (the KL loss "blows up, then turns into NaN").
    seeded()
    inputs = keras.Input((6,))
    z_mean = keras.layers.Dense(2, name="z_mean")(inputs)
    z_log_var = keras.layers.Dense(2, kernel_initializer="ones", name="z_log_var")(inputs)
    encoder = keras.Model(inputs, [z_mean, z_log_var], name="encoder")
    decoder = keras.Sequential([keras.Input((2,)), keras.layers.Dense(6)], name="decoder")
    model = VAE(encoder, decoder, fixed=fixed)
    model.compile(optimizer=keras.optimizers.Adam(1e-3))
    x = np.full((16, 6), 25.0, "float32")
    return model, x, None, {"batch_size": 8}


class GANLogLoss(keras.Model):
    """A GAN whose losses are written with tf.math.log of the discriminator's probabilities."""

    def __init__(self, discriminator, generator, fixed=False):
        super().__init__()
        self.discriminator, self.generator, self.fixed = discriminator, generator, fixed
        self.seed_generator = keras.random.SeedGenerator(3)

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    def train_step(self, real):
        def floor(p):
            return tf.maximum(p, EPS) if self.fixed else p

        latent = keras.random.normal((tf.shape(real)[0], 2), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            d_real = self.discriminator(real)
            d_fake = self.discriminator(self.generator(latent))
            d_loss = -tf.reduce_mean(log(d_real, self.fixed) + tf.math.log(floor(1.0 - d_fake)))  # <- gan_log_loss
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        with tf.GradientTape() as tape:
            g_loss = -tf.reduce_mean(log(self.discriminator(self.generator(latent)), self.fixed))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        return {"d_loss": d_loss, "g_loss": g_loss}


def gan_log_loss(fixed=False):
    # A saturated discriminator: sigmoid(40) == 1 in float32, so log(1 - D(G(z))) = log(0).
    seeded()
    discriminator = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(1, activation="sigmoid", kernel_initializer="zeros",
                                               bias_initializer=keras.initializers.Constant(40.0))],
        name="discriminator")
    generator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)], name="generator")
    model = GANLogLoss(discriminator, generator, fixed=fixed)
    model.compile(keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3))
    return model, np.ones((16, 3), "float32"), None, {"batch_size": 8}


class TripletModel(keras.Model):
    """keras.io examples/vision/siamese_network.py's SiameseModel, with Euclidean (sqrt) distances."""

    def __init__(self, embedding, fixed=False):
        super().__init__()
        self.embedding, self.fixed = embedding, fixed

    def call(self, inputs):
        anchor, positive, negative = inputs
        return self.embedding(anchor), self.embedding(positive), self.embedding(negative)

    def train_step(self, data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            a, p, n = self(x)
            ap, an = tf.reduce_sum(tf.square(a - p), -1), tf.reduce_sum(tf.square(a - n), -1)
            ap = tf.sqrt(tf.maximum(ap, EPS) if self.fixed else ap)  # <- triplet_sqrt_distance
            an = tf.sqrt(tf.maximum(an, EPS) if self.fixed else an)
            loss = tf.reduce_mean(tf.maximum(ap - an + 0.5, 0.0))
        grads = tape.gradient(loss, self.embedding.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.embedding.trainable_weights))
        return {"loss": loss}


def triplet_sqrt_distance(fixed=False):
    # Two identical images as anchor and positive: the distance is sqrt(0).
    seeded()
    embedding = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)], name="embedding")
    model = TripletModel(embedding, fixed=fixed)
    model.compile(optimizer=keras.optimizers.Adam(1e-3))
    rng = np.random.default_rng(0)
    anchor = rng.normal(size=(16, 5)).astype("float32")
    negative = rng.normal(size=(16, 5)).astype("float32")
    positive = anchor.copy()
    return model, (anchor, positive, negative), None, {"batch_size": 8}  # fit(x=(a, p, n)): one multi-input x


class SupCon(keras.Model):
    """A supervised contrastive model: the mean log-probability over each anchor's positives."""

    def __init__(self, encoder, fixed=False):
        super().__init__()
        self.encoder, self.fixed = encoder, fixed

    def call(self, x):
        return self.encoder(x)

    def train_step(self, data):
        x, labels = data
        with tf.GradientTape() as tape:
            z = tf.math.l2_normalize(self(x), axis=1)
            logits = tf.matmul(z, z, transpose_b=True) / 0.1
            same = tf.cast(tf.equal(labels[:, None], labels[None, :]), tf.float32)
            mask = same - tf.eye(tf.shape(x)[0])
            log_prob = logits - tf.reduce_logsumexp(logits, axis=1, keepdims=True)
            if self.fixed:
                mean_log_prob = tf.math.divide_no_nan(tf.reduce_sum(mask * log_prob, 1), tf.reduce_sum(mask, 1))
            else:
                mean_log_prob = tf.reduce_sum(mask * log_prob, 1) / tf.reduce_sum(mask, 1)  # <- supcon_no_positive
            loss = -tf.reduce_mean(mean_log_prob)
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        return {"loss": loss}


def supcon_no_positive(fixed=False):
    # A batch in which one anchor's class appears only once: mask.sum(1) is 0 for it.
    seeded()
    encoder = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)], name="encoder")
    model = SupCon(encoder, fixed=fixed)
    model.compile(optimizer=keras.optimizers.SGD(0.01))
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    labels = np.array([0, 0, 1, 1, 2, 2, 3, 3, 0, 0, 1, 1, 2, 2, 3, 4], "float32")  # class 4: no positive
    return model, x, labels, {"batch_size": 8}




def guide_poisson_log(fixed=False):
    # The guide's model with a hand-written Poisson loss on a ReLU rate that is 0.
    def poisson(y, p):
        return tf.reduce_mean(p - y * tf.math.log(tf.maximum(p, EPS) if fixed else p), axis=-1)  # <- guide_poisson_log

    seeded()
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(1, activation="relu", kernel_initializer="zeros", name="rate")(inputs)
    model = GuideModel(inputs, outputs)
    model.compile(optimizer="adam", loss=poisson, metrics=["mae"])
    return model, np.ones((16, 3), "float32"), np.ones((16, 1), "float32"), {"batch_size": 8}


# --------------------------------------------------------------------------------------
# Mixed precision
# --------------------------------------------------------------------------------------


class MixedGuideModel(GuideModel):
    """The guide's model under mixed_float16: compute_loss, the LossScaleOptimizer's scale_loss."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)  # <- mixed_dense_overflow
            loss = self.compute_loss(y=y, y_pred=y_pred)
            scaled = self.optimizer.scale_loss(loss)
        gradients = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return {"loss": loss}


def mixed_dense_overflow(fixed=False):
    # A Dense layer under mixed_float16 on unscaled features (about 1e3 each, 64 of them):
    # its float16 matmul exceeds 65504.
    keras.mixed_precision.set_global_policy("mixed_float16")
    seeded()
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(8, kernel_initializer="ones", name="features",
                                dtype="float32" if fixed else None)(inputs)
    outputs = keras.layers.Dense(1, dtype="float32", name="head")(hidden)
    model = MixedGuideModel(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    return model, np.full((8, 64), 1.2e3, "float32"), np.ones((8, 1), "float32"), {"batch_size": 8}


class Standardize(keras.layers.Layer):
    """A hand-written normalisation: (x - mean) / sqrt(E[x**2] - mean**2 + eps)."""

    def call(self, x):
        mean = tf.reduce_mean(x, axis=-1, keepdims=True)
        variance = tf.reduce_mean(tf.square(x), axis=-1, keepdims=True) - tf.square(mean)  # <- mixed_rms_norm
        return (x - mean) / tf.sqrt(variance + 1e-3)


def mixed_rms_norm(fixed=False):
    # A normalisation layer under mixed_float16: the square of activations of about 300
    # exceeds float16's 65504 (BatchNormalization in float16 gives NaN after one batch).
    keras.mixed_precision.set_global_policy("mixed_float16")
    seeded()
    model = keras.Sequential(
        [keras.Input((4,)), Standardize(name="standardize", dtype="float32" if fixed else None),
         keras.layers.Dense(1, dtype="float32", name="head")], name="net")
    model.compile(optimizer="sgd", loss="mse")
    x = (np.random.default_rng(0).normal(size=(8, 4)) * 300.0).astype("float32")
    return model, x, np.ones((8, 1), "float32"), {"batch_size": 8}


class Energy(keras.layers.Layer):
    """The sum of squares of its inputs, rescaled: each term is in float16's range, their sum is not."""

    def call(self, x):
        return tf.reduce_sum(tf.square(x), axis=-1, keepdims=True) / 1e4  # <- mixed_loss_sum


def mixed_loss_sum(fixed=False):
    # Several reasonable losses whose float16 sum is Inf ("each loss is reasonable, the
    # total loss is NaN").
    keras.mixed_precision.set_global_policy("mixed_float16")
    seeded()
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(16, kernel_initializer="identity", name="dense"),
         Energy(name="energy", dtype="float32" if fixed else None),
         keras.layers.Dense(1, dtype="float32", name="head")], name="net")
    model.compile(optimizer="sgd", loss="mse")
    return model, np.full((4, 16), 80.0, "float32"), np.ones((4, 1), "float32"), {"batch_size": 4}


class Attention(keras.layers.Layer):
    """Dot-product attention without the 1/sqrt(d) scale."""

    def call(self, x):
        scores = tf.matmul(x, x, transpose_b=True)  # <- mixed_attention_scores
        return tf.matmul(tf.nn.softmax(scores, axis=-1), x)


def mixed_attention_scores(fixed=False):
    # Unscaled attention logits of large activations overflow float16 (Inf - Inf in softmax).
    keras.mixed_precision.set_global_policy("mixed_float16")
    seeded()
    model = keras.Sequential(
        [keras.Input((3, 8)), Attention(name="attention", dtype="float32" if fixed else None),
         keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1, dtype="float32", name="head")], name="net")
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(4, 3, 8)).astype("float32") * 100.0
    return model, x, np.ones((4, 1), "float32"), {"batch_size": 4}


# --------------------------------------------------------------------------------------
# An op inside a library function the user cannot edit
# --------------------------------------------------------------------------------------


def library_norm(fixed=False):
    # tf.norm of a zero difference: its Sqrt, inside tf.norm, has an infinite derivative.
    def loss(y, p):
        if fixed:
            return tf.reduce_mean(tf.sqrt(tf.maximum(tf.reduce_sum(tf.square(p - y), axis=1), EPS)))
        return tf.reduce_mean(tf.norm(p - y, axis=1))  # <- library_norm

    seeded()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_initializer="zeros", name="embed")],
                             name="net")
    model.compile(loss=loss, optimizer="sgd")
    return model, np.ones((4, 3), "float32"), np.zeros((4, 2), "float32"), {"batch_size": 4}


# --------------------------------------------------------------------------------------
# Runs that diverge over steps
# --------------------------------------------------------------------------------------


def learning_rate(fixed, rate):
    return rate / 10 if fixed else rate


def diverge_unscaled_regression(fixed=False):
    # Linear regression on unscaled features (house sizes in square feet) with SGD(0.01).
    seeded()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="linear")], name="net")
    model.compile(optimizer=keras.optimizers.SGD(learning_rate(fixed, 5e-5)), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.uniform(10.0, 30.0, size=(64, 2)).astype("float32") * 10
    y = (x @ np.array([[0.5], [0.2]], "float32")).astype("float32")
    return model, x, y, {"batch_size": 16, "epochs": 8}


def diverge_lstm(fixed=False):
    # An LSTM regressor on unscaled targets with a large SGD learning rate.
    seeded()
    model = keras.Sequential([keras.Input((5, 1)), keras.layers.LSTM(4, name="lstm"),
                              keras.layers.Dense(1, name="head")], name="net")
    model.compile(optimizer=keras.optimizers.SGD(learning_rate(fixed, 2.0)), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(64, 5, 1)).astype("float32")
    y = (x.sum(axis=1) * 10).astype("float32")
    return model, x, y, {"batch_size": 16, "epochs": 6}


def diverge_simple_rnn(fixed=False):
    # A character-level SimpleRNN regressor with SGD(2.0): the loss grows, then NaN.
    seeded()
    model = keras.Sequential([keras.Input((6, 2)), keras.layers.SimpleRNN(4, name="rnn"),
                              keras.layers.Dense(1, name="head")], name="net")
    model.compile(optimizer=keras.optimizers.SGD(learning_rate(fixed, 2.0)), loss="mse")
    rng = np.random.default_rng(1)
    x = rng.uniform(size=(64, 6, 2)).astype("float32")
    y = (x.sum(axis=(1, 2))[:, None] * 10).astype("float32")
    return model, x, y, {"batch_size": 16, "epochs": 6}


def diverge_guide_model(fixed=False):
    # Keras' guide model (its own train_step) with too large a learning rate.
    seeded()
    inputs = keras.Input((3,))
    model = GuideModel(inputs, keras.layers.Dense(1, name="linear")(inputs))
    model.compile(optimizer=keras.optimizers.SGD(learning_rate(fixed, 0.6)), loss="mse", metrics=["mae"])
    rng = np.random.default_rng(2)
    x = rng.normal(size=(64, 3)).astype("float32") * 3
    y = x.sum(axis=1, keepdims=True).astype("float32")
    return model, x, y, {"batch_size": 16, "epochs": 6}


CASES = [
    Case("wgan_gp_norm", "https://github.com/keras-team/keras-io/issues/910", ("custom",), wgan_gp_norm,
         "singular_derivative", "SqrtGrad", "tf.sqrt(tf.maximum(x, 1.19e-07))"),
    Case("vae_kl_exp", "https://github.com/AppliedDataSciencePartners/WorldModels/issues/9", ("custom",),
         vae_kl_exp, "overflow", "Exp", "tf.exp(tf.minimum(x, 44))"),
    Case("gan_log_loss", "https://github.com/AYLIEN/gan-intro/pull/10", ("custom",), gan_log_loss,
         "log_of_zero", "Log", "tf.math.log(tf.maximum(x, 1.19e-07))"),
    Case("triplet_sqrt_distance", "https://github.com/adambielski/siamese-triplet/issues/18", ("custom",),
         triplet_sqrt_distance, "singular_derivative", "SqrtGrad", "tf.sqrt(tf.maximum(x, 1.19e-07))"),
    Case("supcon_no_positive", "https://github.com/HobbitLong/SupContrast/issues/50", ("custom",),
         supcon_no_positive, "division_by_zero", "RealDiv", "tf.math.divide_no_nan(x, y)"),
    Case("guide_poisson_log", "https://github.com/keras-team/keras/issues/590",
         ("custom",), guide_poisson_log, "log_of_zero", "Log", "tf.math.log(tf.maximum(x, 1.19e-07))"),
    Case("mixed_dense_overflow", "https://github.com/keras-team/keras/issues/16552", ("custom", "mixed"),
         mixed_dense_overflow, "overflow", "MatMul", 'Dense(..., dtype="float32")', run="diagnose"),
    Case("mixed_rms_norm", "https://github.com/keras-team/keras/issues/9582", ("mixed",), mixed_rms_norm,
         "overflow", "Square", 'Standardize(..., dtype="float32")', run="diagnose"),
    Case("mixed_loss_sum", "https://github.com/matterport/Mask_RCNN/issues/1482", ("mixed",), mixed_loss_sum,
         "overflow", "Sum", 'Energy(..., dtype="float32")', run="diagnose"),
    Case("mixed_attention_scores", "https://github.com/tensorflow/tensorflow/issues/56142", ("mixed",),
         mixed_attention_scores, "overflow", "BatchMatMulV2", 'Attention(..., dtype="float32")', run="diagnose"),
    Case("library_norm", "https://github.com/jina-ai/finetuner/pull/34", ("library",), library_norm,
         "singular_derivative", "SqrtGrad",
         "tf.norm(x, axis=a) -> tf.sqrt(tf.maximum(tf.reduce_sum(tf.square(x), axis=a), 1.19e-07))",
         run="diagnose"),
    Case("diverge_unscaled_regression", "https://github.com/keras-team/keras/issues/3040", ("diverge",),
         diverge_unscaled_regression, "divergence", None, "learning rate ten times smaller", line=False),
    Case("diverge_lstm", "https://github.com/keras-team/keras/issues/6399", ("diverge",), diverge_lstm,
         "divergence", None, "learning rate ten times smaller", line=False),
    Case("diverge_simple_rnn", "https://github.com/keras-team/keras/issues/7375", ("diverge",), diverge_simple_rnn,
         "divergence", None, "learning rate ten times smaller", line=False),
    Case("diverge_guide_model",
         "https://github.com/alexander-rakhlin/CNN-for-Sentence-Classification-in-Keras/issues/7", ("custom", "diverge"), diverge_guide_model, "divergence", None, "learning rate ten times smaller",
         line=False),
]


def _fit_data(x, y):
    return (x,) if y is None else (x, y)


def diagnosis_of(case: Case):
    model, x, y, kwargs = case.build(False)
    if case.run == "diagnose":
        return model, diagnose(model, (x, y) if y is not None else (x,), batch_size=kwargs.get("batch_size"))
    doctor = NaNDoctor(verbose=False)
    model.fit(*_fit_data(x, y), shuffle=False, verbose=0, callbacks=[doctor],
              **{"epochs": 1, **kwargs})
    return model, doctor.diagnosis


def finite_after_remedy(case: Case) -> bool:
    """The fixed build (the remedy applied): the run is finite, every weight finite."""
    model, x, y, kwargs = case.build(True)
    if "diverge" in case.kinds:
        history = model.fit(*_fit_data(x, y), shuffle=False, verbose=0, **{"epochs": 1, **kwargs})
        logged = [v for values in history.history.values() for v in values]
        return all(np.isfinite(logged)) and all(np.isfinite(w).all() for w in model.get_weights())
    found = diagnose(model, (x, y) if y is not None else (x,), batch_size=kwargs.get("batch_size"))
    return found is None


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_the_first_remedy_of_a_rebuilt_report_applied_as_printed_makes_the_step_finite(case):
    model, d = diagnosis_of(case)
    assert d is not None, f"{case.id} ({case.url}): no diagnosis"
    assert (d.cause, d.op) == (case.cause, case.op) if case.op else d.cause == case.cause, str(d)
    assert d.cause in CAUSES and d.section == CAUSES[d.cause].section
    if case.line:
        assert d.source == f"{HERE}:{marked(case.id)}", str(d)
    first = str(d).split("\n  remedy:", 1)
    assert len(first) == 2, f"no remedy printed:\n{d}"
    assert case.remedy in " ".join(first[1].split()), str(d)
    assert d.remedy is not None and case.remedy in d.remedy
    # The doctor's own check of its remedy, on a copy of the failing step (every one is mechanical).
    assert d.verified is not None and d.verified.startswith("verified: the step is finite "), str(d)
    assert "  checked:   verified:" in str(d)
    assert finite_after_remedy(case), f"{case.id}: the remedy {d.remedy!r} does not cure"


def test_there_are_enough_rebuilt_reports_of_each_kind():
    assert len({c.url for c in CASES}) == len(CASES)
    assert sum("custom" in c.kinds for c in CASES) >= 6
    assert sum("mixed" in c.kinds for c in CASES) >= 4
    assert sum("diverge" in c.kinds for c in CASES) >= 4


# --------------------------------------------------------------------------------------
# The reports of test_doctor_reports.py: their first remedy, applied as printed, cures
# --------------------------------------------------------------------------------------

weighted, net, ones, mse = reports.weighted, reports.net, reports.ones, reports.mse


def in_float32(layer):
    """The same layer built with ``dtype="float32"`` (as the remedy prints it)."""
    return type(layer)(name=layer.name, dtype="float32")


def _dense(name, units, activation=None):
    return keras.layers.Dense(units, activation=activation, kernel_initializer="zeros", bias_initializer="zeros",
                              name=name)


def fixed_sqrt_of_product():
    x = ones()
    x[1] = 0.0
    return net(weighted("sqrt_cx", lambda w, x: tf.sqrt(tf.maximum(w * x, EPS)))), x, ones(), mse


def fixed_norm_of_difference():
    fn = lambda w, x: tf.sqrt(tf.maximum(tf.reduce_sum(tf.square(x - w), 1, keepdims=True), EPS))  # noqa: E731
    return net(weighted("dist", fn)), ones(), ones() * 2, mse


def fixed_norm_of_relu():
    def fn(w, x):
        r = tf.nn.relu(w * x)
        return tf.sqrt(tf.maximum(tf.reduce_sum(tf.square(r), 1, keepdims=True), EPS)) + r

    return net(weighted("relu_norm", fn)), -ones(), ones(), mse


def fixed_triplet_distance():
    def loss(y, p):
        d = tf.reduce_sum(tf.square(p - y), axis=1)
        return tf.reduce_mean(tf.maximum(tf.sqrt(tf.maximum(d, EPS)) + 0.5, 0.0))

    model = net(_dense("embed", 1))
    return model, ones(), np.zeros((4, 1), "float32"), loss


def fixed_where_log():
    def loss(y, p):
        return tf.reduce_mean(tf.where(p > 0, -tf.math.log(tf.where(p > 0, p, 1.0)), tf.zeros_like(p)))

    x = ones()
    x[2] = 0.0
    return net(weighted("scale", lambda w, x: w * x)), x, ones(), loss


def fixed_where_exp_overflow():
    def fn(w, x):
        c = w * x > 0
        return tf.where(c, tf.zeros_like(x), tf.exp(tf.where(c, 1.0, w * x)))

    return net(weighted("gate", fn)), ones() * 1e10, ones(), mse


def fixed_where_pow_exp():
    def fn(w, x):
        a = w * x
        return tf.where(a < 15.0, a, tf.pow(10.0, tf.exp(tf.where(a < 15.0, 1.0, a))))

    return net(weighted("branch", fn, init=10.0)), ones(), ones(), mse


def fixed_where_reciprocal():
    def fn(w, x):
        z = w * x
        return tf.where(z < 0, 1.0 / (1.0 - z), tf.math.log(tf.where(z < 0, 1.0, z) + 1.0))

    return net(weighted("transfer", fn)), -ones(), ones(), mse


def fixed_acos_of_clipped_cosine():
    def fn(w, x):
        cosine = tf.clip_by_value(w * x, -1.0, 1.0)
        return tf.acos(tf.clip_by_value(cosine, -1 + EPS, 1 - EPS))

    return net(weighted("angle", fn)), ones(), ones(), mse


def fixed_complex_angle():
    def loss(y, p):
        z = tf.complex(p[:, 0], p[:, 1])
        return tf.reduce_mean(tf.square(tf.math.angle(z + EPS)))

    return net(_dense("complex_out", 2)), ones(), ones(), loss


def fixed_atan2_at_origin():
    def loss(y, p):
        return tf.reduce_mean(tf.atan2(p[:, 0], p[:, 1] + EPS))

    return net(_dense("xy", 2)), ones(), ones(), loss


def fixed_focal_loss_pow():
    def loss(y, p):
        return tf.reduce_mean(-safe_pow(1.0 - p, 0.5) * tf.math.log(p))

    model = net(_dense("prob", 1, "sigmoid"))
    model.layers[-1].bias.assign([40.0])
    return model, ones(), ones(), loss


def fixed_crossentropy_on_probabilities():
    def loss(y, p):
        return -tf.reduce_sum(tf.math.log(tf.maximum(p, EPS)) * y)

    return net(_dense("policy", 2, "relu")), ones(), ones(4, 2), loss


def fixed_logistic_loss_saturated():
    def loss(y, p):
        return -tf.reduce_mean(y * tf.math.log(tf.maximum(p, EPS)) + (1 - y) * tf.math.log(tf.maximum(1.0 - p, EPS)))

    model = net(keras.layers.Dense(1, activation="sigmoid", name="logit"))
    model.layers[-1].set_weights([np.full((1, 1), 50.0, "float32"), np.zeros(1, "float32")])
    return model, ones(), np.zeros((4, 1), "float32"), loss


def fixed_naive_softplus():
    return net(weighted("softplus", lambda w, x: tf.nn.softplus(w * x))), ones() * 100.0, ones(), mse


def fixed_naive_softmax():
    fn = lambda w, x: tf.nn.softmax(w * x, axis=1)  # noqa: E731
    return net(weighted("softmax", fn), features=3), np.full((4, 3), 100.0, "float32"), ones(4, 3), mse


def fixed_float16_square():
    model, x, y, loss = reports.float16_square()
    return net(in_float32(model.get_layer("energy"))), x, y, loss


def fixed_float16_exp():
    model, x, y, loss = reports.float16_exp()
    return net(in_float32(model.get_layer("growth"))), x, y, loss


def fixed_negative_base_pow():
    return net(weighted("power", lambda w, x: signed_pow(w * x, 0.3), init=-1.0)), ones(), ones(), mse


def fixed_dice_without_smoothing():
    def loss(y, p):
        intersection = tf.reduce_sum(y * p)
        return 1.0 - tf.math.divide_no_nan(2.0 * intersection, tf.reduce_sum(y) + tf.reduce_sum(p))

    return net(_dense("mask", 1, "relu")), ones(), np.zeros((4, 1), "float32"), loss


def fixed_normalize_zero_rows():
    def fn(w, x):
        z = w * x
        return tf.math.divide_no_nan(z, tf.reduce_sum(z, axis=1, keepdims=True))

    return net(weighted("normalize", fn), features=2), np.zeros((4, 2), "float32"), ones(4, 2), mse


def fixed_cosine_of_zero_vector():
    def loss(y, p):
        return -tf.reduce_mean(tf.reduce_sum(tf.math.l2_normalize(y, 1) * tf.math.l2_normalize(p, 1), 1))

    return net(_dense("embedding", 2)), ones(), ones(4, 2), loss


def fixed_poisson_log_of_relu():
    def loss(y, p):
        return tf.reduce_mean(p - y * tf.math.log(tf.maximum(p, EPS)))

    return net(_dense("rate", 1, "relu")), ones(), ones(), loss


def fixed_negative_variance():
    def fn(w, x):
        z = w * x
        variance = tf.reduce_mean(tf.square(z)) - tf.square(tf.reduce_mean(z)) - 1e-7
        return z / tf.sqrt(tf.maximum(variance, EPS))

    return net(weighted("standardize", fn)), ones() * 0.214441, ones(), mse


def fixed_lgamma_at_zero():
    def loss(y, p):
        return tf.reduce_mean(tf.math.lgamma(tf.maximum(p, EPS)) - y * tf.math.log(p + 1.0))

    return net(_dense("count", 1, "relu")), ones(), ones(), loss


def fixed_masked_attention_row():
    def fn(w, x):
        return tf.nn.softmax(w * x + tf.constant([[-1e9, -1e9, -1e9]]), axis=-1)

    return net(weighted("attention", fn), features=3), ones(4, 3), ones(4, 3), mse


def fixed_data_with_nan():
    model, x, y, loss = reports.data_with_nan()
    keep = np.isfinite(x).all(axis=1)  # the rows the remedy names, dropped
    return model, x[keep], y[keep], loss


#: Each reported case: what its first remedy says, and the case with it applied.
FIXED = {
    "sqrt_of_product": ("tf.sqrt(tf.maximum(x, 1.19e-07))", fixed_sqrt_of_product),
    "norm_of_difference": ("tf.sqrt(tf.maximum(x, 1.19e-07))", fixed_norm_of_difference),
    "norm_of_relu": ("tf.sqrt(tf.maximum(x, 1.19e-07))", fixed_norm_of_relu),
    "triplet_distance": ("tf.sqrt(tf.maximum(x, 1.19e-07))", fixed_triplet_distance),
    "keras_normalize_zero_vector": ("jit_compile=False", None),
    "where_log": ("tf.where(c, f(tf.where(c, x, 1.0)), y)", fixed_where_log),
    "where_exp_overflow": ("tf.where(c, f(tf.where(c, x, 1.0)), y)", fixed_where_exp_overflow),
    "where_pow_exp": ("tf.where(c, f(tf.where(c, x, 1.0)), y)", fixed_where_pow_exp),
    "where_reciprocal": ("tf.where(c, f(tf.where(c, x, 1.0)), y)", fixed_where_reciprocal),
    "acos_of_clipped_cosine": ("tf.acos(tf.clip_by_value(x, -1 + 1.19e-07, 1 - 1.19e-07))",
                               fixed_acos_of_clipped_cosine),
    "complex_angle": ("tf.math.angle(z + 1.19e-07)", fixed_complex_angle),
    "atan2_at_origin": ("tf.atan2(y, x + 1.19e-07)", fixed_atan2_at_origin),
    "focal_loss_pow": ("companion.numerics.safe_pow(x, p)", fixed_focal_loss_pow),
    "crossentropy_on_probabilities": ("tf.math.log(tf.maximum(x, 1.19e-07))", fixed_crossentropy_on_probabilities),
    "logistic_loss_saturated": ("tf.math.log(tf.maximum(x, 1.19e-07))", fixed_logistic_loss_saturated),
    "naive_softplus": ("tf.nn.softplus(x)", fixed_naive_softplus),
    "naive_softmax": ("tf.nn.softmax(x, axis)", fixed_naive_softmax),
    "float16_square": ('Weighted(..., dtype="float32")', fixed_float16_square),
    "float16_exp": ('Weighted(..., dtype="float32")', fixed_float16_exp),
    "negative_base_pow": ("companion.numerics.signed_pow(x, p)", fixed_negative_base_pow),
    "dice_without_smoothing": ("tf.math.divide_no_nan(x, y)", fixed_dice_without_smoothing),
    "normalize_zero_rows": ("tf.math.divide_no_nan(x, y)", fixed_normalize_zero_rows),
    "cosine_of_zero_vector": ("tf.math.l2_normalize(x, axis)", fixed_cosine_of_zero_vector),
    "poisson_log_of_relu": ("tf.math.log(tf.maximum(x, 1.19e-07))", fixed_poisson_log_of_relu),
    "negative_variance": ("tf.sqrt(tf.maximum(x, 1.19e-07))", fixed_negative_variance),
    "lgamma_at_zero": ("tf.math.lgamma(tf.maximum(x, 1.19e-07))", fixed_lgamma_at_zero),
    "masked_attention_row": ("a large finite negative mask instead of -inf: -1e9", fixed_masked_attention_row),
    "data_with_nan": ("drop or impute row 1 of the batch", fixed_data_with_nan),
    "exploding_learning_rate": ("keras.optimizers.SGD(learning_rate=0.1)", None),
}


#: The reported cases whose first remedy is not one mechanical change, so the doctor claims
#: nothing (``verified`` is None), and why; every other case's remedy is verified.
NOT_MECHANICAL: dict[str, str] = {}  # every first remedy is checked now, the rewritten lines too (issue 42)

#: What the doctor's check says it applied, for each mechanical first remedy.
VERIFIED_WITH = {
    "keras_normalize_zero_vector": "jit_compile=False",
    "float16_square": "net/energy's dtype policy float32",
    "float16_exp": "net/growth's dtype policy float32",
    "data_with_nan": "without row 1",
    "exploding_learning_rate": "learning_rate=0.1 (the 17 steps from the start of fit",
    "focal_loss_pow": "safe_pow instead of pow at test_doctor_reports.py:",
    "negative_base_pow": "signed_pow instead of pow at test_doctor_reports.py:",
    "dice_without_smoothing": "divide_no_nan instead of the division at test_doctor_reports.py:",
    "normalize_zero_rows": "divide_no_nan instead of the division at test_doctor_reports.py:",
    "acos_of_clipped_cosine": "acos's input clipped to [-1 + 1.19e-07, 1 - 1.19e-07] at",
    "complex_angle": "angle's input moved by 1.19e-07 at",
    "atan2_at_origin": "atan2's x moved by 1.19e-07 at",
    "lgamma_at_zero": "lgamma's input clamped at 1.19e-07 at",
    # a rewritten line: the function's statement rewritten as printed, for one re-run
    "where_log": "the double where (safe value 1.0) at",
    "where_exp_overflow": "the double where (safe value 1.0) at",
    "where_pow_exp": "the double where (safe value 1.0) at",
    "where_reciprocal": "the double where (safe value 1.0) at",
    "naive_softplus": "log(1 + exp(x)) rewritten as tf.nn.softplus(x) at",
    "naive_softmax": "exp(x) / reduce_sum(exp(x)) rewritten as tf.nn.softmax(x, axis) at",
    "cosine_of_zero_vector": "x / norm(x) rewritten as tf.math.l2_normalize(x, axis) at",
    "masked_attention_row": "-inf replaced by -1e+09 at",
}


#: The cases whose remedy changes the model, the data or the optimizer, not a line.
MODEL_REMEDIES = {"keras_normalize_zero_vector", "float16_square", "float16_exp", "data_with_nan",
                  "exploding_learning_rate"}


def _fixed_run(case, mode):
    """The case with its remedy applied, run as its reporter ran it: the diagnosis (None: finite)."""
    if case.id == "keras_normalize_zero_vector":  # compile without XLA, as printed
        model, x, y, loss = case.build()
        model.compile(loss=loss, optimizer=keras.optimizers.SGD(1e-3), jit_compile=False)
        return diagnose(model, (x, y))
    if case.id == "exploding_learning_rate":  # the learning rate the remedy prints
        model, x, y, loss = case.build()
        model.compile(loss=loss, optimizer=keras.optimizers.SGD(0.1))
        doctor = NaNDoctor(verbose=False)
        model.fit(x, y, batch_size=4, epochs=3, verbose=0, shuffle=False, callbacks=[doctor])
        return doctor.diagnosis
    fixed = dataclasses.replace(case, build=FIXED[case.id][1])
    return reports.run(fixed, mode)


def test_every_reported_case_has_a_fix():
    assert set(FIXED) == {case.id for case in reports.CASES}


@pytest.mark.parametrize("case", reports.CASES, ids=[c.id for c in reports.CASES])
def test_the_first_remedy_of_a_reported_case_applied_as_printed_makes_its_step_finite(case):
    mode = case.modes[0]
    d = reports.run(case, mode)
    keras.mixed_precision.set_global_policy("float32")
    assert d is not None and (d.cause, d.op) == (case.cause, case.op), str(d)
    expected, _ = FIXED[case.id]
    assert d.remedy is not None and expected in d.remedy, str(d)
    assert str(d).index("  remedy:") < str(d).index("  fix:")  # printed first
    if case.line:
        assert d.source == f"{reports.HERE}:{reports.marked(case.id)}"
    if case.id in NOT_MECHANICAL:
        assert d.verified.startswith("not verified: the doctor could not apply"), d.verified
    else:  # the doctor applied its remedy to a copy of the failing step, and it cured it
        assert d.verified is not None and d.verified.startswith("verified: the step is finite "), str(d)
        clamp = "sqrt's input clamped at 1.19e-07" if "sqrt" in expected else "log's input clamped at 1.19e-07"
        assert VERIFIED_WITH.get(case.id, clamp) in d.verified, d.verified
        if case.id not in MODEL_REMEDIES:  # a clamp applied on the case's own line, and only there
            assert d.verified.endswith(f" at test_doctor_reports.py:{reports.marked(case.id)}"), d.verified
    assert _fixed_run(case, mode) is None, f"{case.id}: the remedy {d.remedy!r} does not cure"


def test_every_reported_case_is_either_verified_or_said_not_mechanical():
    assert set(NOT_MECHANICAL) <= {case.id for case in reports.CASES}
    assert not set(NOT_MECHANICAL) & set(VERIFIED_WITH)


def test_there_are_at_least_40_rebuilt_reports_whose_first_remedy_cures():
    urls = {c.url for c in CASES} | {c.url for c in reports.CASES}
    assert len(urls) == len(CASES) + len(reports.CASES) >= 40
