"""train keeps Keras' contracts: what works with ``model.fit`` works with ``train``, with the same numbers.

Every comparison runs ``fit`` and ``train`` from the same initial weights (the same
seed) on the same batches, in the same order, and compares the final weights and every
logged number (``History.history`` against ``TrainingHistory.history``).
"""

from __future__ import annotations

import csv
import math
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from companion.optimizers import SkipNonFinite
from companion.training import train

TOLERANCE = 1e-5
RNG = np.random.default_rng(0)
N = 48
BATCH = 8


def _regression():
    x = RNG.normal(size=(N, 3)).astype("float32")
    return x, (x @ np.array([[1.0], [2.0], [-1.0]], "float32")).astype("float32")


X, Y = _regression()
W = RNG.uniform(0.5, 2.0, size=(N,)).astype("float32")


class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.head = keras.layers.Dense(1)

    def call(self, inputs):
        return self.head(self.hidden(inputs))


def _sequential():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])


def _functional_two_inputs():
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    merged = keras.layers.Concatenate()([keras.layers.Dense(4, activation="relu")(a), b])
    return keras.Model({"a": a, "b": b}, keras.layers.Dense(1)(merged))


def _two_outputs():
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    return keras.Model(
        inputs, {"value": keras.layers.Dense(1, name="value")(hidden), "label": keras.layers.Dense(1, name="label")(hidden)}
    )


def _cnn():
    return keras.Sequential(
        [
            keras.Input((6, 6, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Flatten(),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(1),
        ]
    )


def _lstm():
    return keras.Sequential(
        [keras.Input((5,), dtype="int32"), keras.layers.Embedding(10, 4), keras.layers.LSTM(6), keras.layers.Dense(1)]
    )


#: name -> (model factory, dataset, compile arguments)
CASES = {
    "sequential-mlp": (_sequential, lambda: tf.data.Dataset.from_tensor_slices((X, Y)), {"loss": "mse"}),
    "functional-two-inputs": (
        _functional_two_inputs,
        lambda: tf.data.Dataset.from_tensor_slices(({"a": X, "b": X[:, :2]}, Y)),
        {"loss": "mse"},
    ),
    "two-outputs-loss-dict": (
        _two_outputs,
        lambda: tf.data.Dataset.from_tensor_slices((X, {"value": Y, "label": (Y > 0).astype("float32")})),
        {
            "loss": {"value": "mse", "label": keras.losses.BinaryCrossentropy(from_logits=True)},
            "loss_weights": {"value": 1.0, "label": 0.5},
            "metrics": {"label": ["accuracy"]},
        },
    ),
    "subclassed": (Subclassed, lambda: tf.data.Dataset.from_tensor_slices((X, Y)), {"loss": "mae"}),
    "cnn-batchnorm-dropout": (
        _cnn,
        lambda: tf.data.Dataset.from_tensor_slices(
            (RNG.normal(size=(N, 6, 6, 1)).astype("float32"), Y)
        ),
        {"loss": "mse"},
    ),
    "embedding-lstm": (
        _lstm,
        lambda: tf.data.Dataset.from_tensor_slices((RNG.integers(0, 10, size=(N, 5)).astype("int32"), Y)),
        {"loss": "mse"},
    ),
}
OPTIMIZERS = {"SGD": lambda: keras.optimizers.SGD(0.02, momentum=0.5), "Adam": lambda: keras.optimizers.Adam(0.01)}


def _fit_and_train(make_model, dataset, compile_args, make_optimizer, *, epochs=2, **fit_args):
    keras.utils.set_random_seed(0)
    reference = make_model()
    keras.utils.set_random_seed(0)
    candidate = make_model()
    reference.compile(optimizer=make_optimizer(), **compile_args)  # jit_compile="auto", as train
    fitted = reference.fit(dataset, epochs=epochs, verbose=0, shuffle=False, **fit_args)
    keras.utils.set_random_seed(0)  # the same dropout stream as fit's
    trained = train(candidate, dataset, optimizer=make_optimizer(), epochs=epochs, verbose=0, **compile_args, **fit_args)
    return reference, fitted.history, candidate, trained


def _assert_same(reference, fitted, candidate, trained, *, tolerance=TOLERANCE):
    for a, b in zip(reference.get_weights(), candidate.get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=tolerance, atol=tolerance)
    assert set(fitted) <= set(trained.history), (sorted(fitted), sorted(trained.history))
    for key, values in fitted.items():
        np.testing.assert_allclose(trained.history[key], values, rtol=tolerance, atol=tolerance, err_msg=key)


@pytest.mark.parametrize("make_optimizer", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
@pytest.mark.parametrize("case", CASES)
def test_train_equals_fit_on_the_same_weights_and_batches(case, make_optimizer):
    make_model, make_data, compile_args = CASES[case]
    data = make_data()
    dataset = data.batch(BATCH)
    validation = data.take(16).batch(BATCH)
    reference, fitted, candidate, trained = _fit_and_train(
        make_model, dataset, compile_args, make_optimizer, validation_data=validation
    )
    assert trained.skipped == [] and any(key.startswith("val_") for key in trained.history)
    _assert_same(reference, fitted, candidate, trained)


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda: keras.optimizers.SGD(0.05, loss_scale_factor=128.0),
        lambda: keras.optimizers.SGD(0.05, use_ema=True, ema_momentum=0.5),
        lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.5),
        lambda: keras.optimizers.SGD(0.05, gradient_accumulation_steps=2),
    ],
    ids=["loss_scale_factor", "use_ema", "global_clipnorm", "gradient_accumulation_steps"],
)
def test_sample_weights_and_the_optimizers_own_options_act_as_in_fit(make_optimizer):
    dataset = tf.data.Dataset.from_tensor_slices((X, Y, W)).batch(BATCH)
    reference, fitted, candidate, trained = _fit_and_train(
        _sequential, dataset, {"loss": "mse", "metrics": ["mae"]}, make_optimizer
    )
    _assert_same(reference, fitted, candidate, trained)


