"""The doctor on public reports of a NaN made by the input pipeline (issue 42, item 3).

A NaN that a ``tf.data`` map makes (the log of a silent clip, a 0/0 normalisation) is
``nonfinite_input``, and the diagnosis names the map function's op and line: the doctor
re-runs the pipeline's map functions eagerly, op by op, on the elements they read. Each
test names the report it rebuilds, asserts the op, the line and the cause, and applies
the first printed remedy, as printed, to the pipeline: ``fit`` is then finite.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from companion.book import field
from companion.book.field import field_rebuild
from companion.diagnostics import diagnose

HERE = __file__
FIELD = field.__file__  # where the rebuilt speech-commands pipeline's lines are


def line_of(marker: str, path: str = HERE) -> int:
    """The line of ``path`` (by default this file) that ends with ``# <marker>``."""
    lines = open(path).read().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if line.rstrip().endswith(f"# {marker}"))


def _fit_is_finite(model, dataset) -> bool:
    history = model.fit(dataset, epochs=2, verbose=0)
    return bool(np.isfinite(history.history["loss"]).all())


# --------------------------------------------------------------------------------------
# The log of a silent clip, two maps after the source
# --------------------------------------------------------------------------------------


def _speech_commands(fixed=False):
    rebuild = field_rebuild("speech_commands", fixed=fixed)  # seeds Keras with 0 first
    return rebuild.model, rebuild.data


def test_the_log_of_a_silent_clip_in_a_map_is_named_at_its_line():
    """tensorflow/examples#339 (https://github.com/tensorflow/examples/pull/339).

    Model Maker's audio preprocessing gives NaN "when the input tensors contain too many
    zero entries" (a recording that starts with an empty stream): the log of a frame's
    power of 0 is ``-inf``, made in the pipeline's second map.
    """
    model, dataset = _speech_commands()
    d = diagnose(model, dataset)
    assert (d.phase, d.op, d.cause, d.batch) == ("input", "Log", "nonfinite_input", 1), str(d)
    assert d.source == f"{FIELD}:{line_of('log-power', FIELD)}" and "tf.math.log(power)" in d.code
    assert "made non-finite by Log in the input pipeline's map 2 of 2, log_spectrum" in d.inputs_summary
    assert "are exactly 0" in d.inputs_summary, d.inputs_summary
    assert d.remedy == (f"at field.py:{line_of('log-power', FIELD)}: tf.math.log(x) -> "
                        "tf.math.log(tf.maximum(x, 1.19e-07))"), d.remedy
    assert d.verified.startswith("verified: the map function's values are finite with log's input clamped"), d.verified
    assert "the failing step is finite without row 5" in d.verified
    model, dataset = _speech_commands(fixed=True)
    assert _fit_is_finite(model, dataset)


# --------------------------------------------------------------------------------------
# A 0/0 normalisation of a batch (batch before map)
# --------------------------------------------------------------------------------------


def standardize(x, y):
    mean = tf.reduce_mean(x, axis=0)
    std = tf.math.reduce_std(x, axis=0)
    return tf.math.divide(x - mean, std), y  # featurewise


def standardize_fixed(x, y):
    mean = tf.reduce_mean(x, axis=0)
    std = tf.math.reduce_std(x, axis=0)
    return tf.math.divide_no_nan(x - mean, std), y  # the remedy, as printed


def _digits(normalise):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(1)
    images = rng.uniform(0, 255, size=(64, 6)).astype("float32")
    images[:, 0] = 0.0  # a border pixel that is 0 in every image
    labels = rng.integers(0, 3, size=(64,))
    dataset = tf.data.Dataset.from_tensor_slices((images, labels)).batch(16).map(normalise)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)], name="digits")
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, dataset


