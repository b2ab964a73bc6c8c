"""Tests of companion.training's recovery: ``on_nonfinite="rollback"`` and ``skip_loss_spikes``.

The models are this file's own: a tanh MLP on a smooth regression that SGD(0.3, momentum
0.9) drives to NaN in its first epoch while a quarter of that rate trains it, and a
linear-ish regression whose data holds two batches with targets 300 times too large.
"""

from __future__ import annotations

import json
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from companion import _internal
from companion.diagnostics import CAUSES
from companion.training import NonFiniteError, Rollback, ScaledSchedule, SkippedStep, TrainingHistory, train
from companion.training.recovery import RATE_CANNOT_CURE


ROWS, FEATURES, BATCH = 2048, 8, 32  # 64 steps per epoch


W = np.random.default_rng(123).normal(size=(FEATURES, 1)).astype("float32")


def regression(rows=ROWS, seed=0):
    """``rows`` inputs (from ``seed``) and their targets, one smooth function for all seeds."""
    x = np.random.default_rng(seed).normal(size=(rows, FEATURES)).astype("float32")
    y = (np.sin(x @ W) + 0.5 * x[:, :1] * x[:, 1:2]).astype("float32")
    return x, y


def mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(64, activation="tanh"),
        keras.layers.Dense(64, activation="tanh"),
        keras.layers.Dense(1),
    ])


def sgd(rate):
    return keras.optimizers.SGD(rate, momentum=0.9)


def rate_of(optimizer) -> float:
    return float(tf.convert_to_tensor(optimizer.learning_rate).numpy())


def finite(model) -> bool:
    return all(np.isfinite(np.asarray(v.numpy())).all() for v in model.variables)


# --------------------------------------------------------------------------------------
# Rollback
# --------------------------------------------------------------------------------------


def test_a_diverging_run_rolls_back_and_finishes_at_a_smaller_rate():
    x, y = regression()
    model, optimizer = mlp(), sgd(0.3)
    history = train(model, x, y, batch_size=BATCH, epochs=6, loss="mse", optimizer=optimizer,
                    on_nonfinite="rollback", shuffle=False, verbose=0)

    rates = [r.learning_rate for r in history.rollbacks]
    assert rates == pytest.approx([0.15, 0.075])
    assert rate_of(optimizer) == pytest.approx(0.075)
    assert [r.scale for r in history.rollbacks] == [0.5, 0.25]
    assert all(r.restored_step < r.step for r in history.rollbacks)
    assert all(r.cause not in RATE_CANNOT_CURE for r in history.rollbacks)
    assert finite(model)

    reference, reference_optimizer = mlp(), sgd(0.075)
    clean = train(reference, x, y, batch_size=BATCH, epochs=6, loss="mse", optimizer=reference_optimizer,
                  shuffle=False, verbose=0)
    assert clean.skipped == [] and clean.rollbacks == []
    assert history.epoch_loss[-1] < 2 * clean.epoch_loss[-1]
    if tuple(int(p) for p in keras.__version__.split(".")[:2]) < (3, 6):
        return  # Keras 3.5 runs 32 steps per host call here (loop.UNROLLED_STEPS), not an epoch
    # The second rollback restored the state before the first step, at the end of epoch
    # 2: epochs 3 to 5 are the first three epochs of the run started at 0.075.
    assert history.rollbacks[-1].restored_step == 0
    assert history.epoch_loss[3:] == pytest.approx(clean.epoch_loss[:3], rel=1e-3)


def test_a_rollback_is_printed(capsys):
    x, y = regression()
    model = mlp()
    train(model, x, y, batch_size=BATCH, epochs=1, loss="mse", optimizer=sgd(0.3), on_nonfinite="rollback",
          max_rollbacks=1, shuffle=False, verbose=2)
    out = capsys.readouterr().out
    assert "companion.training: rollback 1 of 1 at step" in out and "learning rate 0.3 -> 0.15" in out


def test_after_max_rollbacks_the_last_good_state_is_restored_bit_for_bit():
    x, y = regression()
    model, optimizer = mlp(), sgd(0.3)
    initial = [np.array(v.numpy()) for v in model.variables]
    with pytest.raises(NonFiniteError, match=r"After 0 rollbacks \(max_rollbacks=0\)") as caught:
        train(model, x, y, batch_size=BATCH, epochs=2, loss="mse", optimizer=optimizer, on_nonfinite="rollback",
              max_rollbacks=0, shuffle=False, verbose=0)
    # The snapshot of the first epoch's start: the initial weights, a fresh optimizer.
    for before, variable in zip(initial, model.variables):
        assert np.array_equal(before.view(np.uint32), np.array(variable.numpy()).view(np.uint32))
    assert int(optimizer.iterations.numpy()) == 0
    assert all(not np.array(v.numpy()).any() for v in optimizer.variables if "momentum" in v.path)
    assert rate_of(optimizer) == pytest.approx(0.3)  # no rollback was made
    assert caught.value.history.rollbacks == []


