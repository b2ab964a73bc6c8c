"""A remedy that does not cure is printed "not verified", and its check changes nothing (issue 45).

The doctor tries each mechanical remedy on a copy of the failing step before it prints
``verified``. One case per kind of remedy — a clamp on the user's line (a patched
``tf.exp``, a patched division operator), the batch without its non-finite rows, a
layer's float32 policy, a ten times smaller learning rate, ``clipnorm=1.0`` — is built
so that the remedy, applied, leaves the step non-finite: the report must say ``not
verified`` (in :attr:`Diagnosis.verified` and in the printed report), and everything
the check changed must be back afterwards: every variable of the model and of its
optimizer, the layer's dtype policy, the optimizer's learning rate and clipping, the
patched functions. A check that always said "verified" fails each of these tests.
"""

from __future__ import annotations

import inspect
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from companion.diagnostics import diagnose

HERE = os.path.basename(inspect.getsourcefile(lambda: None))


def _line_of(function, marker: str) -> int:
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if marker in line)


def _state(model) -> list[np.ndarray]:
    """Every value a check could change: the model's variables and its optimizer's."""
    variables = list(model.variables) + list(model.optimizer.variables)
    return [np.array(v.numpy()) for v in variables]


def _unchanged(before, model) -> bool:
    after = _state(model)
    return len(before) == len(after) and all(np.array_equal(a, b, equal_nan=True) for a, b in zip(before, after))


def _printed_not_verified(d) -> bool:
    return "\n  checked:   not verified: " in str(d)


def _model(layer, inputs=1, optimizer="sgd") -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((inputs,)), layer], name="net")
    model.compile(optimizer=optimizer, loss="mse")
    model.optimizer.build(model.trainable_variables)  # its state is compared too
    return model


@pytest.fixture(autouse=True)
def float32_policy():
    yield
    keras.mixed_precision.set_global_policy("float32")


# --------------------------------------------------------------------------------------
# A clamp on the user's line
# --------------------------------------------------------------------------------------


class ExpCubed(keras.layers.Layer):
    """exp(w x)^3: exp's input clamped at 44 still overflows float32 when cubed."""

    def build(self, shape):
        self.w = self.add_weight(shape=(), initializer="ones", name="w")

    def call(self, x):
        grown = tf.exp(self.w * x)  # the exp line
        return grown * grown * grown


def test_an_exp_clamp_that_leaves_the_step_overflowing_is_not_verified_and_tf_exp_is_put_back():
    exp = tf.exp
    model = _model(ExpCubed(name="cube"))
    before = _state(model)
    d = diagnose(model, (np.array([[1.0], [100.0]], "float32"), np.ones((2, 1), "float32")))
    line = _line_of(ExpCubed.call, "# the exp line")
    assert (d.op, d.cause, d.source) == ("Exp", "overflow", f"{inspect.getsourcefile(ExpCubed)}:{line}")
    assert d.remedy.endswith("tf.exp(x) -> tf.exp(tf.minimum(x, 44)) (half the log of float32's max: exp of it, "
                             "even squared, is finite)")
    assert d.verified == f"not verified: the step is still non-finite with exp's input clamped at 44 at {HERE}:{line}"
    assert _printed_not_verified(d)
    assert tf.exp is exp and tf.math.exp is exp  # the patched function is put back
    assert _unchanged(before, model)


class Ratio(keras.layers.Layer):
    """1 / (w x) + log(w x) at x = 0: divide_no_nan cures the division, not the log."""

    def build(self, shape):
        self.w = self.add_weight(shape=(), initializer="ones", name="w")

    def call(self, x):
        ratio = 1.0 / (self.w * x)  # the ratio line
        return ratio + tf.math.log(self.w * x)


def test_a_division_clamp_that_leaves_a_log_of_zero_is_not_verified_and_the_operator_is_put_back():
    dunders = {(cls, name): vars(cls)[name] for cls in (tf.Tensor, type(tf.constant(0.0)))
               for name in ("__truediv__", "__rtruediv__") if name in vars(cls)}
    assert dunders  # the division operator the clamp patches is on these classes
    model = _model(Ratio(name="ratio"))
    before = _state(model)
    d = diagnose(model, (np.array([[1.0], [0.0]], "float32"), np.ones((2, 1), "float32")))
    line = _line_of(Ratio.call, "# the ratio line")
    assert (d.op, d.cause) == ("RealDiv", "division_by_zero")
    assert d.remedy.endswith("x / y -> tf.math.divide_no_nan(x, y) (0 where y == 0, and a zero gradient there)")
    assert d.verified == (f"not verified: the step is still non-finite with divide_no_nan instead of the division "
                          f"at {HERE}:{line}")
    assert _printed_not_verified(d)
    assert all(vars(cls)[name] is original for (cls, name), original in dunders.items())
    assert _unchanged(before, model)


# --------------------------------------------------------------------------------------
# The batch without its non-finite rows
# --------------------------------------------------------------------------------------


class Log(keras.layers.Layer):
    def build(self, shape):
        self.w = self.add_weight(shape=(), initializer="ones", name="w")

    def call(self, x):
        return tf.math.log(self.w * x)


def test_dropping_the_nan_row_of_a_batch_whose_other_rows_still_fail_is_not_verified():
    model = _model(Log(name="log"))
    before = _state(model)
    x = np.array([[1.0], [np.nan], [0.0], [2.0]], "float32")  # row 1 NaN, and row 2's log(0)
    d = diagnose(model, (x, np.ones((4, 1), "float32")))
    assert (d.cause, d.batch) == ("nonfinite_input", 0)
    assert d.remedy.startswith("drop or impute row 1 of the batch in the input pipeline")
    assert d.verified == "not verified: the step is still non-finite without row 1"
    assert _printed_not_verified(d)
    assert _unchanged(before, model)


