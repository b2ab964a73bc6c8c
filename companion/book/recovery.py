"""The training-loop chapter's two runs that skipping alone does not save, and their plot.

* The **diverging run**: a tanh MLP (8 → 64 → 64 → 1) on a smooth regression of 2048 rows
  in batches of 32 (64 steps an epoch), trained with ``SGD(0.3, momentum=0.9)``: its loss
  grows and turns ``NaN`` within the first epoch, while a quarter of that rate trains it.
  ``train(..., on_nonfinite="rollback")`` rolls back and halves the rate.
* The **spiky run**: a tanh MLP (8 → 32 → 1) on the same function, 128 batches of 64 of
  which two (:data:`OUTLIER_BATCHES`) have targets :data:`OUTLIER_FACTOR` times too large:
  finite outliers whose steps throw Adam's moments off for the rest of the run.
  ``train(..., skip_loss_spikes=6)`` skips exactly those steps.

:class:`StepLoss` records the loss of every step of a ``fit`` (Keras logs the running mean
of the epoch), and :func:`plot_losses` draws losses against steps, with rollbacks and
skipped spikes marked. The chapter is ``book/tools/training_loop.ipynb``; the tests of the
features are ``tests/unit/test_training_recovery.py``.
"""

from __future__ import annotations

from typing import Any, Sequence

import keras
import numpy as np

__all__ = [
    "BATCH", "FEATURES", "OUTLIER_BATCHES", "OUTLIER_FACTOR", "SPIKY_BATCH", "SPIKY_BATCHES", "StepLoss",
    "diverging_model", "plot_losses", "regression", "spiky_data", "spiky_model", "without_outliers",
]

#: The features of both runs' regressions.
FEATURES = 8
#: The diverging run's batch size (2048 rows, so 64 steps an epoch).
BATCH = 32
#: The spiky run's batch size and batches per epoch.
SPIKY_BATCH, SPIKY_BATCHES = 64, 128
#: The spiky run's outlier batches, and how much too large their targets are.
OUTLIER_BATCHES, OUTLIER_FACTOR = (40, 100), 300.0

_W = np.random.default_rng(123).normal(size=(FEATURES, 1)).astype("float32")


def regression(rows: int = 2048, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` standard-normal inputs (from ``seed``) and their targets
    ``sin(x · w) + x₀ x₁ / 2``, one fixed ``w`` for every seed.

    Example:
        >>> x, y = regression(4)
        >>> x.shape, y.shape, str(y.dtype)
        ((4, 8), (4, 1), 'float32')
    """
    x = np.random.default_rng(seed).normal(size=(rows, FEATURES)).astype("float32")
    y = (np.sin(x @ _W) + 0.5 * x[:, :1] * x[:, 1:2]).astype("float32")
    return x, y


def diverging_model(seed: int = 0) -> keras.Model:
    """The diverging run's tanh MLP, 8 → 64 → 64 → 1, its weights from ``seed``."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(64, activation="tanh"),
        keras.layers.Dense(64, activation="tanh"),
        keras.layers.Dense(1),
    ])


def spiky_model(seed: int = 0) -> keras.Model:
    """The spiky run's tanh MLP, 8 → 32 → 1, its weights from ``seed``."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((FEATURES,)), keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(1),
    ])


def spiky_data(outliers: Sequence[int] = OUTLIER_BATCHES,
               factor: float = OUTLIER_FACTOR) -> tuple[np.ndarray, np.ndarray]:
    """:data:`SPIKY_BATCHES` batches of :data:`SPIKY_BATCH` rows (seed 1) whose batches
    ``outliers`` have their targets multiplied by ``factor``.

    Example:
        >>> x, y = spiky_data()
        >>> clean = regression(len(x), seed=1)[1]
        >>> bool(np.allclose(y[40 * 64], 300 * clean[40 * 64]))
        True
        >>> bool((y[:64] == clean[:64]).all())
        True
    """
    x, y = regression(SPIKY_BATCH * SPIKY_BATCHES, seed=1)
    y = y.copy()
    for batch in outliers:
        y[batch * SPIKY_BATCH: (batch + 1) * SPIKY_BATCH] *= factor
    return x, y


def without_outliers(x: np.ndarray, y: np.ndarray,
                     outliers: Sequence[int] = OUTLIER_BATCHES) -> tuple[np.ndarray, np.ndarray]:
    """``x`` and ``y`` without the rows of the batches ``outliers``: the run without them."""
    keep = np.ones(len(x), bool)
    for batch in outliers:
        keep[batch * SPIKY_BATCH: (batch + 1) * SPIKY_BATCH] = False
    return x[keep], y[keep]


class StepLoss(keras.callbacks.Callback):
    """The loss of every step of a ``fit``, in ``losses``.

    Keras logs, after batch ``k`` of an epoch, the mean ``m_k`` of the epoch's losses so
    far; the step's own loss is ``(k + 1) m_k - k m_{k-1}``. Once a mean is ``NaN`` every
    later step of the epoch is ``NaN`` too.

    Example:
        >>> model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> steps = StepLoss()
        >>> _ = model.fit(np.ones((8, 1)), np.ones((8, 1)), batch_size=2, epochs=2,
        ...               verbose=0, callbacks=[steps])
        >>> len(steps.losses)
        8
    """

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []
        self._mean = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._mean = 0.0

    def on_train_batch_end(self, batch, logs=None):
        mean = float(logs["loss"])
        self.losses.append((batch + 1) * mean - batch * self._mean)
        self._mean = mean


def plot_losses(ax, runs: dict[str, Any], *, title: str | None = None) -> None:
    """Loss against step, one line per run, on a log scale; a run's ``NaN`` steps end its line.

    Args:
        ax: a matplotlib ``Axes``.
        runs: label → a :class:`~companion.training.TrainingHistory` (its ``step_loss``,
            its rollbacks drawn as dotted vertical lines at the failed step, its skipped
            spikes as crosses) or a sequence of per-step losses (a ``fit``).
        title: the axes' title.
    """
    marked_rollback = marked_spike = False
    for index, (label, run) in enumerate(runs.items()):
        color = f"C{index}"
        losses = np.asarray(getattr(run, "step_loss", run), dtype=float)
        shown = np.where(np.isfinite(losses), losses, np.nan)
        ax.plot(np.arange(len(losses)), shown, color=color, lw=1, label=label)
        bad = np.flatnonzero(~np.isfinite(losses))
        if len(bad):
            ax.axvline(bad[0], color=color, lw=0.8, ls="--")
        for rollback in getattr(run, "rollbacks", ()):
            ax.axvline(rollback.step, color=color, lw=1.2, ls=":",
                       label=None if marked_rollback else "rollback")
            marked_rollback = True
        spikes = list(getattr(run, "spikes", ()))
        if spikes:
            ax.scatter(spikes, losses[spikes], color=color, marker="x", s=50, zorder=3,
                       label=None if marked_spike else "skipped spike")
            marked_spike = True
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss of the step (MSE, log scale)")
    if title:
        ax.set_title(title)
    ax.legend(fontsize="small")
