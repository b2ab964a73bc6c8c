"""Case A's one-term model and the seed's own loop: a NaN after many finite steps, diagnosed."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from companion.book.models import BasisPower
from companion.book.reports import rebuild, reporter_step
from companion.book.reproductions import seed_gradients, seed_train_step
from companion.diagnostics import diagnose_function


def _first_nonfinite_step(model, steps=200):
    x = np.linspace(0.0, 1.0, 33, dtype=np.float32)[:, None]
    step = seed_train_step(model, keras.optimizers.Adam(0.02))
    for k in range(steps):
        before = [v.numpy() for v in model.weights]
        step(x, np.sqrt(x))
        if not all(np.isfinite(v.numpy()).all() for v in model.weights):
            return k, before, x
    return None, before, x


def test_the_power_turns_nan_after_many_finite_steps_once_b_is_below_one():
    keras.utils.set_random_seed(0)
    model = BasisPower(b=2.0)
    k, before, x = _first_nonfinite_step(model)
    assert k is not None and k >= 20 and before[1] < 1.0 <= 2.0
    for variable, value in zip(model.weights, before):
        variable.assign(value)
    d = seed_gradients(model)
    found = diagnose_function(d, x, np.sqrt(x))
    assert (found.op, found.forward_op, found.cause) == ("Pow", "Pow", "singular_derivative"), str(found)
    assert found.verified.startswith("verified: the step is finite with safe_pow instead of pow"), str(found)


def test_safe_pow_trains_the_same_loop_to_the_end():
    keras.utils.set_random_seed(0)
    k, _, _ = _first_nonfinite_step(BasisPower(b=2.0, safe=True))
    assert k is None


def test_basis_power_round_trips_its_config():
    model = BasisPower(b=1.5, safe=True)
    again = BasisPower.from_config(model.get_config())
    assert (again.initial_b, again.safe) == (1.5, True)


def test_the_reporter_step_of_a_loop_rebuild_is_diagnosed_as_the_chapter_shows():
    r = rebuild("where_activation")
    d = diagnose_function(reporter_step(r), *r.data)
    assert d.cause == "where_trap" and "tf.where(c, x, 0.0)" in d.remedy
    assert d.verified.startswith("not verified: the function writes variables")  # said, not run twice
    assert isinstance(reporter_step(rebuild("triplet_loss")), type(lambda: None))
    assert isinstance(reporter_step(rebuild("complex_angle")), tf.types.experimental.PolymorphicFunction)
