"""A training loop that survives NaN, and an optimizer wrapper that does the same for ``fit``.

:func:`train` runs a Keras model over a ``tf.data.Dataset`` and checks, inside the
compiled step, that the loss and every gradient are finite. A step that fails the
check applies no update at all (weights, optimizer moments and iteration counter, and
the batch-normalisation statistics the forward pass touched all stay as they were) and
is recorded in the :class:`TrainingHistory`; too many in a row raise
:class:`NonFiniteError`. :class:`SkipNonFinite` gives ``model.fit`` users the same
skip guarantee. Under ``tf.distribute.MultiWorkerMirroredStrategy`` :func:`train` runs
on several machines; a worker that loses a peer raises :class:`WorkerLostError`.

How the check stays cheap
-------------------------
Every step is one XLA-compiled function: forward pass, gradients, their global norm,
optional clipping and the update. The finiteness test is the norm itself (a NaN or Inf
anywhere makes the sum of squares non-finite), so a good step pays for no extra pass
over the gradients. The update is not put under a conditional: every variable write of
``optimizer.apply`` (weights, moments, iteration counter) is traced as
``where(finite, new, old)``, which XLA fuses into the optimizer's element-wise update,
so a guarded step reads and writes each parameter and slot once, as an unguarded step
does. (A conditional update inside XLA makes XLA copy every variable and slot; a
conditional between two XLA functions costs a launch and a round trip of the gradients
through memory.) Per-variable NaN and Inf counts are computed in a branch that runs
only on skipped steps. If an optimizer's update holds something that cannot be masked
that way (a fused ``ResourceApply*`` kernel, a scatter, a conditional of its own), the
loop finds out while tracing, before any step runs, and puts the update under a
``tf.cond`` instead: inside the step's XLA function, or, from 2**20 parameters on, as
its own XLA function called from a graph-level ``tf.cond``.

Several steps run per host call: a ``tf.while_loop`` pulls batches from the dataset
iterator and writes each step's loss, gradient norm and finiteness into
``tf.TensorArray`` s, and stops early at the end of the epoch or when the consecutive
non-finite count reaches its limit. The host reads those arrays back once per call and
adapts the number of steps per call so that it syncs a few times per second (which is
also how often the progress bar moves; several workers agree on it, with one small
all-reduce per call, since their collective ops must match step for step). This is the
``steps_per_execution`` loop of Keras' own trainer, without a per-step
``TerminateOnNaN`` sync.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Iterable

import keras
import numpy as np
import tensorflow as tf

from companion.diagnostics import (
    GradientRecord,
    GradientReport,
    _gradient_values,
    _loss_value,
    _resolve_loss,
)

__all__ = ["NonFiniteError", "SkipNonFinite", "SkippedStep", "TrainingHistory", "WorkerLostError", "train"]

_ON_NONFINITE = ("skip", "raise")
#: Seconds of work per host call the loop aims for (progress-bar refresh interval).
_TARGET_SECONDS_PER_CALL = 0.2
_MAX_STEPS_PER_CALL = 1024
#: When the update cannot be masked: from this many trainable parameters on, it runs as its own XLA function
#: (see ``_Runner``): around 2**20 parameters the copy XLA makes of the variables and
#: optimizer slots around a conditional update costs about as much, on CPU, as one
#: more function launch per step.
_SPLIT_UPDATE_MIN_PARAMETERS = 2**20
#: A dynamic loss scale at or below this value no longer amplifies the gradients.
_STALLED_LOSS_SCALE = 1.0


# --------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------


class NonFiniteError(FloatingPointError):
    """Training stopped because of non-finite losses or gradients.

    Raised by :func:`train` at the first non-finite step when
    ``on_nonfinite="raise"``, or after ``max_consecutive_nonfinite`` consecutive
    non-finite steps when ``on_nonfinite="skip"``. None of these steps applied an
    update, so the model's weights and the optimizer's state are bit-identical to those
    after the last good step.

    Attributes:
        step: index (0-based, counted over all epochs) of the last non-finite step.
        epoch: index (0-based) of its epoch.
        reports: the :class:`SkippedStep` records of the consecutive non-finite steps.
        history: the :class:`TrainingHistory` up to and including ``step``.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        epoch: int,
        reports: tuple[SkippedStep, ...] = (),
        history: TrainingHistory | None = None,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.epoch = epoch
        self.reports = tuple(reports)
        self.history = history


