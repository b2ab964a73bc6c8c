"""companion.book.runs: the instrumented runs of the case A chapters.

The model is the chapters' (ParameterNet, K = 3, d_model 16, 2 heads) on the power-law
batches every function of which is sampled at x = 0, so that the runs fail the way the
book says they fail.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework.config import disable_op_determinism, is_op_determinism_enabled

from companion.book import targets
from companion.diagnostics import nonfinite_gradients
from companion.book.models import ParameterNet
from companion.numerics import bounded
from companion.book.runs import NonFiniteRun, learning_rate_sweep, run_until_nonfinite, steps_to_reach


@pytest.fixture(scope="module", autouse=True)
def _deterministic_ops():
    was_enabled = is_op_determinism_enabled()
    tf.config.experimental.enable_op_determinism()
    yield
    if not was_enabled:
        disable_op_determinism()


@pytest.fixture(scope="module")
def batches():
    return list(targets.dataset("power_law", batches=8, batch_size=16, n=32, seed=0))


def _net(fixes=()):
    return ParameterNet(num_terms=3, d_model=16, num_heads=2, fixes=fixes)


def test_run_stops_at_the_first_nonfinite_step_and_does_not_apply_it(batches):
    keras.utils.set_random_seed(0)
    model = _net()
    run = run_until_nonfinite(model, batches, keras.optimizers.Adam(1e-2), max_steps=30)
    assert isinstance(run, NonFiniteRun) and run.step is not None
    assert run.steps == run.step + 1 == len(run.smallest_exponent)
    assert all(math.isfinite(loss) for loss in run.losses)  # the loss never shows it
    # The model keeps the weights of the step before: its gradients on the failing
    # batch are the non-finite ones the run counted, and its weights are finite.
    report = nonfinite_gradients(model, "mse", batches[run.step % len(batches)])
    assert len(report.nonfinite) == run.nonfinite_variables > 0
    assert all(bool(np.all(np.isfinite(v))) for v in model.trainable_variables)
    # The mechanism of the book: every exponent >= 1 until the failing step, one below 1 there.
    assert min(run.smallest_exponent[:-1]) >= 1.0 > run.smallest_exponent[-1]
    assert all(low <= high for low, high in zip(run.smallest_exponent, run.largest_exponent))


def test_run_with_the_exact_power_has_no_failing_step(batches):
    keras.utils.set_random_seed(0)
    run = run_until_nonfinite(_net(("safe_power",)), batches, keras.optimizers.Adam(1e-2), max_steps=12)
    assert run.step is None and run.steps == 12 and run.nonfinite_variables == 0
    assert min(run.smallest_exponent) < 1.0  # it went below 1 and carried on


def test_run_accepts_bare_input_pairs_and_models_without_parameters():
    xs, ys = targets.sample("sqrt", 4, 8, seed=0)
    keras.utils.set_random_seed(0)
    dense = keras.Sequential([keras.Input((8, 1)), keras.layers.Dense(1)])
    run = run_until_nonfinite(dense, [(xs, ys)] * 2, keras.optimizers.SGD(0.1), max_steps=3)
    assert run.step is None and run.steps == 3 and run.smallest_exponent == ()
    assert run.losses[-1] < run.losses[0]


def test_a_smaller_learning_rate_postpones_the_failure_from_the_same_start(batches):
    runs = learning_rate_sweep(_net, batches, [1e-2, 1e-3], max_steps=120)
    assert list(runs) == [1e-2, 1e-3]
    assert runs[1e-2].losses[0] == runs[1e-3].losses[0]  # the same seeded start
    assert runs[1e-2].step is not None and runs[1e-3].step is not None
    assert runs[1e-3].step > 3 * runs[1e-2].step


@pytest.mark.parametrize("learning_rate", [0.1, 0.25, 0.4])
def test_steps_to_reach_matches_the_closed_form_of_gradient_descent(learning_rate):
    # On (w - 1)^2, SGD multiplies the distance to 1 by |1 - 2 lr| each step.
    starts = np.array([0.0, 0.5, 0.9, 1.5])
    steps = steps_to_reach(
        lambda w: w, starts, keras.optimizers.SGD(learning_rate), target=1.0, tolerance=1e-3, max_steps=500
    )
    expected = [max(1, math.ceil(math.log(1e-3 / abs(s - 1)) / math.log(abs(1 - 2 * learning_rate)))) for s in starts]
    np.testing.assert_array_equal(steps, expected)


def test_steps_to_reach_through_a_sigmoid_is_slower_near_the_bound_and_reports_0_when_out_of_budget():
    starts = np.float32([0.29, 0.119])
    raw = np.log(starts - 0.1) - np.log(2.0 - starts)
    through = steps_to_reach(
        lambda r: bounded(r, 0.1, 2.0), raw, keras.optimizers.SGD(0.1), target=1.0, tolerance=0.01, max_steps=2000
    )
    direct = steps_to_reach(lambda w: w, starts, keras.optimizers.SGD(0.1), target=1.0, tolerance=0.01, max_steps=2000)
    assert np.all(through > direct) and through[1] > through[0] > 0
    short = steps_to_reach(lambda w: w, [0.0], keras.optimizers.SGD(0.01), target=1.0, tolerance=1e-6, max_steps=3)
    np.testing.assert_array_equal(short, [0])


@pytest.mark.parametrize(
    "call",
    [
        lambda: run_until_nonfinite(_net(), [], keras.optimizers.Adam(), max_steps=1),
        lambda: run_until_nonfinite(_net(), [targets.sample("sqrt", 2, 4)], keras.optimizers.Adam(), max_steps=0),
        lambda: learning_rate_sweep(_net, [targets.sample("sqrt", 2, 4)], [0.0], max_steps=1),
        lambda: steps_to_reach(lambda w: w, 0.0, keras.optimizers.SGD(), target=1.0, tolerance=0.0, max_steps=1),
        lambda: steps_to_reach(lambda w: w, 0.0, keras.optimizers.SGD(), target=1.0, tolerance=0.1, max_steps=True),
    ],
)
def test_bad_arguments_raise_value_error(call):
    with pytest.raises(ValueError):
        call()
