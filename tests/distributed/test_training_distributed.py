"""companion.training under tf.distribute.MirroredStrategy and under mixed precision.

MirroredStrategy needs two logical CPU devices, which can only be configured before
TensorFlow runs its first op, so that scenario runs in a fresh Python process (one
process for all its checks: the TensorFlow import alone takes seconds). Mixed precision
is set per layer (``dtype="mixed_float16"``), so it runs here without touching the
global Keras policy.
"""

from __future__ import annotations

import textwrap
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from companion.training import train
from fresh_process import TWO_CPUS, run_script  # tests/distributed/fresh_process.py

MIRRORED_SCRIPT = TWO_CPUS + textwrap.dedent(
    r"""
    import keras
    import numpy as np
    from companion.training import SkipNonFinite, train

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype("float32")
    y = x @ np.array([[1.0], [2.0], [-1.0]], "float32")
    # Global batch 8 is split 4 + 4: row 6 of batch 1 goes to replica 1 only.
    x_poisoned = x.copy()
    x_poisoned[8 + 6, 0] = np.nan
    poisoned = tf.data.Dataset.from_tensor_slices((x_poisoned, y)).batch(8)
    clean = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)

    def model_and_optimizer():
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([
                keras.Input((3,)),
                keras.layers.Dense(8, activation="tanh"),
                keras.layers.BatchNormalization(),
                keras.layers.Dense(1),
            ])
            return model, keras.optimizers.Adam(0.05)

    def replica_values(variable):
        return [np.array(v.numpy()) for v in variable.value.values]

    def state(model, optimizer):
        return [a for v in model.variables + optimizer.variables for a in replica_values(v)]

    result = {"replicas": strategy.num_replicas_in_sync}
    first_replica, second_replica = [], []
    for xb, _ in strategy.experimental_distribute_dataset(poisoned.take(2)):
        first_replica.append(bool(np.isnan(xb.values[0].numpy()).any()))
        second_replica.append(bool(np.isnan(xb.values[1].numpy()).any()))
    result["nan_on_replica"] = [first_replica, second_replica]

    model, optimizer = model_and_optimizer()
    history = train(model, poisoned, loss="mse", optimizer=optimizer, epochs=3, strategy=strategy, verbose=0)
    result["skipped"] = history.skipped
    result["iterations"] = int(optimizer.iterations.numpy())
    result["epoch_loss"] = history.epoch_loss
    result["xla"] = history.xla
    result["report_paths"] = [r.path for r in history.reports[0].gradients]
    result["all_finite"] = all(np.isfinite(a).all() for a in state(model, optimizer))
    result["trainable_in_sync"] = all(
        all(np.array_equal(values[0], other) for other in values[1:])
        for values in (replica_values(v) for v in model.trainable_variables)
    )

    # Skipping changes nothing on any replica: [batch 0, poisoned batch 1] == [batch 0]
    # (without XLA, to save compile time: the skip logic is the same).
    a_model, a_opt = model_and_optimizer()
    train(a_model, poisoned.take(2), loss="mse", optimizer=a_opt, strategy=strategy, verbose=0, jit_compile=False)
    b_model, b_opt = model_and_optimizer()
    train(b_model, clean.take(1), loss="mse", optimizer=b_opt, strategy=strategy, verbose=0, jit_compile=False)
    result["skip_bit_identical"] = all(
        a.tobytes() == b.tobytes() for a, b in zip(state(a_model, a_opt), state(b_model, b_opt))
    )

    # model.fit with SkipNonFinite under the same strategy.
    keras.utils.set_random_seed(0)
    with strategy.scope():
        fit_model = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
        )
        fit_model.compile(optimizer=SkipNonFinite(keras.optimizers.Adam(0.05)), loss="mse")
    fit_model.fit(poisoned, epochs=2, verbose=0, shuffle=False)
    result["fit_skipped"] = int(fit_model.optimizer.skipped_steps.numpy())
    result["fit_iterations"] = int(fit_model.optimizer.iterations.numpy())
    result["fit_finite"] = all(np.isfinite(a).all() for v in fit_model.variables for a in replica_values(v))

    # The update uses the gradients of the global batch, summed once: with SGD (whose step
    # is proportional to the gradient, unlike Adam's) two replicas equal one device.
    def sgd_weights(strategy_or_none, **options):
        keras.utils.set_random_seed(0)
        with (strategy_or_none or tf.distribute.get_strategy()).scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
            optimizer = keras.optimizers.SGD(0.05, momentum=0.5)
        train(model, clean, loss="mse", optimizer=optimizer, epochs=2, strategy=strategy_or_none, verbose=0,
              jit_compile=False, **options)
        return np.concatenate([w.ravel() for w in model.get_weights()])

    result["sgd_difference"] = float(np.abs(sgd_weights(strategy) - sgd_weights(None)).max())
    result["sgd_clipped_difference"] = float(
        np.abs(sgd_weights(strategy, clip_global_norm=0.5) - sgd_weights(None, clip_global_norm=0.5)).max()
    )

    # A step whose loss and gradients are finite but whose update overflows (SGD with a
    # learning rate of 1e30 on gradients of about 1e10) is skipped on every replica, and
    # every replica's copy of every variable is put back.
    keras.utils.set_random_seed(0)
    with strategy.scope():
        big = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        big_optimizer = keras.optimizers.SGD(1e30)
    big_before = [a.copy() for v in big.variables for a in replica_values(v)]
    overflowing = tf.data.Dataset.from_tensor_slices((x, y * 1e10)).batch(8).take(1)
    big_history = train(big, overflowing, loss="mse", optimizer=big_optimizer, strategy=strategy, verbose=0)
    result["overflow_skipped"] = big_history.skipped
    result["overflow_loss_finite"] = bool(np.isfinite(big_history.step_loss[0]))
    result["overflow_norm_finite"] = bool(np.isfinite(big_history.grad_norm[0]))
    result["overflow_unchanged"] = all(
        a.tobytes() == b.tobytes()
        for a, b in zip(big_before, [a for v in big.variables for a in replica_values(v)])
    )
    result["overflow_iterations"] = int(big_optimizer.iterations.numpy())

    # A model created outside the scope is refused before any step.
    keras.utils.set_random_seed(0)
    outside = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    try:
        train(outside, clean, loss="mse", optimizer=keras.optimizers.SGD(), strategy=strategy, verbose=0)
        result["outside_error"] = None
    except ValueError as error:
        result["outside_error"] = str(error)

    # keras.io's models that customise fit (tests/unit/test_training_custom_steps.py), two of
    # them with two optimizers of their own (a GAN's d_optimizer and g_optimizer): on
    # clean data train ends bit-identical to fit under the same strategy, on every
    # replica; a step with a NaN on replica 1 only changes no replica's copy of any
    # variable (the weights, every optimizer's state, the metrics, a queue the step
    # assigns itself); only the random state moves on.
    import sys
    sys.path[:0] = [os.environ["COMPANION_TESTS"], os.path.join(os.environ["COMPANION_TESTS"], "unit")]
    import test_training_custom_steps as steps

    def built(name):
        with strategy.scope():
            model, data = steps._make(name)
            # Under a strategy fit builds a model symbolically, which a model without
            # call() (the GAN, the VAE) cannot be: the user says it is built.
            model.built = True
        return model, data

    def every_copy(model):
        return {path: replica_values(v) for path, v in steps.every_variable(model, values=False).items()}

    def differing(a, b, seeds=False):
        return sorted(p for p in a if (p.endswith("seed_generator_state") == seeds)
                      and not all(x.tobytes() == y.tobytes() for x, y in zip(a[p], b[p])))

    result["custom"] = {}
    for name in steps.PATTERNS:
        fitted, (xs, ys) = built(name)
        xs, ys = xs[:32], None if ys is None else ys[:32]
        with strategy.scope():
            steps.OPTIMIZERS_BUILT_BEFORE_FIT.get(name, lambda model: None)(fitted)
        fitted.fit(xs, ys, batch_size=16, shuffle=False, verbose=0)
        trained, _ = built(name)
        history = train(trained, xs, ys, batch_size=16, shuffle=False, verbose=0, strategy=strategy)
        fit_state, train_state = every_copy(fitted), every_copy(trained)
        # Then one more step, with a NaN in row 12 of the batch: replica 1's half.
        poisoned_x = xs[:16].copy()
        poisoned_x[12] = np.nan
        before = {}  # after fit has reset the metrics, before the step
        snapshot = keras.callbacks.LambdaCallback(on_epoch_begin=lambda *_: before.update(every_copy(trained)))
        poisoned_history = train(trained, poisoned_x, None if ys is None else ys[:16], batch_size=16,
                                 shuffle=False, verbose=0, strategy=strategy, callbacks=[snapshot])
        after = every_copy(trained)
        result["custom"][name] = {
            "copies": sorted({len(values) for values in train_state.values()}),
            "skipped": history.skipped, "steps": history.steps,
            "same_variables": sorted(fit_state) == sorted(train_state),
            "differ_from_fit": differing(fit_state, train_state) + differing(fit_state, train_state, seeds=True),
            "poisoned_skipped": poisoned_history.skipped,
            "diagnosis": [(r.diagnosis.cause, r.diagnosis.inputs_summary.split(":")[0]) if r.diagnosis else None
                          for r in poisoned_history.reports],
            "changed_by_skip": differing(before, after),
            "seeds": sorted(p for p in after if p.endswith("seed_generator_state")),
            "seeds_moved": differing(before, after, seeds=True),
        }
    print("RESULT " + json.dumps(result))
    """
)