@dataclasses.dataclass(frozen=True)
class SkippedStep:
    """One step whose loss or gradients were not finite, and that applied no update.

    Attributes:
        step: index of the step (0-based, counted over all epochs), i.e. its position
            in :attr:`TrainingHistory.step_loss`.
        epoch: index (0-based) of its epoch.
        loss: the step's loss (may itself be NaN or Inf).
        gradients: a :class:`~companion.diagnostics.GradientReport` of the variables
            whose gradient had NaN or Inf entries, with the counts; empty if only the
            loss was non-finite. Under a distribution strategy these are the
            gradients summed over replicas.
        loss_scale: the dynamic loss scale used in that step (mixed float16), else
            ``None``.
    """

    step: int
    epoch: int
    loss: float
    gradients: GradientReport
    loss_scale: float | None = None
    grad_norm: float | None = None

    def __str__(self) -> str:
        scale = f", loss scale {self.loss_scale:g}" if self.loss_scale is not None else ""
        return f"step {self.step} (epoch {self.epoch}): loss {self.loss:.6g}{scale}; {self.cause()}"

    def cause(self) -> str:
        """Why the step was skipped, in words."""
        if self.gradients:
            return "non-finite gradients: " + "; ".join(
                f"{r.path} ({r.nan_count} NaN, {r.inf_count} Inf of {_size(r.shape)})" for r in self.gradients
            )
        if self.grad_norm is not None and math.isinf(self.grad_norm) and math.isfinite(self.loss):
            return "all gradient entries finite, but their global norm overflows float32"
        return "non-finite loss; all gradients finite"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict (used by the checkpoint)."""
        return {
            "step": self.step,
            "epoch": self.epoch,
            "loss": self.loss,
            "loss_scale": self.loss_scale,
            "grad_norm": self.grad_norm,
            "gradients": [
                {field.name: getattr(r, field.name) for field in dataclasses.fields(r)} for r in self.gradients
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SkippedStep":
        """Inverse of :meth:`to_dict`."""
        records = [GradientRecord(**{**r, "shape": tuple(r["shape"])}) for r in data["gradients"]]
        return cls(
            step=int(data["step"]),
            epoch=int(data["epoch"]),
            loss=float(data["loss"]),
            gradients=GradientReport(records),
            loss_scale=data.get("loss_scale"),
            grad_norm=data.get("grad_norm"),
        )


def _size(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


@dataclasses.dataclass
class TrainingHistory:
    """What :func:`train` did, step by step.

    All step indices are 0-based and count over all epochs, so ``step_loss[i]`` and
    ``grad_norm[i]`` describe step ``i`` and ``skipped`` lists positions in them.

    Attributes:
        step_loss: the loss of every step, applied or skipped (a skipped step's loss
            may be NaN or Inf).
        grad_norm: the global gradient norm of every step, before clipping.
        skipped: indices of the steps that applied no update.
        reports: one :class:`SkippedStep` per skipped step: which variables had NaN or
            Inf gradients, and how many entries.
        epoch_loss: per completed epoch, the mean loss of its applied steps (NaN if
            none was applied).
        epoch_steps: per completed epoch, the number of steps.
        loss_scale: with dynamic loss scaling (a ``mixed_float16`` model, or a
            :class:`keras.optimizers.LossScaleOptimizer`), the loss scale used in each
            step; empty otherwise.
        loss_scale_stalled: ``True`` once the dynamic loss scale fell to 1 or below:
            the non-finite gradients were then not an overflow that a smaller scale can
            fix (a warning is issued at the same time).
        xla: whether the steps ran XLA-compiled (``None`` before the first step).
    """

    step_loss: list[float] = dataclasses.field(default_factory=list)
    grad_norm: list[float] = dataclasses.field(default_factory=list)
    skipped: list[int] = dataclasses.field(default_factory=list)
    reports: list[SkippedStep] = dataclasses.field(default_factory=list)
    epoch_loss: list[float] = dataclasses.field(default_factory=list)
    epoch_steps: list[int] = dataclasses.field(default_factory=list)
    loss_scale: list[float] = dataclasses.field(default_factory=list)
    loss_scale_stalled: bool = False
    xla: bool | None = None

    @property
    def steps(self) -> int:
        """Number of steps run (applied or skipped)."""
        return len(self.step_loss)

    @property
    def epochs(self) -> int:
        """Number of completed epochs."""
        return len(self.epoch_loss)

    def trailing_nonfinite(self) -> int:
        """Number of consecutive skipped steps at the end of the history."""
        count, expected = 0, self.steps - 1
        for index in reversed(self.skipped):
            if index != expected:
                break
            count, expected = count + 1, expected - 1
        return count

    def to_json(self) -> str:
        """The history as a JSON string (NaN and Inf are written as JavaScript literals)."""
        data = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        data["reports"] = [r.to_dict() for r in self.reports]
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> "TrainingHistory":
        """Inverse of :meth:`to_json`."""
        data = json.loads(text)
        data["reports"] = [SkippedStep.from_dict(r) for r in data["reports"]]
        return cls(**data)

    def __str__(self) -> str:
        last = f", last epoch loss {self.epoch_loss[-1]:.6g}" if self.epoch_loss else ""
        return f"TrainingHistory({self.epochs} epochs, {self.steps} steps, {len(self.skipped)} skipped{last})"


# --------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------


def _describe_spec(spec) -> str:
    if isinstance(spec, tf.TensorSpec):
        return f"a single tensor of shape {tuple(spec.shape)} and dtype {spec.dtype.name}"
    if isinstance(spec, dict):
        return f"a dict with keys {sorted(spec)}"
    if isinstance(spec, (tuple, list)):
        return f"a {type(spec).__name__} of {len(spec)} elements"
    return f"{type(spec).__name__}"


def _as_dataset(dataset) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of ``(inputs, targets)`` with a known, finite cardinality."""
    if isinstance(dataset, tf.data.Dataset):
        spec = dataset.element_spec
        if not (isinstance(spec, (tuple, list)) and len(spec) == 2):
            extra = ""
            if isinstance(spec, (tuple, list)) and len(spec) == 3:
                extra = " (sample weights are not supported: fold them into the loss)"
            raise TypeError(
                f"dataset must yield (inputs, targets) pairs, but its elements are {_describe_spec(spec)}{extra}; "
                "e.g. tf.data.Dataset.from_tensor_slices((x, y)).batch(32)"
            )
        cardinality = int(dataset.cardinality())
        if cardinality == 0:
            raise ValueError("dataset is empty: it yields no batch")
        if cardinality == tf.data.INFINITE_CARDINALITY:
            raise ValueError(
                "dataset is infinite (e.g. .repeat() without a count), so an epoch would never end; "
                "use .take(steps_per_epoch) or .repeat(n)"
            )
        return dataset
    if isinstance(dataset, (str, bytes, dict)) or not isinstance(dataset, Iterable):
        raise TypeError(
            "dataset must be a tf.data.Dataset or an iterable of (inputs, targets) batches, "
            f"got {type(dataset).__name__}"
        )
    batches = []
    for index, element in enumerate(dataset):
        if not (isinstance(element, (tuple, list)) and len(element) == 2):
            described = type(element).__name__
            if isinstance(element, (tuple, list)):
                described += f" of length {len(element)}"
            raise TypeError(f"dataset must yield (inputs, targets) pairs, but element {index} is a {described}")
        try:
            batches.append(tf.nest.map_structure(tf.convert_to_tensor, tuple(element)))
        except (TypeError, ValueError) as err:
            raise TypeError(f"element {index} of dataset cannot be converted to tensors: {err}") from None
    if not batches:
        raise ValueError("dataset is empty: it yields no batch")
    spec = tf.nest.map_structure(tf.type_spec_from_value, batches[0])
    for index, batch in enumerate(batches[1:], start=1):
        try:
            tf.nest.assert_same_structure(batches[0], batch)
            spec = tf.nest.map_structure(
                lambda s, t: s.most_specific_common_supertype([tf.type_spec_from_value(t)]), spec, batch
            )
        except (TypeError, ValueError) as err:
            raise TypeError(f"element {index} of dataset does not have the structure of element 0: {err}") from None
        if any(s is None for s in tf.nest.flatten(spec)):
            raise TypeError(f"element {index} of dataset has a different dtype from element 0")
    result = tf.data.Dataset.from_generator(lambda: iter(batches), output_signature=spec)
    return result.apply(tf.data.experimental.assert_cardinality(len(batches)))


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _flatten_layers(model) -> list:
    flatten = getattr(model, "_flatten_layers", None)
    if flatten is None:
        return [model]
    try:
        return list(flatten(include_self=True, recursive=True))
    except TypeError:  # pragma: no cover - older signature
        return list(flatten())


def _uses_float16(model) -> bool:
    for layer in _flatten_layers(model):
        policy = getattr(layer, "dtype_policy", None)
        if policy is not None and getattr(policy, "compute_dtype", None) == "float16":
            return True
    return False


def _build_model(model, spec) -> None:
    """Create the model's variables from the dataset's element spec, without running it."""
    inputs = tf.nest.map_structure(lambda s: keras.KerasTensor(s.shape, dtype=s.dtype.name), spec)
    model(inputs)


def _optimizer_knows(optimizer, variables) -> bool:
    known = getattr(optimizer, "_trainable_variables", None)
    if known is None:
        return True
    ids = {id(v) for v in known}
    return all(id(v) in ids for v in variables)


# --------------------------------------------------------------------------------------
# The compiled step and loop
# --------------------------------------------------------------------------------------


def _scale_gradient(gradient, factor):
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            gradient.values * tf.cast(factor, gradient.values.dtype), gradient.indices, gradient.dense_shape
        )
    return gradient * tf.cast(factor, gradient.dtype)


def _global_norm(gradients) -> tf.Tensor:
    squares = [
        tf.reduce_sum(tf.square(tf.cast(_gradient_values(g), tf.float32))) for g in gradients if g is not None
    ]
    if not squares:
        return tf.constant(0.0, tf.float32)
    return tf.sqrt(tf.add_n(squares))


def _batch_size(targets) -> tf.Tensor:
    """The number of examples in a batch (the leading dimension of its targets), as float32."""
    return tf.cast(tf.shape(tf.nest.flatten(targets)[0])[0], tf.float32)


def _restore(variable, values) -> None:
    """Assign each replica's copy of ``variable`` its own saved value (cross-replica context)."""
    tf_variable = getattr(variable, "value", variable)
    components = getattr(tf_variable, "values", None)
    if components is not None and len(components) == len(values):
        for component, value in zip(components, values):
            component.assign(value)
    else:
        variable.assign(values[0])


def _nonfinite_counts(gradients) -> tuple[tf.Tensor, tf.Tensor]:
    """NaN and Inf counts per gradient (``None`` counts 0), as two int64 vectors."""
    nan_counts, inf_counts = [], []
    for gradient in gradients:
        if gradient is None:
            nan_counts.append(tf.constant(0, tf.int64))
            inf_counts.append(tf.constant(0, tf.int64))
            continue
        values = _gradient_values(gradient)
        nan = tf.reduce_sum(tf.cast(tf.math.is_nan(values), tf.int32))
        nonfinite = tf.reduce_sum(tf.cast(tf.logical_not(tf.math.is_finite(values)), tf.int32))
        nan_counts.append(tf.cast(nan, tf.int64))
        inf_counts.append(tf.cast(nonfinite - nan, tf.int64))
    return tf.stack(nan_counts), tf.stack(inf_counts)


