"""Recovery: ``train(..., on_nonfinite="rollback")`` rolls back with a smaller learning rate.

Where ``on_nonfinite="skip"`` stops after ``max_consecutive_nonfinite`` consecutive
non-finite steps, :class:`Recovery` restores the last good state, multiplies every
optimizer's learning rate by ``rollback_lr_factor`` and lets ``fit`` go on; after
``max_rollbacks`` rollbacks it restores that state once more and raises
:class:`~companion.training.NonFiniteError`. It does not roll back where no learning
rate can help: when the NaN doctor's diagnosis of the first step of the run of
non-finite steps names a cause in the data or in a function's domain
(:data:`RATE_CANNOT_CURE`), ``train`` stops at once with that diagnosis.

The state restored is a snapshot taken at the start of the first epoch, and again at the
start of every later epoch, and within an epoch every :data:`SNAPSHOT_EVERY_STEPS` steps
(at the end of the first host call that reaches them), when the state is good: no
non-finite step (so no rollback) since the last of these points, and the mean loss of the
steps applied since then at most :data:`SNAPSHOT_GROWTH` times the lowest mean of
:data:`SNAPSHOT_WINDOW` consecutive applied steps so far (a run diverges with finite,
growing losses for a while before its first NaN: an epoch at a rate too large can end
finite, its loss grown by orders of magnitude).
It is a state from before the run began to diverge, not the state after the last good
step, whose weights are already on their way out. It
holds every variable of the model (weights, non-trainable state such as batch-norm
statistics) and of every optimizer (moments, iteration counter), but not the learning
rates (the rollback sets them), the random state (as for a skipped step), a dynamic loss
scale or the metrics (the epoch's logs and ``epoch_loss`` describe every step it
applied, those a rollback undid included). It is kept on the host (numpy): a model on a
GPU uses no more device memory, and the host holds one copy of the state (one read of
every variable per snapshot).

Keras' ``fit`` cannot rewind its data iterator: the rollback happens in a callback
(:class:`~companion.training.callbacks.GuardCallback`, after the host call in which the
limit was reached), and ``fit`` goes on with the next batches. The batches between the
snapshot and the rollback are not seen again in that epoch; the history keeps their
records, and :attr:`TrainingHistory.rollbacks` says which steps were undone.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from companion import _internal
from companion.diagnostics.causes import CAUSES
from companion.diagnostics.state import components
from companion.training.records import nonfinite_error
from companion.training.results import Rollback, TrainingHistory
from companion.training.holdings import model_optimizers, random_state
from companion.training.step import GuardedStep

#: The doctor's causes that no learning rate cures: the data (a NaN or Inf in the batch, a
#: label outside the classes, a weight set non-finite before training) or a function used
#: outside or at the edge of its domain (log of 0, a division by 0, a power of a negative base, an infinite
#: derivative, a ``tf.where`` whose other branch is NaN). ``train(...,
#: on_nonfinite="rollback")`` stops at once on these instead of rolling back.
RATE_CANNOT_CURE = frozenset({
    "nonfinite_input", "nonfinite_init", "log_of_zero", "division_by_zero", "domain_edge", "pow_negative_base",
    "singular_derivative", "where_trap", "label_out_of_range",
})

#: A snapshot replaces the last one only when the mean loss of the steps applied since the
#: last snapshot point is at most this many times the lowest mean of
#: :data:`SNAPSHOT_WINDOW` consecutive applied steps so far (and none was non-finite).
SNAPSHOT_GROWTH = 2.0

#: The consecutive applied steps whose lowest mean loss is the reference of a snapshot.
SNAPSHOT_WINDOW = 16

#: Within an epoch, a snapshot is considered every this many steps (``None``: at epoch
#: starts only). Long epochs then lose at most this many steps to a rollback; each
#: snapshot is one read of the state into the host's copy, which is reused.
SNAPSHOT_EVERY_STEPS: int | None = 1000

#: The consecutive-skip limit the guarded step is given under ``"rollback"``: it never
#: halts inside a host call (the callback counts the runs and rolls back).
NO_LIMIT = 2**31 - 1


@keras.saving.register_keras_serializable(package="companion")
class ScaledSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A learning-rate schedule multiplied by a constant factor.

    ``train(..., on_nonfinite="rollback")`` wraps an optimizer's schedule in it at a
    rollback, so that the rate keeps its shape at a smaller scale; it serialises with
    the optimizer (``get_config``), so a saved model keeps the reduced rate.

    Args:
        schedule: a ``keras.optimizers.schedules.LearningRateSchedule`` (or its
            serialised config).
        factor: what its rate is multiplied by (> 0).

    Example:
        >>> decay = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
        >>> round(float(ScaledSchedule(decay, 0.25)(0)), 6)
        0.025
    """

    def __init__(self, schedule, factor: float) -> None:
        if isinstance(schedule, dict):
            schedule = keras.optimizers.schedules.deserialize(schedule)
        if not isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            raise TypeError(f"schedule must be a LearningRateSchedule, got {type(schedule).__name__}")
        if not factor > 0:
            raise ValueError(f"factor must be > 0, got {factor!r}")
        self.schedule = schedule
        self.factor = float(factor)

    def __call__(self, step):
        rate = tf.convert_to_tensor(self.schedule(step))
        return rate * tf.cast(self.factor, rate.dtype)

    def get_config(self) -> dict[str, Any]:
        return {"schedule": keras.optimizers.schedules.serialize(self.schedule), "factor": self.factor}


