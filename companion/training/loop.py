"""The host loop of :func:`companion.training.train`: validate, prepare, then per epoch run
host calls of several compiled steps, record what they did, and adapt the number of
steps per call (chapter *The guarded training loop*).
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import time
import warnings
from typing import Any, Callable, Iterable

import keras
import numpy as np
import tensorflow as tf

from companion import _tf_internals
from companion.diagnostics import GradientRecord, GradientReport
from companion.training.checkpoints import TrainingCheckpoint
from companion.training.cluster import PEER_FAILURES, Cluster
from companion.training.inputs import as_dataset, check_arguments, prepare_model, prepare_optimizer, uses_float16
from companion.training.masking import UnmaskableUpdate
from companion.training.results import NonFiniteError, SkippedStep, TrainingHistory
from companion.training.step import Runner, loss_scale_wrapper, model_cache, runner_for

#: Seconds of work per host call the loop aims for (also the progress-bar refresh interval).
TARGET_SECONDS_PER_CALL = 0.2
MAX_STEPS_PER_CALL = 1024
#: A dynamic loss scale at or below this value no longer amplifies the gradients.
STALLED_LOSS_SCALE = 1.0


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
    the batch, plus ``model.losses``), its gradients, their global norm and whether the
    loss and every gradient are finite (the norm is NaN or Inf as soon as one entry is;
    finite gradients whose norm overflows float32, above ~1.8e19, count as non-finite
    too). A non-finite step applies nothing: the weights, the optimizer's moments and
    iteration counter, and the model variables the forward pass changed (batch-norm
    statistics, dropout seed state) keep their exact previous values. Several steps run
    per host call, XLA-compiled, without a host round trip per step.

    * Distribution: under a ``tf.distribute`` strategy the gradients are summed across
      replicas before the test, so a NaN on one replica skips the step on all; the
      model and optimizer must be created under ``strategy.scope()``, ``dataset``
      yields global batches, and the loss is the mean over the global batch.
    * Several machines: under ``tf.distribute.MultiWorkerMirroredStrategy`` every
      worker calls ``train`` with the same arguments (see :mod:`companion.launch`);
      only the chief shows progress and writes ``checkpoint_dir`` (which every worker
      must see), and a lost peer raises :class:`WorkerLostError` on every survivor.
    * XLA: if the step cannot be compiled (an op without an XLA kernel, such as
      ``tf.py_function``), it runs without XLA and a warning says so.
    * Mixed precision: a float16 model gets a :class:`keras.optimizers.LossScaleOptimizer`
      (kept with the model across calls); an overflowing step is skipped and halves the
      loss scale. If the scale falls to 1, ``history.loss_scale_stalled`` is set and a
      warning says the NaNs are not float16 overflow.
    * Checkpoints: with ``checkpoint_dir``, the model, the optimizer, the number of
      completed epochs and the history are saved at every epoch end (the last two are
      kept); calling ``train`` again with the same directory resumes after the last
      completed epoch and ends bit-identical to an uninterrupted run on CPU, provided
      each epoch yields the same batches.

    The design and its cost are in the chapter *The guarded training loop*; several
    machines in *Training across machines*.

    Args:
        model: a Keras model (any :class:`keras.layers.Layer` with trainable
            variables); an unbuilt model is built from the dataset's element spec.
        dataset: a ``tf.data.Dataset`` of ``(inputs, targets)`` batches with a finite
            number of batches, or any finite iterable of such pairs (read once, kept in
            memory).
        loss: ``loss(y_true, y_pred)`` returning a scalar or one value per example, a
            :class:`keras.losses.Loss`, or a Keras loss name such as ``"mse"``.
            Half-precision predictions are cast to float32 first.
        optimizer: a :class:`keras.optimizers.Optimizer`, built on the model's
            trainable variables if it is not built yet.
        epochs: total number of passes over ``dataset`` (restored epochs included), >= 1.
        strategy: a ``tf.distribute.Strategy``; default: the model's, else the current one.
        jit_compile: compile the step with XLA.
        clip_global_norm: if given (> 0), finite gradients are rescaled so that their
            global norm is at most this value (:func:`tf.clip_by_global_norm`
            semantics). Non-finite gradients are never clipped, which would spread one
            NaN to every variable.
        on_nonfinite: ``"skip"`` (skip the step and go on), ``"raise"`` (raise
            :class:`NonFiniteError` at the first non-finite step, which is not applied
            either), or ``"ignore"`` (no check: every step is applied, NaN included, as
            ``model.fit`` does; for measuring what the guard costs).
        max_consecutive_nonfinite: with ``"skip"``, raise :class:`NonFiniteError` after
            this many consecutive skipped steps (>= 1); the weights are then exactly
            those of the last good step.
        checkpoint_dir: directory for epoch-end checkpoints, or ``None``.
        verbose: 0 prints nothing, 1 shows a :class:`keras.utils.Progbar` per epoch,
            2 prints one line per epoch.

    Returns:
        A :class:`TrainingHistory` with the loss, gradient norm and finiteness of every
        step and a report per skipped step.

    Raises:
        TypeError: if an argument has the wrong type (``model`` not a Keras layer,
            ``optimizer`` not a Keras optimizer, ``loss`` not callable, ...) or
            ``dataset`` does not yield ``(inputs, targets)`` pairs.
        ValueError: if an argument is out of range, the dataset is empty or infinite,
            predictions and targets have incompatible shapes, the model has no trainable
            variables or was not created under the strategy's scope, or
            ``checkpoint_dir`` holds a checkpoint of another model. All of these are
            raised before any step runs.
        NonFiniteError: see ``on_nonfinite`` and ``max_consecutive_nonfinite``.
        WorkerLostError: under a multi-worker strategy, when another worker crashed or
            stopped responding.

    Example:
        >>> model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        >>> x = np.array([[1.0], [2.0], [np.nan], [4.0]], "float32")
        >>> data = tf.data.Dataset.from_tensor_slices((x, 2 * x)).batch(1)
        >>> history = train(model, data, loss="mse", optimizer=keras.optimizers.SGD(0.01),
        ...                 epochs=2, verbose=0)
        >>> history.skipped
        [2, 6]
    """
    args = check_arguments(
        model, loss, optimizer, epochs=epochs, strategy=strategy, jit_compile=jit_compile,
        clip_global_norm=clip_global_norm, on_nonfinite=on_nonfinite,
        max_consecutive_nonfinite=max_consecutive_nonfinite, checkpoint_dir=checkpoint_dir, verbose=verbose,
    )
    run = _prepare(model, as_dataset(dataset), **args)
    for epoch in range(run.start_epoch, run.epochs):
        _run_epoch(run, epoch)
    return run.history


