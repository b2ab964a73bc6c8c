"""The deferred update: no copy of the weights or the optimizer's state, honest all the same.

On one replica without XLA, `train` runs the model optimizer's update at the end of the
step, under one predicate, proved finite from running bounds (SGD, Adam, AdamW, Lion) or
tested on a copy. These tests hold the proof to its word (whenever it says finite, the
update is finite), check that ordinary training never takes the tested path, that an
update that overflows from finite gradients is still skipped bit for bit, and that a
`train_step` that reads or writes what the update writes is traced again, masked, and
trains exactly as `fit` does.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from companion.training import train
from companion.training.bounds import UNKNOWN, UpdateBound, provable
from companion.training.records import APPLIED, COLUMNS, TESTED
from companion.training.step import model_cache

#: Every test here is of the deferred update, on small models and short calls that would
#: otherwise take the masked step.
pytestmark = pytest.mark.usefixtures("always_defer")

OPTIMIZERS = {
    "SGD": lambda lr: keras.optimizers.SGD(lr),
    "SGD-momentum": lambda lr: keras.optimizers.SGD(lr, momentum=0.9),
    "SGD-nesterov": lambda lr: keras.optimizers.SGD(lr, momentum=0.99, nesterov=True),
    "Adam": lambda lr: keras.optimizers.Adam(lr),
    "Adam-amsgrad": lambda lr: keras.optimizers.Adam(lr, amsgrad=True, epsilon=1e-30),
    "AdamW": lambda lr: keras.optimizers.AdamW(lr, weight_decay=0.5),
    "Lion": lambda lr: keras.optimizers.Lion(lr),
}


def _step(model):
    return next(v for k, v in model_cache(model).items() if isinstance(k, tuple) and k[0] == "step")


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    log_lr=st.floats(-6, 38),
    log_grad=st.floats(-3, 30),
    log_weight=st.floats(-3, 38),
    steps=st.integers(1, 3),
)
def test_whenever_the_bound_proves_an_update_finite_it_is(name, log_lr, log_grad, log_weight, steps):
    rng = np.random.default_rng(0)
    weights = tf.Variable((rng.uniform(-1, 1, 16) * 10.0**log_weight).astype("float32"))
    optimizer = OPTIMIZERS[name](float(10.0**log_lr))
    optimizer.build([weights])
    bound = UpdateBound(optimizer, [weights])
    bound.measure()
    for _ in range(steps):
        gradient = tf.constant((rng.uniform(-1, 1, 16) * 10.0**log_grad).astype("float32"))
        norm = tf.norm(gradient)
        proved, advance = bound.prove(norm, optimizer.learning_rate)
        if not bool(proved):
            return
        optimizer.apply([gradient], [weights])
        advance()
        values = [weights.numpy(), *(v.numpy() for v in optimizer.variables)]
        assert all(np.isfinite(v).all() for v in values), "the bound proved finite an update that is not"
        # The bounds still bound what the update wrote.
        assert np.abs(weights.numpy()).max() <= float(bound.weights.numpy())


def test_the_bound_is_off_for_an_optimizer_it_does_not_know_or_a_constrained_weight():
    variable = tf.Variable(tf.ones([3]))
    assert not provable(keras.optimizers.RMSprop(), [variable])
    assert not provable(keras.optimizers.Adam(use_ema=True), [variable])
    layer = keras.layers.Dense(2, kernel_constraint=keras.constraints.NonNeg())
    layer.build((None, 3))
    assert not provable(keras.optimizers.Adam(), [layer.kernel])
    assert provable(keras.optimizers.Adam(), [variable])


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.BatchNormalization(), keras.layers.Dense(1)])


def _data(n=256):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, np.tanh(x.sum(axis=1, keepdims=True))


@pytest.mark.parametrize("name", ["SGD-momentum", "Adam", "AdamW", "Lion"])
def test_ordinary_training_never_takes_the_tested_path_and_equals_fit(name):
    x, y = _data()
    trained, fitted = _model(), _model()
    history = train(trained, x, y, batch_size=32, epochs=3, shuffle=False, loss="mse", verbose=0,
                    optimizer=OPTIMIZERS[name](0.01))
    fitted.compile(loss="mse", optimizer=OPTIMIZERS[name](0.01))
    fitted.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)

    assert history.update == "deferred" and history.skipped == []
    bound = _step(trained).bound
    assert bound.enabled and int(bound.tested.numpy()) == 0, "a finite run took the tested path"
    for a, b in zip(trained.get_weights(), fitted.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_an_optimizer_the_bound_does_not_know_takes_the_tested_path_at_every_step():
    x, y = _data(64)
    model = _model()
    history = train(model, x, y, batch_size=32, epochs=2, shuffle=False, loss="mse", verbose=0,
                    optimizer=keras.optimizers.RMSprop(0.01))
    assert history.update == "deferred" and history.skipped == []
    assert int(_step(model).bound.tested.numpy()) == history.steps


@pytest.mark.parametrize("name", ["Adam", "SGD-momentum"])
def test_an_update_that_is_not_finite_from_finite_gradients_is_skipped_bit_for_bit(name):
    # An infinite learning rate (a schedule gone wrong): the loss and the gradients are
    # finite, the update is not; the bound cannot prove it, the tested path finds it.
    x, y = _data(64)
    model = _model()
    train(model, x[:32], y[:32], batch_size=32, epochs=1, shuffle=False, loss="mse", verbose=0,
          optimizer=OPTIMIZERS[name](1e-3))
    model.optimizer.learning_rate.assign(np.inf)
    before = [v.numpy().copy() for v in [*model.variables, *model.optimizer.variables]]
    history = train(model, x[32:], y[32:], batch_size=32, epochs=1, shuffle=False, verbose=0)

    assert history.skipped == [0] and np.isfinite(history.step_loss[0]) and np.isfinite(history.grad_norm[0])
    assert int(_step(model).bound.tested.numpy()) == 1
    after = [v.numpy() for v in [*model.variables, *model.optimizer.variables]]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_after_a_tested_step_the_host_measures_the_bounds_again():
    # The tested path sets the bounds to unknown (no measure traced into the step); the
    # drain after the host call measures them exactly, so the next call's steps are proved.
    x, y = _data(64)
    model = _model()
    train(model, x, y, batch_size=32, epochs=1, shuffle=False, loss="mse", verbose=0,
          optimizer=keras.optimizers.Adam(1e-3))
    step = _step(model)
    bound = step.bound
    bound.forget()  # as the tested path does, inside the step
    assert float(bound.weights.numpy()) >= UNKNOWN and float(bound.slots.numpy()) >= UNKNOWN
    row = np.zeros([step.buffer.capacity, COLUMNS], np.float32)
    row[0, APPLIED] = row[0, TESTED] = 1.0
    step.buffer.records.assign(row)
    step.buffer.written.assign(1)
    step.drain()
    largest = max(float(np.abs(v.numpy()).max()) for v in model.trainable_variables)
    assert float(bound.weights.numpy()) == largest
    slots = [v for v in model.optimizer.variables if tuple(v.shape) in {tuple(w.shape) for w in model.trainable_variables}]
    assert float(bound.slots.numpy()) == max(float(np.abs(v.numpy()).max()) for v in slots)
    tested = int(bound.tested.numpy())
    train(model, x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert int(bound.tested.numpy()) == tested, "the steps after the bounds were measured again were not proved"


class _Regression(keras.Model):
    """A model with its own `train_step`: the squared error, its gradients, the update."""

    def _update(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return loss


class ReadsAfterApply(_Regression):
    """A `train_step` that logs the kernel's norm after its update (it must see the new kernel)."""

    def train_step(self, data):
        loss = self._update(data)
        return {"loss": loss, "kernel_norm": tf.norm(self.trainable_variables[0])}


