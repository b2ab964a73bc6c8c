"""The callbacks :func:`companion.training.train` adds to ``fit``, and what it asks of the user's.

:class:`GuardCallback` drains the guarded step's records after every host call into the
run's history (:mod:`companion.training.records`), raises :class:`NonFiniteError` after too
many consecutive skipped steps (or rolls back, :mod:`companion.training.recovery`) and
warns when a dynamic loss scale stalls;
:class:`CheckpointCallback` saves the run at every epoch end; :func:`asks_for_batch_hooks`
tells whether the user's callbacks need a host call per step.
"""

from __future__ import annotations

import warnings
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from companion import _internal
from companion.diagnostics.hooks import diagnose_skipped_step
from companion.training.checkpoints import TrainingCheckpoint
from companion.training.records import DoctorView, append_records, nonfinite_error
from companion.training.results import TrainingHistory
from companion.training.step import GuardedStep

#: A dynamic loss scale at or below this value no longer amplifies the gradients.
STALLED_LOSS_SCALE = 1.0


class GuardCallback(keras.callbacks.Callback):
    """Drains the guard's records after every host call into the :class:`TrainingHistory`.

    Raises :class:`NonFiniteError` (from ``on_train_batch_end``, so out of ``fit``) once
    ``limit`` consecutive steps were skipped, and warns once when the dynamic loss
    scale stalls. With a ``recovery`` (``on_nonfinite="rollback"``) it takes the
    snapshot at every epoch's start and, once ``limit`` consecutive steps were
    non-finite, rolls back or raises (:class:`~companion.training.recovery.Recovery`).
    """

    def __init__(
        self, step: GuardedStep, history: TrainingHistory, *, on_nonfinite: str, limit: int,
        doctor: DoctorView | None = None, recovery=None,
    ) -> None:
        super().__init__()
        self.step = step
        self.doctor = doctor
        self.training_history = history
        self.on_nonfinite = on_nonfinite
        self.limit = limit
        self.recovery = recovery
        self.epoch = 0
        self.epoch_start = 0
        self.applied_losses: list[float] = []
        self._last_records: Any = ()

    def on_train_begin(self, logs=None):
        self.step.reset(self.training_history.trailing_nonfinite())
        if self.recovery is not None:
            self.step.reset(0)  # the callback counts the runs (the step never halts)
            self.recovery.begin()

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self.epoch_start = self.training_history.steps
        self.applied_losses = []
        if self.recovery is not None:
            self.recovery.take()

    def on_train_batch_end(self, batch, logs=None):
        self.record()

    def record(self) -> None:
        start = self.training_history.steps
        records, counts = self.step.drain()
        self._last_records = records
        history = self.training_history
        history.xla = bool(self.model.jit_compile)
        mode = self.step.mode
        if mode == "conditional":
            mode = "whole" if history.xla and self.step.replicas == 1 else "graph"
        history.update = mode
        self.applied_losses += append_records(
            history, records, counts, self.step.variables, epoch=self.epoch,
            loss_scaled=self.step.loss_scaler is not None, diagnose=None if self.doctor is None else self._diagnose,
        )
        self._watch_loss_scale()
        if self.recovery is not None:
            failed = self.recovery.limit_reached(start)
            if failed is not None:
                self.recovery.recover(failed, self.epoch, None if self.doctor is None else self._diagnose,
                                      self.step.loss_scaler is not None)
            return
        consecutive = history.trailing_nonfinite()
        if self.step.guard and consecutive >= self.limit:
            raise nonfinite_error(history, consecutive, self.limit, self.on_nonfinite, self.step.loss_scaler is not None)

    def _diagnose(self, index):
        with self.step.unguarded_steps():
            return diagnose_skipped_step(self.doctor, index)

    def on_epoch_end(self, epoch, logs=None):
        history = self.training_history
        history.epoch_steps.append(history.steps - self.epoch_start)
        history.epoch_loss.append(float(np.mean(self.applied_losses)) if self.applied_losses else float("nan"))

    def _watch_loss_scale(self) -> None:
        history = self.training_history
        scaler = self.step.loss_scaler
        if scaler is None or not scaler.built or history.loss_scale_stalled or not history.loss_scale:
            return
        # The scale each step used is recorded, so the first step after which it had
        # fallen is found even when a host call ran several steps.
        scales = history.loss_scale
        start = max(1, len(scales) - len(self._last_records))
        fallen = next((j for j in range(start, len(scales)) if scales[j] <= STALLED_LOSS_SCALE), None)
        if fallen is not None:
            current, step = scales[fallen], fallen - 1
        else:
            current, step = float(tf.convert_to_tensor(scaler.dynamic_scale).numpy()), history.steps - 1
        if current <= STALLED_LOSS_SCALE:
            history.loss_scale_stalled = True
            warnings.warn(
                f"the dynamic loss scale fell to {current:g} by step {step}: the gradients are "
                "non-finite even without float16 overflow, so loss scaling cannot fix them (and small "
                "gradients now underflow). Look for the NaN with companion.diagnostics.locate_nonfinite.",
                RuntimeWarning,
                stacklevel=2,
            )


class CheckpointCallback(keras.callbacks.Callback):
    """Saves the :class:`TrainingCheckpoint` at every epoch end (after ``History``)."""

    def __init__(self, checkpoint: TrainingCheckpoint, history: TrainingHistory) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.training_history = history

    def on_epoch_end(self, epoch, logs=None):
        self.checkpoint.save(epoch + 1, self.training_history)


#: Keras' callbacks whose own batch hooks do nothing when they save once per epoch.
_EPOCH_SAVERS = (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore)


def asks_for_batch_hooks(callbacks, guarded: bool = False) -> bool:
    """Whether any of ``callbacks`` overrides a batch hook of training (as Keras tells).

    ``ModelCheckpoint`` and ``BackupAndRestore`` with ``save_freq="epoch"`` do not: their
    ``on_train_batch_end`` returns at once then (unless a subclass overrides it). Nor,
    when ``guarded`` (a skipped step never shows in the logs), does ``TerminateOnNaN``:
    its hook acts only on a logged loss that is not finite.
    """
    hooks = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end")
    for callback in callbacks:
        if isinstance(callback, (keras.callbacks.History, keras.callbacks.ProgbarLogger)):
            continue
        overridden = [name for name in hooks if not _internal.is_default_callback_method(callback, name)]
        inert = None
        if isinstance(callback, _EPOCH_SAVERS) and getattr(callback, "save_freq", None) == "epoch":
            inert = next(c for c in _EPOCH_SAVERS if isinstance(callback, c))
        elif guarded and isinstance(callback, keras.callbacks.TerminateOnNaN):
            inert = keras.callbacks.TerminateOnNaN
        if inert is not None:
            overridden = [name for name in overridden if getattr(type(callback), name) is not getattr(inert, name)]
        if overridden:
            return True
    return False