# --------------------------------------------------------------------------------------
# Prepare: strategy, optimizer, resume, compiled runner, input pipeline
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Run:
    """Everything one call of ``train`` works with."""

    model: Any
    loss: Callable
    optimizer: Any
    strategy: tf.distribute.Strategy
    epochs: int
    clip: float | None
    guard: bool
    on_nonfinite: str
    limit: int
    verbose: int
    cluster: Cluster | None
    checkpoint: TrainingCheckpoint | None
    history: TrainingHistory
    start_epoch: int
    runner: Runner
    distributed: Any
    shared_iterator: Any
    steps_per_epoch: int

    @property
    def known_length(self) -> bool:
        return self.steps_per_epoch > 0

    @property
    def loss_scaled(self) -> bool:
        return self.runner.loss_scaler is not None

    def lost(self, error: Exception, epoch: int):
        """The WorkerLostError for a collective that failed because a peer is gone."""
        return self.cluster.lost(error, epoch, self.history, self.checkpoint)

    def make_runner(self, *, jit: bool, masked: bool = True) -> Runner:
        return runner_for(
            self.model, self.loss, self.optimizer, self.strategy, jit=jit, clip=self.clip, guard=self.guard,
            masked=masked,
        )


def _prepare(
    model, dataset, *, loss, optimizer, epochs, strategy, jit_compile, clip_global_norm, on_nonfinite,
    max_consecutive_nonfinite, checkpoint_dir, verbose,
) -> _Run:
    if strategy is None:
        strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
    with strategy.scope():
        prepare_model(model, dataset.element_spec[0], strategy)
        if uses_float16(model) and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            optimizer = loss_scale_wrapper(model, optimizer)
        prepare_optimizer(optimizer, model)

    cluster = Cluster.of(strategy)
    if cluster is not None and not cluster.is_chief:
        verbose = 0  # one progress bar, the chief's
    history, start_epoch, checkpoint = _resume(model, optimizer, cluster, checkpoint_dir)

    steps_per_epoch = int(dataset.cardinality())
    # Under a multi-worker strategy a new iterator costs a good fraction of a second, so
    # with a known number of batches one iterator over the repeated dataset serves every
    # epoch (each takes its batches from it; a shuffle still reshuffles per epoch).
    shared = cluster is not None and steps_per_epoch > 0
    distributed = strategy.experimental_distribute_dataset(dataset.repeat() if shared else dataset)
    guard = on_nonfinite != "ignore"
    run = _Run(
        model=model, loss=loss, optimizer=optimizer, strategy=strategy, epochs=epochs, clip=clip_global_norm,
        guard=guard, on_nonfinite=on_nonfinite,
        limit=1 if on_nonfinite == "raise" else max_consecutive_nonfinite,
        verbose=verbose, cluster=cluster, checkpoint=checkpoint, history=history, start_epoch=start_epoch,
        runner=None, distributed=distributed, shared_iterator=iter(distributed) if shared else None,
        steps_per_epoch=steps_per_epoch,
    )
    run.runner = run.make_runner(jit=jit_compile)
    return run