class ClipsItsWeights(_Regression):
    """keras.io's WGAN-style weight clipping: the step writes the weights itself, after the update."""

    def train_step(self, data):
        loss = self._update(data)
        for v in self.trainable_variables:
            v.assign(tf.clip_by_value(v, -0.05, 0.05))
        return {"loss": loss}


def _functional(cls):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    return cls(inputs, keras.layers.Dense(1)(keras.layers.Dense(8, activation="tanh")(inputs)))


@pytest.mark.parametrize("cls", [ReadsAfterApply, ClipsItsWeights])
def test_a_step_that_reads_or_writes_what_the_update_writes_is_masked_and_equals_fit(cls):
    x, y = _data(96)
    x[40] = np.nan  # the second batch is skipped
    trained, fitted = _functional(cls), _functional(cls)
    history = train(trained, x, y, batch_size=32, shuffle=False, loss="mse", verbose=0,
                    optimizer=keras.optimizers.Adam(0.01))
    fitted.compile(loss="mse", optimizer=keras.optimizers.Adam(0.01))
    fitted.fit(np.concatenate([x[:32], x[64:]]), np.concatenate([y[:32], y[64:]]), batch_size=32,
               shuffle=False, verbose=0)

    assert history.update == "masked" and history.skipped == [1]
    assert model_cache(trained).get("undeferrable")
    for a, b in zip(trained.get_weights(), fitted.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# --- one update at a time: the conditional update's temporaries are not all alive together --


def _ancestors(op) -> set:
    seen, stack = set(), [op]
    while stack:
        node = stack.pop()
        for parent in [t.op for t in node.inputs] + list(node.control_inputs):
            if parent.name not in seen:
                seen.add(parent.name)
                stack.append(parent)
    return seen


def _writes(graph, variable) -> list:
    """The ops of ``graph`` that write ``variable`` (an assign taking its captured handle)."""
    handle = next(internal for external, internal in graph.captures if external is variable.handle)
    return [op for op in graph.get_operations()
            if op.type.startswith("Assign") and any(t is handle for t in op.inputs)]


def test_on_a_cpu_alone_only_the_largest_variables_updates_are_chained():
    """Chained updates of small variables cost a CPU wall time (their short updates lose
    their overlap) for a few MiB: on a CPU alone only variables of CHAIN_FROM_ON_CPU
    entries or more are chained (CHAIN_FROM where an accelerator is, or if asked)."""
    from companion._gradients import CHAIN_FROM, CHAIN_FROM_ON_CPU, one_update_at_a_time

    if tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("TPU"):
        pytest.skip("an accelerator is present")
    assert CHAIN_FROM < 300 * 300 < CHAIN_FROM_ON_CPU <= 2048 * 1024

    def chained(shape, on_cpu):
        variables = [tf.Variable(tf.ones(shape)) for _ in range(2)]
        optimizer = keras.optimizers.Adam()
        optimizer.build(variables)
        grads = [tf.ones(shape) for _ in variables]

        @tf.function
        def step():
            with one_update_at_a_time(optimizer, smallest=CHAIN_FROM if on_cpu else None):
                optimizer.apply(grads, variables)

        graph = step.get_concrete_function().graph
        earlier = {op.name for op in _writes(graph, variables[0])}
        return all(earlier <= _ancestors(op) for op in _writes(graph, variables[1]))

    assert not chained((300, 300), on_cpu=False)
    assert chained((300, 300), on_cpu=True)
    assert chained((2048, 1024), on_cpu=False)


@pytest.mark.parametrize("name", ["Adam", "SGD-momentum", "Lion"])
def test_large_variables_are_updated_one_after_another_and_to_the_same_bits(name):
    from companion._gradients import CHAIN_FROM, one_update_at_a_time

    rng = np.random.default_rng(0)
    shapes = [(300, 300), (300, 300), (3,)]  # two large (> CHAIN_FROM entries), one small
    assert all(a * b > CHAIN_FROM for a, b in shapes[:2])
    start = [rng.normal(size=s).astype("float32") for s in shapes]
    grads = [tf.constant(rng.normal(size=s).astype("float32")) for s in shapes]
    results = []
    for chained in (False, True):
        variables = [tf.Variable(v) for v in start]
        optimizer = OPTIMIZERS[name](1e-2)
        optimizer.build(variables)

        def make(chained, variables, optimizer):  # closures: the variables are captured
            @tf.function
            def step():
                if chained:
                    with one_update_at_a_time(optimizer, smallest=CHAIN_FROM):
                        optimizer.apply(grads, variables)
                else:
                    optimizer.apply(grads, variables)
            return step

        step = make(chained, variables, optimizer)

        for _ in range(3):
            step()
        assert not {"update_step", "assign", "assign_add", "assign_sub"} & set(vars(optimizer))
        results.append([v.numpy() for v in [*variables, *optimizer.variables]])
        graph = step.get_concrete_function().graph
        first, second = variables[0], variables[1]
        later = _writes(graph, second)
        earlier = {op.name for op in _writes(graph, first)}
        assert later and earlier
        # Chained: every write of the second large variable comes after every write of the first.
        after = all(earlier <= _ancestors(op) for op in later)
        assert after is chained
    for unchained, chained in zip(*results):
        np.testing.assert_array_equal(unchained, chained)