class _StateAtEpochStart(keras.callbacks.Callback):
    """Keeps the state at every epoch's start, and after a rollback compares the model with it."""

    def __init__(self, optimizer):
        super().__init__()
        self.optimizer, self.saved, self.checked, self.seen = optimizer, None, [], 0

    def _state(self):
        rate = _internal.learning_rate_as_given(self.optimizer)
        variables = [*self.model.variables, *[v for v in self.optimizer.variables if v is not rate]]
        return [np.array(v.numpy()) for v in variables]

    def on_epoch_begin(self, epoch, logs=None):
        self.saved, self.start = self._state(), self.model.history.steps

    def on_train_batch_end(self, batch, logs=None):
        rollbacks = self.model.history.rollbacks
        if len(rollbacks) > self.seen:
            self.seen = len(rollbacks)
            if rollbacks[-1].restored_step == self.start:
                self.checked.append(all(np.array_equal(a, b) for a, b in zip(self.saved, self._state())))


def test_a_rollback_restores_exactly_the_snapshot_and_goes_on():
    x, y = regression()
    model, optimizer = mlp(), sgd(0.3)
    watcher = _StateAtEpochStart(optimizer)
    history = train(model, x, y, batch_size=BATCH, epochs=2, loss="mse", optimizer=optimizer,
                    on_nonfinite="rollback", callbacks=[watcher], shuffle=False, verbose=0)
    assert history.rollbacks and watcher.checked == [True] * len(watcher.checked) and watcher.checked
    assert history.steps == 2 * ROWS // BATCH  # fit went on with the next batches


class _StateAfterEveryStep(keras.callbacks.Callback):
    """The state at the start of every step (after the previous one), and after the first
    rollback the restored state next to the one kept for its ``restored_step``."""

    def __init__(self, optimizer):
        super().__init__()
        self.optimizer, self.states, self.restored = optimizer, {}, None

    def _state(self):
        rate = _internal.learning_rate_as_given(self.optimizer)
        variables = [*self.model.variables, *[v for v in self.optimizer.variables if v is not rate]]
        return [np.array(v.numpy()) for v in variables]

    def on_train_begin(self, logs=None):
        self.states[0] = self._state()

    def on_train_batch_end(self, batch, logs=None):
        history = self.model.history
        if history.rollbacks and self.restored is None:
            self.restored = (history.rollbacks[0], self._state())
        elif not history.rollbacks:
            self.states[history.steps] = self._state()


def test_a_snapshot_is_taken_every_so_many_steps_within_an_epoch():
    x, y = regression()
    model, optimizer = mlp(), sgd(0.3)
    watcher = _StateAfterEveryStep(optimizer)
    history = train(model, x, y, batch_size=BATCH, epochs=1, loss="mse", optimizer=optimizer, max_rollbacks=1,
                    on_nonfinite="rollback", snapshot_every_steps=8, callbacks=[watcher], shuffle=False, verbose=0)
    rollback, restored = watcher.restored
    # Within the first epoch (which diverges before its end), from a step after the first
    # and before the first non-finite one, on the 8-step grid; exactly that step's state.
    assert 0 < rollback.restored_step < history.skipped[0] and rollback.restored_step % 8 == 0
    assert rollback.step < ROWS // BATCH
    kept = watcher.states[rollback.restored_step]
    assert all(np.array_equal(a, b) for a, b in zip(kept, restored))
    assert all(np.isfinite(a).all() for a in restored)


def test_snapshot_every_steps_is_checked():
    model = mlp()
    with pytest.raises(ValueError, match="snapshot_every_steps"):
        train(model, *regression(), batch_size=BATCH, loss="mse", optimizer=sgd(0.1), on_nonfinite="rollback",
              snapshot_every_steps=-1, verbose=0)


