"""companion.book.models.ParameterNet: the seed's failure, the fixes, Keras plumbing.

The training tests use a plain loop (tf.GradientTape + Adam, no guard), so a NaN
gradient is applied as it would be in the seed question. Small models: n = 32 points,
d_model 16, 2 heads, K = 3 terms, batches of 16 functions, Adam(1e-2).
"""

from __future__ import annotations

import dataclasses
import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework.config import disable_op_determinism, is_op_determinism_enabled

from companion.book import targets
from companion.book.models import FIX_NAMES, FIXES, ParameterNet
from companion.book.reproductions import seed_train_step

SEED = 0
LEARNING_RATE = 1e-2
BATCHES, BATCH_SIZE, POINTS = 8, 16, 32
#: The deterministic reproduction: ParameterNet(fixes=()) on the power-law family, after
#: keras.utils.set_random_seed(0), first gets non-finite gradients at this step (0-based).
SEED_MODEL_FIRST_NONFINITE_STEP = 8
#: Steps of the runs with every fix on.
TRAINING_STEPS = 100


@pytest.fixture(scope="module", autouse=True)
def _deterministic_ops():
    was_enabled = is_op_determinism_enabled()
    tf.config.experimental.enable_op_determinism()
    yield
    if not was_enabled:  # process-wide state: later test modules must not inherit it
        disable_op_determinism()


def _model(fixes=FIXES, **kwargs) -> ParameterNet:
    keras.utils.set_random_seed(SEED)
    return ParameterNet(num_terms=3, d_model=16, num_heads=2, fixes=fixes, **kwargs)


@dataclasses.dataclass
class Run:
    model: ParameterNet  # after the last applied step
    losses: list[float]  # the loss of each step, before its update
    finite: list[bool]  # whether all gradients of the step were finite
    first_nonfinite: int | None
    initial_eval: float  # loss on a held-out batch before training
    final_eval: float  # ... and after


def _batches(family):
    return [batch for batch, _ in targets.dataset(family, BATCHES, BATCH_SIZE, POINTS, seed=SEED)]


@functools.lru_cache(maxsize=None)
def _train(fixes, family, steps, *, c_range=(0.1, 2.0)) -> Run:
    """Adam on `family`'s batches, cycling, until `steps` or the first non-finite gradient.

    The step whose gradients are not all finite is not applied and ends the run, so
    `model` is in the state of that step (plain Adam would apply it and make the weights
    NaN; nothing the tests look at differs before that). Cached: tests share runs and
    must not train `model` further.
    """
    model = _model(fixes=fixes, c_range=c_range)
    data = _batches(family)
    held_out = targets.sample(family, 64, POINTS, seed=SEED + 1000)
    model(held_out)
    optimizer = keras.optimizers.Adam(LEARNING_RATE)
    variables = model.trainable_variables
    optimizer.build(variables)

    @tf.function
    def step(xs, ys):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model((xs, ys)) - ys))
        grads = tape.gradient(loss, variables)
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])

        def update():
            optimizer.apply_gradients(zip(grads, variables))
            return tf.constant(True)

        tf.cond(finite, update, lambda: tf.constant(False))
        return loss, finite

    def evaluate():
        return float(tf.reduce_mean(tf.square(model(held_out) - held_out[1])))

    initial = evaluate()
    losses, finite = [], []
    for index in range(steps):
        loss, ok = step(*data[index % BATCHES])
        losses.append(float(loss))
        finite.append(bool(ok))
        if not ok:
            break
    first = next((i for i, ok in enumerate(finite) if not ok), None)
    return Run(model, losses, finite, first, initial, evaluate())


# --- the seed's model fails ---------------------------------------------------------------


def test_seed_model_gets_nan_gradients_at_a_finite_loss_at_a_fixed_step():
    run = _train((), "power_law", 40)
    step = SEED_MODEL_FIRST_NONFINITE_STEP
    assert run.first_nonfinite == step
    assert all(run.finite[:step])
    assert all(np.isfinite(run.losses))  # the loss of the failing step is finite...
    assert run.losses[step] < run.losses[0]  # ...and lower than at the start: training "worked"


