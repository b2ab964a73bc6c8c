"""Tests of companion.training: the guarded loop `train` and the `SkipNonFinite` optimizer wrapper.

Bit-identical comparisons use two models built from the same seed: XLA on CPU is
deterministic, so "skipped steps change nothing" can be checked exactly by comparing a
run with poisoned batches against a run on the good batches alone.
"""

from __future__ import annotations

import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from companion.training import NonFiniteError, SkippedStep, TrainingHistory, train
from companion.training import deferred
from companion.training.loop import MIN_STEPS_FOR_LOOP, MIN_STEPS_FOR_LOOP_PER_VARIABLE
from training_data import (
    BATCH,
    FEATURES,
    N_BATCHES,
    X,
    Y,
    SqrtOfProduct,
    assert_bit_identical,
    make_dataset,
    make_model,
    state_of,
)

# --------------------------------------------------------------------------------------
# Skipping
# --------------------------------------------------------------------------------------


def test_poisoned_batches_are_skipped_and_the_rest_trains():
    model, optimizer = make_model(), keras.optimizers.Adam(0.05)
    history = train(model, make_dataset(poisoned=[1, 5]), loss="mse", optimizer=optimizer, epochs=4, verbose=0)

    assert history.skipped == [1, 5, 9, 13, 17, 21, 25, 29]
    assert int(optimizer.iterations) == 4 * N_BATCHES - 8  # skipped steps do not count
    assert all(np.isnan(history.step_loss[i]) for i in history.skipped)
    assert all(np.isnan(history.grad_norm[i]) for i in history.skipped)
    assert np.isfinite(np.delete(history.grad_norm, history.skipped)).all()
    assert history.epoch_loss[-1] < 0.5 * history.epoch_loss[0]  # it keeps learning
    assert history.epoch_steps == [N_BATCHES] * 4
    assert all(np.isfinite(v.numpy()).all() for v in model.variables)

    report = history.reports[0]
    assert isinstance(report, SkippedStep) and report.step == 1 and report.epoch == 0
    assert {r.path for r in report.gradients} == {v.path for v in model.trainable_variables}
    kernel = next(r for r in report.gradients if r.path == model.trainable_variables[0].path)
    assert kernel.nan_count == FEATURES * 8  # the NaN row reaches every entry of the first kernel
    assert "step 1 (epoch 0)" in str(report)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_flattened_nonfinite_counts_equal_the_per_gradient_ones(compiled):
    from companion._gradients import nonfinite_counts

    rng = np.random.default_rng(3)
    kernel = rng.normal(size=(5, 4)).astype("float32")
    kernel[1, 2], kernel[3, 0], kernel[4, 3] = np.nan, np.inf, -np.inf
    half = np.array([65504.0, 1.0, np.nan], "float16") * np.array([2.0, 1.0, 1.0], "float16")  # inf, 1, nan
    gradients = [tf.constant(kernel), None, tf.constant(half), tf.constant(np.float32(np.nan)), tf.zeros([0, 3])]
    # float64 beside float32: 1e300 is finite, and stays so in the flattened count.
    gradients.append(tf.constant([1e300, np.inf], tf.float64))

    def both():
        return nonfinite_counts(gradients, flatten=True), nonfinite_counts(gradients)

    (flat_nan, flat_inf), (nan, inf) = tf.function(both)() if compiled else both()
    assert flat_nan.numpy().tolist() == nan.numpy().tolist() == [1, 0, 1, 1, 0, 0]
    assert flat_inf.numpy().tolist() == inf.numpy().tolist() == [2, 0, 1, 0, 0, 1]
    # An embedding's IndexedSlices (rows of unknown number) is counted one by one.
    sliced = tf.IndexedSlices(tf.constant([[np.nan, 1.0]]), tf.constant([0]), tf.constant([3, 2]))
    assert [t.numpy().tolist() for t in nonfinite_counts([sliced, tf.constant([np.inf])], flatten=True)] == [
        [1, 0], [0, 1]]


