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

from companion.book import field
from companion.book.field import field_rebuild
from companion.diagnostics import diagnose

HERE = __file__
FIELD = field.__file__  # where the rebuilt Min-SNR model's lines are


def line_of(marker: str, path: str = HERE) -> int:
    """The line of ``path`` (by default this file) that ends with ``# <marker>``."""
    lines = open(path).read().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if line.rstrip().endswith(f"# {marker}"))


def _diffusion(fixed=False):
    rebuild = field_rebuild("min_snr_diffusion", fixed=fixed)  # seeds Keras with 0 first
    return rebuild.model, rebuild.data


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
    assert d.source == f"{FIELD}:{line_of('min-snr', FIELD)}"
    assert "denominators of RealDiv are exactly 0" in d.inputs_summary, d.inputs_summary
    assert d.remedy == (f"at field.py:{line_of('min-snr', FIELD)}: x / y -> tf.math.divide_no_nan(x, y) "
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
