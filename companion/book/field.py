"""Four more public NaN reports, rebuilt, for the doctor's chapter: the kinds of issue 42.

*Finding your own NaN* (``book/closing/finding_your_own_nan.ipynb``) runs the NaN doctor
on each; each rebuild keeps what its report describes and makes up the rest, like
:mod:`companion.book.reports`. ``fixed=True`` applies the first remedy the doctor prints,
as it prints it. :data:`FIELD_REPORTS` lists them: ``key -> (title, url)``.

* ``"ethogram"``: an output bias initialised to ``log(pos / neg)``, ``-inf`` for a label
  with no example (weights non-finite before the first step);
* ``"speech_commands"``: a ``tf.data`` map that takes the log of a silent clip's power
  (a NaN made in the input pipeline);
* ``"min_snr_diffusion"``: timesteps drawn inside ``train_step``, a loss weight ``0/0``
  at one of them (random draws inside the step);
* ``"wgan_critic"``: a block under ``mixed_float16`` whose own ``Conv1D`` computes in
  float16 (a sublayer under mixed precision).

Part of the book's support code (:mod:`companion.book`): no stability promise.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import numpy as np
import tensorflow as tf

__all__ = ["FIELD_REPORTS", "FieldRebuild", "batch_losses", "describe", "field_rebuild"]

#: The rebuilt reports, each key -> (what the reporter saw, the report's URL).
FIELD_REPORTS: dict[str, tuple[str, str]] = {
    "ethogram": ("bias initialised to -inf for a behaviour with no examples",
                 "https://github.com/jbohnslav/deepethogram/issues/15"),
    "speech_commands": ("audio preprocessing gives NaN on clips with many zeros",
                        "https://github.com/tensorflow/examples/pull/339"),
    "min_snr_diffusion": ("Min-SNR loss NaN at a zero-terminal-SNR timestep",
                          "https://github.com/TiankaiHang/Min-SNR-Diffusion-Training/pull/4"),
    "wgan_critic": ("WGAN-GP critic under mixed_float16: the variance overflows",
                    "https://github.com/tensorflow/tensorflow/issues/47156"),
}

EPS = 1.19e-07  # float32's eps, as the doctor's remedies print it


@dataclasses.dataclass(frozen=True)
class FieldRebuild:
    """A rebuilt report: the compiled model and what ``fit`` takes.

    Attributes:
        key: its key in :data:`FIELD_REPORTS`.
        model: the compiled Keras model.
        data: a ``tf.data.Dataset``, or an ``(x, y)`` tuple trained in batches of
            ``batch_size`` without shuffling.
        batch_size: the batch size for array data (None for a dataset).
    """

    key: str
    model: Any
    data: Any
    batch_size: int | None = None

    def fit(self, epochs: int = 2, callbacks=()) -> list[float]:
        """Train as the reporter did; the loss of each batch (floats, possibly NaN)."""
        return batch_losses(self, epochs, callbacks)


class _BatchLosses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def batch_losses(r: FieldRebuild, epochs: int = 2, callbacks=()) -> list[float]:
    """``fit`` on a rebuild; the loss ``fit`` logs after each batch.

    Example:
        >>> losses = batch_losses(field_rebuild("ethogram", fixed=True), epochs=1)
        >>> bool(np.isfinite(losses).all())
        True
    """
    record = _BatchLosses()
    if isinstance(r.data, tf.data.Dataset):
        r.model.fit(r.data, epochs=epochs, shuffle=False, verbose=0, callbacks=[record, *callbacks])
    else:
        x, y = r.data
        r.model.fit(x, y, batch_size=r.batch_size, epochs=epochs, shuffle=False, verbose=0,
                    callbacks=[record, *callbacks])
    return record.losses


def describe(d, width: int = 88) -> str:
    """The rows of a diagnosis a chapter shows, each wrapped to ``width`` characters.

    The phase, op, batch and cause; the user's line; the first remedy and what checked
    it. (The full ``print(d)`` also lists variables whose auto-generated names depend on
    how many layers a session made before.)

    Example:
        >>> from companion.diagnostics import diagnose
        >>> r = field_rebuild("ethogram")
        >>> describe(diagnose(r.model, r.data)).splitlines()[0]
        'cause: nonfinite_init | phase: weights | layer: ethogram/logits'
    """
    import textwrap

    head = [f"cause: {d.cause}", f"phase: {d.phase}"]
    head += [f"op: {d.op}"] if d.op else []
    head += [f"batch: {d.batch}"] if d.batch else []
    head += [f"layer: {d.layer}"] if d.layer else []
    rows = [" | ".join(head)]
    for label, text in (("line", d.code), ("remedy", d.remedy), ("checked", d.verified)):
        if text:
            rows.append(textwrap.fill(f"{label}: {text}", width, subsequent_indent="  "))
    return "\n".join(rows)


# --------------------------------------------------------------------------------------
# jbohnslav/deepethogram#15: a bias of log(pos / neg) = -inf
# --------------------------------------------------------------------------------------


class BehaviorLogits(keras.layers.Dense):
    """deepethogram's output layer: its bias is ``log(pos / neg)`` of each behaviour."""

    def __init__(self, pos, neg, fixed: bool = False, **kwargs):
        with np.errstate(divide="ignore"):
            value = np.log(np.asarray(pos, "float64") / np.asarray(neg, "float64"))
        if fixed:  # the doctor's remedy, as printed
            value = np.nan_to_num(value, nan=0.0, posinf=0.0, neginf=0.0)
        init = keras.initializers.Constant(value)
        super().__init__(len(value), bias_initializer=init, **kwargs)  # log-odds bias