def test_a_zero_spread_normalisation_of_batches_is_named_at_its_division():
    """keras-team/keras#1880 (https://github.com/keras-team/keras/issues/1880).

    ``ImageDataGenerator``'s normalisation divided by the pixels' standard deviation
    without a check that it is not 0; on MNIST a border pixel is 0 in every image, and
    ``0 / 0`` is NaN. Rebuilt as a ``tf.data`` pipeline that batches, then normalises.
    """
    model, dataset = _digits(standardize)
    d = diagnose(model, dataset)
    assert (d.phase, d.op, d.cause) == ("input", "RealDiv", "nonfinite_input"), str(d)
    assert d.source == f"{HERE}:{line_of('featurewise')}"
    assert "made non-finite by RealDiv in the input pipeline's map, standardize: 4 of the 4 elements it read are " \
        "finite before it and not after it (1 of 6 denominators of RealDiv are exactly 0)" in d.inputs_summary
    assert "denominators of RealDiv are exactly 0" in d.inputs_summary, d.inputs_summary
    assert d.remedy == (f"at test_doctor_field_input.py:{line_of('featurewise')}: x / y -> "
                        "tf.math.divide_no_nan(x, y) (0 where y == 0, and a zero gradient there)"), d.remedy
    assert d.verified.startswith("verified: the map function's values are finite"), d.verified
    model, dataset = _digits(standardize_fixed)
    assert _fit_is_finite(model, dataset)


# --------------------------------------------------------------------------------------
# A py_function in a map, among several maps
# --------------------------------------------------------------------------------------


def _window_ratio(window):
    return window / window[0] - 1.0  # py-window


def _window_ratio_fixed(window):
    return tf.math.divide_no_nan(window, window[0]) - 1.0


def _windows(ratio):
    def normalise(window, target):
        x = tf.py_function(ratio, [window], tf.float32)
        return tf.ensure_shape(x, [5]), target

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(2)
    series = rng.uniform(1, 50, size=(40, 5)).astype("float32")
    series[22, 0] = 0.0  # a window that starts at a price of 0
    dataset = (tf.data.Dataset.from_tensor_slices((series, series[:, -1:]))
               .map(lambda w, t: (w, t / 50.0)).map(normalise).batch(8))
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)], name="lstm")
    model.compile(optimizer="adam", loss="mse")
    return model, dataset


def test_a_division_inside_a_py_function_in_a_map_is_named_at_its_line():
    """jaungiers/LSTM-Neural-Network-for-Time-Series-Prediction#66
    (https://github.com/jaungiers/LSTM-Neural-Network-for-Time-Series-Prediction/issues/66).

    Each window is normalised by its first value, ``p / p[0] - 1``; a series with zeros
    divides by 0. Rebuilt with the normalisation in a ``tf.py_function`` inside the
    second of two maps: the op and line are those inside the Python function.
    """
    model, dataset = _windows(_window_ratio)
    d = diagnose(model, dataset)
    assert (d.phase, d.op, d.cause, d.batch) == ("input", "RealDiv", "nonfinite_input", 2), str(d)
    assert d.source == f"{HERE}:{line_of('py-window')}", d.source
    assert "map 2 of 2" in d.inputs_summary
    assert d.remedy.startswith(f"at test_doctor_field_input.py:{line_of('py-window')}: x / y -> "
                               "tf.math.divide_no_nan(x, y)"), d.remedy
    assert d.verified.startswith("verified:"), d.verified
    model, dataset = _windows(_window_ratio_fixed)
    assert _fit_is_finite(model, dataset)


def test_a_nan_in_the_data_itself_names_no_pipeline_line():
    """A NaN that is in the arrays before any map keeps the rows' remedy and names no line."""
    x = np.ones((16, 3), "float32")
    x[3, 1] = np.nan
    dataset = tf.data.Dataset.from_tensor_slices((x, np.ones((16, 1), "float32"))).map(lambda a, b: (a * 2.0, b))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    d = diagnose(model, dataset.batch(8))
    assert (d.cause, d.op, d.source) == ("nonfinite_input", None, None), str(d)
    assert d.remedy.startswith("drop or impute row 3 of the batch")