def test_nan_in_the_data_stops_at_once_with_the_data_named():
    x, y = regression()
    x[5 * BATCH: 9 * BATCH: 7, 2] = np.nan  # a NaN in every batch from 5 to 8
    model, optimizer = mlp(), sgd(0.01)
    with pytest.raises(NonFiniteError) as caught:
        train(model, x, y, batch_size=BATCH, epochs=2, loss="mse", optimizer=optimizer, on_nonfinite="rollback",
              max_consecutive_nonfinite=3, shuffle=False, verbose=0)
    error = caught.value
    assert error.step == 7 and error.history.rollbacks == []
    assert error.diagnosis is not None and error.diagnosis.cause == "nonfinite_input"
    assert "nonfinite_input" in str(error) and "No rollback was made for it" in str(error)
    applied = sorted(set(range(error.history.steps)) - set(error.history.skipped))
    assert f"those after step {applied[-1]}" in str(error)
    assert rate_of(optimizer) == pytest.approx(0.01)
    assert finite(model)


def test_a_schedule_is_scaled_serialised_and_kept_by_a_resumed_run(tmp_path):
    x, y = regression()
    schedule = keras.optimizers.schedules.ExponentialDecay(0.3, decay_steps=10_000, decay_rate=0.9)
    model, optimizer = mlp(), keras.optimizers.SGD(schedule, momentum=0.9)
    history = train(model, x, y, batch_size=BATCH, epochs=2, loss="mse", optimizer=optimizer,
                    on_nonfinite="rollback", checkpoint_dir=tmp_path, shuffle=False, verbose=0)
    assert history.rollbacks
    scale = history.rollbacks[-1].scale
    scaled = _internal.learning_rate_as_given(optimizer)
    assert isinstance(scaled, ScaledSchedule) and scaled.factor == scale and scaled.schedule is schedule
    assert rate_of(optimizer) == pytest.approx(scale * float(schedule(optimizer.iterations)), rel=1e-6)
    copy = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert isinstance(_internal.learning_rate_as_given(copy), ScaledSchedule)
    assert float(copy.learning_rate) == pytest.approx(float(scaled(0)), rel=1e-6)

    # A new process would build the same model and optimizer, and resume.
    fresh_schedule = keras.optimizers.schedules.ExponentialDecay(0.3, decay_steps=10_000, decay_rate=0.9)
    resumed, resumed_optimizer = mlp(), keras.optimizers.SGD(fresh_schedule, momentum=0.9)
    again = train(resumed, x, y, batch_size=BATCH, epochs=3, loss="mse", optimizer=resumed_optimizer,
                  on_nonfinite="rollback", checkpoint_dir=tmp_path, shuffle=False, verbose=0)
    kept = _internal.learning_rate_as_given(resumed_optimizer)
    assert again.rollbacks[: len(history.rollbacks)] == history.rollbacks
    assert isinstance(kept, ScaledSchedule) and kept.factor == again.rollbacks[-1].scale


def test_a_resumed_run_keeps_the_reduced_rate(tmp_path):
    x, y = regression()
    model, optimizer = mlp(), sgd(0.3)
    history = train(model, x, y, batch_size=BATCH, epochs=2, loss="mse", optimizer=optimizer,
                    on_nonfinite="rollback", checkpoint_dir=tmp_path, shuffle=False, verbose=0)
    reduced = rate_of(optimizer)
    assert history.rollbacks and reduced < 0.3
    resumed, resumed_optimizer = mlp(), sgd(0.3)
    again = train(resumed, x, y, batch_size=BATCH, epochs=3, loss="mse", optimizer=resumed_optimizer,
                  on_nonfinite="rollback", checkpoint_dir=tmp_path, shuffle=False, verbose=0)
    assert again.rollbacks[: len(history.rollbacks)] == history.rollbacks
    assert rate_of(resumed_optimizer) == pytest.approx(again.rollbacks[-1].learning_rate)
    assert rate_of(resumed_optimizer) <= reduced
    assert again.epochs == 3 and finite(resumed)


# --------------------------------------------------------------------------------------
# Loss spikes
# --------------------------------------------------------------------------------------

SPIKE_BATCH, SPIKE_BATCHES, OUTLIERS = 64, 128, (40, 100)


def spiky_data(outliers=OUTLIERS):
    x, y = regression(SPIKE_BATCH * SPIKE_BATCHES, seed=1)
    y = y.copy()
    for batch in outliers:
        y[batch * SPIKE_BATCH: (batch + 1) * SPIKE_BATCH] *= 300.0
    return x, y


def small_mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((FEATURES,)), keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(1),
    ])