def _resume(model, optimizer, cluster, checkpoint_dir) -> tuple[TrainingHistory, int, TrainingCheckpoint | None]:
    """The history and first epoch to run: from the latest checkpoint, if there is one."""
    history, start_epoch, checkpoint = TrainingHistory(), 0, None
    if checkpoint_dir is not None:
        checkpoint = TrainingCheckpoint(checkpoint_dir, model, optimizer, cluster)
        restored = checkpoint.restore()
        if restored is not None:
            start_epoch, history = restored
    if cluster is not None:
        try:
            restored_epochs = sorted({int(v) for v in cluster.gather(start_epoch)[:, 0]})
        except PEER_FAILURES as error:
            raise cluster.lost(error, start_epoch, history, checkpoint) from error
        if len(restored_epochs) > 1:
            raise ValueError(
                f"the workers restored different checkpoints from {checkpoint_dir!r} (after epochs "
                f"{restored_epochs}; {cluster.task} after epoch {start_epoch}): every worker must see the chief's "
                "checkpoint_dir, e.g. on a shared file system"
            )
    return history, start_epoch, checkpoint


# --------------------------------------------------------------------------------------
# One epoch: host calls, records, adaptation
# --------------------------------------------------------------------------------------


def _run_epoch(run: _Run, epoch: int) -> None:
    history = run.history
    if run.verbose:
        print(f"Epoch {epoch + 1}/{run.epochs}")
    target = run.steps_per_epoch if run.known_length else None
    bar = None
    if run.verbose:
        bar = keras.utils.Progbar(target, verbose=run.verbose, stateful_metrics=("loss", "skipped"), unit_name="step")
    iterator = run.shared_iterator if run.shared_iterator is not None else iter(run.distributed)
    epoch_start = history.steps
    applied_losses: list[float] = []
    consecutive = history.trailing_nonfinite()
    done = False
    while not done:
        steps_asked = run.runner.steps_per_call
        if run.known_length:
            steps_asked = min(steps_asked, run.steps_per_epoch - (history.steps - epoch_start))
        result = _host_call(run, iterator, epoch, steps_asked, consecutive)
        if result is _RETRY:  # the runner changed before any step ran: ask again
            continue
        if result is _RETRY_FRESH:  # ... and the failed call may have consumed a batch
            iterator = iter(run.distributed)
            if run.shared_iterator is not None:
                run.shared_iterator = iterator
            continue
        out, elapsed = result
        steps, consecutive = int(out["steps"]), int(out["consecutive"])
        if run.known_length:
            done = history.steps + steps - epoch_start >= run.steps_per_epoch
        else:
            done = bool(out["done"])
        _record(run, out, epoch, applied_losses)
        _watch_loss_scale(run)
        if bar is not None and not done and (target is None or history.steps - epoch_start < target):
            bar.update(history.steps - epoch_start, values=_bar_values(history, epoch_start, applied_losses))
        if consecutive >= run.limit:
            raise _nonfinite_error(history, consecutive, run.limit, run.on_nonfinite, run.loss_scaled)
        _adapt_steps_per_call(run.runner, steps, elapsed)
    _end_epoch(run, epoch, epoch_start, applied_losses, bar)


_RETRY = object()
_RETRY_FRESH = object()