def test_seed_model_nan_comes_from_the_power_at_zero_with_an_exponent_below_one():
    # The model as it is at the failing step; the gradients of the predicted parameters
    # a, b, c, d of every (function, term).
    model = _train((), "power_law", 40).model
    xs, ys = _batches("power_law")[SEED_MODEL_FIRST_NONFINITE_STEP % BATCHES]
    with tf.GradientTape() as tape:
        parameters = model.predict_parameters((xs, ys))
        tape.watch(list(parameters.values()))
        loss = tf.reduce_mean(tf.square(model.evaluate_terms(parameters, xs) - ys))
    grads = tape.gradient(loss, parameters)
    assert np.isfinite(float(loss))
    bad = ~np.isfinite(grads["a"].numpy())
    assert bad.any()
    # Exactly the terms whose exponents dropped below 1. (b and c move together: their
    # gradients are equal while b = c, and both start at 1.)
    np.testing.assert_array_equal(bad, parameters["b"].numpy() < 1)
    np.testing.assert_allclose(parameters["b"].numpy(), parameters["c"].numpy(), rtol=1e-6)
    assert np.all(xs.numpy()[:, 0, 0] == 0.0)  # every function is sampled at x = 0
    # d/db is NaN as well (the outer power's infinite base-side derivative times the
    # masked 0 of the inner one); d/dd is finite: it does not pass through a derivative.
    np.testing.assert_array_equal(~np.isfinite(grads["b"].numpy()), bad)
    assert np.all(np.isfinite(grads["d"].numpy()))


def test_seed_train_step_with_global_norm_clipping_makes_every_weight_nan():
    model = _model(fixes=())
    xs, ys = targets.sample("sqrt", BATCH_SIZE, POINTS, seed=SEED)
    model((xs, ys))
    train_step = seed_train_step(model, keras.optimizers.Adam(learning_rate=1e-4))  # the answer's settings
    losses = [train_step((xs, ys), ys) for _ in range(2)]
    # Step 1 (b = 1 - 1e-4 after one Adam step) has a finite loss, yet it writes NaN everywhere.
    assert all(np.all(np.isfinite(loss.numpy())) for loss in losses)
    assert all(np.all(np.isnan(v.numpy())) for v in model.trainable_variables)
    assert np.all(np.isnan(model((xs, ys)).numpy()))


@pytest.mark.parametrize("fixes", [("bounded_exponents",), ("scaled_attention",)])
def test_the_answers_other_fixes_do_not_prevent_the_nan(fixes):
    run = _train(fixes, "power_law", 40)
    assert run.first_nonfinite is not None
    assert np.isfinite(run.losses[run.first_nonfinite])


@pytest.mark.parametrize("fixes", [("safe_power",), ("log_exp_power",)])
def test_a_power_fix_alone_prevents_the_nan(fixes):
    run = _train(fixes, "power_law", 30)
    assert run.first_nonfinite is None


# --- every fix on: clean training on every target family ------------------------------------


@pytest.mark.parametrize("family", sorted(targets.FAMILIES))
def test_fixed_model_trains_without_nonfinite_gradients_and_halves_the_loss(family):
    run = _train(FIXES, family, TRAINING_STEPS)
    assert run.first_nonfinite is None
    assert all(np.isfinite(run.losses))
    assert run.final_eval <= 0.5 * run.initial_eval, (run.initial_eval, run.final_eval)


def test_a_negative_c_range_fits_the_steep_target_better():
    bounded_default = _train(FIXES, "inverse_sqrt", TRAINING_STEPS)
    negative_c = _train(FIXES, "inverse_sqrt", TRAINING_STEPS, c_range=(-2.0, 2.0))
    assert negative_c.first_nonfinite is None
    assert negative_c.final_eval < 0.5 * bounded_default.final_eval


def test_signed_power_is_needed_for_negative_inputs():
    all_but_signed = tuple(fix for fix in FIXES if fix != "signed_power")
    safe_only = _train(all_but_signed, "signed_power", TRAINING_STEPS)
    signed = _train(FIXES, "signed_power", TRAINING_STEPS)
    assert safe_only.first_nonfinite is None and signed.first_nonfinite is None
    assert signed.final_eval < 0.25 * safe_only.final_eval  # safe_pow maps a x < 0 to 0


# --- construction, parameters, Keras plumbing ------------------------------------------------