def _inner(optimizer):
    return getattr(optimizer, "inner_optimizer", None) or optimizer


def _is_variable(value) -> bool:
    """A variable, Keras' or TensorFlow's: what a float learning rate becomes. Told by
    what it does (Keras 3.5's backend variables are not instances of ``keras.Variable``)."""
    return isinstance(value, (keras.Variable, tf.Variable)) or (
        callable(getattr(value, "assign", None)) and hasattr(value, "dtype") and hasattr(value, "shape")
    )


def check_learning_rates(model) -> None:
    """Every optimizer's learning rate can be scaled: a float (a variable) or a schedule."""
    for optimizer in model_optimizers(model):
        rate = _internal.learning_rate_as_given(_inner(optimizer))
        if not (_is_variable(rate) or isinstance(rate, keras.optimizers.schedules.LearningRateSchedule)):
            raise ValueError(
                f"on_nonfinite='rollback' scales the learning rate of {type(optimizer).__name__}, which must be a "
                f"float or a keras.optimizers.schedules.LearningRateSchedule, got {type(rate).__name__}"
            )


def scale_learning_rate(optimizer, factor: float) -> bool:
    """Multiply ``optimizer``'s learning rate by ``factor``: a float's variable is assigned,
    a schedule wrapped in :class:`ScaledSchedule`. Returns whether a schedule changed
    (its step function must be traced again)."""
    inner = _inner(optimizer)
    rate = _internal.learning_rate_as_given(inner)
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        base, scale = (rate.schedule, rate.factor) if isinstance(rate, ScaledSchedule) else (rate, 1.0)
        inner.learning_rate = ScaledSchedule(base, scale * factor)
        return True
    rate.assign(rate * factor)
    return False


def set_schedule_scale(model, scale: float) -> bool:
    """A resumed run: every schedule at ``scale`` times its unscaled rate (a float's rate
    comes back with the checkpoint's variables). Whether anything changed."""
    changed = False
    for optimizer in model_optimizers(model):
        inner = _inner(optimizer)
        rate = _internal.learning_rate_as_given(inner)
        if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
            base = rate.schedule if isinstance(rate, ScaledSchedule) else rate
            current = rate.factor if isinstance(rate, ScaledSchedule) else 1.0
            if current != scale:
                inner.learning_rate = base if scale == 1.0 else ScaledSchedule(base, scale)
                changed = True
    return changed


def current_learning_rate(optimizer) -> float:
    """The learning rate ``optimizer`` uses now (a schedule's at its current iteration)."""
    return float(tf.convert_to_tensor(_inner(optimizer).learning_rate).numpy())