def test_loss_spikes_are_skipped_exactly_at_the_outlier_batches():
    x, y = spiky_data()
    validation = regression(1024, seed=2)
    epochs = 3

    def run(data, **options):
        model = small_mlp()
        return model, train(model, *data, batch_size=SPIKE_BATCH, epochs=epochs, loss="mse",
                            optimizer=keras.optimizers.Adam(3e-3), validation_data=validation, shuffle=False,
                            verbose=0, **options)

    _, guarded = run((x, y), skip_loss_spikes=6)
    expected = [e * SPIKE_BATCHES + b for e in range(epochs) for b in OUTLIERS]
    assert guarded.skipped == expected and guarded.spikes == expected
    assert all(r.reason == "spike" and np.isfinite(r.loss) and r.diagnosis is None for r in guarded.reports)
    assert "loss spike" in guarded.reports[0].cause()

    keep = np.ones(len(x), bool)
    for batch in OUTLIERS:
        keep[batch * SPIKE_BATCH: (batch + 1) * SPIKE_BATCH] = False
    _, without = run((x[keep], y[keep]))
    _, unguarded = run((x, y))
    guarded_loss, clean_loss = guarded.history["val_loss"][-1], without.history["val_loss"][-1]
    assert guarded_loss < 1.5 * clean_loss
    assert unguarded.history["val_loss"][-1] > 5 * clean_loss  # what the spikes do unskipped


def test_a_spike_does_not_count_toward_the_consecutive_limit():
    history = TrainingHistory(step_loss=[1.0, 2.0, 3.0, 4.0], skipped=[1, 2, 3])
    report = SkippedStep(1, 0, 2.0, _empty())
    history.reports += [report, SkippedStep(2, 0, 3e9, _empty(), reason="spike"), SkippedStep(3, 0, np.nan, _empty())]
    assert history.trailing_nonfinite() == 1
    assert history.spikes == [2]


def _empty():
    from companion.diagnostics.gradients import GradientReport

    return GradientReport([])


# --------------------------------------------------------------------------------------
# Records and arguments
# --------------------------------------------------------------------------------------


def test_records_survive_json_and_old_records_default_to_nonfinite():
    history = TrainingHistory(step_loss=[1.0, float("nan")], skipped=[1])
    history.reports.append(SkippedStep(1, 0, float("nan"), _empty(), reason="spike"))
    history.rollbacks.append(
        Rollback(step=9, restored_step=0, learning_rate=0.15, epoch=0, scale=0.5, cause="overflow"))
    again = TrainingHistory.from_json(history.to_json())
    assert again.rollbacks == history.rollbacks and again.reports[0].reason == "spike"
    old = SkippedStep(1, 0, 2.0, _empty()).to_dict()
    del old["reason"]
    assert SkippedStep.from_dict(json.loads(json.dumps(old))).reason == "nonfinite"
    data = json.loads(history.to_json())
    del data["rollbacks"]
    assert TrainingHistory.from_json(json.dumps(data)).rollbacks == []


def test_the_causes_no_rate_cures_are_the_doctors():
    assert RATE_CANNOT_CURE <= set(CAUSES)
    assert {"nonfinite_input", "log_of_zero", "division_by_zero", "domain_edge", "nonfinite_init"} <= RATE_CANNOT_CURE
    assert not {"divergence", "overflow", "not_reproducible", "unclassified"} & RATE_CANNOT_CURE


def test_scaled_schedule_serialises():
    decay = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    scaled = ScaledSchedule(ScaledSchedule(decay, 0.5).get_config()["schedule"], 0.25)
    again = keras.optimizers.schedules.deserialize(keras.optimizers.schedules.serialize(scaled))
    assert isinstance(again, ScaledSchedule) and again.factor == 0.25
    assert float(again(10)) == pytest.approx(0.1 * 0.5 * 0.25)
    with pytest.raises(ValueError):
        ScaledSchedule(decay, 0.0)


@pytest.mark.parametrize("options, error", [
    (dict(on_nonfinite="rollback", rollback_lr_factor=1.0), ValueError),
    (dict(on_nonfinite="rollback", rollback_lr_factor=0.0), ValueError),
    (dict(on_nonfinite="rollback", max_rollbacks=-1), ValueError),
    (dict(skip_loss_spikes=0), ValueError),
    (dict(skip_loss_spikes="6"), TypeError),
    (dict(skip_loss_spikes=6, on_nonfinite="ignore"), ValueError),
])
def test_recovery_arguments_are_checked(options, error):
    x, y = regression(64)
    with pytest.raises(error):
        train(mlp(), x, y, loss="mse", optimizer="sgd", verbose=0, **options)