def _all_finite(gradients) -> tf.Tensor:
    flags = [tf.reduce_all(tf.math.is_finite(_gradient_values(g))) for g in gradients if g is not None]
    if not flags:
        return tf.constant(True)
    return tf.reduce_all(tf.stack(flags))


# --------------------------------------------------------------------------------------
# Masked writes: an update that is applied or not without a conditional
# --------------------------------------------------------------------------------------


class _UnmaskableUpdate(Exception):
    """The optimizer's update wrote state in a way ``_masked_writes`` cannot mask."""


#: Stateful ops an update traced under ``_masked_writes`` may contain: reads, and the
#: masked assignments the context emits itself (each one counted). Anything else, a
#: variable created during the update included, makes the loop use a conditional update.
_MASKABLE_STATEFUL_OPS = frozenset({"ReadVariableOp", "AssignVariableOp"})


class _masked_writes:
    """Trace-time context: every resource-variable write becomes ``where(keep, new, old)``.

    While it is active (in the thread that entered it), ``assign``, ``assign_add`` and
    ``assign_sub`` of any ``tf.Variable`` are traced as one ``AssignVariableOp`` of
    ``tf.where(apply, new_value, old_value)``, where ``new_value`` is computed exactly as
    the original op computes it (``old + delta`` for ``assign_add``). When ``apply`` is
    false every variable is written its own old value, bit for bit; when it is true the
    update is the one the optimizer asked for. Under XLA the select fuses into the
    optimizer's element-wise update, so a guarded step reads and writes each variable
    and slot once, as an unguarded one does, where a conditional update makes XLA copy
    them all.

    On exit, the ops traced inside the context are checked: any stateful op other than
    reads and the masked assignments themselves (a scatter, a fused ``ResourceApply*``
    kernel, a nested conditional or function call, a random-number generator) raises
    :class:`_UnmaskableUpdate`, and the caller falls back to a conditional update.
    """

    _WRITERS = ("assign_variable_op", "assign_add_variable_op", "assign_sub_variable_op")

    def __init__(self, apply: tf.Tensor) -> None:
        self.apply = apply
        self.count = 0

    def __enter__(self) -> "_masked_writes":
        from tensorflow.python.ops import gen_resource_variable_ops as gen

        self._gen = gen
        self._owner = threading.get_ident()
        self._originals = {name: getattr(gen, name) for name in self._WRITERS}
        read, assign = gen.read_variable_op, self._originals["assign_variable_op"]

        def wrap(name, combine):
            original = self._originals[name]

            def masked(resource, value, *args, **kwargs):
                if threading.get_ident() != self._owner:
                    return original(resource, value, *args, **kwargs)
                old = read(resource, value.dtype)
                self.count += 1
                return assign(resource, tf.where(self.apply, combine(old, value), old), *args, **kwargs)

            return masked

        patches = {
            "assign_variable_op": wrap("assign_variable_op", lambda old, value: value),
            "assign_add_variable_op": wrap("assign_add_variable_op", lambda old, value: old + value),
            "assign_sub_variable_op": wrap("assign_sub_variable_op", lambda old, value: old - value),
        }
        self._graph = tf.compat.v1.get_default_graph()
        self._first_op = len(self._graph.get_operations())
        for name, patch in patches.items():
            setattr(gen, name, patch)
        return self

    def __exit__(self, kind, error, trace) -> None:
        for name, original in self._originals.items():
            setattr(self._gen, name, original)
        if kind is not None:
            return
        traced = self._graph.get_operations()[self._first_op :]
        stateful = [op for op in traced if op.op_def is not None and op.op_def.is_stateful]
        foreign = sorted({op.type for op in stateful if op.type not in _MASKABLE_STATEFUL_OPS})
        assigns = sum(op.type == "AssignVariableOp" for op in stateful)
        if foreign or assigns != self.count:
            raise _UnmaskableUpdate(
                f"the update contains {', '.join(foreign) or 'unmasked assignments'}"
            )


class _Runner:
    """The traced and compiled functions of one (model, loss, optimizer, strategy) setup."""

    def __init__(
        self, model, loss, optimizer, strategy, *, jit: bool, clip: float | None, guard: bool, masked: bool = True
    ) -> None:
        self._model = weakref.ref(model)
        self.loss = loss
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
        self.presummed = self.replicas > 1 and callable(
            getattr(type(self.inner), "_all_reduce_sum_gradients", None)
        )
        # Variables the forward pass may change (batch-norm statistics, dropout seeds):
        # restored on a skipped step.
        self.state = list(model.non_trainable_variables) if guard else []
        self.present: list[int] | None = None
        self.verified = False  # one call has run without error
        self.steps_per_call = 1
        # How the step is compiled (the results are the same, only the speed differs):
        # "masked": one XLA function per step; every write of the update is a select
        #     between the new and the old value (see _masked_writes), which XLA fuses
        #     into the update itself. The default.
        # "whole": one XLA function per step, the update under a conditional inside
        #     it; XLA copies the variables and optimizer slots around it, a cost
        #     proportional to the number of parameters. Used when the update cannot
        #     be masked (or with loss scaling, whose scale updates are conditional).
        # "split": as "whole" from 2**20 parameters on: two XLA functions per step,
        #     (forward, backward, test) and (update), with the conditional between
        #     them in the TensorFlow graph, where the update is in place.
        # "graph": several replicas (the all-reduce and the cross-replica conditional,
        #     which uses merge_call, stay in the graph; the forward and backward pass
        #     are compiled), or jit_compile=False.
        parameters = sum(int(np.prod(v.shape)) for v in self.variables)
        if not self.jit:
            self.mode = "graph"
        elif self.replicas > 1:
            self.mode = "graph"
        elif guard and masked and self.loss_scaler is None:
            self.mode = "masked"
        elif guard and parameters >= _SPLIT_UPDATE_MIN_PARAMETERS:
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

    def _forward(self, x, y, scale):
        model = self._model()
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            value = _loss_value(self.loss, y, y_pred)
            if model.losses:
                value = value + tf.cast(tf.add_n(model.losses), tf.float32)
            if self.replicas > 1:
                # This replica's share of the batch mean: its examples' total, which
                # _compute divides by the global batch size (replicas may get unequal
                # parts of a batch, or an empty one at the end of a worker's data).
                count = _batch_size(y)
                local = tf.where(count > 0, value * count, tf.zeros_like(value))
            else:
                local = value
            scaled = local * scale if self.loss_scaler is not None else local
        gradients = tape.gradient(scaled, self.variables)
        if self.loss_scaler is not None:
            gradients = [_scale_gradient(g, 1.0 / scale) for g in gradients]
        return local, gradients

    def _replica_step(self, batch, scale):
        # This replica's copy of the state the forward pass may change.
        saved = [tf.identity(tf.convert_to_tensor(v)) for v in self.state]
        outputs = self.compute_fn(batch, scale)
        return (outputs[0], saved) + tuple(outputs[1:])

    def _compute(self, batch, scale):
        """Loss, gradients (summed over replicas), their norm, the finiteness test, clipping."""
        x, y = batch
        loss, gradients = self.forward_fn(x, y, scale)
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
            gradients = total if self.presummed else [_scale_gradient(g, inverse) for g in gradients]
        else:
            total = gradients
        norm = _global_norm(total)
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
            clipped = [_scale_gradient(g, factor) for g in gradients]
        # The skipped branch counts NaN and Inf entries in the (summed, unclipped)
        # gradients; without clipping and with one replica those are the same tensors.
        if self.guard and (self.clip is not None or (self.replicas > 1 and not self.presummed)):
            unclipped = [total[i] for i in self.present]
        else:
            unclipped = []
        return [clipped[i] for i in self.present], unclipped, loss, norm, finite

    def _apply(self, gradients):
        self.inner.apply(list(gradients), [self.variables[i] for i in self.present])

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
        self.inner._all_reduce_sum_gradients = list  # the pairs, unchanged
        try:
            yield
        finally:
            del self.inner._all_reduce_sum_gradients

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
            return _nonfinite_counts(total)

        def apply():
            with self._summed_gradients():
                self.strategy.run(self.apply_fn, args=(gradients,))
            if self.loss_scaler is not None:
                self._grow_loss_scale()
            return no_counts

        def skip():
            for variable, value in zip(self.state, saved):
                _restore(variable, self.strategy.experimental_local_results(value))
            if self.loss_scaler is not None:
                self._shrink_loss_scale()
            return count()

        if self.mode == "masked":
            with _masked_writes(finite):
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


