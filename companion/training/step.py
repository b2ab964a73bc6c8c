"""The compiled training step and the loop of steps that runs per host call.

A :class:`Runner` holds the traced functions of one (model, loss, optimizer, strategy)
set-up. Each step computes the loss, the gradients (summed over replicas), their
global norm, which is also the finiteness test (a NaN or Inf anywhere makes it
non-finite), optional clipping, and the update, applied or not. Several steps run per
host call in a ``tf.while_loop`` that records each step's loss, norm and finiteness in
``TensorArray`` s and stops at the end of the epoch or at the consecutive-skip limit:
the ``steps_per_execution`` loop of Keras' trainer, without a per-step host sync.
The design and its cost are derived in the chapter *The guarded training loop*.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from companion import _tf_internals
from companion._gradients import global_norm, nonfinite_counts, scale_gradient
from companion.training.masking import masked_writes

#: When the update cannot be masked: from this many trainable parameters on, it runs
#: as its own XLA function ("split" mode): around 2**20 parameters the copy XLA makes
#: of the variables and optimizer slots around a conditional update costs about as
#: much, on CPU, as one more function launch per step.
SPLIT_UPDATE_MIN_PARAMETERS = 2**20


def _batch_size(targets) -> tf.Tensor:
    """The number of examples in a batch (the leading dimension of its targets), as float32."""
    return tf.cast(tf.shape(tf.nest.flatten(targets)[0])[0], tf.float32)


def restore(variable, values) -> None:
    """Assign each replica's copy of ``variable`` its own saved value (cross-replica context)."""
    tf_variable = getattr(variable, "value", variable)
    components = getattr(tf_variable, "values", None)
    if components is not None and len(components) == len(values):
        for component, value in zip(components, values):
            component.assign(value)
    else:
        variable.assign(values[0])


