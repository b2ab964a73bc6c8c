"""The doctor on public reports it was not built around (issue 42), each rebuilt as its reporter trained.

Each test names the report it rebuilds, asserts what the doctor names (the phase or op,
the layer, the variable, the line, the cause), and applies the first printed remedy as
printed: the failing run is then finite.
"""

from __future__ import annotations

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

from companion.diagnostics import CAUSES, diagnose
from companion.training import train
from companion.training.inputs import check_finite_weights

HERE = __file__


def line_of(marker: str) -> int:
    """The line of this file that ends with ``# <marker>``."""
    lines = open(HERE).read().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if line.rstrip().endswith(f"# {marker}"))


# --------------------------------------------------------------------------------------
# Item 2: weights that are not finite before the first step
# --------------------------------------------------------------------------------------


def _segmentation_bias(counts, fixed=False):
    """perslev/MultiPlanarUNet's ``set_bias_weights``: the output bias from class frequencies."""
    freq = counts / counts.sum()
    with np.errstate(divide="ignore", invalid="ignore"):
        bias = np.log(freq * np.sum(np.exp(freq)))
        bias /= np.linalg.norm(bias)
    if fixed:  # the first printed remedy, applied to the value set at the marked line
        bias = np.nan_to_num(bias, nan=0.0, posinf=0.0, neginf=0.0)
    return bias.astype("float32")


def _multiplanar_unet(fixed=False):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3, name="out")], name="unet")
    counts = np.array([90.0, 10.0, 0.0])  # class 2 absent from the images the counts come from
    model.get_layer("out").bias.assign(_segmentation_bias(counts, fixed))  # set-bias
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    return model, rng.normal(size=(64, 4)).astype("float32"), rng.integers(0, 2, (64, 1))


def test_a_bias_set_from_a_zero_class_frequency_is_named_with_its_layer_variable_and_line():
    """perslev/MultiPlanarUNet#24 (https://github.com/perslev/MultiPlanarUNet/issues/24).

    The output layer's bias is set from class frequencies estimated from a sample in which
    one class is absent: ``log(0) = -inf``, then divided by the norm (``inf``), gives a
    ``NaN`` bias, and the loss is ``NaN`` from the first step.
    """
    model, x, y = _multiplanar_unet()
    d = diagnose(model, (x, y))
    assert (d.phase, d.op, d.cause) == ("weights", None, "nonfinite_init"), str(d)
    assert d.layer == "unet/out" and d.variables == ("unet/out/bias",)
    assert d.source == f"{HERE}:{line_of('set-bias')}" and ".bias.assign(" in d.code
    assert "NaN" in d.inputs_summary and "assigned after the layer was built" in d.inputs_summary
    assert "train" not in d.remedy and "train" not in d.fix.partition("(companion.training.train")[0]
    assert d.remedy.startswith(f"at test_doctor_field.py:{line_of('set-bias')}: ")
    assert "np.nan_to_num(value, nan=0.0, posinf=0.0, neginf=0.0)" in d.remedy
    assert d.verified.startswith("verified: the step is finite"), d.verified
    model, x, y = _multiplanar_unet(fixed=True)  # the remedy, as printed
    history = model.fit(x, y, epochs=2, batch_size=16, verbose=0, shuffle=False)
    assert np.isfinite(history.history["loss"]).all()


def _behavior_classifier(fixed=False):
    keras.utils.set_random_seed(0)
    pos = np.array([40.0, 12.0, 0.0])  # one behaviour never labelled in the training set
    neg = 64.0 - pos
    value = np.log(pos / neg) if not fixed else np.nan_to_num(np.log(pos / neg), nan=0.0, posinf=0.0, neginf=0.0)
    with np.errstate(divide="ignore"):
        model = keras.Sequential([
            keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3, name="logits", bias_initializer=keras.initializers.Constant(value)),  # prior
        ], name="ethogram")
    model.compile(optimizer="sgd", loss=keras.losses.BinaryCrossentropy(from_logits=True))
    rng = np.random.default_rng(1)
    y = np.stack([rng.random(64) < 40 / 64, rng.random(64) < 12 / 64, np.zeros(64, bool)], 1).astype("float32")
    return model, rng.normal(size=(64, 6)).astype("float32"), y