def test_nan_gradient_under_a_finite_loss_is_skipped():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), SqrtOfProduct(name="sqrt_wx"), keras.layers.Dense(1)])
    x = np.array([[1.0], [4.0], [0.0], [9.0]], "float32")  # x = 0 in the third batch
    data = tf.data.Dataset.from_tensor_slices((x, np.sqrt(x))).batch(1)
    history = train(model, data, loss="mse", optimizer=keras.optimizers.SGD(0.01), verbose=0)

    assert history.skipped == [2]
    assert np.isfinite(history.step_loss[2])  # the loss is finite, the gradient is not
    (record,) = history.reports[0].gradients
    assert record.path.endswith("sqrt_wx/w") and record.nan_count == 1


def test_a_step_whose_gradient_norm_overflows_is_skipped_and_said_so():
    model, optimizer = make_model(), keras.optimizers.SGD(0.01)

    def huge_linear_loss(y, p):  # finite loss, finite but ~1e20-sized gradient entries
        return tf.reduce_mean(p) * 1e20

    history = train(model, make_dataset(n_batches=1), loss=huge_linear_loss, optimizer=optimizer, verbose=0)
    assert history.skipped == [0] and np.isfinite(history.step_loss[0]) and np.isinf(history.grad_norm[0])
    assert len(history.reports[0].gradients) == 0
    assert "global norm overflows float32" in str(history.reports[0])
    assert int(optimizer.iterations) == 0


#: An optimizer whose update holds a conditional of its own (the EMA overwrite every two
#: steps): the step's end puts its writes back all the same.
def _conditional_update_optimizer():
    return keras.optimizers.Adam(0.05, use_ema=True, ema_overwrite_frequency=2)


@pytest.mark.parametrize(
    "width, make_optimizer, update, xla",
    [
        (8, lambda: keras.optimizers.Adam(0.05), "masked", True),
        (8, _conditional_update_optimizer, "masked", True),
        # A large model takes the same way.
        (1024, _conditional_update_optimizer, "masked", True),
        # Without XLA a small state is put back by selects, a large one (over
        # guard.SELECT_LIMIT entries) under a conditional: both leave nothing behind.
        # Without XLA the model optimizer's update is deferred to the step's end and run
        # under one predicate (proved finite for Adam; an EMA optimizer takes the tested
        # path at every step): no copy of a weight or a moment.
        (8, lambda: keras.optimizers.Adam(0.05), "deferred", False),
        (1024, lambda: keras.optimizers.Adam(0.05), "deferred", False),
        (1024, _conditional_update_optimizer, "deferred", False),
    ],
    ids=["masked", "conditional-update-small-model", "conditional-update-large-model",
         "small-model-without-xla", "large-model-without-xla", "tested-update-large-model-without-xla"],
)
def test_skipped_step_leaves_weights_and_optimizer_state_unchanged(width, make_optimizer, update, xla, always_defer):
    # "masked": on one replica the step runs, and its end selects, for every variable
    # of the model and its optimizers, between the new and the old value (fused by XLA),
    # whatever the optimizer's update holds (here a conditional of its own).
    def model():
        built = make_model(batch_norm=True, width=width)
        if width > 8:  # a second wide layer: 1024 * 1024 more parameters
            built = keras.Sequential([*built.layers[:-1], keras.layers.Dense(width), built.layers[-1]])
        return built

    poisoned_model, poisoned_opt = model(), make_optimizer()
    clean_model, clean_opt = model(), make_optimizer()
    # Step 1 of the poisoned run is batch 1 poisoned; the clean run never sees it.
    data = make_dataset(poisoned=[1], n_batches=2)
    # Under XLA (train's default, jit_compile="auto", turns it on only where a GPU is):
    # the select is fused; test_every_keras_optimizer... covers the step without XLA.
    history = train(poisoned_model, data, loss="mse", optimizer=poisoned_opt, verbose=0, jit_compile=xla)
    train(clean_model, data.take(1), loss="mse", optimizer=clean_opt, verbose=0, jit_compile=xla)

    assert history.update == update
    assert history.skipped == [1] and history.xla == xla
    # The skipped step's NaN counts were recorded (without XLA a large model writes them
    # under a conditional of their own): every gradient of the poisoned batch is NaN.
    gradients = history.reports[0].gradients
    assert len(gradients) == len(poisoned_model.trainable_variables)
    assert all(g.nan_count == int(np.prod(g.shape)) for g in gradients)
    assert int(poisoned_opt.iterations) == 1
    # Weights, batch-norm statistics (restored after the NaN forward pass), Adam state.
    assert_bit_identical(state_of(poisoned_model, poisoned_opt), state_of(clean_model, clean_opt))
    # A second call takes the same way.
    again = train(poisoned_model, data, loss="mse", optimizer=poisoned_opt, verbose=0, jit_compile=xla)
    assert again.update == update


