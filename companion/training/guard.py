"""The guard that :func:`companion.training.train` installs in Keras' own ``fit``.

``train`` *is* ``model.fit``: Keras' trainer runs the epochs, the callbacks, the
validation, ``steps_per_execution``, ``History``. What ``train`` adds is a guarded
``train_step``, installed on the model for the duration of the call: it runs the
model's own ``train_step`` (Keras', or the user's override) and intercepts, while the
step is traced, the two calls that step makes on its optimizer:

* ``optimizer.scale_loss(loss)``: the step's loss (this replica's share, as ``fit``
  computes it) is noted;
* ``optimizer.apply(gradients, variables)``: the gradients are summed across replicas
  once (the optimizer is told not to sum them again), their global norm and the
  loss's finiteness decide whether the step is applied (the same decision on every
  replica and worker, since it is taken on summed values), the optional clipping is
  applied, and the update runs masked (every variable write a select between the new
  and the old value, :mod:`companion.training.masking`) or under a conditional.

After the model's step returns, the state the step changed besides the update
(batch-norm statistics, seed-generator state, the metrics and the loss tracker) is
put back on a skipped step, the step's record (loss, norm, applied or not, loss
scale, NaN/Inf counts per variable on a skipped step) is written into a small buffer
of variables, and the logs are re-read so that they never show a skipped step. The
buffer is drained by :class:`GuardCallback` after every host call (every
``steps_per_execution`` steps), which fills the :class:`TrainingHistory` and raises
:class:`NonFiniteError`; once the consecutive-skip limit is reached inside a host
call, the remaining steps of that call apply nothing and are not recorded.

Under a multi-worker strategy the step's logs get a leading axis of length 1 (Keras'
``fit`` reduces them with ``strategy.reduce("MEAN", value, axis=0)``, which fails on a
scalar), and the model's symbolic build takes its example batch from the local
replica (a repair in :mod:`companion._tf_internals`): the two places where Keras 3's
``fit`` fails under ``MultiWorkerMirroredStrategy``.

The design is derived in the chapter *The guarded training loop*.
"""

from __future__ import annotations

import functools
import threading
import types
import warnings
import weakref
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from companion import _tf_internals
from companion._gradients import global_norm, nonfinite_counts, scale_gradient
from companion.diagnostics import GradientRecord, GradientReport
from companion.diagnostics.hooks import diagnose_skipped_step
from companion.training.masking import UnmaskableUpdate, masked_writes
from companion.training.results import NonFiniteError, SkippedStep, TrainingHistory

#: A dynamic loss scale at or below this value no longer amplifies the gradients.
STALLED_LOSS_SCALE = 1.0
#: Columns of a step record.
_LOSS, _NORM, _APPLIED, _SCALE = range(4)

_ON_READ = dict(
    synchronization=tf.VariableSynchronization.ON_READ,
    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
    trainable=False,
)


class _TraceSlot(threading.local):
    """What the intercepted optimizer calls saw while one replica's step was traced."""

    def __init__(self) -> None:
        self.active = False
        self.loss = None
        self.multiplier_fn = None
        self.record = None
        self.halted = None