def test_a_bias_initializer_of_log_zero_prior_is_named_and_train_refuses_the_model():
    """jbohnslav/deepethogram#15 (https://github.com/jbohnslav/deepethogram/issues/15).

    A multi-label classifier's output bias is initialised to ``log(pos / neg)``; a class
    with no positive example gets ``-inf``, and the sigmoid cross-entropy from logits is
    ``-inf * 0 = NaN`` from the first step.
    """
    with np.errstate(divide="ignore"):
        model, x, y = _behavior_classifier()
        d = diagnose(model, (x, y))
    assert (d.phase, d.cause, d.layer, d.variables) == ("weights", "nonfinite_init", "ethogram/logits",
                                                         ("ethogram/logits/bias",)), str(d)
    assert d.source == f"{HERE}:{line_of('prior')}"
    assert "-Inf" in d.inputs_summary and "its initializer bias_initializer=Constant(" in d.inputs_summary
    assert "train" not in d.remedy and d.verified.startswith("verified:"), (d.remedy, d.verified)
    with pytest.raises(ValueError, match=r"ethogram/logits/bias \(1 of 3 entries\)"):
        train(model, x, y, epochs=1, batch_size=16, verbose=0)
    model, x, y = _behavior_classifier(fixed=True)  # the remedy, as printed
    check_finite_weights(model)
    history = model.fit(x, y, epochs=2, batch_size=16, verbose=0, shuffle=False)
    assert np.isfinite(history.history["loss"]).all()


class ActNorm(keras.layers.Layer):
    """FrEIA's ActNorm, in Keras: scale and shift initialised from the first batch."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="scale")
        self.shift = self.add_weight(shape=(shape[-1],), initializer="zeros", name="shift")

    def initialize(self, x, fixed=False):
        mean, std = tf.reduce_mean(x, 0), tf.math.reduce_std(x, 0)
        scale, shift = 1.0 / std, -mean / std
        if fixed:
            scale, shift = (tf.constant(np.nan_to_num(v.numpy(), nan=0.0, posinf=0.0, neginf=0.0)) for v in (scale, shift))
        self.scale.assign(scale)  # actnorm-scale
        self.shift.assign(shift)

    def call(self, x):
        return x * self.scale + self.shift


def _flow(fixed=False):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(32, 3)).astype("float32")
    x[:, 1] = 0.5  # a channel that always has the same value
    norm = ActNorm(name="actnorm")
    model = keras.Sequential([keras.Input((3,)), norm, keras.layers.Dense(1, name="head")], name="flow")
    norm.initialize(tf.constant(x), fixed)
    model.compile(optimizer="sgd", loss="mse")
    return model, x, x.sum(1, keepdims=True)


def test_a_data_dependent_initialisation_over_a_constant_channel_is_named_at_its_assign():
    """vislearn/FrEIA#121 (https://github.com/vislearn/FrEIA/issues/121).

    ActNorm's scale and shift are set from the first batch; a channel that always has the
    same value has a spread of 0, the scale is ``1/0 = inf`` and the output ``NaN``.
    """
    model, x, y = _flow()
    d = diagnose(model, (x, y))
    assert (d.phase, d.cause, d.layer) == ("weights", "nonfinite_init", "flow/actnorm"), str(d)
    assert set(d.variables) == {"flow/actnorm/scale", "flow/actnorm/shift"}
    assert d.source == f"{HERE}:{line_of('actnorm-scale')}"
    assert d.remedy and "train" not in d.remedy and d.verified.startswith("verified:")
    with pytest.raises(ValueError, match="flow/actnorm/scale"):
        check_finite_weights(model)
    model, x, y = _flow(fixed=True)
    history = model.fit(x, y, epochs=2, batch_size=8, verbose=0, shuffle=False)
    assert np.isfinite(history.history["loss"]).all()


def test_weights_made_non_finite_by_training_keep_their_cause():
    """A weight that an earlier step wrote non-finite is not an initial value: ``nonfinite_weights``."""
    model, x, y = _multiplanar_unet(fixed=True)
    model.fit(x, y, epochs=1, batch_size=64, verbose=0)
    model.get_layer("out").bias.assign([np.nan, 0.0, 0.0])  # as a non-finite update would
    assert diagnose(model, (x, y)).cause == "nonfinite_weights"
    assert "nonfinite_init" in CAUSES