def test_a_short_call_on_a_small_model_is_masked_a_longer_one_or_an_unknown_length_deferred(monkeypatch):
    # The masked step's trace costs a first call less; the deferred update's steps cost
    # less: a call defers once its steps times the model's weights reach DEFER_FROM.
    # Large models always defer (the masked step's copy would cost memory), a model not
    # built yet too.
    assert deferred.worth_deferring([tf.zeros([deferred.MASK_UP_TO + 1])], 1)
    assert not deferred.worth_deferring([tf.zeros([deferred.MASK_UP_TO])], 1)
    assert deferred.worth_deferring([], 1)
    model, optimizer = make_model(batch_norm=True), keras.optimizers.Adam(0.05)
    weights = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    monkeypatch.setattr(deferred, "DEFER_FROM", 3 * weights)
    data = make_dataset(poisoned=[1], n_batches=2)
    short = train(model, data, loss="mse", optimizer=optimizer, verbose=0)  # 2 steps
    assert short.update == "masked" and short.skipped == [1]
    longer = train(model, data, epochs=2, verbose=0)  # 4 steps
    assert longer.update == "deferred" and longer.skipped == [1, 3]
    unknown = train(model, data.filter(lambda x, y: True), verbose=0)  # no cardinality
    assert unknown.update == "deferred"


#: One optimizer per kind of update code in Keras (momentum, centred second moments,
#: weight decay and clipping, sign updates, factored moments, FTRL's own accumulators).
KERAS_OPTIMIZERS = {
    "SGD-nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "RMSprop-centered": lambda: keras.optimizers.RMSprop(0.01, momentum=0.9, centered=True),
    "AdamW-clipnorm": lambda: keras.optimizers.AdamW(0.01, clipnorm=1.0),
    "Lion": lambda: keras.optimizers.Lion(0.01),
    "Adafactor": lambda: keras.optimizers.Adafactor(0.01),
    "Ftrl": lambda: keras.optimizers.Ftrl(0.1),
}


@pytest.mark.parametrize("make_optimizer", KERAS_OPTIMIZERS.values(), ids=KERAS_OPTIMIZERS.keys())
def test_every_keras_optimizer_is_deferred_and_a_skip_leaves_its_state_bit_identical(make_optimizer, always_defer):
    poisoned_model, poisoned_opt = make_model(batch_norm=True), make_optimizer()
    clean_model, clean_opt = make_model(batch_norm=True), make_optimizer()
    data = make_dataset(poisoned=[1], n_batches=2)
    history = train(poisoned_model, data, loss="mse", optimizer=poisoned_opt, verbose=0)
    train(clean_model, data.take(1), loss="mse", optimizer=clean_opt, verbose=0)

    assert history.update == "deferred"
    assert history.skipped == [1]
    assert_bit_identical(state_of(poisoned_model, poisoned_opt), state_of(clean_model, clean_opt))


def test_nonfinite_error_after_consecutive_skips_leaves_last_good_state_bit_identical():
    good = make_dataset().take(3)
    bad = make_dataset(poisoned=range(N_BATCHES)).skip(3)
    model, optimizer = make_model(batch_norm=True), keras.optimizers.Adam(0.05)
    with pytest.raises(NonFiniteError) as caught:
        train(model, good.concatenate(bad), loss="mse", optimizer=optimizer, max_consecutive_nonfinite=3, verbose=0)

    error = caught.value
    assert isinstance(error, FloatingPointError)
    assert error.step == 5 and len(error.reports) == 3
    message = str(error)
    assert "step 5" in message and "max_consecutive_nonfinite=3" in message
    for variable in model.trainable_variables:
        assert variable.path in message
    assert "after step 2" in message
    assert error.history.skipped == [3, 4, 5]

    reference_model, reference_opt = make_model(batch_norm=True), keras.optimizers.Adam(0.05)
    train(reference_model, good, loss="mse", optimizer=reference_opt, verbose=0)
    # Weights, batch-norm statistics, Adam moments and iteration counter: all bit-identical.
    assert_bit_identical(state_of(model, optimizer), state_of(reference_model, reference_opt))
    assert int(optimizer.iterations) == 3


