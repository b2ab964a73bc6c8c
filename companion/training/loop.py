""":func:`companion.training.train`: Keras' own ``fit``, with the guarded step of
:mod:`companion.training.step` installed (:mod:`companion.training.patches` lists what that
changes on the model and puts back), the callbacks of :mod:`companion.training.callbacks`,
epoch-end checkpoints, and the clean exit after a lost worker (chapter *A training loop
that survives NaN*). What it does before ``fit`` runs (check, compile, build, resume) is
in :mod:`companion.training.preparation`.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from companion import _internal
from companion._checks import check_int, check_positive_number
from companion.training.cluster import PEER_FAILURES, Cluster, arm_exit_after_worker_loss
from companion.training.callbacks import CheckpointCallback, GuardCallback, asks_for_batch_hooks
from companion.training.patches import ModelPatches, restore_leftover
from companion.training.records import DoctorView
from companion.training.recovery import NO_LIMIT, Recovery, check_learning_rates, set_schedule_scale
from companion.training.deferred import Undeferrable, worth_deferring
from companion.training.inputs import (
    ON_NONFINITE, as_dataset, check_callbacks, check_finite_weights, check_targets, replay_batches,
)
from companion.training.preparation import build_model, check_model, check_scope, compile_model, guarded_step, resume
from companion.training.results import TrainingHistory, WorkerLostError

#: The most steps one host call runs when ``train`` chooses ``steps_per_execution``.
MAX_STEPS_PER_EXECUTION = 1024
#: An older Keras (3.5) unrolls a call's steps, and TensorFlow refuses more than this many
#: ``get_next`` calls of one iterator in one function.
UNROLLED_STEPS = 32
#: The fewest steps (epochs times steps per epoch) of a call for which ``train`` chooses
#: several steps per host call, at least, and per trainable variable. Keras' multi-step
#: loop costs a first call about as much to trace and optimise as some 30 host calls
#: cost, more for a larger step graph (measured on fresh models: the cold-start
#: benchmark's compute-bound MLP, 6 variables, took 0.1 s longer with it over 16 steps and
#: 0.05 s less over 48; the book's ParameterNet, 18 variables, 0.2 s longer over 48).
MIN_STEPS_FOR_LOOP = 32
MIN_STEPS_FOR_LOOP_PER_VARIABLE = 4


# What train adds to fit, in detail (the reference behind the chapter and the differences
# page; train's docstring is the summary):
#
# * Each step is the model's own ``train_step`` (Keras', or an override that applies
#   any number of optimizers, assigns variables, updates metrics: a GAN, a VAE).
#   The step is *skipped* on every replica and worker when its loss, the gradients
#   of any optimizer (summed over the replicas; a global norm that overflows
#   float32, above ~1.8e19, counts), a value it logs, or anything it wrote (the
#   weights, the optimizers' state, non-trainable variables, the metrics; on one
#   replica) is not finite. A skipped step changes nothing: every variable of the
#   model and of its optimizers keeps its exact previous value, so no log ever shows
#   it (``keras.callbacks.TerminateOnNaN`` does not fire under the guard); only the
#   random state moves on, so a skipped random draw is not drawn again.
# * Skipped steps are reported in the returned :class:`TrainingHistory` (``skipped``,
#   ``reports``), never as a log key: the logs, the ``History`` and ``CSVLogger``'s
#   columns have exactly ``fit``'s keys.
# * Callbacks run as ``fit`` runs them, batch hooks every ``steps_per_execution``
#   steps. When neither ``compile`` nor ``train`` was given ``steps_per_execution``,
#   no callback overrides a batch hook (but ``TerminateOnNaN``'s, which does nothing
#   under the guard) and the call runs at least 32 steps, and 4 per
#   trainable variable (epochs times steps per epoch), ``train`` runs up to a
#   whole epoch (at most 1024 steps) per host call, as ``fit`` with that
#   ``steps_per_execution`` would; the progress bar is then updated after each host
#   call. A shorter call runs one step per host call, as ``fit`` does: Keras'
#   multi-step loop would cost it more to trace than it saves.
# * ``MultiWorkerMirroredStrategy``: Keras 3's ``fit`` fails under it; ``train`` repairs
#   the two places (the example batch of the symbolic build, the reduction of the
#   logs). Every worker calls ``train`` with the same arguments (see
#   :mod:`companion.launch`); each worker's TensorFlow server listens on every
#   interface of its machine, without authentication, and runs the graphs it is
#   sent: TensorFlow's SECURITY.md requires the cluster's network to be isolated
#   (:func:`companion.launch.launch` runs local workers in a private, loopback-only
#   network namespace). A lost peer raises :class:`WorkerLostError` on every survivor
#   (see ``on_worker_loss``). What bounds a survivor's exit: detecting the loss (a
#   crashed peer breaks the connection at once; a crashed or stopped one stops its
#   heartbeats to TensorFlow's coordination service, which aborts the collectives
#   within about ten seconds; a collective timeout, if the strategy sets one, bounds any
#   wait), then at most 30 s. The tests kill workers at every moment of training and
#   require 60 s.
# * Recovery (:mod:`companion.training.recovery`): ``on_nonfinite="rollback"`` restores
#   the last snapshot (considered at every epoch start and every ``snapshot_every_steps``
#   steps, taken when no step since the last such point was non-finite and their mean loss
#   is at most ``SNAPSHOT_GROWTH`` times the lowest mean of ``SNAPSHOT_WINDOW`` applied
#   steps) from a callback after the host call in which the limit was reached, so the steps after
#   it in that call ran and are recorded (and undone); the doctor's diagnosis of the
#   run's first step decides (``RATE_CANNOT_CURE``). A schedule is wrapped in
#   ``ScaledSchedule`` and the step traced again; a resumed run scales it again from
#   ``history.rollbacks``. ``skip_loss_spikes`` keeps a running mean and variance of
#   the loss in device variables of the guarded step and adds its test to the step's
#   predicate, before the deferred update runs.
# * Checkpoints: with ``checkpoint_dir``, the model, the optimizer, the number of
#   completed epochs and the history are saved at every epoch end (the last two are
#   kept); calling ``train`` again with the same directory resumes after the last
#   completed epoch and ends bit-identical to an uninterrupted run on CPU, provided
#   each epoch yields the same batches. ``keras.callbacks.BackupAndRestore`` works as
#   with ``fit``.
# * XLA: ``jit_compile="auto"`` by default, as ``compile``'s: XLA where a GPU or TPU
#   is present, not on a CPU alone, where compiling the step costs more than it saves
#   on a run of up to ten epochs (``benchmarks/cold_start.py``). With
#   ``jit_compile=True``, a step XLA cannot compile (an op without an XLA kernel, such
#   as ``tf.py_function``) runs without XLA and a warning says so. Under several replicas (``MirroredStrategy``,
#   several workers) the step runs without XLA: Keras' XLA step there reads variables
#   of other devices, which XLA refuses (``fit`` fails with ``InvalidArgumentError``).
# * Mixed precision: ``compile`` wraps the optimizer of a ``mixed_float16`` model in a
#   :class:`keras.optimizers.LossScaleOptimizer`; an overflowing step is skipped and
#   halves the loss scale. If the scale falls to 1, ``history.loss_scale_stalled`` is
#   set and a warning says the NaNs are not float16 overflow.


def train(
    model: keras.Model,
    x: Any = None,
    y: Any = None,
    *,
    batch_size: int | None = None,
    epochs: int = 1,
    verbose: int | str = "auto",
    callbacks: list[keras.callbacks.Callback] | None = None,
    validation_split: float = 0.0,
    validation_data: Any = None,
    shuffle: bool | str = True,
    class_weight: dict | None = None,
    sample_weight: Any = None,
    initial_epoch: int = 0,
    steps_per_epoch: int | None = None,
    validation_steps: int | None = None,
    validation_batch_size: int | None = None,
    validation_freq: int = 1,
    loss: Any = None,
    optimizer: Any = None,
    metrics: Any = None,
    loss_weights: Any = None,
    weighted_metrics: Any = None,
    run_eagerly: bool = False,
    steps_per_execution: int | None = None,
    jit_compile: bool | str = "auto",
    auto_scale_loss: bool = True,
    strategy: tf.distribute.Strategy | None = None,
    clip_global_norm: float | None = None,
    on_nonfinite: str = "skip",
    max_consecutive_nonfinite: int = 10,
    max_rollbacks: int = 3,
    rollback_lr_factor: float = 0.5,
    snapshot_every_steps: int | None = None,
    skip_loss_spikes: float | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    on_worker_loss: str = "exit",
) -> TrainingHistory:
    """``model.fit``, skipping every step whose loss, gradients or writes are not finite.

    ``train`` *is* ``fit``: Keras' own ``model.fit`` with every argument ``fit`` takes,
    after ``compile`` with ``compile``'s arguments when one is given, and with a guarded
    step installed for the call: the model's own ``train_step`` (Keras', a GAN's, a
    VAE's), skipped on every replica and worker when its loss, its gradients, a value it
    logs or anything it wrote is not finite. A skipped step changes nothing and is
    reported in the returned history, never in the logs. Any ``tf.distribute`` strategy,
    XLA, mixed precision, epoch-end checkpoints. Design and cost: the chapter *A training
    loop that survives NaN*; several workers: *Training across machines*; what differs
    from ``fit``: the reference page *Differences from fit*.

    Args:
        model: a Keras model (or a layer with Keras' ``Trainer`` mixed in).
        x ... validation_freq: ``model.fit``'s arguments, same names and meaning.
        loss ... auto_scale_loss: ``model.compile``'s; if ``loss`` or ``optimizer`` is
            given the model is compiled (again only when they changed), else it must be
            compiled already (a ``steps_per_execution`` given here holds for the call
            then too). A :class:`~companion.optimizers.SkipNonFinite` is unwrapped
            (``train`` guards by itself).
        strategy: a ``tf.distribute.Strategy`` (default: the model's); the model and
            the optimizer must be created under its scope.
        clip_global_norm: if given (> 0), finite gradients are rescaled to this global
            norm at most (:func:`tf.clip_by_global_norm`); non-finite ones never are.
            The optimizer's own clipping acts as in ``fit``, after this.
        on_nonfinite: ``"skip"`` (skip the step and go on), ``"raise"`` (raise
            :class:`NonFiniteError` at the first non-finite step, not applied either),
            ``"rollback"`` (skip; see ``max_rollbacks``) or ``"ignore"`` (no guard:
            every step applied, NaN included, as ``fit`` does).
        max_consecutive_nonfinite: with ``"skip"``, raise :class:`NonFiniteError` after
            this many consecutive non-finite steps (>= 1), with the weights of the last
            good step.
        max_rollbacks, rollback_lr_factor: with ``"rollback"``, instead of that error:
            restore the last good snapshot (weights, optimizer state, the step's small
            state; kept on the host), multiply every optimizer's learning rate by the
            factor (0 < f < 1; a schedule is wrapped) and go on; after ``max_rollbacks``
            rollbacks, raise with that state in place. Where the NaN doctor puts the
            cause in the data or a function's domain, raise at once. Each rollback is
            recorded in ``history.rollbacks``. ``snapshot_every_steps``: also snapshot
            every so many steps (default ``recovery.SNAPSHOT_EVERY_STEPS``; 0: epoch
            starts only), each time only after steps that were all finite.
        skip_loss_spikes: ``z`` or ``None``: also skip (``reason="spike"``) a step whose
            finite loss is over ``z`` running standard deviations above the running
            mean of the applied steps' losses (after 20 steps; decided on the device).
        checkpoint_dir: directory for epoch-end checkpoints, or ``None``.
        on_worker_loss: after :class:`WorkerLostError`, ``"exit"`` (exit code 1 at
            interpreter exit, at the latest 30 s after the error, so that a scheduler
            can restart the job) or ``"raise"`` (only raise).

    Returns:
        A :class:`TrainingHistory`: ``fit``'s ``History`` (``model.history`` is it), plus
        every step's loss, gradient norm and finiteness, and a report per skipped step.

    Raises:
        TypeError, ValueError: for a wrong argument, a missing loss or optimizer, a Keras
            loss that would compare predictions with the wrong targets, a model not made
            under the strategy's scope or another model's checkpoint: before any step.
        NonFiniteError: see ``on_nonfinite``, ``max_consecutive_nonfinite``, ``max_rollbacks``.
        WorkerLostError: when another worker of a multi-worker run crashed or stopped
            responding.

    Example:
        >>> model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        >>> x = np.array([[1.0], [2.0], [np.nan], [4.0]], "float32")
        >>> sgd = keras.optimizers.SGD(0.01)
        >>> history = train(model, x, 2 * x, batch_size=1, shuffle=False, epochs=2,
        ...                 loss="mse", optimizer=sgd, verbose=0)
        >>> history.skipped, sorted(history.history), history.epoch
        ([2, 6], ['loss'], [0, 1])
    """
    check_model(model)
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
    if on_worker_loss not in ("exit", "raise"):
        raise ValueError(f"on_worker_loss must be 'exit' or 'raise', got {on_worker_loss!r}")
    limit = 1 if on_nonfinite == "raise" else check_int("max_consecutive_nonfinite", max_consecutive_nonfinite, 1)
    max_rollbacks = check_int("max_rollbacks", max_rollbacks, 0)
    rollback_lr_factor = check_positive_number("rollback_lr_factor", rollback_lr_factor)
    if not rollback_lr_factor < 1:
        raise ValueError(f"rollback_lr_factor must be in (0, 1), got {rollback_lr_factor!r}")
    if snapshot_every_steps is not None:
        snapshot_every_steps = check_int("snapshot_every_steps", snapshot_every_steps, 0)
    skip_loss_spikes = check_positive_number("skip_loss_spikes", skip_loss_spikes, allow_none=True)
    if steps_per_execution is not None:
        steps_per_execution = check_int("steps_per_execution", steps_per_execution, 1)
    if skip_loss_spikes is not None and on_nonfinite == "ignore":
        raise ValueError("skip_loss_spikes needs the guard: it cannot be used with on_nonfinite='ignore'")
    clip_global_norm = check_positive_number("clip_global_norm", clip_global_norm, allow_none=True)
    if strategy is not None and not isinstance(strategy, tf.distribute.Strategy):
        raise TypeError(f"strategy must be a tf.distribute.Strategy or None, got {type(strategy).__name__}")
    if checkpoint_dir is not None and not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise TypeError(
            f"checkpoint_dir must be a path (str or os.PathLike) or None, got {type(checkpoint_dir).__name__}"
        )
    callbacks = check_callbacks(callbacks)
    if y is None and isinstance(x, list) and x and all(isinstance(e, tuple) for e in x):
        x = as_dataset(x, "dataset")  # a list of (inputs, targets[, sample_weights]) batches
    check_targets(model, x, y, loss)
    strategy = strategy or model.distribute_strategy
    if strategy.num_replicas_in_sync > 1:
        check_scope(model, strategy)
    if isinstance(x, tf.data.Dataset) and shuffle is True:
        shuffle = False  # fit ignores shuffle for a dataset (and warns that it does)
    fit_arguments = dict(
        batch_size=batch_size, epochs=epochs, verbose=verbose, validation_split=validation_split,
        validation_data=validation_data, shuffle=shuffle, class_weight=class_weight, sample_weight=sample_weight,
        initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
        validation_batch_size=validation_batch_size, validation_freq=validation_freq,
    )
    with strategy.scope():
        if loss is not None or optimizer is not None:
            compile_model(
                model, x, y, loss=loss, optimizer=optimizer, metrics=metrics, loss_weights=loss_weights,
                weighted_metrics=weighted_metrics, run_eagerly=run_eagerly, steps_per_execution=steps_per_execution,
                jit_compile=jit_compile, auto_scale_loss=auto_scale_loss,
            )
        elif not getattr(model, "compiled", False):
            raise TypeError(
                f"model {model.name!r} is not compiled: pass loss= and optimizer= to train (as to compile), "
                "or compile the model first"
            )
        build_model(model, x)
        check_finite_weights(model)  # no step can cure a weight that starts NaN or Inf
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and model.built and not optimizer.built and model.trainable_variables:
            optimizer.build(model.trainable_variables)  # as fit's symbolic build does
    rollback = on_nonfinite == "rollback"
    if rollback:
        check_learning_rates(model)
    cluster = Cluster.of(strategy)
    history, restored_epochs, checkpoint = resume(model, cluster, checkpoint_dir)
    # A resumed run keeps its reduced rates: a float's variable comes back with the
    # checkpoint, a schedule is scaled again.
    rescaled = bool(history.rollbacks) and set_schedule_scale(model, history.rollbacks[-1].scale)
    fit_arguments["initial_epoch"] = max(int(initial_epoch or 0), restored_epochs)
    if cluster is not None and not cluster.is_chief:
        fit_arguments["verbose"] = 0  # one progress bar, the chief's
    chosen = (
        steps_per_execution is None and model.steps_per_execution == 1
        and not asks_for_batch_hooks(callbacks, guarded=on_nonfinite != "ignore")
        # fit runs steps_per_execution steps per call of validation too, whatever
        # validation_steps says, and counts steps_per_epoch in host calls: 1 there.
        and not steps_per_epoch and not validation_steps
    )
    restore_leftover(model)  # a NaN doctor's guard left by a fit that raised
    patches = ModelPatches()  # everything this call changes on the model, put back at its end
    if steps_per_execution is not None and int(model.steps_per_execution) != steps_per_execution:
        # A model compiled before the call (train compiled nothing): for this call, as asked.
        patches.set(model, "steps_per_execution", steps_per_execution)
    if strategy.num_replicas_in_sync > 1 and bool(model.jit_compile):
        # Keras' XLA step under several replicas accesses variables placed on the other
        # replicas' devices: fit itself raises InvalidArgumentError (TF 2.16-2.21).
        patches.set(model, "jit_compile", False)
    short_calls = _internal.multi_step_loop_ends_short_calls()
    if chosen and not short_calls and (validation_data is not None or validation_split):
        chosen = False  # older Keras would drop the validation pass's short last call
    batches = _batches_per_epoch(x, batch_size, steps_per_epoch, validation_split)
    call_epochs = max(int(epochs) - fit_arguments["initial_epoch"], 1)
    if chosen and strategy.num_replicas_in_sync == 1:
        # (Keras 3.15's multi-step loop fails under MirroredStrategy: one step per call there.)
        patches.set(model, "steps_per_execution", _steps_per_execution(
            batches, whole_epochs_only=not short_calls, epochs=call_epochs,
            variables=len(model.trainable_variables),
        ))
    # The deferred update, or the masked step for a short call on a small model (its trace
    # costs a first call less than the deferred update's saves over the call's steps).
    steps = None if batches is None else batches * call_epochs
    step = guarded_step(model, strategy, guard=on_nonfinite != "ignore", clip=clip_global_norm,
                        limit=NO_LIMIT if rollback else limit, spikes=skip_loss_spikes,
                        defer=worth_deferring(model.trainable_variables, steps))
    if rescaled:
        step.forget_functions(patches)  # traced with the schedule before it was scaled
    doctor = DoctorView(
        model, strategy, history, lambda: replay_batches(x, y, sample_weight, batch_size, validation_split), cluster,
        verbose=fit_arguments["verbose"] != 0,
        # fit permutes the rows of arrays (not of a dataset) with a permutation only its
        # pipeline knows: the doctor cannot read that step's batch again.
        shuffled=shuffle is not False and not isinstance(x, tf.data.Dataset),
    )
    recovery = Recovery(
        model, step, history, limit=limit, max_rollbacks=max_rollbacks, factor=rollback_lr_factor,
        verbose=fit_arguments["verbose"] != 0, snapshot_every=snapshot_every_steps,
    ) if rollback else None
    guard_callback = GuardCallback(step, history, on_nonfinite=on_nonfinite, limit=limit, doctor=doctor,
                                   recovery=recovery)
    extra = [CheckpointCallback(checkpoint, history)] if checkpoint is not None else []
    try:
        return _fit(model, x, y, step, patches, [guard_callback, *callbacks, history, *extra], fit_arguments,
                    history, cluster, checkpoint, guard_callback)
    except WorkerLostError:
        if on_worker_loss == "exit":
            arm_exit_after_worker_loss()
        raise
    finally:
        patches.restore()


def _fit(model, x, y, step, patches, callbacks, fit_arguments, history, cluster, checkpoint, guard_callback):
    attempt = 0
    while True:
        step.install(patches)
        try:
            model.fit(x, y, callbacks=callbacks, **fit_arguments)
            return history
        except Undeferrable:
            if not step.deferred or history.steps:
                raise
            step.undeferrable(patches)  # traced again, with the masked update
            continue
        except tf.errors.OpError as error:
            # Every collective of the run is inside this call: the steps', reading the
            # metrics for the logs (an eager all-reduce), the callbacks', validation's and
            # the checkpoint's; any of them failing because a peer is gone is a
            # WorkerLostError, so the survivor exits (the kill matrix covers each moment).
            if cluster is not None and isinstance(error, PEER_FAILURES):
                raise cluster.lost(error, guard_callback.epoch, history, checkpoint) from error
            if attempt == 0 and model.jit_compile and history.steps == 0 and _internal.looks_like_xla_failure(
                error
            ):
                warnings.warn(
                    f"XLA could not compile the training step ({_internal.xla_failure_summary(error)}); "
                    "training without XLA. Pass jit_compile=False to skip this attempt.",
                    RuntimeWarning,
                    stacklevel=3,
                )
                model.jit_compile = False  # kept after the call: this model's step does not compile
                step.forget_functions(patches)
                attempt += 1
                continue
            raise


def _steps_per_execution(batches, whole_epochs_only=False, epochs=1, variables=0) -> int:
    """Steps per host call when no one asked for per-step hooks: up to an epoch of
    ``batches`` (``None``: not known, 1), when the ``epochs`` of the call run at least
    :data:`MIN_STEPS_FOR_LOOP` steps and :data:`MIN_STEPS_FOR_LOOP_PER_VARIABLE` per
    trainable variable (else 1).

    With ``whole_epochs_only`` (an older Keras that drops a short last call and unrolls
    a call's steps, of which TensorFlow takes at most :data:`UNROLLED_STEPS` iterator
    reads), the largest divisor of the epoch's batches up to that.
    """
    if batches is None:
        return 1
    if batches * max(int(epochs), 1) < max(MIN_STEPS_FOR_LOOP, MIN_STEPS_FOR_LOOP_PER_VARIABLE * variables):
        return 1
    if whole_epochs_only:
        return max(d for d in range(1, min(batches, UNROLLED_STEPS) + 1) if batches % d == 0)
    return max(1, min(batches, MAX_STEPS_PER_EXECUTION))


def _batches_per_epoch(x, batch_size, steps_per_epoch, validation_split) -> int | None:
    """How many batches an epoch of ``fit`` trains on (``None``: not known beforehand)."""
    batches = None
    if steps_per_epoch:
        batches = int(steps_per_epoch)
    elif isinstance(x, tf.data.Dataset):
        cardinality = int(x.cardinality())
        batches = cardinality if cardinality > 0 else None
    elif isinstance(x, (np.ndarray, tf.Tensor)) or (
        isinstance(x, (list, tuple, dict)) and all(hasattr(v, "shape") for v in tf.nest.flatten(x))
    ):
        first = tf.nest.flatten(x)[0]
        rows = int(first.shape[0]) if first.shape and first.shape[0] is not None else None
        if rows is not None:
            rows = int(rows * (1 - (validation_split or 0.0)))
            batches = max(1, math.ceil(rows / (batch_size or 32)))
    return batches