def test_default_turns_every_fix_on_and_fixes_are_canonical():
    assert ParameterNet().fixes == FIXES
    assert set(FIX_NAMES) == {*FIXES, "log_exp_power"}
    assert ParameterNet(fixes=["layer_norm", "safe_power", "layer_norm"]).fixes == ("safe_power", "layer_norm")
    assert ParameterNet(fixes=()).power_name == "tf.pow"
    assert ParameterNet(fixes=("safe_power",)).power_name == "safe_pow"
    assert ParameterNet(fixes=("safe_power", "signed_power")).power_name == "signed_pow"
    assert ParameterNet(fixes=("log_exp_power",)).power_name == "log_exp_pow"


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"fixes": ("safe_powr",)}, ValueError, "unknown fix 'safe_powr'; valid fixes: safe_power, signed_power"),
        ({"fixes": "safe_power"}, TypeError, "collection of fix names"),
        ({"fixes": ("log_exp_power", "safe_power")}, ValueError, "instead of"),
        ({"b_range": (1.5, 2.0)}, ValueError, "contain 1"),
        ({"c_range": (2.0, 0.1)}, ValueError, "low < high"),
        ({"c_range": 2.0}, TypeError, "pair of numbers"),
        ({"num_terms": 0}, ValueError, "num_terms must be >= 1"),
        ({"d_model": 16.0}, TypeError, "d_model must be an int"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        ParameterNet(**kwargs)


def test_bad_inputs_raise_clear_errors():
    model = ParameterNet()
    xs, ys = targets.sample("sqrt", 2, 8)
    with pytest.raises(TypeError, match=r"pair \(xs, ys\)"):
        model(xs)
    with pytest.raises(ValueError, match=r"xs must have shape \(batch, n, 1\)"):
        model((xs[..., 0], ys))


@pytest.mark.parametrize("fixes", [(), ("bounded_exponents",), FIXES], ids=["seed", "bounded", "all"])
def test_exponents_start_at_one_and_the_output_has_the_input_shape(fixes):
    model = _model(fixes=fixes)
    xs, ys = targets.sample("power_law", 4, 16, seed=3)
    assert model((xs, ys)).shape == (4, 16, 1)
    parameters = model.predict_parameters((xs, ys))
    for name in "bc":
        np.testing.assert_allclose(parameters[name].numpy(), 1.0, atol=1e-6)
    assert parameters["a"].shape == (4, 3)
    # The terms differ (through a and d), so they do not stay identical during training.
    assert np.ptp(parameters["a"].numpy(), axis=1).min() > 0


def test_evaluate_terms_reproduces_the_call_and_evaluates_on_a_grid():
    model = _model()
    xs, ys = targets.sample("two_powers", 3, 16, seed=4)
    parameters = model.predict_parameters((xs, ys))
    np.testing.assert_allclose(model.evaluate_terms(parameters, xs).numpy(), model((xs, ys)).numpy(), rtol=1e-6)
    grid = np.tile(np.linspace(0, 2, 50, dtype=np.float32)[None, :, None], (3, 1, 1))
    per_term = model.evaluate_terms(parameters, grid, per_term=True)
    assert per_term.shape == (3, 50, 3)
    np.testing.assert_allclose(
        tf.reduce_sum(per_term, -1, keepdims=True).numpy(), model.evaluate_terms(parameters, grid).numpy(), rtol=1e-6
    )


@pytest.mark.parametrize("fixes", [(), FIXES], ids=["seed", "all"])
def test_config_round_trips_and_the_model_saves_and_loads(fixes, tmp_path):
    model = _model(fixes=fixes, c_range=(-2.0, 2.0))
    xs, ys = targets.sample("sqrt", 2, 8, seed=5)
    expected = model((xs, ys)).numpy()
    config = model.get_config()
    clone = ParameterNet.from_config(config)
    assert clone.get_config() == config
    assert clone.fixes == tuple(fixes) and clone.c_range == (-2.0, 2.0)
    assert keras.saving.get_registered_name(ParameterNet) == "companion>ParameterNet"
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, ParameterNet) and loaded.fixes == model.fixes
    np.testing.assert_array_equal(loaded((xs, ys)).numpy(), expected)


def test_mixed_precision_model_has_finite_gradients_at_zero():
    keras.utils.set_random_seed(SEED)
    model = ParameterNet(fixes=FIXES, dtype="mixed_float16")
    xs, ys = targets.sample("sqrt", 4, 16, seed=6)
    with tf.GradientTape() as tape:
        prediction = model((xs, ys))
        loss = tf.reduce_mean(tf.square(tf.cast(prediction, tf.float32) - ys))
    assert prediction.dtype == tf.float16
    grads = tape.gradient(loss, model.trainable_variables)
    assert all(np.all(np.isfinite(tf.cast(g, tf.float32).numpy())) for g in grads)