def test_raise_mode_raises_at_the_first_nonfinite_step_without_applying_it():
    model, optimizer = make_model(), keras.optimizers.Adam(0.05)
    with pytest.raises(NonFiniteError, match=r"step 2 .*on_nonfinite='raise'") as caught:
        train(model, make_dataset(poisoned=[2]), loss="mse", optimizer=optimizer, on_nonfinite="raise", verbose=0)
    assert caught.value.step == 2
    assert int(optimizer.iterations) == 2
    assert all(np.isfinite(v.numpy()).all() for v in model.variables)
    # The error carries the NaN doctor's diagnosis of that step, as the skip mode's report does.
    assert caught.value.diagnosis is not None and caught.value.diagnosis.cause == "nonfinite_input"


def test_clipping_bounds_finite_updates_and_does_not_spread_a_nan():
    model, optimizer = make_model(), keras.optimizers.SGD(1.0)
    before = [v.numpy().copy() for v in model.trainable_variables]
    data = make_dataset(poisoned=[1], n_batches=2)
    history = train(model, data, loss="mse", optimizer=optimizer, clip_global_norm=0.1, verbose=0)

    assert history.skipped == [1]
    assert history.grad_norm[0] > 0.1  # so clipping was active
    change = np.sqrt(sum(np.sum((v.numpy() - b) ** 2) for v, b in zip(model.trainable_variables, before)))
    assert change == pytest.approx(0.1, rel=1e-4)  # SGD(1.0): the update is the clipped gradient
    assert all(np.isfinite(v.numpy()).all() for v in model.variables)


@settings(max_examples=12, deadline=None)
@given(poisoned=st.sets(st.integers(0, N_BATCHES - 1), max_size=N_BATCHES - 1))
def test_exactly_the_poisoned_steps_are_skipped(poisoned, shared_setup):
    model, optimizer = shared_setup
    start = int(optimizer.iterations)
    history = train(model, make_dataset(poisoned=sorted(poisoned)), loss="mse", optimizer=optimizer, verbose=0)
    assert history.skipped == sorted(poisoned)
    assert [r.step for r in history.reports] == sorted(poisoned)
    assert int(optimizer.iterations) - start == N_BATCHES - len(poisoned)
    assert all(np.isfinite(v.numpy()).all() for v in model.variables)


@pytest.fixture(scope="module")
def shared_setup():
    # One model for all examples: train() reuses its compiled step, so examples are fast.
    return make_model(seed=1), keras.optimizers.Adam(0.01)


# --------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------


class _Interrupt:
    """A dataset that raises inside epoch `epoch` at batch `batch`, once."""

    def __init__(self, epoch: int | None, batch: int) -> None:
        self.fail_at = (epoch, batch)
        self.epoch = -1

    def dataset(self) -> tf.data.Dataset:
        indices = np.arange(N_BATCHES)
        batches = (indices, X.reshape(N_BATCHES, BATCH, FEATURES), Y.reshape(N_BATCHES, BATCH, 1))
        base = tf.data.Dataset.from_tensor_slices(batches)

        def check(i):
            if i == 0:
                self.epoch += 1
            if (self.epoch, int(i)) == self.fail_at:
                raise RuntimeError("simulated interruption")
            return i

        def with_check(i, x, y):
            i = tf.numpy_function(check, [i], tf.int64)
            with tf.control_dependencies([i]):
                return tf.identity(x), y

        return base.map(with_check)