def test_a_users_loss_may_read_extra_target_columns():
    def masked_mse(y_true, y_pred):  # y_true = [target, mask]
        target, mask = y_true[:, :1], y_true[:, 1:]
        return tf.reduce_sum(mask * tf.square(target - y_pred), axis=-1)

    targets = np.concatenate([Y, (RNG.uniform(size=(N, 1)) > 0.3).astype("float32")], axis=1)
    dataset = tf.data.Dataset.from_tensor_slices((X, targets)).batch(BATCH)
    reference, fitted, candidate, trained = _fit_and_train(
        _sequential, dataset, {"loss": masked_mse}, lambda: keras.optimizers.SGD(0.05)
    )
    _assert_same(reference, fitted, candidate, trained)


def test_a_keras_elementwise_loss_still_refuses_targets_that_broadcast_wrongly():
    dataset = tf.data.Dataset.from_tensor_slices((X, np.repeat(Y, 2, axis=1))).batch(BATCH)
    with pytest.raises(ValueError, match=r"prediction shape \(None, 1\) does not match target shape \(None, 2\)"):
        train(_sequential(), dataset, loss="mse", optimizer=keras.optimizers.SGD(), verbose=0)


def _poisoned():
    x = X.copy()
    x[BATCH + 2, 0] = np.nan  # batch 1
    return tf.data.Dataset.from_tensor_slices((x, Y)).batch(BATCH)


def test_a_skipped_step_does_not_poison_the_metrics_or_the_validation():
    model = _sequential()
    history = train(
        model, _poisoned(), loss="mse", optimizer=keras.optimizers.Adam(0.01), metrics=["mae"], epochs=2,
        validation_data=(X[:16], Y[:16]), callbacks=[keras.callbacks.TerminateOnNaN()], verbose=0,
    )
    assert history.skipped == [1, 7] and "skipped" not in history.history  # not a log key
    assert history.epochs == 2  # TerminateOnNaN never fires: the logged loss is of applied steps
    for key in ("loss", "mae", "val_loss", "val_mae"):
        assert all(math.isfinite(v) for v in history.history[key]), key
    # The epoch's loss is fit's mean over the applied steps' batches (weighted by size).
    applied = [loss for i, loss in enumerate(history.step_loss[:6]) if i != 1]
    assert history.history["loss"][0] == pytest.approx(np.mean(applied), rel=1e-5)


def test_terminate_on_nan_stops_an_unguarded_run_as_it_stops_fit():
    history = train(
        _sequential(), _poisoned(), loss="mse", optimizer=keras.optimizers.SGD(0.01), epochs=3,
        callbacks=[keras.callbacks.TerminateOnNaN()], on_nonfinite="ignore", verbose=0,
    )
    assert history.epochs == 1 and not math.isfinite(history.history["loss"][0])