# --------------------------------------------------------------------------------------
# A layer's float32 policy
# --------------------------------------------------------------------------------------


class Energy(keras.layers.Layer):
    """w x squared, not reduced: 90000 leaves the layer and overflows the next one's float16."""

    def build(self, shape):
        self.w = self.add_weight(shape=(), initializer="ones", name="w")

    def call(self, x):
        return tf.square(self.w * x)


def test_a_float32_policy_that_leaves_the_next_layer_overflowing_is_not_verified_and_the_policy_is_put_back():
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), Energy(name="energy"), keras.layers.Dense(1, name="dense")],
                             name="net")
    keras.mixed_precision.set_global_policy("float32")
    model.compile(optimizer="sgd", loss="mse")
    model.optimizer.build(model.trainable_variables)
    energy = model.get_layer("energy")
    policy = energy.dtype_policy
    before = _state(model)
    d = diagnose(model, (np.full((4, 4), 300.0, "float32"), np.ones((4, 1), "float32")))
    assert (d.cause, d.op, d.layer, d.dtype) == ("overflow", "Square", "net/energy", "float16")
    assert d.remedy.startswith('compute net/energy in float32: Energy(..., dtype="float32")')
    assert d.verified == "not verified: the step is still non-finite with net/energy's dtype policy float32"
    assert _printed_not_verified(d)
    assert energy.dtype_policy is policy and energy.compute_dtype == "float16"  # the policy is put back
    assert _unchanged(before, model)


# --------------------------------------------------------------------------------------
# A divergence: a smaller learning rate, clipnorm
# --------------------------------------------------------------------------------------


class Growing(keras.layers.Layer):
    """(w + s) x with a state s that grows 100 times per training call, whatever the optimizer does.

    From s = 1e18 the next step's loss, about s^2 = 1e40, overflows float32 with any
    learning rate and any clipping: neither remedy can cure it.
    """

    def build(self, shape):
        self.w = self.add_weight(shape=(), initializer="zeros", name="w")
        self.scale = self.add_weight(shape=(), initializer="ones", trainable=False, name="scale")

    def call(self, x, training=False):
        if training:
            self.scale.assign(self.scale * 100.0)
        return (self.w + self.scale) * x


SCHEDULE = keras.optimizers.schedules.ExponentialDecay(1e-3, decay_steps=10, decay_rate=0.9)

SMALLER = "with learning_rate=0.0001, the failing step is still non-finite"
CLIPNORM = "with clipnorm=1.0, the failing step is still non-finite"


@pytest.mark.parametrize(
    ("options", "verdict"),
    [
        ({}, f"{SMALLER}; {CLIPNORM}"),  # both tried, both fail
        ({"clipnorm": 0.5}, SMALLER),  # clipped already: the smaller rate alone
        ({"learning_rate": SCHEDULE}, "learning_rate=0.0001 could not be set (This optimizer was created with a "
                                      f"`LearningRateSchedule` object as its `learning_rate` constructor argument, "
                                      f"hence its l); {CLIPNORM}"),  # a schedule: clipnorm alone
    ],
    ids=["rate-and-clipnorm", "rate", "clipnorm"],
)
def test_a_divergence_that_neither_remedy_cures_is_not_verified_and_the_optimizer_is_put_back(options, verdict):
    optimizer = keras.optimizers.Adam(**{"learning_rate": 1e-3, **options})
    model = _model(Growing(name="growing"), optimizer=optimizer)
    model.get_layer("growing").scale.assign(1e18)
    compiled = optimizer.get_config()  # learning_rate (or its schedule), clipnorm, global_clipnorm, clipvalue
    before = _state(model)
    x = np.ones((16, 1), "float32")
    d = diagnose(model, (x, x), losses_before=[1.0, 1e4, 1e8, 1e12])
    assert d.cause == "divergence"
    assert d.remedy.startswith("recompile with a learning rate ten times smaller: keras.optimizers.Adam("
                               "learning_rate=0.0001)")
    assert d.verified == f"not verified: {verdict} (the failing step re-run from the weights before it)"
    assert _printed_not_verified(d)
    assert optimizer.get_config() == compiled  # the optimizer as compiled ...
    assert _unchanged(before, model)  # ... and its state, the weights and the grown state as they were


def test_checking_a_divergences_remedy_leaves_an_optimizer_that_never_stepped_as_it_was():
    # The re-run of the training step builds an optimizer that had not stepped yet: its
    # slots must not keep the re-run's values (here Adam's velocity, an Inf), or the next
    # fit would start from them.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), Growing(name="growing")], name="net")
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    model.get_layer("growing").scale.assign(1e18)
    before = [np.array(v.numpy()) for v in model.variables]
    x = np.ones((16, 1), "float32")
    d = diagnose(model, (x, x), losses_before=[1.0, 1e4, 1e8, 1e12])
    assert d.cause == "divergence" and d.verified.startswith("not verified: ")
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.variables))
    fresh = keras.optimizers.Adam(1e-3)
    fresh.build(model.trainable_variables)  # what fit's first step starts from
    assert [v.numpy().tolist() for v in model.optimizer.variables] == [v.numpy().tolist() for v in fresh.variables]