class Runner:
    """The traced and compiled functions of one (model, loss, optimizer, strategy) set-up.

    :meth:`run` executes up to ``max_steps`` steps in one ``tf.function`` call and
    returns their records (loss, gradient norm, finiteness, loss scale per step, and
    the NaN/Inf counts per variable of the skipped ones). A step is
    :meth:`_replica_step` on every replica (forward and backward pass, the all-reduce,
    the norm and the finiteness test, clipping) followed by the update, which
    :meth:`_step` applies or not according to :attr:`mode`:

    * ``"masked"``: one XLA function per step; every write of the update is a select
      between the new and the old value (:class:`~companion.training.masking.masked_writes`).
      The default.
    * ``"whole"``: one XLA function per step, the update under a conditional inside it;
      used when the update cannot be masked, or with loss scaling (whose scale updates
      are conditional).
    * ``"split"``: as ``"whole"`` from :data:`SPLIT_UPDATE_MIN_PARAMETERS` on, as two XLA
      functions with the conditional between them in the TensorFlow graph.
    * ``"graph"``: several replicas (the all-reduce and the cross-replica conditional
      stay in the graph; the forward and backward pass are compiled), or no XLA.

    The mode changes only the speed, never the numbers.
    """

    def __init__(
        self, model, optimizer, strategy, *, jit: bool, clip: float | None, guard: bool, masked: bool = True
    ) -> None:
        self._model = weakref.ref(model)
        self.optimizer = optimizer
        self.loss_scaler = optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else None
        self.inner = self.loss_scaler.inner_optimizer if self.loss_scaler is not None else optimizer
        self.strategy = strategy
        self.replicas = int(strategy.num_replicas_in_sync)
        self.jit = bool(jit)
        self.clip = clip
        self.guard = guard
        self.variables = list(model.trainable_variables)
        # Several replicas: the update gets the gradients the step summed (and tested),
        # when the optimizer's own all-reduce can be switched off (_summed_gradients).
        self.presummed = self.replicas > 1 and _tf_internals.can_skip_optimizer_all_reduce(self.inner)
        # Variables the forward pass may change (batch-norm statistics, dropout seeds):
        # restored on a skipped step.
        # The optimizer's loss_scale_factor (fit multiplies the loss by it; apply divides).
        self.factor = getattr(self.inner, "loss_scale_factor", None)
        self.loss_tracker = next(
            (m for m in model.metrics if m.name == "loss" and isinstance(m, keras.metrics.Mean)), None
        )
        # State a skipped step must leave as it was: what the forward pass may change
        # (batch-norm statistics, dropout seeds) and the metrics it updated.
        state = {id(v): v for v in [*model.non_trainable_variables, *model.metrics_variables]}
        self.state = list(state.values()) if guard else []
        self.present: list[int] | None = None
        self.verified = False  # one call has run without error
        self.steps_per_call = 1
        parameters = sum(int(np.prod(v.shape)) for v in self.variables)
        if not self.jit:
            self.mode = "graph"
        elif self.replicas > 1:
            self.mode = "graph"
        elif guard and masked and self.loss_scaler is None:
            self.mode = "masked"
        elif guard and parameters >= SPLIT_UPDATE_MIN_PARAMETERS:
            self.mode = "split"
        else:
            self.mode = "whole"

        def compiled(fn, when: bool):
            return tf.function(fn, jit_compile=True, autograph=False) if when else fn

        self.step_fn = compiled(self._recorded_step, self.mode in ("whole", "masked"))
        self.compute_fn = compiled(self._compute, self.mode == "split")
        self.apply_fn = compiled(self._apply, self.mode == "split")
        self.forward_fn = compiled(self._forward, self.mode == "graph" and self.jit)
        self._run_known = tf.function(functools.partial(self._run, known_length=True), autograph=False)
        self._run_unknown = tf.function(functools.partial(self._run, known_length=False), autograph=False)

    def run(self, iterator, max_steps: int, consecutive: int, limit: int, known_length: bool) -> dict[str, np.ndarray]:
        """Run up to ``max_steps`` steps and read their records back in one go."""
        fn = self._run_known if known_length else self._run_unknown
        out = fn(
            iterator,
            tf.constant(max_steps, tf.int32),
            tf.constant(consecutive, tf.int32),
            tf.constant(limit, tf.int32),
        )
        return {name: value.numpy() for name, value in out.items()}

    # -- one step ----------------------------------------------------------------------

    def _forward(self, x, y, weights, scale):
        """This replica's loss (as ``fit`` computes it), its gradients, and the metric updates."""
        model = self._model()
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            value = tf.cast(model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=weights), tf.float32)
            count = _batch_size(y)
            if self.replicas > 1:
                # Keras divides its compiled loss (not the regularisation losses) by the
                # number of replicas; undo that to get this replica's mean loss.
                regularization = tf.cast(tf.add_n(model.losses), tf.float32) if model.losses else 0.0
                value = (value - regularization) * float(self.replicas) + regularization
                # This replica's share of the batch mean: its examples' total, which
                # _compute divides by the global batch size (replicas may get unequal
                # parts of a batch, or an empty one at the end of a worker's data).
                local = tf.where(count > 0, value * count, tf.zeros_like(value))
            else:
                local = value
            scaled = local * scale if self.loss_scaler is not None else local
            if self.factor is not None:
                scaled = scaled * self.factor  # the optimizer's scale_loss, as fit applies it
        gradients = tape.gradient(scaled, self.variables)
        if self.loss_scaler is not None:
            gradients = [scale_gradient(g, 1.0 / scale) for g in gradients]
        if self.factor is not None:
            gradients = [scale_gradient(g, 1.0 / self.factor) for g in gradients]
        # The metrics of this step (undone with the rest of the state on a skipped step).
        if self.loss_tracker is not None:
            self.loss_tracker.update_state(tf.where(count > 0, value, 0.0), sample_weight=count)
        model.compute_metrics(x, y, y_pred, sample_weight=weights)
        return local, gradients

    def _replica_step(self, batch, scale):
        # This replica's copy of the state the forward pass may change.
        saved = [tf.identity(tf.convert_to_tensor(v)) for v in self.state]
        outputs = self.compute_fn(batch, scale)
        return (outputs[0], saved) + tuple(outputs[1:])

    def _compute(self, batch, scale):
        """Loss, gradients (summed over replicas), their norm, the finiteness test, clipping."""
        x, y, weights = keras.utils.unpack_x_y_sample_weight(batch)
        loss, gradients = self.forward_fn(x, y, weights, scale)
        gradients = list(gradients)
        self.present = [i for i, g in enumerate(gradients) if g is not None]
        if self.replicas > 1:
            gradients = [None if g is None else tf.convert_to_tensor(g) for g in gradients]
            context = tf.distribute.get_replica_context()
            reduced = context.all_reduce(
                tf.distribute.ReduceOp.SUM, [loss, _batch_size(y)] + [gradients[i] for i in self.present]
            )
            # The global batch size; the max() only matters for a batch that is empty on
            # every replica, which the dataset iterator does not produce.
            inverse = 1.0 / tf.maximum(reduced[1], 1.0)
            loss = reduced[0] * inverse
            total = [None] * len(gradients)
            for i, g in zip(self.present, reduced[2:]):
                total[i] = g * inverse
            # The update uses the summed gradients (see _summed_gradients), or, if this
            # Keras has no way to say they are summed, this replica's share to be summed.
            gradients = total if self.presummed else [scale_gradient(g, inverse) for g in gradients]
        else:
            total = gradients
        norm = global_norm(total)
        if self.guard:
            # A NaN or Inf anywhere makes the sum of squares NaN or Inf, so the norm
            # (recorded anyway) is the finiteness test: no extra pass over the gradients.
            # (Finite gradients whose squared norm overflows float32, a norm above
            # ~1.8e19, are skipped too: no update computed from them can be trusted.)
            finite = tf.logical_and(tf.math.is_finite(loss), tf.math.is_finite(norm))
        else:
            finite = tf.constant(True)
        clipped = gradients
        if self.clip is not None:
            factor = self.clip / tf.maximum(norm, self.clip)
            clipped = [scale_gradient(g, factor) for g in gradients]
        # The skipped branch counts NaN and Inf entries in the (summed, unclipped)
        # gradients; without clipping and with one replica those are the same tensors.
        if self.guard and (self.clip is not None or (self.replicas > 1 and not self.presummed)):
            unclipped = [total[i] for i in self.present]
        else:
            unclipped = []
        return [clipped[i] for i in self.present], unclipped, loss, norm, finite

    def _apply(self, gradients):
        gradients = list(gradients)
        if self.factor is not None:  # the optimizer divides by its loss_scale_factor itself
            gradients = [scale_gradient(g, self.factor) for g in gradients]
        self.inner.apply(gradients, [self.variables[i] for i in self.present])

    @contextlib.contextmanager
    def _summed_gradients(self):
        """While tracing the update: tell the optimizer its gradients are summed already.

        Keras' TensorFlow optimizers all-reduce the gradients inside ``apply``; the step
        has summed them across replicas for the finiteness test, and a second all-reduce
        would double the traffic between devices or machines for the same numbers.
        """
        if not self.presummed:
            yield
            return
        with _tf_internals.optimizer_all_reduce_skipped(self.inner):
            yield

    def _grow_loss_scale(self):
        scaler = self.loss_scaler

        def double():
            scaler.step_counter.assign(0)
            scaler.dynamic_scale.assign(tf.convert_to_tensor(scaler.dynamic_scale) * 2.0)
            return tf.constant(True)

        def count():
            scaler.step_counter.assign_add(1)
            return tf.constant(False)

        counter = tf.convert_to_tensor(scaler.step_counter)
        tf.cond(tf.equal(counter, tf.cast(scaler.dynamic_growth_steps - 1, counter.dtype)), double, count)

    def _shrink_loss_scale(self):
        scaler = self.loss_scaler
        scaler.step_counter.assign(0)
        scaler.dynamic_scale.assign(tf.convert_to_tensor(scaler.dynamic_scale) * 0.5)

    def _step(self, batch):
        if self.loss_scaler is not None:
            scale = tf.identity(tf.convert_to_tensor(self.loss_scaler.dynamic_scale))
        else:
            scale = tf.constant(1.0, tf.float32)
        outputs = self.strategy.run(self._replica_step, args=(batch, scale))
        gradients, saved, unclipped = outputs[0], outputs[1], outputs[2]

        def first(value):
            return self.strategy.experimental_local_results(value)[0]

        loss, norm, finite = (first(v) for v in outputs[3:])
        nvars = len(self.variables)
        no_counts = (tf.zeros([nvars], tf.int64), tf.zeros([nvars], tf.int64))

        def count():
            # The NaN and Inf entries per variable: only skipped steps pay for them.
            total = [None] * nvars
            for i, g in zip(self.present, [first(g) for g in (unclipped or gradients)]):
                total[i] = g
            return nonfinite_counts(total)

        def apply():
            with self._summed_gradients():
                self.strategy.run(self.apply_fn, args=(gradients,))
            if self.loss_scaler is not None:
                self._grow_loss_scale()
            return no_counts

        def skip():
            for variable, value in zip(self.state, saved):
                restore(variable, self.strategy.experimental_local_results(value))
            if self.loss_scaler is not None:
                self._shrink_loss_scale()
            return count()

        if self.mode == "masked":
            with masked_writes(finite):
                self.strategy.run(self.apply_fn, args=(gradients,))
            for variable, value in zip(self.state, saved):
                variable.assign(tf.where(finite, tf.convert_to_tensor(variable), first(value)))
            nan_counts, inf_counts = tf.cond(finite, lambda: no_counts, count)
        elif self.guard:
            nan_counts, inf_counts = tf.cond(finite, apply, skip)
        else:
            apply()
            nan_counts, inf_counts = no_counts
        return loss, norm, finite, nan_counts, inf_counts, scale

    def _recorded_step(self, batch, consecutive):
        """One step, its record packed into three tensors, and the new consecutive count."""
        loss, norm, finite, nan_counts, inf_counts, scale = self._step(batch)
        scalars = tf.stack([loss, norm, tf.cast(finite, tf.float32), scale])
        counts = tf.stack([nan_counts, inf_counts])
        consecutive = tf.where(finite, tf.zeros_like(consecutive), consecutive + 1)
        return scalars, counts, consecutive

    # -- several steps per host call -----------------------------------------------------

    def _run(self, iterator, max_steps, consecutive, limit, *, known_length: bool):
        """Up to ``max_steps`` steps in a ``tf.while_loop``; records come back stacked.

        With a known number of batches per epoch the host never asks for more steps
        than remain, so the loop calls ``get_next`` directly; otherwise it uses
        ``get_next_as_optional`` and stops at the end of the data.
        """
        nvars = len(self.variables)

        def array(dtype, shape):
            return tf.TensorArray(dtype, size=0, dynamic_size=True, element_shape=shape)

        arrays = (array(tf.float32, [4]), array(tf.int64, [2, nvars]))

        def keep_going(i, done, consecutive, *arrays):
            return tf.logical_and(tf.logical_and(i < max_steps, tf.logical_not(done)), consecutive < limit)

        def step(i, consecutive, arrays, batch):
            scalars, counts, consecutive = self.step_fn(batch, consecutive)
            scalars_a, counts_a = arrays
            return (i + 1, tf.constant(False), consecutive, scalars_a.write(i, scalars), counts_a.write(i, counts))

        def body(i, done, consecutive, *arrays):
            if known_length:
                return step(i, consecutive, arrays, iterator.get_next())
            optional = iterator.get_next_as_optional()
            return tf.cond(
                optional.has_value(),
                lambda: step(i, consecutive, arrays, optional.get_value()),
                lambda: (i, tf.constant(True), consecutive) + tuple(arrays),
            )

        start = (tf.constant(0), tf.constant(False), consecutive)
        result = tf.while_loop(keep_going, body, start + arrays, parallel_iterations=1)
        steps, done, consecutive = result[:3]
        scalars = result[3].stack()
        skipped = tf.reshape(tf.where(scalars[:, 2] < 0.5), [-1])
        return {
            "steps": steps,
            "done": done,
            "consecutive": consecutive,
            "scalars": scalars,
            "skip_index": tf.cast(skipped, tf.int32),
            "counts": tf.gather(result[4].stack(), skipped),
        }