def test_early_stopping_restores_the_best_weights_and_stops():
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH)
    stopper = keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=10.0, restore_best_weights=True)
    best = {}

    class Snapshot(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                best["weights"] = self.model.get_weights()

    model = _sequential()
    history = train(model, dataset, loss="mse", optimizer=keras.optimizers.SGD(0.05), epochs=10,
                    callbacks=[Snapshot(), stopper], verbose=0)
    assert history.epochs == 2 and stopper.stopped_epoch == 1
    for restored, saved in zip(model.get_weights(), best["weights"]):
        np.testing.assert_array_equal(restored, saved)


def test_model_checkpoint_csv_logger_lr_schedule_and_plateau(tmp_path):
    def callbacks(directory):
        directory.mkdir()
        return [
            keras.callbacks.ModelCheckpoint(str(directory / "epoch{epoch}.keras")),
            keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 / (epoch + 1)),
            keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=1e9),
            keras.callbacks.CSVLogger(str(directory / "log.csv")),  # last: it sees what the others log
        ]

    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH)
    keras.utils.set_random_seed(0)
    reference = _sequential()
    reference.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    fitted = reference.fit(dataset, epochs=3, verbose=0, shuffle=False, callbacks=callbacks(tmp_path / "fit")).history
    keras.utils.set_random_seed(0)
    model, optimizer = _sequential(), keras.optimizers.SGD(0.05)
    history = train(model, dataset, loss="mse", optimizer=optimizer, metrics=["mae"], epochs=3,
                    callbacks=callbacks(tmp_path / "train"), verbose=0)
    _assert_same(reference, fitted, model, history)
    # The learning rate of each epoch (the schedule's), logged as fit logs it; the plateau halved the last.
    assert history.history["learning_rate"] == pytest.approx([0.05, 0.025, 0.05 / 3])
    assert float(optimizer.learning_rate) == pytest.approx(0.05 / 3 / 2)
    directory = tmp_path / "train"
    assert sorted(p.name for p in directory.glob("*.keras")) == ["epoch1.keras", "epoch2.keras", "epoch3.keras"]
    restored = keras.models.load_model(directory / "epoch3.keras")
    for a, b in zip(restored.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    with open(directory / "log.csv") as file:
        rows = list(csv.DictReader(file))
    with open(tmp_path / "fit" / "log.csv") as file:
        fit_rows = list(csv.DictReader(file))
    assert [float(r["loss"]) for r in rows] == pytest.approx([float(r["loss"]) for r in fit_rows], rel=1e-5)
    # The same columns as fit's (skipped steps are reported in the history, not logged).
    assert set(rows[0]) == set(fit_rows[0])
    assert model.history.history["loss"] == history.history["loss"]


def test_progress_bar_is_keras_progbar_logger(capsys):
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH)
    train(_sequential(), dataset, loss="mse", optimizer=keras.optimizers.SGD(0.01), epochs=2, verbose=1)
    out = capsys.readouterr().out
    assert "Epoch 1/2" in out and "Epoch 2/2" in out and f"{N // BATCH}/{N // BATCH}" in out and "loss:" in out


def test_stop_training_set_by_a_callback_ends_training_after_the_host_call():
    class StopAfterFirstEpoch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.stop_training = True

    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH)
    history = train(_sequential(), dataset, loss="mse", optimizer=keras.optimizers.SGD(0.01), epochs=5,
                    callbacks=[StopAfterFirstEpoch()], verbose=0)
    assert history.epochs == 1


def _dataset(**kwargs):
    return tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH)