def _ethogram(fixed: bool) -> FieldRebuild:
    pos = np.array([40.0, 12.0, 0.0])  # one behaviour never labelled in the training set
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              BehaviorLogits(pos, 64.0 - pos, fixed, name="logits")], name="ethogram")
    model.compile(optimizer="sgd", loss=keras.losses.BinaryCrossentropy(from_logits=True))
    rng = np.random.default_rng(1)
    y = np.stack([rng.random(64) < 40 / 64, rng.random(64) < 12 / 64, np.zeros(64, bool)], 1)
    return FieldRebuild("ethogram", model, (rng.normal(size=(64, 6)).astype("float32"), y.astype("float32")), 16)


# --------------------------------------------------------------------------------------
# tensorflow/examples#339: the log of a silent clip, in a tf.data map
# --------------------------------------------------------------------------------------


def decode(wav, label):
    """The pipeline's first map: 16-bit samples to floats in [-1, 1)."""
    return tf.cast(wav, tf.float32) / 32768.0, label


def log_spectrum(wav, label):
    """The pipeline's second map: the log of each frame's power."""
    frames = tf.signal.frame(wav, 16, 16)
    power = tf.reduce_mean(tf.square(frames), axis=-1)
    return tf.math.log(power), label  # log-power


def log_spectrum_fixed(wav, label):
    """The second map with the doctor's remedy, as printed."""
    frames = tf.signal.frame(wav, 16, 16)
    power = tf.reduce_mean(tf.square(frames), axis=-1)
    return tf.math.log(tf.maximum(power, EPS)), label


def _speech_commands(fixed: bool) -> FieldRebuild:
    rng = np.random.default_rng(0)
    clips = (rng.normal(size=(48, 128)) * 3000).astype("int16")
    clips[13, :40] = 0  # a recording that starts with an empty stream
    labels = rng.integers(0, 2, size=(48, 1)).astype("float32")
    spectrum = log_spectrum_fixed if fixed else log_spectrum
    dataset = (tf.data.Dataset.from_tensor_slices((clips, labels)).map(decode)
               .map(spectrum, num_parallel_calls=2).batch(8).prefetch(1))
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")], name="kws")
    model.compile(optimizer="adam", loss="binary_crossentropy")
    return FieldRebuild("speech_commands", model, dataset)