class GuardedStep:
    """A guarded ``train_step`` for one (model, optimizer, strategy, options) set-up.

    Args:
        model: the compiled Keras model.
        strategy: its distribution strategy.
        capacity: the most steps one host call runs (``steps_per_execution``).
        guard: ``False`` for ``on_nonfinite="ignore"`` (records only, every step applied).
        clip: the ``clip_global_norm`` of :func:`train`, or ``None``.
        limit: the consecutive skipped steps after which nothing more is applied.
    """

    def __init__(self, model, strategy, *, capacity: int, guard: bool, clip: float | None, limit: int) -> None:
        self.model = model
        self.optimizer = model.optimizer
        self.loss_scaler = self.optimizer if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer) else None
        self.inner = self.loss_scaler.inner_optimizer if self.loss_scaler is not None else self.optimizer
        self.strategy = strategy
        self.replicas = int(strategy.num_replicas_in_sync)
        self.multi_worker = _tf_internals.in_multi_worker_mode(strategy)
        if self.replicas > 1 and not self.multi_worker:
            _tf_internals.isolate_collective_keys(strategy)
        self.capacity = int(capacity)
        self.guard = guard
        self.clip = clip
        self.limit = int(limit)
        self.variables = list(model.trainable_variables)
        self.original_step = model.train_step
        self.original_test_step = model.test_step
        self.presummed = self.replicas > 1 and _tf_internals.can_skip_optimizer_all_reduce(self.inner)
        self.masked = self.replicas == 1 and self.loss_scaler is None and guard
        self.mode = None  # how the update was compiled, known once traced
        self._slot = _TraceSlot()
        nvars = max(len(self.variables), 1)
        with strategy.scope():
            self.records = tf.Variable(tf.zeros([self.capacity, 4]), name="guard_records", **_ON_READ)
            self.counts = tf.Variable(
                tf.zeros([self.capacity, 2, nvars], tf.int64), name="guard_counts", **_ON_READ
            )
            self.written = tf.Variable(tf.constant(0, tf.int32), name="guard_written", **_ON_READ)
            self.consecutive = tf.Variable(tf.constant(0, tf.int32), name="guard_consecutive", **_ON_READ)
        self.state = None  # found when the step is traced (fit builds the metrics first)

    def _state(self) -> list:
        """The variables a skipped step must put back: all but the trainable ones."""
        if self.state is None:
            self.state = []
            if self.guard:
                seen = {id(v) for v in self.model.trainable_variables}
                for v in [*self.model.non_trainable_variables, *self.model.metrics_variables]:
                    if id(v) not in seen:
                        seen.add(id(v))
                        self.state.append(v)
            if len(self.model.trainable_variables) != len(self.variables):
                self.variables = list(self.model.trainable_variables)
        return self.state

    # -- installing ----------------------------------------------------------------------

    def install(self) -> None:
        """Make ``model.fit`` run the guarded step (until :meth:`uninstall`)."""
        model = self.model
        model.train_step = types.MethodType(lambda _model, data: self.train_step(data), model)
        self._originals = self._intercept()
        if self.multi_worker:
            model.test_step = types.MethodType(lambda _model, data: self.test_step(data), model)
            _tf_internals.repair_symbolic_build_for_multi_worker(model)
        # fit builds its train function from model.train_step: the guarded one traced by
        # an earlier call of train, else a fresh one; the user's is put back afterwards.
        self._user_functions = (model.train_function, model.test_function)
        model.train_function = getattr(self, "_train_function", None)
        model.test_function = getattr(self, "_test_function", None) if self.multi_worker else None

    def forget_functions(self) -> None:
        """Trace afresh at the next install (e.g. after ``jit_compile`` changed)."""
        self._train_function = self._test_function = None
        self.model.train_function = self.model.test_function = None

    def uninstall(self) -> None:
        model = self.model
        if getattr(self, "_originals", None) is not None:
            self._restore_optimizer(self._originals)
            self._originals = None
        for name in ("train_step", "test_step"):
            if name in vars(model):
                delattr(model, name)
        _tf_internals.undo_symbolic_build_repair(model)
        self._train_function, self._test_function = model.train_function, model.test_function
        model.train_function, model.test_function = getattr(self, "_user_functions", (None, None))

    # -- the step ------------------------------------------------------------------------

    def test_step(self, data):
        return self._per_worker_logs(self.original_test_step(data))

    def _per_worker_logs(self, logs):
        if not self.multi_worker:
            return logs
        return tf.nest.map_structure(lambda v: tf.expand_dims(v, 0) if tf.is_tensor(v) else v, logs)

    def train_step(self, data):
        """The model's own ``train_step``, guarded (replica context)."""
        slot = self._slot
        if self.state is None and self.guard:
            # Without a strategy fit builds the compiled metrics inside the first traced
            # step; the guard must know their variables before the step runs.
            spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype) if tf.is_tensor(t) else t, data)
            with tf.init_scope():
                _tf_internals.build_compiled_state(self.model, spec)
        state = self._state()
        saved = [tf.identity(tf.convert_to_tensor(v)) for v in state]
        written = tf.convert_to_tensor(self.written)
        consecutive = tf.convert_to_tensor(self.consecutive)
        halted = consecutive >= self.limit
        slot.active, slot.loss, slot.multiplier_fn, slot.record, slot.halted = True, None, None, None, halted
        try:
            logs = self.original_step(data)
        finally:
            slot.active = False
        record = slot.record
        if record is None:  # the step applied no gradients (no trainable variables)
            loss = self._global_loss(slot)
            finite = tf.logical_and(tf.math.is_finite(loss), tf.logical_not(halted)) if self.guard else tf.constant(True)
            applied = tf.logical_and(finite, tf.logical_not(halted))
            record = (loss, tf.constant(0.0), applied, self._scale(), None)
        loss, norm, applied, scale, counts = record
        for variable, value in zip(state, saved):
            variable.assign(tf.where(applied, tf.convert_to_tensor(variable), value))
        row = tf.stack([tf.cast(loss, tf.float32), tf.cast(norm, tf.float32), tf.cast(applied, tf.float32), scale])

        def write():
            index = tf.minimum(written, self.capacity - 1)
            self.records.assign(tf.tensor_scatter_nd_update(tf.convert_to_tensor(self.records), [[index]], [row]))
            if counts is not None and self.counts.shape[-1] == len(self.variables):

                def write_counts():
                    self.counts.assign(
                        tf.tensor_scatter_nd_update(tf.convert_to_tensor(self.counts), [[index]], [counts()])
                    )
                    return tf.constant(0)

                tf.cond(applied, lambda: tf.constant(0), write_counts)
            self.written.assign(written + 1)
            self.consecutive.assign(tf.where(applied, tf.zeros_like(consecutive), consecutive + 1))
            return tf.constant(0)

        tf.cond(halted, lambda: tf.constant(0), write)
        if isinstance(logs, dict):
            # Re-read after the restore: a skipped step leaves no trace in the logs.
            fresh = self.model.get_metrics_result()
            if set(fresh) == set(logs):
                logs = fresh
        return self._per_worker_logs(logs)

    def _metric_names(self):
        return [m.name for m in self.model.metrics]

    def _scale(self):
        if self.loss_scaler is None or not self.loss_scaler.built:
            return tf.constant(1.0)
        return tf.cast(tf.convert_to_tensor(self.loss_scaler.dynamic_scale), tf.float32)

    def _global_loss(self, slot):
        loss = tf.constant(float("nan")) if slot.loss is None else tf.cast(slot.loss, tf.float32)
        if self.replicas > 1 and slot.loss is not None:
            # fit's per-replica loss is already divided by the number of replicas.
            loss = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, loss)
        return loss

    # -- the optimizer calls the step makes ----------------------------------------------

    def _intercept(self):
        optimizer, slot = self.optimizer, self._slot
        originals = {name: vars(optimizer).get(name) for name in ("scale_loss", "apply")}
        scale_loss = optimizer.scale_loss
        apply = optimizer.apply

        def noted_scale_loss(loss):
            scaled = scale_loss(loss)
            if slot.active and slot.loss is None:
                slot.loss = loss
                slot.multiplier_fn = lambda: tf.cast(scale_loss(tf.constant(1.0, loss.dtype)), tf.float32)
            return scaled

        def guarded_apply(grads, trainable_variables=None):
            if not slot.active or slot.record is not None:
                return apply(grads, trainable_variables)
            return self._apply(apply, list(grads), trainable_variables)

        optimizer.scale_loss = noted_scale_loss
        optimizer.apply = guarded_apply
        return originals

    def _restore_optimizer(self, originals) -> None:
        for name, value in originals.items():
            if value is None:
                vars(self.optimizer).pop(name, None)
            else:
                setattr(self.optimizer, name, value)

    def _apply(self, apply, grads, trainable_variables):
        slot = self._slot
        if trainable_variables is None:
            trainable_variables = self.variables
        trainable_variables = list(trainable_variables)
        if not self.optimizer.built:
            # As Keras' apply would, but before the update is traced (masked or not).
            with tf.init_scope():
                self.optimizer.build(trainable_variables)
        # Gradients arrive multiplied by what scale_loss multiplied the loss by (the
        # dynamic loss scale, the optimizer's loss_scale_factor).
        multiplier = slot.multiplier_fn() if slot.loss is not None else tf.constant(1.0)
        present = [i for i, g in enumerate(grads) if g is not None]
        loss = self._global_loss(slot)
        summed = grads
        if self.replicas > 1 and present:
            context = tf.distribute.get_replica_context()
            reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in present])
            summed = list(grads)
            for i, g in zip(present, reduced):
                summed[i] = g
        norm = global_norm(summed) / multiplier
        if self.guard:
            finite = tf.logical_and(tf.math.is_finite(loss), tf.math.is_finite(norm))
        else:
            finite = tf.constant(True)
        applied = tf.logical_and(finite, tf.logical_not(slot.halted))
        update = summed if self.presummed else grads
        if self.clip is not None:
            factor = tf.minimum(self.clip / tf.maximum(norm, 1e-30), 1.0)
            factor = tf.where(tf.math.is_finite(factor), factor, 1.0)
            update = [scale_gradient(g, factor) for g in update]
        index = {id(v): i for i, v in enumerate(self.variables)}

        def counts():
            ordered = [None] * max(len(self.variables), 1)
            for g, v in zip(summed, trainable_variables):
                if g is not None and id(v) in index:
                    ordered[index[id(v)]] = g
            nan, inf = nonfinite_counts(ordered)
            return tf.stack([nan, inf])

        scale = self._scale()  # before the update may change it
        if self.presummed:
            with _tf_internals.optimizer_all_reduce_skipped(self.inner):
                self._update(apply, update, trainable_variables, applied)
        else:
            self._update(apply, update, trainable_variables, applied)
        slot.record = (loss, norm, applied, scale, counts if self.guard else None)
        return self.optimizer.iterations

    def _run_apply(self, apply, grads, variables):
        return apply(grads, variables)

    def _update(self, apply, grads, variables, applied) -> None:
        if not self.guard:
            self.mode = "unguarded"
            self._run_apply(apply, grads, variables)
            return
        cache = model_cache(self.model)
        if self.masked and not cache.get(("unmaskable", id(self.optimizer))):
            masked = tf.function(self._masked_apply(apply, variables), autograph=False)
            try:
                masked(applied, grads)
                self.mode = "masked"
                return
            except UnmaskableUpdate:
                cache[("unmaskable", id(self.optimizer))] = True
        self.mode = "conditional"
        if self.loss_scaler is not None:

            def skip():
                # As the loss scaler does on an overflow: halve the scale.
                scaler = self.loss_scaler
                scaler.step_counter.assign(0)
                scaler.dynamic_scale.assign(tf.convert_to_tensor(scaler.dynamic_scale) * 0.5)
                return tf.constant(0)
        else:

            def skip():
                return tf.constant(0)

        def run():
            self._run_apply(apply, grads, variables)
            return tf.constant(0)

        if self.replicas > 1 and not _tf_internals.strategy_supports_no_merge_call():
            context = tf.distribute.get_replica_context()

            def cross_replica(distribution, grads, applied):
                def apply_each():
                    distribution.extended.call_for_each_replica(
                        lambda g: self._run_apply(apply, g, variables), args=(grads,)
                    )
                    return tf.constant(0)

                value = distribution.experimental_local_results(applied)[0]
                tf.cond(value, apply_each, skip)

            context.merge_call(cross_replica, args=(grads, applied))
        else:
            tf.cond(applied, run, skip)

    def _masked_apply(self, apply, variables):
        def masked(applied, grads):
            with masked_writes(applied):
                self._run_apply(apply, grads, variables)
            return tf.constant(0)

        return masked

    # -- the host side -------------------------------------------------------------------

    def reset(self, consecutive: int = 0) -> None:
        self.written.assign(0)
        self.consecutive.assign(consecutive)

    def drain(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The records of the steps run since the last drain, and their NaN/Inf counts.

        One function call per host call: it reads the buffer and empties it.
        """
        if getattr(self, "_drain_fn", None) is None:

            def drain():
                n = tf.minimum(tf.convert_to_tensor(self.written), self.capacity)
                records = tf.convert_to_tensor(self.records)[:n]
                self.written.assign(0)
                return records, tf.convert_to_tensor(self.counts)[:n]

            self._drain_fn = tf.function(drain, autograph=False)
        records, counts = self._drain_fn()
        records = records.numpy()
        if not self.guard or records[:, _APPLIED].all():
            return records, None
        return records, counts.numpy()


#: Per model: what train learnt about it (an optimizer whose update cannot be masked),
#: and the guarded steps built for it, so that calling ``train`` again does not retrace.
_CACHE: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


class DoctorView:
    """What :func:`companion.diagnostics.hooks.diagnose_skipped_step` reads of a run.

    Args:
        model: the model being trained.
        strategy: its distribution strategy.
        history: the run's :class:`TrainingHistory` (``epoch_steps`` locates the batch).
        replay: a function returning an epoch's batches in ``fit``'s order (see
            :func:`companion.training.inputs.replay_batches`) or ``None``; called once,
            at the first skipped step, as :attr:`distributed`.
        cluster: the :class:`~companion.training.cluster.Cluster`, or ``None``.
        verbose: whether the diagnosis is printed.

    Its ``optimizer`` is the model's (compiled by then): the doctor restores its
    variables too.
    """

    def __init__(self, model, strategy, history, replay, cluster=None, *, verbose: bool = False) -> None:
        self.model, self.strategy, self.history, self.cluster = model, strategy, history, cluster
        self.verbose = verbose
        self._replay = replay

    @property
    def optimizer(self):
        return getattr(self.model, "optimizer", None)

    @functools.cached_property
    def distributed(self):
        """An epoch's batches, or ``None`` if the inputs cannot be read again."""
        return self._replay()


def model_cache(model) -> dict:
    try:
        return _CACHE.setdefault(model, {})
    except TypeError:  # not weak-referenceable or unhashable: no cache
        return {}


class GuardCallback(keras.callbacks.Callback):
    """Drains the guard's records after every host call into the :class:`TrainingHistory`.

    Raises :class:`NonFiniteError` (from ``on_train_batch_end``, so out of ``fit``) once
    ``limit`` consecutive steps were skipped, and warns once when the dynamic loss
    scale stalls.
    """

    def __init__(
        self, step: GuardedStep, history: TrainingHistory, *, on_nonfinite: str, limit: int,
        doctor: DoctorView | None = None,
    ) -> None:
        super().__init__()
        self.step = step
        self.doctor = doctor
        self.training_history = history
        self.on_nonfinite = on_nonfinite
        self.limit = limit
        self.epoch = 0
        self.epoch_start = 0
        self.applied_losses: list[float] = []
        self._last_records: Any = ()

    def on_train_begin(self, logs=None):
        self.step.reset(self.training_history.trailing_nonfinite())

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self.epoch_start = self.training_history.steps
        self.applied_losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.record()

    def record(self) -> None:
        records, counts = self.step.drain()
        self._last_records = records
        history = self.training_history
        history.xla = bool(self.model.jit_compile)
        mode = self.step.mode
        if mode == "conditional":
            mode = "whole" if history.xla and self.step.replicas == 1 else "graph"
        history.update = mode
        for k, row in enumerate(records):
            index = history.steps
            loss, norm, applied = float(row[_LOSS]), float(row[_NORM]), row[_APPLIED] > 0.5
            history.step_loss.append(loss)
            history.grad_norm.append(norm)
            scale = float(row[_SCALE]) if self.step.loss_scaler is not None else None
            if scale is not None:
                history.loss_scale.append(scale)
            if applied:
                self.applied_losses.append(loss)
                continue
            history.skipped.append(index)
            nan_counts, inf_counts = counts[k] if counts is not None else (np.zeros(0), np.zeros(0))
            variables = self.step.variables
            records_ = [
                GradientRecord(
                    path=str(v.path), shape=tuple(int(d) for d in v.shape), nan_count=int(nan_counts[i]),
                    inf_count=int(inf_counts[i]), max_abs=None,
                )
                for i, v in enumerate(variables)
                if i < len(nan_counts) and (nan_counts[i] or inf_counts[i])
            ]
            history.reports.append(
                SkippedStep(
                    step=index, epoch=self.epoch, loss=loss, gradients=GradientReport(records_),
                    loss_scale=scale, grad_norm=norm,
                    # The NaN doctor, once per run: on the first skipped step only (on every
                    # worker: the hook's exchange is a collective every worker must join).
                    diagnosis=(
                        None if history.reports or self.doctor is None
                        else diagnose_skipped_step(self.doctor, index)
                    ),
                )
            )
        self._watch_loss_scale()
        consecutive = history.trailing_nonfinite()
        if self.step.guard and consecutive >= self.limit:
            raise nonfinite_error(history, consecutive, self.limit, self.on_nonfinite, self.step.loss_scaler is not None)

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


def nonfinite_error(history, consecutive, limit, on_nonfinite, loss_scaled) -> NonFiniteError:
    """The :class:`NonFiniteError` for the last ``consecutive`` skipped steps."""
    reports = tuple(history.reports[-consecutive:])
    last = reports[-1]
    if on_nonfinite == "raise":
        head = f"non-finite loss or gradients at step {last.step} (epoch {last.epoch}) with on_nonfinite='raise'"
    else:
        head = (
            f"{consecutive} consecutive steps with non-finite loss or gradients "
            f"(max_consecutive_nonfinite={limit}), the last at step {last.step} (epoch {last.epoch})"
        )
    if last.gradients:
        variables = ", ".join(f"{r.path} ({r.nan_count} NaN, {r.inf_count} Inf)" for r in last.gradients)
        detail = f"loss {last.loss:.6g}; non-finite gradients in {variables}"
    else:
        detail = f"loss {last.loss:.6g}; {last.cause()}"
    if loss_scaled and reports[0].loss_scale is not None:
        detail += f"; loss scale {reports[0].loss_scale:g} -> {last.loss_scale:g}"
    good = reports[0].step - 1
    state = f"after step {good}" if good >= 0 else "at the start of training"
    return NonFiniteError(
        f"{head}: {detail}. No update was applied on these steps: the weights and optimizer state are those {state}.",
        step=last.step,
        epoch=last.epoch,
        reports=reports,
        history=history,
    )


#: Keras' callbacks whose own batch hooks do nothing when they save once per epoch.
_EPOCH_SAVERS = (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore)


def asks_for_batch_hooks(callbacks) -> bool:
    """Whether any of ``callbacks`` overrides a batch hook of training (as Keras tells).

    ``ModelCheckpoint`` and ``BackupAndRestore`` with ``save_freq="epoch"`` do not: their
    ``on_train_batch_end`` returns at once then (unless a subclass overrides it).
    """
    hooks = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end")
    for callback in callbacks:
        if isinstance(callback, (keras.callbacks.History, keras.callbacks.ProgbarLogger)):
            continue
        overridden = [name for name in hooks if not _tf_internals.is_default_callback_method(callback, name)]
        if isinstance(callback, _EPOCH_SAVERS) and getattr(callback, "save_freq", None) == "epoch":
            keras_own = next(c for c in _EPOCH_SAVERS if isinstance(callback, c))
            overridden = [
                name for name in overridden if getattr(type(callback), name) is not getattr(keras_own, name)
            ]
        if overridden:
            return True
    return False
