"""Tests of companion.optimizers.SkipNonFinite: the skip guarantee for ``model.fit``."""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from companion.optimizers import SkipNonFinite
from training_data import N_BATCHES, X, Y, assert_bit_identical, make_dataset, make_model, state_of


def test_skip_nonfinite_makes_fit_skip_a_poisoned_batch():
    model = make_model()
    model.compile(optimizer=SkipNonFinite(keras.optimizers.Adam(0.05)), loss="mse", jit_compile=True)
    assert model.jit_compile  # the guard runs inside the XLA-compiled train step
    before = model.evaluate(X, Y, verbose=0)
    model.fit(make_dataset(poisoned=[2]), epochs=3, verbose=0, shuffle=False)

    assert int(model.optimizer.skipped_steps) == 3
    assert int(model.optimizer.iterations) == 3 * (N_BATCHES - 1)
    assert all(np.isfinite(v.numpy()).all() for v in model.variables)
    assert model.evaluate(X, Y, verbose=0) < 0.5 * before


def test_skip_nonfinite_skip_leaves_inner_optimizer_state_unchanged():
    guarded_model, clean_model = make_model(), make_model()
    guarded_model.compile(optimizer=SkipNonFinite(keras.optimizers.Adam(0.05)), loss="mse", jit_compile=True)
    clean_model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse", jit_compile=True)
    guarded_model.fit(make_dataset(poisoned=[1], n_batches=2), verbose=0, shuffle=False)
    clean_model.fit(make_dataset(n_batches=1), verbose=0, shuffle=False)
    inner = guarded_model.optimizer.inner_optimizer
    assert_bit_identical(state_of(guarded_model, inner), state_of(clean_model, clean_model.optimizer))


@pytest.mark.parametrize("entry, applied", [(3e38, True), (np.nan, False), (-np.inf, False)])
def test_a_large_gradient_whose_sum_overflows_is_tested_entry_by_entry(entry, applied):
    """A gradient of more than 2**16 entries is tested by its sum first (one pass, no
    temporary of its size); finite entries whose sum overflows (3 x 3e38) are still
    applied, a NaN or an infinity among them skipped."""
    variable = keras.Variable(np.zeros((300, 300), np.float32))
    gradient = np.zeros((300, 300), np.float32)
    gradient[0, :2] = 3e38
    gradient[5, 7] = entry
    optimizer = SkipNonFinite(keras.optimizers.SGD(1e-30))
    tf.function(lambda g: optimizer.apply([g], [variable]))(tf.constant(gradient))
    assert int(optimizer.skipped_steps) == (0 if applied else 1)
    after = variable.numpy()
    assert np.isfinite(after).all()
    assert (after[0, 0] != 0) == applied


def test_skip_nonfinite_rejects_what_it_cannot_wrap():
    with pytest.raises(TypeError, match="inner_optimizer must be a Keras optimizer"):
        SkipNonFinite("adam")
    with pytest.raises(ValueError, match=re.escape("LossScaleOptimizer(SkipNonFinite(optimizer))")):
        SkipNonFinite(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))


def test_skip_nonfinite_config_round_trip():
    wrapper = SkipNonFinite(keras.optimizers.Adam(0.003), name="guarded")
    restored = SkipNonFinite.from_config(wrapper.get_config())
    assert restored.name == "guarded"
    assert isinstance(restored.inner_optimizer, keras.optimizers.Adam)
    assert float(restored.learning_rate) == pytest.approx(0.003)


def test_skip_nonfinite_is_re_exported_by_companion_training():
    from companion import training

    assert training.SkipNonFinite is SkipNonFinite