def _model_cache(model) -> dict:
    try:
        return _RUNNERS.setdefault(model, {})
    except TypeError:  # not weak-referenceable or unhashable: no cache
        return {}


def _loss_scale_wrapper(model, optimizer) -> keras.optimizers.LossScaleOptimizer:
    """The LossScaleOptimizer wrapping ``optimizer`` for ``model``, kept across calls."""
    cache = _model_cache(model)
    key = ("loss_scale", id(optimizer))
    wrapper = cache.get(key)
    if wrapper is None or wrapper.inner_optimizer is not optimizer:
        wrapper = keras.optimizers.LossScaleOptimizer(optimizer)
        cache[key] = wrapper
    return wrapper


def _runner_for(model, loss, optimizer, strategy, *, jit, clip, guard, masked=True) -> _Runner:
    key = (
        id(loss),
        id(optimizer),
        id(strategy),
        bool(jit),
        clip,
        guard,
        masked,
        tuple(id(v) for v in model.trainable_variables),
        tuple(id(v) for v in model.non_trainable_variables),
    )
    cache = _model_cache(model)
    if masked and cache.get(("unmaskable", id(optimizer))):
        return _runner_for(model, loss, optimizer, strategy, jit=jit, clip=clip, guard=guard, masked=False)
    runner = cache.get(key)
    if runner is None or (runner.loss, runner.optimizer, runner.strategy) != (loss, optimizer, strategy):
        runner = _Runner(model, loss, optimizer, strategy, jit=jit, clip=clip, guard=guard, masked=masked)
        cache[key] = runner
    return runner


def _xla_failure_summary(error: Exception) -> str:
    text = str(error)
    unsupported = re.search(r"on XLA_\w+_JIT: ([\w, ]+)", text)
    if unsupported:
        return f"no XLA kernel for {unsupported.group(1).strip()}"
    for line in text.splitlines():
        if "XLA" in line or "compile" in line:
            return line.strip()[:300]
    return text.strip().splitlines()[0][:300] if text.strip() else type(error).__name__


def _looks_like_xla_failure(error: Exception) -> bool:
    text = str(error)
    markers = ("_XlaMustCompile", "XLA_CPU_JIT", "XLA_GPU_JIT", "XLA_TPU_JIT", "could not be compiled", "XlaCompile")
    return any(marker in text for marker in markers)


# --------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------


class _LoopState(tf.train.experimental.PythonState):
    """The loop's own state in the checkpoint: completed epochs and the history (as JSON)."""

    def __init__(self) -> None:
        self.epochs_done = 0
        self.history = TrainingHistory()

    def serialize(self) -> str:
        return json.dumps({"epochs_done": self.epochs_done, "history": self.history.to_json()})

    def deserialize(self, string) -> None:
        data = json.loads(string.decode() if isinstance(string, bytes) else string)
        self.epochs_done = int(data["epochs_done"])
        self.history = TrainingHistory.from_json(data["history"])


class _TrainingCheckpoint:
    """Model, optimizer, completed-epoch counter and history, saved at epoch ends.

    A ``tf.train.Checkpoint`` with the children ``model``, ``optimizer`` (the loss-scale
    wrapper, if any, with the inner optimizer inside), ``model_variables`` (every model
    variable by position, including those Keras does not expose to
    ``tf.train.Checkpoint``, such as the seed-generator state of ``Dropout``) and
    ``loop`` (completed epochs and the :class:`TrainingHistory` as JSON), managed by a
    ``tf.train.CheckpointManager`` that keeps the last two.
    """

    def __init__(self, directory, model, optimizer, cluster: "_Cluster | None" = None) -> None:
        self.directory = os.fspath(directory)
        # Under a multi-worker strategy every worker saves (saving may run collective
        # ops), but only the chief writes to ``directory``; the others write to a
        # directory of their own, deleted after each save (as TensorFlow's multi-worker
        # tutorial does). Every worker restores from ``directory``.
        self.scratch = None
        if cluster is not None and not cluster.is_chief:
            self.scratch = os.path.join(self.directory, f".worker-{cluster.task_id}-tmp")
            _remove_tree(self.scratch)  # left by a worker that died while saving
        self.loop = _LoopState()
        self.checkpoint = tf.train.Checkpoint(
            model=model,
            optimizer=optimizer,
            model_variables=list(model.variables),
            loop=self.loop,
        )
        self.manager = tf.train.CheckpointManager(self.checkpoint, self.directory, max_to_keep=2)

    def restore(self) -> tuple[int, TrainingHistory] | None:
        path = self.manager.latest_checkpoint
        if path is None:
            return None
        try:
            status = self.checkpoint.restore(path)
            status.expect_partial()  # no deletion-time warnings if it does not match
            status.assert_existing_objects_matched()
        except (AssertionError, ValueError, tf.errors.OpError) as err:
            raise ValueError(
                f"the checkpoint in {self.directory!r} does not match this model and optimizer ({err}); "
                "use another checkpoint_dir or the model and optimizer it was written for"
            ) from None
        return self.loop.epochs_done, self.loop.history

    def save(self, epochs_done: int, history: TrainingHistory) -> None:
        self.loop.epochs_done = epochs_done
        self.loop.history = history
        if self.scratch is None:
            self.manager.save(checkpoint_number=epochs_done)
        else:
            tf.train.CheckpointManager(self.checkpoint, self.scratch, max_to_keep=1).save(checkpoint_number=epochs_done)
            _remove_tree(self.scratch)

    @property
    def latest(self) -> str | None:
        """Path prefix of the latest checkpoint in the directory, if any."""
        return self.manager.latest_checkpoint


def _remove_tree(path: str) -> None:
    if tf.io.gfile.exists(path):
        tf.io.gfile.rmtree(path)


# --------------------------------------------------------------------------------------
# Several workers: MultiWorkerMirroredStrategy
# --------------------------------------------------------------------------------------


class WorkerLostError(RuntimeError):
    """A worker of a multi-worker run lost a peer, so training stopped on this worker.

    Raised by :func:`train` under ``tf.distribute.MultiWorkerMirroredStrategy`` when a
    collective operation fails because another worker crashed, was stopped, became
    unreachable, or did not reach the collective within the strategy's collective
    timeout. TensorFlow then aborts every collective op of the process, so it cannot go
    on: restart all workers. With ``checkpoint_dir`` they resume after the last
    completed epoch; a failure during an epoch does not touch the checkpoints already
    written.

    Attributes:
        task: this worker's task, e.g. ``"worker 1"``.
        peers: the tasks TensorFlow named as the cause, e.g. ``("/job:worker/replica:0/task:0",)``
            (empty if it did not say, as for a timeout).
        epoch: index (0-based) of the epoch that was running.
        checkpoint: the latest checkpoint in ``checkpoint_dir`` (where a restart resumes),
            or ``None``.
        history: the :class:`TrainingHistory` up to the last steps that completed.
    """

    def __init__(
        self,
        message: str,
        *,
        task: str,
        peers: tuple[str, ...],
        epoch: int,
        checkpoint: str | None,
        history: TrainingHistory,
    ) -> None:
        super().__init__(message)
        self.task = task
        self.peers = tuple(peers)
        self.epoch = epoch
        self.checkpoint = checkpoint
        self.history = history