def _host_call(run: _Run, iterator, epoch: int, steps_asked: int, consecutive: int):
    """Run up to ``steps_asked`` steps: their records and the seconds they took.

    Returns ``_RETRY`` (same iterator) or ``_RETRY_FRESH`` (new iterator) when the
    runner had to change before any step was applied.

    Two fall-backs are found on the first call, before any step has been applied: an
    update that cannot be masked (it is then put under a conditional) and a step XLA
    cannot compile (it then runs without XLA, with a warning).
    """
    runner = run.runner
    started = time.perf_counter()
    try:
        out = runner.run(iterator, steps_asked, consecutive, run.limit, run.known_length)
    except UnmaskableUpdate:
        model_cache(run.model)[("unmaskable", id(run.optimizer))] = True
        run.runner = run.make_runner(jit=runner.jit, masked=False)
        return _RETRY
    except tf.errors.OpError as error:
        if run.cluster is not None and isinstance(error, PEER_FAILURES):
            raise run.lost(error, epoch) from error
        if runner.jit and not runner.verified and _tf_internals.looks_like_xla_failure(error):
            warnings.warn(
                f"XLA could not compile the training step ({_tf_internals.xla_failure_summary(error)}); "
                "training without XLA. Pass jit_compile=False to skip this attempt.",
                RuntimeWarning,
                stacklevel=4,
            )
            run.runner = run.make_runner(jit=False)
            return _RETRY_FRESH
        raise
    elapsed = time.perf_counter() - started
    if run.cluster is not None:
        # Every worker must ask for the same number of steps per call.
        try:
            elapsed = float(run.cluster.gather(elapsed).max())
        except PEER_FAILURES as error:
            raise run.lost(error, epoch) from error
    runner.verified = True
    run.history.xla = runner.jit
    run.history.update = runner.mode
    return out, elapsed


def _record(run: _Run, out: dict[str, np.ndarray], epoch: int, applied_losses: list[float]) -> None:
    """Append the steps of one host call to the history, with a report per skipped step."""
    history = run.history
    first_index = history.steps
    scalars = out["scalars"]
    skip_rows = {int(k): row for row, k in enumerate(out["skip_index"])}
    for k in range(int(out["steps"])):
        index = first_index + k
        step_loss = float(scalars[k, 0])
        history.step_loss.append(step_loss)
        history.grad_norm.append(float(scalars[k, 1]))
        scale = float(scalars[k, 3]) if run.loss_scaled else None
        if run.loss_scaled:
            history.loss_scale.append(scale)
        if scalars[k, 2] > 0.5:
            applied_losses.append(step_loss)
            continue
        history.skipped.append(index)
        nan_counts, inf_counts = out["counts"][skip_rows[k]]
        records = [
            GradientRecord(
                path=str(v.path),
                shape=tuple(int(d) for d in v.shape),
                nan_count=int(nan_counts[i]),
                inf_count=int(inf_counts[i]),
                max_abs=None,
            )
            for i, v in enumerate(run.runner.variables)
            if nan_counts[i] or inf_counts[i]
        ]
        history.reports.append(
            SkippedStep(
                step=index, epoch=epoch, loss=step_loss, gradients=GradientReport(records), loss_scale=scale,
                grad_norm=history.grad_norm[-1],
            )
        )


def _watch_loss_scale(run: _Run) -> None:
    """Warn once if the dynamic loss scale fell so low that the NaNs cannot be overflow."""
    history = run.history
    if not run.loss_scaled or history.loss_scale_stalled:
        return
    current = float(tf.convert_to_tensor(run.runner.loss_scaler.dynamic_scale).numpy())
    if current <= STALLED_LOSS_SCALE:
        history.loss_scale_stalled = True
        warnings.warn(
            f"the dynamic loss scale fell to {current:g} by step {history.steps - 1}: the gradients are "
            "non-finite even without float16 overflow, so loss scaling cannot fix them (and small "
            "gradients now underflow). Look for the NaN with companion.diagnostics.locate_nonfinite.",
            RuntimeWarning,
            stacklevel=4,
        )


def _adapt_steps_per_call(runner: Runner, steps: int, elapsed: float) -> None:
    """Aim for a few host calls per second; the number of steps per call does not change results."""
    requested = runner.steps_per_call
    if steps == requested and elapsed < TARGET_SECONDS_PER_CALL / 2:
        runner.steps_per_call = min(requested * 2, MAX_STEPS_PER_CALL)
    elif elapsed > 2 * TARGET_SECONDS_PER_CALL and requested > 1 and steps > 1:
        runner.steps_per_call = max(requested // 2, 1)


def _end_epoch(run: _Run, epoch: int, epoch_start: int, applied_losses: list[float], bar) -> None:
    """Close the epoch's records and progress bar, and write its checkpoint."""
    history = run.history
    epoch_steps = history.steps - epoch_start
    if epoch_steps == 0:
        raise ValueError("dataset yielded no batch in this epoch")
    history.epoch_steps.append(epoch_steps)
    history.epoch_loss.append(float(np.mean(applied_losses)) if applied_losses else float("nan"))
    if bar is not None:
        bar.update(epoch_steps, values=_bar_values(history, epoch_start, applied_losses), finalize=True)
    if run.checkpoint is not None:
        try:
            run.checkpoint.save(epoch + 1, history)
        except PEER_FAILURES as error:
            if run.cluster is None:
                raise
            raise run.lost(error, epoch) from error


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
