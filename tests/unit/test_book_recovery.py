"""companion.book.recovery: the training-loop chapter's diverging and spiky runs, and their plot."""

from __future__ import annotations

import doctest

import keras
import matplotlib
import numpy as np
import pytest

from companion.book import recovery
from companion.training import Rollback, TrainingHistory


def test_the_examples_run():
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    tests = [t for t in finder.find(recovery, globs={"keras": keras, "np": np, **vars(recovery)}) if t.examples]
    assert len(tests) >= 3
    for test in tests:
        runner.run(test)
    assert runner.failures == 0


def test_the_outlier_batches_alone_are_scaled_and_without_outliers_drops_them():
    x, y = recovery.spiky_data()
    clean = recovery.regression(len(x), seed=1)[1]
    ratio = np.ones(len(y), "float32")
    for batch in recovery.OUTLIER_BATCHES:
        ratio[batch * recovery.SPIKY_BATCH: (batch + 1) * recovery.SPIKY_BATCH] = recovery.OUTLIER_FACTOR
    np.testing.assert_allclose(y, clean * ratio[:, None], rtol=1e-6)
    kept_x, kept_y = recovery.without_outliers(x, y)
    assert len(kept_x) == len(x) - len(recovery.OUTLIER_BATCHES) * recovery.SPIKY_BATCH
    np.testing.assert_array_equal(kept_y, clean[ratio == 1])


def test_step_loss_recovers_each_steps_own_loss():
    """Keras logs the epoch's running mean; StepLoss gives back each batch's loss."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="zeros")])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")  # nothing trains: the losses are y²
    y = np.repeat(np.array([1.0, 2.0, 3.0, 4.0], "float32"), 2)[:, None]
    steps = recovery.StepLoss()
    model.fit(np.ones((8, 1), "float32"), y, batch_size=2, epochs=2, shuffle=False, verbose=0, callbacks=[steps])
    np.testing.assert_allclose(steps.losses, [1.0, 4.0, 9.0, 16.0] * 2, rtol=1e-5)


def test_plot_marks_rollbacks_spikes_and_the_first_nonfinite_step():
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = TrainingHistory(step_loss=[1.0, 2.0, 50.0, 1.5, float("nan"), 1.0], skipped=[2, 4])
    from companion.diagnostics.gradients import GradientReport
    from companion.training import SkippedStep

    history.reports += [SkippedStep(2, 0, 50.0, GradientReport([]), reason="spike"),
                        SkippedStep(4, 0, float("nan"), GradientReport([]))]
    history.rollbacks.append(Rollback(step=4, restored_step=0, learning_rate=0.1, epoch=0, scale=0.5, cause=None))
    fig, ax = plt.subplots()
    recovery.plot_losses(ax, {"fit": [1.0, 3.0, float("inf")], "train": history}, title="t")
    labels = ax.get_legend_handles_labels()[1]
    assert labels == ["fit", "train", "rollback", "skipped spike"]
    vertical = sorted(line.get_xdata()[0] for line in ax.lines if line.get_linestyle() in ("--", ":"))
    assert vertical == [2, 4, 4]  # fit's first inf, train's first NaN, the rollback
    assert ax.get_yscale() == "log"
    plt.close(fig)


@pytest.mark.parametrize("make", [recovery.diverging_model, recovery.spiky_model])
def test_models_are_seeded(make):
    first, second = make(seed=3), make(seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(first.get_weights(), second.get_weights()))
