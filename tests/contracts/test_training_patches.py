"""What ``train`` changes on a model is put back: afterwards a plain ``fit`` is Keras' own.

``companion.training.patches`` lists every attribute ``train`` sets on a model and its
optimizers for the duration of a call; these tests compare the objects' attributes before
and after a call that returns and one that raises, and check that a later plain
``model.fit`` runs Keras' own step (which applies a NaN update the guarded step would skip).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from companion.training import NonFiniteError, train
from companion.training.patches import ModelPatches


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", metrics=["mae"])
    return model


def _data(nan: bool = False):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    if nan:
        x[:] = np.nan
    return x, y


def _attributes(obj) -> dict:
    # model.history: Keras' fit itself replaces it on every call (its History callback)
    return {k: v for k, v in vars(obj).items() if k != "history"}


def _same(before: dict, after: dict) -> list[str]:
    keys = set(before) | set(after)
    return sorted(k for k in keys if k not in before or k not in after or before[k] is not after[k])


def test_train_returns_or_raises_and_the_model_and_optimizer_are_as_they_were():
    model = _model()
    x, y = _data()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # the user's own compiled function
    model_before, optimizer_before = _attributes(model), _attributes(model.optimizer)
    user_function = model.train_function
    assert user_function is not None

    train(model, x, y, batch_size=4, epochs=2, verbose=0)
    assert _same(model_before, _attributes(model)) == []
    assert _same(optimizer_before, _attributes(model.optimizer)) == []
    assert model.train_function is user_function

    with pytest.raises(NonFiniteError):
        train(model, *_data(nan=True), batch_size=4, epochs=1, verbose=0, on_nonfinite="raise")
    assert _same(model_before, _attributes(model)) == []
    assert _same(optimizer_before, _attributes(model.optimizer)) == []


def test_after_train_a_plain_fit_runs_keras_own_step():
    model = _model()
    x, y = _data()
    train(model, x, y, batch_size=4, epochs=1, verbose=0)
    assert "train_step" not in vars(model) and "apply" not in vars(model.optimizer)
    # Keras' own step applies a NaN update (the guarded one would skip it)
    model.fit(*_data(nan=True), batch_size=4, epochs=1, verbose=0)
    assert not np.isfinite(model.layers[0].kernel.numpy()).all()


def test_model_patches_put_back_own_attributes_class_attributes_and_properties():
    class Owner:
        level = "class"

        def __init__(self):
            self.own = "own"
            self._value = 1

        @property
        def value(self):
            return self._value

        @value.setter
        def value(self, new):
            self._value = new

        def method(self):
            return "method"

    owner = Owner()
    patches = ModelPatches()
    patches.set(owner, "own", "patched")
    patches.set(owner, "own", "patched twice")  # the first value is what comes back
    patches.set(owner, "method", lambda: "patched")
    patches.set(owner, "level", "patched")
    patches.set(owner, "value", 2)
    kept = []

    def keep():
        kept.append(owner.method())

    patches.before_restore(keep)
    patches.before_restore(keep)  # as a second install of the same step does: once
    assert [name for _, name in patches.changed()] == ["own", "method", "level", "value"]
    patches.restore()
    assert kept == ["patched"]
    assert (owner.own, owner.method(), owner.level, owner.value) == ("own", "method", "class", 1)
    assert set(vars(owner)) == {"own", "_value"}
    patches.restore()  # twice is harmless
    assert owner.own == "own"
