"""NaNDoctor under `fit` runs the guarded step: the state before the failing step is the
state after it, whatever the model, and the batch diagnosed is the one `fit` trained on.

Two public reports rebuilt: weights created in the model's first step (a subclassed model
built lazily, keras-team/keras#19300-style; the doctor once restored them to zeros or to
their post-step values), and a `tf.data` pipeline that reshuffles every epoch (the doctor
once read it again and diagnosed another batch than the one `fit` failed on).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from companion.diagnostics import NaNDoctor
from companion.training.step import GUARDED


class Lazy(keras.Model):
    """A subclassed model whose weights are created by its first call (in fit's first step)."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(tf.math.log(x)))  # log of a 0 in the data: -inf


def _lazy(seed=0):
    keras.utils.set_random_seed(seed)
    model = Lazy()
    model.compile(loss="mse", optimizer=keras.optimizers.Adam(0.01))
    return model


def test_a_lazily_built_model_keeps_exactly_the_state_before_the_failing_step():
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 2.0, size=(48, 3)).astype("float32")
    y = rng.normal(size=(48, 1)).astype("float32")
    x[35, 1] = 0.0  # batch 2 (rows 32-47) is the first with a log of 0
    doctor = NaNDoctor(verbose=False)
    watched = _lazy()
    watched.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[doctor])
    plain = _lazy()
    plain.fit(x[:32], y[:32], batch_size=16, epochs=1, shuffle=False, verbose=0)  # the two good steps

    assert doctor.batch == (0, 2) and doctor.diagnosis is not None and doctor.diagnosis.batch == 2
    for a, b in zip(watched.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert [int(v.numpy()) for v in (watched.optimizer.iterations,)] == [2]
    assert watched not in GUARDED and "train_step" not in vars(watched)  # fit's own step again


def test_a_reshuffling_pipeline_is_diagnosed_on_the_batch_fit_trained_on():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 4)).astype("float32")
    x[45, 2] = np.nan
    y = x.sum(axis=1, keepdims=True)
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=3, reshuffle_each_iteration=True).batch(8)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer="sgd")
    doctor = NaNDoctor(verbose=False)
    model.fit(data, epochs=1, verbose=0, callbacks=[doctor])

    d = doctor.diagnosis
    assert d is not None and d.cause == "nonfinite_input"
    batch_x = np.asarray(d._capsule["batch"][0])
    assert np.isnan(batch_x).any(), "the diagnosed batch is not the one fit failed on"
    # The row the diagnosis names is the poisoned row of x, where fit's shuffle put it.
    row = int(np.flatnonzero(np.isnan(batch_x).any(axis=1))[0])
    np.testing.assert_array_equal(np.nan_to_num(batch_x[row]), np.nan_to_num(x[45]))
    assert f"row {row}" in d.inputs_summary
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_the_doctor_stays_out_of_the_way_of_train_which_guards_and_diagnoses_itself():
    from companion.training import train

    rng = np.random.default_rng(2)
    x = rng.normal(size=(32, 2)).astype("float32")
    x[20] = np.nan
    doctor = NaNDoctor(verbose=False)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    history = train(model, x, x[:, :1], batch_size=8, shuffle=False, loss="mse", optimizer="sgd", verbose=0,
                    callbacks=[doctor])
    assert history.skipped == [2] and doctor.diagnosis is None
    assert history.reports[0].diagnosis is not None


def test_a_recurrent_model_keeps_the_deferred_update_under_the_doctor():
    # An LSTM's loop reads its kernel inside a While op: a read, not a write.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(4), keras.layers.Dense(1)])
    model.compile(loss="mse", optimizer="adam")
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(32, 5, 3)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")
    doctor = NaNDoctor(verbose=False)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[doctor])
    assert doctor.diagnosis is None and doctor._guard is not None and doctor._guard.mode == "deferred"


def test_restore_weights_false_applies_the_failing_step_as_fit_would_have():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(32, 2)).astype("float32")
    x[20] = np.nan  # batch 2 of 8 rows
    y = x[:, :1].copy()
    keras.utils.set_random_seed(0)
    watched = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    watched.compile(loss="mse", optimizer="sgd")
    doctor = NaNDoctor(verbose=False, restore_weights=False)
    watched.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[doctor])
    keras.utils.set_random_seed(0)
    plain = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    plain.compile(loss="mse", optimizer="sgd")
    plain.fit(x[:24], y[:24], batch_size=8, epochs=1, shuffle=False, verbose=0)  # up to the NaN step

    assert doctor.batch == (0, 2) and doctor.diagnosis is not None
    for a, b in zip(watched.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    assert not all(np.isfinite(w).all() for w in watched.get_weights())  # the NaN step applied


def _wide(seed=0):
    """300 x 300 weights (more than SELECT_LIMIT entries: the doctor's step tests them
    through their norm first), zero at the start."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((300,)),
                              keras.layers.Dense(300, use_bias=False, kernel_initializer="zeros"),
                              keras.layers.Lambda(lambda h: tf.reduce_sum(h, axis=1, keepdims=True))])
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(1e-30))
    return model


def test_finite_gradients_whose_norm_overflows_are_a_finite_step_for_the_doctor():
    # Every entry of the kernel's gradient is -2e18, finite; the sum of their 90 000
    # squares overflows float32: the doctor falls back on the entries, as fit would count it.
    x, y = np.ones((2, 300), "float32"), np.full((2, 1), 1e18, "float32")
    model = _wide()
    doctor = NaNDoctor(verbose=False)
    model.fit(x, y, batch_size=1, epochs=1, shuffle=False, verbose=0, callbacks=[doctor])
    assert doctor.diagnosis is None and doctor._guard is not None and doctor._guard.mode == "deferred"
    assert int(model.optimizer.iterations.numpy()) == 2
    kernel = model.get_weights()[0]
    assert np.isfinite(kernel).all() and (kernel > 0).all()  # both steps applied


def test_a_nan_gradient_of_a_large_variable_under_a_finite_loss_is_caught_by_the_doctor():
    # sqrt(|0|) is finite; its gradient is inf * 0 = NaN in every entry of the kernel.
    model = _wide()
    model.layers[-1].function = lambda h: tf.sqrt(tf.abs(tf.reduce_sum(h, axis=1, keepdims=True)))
    x, y = np.ones((2, 300), "float32"), np.ones((2, 1), "float32")
    doctor = NaNDoctor(verbose=False)
    model.fit(x, y, batch_size=1, epochs=1, shuffle=False, verbose=0, callbacks=[doctor])
    assert doctor.batch == (0, 0) and doctor.diagnosis is not None
    assert int(model.optimizer.iterations.numpy()) == 0
    np.testing.assert_array_equal(model.get_weights()[0], 0.0)  # the NaN step put back