#: Compiled runners per model, so that calling ``train`` again does not recompile.
_RUNNERS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def model_cache(model) -> dict:
    try:
        return _RUNNERS.setdefault(model, {})
    except TypeError:  # not weak-referenceable or unhashable: no cache
        return {}


def loss_scale_wrapper(model, optimizer) -> keras.optimizers.LossScaleOptimizer:
    """The LossScaleOptimizer wrapping ``optimizer`` for ``model``, kept across calls."""
    cache = model_cache(model)
    key = ("loss_scale", id(optimizer))
    wrapper = cache.get(key)
    if wrapper is None or wrapper.inner_optimizer is not optimizer:
        wrapper = keras.optimizers.LossScaleOptimizer(optimizer)
        cache[key] = wrapper
    return wrapper


def runner_for(model, optimizer, strategy, *, jit, clip, guard, masked=True) -> Runner:
    """The cached :class:`Runner` for this set-up (a new one after ``compile`` made new metrics)."""
    key = (
        id(optimizer),
        id(strategy),
        bool(jit),
        clip,
        guard,
        masked,
        tuple(id(v) for v in model.trainable_variables),
        tuple(id(v) for v in model.non_trainable_variables),
        tuple(id(v) for v in model.metrics_variables),
    )
    cache = model_cache(model)
    if masked and cache.get(("unmaskable", id(optimizer))):
        return runner_for(model, optimizer, strategy, jit=jit, clip=clip, guard=guard, masked=False)
    runner = cache.get(key)
    if runner is None or (runner.optimizer, runner.strategy) != (optimizer, strategy):
        runner = Runner(model, optimizer, strategy, jit=jit, clip=clip, guard=guard, masked=masked)
        cache[key] = runner
    return runner