@pytest.fixture(scope="module")
def mirrored_result() -> dict:
    return run_script(MIRRORED_SCRIPT)


@pytest.mark.slow
def test_mirrored_nan_on_one_replica_skips_the_step_on_all(mirrored_result):
    result = mirrored_result
    assert result["replicas"] == 2
    assert result["nan_on_replica"] == [[False, False], [False, True]]  # only replica 1 sees the NaN
    assert result["skipped"] == [1, 9, 17]
    assert result["iterations"] == 3 * 8 - 3
    assert result["all_finite"] and result["trainable_in_sync"]
    assert result["epoch_loss"][-1] < result["epoch_loss"][0]
    # Keras' XLA step fails under MirroredStrategy on CPU (fit raises InvalidArgumentError
    # with jit_compile=True), so train runs it without XLA under several replicas
    # (book/reference/differences_from_fit.md); the old train compiled its own step.
    assert result["xla"] is False
    assert "sequential/dense/kernel" in result["report_paths"]


@pytest.mark.slow
def test_mirrored_skip_is_bit_identical_on_every_replica(mirrored_result):
    assert mirrored_result["skip_bit_identical"]


@pytest.mark.slow
def test_mirrored_fit_with_skip_nonfinite(mirrored_result):
    assert mirrored_result["fit_skipped"] == 2
    assert mirrored_result["fit_iterations"] == 2 * (8 - 1)
    assert mirrored_result["fit_finite"]


