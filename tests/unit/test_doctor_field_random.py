"""The doctor on public reports of NaNs that depend on random draws (issue 42, item 4).

A diffusion model draws its timesteps and noise inside ``train_step`` (or a layer's
``call``) from a ``SeedGenerator``; ``fit`` draws batch k's from the state k steps have
advanced. The doctor's scan advances the random states batch by batch in the same way,
so the batch at which ``fit`` meets the NaN is the batch the doctor finds, and its
re-runs draw the same numbers; every state is put back afterwards.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from companion.diagnostics import diagnose

HERE = __file__
STEPS = 40  # diffusion timesteps


def line_of(marker: str) -> int:
    """The line of this file that ends with ``# <marker>``."""
    lines = open(HERE).read().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if line.rstrip().endswith(f"# {marker}"))


def _zero_terminal_alphas_cumprod() -> np.ndarray:
    """A linear schedule rescaled to zero terminal SNR: alpha_bar at the last step is exactly 0."""
    betas = np.linspace(1e-4, 0.2, STEPS)
    alphas_bar_sqrt = np.sqrt(np.cumprod(1.0 - betas))
    first, last = alphas_bar_sqrt[0], alphas_bar_sqrt[-1]
    alphas_bar_sqrt = (alphas_bar_sqrt - last) * first / (first - last)
    return (alphas_bar_sqrt ** 2).astype("float32")


class MinSNRDiffusion(keras.Model):
    """A denoiser trained with the Min-SNR-5 loss weight, timesteps and noise drawn in train_step."""

    def __init__(self, fixed=False):
        super().__init__()
        self.fixed = fixed
        self.alphas_cumprod = tf.constant(_zero_terminal_alphas_cumprod())
        self.seed_generator = keras.random.SeedGenerator(42)
        self.denoiser = keras.Sequential([keras.Input((5,)), keras.layers.Dense(16, activation="relu"),
                                          keras.layers.Dense(4)], name="denoiser")

    def call(self, inputs):
        return self.denoiser(inputs)

    def train_step(self, images):
        batch = tf.shape(images)[0]
        t = keras.random.randint((batch,), 0, STEPS, seed=self.seed_generator)
        noise = keras.random.normal(tf.shape(images), seed=self.seed_generator)
        alpha_bar = tf.gather(self.alphas_cumprod, t)[:, None]
        noisy = tf.sqrt(alpha_bar) * images + tf.sqrt(1.0 - alpha_bar) * noise
        snr = alpha_bar / (1.0 - alpha_bar)
        if self.fixed:  # the remedy, as printed
            weight = tf.math.divide_no_nan(tf.minimum(snr, 5.0), snr)
        else:
            weight = tf.minimum(snr, 5.0) / snr  # min-snr
        with tf.GradientTape() as tape:
            step = tf.cast(t, tf.float32)[:, None] / STEPS
            predicted = self(tf.concat([noisy, step], axis=-1), training=True)
            loss = tf.reduce_mean(weight * tf.square(predicted - noise))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def _diffusion(fixed=False):
    keras.utils.set_random_seed(0)
    model = MinSNRDiffusion(fixed)
    model.compile(optimizer=keras.optimizers.Adam(1e-3))
    images = np.random.default_rng(0).normal(size=(160, 4)).astype("float32")
    return model, tf.data.Dataset.from_tensor_slices(images).batch(4)


def _first_nan_step(model, dataset) -> int | None:
    history = model.fit(dataset, epochs=1, verbose=0, callbacks=[_Losses()])
    losses = history.history["batch_losses"]
    return next((i for i, loss in enumerate(losses) if not np.isfinite(loss)), None)