def test_resumed_run_ends_bit_identical_to_an_uninterrupted_run(tmp_path):
    directory = tmp_path / "ckpt"
    model, optimizer = make_model(batch_norm=True), keras.optimizers.Adam(0.05)
    with pytest.raises(tf.errors.OpError, match="simulated interruption"):
        train(model, _Interrupt(epoch=1, batch=3).dataset(), loss="mse", optimizer=optimizer, epochs=3,
              checkpoint_dir=directory, verbose=0)
    # A new process would build a fresh model and optimizer; so do we.
    resumed_model, resumed_opt = make_model(batch_norm=True, seed=7), keras.optimizers.Adam(0.05)
    resumed = train(resumed_model, _Interrupt(epoch=None, batch=0).dataset(), loss="mse", optimizer=resumed_opt,
                    epochs=3, checkpoint_dir=directory, verbose=0)

    straight_model, straight_opt = make_model(batch_norm=True), keras.optimizers.Adam(0.05)
    straight = train(straight_model, _Interrupt(epoch=None, batch=0).dataset(), loss="mse", optimizer=straight_opt,
                     epochs=3, verbose=0)

    assert_bit_identical(state_of(resumed_model, resumed_opt), state_of(straight_model, straight_opt))
    assert resumed.step_loss == straight.step_loss and resumed.epoch_loss == straight.epoch_loss
    assert resumed.epochs == 3 and int(resumed_opt.iterations) == 3 * N_BATCHES

    # Same directory, finished run: nothing left to do, and the history comes back.
    again = train(resumed_model, make_dataset(), loss="mse", optimizer=resumed_opt, epochs=3,
                  checkpoint_dir=directory, verbose=0)
    assert again.step_loss == straight.step_loss and int(resumed_opt.iterations) == 3 * N_BATCHES

    # Another architecture cannot be restored from it.
    keras.utils.set_random_seed(0)
    other = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="does not match this model"):
        train(other, make_dataset(), loss="mse", optimizer=keras.optimizers.Adam(), epochs=3,
              checkpoint_dir=directory, verbose=0)


def test_history_survives_a_json_round_trip():
    from companion.diagnostics import GradientRecord, GradientReport

    history = TrainingHistory(step_loss=[1.0, 3.5], grad_norm=[2.0, float("nan")], skipped=[1],
                              epoch_loss=[1.0], epoch_steps=[2], xla=True)
    record = GradientRecord("dense/kernel", (2, 3), nan_count=6, inf_count=0, max_abs=float("nan"))
    history.reports.append(SkippedStep(1, 0, 3.5, GradientReport([record])))
    restored = TrainingHistory.from_json(history.to_json())
    assert restored.to_json() == history.to_json()
    assert restored.skipped == [1] and restored.reports[0].gradients[0].shape == (2, 3)
    assert np.isnan(restored.grad_norm[1]) and restored.xla is True
    assert restored.trailing_nonfinite() == 1 and TrainingHistory(step_loss=[1.0], skipped=[]).trailing_nonfinite() == 0


# --------------------------------------------------------------------------------------
# Output, inputs, XLA
# --------------------------------------------------------------------------------------


def test_verbose_0_prints_nothing_and_verbose_1_shows_a_progress_bar(capsys):
    model, optimizer = make_model(), keras.optimizers.SGD(0.01)
    train(model, make_dataset(poisoned=[2]), loss="mse", optimizer=optimizer, epochs=2, verbose=0)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""

    train(model, make_dataset(poisoned=[2]), loss="mse", optimizer=optimizer, epochs=2, verbose=1)
    out = capsys.readouterr().out
    assert "Epoch 1/2" in out and "Epoch 2/2" in out
    assert f"{N_BATCHES}/{N_BATCHES}" in out and "loss:" in out
    assert "skipped:" not in out  # skipped steps are in the history, not in the logs


def test_an_iterable_of_numpy_pairs_is_accepted():
    batches = [(X[i : i + BATCH], Y[i : i + BATCH]) for i in range(0, len(X), BATCH)]
    history = train(make_model(), batches, loss=keras.losses.MeanSquaredError(),
                    optimizer=keras.optimizers.Adam(0.05), epochs=3, verbose=0, jit_compile=False)
    assert history.steps == 3 * N_BATCHES and history.epoch_loss[-1] < history.epoch_loss[0]


class _DuckOptimizer:
    """Has apply_gradients, like a Keras 2 / tf_keras optimizer, but is not a Keras 3 optimizer."""

    def apply_gradients(self, grads_and_vars):
        raise AssertionError("must not be called")