@pytest.mark.slow
def test_mirrored_update_equals_one_device_with_and_without_clipping(mirrored_result):
    # A gradient summed twice (once for the finiteness test, once more by the optimizer)
    # would make these steps twice as long: differences of order 0.1, not 1e-6.
    assert mirrored_result["sgd_difference"] < 1e-5
    assert mirrored_result["sgd_clipped_difference"] < 1e-5


@pytest.mark.slow
def test_mirrored_step_whose_update_overflows_is_skipped_and_put_back_on_every_replica(mirrored_result):
    # Finite loss and gradients: only the test of what the step wrote sees the overflow.
    assert mirrored_result["overflow_loss_finite"] and mirrored_result["overflow_norm_finite"]
    assert mirrored_result["overflow_skipped"] == [0]
    assert mirrored_result["overflow_unchanged"]
    assert mirrored_result["overflow_iterations"] == 0


@pytest.mark.slow
def test_mirrored_model_created_outside_the_scope_is_refused(mirrored_result):
    assert "not created under the strategy's scope" in mirrored_result["outside_error"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["guide", "vae", "gan", "contrastive", "own_optimizer"])
def test_mirrored_custom_train_step_trains_bit_identical_to_fit_and_a_poisoned_step_changes_no_replica(
    mirrored_result, name
):
    got = mirrored_result["custom"][name]
    assert got["copies"] == [2]  # every variable read on both replicas
    assert got["skipped"] == [] and got["steps"] == 2
    assert got["same_variables"] and got["differ_from_fit"] == []
    assert got["poisoned_skipped"] == [0]
    # The doctor re-runs the model's own step on each replica's part of the batch.
    assert got["diagnosis"] == [["nonfinite_input", "replica 1"]]
    assert got["changed_by_skip"] == []
    assert got["seeds_moved"] == got["seeds"]  # a skipped random draw is not drawn again