# --------------------------------------------------------------------------------------
# TiankaiHang/Min-SNR-Diffusion-Training#4: timesteps drawn in train_step
# --------------------------------------------------------------------------------------

STEPS = 40  # diffusion timesteps


def zero_terminal_alphas_cumprod() -> np.ndarray:
    """A linear beta schedule rescaled to a zero terminal SNR: the last alpha_bar is exactly 0."""
    betas = np.linspace(1e-4, 0.2, STEPS)
    root = np.sqrt(np.cumprod(1.0 - betas))
    root = (root - root[-1]) * root[0] / (root[0] - root[-1])
    return (root**2).astype("float32")


class MinSNRDiffusion(keras.Model):
    """A denoiser trained with the Min-SNR-5 weight; timesteps and noise drawn in ``train_step``."""

    def __init__(self, fixed: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.fixed = fixed
        self.alphas_cumprod = tf.constant(zero_terminal_alphas_cumprod())
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
        if self.fixed:  # the doctor's remedy, as printed
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


def _min_snr_diffusion(fixed: bool) -> FieldRebuild:
    model = MinSNRDiffusion(fixed, name="diffusion")
    model.compile(optimizer=keras.optimizers.Adam(1e-3))
    images = np.random.default_rng(0).normal(size=(160, 4)).astype("float32")
    return FieldRebuild("min_snr_diffusion", model, tf.data.Dataset.from_tensor_slices(images).batch(4))


# --------------------------------------------------------------------------------------
# tensorflow/tensorflow#47156: a float16 sublayer inside a block
# --------------------------------------------------------------------------------------


class ResBlock(keras.layers.Layer):
    """A critic's residual block: a convolution, then instance normalisation written out."""

    def __init__(self, filters, conv_dtype=None, **kwargs):
        super().__init__(**kwargs)
        self.conv = keras.layers.Conv1D(filters, 3, padding="same", dtype=conv_dtype, name="conv")

    def call(self, x):
        h = self.conv(x)
        mean = tf.reduce_mean(h, axis=1, keepdims=True)
        variance = tf.reduce_mean(tf.square(h), axis=1, keepdims=True) - tf.square(mean)  # instance-var
        return x + (h - mean) * tf.math.rsqrt(variance + 1e-5)


def _wgan_critic(fixed: bool) -> FieldRebuild:
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:  # the layers keep the policy they are made with
        dtype = "float32" if fixed else None  # the doctor's remedy: the block and its conv in float32
        block = ResBlock(4, conv_dtype=dtype, dtype=dtype, name="block")
        model = keras.Sequential([keras.Input((16, 4)), block, keras.layers.GlobalAveragePooling1D(),
                                  keras.layers.Dense(1, dtype="float32", name="head")], name="critic")
        model.compile(optimizer="adam", loss="mse")
    finally:
        keras.mixed_precision.set_global_policy(previous)
    x = (np.random.default_rng(0).normal(size=(32, 16, 4)) * 50 + 600).astype("float32")
    return FieldRebuild("wgan_critic", model, (x, np.ones((32, 1), "float32")), 8)


_BUILDERS = {
    "ethogram": _ethogram,
    "speech_commands": _speech_commands,
    "min_snr_diffusion": _min_snr_diffusion,
    "wgan_critic": _wgan_critic,
}


def field_rebuild(key: str, fixed: bool = False, seed: int = 0) -> FieldRebuild:
    """Rebuild the report ``key`` of :data:`FIELD_REPORTS` (``fixed``: with the doctor's remedy).

    Seeds Keras with ``seed`` first, so a rebuild is the same every time.

    Example:
        >>> r = field_rebuild("speech_commands")
        >>> r.model.name
        'kws'
    """
    if key not in _BUILDERS:
        raise ValueError(f"unknown report {key!r}; expected one of {sorted(_BUILDERS)}")
    keras.utils.set_random_seed(seed)
    return _BUILDERS[key](fixed)