#: train's own checks (fit's and compile's arguments raise as fit and compile raise them:
#: tests/contracts/test_training_keras_contracts.py compares the two).
BAD_INPUTS = [
    ({"on_nonfinite": "warn"}, ValueError, r"on_nonfinite must be one of \('skip', 'raise', 'ignore', 'rollback'\), got 'warn'"),
    ({"max_consecutive_nonfinite": 0}, ValueError, r"max_consecutive_nonfinite must be >= 1"),
    ({"clip_global_norm": -1.0}, ValueError, r"clip_global_norm must be a finite number > 0, got -1\.0"),
    ({"on_worker_loss": "hang"}, ValueError, r"on_worker_loss must be 'exit' or 'raise'"),
    ({"strategy": "mirrored"}, TypeError, r"strategy must be a tf.distribute.Strategy"),
    ({"dataset": [(X, Y, Y, Y)]}, TypeError, r"element 0 is a tuple of length 4"),
    ({"dataset": tf.data.Dataset.from_tensor_slices((X, np.repeat(Y, 3, 1))).batch(8)}, ValueError,
     r"prediction shape \(None, 1\) does not match target shape \(None, 3\)"),
]


@pytest.mark.parametrize("override, error, message", BAD_INPUTS, ids=lambda v: None)
def test_bad_input_raises_a_clear_error_before_any_step(override, error, message):
    model, optimizer = make_model(), keras.optimizers.SGD(0.01)
    arguments = {"dataset": make_dataset(), "loss": "mse", "optimizer": optimizer, "verbose": 0, **override}
    dataset = arguments.pop("dataset")
    before = [v.numpy().copy() for v in model.variables]
    with pytest.raises(error, match=message):
        train(model, dataset, **arguments)
    assert int(optimizer.iterations) == 0
    assert all(np.array_equal(v.numpy(), b) for v, b in zip(model.variables, before))


def test_model_that_is_not_a_keras_model_is_rejected():
    with pytest.raises(TypeError, match=r"model must be a Keras model .*got function"):
        train(lambda x: x, make_dataset(), loss="mse", optimizer=keras.optimizers.SGD())


def test_unbuilt_model_is_built_from_the_dataset():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    history = train(model, make_dataset(), loss="mse", optimizer=keras.optimizers.Adam(0.05), epochs=2, verbose=0,
                    jit_compile=False)
    assert model.built and history.steps == 2 * N_BATCHES


class HostOnlyNoise(keras.layers.Layer):
    """Adds zero computed by NumPy: tf.numpy_function has no XLA kernel."""

    def call(self, x):
        zero = tf.numpy_function(lambda a: np.zeros_like(a), [x], tf.float32)
        return x + tf.stop_gradient(tf.ensure_shape(zero, x.shape))


def test_xla_failure_falls_back_with_a_warning_and_trains():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(4), HostOnlyNoise(), keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam(0.05)
    with pytest.warns(RuntimeWarning, match=r"XLA could not compile the training step \(no XLA kernel for PyFunc\)"):
        history = train(model, make_dataset(poisoned=[3]), loss="mse", optimizer=optimizer, epochs=2, verbose=0,
                        jit_compile=True)
    assert history.xla is False
    assert history.skipped == [3, 11]  # the failed attempt consumed no step
    assert int(optimizer.iterations) == 2 * N_BATCHES - 2


def test_a_clean_run_issues_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        history = train(make_model(), make_dataset(), loss="mse", optimizer=keras.optimizers.SGD(0.01), verbose=0,
                        jit_compile=False)
    assert history.skipped == [] and history.reports == []


def test_ignore_mode_applies_every_step_as_fit_does():
    model, optimizer = make_model(), keras.optimizers.SGD(0.01)
    history = train(model, make_dataset(poisoned=[2]), loss="mse", optimizer=optimizer, on_nonfinite="ignore",
                    verbose=0)
    assert history.skipped == [] and not np.isfinite(history.step_loss[2])
    assert int(optimizer.iterations) == N_BATCHES
    assert not all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)


class _StepsPerCall(keras.callbacks.Callback):
    """Notes the model's steps_per_execution during fit (an epoch hook only)."""

    seen: list

    def on_epoch_end(self, epoch, logs=None):
        self.seen = [*getattr(self, "seen", []), int(self.model.steps_per_execution)]


