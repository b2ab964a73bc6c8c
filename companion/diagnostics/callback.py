"""The NaN doctor for ``model.fit`` users: the :class:`NaNDoctor` callback."""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import warnings
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from companion import _internal
from companion.diagnostics.data import _unpack, batches
from companion.diagnostics.diagnosis import Diagnosis, replace
from companion.diagnostics.doctor import diagnose
from companion.diagnostics.optimizer_remedies import MAX_STEPS, Steps
from companion.diagnostics.remedies import LOW_PRECISION, STEP_CAUSES, verify
from companion.diagnostics.step import step_variables
from companion.training.patches import ModelPatches, hold_until_fit_ends, restore_leftover
from companion.training.records import APPLIED, LOSS
from companion.training.step import GUARDED, GuardedStep, model_cache

__all__ = ["NaNDoctor"]


class NaNDoctor(keras.callbacks.Callback):
    """Diagnose the first step of ``fit`` that makes anything non-finite: one added line.

    ``model.fit(x, y, callbacks=[NaNDoctor()])``. For the length of the ``fit`` call the
    callback runs ``fit``'s steps through the guarded step of
    :func:`companion.training.train` (``companion.training.step``): a step whose
    loss, gradients, logged values or writes (the update's included) are not finite is
    not applied, so the state before the failing step is the state after it, and no
    copy of the weights or of the optimizer's state is kept along the way (what it
    costs is measured by ``benchmarks/scale.py``, on the book's page *What the fixes
    cost*). A NaN written into the weights behind
    a finite loss (max-pooling drops NaN: ``maxpool([nan, 1]) = 1``) is named at the
    step that would have written it. At the first such step the guard is removed,
    :func:`diagnose` runs on that step's batch — the batch ``fit`` trained on: the rows
    it shuffled into the step, or the element a reshuffling ``tf.data`` pipeline gave
    it (the callback taps ``fit``'s pipeline) — with the compiled loss, or the model's
    own ``train_step`` if it has one or no compiled loss, the :class:`Diagnosis` is
    printed and, by default, training stops, like
    :class:`keras.callbacks.TerminateOnNaN`. For a divergence, the remedy (a learning
    rate ten times smaller, or ``clipnorm=1.0``) is verified by re-running ``fit``'s
    steps with it, from a kept state to the failing step, after a control re-run
    without it that must fail as ``fit`` did. For that re-run one copy of the state is
    kept, never on an accelerator: in host memory for a state of up to 16 MiB, else in
    a temporary file. It is the state at ``fit``'s start while a re-run from there can
    reach every step of the epoch that begins (judged by the last epoch's length: at
    most 500 steps in all and, for shuffled data, all their batches kept, below); from
    the first epoch where it cannot, a small state is replaced at each epoch's start by
    the state then, and the re-run starts there (a large state stays ``fit``'s start,
    kept once). When ``fit`` shuffles arrays or reads a ``tf.data`` pipeline, the
    batches it trained on are kept too, up to a quarter of the weights' bytes (at least
    4 MiB, at most 64 MiB); beyond that, or beyond 500 steps, only the epoch's are kept
    and the re-run starts at the epoch's start (if its state was kept), then only the
    failing step's own batch (no re-run of ``fit``'s steps is then made).

    The doctor never breaks the run it watches: any failure of its own is a
    ``RuntimeWarning``, its guard is removed and training goes on as plain ``fit``.
    Under :func:`companion.training.train`, which skips and diagnoses non-finite steps
    itself, the callback does nothing.

    Args:
        data: the data to diagnose, as ``fit`` takes it; ``None`` uses the ``x``,
            ``y`` and ``sample_weight`` of the running ``fit`` call.
        loss: passed to :func:`diagnose` (``None``: the compiled loss, or the model's
            own ``train_step``).
        stop_training: stop ``fit`` after the diagnosis (default ``True``).
        restore_weights: keep the state from before the failing step (default
            ``True``); if ``False``, the failing step is applied after the diagnosis,
            as ``fit`` would have applied it.
        verbose: print the diagnosis (default ``True``).

    Attributes:
        diagnosis: the :class:`Diagnosis`, or ``None`` (nothing non-finite yet).
        batch: ``(epoch, batch)`` of ``fit``'s step that made the first non-finite
            value.
        nonfinite_logs: the names of the values that step logged that were not finite.

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
        self.nonfinite_logs: tuple[str, ...] = ()
        self._fit_data = None
        self._guard: GuardedStep | None = None
        self._patches: ModelPatches | None = None
        self._reset()

    def _reset(self) -> None:
        self._start = None  # the state at fit's start (a _KeptState), and at the epoch's
        self._epoch_start = None
        self._epoch_first = 0  # the index (counted from fit's start) of the epoch's first step
        self._epoch_steps: list[int] = []  # the steps fit ran in each epoch
        self._losses: list[float] = []
        self._epoch = 0
        self._done = False
        self._steps = 0
        self._shuffled = False  # the steps' batches are known from the tap only
        self._tapped: dict[int, Any] = {}  # step index (from fit's start) -> the batch fit trained on
        self._tapped_bytes = 0
        self._kept_limit: tuple[int, int] | None = None  # (trainable variables, _max_kept_bytes)
        self._collected_at = 0  # the steps run when the tap's queue was last collected
        self._lock = threading.Lock()
        self._produced = 0
        self._untap = None

    def _warn(self, what: str, error: BaseException) -> None:
        warnings.warn(f"the NaN doctor {what}: {error!r}; training goes on without it", RuntimeWarning, stacklevel=3)

    def on_train_begin(self, logs=None) -> None:
        try:
            restore_leftover(self.model)  # the doctor's guard left by a fit that raised
            self._reset()
            self.diagnosis = None
            self.batch = None
            self.nonfinite_logs = ()
            if self.model in GUARDED:  # companion.training.train: it skips and diagnoses itself
                self._done = True
                return
            self._fit_data = self.data
            if self._fit_data is None:
                found = _internal.running_fit_arguments(sys._getframe(1))
                if found is not None:
                    self._fit_data = found
            self._tap(sys._getframe(1))
            self._install()
            self._start = _KeptState(_watched(self.model))
        except Exception as error:  # pragma: no cover - the doctor never ends a run
            self._done = True
            self._uninstall()
            self._warn("could not start", error)

    def _install(self) -> None:
        """Run fit's steps through a guarded step that stops applying at the first bad one."""
        model = self.model
        capacity = max(int(getattr(model, "steps_per_execution", 1) or 1), 1)
        cache = model_cache(model)
        key = (
            "doctor", id(model.optimizer), id(model.distribute_strategy), capacity,
            tuple(id(v) for v in model.trainable_variables), tuple(id(v) for v in model.metrics_variables),
            tuple(id(v) for v in model.non_trainable_variables),
        )
        step = cache.get(key)
        if step is None or step.optimizer is not model.optimizer:
            # Deferred where it is known to be exact (Keras' own train_step): a step of
            # its own that reads the weights after its update could not be traced again
            # inside the user's fit.
            step = GuardedStep(model, model.distribute_strategy, capacity=capacity, guard=True, clip=None, limit=1,
                               defer=_keras_own_step(model), watch_logs=True)
            cache[key] = step
        patches = ModelPatches()
        self._guard, self._patches = step, patches
        step.install(patches)
        hold_until_fit_ends(model, patches)
        if getattr(model, "train_function", None) is None:  # fit made its own before calling back
            model.make_train_function(force=True)
        step.reset(0)

    def _uninstall(self) -> None:
        patches, self._patches = self._patches, None
        if patches is not None:
            patches.restore()

    def _tap(self, frame) -> None:
        """Keep the batches fit trains on when it shuffles arrays (Keras' permutation is
        its own) or reads a ``tf.data`` pipeline (which may reshuffle every epoch)."""
        found = _internal.running_fit_locals(frame, ("x", "shuffle", "steps_per_epoch"))
        if found is None:
            return
        x = found["x"]
        if not (isinstance(x, tf.data.Dataset) or (found["shuffle"] and _is_arrays(x))):
            return
        self._shuffled = True

        def record(batch) -> None:  # (from tf.data's thread for a batch of composite tensors)
            size = sum(int(np.asarray(v).nbytes) for v in tf.nest.flatten(batch))
            with self._lock:
                self._tapped[self._produced] = batch
                self._tapped_bytes += size
                self._produced += 1

        self._untap = _internal.tap_fit_batches(frame, record)  # (record runs at _collect)
        if self._untap is None:
            self._shuffled = _is_arrays(x)  # a dataset is read again, in order (the best left)

    def _collect(self) -> None:
        """The batches fit's pipeline yielded since the last collection, into ``_tapped``."""
        self._collected_at = self._steps
        if self._untap is not None:
            self._untap.collect()

    def on_train_end(self, logs=None) -> None:
        self._uninstall()
        untap, self._untap = self._untap, None
        self._tapped = {}
        self._start = self._epoch_start = None
        if untap is not None:
            try:
                untap()
            except Exception as error:  # pragma: no cover - the doctor never ends a run
                self._warn("could not remove its tap of fit's batches", error)

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self._epoch = epoch
        self._epoch_first = self._steps
        last = self._epoch_steps[-1] if self._epoch_steps else 0
        self._epoch_steps.append(0)
        if self._done:
            return
        self._collect()
        try:
            # One state is kept at a time: fit's start while a re-run from there can reach
            # every step of this epoch (judged by the last epoch's), else, for a small
            # state, this epoch's start (fit's is dropped first: never two copies).
            if len(self._epoch_steps) == 1:  # fit's first epoch (epoch 0, or fit's initial_epoch)
                self._epoch_start = self._start
            elif self._start is not None and (self._start.on_disk or self._reaches_this_epoch(last)):
                self._epoch_start = None  # fit's start serves (a large state is kept once, on disk)
            else:
                self._start = self._epoch_start = None
                variables = _watched(self.model)
                if sum(_nbytes(v) for v in variables) <= KEPT_IN_MEMORY_BYTES:
                    self._epoch_start = _KeptState(variables, on_disk=False)
        except Exception as error:  # pragma: no cover - the doctor never ends a run
            self._start = self._epoch_start = None
            self._warn("could not keep the state at the epoch's start", error)
        if self._start is None or self._steps > MAX_STEPS or self._tapped_bytes > self._max_kept_bytes():
            # fit's batches from its start would be too many to keep (or to re-run), or no
            # re-run starts there any more: this epoch's only
            self._forget(self._steps)

    def _reaches_this_epoch(self, last: int) -> bool:
        """Whether a re-run from fit's start can reach every step of an epoch as long as the
        last one: no more than MAX_STEPS steps, and (fit shuffled) every batch from fit's
        start still kept, with room for this epoch's."""
        if self._steps + last > MAX_STEPS:
            return False
        if not self._shuffled:
            return True
        with self._lock:
            kept, size = len(self._tapped), self._tapped_bytes
            from_start = 0 in self._tapped or self._produced == 0
        per_step = size / kept if kept else 0
        return from_start and size + per_step * last <= self._max_kept_bytes()

    def _max_kept_bytes(self) -> int:
        """The most bytes of fit's batches kept: a quarter of the weights' bytes, at least
        4 MiB and at most :data:`MAX_KEPT_BYTES` (beyond: this epoch's, then the step's own),
        checked when the tap's queue is collected (it holds the batches of up to
        :data:`COLLECT_EVERY` steps between two collections, beside these)."""
        variables = self.model.trainable_variables
        if self._kept_limit is None or self._kept_limit[0] != len(variables):  # (a model built in its first step)
            weights = sum(_nbytes(v) for v in variables)
            self._kept_limit = (len(variables), min(MAX_KEPT_BYTES, max(weights // 4, 4 * 2**20)))
        return self._kept_limit[1]

    def _forget(self, before: int) -> None:
        """Drop the kept batches of the steps before ``before``."""
        with self._lock:
            for index in [i for i in list(self._tapped) if i < before]:
                batch = self._tapped.pop(index)
                self._tapped_bytes -= sum(int(np.asarray(v).nbytes) for v in tf.nest.flatten(batch))

    def on_train_batch_end(self, batch, logs=None) -> None:
        if self._done:
            if self._untap is not None:
                self._untap.discard()  # (the tap stays until fit's end: its batches are not kept)
            return
        try:
            if self._steps >= self._collected_at + COLLECT_EVERY:
                self._collect()
            records, _ = self._guard.drain()
            for row, record in enumerate(records):
                self._steps += 1
                if self._epoch_steps:
                    self._epoch_steps[-1] += 1
                if record[APPLIED] >= 0.5:
                    self._keep_what_can_be_re_run()
                    self._losses.append(float(record[LOSS]))
                    continue
                self.nonfinite_logs = tuple(self._guard.nonfinite_logs(row))
                self._collect()  # the failing step's batch, and any before it
                self._keep_what_can_be_re_run()
                self._found(self._steps - 1 - self._epoch_first)
                return
        except Exception as error:
            self._done = True
            self._uninstall()
            self._warn(f"failed at batch {batch} of epoch {self._epoch}", error)

    def _keep_what_can_be_re_run(self) -> None:
        if self._tapped and (self._steps - self._epoch_first > MAX_STEPS or self._tapped_bytes > self._max_kept_bytes()):
            self._forget(self._steps - 1)  # too many to re-run from the epoch's start: the step's own only

    def _found(self, batch: int) -> None:
        """The step ``batch`` of this epoch was not applied: the state is the one before it."""
        self._done = True
        self.batch = (self._epoch, batch)
        self._uninstall()  # the model's own train_step again, for the diagnosis and what follows
        try:
            self._diagnose(batch)
        finally:
            if self.stop_training:
                self.model.stop_training = True

    def _diagnose(self, batch: int) -> None:
        try:
            found = self._run(batch)
        except Exception as error:
            found = None
            self._warn(f"could not diagnose batch {batch} of epoch {self._epoch}", error)
        self.diagnosis = found
        if not self.restore_weights:
            self._apply_failing_step(batch)
        if self.verbose:
            what = (
                f"{', '.join(self.nonfinite_logs)} turned non-finite"
                if self.nonfinite_logs
                else "the gradients or the update turned non-finite (every logged value is finite)"
            )
            where = f"fit's batch {batch} of epoch {self._epoch}"
            if self.diagnosis is None:
                print(f"NaN doctor: {what} at {where}, but the batch is finite when re-run", flush=True)
            else:
                print(f"NaN doctor: {what} at {where}.\n{self.diagnosis}", flush=True)

    def _apply_failing_step(self, batch: int) -> None:
        """``restore_weights=False``: the failing step applied, as ``fit`` applied it."""
        trained = self._tapped.get(self._steps - 1)
        if trained is None and not self._shuffled and self._fit_data is not None:
            data, kwargs = _data_and_arguments(self._fit_data)
            for number, found in enumerate(batches(data, kwargs.get("y"), kwargs.get("sample_weight"),
                                                   kwargs.get("batch_size"))):
                if number == batch:
                    trained = found
                    break
        if trained is None:
            self._warn("could not apply the failing step (its batch is not known)", LookupError(batch))
            return
        x, y, w = _unpack(trained)
        try:
            self.model.train_step(keras.utils.pack_x_y_sample_weight(x, y, w))
        except Exception as error:  # the doctor never raises into fit
            self._warn("could not apply the failing step", error)

    def _run(self, step: int) -> Diagnosis | None:
        if self._fit_data is None:
            return None
        data, kwargs = _data_and_arguments(self._fit_data)
        index = self._steps - 1  # the failing step, counted from fit's start
        trained = self._tapped.get(index)
        found = None
        if trained is not None:  # the batch fit trained on at that step, from its pipeline
            found = diagnose(self.model, iter([trained]), self.loss, losses_before=self._losses)
            if found is not None:
                found = replace(found, batch=step)
        elif not self._shuffled:  # the step's own batch first (fit's order), then a scan from the start
            found = diagnose(self.model, data, self.loss, skip_batches=step, max_batches=1,
                             losses_before=self._losses, **kwargs)
        if found is not None:
            found = replace(found, epoch=self._epoch)
            return self._verify_run(found, data, kwargs, index)
        # Not the step's batch (fit shuffled rows the doctor could not see, or it is finite
        # when re-run): the first non-finite batch of the data, in order.
        return diagnose(self.model, data, self.loss, losses_before=self._losses, **kwargs)

    def _verify_run(self, found: Diagnosis, data, kwargs, index: int) -> Diagnosis:
        """A divergence's remedy re-run over fit's steps from the earliest state kept."""
        if found.cause not in STEP_CAUSES or found.dtype in LOW_PRECISION:
            return found
        try:
            steps = self._steps_to(data, kwargs, index)
            if steps is None:
                return found
            capsule = getattr(found, "_capsule", None) or {}
            x, y, w = capsule.get("batch", (None, None, None))
            return verify(found, self.model, None, x, y, w, steps=steps)
        except Exception as error:  # the doctor never raises into fit: the check is said to have failed
            return replace(found, verified=f"not verified: the re-run of fit's steps failed "
                                           f"({type(error).__name__}: {error})"[:300])

    def _steps_to(self, data, kwargs, index: int) -> Steps | None:
        """fit's steps from the earliest state kept to step ``index``, with their batches."""
        kept = self._start or self._epoch_start
        if kept is None:
            return None
        variables = kept.variables
        if self._shuffled:
            first, start = 0, self._start
            if start is None or any(self._tapped.get(i) is None for i in range(index + 1)):  # only this epoch's
                first, start = self._epoch_first, self._epoch_start
            known = [self._tapped.get(i) for i in range(first, index + 1)]
            if start is None or any(b is None for b in known):
                return None
            origin = "the start of fit" if first == 0 else (
                f"the start of epoch {self._epoch} (fit shuffled the rows; the doctor kept this epoch's batches)")

            def shuffled():
                for batch in known:
                    yield _unpack(batch)

            return Steps(variables, start.values(), shuffled, len(known), origin)
        if isinstance(data, tf.data.Dataset) or isinstance(data, keras.utils.PyDataset):
            again = " (the dataset read again)"  # one that reshuffles gives another order
        elif _is_arrays(data):
            again = ""
        else:  # a generator: reading it again would take batches from fit
            return None
        origin, start, counts = "the start of fit", self._start, list(self._epoch_steps)
        if index + 1 > MAX_STEPS or start is None:  # too long a re-run: from the epoch, if its start was kept
            origin, start, counts = f"the start of epoch {self._epoch}", self._epoch_start, counts[-1:]
        if start is None:
            return None
        origin += again

        def in_order():
            for count in counts:  # each epoch: its first `count` batches, in order
                for number, batch in enumerate(batches(data, kwargs.get("y"), kwargs.get("sample_weight"),
                                                       kwargs.get("batch_size"))):
                    if number >= count:
                        break
                    yield batch

        return Steps(variables, start.values(), in_order, sum(counts), origin)


def _data_and_arguments(data) -> tuple[Any, dict]:
    """``fit``'s data and the keyword arguments :func:`diagnose` takes with it."""
    if not isinstance(data, dict):
        return data, {}
    kwargs = dict(y=data["y"], sample_weight=data["sample_weight"], batch_size=data["batch_size"])
    x = data["x"]
    if kwargs["y"] is None and kwargs["sample_weight"] is None and isinstance(x, (tuple, list)):
        x = (tuple(x),)  # fit's x=(a, b, c) is one multi-input x, not (x, y, sample_weight)
    return x, kwargs


def _keras_own_step(model) -> bool:
    """Whether ``model``'s ``train_step`` is Keras' own (no subclass overrides it)."""
    for klass in type(model).__mro__:
        if "train_step" in vars(klass):
            return klass.__module__.startswith("keras.")
    return False


def _watched(model) -> list:
    """Everything a step may write but the random state (a skipped draw is not drawn again)."""
    return [v for v in step_variables(model) if not _is_random_state(v)]


def _is_random_state(variable) -> bool:
    return any(variable is state for state in _internal.global_random_states())


def _nbytes(variable) -> int:
    count = variable.shape.num_elements() or 0
    return count * tf.as_dtype(variable.dtype).size


#: A state of at most this many bytes is kept in host memory (fit's start, or an epoch's);
#: a larger one once, at fit's start, in a temporary file. Never on the device: the
#: accelerator's memory holds no copy of the model.
KEPT_IN_MEMORY_BYTES = 16 * 2**20


class _KeptState:
    """The values of ``variables`` at one moment: in host memory if small, else on disk."""

    def __init__(self, variables, on_disk: bool | None = None) -> None:
        self.variables = list(variables)
        if on_disk is None:
            on_disk = sum(_nbytes(v) for v in self.variables) > KEPT_IN_MEMORY_BYTES
        self.on_disk = bool(on_disk)
        self._folder = None
        self._values = None
        if on_disk:
            self._folder = tempfile.TemporaryDirectory(prefix="nan-doctor-")
            for i, v in enumerate(self.variables):
                np.save(os.path.join(self._folder.name, f"{i}.npy"), np.asarray(tf.convert_to_tensor(v)))
        else:
            self._values = [np.array(v.numpy()) for v in self.variables]  # a copy of its own, on the host

    def values(self) -> list:
        if self._values is not None:
            return list(self._values)
        return [np.load(os.path.join(self._folder.name, f"{i}.npy")) for i in range(len(self.variables))]


#: The most bytes of fit's shuffled batches the doctor keeps (beyond: the epoch's, then the step's own only).
MAX_KEPT_BYTES = 64 * 2**20

#: Every so many steps the doctor takes the batches fit's pipeline yielded from the tap's
#: queue (and at every epoch's start and at a failing step); a few eager ops each time.
COLLECT_EVERY = 16


def _is_arrays(x) -> bool:
    """Whether ``x`` is what Keras' array adapter takes (and so shuffles): arrays, nested."""
    leaves = tf.nest.flatten(x)
    return bool(leaves) and all(isinstance(v, (np.ndarray, tf.Tensor)) or hasattr(v, "__array__") for v in leaves)