def _error_summary(text: str) -> str:
    """The line of a TensorFlow error message that says what happened."""
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", text)
    aborted = re.search(r"Collective ops is aborted by: (.+)", text)
    if aborted:
        return aborted.group(1).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if re.search(r"unhealthy|timed out|reset by peer|refused|Socket closed|is down|unavailable", line, re.I):
            return line
    return lines[0] if lines else ""


#: Errors a collective op raises when a peer is gone (crashed, unreachable, timed out).
_PEER_FAILURES = (
    tf.errors.UnavailableError,
    tf.errors.DeadlineExceededError,
    tf.errors.CancelledError,
    tf.errors.AbortedError,
)


class _Cluster:
    """The workers of a multi-worker strategy, as :func:`train` sees them."""

    def __init__(self, strategy: tf.distribute.Strategy) -> None:
        resolver = strategy.cluster_resolver
        self.strategy = strategy
        self.task_type = resolver.task_type
        self.task_id = int(resolver.task_id)
        spec = resolver.cluster_spec()
        self.workers = sum(spec.num_tasks(job) for job in spec.jobs if job in ("chief", "worker"))
        self.is_chief = bool(strategy.extended.should_checkpoint)
        self._gather = None

    @classmethod
    def of(cls, strategy: tf.distribute.Strategy) -> "_Cluster | None":
        """The cluster of ``strategy``, or ``None`` if it runs in this process only."""
        in_multi_worker_mode = getattr(strategy.extended, "_in_multi_worker_mode", None)
        if in_multi_worker_mode is None or not in_multi_worker_mode():
            return None
        return cls(strategy)

    @property
    def task(self) -> str:
        return f"{self.task_type} {self.task_id}"

    def gather(self, *values: float) -> np.ndarray:
        """``values`` of every replica, one row per replica (one small all-reduce)."""
        if self._gather is None:

            def gather(value):
                # An all-reduce of one row per replica, zeros elsewhere: exact, and it
                # works on values that live on no particular device, unlike all_gather.
                context = tf.distribute.get_replica_context()
                rows = tf.one_hot(context.replica_id_in_sync_group, context.num_replicas_in_sync)[:, None]
                return context.all_reduce(tf.distribute.ReduceOp.SUM, rows * value[None, :])

            self._gather = tf.function(lambda value: self.strategy.run(gather, args=(value,)), autograph=False)
        result = self._gather(tf.constant(values, tf.float32))
        return self.strategy.experimental_local_results(result)[0].numpy()

    def lost(self, error: Exception, epoch: int, history: TrainingHistory, checkpoint) -> WorkerLostError:
        """The :class:`WorkerLostError` for a collective that failed with ``error``."""
        text = str(error)
        peers = tuple(dict.fromkeys(re.findall(r"/job:\w+/replica:\d+/task:\d+", text)))
        if isinstance(error, tf.errors.DeadlineExceededError) or "timed out" in text:
            cause = (
                "a collective operation timed out (the timeout_seconds of the strategy's communication_options): "
                "a peer is gone or stuck"
            )
        elif "heartbeat" in text:
            cause = f"the coordination service stopped receiving heartbeats from {', '.join(peers) or 'a peer'}"
        else:
            cause = f"{', '.join(peers) or 'a peer'} is unreachable"
        latest = checkpoint.latest if checkpoint is not None else None
        if latest is not None:
            resume = (
                f"restart all workers with the same checkpoint_dir to resume from {latest!r} "
                f"(after epoch {int(latest.rsplit('-', 1)[-1])})"
            )
        elif checkpoint is not None:
            resume = "restart all workers; no epoch had completed, so training starts again from the beginning"
        else:
            resume = "restart all workers (pass checkpoint_dir to resume after the last completed epoch)"
        first_line = _error_summary(text) or type(error).__name__
        return WorkerLostError(
            f"{self.task} of {self.workers} lost a peer during epoch {epoch + 1}: {cause} "
            f"({type(error).__name__}: {first_line[:300]}). TensorFlow aborted this process's collective "
            f"operations, so training cannot continue here; {resume}.",
            task=self.task,
            peers=peers,
            epoch=epoch,
            checkpoint=latest,
            history=history,
        )


# --------------------------------------------------------------------------------------
# train
# --------------------------------------------------------------------------------------


