"""The NaN doctor for ``model.fit`` users: the :class:`NaNDoctor` callback."""

from __future__ import annotations

import collections
import math
import sys
import weakref
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from companion import _tf_internals
from companion._gradients import all_finite
from companion.diagnostics.doctor import Diagnosis, diagnose

__all__ = ["NaNDoctor"]


class NaNDoctor(keras.callbacks.Callback):
    """Diagnose the first batch of ``fit`` whose loss is not finite: one added line.

    ``model.fit(x, y, callbacks=[NaNDoctor()])``. After every batch the callback
    looks at the loss ``fit`` logs, as :class:`keras.callbacks.TerminateOnNaN` does.
    Before each batch it copies the model's weights on their device, without waiting
    for the copy (one compiled call, no check and no transfer to the host: the
    doctor's cost on a clean batch, measured by ``benchmarks/doctor.py``); it keeps the
    last two copies. At the first non-finite loss (or, at the end of an epoch, a
    non-finite weight, which a finite loss with infinite gradients leaves behind) it
    puts back the newest copy whose weights are all finite (``fit`` has applied the
    non-finite update by then, and a finite loss with NaN gradients shows as a NaN
    loss one step later), runs :func:`diagnose` on that step's batch (the data ``fit``
    was given, in order, or ``data``), prints the :class:`Diagnosis` and, by default,
    stops training, like :class:`keras.callbacks.TerminateOnNaN`.

    Args:
        data: the data to diagnose, as ``fit`` takes it; ``None`` uses the ``x``,
            ``y`` and ``sample_weight`` of the running ``fit`` call.
        loss: passed to :func:`diagnose` (``None``: the compiled loss).
        stop_training: stop ``fit`` after the diagnosis (default ``True``).
        restore_weights: keep the restored finite weights (default ``True``); if
            ``False`` the non-finite weights are put back after the diagnosis.
        verbose: print the diagnosis (default ``True``).

    Attributes:
        diagnosis: the :class:`Diagnosis`, or ``None`` (nothing non-finite yet, or the
            NaN did not reproduce).
        batch: ``(epoch, batch)`` of ``fit``'s step that made the first non-finite
            loss or weight.

    Example:
        >>> keras.utils.set_random_seed(0)
        >>> model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        >>> model.compile(loss=lambda y, p: tf.math.log(p - p), optimizer="sgd")
        >>> doctor = NaNDoctor(verbose=False)
        >>> x = np.ones((4, 1))
        >>> _ = model.fit(x, x, batch_size=2, verbose=0, callbacks=[doctor])
        >>> doctor.diagnosis.cause, doctor.diagnosis.op, doctor.diagnosis.phase
        ('log_of_zero', 'Log', 'loss')
    """

    def __init__(
        self,
        data: Any = None,
        loss: Callable | str | None = None,
        *,
        stop_training: bool = True,
        restore_weights: bool = True,
        verbose: bool = True,
    ) -> None:
        super().__init__()
        self.data = data
        self.loss = loss
        self.stop_training = bool(stop_training)
        self.restore_weights = bool(restore_weights)
        self.verbose = bool(verbose)
        self.diagnosis: Diagnosis | None = None
        self.batch: tuple[int, int] | None = None
        self._fit_data = None
        self._reset()

    def _reset(self) -> None:
        self._snapshots: collections.deque = collections.deque(maxlen=2)
        self._losses: list[float] = []
        self._epoch = 0
        self._done = False

    def on_train_begin(self, logs=None) -> None:
        self._reset()
        self.diagnosis = None
        self.batch = None
        self._copy, self._finite, self._weights_finite = _functions(self.model)
        self._fit_data = self.data
        if self._fit_data is None:
            found = _tf_internals.running_fit_arguments(sys._getframe(1))
            if found is not None:
                self._fit_data = found

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None) -> None:
        if not self._done:
            self._snapshots.append((batch, self._copy()))  # asynchronous: nothing is read back

    def on_epoch_end(self, epoch, logs=None) -> None:
        # The epoch's last step may have written a NaN that no later batch would see.
        if not self._done and self._snapshots and not bool(self._weights_finite()):
            self._found(self._snapshots[-1][0])

    def on_train_batch_end(self, batch, logs=None) -> None:
        if self._done or not logs or "loss" not in logs:
            return
        value = float(np.asarray(logs["loss"]))
        if math.isfinite(value):
            self._losses.append(value)
            return
        self._found(batch)

    def _found(self, batch: int) -> None:
        self._done = True
        self.batch = (self._epoch, batch)
        self._diagnose(batch)
        if self.stop_training:
            self.model.stop_training = True

    def _diagnose(self, batch: int) -> None:
        current = self._copy()
        # The newest snapshot whose weights are all finite (the one before a step that
        # wrote a NaN with a finite loss, whose NaN loss shows one step later).
        finite = [(step, values) for step, values in self._snapshots if bool(self._finite(values))]
        step, values = finite[-1] if finite else (batch, current)
        self.batch = (self._epoch, step)
        for variable, value in zip(self.model.variables, values):
            variable.assign(value)
        try:
            self.diagnosis = self._run(step)
        finally:
            if not self.restore_weights:
                for variable, value in zip(self.model.variables, current):
                    variable.assign(value)
        if self.verbose:
            where = f"fit's batch {batch} of epoch {self._epoch}"
            if self.diagnosis is None:
                print(f"NaN doctor: the loss turned non-finite at {where}, but the batch is finite when re-run")
            else:
                print(f"NaN doctor: the loss turned non-finite at {where}.\n{self.diagnosis}")

    def _run(self, step: int) -> Diagnosis | None:
        data = self._fit_data
        if data is None:
            return None
        if isinstance(data, dict):
            kwargs = dict(y=data["y"], sample_weight=data["sample_weight"], batch_size=data["batch_size"])
            data = data["x"]
        else:
            kwargs = {}
        # The step's own batch first (fit's order, if unshuffled), then a scan from the start.
        found = diagnose(self.model, data, self.loss, skip_batches=step, max_batches=1, losses_before=self._losses, **kwargs)
        if found is None:
            found = diagnose(self.model, data, self.loss, losses_before=self._losses, **kwargs)
        return found


#: The compiled copy and checks of each model, kept while its variables are the same, so
#: that a new NaNDoctor on each ``fit`` call does not trace them again.
_FUNCTIONS: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _functions(model) -> tuple[Callable, Callable, Callable]:
    """``(copy(), finite(copies), weights_finite())`` for ``model``'s variables."""
    variables = list(model.variables)
    key = tuple(id(v) for v in variables)
    try:
        cached = _FUNCTIONS.get(model)
    except TypeError:  # pragma: no cover - a model that cannot be weakly referenced
        cached = None
    if cached is not None and cached[0] == key:
        return cached[1]

    def copy():
        return [tf.raw_ops.DeepCopy(x=v.value) for v in variables]

    def finite(values):
        return all_finite([v for v in values if v.dtype.is_floating])

    functions = (
        tf.function(copy, autograph=False),
        tf.function(finite, autograph=False),  # of a copy (tensors: traced once)
        tf.function(lambda: finite([v.value for v in variables]), autograph=False),
    )
    try:
        _FUNCTIONS[model] = (key, functions)
    except TypeError:  # pragma: no cover
        pass
    return functions