def test_rollback_refuses_a_learning_rate_it_cannot_scale():
    x, y = regression(64)
    with pytest.raises(ValueError, match="rollback"):
        train(mlp(), x, y, loss="mse", optimizer=keras.optimizers.SGD(lambda: 0.1), on_nonfinite="rollback",
              verbose=0)


class TwoOptimizers(keras.Model):
    """A model's own ``train_step`` with two optimizers: the model's for the body, another for the head."""

    def __init__(self, rate):
        super().__init__()
        keras.utils.set_random_seed(0)
        self.body = [keras.layers.Dense(64, activation="tanh"), keras.layers.Dense(64, activation="tanh")]
        self.head = keras.layers.Dense(1)
        self.other = sgd(rate)

    def call(self, x):
        for layer in self.body:
            x = layer(x)
        return self.head(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean((self(x, training=True) - y) ** 2)
        body = [v for layer in self.body for v in layer.trainable_variables]
        head = self.head.trainable_variables
        grads = tape.gradient(loss, body + head)
        self.optimizer.apply(grads[: len(body)], body)
        self.other.apply(grads[len(body):], head)
        return {"loss": loss}


def test_a_models_own_step_with_two_optimizers_rolls_back_both():
    x, y = regression()
    model = TwoOptimizers(0.3)
    model(x[:1])
    with warnings.catch_warnings():
        # The doctor diagnoses each rollback's step: ``train`` builds the model's optimizer
        # on every weight, the step applies it to the body only (it once said "the
        # optimizer's state cannot be copied" and gave no cause).
        warnings.filterwarnings("error", message="the NaN doctor could not", category=RuntimeWarning)
        history = train(model, x, y, batch_size=BATCH, epochs=4, loss="mse", optimizer=sgd(0.3),
                        on_nonfinite="rollback", shuffle=False, verbose=0)
    assert history.rollbacks and all(rollback.cause == "overflow" for rollback in history.rollbacks)
    assert rate_of(model.optimizer) == pytest.approx(rate_of(model.other))
    assert rate_of(model.optimizer) == pytest.approx(0.3 * history.rollbacks[-1].scale)
    assert finite(model) and all(np.isfinite(np.asarray(v.numpy())).all() for v in model.other.variables)


def test_a_spike_ends_a_run_of_nonfinite_steps_in_the_step_too():
    x, y = spiky_data(outliers=(32,))
    x = x.copy()
    for batch in (30, 31, 33):
        x[batch * SPIKE_BATCH + 5, 0] = np.nan
    history = train(small_mlp(), x, y, batch_size=SPIKE_BATCH, epochs=1, loss="mse",
                    optimizer=keras.optimizers.Adam(3e-3), skip_loss_spikes=6, max_consecutive_nonfinite=3,
                    shuffle=False, verbose=0)  # no NonFiniteError: the spike is a finite step
    assert history.skipped == [30, 31, 32, 33]
    assert [r.reason for r in history.reports] == ["nonfinite", "nonfinite", "spike", "nonfinite"]
    assert history.reports[0].diagnosis is not None and history.reports[2].diagnosis is None


def test_rollback_and_spikes_work_with_mixed_precision():
    """Float16 layers: a loss-scale optimizer, whose update runs under the step's conditional."""

    def mixed(*widths):
        keras.utils.set_random_seed(0)
        hidden = [keras.layers.Dense(w, activation="tanh", dtype="mixed_float16") for w in widths]
        return keras.Sequential([keras.Input((FEATURES,)), *hidden, keras.layers.Dense(1, dtype="float32")])

    x, y = regression()
    model = mixed(64, 64)
    history = train(model, x, y, batch_size=BATCH, epochs=2, loss="mse", optimizer=sgd(0.3),
                    on_nonfinite="rollback", shuffle=False, verbose=0)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert history.rollbacks and rate_of(model.optimizer) == pytest.approx(0.3 * history.rollbacks[-1].scale)
    assert finite(model)

    xs, ys = spiky_data()
    # Targets divided by 30: the outliers are 10 times too large, and no float16 overflows.
    spiky = train(mixed(32), xs, ys / 30.0, batch_size=SPIKE_BATCH, epochs=2, loss="mse",
                  optimizer=keras.optimizers.Adam(3e-3), skip_loss_spikes=6, shuffle=False, verbose=0)
    assert spiky.update == "whole" or spiky.update == "graph"
    assert spiky.spikes == spiky.skipped == [e * SPIKE_BATCHES + b for e in range(2) for b in OUTLIERS]