def train(
    model: keras.layers.Layer,
    dataset: tf.data.Dataset | Iterable[tuple[Any, Any]],
    *,
    loss: Callable | str,
    optimizer: keras.optimizers.Optimizer,
    epochs: int = 1,
    strategy: tf.distribute.Strategy | None = None,
    jit_compile: bool = True,
    clip_global_norm: float | None = None,
    on_nonfinite: str = "skip",
    max_consecutive_nonfinite: int = 10,
    checkpoint_dir: str | os.PathLike | None = None,
    verbose: int = 1,
) -> TrainingHistory:
    """Train ``model`` on ``dataset``, skipping every step whose loss or gradients are not finite.

    Each step computes ``loss(targets, model(inputs, training=True))`` (averaged over
    the batch, plus ``model.losses``), its gradients, their global norm, and whether the
    loss and all gradients are finite. Inside the same compiled function, a ``tf.cond``
    then either applies the (optionally clipped) gradients with ``optimizer`` or, for a
    non-finite step, applies nothing: the weights, the optimizer's moments and its
    iteration counter, and the model variables the forward pass changed (batch-norm
    statistics, dropout seed state) keep their exact previous values. There is no host
    round-trip per step (see the module documentation). The test is made on the global
    gradient norm, which is NaN or Inf as soon as one entry is; a step whose entries are
    all finite but whose norm overflows float32 (above ~1.8e19) is skipped as well, and
    its report says so.

    Distribution: under a ``tf.distribute`` strategy each replica computes its
    gradients, they are summed across replicas with an all-reduce, and the finiteness
    test is made on the sum, so a NaN on any replica skips the step on all of them.
    The model and optimizer must be created under ``strategy.scope()``. ``dataset``
    yields *global* batches, which the strategy splits between the replicas; the loss
    is the mean over the global batch even when the parts are unequal (a batch of 8 on
    3 replicas is split 3 + 3 + 2).

    Several machines: under ``tf.distribute.MultiWorkerMirroredStrategy`` every worker
    runs the same script (``TF_CONFIG`` tells it the cluster and its own index; see
    :mod:`companion.launch`) and calls ``train`` with the same arguments. The skip
    decision, the history and the weights are then identical on every worker, and
    ``NonFiniteError`` is raised on all of them. The dataset is sharded by
    ``tf.data``'s auto-shard policy (``AUTO``: by file if the dataset reads files, else
    by data, in which each worker reads every batch and keeps its part of it; set
    ``tf.data.Options().experimental_distribute.auto_shard_policy`` to choose). With a
    known number of batches every worker runs that many steps per epoch. Only the chief
    (worker 0) shows a progress bar and writes ``checkpoint_dir``; the other workers
    save to a directory of their own inside it, deleted right after (saving may run
    collective ops, so all workers must take part), and every worker restores from
    ``checkpoint_dir``, which must therefore be visible to all of them (a shared file
    system or bucket). If a peer dies or stops responding, the collective op that waits
    for it fails (the coordination service notices a crashed worker within about ten
    seconds; ``tf.distribute.experimental.CommunicationOptions(timeout_seconds=...)``
    bounds how long any collective may wait, and must then be longer than the longest
    pause of a worker between two steps, such as the first step's compilation or a
    checkpoint), and ``train`` raises :class:`WorkerLostError` on every surviving
    worker; the checkpoints already written are intact.

    XLA: with one replica the whole step is one XLA function, the update included: each
    of its writes selects between the new and the old value, so a skipped step writes
    back what was there (an optimizer whose update cannot be written so gets a
    conditional update instead, see the module's docstring); with several replicas the
    forward and backward pass are compiled (the all-reduce and the conditional update
    run as a TensorFlow graph). If compilation
    fails (an op without an XLA kernel, such as ``tf.py_function``), the first step is
    rerun without XLA and a warning says so; ``history.xla`` tells which way it ran.

    Mixed precision: if the model computes in float16 (``mixed_float16`` policy),
    ``optimizer`` is wrapped in :class:`keras.optimizers.LossScaleOptimizer` unless it
    already is one. A step that overflows is skipped like any other non-finite step,
    but it halves the loss scale (the only optimizer state that changes); every
    ``dynamic_growth_steps`` good steps double it. If the scale falls to 1 or below, a
    warning is issued and ``history.loss_scale_stalled`` is set: the NaNs then do not
    come from float16 overflow. ``mixed_bfloat16`` needs no loss scaling. The wrapper
    is kept with the model, so the loss scale carries over to the next call.

    Checkpoints: with ``checkpoint_dir``, a ``tf.train.Checkpoint`` is written at the
    end of every epoch (the last two are kept) with the children ``model``,
    ``optimizer``, ``model_variables`` (every model variable, including dropout seed
    states that Keras does not expose to ``tf.train.Checkpoint``) and ``loop`` (the
    number of completed epochs and the history, as JSON). Calling ``train`` again with
    the same directory restores the latest one and continues from the next epoch, so an
    interrupted run that is resumed ends with the same weights as an uninterrupted one
    (bit for bit on CPU), provided the dataset yields the same batches for the same
    epoch: a ``shuffle`` with ``reshuffle_each_iteration=True`` draws its order from
    how often the dataset object was iterated, which a new process does not know.
    ``epochs`` counts all epochs, including restored ones.

    Args:
        model: a Keras model (any :class:`keras.layers.Layer` with trainable
            variables). An unbuilt model is built from the dataset's element spec.
        dataset: a ``tf.data.Dataset`` yielding ``(inputs, targets)`` batches, or any
            finite iterable of such pairs (NumPy arrays or tensors; it is read once and
            kept in memory).
        loss: ``loss(y_true, y_pred)``: any callable returning a scalar or one value
            per example, a :class:`keras.losses.Loss`, or a Keras loss name like
            ``"mse"``. Half-precision predictions are cast to float32 first.
        optimizer: a :class:`keras.optimizers.Optimizer`. It is built on the model's
            trainable variables if it is not built yet.
        epochs: total number of passes over ``dataset``, >= 1.
        strategy: a ``tf.distribute.Strategy``; default: the model's strategy (the one
            whose scope it was created in), else the current one.
        jit_compile: compile the step with XLA.
        clip_global_norm: if given (> 0), finite gradients are rescaled so that their
            global norm is at most this value (:func:`tf.clip_by_global_norm`
            semantics). Non-finite gradients are never clipped, as clipping would
            spread one NaN to every variable.
        on_nonfinite: ``"skip"`` (skip the step and go on) or ``"raise"`` (raise
            :class:`NonFiniteError` at the first non-finite step, which is not
            applied either).
        max_consecutive_nonfinite: with ``"skip"``, raise :class:`NonFiniteError` after
            this many consecutive skipped steps (>= 1). The steps of one host call stop
            right there, so the weights are exactly those of the last good step.
        checkpoint_dir: directory for epoch-end checkpoints, or ``None``.
        verbose: 0 prints nothing, 1 shows a :class:`keras.utils.Progbar` per epoch,
            2 prints one line per epoch (on the chief only, with several workers).

    Returns:
        A :class:`TrainingHistory` with the loss, gradient norm and finiteness of every
        step and a report per skipped step.

    Raises:
        TypeError: if ``model`` is not a Keras layer/model, ``optimizer`` is not a
            Keras optimizer, ``loss`` is not callable, an argument has the wrong type,
            or ``dataset`` does not yield ``(inputs, targets)`` pairs.
        ValueError: if an argument is out of range (``epochs <= 0``, unknown
            ``on_nonfinite``, ...), the dataset is empty or infinite, predictions and
            targets have incompatible shapes or the loss does not return a scalar or a
            per-example value, the model has no trainable variables or was not created
            under the strategy's scope, or ``checkpoint_dir`` holds a checkpoint of
            another model. All of these are raised before any step runs.
        NonFiniteError: see ``on_nonfinite`` and ``max_consecutive_nonfinite``.
        WorkerLostError: under a multi-worker strategy, when another worker crashed or
            stopped responding (see *Several machines* above).

    Example:
        >>> model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        >>> x = np.array([[1.0], [2.0], [np.nan], [4.0]], "float32")
        >>> data = tf.data.Dataset.from_tensor_slices((x, 2 * x)).batch(1)
        >>> history = train(model, data, loss="mse", optimizer=keras.optimizers.SGD(0.01),
        ...                 epochs=2, verbose=0)
        >>> history.skipped
        [2, 6]
    """
    return _train(
        model,
        dataset,
        loss=loss,
        optimizer=optimizer,
        epochs=epochs,
        strategy=strategy,
        jit_compile=jit_compile,
        clip_global_norm=clip_global_norm,
        on_nonfinite=on_nonfinite,
        max_consecutive_nonfinite=max_consecutive_nonfinite,
        checkpoint_dir=checkpoint_dir,
        verbose=verbose,
    )