#: Arguments train used to check itself and now hands to compile and fit (the removed
#: checks of the old train's BAD_INPUTS): (arguments, model, data, raises; None: as fit
#: does on this Keras).
HANDED_TO_FIT = [
    ({"metrics": ["no_such_metric"]}, _sequential, _dataset, True),
    ({"validation_data": [1, 2, 3, 4]}, _sequential, _dataset, True),
    # (Keras 3.5 accepts a dict for a model with one input, later Keras refuses it.)
    ({"validation_data": ({"a": X}, Y)}, _sequential, _dataset, None),
    ({"validation_data": (X[:, :2], Y)}, _sequential, _dataset, True),
    ({"loss": {"nope": "mse"}}, _sequential, _dataset, True),
    ({"loss": {"value": "mse", "score": "mse"}}, _two_outputs,
     lambda: tf.data.Dataset.from_tensor_slices((X, {"value": Y, "label": Y})).batch(BATCH), True),
    ({"loss": "no_such_loss"}, _sequential, _dataset, True),
    ({"loss": 3}, _sequential, _dataset, True),
    ({"loss_weights": ["heavy"]}, _sequential, _dataset, True),
    ({"epochs": 1.5}, _sequential, _dataset, True),
    ({}, _sequential, lambda: tf.data.Dataset.from_tensor_slices(X).batch(BATCH), True),
    ({}, _sequential, lambda: tf.data.Dataset.from_tensor_slices((X, Y, Y, Y)).batch(BATCH), True),
    ({}, _sequential, lambda: 42, True),
    # Accepted by fit, so by train: an empty dataset, no epoch to run, an optimizer by name.
    ({}, _sequential, lambda: _dataset().take(0), False),
    ({"epochs": 0}, _sequential, _dataset, False),
    ({"optimizer": "adam"}, _sequential, _dataset, False),
]


@pytest.mark.parametrize("arguments, make_model, make_data, raises", HANDED_TO_FIT, ids=lambda v: None)
def test_keras_arguments_raise_or_pass_as_compile_and_fit_treat_them(arguments, make_model, make_data, raises):
    # train hands compile's and fit's arguments to compile and fit: the same outcome
    # (the error's type, and whether any step changed the weights before it).
    compile_names = {"metrics", "loss", "loss_weights", "optimizer"}
    outcomes = []
    for runner in ("fit", "train"):
        keras.utils.set_random_seed(0)
        model = make_model()
        before = [w.copy() for w in model.get_weights()]
        options = {"loss": "mse", "optimizer": keras.optimizers.SGD(0.1), **arguments}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if runner == "fit":
                    model.compile(**{k: v for k, v in options.items() if k in compile_names})
                    model.fit(make_data(), verbose=0, **{k: v for k, v in options.items() if k not in compile_names})
                else:
                    train(model, make_data(), verbose=0, **options)
        except Exception as error:  # noqa: BLE001 - the type is what is compared
            outcomes.append((type(error), all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))))
        else:
            outcomes.append((None, all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))))
    assert outcomes[0] == outcomes[1]
    if raises is not None:
        assert (outcomes[1][0] is not None) == raises, outcomes


@pytest.mark.parametrize(
    "arguments, error, message",
    [
        ({"callbacks": [lambda logs: None]}, TypeError, "callbacks must be keras.callbacks.Callback instances"),
        ({"callbacks": keras.callbacks.TerminateOnNaN()}, TypeError, "callbacks must be a list"),
        ({"on_nonfinite": "later"}, ValueError, "on_nonfinite must be one of"),
        ({"clip_global_norm": -1.0}, ValueError, "clip_global_norm"),
    ],
    ids=lambda v: None,
)
def test_bad_guard_arguments_raise_before_any_step(arguments, error, message):
    model = _sequential()
    before = [w.copy() for w in model.get_weights()]
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH)
    with pytest.raises(error, match=message):
        train(model, dataset, **{"loss": "mse", "optimizer": keras.optimizers.SGD(0.1), "verbose": 0, **arguments})
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_skip_nonfinite_refuses_arguments_it_does_not_support():
    with pytest.raises(ValueError, match=r"does not support arguments \['learning_rate'\]"):
        SkipNonFinite(keras.optimizers.SGD(), learning_rate=0.1)
    with pytest.raises(ValueError, match=r"does not support arguments \['clipnorm'\]"):
        SkipNonFinite(keras.optimizers.SGD(), clipnorm=None)


def test_skip_nonfinite_round_trips_through_a_keras_file_with_its_state(tmp_path):
    model = _sequential()
    model.compile(optimizer=SkipNonFinite(keras.optimizers.Adam(0.01)), loss="mse")
    model.fit(_poisoned(), epochs=1, verbose=0, shuffle=False)
    assert int(model.optimizer.skipped_steps) == 1
    model.save(tmp_path / "guarded.keras")
    restored = keras.models.load_model(tmp_path / "guarded.keras")
    assert isinstance(restored.optimizer, SkipNonFinite)
    assert int(restored.optimizer.skipped_steps) == 1
    assert int(restored.optimizer.iterations) == int(model.optimizer.iterations) == N // BATCH - 1
    for a, b in zip(model.optimizer.variables, restored.optimizer.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


