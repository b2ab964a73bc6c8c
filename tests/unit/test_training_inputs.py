"""Bad input to train is refused before the first step, naming the argument (issue 28, point 5).

The errors are of the type fit raises for the same input (ValueError: train hands fit's
arguments on and raises what fit raises, tests/contracts/test_training_keras_contracts.py), with a
message that says what is wrong.

companion.training.inputs.check_targets raises where Keras' fit would fail with a message
that does not say what is wrong (a dataset without targets: "None values not supported.";
one-hot targets for a sparse cross-entropy: a complaint about the predictions' rank), and
lets through everything fit itself accepts: each valid case is also trained by fit here.
"""

from __future__ import annotations

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

from companion.training import inputs, loop, train
from companion.training.inputs import check_targets

ROWS, FEATURES, CLASSES = 32, 4, 3


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype("float32")
    y = rng.normal(size=(ROWS, 1)).astype("float32")
    labels = rng.integers(0, CLASSES, size=(ROWS,))
    return x, y, labels, np.eye(CLASSES, dtype="float32")[labels]


def _mlp(units: int = 1) -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(units)])


def _dict_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((FEATURES,), name="a")
    return keras.Model({"a": inp}, keras.layers.Dense(1)(inp))


def _batched(*parts):
    return tf.data.Dataset.from_tensor_slices(parts if len(parts) > 1 else parts[0]).batch(8)


class OwnStep(keras.Model):
    """An autoencoder-like model whose train_step needs inputs only (as fit allows)."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(FEATURES)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x) - x))
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return {"loss": loss}


# --- refused, with the argument named ------------------------------------------------------


@pytest.mark.parametrize("form", ["tensor", "1-tuple", "dict"])
def test_dataset_of_inputs_without_targets_is_refused_naming_x(form):
    x, _, _, _ = _data()
    model, data = {
        "tensor": (_mlp(), _batched(x)),
        "1-tuple": (_mlp(), tf.data.Dataset.from_tensor_slices((x,)).batch(8)),
        "dict": (_dict_model(), _batched({"a": x})),
    }[form]
    with pytest.raises(ValueError, match=r"^x is a tf\.data\.Dataset that yields inputs without targets.*'mse'"):
        check_targets(model, data, loss="mse")


def test_a_loss_the_model_was_compiled_with_counts_too():
    x, _, _, _ = _data()
    model = _mlp()
    model.compile(optimizer="sgd", loss="mae")
    with pytest.raises(ValueError, match=r"inputs without targets.*'mae'"):
        check_targets(model, _batched(x))


def test_arrays_without_y_are_refused_naming_y():
    x, _, _, _ = _data()
    with pytest.raises(ValueError, match=r"^y is None.*pass the targets as y"):
        check_targets(_mlp(), x, None, loss="mse")


@pytest.mark.parametrize("as_dataset", [True, False], ids=["dataset", "arrays"])
def test_one_hot_targets_for_a_sparse_cross_entropy_are_refused_with_the_loss_they_need(as_dataset):
    x, _, _, one_hot = _data()
    args = (_batched(x, one_hot), None) if as_dataset else (x, one_hot)
    with pytest.raises(ValueError, match=r"targets .*\(None, 3\).*one-hot targets.*'categorical_crossentropy'"):
        check_targets(_mlp(CLASSES), *args, loss="sparse_categorical_crossentropy")


@pytest.mark.parametrize("loss", ["categorical_crossentropy", keras.losses.CategoricalCrossentropy()],
                         ids=["name", "instance"])
def test_integer_labels_for_a_categorical_cross_entropy_are_refused_with_the_loss_they_need(loss):
    x, _, labels, _ = _data()
    with pytest.raises(ValueError, match=r"targets y have shape \(None,\).*'sparse_categorical_crossentropy'"):
        check_targets(_mlp(CLASSES), x, labels, loss=loss)


def test_array_targets_that_would_broadcast_against_the_predictions_are_refused():
    x, y, _, _ = _data()
    with pytest.raises(ValueError, match=r"^the targets y: prediction shape \(None, 1\) does not match"):
        check_targets(_mlp(), x, np.concatenate([y, y], axis=1), loss="mse")


# --- fit's own valid inputs pass ---------------------------------------------------------------


def _valid_cases():
    x, y, labels, one_hot = _data()
    weights = np.ones(ROWS, "float32")
    return {
        "dataset (x, y)": (_mlp, (_batched(x, y),), "mse"),
        "dataset (x, y, w)": (_mlp, (_batched(x, y, weights),), "mse"),
        "dataset ({'a': x}, y)": (_dict_model, (_batched({"a": x}, y),), "mse"),
        "arrays x, y": (_mlp, (x, y), "mse"),
        "arrays, targets (n,)": (_mlp, (x, y[:, 0]), "mse"),
        "sparse labels": (lambda: _mlp(CLASSES), (_batched(x, labels),), "sparse_categorical_crossentropy"),
        "sparse labels (n, 1)": (lambda: _mlp(CLASSES), (x, labels[:, None]), "sparse_categorical_crossentropy"),
        "one-hot, categorical": (lambda: _mlp(CLASSES), (x, one_hot), "categorical_crossentropy"),
    }


@pytest.mark.parametrize("case", list(_valid_cases()))
def test_inputs_fit_accepts_pass_and_fit_trains_on_them(case):
    make, args, loss = _valid_cases()[case]
    check_targets(make(), *args, loss=loss)
    model = make()
    model.compile(optimizer="sgd", loss=loss)
    history = model.fit(*args, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][-1])


def test_a_model_with_its_own_train_step_may_train_on_inputs_alone():
    x, _, _, _ = _data()
    model = OwnStep()
    model.compile(optimizer="sgd", loss="mse")  # a loss its train_step never uses
    check_targets(model, _batched(x), loss="mse")
    check_targets(model, x, None)
    assert np.isfinite(model.fit(_batched(x), epochs=1, verbose=0).history["loss"][-1])


def test_a_model_without_a_compiled_loss_is_not_asked_for_targets():
    x, _, _, _ = _data()
    model = _mlp()
    model.compile(optimizer="sgd")  # e.g. a model that adds its losses with add_loss
    check_targets(model, _batched(x))
    check_targets(model, x)


def test_inputs_that_cannot_be_read_without_consuming_them_are_left_to_fit():
    x, y, _, _ = _data()

    def batches():
        yield x[:8], y[:8]

    check_targets(_mlp(), batches(), loss="mse")


# --- through train, once loop.py calls check_targets ----------------------------------------


@pytest.mark.skipif("check_targets" not in inspect.getsource(loop), reason="train does not call check_targets yet")
def test_train_refuses_a_dataset_without_targets_before_the_first_step():
    x, _, _, _ = _data()
    model = _mlp()
    before = [v.numpy().copy() for v in model.trainable_variables]
    with pytest.raises(ValueError, match=r"^x is a tf\.data\.Dataset that yields inputs without targets"):
        train(model, _batched(x), loss="mse", optimizer=keras.optimizers.SGD(0.1), verbose=0)
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.trainable_variables))


def test_check_targets_docstring_example_runs():
    import doctest

    globs = {**vars(inputs), "keras": keras, "np": np, "tf": tf}
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    for test in doctest.DocTestFinder().find(check_targets, "check_targets", globs=globs):
        runner.run(test)
    assert runner.failures == 0 and runner.tries > 0
