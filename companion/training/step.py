"""The guarded step that :func:`companion.training.train` installs in Keras' own ``fit``.

``train`` *is* ``model.fit``: Keras' trainer runs the epochs, the callbacks, the
validation, ``steps_per_execution``, ``History``. What ``train`` adds is a guarded
``train_step``, installed on the model for the duration of the call: it runs the
model's own ``train_step`` (Keras', or the user's override: a GAN's, a VAE's, Keras'
guide's) and decides, after it, whether the step counts.

* On one replica, without XLA or a loss scaler, in a call long enough for its model
  (``defer``, :func:`companion.training.deferred.worth_deferring`), the model
  optimizer's update is deferred to the step's end and run under one predicate, with no
  copy of the weights or of the optimizer's state (:mod:`companion.training.deferred`);
  only the small state the step writes itself is read before it and put back. Otherwise
  (and for a step that reads or writes what the update writes, traced again):
* Before the step, the values of every variable a step may write are read (under
  several replicas, each replica its own copy): every variable of the model (weights,
  non-trainable state such as batch-norm statistics, the metrics) and of every
  optimizer it holds (``model.optimizer`` and any other, a GAN's ``d_optimizer`` and
  ``g_optimizer``; an optimizer first built by the
  step's own ``apply`` is built just before it, and read then). Not the random state
  (a skipped random draw is not drawn again) and not the dynamic loss scale.
* While the step is traced, its calls on the optimizers are intercepted
  (:mod:`companion.training.interception`): ``optimizer.scale_loss(loss)`` notes the loss; ``optimizer.apply(gradients,
  variables)`` notes the gradients (for the model's optimizer they are summed across
  replicas once, clipped if asked, and tested before the update).
* After the step, it is non-finite when its loss (noted, else its logged ``loss`` or
  first logged value), any optimizer's gradients, any value it logs, or any variable
  it may have written is not finite, or when the
  consecutive-skip limit was reached. Every variable read before the step is then
  written back, ``where(ok, new, old)``: nothing the step did remains, whoever wrote
  it. Under several replicas the same decision is taken on every replica (an
  all-reduce), the update of the model's optimizer is put under a conditional, and
  every replica puts back its own copy of every variable (other optimizers' writes
  included).

The step's record (loss, norm, applied or not, loss scale, NaN/Inf counts per variable
on a skipped step) is written into a small buffer of variables, and the logs are re-read
so that they never show a skipped step. The buffer is drained by
:class:`~companion.training.callbacks.GuardCallback` after every host call (every ``steps_per_execution`` steps), which fills the
:class:`TrainingHistory` (:mod:`companion.training.records`) and raises
:class:`NonFiniteError`; once the consecutive-skip
limit is reached inside a host call, the remaining steps of that call apply nothing and
are not recorded.

Under a multi-worker strategy the step's logs get a leading axis of length 1 (Keras'
``fit`` reduces them with ``strategy.reduce("MEAN", value, axis=0)``, which fails on a
scalar), and the model's symbolic build takes its example batch from the local
replica (a repair in :mod:`companion._internal.keras_trainer`): the two places where Keras 3's
``fit`` fails under ``MultiWorkerMirroredStrategy``.

What the step changes on the model and its optimizers, and how it is put back, is
listed in :mod:`companion.training.patches`. The design is derived in the chapter *A training loop that survives NaN*.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from companion import _internal
from companion._gradients import nonfinite_counts
from companion.training.bounds import UpdateBound
from companion.training.deferred import DeferredUpdate, writes_of_step
from companion.training.holdings import model_optimizers, random_state
from companion.training.interception import OptimizerInterception, TraceSlot
from companion.training.patches import ModelPatches
from companion.training.buffer import ON_READ, RecordBuffer
from companion.training.records import TESTED
from companion.training.spikes import LossSpikes
from companion.training.values import SELECT_LIMIT, float_values as _float_values, read as _read
from companion.training.values import all_finite as _all_finite, entries as _entries


class GuardedStep(OptimizerInterception):
    """A guarded ``train_step`` for one (model, optimizer, strategy, options) set-up.

    Args:
        model: the compiled Keras model.
        strategy: its distribution strategy.
        capacity: the most steps one host call runs (``steps_per_execution``).
        guard: ``False`` for ``on_nonfinite="ignore"`` (records only, every step applied).
        clip: the ``clip_global_norm`` of :func:`train`, or ``None``.
        limit: the consecutive skipped steps after which nothing more is applied.
        spikes: the ``skip_loss_spikes`` of :func:`train` (a step whose loss is more
            than this many running standard deviations above the running mean of the
            loss is skipped), or ``None``.
        defer: defer the update where one replica without a loss scaler allows it
            (``False``: the masked step, for a call too short for its model).
        watch_logs: record which logged values were not finite (the NaN doctor's step).
    """

    def __init__(self, model, strategy, *, capacity: int, guard: bool, clip: float | None, limit: int,
                 defer: bool = True, watch_logs: bool = False, spikes: float | None = None) -> None:
        self.model = model
        self.optimizer = model.optimizer
        self.loss_scaler = self.optimizer if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer) else None
        self.inner = self.loss_scaler.inner_optimizer if self.loss_scaler is not None else self.optimizer
        self.strategy = strategy
        self.replicas = int(strategy.num_replicas_in_sync)
        self.multi_worker = _internal.in_multi_worker_mode(strategy)
        if self.replicas > 1 and not self.multi_worker:
            _internal.isolate_collective_keys(strategy)
        self.capacity = int(capacity)
        self.guard = guard
        self.clip = clip
        self.limit = int(limit)
        self.spikes = None if spikes is None or not guard else float(spikes)
        self.variables = list(model.trainable_variables)
        self.original_step = model.train_step
        self.optimizers = model_optimizers(model)
        self.original_test_step = model.test_step
        self.presummed = self.replicas > 1 and _internal.can_skip_optimizer_all_reduce(self.inner)
        self.masked = self.replicas == 1 and self.loss_scaler is None and guard
        # One replica, no loss scaler: the model optimizer's update is deferred to the
        # step's end and applied under one predicate, with no copy of what it writes
        # (DeferredUpdate); off for a step that reads the weights after its update or
        # writes them itself (found while tracing: the step is then traced again, masked).
        self.deferred = defer and self.masked and not model_cache(model).get("undeferrable")
        # The NaN doctor's step records which logged values were not finite (fit's logs
        # show a skipped step's values put back).
        self.watch_logs = watch_logs and self.replicas == 1
        self.bound = UpdateBound(self.inner, self.variables) if self.deferred and self.inner is not None else None
        self.mode = None  # how the update was compiled, known once traced
        self._slot = TraceSlot()
        self.buffer = RecordBuffer(self.capacity, len(self.variables), strategy)
        with strategy.scope():
            self.loss_spikes = None if self.spikes is None else LossSpikes(self.spikes, self.replicas, ON_READ)
        self.state = None  # found when the step is traced (fit builds the metrics first)

    def _state(self) -> list:
        """The variables a skipped step must put back, read before the step.

        Every variable of the model (its weights, the non-trainable state the forward
        pass changes, the metrics) and of every optimizer the model holds
        (``model.optimizer`` and any other, e.g. a GAN's ``d_optimizer``), so that a
        skipped step changes nothing, whoever writes; under several replicas each
        replica reads and puts back its own copy. Never the random state (a
        ``SeedGenerator``'s): a skipped random draw is not drawn again. Never the
        dynamic loss scale: a skipped step halves it.
        """
        model = self.model
        if len(model.trainable_variables) != len(self.variables):
            self.variables = list(model.trainable_variables)
        if not self.guard:
            return []
        kept = {id(v) for v in random_state(model)}
        if self.loss_scaler is not None:
            kept.update(id(v) for v in (self.loss_scaler.dynamic_scale, self.loss_scaler.step_counter))
        candidates = [*model.variables, *model.metrics_variables]
        for optimizer in self.optimizers:
            if optimizer.built:
                candidates.extend(optimizer.variables)
        state = []
        for v in candidates:
            if id(v) not in kept:
                kept.add(id(v))
                state.append(v)
        return state

    # -- installing ----------------------------------------------------------------------

    def install(self, patches: ModelPatches) -> None:
        """Make ``model.fit`` run the guarded step, until ``patches.restore()``."""
        model = self.model
        # Not converted by AutoGraph, as Keras' own step functions are not: under a
        # strategy, strategy.run would otherwise try to convert these and warn that it
        # cannot (the model's own train_step runs as fit runs it either way).
        patches.set(model, "train_step", types.MethodType(
            tf.autograph.experimental.do_not_convert(lambda _model, data: self.train_step(data)), model))
        self._intercept(patches)
        if self.multi_worker:
            patches.set(model, "test_step", types.MethodType(
                tf.autograph.experimental.do_not_convert(lambda _model, data: self.test_step(data)), model))
            patches.repair_symbolic_build(model)
        # fit builds its train function from model.train_step: the guarded one traced by
        # an earlier call of train, else a fresh one; the user's is put back afterwards,
        # and the guarded one kept for the next call.
        patches.set_step_functions(
            model, getattr(self, "_train_function", None),
            getattr(self, "_test_function", None) if self.multi_worker else None,
        )
        patches.before_restore(self._keep_functions)
        GUARDED.add(model)
        patches.before_restore(lambda: GUARDED.discard(model))
        if self.bound is not None:
            self.bound.measure()  # the weights and moments may have changed since the last call

    def undeferrable(self, patches: ModelPatches) -> None:
        """The step reads or writes what a deferred update writes: trace it again, masked
        (and remember it for this model)."""
        model_cache(self.model)["undeferrable"] = True
        self.deferred = False
        self.forget_functions(patches)

    def _keep_functions(self) -> None:
        self._train_function = getattr(self.model, "train_function", None)
        self._test_function = getattr(self.model, "test_function", None)

    @contextlib.contextmanager
    def unguarded_steps(self):
        """The model's own ``train_step`` and ``test_step`` for the duration (the doctor
        re-runs a skipped step with them): a re-run of the guarded step would count in the
        guard's records and consecutive skips, and halt the steps after it."""
        model = self.model
        installed = {name: vars(model).pop(name) for name in ("train_step", "test_step") if name in vars(model)}
        try:
            yield
        finally:
            for name, value in installed.items():
                setattr(model, name, value)

    def forget_functions(self, patches: ModelPatches) -> None:
        """Trace afresh at the next install (e.g. after ``jit_compile`` changed)."""
        self._train_function = self._test_function = None
        patches.set_step_functions(self.model, None, None)

    # -- the step ------------------------------------------------------------------------

    def test_step(self, data):
        return self._per_worker_logs(self.original_test_step(data))

    def _per_worker_logs(self, logs):
        if not self.multi_worker:
            return logs
        return tf.nest.map_structure(lambda v: tf.expand_dims(v, 0) if tf.is_tensor(v) else v, logs)

    def train_step(self, data):
        """The model's own ``train_step``, guarded (replica context).

        The step is non-finite when its loss, its gradients (any optimizer's), its
        logged values or anything it wrote (weights, optimizer state, non-trainable
        variables, metrics) are not finite; every variable of
        :meth:`_state` is then put back to its value before the step.
        """
        slot = self._slot
        if self.state is None and self.guard:
            # Without a strategy fit builds the compiled metrics inside the first traced
            # step; the guard must know their variables before the step runs. A model
            # that cannot be built symbolically (a VAE without call()) is left to fit,
            # which builds what the step uses while tracing it.
            spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype) if tf.is_tensor(t) else t, data)
            with tf.init_scope():
                try:
                    _internal.build_compiled_state(self.model, spec)
                except (RuntimeError, NotImplementedError):
                    pass
        self.state = state = self._state()
        one = self.replicas == 1
        # (Not in an eager step, run_eagerly: its ops run as they are made, none to read.)
        deferred = self.deferred and not self.model.jit_compile and tf.inside_function()
        direct: list = []
        if deferred:
            # What the deferred update writes is never copied: the model's trainable
            # variables and its optimizer's state.
            direct = self._direct()
            ids = {id(v) for v in direct}
            state = [v for v in state if id(v) not in ids]
        saved = [_read(v) for v in state]  # each replica its own copy
        buffer = self.buffer
        written = _read(buffer.written) if one else tf.convert_to_tensor(buffer.written)
        consecutive = _read(buffer.consecutive) if one else tf.convert_to_tensor(buffer.consecutive)
        halted = tf.raw_ops.GreaterEqual(x=consecutive, y=tf.constant(self.limit, tf.int32))
        slot.active, slot.loss, slot.multiplier_fn, slot.record, slot.halted = True, None, None, None, halted
        slot.late, slot.grads, slot.norms, slot.spike = [], {}, [], None
        slot.deferred, slot.after_apply = deferred, None
        graph = tf.compat.v1.get_default_graph()
        first = len(graph.get_operations())
        try:
            logs = self.original_step(data)
        finally:
            slot.active = False
        if deferred:
            # Only what the step itself wrote is put back (a batch-norm statistic, a
            # metric, another optimizer's state); the step must neither write what the
            # deferred update writes nor read it after its apply.
            touched = writes_of_step(graph, first, len(graph.get_operations()), slot.after_apply, state, direct)
            saved = [value for v, value in zip(state, saved) if id(v) in touched]
            state = [v for v in state if id(v) in touched]
        record = slot.record
        loss = self._global_loss(slot) if slot.loss is not None else self._logged_loss(logs)
        if record is None:  # the model's optimizer applied nothing (another one may have)
            applied = tf.raw_ops.LogicalNot(x=halted)
            record = (loss, tf.constant(0.0), applied, self._scale(), None)
        _, norm, applied, scale, _ = record
        if slot.norms:
            norm = tf.raw_ops.Sqrt(x=tf.raw_ops.AddN(inputs=[tf.raw_ops.Square(x=tf.cast(n, tf.float32))
                                                             for n in [norm, *slot.norms]]))
        restored = [*zip(state, saved), *slot.late]
        now = None
        if self.guard:
            # One test for the whole step: its loss, its gradients' norm, every float it
            # logs and every variable it may have written (each replica its own copy).
            now = [_read(v) for v, _ in restored]
            # (The doctor's step tests the gradients' entries instead of their norm: a norm
            # that overflows from finite entries is not a value fit makes non-finite.)
            gradients = list(slot.grads.values()) if self.watch_logs else [norm]
            by_norm = None
            if self.watch_logs and _entries(gradients) > SELECT_LIMIT:
                # A finite norm proves every entry finite (a NaN or an Inf survives the
                # sum of squares): the entries are tested only where it is not, so that
                # a step reads large gradients once (for their norm), not twice.
                entries_of = gradients
                by_norm = tf.cond(tf.raw_ops.IsFinite(x=tf.cast(norm, tf.float32)), lambda: tf.constant(True),
                                  lambda: _all_finite(entries_of))
                gradients = []
            finite = _all_finite([loss, *gradients, *_float_values(logs), *now], flatten=_entries(now) <= SELECT_LIMIT)
            if by_norm is not None:
                finite = tf.raw_ops.LogicalAnd(x=finite, y=by_norm)
            if not one:
                # The same decision on every replica and worker.
                context = tf.distribute.get_replica_context()
                bad = tf.cast(tf.logical_not(finite), tf.float32)
                finite = context.all_reduce(tf.distribute.ReduceOp.SUM, bad) < 0.5
            applied = tf.raw_ops.LogicalAnd(x=applied, y=finite)
        spike = threshold = None
        if self.spikes is not None:
            # A finite loss far above the running mean of the applied steps' losses:
            # skipped like a non-finite step, decided on the device (no host round trip).
            if slot.spike is not None:
                # Tested before the update's conditional, which the spike skipped already.
                spike, threshold = slot.spike
                spike = tf.raw_ops.LogicalAnd(x=spike, y=finite)  # a non-finite step is not called a spike
            else:
                spike, threshold = self.loss_spikes.test(loss, halted)
                spike = tf.raw_ops.LogicalAnd(x=spike, y=applied)  # a non-finite step is not called a spike
                applied = tf.raw_ops.LogicalAnd(x=applied, y=tf.raw_ops.LogicalNot(x=spike))
        counts = self._counts(slot) if self.guard and self.variables else None
        if self.guard and isinstance(slot.deferred, DeferredUpdate):
            # The NaN/Inf counts of a step that may be skipped, written before the update
            # so that no gradient outlives its variable's update; then the update, only
            # if everything above is finite and it is proved (or, tested on a copy,
            # found) finite itself.
            on_skip = on_tested = None
            n = len(self.variables)
            if counts is not None and self._few_weights():
                buffer.write_counts(counts, written, applied, n, True)  # at every step: a few ops
            elif counts is not None:
                def on_skip(counts=counts):  # inside the update's conditional: no gradient waits for it
                    buffer.write_counts(counts, written, None, n, False)

                def on_tested():  # the gradients were finite: no count to take
                    buffer.write_counts(lambda: tf.zeros([2, n], tf.int64), written, None, n, False)
            counts = None
            applied = slot.deferred.run(applied, self._direct(), on_skip, on_tested)
            tested = tf.cast(slot.deferred.tested, tf.float32)
        else:
            tested = tf.constant(0.0)
        self._put_back(restored, applied, now)
        if spike is not None:
            self.loss_spikes.count(loss, spike, threshold, tf.raw_ops.LogicalOr(x=applied, y=spike))
        if self.watch_logs and isinstance(logs, dict):
            buffer.write_log_flags(logs, written)
        spiked = tf.constant(0.0) if spike is None else tf.cast(spike, tf.float32)
        row = tf.stack([tf.cast(loss, tf.float32), tf.cast(norm, tf.float32), tf.cast(applied, tf.float32), scale,
                        spiked, tested])
        # A spike is a finite step: it ends a run of non-finite ones, as an applied step does.
        ended = applied if spike is None else tf.raw_ops.LogicalOr(x=applied, y=spike)
        if one:
            buffer.record_raw(row, counts, written, consecutive, halted, applied, ended, len(self.variables),
                              self._few_weights())
        else:
            buffer.record(row, counts, written, consecutive, halted, applied, ended, len(self.variables))
        if isinstance(logs, dict):
            # Re-read after the restore: a skipped step leaves no trace in the logs.
            fresh = self.model.get_metrics_result()
            if set(fresh) == set(logs):
                logs = fresh
            elif self.guard and one:
                logs = self._last_good_logs(logs, applied)
        return self._per_worker_logs(logs)

    def reset_loss_stats(self) -> None:
        """Forget the running loss statistics (after a rollback: the warm-up again)."""
        if self.loss_spikes is not None:
            self.loss_spikes.reset()

    def _put_back(self, restored, applied, now=None) -> None:
        """Every variable of ``restored`` to its value before the step, unless ``applied``.

        Raw reads and writes of the variables' handles (``now``: their values after the
        step; under several replicas each replica's handle is its own copy's, and the
        decision is the same on every replica). Under XLA, and without it for a small
        state, one select per variable: XLA fuses the selects into the step's
        element-wise work, and a small model's selects cost less to trace and to run
        than a conditional with every variable as its input. Without XLA, a state of
        more than :data:`SELECT_LIMIT` entries is put back under a conditional instead:
        there the selects, a pass over every weight and moment at every step, would
        cost more than the conditional's one trace. Unguarded (``now`` is ``None``),
        only an optimizer built during the step is put back, with Keras' ``assign``.
        """
        if not restored:
            return
        if now is None:
            for variable, value in restored:
                variable.assign(tf.where(applied, tf.convert_to_tensor(variable), value))
            return
        if not self.model.jit_compile and _entries(now) > SELECT_LIMIT:

            def put_back():
                for variable, value in restored:
                    tf.raw_ops.AssignVariableOp(resource=variable.handle, value=value)
                return tf.constant(0)

            tf.cond(applied, lambda: tf.constant(0), put_back)
            return
        for (variable, value), new in zip(restored, now):
            tf.raw_ops.AssignVariableOp(resource=variable.handle, value=tf.raw_ops.SelectV2(
                condition=applied, t=new, e=value))

    def _logged_loss(self, logs):
        """The step's loss when the step did not call ``scale_loss``: its logged ``loss``, or
        the first value it logs (a GAN's ``d_loss``); 0 when it logs nothing."""
        values = _float_values(logs, scalars=True)
        if isinstance(logs, dict) and tf.is_tensor(logs.get("loss")) and logs["loss"].dtype.is_floating:
            values = [logs["loss"]]
        loss = tf.reduce_mean(tf.cast(values[0], tf.float32)) if values else tf.constant(0.0)
        if self.replicas > 1:
            context = tf.distribute.get_replica_context()
            loss = context.all_reduce(tf.distribute.ReduceOp.SUM, loss) / self.replicas
        return loss

    def _last_good_logs(self, logs, applied):
        """``logs`` whose values are not metrics: a skipped step shows the last applied
        step's values, so that no log ever shows a skipped step."""
        if getattr(self, "_good_logs", None) is None:
            self._good_logs = {}
        out = dict(logs)
        for key, value in logs.items():
            if not (tf.is_tensor(value) and value.dtype.is_floating and value.shape.rank == 0):
                continue
            if key not in self._good_logs:
                with tf.init_scope():
                    self._good_logs[key] = tf.Variable(tf.zeros([], value.dtype), trainable=False, name=f"guard_{key}")
            memory = self._good_logs[key]
            kept = tf.where(applied, value, tf.convert_to_tensor(memory))
            memory.assign(kept)
            out[key] = kept
        return out

    def _counts(self, slot):
        grads = dict(slot.grads)
        flatten = self._few_weights()

        def counts():
            """NaN and Inf counts per trainable variable's gradient, ``[2, n]``."""
            gradients = [grads.get(id(v)) for v in self.variables]
            return tf.raw_ops.Pack(values=list(nonfinite_counts(gradients, flatten=flatten)))

        return counts

    def _few_weights(self) -> bool:
        """At most :data:`SELECT_LIMIT` trainable entries: the NaN/Inf counts are computed
        at every step (a few ops over all gradients at once), without a conditional, whose
        two traced branches cost a small model more than the counts."""
        return _entries(self.variables) <= SELECT_LIMIT

    def _scale(self):
        if self.loss_scaler is None or not self.loss_scaler.built:
            return tf.constant(1.0)
        return tf.cast(tf.convert_to_tensor(self.loss_scaler.dynamic_scale), tf.float32)

    # -- the host side -------------------------------------------------------------------

    def reset(self, consecutive: int = 0) -> None:
        self.buffer.reset(consecutive)

    def drain(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The records of the steps run since the last drain, and their NaN/Inf counts; the
        deferred update's bounds measured again if one of these steps took its tested path."""
        records, counts = self.buffer.drain(self.guard)
        if self.bound is not None and len(records) and records[:, TESTED].any():
            self.bound.measure()
        return records, counts

    def nonfinite_logs(self, row: int) -> list[str]:
        """The logged values that were not finite at ``row`` of the last drained records."""
        return self.buffer.nonfinite_logs(row)


#: The models whose ``fit`` runs a guarded step now (``train``'s, or the NaN doctor's).
GUARDED: "weakref.WeakSet[Any]" = weakref.WeakSet()

#: Per model: what train learnt about it (an optimizer whose update cannot be masked),
#: and the guarded steps built for it, so that calling ``train`` again does not retrace.
_CACHE: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def model_cache(model) -> dict:
    try:
        return _CACHE.setdefault(model, {})
    except TypeError:  # not weak-referenceable or unhashable: no cache
        return {}