class Recovery:
    """The rollbacks of one :func:`train` call (see the module's docstring).

    Args:
        model: the model being trained.
        step: its :class:`~companion.training.step.GuardedStep`.
        history: the run's :class:`TrainingHistory`.
        limit: ``max_consecutive_nonfinite``.
        max_rollbacks: the rollbacks allowed (over the whole run, a resumed one included).
        factor: ``rollback_lr_factor``.
        verbose: print each rollback.
        snapshot_every: consider a snapshot within an epoch every this many steps
            (default :data:`SNAPSHOT_EVERY_STEPS`; ``0`` or ``None`` there: at epoch
            starts only).
    """

    def __init__(self, model, step: GuardedStep, history: TrainingHistory, *, limit: int, max_rollbacks: int,
                 factor: float, verbose: bool, snapshot_every: int | None = None) -> None:
        self.model, self.step, self.history = model, step, history
        self.limit, self.max_rollbacks, self.factor, self.verbose = limit, max_rollbacks, factor, verbose
        self.every = SNAPSHOT_EVERY_STEPS if snapshot_every is None else snapshot_every
        self.saved: list[tuple[Any, np.ndarray]] | None = None
        self.saved_step = 0
        self.run = 0  # the non-finite steps in a row, counted on the host
        self.period = 0  # the first step since the last snapshot point (an epoch start, every steps)
        self.period_clean = True  # no non-finite step since then
        # The losses of the last applied steps (since the last rollback), and the lowest
        # mean of SNAPSHOT_WINDOW consecutive ones so far.
        self.recent: collections.deque = collections.deque(maxlen=SNAPSHOT_WINDOW)
        self.lowest: float = float("inf")

    # -- the snapshot --------------------------------------------------------------------

    def _variables(self) -> list:
        """Every variable a rollback restores (see the module's docstring)."""
        model = self.model
        kept = {id(v) for v in random_state(model)}
        optimizers = model_optimizers(model)
        for optimizer in optimizers:
            rate = _internal.learning_rate_as_given(_inner(optimizer))
            if _is_variable(rate):
                kept.add(id(rate))
            if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
                kept.update(id(v) for v in (optimizer.dynamic_scale, optimizer.step_counter))
        found = []
        candidates = list(model.variables)
        for optimizer in optimizers:
            if optimizer.built:
                candidates.extend(optimizer.variables)
        for v in candidates:
            if id(v) not in kept:
                kept.add(id(v))
                found.append(v)
        return found

    def begin(self) -> None:
        """At the start of ``fit``: the run of non-finite steps a resumed history ends with."""
        self.run = self.history.trailing_nonfinite()

    def good(self) -> bool:
        """Whether the state now is good enough for a snapshot (and the start of the next
        period): no non-finite step since the last snapshot point, and the mean loss of the
        steps applied since then at most :data:`SNAPSHOT_GROWTH` times the lowest mean of
        :data:`SNAPSHOT_WINDOW` consecutive applied steps so far."""
        history = self.history
        skipped = set(history.skipped)
        losses = [history.step_loss[i] for i in range(self.period, history.steps) if i not in skipped]
        clean, self.period, self.period_clean = self.period_clean, history.steps, True
        if not clean or self.run or not losses:
            return False
        mean = float(np.mean(losses))
        return bool(np.isfinite(mean) and mean <= SNAPSHOT_GROWTH * self.lowest)

    def take(self) -> None:
        """At the start of an epoch: the snapshot, the first, or if the state is good."""
        good = self.good()
        if self.saved is None or good:
            self._snapshot()

    def take_within_epoch(self) -> None:
        """After a host call: if ``every`` steps have passed since the last snapshot point,
        the snapshot if the state is good."""
        if self.every and self.saved is not None and self.history.steps - self.period >= self.every and self.good():
            self._snapshot()

    def _snapshot(self) -> None:
        """Every copy of every variable into the host's copy (its arrays reused when their
        shapes still match: the host holds one snapshot, not two, while a new one is taken)."""
        old = {id(copy): value for copy, value in self.saved or ()}
        saved = []
        for variable in self._variables():
            for copy in components(variable):
                with tf.device(copy.device):
                    value = np.asarray(copy.read_value())
                kept = old.get(id(copy))
                if kept is not None and kept.shape == value.shape and kept.dtype == value.dtype:
                    kept[...] = value
                    saved.append((copy, kept))
                else:
                    saved.append((copy, np.array(value)))
        self.saved = saved
        self.saved_step = self.history.steps

    def restore(self) -> None:
        """Every copy of every variable to its snapshot (an optimizer built since: to its
        initial zeros); the guard's bounds measured again."""
        saved = {id(copy): value for copy, value in self.saved}
        for variable in self._variables():
            for copy in components(variable):
                value = saved.get(id(copy))
                if value is None:
                    value = np.zeros(copy.shape, copy.dtype.as_numpy_dtype)
                with tf.device(copy.device):
                    copy.assign(value)
        if self.step.bound is not None:
            self.step.bound.measure()

    # -- the decision --------------------------------------------------------------------

    def limit_reached(self, start: int) -> int | None:
        """The step of those appended since ``start`` at which ``limit`` consecutive steps
        had been non-finite, or ``None``."""
        history = self.history
        bad = set()
        for report in reversed(history.reports):
            if report.step < start:
                break
            if report.reason == "nonfinite":
                bad.add(report.step)
        self.period_clean = self.period_clean and not bad
        skipped = set(history.skipped[-(history.steps - start):]) if history.steps > start else set()
        failed = None
        for index in range(start, history.steps):
            self.run = self.run + 1 if index in bad else 0
            if failed is None and self.run >= self.limit:
                failed = index
            loss = history.step_loss[index]
            if index not in skipped and np.isfinite(loss):
                self.recent.append(loss)
                if len(self.recent) == self.recent.maxlen or not np.isfinite(self.lowest):
                    self.lowest = min(self.lowest, float(np.mean(self.recent)))
        if failed is None:
            self.take_within_epoch()
        return failed

    def recover(self, failed: int, epoch: int, diagnose: Callable[[int], Any] | None, loss_scaled: bool) -> None:
        """Roll back after ``failed``, or raise :class:`NonFiniteError`."""
        history = self.history
        first = failed - self.limit + 1
        diagnosis = self._diagnosis(first, diagnose)
        cause = None if diagnosis is None else diagnosis.cause
        error = functools.partial(nonfinite_error, history, self.limit, self.limit, "rollback", loss_scaled,
                                  last=failed, diagnosis=diagnosis)
        if cause in RATE_CANNOT_CURE:
            skipped = set(history.skipped)
            last = next((i for i in range(history.steps - 1, -1, -1) if i not in skipped), None)
            where = f"after step {last}" if last is not None else "at the start of training"
            raise error(end=(
                f"The NaN doctor puts the cause in the data or a function's domain, where no learning rate helps: "
                f"{cause} ({CAUSES[cause].description}){_summary(diagnosis)}. No rollback was made for it: the "
                f"weights and optimizer state are those {where}. Fix: {CAUSES[cause].fix}."
            ))
        if len(history.rollbacks) >= self.max_rollbacks:
            self.restore()
            raise error(end=(
                f"After {len(history.rollbacks)} rollbacks (max_rollbacks={self.max_rollbacks}) the run still "
                f"diverges{_cause_words(cause)}: the weights and optimizer state are those restored, from the "
                f"start of step {self.saved_step}."
            ))
        before = current_learning_rate(self.model.optimizer)
        self.restore()
        retrace = False
        for optimizer in model_optimizers(self.model):
            retrace = scale_learning_rate(optimizer, self.factor) or retrace
        after = current_learning_rate(self.model.optimizer)
        scale = (history.rollbacks[-1].scale if history.rollbacks else 1.0) * self.factor
        history.rollbacks.append(Rollback(
            step=failed, restored_step=self.saved_step, learning_rate=after, epoch=epoch, scale=scale, cause=cause,
        ))
        self.step.reset(0)
        self.step.reset_loss_stats()
        self.run = 0
        self.recent.clear()  # (the period of the rollback stays unclean: no snapshot at its end)
        if retrace:
            self.model.make_train_function(force=True)  # the schedule is read in the traced step
        if self.verbose:
            print(
                f"\ncompanion.training: rollback {len(history.rollbacks)} of {self.max_rollbacks} at step {failed} "
                f"(epoch {epoch}), after {self.limit} non-finite steps{_cause_words(cause)}: restored the state "
                f"at the start of step {self.saved_step}; learning rate {before:.4g} -> {after:.4g}",
                flush=True,
            )

    def _diagnosis(self, first: int, diagnose):
        """The doctor's diagnosis of step ``first`` (made now if the run's own first skipped
        step was diagnosed already), stored in its report."""
        reports = self.history.reports
        for k in range(len(reports) - 1, -1, -1):
            report = reports[k]
            if report.step < first:
                break
            if report.step == first:
                if report.diagnosis is None and diagnose is not None:
                    found = diagnose(first)
                    if found is not None:
                        reports[k] = dataclasses.replace(report, diagnosis=found)
                    return found
                return report.diagnosis
        return None


def _cause_words(cause) -> str:
    return f" (the NaN doctor: {cause})" if cause else ""


def _summary(diagnosis) -> str:
    summary = getattr(diagnosis, "inputs_summary", "") or ""
    return f"; {summary}" if summary else ""