def _train(
    model,
    dataset,
    *,
    loss,
    optimizer,
    epochs=1,
    strategy=None,
    jit_compile=True,
    clip_global_norm=None,
    on_nonfinite="skip",
    max_consecutive_nonfinite=10,
    checkpoint_dir=None,
    verbose=1,
    guard: bool = True,
) -> TrainingHistory:
    """:func:`train`, with ``guard=False`` to switch the finiteness check off (benchmarks only)."""
    # ---- arguments, before anything runs -------------------------------------------------
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"model must be a Keras model (keras.Model or keras.layers.Layer), got {type(model).__name__}")
    loss = _resolve_loss(loss)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        hint = ""
        if isinstance(optimizer, str):
            hint = " (a name like 'adam' is not accepted: pass keras.optimizers.Adam())"
        raise TypeError(
            f"optimizer must be a Keras optimizer (an instance of keras.optimizers.Optimizer), "
            f"got {type(optimizer).__module__}.{type(optimizer).__name__}{hint}"
        )
    if isinstance(optimizer, SkipNonFinite):
        optimizer = optimizer.inner_optimizer  # train() guards by itself
    epochs = _check_int("epochs", epochs, 1)
    max_consecutive_nonfinite = _check_int("max_consecutive_nonfinite", max_consecutive_nonfinite, 1)
    if not isinstance(on_nonfinite, str) or on_nonfinite not in _ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {_ON_NONFINITE}, got {on_nonfinite!r}")
    if clip_global_norm is not None:
        if isinstance(clip_global_norm, bool) or not isinstance(
            clip_global_norm, (int, float, np.floating, np.integer)
        ):
            raise TypeError(
                f"clip_global_norm must be a positive number or None, got {type(clip_global_norm).__name__}"
            )
        clip_global_norm = float(clip_global_norm)
        if not (math.isfinite(clip_global_norm) and clip_global_norm > 0):
            raise ValueError(f"clip_global_norm must be a finite number > 0, got {clip_global_norm}")
    if not isinstance(jit_compile, bool):
        raise TypeError(f"jit_compile must be True or False, got {jit_compile!r}")
    if isinstance(verbose, bool) or verbose not in (0, 1, 2):
        raise ValueError(f"verbose must be 0, 1 or 2, got {verbose!r}")
    if strategy is not None and not isinstance(strategy, tf.distribute.Strategy):
        raise TypeError(f"strategy must be a tf.distribute.Strategy or None, got {type(strategy).__name__}")
    if checkpoint_dir is not None and not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise TypeError(
            f"checkpoint_dir must be a path (str or os.PathLike) or None, got {type(checkpoint_dir).__name__}"
        )
    dataset = _as_dataset(dataset)

    # ---- model, strategy, optimizer ------------------------------------------------------
    if strategy is None:
        strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
    with strategy.scope():
        if not model.built:
            _build_model(model, dataset.element_spec[0])
        if not model.trainable_variables:
            raise ValueError(f"model {model.name!r} has no trainable variables")
        if strategy.num_replicas_in_sync > 1:
            outside = [v.path for v in model.variables if not strategy.extended.variable_created_in_scope(v.value)]
            if outside:
                raise ValueError(
                    f"the model's variables (e.g. {outside[0]!r}) were not created under the strategy's scope; "
                    "create the model and the optimizer inside `with strategy.scope():`"
                )
        if _uses_float16(model) and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            optimizer = _loss_scale_wrapper(model, optimizer)
        if optimizer.built:
            if not _optimizer_knows(optimizer, model.trainable_variables):
                raise ValueError(
                    "optimizer was built for other variables than this model's trainable variables; "
                    "pass a fresh optimizer"
                )
        else:
            optimizer.build(model.trainable_variables)

    # ---- resume ------------------------------------------------------------------------
    cluster = _Cluster.of(strategy)
    if cluster is not None and not cluster.is_chief:
        verbose = 0  # one progress bar, the chief's
    history = TrainingHistory()
    start_epoch = 0
    checkpoint = None
    if checkpoint_dir is not None:
        checkpoint = _TrainingCheckpoint(checkpoint_dir, model, optimizer, cluster)
        restored = checkpoint.restore()
        if restored is not None:
            start_epoch, history = restored
    if cluster is not None:
        try:
            restored_epochs = sorted({int(v) for v in cluster.gather(start_epoch)[:, 0]})
        except _PEER_FAILURES as error:
            raise cluster.lost(error, start_epoch, history, checkpoint) from error
        if len(restored_epochs) > 1:
            raise ValueError(
                f"the workers restored different checkpoints from {checkpoint_dir!r} (after epochs "
                f"{restored_epochs}; {cluster.task} after epoch {start_epoch}): every worker must see the chief's "
                "checkpoint_dir, e.g. on a shared file system"
            )
    consecutive = history.trailing_nonfinite()
    limit = 1 if on_nonfinite == "raise" else max_consecutive_nonfinite

    runner = _runner_for(model, loss, optimizer, strategy, jit=jit_compile, clip=clip_global_norm, guard=guard)
    steps_per_epoch = int(dataset.cardinality())
    known_length = steps_per_epoch > 0
    # Under a multi-worker strategy a new iterator costs a good fraction of a second, so
    # with a known number of batches one iterator over the repeated dataset serves every
    # epoch (each takes its batches from it; a shuffle still reshuffles per epoch).
    shared = cluster is not None and known_length
    distributed = strategy.experimental_distribute_dataset(dataset.repeat() if shared else dataset)
    shared_iterator = iter(distributed) if shared else None
    target = steps_per_epoch if known_length else None
    loss_scaled = runner.loss_scaler is not None

    for epoch in range(start_epoch, epochs):
        if verbose:
            print(f"Epoch {epoch + 1}/{epochs}")
        bar = (
            keras.utils.Progbar(target, verbose=verbose, stateful_metrics=("loss", "skipped"), unit_name="step")
            if verbose
            else None
        )
        iterator = shared_iterator if shared else iter(distributed)
        epoch_start = history.steps
        applied_losses: list[float] = []
        done = False
        while not done:
            steps_asked = runner.steps_per_call
            if known_length:
                steps_asked = min(steps_asked, steps_per_epoch - (history.steps - epoch_start))
            started = time.perf_counter()
            try:
                out = runner.run(iterator, steps_asked, consecutive, limit, known_length)
            except _UnmaskableUpdate:
                # Found while tracing, before anything ran: update under a conditional.
                _model_cache(model)[("unmaskable", id(optimizer))] = True
                runner = _runner_for(
                    model, loss, optimizer, strategy, jit=runner.jit, clip=clip_global_norm, guard=guard, masked=False
                )
                continue
            except tf.errors.OpError as error:
                if cluster is not None and isinstance(error, _PEER_FAILURES):
                    raise cluster.lost(error, epoch, history, checkpoint) from error
                if runner.jit and not runner.verified and _looks_like_xla_failure(error):
                    warnings.warn(
                        f"XLA could not compile the training step ({_xla_failure_summary(error)}); "
                        "training without XLA. "
                        "Pass jit_compile=False to skip this attempt.",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    runner = _runner_for(
                        model, loss, optimizer, strategy, jit=False, clip=clip_global_norm, guard=guard
                    )
                    iterator = iter(distributed)  # the failed call may have consumed a batch
                    if shared:
                        shared_iterator = iterator
                    continue
                raise
            elapsed = time.perf_counter() - started
            if cluster is not None:
                # Every worker must ask for the same number of steps per call.
                try:
                    elapsed = float(cluster.gather(elapsed).max())
                except _PEER_FAILURES as error:
                    raise cluster.lost(error, epoch, history, checkpoint) from error
            runner.verified = True
            history.xla = runner.jit

            steps = int(out["steps"])
            consecutive = int(out["consecutive"])
            if known_length:
                done = history.steps + steps - epoch_start >= steps_per_epoch
            else:
                done = bool(out["done"])
            first_index = history.steps
            scalars = out["scalars"]
            skip_rows = {int(k): row for row, k in enumerate(out["skip_index"])}
            for k in range(steps):
                index = first_index + k
                step_loss = float(scalars[k, 0])
                history.step_loss.append(step_loss)
                history.grad_norm.append(float(scalars[k, 1]))
                scale = float(scalars[k, 3]) if loss_scaled else None
                if loss_scaled:
                    history.loss_scale.append(scale)
                if scalars[k, 2] > 0.5:
                    applied_losses.append(step_loss)
                    continue
                history.skipped.append(index)
                row = skip_rows[k]
                nan_counts, inf_counts = out["counts"][row]
                records = [
                    GradientRecord(
                        path=str(v.path),
                        shape=tuple(int(d) for d in v.shape),
                        nan_count=int(nan_counts[i]),
                        inf_count=int(inf_counts[i]),
                        max_abs=None,
                    )
                    for i, v in enumerate(runner.variables)
                    if nan_counts[i] or inf_counts[i]
                ]
                history.reports.append(
                    SkippedStep(
                        step=index,
                        epoch=epoch,
                        loss=step_loss,
                        gradients=GradientReport(records),
                        loss_scale=scale,
                        grad_norm=history.grad_norm[-1],
                    )
                )
            if loss_scaled and not history.loss_scale_stalled:
                current = float(tf.convert_to_tensor(runner.loss_scaler.dynamic_scale).numpy())
                if current <= _STALLED_LOSS_SCALE:
                    history.loss_scale_stalled = True
                    warnings.warn(
                        f"the dynamic loss scale fell to {current:g} by step {history.steps - 1}: the gradients are "
                        "non-finite even without float16 overflow, so loss scaling cannot fix them (and small "
                        "gradients now underflow). Look for the NaN with companion.diagnostics.locate_nonfinite.",
                        RuntimeWarning,
                        stacklevel=3,
                    )
            if bar is not None and not done and (target is None or history.steps - epoch_start < target):
                bar.update(history.steps - epoch_start, values=_bar_values(history, epoch_start, applied_losses))
            if consecutive >= limit:
                raise _nonfinite_error(history, consecutive, limit, on_nonfinite, loss_scaled)
            # Aim for a few host calls per second; the step count does not change results.
            requested = runner.steps_per_call
            if steps == requested and elapsed < _TARGET_SECONDS_PER_CALL / 2:
                runner.steps_per_call = min(requested * 2, _MAX_STEPS_PER_CALL)
            elif elapsed > 2 * _TARGET_SECONDS_PER_CALL and requested > 1 and steps > 1:
                runner.steps_per_call = max(requested // 2, 1)
        epoch_steps = history.steps - epoch_start
        if epoch_steps == 0:
            raise ValueError("dataset yielded no batch in this epoch")
        history.epoch_steps.append(epoch_steps)
        history.epoch_loss.append(float(np.mean(applied_losses)) if applied_losses else float("nan"))
        if bar is not None:
            bar.update(epoch_steps, values=_bar_values(history, epoch_start, applied_losses), finalize=True)
        if checkpoint is not None:
            try:
                checkpoint.save(epoch + 1, history)
            except _PEER_FAILURES as error:
                if cluster is None:
                    raise
                raise cluster.lost(error, epoch, history, checkpoint) from error
    return history


def _bar_values(history: TrainingHistory, epoch_start: int, applied_losses: list[float]) -> list[tuple[str, float]]:
    """Progress-bar metrics: the epoch's mean loss of applied steps, and its skipped count if any."""
    values = []
    if applied_losses:
        values.append(("loss", float(np.mean(applied_losses))))
    skipped = len(history.skipped) - bisect.bisect_left(history.skipped, epoch_start)
    if skipped:
        values.append(("skipped", skipped))
    return values


def _nonfinite_error(history, consecutive, limit, on_nonfinite, loss_scaled) -> NonFiniteError:
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
    if loss_scaled:
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


# --------------------------------------------------------------------------------------
# SkipNonFinite: the same guarantee for model.fit
# --------------------------------------------------------------------------------------


@keras.saving.register_keras_serializable(package="companion")
class SkipNonFinite(keras.optimizers.Optimizer):
    """An optimizer wrapper that skips every update whose gradients are not all finite.

    For ``model.fit`` users: ``model.compile(optimizer=SkipNonFinite(keras.optimizers.Adam()))``.
    When any gradient of a step has a NaN or Inf entry, the wrapped optimizer is not
    called at all, so neither the weights nor its state (moments, iteration counter)
    change; :attr:`skipped_steps` counts such steps. Under a distribution strategy the
    decision is made across replicas (a NaN on one replica skips the step on all of
    them). It works with ``jit_compile=True``.

    What it cannot do inside ``fit``: the loss metric of a skipped step is NaN, so the
    epoch's mean loss shown by ``fit`` is NaN (and ``keras.callbacks.TerminateOnNaN``
    would stop training); batch-norm statistics updated by the forward pass are not
    restored. :func:`train` has neither limitation.

    With ``mixed_float16``, ``compile`` wraps this optimizer in a
    :class:`keras.optimizers.LossScaleOptimizer`, which is the right order (overflowing
    steps are then handled by the loss scaler). Do not wrap a ``LossScaleOptimizer`` in
    ``SkipNonFinite``: it would never see an overflow and its scale would never drop.

    Args:
        inner_optimizer: the :class:`keras.optimizers.Optimizer` to guard.
        name: name of the wrapper.

    Raises:
        TypeError: if ``inner_optimizer`` is not a Keras optimizer.
        ValueError: if ``inner_optimizer`` is a ``LossScaleOptimizer``.

    Example:
        >>> model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer=SkipNonFinite(keras.optimizers.SGD(0.1)), loss="mse")
        >>> x = np.array([[1.0], [np.nan]], "float32")
        >>> _ = model.fit(x, x, batch_size=1, shuffle=False, verbose=0)
        >>> int(model.optimizer.skipped_steps), int(model.optimizer.iterations)
        (1, 1)
    """

    def __init__(self, inner_optimizer: keras.optimizers.Optimizer, name: str | None = None, **kwargs: Any) -> None:
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "inner_optimizer must be a Keras optimizer (an instance of keras.optimizers.Optimizer), "
                f"got {type(inner_optimizer).__name__}"
            )
        if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                "SkipNonFinite cannot wrap a LossScaleOptimizer (the scaler would never see an overflow); "
                "wrap the other way round: LossScaleOptimizer(SkipNonFinite(optimizer))"
            )
        for key in list(kwargs):
            if kwargs[key] in (None, False) or key in ("learning_rate",):
                kwargs.pop(key)  # defaults written by get_config of older versions
        if kwargs:
            raise ValueError(
                f"SkipNonFinite does not support arguments {sorted(kwargs)}; set them on the inner optimizer"
            )
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer

    def build(self, var_list) -> None:
        """Create the skip counter and build the inner optimizer on ``var_list``."""
        if self.built:
            return
        self._skipped_steps = self.add_variable(
            shape=(), dtype="int64", initializer="zeros", aggregation="only_first_replica", name="skipped_steps"
        )
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def skipped_steps(self):
        """Number of steps skipped because a gradient was not finite (a variable)."""
        if not self.built:
            return 0
        return self._skipped_steps

    @property
    def variables(self) -> list:
        return self._variables + self.inner_optimizer.variables

    @property
    def iterations(self):
        """The inner optimizer's iteration counter (skipped steps do not count)."""
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):  # pragma: no cover
        """Not supported: :class:`SkipNonFinite` works with the TensorFlow backend only."""
        raise NotImplementedError("SkipNonFinite supports the TensorFlow backend only")

    def apply(self, grads, trainable_variables=None) -> None:
        """Apply ``grads`` with the inner optimizer if every gradient is finite; else skip."""
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if tf.distribute.in_cross_replica_context():
            raise ValueError("SkipNonFinite.apply() must be called in a replica context")
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            self._replica_apply(grads, trainable_variables)
        else:
            tf.distribute.get_replica_context().merge_call(self._cross_replica_apply, args=(grads, trainable_variables))

    @staticmethod
    def _finite(grads) -> tf.Tensor:
        return _all_finite(grads)

    def _skip(self):
        self._skipped_steps.assign_add(1)
        return tf.constant(False)

    def _replica_apply(self, grads, trainable_variables):
        finite = self._finite(grads)
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            bad = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.int32))
            finite = tf.equal(bad, 0)

        def apply():
            self.inner_optimizer.apply(grads, trainable_variables)
            return tf.constant(True)

        tf.cond(finite, apply, self._skip)

    def _cross_replica_apply(self, distribution, grads, trainable_variables):
        bad_per_replica = distribution.extended.call_for_each_replica(
            lambda g: tf.cast(tf.logical_not(self._finite(g)), tf.int32), args=(grads,)
        )
        finite = tf.equal(distribution.reduce(tf.distribute.ReduceOp.SUM, bad_per_replica, axis=None), 0)

        def apply():
            distribution.extended.call_for_each_replica(self.inner_optimizer.apply, args=(grads, trainable_variables))
            return tf.constant(True)

        # The cond is made in cross-replica context, like LossScaleOptimizer does: a
        # cond in replica context must not contain the merge_call of apply().
        tf.cond(finite, apply, self._skip)

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer)}

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects=None) -> "SkipNonFinite":
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)