class _Losses(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(float(logs["loss"]))

    def on_train_end(self, logs=None):
        self.model.history.history["batch_losses"] = self.seen


def test_timesteps_drawn_in_train_step_are_replayed_per_batch_as_fit_drew_them():
    """TiankaiHang/Min-SNR-Diffusion-Training#4 (https://github.com/TiankaiHang/Min-SNR-Diffusion-Training/pull/4).

    With betas rescaled for a zero terminal SNR, ``alpha_bar`` at the last timestep is 0
    and the Min-SNR weight ``min(snr, 5) / snr`` is ``0 / 0``: the loss is NaN at the
    first step whose random timesteps include the last one ("without this fix, step loss
    goes to NaN"), not at the first step.
    """
    model, dataset = _diffusion()
    state = model.seed_generator.state.numpy().copy()
    d = diagnose(model, dataset)
    assert d is not None, "every batch replayed with the first batch's timesteps"
    assert np.array_equal(model.seed_generator.state.numpy(), state)  # put back
    fit_step = _first_nan_step(*_diffusion())
    assert fit_step is not None and fit_step > 0
    assert d.batch == fit_step, (d.batch, fit_step)
    assert (d.op, d.cause) == ("RealDiv", "division_by_zero"), str(d)
    assert d.source == f"{HERE}:{line_of('min-snr')}"
    assert "denominators of RealDiv are exactly 0" in d.inputs_summary, d.inputs_summary
    assert d.remedy == (f"at test_doctor_field_random.py:{line_of('min-snr')}: x / y -> tf.math.divide_no_nan(x, y) "
                        "(0 where y == 0, and a zero gradient there)"), d.remedy
    assert d.verified.startswith("verified: the step is finite with divide_no_nan"), d.verified
    assert _first_nan_step(*_diffusion(fixed=True)) is None


class NoisedTimesteps(keras.layers.Layer):
    """imagen-pytorch's q_sample as a layer: the noised input at a random timestep, drawn in call."""

    def __init__(self, betas, **kwargs):
        super().__init__(**kwargs)
        self.alphas_cumprod = np.cumprod(1.0 - betas).astype("float32")
        self.seed_generator = keras.random.SeedGenerator(3)
        self.clamp = None

    def call(self, x, training=False):
        t = keras.random.randint((tf.shape(x)[0],), 0, len(self.alphas_cumprod), seed=self.seed_generator)
        alpha_bar = tf.gather(tf.constant(self.alphas_cumprod), t)[:, None]
        noise = keras.random.normal(tf.shape(x), seed=self.seed_generator)
        if self.clamp is not None:
            return tf.sqrt(tf.maximum(alpha_bar, self.clamp)) * x + tf.sqrt(1.0 - alpha_bar) * noise
        return tf.sqrt(alpha_bar) * x + tf.sqrt(1.0 - alpha_bar) * noise  # q-sample


def _imagen(betas):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), NoisedTimesteps(betas, name="q_sample"), keras.layers.Dense(3)],
                             name="unet")
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(1).normal(size=(96, 3)).astype("float32")
    return model, tf.data.Dataset.from_tensor_slices((x, x)).batch(2)


def test_timesteps_drawn_in_a_layer_s_call_are_replayed_per_batch_as_fit_drew_them():
    """lucidrains/imagen-pytorch#161 (https://github.com/lucidrains/imagen-pytorch/issues/161).

    A linear beta schedule scaled by ``1000 / timesteps`` for too few timesteps gives a
    last beta above 1: ``alpha_bar`` is negative at that step and ``sqrt(alpha_bar)`` is
    NaN, only in the batches whose random timesteps reach it. The first printed remedy
    (the clamped square root) then makes ``fit`` finite.
    """
    steps, scaled_for = 30, 19.5  # the scale of a shorter schedule: only the last beta is above 1
    betas = np.linspace(1e-4, 0.02, steps) * 1000 / scaled_for
    assert (betas > 1).sum() == 1
    model, dataset = _imagen(betas)
    d = diagnose(model, dataset)
    assert d is not None and d.batch > 0, d
    history = _imagen(betas)[0].fit(dataset, epochs=1, verbose=0, callbacks=[_Losses()])
    fit_step = next(i for i, v in enumerate(history.history["batch_losses"]) if not np.isfinite(v))
    assert d.batch == fit_step, (d.batch, fit_step)
    assert (d.op, d.cause, d.layer) == ("Sqrt", "domain_edge", "unet/q_sample"), str(d)
    assert d.source == f"{HERE}:{line_of('q-sample')}"
    assert "inputs of Sqrt are negative" in d.inputs_summary
    assert d.remedy.startswith(f"at test_doctor_field_random.py:{line_of('q-sample')}: tf.sqrt(x) -> "
                               "tf.sqrt(tf.maximum(x, 1.19e-07))"), d.remedy
    assert d.verified.startswith("verified: the step is finite with sqrt's input clamped"), d.verified
    model, dataset = _imagen(betas)
    model.layers[0].clamp = 1.19e-07  # the remedy, as printed
    history = model.fit(dataset, epochs=1, verbose=0, callbacks=[_Losses()])
    assert np.isfinite(history.history["batch_losses"]).all()
