"""``train`` against ``fit`` on the same weights and batches, for each item of issue 21.

Each test builds the same model twice from one seed, runs ``fit`` on one and ``train``
(with the same arguments) on the other, and compares what matters: the weights, the
``History`` (``.history``, ``.epoch``, ``.params``), what callbacks saw. The
MirroredStrategy items run in a fresh process (two logical CPU devices).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from companion.training import TrainingHistory, train

RNG = np.random.default_rng(0)
X = RNG.normal(size=(48, 3)).astype("float32")
Y = (X @ np.array([[1.0], [2.0], [-1.0]], "float32")).astype("float32")


def mlp(**dense):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh", **dense), keras.layers.Dense(1)])


def both(build, compile_args, fit_args):
    """(fit's model and History, train's model and TrainingHistory) from the same start."""
    a, b = build(), build()
    b.set_weights(a.get_weights())
    a.compile(**compile_args())
    b.compile(**compile_args())
    history_a = a.fit(**fit_args())
    history_b = train(b, **fit_args())
    return (a, history_a), (b, history_b)


def assert_same_run(fit_run, train_run):
    (a, ha), (b, hb) = fit_run, train_run
    assert isinstance(hb, keras.callbacks.History) and isinstance(hb, TrainingHistory)
    assert b.history is hb
    assert hb.epoch == ha.epoch
    assert hb.params == ha.params
    assert sorted(hb.history) == sorted(ha.history)
    for key in ha.history:
        np.testing.assert_allclose(np.asarray(hb.history[key]), np.asarray(ha.history[key]), rtol=1e-6, atol=1e-7)
    for u, v in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(v, u, rtol=1e-6, atol=1e-7)


FIT_ARGUMENTS = {
    "arrays-batch-size-shuffle": dict(x=X, y=Y, batch_size=8, epochs=2, shuffle=True),
    "validation-split-freq-batch": dict(
        x=X, y=Y, batch_size=8, epochs=3, validation_split=0.25, validation_freq=2, validation_batch_size=4,
        shuffle=False,
    ),
    "initial-epoch": dict(x=X, y=Y, batch_size=16, epochs=3, initial_epoch=1, shuffle=False),
    "steps-per-epoch-infinite-data": dict(
        x=tf.data.Dataset.from_tensor_slices((X, Y)).batch(8).repeat(), steps_per_epoch=4, epochs=2,
        validation_data=tf.data.Dataset.from_tensor_slices((X, Y)).batch(8).repeat(), validation_steps=2,
    ),
    "sample-weight": dict(x=X, y=Y, sample_weight=np.linspace(0.1, 1.0, 48).astype("float32"), batch_size=8),
}


@pytest.mark.parametrize("name", sorted(FIT_ARGUMENTS))
def test_fit_arguments_act_as_in_fit(name):
    # keras.utils.set_random_seed in mlp() makes fit's and train's shuffles the same.
    def fit_args():
        keras.utils.set_random_seed(1)
        return dict(FIT_ARGUMENTS[name], verbose=0)

    compile_args = lambda: dict(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])  # noqa: E731
    assert_same_run(*both(mlp, compile_args, fit_args))


def test_class_weight_weighted_metrics_and_steps_per_execution_act_as_in_fit():
    labels = (X[:, 0] > 0).astype("int32")

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, activation="softmax")])

    compile_args = lambda: dict(  # noqa: E731
        optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
        metrics=["accuracy"], weighted_metrics=["accuracy"], steps_per_execution=3,
    )
    fit_args = lambda: dict(x=X, y=labels, batch_size=8, epochs=2, class_weight={0: 1.0, 1: 3.0}, verbose=0, shuffle=False)  # noqa: E731,E501
    assert_same_run(*both(build, compile_args, fit_args))


def test_dict_losses_and_add_loss_only_models_train_as_with_fit():
    def build():
        keras.utils.set_random_seed(0)
        i = keras.Input((3,))
        return keras.Model(i, {"a": keras.layers.Dense(1, name="a")(i),
                               "b": keras.layers.Dense(2, activation="softmax", name="b")(i)})

    labels = np.eye(2, dtype="float32")[(X[:, 0] > 0).astype(int)]
    compile_args = lambda: dict(optimizer=keras.optimizers.SGD(0.05),  # noqa: E731
                                loss={"a": "mse", "b": "categorical_crossentropy"}, loss_weights={"a": 1.0, "b": 0.5})
    fit_args = lambda: dict(x=X, y={"a": Y, "b": labels}, batch_size=8, epochs=2, verbose=0, shuffle=False)  # noqa: E731
    assert_same_run(*both(build, compile_args, fit_args))

    class OnlyAddLoss(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            out = self.dense(x)
            self.add_loss(keras.ops.mean(keras.ops.square(out - 1.0)))
            return out

    def build_add_loss():
        keras.utils.set_random_seed(0)
        model = OnlyAddLoss()
        model.build((None, 3))
        return model

    compile_args = lambda: dict(optimizer=keras.optimizers.SGD(0.05))  # noqa: E731
    fit_args = lambda: dict(x=X, batch_size=8, epochs=2, verbose=0, shuffle=False)  # noqa: E731
    assert_same_run(*both(build_add_loss, compile_args, fit_args))


def test_a_compute_loss_override_runs_and_a_model_without_trainable_variables_is_a_no_op():
    class HalfLoss(keras.Sequential):
        def compute_loss(self, *args, **kwargs):
            return 0.5 * super().compute_loss(*args, **kwargs)

    def build():
        keras.utils.set_random_seed(0)
        return HalfLoss([keras.Input((3,)), keras.layers.Dense(1)])

    compile_args = lambda: dict(optimizer=keras.optimizers.SGD(0.05), loss="mse")  # noqa: E731
    fit_args = lambda: dict(x=X, y=Y, batch_size=8, epochs=2, verbose=0, shuffle=False)  # noqa: E731
    assert_same_run(*both(build, compile_args, fit_args))

    def frozen():
        model = mlp()
        model.trainable = False
        return model

    (a, ha), (b, hb) = both(frozen, lambda: dict(optimizer="sgd", loss="mse"), fit_args)
    assert hb.skipped == [] and sorted(hb.history) == sorted(ha.history)
    for u, v in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_array_equal(u, v)


def test_a_non_scalar_validation_metric_is_logged_as_fit_logs_it():
    labels = np.eye(3, dtype="float32")[np.arange(48) % 3]

    def build():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(3, activation="softmax")])

    compile_args = lambda: dict(optimizer=keras.optimizers.SGD(0.1), loss="categorical_crossentropy",  # noqa: E731
                                metrics=[keras.metrics.F1Score()])
    fit_args = lambda: dict(x=X, y=labels, batch_size=8, epochs=2, validation_data=(X, labels), verbose=0,  # noqa: E731
                            shuffle=False)
    assert_same_run(*both(build, compile_args, fit_args))


class CountBatches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(batch)


def test_batch_hooks_run_every_steps_per_execution_steps_as_in_fit(tmp_path):
    runs = []
    for runner in ("fit", "train"):
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=2)
        counter = CountBatches()
        saver = keras.callbacks.ModelCheckpoint(str(tmp_path / runner / "{batch}.weights.h5"), save_freq=1,
                                                save_weights_only=True)
        os.makedirs(tmp_path / runner)
        arguments = dict(x=X, y=Y, batch_size=4, epochs=1, callbacks=[counter, saver], verbose=0, shuffle=False)
        model.fit(**arguments) if runner == "fit" else train(model, **arguments)
        runs.append((counter.ends, sorted(os.listdir(tmp_path / runner))))
    assert runs[0] == runs[1]
    assert len(runs[0][0]) == 6  # 12 batches, 2 per host call


def test_backup_and_restore_resumes_after_the_interrupted_epoch_as_in_fit(tmp_path):
    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    iterations = []
    for runner in ("fit", "train"):
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / runner))
        run = model.fit if runner == "fit" else (lambda **kw: train(model, **kw))
        arguments = dict(x=X, y=Y, batch_size=16, epochs=6, verbose=0, shuffle=False)
        with pytest.raises(RuntimeError, match="interrupted"):
            run(callbacks=[backup, Interrupt()], **arguments)
        history = run(callbacks=[backup], **arguments)
        iterations.append((int(model.optimizer.iterations), history.epoch))
    assert iterations[0] == iterations[1]
    # 3 batches x 6 epochs: the resumed run starts after the two backed-up epochs (before
    # issue 21 train ran every epoch again: 3 x (2 + 6) = 24).
    assert iterations[1] == (18, [2, 3, 4, 5])


def test_logs_keys_and_csv_columns_equal_fits_and_skips_are_reported_elsewhere(tmp_path):
    poisoned = X.copy()
    poisoned[9, 0] = np.nan  # batch 1 of each epoch
    logs = {}
    for runner in ("fit", "train"):
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mae"])
        path = tmp_path / f"{runner}.csv"
        arguments = dict(x=poisoned if runner == "train" else X, y=Y, batch_size=8, epochs=2, verbose=0,
                         shuffle=False, validation_data=(X, Y), callbacks=[keras.callbacks.CSVLogger(str(path))])
        history = model.fit(**arguments) if runner == "fit" else train(model, **arguments)
        logs[runner] = (sorted(history.history), path.read_text().splitlines()[0])
    assert logs["fit"] == logs["train"]
    assert history.skipped == [1, 7]
    assert all(np.isfinite(v) for values in history.history.values() for v in values)


MIRRORED = textwrap.dedent(
    r"""
    import json, sys
    import numpy as np, tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    from companion.training import train
    order = sys.argv[1]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 3)).astype("float32"); y = x.sum(1, keepdims=True)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    result = {}
    for runner in order.split(","):
        strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])  # a new one per run
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(
                1, kernel_initializer="ones", kernel_regularizer=keras.regularizers.L2(0.1))])
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        run = model.fit if runner == "fit" else (lambda **kw: train(model, **kw))
        history = run(x=data, epochs=2, verbose=0)
        result.setdefault(runner, []).append(
            {"kernel": model.get_weights()[0].ravel().tolist(), "loss": history.history["loss"]})
    print(json.dumps(result))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["fit,train", "train,fit"])
def test_under_mirrored_strategy_train_equals_fit_with_regularisation_and_they_mix(order):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", MIRRORED, order], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    fit, trained = result["fit"][0], result["train"][0]
    # Keras since 3.8 divides the regulariser by the replica count too; train computes the
    # loss as fit does, so the regulariser acts with its full weight in both.
    np.testing.assert_allclose(trained["kernel"], fit["kernel"], rtol=1e-6)
    np.testing.assert_allclose(trained["loss"], fit["loss"], rtol=1e-6)