def test_epoch_checkpoints_leave_train_several_steps_per_host_call_and_per_step_saving_does_not(tmp_path):
    from companion.training.callbacks import asks_for_batch_hooks

    class Custom(keras.callbacks.ModelCheckpoint):
        def on_train_batch_end(self, batch, logs=None):
            pass

    epoch_savers = [
        keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras")),
        keras.callbacks.BackupAndRestore(str(tmp_path / "backup")),
    ]
    assert not asks_for_batch_hooks(epoch_savers)
    assert asks_for_batch_hooks([keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras"), save_freq=1)])
    assert asks_for_batch_hooks([Custom(str(tmp_path / "m.keras"))])
    epochs = MIN_STEPS_FOR_LOOP // N_BATCHES  # a call long enough for the multi-step loop
    for callbacks, steps in ((epoch_savers[:1], N_BATCHES), ([Custom(str(tmp_path / "c.keras"))], 1)):
        watch = _StepsPerCall()
        train(make_model(), make_dataset(), loss="mse", optimizer=keras.optimizers.SGD(0.01), epochs=epochs,
              callbacks=[*callbacks, watch], verbose=0)
        assert watch.seen == [steps] * epochs


def test_steps_per_execution_given_to_train_holds_for_a_model_compiled_before_and_only_for_the_call():
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    watch = _StepsPerCall()
    history = train(model, make_dataset(), epochs=2, steps_per_execution=4, callbacks=[watch], verbose=0)
    assert watch.seen == [4, 4] and history.steps == 2 * N_BATCHES
    assert model.steps_per_execution == 1
    with pytest.raises(ValueError, match="steps_per_execution must be >= 1"):
        train(model, make_dataset(), steps_per_execution=0, verbose=0)


def test_terminate_on_nan_leaves_the_guarded_train_several_steps_per_host_call_but_not_ignore():
    # Under the guard a skipped step never reaches the logs, so TerminateOnNaN's per-step
    # hook acts on nothing; with on_nonfinite="ignore" it must see every step's loss.
    from companion.training.callbacks import asks_for_batch_hooks

    class Custom(keras.callbacks.TerminateOnNaN):
        def on_batch_end(self, batch, logs=None):
            pass

    terminate = keras.callbacks.TerminateOnNaN()
    assert asks_for_batch_hooks([terminate]) and not asks_for_batch_hooks([terminate], guarded=True)
    assert asks_for_batch_hooks([Custom()], guarded=True)
    epochs = MIN_STEPS_FOR_LOOP // N_BATCHES
    for mode, steps in (("skip", N_BATCHES), ("ignore", 1)):
        watch = _StepsPerCall()
        train(make_model(), make_dataset(), loss="mse", optimizer=keras.optimizers.SGD(0.01), epochs=epochs,
              callbacks=[keras.callbacks.TerminateOnNaN(), watch], verbose=0, on_nonfinite=mode)
        assert watch.seen == [steps] * epochs
    # Guarded, several steps per call: the NaN batch is skipped in every epoch, and
    # TerminateOnNaN never fires.
    model, optimizer = make_model(), keras.optimizers.SGD(0.01)
    history = train(model, make_dataset(poisoned=[2]), loss="mse", optimizer=optimizer, epochs=epochs,
                    callbacks=[keras.callbacks.TerminateOnNaN()], verbose=0)
    assert history.skipped == [2 + N_BATCHES * e for e in range(epochs)] and history.steps == epochs * N_BATCHES
    assert int(optimizer.iterations) == epochs * (N_BATCHES - 1)
    # Ignored, one step per call: TerminateOnNaN stops the run at the NaN batch, as under fit.
    history = train(make_model(), make_dataset(poisoned=[2]), loss="mse", optimizer=keras.optimizers.SGD(0.01),
                    epochs=epochs, callbacks=[keras.callbacks.TerminateOnNaN()], verbose=0, on_nonfinite="ignore")
    assert history.steps == 3


@pytest.mark.parametrize("epochs", [1, MIN_STEPS_FOR_LOOP // N_BATCHES - 1, MIN_STEPS_FOR_LOOP // N_BATCHES])
def test_train_runs_an_epoch_per_host_call_only_on_a_call_of_at_least_min_steps(epochs):
    # A shorter call would pay more for tracing Keras' multi-step loop than it saves.
    watch = _StepsPerCall()
    history = train(make_model(), make_dataset(), loss="mse", optimizer=keras.optimizers.SGD(0.01),
                    epochs=epochs, callbacks=[watch], verbose=0)
    long_enough = epochs * N_BATCHES >= MIN_STEPS_FOR_LOOP
    assert watch.seen == [N_BATCHES if long_enough else 1] * epochs
    assert history.steps == epochs * N_BATCHES
    # initial_epoch counts: the epochs left to run decide.
    watch = _StepsPerCall()
    train(make_model(), make_dataset(), loss="mse", optimizer=keras.optimizers.SGD(0.01), epochs=epochs + 1,
          initial_epoch=1, callbacks=[watch], verbose=0)
    assert watch.seen == [N_BATCHES if long_enough else 1] * epochs


def test_a_model_of_many_variables_needs_a_longer_call_for_several_steps_per_host_call():
    # The loop's one-off cost grows with the step's graph: 4 steps per trainable variable.
    def deep():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((FEATURES,)), *[keras.layers.Dense(4) for _ in range(11)],
                                 keras.layers.Dense(1)])

    variables = len(deep().trainable_variables)
    needed = MIN_STEPS_FOR_LOOP_PER_VARIABLE * variables
    assert needed > MIN_STEPS_FOR_LOOP
    for epochs in (MIN_STEPS_FOR_LOOP // N_BATCHES, -(-needed // N_BATCHES)):
        watch = _StepsPerCall()
        train(deep(), make_dataset(), loss="mse", optimizer=keras.optimizers.SGD(0.01), epochs=epochs,
              callbacks=[watch], verbose=0)
        assert watch.seen == [N_BATCHES if epochs * N_BATCHES >= needed else 1] * epochs


def test_the_doctor_finds_the_first_skipped_batch_of_arrays_and_skips_inputs_it_cannot_reread():
    x = X.copy()
    x[2 * BATCH + 3, 0] = np.nan
    history = train(make_model(), x, Y, batch_size=BATCH, shuffle=False, validation_split=0.25, epochs=2,
                    loss="mse", optimizer=keras.optimizers.SGD(0.01), verbose=0)
    assert history.skipped == [2, 8]  # 6 training batches per epoch (the last 2 validate)
    first, second = history.reports
    assert first.diagnosis is not None and first.diagnosis.batch == 2 and second.diagnosis is None
    assert first.diagnosis.cause == "nonfinite_input"

    # With shuffle=True (fit's default for arrays) fit permutes the rows with a
    # permutation only its pipeline knows: the doctor finds the NaN row in the rows' own
    # order and names no batch, rather than the unshuffled batch at the step's index.
    history = train(make_model(), x, Y, batch_size=BATCH, epochs=1, loss="mse",
                    optimizer=keras.optimizers.SGD(0.01), verbose=0)
    assert len(history.skipped) == 1
    shuffled = history.reports[0].diagnosis
    assert shuffled is not None and shuffled.cause == "nonfinite_input" and shuffled.batch is None

    def batches():  # a generator: fit reads it once, so the doctor cannot
        for start in range(0, len(x), BATCH):
            yield x[start:start + BATCH], Y[start:start + BATCH]

    history = train(make_model(), batches(), loss="mse", optimizer=keras.optimizers.SGD(0.01), verbose=0)
    assert history.skipped == [2] and history.reports[0].diagnosis is None


def test_an_older_keras_runs_at_most_32_steps_per_host_call_dividing_the_epoch():
    """Keras 3.5 unrolls a call's steps (TensorFlow refuses more than 32 iterator reads in
    one function) and drops a short last call: the largest divisor of the epoch up to 32."""
    from companion.training.loop import UNROLLED_STEPS, _batches_per_epoch, _steps_per_execution

    def chosen(batches):
        x = np.zeros((batches * 4, 1), "float32")
        return _steps_per_execution(_batches_per_epoch(x, 4, None, 0.0), whole_epochs_only=True, epochs=3)

    assert UNROLLED_STEPS == 32
    assert [chosen(b) for b in (64, 40, 37, 96, 12)] == [32, 20, 1, 32, 12]
    x = np.zeros((64 * 4, 1), "float32")
    assert _steps_per_execution(_batches_per_epoch(x, 4, None, 0.0), epochs=3) == 64  # a newer Keras: the whole epoch