# --------------------------------------------------------------------------------------
# Mixed precision
# --------------------------------------------------------------------------------------

_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(64, 3)).astype("float32")
Y = X @ np.array([[1.0], [2.0], [-1.0]], "float32")


def dataset(poisoned=()):
    x = X.copy()
    for batch in poisoned:
        x[batch * 8 + 3, 0] = np.nan
    return tf.data.Dataset.from_tensor_slices((x, Y)).batch(8)


def mixed_model(policy: str) -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(16, activation="tanh", dtype=policy),
            keras.layers.Dense(1, dtype=policy),
        ]
    )


def test_mixed_float16_trains_with_dynamic_loss_scaling():
    model, optimizer = mixed_model("mixed_float16"), keras.optimizers.Adam(0.05)
    assert model.layers[0].compute_dtype == "float16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no stall warning on a healthy run
        history = train(model, dataset(poisoned=[2]), loss="mse", optimizer=optimizer, epochs=4, verbose=0)

    assert history.epoch_loss[-1] < 0.2 * history.epoch_loss[0]
    assert len(history.loss_scale) == history.steps and history.loss_scale[0] == 2.0**15
    assert not history.loss_scale_stalled
    for step in history.skipped:  # every skipped step halves the scale, and nothing else
        assert history.loss_scale[step + 1] == history.loss_scale[step] / 2
    assert {2, 10, 18, 26} <= set(history.skipped)
    assert int(optimizer.iterations) == history.steps - len(history.skipped)  # the inner optimizer's counter
    assert all(np.isfinite(v.numpy()).all() for v in model.variables)


def test_stalled_loss_scale_is_reported():
    model = mixed_model("mixed_float16")
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.05), initial_scale=4.0)
    with pytest.warns(RuntimeWarning, match=r"dynamic loss scale fell to 1 by step 1: the gradients are non-finite"):
        history = train(model, dataset(poisoned=[0, 1, 2, 3]), loss="mse", optimizer=optimizer, verbose=0,
                        jit_compile=False)

    assert history.loss_scale_stalled
    assert history.skipped == [0, 1, 2, 3]
    assert history.loss_scale[:5] == [4.0, 2.0, 1.0, 0.5, 0.25]
    assert int(optimizer.inner_optimizer.iterations) == 4  # the four good steps after the stall


def test_mixed_bfloat16_trains_and_skips_without_loss_scaling():
    model, optimizer = mixed_model("mixed_bfloat16"), keras.optimizers.Adam(0.05)
    history = train(model, dataset(poisoned=[1]), loss="mse", optimizer=optimizer, epochs=3, verbose=0,
                    jit_compile=False)
    assert history.skipped == [1, 9, 17] and history.loss_scale == []
    assert history.epoch_loss[-1] < 0.5 * history.epoch_loss[0]
